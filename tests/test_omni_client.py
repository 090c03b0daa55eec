"""The vLLM-Omni rollout client (rollout_backends.OmniBackend) without vLLM-Omni: request building, trajectory
reading, policy export, and the whole client against a loopback stand-in server (threads, retries, errors).

The stand-in answers like vLLM-Omni's /v1/images/generations and writes trajectory files in the format of
omni/pipeline.py, filled with tensors derived from each image's seed so that the test can check which row
landed where, or leaves something broken or hostile at the trajectory path (`mode`). That the real server's
files match the local backend is tests/omni/'s job.
"""
import base64
import importlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from peft import LoraConfig
from PIL import Image
from safetensors.torch import load_file, save_file

import models
import models_qwen
import reward_http
import rollout
import rollout_backends
import scheduler as sch
from tiny_setup import main_here

H = W = 32
STEPS, NUM_STEPS = [0, 1, 2], 4
KW = dict(steps=STEPS, num_steps=NUM_STEPS, height=H, width=W, cfg_scale=1.0, negative_prompt=" ", noise_level=0.7,
          sde_type="sde", seed=5, iteration=3, chunk=4)
SAMPLER = {k: v for k, v in KW.items() if k != "chunk"}  # build_requests' arguments
HANG_S = 60  # a rollout that has not returned after this long is blocked (it takes well under a second)


@pytest.fixture(scope="module")
def model():
    return models.load_model("tiny", None, "cpu", seed=0)


def fake_engine(state=None, targets=("to_q", "to_k")):
    return SimpleNamespace(rank=0, is_main=True, barrier=lambda: None, broadcast_object=lambda x: x,
                           lora_config=LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)),
                           lora_state_dict=lambda: state or {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 8)})


# ---- the stand-in server ------------------------------------------------------------------------
def seed_rows(seeds, shape):
    return torch.stack([torch.randn(*shape, generator=torch.Generator().manual_seed(s)) for s in seeds])


def trainer_sigmas(num_steps, seq_len):
    return sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**models_qwen.QWEN_SCHEDULER), num_steps, seq_len)


def write_fake_trajectory(body, seq_len, channels, mode):
    """What omni/pipeline.py writes for this request, with seed-derived contents (or broken, by `mode`)."""
    k, n = body["extra_params"]["flowgrpo"], body["n"]
    if mode in ("fifo", "directory"):  # what a broken or hostile server may leave at the path instead of a file
        return os.mkfifo(k["trajectory"]) if mode == "fifo" else os.mkdir(k["trajectory"])
    w, h = map(int, body["size"].split("x"))
    steps = k["steps"]
    schedule = trainer_sigmas(body["num_inference_steps"], seq_len)
    sigmas = schedule[steps[0]:steps[-1] + 2].clone() if steps else schedule[:0]  # none stored by an ODE-only rollout
    if mode == "other_sigmas":  # one σ off by one float32 ulp
        sigmas[1] = torch.nextafter(sigmas[1], torch.tensor(2.0))
    tensors = {"latents": seed_rows(k["seeds"], (len(sigmas), seq_len, channels)),
               "log_probs": torch.tensor([[float(s % 1000)] * len(steps) for s in k["seeds"]]), "sigmas": sigmas,
               "sigma_max": torch.tensor(123.0 if mode == "sigma_max" else float(schedule[1])),
               "images": seed_rows(k["seeds"], (3, h, w)).sigmoid(), "x0": -seed_rows(k["seeds"], (seq_len, channels))}
    if mode == "wrong_shape":
        tensors["latents"] = tensors["latents"][:, :-1].contiguous()
    if mode in ("huge_x0", "huge_latents"):  # finite, and no latent: near float32's largest
        tensors[mode.removeprefix("huge_")].view(-1)[0] = 3e38
    seeds = json.dumps(k["seeds"][::-1] if mode == "wrong_seeds" and n > 1 else k["seeds"])
    # nested_seeds: 1,500 levels deep, beyond Python's JSON parser (RecursionError), within the file's size bound
    meta = {"format": rollout_backends.FORMAT, "prompt": body["prompt"],
            "seeds": "[" * 1500 + "]" * 1500 if mode == "nested_seeds" else seeds}
    save_file(tensors, k["trajectory"], metadata=meta)
    if mode == "truncated":
        with open(k["trajectory"], "r+b") as f:
            f.truncate(os.path.getsize(k["trajectory"]) // 2)


class StandIn:
    """A loopback HTTP server speaking the two routes the client uses; `mode` picks a behaviour."""

    def __init__(self, seq_len, channels):
        self.mode, self.bodies, self.fail_next = "ok", [], 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, obj, raw=None):
                raw = raw or json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):  # vLLM-Omni's answers (its api_server.py: health, show_available_models)
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": "tiny", "root": "/models/tiny"}]})
                self._send(200, {"status": "healthy"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.bodies.append(body)
                if outer.fail_next:
                    outer.fail_next -= 1
                    return self._send(503, {"error": {"message": "busy"}})
                if outer.mode == "error":
                    return self._send(500, {"error": {"message": "Image generation failed: boom"}})
                if outer.mode != "no_file":
                    write_fake_trajectory(body, seq_len, channels, outer.mode)
                if outer.mode == "nested_reply":  # the answer nested 100,000 deep (the trajectory is fine)
                    return self._send(200, None, b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
                if outer.mode == "data_string":  # n characters where n images belong
                    return self._send(200, {"data": "x" * body["n"]})
                png = io.BytesIO()
                Image.new("RGB", (W, H)).save(png, "PNG")
                self._send(200, {"data": [{"b64_json": base64.b64encode(png.getvalue()).decode()}] * body["n"]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def standin(model):
    server = StandIn(model.image_seq_len(H, W), model.transformer.config.in_channels)
    yield server
    server.stop()


def make(urls, tmp_path, **kw):
    return rollout_backends.OmniBackend(urls, str(tmp_path / "run"), fake_engine(), timeout=10.0, retries=2,
                                        backoff=0.01, **kw)


def closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---- validation and request building -----------------------------------------------------------
@pytest.mark.parametrize("kind,urls,needle", [
    ("vllm", None, "--rollout must be"), ("local", "http://h:1", "--rollout-url is only"),
    ("vllm-omni", None, "needs --rollout-url"), ("vllm-omni", " , ", "needs --rollout-url"),
    ("vllm-omni", "127.0.0.1:8000", "not of the form"), ("vllm-omni", "http://h:port", "not of the form"),
    ("vllm-omni", "http://h:1/v1", "not of the form"), ("vllm-omni", "http://h:1,http://h:1/", "listed twice"),
    ("vllm-omni", "http://h", "not of the form"), ("vllm-omni", "http://h:0", "not of the form")])  # no port: passed
def test_check_backend_names_the_flag(kind, urls, needle):
    with pytest.raises(ValueError, match=needle):
        rollout_backends.check_backend(kind, urls)


def test_check_backend_parses_without_network():
    # 192.0.2.x (TEST-NET-1) is unroutable: any connection attempt would hang or fail, a parse does not.
    assert rollout_backends.check_backend("vllm-omni", "http://192.0.2.1:8000/, https://b:1") == [
        "http://192.0.2.1:8000", "https://b:1"]
    assert rollout_backends.check_backend("local", None) == []
    assert isinstance(rollout_backends.make_backend("local", None, "/nonexistent", None), rollout_backends.LocalBackend)
    assert rollout_backends.LocalBackend(None).engine is None  # (its sample: tests/test_engine.py, gathered once)


def test_environment_knobs_are_checked(monkeypatch):
    monkeypatch.setenv("FLOWGRPO_ROLLOUT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="FLOWGRPO_ROLLOUT_"):
        rollout_backends.make_backend("vllm-omni", "http://192.0.2.1:8000", "/tmp", fake_engine())


def test_requests_group_by_prompt_and_keep_per_image_seeds(model):
    prompts = ["a", "b"] * 7 + ["a"] * 6  # 13 of "a" (interleaved, as image_assignment shuffles), 7 of "b"
    ids = list(range(100, 120))
    lora = {"name": "v3", "local_path": "/x/v3", "int_id": 7}
    jobs = rollout_backends.build_requests(model, prompts, ids, **SAMPLER, lora=lora, prefix="/ex/trajectories/it-r0-x")
    assert [(b["prompt"], b["n"]) for _, b in jobs] == [("a", 10), ("a", 3), ("b", 7)]  # n <= vLLM-Omni's 10
    assert sorted(i for pos, _ in jobs for i in pos) == list(range(20))
    for pos, body in jobs:
        knobs = body["extra_params"]["flowgrpo"]
        assert all(prompts[i] == body["prompt"] for i in pos)
        assert knobs["seeds"] == [rollout.image_seed(5, 3, ids[i]) for i in pos] and body["seed"] == knobs["seeds"][0]
        assert knobs["steps"] == STEPS and knobs["noise_level"] == 0.7 and knobs["sde_type"] == "sde"
        assert knobs["max_sequence_length"] == 512  # the Qwen adapter's text length (its pipeline call's)
        assert body["size"] == f"{W}x{H}" and body["num_inference_steps"] == NUM_STEPS and body["lora"] == lora
        assert body["true_cfg_scale"] == 1.0 and "negative_prompt" not in body  # no CFG: one pass, as locally
    assert len({b["extra_params"]["flowgrpo"]["trajectory"] for _, b in jobs}) == 3
    # the seed of image i is the seed of the local backend's generator for image i: the same draws
    g_local = rollout.image_generators(5, 3, [117])[0]
    g_server = torch.Generator().manual_seed(rollout.image_seed(5, 3, 117))
    assert torch.equal(torch.randn(8, generator=g_local), torch.randn(8, generator=g_server))
    cfg = rollout_backends.build_requests(model, ["a"], [0], **{**SAMPLER, "cfg_scale": 4.0}, lora=lora, prefix="/p")
    assert cfg[0][1]["negative_prompt"] == " " and cfg[0][1]["true_cfg_scale"] == 4.0


def test_each_family_asks_for_its_own_guidance():
    """CFG and guidance travel in each vLLM-Omni pipeline's own request fields (the adapters' `omni_request`):
    Qwen-Image's true_cfg_scale, SD3's guidance_scale, FLUX's guidance embedding; a negative prompt only with
    CFG (the servers would run CFG with one), and never for FLUX; Wan's and FLUX.2 [klein]'s as SD3's; Z-Image's in
    its own form. Only FLUX's reads its adapter's state."""
    qwen, sd3 = models.adapter_class("tiny").omni_request, models.adapter_class("tiny-sd3").omni_request
    flux = models.adapter_class("tiny-flux").omni_request
    assert qwen(None, 1.0, " ") == {"true_cfg_scale": 1.0}
    assert qwen(None, 4.0, " ") == {"true_cfg_scale": 4.0, "negative_prompt": " "}
    assert sd3(None, 1.0, "") == {"guidance_scale": 1.0}
    assert sd3(None, 4.5, "") == {"guidance_scale": 4.5, "negative_prompt": ""}
    assert flux(SimpleNamespace(guidance=3.5), 1.0, "") == {"guidance_scale": 3.5}
    wan = models.adapter_class("tiny-wan").omni_request  # and its frame count rides in the request's knobs
    assert wan(None, 1.0, "") == {"guidance_scale": 1.0} and wan(None, 4.5, "") == {"guidance_scale": 4.5,
                                                                                     "negative_prompt": ""}
    assert [models.adapter_class(m).omni_pipeline_class for m in models.TINY] == [
        "omni.pipeline.FlowGRPOQwenImagePipeline", "omni.pipeline.FlowGRPOSD3Pipeline",
        "omni.pipeline.FlowGRPOFluxPipeline", "omni.pipeline_edit.FlowGRPOFluxKontextPipeline",
        "omni.pipeline_edit.FlowGRPOQwenImageEditPlusPipeline", "omni.pipeline.FlowGRPOWanPipeline",
        "omni.pipeline_2026.FlowGRPOZImagePipeline", "omni.pipeline_2026.FlowGRPOFlux2KleinPipeline",
        None, None]  # tiny-qwen-image-2.1[-edit]: vLLM-Omni 0.30.0 has none; start-up refuses --rollout vllm-omni
    # Z-Image's CFG in its own form: guidance g = w − 1; FLUX.2 [klein]'s as SD3's (its negative prompt encoded)
    zimage = models.adapter_class("tiny-z-image").omni_request
    klein = models.adapter_class("tiny-flux.2-klein").omni_request
    assert zimage(None, 1.0, "") == {"guidance_scale": 0.0} and zimage(None, 5.0, "x") == {"guidance_scale": 4.0,
                                                                                          "negative_prompt": "x"}
    assert klein(None, 1.0, "") == {"guidance_scale": 1.0} and klein(None, 4.0, "x") == {"guidance_scale": 4.0,
                                                                                         "negative_prompt": "x"}


# ---- trajectory files ---------------------------------------------------------------------------
def test_read_trajectory_checks_everything(tmp_path):
    body = dict(prompt="p", n=2, size=f"{W}x{H}", num_inference_steps=NUM_STEPS,
                extra_params={"flowgrpo": dict(trajectory=str(tmp_path / "t.safetensors"), seeds=[11, 12],
                                               steps=STEPS)})
    schedule = trainer_sigmas(NUM_STEPS, 16)
    sigmas, sigma_max = schedule[:4], float(schedule[1])
    expected = {"seeds": [11, 12], "prompt": "p", "sigmas": sigmas, "sigma_max": sigma_max, "latent_shape": (16, 16),
                "image_shape": (3, H, W), "pipeline": "omni.pipeline.P"}

    def read(**kw):  # the trajectory, checked against `expected` with `kw` changed
        return rollout_backends.read_trajectory(str(tmp_path / "t.safetensors"), **(expected | kw))
    with pytest.raises(FileNotFoundError, match="must run omni.pipeline.P .*shared filesystem"):
        read()
    write_fake_trajectory(body, 16, 16, "ok")
    t = read()
    assert t["latents"].shape == (2, 4, 16, 16) and t["log_probs"].tolist() == [[11.0] * 3, [12.0] * 3]
    ulp = torch.nextafter(torch.tensor(sigma_max), torch.tensor(2.0)).item()  # σ must equal the trainer's to the bit
    for kw, needle in [(dict(seeds=[12, 11]), "written for"), (dict(prompt="q"), "written for"),
                       (dict(latent_shape=(16, 32)), "latents has shape"), (dict(sigmas=sigmas + 1), "sigmas"),
                       (dict(sigma_max=ulp), f"sigma_max {sigma_max}.*max \\|diff\\| 5.96e-08"),
                       (dict(image_shape=(3, 64, 64)), "images has shape")]:
        with pytest.raises(ValueError, match=needle):
            read(**kw)
    for mode in ("other_sigmas", "sigma_max"):  # one σ one ulp off; a σ_max of 123 (it scales the SDE's noise)
        write_fake_trajectory(body, 16, 16, mode)
        with pytest.raises(ValueError, match="sampled with sigmas"):
            read()
    bad = load_file(str(tmp_path / "t.safetensors"))
    bad["log_probs"][0, 0] = float("nan")
    save_file(bad, str(tmp_path / "t.safetensors"), metadata={"format": rollout_backends.FORMAT, "prompt": "p",
                                                                "seeds": "[11, 12]"})
    with pytest.raises(ValueError, match="log_probs is not finite"):
        read()
    bad["log_probs"][0, 0] = -1e30  # finite, and no log-density of a sample (accepted before)
    save_file(bad, str(tmp_path / "t.safetensors"), metadata={"format": rollout_backends.FORMAT, "prompt": "p",
                                                                "seeds": "[11, 12]"})
    with pytest.raises(ValueError, match=r"log_probs reach 1e\+30, beyond ±1000"):
        read()
    for mode, needle in [("truncated", "malformed"), ("wrong_shape", "latents has shape")]:
        write_fake_trajectory(body, 16, 16, mode)
        with pytest.raises(ValueError, match=needle):
            read()
    with open(tmp_path / "t.safetensors", "ab") as f:  # more bytes than the request's trajectory can take
        f.write(bytes(2 * 4 * (3 * H * W + 4 * 16 * 16)))
    with pytest.raises(ValueError, match="has more than the 38970 bytes a trajectory of this request takes"):
        read()
    os.remove(tmp_path / "t.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", tmp_path / "t.safetensors")  # the server writes files, not links
    with pytest.raises(ValueError, match="cannot be opened"):
        read()


# ---- policy export ------------------------------------------------------------------------------
def test_sync_writes_peft_versions_with_fresh_ids_and_prunes(tmp_path, standin):
    backend = make(standin.url, tmp_path)
    engine = fake_engine()
    backend.sync(engine, 0)
    first = dict(backend.lora)
    backend.sync(engine, 1)
    policy = Path(backend.policy_dir)
    assert policy.parent.parent == tmp_path / "run" and policy.parent.name.startswith("rollout-")
    assert os.listdir(policy) == ["v1"] and backend.lora["local_path"] == str(policy / "v1")
    assert backend.lora["int_id"] == first["int_id"] + 1 and backend.lora["name"] != first["name"]
    config = json.loads((policy / "v1" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, ["to_k", "to_q"])
    keys = list(load_file(str(policy / "v1" / "adapter_model.safetensors")))
    assert keys == ["base_model.model.transformer_blocks.0.attn.to_q.lora_A.weight"]  # PEFT's key layout
    # a restarted trainer (new backend) never reuses an id a long-lived server may have cached, nor a directory
    restarted = make(standin.url, tmp_path)
    assert restarted.id_base != backend.id_base and restarted.root != backend.root
    with pytest.raises(ValueError, match="--full-finetune"):
        rollout_backends.OmniBackend(standin.url, str(tmp_path),
                                     SimpleNamespace(**{**vars(engine), "lora_config": None}))


# ---- the whole client against the stand-in ------------------------------------------------------
def test_sample_assembles_the_local_layout_in_batch_order(tmp_path, standin, model):
    backend = make(f"{standin.url}", tmp_path, concurrency=3)
    backend.sync(fake_engine(), 3)
    prompts = ["a cat", "a dog", "a cat", "a dog", "a cat", "a dog"]
    ids = [7, 2, 9, 4, 0, 11]
    batch = backend.sample(model, prompts, [{"i": i} for i in ids], torch.tensor(ids) // 4, ids, **KW)
    local = rollout.sample(model, prompts, [{"i": i} for i in ids], torch.tensor(ids) // 4, ids, **KW)
    for name in ("latents", "log_probs", "images", "sigmas"):  # the local backend's shapes and dtypes
        assert getattr(batch, name).shape == getattr(local, name).shape and getattr(batch, name).dtype == torch.float32
    assert batch.sigma_max == local.sigma_max and torch.equal(batch.sigmas, local.sigmas)
    assert batch.prompts == prompts and batch.metadata == local.metadata
    assert torch.equal(batch.group, local.group) and batch.cond.keys() == local.cond.keys()
    assert torch.equal(batch.cond["embeds"], local.cond["embeds"])  # re-encoded by the trainer's text encoder
    seeds = [rollout.image_seed(5, 3, i) for i in ids]
    assert batch.log_probs[:, 0].tolist() == [float(s % 1000) for s in seeds]  # row i is image i's trajectory
    assert torch.equal(batch.latents[3], seed_rows([seeds[3]], (4, 16, 16))[0])
    assert [b["lora"]["int_id"] for b in standin.bodies] == [backend.lora["int_id"]] * 2
    assert os.listdir(backend.traj_dir) == []  # read, then deleted


def test_an_ode_only_rollout_returns_images_and_final_latents(tmp_path, standin, model):
    """The forward-process algorithms' rollout (no SDE steps): the servers return images and each image's final
    latents `x0` only; no log-probs, no per-step latents (their shapes: (n, 0), (n, 0, *L))."""
    backend = make(standin.url, tmp_path)
    backend.sync(fake_engine(), 0)
    ids = [3, 8, 1]
    batch = backend.sample(model, ["a cat", "a dog", "a cat"], [{}] * 3, [0, 1, 0], ids, **(KW | dict(steps=[])))
    seeds = [rollout.image_seed(5, 3, i) for i in ids]
    assert batch.log_probs.shape == (3, 0) and batch.latents.shape == (3, 0, 16, 16) and len(batch.sigmas) == 0
    assert torch.equal(batch.x0, -seed_rows(seeds, (16, 16))) and batch.ids.tolist() == ids and batch.iteration == 3
    assert standin.bodies[0]["extra_params"]["flowgrpo"]["steps"] == []


def test_transient_503_is_retried(tmp_path, standin, model):
    backend = make(standin.url, tmp_path)
    backend.sync(fake_engine(), 0)
    standin.fail_next = 2  # retries=2: the third attempt succeeds
    batch = backend.sample(model, ["a cat"] * 2, [{}] * 2, [0, 0], [0, 1], **KW)
    assert batch.latents.shape[0] == 2 and len(standin.bodies) == 3


@pytest.mark.parametrize("mode,needle", [
    ("error", "answered HTTP 500 to the request for prompt 'a cat', seeds \\[.*boom"),
    ("no_file", "no trajectory file .*omni.pipeline.FlowGRPOQwenImagePipeline"),
    ("truncated", "malformed trajectory file"), ("wrong_seeds", "written for prompt"),
    ("other_sigmas", "sampled with sigmas"), ("sigma_max", "sigma_max 123.0"),
    ("directory", "not a regular file \\(mode d"),
    ("huge_x0", r"x0 reach 3e\+38, beyond ±10000 \(no sample\)"),
    ("huge_latents", r"latents reach 3e\+38, beyond ±10000"),
    ("nested_seeds", r"written for prompt 'a cat', seeds '\[\[\[\[\[\["),
    ("nested_reply", "maximum recursion depth exceeded while decoding a JSON"),
    ("data_string", "the answer lacks its 2 images: {'data': 'xx'}")])
def test_server_faults_name_the_server_and_the_request(tmp_path, standin, model, mode, needle):
    """The first error reported is the real one: removing what the server left (a directory: it cannot be
    unlinked) never replaces it. Each is one line. A finite x0 of 3e38 (before: every optimizer step of the run
    skipped, exit 0), seeds or an answer nested deeper than the JSON parser goes (before: a RecursionError naming no
    server), and an answer whose `data` is a string of n characters (before: taken for n images) are refused."""
    backend = make(standin.url, tmp_path)
    backend.sync(fake_engine(), 0)
    standin.mode = mode
    with pytest.raises(RuntimeError, match=needle) as err:
        backend.sample(model, ["a cat"] * 2, [{}] * 2, [0, 0], [0, 1], **KW)
    assert standin.url in str(err.value) and "a cat" in str(err.value) and "\n" not in str(err.value)
    backend.close()
    assert os.listdir(tmp_path / "run") == []  # the run's directory, and what the server left in it, are gone


# Run by the FIFO test in its own process: a reader blocked in open() may hold the test process's GIL.
RELEASER = """
import os
import stat
import sys
import time
folder, hang = sys.argv[1], float(sys.argv[2])
time.sleep(hang)
while True:  # each open of a FIFO for reading waits for a writer: open every FIFO there for writing, again and again
    for name in os.listdir(folder):
        try:
            if stat.S_ISFIFO(os.lstat(os.path.join(folder, name)).st_mode):
                os.close(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_NONBLOCK))
                print("released", name, flush=True)
        except OSError:  # ENXIO: no reader waiting at this instant
            pass
    time.sleep(0.1)
"""


def test_a_fifo_at_the_trajectory_path_is_an_error_not_a_hang(tmp_path, standin, model):
    """A plain open of a FIFO blocks until a writer comes (in a thread that may hold the GIL: the whole trainer
    stops). A helper process releases any reader still blocked after HANG_S, so the test fails, not hangs."""
    backend = make(standin.url, tmp_path)
    backend.sync(fake_engine(), 0)
    standin.mode = "fifo"
    releaser = subprocess.Popen([sys.executable, "-c", RELEASER, backend.traj_dir, str(HANG_S)],
                                stdout=subprocess.PIPE, text=True)
    try:
        with pytest.raises(RuntimeError) as err:
            backend.sample(model, ["a cat"] * 2, [{}] * 2, [0, 0], [0, 1], **KW)
    finally:
        releaser.kill()
        released = releaser.communicate()[0]
    assert not released, f"the rollout was blocked on the FIFO for {HANG_S} s: {released}"
    assert re.search(f"{standin.url}.*'a cat'.*not a regular file \\(mode p", str(err.value)), err.value
    assert os.listdir(backend.traj_dir) == []


def test_a_trajectories_directory_swapped_for_a_link_is_refused(tmp_path, standin, model):
    """A server (or anyone) that replaces the run's trajectories/ by a symbolic link to elsewhere: the files were
    read through it. No link is followed beneath the run's exchange directory now."""
    backend = make(standin.url, tmp_path)
    backend.sync(fake_engine(), 0)
    elsewhere = tmp_path / "elsewhere"
    os.rename(backend.traj_dir, elsewhere)
    os.symlink(elsewhere, backend.traj_dir)
    with pytest.raises(RuntimeError, match=f"{standin.url}.*'a cat'.*trajectories/.*cannot be opened"):
        backend.sample(model, ["a cat"] * 2, [{}] * 2, [0, 0], [0, 1], **KW)


def test_runs_sharing_a_rollout_dir_never_touch_each_others_files(tmp_path, standin, model, monkeypatch):
    """Two runs with one FLOWGRPO_ROLLOUT_DIR (both rank 0): each has a directory of its own beneath it, so one
    run's pruning, cleanup and close leave the other's adapters and trajectories alone."""
    shared = tmp_path / "shm"
    monkeypatch.setenv("FLOWGRPO_ROLLOUT_DIR", str(shared))
    a, b = (rollout_backends.make_backend("vllm-omni", standin.url, str(tmp_path / run), fake_engine()) for run in "ab")
    a.sync(fake_engine(), 0)
    b.sync(fake_engine(), 0)
    b.sync(fake_engine(), 1)  # prunes b's v0
    assert os.path.isdir(a.lora["local_path"]), "b's pruning removed a's policy"
    late = Path(a.traj_dir) / "it000000-r0-0badf00d-0000.safetensors"  # a server's late write for run a
    late.write_bytes(b"x")
    b.sample(model, ["a cat"] * 2, [{}] * 2, [0, 0], [0, 1], **KW)
    b.close()
    assert late.exists() and os.path.isdir(a.lora["local_path"]), "b's close removed a's files"
    assert os.listdir(shared) == [os.path.basename(a.root)]  # b's own directory is gone
    assert a.sample(model, ["a dog"], [{}], [0], [0], **KW).latents.shape[0] == 1
    # each run's directory is made with os.mkdir: a name that exists (here forced) is an error, never shared
    monkeypatch.setattr(rollout_backends.uuid, "uuid4", lambda: SimpleNamespace(hex="0" * 32))
    monkeypatch.setattr(rollout_backends.time, "strftime", lambda fmt: "20250101-000000")
    rollout_backends.make_backend("vllm-omni", standin.url, str(tmp_path / "c"), fake_engine())
    with pytest.raises(OSError, match="FLOWGRPO_ROLLOUT_DIR .* cannot create .*File exists"):
        rollout_backends.make_backend("vllm-omni", standin.url, str(tmp_path / "d"), fake_engine())
    a.close()
    assert os.path.basename(a.root) not in os.listdir(shared)


def test_a_server_that_is_or_goes_down_is_named(tmp_path, standin, model):
    dead = closed_port_url()
    with pytest.raises(RuntimeError, match=f"{dead} stayed down for GET /health: 3 attempts"):
        make(f"{standin.url},{dead}", tmp_path)
    backend = make(standin.url, tmp_path)
    backend.sync(fake_engine(), 0)
    standin.stop()  # dies mid-run
    with pytest.raises(RuntimeError, match=f"{standin.url} stayed down for the request for prompt 'a cat'"):
        backend.sample(model, ["a cat"] * 2, [{}] * 2, [0, 0], [0, 1], **KW)
    standin.httpd = SimpleNamespace(shutdown=lambda: None, server_close=lambda: None)  # already stopped


def test_the_servers_are_asked_once_before_the_model_loads(tmp_path, standin, capsys):
    """Start-up asks each --rollout-url server once (rollout_backends.probe, from startup.check_args): the wrong server
    (a reward server, a web page) is refused in one line before anything is built; before, the backend's GET /health,
    after the policy had loaded, took any 2xx, and the run stopped at its first rollout with a 404. One still loading
    its model (its port closed) warns; one that is up says what it serves."""
    rollout_backends.probe([standin.url])
    assert capsys.readouterr().out == f"--rollout-url {standin.url}: up, serving ['/models/tiny']\n"
    dead = closed_port_url()
    rollout_backends.probe([dead])
    assert capsys.readouterr().err.startswith(f"warning: --rollout-url {dead}: no answer yet (vLLM-Omni server "
                                              f"{dead}/health failed 1 times")

    class Other(BaseHTTPRequestHandler):  # a reward server (python rewards.py serve), or a web server
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.server.body)))
            self.end_headers()
            self.wfile.write(self.server.body)

        def log_message(self, *args):
            pass
    for body, said in ((b'{"status": "ok", "reward": "brightness"}', 'GET /health answered {"status": "ok", "reward": '
                        '"brightness"}, not vLLM-Omni\'s {"status": "healthy"}'),
                       (b"<html>a web page</html>", "answered with a body that is not JSON: '<html>")):
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Other)
        httpd.body = body
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        url, run = f"http://127.0.0.1:{httpd.server_address[1]}", tmp_path / "run"
        try:
            with pytest.raises(ValueError) as e:
                main_here("--model", "tiny", "--rollout", "vllm-omni", "--rollout-url", url, "--run-dir", run)
            assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
            assert not run.exists() and "batch arithmetic" not in capsys.readouterr().out
        finally:
            httpd.shutdown()
            httpd.server_close()


def test_an_answer_past_the_reply_bound_is_said_at_once_not_asked_again(monkeypatch):
    """A reply over MAX_REPLY (vLLM-Omni's 10 images of 1328² as uncompressed PNG were 67 MiB) is the answer the same
    request would get again: one POST, then the error; before, four whole generations, then "stayed down"."""
    posts = []

    class TooLong(BaseHTTPRequestHandler):
        def do_POST(self):
            posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = b'{"data": ["' + b"A" * 5000 + b'"]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), TooLong)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setattr(rollout_backends, "MAX_REPLY", 4096)
    me, url = SimpleNamespace(retries=3, backoff=0.0, timeout=30.0), f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(RuntimeError, match="answered the request for 'p' with a reply of more than 4096 bytes"):
            rollout_backends.OmniBackend._call(me, url, "/v1/images/generations", {"prompt": "p", "n": 10},
                                               "the request for 'p'")
        assert len(posts) == 1, f"{len(posts)} requests for one answer"
        client = reward_http.Client("reward server", "is it running?", retries=3, backoff=0.0, max_reply=4096)
        with pytest.raises(RuntimeError, match="answered with a reply of more than 4096 bytes"):  # the reward's too
            client.call(url, "/score", {"n": 1})
        assert len(posts) == 2, f"{len(posts) - 1} requests for one answer"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_generation_past_the_deadline_is_not_asked_again():
    """A generation that outlasts FLOWGRPO_ROLLOUT_TIMEOUT still runs on the server: sent again, the server would run
    it twice and its queue grow with every retry. One POST, then the error naming the setting; a GET (/health) past
    its deadline is still retried."""
    seen = []

    class Slow(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append("GET")
            time.sleep(1.5)

        def do_POST(self):
            seen.append("POST")
            time.sleep(1.5)

        def log_message(self, *args):
            pass
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    me, url = SimpleNamespace(retries=2, backoff=0.0, timeout=0.5), f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(RuntimeError, match="within the 0.5 s deadline .*FLOWGRPO_ROLLOUT_TIMEOUT.*may still be"):
            rollout_backends.OmniBackend._call(me, url, "/v1/images/generations", {"prompt": "p"}, "the request for 'p'")
        assert seen == ["POST"], seen
        with pytest.raises(RuntimeError, match="stayed down for GET /health: 3 attempts"):
            rollout_backends.OmniBackend._call(me, url, "/health", None, "GET /health")
        assert seen == ["POST", "GET", "GET", "GET"], seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_connection_never_made_is_asked_again_and_said_down():
    """A POST whose connection timed out (a server's host dropping packets; here a listener whose queue is full)
    never reached the server: before, it was said to be past FLOWGRPO_ROLLOUT_TIMEOUT and "may still be generating
    it", and not asked again. It is asked again, then the server said down."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        url, queued = f"http://127.0.0.1:{listener.getsockname()[1]}", []
        for _ in range(64):  # fill the queue of connections never accepted: the kernel drops the next one's SYN
            try:
                queued.append(socket.create_connection(("127.0.0.1", listener.getsockname()[1]), timeout=0.2))
            except TimeoutError:
                break
        me = SimpleNamespace(retries=1, backoff=0.0, timeout=0.3)
        try:
            with pytest.raises(RuntimeError, match="stayed down for the request for 'p': 2 attempts failed "
                                                   r"\(last: TimeoutError: timed out\)"):
                rollout_backends.OmniBackend._call(me, url, "/v1/images/generations", {"prompt": "p"},
                                                   "the request for 'p'")
        finally:
            for s in queued:
                s.close()


def test_sample_needs_sync_first_and_takes_the_local_arguments(tmp_path, standin, model):
    backend = make(standin.url, tmp_path)
    with pytest.raises(RuntimeError, match="before sync"):
        backend.sample(model, ["a"], [{}], [0], [0], **KW)
    backend.sync(fake_engine(), 0)
    assert backend.sample(model, ["a"], [{}], [0], [0], **KW, branch=False, ode_solver="euler").latents.shape[0] == 1
    for variant in (dict(branch=True), dict(ode_solver="dpm2")):  # what the pipeline cannot do is refused
        with pytest.raises(ValueError, match="vLLM-Omni pipeline samples independent images with Euler"):
            backend.sample(model, ["a"], [{}], [0], [0], **KW, **variant)


def test_the_main_modules_never_import_vllm_omni():
    import flowgrpo  # noqa: F401
    assert "vllm_omni" not in sys.modules and "omni.pipeline" not in sys.modules


@pytest.mark.parametrize("module,builder", [("serve_tiny", "build_tiny_pipeline"), ("tiny_vl", "build")])
def test_a_build_flag_it_does_not_know_is_refused(module, builder, monkeypatch, tmp_path, capsys):
    """`omni/serve_tiny.py build DIR --models tiny-sd3` (a typo of --model) built the default tiny Qwen-Image, the flag
    unread: only `serve` hands the flags it does not know on, to vLLM."""
    tool, built = importlib.import_module(f"omni.{module}"), []
    monkeypatch.setattr(tool, builder, lambda *args: built.append(args))
    monkeypatch.setattr(sys, "argv", [f"{module}.py", "build", str(tmp_path / "x"), "--models", "tiny-sd3"])
    with pytest.raises(SystemExit):
        tool.main()
    assert not built and "unrecognized arguments: --models tiny-sd3" in capsys.readouterr().err
