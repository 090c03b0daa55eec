"""Rollout through the real vLLM-Omni 0.30.0 server running omni.pipeline.FlowGRPOQwenImagePipeline.

In-process: the served trajectories equal the local backend's (same seeds, same LoRA) and their σ equal the
trainer's to the bit, every policy version is a new adapter that changes the images, the PNG response is the
trajectory's image quantised, a bad request, a missing or a malformed trajectory file are errors naming the
server and the request, and a server writes only beneath its trajectory_root (none without one).
Training runs (`flowgrpo.py --rollout vllm-omni`): through the CLI, a run learns with a tiny rollout-vs-trainer
log-prob gap, and a run whose server dies mid-run stops with an error naming the server and the request; its last
checkpoint resumes on another server. In this process (flowgrpo.main, the same training without a new interpreter):
DiffusionNFT's and AWM's runs, and a run whose server answers an error stops with one naming the server and the
request.

One server (the session's `omni_server`) serves every test but the one that needs a server without trajectory_root.
"""
import base64
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import harness
from harness import ROOT, Forwarder, OmniServer, http, set_lora_b, train_here

import checkpoint
import ema
import engine as eng
import models
import models_qwen
import rollout
import rollout_backends
import scheduler as sch

H = W = 32
KW = dict(num_steps=4, height=H, width=W, negative_prompt=" ", noise_level=0.7, seed=0, iteration=3, chunk=8)
PROMPTS = ["a red cube on a table", "a blue ball", "a red cube on a table", "a blue ball", "a red cube on a table"]
TRAINER = ROOT / "flowgrpo.py"
needs_cli = pytest.mark.skipif("rollout_url" not in TRAINER.read_text(),
                               reason="flowgrpo.py has no --rollout-url yet (rollout_backends.make_backend is not "
                                      "wired in)")


@pytest.fixture(scope="module")
def trainer(tiny_pipeline_dir):
    """The trainer's side: the tiny model (the served weights) with the tiny recipe's LoRA."""
    model = models.load_model("tiny", str(tiny_pipeline_dir), "cpu")
    engine = eng.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=models_qwen.QwenImage.lora_targets, lr=1e-2,
                        weight_decay=0.0, max_grad_norm=1.0, seed=0)
    return model, engine


def both(backend, model, steps, cfg, sde_type, image_ids=range(5)):
    group = torch.tensor([0, 1, 0, 1, 0])
    kw = dict(KW, steps=steps, cfg_scale=cfg, sde_type=sde_type)
    served = backend.sample(model, PROMPTS, [{}] * 5, group, list(image_ids), **kw)
    local = rollout.sample(model, PROMPTS, [{}] * 5, group, list(image_ids), **kw)
    return served, local


@pytest.mark.parametrize("steps,cfg,sde_type", [([0, 1, 2], 1.0, "sde"), ([1, 2], 4.0, "cps")])
def test_served_trajectories_equal_the_local_backend(omni_server, trainer, tmp_path, steps, cfg, sde_type):
    model, engine = trainer
    set_lora_b(model, 1)
    backend = rollout_backends.OmniBackend(omni_server.url, str(tmp_path), engine)
    backend.sync(engine, 0)
    served, local = both(backend, model, steps, cfg, sde_type)
    assert torch.equal(served.sigmas, local.sigmas) and served.sigma_max == local.sigma_max
    diffs = {k: (getattr(served, k) - getattr(local, k)).abs().max().item() for k in ("latents", "log_probs", "images")}
    # the trainer's log-prob of the served transitions: what train/logp_gap measures in the first update
    gaps = []
    with torch.no_grad():
        for j in range(len(steps)):
            x = served.latents[:, j]
            v = model.velocity(x, served.sigmas[j].expand(5), served.cond, cfg, H, W)
            _, logp, _, _ = sch.step(v, x, served.sigmas[j], served.sigmas[j + 1], sigma_max=served.sigma_max,
                                     noise_level=0.7, sde_type=sde_type, x_next=served.latents[:, j + 1])
            gaps.append((logp - served.log_probs[:, j]).abs().max().item())
    print(f"\nsteps {steps}, cfg {cfg}, {sde_type}: served - local max|diff| {diffs}; trainer-vs-server log-prob "
          f"gap max {max(gaps):.2e}")
    for name in ("latents", "log_probs", "images"):
        assert getattr(served, name).shape == getattr(local, name).shape
        assert getattr(served, name).dtype == torch.float32
    assert max(diffs.values()) < 1e-5 and max(gaps) < 1e-5  # float32, CPU: vLLM-Omni's transformer vs diffusers'
    assert os.listdir(backend.traj_dir) == []


def test_an_ode_rollout_returns_the_local_final_latents_sampled_with_the_old_policy(omni_server, trainer, tmp_path):
    """The forward-process rollout (no SDE step): the server returns images and final latents `x0` only, equal to the
    local backend's; DiffusionNFT samples with its old policy (engine.old_weights), which is what the server serves."""
    model, engine = trainer
    set_lora_b(model, 5)
    named = [(n, p) for n, p in model.transformer.named_parameters() if p.requires_grad]
    engine.old = eng.OldPolicy(named)  # the trained weights, then a different policy as the old one
    try:
        with torch.no_grad():
            for s, (n, _) in zip(engine.old.shadow, named):
                if "lora_B" in n:
                    ema.local_shard(s).normal_(0.0, 0.05, generator=torch.Generator().manual_seed(6))
        backend = rollout_backends.OmniBackend(omni_server.url, str(tmp_path), engine)
        with engine.old_weights():
            backend.sync(engine, 0)
            served, local = both(backend, model, [], 1.0, "sde")
        trained = rollout.sample(model, PROMPTS, [{}] * 5, [0, 1, 0, 1, 0], list(range(5)),
                                 **dict(KW, steps=[], cfg_scale=1.0, sde_type="sde"))
    finally:
        engine.old = None
    diffs = {k: (getattr(served, k) - getattr(local, k)).abs().max().item() for k in ("x0", "images")}
    print(f"\nODE rollout, old policy: served − local max|diff| {diffs}")
    assert served.log_probs.shape == (5, 0) and served.latents.shape[1] == 0 and served.x0.shape == local.x0.shape
    assert max(diffs.values()) < 1e-5
    assert (served.x0 - trained.x0).abs().max() > 1e-3  # the old policy sampled, not the trained one


def test_each_version_is_a_new_adapter_that_changes_the_images(omni_server, trainer, tmp_path):
    model, engine = trainer
    backend = rollout_backends.OmniBackend(omni_server.url, str(tmp_path), engine)
    images, ids = [], []
    for version, b_seed in enumerate((None, 2, 3)):  # the base model, then two different policies
        set_lora_b(model, b_seed)
        backend.sync(engine, version)
        ids.append(backend.lora["int_id"])
        served, local = both(backend, model, [0, 1, 2], 1.0, "sde")
        assert (served.images - local.images).abs().max() < 1e-5  # the served policy is the trainer's policy
        images.append(served.images)
    assert len(set(ids)) == 3 and os.listdir(backend.policy_dir) == ["v2"]
    assert all((a - b).abs().max() > 1e-3 for a, b in ((images[0], images[1]), (images[1], images[2])))
    loaded = re.findall(r"Loading new adapter: id=(\d+), name=(flowgrpo-v\d)", omni_server.log_text())
    assert [(str(i), f"flowgrpo-v{v}") for v, i in enumerate(ids)] == loaded[-3:]


def test_fused_requests_and_concurrent_samplers_share_a_server(omni_server, trainer, tmp_path):
    """Two clients at once, one adapter id, different noise levels, prompts of different lengths, n = 3:
    vLLM-Omni fuses waiting requests into one forward (--max-num-seqs 4), padding the prompts to one length.
    Each request must keep its own sampler and its own prompt mask (vLLM-Omni 0.30.0 interleaves the masks
    of a fused batch with n > 1: omni.pipeline.encode_prompt; without that fix latents differ by ~1e-2)."""
    model, engine = trainer
    set_lora_b(model, 4)
    prompts = [("a cat " * (1 + i % 6)).strip() for i in range(18)]  # 6 requests of 3 images per client
    results = {}

    def run(noise_level):
        backend = rollout_backends.OmniBackend(omni_server.url, str(tmp_path / str(noise_level)), engine, concurrency=4)
        backend.id_base = 1 << 40  # both clients name the same adapter, so their requests may share a batch
        backend.sync(engine, 0)
        results[noise_level] = backend.sample(model, prompts, [{}] * 18, torch.zeros(18, dtype=torch.long),
                                              range(18), **dict(KW, steps=[0, 1, 2], cfg_scale=1.0,
                                                                sde_type="sde", noise_level=noise_level))
    threads = [threading.Thread(target=run, args=(nl,)) for nl in (0.7, 0.5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for nl, served in results.items():
        local = rollout.sample(model, prompts, [{}] * 18, torch.zeros(18, dtype=torch.long), range(18),
                               **dict(KW, steps=[0, 1, 2], cfg_scale=1.0, sde_type="sde", noise_level=nl))
        assert (served.latents - local.latents).abs().max() < 1e-5, nl
        assert (served.log_probs - local.log_probs).abs().max() < 1e-5, nl
    assert len(results) == 2


def test_png_response_is_the_trajectory_image_quantised(omni_server, trainer, tmp_path):
    sampler = {k: v for k, v in KW.items() if k != "chunk"}
    [(_, body)] = rollout_backends.build_requests(trainer[0], ["a red cube on a table"] * 2, [0, 1], steps=[0, 1, 2],
                                                  cfg_scale=1.0, sde_type="sde", lora=None,
                                                  prefix=str(tmp_path / "t"), **sampler)
    del body["lora"]  # the base model
    # the trainer asks for the smallest answer (it reads the trajectory file); a user of the server sees PNGs
    assert (body["output_format"], body["output_compression"]) == ("jpeg", 1)
    status, resp = http("POST", omni_server.url + "/v1/images/generations", body | {"output_format": "png"})
    assert status == 200, resp
    images = load_file(body["extra_params"]["flowgrpo"]["trajectory"])["images"]  # (2, 3, H, W) float32
    for item, image in zip(resp["data"], images, strict=True):
        png = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))).astype(np.float32) / 255
        err = np.abs(png - image.permute(1, 2, 0).numpy()).max()
        assert err <= 0.5 / 255 + 1e-6, err  # the reward sees `images`; the PNG is them rounded to 8 bits


FAILED_WRITE = """
import os, resource, signal, sys, torch
from omni.pipeline import write_trajectory
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails (EFBIG), as on a full /dev/shm (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))
try:
    write_trajectory(sys.argv[1], "t", "it000001-r0-x-0000.safetensors", {"latents": torch.zeros(2**19)}, {})
except OSError as e:
    print("refused:", e)
"""


# A server of 2 data-parallel replicas of 2 sequence-parallel ranks each (global ranks 0-3): each rank runs one pass
# (a stand-in for the parent pipeline) and writes its trajectory file if it is the one to. The ranks in turn, in one
# process (vLLM-Omni's import is most of its time).
REPLICA_WRITES = """
import json, os, sys, torch
from types import SimpleNamespace
import omni.pipeline as P
root, rank = os.path.realpath(sys.argv[1]), 0
P.dist = SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 4, get_rank=lambda: rank)
P.get_sequence_parallel_rank = lambda: rank % 2  # replica r's primary: global rank 2r (vLLM-Omni's executor)
P.get_classifier_free_guidance_rank = P.get_tensor_model_parallel_rank = P.get_pipeline_parallel_rank = lambda: 0

class Pass(P.FlowGRPOSampler):
    def generate(self, req, **kwargs):
        self._run.update(latents=torch.zeros(1, 2, 4), log_probs=torch.zeros(1, 1), sigmas=torch.ones(2), sigma_max=1.0,
                         x0=torch.zeros(1, 4))
        return [SimpleNamespace(output=torch.zeros(1, 3, 2, 2))]

pipe = object.__new__(Pass)
pipe.trajectory_root = root
for rank in range(4):
    knobs = dict(trajectory=os.path.join(root, f"r{rank}.safetensors"), seeds=[1], steps=[0], noise_level=0.7,
                 sde_type="sde", max_sequence_length=8)
    sp = SimpleNamespace(num_outputs_per_prompt=1, num_inference_steps=2, extra_args={P.KEY: knobs})
    pipe.forward(SimpleNamespace(sampling_params_list=[sp], requests=[None], prompts=["a"]))
"""


def test_a_failed_trajectory_write_leaves_no_partial_file(tmp_path):
    """A trajectory the server cannot write whole (a full tmpfs) raises and leaves nothing: before, its partial
    temporary file stayed, and on a full tmpfs kept the next writes failing. And on a server of several data-parallel
    replicas (vLLM-Omni infers them from the world size) each replica's primary rank writes its requests' files: before,
    global rank 0 alone did, and every request that another replica sampled failed for want of its file."""
    (tmp_path / "t").mkdir()
    out = subprocess.run([str(harness.OMNI_VENV / "bin" / "python"), "-c", FAILED_WRITE, str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert "refused:" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    assert os.listdir(tmp_path / "t") == []
    (tmp_path / "dp").mkdir()
    out = subprocess.run([str(harness.OMNI_VENV / "bin" / "python"), "-c", REPLICA_WRITES, str(tmp_path / "dp")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "dp")) == ["r0.safetensors", "r2.safetensors"]  # the replicas' primaries


def test_a_bad_request_is_an_error_and_the_server_stays_up(omni_server, tmp_path):
    knobs = dict(trajectory=str(tmp_path / "t.safetensors"), seeds=[1], steps=[0], noise_level=0.7, sde_type="ode",
                 max_sequence_length=1024)
    status, resp = http("POST", omni_server.url + "/v1/images/generations",
                        dict(prompt="x", size=f"{W}x{H}", num_inference_steps=4, extra_params={"flowgrpo": knobs}))
    assert status == 500 and "sde_type must be one of" in resp["error"]["message"], resp
    assert not (tmp_path / "t.safetensors").exists()
    assert http("GET", omni_server.url + "/health")[0] == 200


def test_a_knob_the_pipeline_does_not_read_is_refused(omni_server, tmp_path):
    """An edit model's source sent to a text-to-image class (the wrong pipeline_class over the edit model's weights)
    was dropped: the server sampled without it, and the trainer, its σ and shapes alike, took the rollout as the edit
    model's (measured: tiny-flux-kontext served by FlowGRPOFluxPipeline, latents 2.5e-2 off the local backend's,
    accepted). A knob the class does not read is refused, named."""
    knobs = dict(trajectory=str(tmp_path / "t.safetensors"), seeds=[1], steps=[0], noise_level=0.7, sde_type="sde",
                 max_sequence_length=1024, source="iVBORw0KGgo=", source_areas=[1024, 1024])
    status, resp = http("POST", omni_server.url + "/v1/images/generations",
                        dict(prompt="x", size=f"{W}x{H}", num_inference_steps=4, extra_params={"flowgrpo": knobs}))
    assert status == 500 and ("['source', 'source_areas'], which omni.pipeline.FlowGRPOQwenImagePipeline does not "
                              "read: serve the class of the trainer's --model") in resp["error"]["message"], resp
    assert not (tmp_path / "t.safetensors").exists()


def test_served_sigmas_equal_the_trainers_to_the_bit(omni_server, trainer, tmp_path):
    """The client requires the file's σ and σ_max to equal the trainer's exactly. The server's come from
    vLLM-Omni's prepare_timesteps on its own diffusers' scheduler, the trainer's from scheduler.sigma_schedule:
    they agree to the bit over step counts and image sizes (the size sets image_seq_len, hence the shift)."""
    model, _ = trainer
    sampler = dict(cfg_scale=1.0, negative_prompt=" ", noise_level=0.7, sde_type="sde", seed=0, iteration=0, lora=None)
    for num_steps, height, width in [(2, 32, 32), (10, 64, 32), (50, 64, 64)]:
        [(_, body)] = rollout_backends.build_requests(model, ["a blue ball"], [0], steps=list(range(num_steps - 1)),
                                                      num_steps=num_steps, height=height, width=width,
                                                      prefix=str(tmp_path / f"s{num_steps}"), **sampler)
        del body["lora"]  # the base model
        status, resp = http("POST", omni_server.url + "/v1/images/generations", body)
        assert status == 200, resp
        served = load_file(body["extra_params"]["flowgrpo"]["trajectory"])
        sigmas = sch.sigma_schedule(model.scheduler, num_steps, model.image_seq_len(height, width))
        assert served["sigmas"].shape == (num_steps,) and served["sigmas"].dtype == torch.float32
        diff = (served["sigmas"] - sigmas[:num_steps]).abs().max().item()
        assert torch.equal(served["sigmas"], sigmas[:num_steps]), (num_steps, height, width, diff)
        assert served["sigma_max"].item() == float(sigmas[1]), (served["sigma_max"].item(), float(sigmas[1]))


def test_the_server_writes_only_beneath_its_trajectory_root(omni_server, trainer, tmp_path, monkeypatch):
    """The session server's trajectory_root is pytest's base temporary directory. A path outside it (plainly,
    through `..`, through a symlinked directory) or in a directory that does not exist is refused before any
    sampling, and nothing is written; a symlink at the file name itself is replaced, never followed (its target,
    model weights say, is untouched). A trainer whose FLOWGRPO_ROLLOUT_DIR lies outside gets an error naming the
    server, the root and the setting."""
    model, engine = trainer
    outside = Path(tempfile.mkdtemp(prefix="flowgrpo-outside-"))  # /tmp/…: not beneath pytest's base directory
    try:
        weights = outside / "model.safetensors"
        weights.write_bytes(b"weights")
        (tmp_path / "link").symlink_to(outside, target_is_directory=True)
        (tmp_path / "weights.safetensors").symlink_to(weights)
        refused = {str(weights): "not beneath this server's trajectory_root",
                   os.path.join(tmp_path, os.path.relpath(weights, tmp_path)): "not beneath",  # tmp_path/../../…
                   str(tmp_path / "link" / "model.safetensors"): "not beneath",
                   str(tmp_path / "missing" / "t.safetensors"): "no such directory on this server"}
        for path, needle in {**refused, str(tmp_path / "weights.safetensors"): None}.items():
            knobs = dict(trajectory=path, seeds=[1], steps=[0], noise_level=0.7, sde_type="sde",
                         max_sequence_length=1024)
            body = dict(prompt="x", size=f"{W}x{H}", num_inference_steps=4, extra_params={"flowgrpo": knobs})
            status, resp = http("POST", omni_server.url + "/v1/images/generations", body)
            assert (status, needle) == (200, None) or status == 500 and needle in resp["error"]["message"], (path, resp)
        assert weights.read_bytes() == b"weights" and os.listdir(outside) == ["model.safetensors"]
        assert not (tmp_path / "weights.safetensors").is_symlink()  # the link was replaced by the trajectory
        assert load_file(tmp_path / "weights.safetensors")["images"].shape == (1, 3, H, W)
        assert not (tmp_path / "missing").exists()
        monkeypatch.setenv("FLOWGRPO_ROLLOUT_DIR", str(outside))
        backend = rollout_backends.make_backend("vllm-omni", omni_server.url, str(tmp_path / "run"), engine)
        backend.sync(engine, 0)
        with pytest.raises(RuntimeError) as err:
            backend.sample(model, PROMPTS[:1], [{}], [0], [0],
                           **dict(KW, steps=[0, 1, 2], cfg_scale=1.0, sde_type="sde"))
        print("\n" + str(err.value))
        assert f"vLLM-Omni server {omni_server.url} answered HTTP 500" in str(err.value)
        assert re.search(r"not beneath this server's trajectory_root \S+ .*FLOWGRPO_ROLLOUT_DIR", str(err.value))
        assert os.listdir(backend.traj_dir) == []
        backend.close()
    finally:
        shutil.rmtree(outside)


def test_a_server_without_trajectory_root_writes_nothing(tiny_pipeline_dir, trainer, tmp_path):
    """Started without trajectory_root (as the README once showed): it still serves plain requests (its warm-up
    ran), but refuses every FlowGRPO request with an error naming the missing setting; the trainer shows it with
    the server and the request."""
    model, engine = trainer
    server = OmniServer(tiny_pipeline_dir, tmp_path / "no-root.log")
    try:
        backend = rollout_backends.OmniBackend(server.url, str(tmp_path), engine)
        backend.sync(engine, 0)
        with pytest.raises(RuntimeError) as err:
            backend.sample(model, PROMPTS[:2], [{}] * 2, [0, 0], [0, 1],
                           **dict(KW, steps=[0, 1, 2], cfg_scale=1.0, sde_type="sde"))
        print("\n" + str(err.value))
        assert f"vLLM-Omni server {server.url} answered HTTP 500 to the request for prompt" in str(err.value)
        assert "this server has no trajectory_root" in str(err.value) and '"trajectory_root": ' in str(err.value)
        assert os.listdir(backend.traj_dir) == [] and server.request("GET", "/health")[0] == 200
    finally:
        server.stop()


@pytest.mark.parametrize("damage,needle", [("delete", "no trajectory file"), ("truncate", "malformed trajectory")])
def test_a_missing_or_malformed_file_is_an_error_naming_the_server(omni_server, trainer, tmp_path, monkeypatch,
                                                                  damage, needle):
    """The real server writes the file; it is then lost or damaged before the client reads it (what a
    filesystem the server does not share, or a dying disk, looks like from the client)."""
    model, engine = trainer
    read = rollout_backends.read_trajectory

    def damaged(path, **kw):
        if damage == "delete":
            os.remove(path)
        else:
            os.truncate(path, os.path.getsize(path) // 3)
        return read(path, **kw)
    monkeypatch.setattr(rollout_backends, "read_trajectory", damaged)
    backend = rollout_backends.OmniBackend(omni_server.url, str(tmp_path), engine)
    backend.sync(engine, 0)
    with pytest.raises(RuntimeError, match=needle) as err:
        both(backend, model, [0, 1, 2], 1.0, "sde")
    # both prompts' requests are in flight and damaged: the error names whichever failed first
    assert omni_server.url in str(err.value) and any(f"prompt {p!r}" in str(err.value) for p in set(PROMPTS))
    # The other one may still be in flight (the first error ends the rollout at once; measured on a loaded machine):
    # its thread removes its file as it ends.
    for thread in threading.enumerate():
        if thread.name.startswith("rollout-"):
            thread.join(timeout=300)
    assert os.listdir(backend.traj_dir) == []


# ---- through the CLI ----------------------------------------------------------------------------
def trainer_cli(*flags, env=None, timeout=600, wait=True):
    argv = [sys.executable, str(TRAINER), "--model", "tiny", "--no-wandb", *flags]
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
              env=os.environ | {"WANDB_MODE": "offline"} | (env or {}))
    return subprocess.run(argv, timeout=timeout, **kw) if wait else subprocess.Popen(argv, **kw)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@needs_cli
def test_cli_training_run_learns_with_a_tiny_logp_gap(omni_server, tiny_pipeline_dir, tmp_path):
    """The tiny recipe with --lr 3e-2 and --clip-range 0.2 (its own 1e-2 and 1e-3 need 12 iterations: measured
    3.88 within-batch stds there, 1.16 at 6 with --lr 3e-2 alone), 6 iterations: reward 0.49474 -> 0.51112, its
    last 3 iterations' mean 3.78 iteration-0 stds (0.00307) above its first 3's; train/logp_gap at most 3.4e-8."""
    run, iterations = tmp_path / "run", 6
    log_start = len(omni_server.log_text())
    t0 = time.monotonic()
    out = trainer_cli("--model-path", str(tiny_pipeline_dir), "--rollout", "vllm-omni", "--rollout-url",
                      omni_server.url, "--run-dir", str(run), "--iterations", str(iterations), "--eval-every", "0",
                      "--lr", "3e-2", "--clip-range", "0.2")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(run)
    gaps = [r["train/logp_gap"] for r in rows]
    first, last = (sum(r["reward/mean"] for r in rows[s]) / 3 for s in (slice(0, 3), slice(-3, None)))
    print(f"\n{iterations} iterations through vLLM-Omni in {time.monotonic() - t0:.0f} s: reward "
          f"{[round(r['reward/mean'], 4) for r in rows]}; train/logp_gap max {max(gaps):.2e}, mean "
          f"{sum(gaps) / len(gaps):.2e}; rollout {sum(r['perf/rollout_s'] for r in rows):.1f} s")
    assert len(rows) == iterations and max(gaps) < 1e-5
    assert last - first > 3 * rows[0]["reward/std"], (first, last)  # the margin tests/test_loop.py uses
    loaded = re.findall(r"Loading new adapter: id=(\d+), name=flowgrpo-v(\d+)", omni_server.log_text()[log_start:])
    assert [int(v) for _, v in loaded] == list(range(iterations)) and len({i for i, _ in loaded}) == iterations
    assert not [p for p in os.listdir(run) if p.startswith("rollout-")]  # the run's exchange directory: removed


@needs_cli
@pytest.mark.parametrize("algorithm,flags,watch", [("nft", ("--kl-beta", "0.01"), "train/kl"),
                                                   ("awm", ("--kl-beta", "0.01"), "train/kl"),
                                                   ("dgpo", ("--kl-beta", "0.01"), "train/kl"),
                                                   ("dpo", ("--train-timesteps", "2"), "train/implicit_acc")])
def test_a_forward_process_run_on_the_server(omni_server, tiny_pipeline_dir, tmp_path, algorithm, flags, watch):
    """`--algorithm nft|awm|dgpo|dpo --rollout vllm-omni` (flowgrpo.main in this process; the CLI's own path through a
    server: the learning run above, the server-death run below): the server samples (a new adapter version each
    iteration; dpo: its full-mode SDE), the trainer trains on the returned final latents, and the run checkpoints with
    its old policy."""
    run, iterations = tmp_path / "run", 2
    log_start = len(omni_server.log_text())
    rows = train_here("--model", "tiny", "--model-path", str(tiny_pipeline_dir), "--rollout", "vllm-omni",
                      "--rollout-url", omni_server.url, "--run-dir", str(run), "--iterations", str(iterations),
                      "--eval-every", "0", "--algorithm", algorithm, *flags)
    assert len(rows) == iterations and all(r["train/grad_norm"] > 0 and r[watch] >= 0 for r in rows), rows
    loaded = re.findall(r"Loading new adapter: id=(\d+), name=flowgrpo-v(\d+)", omni_server.log_text()[log_start:])
    assert [int(v) for _, v in loaded] == list(range(iterations))
    assert (run / "checkpoints" / f"{checkpoint.PREFIX}{iterations - 1:06d}" / "meta.json").exists()


@needs_cli
def test_a_server_error_stops_the_run_naming_the_server_and_the_request(omni_server, tiny_pipeline_dir, tmp_path):
    """A LoRA on `to_out.0` (diffusers accepts it, vLLM-Omni's packed attention does not): HTTP 500, and the run
    (flowgrpo.main in this process; what the CLI prints of such an error: the server-death run below) stops."""
    with pytest.raises(RuntimeError) as err:
        train_here("--model", "tiny", "--model-path", str(tiny_pipeline_dir), "--rollout", "vllm-omni",
                   "--rollout-url", omni_server.url, "--run-dir", str(tmp_path / "run"), "--iterations", "2",
                   "--lora-targets", "to_q", "to_out.0")
    msg = str(err.value)
    print("\n" + msg.strip().splitlines()[-1])
    assert f"vLLM-Omni server {omni_server.url} answered HTTP 500" in msg and "to_out" in msg, msg
    assert re.search(r"the request for prompt '.+', seeds \[\d+", msg), msg
    assert http("GET", omni_server.url + "/health")[0] == 200


@needs_cli
def test_cli_server_death_stops_the_run_and_the_checkpoint_resumes_elsewhere(omni_server, tiny_pipeline_dir,
                                                                             tmp_path):
    """The CLI's run on a server that dies after the run's first checkpoint stops with an error naming the server and
    the request; the newest checkpoint resumes (flowgrpo.main in this process) on another server. The dying server is
    the session's behind a forwarder (harness.Forwarder), killed by SIGKILL; its abandoned requests cannot share a
    batch with the resumed run's, which name another adapter."""
    doomed = Forwarder(omni_server, tmp_path / "doomed.log")
    try:
        run = tmp_path / "run"
        proc = trainer_cli("--model-path", str(tiny_pipeline_dir), "--rollout", "vllm-omni", "--rollout-url",
                           doomed.url, "--run-dir", str(run), "--iterations", "30", "--checkpoint-every", "1",
                           "--eval-every", "0", wait=False, env={"FLOWGRPO_ROLLOUT_RETRIES": "2",
                                                                "FLOWGRPO_ROLLOUT_BACKOFF": "0.5"})
        try:
            deadline = time.monotonic() + 300
            while not (run / "checkpoints" / f"{checkpoint.PREFIX}{0:06d}" / "meta.json").exists():
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                time.sleep(0.2)
            os.killpg(doomed.pgid, signal.SIGKILL)  # the server dies mid-run
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        doomed.stop()
    err = stderr[-3000:]
    assert proc.returncode != 0, err
    print("\n" + err.strip().splitlines()[-1])
    assert f"vLLM-Omni server {doomed.url} stayed down for the request for prompt" in err, err
    # the newest checkpoint is complete and continues the run on the other server
    newest = checkpoint.list_checkpoints(str(run / "checkpoints"))[-1]
    done = checkpoint.read_checkpoint_meta(newest)["loop"]["iteration"]
    train_here("--model", "tiny", "--model-path", str(tiny_pipeline_dir), "--rollout", "vllm-omni", "--rollout-url",
               omni_server.url, "--run-dir", str(run), "--iterations", str(done + 2), "--checkpoint-every", "1",
               "--eval-every", "0", "--resume", "auto")
    assert [r["iteration"] for r in metrics(run)] == list(range(done + 2))
