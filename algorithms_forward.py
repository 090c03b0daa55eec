"""The forward-process algorithms `--algorithm` chooses (docs/algorithm.md §12): DiffusionNFT (`nft`) and Advantage
Weighted Matching (`awm`). They train on the rollout's final clean latents re-noised at drawn timesteps: any ODE
sampler, no log-probs, no trajectory; each keeps an old policy (engine.OldPolicy) that moves by a decay schedule.
What they share with the other rows (advantages, the table) is in algorithms.py, which imports this file; the
preference rows built on the same update are in algorithms_preference.py. `a` is the run's flags, read by name.
"""
import functools
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

import regularisers as reg
import rollout
import scheduler as sch


# ---- how advantages become each algorithm's per-image weights ----------------------------------------------------
def nft_weights(adv: torch.Tensor, r: torch.Tensor, a) -> torch.Tensor:
    """DiffusionNFT's r ∈ [0, 1]: the advantage clipped to ±c (--adv-clip) and mapped linearly, r = A/(2c) + 1/2."""
    return torch.clamp((adv.clamp(-a.adv_clip, a.adv_clip) / a.adv_clip) / 2.0 + 0.5, 0, 1)


def awm_weights(adv: torch.Tensor, r: torch.Tensor, a) -> torch.Tensor:
    """AWM's weight: the advantage clipped to ±c and divided by c (its advantage_max 1), in [−1, 1]."""
    return adv.clamp(-a.adv_clip, a.adv_clip) / a.adv_clip



# ---- the forward-process losses on given tensors (tests/test_nft_awm.py re-types the public code) ----------------

def nft_objective(v, v_old, v_ref, x0, xt, t, r, *, beta: float, adv_clip: float, kl_beta: float):
    """DiffusionNFT's loss at one timestep per image. v, v_old, v_ref: (b, *L) velocities of the trained, old and
    reference policy at x_t (v_ref None: no KL term); x0, xt: (b, *L); t: (b,) σ; r: (b,) in [0, 1]. The implicit
    positive and negative policies v± = β·v + (1 − β)·v_old and (1 + β)·v_old − β·v each predict x̂0 = x_t − t·v±;
    each squared x0 error is divided by its own mean absolute error (detached, ≥ 1e-5, float64, per image), and
    L = c·mean(r·L₊/β + (1 − r)·L₋/β) + kl_beta·mean((v − v_ref)²). Returns (loss, detached statistics)."""
    v, v_old = v.float(), v_old.float()
    dims = tuple(range(1, x0.dim()))
    te = t.view(-1, *[1] * (x0.dim() - 1))

    def x0_loss(prediction):  # (b,) float64: the x0 error over its adaptive weight
        x0_hat = xt - te * prediction
        with torch.no_grad():
            weight = torch.abs(x0_hat.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=0.00001)
        return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)
    positive = x0_loss(beta * v + (1 - beta) * v_old.detach())
    negative = x0_loss((1.0 + beta) * v_old.detach() - beta * v)
    policy = ((r * positive / beta + (1.0 - r) * negative / beta) * adv_clip).mean()
    kl = ((v - v_ref.float()) ** 2).mean(dim=dims).mean() if v_ref is not None else torch.zeros((), device=v.device)
    stats = {"policy_loss": policy.detach(), "kl": kl.detach(), "old_kl": ((v - v_old) ** 2).mean().detach()}
    return policy + kl_beta * kl, stats


AWM_GHUBER_POWER = 0.25  # the public recipes' ghuber_power (AWM's config/dgx_awm.py, every SD3.5 recipe)


def awm_objective(v, v_ref, v_old, x0, noise, t, w, *, kl_beta: float, old_kl: float):
    """AWM's loss at one timestep per image (its recipes: `ghuber` weighting, `exp_first`, on-policy). v, v_ref, v_old:
    (b, *L) (v_ref / v_old None: that term off); noise, x0: (b, *L); t: (b,) σ; w: (b,) = clip(A)/c. Its log-likelihood
    surrogate is the flow-matching error e = mean((v − (ε − x0))²), log p = −((e + 1e-10)^p − (1e-10)^p)·t/p with
    p = AWM_GHUBER_POWER, the ratio exp(log p − log p_old) with log p_old = log p detached (it is the policy that
    sampled: the ratio is 1, its PPO clip never acts, the gradient is −w·∇log p), and the regularisers are the mean
    squared velocity gaps to the reference and to the old policy. All in float64, as the public code."""
    dims = tuple(range(1, x0.dim()))
    v = v.double()
    error = ((v - (noise.double() - x0.double())) ** 2).mean(dim=dims)
    eps = torch.tensor(1e-10, device=v.device, dtype=torch.float64)
    logp = -(torch.pow(error + 1e-10, AWM_GHUBER_POWER) - torch.pow(eps, AWM_GHUBER_POWER)) * t / AWM_GHUBER_POWER
    policy = (-w * torch.exp(logp - logp.detach())).mean()

    def gap(other):  # mean squared velocity difference, or 0 for a term that is off
        return ((v - other.double()) ** 2).mean(dim=dims).mean() if other is not None else v.new_zeros(())
    kl, okl = gap(v_ref), gap(v_old)
    stats = {"policy_loss": policy.detach(), "kl": kl.detach(), "old_kl": okl.detach()}
    return policy + kl_beta * kl + old_kl * okl, stats


# ---- the forward-process update: per image T timesteps and noises, three (or two) forwards each ----------

def reference(engine, velocity, weight: float):
    """The reference policy's velocity (the adapter off), or None when its term has no weight (the pass is saved)."""
    if not weight > 0:
        return None
    with torch.no_grad(), engine.reference():
        return velocity()


def old(engine, velocity, weight: float):
    """The old policy's velocity, or None when its term has no weight."""
    if not weight > 0:
        return None
    with torch.no_grad(), engine.old_weights():
        return velocity()


def nft_loss(model, engine, mb: rollout.Batch, t, noise, a):
    """DiffusionNFT on a micro-batch at σ = t (b,) with noise (b, *L): the old policy's forward first (no gradient),
    then the trained one's, then the reference's (no gradient)."""
    xt = sch.noised(mb.x0, t, noise)
    velocity = functools.partial(model.velocity, xt, t, mb.cond, a.cfg_scale, a.height, a.width)
    v_old = old(engine, velocity, 1.0)
    v = velocity()
    return nft_objective(v, v_old, reference(engine, velocity, a.kl_beta), mb.x0, xt, t, mb.advantages,
                         beta=a.nft_beta, adv_clip=a.adv_clip, kl_beta=a.kl_beta)


def awm_loss(model, engine, mb: rollout.Batch, t, noise, a):
    """AWM on a micro-batch at σ = t (b,) with noise (b, *L); the old policy's forward (its regulariser) first."""
    xt = sch.noised(mb.x0, t, noise)
    velocity = functools.partial(model.velocity, xt, t, mb.cond, a.cfg_scale, a.height, a.width)
    v_old = old(engine, velocity, a.old_kl)
    v = velocity()
    return awm_objective(v, reference(engine, velocity, a.kl_beta), v_old, mb.x0, noise, t, mb.advantages,
                         kl_beta=a.kl_beta, old_kl=a.old_kl)


def nft_timesteps(g: torch.Generator, a) -> torch.Tensor:
    """DiffusionNFT's: T distinct schedule steps of --train-timestep-range [lo, hi), a fresh permutation per image."""
    lo, hi = a.train_timestep_range
    return lo + torch.randperm(hi - lo, generator=g)[:a.train_timesteps]


def awm_strata(a) -> tuple[torch.Tensor, torch.Tensor]:
    """AWM's discrete strata of [lo, hi): bounds linspace(lo, hi, T + 1) rounded down; (lower, upper), (T,) each."""
    bounds = torch.linspace(*a.train_timestep_range, steps=a.train_timesteps + 1).long()
    return bounds[:-1], bounds[1:]


def awm_timesteps(g: torch.Generator, a) -> torch.Tensor:
    """AWM's: one schedule step drawn uniformly in each stratum (per image here; AWM draws one set per micro-batch)."""
    lower, upper = awm_strata(a)
    return lower + (torch.rand(a.train_timesteps, generator=g) * (upper - lower)).long()


TRAIN_STREAM = -2  # iteration it's update noise: seeds image_seed(seed, TRAIN_STREAM − it, id), which no rollout
# (iteration >= 0) or evaluation (−1) uses: per image, so it does not depend on ranks, micro-batches or a resume


def update_generator(a, iteration: int, image: int) -> torch.Generator:
    """The generator of image `image`'s update draws in iteration `iteration` (−1: no image's, the iteration's own)."""
    return torch.Generator().manual_seed(rollout.image_seed(a.seed, TRAIN_STREAM - iteration, image))


def draws(mb: rollout.Batch, a, schedule: torch.Tensor, timesteps: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's T timesteps (b, T) σ and noises (b, T, *L), from its own generator: first the steps, then the noise."""
    gens = [update_generator(a, mb.iteration, i) for i in mb.ids.tolist()]
    steps = torch.stack([timesteps(g, a) for g in gens])
    noise = torch.stack([torch.randn((a.train_timesteps, *mb.x0.shape[1:]), generator=g) for g in gens])
    return schedule[steps].to(mb.x0.device), noise.to(mb.x0.device)


OLD_DECAYS = {  # name: (what n counts, flat, rate, hold): the old policy's decay d(n) = 0 for n < flat, else
    # min((n − flat)·rate, hold), at n optimizer steps (DiffusionNFT's and AWM's global_step) or iterations (verl-omni)
    "nft0": ("steps", 0, 0.0, 0.0),  # DiffusionNFT's decay_type 0: the old policy is a copy
    "nft1": ("steps", 0, 0.001, 0.5),  # decay_type 1, config/nft.py's default
    "nft2": ("steps", 75, 0.0075, 0.999),  # decay_type 2, its OCR recipe
    "nft2-iterations": ("iterations", 75, 0.0075, 0.999),  # verl-omni's delayed_linear_to_0_999
    "awm": ("steps", 0, 0.001, 0.3),  # AWM's linear kl_ema_decay: min(0.3, 0.001·n)
    "dgpo": ("steps", 1, 0.001, 0.3),  # DGPO's ema_ref: min(0.3, 0.001·n) at its step count n before the step
}


def old_decay(name: str, n: int) -> float:
    _, flat, rate, hold = OLD_DECAYS[name]
    return 0.0 if n < flat else min((n - flat) * rate, hold)


def move_old(engine, a, iteration: int) -> None:
    """After iteration `iteration` (from 0), every --old-every iterations: old ← old·d + θ·(1 − d) (engine.OldPolicy)."""
    done = iteration + 1
    if done % a.old_every == 0:
        n = done * a.optimizer_steps if OLD_DECAYS[a.old_decay][0] == "steps" else done
        engine.old.blend(old_decay(a.old_decay, n))


def sampling_schedule(model, a) -> torch.Tensor:
    """The rollout's σ_0 … σ_N (--num-steps), which the timesteps index."""
    return sch.sigma_schedule(model.scheduler, a.num_steps, model.image_seq_len(a.height, a.width))


def train_forward(model, engine, batch: rollout.Batch, a, arith: dict, progress: bool, *, loss, timesteps,
                  draw: Callable = draws, schedule: Callable = sampling_schedule, move: Callable = move_old) -> dict:
    """`optimizer_steps` steps, each accumulating gradients over its micro-batches × the T timesteps drawn for each
    image (one backward per timestep, as train_on per trained step), then the old policy's `move`. `draw`: how a
    micro-batch's timesteps and noises are drawn (`draws`: each image its own) from the σ `schedule` gives."""
    per_step, T = arith["micro_batches_per_optimizer_step"], a.train_timesteps
    model = reg.Watched(model, engine, a)  # --normguard: the velocity-norm hinge on every trained forward
    schedule = schedule(model, a)
    logs = []
    bar = tqdm(total=arith["micro_batches_per_rank"] * T, desc="train", unit="step", disable=not progress, leave=False)
    for k in range(a.optimizer_steps):
        for m in range(k * per_step, (k + 1) * per_step):
            mb = batch.chunk(m * a.micro_batch, (m + 1) * a.micro_batch)
            sigmas, noise = draw(mb, a, schedule, timesteps)  # (b, T), (b, T, *L)
            for j in range(T):
                value, stats = loss(model, engine, mb, sigmas[:, j], noise[:, j], a)
                (model.added(value) / (T * per_step)).backward()  # the mean over timesteps and micro-batches
                logs.append(stats)
                bar.update()
        grad_norm, skipped = engine.step()
        logs[-1] |= {"grad_norm": grad_norm, "skipped_fraction": float(skipped)}
    bar.close()
    move(engine, a, batch.iteration)
    keys = dict.fromkeys(k for s in logs for k in s)  # every statistic some loss reported, in order
    means = {k: float(np.mean([float(s[k]) for s in logs if k in s])) for k in keys}
    return {f"train/{k}": v for k, v in means.items()} | {"train/skipped_steps": engine.skipped_steps} | model.stats()


def check_forward(a) -> None:
    """The forward-process flags: an ODE-only rollout, T >= 1 timesteps from [lo, hi) of the --num-steps schedule."""
    sch.check_variants(a.num_steps, 0, a.window_range, sde_type=a.sde_type, noise_level=a.noise_level,
                       window_schedule=a.window_schedule, ode_solver=a.ode_solver)
    lo, hi = a.train_timestep_range
    if not 0 <= lo < hi <= a.num_steps:
        raise ValueError(f"--train-timestep-range [{lo}, {hi}) must be a non-empty range of schedule steps, inside "
                         f"[0, {a.num_steps}] (--num-steps)")
    if a.train_timesteps < 1 or a.old_every < 1:
        raise ValueError(f"--train-timesteps and --old-every must be >= 1, got {a.train_timesteps}, {a.old_every}")


def check_distinct(a, name: str = "DiffusionNFT") -> None:
    """The forward flags, and T distinct steps of [lo, hi) (nft_timesteps draws them without replacement)."""
    check_forward(a)
    lo, hi = a.train_timestep_range
    if a.train_timesteps > hi - lo:
        raise ValueError(f"--train-timesteps {a.train_timesteps}: {name} draws that many distinct steps of "
                         f"--train-timestep-range [{lo}, {hi}), which has {hi - lo}")


def check_awm(a) -> None:
    check_forward(a)
    lower, upper = awm_strata(a)
    if not bool((upper > lower).all()):
        raise ValueError(f"--train-timesteps {a.train_timesteps}: AWM cuts --train-timestep-range "
                         f"{list(a.train_timestep_range)} into that many strata of whole steps, and some are empty: use "
                         f"at most {a.train_timestep_range[1] - a.train_timestep_range[0]}")
