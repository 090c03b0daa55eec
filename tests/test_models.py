"""The tiny Qwen-Image adapter against diffusers' own QwenImagePipeline; the model registry's cheap import and
one-line loading errors."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import model_checks
import models
import models_qwen
import rollout
import scheduler as sch

H = W = 32
PROMPTS = ["a red cat", "a blue dog sitting on a green hill at sunset"]  # different lengths: padded mask


@pytest.fixture(scope="module")
def model():
    return models.load_model("tiny", None, "cpu", seed=0)


def test_tiny_is_deterministic_from_its_seed(model):
    again = models_qwen.build_tiny_qwen_pipeline(seed=0)
    other = models_qwen.build_tiny_qwen_pipeline(seed=1)
    for name, p in model.transformer.state_dict().items():
        assert torch.equal(p, again.transformer.state_dict()[name]), name
    assert any(not torch.equal(p, other.transformer.state_dict()[n]) for n, p in model.transformer.state_dict().items())
    assert torch.equal(next(model.pipe.vae.parameters()), next(again.vae.parameters()))


def test_encode_matches_the_pipeline_and_pads(model):
    embeds, mask = model.encode(PROMPTS).values()
    ref, ref_mask = model.pipe.encode_prompt(PROMPTS, device="cpu")
    assert torch.equal(embeds, ref) and torch.equal(mask, ref_mask)
    assert mask[0].sum() < mask[1].sum() == mask.shape[1]  # the short prompt is padded
    # the adapter's text encoder computes one position's logits (models_qwen.last_logit_only): a pipeline without
    # that hook encodes the same bits
    plain, plain_mask = models_qwen.build_tiny_qwen_pipeline(seed=0).encode_prompt(PROMPTS, device="cpu")
    assert torch.equal(embeds, plain) and torch.equal(mask, plain_mask), (embeds - plain).abs().max()
    ids = torch.ones(2, 5, dtype=torch.long)
    assert model.pipe.text_encoder(input_ids=ids).logits.shape[1] == 1


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_ode_rollout_reproduces_the_diffusers_pipeline(model, cfg):
    """Same initial latents and embeddings: our ODE sampler (rollout.sample with no SDE step) gives the
    pipeline's output latents and images, bit for bit on CPU float32."""
    n_steps = 4
    batch = rollout.sample(model, PROMPTS, [{}, {}], [0, 1], [0, 1], steps=[], num_steps=n_steps, height=H, width=W,
                           cfg_scale=cfg, negative_prompt=" ", noise_level=0.0, sde_type="sde", seed=3, iteration=5,
                           chunk=2)
    x1 = model.noise(rollout.image_generators(3, 5, [0, 1]), H, W)
    cond = model.conditioning(PROMPTS, " ", cfg)
    kw = dict(model.pipeline_kwargs(cond, cfg), height=H, width=W, num_inference_steps=n_steps)
    ref_latents = model.pipe(latents=x1.clone(), output_type="latent", **kw).images
    ref_images = model.pipe(latents=x1.clone(), output_type="pt", **kw).images
    torch.testing.assert_close(model.decode(ref_latents, H, W), ref_images, rtol=0, atol=0)
    torch.testing.assert_close(batch.images, ref_images, rtol=0, atol=1e-6)
    # the latents themselves, step by step through our velocity and scheduler.step
    sig, x = sch.sigma_schedule(model.scheduler, n_steps, model.image_seq_len(H, W)), x1
    with torch.no_grad():
        for i in range(n_steps):
            v = model.velocity(x, sig[i].expand(2), cond, cfg, H, W)
            x, *_ = sch.step(v, x, sig[i], sig[i + 1], sigma_max=sig[1], noise_level=0)
    torch.testing.assert_close(x, ref_latents, rtol=0, atol=1e-6)


def test_a_prompt_past_the_pipelines_text_length_samples_as_its_call(model):
    """QwenImagePipeline.__call__ cuts a prompt's embeddings at its max_sequence_length, 512 (encode_prompt's own
    default is 1024): prompts of ~1,500 tokens, positive and negative, sample the call's latents bit for bit."""
    long = " ".join(f"word{i}" for i in range(400))
    negative = " ".join(f"bad{i}" for i in range(400))
    batch = rollout.sample(model, [long], [{}], [0], [0], steps=[], num_steps=2, height=H, width=W, cfg_scale=4.0,
                           negative_prompt=negative, noise_level=0.0, sde_type="sde", seed=3, iteration=5, chunk=1)
    ref = model.pipe(prompt=long, negative_prompt=negative, true_cfg_scale=4.0, height=H, width=W, num_inference_steps=2,
                     output_type="latent", generator=rollout.image_generators(3, 5, [0])).images
    assert torch.equal(batch.x0, ref), (batch.x0 - ref).abs().max()
    assert model.encode([long])["embeds"].shape[1] == 512


def test_rollout_is_chunk_invariant_and_records_the_window(model):
    kw = dict(steps=[1, 2], num_steps=4, height=H, width=W, cfg_scale=1.0, negative_prompt=" ", noise_level=0.7,
              sde_type="sde", seed=0, iteration=2)
    prompts = PROMPTS * 2
    a = rollout.sample(model, prompts, [{}] * 4, [0, 1, 0, 1], [0, 1, 2, 3], chunk=4, **kw)
    b = rollout.sample(model, prompts, [{}] * 4, [0, 1, 0, 1], [0, 1, 2, 3], chunk=2, **kw)
    assert a.latents.shape == (4, 3, (H // 8) * (W // 8), 16) and a.log_probs.shape == (4, 2) and a.sigmas.shape == (3,)
    torch.testing.assert_close(a.images, b.images, rtol=0, atol=1e-5)
    assert not torch.allclose(a.images[0], a.images[2])  # same prompt, different noise
    assert torch.isfinite(a.log_probs).all()


def test_bad_resolution_and_model_name(model):
    with pytest.raises(ValueError, match="--height"):
        model_checks.check_resolution("tiny", 36, 32)
    with pytest.raises(ValueError, match="--model"):
        models.load_model("sd9", None, "cpu")


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_importing_models_loads_neither_diffusers_nor_transformers():
    """`flowgrpo.py --help` must not pay for diffusers or transformers: models*.py import them only to build or load
    (models.py imports every family's file)."""
    code = ("import sys, model_checks; model_checks.check_model_args('flux.1-dev', height=512, width=512, "
            "cfg_scale=1.0, guidance=3.5, model_path=None); print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('diffusers', 'transformers', 'peft')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def test_weights_that_cannot_be_reached_are_one_clear_line(tmp_path):
    """A hub id with HF_HUB_OFFLINE=1 and an empty cache, and a missing local directory: one line naming
    --model-path and HF_HUB_OFFLINE and how to fetch the weights, and no deprecation warning from our own call."""
    code = ("import models\ntry:\n    models.load_model('qwen-image', None, 'cpu')\nexcept ValueError as e:\n"
            "    print(e)")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Qwen/Qwen-Image" in lines[0] and "--model-path" in lines[0] and "HF_HUB_OFFLINE" in lines[0], lines[0]
    assert "`hf download Qwen/Qwen-Image --local-dir DIR`" in lines[0]  # how to get them, not a circle
    for noise in ("torch_dtype", "local_files_only", "Couldn't connect to the Hub", "Traceback"):
        assert noise not in out.stdout + out.stderr, out.stderr[-2000:]
    with pytest.raises(ValueError, match="--model sd3.5-medium: cannot load .*--model-path") as e:
        models.load_model("sd3.5-medium", str(tmp_path / "missing"), "cpu")
    assert "\n" not in str(e.value)


def test_a_pipeline_directory_without_a_tokenizers_files_is_refused_in_one_line(tmp_path):
    """Before: diffusers loaded it, transformers building the tokenizer from no files without a word: tiny-flux's T5
    read "a red cat" as <unk>s ([3, 2, 3, 2, 3, 2, 1]) and trained on that; tiny's Qwen2 had 1 token and its first
    prompt crashed in the text encoder. Any other part missing fails to load. Each case: (model, part, the files left
    in its folder; None: no folder)."""
    saved = {name: models.save_tiny_pipeline(str(tmp_path / name), 0, name) for name in ("tiny-flux", "tiny")}
    for i, (name, part, keep) in enumerate([("tiny-flux", "tokenizer_2", None), ("tiny-flux", "tokenizer_2", []),
                                            ("tiny-flux", "tokenizer", ["tokenizer_config.json"]),
                                            ("tiny", "tokenizer", None)]):
        path = shutil.copytree(saved[name], str(tmp_path / f"case{i}"))
        for file in os.listdir(os.path.join(path, part)):
            if keep is not None and file not in keep:
                os.remove(os.path.join(path, part, file))
        if keep is None:
            shutil.rmtree(os.path.join(path, part))
        refusal = rf"^--model {name}: cannot load a \w+Pipeline from '{path}' \(it lacks {part}/.*which its " \
                  r"model_index.json names\); not a complete pipeline"
        with pytest.raises(ValueError, match=refusal) as e:
            models.load_model(name, path, "cpu")
        assert "\n" not in str(e.value)
    models.load_model("tiny-flux", saved["tiny-flux"], "cpu")  # whole, it loads


def test_z_image_stacks_are_bounded_before_a_weightless_copy_is_built(tmp_path):
    """Z-Image's transformer config names its stacks `n_layers`, `n_refiner_layers`: bounded as `num_layers` are (before:
    any count passed, and the --lora-targets check built them weightless, 3,000 in 9 s, 10⁶ for hours)."""
    (tmp_path / "transformer").mkdir()
    config = {"_class_name": "ZImageTransformer2DModel", "n_layers": 300}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="transformer/config.json has n_layers 300, more than 256$"):
        model_checks.check_lora_targets("z-image", str(tmp_path), models.adapter_class("z-image").lora_targets)
