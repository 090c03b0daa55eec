"""Rewards of an edit against its source image: `preserve` (the result's likeness to the source at low resolution) and
the judge's `edit` task (the source and the result in one message, against the fake OpenAI-style server of
tests/test_judge.py); the refusals of prompts without a source, at start-up and at the first call; and an edit run's
sample grid, which shows each result beside its source."""
import base64
import dataclasses
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import cli
import flowgrpo
import model_checks
import rewards
import runlog
import startup
from test_judge import chat_reply, fast_retries, judges  # noqa: F401 (fixtures)
from tiny_setup import main_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_png(path, pixels: np.ndarray) -> str:
    Image.fromarray(pixels).save(path)
    return str(path)


def random_pixels(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def as_tensor(pixels: np.ndarray) -> torch.Tensor:
    """(H, W, 3) uint8 -> (1, 3, H, W) float in [0, 1], whose quantisation (rewards.to_uint8) gives the pixels back."""
    return torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 255


def block_means(pixels: np.ndarray, side: int) -> np.ndarray:
    """(H, W, 3) -> (side, side, 3): the mean of each H/side × W/side block (what a box filter computes)."""
    h, w, _ = pixels.shape
    return pixels.astype(np.float64).reshape(side, h // side, side, w // side, 3).mean(axis=(1, 3))


# ---------------------------------------------------------------- preserve

def test_preserve_is_one_minus_the_mean_absolute_difference_at_low_resolution(tmp_path):
    source = random_pixels(32, 32, seed=0)
    meta = [{"image": write_png(tmp_path / "source.png", source)}]
    fn = rewards.make_reward("preserve:8")
    assert fn(as_tensor(source), ["keep it"], meta)[0].tolist() == [1.0]  # the source itself
    for seed in (1, 2):
        result = random_pixels(32, 32, seed)
        expected = 1 - np.abs(block_means(result, 8) - block_means(source, 8)).mean() / 255
        got = fn(as_tensor(result), ["keep it"], meta)[0]
        assert abs(got[0] - expected) < 1e-6, f"preserve {got[0]} vs {expected}: off by {abs(got[0] - expected):.2g}"
        np.testing.assert_array_equal(fn(as_tensor(result), ["keep it"], meta)[0], got)  # deterministic
    # Coarse on purpose: the source's pixels swapped within each 4×4 block (texture redrawn, layout and colours kept)
    # cost nothing at 8×8 and much at full resolution.
    shuffled = source.reshape(8, 4, 8, 4, 3)[:, ::-1, :, ::-1].reshape(32, 32, 3)
    assert abs(fn(as_tensor(shuffled), ["keep it"], meta)[0][0] - 1) < 1e-6
    assert rewards.make_reward("preserve:32")(as_tensor(shuffled), ["keep it"], meta)[0][0] < 0.8
    # The default side is 64: a 16×16 image is compared at 64×64 (box-upsampled, i.e. pixel for pixel).
    small = random_pixels(16, 16, seed=3)
    meta16 = [{"image": write_png(tmp_path / "small.png", random_pixels(16, 16, seed=4))}]
    expected = 1 - np.abs(small.astype(np.float64) - np.asarray(Image.open(meta16[0]["image"]), np.float64)).mean() / 255
    got = rewards.make_reward("preserve")(as_tensor(small), ["x"], meta16)[0][0]
    assert abs(got - expected) < 1e-6, f"off by {abs(got - expected):.2g}"


def test_preserve_on_a_video_scores_each_fourth_frame_against_the_source(tmp_path):
    source = random_pixels(16, 16, seed=0)
    meta = [{"image": write_png(tmp_path / "source.png", source)}]
    frames = [random_pixels(16, 16, seed=s) for s in range(1, 6)]  # frames 0 and 4 are scored
    video = torch.stack([as_tensor(f)[0] for f in frames])[None]  # (1, 5, 3, 16, 16)
    one = rewards.make_reward("preserve:4")
    expected = np.mean([one(as_tensor(frames[i]), ["x"], meta)[0][0] for i in (0, 4)])
    got = one(video, ["x"], meta)[0][0]
    assert abs(got - expected) < 1e-12, f"off by {abs(got - expected):.2g}"


def test_a_prompt_without_a_source_is_refused_at_start_up_and_at_the_first_call(tmp_path):
    path = write_png(tmp_path / "s.png", random_pixels(8, 8, seed=0))
    for spec in ("preserve=0.3", "judge:edit=http://h:1"):
        with pytest.raises(ValueError, match=rf"--reward {spec.split('=')[0]} compares each result with its prompt's "
                                             r"source image, and 1 of the 2 prompts have none \(the first: 'b'\): use "
                                             r"an edit model .* whose every line has \"image\"") as refusal:
            rewards.check_prompts_for_reward(f"brightness,{spec}", ["a", "b"], [{"image": path}, {}])
        assert "\n" not in str(refusal.value)
        rewards.check_prompts_for_reward(spec, ["a", "b"], [{"image": path}] * 2)
    with pytest.raises(ValueError, match=r"--reward preserve compares each result with its prompt's source image, and "
                                         r"prompt 'a cat' has none: use an edit model"):
        rewards.make_reward("preserve")(torch.rand(1, 3, 8, 8), ["a cat"])
    for bad in ("preserve:abc", "preserve:2", "preserve:-8", "preserve:4096"):
        with pytest.raises(ValueError, match=rf"--reward {bad}: ARG is the side in pixels .* in \[4, 1024\]"):
            rewards.check_reward_spec(bad)
    # A reward server would open whatever path a client's metadata names: refused there.
    for spec in ("preserve", "ocr=1,judge:edit=http://h:1=0.5", "edit", "edit_judge"):  # nano-edit's too
        with pytest.raises(ValueError, match="reads each prompt's source image from a path in the request"):
            rewards.check_servable(spec)


def test_a_side_of_digits_int_cannot_read_is_refused_in_the_flags_words():
    """"²" and "①" are digits to str.isdigit but not numbers to int(): `--reward preserve:²` stopped the start with
    Python's "invalid literal for int() with base 10", naming neither the flag nor what ARG should be."""
    for bad in ("preserve:\u00b2", "preserve:\u2460"):
        with pytest.raises(ValueError, match=rf"--reward {bad}: ARG is the side in pixels .* in \[4, 1024\]"):
            rewards.check_reward_spec(bad)


def test_the_reward_server_refuses_to_serve_a_reward_that_opens_source_paths():
    """`python rewards.py serve --reward preserve`: refused in one line before it listens."""
    out = subprocess.run([sys.executable, "rewards.py", "serve", "--reward", "preserve", "--port", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--reward preserve reads each prompt's source image from a path" in out.stderr, \
        out.stderr[-2000:]


def test_start_up_refuses_preserve_for_prompts_without_sources():
    """A text-to-image run (its prompts carry no source) with --reward preserve: one line from startup.check_args."""
    args = dataclasses.replace(flowgrpo.RECIPES["tiny-flux"], reward="brightness=1,preserve=0.3")
    with pytest.raises(ValueError, match=r"--reward preserve compares each result with its prompt's source image, and "
                                         r"48 of the 48 prompts have none") as refusal:
        startup.check_args(args)
    assert "\n" not in str(refusal.value)


# ---------------------------------------------------------------- the judge's edit task

def sent_images(body) -> list[np.ndarray]:
    """The PNG images of a chat request's message, in order."""
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1]))))
            for part in body["messages"][0]["content"] if part["type"] == "image_url"]


def yes_probability(body) -> float:
    """For instruction "edit i": P(Yes) = 0.1·(i+1) (as "Yes" and "Y"), P(No) = 0.8 − that, 0.2 on other tokens."""
    text = body["messages"][0]["content"][-1]["text"]
    return 0.1 * (int(text.split("Instruction: edit ", 1)[1].split("\n", 1)[0]) + 1)


def edit_answer(body):
    y = yes_probability(body)
    return chat_reply("Yes" if y > 0.4 else "No", [("Yes", y / 2), ("No", 0.8 - y), ("Y", y / 2), ("Sure", 0.2)])


def test_edit_judge_sees_the_source_then_the_result_and_scores_the_expectation(judges, fast_retries, tmp_path):
    j = judges(edit_answer)
    fn = rewards.make_reward(f"judge:edit={j.url}")
    sources = [random_pixels(16, 16, seed=i) for i in range(3)] + [random_pixels(32, 32, seed=3)]
    meta = [{"image": write_png(tmp_path / f"{i}.png", s)} for i, s in enumerate(sources)]
    results, prompts = torch.rand(4, 3, 16, 16), [f"edit {i}" for i in range(4)]
    scores, info = fn(results, prompts, meta)
    expected = [0.1 * (i + 1) / 0.8 for i in range(4)]  # P(Yes) / (P(Yes) + P(No)); "Sure" begins no answer
    np.testing.assert_allclose(scores, expected, rtol=1e-12, atol=0)
    assert list(info) == [f"judge:edit@{j.url[len('http://'):]}"]
    pixels = rewards.to_uint8(results)
    assert len(j.bodies) == 4
    for body in j.bodies:
        i = int(body["messages"][0]["content"][-1]["text"].split("Instruction: edit ", 1)[1][0])
        kinds = [part["type"] for part in body["messages"][0]["content"]]
        assert kinds == ["image_url", "image_url", "text"], kinds  # one message: source, result, instruction
        source, result = sent_images(body)
        np.testing.assert_array_equal(result, pixels[i])
        if i < 3:  # a source of the result's size is sent pixel for pixel
            np.testing.assert_array_equal(source, sources[i])
        else:  # a larger one at the result's size, as the edit model sees it
            assert source.shape == pixels[i].shape
        assert f"Instruction: edit {i}\n" in body["messages"][0]["content"][-1]["text"]
        assert "first image is the original" in body["messages"][0]["content"][-1]["text"]
        assert body["temperature"] == 0 and body["logprobs"] is True and body["top_logprobs"] == 20
        assert body["structured_outputs"] == {"choice": ["Yes", "No"]}
    np.testing.assert_array_equal(fn(results, prompts, meta)[0], scores)  # identical inputs, identical scores
    # A prompt without a source fails before anything is sent.
    with pytest.raises(ValueError, match="--reward judge:edit compares each result with its prompt's source image"):
        fn(results[:1], ["edit 0"], [{}])
    assert len(j.bodies) == 8 and fast_retries == []


def test_weighted_following_against_preservation(judges, fast_retries, tmp_path):
    """--reward judge:edit=URL=1,preserve=0.3: the total is the weighted sum of the two, each logged by name."""
    j = judges(edit_answer)
    source = random_pixels(16, 16, seed=0)
    meta = [{"image": write_png(tmp_path / "s.png", source)}] * 2
    results = torch.cat([as_tensor(source), torch.rand(1, 3, 16, 16)])
    total, info = rewards.make_reward(f"judge:edit={j.url}=1,preserve=0.3")(results, ["edit 1", "edit 5"], meta)
    label = f"judge:edit@{j.url[len('http://'):]}"
    np.testing.assert_allclose(total, info[label] + 0.3 * info["preserve"], rtol=1e-12)
    assert info["preserve"][0] == 1.0 and info["preserve"][1] < 1


# ---------------------------------------------------------------- sample grids

def contains(grid: np.ndarray, tile: np.ndarray) -> bool:
    """Whether `tile` (h, w, 3) appears pixel for pixel somewhere in `grid`."""
    h, w, _ = tile.shape
    ys, xs = np.nonzero((grid[:-h + 1 or None, :-w + 1 or None] == tile[0, 0]).all(-1))
    return any(np.array_equal(grid[y:y + h, x:x + w], tile) for y, x in zip(ys, xs))


def test_grid_draws_each_result_beside_its_source(tmp_path):
    source = random_pixels(32, 32, seed=0)
    path = write_png(tmp_path / "s.png", source)
    images = torch.full((2, 3, 32, 32), 0.25)
    grid = np.asarray(runlog.grid_image(images, ["make it red | 0.500", "no source | 0.100"], [path, None]))
    # Two prompts, 4 to a row: each tile a 32×64 pair drawn 3× larger, the source on its left.
    assert contains(grid, source.repeat(3, axis=0).repeat(3, axis=1))
    # a white gap between the source and its result, which before ran into each other
    assert contains(grid, np.concatenate([source.repeat(3, axis=0).repeat(3, axis=1)[:, -1:], np.full((96, 4, 3), 255,
                                                                                                 np.uint8)], axis=1))
    assert contains(grid, np.full((96, 96, 3), 128, np.uint8))  # the missing source: grey
    assert not contains(np.asarray(runlog.grid_image(images, ["make it red | 0.500", "no source | 0.100"])),
                        source[:8, :8])


def test_an_instruction_on_other_sources_is_another_prompt_of_the_grid_and_of_eval_diversity(tmp_path):
    """One instruction on two sources, two seeds each: two rows of the grid and two groups of eval/diversity (the
    spread across seeds), not one of four, whose spread was that of the sources (nano-edit's eval set of 180 distinct
    pairs once logged 16 groups)."""
    a, b = (write_png(tmp_path / f"{k}.png", random_pixels(32, 32, seed=k)) for k in (0, 1))
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    same = runlog.grid_image(images, ["make it red | 0.5"] * 4, [a, b, a, b])
    assert same.size == runlog.grid_image(images, ["x | 0.5", "y | 0.5"] * 2, [a, b, a, b]).size  # 2 rows of 2
    evalset = [("make it red", {"image": a, "image_sha256": "a"}), ("make it red", {"image": b, "image_sha256": "b"})]
    assert flowgrpo.seed_groups(evalset * 2) == [[0, 2], [1, 3]]
    assert flowgrpo.seed_groups([("a cat", {}), ("a dog", {}), ("a cat", {})]) == [[0, 2], [1]]


def test_an_edit_run_with_preserve_shows_sources_in_its_grid(tmp_path):
    """1 iteration of `flowgrpo.py --model tiny-flux-kontext --reward preserve`: rewards in [0, 1], and the
    evaluation grid holds each source's colours (the sources are 4×4 blocks of solid colour, which any resize keeps)."""
    (tmp_path / "sources").mkdir()
    lines, colours = [], []
    for i in range(2):
        blocks = np.random.default_rng(10 + i).integers(0, 256, (4, 4, 3), dtype=np.uint8)
        colours += [tuple(c) for c in blocks.reshape(-1, 3)]
        write_png(tmp_path / "sources" / f"{i}.png", blocks.repeat(8, axis=0).repeat(8, axis=1))
        lines.append(json.dumps({"prompt": f"make it red {i}", "image": f"sources/{i}.png"}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    rows = main_here("--model", "tiny-flux-kontext", "--prompts", tmp_path / "edits.jsonl", "--reward", "preserve",
                     "--iterations", "1", "--group-size", "2", "--prompts-per-iteration", "2", "--micro-batch", "2",
                     "--eval-every", "1", "--eval-images", "2", "--checkpoint-every", "0", "--run-dir", tmp_path / "run")
    assert 0 <= rows[0]["reward/mean"] <= 1 and 0 <= rows[0]["eval/reward_mean"] <= 1, rows[0]
    grid = np.asarray(Image.open(tmp_path / "run" / "samples" / "eval_00000.png").convert("RGB"))
    shown = {tuple(c) for c in grid.reshape(-1, 3)}
    evaluated = [i for i in range(2) if all(c in shown for c in colours[16 * i:16 * (i + 1)])]
    assert evaluated, "no source's colours are in the evaluation grid"


# ---------------------------------------------------------------- the public edit recipes

def edit_set(tmp_path, height: int = 512, width: int = 512) -> str:
    """A .jsonl of two edit instructions, each with its own random source of height × width pixels."""
    (tmp_path / "sources").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(2):
        write_png(tmp_path / "sources" / f"{i}.png", random_pixels(height, width, seed=i))
        lines.append(json.dumps({"prompt": f"add {i + 2} apples", "image": f"sources/{i}.png"}))
    (tmp_path / "edits.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / "edits.jsonl")


def test_the_kontext_recipe_starts_with_an_edit_prompt_set(tmp_path):
    """flux.1-kontext-dev (recipes.py, from Flow-GRPO's counting_flux_kontext) passes every start-up check given a
    .jsonl of 512² sources, before anything loads; its LoRA targets, proj_mlp included, name modules of the Kontext
    transformer (its tiny twin's, built from the same classes)."""
    recipe = flowgrpo.RECIPES["flux.1-kontext-dev"]
    assert (recipe.group_size, recipe.prompts_per_iteration, recipe.num_steps, recipe.guidance) == (21, 48, 6, 2.5)
    startup.check_args(dataclasses.replace(recipe, prompts=edit_set(tmp_path)))
    model_checks.check_lora_targets("tiny-flux-kontext", None, recipe.lora_targets)
    assert "proj_mlp" in recipe.lora_targets


def test_the_qwen_image_edit_recipe_starts_with_an_edit_prompt_set(tmp_path):
    """qwen-image-edit (recipes.py, from verl-omni's run_qwen_image_edit_lora.sh) is what `--model qwen-image-edit`
    alone picks, passes every start-up check given a .jsonl of 512² sources (its PickScore reward included), splits
    its 32 × 16 images into 2 optimizer steps of whole micro-batches of 16 on the public run's 8 GPUs, and its LoRA
    targets name modules of the edit transformer; a source of another aspect ratio is refused at start-up, where the
    public converter letterboxes it (docs/algorithm.md §7)."""
    recipe = flowgrpo.RECIPES["qwen-image-edit"]
    assert cli.parse_args(flowgrpo.Args, ["--model", "qwen-image-edit"]) == recipe
    assert (recipe.group_size, recipe.prompts_per_iteration, recipe.num_steps, recipe.window, recipe.window_range,
            recipe.cfg_scale, recipe.noise_level, recipe.std, recipe.reward) == (
        16, 32, 12, 3, (0, 6), 4.0, 0.7, "group", "pickscore")
    startup.check_args(dataclasses.replace(recipe, prompts=edit_set(tmp_path)))
    layout = flowgrpo.batch_arithmetic(recipe, world_size=8)
    assert (layout["images_per_rank"], layout["micro_batches_per_optimizer_step"]) == (64, 2), layout
    model_checks.check_lora_targets("tiny-qwen-image-edit", None, recipe.lora_targets)
    with pytest.raises(ValueError, match="aspect ratio") as refusal:
        startup.check_args(dataclasses.replace(recipe, prompts=edit_set(tmp_path / "wide", 512, 768)))
    assert "\n" not in str(refusal.value)
