"""Qwen-Image 2.1 (`tiny-qwen-image-2.1`, `tiny-qwen-image-2.1-edit`) against diffusers' own QwenImage21Pipeline: text
to image and editing, the ODE path bit for bit, the on-policy first update, the tiny twin saved and reloaded (its
image-only processor), exact resume through the CLI, and the refusals. (LoRA export: tests/test_models_sd3_flux.py.)

The pipeline's sources are resized to about its `output_resolution`² pixels (1024²); these tests shrink the adapter's
CONDITION_SIDE to 64 and call the pipeline with the same, so that a source costs 16 vision and 16 latent tokens."""
import dataclasses

import pytest
import torch
from PIL import Image

import algorithms
import cli
import engine as eng
import flowgrpo
import model_checks
import models
import models_qwen21
import rollout
import scheduler as sch
import startup
from test_edit import edit_prompts, write_png
from test_engine import check_cli_resume, rows, without_perf
from test_models_zimage_flux2 import check_ode_equals_pipeline

PROMPTS = ["a red cat", "a blue dog sitting on a green hill at sunset"]  # 2 lengths: padded, masked, trimmed
SIDE = 64


@pytest.fixture(scope="module")
def qwen21():
    return models.load_model("tiny-qwen-image-2.1", None, "cpu", seed=0)


@pytest.fixture
def small_sources(monkeypatch):
    monkeypatch.setattr(models_qwen21, "CONDITION_SIDE", SIDE)


@pytest.mark.parametrize("cfg,height,width", [(1.0, 64, 64), (4.0, 32, 64)])
def test_text_to_image_ode_reproduces_the_pipeline(qwen21, cfg, height, width):
    """Two prompts of different lengths (padded to the longer and masked), CFG off and on: the latents equal
    `QwenImage21Pipeline.__call__(use_kv_cache=False)`'s bit for bit, the images (RGB of its RGBA) within 1e-6
    (measured: 0)."""
    print(f"\ncfg {cfg}: {check_ode_equals_pipeline(qwen21, PROMPTS, cfg, height, width, use_kv_cache=False)}")


def test_the_prefix_kv_cache_changes_no_bit_here(qwen21):
    """The pipeline's default, its prefix-KV cache (the text's keys and values kept from the first step), gives the same
    latents as recomputing them on the tiny twin in float32 on CPU (its docstring: not so in reduced precision); the
    cache is used (every step after the first reads it)."""
    modes = []
    hook = qwen21.transformer.register_forward_pre_hook(lambda m, a, kw: modes.append(kw.get("kv_cache_mode")),
                                                        with_kwargs=True)
    try:
        check_ode_equals_pipeline(qwen21, PROMPTS[:1], 1.0, SIDE, SIDE, use_kv_cache=True)
    finally:
        hook.remove()
    assert modes[-4:] == ["extract", "cached", "cached", "cached"], modes


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_edit_ode_reproduces_the_pipeline(qwen21, small_sources, tmp_path, cfg):
    """An edit prompt with its source (through the VL encoder and as VAE tokens), CFG off and with a negative prompt
    encoded with the source: the latents equal the pipeline's, given the prompt and image, bit for bit; the source
    changes the result (the check is not vacuous)."""
    source = write_png(tmp_path / "s.png", SIDE, SIDE, 0)
    kw = dict(steps=[], num_steps=4, height=SIDE, width=SIDE, cfg_scale=cfg, negative_prompt=" ", noise_level=0.0,
              sde_type="sde", seed=3, iteration=5, chunk=1)
    batch = rollout.sample(qwen21, ["make it red"], [{"image": source}], [0], [0], **kw)
    last = {}

    def keep(pipe, i, t, tensors):
        last["latents"] = tensors["latents"]
        return {}
    with Image.open(source) as image:
        images = qwen21.pipe(prompt=["make it red"], image=[image], negative_prompt=" " if cfg > 1 else None,
                             true_cfg_scale=cfg, generator=rollout.image_generators(3, 5, [0]), height=SIDE, width=SIDE,
                             num_inference_steps=4, output_type="pt", callback_on_step_end=keep, use_kv_cache=False,
                             output_resolution=SIDE).images
    assert torch.equal(batch.x0, last["latents"]), (batch.x0 - last["latents"]).abs().max()
    torch.testing.assert_close(batch.images, images[:, :3], rtol=0, atol=1e-6)
    other = rollout.sample(qwen21, ["make it red"], [{"image": write_png(tmp_path / "o.png", SIDE, SIDE, 1)}], [0], [0],
                           **kw)
    assert (other.x0 - batch.x0).abs().max() > 1e-4


def test_tiny_saves_and_reloads_with_its_image_only_processor(qwen21, tmp_path):
    """`save-tiny` writes a directory naming a Qwen3VLProcessor, as the real model's; without torchvision it is read
    back through the adapter's image-only processor, every weight and each prompt's embedding the same."""
    again = models.load_model("tiny-qwen-image-2.1", models.save_tiny_pipeline(str(tmp_path / "q"), 0,
                                                                               "tiny-qwen-image-2.1"), "cpu")
    for part in ("transformer", "vae", "text_encoder"):
        theirs = getattr(again.pipe, part).state_dict()
        assert all(torch.equal(p, theirs[k]) for k, p in getattr(qwen21.pipe, part).state_dict().items()), part
    for k, v in qwen21.encode(PROMPTS).items():
        assert torch.equal(again.encode(PROMPTS)[k], v), k
    other = models.adapter_class("tiny-qwen-image-2.1").build_tiny(1)
    assert not torch.equal(other.transformer.img_in.weight, qwen21.transformer.img_in.weight)


@pytest.mark.parametrize("edit,cfg,window", [(False, 1.0, 0), (True, 4.0, 2)])
def test_first_update_is_exactly_on_policy(small_sources, tmp_path, edit, cfg, window):
    """`train/logp_gap` is exactly 0: text to image in full mode, and editing with true CFG in a window with the frozen
    Qwen3-VL FSDP2-sharded; the second optimizer step's gap is not 0."""
    name = "tiny-qwen-image-2.1" + ("-edit" if edit else "")
    args = dataclasses.replace(flowgrpo.RECIPES[name], window=window, window_range=(0, 3), cfg_scale=cfg,
                               negative_prompt=" ", group_size=2, prompts_per_iteration=2, micro_batch=2,
                               optimizer_steps=2)
    model = models.load_model(name, None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0, shard_text_encoder=window > 0)
    meta = [{"image": write_png(tmp_path / f"{i}.png", 32, 32, i)} if edit else {} for i in range(2)]
    batch = rollout.sample(model, ["a cat", "a cat", "a tall red house", "a tall red house"], [meta[0]] * 2 + [meta[1]] * 2,
                           [0, 0, 1, 1], range(4), steps=sch.trained_steps(4, window, (0, 3), seed=1), num_steps=4,
                           height=32, width=32, cfg_scale=cfg, negative_prompt=" ", noise_level=0.7, sde_type="sde",
                           seed=0, iteration=0, chunk=2)
    batch.advantages = torch.linspace(-1, 1, 4)
    stats = algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0
    _, after = algorithms.policy_loss(model, engine, batch.chunk(0, 2), 0, args)
    assert float(after["gap"]) > 0


@pytest.mark.parametrize("edit,window", [(False, 0), (True, 2)])
def test_the_rollouts_prefix_kv_cache_keeps_the_first_update_on_policy(small_sources, tmp_path, edit, window):
    """--prefix-kv-cache with true CFG (a cache per branch), text to image on prompts of two lengths (padded, masked) in
    full mode, editing (the source's tokens cached too) in a window: the rollout reads the cache (later calls run the
    noisy tokens alone) and equals the one without it bit for bit, latents, log-probs and images; the update, which
    never sees the cache, has `train/logp_gap` exactly 0."""
    name = "tiny-qwen-image-2.1" + ("-edit" if edit else "")
    args = dataclasses.replace(flowgrpo.RECIPES[name], window=window, window_range=(0, 3), cfg_scale=4.0,
                               negative_prompt=" ", group_size=2, prompts_per_iteration=2, micro_batch=2)
    model = models.load_model(name, None, "cpu", seed=0, prefix_kv_cache=True)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0)
    meta = [{"image": write_png(tmp_path / f"{i}.png", 32, 32, i)} if edit else {} for i in range(2)]
    modes = []
    model.transformer.register_forward_pre_hook(lambda m, a, kw: modes.append(kw.get("kv_cache_mode")), with_kwargs=True)

    def sample(cache):
        model.prefix_kv_cache = cache
        return rollout.sample(model, [*PROMPTS[:1] * 2, *PROMPTS[1:] * 2], [meta[0]] * 2 + [meta[1]] * 2, [0, 0, 1, 1],
                              range(4), steps=sch.trained_steps(4, window, (0, 3), seed=1), num_steps=4, height=32,
                              width=32, cfg_scale=4.0, negative_prompt=" ", noise_level=0.7, sde_type="sde", seed=0,
                              iteration=0, chunk=2)
    plain, batch = sample(False), sample(True)
    assert modes[16:] == ["extract"] * 2 + ["cached"] * 6 + ["extract"] * 2 + ["cached"] * 6, modes  # 2 chunks × 4 steps
    for k in ("latents", "log_probs", "images"):
        assert torch.equal(getattr(batch, k), getattr(plain, k)), (k, (getattr(batch, k) - getattr(plain, k)).abs().max())
    batch.advantages, modes[:] = torch.linspace(-1, 1, 4), []
    stats = algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0, stats["train/logp_gap"]
    assert modes and set(modes) == {None}, modes


@pytest.mark.parametrize("edit", [False, True])
def test_resume_through_the_cli_is_bit_for_bit(small_sources, tmp_path, edit):
    """`python flowgrpo.py --model tiny-qwen-image-2.1[-edit]` (in this process) for 2 iterations, and for 1 then
    `--resume auto` to 2: the same LoRA, AdamW state and metrics, bit for bit; every first update on-policy."""
    run = ["--model", "tiny-qwen-image-2.1" + ("-edit" if edit else ""), "--iterations", "2", "--prompts-per-iteration",
           "2", "--group-size", "2", "--micro-batch", "2", "--eval-every", "0", "--checkpoint-every", "1", "--seed", "3"]
    run += ["--prompts", edit_prompts(tmp_path)] if edit else []
    straight, resumed = check_cli_resume(run, tmp_path)
    assert [without_perf(r) for r in rows(resumed)] == [without_perf(r) for r in rows(straight)]
    assert all(r["train/logp_gap"] == 0 for r in rows(straight))


@pytest.mark.parametrize("model,change,needle", [
    ("qwen-image-2.1", dict(sp=2), "--sp: --model qwen-image-2.1 has no sequence parallelism: diffusers 0.42.1 has "
                                   "no context-parallel plan for QwenImage21Transformer2DModel"),
    ("qwen-image-2.1", dict(height=1008), "--height must be a positive multiple of 32"),
    ("qwen-image-2.1-edit", dict(guidance=3.5), "--guidance applies only to"),
])
def test_what_the_family_cannot_do_is_refused_before_loading(model, change, needle):
    kw = dict(height=512, width=512, cfg_scale=1.0, guidance=None, model_path=None) | change
    with pytest.raises(ValueError, match=needle):
        model_checks.check_model_args(model, **kw)


@pytest.mark.parametrize("model,rollout_kind", [("tiny", "local"), ("tiny-qwen-image-2.1", "vllm-omni")])
def test_the_prefix_kv_cache_is_refused_where_there_is_none(model, rollout_kind):
    """--prefix-kv-cache at start-up, in one line: a family without a prefix-KV cache, or another sampler."""
    args = dataclasses.replace(cli.recipe_args(flowgrpo.Args, model), prefix_kv_cache=True, rollout=rollout_kind,
                               rollout_url="http://localhost:1" if rollout_kind == "vllm-omni" else None)
    with pytest.raises(ValueError, match=rf"^--prefix-kv-cache needs --rollout local .* --model {model} with "
                                         rf"--rollout {rollout_kind} has none: run without it$"):
        startup.check_args(args)
    with pytest.raises(ValueError, match="--prefix-kv-cache: --model tiny has no prefix-KV cache"):
        models.load_model("tiny", None, "cpu", prefix_kv_cache=True)


def test_the_recipes_pass_start_up(tmp_path):
    """The one-GPU recipes (docs/algorithm.md §7): from text on the built-in prompts, editing on an edit set."""
    startup.check_args(cli.recipe_args(flowgrpo.Args, "qwen-image-2.1"))
    startup.check_args(dataclasses.replace(cli.recipe_args(flowgrpo.Args, "qwen-image-2.1-edit"),
                                           prompts=edit_prompts(tmp_path)))


def test_rollout_through_vllm_omni_is_refused_at_start_up_with_the_reason(tmp_path):
    """vLLM-Omni 0.30.0 ships no Qwen-Image 2.1 pipeline: `--rollout vllm-omni` is refused in one line naming that and
    the fix, before anything is built or any server is asked."""
    for name, prompts in (("qwen-image-2.1", "general"), ("qwen-image-2.1-edit", edit_prompts(tmp_path))):
        args = dataclasses.replace(cli.recipe_args(flowgrpo.Args, name), rollout="vllm-omni",
                                   rollout_url="http://127.0.0.1:1", prompts=prompts)
        with pytest.raises(ValueError) as refusal:
            startup.check_args(args)
        assert str(refusal.value) == (f"--rollout vllm-omni: --model {name} has no vLLM-Omni pipeline (vLLM-Omni "
                                      "0.30.0 ships none for Qwen-Image 2.1): use --rollout local")
