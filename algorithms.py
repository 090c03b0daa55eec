"""The update rules `--algorithm` chooses (docs/algorithm.md §12), as one table: Flow-GRPO (`grpo`: SDE rollouts with
log-probs, and the PPO-clip loss with its variants' tables, docs/algorithm.md §6, §10) here; the forward-process
algorithms DiffusionNFT (`nft`) and Advantage Weighted Matching (`awm`), which train on the rollout's final clean
latents re-noised (any ODE sampler, no log-probs, no trajectory), in algorithms_forward.py; the preference algorithms
DGPO (`dgpo`) and online Diffusion-DPO (`dpo`) in algorithms_preference.py. All share the group-relative advantages,
here.

An algorithm is a row of small named pieces (`Algorithm`): the flags it uses, what the rollout records, which weights
sample, how advantages become the update's weights, the update itself and its start-up checks. The loop calls them
the same way for every algorithm. Nothing here knows a model family: the model is reached through its adapter's
`velocity` and scheduler, the data through the latents the rollout returned, so any adapter trains unchanged.
`a` is the run's flags (flowgrpo.Args), read by name: this file imports nothing of the loop.
"""
import contextlib
import functools
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

import algorithms_forward as fwd
import algorithms_preference as pref
import regularisers as reg
import rollout
import scheduler as sch


@dataclass(frozen=True)
class Algorithm:
    flags: frozenset  # the Args fields that only some algorithms use and this one does (the others are refused)
    rollout_steps: Callable  # (a, iteration) -> the SDE (recorded) step indices; []: an ODE-only rollout
    behaviour: Callable  # (engine, a, iteration) -> the context the rollout samples in (whose weights)
    weights: Callable  # (advantages (B,), rewards (B,), a) -> the update's per-image weights, into Batch.advantages
    update: Callable  # (model, engine, batch, a, arith, progress) -> {"train/...": float}
    keeps_old: bool  # the engine keeps an old policy (engine.OldPolicy)
    watch: str  # the statistic the progress bar shows
    check: Callable  # a -> None, or a ValueError naming the flag
    whole_groups: bool = False  # a micro-batch holds whole groups: the loop assigns groups, not images, to steps
    advantages: Callable | None = None  # (r_all, a, engine, batch, info, assignment) -> (A (N,) by id, zero-std
    # fraction); None: the group-relative ones (group_advantages)
    state: Callable | None = None  # engine -> what the algorithm carries between iterations, kept by a checkpoint
    # (its state_dict, JSON; load_state_dict checks what it reads); None: nothing beyond the weights


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


# ---- what the rollout records, and with which weights ---------------------------------------------

def sde_steps(a, iteration: int) -> list[int]:
    """Flow-GRPO's trained (SDE) steps: every step but the last, or this iteration's window (scheduler.py)."""
    return sch.trained_steps(a.num_steps, a.window, a.window_range, seed=a.seed * 100_003 + iteration,
                             iteration=iteration, schedule=a.window_schedule, slide_every=a.slide_every)


def no_steps(a, iteration: int) -> list[int]:
    """The forward-process rollout: `--ode-solver` on every step; the batch holds the images and final latents."""
    return []


def current_weights(engine, a, iteration: int):
    return contextlib.nullcontext()


def old_weights(engine, a, iteration: int):
    return engine.old_weights()


# ---- advantages, and how they become weights (tests/test_loop.py checks them by hand) ----------------------------

def group_advantages(r: torch.Tensor, group: torch.Tensor, *, std: str, clip: float,
                     eps: float = 1e-4) -> tuple[torch.Tensor, float]:
    """A_i = (r_i − mean of i's group) / (σ + eps), clipped; σ = std of the whole batch or of i's group (÷ n; ÷ n − 1
    for global-unbiased). r, group: (N,) over the iteration (all ranks). Returns (A (N,), fraction of zero-std groups)."""
    r = r.double()
    adv, zero = torch.zeros_like(r), 0
    for g in group.unique():
        idx = group == g
        sigma = (r[idx] if std == "group" else r).std(unbiased=std == "global-unbiased")
        # equal rewards have A = 0 exactly: their mean can miss them by an ulp (1 − 1/7 over 24 images: A ~ 1e-12, which
        # --zero-advantage drop kept and zero_std_ratio missed)
        spread = r[idx].max() > r[idx].min()
        adv[idx] = (r[idx] - r[idx].mean()) / (sigma + eps) * spread
        zero += int(not spread)
    return adv.clamp(-clip, clip).float(), zero / len(group.unique())


def advantages(algo: Algorithm, r_all: torch.Tensor, a, **iteration) -> tuple[torch.Tensor, float]:
    """The iteration's advantages (N,) by image id and the fraction of zero-std groups, as the row computes them."""
    if algo.advantages is None:
        return group_advantages(r_all, torch.arange(len(r_all)) // a.group_size, std=a.std, clip=a.adv_clip,
                                eps=a.adv_eps)
    return algo.advantages(r_all, a, **iteration)


def keep_zero_advantage(adv: torch.Tensor, assignment: torch.Tensor, optimizer_steps: int) -> torch.Tensor:
    """Every image weighs 1 in its optimizer step's loss mean, A = 0 or not. (N,) by image id."""
    return torch.ones_like(adv)


def drop_zero_advantage(adv: torch.Tensor, assignment: torch.Tensor, optimizer_steps: int) -> torch.Tensor:
    """Flow-GRPO's SD3 scripts drop every image whose A is exactly 0 before training. Here they stay in their chunks
    (the first update stays the rollout's computation) with weight 0, and the others of optimizer step k weigh
    n_k/kept_k, so that step's loss is the mean over its kept images of all ranks (docs/algorithm.md §6). (N,) by id."""
    steps = assignment.view(assignment.shape[0], optimizer_steps, -1).transpose(0, 1).flatten(1)  # (K, n_k) image ids
    kept = (adv[steps] != 0).float()
    weights = torch.zeros_like(adv)
    weights[steps] = kept * steps.shape[1] / kept.sum(1, keepdim=True).clamp(min=1)
    return weights


ZERO_ADVANTAGE = {"drop": drop_zero_advantage, "keep": keep_zero_advantage}  # --zero-advantage


def as_advantages(adv: torch.Tensor, r: torch.Tensor, a) -> torch.Tensor:
    return adv


# ---- Flow-GRPO's PPO-clip loss and its update (tests/test_loop.py, tests/test_parity.py check them) ---------------

def log_ratio(logp, mean, std, mb: rollout.Batch, j: int, a) -> torch.Tensor:
    """log(π_θ/π_old) of trained transition j, (b,), of the densities --cps-density names."""
    return CPS_DENSITIES[a.cps_density](logp - mb.log_probs[:, j], std, a.sde_type)


def guard_log_ratio(logp, mean, std, mb: rollout.Batch, j: int, a) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio (docs/algorithm.md §10), (b,): needs the behaviour means."""
    return sch.guard_log_ratio(logp, mb.log_probs[:, j], mean, mb.means[:, j], std)


# The loss's choices, each a table of small functions (the step math lives in scheduler.py; docs/algorithm.md §6, §10).
CPS_DENSITIES = {"public": sch.public_log_ratio, "exact": sch.exact_log_ratio}  # --cps-density
# --guard: the log-ratio, and the divisor of each step's policy loss
LOG_RATIOS = {"none": log_ratio, "full": guard_log_ratio, "ratio-norm": guard_log_ratio, "reweight": log_ratio}
REWEIGHTS = {"none": sch.no_reweight, "full": sch.guard_reweight, "ratio-norm": sch.no_reweight,
             "reweight": sch.guard_reweight}
NEEDS_MEANS = {g for g, f in LOG_RATIOS.items() if f is guard_log_ratio}  # --guard values that need Batch.means
KL_FORMS = {"public": sch.kl_public, "exact": sch.kl_exact}  # --kl-form


def clip_surrogate(adv, ratio, mean, std, mb: rollout.Batch, j: int, a) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate max(−A·r, −A·clip(r, 1 ± ε)), (b,), and where the clip acts (b,) bool."""
    clipped = ratio.clamp(1 - a.clip_range, 1 + a.clip_range)
    return torch.maximum(-adv * ratio, -adv * clipped), (ratio - 1).abs() > a.clip_range


def dppo_surrogate(adv, ratio, mean, std, mb: rollout.Batch, j: int, a) -> tuple[torch.Tensor, torch.Tensor]:
    """Flow-DPPO's trust region (docs/algorithm.md §10), (b,): the unclipped −A·r, replaced by a constant 0 where
    the transition's exact KL to the behaviour one exceeds --dppo-threshold and r has already moved the way A pushes
    it (r > 1 with A > 0, r < 1 with A < 0); and where it was replaced, (b,) bool."""
    kl = sch.kl_exact(mean, mb.means[:, j], std, None, a.sde_type)  # (b,): mean((μ − μ_old)²)/(2·std²)
    pushed = ((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0))
    masked = (kl >= a.dppo_threshold) & pushed
    return torch.where(masked, torch.zeros((), dtype=ratio.dtype, device=ratio.device), -adv * ratio), masked


TRUST_REGIONS = {"clip": clip_surrogate, "dppo": dppo_surrogate}  # --trust-region


def needs_means(a) -> bool:
    """Whether the update reads the behaviour policy's transition means (Batch.means), which a vLLM-Omni server
    does not return."""
    return a.guard in NEEDS_MEANS or a.trust_region == "dppo"


def transition(model, mb: rollout.Batch, j: int, a) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trained transition j of a micro-batch of b images under the current weights: the recorded step's log-prob (b,),
    the step's mean (b, S, C) and std. The velocity is the rollout's own, graph and all, where it kept one for this
    (micro-batch, j) (--reuse-rollout-forward: the weights have not moved since), each used once."""
    x, sigma = mb.latents[:, j].contiguous(), mb.sigmas[j]  # as the rollout's: a one-token image rounds by layout
    v = mb.graphs.pop((int(mb.ids[0]), j), None) if mb.graphs else None
    v = model.velocity(x, sigma.expand(x.shape[0]), mb.cond, a.cfg_scale, a.height, a.width) if v is None else v
    _, logp, mean, std = sch.step(v, x, sigma, mb.sigmas[j + 1], sigma_max=mb.sigma_max, noise_level=a.noise_level,
                                  sde_type=a.sde_type, x_next=mb.latents[:, j + 1])
    return logp, mean, std


def base_model(engine):
    """Flow-GRPO's KL reference: the network with the adapter off."""
    return engine.reference()


def old_policy(engine):
    """GARDO's: the old policy (engine.OldPolicy), reset to the trained weights now and then."""
    return engine.old_weights()


def weighted_kl(kl, mb: rollout.Batch, w) -> torch.Tensor:
    """Flow-GRPO's KL term of a micro-batch: each image's KL weighted as its policy loss (w), averaged over the images."""
    return (w * kl).mean()


def gated_kl(kl, mb: rollout.Batch, w, *, gate: torch.Tensor) -> torch.Tensor:
    """GARDO's: the mean over the images its gate (N,) by id chose and the zero-advantage rule kept, or 0."""
    return reg.gated_kl(kl, gate[mb.ids.cpu()].to(kl.device) & (w > 0))


def policy_loss(model, engine, mb: rollout.Batch, j: int, a, *, reference=base_model, kl_mean=weighted_kl
                ) -> tuple[torch.Tensor, dict]:
    """PPO's loss (and optional KL) of trained transition j for a micro-batch of b images, under the trust region
    --trust-region names, image i weighted by mb.weights[i] (none: 1; --zero-advantage drop gives A = 0 images weight
    0) and, with --stale-correction decoupled, transition (i, j) by its importance weight mb.is_weights[i, j]. The KL's
    reference: `reference(engine)`'s weights, its mean over the images `kl_mean` (logged: `kl_term`)."""
    sigma, sigma_next = mb.sigmas[j], mb.sigmas[j + 1]
    if a.kl_beta > 0:  # the reference first: an old policy is swapped into the weights, never between forward and backward
        x = mb.latents[:, j].contiguous()
        with torch.no_grad(), reference(engine):
            v_ref = model.velocity(x, sigma.expand(x.shape[0]), mb.cond, a.cfg_scale, a.height, a.width)
            _, _, mean_ref, _ = sch.step(v_ref, x, sigma, sigma_next, sigma_max=mb.sigma_max,
                                         noise_level=a.noise_level, sde_type=a.sde_type, x_next=mb.latents[:, j + 1])
    logp, mean, std = transition(model, mb, j, a)  # logp: (b,)
    delta = logp - mb.log_probs[:, j]
    log_r = LOG_RATIOS[a.guard](logp, mean, std, mb, j, a)
    ratio = torch.exp(log_r)
    adv = mb.advantages
    w = torch.ones_like(adv) if mb.weights is None else mb.weights
    surrogate, acted = TRUST_REGIONS[a.trust_region](adv, ratio, mean, std, mb, j, a)  # (b,), (b,) bool
    w_is = w if mb.is_weights is None else w * mb.is_weights[:, j]
    loss = (w_is * surrogate).mean() / REWEIGHTS[a.guard](sigma, sigma_next)
    # detached tensors, read once per iteration: an .item() here would sync the GPU every step
    stats = {"gap": delta.detach().abs().mean(), "clipfrac": acted.float().mean(),
             "approx_kl": 0.5 * (delta.detach() ** 2).mean(), "policy_loss": loss.detach(), "kl": torch.zeros(()),
             "log_ratio": log_r.detach()}
    if a.kl_beta > 0:
        kl = KL_FORMS[a.kl_form](mean, mean_ref, std, sigma_next - sigma, a.sde_type)  # (b,)
        term = kl_mean(kl, mb, w)
        loss = loss + a.kl_beta * term
        stats |= {"kl": kl.mean().detach(), "kl_term": term.detach()}
    return loss, stats


# ---- samples from older weights (--off-policy, --stale-correction; docs/algorithm.md §16) -------------------------

def correction_stats(log_ratio: torch.Tensor, applied: torch.Tensor | None) -> dict:
    """verl's rollout_corr/* metrics of the log-ratios log(π_current/π_behaviour) of (n, W) transitions, under the
    weights at the start of the update: the importance weights' mean, max and effective sample size (1: all equal),
    each trained step's mean |log-ratio|, and the fraction of transitions the correction gave weight 0."""
    w = log_ratio.double().exp()
    return {"rollout_corr/is_mean": w.mean().item(), "rollout_corr/is_max": w.max().item(),
            "rollout_corr/ess": (w.sum() ** 2 / (w.numel() * (w ** 2).sum())).item(),
            "rollout_corr/rejected_fraction": 0.0 if applied is None else (applied == 0).double().mean().item(),
            **{f"rollout_corr/logp_diff/step{j}": log_ratio[:, j].abs().mean().item() for j in range(w.shape[1])}}


def bypass(model, batch: rollout.Batch, a) -> None:
    """Flow-GRPO's own ratio, verl's bypass mode: PPO against the log-probs the sampler recorded, whichever weights
    sampled. Nothing to compute first; its metrics are read from the first optimizer step (train_on)."""
    return None


def decoupled(model, batch: rollout.Batch, a) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO: the proximal log-probs and transition means, recomputed (no grad) under the weights at the start
    of the update on the rollout's own chunks, become the ratio's and the trust region's reference (so the first
    update's ratio is exactly 1 again, GRPO-Guard's and DPPO's too), and each transition's loss is weighted by its
    importance weight min(π_prox/π_behaviour, --is-cap), or 0 where |log of it| exceeds --reject-band (> 0). Costs one
    forward per trained step of every image. Returns this rank's log-ratios and weights, (B, W) each."""
    W, b = len(batch.sigmas) - 1, a.micro_batch
    prox, log_is = torch.empty_like(batch.log_probs), torch.empty_like(batch.log_probs)  # (B, W)
    # the rollout keeps the means where the loss reads them
    means = torch.empty_like(batch.means) if batch.means is not None and batch.means.shape[1] == W else None
    with torch.no_grad():
        for m in range(0, len(batch.prompts), b):
            mb = batch.chunk(m, m + b)
            for j in range(W):
                logp, mean, std = transition(model, mb, j, a)
                prox[m:m + b, j], log_is[m:m + b, j] = logp, CPS_DENSITIES[a.cps_density](
                    logp - mb.log_probs[:, j], std, a.sde_type)
                if means is not None:
                    means[m:m + b, j] = mean
    kept = log_is.abs() <= a.reject_band if a.reject_band > 0 else torch.ones_like(log_is, dtype=torch.bool)
    batch.behaviour_log_probs, batch.log_probs = batch.log_probs, prox
    batch.means = batch.means if means is None else means
    batch.is_weights = log_is.exp().clamp(max=a.is_cap) * kept
    return log_is, batch.is_weights


STALE_CORRECTIONS = {"bypass": bypass, "decoupled": decoupled}  # --stale-correction


def train_on(model, engine, batch: rollout.Batch, a, arith: dict, progress: bool, *, loss_of=policy_loss,
             step_kls: list | None = None) -> dict:
    """PPO-clip updates over this rank's images: `optimizer_steps` steps, each accumulating gradients over
    its micro-batches × trained steps. Micro-batches are the rollout's chunks, in order (the images were
    shuffled when they were assigned), so the first one is exactly what the rollout computed. `loss_of`: the loss
    of one transition (GARDO's: its reference and gate); `step_kls` receives each optimizer step's mean KL term."""
    model = reg.Watched(model, engine, a)  # --normguard: the velocity-norm hinge on every trained forward
    n_micro, per_step = arith["micro_batches_per_rank"], arith["micro_batches_per_optimizer_step"]
    W = len(batch.sigmas) - 1  # trained steps per image
    measured = STALE_CORRECTIONS[a.stale_correction](model, batch, a)  # decoupled: the proximal pass's log-ratios
    logs, gap, first = [], None, []
    bar = tqdm(total=n_micro * W, desc="train", unit="step", disable=not progress, leave=False)
    for k in range(a.optimizer_steps):
        for m in range(k * per_step, (k + 1) * per_step):
            mb = batch.chunk(m * a.micro_batch, (m + 1) * a.micro_batch)
            for j in range(W):
                loss, stats = loss_of(model, engine, mb, j, a)
                (model.added(loss) / (W * per_step)).backward()  # mean over trained steps and micro-batches
                log_ratio = stats.pop("log_ratio")  # (b,): under the update's starting weights while k == 0
                first += [log_ratio] if k == 0 else []
                logs.append(stats)
                bar.update()
            gap = float(sum(s["gap"] for s in logs[-W:]) / W) if gap is None else gap  # first micro-batch: on-policy
        # the rollout's kept forwards belong to this first step's micro-batches: none may outlive the weights it moves
        assert not batch.graphs, f"{len(batch.graphs)} kept rollout forwards were not used by the first optimizer step"
        if step_kls is not None:
            step_kls.append(float(np.mean([float(s["kl_term"]) for s in logs[-per_step * W:]])))
        grad_norm, skipped = engine.step()
        logs[-1] |= {"grad_norm": grad_norm, "skipped_fraction": float(skipped)}
    bar.close()
    if a.off_policy and measured is None:  # bypass: the first optimizer step's images, (per_step·b, W)
        measured = torch.stack(first).view(per_step, W, -1).transpose(1, 2).flatten(0, 1), None
    # over every rank's images: a max, an effective sample size and a fraction are not means of the ranks' own
    corrected = {} if measured is None else correction_stats(*(t if t is None else engine.all_gather(t) for t in measured))

    def mean(key):
        return float(np.mean([float(s[key]) for s in logs if key in s]))
    return {"train/logp_gap": gap, "train/clipfrac": mean("clipfrac"), "train/approx_kl": mean("approx_kl"),
            "train/policy_loss": mean("policy_loss"), "train/kl": mean("kl"), "train/grad_norm": mean("grad_norm"),
            "train/skipped_fraction": mean("skipped_fraction"), "train/skipped_steps": engine.skipped_steps} | corrected | \
        model.stats()


# ---- GARDO: Flow-GRPO with gated, adaptive KL and diversity-aware advantages (regularisers.py; §17) ---------------

def by_id(values, engine, assignment: torch.Tensor) -> torch.Tensor:
    """This rank's per-image values (B, ...) gathered from every rank into image-id order (N, ...)."""
    gathered = engine.all_gather(values)
    return torch.empty_like(gathered).index_copy_(0, assignment.flatten(), gathered)


def gardo_advantages(r_all, a, *, engine, batch, info, assignment) -> tuple[torch.Tensor, float]:
    """GARDO's advantages over the whole iteration (the trained reward, no std, each above-mean image scaled by its
    diversity in its group), clipped to ±--adv-clip as its loss clips them; and the gate of the iteration's images
    (the proxies of --gardo-proxies against the trained reward), kept in the run's GARDO state for the update."""
    group = torch.arange(len(r_all)) // a.group_size
    features = by_id(reg.FEATURES[a.gardo_features](batch.images.detach()), engine, assignment)
    adv = reg.gardo_advantages(r_all, group, features).clamp(-a.adv_clip, a.adv_clip).float()
    u = reg.uncertainty(r_all, [by_id(info[p], engine, assignment) for p in a.gardo_proxies])
    reg.state(engine).gate = reg.gate(u, reg.state(engine).compensator)
    return adv, group_advantages(r_all, group, std=a.std, clip=a.adv_clip)[1]


def gardo_update(model, engine, batch: rollout.Batch, a, arith: dict, progress: bool) -> dict:
    """Flow-GRPO's update with GARDO's KL: against the old policy, reset to the trained weights first where the
    script's rule says so (regularisers.should_reset), on the gated images only; an optimizer step whose mean KL term
    (over the ranks) exceeds --gardo-kl-threshold asks for the next reset."""
    s, kls = reg.state(engine), []
    if a.kl_beta > 0 and reg.should_reset(s, batch.iteration, a.gardo_reset_every):
        engine.old.blend(0.0)
        s.reset, s.last_reset = False, batch.iteration
    loss = functools.partial(policy_loss, reference=old_policy, kl_mean=functools.partial(gated_kl, gate=s.gate))
    stats = train_on(model, engine, batch, a, arith, progress, loss_of=loss, step_kls=kls if a.kl_beta > 0 else None)
    if kls:
        means = engine.mean_over_ranks({str(k): v for k, v in enumerate(kls)})
        s.reset = s.reset or max(means.values()) > a.gardo_kl_threshold
    return stats | {"train/gardo_gated_fraction": s.gate.float().mean().item(), "train/gardo_beta": s.compensator.beta,
                    "train/gardo_last_reset": float(s.last_reset)}


def saved_state(algo: Algorithm, engine) -> dict:
    """What a checkpoint's loop state keeps of the algorithm's own (`Algorithm.state`): nothing for most."""
    return {"algorithm_state": algo.state(engine).state_dict()} if algo.state else {}


def resume_state(algo: Algorithm, engine, loop: dict, directory: str, written_by: str | None) -> None:
    """The algorithm's own state from checkpoint `directory`'s loop state. One written by another --algorithm's run
    (`written_by`; --allow-change algorithm) or before checkpoints kept it has none: it starts afresh, and says so."""
    if algo.state and "algorithm_state" in loop:
        algo.state(engine).load_state_dict(loop["algorithm_state"], f"--resume: {directory}/meta.json")
    elif algo.state and engine.is_main:
        why = "written before checkpoints kept it" if ALGORITHMS.get(written_by) is algo else f"written by a run " \
            f"of --algorithm {written_by}, which keeps none; to continue a run of this algorithm, resume its checkpoint"
        print(f"--resume: {directory} holds no state of the algorithm's own ({why}): it starts afresh (GARDO: its "
              "gate's controller at β 0.1, no history, no reset), unlike an unbroken run's", file=sys.stderr)


def check_gardo(a) -> None:
    """Flow-GRPO's checks, and at least one proxy for GARDO's gate (startup.py checks each is a reward of --reward)."""
    check_sde(a)
    need(a.gardo_proxies, "--gardo-proxies: GARDO's gate ranks each image under proxy rewards: name one or more, each "
         "a reward of --reward at weight 0 (the script trains on its main reward alone), e.g. --reward "
         "ocr=1,aesthetic=0,imagereward=0 --gardo-proxies aesthetic imagereward")
    need(not (a.kl_beta > 0 and a.reuse_rollout_forward), "--reuse-rollout-forward with GARDO's KL (--kl-beta > 0): "
         "its reference, the old policy, is swapped into the weights the kept rollout forward's backward needs; drop "
         "one of the two")


# ---- start-up checks: each algorithm's, and the flags that mean nothing for it -----------------------

def check_sde(a) -> None:
    """Flow-GRPO's sampler flags (scheduler.check_variants)."""
    sch.check_variants(a.num_steps, a.window, a.window_range, sde_type=a.sde_type, noise_level=a.noise_level,
                       window_schedule=a.window_schedule, ode_solver=a.ode_solver)
    need(a.trust_region == "clip" or a.guard == "none", f"--trust-region {a.trust_region} replaces the ratio clip "
         f"that --guard {a.guard} reshapes: choose one (no public code combines them)")
    need(not a.reuse_rollout_forward or (a.rollout == "local" and not a.rollout_ranks and a.stale_correction == "bypass"),
         "--reuse-rollout-forward reuses this process's own rollout forwards: it needs --rollout local, no "
         "--rollout-ranks and --stale-correction bypass (decoupled recomputes them under no gradient)")
    need(not a.fp8_rollout or a.stale_correction == "decoupled", "--fp8-rollout needs --stale-correction decoupled: "
         "the ratio against the float8 rollout's log-probs (bypass) took nano's judge from 53% to 28% (docs/scaling.md)")


# The losses' scale flags, each refused outside [lowest, highest] (docs/methods.md#the-losses-flags-are-bounded): far
# inside the range where the tiny model's loss and gradient stay finite (--nft-beta 1e-39 to 1e20; --old-kl, --kl-beta
# up to 1e22; --adv-clip 1e-40 to 1e7, where nft's r = A/(2c) + 1/2 rounds to 1/2; --clip-range below float32's 3.4e38),
# far around the public values (--nft-beta 0.1 to 1, --old-kl 1, --kl-beta 1e-4 to 0.04, --adv-clip 5, --clip-range
# 2e-6 to 2e-3). Beyond, every optimizer step is skipped (the gradient norm not finite), the loss is NaN, or it is 0.
FLAG_RANGES = {"nft_beta": (1e-6, 1e6), "old_kl": (0.0, 1e6), "kl_beta": (0.0, 1e6), "adv_clip": (1e-6, 1e4),
               "clip_range": (0.0, 1e6), "dppo_threshold": (0.0, 1e6), "dgpo_beta": (0.0, 1e6), "dpo_beta": (0.0, 1e6),
               "normguard": (0.0, 1e6), "normguard_margin": (0.0, 1e3), "gardo_kl_threshold": (0.0, 1e6),
               "adv_eps": (1e-12, 1.0)}  # 0: a group of equal rewards is 0/0


def check_flags(a, recipe) -> None:
    """Refuse, naming them, the flags that mean nothing for --algorithm: those another algorithm uses and this one
    does not, set to a value other than the recipe's (that is, given on the command line); and a loss flag outside
    its FLAG_RANGES."""
    need(a.algorithm in ALGORITHMS, f"--algorithm must be one of {tuple(ALGORITHMS)}, got {a.algorithm!r}")
    others = set().union(*(x.flags for x in ALGORITHMS.values())) - ALGORITHMS[a.algorithm].flags
    given = sorted(f for f in others if getattr(a, f) != getattr(recipe, f))
    need(not given, f"{', '.join('--' + f.replace('_', '-') for f in given)}: not used by --algorithm {a.algorithm} "
         f"(it uses {', '.join(sorted('--' + f.replace('_', '-') for f in ALGORITHMS[a.algorithm].flags))}): "
         "drop the flag or choose the algorithm that uses it")
    for flag, (lo, hi) in FLAG_RANGES.items():
        need(lo <= getattr(a, flag) <= hi, f"--{flag.replace('_', '-')} must be in [{lo:g}, {hi:g}], got "
             f"{getattr(a, flag):g}: far beyond, the loss or its gradient overflows or vanishes (docs/methods.md)")


# ---- the table's rows ---------------------------------------------------------------------------------

SDE_FLAGS = frozenset({"sde_type", "noise_level", "window", "window_range", "window_schedule", "slide_every",
                       "branch", "guard", "cps_density", "clip_range", "zero_advantage", "kl_form", "trust_region",
                       "dppo_threshold", "stale_correction", "is_cap", "reject_band", "reuse_rollout_forward"})
FORWARD_FLAGS = frozenset({"old_decay", "old_every", "train_timesteps", "train_timestep_range"})
GARDO_FLAGS = frozenset({"gardo_proxies", "gardo_features", "gardo_kl_threshold", "gardo_reset_every"})


ALGORITHMS = {  # --algorithm: Flow-GRPO and AWM sample with the trained weights (AWM's old policy is a regulariser),
    # DiffusionNFT with its old policy, DGPO with the trained ones and with its old policy after --dgpo-switch steps,
    # DPO with its reference (the old policy, a copy every --old-every iterations) on Flow-GRPO's full-mode SDE
    "grpo": Algorithm(SDE_FLAGS, sde_steps, current_weights, as_advantages, train_on, keeps_old=False,
                      watch="train/logp_gap", check=check_sde),
    # GARDO (regularisers.py): Flow-GRPO's row with its advantages, its gated KL to an old policy that it resets
    "gardo": Algorithm(SDE_FLAGS | GARDO_FLAGS, sde_steps, current_weights, as_advantages, gardo_update,
                       keeps_old=True, watch="train/logp_gap", check=check_gardo, advantages=gardo_advantages,
                       state=reg.state),
    "nft": Algorithm(FORWARD_FLAGS | {"nft_beta"}, no_steps, old_weights, fwd.nft_weights,
                     functools.partial(fwd.train_forward, loss=fwd.nft_loss, timesteps=fwd.nft_timesteps),
                     keeps_old=True, watch="train/policy_loss", check=fwd.check_distinct),
    "awm": Algorithm(FORWARD_FLAGS | {"old_kl"}, no_steps, current_weights, fwd.awm_weights,
                     functools.partial(fwd.train_forward, loss=fwd.awm_loss, timesteps=fwd.awm_timesteps),
                     keeps_old=True, watch="train/policy_loss", check=fwd.check_awm),
    "dgpo": Algorithm(FORWARD_FLAGS | {"clip_range", "dgpo_beta", "dgpo_reference", "dgpo_switch"}, no_steps,
                      pref.dgpo_behaviour, as_advantages,
                      functools.partial(fwd.train_forward, loss=pref.dgpo_loss, timesteps=fwd.nft_timesteps,
                                        draw=pref.group_draws),
                      keeps_old=True, watch="train/policy_loss", check=pref.check_dgpo, whole_groups=True),
    "dpo": Algorithm(frozenset({"sde_type", "noise_level", "old_every", "train_timesteps", "dpo_beta"}),
                     pref.full_mode, old_weights, pref.dpo_pairs,
                     functools.partial(fwd.train_forward, loss=pref.dpo_loss, timesteps=pref.logit_normal,
                                       draw=pref.dpo_draws, schedule=pref.train_sigmas, move=pref.copy_reference),
                     keeps_old=True, watch="train/implicit_acc", check=pref.check_dpo, whole_groups=True),
}
