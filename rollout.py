"""Rollout: sample images and the trajectories the policy update needs (the data contract: `Batch` below,
docs/algorithm.md §9).

The trainer's own transformer samples under `no_grad` (`sample`: the `local` backend), so each iteration's first
update sees exactly the weights, shapes and kernels that produced the data (ratio == 1). Each image draws its
noise from its own generator, seeded by (seed, iteration, global image index): images do not depend on
chunking or ranks. Who samples (`--rollout`: this sampler, or vLLM-Omni servers returning the same `Batch` through
their HTTP client) is rollout_backends.py's choice.
"""
import contextlib
import dataclasses
import functools

import torch
from tqdm import tqdm

import scheduler as sch


@dataclasses.dataclass
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
    images: torch.Tensor  # (B, 3, H, W) float32 in [0, 1]; videos (B, F, 3, H, W) (docs/algorithm.md §13)
    advantages: torch.Tensor | None = None  # (B,) the update's per-image weights, set by the loop after the rewards
    means: torch.Tensor | None = None  # (B, W, S, C) float32: behaviour means of the trained transitions
    weights: torch.Tensor | None = None  # (B,) each image's weight in the loss mean, set by the loop (None: 1)
    x0: torch.Tensor | None = None  # (B, S, C) float32: each image's final latents (the forward-process algorithms')
    ids: torch.Tensor | None = None  # (B,) long: global image index (with `iteration`, it seeds the image's noise)
    behaviour_log_probs: torch.Tensor | None = None  # (B, W): the sampler's, where log_probs were recomputed (decoupled)
    is_weights: torch.Tensor | None = None  # (B, W): each transition's truncated importance weight (0: rejected)
    iteration: int = 0
    graphs: dict | None = None  # (a micro-batch's first image id, j) -> velocity (b, S, C) with its graph (`sample`'s keep)

    def chunk(self, start: int, stop: int) -> "Batch":
        """Images [start, stop) as a Batch (views, no copies): every per-image field sliced, the schedule shared."""
        s, shared = slice(start, stop), {"sigmas", "sigma_max", "iteration", "cond", "graphs"}
        per_image = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in shared}
        return dataclasses.replace(self, cond={k: v[s] for k, v in self.cond.items()},
                                   **{k: None if v is None else v[s] for k, v in per_image.items()})


def image_seed(seed: int, iteration: int, image_id: int) -> int:
    """The seed of one image's generator, from (seed, iteration, global image index)."""
    return ((seed * 1_000_003 + iteration) * 1_000_003 + int(image_id)) % 2**63


def image_generators(seed: int, iteration: int, image_ids) -> list[torch.Generator]:
    """One CPU generator per image, from (seed, iteration, global image index): rank- and chunk-invariant."""
    return [torch.Generator().manual_seed(image_seed(seed, iteration, i)) for i in image_ids]


def branch_prefixes(model, prompts: list[str], metadata: list[dict], group: torch.Tensor, *, sigmas: torch.Tensor,
                    start: int, negative_prompt: str, cfg_scale: float, seed: int, iteration: int, height: int,
                    width: int) -> dict[int, torch.Tensor]:
    """{group id: (1, S, C) float32, the state at σ_start that all the group's images share}: the group's own
    initial noise (seeded as image index −1 − g, which no image has), then the `start` Euler steps before the
    window. Each group is computed alone (its prompt encoded alone, batch 1), so the bits do not depend on
    what else a rank holds: every rank holding part of a group computes the same prefix."""
    prefixes = {}
    for g, i in {g: i for i, g in enumerate(group.tolist())}.items():  # a group's images share prompt and metadata
        cond = model.conditioning([prompts[i]], negative_prompt, cfg_scale, [metadata[i]], height, width)
        x = model.noise([torch.Generator().manual_seed(image_seed(seed, iteration, -1 - g))], height, width)
        velocity = functools.partial(model.velocity, cond=cond | model.rollout_cache(), cfg_scale=cfg_scale,
                                     height=height, width=width)
        prefixes[g] = sch.ode_euler(velocity, x, sigmas[:start + 1])
    return prefixes


@torch.no_grad()
def sample(model, prompts: list[str], metadata: list[dict], group, image_ids, *, steps: list[int], num_steps: int,
           height: int, width: int, cfg_scale: float, negative_prompt: str, noise_level: float, sde_type: str,
           seed: int, iteration: int, chunk: int, progress: bool = False, on_images=None, branch: bool = False,
           ode_solver: str = "euler", keep: int = 0) -> Batch:
    """Sample B images in chunks of `chunk`; SDE (recorded) on `steps` (consecutive: full or window mode),
    ODE elsewhere (no steps and noise 0: the evaluation sampler). Work: one transformer call per step per CFG
    branch, one VAE decode per image, as diffusers' pipeline. `on_images(start, images)` gets each chunk's
    images once decoded (the loop scores them while the next chunk samples).
    branch: a group's images share their initial noise and the s = steps[0] ODE steps before the window
    (`branch_prefixes`, once per group on each rank that holds part of it) and branch there into their own
    SDE steps: s + G·(N − s) calls per group instead of G·N.
    ode_solver: how the ODE steps after the window are taken (scheduler.ODE_SOLVERS: `euler`, `dpm2` (diffusers'
    DPM-Solver++(2M) on MixGRPO-Flash's 0.4·(K + 1) σ points) or `dpm2-full`); the trained steps and stored latents
    do not change.
    No steps (evaluation; the forward-process algorithms' rollout): `ode_solver` walks the whole schedule and the batch
    holds no log-probs and no per-step latents, only the images and their final latents `x0` (docs/algorithm.md §9).
    keep: the first `keep` images' trained steps run with autograd on and their velocities, graphs and all, go to
    `Batch.graphs` (the first optimizer step's update reuses them: --reuse-rollout-forward); the rest is unchanged."""
    assert list(steps) == list(range(steps[0], steps[0] + len(steps))) if steps else True, f"not consecutive: {steps}"
    if branch and not steps:
        raise ValueError("branching needs SDE steps to branch into (a window); the ODE-only sampler has none")
    sigmas = sch.sigma_schedule(model.scheduler, num_steps, model.image_seq_len(height, width))
    sigma_max = float(sigmas[1])
    group = torch.as_tensor(group)
    cond = model.conditioning(prompts, negative_prompt, cfg_scale, metadata, height, width)
    gens = image_generators(seed, iteration, image_ids)  # each image's own noise: initial (unless branched) and SDE
    start = steps[0] if branch else 0  # the first step an image takes on its own
    tail = steps[-1] + 1 if steps else start  # the first step after the window (none: 0): ODE_SOLVERS[ode_solver] on
    shared = branch_prefixes(model, prompts, metadata, group, sigmas=sigmas, start=start,
                             negative_prompt=negative_prompt, cfg_scale=cfg_scale, seed=seed, iteration=iteration,
                             height=height, width=width) if branch else {}
    tail_calls = sch.ode_calls(ode_solver, num_steps - tail)
    latents, log_probs, means, images, x0, graphs = [], [], [], [], [], {}
    bar = tqdm(total=len(prompts) * (tail - start + tail_calls), desc="rollout", unit="step", disable=not progress,
               leave=False)
    for c in range(0, len(prompts), chunk):
        b_gens = gens[c:c + chunk]
        b_cond = {k: v[c:c + chunk] for k, v in cond.items()} | model.rollout_cache()  # the batch keeps `cond` alone
        velocity = functools.partial(model.velocity, cond=b_cond, cfg_scale=cfg_scale, height=height, width=width)
        # (b, S, C) float32 at σ_start: the groups' shared prefixes, or each image's own noise at σ = 1
        b_group = group[c:c + chunk].tolist()
        x = torch.cat([shared[g] for g in b_group]) if branch else model.noise(b_gens, height, width)
        states, lps, mus = [], [], []
        for i in range(start, tail):
            sde = i in steps
            if sde and not states:
                states.append(x)
            with torch.enable_grad() if sde and c < keep else contextlib.nullcontext():
                v = velocity(x, sigmas[i].expand(x.shape[0]))
            if v.requires_grad:  # the update's forward of (chunk, trained step j); the rollout goes on without its graph
                graphs[int(image_ids[c]), len(lps)], v = v, v.detach()
            x, log_prob, mean, _ = sch.step(v, x, sigmas[i], sigmas[i + 1], sigma_max=sigma_max,
                                            noise_level=noise_level if sde else 0, sde_type=sde_type, generator=b_gens)
            if sde:
                states.append(x)
                lps.append(log_prob)
                mus.append(mean)
            bar.update(x.shape[0])
        x = sch.ODE_SOLVERS[ode_solver](velocity, x, sigmas[tail:])
        bar.update(x.shape[0] * tail_calls)
        latents.append(torch.stack(states, 1) if states else x.new_zeros(x.shape[0], 0, *x.shape[1:]))
        log_probs.append(torch.stack(lps, 1) if lps else x.new_zeros(x.shape[0], 0))
        means.append(torch.stack(mus, 1) if mus else x.new_zeros(x.shape[0], 0, *x.shape[1:]))
        x0.append(x.float())
        images.append(model.decode(x, height, width))
        if on_images:
            on_images(c, images[-1])
    bar.close()
    trained = sigmas[steps[0]:steps[-1] + 2] if steps else sigmas[:0]
    return Batch(list(prompts), list(metadata), group, torch.cat(latents), torch.cat(log_probs), trained, sigma_max,
                 cond, torch.cat(images), means=torch.cat(means), x0=torch.cat(x0), ids=torch.as_tensor(image_ids),
                 iteration=iteration, graphs=graphs)


def sample_ode(model, prompts: list[str], *, num_steps: int, height: int, width: int, cfg_scale: float,
               negative_prompt: str, seed: int, chunk: int, first: int = 0, metadata=None) -> torch.Tensor:
    """Evaluation images (B, 3, H, W): deterministic ODE sampling (noise 0), fixed per-image seeds; the prompts (and
    their `metadata`, e.g. source images) are evaluation images first, first + 1, ... (seeds independent of ranks)."""
    n = range(first, first + len(prompts))
    return sample(model, prompts, metadata or [{}] * len(n), n, n, steps=[], num_steps=num_steps, height=height,
                  width=width, cfg_scale=cfg_scale, negative_prompt=negative_prompt, noise_level=0.0, sde_type="sde",
                  seed=seed, iteration=-1, chunk=chunk).images
