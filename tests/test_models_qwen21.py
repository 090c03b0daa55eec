"""Qwen-Image 2.1 (`tiny-qwen-image-2.1`, `tiny-qwen-image-2.1-edit`) against diffusers' own QwenImage21Pipeline: text
to image and editing, the ODE path bit for bit, the on-policy first update, the tiny twin saved and reloaded (its
image-only processor), exact resume through the CLI, and the refusals. (LoRA export: tests/test_models_sd3_flux.py.)

The pipeline's sources are resized to about its `output_resolution`² pixels (1024²); these tests shrink the adapter's
CONDITION_SIDE to 64 and call the pipeline with the same, so that a source costs 16 vision and 16 latent tokens (one
test keeps the pipeline's size)."""
import dataclasses
import json

import pytest
import torch

import algorithms
import cli
import engine as eng
import flowgrpo
import model_checks
import models
import models_qwen21
import rollout
import scheduler as sch
import source_images
import startup
from test_edit import edit_prompts, write_png
from test_engine import check_cli_resume, rows, without_perf

PROMPTS = ["a red cat", "a blue dog sitting on a green hill at sunset"]  # 2 lengths: padded, masked, run apart
SIDE = 64


@pytest.fixture(scope="module")
def qwen21():
    return models.load_model("tiny-qwen-image-2.1", None, "cpu", seed=0)


@pytest.fixture
def small_sources(monkeypatch):
    monkeypatch.setattr(models_qwen21, "CONDITION_SIDE", SIDE)


def check_each_prompt_alone(model, prompts: list[str], sources: list, cfg: float, height: int, width: int,
                            use_kv_cache: bool = False):
    """`model`'s ODE rollout of `prompts` (each with its source image, a path, or None) in one chunk against
    `QwenImage21Pipeline.__call__` (`use_kv_cache` as given) called on each prompt alone (its text, source and the
    negative prompt " "), from the image's own generator: the σ table the pipeline set, each image's latents bit for
    bit, its RGB (of the pipeline's RGBA) within 1e-5 (the VAE decodes the chunk at once, the pipeline one image:
    measured 1.0e-6). Returns the rollout's batch."""
    n, last = len(prompts), {}
    batch = rollout.sample(model, prompts, [{"image": s} if s else {} for s in sources], range(n), range(n), steps=[],
                           num_steps=4, height=height, width=width, cfg_scale=cfg, negative_prompt=" ", noise_level=0.0,
                           sde_type="sde", seed=3, iteration=5, chunk=n)
    for i, (prompt, source) in enumerate(zip(prompts, sources)):
        image = [source_images.read(source, "RGBA")] if source else None  # (the pipeline takes RGB to RGBA too)
        images = model.pipe(prompt=[prompt], image=image, negative_prompt=" " if cfg > 1 else None, true_cfg_scale=cfg,
                            generator=rollout.image_generators(3, 5, [i]), height=height, width=width,
                            num_inference_steps=4, output_type="pt", use_kv_cache=use_kv_cache,
                            callback_on_step_end=lambda pipe, step, t, tensors: last.update(tensors) or {},
                            output_resolution=models_qwen21.CONDITION_SIDE).images
        sigmas = sch.sigma_schedule(model.scheduler, 4, model.image_seq_len(height, width))
        assert torch.equal(sigmas, model.pipe.scheduler.sigmas), (sigmas, model.pipe.scheduler.sigmas)
        assert torch.equal(batch.x0[i:i + 1], last["latents"]), (prompt, (batch.x0[i] - last["latents"][0]).abs().max())
        torch.testing.assert_close(batch.images[i:i + 1], images[:, :3], rtol=0, atol=1e-5)
    return batch


@pytest.mark.parametrize("cfg,height,width", [(1.0, 64, 64), (4.0, 32, 64)])
def test_text_to_image_ode_reproduces_the_pipeline_on_each_prompt(qwen21, cfg, height, width):
    """Two prompts of different lengths in one chunk, CFG off and on: each image is the pipeline's on its prompt alone.
    Padded to the longer prompt in one call (as the pipeline pads a batch), the shorter one's latents moved by 0.0015
    (CFG 4 at 32 × 64: 0.0051): text and image share one rotary sequence, so the padding moved the image's positions
    and an image depended on the prompts beside it in its micro-batch (the loop's mix prompts)."""
    check_each_prompt_alone(qwen21, PROMPTS, [None, None], cfg, height, width)


def test_the_prefix_kv_cache_changes_no_bit_here(qwen21):
    """The pipeline's default, its prefix-KV cache (the text's keys and values kept from the first step), gives the same
    latents as recomputing them on the tiny twin in float32 on CPU (its docstring: not so in reduced precision); the
    cache is used (every step after the first reads it)."""
    modes = []
    hook = qwen21.transformer.register_forward_pre_hook(lambda m, a, kw: modes.append(kw.get("kv_cache_mode")),
                                                        with_kwargs=True)
    try:
        check_each_prompt_alone(qwen21, PROMPTS[:1], [None], 1.0, SIDE, SIDE, use_kv_cache=True)
    finally:
        hook.remove()
    assert modes[-4:] == ["extract", "cached", "cached", "cached"], modes


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_edit_ode_reproduces_the_pipeline_on_each_prompt(qwen21, small_sources, tmp_path, cfg):
    """Two edit prompts of different lengths in one chunk, each with its source (through the VL encoder and as VAE
    tokens), CFG off and with a negative prompt encoded with the source: each image's latents equal the pipeline's,
    given that prompt and image alone, bit for bit (padded to the longer prompt, the shorter one's moved by up to
    0.0086, CFG 4: 0.035); the source changes the result (the check is not vacuous)."""
    prompts = ["turn the whole picture upside down", "make it red"]
    sources = [write_png(tmp_path / f"{i}.png", SIDE, SIDE, i) for i in range(2)]
    batch = check_each_prompt_alone(qwen21, prompts, sources, cfg, SIDE, SIDE)
    other = rollout.sample(qwen21, prompts[:1], [{"image": sources[1]}], [0], [0], steps=[], num_steps=4, height=SIDE,
                           width=SIDE, cfg_scale=cfg, negative_prompt=" ", noise_level=0.0, sde_type="sde", seed=3,
                           iteration=5, chunk=1)
    assert (other.x0 - batch.x0[:1]).abs().max() > 1e-4


def test_tiny_edit_runs_at_the_pipelines_source_size(qwen21, tmp_path):
    """A source at the pipeline's own size (about 1024², CONDITION_SIDE not shrunk) edits as the pipeline does. With
    transformers' default bound of 980·1024 pixels an image, the tiny twin's Qwen3-VL saw 961 vision slots where the
    VAE made 1,024 slots' worth of tokens: the first transformer call failed (so did `--model
    tiny-qwen-image-2.1-edit`)."""
    check_each_prompt_alone(qwen21, ["make it red"], [write_png(tmp_path / "s.png", 32, 32, 0)], 1.0, 32, 32)


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
    """--prefix-kv-cache with true CFG (a cache per branch and prompt length), chunks of two prompts of two lengths,
    text to image in full mode, editing (the source's tokens cached too) in a window: the rollout reads the caches
    (later calls run the noisy tokens alone) and equals the one without them bit for bit, latents, log-probs and images;
    the update, which never sees them, has `train/logp_gap` exactly 0."""
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
        return rollout.sample(model, PROMPTS * 2, meta * 2, [0, 1, 0, 1], range(4), num_steps=4, height=32, width=32,
                              steps=sch.trained_steps(4, window, (0, 3), seed=1), cfg_scale=4.0, negative_prompt=" ",
                              noise_level=0.7, sde_type="sde", seed=0, iteration=0, chunk=2)
    plain, batch = sample(False), sample(True)
    # each of 2 chunks × 4 steps: a call per prompt length, then the negative prompt's
    assert modes[24:] == (["extract"] * 3 + ["cached"] * 9) * 2, modes
    for k in ("latents", "log_probs", "images"):
        assert torch.equal(getattr(batch, k), getattr(plain, k)), (k, (getattr(batch, k) - getattr(plain, k)).abs().max())
    batch.advantages, modes[:] = torch.linspace(-1, 1, 4), []
    stats = algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0, stats["train/logp_gap"]
    assert modes and set(modes) == {None}, modes


def test_the_prefix_kv_cache_needs_the_causal_condition():
    """A transformer without `causal_condition` (nothing to keep) samples under --prefix-kv-cache as without it, as the
    pipeline then caches nothing; its first call raised "kv_cache requires `causal_condition=True`" once loaded."""
    pipe = models_qwen21.build_tiny_qwen21_pipeline(0)
    transformer = type(pipe.transformer).from_config(pipe.transformer.config, causal_condition=False)
    pipe.register_modules(transformer=transformer)
    model = models_qwen21.QwenImage21(pipe, "cpu", torch.float32)
    kw = dict(steps=[1, 2], num_steps=4, height=32, width=32, cfg_scale=4.0, negative_prompt=" ", noise_level=0.7,
              sde_type="sde", seed=0, iteration=0, chunk=2)
    plain = rollout.sample(model, PROMPTS, [{}] * 2, [0, 1], [0, 1], **kw)
    model.prefix_kv_cache = True
    assert torch.equal(rollout.sample(model, PROMPTS, [{}] * 2, [0, 1], [0, 1], **kw).latents, plain.latents)


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


def test_a_checkpoint_with_its_own_sigma_grid_is_refused(tmp_path):
    """A pipeline config with `sample_sigmas` (the grid a Turbo checkpoint ships) makes QwenImage21Pipeline sample that
    grid whatever `num_inference_steps` asks, where the adapter samples linspace(1, 1/N, N) shifted: the tiny twin with
    a 4-step grid at 4 steps ended 0.028 from the pipeline's latents (σ_1 0.743 against 0.894), and at 6 steps the
    pipeline took 4. Refused in one line at start-up (a --model-path's model_index.json) and when the model is built
    (a hub id's)."""
    pipe = models_qwen21.build_tiny_qwen21_pipeline(0)
    pipe.register_to_config(sample_sigmas=[1.0, 0.9, 0.6, 0.3])
    with pytest.raises(ValueError, match=r"^--model-path: its pipeline samples its own σ grid \(4 steps, model_index"):
        models_qwen21.QwenImage21(pipe, "cpu", torch.float32)
    path = models.save_tiny_pipeline(str(tmp_path / "turbo"), model="tiny-qwen-image-2.1")
    flags = dict(height=32, width=32, cfg_scale=1.0, guidance=None, model_path=path)
    model_checks.check_model_args("tiny-qwen-image-2.1", **flags)  # without a grid
    index = json.loads((tmp_path / "turbo" / "model_index.json").read_text())
    (tmp_path / "turbo" / "model_index.json").write_text(json.dumps(index | {"sample_sigmas": [1.0, 0.9, 0.6, 0.3]}))
    with pytest.raises(ValueError, match=f"^--model-path {path}: its pipeline samples its own σ grid"):
        model_checks.check_model_args("tiny-qwen-image-2.1", **flags)


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
