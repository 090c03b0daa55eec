"""Z-Image and FLUX.2 [klein] through the real vLLM-Omni 0.30.0 server: omni.pipeline_2026.FlowGRPOZImagePipeline
serves tiny-z-image and omni.pipeline_2026.FlowGRPOFlux2KleinPipeline tiny-flux.2-klein (the base model's form: CFG
applies), each family's pipeline directory from models.save_tiny_pipeline, one server per family reused by all of that
family's tests (one request a pass: neither parent batches requests).

The served trajectories equal the local backend's (same seeds, the same LoRA on the adapter's default targets, with
and without CFG and a negative prompt); their σ equal the trainer's to the bit; a 2-iteration run of the family's tiny
recipe with `--rollout vllm-omni` has a tiny `train/logp_gap`.

Tolerances: test_omni_families.py's bounds (TOL 1e-5 on latents, log-probs and images; GAP_TOL 2e-5), for the same
reasons (float32 on CPU, vLLM-Omni's fused-projection transformers against diffusers'). Measured (4 steps, 32², the
same values in two runs): Z-Image's latents within 3.6e-7 without CFG and 1.6e-6 with CFG 5 and cps, log-probs within
1.2e-7, images within 1.4e-6, the trainer's log-prob of the served transitions within 1.2e-7; FLUX.2 [klein]'s latents
within 4.8e-7 (CFG 4 and a negative prompt included), log-probs within 1.2e-7, images within 1.8e-6, the trainer's
log-prob of the served transitions equal to the bit; a recipe run's `train/logp_gap` at most 2.5e-8 (Z-Image) and 0
(klein). The LoRA moves the images by 3.2e-3 (klein) and 0.18 (Z-Image) and the negative prompt klein's latents by more
than 1e-3 (asserted): what the bounds exist to catch is 100 times larger.
"""
import pytest
import torch

from test_omni_families import (TOL, serve, served_equals_local, served_sigmas_equal_the_trainers,
                                short_run_serves_new_adapters)

import rollout_backends

H = W = 32
KW = dict(num_steps=4, height=H, width=W, noise_level=0.7, seed=0, iteration=3, chunk=8)
PROMPTS = ["a red cube on a table", "a blue ball", "a red cube on a table", "a blue ball", "a red cube on a table"]
# (steps, cfg_scale, negative prompt, sde_type) per family: without CFG, then with CFG and a negative prompt (Z-Image's
# --cfg-scale 5 is its guidance 4, the recipe's)
CASES = {"tiny-z-image": [([0, 1, 2], 1.0, "", "sde"), ([1, 2], 5.0, "blurry", "cps")],
         "tiny-flux.2-klein": [([0, 1, 2], 1.0, "", "sde"), ([1, 2], 4.0, "blurry", "cps")]}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    """One family's pipeline on disk, its server and the trainer's side: the adapter loaded from the same directory,
    with LoRA on its default targets."""
    yield from serve(tmp_path_factory, request.param, [])


def test_served_trajectories_equal_the_local_backend(family, tmp_path):
    model, engine = family.model, family.engine
    backend = rollout_backends.OmniBackend(family.server.url, str(tmp_path), engine)
    group = torch.tensor([0, 1, 0, 1, 0])
    for steps, cfg, negative, sde_type in CASES[family.name]:
        served = served_equals_local(family, backend, PROMPTS, dict(KW, steps=steps, cfg_scale=cfg,
                                                                   negative_prompt=negative, sde_type=sde_type))
    if family.name == "tiny-flux.2-klein":  # the negative prompt counts (0.30.0's own pipeline encodes "" instead)
        kw = dict(KW, steps=[1, 2], cfg_scale=4.0, negative_prompt="", sde_type="cps")
        other = backend.sample(model, PROMPTS, [{}] * 5, group, range(5), **kw)
        assert (other.latents - served.latents).abs().max() > 100 * TOL
    backend.close()


def test_served_sigmas_equal_the_trainers_to_the_bit(family, tmp_path):
    """Over step counts and sizes (FLUX.2's shift depends on both, Z-Image's on neither)."""
    served_sigmas_equal_the_trainers(family, tmp_path)


def test_a_short_run_of_the_recipe_serves_each_iteration_a_new_adapter(family, tmp_path):
    """The family's tiny recipe with --rollout vllm-omni for 2 iterations (flowgrpo.main in this process): the server
    samples each iteration with a new adapter version, and the trainer's log-prob of the served transitions is the
    server's within 1e-6 (train/logp_gap)."""
    short_run_serves_new_adapters(family, tmp_path)
