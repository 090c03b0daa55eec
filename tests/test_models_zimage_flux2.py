"""Z-Image and FLUX.2 [klein] (tiny variants) against diffusers' own ZImagePipeline and Flux2KleinPipeline: the ODE path
bit for bit, the on-policy first update, the tiny twins saved and reloaded, exact resume through the CLI, and the
refusals of what a family cannot do. (LoRA export: tests/test_models_sd3_flux.py; --sp: tests/test_sp.py.)"""
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
import rollout
import scheduler as sch
import startup
from test_engine import check_cli_resume, rows, without_perf

H = W = 32
PROMPTS = ["a red cat", "a blue dog sitting on a green hill at sunset"]
NAMES = ["tiny-z-image", "tiny-flux.2-klein"]


@pytest.fixture(scope="module")
def built():
    return {name: models.load_model(name, None, "cpu", seed=0) for name in NAMES}


def check_ode_equals_pipeline(model, prompts: list[str], cfg: float, height: int, width: int, n_steps: int = 4,
                              **call) -> float:
    """`model`'s ODE rollout against its pipeline's `__call__` drawing its own noise from the same per-image
    generators: the σ schedule is the one the pipeline set, the final latents (as the pipeline holds them at its last
    step, before any unpacking) equal bit for bit, the images within 1e-6. `call`: more pipeline arguments. Returns
    the images' max |ours − pipeline's|."""
    n = len(prompts)
    batch = rollout.sample(model, prompts, [{}] * n, range(n), range(n), steps=[], num_steps=n_steps, height=height,
                           width=width, cfg_scale=cfg, negative_prompt="", noise_level=0.0, sde_type="sde", seed=3,
                           iteration=5, chunk=n)
    last = {}

    def keep(pipe, i, t, tensors):
        last["latents"] = tensors["latents"]
        return {}
    images = model.pipe(generator=rollout.image_generators(3, 5, range(n)), height=height, width=width,
                        num_inference_steps=n_steps, output_type="pt", callback_on_step_end=keep,
                        **model.pipeline_kwargs(model.conditioning(prompts, "", cfg), cfg), **call).images
    sigmas = sch.sigma_schedule(model.scheduler, n_steps, model.image_seq_len(height, width))
    assert torch.equal(sigmas, model.pipe.scheduler.sigmas), (sigmas, model.pipe.scheduler.sigmas)
    assert torch.equal(batch.x0, last["latents"]), (batch.x0 - last["latents"]).abs().max()  # bit for bit
    assert batch.images.shape == (n, 3, height, width)
    torch.testing.assert_close(batch.images, images[:, :3], rtol=0, atol=1e-6)
    return (batch.images - images[:, :3]).abs().max().item()


@pytest.mark.parametrize("name,cfg", [(name, cfg) for name in NAMES for cfg in (1.0, 4.0)])
def test_ode_rollout_reproduces_the_diffusers_pipeline(built, name, cfg):
    """Same noise, same prompt embeddings, CFG off and on (Z-Image's own form, g = w − 1): the latents equal the
    pipeline's bit for bit and the images within 1e-6 (measured: 0)."""
    print(f"\n{name} cfg {cfg}: images max |ours − pipeline's| {check_ode_equals_pipeline(built[name], PROMPTS, cfg, H, W)}")


@pytest.mark.parametrize("name", NAMES)
def test_cfg_and_prompts_change_the_velocity(built, name):
    """Neither check above is vacuous: CFG changes v, and the prompts' embeddings differ."""
    model = built[name]
    x, sigma = model.noise(rollout.image_generators(0, 0, [0, 1]), H, W), torch.full((2,), 0.6)
    v1, v4 = (model.velocity(x, sigma, model.conditioning(PROMPTS, "", c), c, H, W) for c in (1.0, 4.0))
    assert (v1 - v4).abs().max() > 1e-4
    embeds = model.encode(PROMPTS)["embeds"]
    assert (embeds[0] - embeds[1]).abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_tiny_is_deterministic_saves_and_reloads(built, name, tmp_path):
    """The same seed builds the same weights, another seed others; `save-tiny` writes a pipeline directory that
    --model-path loads back exactly (the text encoder's embeddings included), which another family's --model refuses."""
    model, other = built[name], models.adapter_class(name).build_tiny(1)
    assert any(not torch.equal(p, other.transformer.state_dict()[n]) for n, p in model.transformer.state_dict().items())
    again = models.load_model(name, models.save_tiny_pipeline(str(tmp_path / name), 0, name), "cpu")
    for part in ("transformer", "vae", "text_encoder"):
        theirs = getattr(again.pipe, part).state_dict()
        assert all(torch.equal(p, theirs[k]) for k, p in getattr(model.pipe, part).state_dict().items()), part
    for k, v in model.encode(PROMPTS).items():
        assert torch.equal(again.encode(PROMPTS)[k], v), k
    with pytest.raises(ValueError, match=f"holds a {model.pipeline_class}, but --model tiny needs a QwenImagePipeline"):
        model_checks.check_model_args("tiny", height=H, width=W, cfg_scale=1.0, guidance=None,
                                      model_path=str(tmp_path / name))


@pytest.mark.parametrize("name,window", [(name, window) for name in NAMES for window in (0, 2)])
def test_first_update_is_exactly_on_policy(name, window):
    """`train/logp_gap` is exactly 0 in float32 on CPU, CFG on, full and window mode (the frozen text encoder
    FSDP2-sharded in window mode); the second optimizer step's gap is not 0, so the check can fail."""
    args = dataclasses.replace(flowgrpo.RECIPES[name], window=window, window_range=(0, 3), cfg_scale=4.0,
                               negative_prompt="", group_size=4, prompts_per_iteration=2, micro_batch=4,
                               optimizer_steps=2)
    model = models.load_model(name, None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0, shard_text_encoder=window > 0)
    steps = sch.trained_steps(args.num_steps, window, args.window_range, seed=1)
    batch = rollout.sample(model, ["a cat"] * 4 + ["a tall house"] * 4, [{}] * 8, [0] * 4 + [1] * 4, range(8),
                           steps=steps, num_steps=args.num_steps, height=H, width=W, cfg_scale=4.0, negative_prompt="",
                           noise_level=0.7, sde_type="sde", seed=0, iteration=0, chunk=4)
    batch.advantages = torch.linspace(-1, 1, 8)
    stats = algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0
    _, after = algorithms.policy_loss(model, engine, batch.chunk(0, 4), 0, args)
    assert float(after["gap"]) > 0


@pytest.mark.parametrize("name", NAMES)
def test_resume_through_the_cli_is_bit_for_bit(name, tmp_path):
    """`python flowgrpo.py --model NAME` (in this process) for 2 iterations, and for 1 then `--resume auto` to 2: the
    same LoRA, AdamW state and metrics, bit for bit; every first update on-policy."""
    run = ["--model", name, "--iterations", "2", "--prompts-per-iteration", "2", "--group-size", "2", "--micro-batch",
           "2", "--eval-every", "0", "--checkpoint-every", "1", "--seed", "3"]
    straight, resumed = check_cli_resume(run, tmp_path)
    assert [without_perf(r) for r in rows(resumed)] == [without_perf(r) for r in rows(straight)]
    assert all(r["train/logp_gap"] == 0 for r in rows(straight))


@pytest.mark.parametrize("model,change,needle", [
    ("z-image", dict(sp=2), "--sp: --model z-image has no sequence parallelism: diffusers 0.42.1 has no "
                            "context-parallel plan for ZImageTransformer2DModel"),
    ("flux.2-klein", dict(cfg_scale=4.0), "--cfg-scale must be 1 for --model flux.2-klein: it is step-distilled"),
    ("flux.2-klein-base", dict(guidance=3.5), "--guidance applies only to"),
    ("flux.2-klein-base", dict(height=200), "--height must be a positive multiple of 16"),
    ("z-image", dict(width=8208), "--width must be at most 8192 for --model z-image, got 8208: its transformer's rotary"),
    ("tiny-z-image", dict(height=4104), "--height must be at most 4096 for --model tiny-z-image"),
])
def test_what_a_family_cannot_do_is_refused_before_loading(model, change, needle):
    kw = dict(height=512, width=512, cfg_scale=1.0, guidance=None, model_path=None) | change
    with pytest.raises(ValueError, match=needle):
        model_checks.check_model_args(model, **kw)
    model_checks.check_model_args("flux.2-klein-base", height=512, width=512, cfg_scale=4.0, guidance=None,
                                  model_path=None)


@pytest.mark.parametrize("recipe", ["z-image", "z-image-turbo", "flux.2-klein-base", "flux.2-klein"])
def test_the_public_recipes_pass_start_up(recipe):
    """Flow-Factory's configs as recipes (docs/algorithm.md §7): every value within start-up's checks."""
    startup.check_args(cli.recipe_args(flowgrpo.Args, recipe))


def test_a_step_distilled_klein_takes_no_cfg(built):
    """A distilled FLUX.2 [klein] pipeline (`is_distilled`, which makes Flux2KleinPipeline ignore guidance) given as
    the base model's --model-path: its adapter refuses --cfg-scale > 1 before the first transformer call."""
    pipe = models.adapter_class("tiny-flux.2-klein").build_tiny(0)
    pipe.register_to_config(is_distilled=True)
    distilled = models.adapter_class("tiny-flux.2-klein")(pipe, "cpu", torch.float32)
    x = distilled.noise(rollout.image_generators(0, 0, [0]), H, W)
    with pytest.raises(ValueError, match="--cfg-scale must be 1 for a step-distilled FLUX.2"):
        distilled.velocity(x, torch.ones(1), distilled.conditioning(PROMPTS[:1], "", 4.0), 4.0, H, W)


def test_a_step_distilled_model_path_is_refused_with_cfg_at_start_up(tmp_path):
    """Such a pipeline saved as a --model-path: start-up reads its model_index.json and refuses --cfg-scale > 1 in one
    line, before the model loads (before: only at the first transformer call, after the load)."""
    path = models.save_tiny_pipeline(str(tmp_path / "klein"), model="tiny-flux.2-klein")
    index = json.loads((tmp_path / "klein" / "model_index.json").read_text())
    flags = dict(height=H, width=W, guidance=None, model_path=path)
    model_checks.check_model_args("tiny-flux.2-klein", cfg_scale=4.0, **flags)  # a base pipeline takes CFG
    (tmp_path / "klein" / "model_index.json").write_text(json.dumps(index | {"is_distilled": True}))
    model_checks.check_model_args("tiny-flux.2-klein", cfg_scale=1.0, **flags)
    with pytest.raises(ValueError, match=f"^--cfg-scale must be 1 with --model-path {path}: its pipeline is "
                                         "step-distilled .*got 4.0: give a base checkpoint$"):
        model_checks.check_model_args("tiny-flux.2-klein", cfg_scale=4.0, **flags)
