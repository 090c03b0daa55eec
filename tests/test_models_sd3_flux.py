"""The SD3.5 and FLUX.1 adapters (tiny variants) against diffusers' own StableDiffusion3Pipeline and FluxPipeline:
the ODE path, the sigma schedule, the on-policy first update, LoRA export, and refusals of flags that do not apply."""
import dataclasses
import json

import pytest
import torch

import algorithms
import engine as eng
import flowgrpo
import model_checks
import models
import rollout
import scheduler as sch
from tiny_setup import check_lora_export, check_ode_path_against_the_pipeline

H = W = 32
PROMPTS = ["a red cat", "a blue dog sitting on a green hill at sunset"]
# (model, guidance arguments): SD3 takes two-pass CFG (`cfg`), FLUX its guidance embedding (`guidance`)
CASES = [("tiny-sd3", dict(cfg=1.0)), ("tiny-sd3", dict(cfg=4.5)),
         ("tiny-flux", dict(guidance=3.5)), ("tiny-flux", dict(guidance=1.0))]


@pytest.fixture(scope="module")
def built():
    """One adapter per (model, guidance), sharing each model's pipeline build."""
    return {name: models.load_model(name, None, "cpu", seed=0) for name in ("tiny-sd3", "tiny-flux")}


def adapter(built, name, guidance=None, **_):
    model = built[name]
    if guidance is not None:
        model.guidance = guidance
    return model


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_tiny_is_deterministic_from_its_seed_and_saves_and_reloads(built, name, tmp_path):
    """The same seed builds the same weights; `save-tiny` writes a directory that `--model-path` loads back exactly,
    tokenizers (built in code) included."""
    model, other = built[name], models.adapter_class(name).build_tiny(1)
    assert any(not torch.equal(p, other.transformer.state_dict()[n]) for n, p in model.transformer.state_dict().items())
    directory = models.save_tiny_pipeline(str(tmp_path / name), seed=0, model=name)
    again = models.load_model(name, directory, "cpu")
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        mine, theirs = getattr(model.pipe, part).state_dict(), getattr(again.pipe, part).state_dict()
        assert all(torch.equal(p, theirs[k]) for k, p in mine.items()), part
    for k, v in model.encode(PROMPTS).items():
        torch.testing.assert_close(again.encode(PROMPTS)[k], v, rtol=0, atol=0)
    # the directory is of this family: another family's --model refuses it by its model_index.json alone
    other_family = "tiny-flux" if name == "tiny-sd3" else "tiny-sd3"
    with pytest.raises(ValueError, match=f"--model-path .* holds a {model.pipeline_class}.*use --model {name}"):
        model_checks.check_model_args(other_family, height=H, width=W, cfg_scale=1.0, guidance=None,
                                      model_path=directory)


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux"])
def test_encode_is_the_pipelines_and_prompts_differ(built, name):
    model = built[name]
    mine = model.encode(PROMPTS)
    if name == "tiny-sd3":
        embeds, _, pooled, _ = model.pipe.encode_prompt(PROMPTS, None, None, do_classifier_free_guidance=False,
                                                        max_sequence_length=model.max_sequence_length)
    else:
        embeds, pooled, _ = model.pipe.encode_prompt(PROMPTS, None, max_sequence_length=model.max_sequence_length)
    assert torch.equal(mine["embeds"], embeds) and torch.equal(mine["pooled"], pooled)
    assert (mine["embeds"][0] - mine["embeds"][1]).abs().max() > 1e-3  # the tokenizers tell the prompts apart


@pytest.mark.parametrize("name,guide", CASES)
def test_ode_rollout_reproduces_the_diffusers_pipeline(built, name, guide):
    """Same initial latents and embeddings: our ODE sampler's latents equal the pipeline's bit for bit, its images
    within 1e-6, and the sigma schedule is the one the pipeline set (tiny_setup.check_ode_path_against_the_pipeline)."""
    check_ode_path_against_the_pipeline(adapter(built, name, **guide), PROMPTS, guide.get("cfg", 1.0), H, W)


def test_guidance_and_cfg_change_the_velocity(built):
    """Neither guidance path is a no-op: the checks above would pass vacuously if it were."""
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    sd3, sigma = built["tiny-sd3"], torch.full((2,), 0.6)
    v1, v4 = (sd3.velocity(x, sigma, sd3.conditioning(PROMPTS, "", c), c, H, W) for c in (1.0, 4.5))
    assert (v1 - v4).abs().max() > 1e-3
    flux = built["tiny-flux"]
    x = flux.noise(rollout.image_generators(0, 0, [0, 1]), H, W)
    cond = flux.conditioning(PROMPTS, "", 1.0)
    vs = [adapter(built, "tiny-flux", guidance=g).velocity(x, sigma, cond, 1.0, H, W) for g in (1.0, 3.5)]
    assert (vs[0] - vs[1]).abs().max() > 1e-4


def tiny_engine(model, **kw):
    return eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                      max_grad_norm=1.0, seed=0, **kw)


@pytest.mark.parametrize("name,guide,window", [(name, guide, window) for name, guide in (("tiny-sd3", dict(cfg=4.5)),
                                                                                     ("tiny-flux", dict(guidance=3.5)))
                                               for window in (0, 2)])
def test_first_update_is_exactly_on_policy(name, guide, window):
    """`train/logp_gap` is exactly 0 in float32 on CPU, full and window mode, with CFG (SD3) / guidance (FLUX); in
    window mode the frozen text encoders are FSDP2-sharded (`text_encoder_shards`), and prompts encode through them."""
    cfg = guide.get("cfg", 1.0)
    args = dataclasses.replace(flowgrpo.RECIPES["tiny"], model=name, window=window, window_range=(0, 3),
                               cfg_scale=cfg, negative_prompt="", group_size=4, prompts_per_iteration=2,
                               micro_batch=4, optimizer_steps=2)
    model = models.load_model(name, None, "cpu", seed=0, guidance=guide.get("guidance"))
    engine = tiny_engine(model, shard_text_encoder=window > 0)
    steps = sch.trained_steps(args.num_steps, window, args.window_range, seed=1)
    batch = rollout.sample(model, ["a cat"] * 4 + ["a tall house"] * 4, [{}] * 8, [0] * 4 + [1] * 4, range(8),
                           steps=steps, num_steps=args.num_steps, height=H, width=W, cfg_scale=cfg, negative_prompt="",
                           noise_level=0.7, sde_type="sde", seed=0, iteration=0, chunk=4)
    batch.advantages = torch.linspace(-1, 1, 8)
    stats = algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0  # bitwise: same weights, shapes and kernels as the rollout
    _, after = algorithms.policy_loss(model, engine, batch.chunk(0, 4), 0, args)
    assert float(after["gap"]) > 0  # the check can fail: after two optimizer steps the policy has moved


@pytest.mark.parametrize("name", ["tiny-sd3", "tiny-flux", "tiny-wan", "tiny-z-image", "tiny-flux.2-klein",
                                  "tiny-qwen-image-2.1"])
def test_exported_lora_loads_into_a_fresh_diffusers_pipeline(name, tmp_path):
    """Train one update in-process, export, load with `<Pipeline>.load_lora_weights` into a fresh pipeline: the
    trained transformer's output, alpha included (Wan too: WanPipeline, one-frame videos; ZImagePipeline,
    Flux2KleinPipeline, QwenImage21Pipeline)."""
    check_lora_export(name, str(tmp_path), [{}] * 4)


@pytest.mark.parametrize("model,change,needle", [
    ("tiny-sd3", dict(height=36), "--height must be a positive multiple of 8"),
    ("sd3.5-medium", dict(width=520), "--width must be a positive multiple of 16"),
    ("flux.1-dev", dict(cfg_scale=3.5), "--cfg-scale must be 1 for --model flux.1-dev.*--guidance"),
    ("sd3.5-medium", dict(guidance=3.5), "--guidance applies only to .*flux.1-dev.*--cfg-scale"),
    ("qwen-image", dict(guidance=2.0), "--guidance"),
    ("flux.1-dev", dict(model_path="/no/such/dir"), "--model-path /no/such/dir: no such directory"),
    ("sd9", {}, "--model must be one of"),
])
def test_flags_that_do_not_apply_are_refused_before_loading(model, change, needle):
    kw = dict(height=512, width=512, cfg_scale=1.0, guidance=None, model_path=None) | change
    with pytest.raises(ValueError, match=needle):
        model_checks.check_model_args(model, **kw)


def test_model_path_of_another_family_is_refused_from_its_index(tmp_path):
    """model_index.json alone decides (nothing is loaded): a Qwen-Image directory for --model flux.1-dev."""
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    with pytest.raises(ValueError, match="holds a QwenImagePipeline, but --model flux.1-dev needs a FluxPipeline: "
                                         "use --model tiny or qwen-image"):
        model_checks.check_model_args("flux.1-dev", height=512, width=512, cfg_scale=1.0, guidance=3.5,
                                      model_path=str(tmp_path))
    (tmp_path / "model_index.json").unlink()
    with pytest.raises(ValueError, match="not a diffusers pipeline directory"):
        model_checks.check_model_args("flux.1-dev", height=512, width=512, cfg_scale=1.0, guidance=3.5,
                                      model_path=str(tmp_path))
    model_checks.check_model_args("flux.1-dev", height=512, width=512, cfg_scale=1.0, guidance=3.5,
                                  model_path="black-forest-labs/FLUX.1-dev")  # a hub id: checked when it loads
