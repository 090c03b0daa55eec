"""SD3.5, FLUX.1 and Wan2.1 through the real vLLM-Omni 0.30.0 server: omni.pipeline.FlowGRPOSD3Pipeline serves
tiny-sd3, omni.pipeline.FlowGRPOFluxPipeline tiny-flux, omni.pipeline.FlowGRPOWanPipeline tiny-wan (5-frame videos;
the recipe's run: 9) (each family's pipeline directory from models.save_tiny_pipeline; one server per family,
reused by all of that family's tests).

The served trajectories equal the local backend's (same seeds, same LoRA on the adapter's default targets, CFG
4.5 for SD3, the guidance embedding for FLUX), also when the server fuses several requests of n > 1 images into
one forward; their σ equal the trainer's to the bit; a 2-iteration run of the recipe with `--rollout vllm-omni` has a
tiny `train/logp_gap`.

Tolerances: float32 on CPU, two implementations of each transformer (vLLM-Omni's fused-QKV layers against
diffusers'), and for SD3's CFG two passes where the trainer batches one. Measured over runs (4 steps, 32²): latents
within 2.3e-6 (SD3, CFG 4.5) and 4.8e-7 (FLUX), log-probs within 2.4e-7, images within 1.1e-6; the trainer's
log-prob of the served transitions within 1.2e-7 without CFG and 4.1e-6 with SD3's CFG 4.5 and cps (CFG scales the
velocity gap by 4.5, cps's small std amplifies it); a recipe run's `train/logp_gap` at most 7e-8. The bounds (1e-5,
2e-5, 1e-6) leave a margin of 4 or more; the errors they exist to catch (another text length, a missing adapter
layer, other noise) are 1e-3 and up (the LoRA alone moves the images by more than 7e-3).
"""
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from harness import OmniServer, http, set_lora_b, train_here

import engine as eng
import models
import rollout
import rollout_backends
import scheduler as sch

H = W = 32
KW = dict(num_steps=4, height=H, width=W, negative_prompt="", noise_level=0.7, seed=0, iteration=3, chunk=8)
PROMPTS = ["a red cube on a table", "a blue ball", "a red cube on a table", "a blue ball", "a red cube on a table"]
# (steps, cfg_scale, sde_type) per family: SD3 with and without CFG; FLUX has only its guidance embedding
CASES = {"tiny-sd3": [([0, 1, 2], 1.0, "sde"), ([1, 2], 4.5, "cps")],
         "tiny-flux": [([0, 1, 2], 1.0, "sde"), ([1, 2], 1.0, "cps")],
         "tiny-wan": [([0, 1, 2], 1.0, "sde"), ([1, 2], 4.5, "dance")]}
FRAMES = {"tiny-wan": 5}  # frames per sample (the image families: 1)
TOL = 1e-5  # served vs local trajectories (module docstring)
GAP_TOL = 2e-5  # the trainer's log-prob of the served transitions vs the server's


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """One family's pipeline on disk, its server (fusing up to 4 waiting requests, as the Qwen-Image tier's) and
    the trainer's side: the adapter loaded from the same directory, with LoRA on its default targets."""
    yield from serve(tmp_path_factory, request.param, ["--max-num-seqs", "4", "--request-batch-max-wait-ms", "50"],
                     num_frames=FRAMES.get(request.param, 1))


def serve(tmp_path_factory, name: str, extra_args: list[str], **load):  # (test_omni_2026.py's families too)
    """Tiny model `name` on disk, its server (`extra_args`) and the trainer's side: the adapter loaded from the same
    directory (`load`: models.load_model's keywords), with LoRA on its default targets. A generator: a module's
    fixture yields from it, and the server stops after that module."""
    directory = models.save_tiny_pipeline(str(tmp_path_factory.mktemp("omni") / name), seed=0, model=name)
    server = OmniServer(Path(directory), tmp_path_factory.mktemp("omni-log") / f"{name}.log", extra_args=extra_args,
                        pipeline_args={"trajectory_root": str(tmp_path_factory.getbasetemp())})
    try:
        model = models.load_model(name, directory, "cpu", **load)
        engine = eng.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=type(model).lora_targets, lr=1e-2,
                            weight_decay=0.0, max_grad_norm=1.0, seed=0)
        yield SimpleNamespace(name=name, dir=directory, server=server, model=model, engine=engine)
    finally:
        server.stop()


def trainer_logp_gap(model, batch, steps, cfg, sde_type) -> float:
    """max |trainer's log-prob − server's| over the served transitions: what train/logp_gap measures."""
    gaps = []
    with torch.no_grad():
        for j in range(len(steps)):
            x = batch.latents[:, j]
            v = model.velocity(x, batch.sigmas[j].expand(x.shape[0]), batch.cond, cfg, H, W)
            _, logp, _, _ = sch.step(v, x, batch.sigmas[j], batch.sigmas[j + 1], sigma_max=batch.sigma_max,
                                     noise_level=KW["noise_level"], sde_type=sde_type, x_next=batch.latents[:, j + 1])
            gaps.append((logp - batch.log_probs[:, j]).abs().max().item())
    return max(gaps)


def test_served_trajectories_equal_the_local_backend(family, tmp_path):
    backend = rollout_backends.OmniBackend(family.server.url, str(tmp_path), family.engine)
    for steps, cfg, sde_type in CASES[family.name]:
        served_equals_local(family, backend, PROMPTS, dict(KW, steps=steps, cfg_scale=cfg, sde_type=sde_type))
    backend.close()


def served_equals_local(family, backend, prompts, kw):  # (test_omni_2026.py's families too)
    """One case of 5 prompts (`kw`: the sampler's): the served trajectories, the LoRA applied, against the local
    backend's within TOL, the trainer's log-prob of them within GAP_TOL; -> the served batch."""
    model, group = family.model, torch.tensor([0, 1, 0, 1, 0])
    steps, cfg, sde_type = kw["steps"], kw["cfg_scale"], kw["sde_type"]
    set_lora_b(model, None)
    base = rollout.sample(model, prompts, [{}] * 5, group, range(5), **kw)  # the policy before training
    set_lora_b(model, 1)
    backend.sync(family.engine, len(steps))
    served = backend.sample(model, prompts, [{}] * 5, group, range(5), **kw)
    local = rollout.sample(model, prompts, [{}] * 5, group, range(5), **kw)
    diffs = {k: (getattr(served, k) - getattr(local, k)).abs().max().item() for k in ("latents", "log_probs", "images")}
    gap = trainer_logp_gap(model, served, steps, cfg, sde_type)
    lora_effect = (local.images - base.images).abs().max().item()
    print(f"\n{family.name} steps {steps}, cfg {cfg}, {sde_type}: served - local max|diff| {diffs}; trainer-vs-"
          f"server log-prob gap max {gap:.2e}; the LoRA moves the images by {lora_effect:.2e}")
    assert torch.equal(served.sigmas, local.sigmas) and served.sigma_max == local.sigma_max
    assert served.latents.shape == local.latents.shape and served.images.shape == local.images.shape
    assert max(diffs.values()) < TOL and gap < GAP_TOL, (diffs, gap)
    assert lora_effect > 100 * TOL  # the server applied the adapter on every target: it matters
    return served


def test_fused_requests_of_several_images_equal_the_local_backend(family, tmp_path):
    """Four requests of n = 3 in flight at once, prompts of different lengths: the server fuses them into one
    forward (B = 4 prompts, 12 rows). vLLM-Omni 0.30.0's SD3 encodes each prompt once there, not n times
    (measured without omni/pipeline.py's fix: HTTP 500, "The size of tensor a (12) must match ... (4)")."""
    model, engine = family.model, family.engine
    set_lora_b(model, 4)
    backend = rollout_backends.OmniBackend(family.server.url, str(tmp_path), engine, concurrency=4)
    backend.sync(engine, 0)
    prompts = [("a cat " * (1 + i % 4)).strip() for i in range(12)]
    cfg = CASES[family.name][-1][1]
    kw = dict(KW, steps=[0, 1, 2], cfg_scale=cfg, sde_type="sde", chunk=12)
    served = backend.sample(model, prompts, [{}] * 12, torch.zeros(12, dtype=torch.long), range(12), **kw)
    local = rollout.sample(model, prompts, [{}] * 12, torch.zeros(12, dtype=torch.long), range(12), **kw)
    diffs = {k: (getattr(served, k) - getattr(local, k)).abs().max().item() for k in ("latents", "log_probs")}
    assert max(diffs.values()) < TOL, diffs
    backend.close()


def test_served_sigmas_equal_the_trainers_to_the_bit(family, tmp_path):
    """FLUX's shift depends on the image's token count, SD3's does not: both over step counts and sizes."""
    served_sigmas_equal_the_trainers(family, tmp_path)


def served_sigmas_equal_the_trainers(family, tmp_path):  # (test_omni_2026.py's families too)
    """The σ a served trajectory records, over step counts and sizes, equal to the trainer's schedule to the bit."""
    model = family.model
    sampler = dict(cfg_scale=1.0, negative_prompt="", noise_level=0.7, sde_type="sde", seed=0, iteration=0, lora=None)
    for num_steps, height, width in [(2, 32, 32), (10, 64, 32), (28, 64, 64)]:
        [(_, body)] = rollout_backends.build_requests(model, ["a blue ball"], [0], steps=list(range(num_steps - 1)),
                                                      num_steps=num_steps, height=height, width=width,
                                                      prefix=str(tmp_path / f"s{num_steps}"), **sampler)
        del body["lora"]  # the base model
        status, resp = http("POST", family.server.url + "/v1/images/generations", body)
        assert status == 200, resp
        served = load_file(body["extra_params"]["flowgrpo"]["trajectory"])
        sigmas = sch.sigma_schedule(model.scheduler, num_steps, model.image_seq_len(height, width))
        diff = (served["sigmas"] - sigmas[:num_steps]).abs().max().item()
        assert torch.equal(served["sigmas"], sigmas[:num_steps]), (num_steps, height, width, diff)
        assert served["sigma_max"].item() == float(sigmas[1]), (served["sigma_max"].item(), float(sigmas[1]))


def test_a_short_run_of_the_recipe_serves_each_iteration_a_new_adapter(family, tmp_path):
    """The family's tiny recipe (SD3: CFG 4.5, negative prompt ""; FLUX: guidance 3.5; Wan: 9 frames, the motion
    reward) with --rollout vllm-omni for 2 iterations (flowgrpo.main in this process): the server samples each
    iteration with a new adapter version, the base one and then the trained one, and the trainer's log-prob of the
    served transitions is the server's within 1e-6 (train/logp_gap; measured at most 7e-8). That the recipes learn:
    tests/test_loop.py (tiny-sd3, tiny-flux) and tests/test_wan.py (tiny-wan), sampling locally, which is what the
    server samples (the tests above); that a run learns through the server: test_omni_rollout.py's CLI run."""
    short_run_serves_new_adapters(family, tmp_path)


def short_run_serves_new_adapters(family, tmp_path):  # (test_omni_2026.py's families too)
    """The family's recipe, 2 iterations through its server: a new adapter version each, logp_gap below 1e-6."""
    log_start = len(family.server.log_text())
    rows = train_here("--model", family.name, "--model-path", family.dir, "--rollout", "vllm-omni", "--rollout-url",
                      family.server.url, "--run-dir", str(tmp_path / "run"), "--iterations", "2", "--eval-every", "0")
    gaps = [r["train/logp_gap"] for r in rows]
    print(f"\n{family.name}: 2 iterations through vLLM-Omni: train/logp_gap {gaps}")
    assert [r["iteration"] for r in rows] == [0, 1] and max(gaps) < 1e-6, gaps
    loaded = re.findall(r"Loading new adapter: id=(\d+), name=flowgrpo-v(\d+)", family.server.log_text()[log_start:])
    assert [int(v) for _, v in loaded] == [0, 1], loaded
