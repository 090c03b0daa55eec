"""Rollout: sample images and the trajectories the policy update needs (DESIGN.md, "Data contract").

Backend `local`: the trainer's own transformer samples under `no_grad`, so the first policy update of
an iteration sees exactly the weights, shapes and kernels that produced the data (ratio == 1).
Each image draws its initial noise and its SDE noise from its own generator, seeded by
(seed, iteration, global image index): the images do not depend on how the batch is chunked or split
over ranks.
"""
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import scheduler as sch


@dataclass
class Batch:
    """One rank's share of an iteration. B images, W trained steps, S latent tokens, C channels."""
    prompts: list[str]  # (B,)
    metadata: list[dict]  # (B,) handed to the reward
    group: torch.Tensor  # (B,) long: global prompt-group id (same across ranks)
    latents: torch.Tensor  # (B, W+1, S, C) float32: states before/after each trained transition
    log_probs: torch.Tensor  # (B, W) float32: behaviour log-probs of those transitions
    sigmas: torch.Tensor  # (W+1,) float32: σ of each stored state
    sigma_max: float  # σ_1 of the schedule (scheduler.step's σ̃ at σ = 1)
    cond: dict  # embeds (B, L, D), mask (B, L), and for CFG neg_embeds, neg_mask
    images: torch.Tensor  # (B, 3, H, W) float32 in [0, 1]
    rewards: torch.Tensor | None = None  # (B,) filled by the loop
    advantages: torch.Tensor | None = None  # (B,)
    info: dict = field(default_factory=dict)  # per-reward components, (B,) each

    def chunk(self, start: int, stop: int) -> "Batch":
        """Images [start, stop) as a Batch (views, no copies)."""
        s = slice(start, stop)
        return Batch(self.prompts[s], self.metadata[s], self.group[s], self.latents[s], self.log_probs[s],
                     self.sigmas, self.sigma_max, {k: v[s] for k, v in self.cond.items()}, self.images[s],
                     None if self.rewards is None else self.rewards[s],
                     None if self.advantages is None else self.advantages[s])


def image_generators(seed: int, iteration: int, image_ids) -> list[torch.Generator]:
    """One CPU generator per image, from (seed, iteration, global image index): rank- and chunk-invariant."""
    return [torch.Generator().manual_seed(((seed * 1_000_003 + iteration) * 1_000_003 + int(i)) % 2**63)
            for i in image_ids]


def encode_conditioning(model, prompts: list[str], negative_prompt: str, cfg_scale: float) -> dict:
    """Embeddings for B prompts (each distinct prompt encoded once) and, with CFG, the negative prompt."""
    distinct = list(dict.fromkeys(prompts))
    embeds, mask = model.encode(distinct)
    index = torch.tensor([distinct.index(p) for p in prompts], device=embeds.device)
    cond = {"embeds": embeds[index], "mask": mask[index]}
    if cfg_scale > 1:
        neg_embeds, neg_mask = model.encode([negative_prompt])
        cond["neg_embeds"] = neg_embeds.expand(len(prompts), -1, -1)
        cond["neg_mask"] = neg_mask.expand(len(prompts), -1)
    return cond


@torch.no_grad()
def sample(model, prompts: list[str], metadata: list[dict], group, image_ids, *, steps: list[int], num_steps: int,
           height: int, width: int, cfg_scale: float, negative_prompt: str, noise_level: float, sde_type: str,
           seed: int, iteration: int, chunk: int, progress: bool = False) -> Batch:
    """Sample B images in chunks of `chunk`; SDE (recorded) on `steps`, ODE elsewhere; decode final latents.

    `steps` must be consecutive (full or window mode, scheduler.trained_steps); an empty list with
    noise_level 0 is the ODE sampler used for evaluation. Work: one transformer call per step per
    CFG branch, one VAE decode per image, as diffusers' pipeline.
    """
    assert steps == list(range(steps[0], steps[0] + len(steps))) if steps else True, steps
    sigmas = sch.sigma_schedule(model.scheduler, num_steps, model.image_seq_len(height, width))
    sigma_max = float(sigmas[1])
    cond = encode_conditioning(model, prompts, negative_prompt, cfg_scale)
    gens = image_generators(seed, iteration, image_ids)
    latents, log_probs, images = [], [], []
    bar = tqdm(total=len(prompts) * num_steps, desc="rollout", unit="step", disable=not progress, leave=False)
    for c in range(0, len(prompts), chunk):
        b_gens = gens[c:c + chunk]
        b_cond = {k: v[c:c + chunk] for k, v in cond.items()}
        x = model.noise(b_gens, height, width)  # (b, S, C) float32 at σ = 1
        states, lps = [], []
        for i in range(num_steps):
            sde = i in steps
            if sde and not states:
                states.append(x)
            v = model.velocity(x, sigmas[i].expand(x.shape[0]), b_cond, cfg_scale, height, width)
            x, log_prob, _, _ = sch.step(v, x, sigmas[i], sigmas[i + 1], sigma_max=sigma_max,
                                         noise_level=noise_level if sde else 0, sde_type=sde_type, generator=b_gens)
            if sde:
                states.append(x)
                lps.append(log_prob)
            bar.update(x.shape[0])
        latents.append(torch.stack(states, 1) if states else x.new_zeros(x.shape[0], 0, *x.shape[1:]))
        log_probs.append(torch.stack(lps, 1) if lps else x.new_zeros(x.shape[0], 0))
        images.append(model.decode(x, height, width))
    bar.close()
    trained = sigmas[steps[0]:steps[-1] + 2] if steps else sigmas[:0]
    return Batch(list(prompts), list(metadata), torch.as_tensor(group), torch.cat(latents), torch.cat(log_probs),
                 trained, sigma_max, cond, torch.cat(images))


def sample_ode(model, prompts: list[str], *, num_steps: int, height: int, width: int, cfg_scale: float,
               negative_prompt: str, seed: int, chunk: int) -> torch.Tensor:
    """Evaluation images (B, 3, H, W): deterministic ODE sampling (noise 0), fixed per-image seeds."""
    batch = sample(model, prompts, [{}] * len(prompts), range(len(prompts)), range(len(prompts)), steps=[],
                   num_steps=num_steps, height=height, width=width, cfg_scale=cfg_scale,
                   negative_prompt=negative_prompt, noise_level=0.0, sde_type="sde", seed=seed, iteration=-1,
                   chunk=chunk)
    return batch.images
