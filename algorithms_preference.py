"""The preference algorithms `--algorithm` chooses (docs/algorithm.md §12): DGPO (`dgpo`), a group-level preference
loss on the rollout's final clean latents re-noised, trained by the forward-process update (algorithms_forward.py)
with two differences: timesteps shared by the whole iteration and one noise per group, and a micro-batch that holds
whole groups (the loop assigns groups, not images: `Algorithm.whole_groups`), because each image's weight depends
on its whole group's errors. What the rows share is in algorithms.py, which imports this file. `a` is the run's flags.
"""
import contextlib
import functools

import torch

import algorithms_forward as fwd
import rollout
import scheduler as sch


def dgpo_objective(v, v_old, v_ref, x0, noise, adv, group, *, beta: float, group_size: int, clip_range: float,
                   kl_beta: float, reference: str):
    """DGPO's loss at one timestep shared by the micro-batch (Luo-Yihong/DGPO `scripts/train_sd3_dgpo.py`, its
    `compute_group_dgpo_loss_allreduce` and the loop around it). v, v_old, v_ref: (b, *L) velocities of the trained
    policy, the old one (its EMA reference) and the reference model (adapter off; None when no term reads it); x0,
    noise: (b, *L); adv: (b,) clipped advantages; group: (b,) group ids, every group whole in the micro-batch.

    d = mean((ε − x0 − v)²) per image, PPO-clipped on the ratio exp(d_old − d) at 1 ± ε (the gradient of an image whose
    ratio already moved the way A pushes is stopped); each group's weight σ(Σ_group A·β·(d − d_ref)/G), no gradient,
    with d_ref the reference model's error (`base`) or the old policy's (`old`, TDM-R1's dynamic reference); and
    L = mean(weight·A·d) + kl_beta·mean((v − v_ref)²). Returns (loss, detached statistics)."""
    dims = tuple(range(1, x0.dim()))
    target = (noise - x0).float()

    def error(velocity):  # (b,) the flow-matching error of one policy
        return ((target - velocity.float()) ** 2).mean(dim=dims)
    d = error(v)
    with torch.no_grad():
        d_old = error(v_old)
        ratio = torch.exp(d_old - d)
        clipped = torch.where(adv > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
        d_ref = error(v_old if reference == "old" else v_ref)
        _, index = torch.unique(group, return_inverse=True)  # (b,) each image's group, from 0
        sums = torch.zeros(int(index.max()) + 1, dtype=d.dtype, device=d.device)
        weight = torch.sigmoid(sums.scatter_add_(0, index, adv * beta * (d - d_ref) / group_size))[index]
    d = torch.where(clipped, d.detach(), d)
    policy = (weight * adv * d).mean()
    kl = ((v.float() - v_ref.float()) ** 2).mean(dim=dims).mean() if kl_beta > 0 else torch.zeros((), device=v.device)
    stats = {"policy_loss": policy.detach(), "kl": kl.detach(), "clipfrac": clipped.float().mean(),
             "group_weight": weight.mean()}
    return policy + kl_beta * kl, stats


def dgpo_loss(model, engine, mb: rollout.Batch, t, noise, a):
    """DGPO on a micro-batch at σ = t (b,) with noise (b, *L): the old policy's forward (its clip and EMA reference),
    the reference model's where a term reads it, then the trained one's; all without CFG, as its training does."""
    xt = sch.noised(mb.x0, t, noise)
    velocity = functools.partial(model.velocity, xt, t, mb.cond, 1.0, a.height, a.width)
    v_old = fwd.old(engine, velocity, 1.0)
    v_ref = fwd.reference(engine, velocity, float(a.kl_beta > 0 or a.dgpo_reference == "base"))
    return dgpo_objective(velocity(), v_old, v_ref, mb.x0, noise, mb.advantages, mb.ids // a.group_size,
                          beta=a.dgpo_beta, group_size=a.group_size, clip_range=a.clip_range, kl_beta=a.kl_beta,
                          reference=a.dgpo_reference)


def group_draws(mb: rollout.Batch, a, schedule: torch.Tensor, timesteps) -> tuple[torch.Tensor, torch.Tensor]:
    """DGPO's draws: T distinct steps shared by every image of the iteration (its shared_sampled_timesteps, one
    generator per iteration) and one noise per group and timestep (its use_shared_noise, the generator of the group's
    first image). Returns σ (b, T) and noises (b, T, *L), as algorithms_forward.draws."""
    def generator(i: int) -> torch.Generator:  # image i's update generator (algorithms_forward.draws); −1 is no image
        return torch.Generator().manual_seed(rollout.image_seed(a.seed, fwd.TRAIN_STREAM - mb.iteration, i))
    steps = timesteps(generator(-1), a)  # (T,)
    first = (mb.ids // a.group_size * a.group_size).tolist()  # each image's group's first image
    shared = {i: torch.randn((a.train_timesteps, *mb.x0.shape[1:]), generator=generator(i)) for i in set(first)}
    noise = torch.stack([shared[i] for i in first])
    return schedule[steps].expand(len(first), -1).to(mb.x0.device), noise.to(mb.x0.device)


def dgpo_behaviour(engine, a, iteration: int):
    """DGPO samples with the trained weights, and with its EMA reference (the old policy) once more than
    --dgpo-switch optimizer steps are done (its switch_ema_ref)."""
    return engine.old_weights() if iteration * a.optimizer_steps > a.dgpo_switch else contextlib.nullcontext()


def check_dgpo(a) -> None:
    fwd.check_distinct(a, "DGPO")
    if a.micro_batch % a.group_size:
        raise ValueError(f"--micro-batch {a.micro_batch}: DGPO weighs each image by its whole group's errors, so a "
                         f"micro-batch holds whole groups: use a multiple of --group-size {a.group_size}")
