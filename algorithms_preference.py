"""The preference algorithms `--algorithm` chooses (docs/algorithm.md §12), both trained by the forward-process update
(algorithms_forward.py) on the rollout's final clean latents re-noised, on micro-batches of whole groups (the loop
assigns groups, not images: `Algorithm.whole_groups`):

- DGPO (`dgpo`): a group-level preference, each image weighted by its whole group's errors; timesteps shared by the
  whole iteration and one noise per group.
- Online Diffusion-DPO (`dpo`): the best and the worst image of each group as a pair, the same noise and timestep for
  both, and the DPO loss on the errors' gaps to the reference, which samples and is the old policy (a copy of the
  trained weights every --old-every iterations).

What the rows share is in algorithms.py, which imports this file. `a` is the run's flags.
"""
import contextlib
import functools

import torch
import torch.nn.functional as F

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
        index = torch.unique(group, return_inverse=True)[1].to(d.device)  # (b,) each image's group, from 0 (ids: CPU)
        sums = torch.zeros(len(index), dtype=d.dtype, device=d.device)  # at most b groups (their count is not read)
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
    steps = timesteps(fwd.update_generator(a, mb.iteration, -1), a)  # (T,)
    first = (mb.ids // a.group_size * a.group_size).tolist()  # each image's group's first image
    shared = {i: torch.randn((a.train_timesteps, *mb.x0.shape[1:]), generator=fwd.update_generator(a, mb.iteration, i))
              for i in set(first)}
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
    if a.full_finetune and a.dgpo_reference == "base":  # engine.reference() would refuse it in the first update
        raise ValueError("--dgpo-reference base with --full-finetune: DGPO's base reference is the network with the "
                         "adapter off, and a full fine-tune has no adapter: use --dgpo-reference old or a LoRA")


# ---- online Diffusion-DPO (flow_grpo scripts/train_sd3_dpo.py, its PerPromptStatTracker type "dpo") -----------------

def dpo_pairs(adv: torch.Tensor, r: torch.Tensor, a) -> torch.Tensor:
    """Each group's pair, as the public stat tracker picks it: +1 on the first image of the highest reward (winner),
    −1 on the first of the lowest (loser), 0 elsewhere (not trained); a group of equal rewards pairs its images 1
    (winner) and 0. r: (B,) this rank's rewards, whole groups in id order (Algorithm.whole_groups). Returns (B,)."""
    groups = r.double().view(-1, a.group_size)  # (B/G, G)
    best, worst = groups.argmax(1), groups.argmin(1)  # first occurrences, as torch.argmax on the public float64
    tied = best == worst
    best, worst = torch.where(tied, 1, best), torch.where(tied, 0, worst)
    out = torch.zeros_like(groups)
    rows = torch.arange(len(groups))
    out[rows, best] = 1.0
    out[rows, worst] = -1.0
    return out.flatten().float()


def dpo_objective(v, v_ref, x0, noise, *, beta: float):
    """The public DPO loss on m pairs: v, v_ref: (2m, *L) the trained and the reference velocities of the m winners
    then the m losers at the same (σ, noise) per pair; x0, noise: (2m, *L). With e = mean((v − (ε − x0))²) per image,
    −log σ(−β/2·((e_w − e_w^ref) − (e_l − e_l^ref))), averaged over the pairs. Returns (loss, detached statistics)."""
    n, m = x0.shape[0], x0.shape[0] // 2
    target = (noise - x0).float()
    theta = ((v.float() - target) ** 2).reshape(n, -1).mean(dim=1)  # (2m,) the trained policy's errors
    ref = ((v_ref.float() - target) ** 2).reshape(n, -1).mean(dim=1)
    gap = (theta[:m] - ref[:m]) - (theta[m:] - ref[m:])  # (m,) how much more the winner's error fell than the loser's
    inside = -0.5 * beta * gap
    loss = -F.logsigmoid(inside).mean()
    stats = {"policy_loss": loss.detach(), "implicit_acc": (inside > 0).float().mean(), "w_l_diff": gap.detach().mean()}
    return loss, stats


def dpo_loss(model, engine, mb: rollout.Batch, t, noise, a):
    """DPO on a micro-batch's pairs at σ = t (b,) with noise (b, *L) (the same for a pair: `dpo_draws`): one forward
    of the winners then the losers, without CFG as its training does; the reference's (the old policy, swapped into
    the weights) first, as its swap may not come between a forward and its backward."""
    adv = mb.advantages.cpu()  # the pairs' indices on the CPU: they index the conditioning kept there too (Qwen-Image
    pair = torch.cat([(adv > 0).nonzero()[:, 0], (adv < 0).nonzero()[:, 0]])  # 2.1's source_grid); (2m,) groups' order
    x0, t, noise = mb.x0[pair], t[pair], noise[pair]
    cond = {k: v[pair] for k, v in mb.cond.items()}
    velocity = functools.partial(model.velocity, sch.noised(x0, t, noise), t, cond, 1.0, a.height, a.width)
    v_ref = fwd.old(engine, velocity, 1.0)
    return dpo_objective(velocity(), v_ref, x0, noise, beta=a.dpo_beta)


def train_sigmas(model, a) -> torch.Tensor:
    """The scheduler's own training σ (diffusers builds num_train_timesteps = 1000 of them, SD3.5's shifted by 3; a
    dynamic-shift scheduler's unshifted): DPO's timesteps index them, not the rollout's."""
    return type(model.scheduler).from_config(model.scheduler.config).sigmas.float()


def logit_normal(g: torch.Generator, a) -> torch.Tensor:
    """T draws u = sigmoid(N(0, 1)) (diffusers' compute_density_for_timestep_sampling, weighting "logit_normal")."""
    return torch.sigmoid(torch.randn(a.train_timesteps, generator=g))


def dpo_draws(mb: rollout.Batch, a, schedule: torch.Tensor, timesteps) -> tuple[torch.Tensor, torch.Tensor]:
    """T (σ, noise) draws per group, from the generator of its first image: σ = schedule[int(u·len)] for u of
    `timesteps`, then the noises; a pair's two images share them. Returns σ (b, T) and noises (b, T, *L)."""
    first = (mb.ids // a.group_size * a.group_size).tolist()  # each image's group's first image
    drawn = {}
    for i in set(first):
        g = fwd.update_generator(a, mb.iteration, i)
        index = (timesteps(g, a) * len(schedule)).long()
        drawn[i] = schedule[index], torch.randn((a.train_timesteps, *mb.x0.shape[1:]), generator=g)
    sigmas, noise = (torch.stack([drawn[i][k] for i in first]).to(mb.x0.device) for k in (0, 1))
    return sigmas, noise


def copy_reference(engine, a, iteration: int) -> None:
    """After iteration `iteration` (from 0), every --old-every iterations: the reference ← the trained weights (its
    copy_learner_to_ref when global_step % ref_update_step == 0, which counts optimizer steps: the same at its one
    step an epoch)."""
    if (iteration + 1) % a.old_every == 0:
        engine.old.blend(0.0)


def full_mode(a, iteration: int) -> list[int]:
    """DPO's rollout: Flow-GRPO's full mode, SDE on every step but the last, whatever --window (its
    pipeline_with_logprob takes the last one with the SDE too: docs/algorithm.md §8, item 22)."""
    return sch.trained_steps(a.num_steps, 0, a.window_range, seed=0)


def check_dpo(a) -> None:
    sch.check_variants(a.num_steps, 0, a.window_range, sde_type=a.sde_type, noise_level=a.noise_level,
                       window_schedule=a.window_schedule, ode_solver=a.ode_solver)
    if a.group_size < 2 or a.micro_batch % a.group_size:
        raise ValueError(f"--micro-batch {a.micro_batch}, --group-size {a.group_size}: DPO pairs the best and the worst "
                         "image of each group, so a group has >= 2 images and a micro-batch holds whole groups: use a "
                         "multiple of --group-size")
    if a.train_timesteps < 1 or a.old_every < 1:
        raise ValueError(f"--train-timesteps and --old-every must be >= 1, got {a.train_timesteps}, {a.old_every}")
    if a.kl_beta > 0:
        raise ValueError(f"--kl-beta {a.kl_beta}: DPO's loss has no KL term (its reference enters the loss itself): "
                         "drop the flag")
