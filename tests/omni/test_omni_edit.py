"""The edit families through the real vLLM-Omni 0.30.0 server: omni.pipeline_edit.FlowGRPOFluxKontextPipeline serves
tiny-flux-kontext and omni.pipeline_edit.FlowGRPOQwenImageEditPlusPipeline tiny-qwen-image-edit (their pipeline
directories from models.save_tiny_pipeline), the source image of each prompt sent in the request's knobs as a PNG
(/v1/images/generations takes no image).

The served trajectories equal the local backend's for prompts with different sources (the same bounds as
test_omni_families.py's: both sides encode the same pixels with the same VAE, argmax); Qwen-Image-Edit's with true CFG
4 and a negative prompt, its source sizes shrunk to 32² in the trainer (test_edit_qwen.py's reason), which the requests
carry to the server; a Kontext source of another size is refused with its reason and the server stays up; a 2-iteration
run through the server has a tiny `train/logp_gap` and serves each iteration a new adapter.
"""
import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from harness import OmniServer, http, set_lora_b, train_here
from test_edit import edit_prompts, write_png
from test_edit_qwen import SMALL, small_sources  # noqa: F401 (an autouse fixture: the Qwen sources at 32² here)
from test_omni_families import GAP_TOL, TOL, trainer_logp_gap
from test_reward_bounds import chunk, png_with_chunks

import engine as eng
import models
import rollout
import rollout_backends

H = W = 32
KW = dict(num_steps=4, height=H, width=W, negative_prompt="", noise_level=0.7, seed=0, iteration=3, chunk=8,
          cfg_scale=1.0, sde_type="sde", steps=[0, 1, 2])
PROMPTS = ["make it red", "make it red", "add a hat", "make it red", "add a hat"]
# Qwen-Image-Edit with true CFG 4: the latents within this, measured 1.9e-5 (4 steps; CFG scales the velocity gap of
# the two transformer implementations by 4, over 4 steps), the log-probs within TOL (6e-8) and the trainer's log-prob
# of the served transitions within GAP_TOL (2.7e-7); another source moves the latents by far more (asserted)
CFG_TOL = 1e-4


def serve(tmp_path_factory, name: str):
    """Tiny model `name` on disk, its server (one request a pass: vLLM-Omni 0.30.0 batches no edit requests, it refuses
    --max-num-seqs > 1 for Kontext at start-up) and the trainer's adapter loaded from the same directory with LoRA on
    its default targets; two source images. A generator: the module's fixtures yield from it."""
    base = tmp_path_factory.mktemp(f"omni-{name}")
    directory = models.save_tiny_pipeline(str(base / name), seed=0, model=name)
    server = OmniServer(Path(directory), tmp_path_factory.mktemp("omni-log") / f"{name}.log",
                        pipeline_args={"trajectory_root": str(tmp_path_factory.getbasetemp())})
    try:
        model = models.load_model(name, directory, "cpu")
        engine = eng.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=type(model).lora_targets, lr=1e-2,
                            weight_decay=0.0, max_grad_norm=1.0, seed=0)
        sources = [write_png(base / f"{i}.png", H, W, seed=i) for i in range(2)]
        yield dict(dir=directory, server=server, model=model, engine=engine, sources=sources)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    yield from serve(tmp_path_factory, "tiny-flux-kontext")


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory):
    yield from serve(tmp_path_factory, "tiny-qwen-image-edit")


def test_served_edits_equal_the_local_backend(kontext, tmp_path):
    """The same prompt with two sources is two requests; each image's latents, log-probs and pixels are the local
    backend's within test_omni_families.py's bounds, and another source gives other images."""
    model, engine, (a, b) = kontext["model"], kontext["engine"], kontext["sources"]
    metadata = [{"image": s} for s in (a, b, b, a, a)]
    group = torch.tensor([0, 1, 2, 0, 3])
    set_lora_b(model, 1)
    backend = rollout_backends.OmniBackend(kontext["server"].url, str(tmp_path), engine, concurrency=4)
    backend.sync(engine, 1)
    served = backend.sample(model, PROMPTS, metadata, group, range(5), **KW)
    local = rollout.sample(model, PROMPTS, metadata, group, range(5), **KW)
    backend.close()
    diffs = {k: (getattr(served, k) - getattr(local, k)).abs().max().item() for k in ("latents", "log_probs", "images")}
    gap = trainer_logp_gap(model, served, KW["steps"], 1.0, "sde")
    other = rollout.sample(model, PROMPTS, [{"image": b}] * 5, group, range(5), **KW)
    source_effect = (other.images[0] - local.images[0]).abs().max().item()
    print(f"\nkontext served - local max|diff| {diffs}; trainer-vs-server log-prob gap {gap:.2e}; another source "
          f"moves an image by {source_effect:.2e}")
    assert torch.equal(served.sigmas, local.sigmas) and served.latents.shape == local.latents.shape
    assert max(diffs.values()) < TOL and gap < GAP_TOL, (diffs, gap)
    assert source_effect > 100 * max(diffs.values())  # the server used each request's own source


def test_a_source_of_another_size_or_kind_is_refused_and_the_server_stays_up(kontext, tmp_path):
    """A source of another size than the request's, a JPEG, a 16-bit grey PNG (whose values over 255 RGB turned
    white), a PNG of 5,000 empty chunks: each refused with its reason; the server answers on."""
    model = kontext["model"]
    [(_, body)] = rollout_backends.build_requests(model, ["make it red"], [0], steps=[0], num_steps=2, height=H,
                                                  width=W, cfg_scale=1.0, negative_prompt="", noise_level=0.7,
                                                  sde_type="sde", seed=0, iteration=0, lora=None,
                                                  prefix=str(tmp_path / "r"),
                                                  metadata=[{"image": kontext["sources"][0]}])
    del body["lora"]
    sent = {}
    for kind, pixels, needle in [("PNG", np.zeros((16, 24, 3), np.uint8), "source is 24×16, not the request's 32×32"),
                                 ("JPEG", np.zeros((H, W, 3), np.uint8), "source is not a base64 PNG within bounds"),
                                 ("PNG", np.zeros((H, W), np.uint16), "source has pixel mode I")]:  # I;16 or I
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, format=kind)
        sent[needle] = base64.b64encode(encoded.getvalue()).decode()
    # a million empty chunks took the server 7.7 s to parse before (the reward server's bound, and its test's image)
    sent["has more than 4096 PNG chunks"] = png_with_chunks([chunk(b"prIv", b"")] * 5000)
    for needle, source in sent.items():
        body["extra_params"]["flowgrpo"]["source"] = source
        status, resp = http("POST", kontext["server"].url + "/v1/images/generations", body)
        assert status >= 400 and needle in str(resp), (needle, status, str(resp)[:2000])
    assert http("GET", kontext["server"].url + "/health")[0] == 200


def test_served_qwen_edits_equal_the_local_backend(qwen_edit, tmp_path):
    """True CFG 4 with a negative prompt, both branches encoded with the source on both sides; the requests carry the
    trainer's (shrunk) source areas."""
    model, engine, (a, b) = qwen_edit["model"], qwen_edit["engine"], qwen_edit["sources"]
    assert model.source_areas() == [SMALL, SMALL]
    prompts, metadata = ["make it red 0", "make it red 1", "make it red 0"], [{"image": s} for s in (a, b, b)]
    kw = dict(KW, cfg_scale=4.0, negative_prompt="blurry")
    set_lora_b(model, 1)
    backend = rollout_backends.OmniBackend(qwen_edit["server"].url, str(tmp_path), engine)
    backend.sync(engine, 1)
    served = backend.sample(model, prompts, metadata, torch.tensor([0, 1, 2]), range(3), **kw)
    local = rollout.sample(model, prompts, metadata, torch.tensor([0, 1, 2]), range(3), **kw)
    backend.close()
    diffs = {k: (getattr(served, k) - getattr(local, k)).abs().max().item() for k in ("latents", "log_probs", "images")}
    gap = trainer_logp_gap(model, served, KW["steps"], 4.0, "sde")
    other = rollout.sample(model, prompts, [{"image": a}] * 3, torch.tensor([0, 1, 2]), range(3), **kw)
    source_effect = (other.latents[1:] - local.latents[1:]).abs().max().item()
    print(f"\nqwen-image-edit served - local max|diff| {diffs}; trainer-vs-server log-prob gap {gap:.2e}; another "
          f"source moves the latents by {source_effect:.2e}")
    assert torch.equal(served.sigmas, local.sigmas) and served.latents.shape == local.latents.shape
    assert max(diffs.values()) < CFG_TOL and gap < GAP_TOL, (diffs, gap)
    assert source_effect > 100 * max(diffs.values())  # the server used each request's own source


# last: a run in this process ends by leaving the process group the fixtures' engines were built in
@pytest.mark.parametrize("family,model", [("kontext", "tiny-flux-kontext"), ("qwen_edit", "tiny-qwen-image-edit")])
def test_a_short_run_of_the_recipe_through_the_server(request, family, model, tmp_path):
    """The family's tiny recipe (Qwen-Image-Edit: true CFG 4) for 2 iterations with --rollout vllm-omni (flowgrpo.main
    in this process): each iteration a new adapter version, and the trainer's log-prob of the served edits is the
    server's within 1e-6."""
    served = request.getfixturevalue(family)
    server = served["server"]
    log_start = len(server.log_text())
    rows = train_here("--model", model, "--model-path", served["dir"], "--prompts",
                      edit_prompts(tmp_path), "--rollout", "vllm-omni", "--rollout-url", server.url, "--run-dir",
                      str(tmp_path / "run"), "--iterations", "2", "--eval-every", "0", "--group-size", "2",
                      "--prompts-per-iteration", "2", "--micro-batch", "2")
    gaps = [r["train/logp_gap"] for r in rows]
    print(f"\n{model}: 2 iterations through vLLM-Omni: train/logp_gap {gaps}")
    assert [r["iteration"] for r in rows] == [0, 1] and max(gaps) < 1e-6, gaps
    loaded = re.findall(r"Loading new adapter: id=(\d+), name=flowgrpo-v(\d+)", server.log_text()[log_start:])
    assert [int(v) for _, v in loaded] == [0, 1], loaded
