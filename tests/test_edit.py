"""The first edit family, FLUX.1 Kontext (`tiny-flux-kontext`), and the data path that brings it a source image: the
ODE rollout against diffusers' own FluxKontextPipeline, the source's effect on the velocity, an exactly on-policy
first update in the real training script, the start-up refusals of prompt sets, the source in a reward's metadata, the
LoRA export loaded by the pipeline, exact resume and 1-vs-2 ranks."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import flowgrpo
import models
import rewards
import rollout
import scheduler as sch
import source_images
import startup
from test_engine import ENV, ROOT, check_cli_resume, lora, relative_difference
from tiny_setup import check_lora_export, main_here

PROMPTS = ["make the cat red", "add a hat to the dog"]


def write_png(path, height: int, width: int, seed: int) -> str:
    """A random RGB image of height × width pixels at `path`."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return str(path)


def edit_prompts(directory, n: int = 2, height: int = 32, width: int = 32) -> str:
    """A .jsonl edit prompt set in `directory`: n prompts, each with its own source PNG (paths relative to the file)."""
    (directory / "sources").mkdir(exist_ok=True)
    lines = []
    for i in range(n):
        write_png(directory / "sources" / f"{i}.png", height, width, seed=i)
        lines.append(json.dumps({"prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "image": f"sources/{i}.png"}))
    (directory / "edits.jsonl").write_text("\n".join(lines) + "\n")
    return str(directory / "edits.jsonl")


@pytest.fixture(scope="module")
def kontext():
    return models.load_model("tiny-flux-kontext", None, "cpu", seed=0)


def test_a_kontext_source_of_another_size_is_resized_as_flow_grpos_script_resizes_it(kontext, tmp_path):
    """Flow-GRPO (scripts/train_flux_kontext.py:229 at 9745241) resizes each source with PIL's default filter to the
    output size, then its pipeline (flux_kontext_pipeline_with_logprob.py:154) resizes it to the output size again, a
    no-op; here it was diffusers' resize (Lanczos) alone. A source at the output size is untouched either way."""
    for side, name in ((64, "big"), (32, "same")):
        path = write_png(tmp_path / f"{name}.png", side, side, seed=1)
        theirs = kontext.pipe.image_processor.resize(Image.open(path).convert("RGB").resize((32, 32)), 32, 32)
        assert np.array_equal(np.asarray(kontext.resized_source(path, 32, 32)), np.asarray(theirs)), name
    lanczos = np.asarray(kontext.pipe.image_processor.resize(Image.open(tmp_path / "big.png").convert("RGB"), 32, 32))
    assert not np.array_equal(np.asarray(kontext.resized_source(str(tmp_path / "big.png"), 32, 32)), lanczos)


@pytest.mark.parametrize("height,width", [(32, 32), (32, 48)])
def test_ode_rollout_reproduces_the_kontext_pipeline(kontext, tmp_path, height, width):
    """From the same per-image generators, embeddings and source images, our ODE rollout's final latents equal
    FluxKontextPipeline.__call__'s bit for bit (the pipeline draws the initial noise itself), its images within 1e-6; the
    σ schedule is the one the pipeline set. `max_area=H·W`: else the pipeline rescales the output to 1024² pixels."""
    sources = [write_png(tmp_path / f"{i}.png", height, width, seed=i) for i in range(2)]
    metadata = [{"image": s} for s in sources]
    batch = rollout.sample(kontext, PROMPTS, metadata, range(2), range(2), steps=[], num_steps=4, height=height,
                           width=width, cfg_scale=1.0, negative_prompt="", noise_level=0.0, sde_type="sde", seed=3,
                           iteration=5, chunk=2)
    cond = kontext.conditioning(PROMPTS, "", 1.0, metadata, height, width)
    kw = dict(kontext.pipeline_kwargs(cond, 1.0), height=height, width=width, num_inference_steps=4,
              max_area=height * width, image=[Image.open(s) for s in sources])

    def pipeline(output_type):
        return kontext.pipe(generator=rollout.image_generators(3, 5, range(2)), output_type=output_type, **kw).images
    latents = pipeline("latent")
    assert torch.equal(sch.sigma_schedule(kontext.scheduler, 4, kontext.image_seq_len(height, width)),
                       kontext.pipe.scheduler.sigmas)
    images = pipeline("pt")
    assert latents.shape == batch.x0.shape and torch.equal(batch.x0, latents), (batch.x0 - latents).abs().max()
    assert images.shape == batch.images.shape == (2, 3, height, width)
    gap = (batch.images - images).abs().max().item()
    print(f"\nmax |ours - FluxKontextPipeline| at {height}x{width}: latents 0, images {gap:.3g}")
    assert gap <= 1e-6  # the same latents, decoded alike (measured: 0)


def test_the_source_image_changes_the_velocity(kontext, tmp_path):
    """Another source, the same noise and prompt: another velocity (the check above would hold vacuously if the
    source were ignored); the same source twice encodes once, to the same tensor."""
    a, b = write_png(tmp_path / "a.png", 32, 32, seed=0), write_png(tmp_path / "b.png", 32, 32, seed=1)
    cond = kontext.conditioning(["edit it"] * 3, "", 1.0, [{"image": a}, {"image": b}, {"image": a}], 32, 32)
    assert cond["source"].shape == (3, 16, 16) and torch.equal(cond["source"][0], cond["source"][2])
    x = kontext.noise(rollout.image_generators(0, 0, [7, 7, 7]), 32, 32)
    v = kontext.velocity(x, torch.full((3,), 0.7), cond, 1.0, 32, 32)
    assert v.shape == x.shape and torch.equal(v[0], v[2])
    assert (v[0] - v[1]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="edits a source image: every prompt needs one"):
        kontext.conditioning(["edit it"], "", 1.0, [{}], 32, 32)


def test_branched_groups_start_from_their_own_source(kontext, tmp_path):
    """--branch: each group's shared prefix (rollout.branch_prefixes) is sampled with that group's source image, and
    the group's images then differ in their own SDE steps."""
    sources = [write_png(tmp_path / f"{i}.png", 32, 32, seed=i) for i in range(2)]
    kw = dict(steps=[2, 3], num_steps=4, height=32, width=32, cfg_scale=1.0, negative_prompt="", noise_level=0.7,
              sde_type="sde", seed=0, iteration=0, chunk=4, branch=True)
    one = rollout.sample(kontext, ["edit it"] * 4, [{"image": sources[0]}] * 4, [0] * 4, range(4), **kw)
    two = rollout.sample(kontext, ["edit it"] * 4, [{"image": sources[1]}] * 4, [0] * 4, range(4), **kw)
    assert all(torch.equal(one.latents[0, 0], one.latents[i, 0]) for i in range(4))  # one prefix per group
    assert not torch.equal(one.latents[0, 0], two.latents[0, 0])  # the same noise, another source: another prefix
    assert not torch.equal(one.latents[0, 1], one.latents[1, 1])


@pytest.fixture(scope="module")
def edit_run(tmp_path_factory):
    """2 iterations of `python flowgrpo.py --model tiny-flux-kontext` on a 2-prompt edit set (in this process), with
    a reward that records the metadata it is given (training and evaluation)."""
    root = tmp_path_factory.mktemp("edit")
    seen = []

    def spy():
        def score(images, prompts, metadata):
            seen.extend(metadata)
            return images.reshape(len(images), -1).mean(axis=1) / 255  # brightness: the advantages are not all 0
        return score
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(rewards.REWARDS, "spy", spy)
        rows = main_here("--model", "tiny-flux-kontext", "--prompts", edit_prompts(root), "--reward", "spy",
                         "--iterations", "2", "--group-size", "2", "--prompts-per-iteration", "2", "--micro-batch",
                         "2", "--eval-every", "2", "--eval-images", "2", "--checkpoint-every", "0", "--run-dir",
                         str(root / "run"))
    return root, rows, seen


def test_edit_training_is_exactly_on_policy(edit_run):
    """The SDE rollout's log-probs, recomputed by the first update of each iteration, are the same bits
    (train/logp_gap 0): the source latents are part of the batch's conditioning, as the prompt's are."""
    _, rows, _ = edit_run
    assert len(rows) == 2
    for r in rows:
        assert r["train/logp_gap"] == 0.0, r
        assert np.isfinite(r["reward/mean"])
    assert np.isfinite(rows[-1]["eval/reward_mean"])


def test_the_source_image_reaches_the_rewards_metadata(edit_run):
    """Every image the reward scores (4 per iteration; 2 evaluation images before training and 2 at the end) comes
    with its prompt's source image, as an absolute path."""
    root, _, seen = edit_run
    sources = {str((root / "sources" / f"{i}.png").resolve()) for i in range(2)}
    assert len(seen) == 2 * 4 + 2 * 2 and {m["image"] for m in seen} == sources


@pytest.mark.parametrize("case,needle", [
    ("missing", r"edits\.jsonl:2: source image sources/1\.png is missing .*relative to the prompt file"),
    ("unreadable", r"edits\.jsonl:2: source image sources/1\.png cannot be read as an image .*save it as a PNG"),
    ("large", r"edits\.jsonl:1: source image sources/0\.png is 32×32, more than 1000 pixels: resize it"),
    ("ratio", r"edits\.jsonl:2: source image sources/1\.png is 48×32, not the run's aspect ratio \(--width 32 "
              r"--height 32\): crop it to 32:32, or set --height/--width to its ratio"),
    ("no images", r"--prompts general: --model tiny-flux-kontext edits a source image, and 48 of its prompts have "
                  r'none: give it a \.jsonl whose every line has "image"'),
    ("text to image", r"its prompts carry source images \(\"image\"\), which --model tiny-flux \(text to image\) "
                      r"cannot use: choose an edit model"),
    ("vllm-omni", r"--rollout vllm-omni: --model tiny-flux-kontext has no vLLM-Omni pipeline yet .*use --rollout "
                  r"local"),
    ("sp", r"--sp: --model tiny-flux-kontext has no sequence parallelism yet .*run without --sp"),
])
def test_prompt_sets_that_cannot_serve_the_model_are_refused_at_start_up(tmp_path, monkeypatch, case, needle):
    """Each refusal is one line naming the file and line (or the flags) and the fix, raised by startup.check_args,
    before anything is built (vllm-omni: as for a family without a vLLM-Omni pipeline, which Kontext has)."""
    prompts = edit_prompts(tmp_path)
    source = tmp_path / "sources" / "1.png"
    change = dict(prompts=prompts)
    if case == "missing":
        source.unlink()
    elif case == "unreadable":
        source.write_text("not an image")
    elif case == "large":
        monkeypatch.setattr(source_images, "SOURCE_PIXELS", 1000)
    elif case == "ratio":
        write_png(source, 32, 48, seed=1)
    elif case == "no images":
        change["prompts"] = "general"
    elif case == "text to image":
        change = dict(prompts=prompts, model="tiny-flux", lora_targets=models.adapter_class("tiny-flux").lora_targets)
    elif case == "sp":
        change["sp"] = 2
    else:
        change |= dict(rollout="vllm-omni", rollout_url="http://127.0.0.1:1")
        monkeypatch.setattr(models.adapter_class("tiny-flux-kontext"), "omni_pipeline_class", None)
    args = dataclasses.replace(flowgrpo.RECIPES["tiny-flux-kontext"], **change)
    with pytest.raises(ValueError, match=needle) as refusal:
        startup.check_args(args)
    assert "\n" not in str(refusal.value)


def test_the_exported_lora_loads_into_a_fresh_kontext_pipeline(tmp_path):
    """One update on an edit batch, exported, loaded by `FluxKontextPipeline.load_lora_weights` into a fresh tiny
    pipeline: its velocity on the same source and noise is the trained one (alpha included)."""
    check_lora_export("tiny-flux-kontext", str(tmp_path), [{"image": write_png(tmp_path / "s.png", 32, 32, 0)}] * 4)


def check_resume_and_ranks(model: str, prompts: str, tmp_path, script: str = os.path.join(ROOT, "flowgrpo.py")):
    """An edit family under the engine's guarantees: 2 iterations straight; 1, then --resume auto to 2 (the same LoRA
    and AdamW state, bit for bit: the prompt embeddings and source latents are rebuilt from the prompt set, not
    checkpointed); and `script` (flowgrpo.py, or a launcher of it) on 2 torchrun ranks against one process (the LoRA
    as a whole within test_engine's 1e-3 relative: only the gradient sums' order differs). 4 edit images an iteration:
    4 micro-batches of 1 in one process, 2 on each of two ranks; a checkpoint per iteration."""
    run = ["--model", model, "--prompts", prompts, "--iterations", "2", "--group-size", "2", "--prompts-per-iteration",
           "2", "--micro-batch", "1", "--eval-every", "0", "--checkpoint-every", "1", "--seed", "3"]
    (straight, _), ranks = check_cli_resume(run, tmp_path), tmp_path / "ranks"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                          "--no-wandb", *run, "--run-dir", str(ranks)], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for ckpt in ("iter_000000", None):
        rel, worst = relative_difference(lora(straight, ckpt), lora(ranks, ckpt))
        print(f"\n{model}: {ckpt or 'final'} LoRA, 1 vs 2 ranks: {rel:.3g} relative, max |Δ| {worst:.3g}")
        assert rel < 1e-3, f"{ckpt or 'final'} LoRA: 1 vs 2 ranks differ by {rel:.3g} relative (max |Δ| {worst:.3g})"


def test_an_edit_run_resumes_bit_for_bit_and_two_ranks_agree_with_one(tmp_path):
    check_resume_and_ranks("tiny-flux-kontext", edit_prompts(tmp_path), tmp_path)
