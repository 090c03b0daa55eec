"""The second edit family, Qwen-Image-Edit (`tiny-qwen-image-edit`): the ODE rollout against diffusers' own
QwenImageEditPlusPipeline with true CFG, the source's two paths into the velocity (the VL text encoder, for both CFG
branches, and the VAE tokens), branched groups, an exactly on-policy first update in the real training script, the
LoRA export loaded by the pipeline, exact resume and 1-vs-2 ranks, the tiny pipeline written by `save-tiny` and read
back, and the start-up refusals.

The pipeline resizes the source to about 1024² pixels for its VAE and 384² for the text encoder; at those sizes the
tiny model takes 30 s on one CPU core to encode a source and 2.3 s a transformer call (16,384 source tokens, measured),
so the whole file runs with both shrunk to 32² in diffusers' module (the adapter reads them there at call time, as the
pipeline does)."""
import dataclasses
import os

import numpy as np
import pytest
import torch
from PIL import Image

import flowgrpo
import models
import rollout
import scheduler as sch
import startup
from test_edit import check_resume_and_ranks, edit_prompts, write_png
from test_engine import ROOT
from tiny_setup import check_lora_export, main_here

MODEL = "tiny-qwen-image-edit"
# the same number of tokens: the pipeline takes one prompt a call, unpadded, and our batch pads to the longest
PROMPTS = ["make the cat red 0", "make the cat red 1"]
NEGATIVE = "blurry"


EDIT_PLUS = "diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus"
SMALL = 32 * 32  # the source's pixels (by area) for the VAE and the text encoder in this file
# flowgrpo.py launched by torchrun with the same sizes: each rank shrinks them, then runs the script
LAUNCHER = f"""import runpy, sys
import {EDIT_PLUS} as edit_plus
edit_plus.VAE_IMAGE_SIZE = edit_plus.CONDITION_IMAGE_SIZE = {SMALL}
sys.argv[0] = {os.path.join(ROOT, "flowgrpo.py")!r}
sys.path.insert(0, {ROOT!r})
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module", autouse=True)
def small_sources():
    """The pipeline's source sizes shrunk to SMALL in diffusers' module for this file."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as edit_plus
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(edit_plus, "VAE_IMAGE_SIZE", SMALL)
        mp.setattr(edit_plus, "CONDITION_IMAGE_SIZE", SMALL)
        yield


@pytest.fixture(scope="module")
def edit():
    return models.load_model(MODEL, None, "cpu", seed=0)


@pytest.mark.parametrize("height,width", [(32, 32), (32, 48)])
def test_ode_rollout_reproduces_the_edit_pipeline(edit, tmp_path, height, width):
    """From the same per-image generators, prompts, negative prompt and source images, our ODE rollout with true CFG 4
    gives QwenImageEditPlusPipeline.__call__'s final latents bit for bit (the pipeline draws the noise and encodes the
    prompts with their images itself, one prompt a call), its images within 1e-6; the σ schedule is the one the
    pipeline set (diffusers 0.42.1, pipelines/qwenimage/pipeline_qwenimage_edit_plus.py)."""
    sources = [write_png(tmp_path / f"{i}.png", height, width, seed=i) for i in range(2)]
    metadata = [{"image": s} for s in sources]
    kw = dict(num_steps=4, height=height, width=width, cfg_scale=4.0, negative_prompt=NEGATIVE, seed=3, iteration=5)
    batch = rollout.sample(edit, PROMPTS, metadata, range(2), range(2), steps=[], noise_level=0.0, sde_type="sde",
                           chunk=1, **kw)
    cond = edit.conditioning(PROMPTS, NEGATIVE, 4.0, metadata, height, width)
    assert cond["mask"].all() and cond["neg_mask"].all()  # nothing padded: the pipeline's shapes exactly
    for i, source in enumerate(sources):
        def pipeline(output_type):
            return edit.pipe(image=Image.open(source), prompt=PROMPTS[i], negative_prompt=NEGATIVE, true_cfg_scale=4.0,
                             height=height, width=width, num_inference_steps=4, output_type=output_type,
                             generator=rollout.image_generators(3, 5, [i])).images
        latents = pipeline("latent")
        assert torch.equal(sch.sigma_schedule(edit.scheduler, 4, edit.image_seq_len(height, width)),
                           edit.pipe.scheduler.sigmas)
        images = pipeline("pt")
        assert latents.shape == batch.x0[i:i + 1].shape, (latents.shape, batch.x0.shape)
        assert torch.equal(batch.x0[i:i + 1], latents), (batch.x0[i:i + 1] - latents).abs().max()
        gap = (batch.images[i:i + 1] - images).abs().max().item()
        print(f"\nmax |ours - QwenImageEditPlusPipeline| at {height}x{width}, image {i}: latents 0, images {gap:.3g}")
        assert gap <= 1e-6  # the same latents, decoded alike


def test_the_source_reaches_the_velocity_through_both_paths(edit, tmp_path):
    """Another source, the same noise and prompt: other prompt embeddings (positive and negative: the image is in the
    text encoder's input for both CFG branches), other source tokens, another velocity; and each path alone changes
    it (the check above would hold vacuously if either were ignored). The same source twice encodes to the same bits."""
    a, b = write_png(tmp_path / "a.png", 32, 32, seed=0), write_png(tmp_path / "b.png", 32, 32, seed=1)
    cond = edit.conditioning(["edit it"] * 3, NEGATIVE, 4.0, [{"image": a}, {"image": b}, {"image": a}], 32, 32)
    assert cond["source"].shape == (3, 16, 16) and cond["source_grid"].tolist() == [[4, 4]] * 3
    for key in ("embeds", "neg_embeds", "source"):
        assert torch.equal(cond[key][0], cond[key][2]) and (cond[key][0] - cond[key][1]).abs().max() > 1e-4, key
    x = edit.noise(rollout.image_generators(0, 0, [7, 7, 7]), 32, 32)
    sigma = torch.full((3,), 0.7)
    v = edit.velocity(x, sigma, cond, 4.0, 32, 32)
    # rows 0 and 2 are the same inputs; the transformer's CPU kernels round them differently by their place in the
    # batch (measured: 3.6e-7 for Qwen-Image's own transformer call, without the source too)
    assert v.shape == x.shape and (v[0] - v[2]).abs().max() < 1e-5, (v[0] - v[2]).abs().max()
    assert (v[0] - v[1]).abs().max() > 1e-3, (v[0] - v[1]).abs().max()
    for path in (("embeds", "mask", "neg_embeds", "neg_mask"), ("source",)):  # a's image in one path, b's in the other
        mixed = {k: t[[0, 0]] if k in path else t[[0, 1]] for k, t in cond.items()}
        v_mixed = edit.velocity(x[:2], sigma[:2], mixed, 4.0, 32, 32)
        assert (v_mixed[1] - v[1]).abs().max() > 1e-4 and (v_mixed[1] - v[0]).abs().max() > 1e-4, path
    with pytest.raises(ValueError, match="edits a source image: every prompt needs one"):
        edit.conditioning(["edit it"], "", 1.0, [{}], 32, 32)


def test_branched_groups_start_from_their_own_source(edit, tmp_path):
    """--branch: each group's shared prefix (rollout.branch_prefixes, its prompt and source encoded alone) is sampled
    with that group's source, and the group's images then differ in their own SDE steps."""
    sources = [write_png(tmp_path / f"{i}.png", 32, 32, seed=i) for i in range(2)]
    kw = dict(steps=[2, 3], num_steps=4, height=32, width=32, cfg_scale=4.0, negative_prompt=NEGATIVE, noise_level=0.7,
              sde_type="sde", seed=0, iteration=0, chunk=4, branch=True)
    one = rollout.sample(edit, ["edit it"] * 4, [{"image": sources[0]}] * 4, [0] * 4, range(4), **kw)
    two = rollout.sample(edit, ["edit it"] * 4, [{"image": sources[1]}] * 4, [0] * 4, range(4), **kw)
    assert all(torch.equal(one.latents[0, 0], one.latents[i, 0]) for i in range(4))  # one prefix per group
    assert (one.latents[0, 0] - two.latents[0, 0]).abs().max() > 1e-4  # the same noise, another source
    assert (one.latents[0, 1] - one.latents[1, 1]).abs().max() > 1e-4


def test_edit_training_is_exactly_on_policy(tmp_path):
    """2 iterations of `python flowgrpo.py --model tiny-qwen-image-edit` (its recipe: true CFG 4) on a 2-prompt edit
    set: the SDE rollout's log-probs, recomputed by the first update of each iteration, are the same bits
    (train/logp_gap 0): the source's embeddings and latents are part of the batch's conditioning."""
    rows = main_here("--model", MODEL, "--prompts", edit_prompts(tmp_path), "--iterations", "2", "--group-size", "2",
                     "--prompts-per-iteration", "2", "--micro-batch", "2", "--eval-every", "2", "--eval-images", "2",
                     "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"))
    assert len(rows) == 2
    for r in rows:
        assert r["train/logp_gap"] == 0.0, r
        assert np.isfinite(r["reward/mean"])
    assert np.isfinite(rows[-1]["eval/reward_mean"])


def test_the_exported_lora_loads_into_a_fresh_edit_pipeline(tmp_path):
    """One update on an edit batch (true CFG 4, a negative prompt), exported, loaded by
    `QwenImageEditPlusPipeline.load_lora_weights` into a fresh tiny pipeline: its velocity on the same source and noise
    is the trained one (alpha included)."""
    check_lora_export(MODEL, str(tmp_path), [{"image": write_png(tmp_path / "s.png", 32, 32, 0)}] * 4, 4.0, NEGATIVE)


def test_an_edit_run_resumes_bit_for_bit_and_two_ranks_agree_with_one(tmp_path):
    """As tests/test_edit.py checks Kontext; the torchrun ranks through LAUNCHER (each shrinks the source sizes)."""
    (tmp_path / "launch.py").write_text(LAUNCHER)
    check_resume_and_ranks(MODEL, edit_prompts(tmp_path), tmp_path, str(tmp_path / "launch.py"))


def test_save_tiny_writes_a_pipeline_that_loads_back(edit, tmp_path):
    """`python models.py save-tiny DIR --model tiny-qwen-image-edit` writes a diffusers directory (its processor named
    a Qwen2VLProcessor, as the real model's) that `--model-path DIR` loads without torchvision: the same weights, and
    the same conditioning from the processor read back."""
    directory = models.save_tiny_pipeline(str(tmp_path / "tiny"), seed=0, model=MODEL)
    startup.check_args(dataclasses.replace(flowgrpo.RECIPES[MODEL], model_path=directory,
                                           prompts=edit_prompts(tmp_path)))
    loaded = models.load_model(MODEL, directory, "cpu")
    for part in ("transformer", "text_encoder", "vae"):
        ours = getattr(edit.pipe, part).state_dict()
        assert all(torch.equal(t, ours[k]) for k, t in getattr(loaded.pipe, part).state_dict().items()), part
    metadata = [{"image": write_png(tmp_path / "s.png", 32, 48, seed=2)}]
    want, got = (m.conditioning(["edit it"], NEGATIVE, 4.0, metadata, 32, 48) for m in (edit, loaded))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("case,needle", [
    ("no images", r"--prompts general: --model tiny-qwen-image-edit edits a source image, and 48 of its prompts have "
                  r'none: give it a \.jsonl whose every line has "image"'),
    ("text to image", r"which --model tiny \(text to image\) cannot use: choose an edit model \(nano-edit, "
                      r"tiny-flux-kontext, flux\.1-kontext-dev, tiny-qwen-image-edit, qwen-image-edit, "
                      r"tiny-qwen-image-2\.1-edit, qwen-image-2\.1-edit\)"),
    ("sp", r"--sp: --model tiny-qwen-image-edit has no sequence parallelism yet .*run without --sp"),
])
def test_prompt_sets_and_flags_it_cannot_serve_are_refused_at_start_up(tmp_path, case, needle):
    """Each refusal is one line naming the problem and the fix, raised by startup.check_args before anything is
    built."""
    change = {"no images": dict(prompts="general"), "text to image": dict(model="tiny"), "sp": dict(sp=2)}[case]
    args = dataclasses.replace(flowgrpo.RECIPES[MODEL], **({"prompts": edit_prompts(tmp_path)} | change))
    with pytest.raises(ValueError, match=needle) as refusal:
        startup.check_args(args)
    assert "\n" not in str(refusal.value)
