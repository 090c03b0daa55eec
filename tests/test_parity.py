"""Parity with the public code: every public recipe computes the objective its public script computes, on the same
inputs, to float32 rounding; every departure is a named option (docs/algorithm.md §6–§8, §10).

The public functions are re-typed below in this project's own code, each naming the file and lines it follows in:
  FG    yifan123/flow_grpo, commit 9745241cf1101407e9b518dd4f10498092150522 (2025-11-04; read from its fork
        zhtmike/flow_grpo, whose history up to that commit is the upstream's)
  MIX   Tencent-Hunyuan/MixGRPO, commit e5cdd6a427778d8c8b2e7a48ce16972141adbe7c
  DANCE XueZeyue/DanceGRPO, commit 15cc71d53cc2e6e18a68ee607d5fb6ba9a99e344
  UNIRL Tencent-Hunyuan/UniRL, commit 1cc88b62c2d756049d059378838b62ec60976529
  MILES radixark/miles_diffusion: the Qwen-Image 2.1 recipe, scripts/run_diffusion_grpo_qwenimage21_pickscore_1gpu_v2.py
        at 6120710d1ef8d7e0d8c972dda6c699ef51675cd5, with the versions of the files it runs read from a code index:
        miles/backends/fsdp_utils/loss_hub/advantages.py at 0c748a398e8751e40c671a7bb9da701fc9a53a14 and
        miles/rollout/step_strategy_hub.py at 019b606ca00dc50b6a54572bbcec09a9f3bb26f9 (its loss, loss_hub/flow_grpo.py,
        is FG's per pair, summed and divided by the optimizer step's pairs: FG's accumulated mean here)
A stand-in transformer (a linear velocity with a trained "adapter") gives both sides the very same velocities: what
is compared is everything after the transformer (step math, advantages, ratios, clip, KL, zero-advantage handling,
GRPO-Guard, gradient accumulation, EMA, MixGRPO-Flash's step selection).
"""
import contextlib
import dataclasses
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

import algorithms
import engine as eng
import flowgrpo
import models_flux
import models_qwen
import models_sd3
import models_wan
import rollout
import scheduler as sch
from tiny_setup import random_walk

PUBLIC_RECIPES = ["qwen-image", "sd3.5-medium", "flux.1-dev", "sd3.5-medium-guard", "qwen-image-2.1"]
SCHEDULERS = {"qwen-image": models_qwen.QWEN_SCHEDULER, "sd3.5-medium": models_sd3.SD3_SCHEDULER,
              "flux.1-dev": models_flux.FLUX_SCHEDULER, "qwen-image-2.1": models_qwen.QWEN_SCHEDULER}
LATENT = {"qwen-image": (16, 8), "sd3.5-medium": (4, 4, 4), "flux.1-dev": (16, 8),  # packed tokens or (C, h, w)
          "qwen-image-2.1": (16, 8)}
# What each public script does that a recipe must reproduce: the script, whether it drops A = 0 samples, how many
# micro-batches per optimizer step per GPU its EMA fires on (its gradient accumulation), from the config it names.
PUBLIC = {"qwen-image": dict(script="scripts/train_qwenimage.py", drops=False, ema_repeat=None),
          "sd3.5-medium": dict(script="scripts/train_sd3.py", drops=True, ema_repeat=2),
          "flux.1-dev": dict(script="scripts/train_flux.py", drops=False, ema_repeat=6),
          "sd3.5-medium-guard": dict(script="scripts/train_sd3_GRPO_Guard.py", drops=True, ema_repeat=4),
          "qwen-image-2.1": dict(script="MILES scripts/run_diffusion_grpo_qwenimage21_pickscore_1gpu_v2.py", drops=False,
                                 ema_repeat=None, advantages=lambda r, a: miles_advantages(r.tolist(), a.group_size))}


# ---- the public functions, re-typed -------------------------------------------------------------------------------

def fg_sde_step(v, x, sigma, sigma_prev, sigma_max, noise_level, prev_sample, sde_type="sde"):
    """FG flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:36-93 (`sde_step_with_logprob`, given prev_sample and
    return_sqrt_dt=True), σ and σ' passed in instead of looked up from the timestep. Returns (log_prob (B,), mean,
    std_dev_t, sqrt_dt), the last two (B, 1, ...)."""
    v, x, prev_sample = v.float(), x.float(), prev_sample.float()
    shape = (-1, *([1] * (x.dim() - 1)))
    sigma = torch.full((x.shape[0],), float(sigma)).view(shape)
    sigma_prev = torch.full((x.shape[0],), float(sigma_prev)).view(shape)
    dt = sigma_prev - sigma
    if sde_type == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        log_prob = (-((prev_sample.detach() - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
                    - torch.log(std_dev_t * torch.sqrt(-1 * dt)) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    else:  # cps
        std_dev_t = sigma_prev * math.sin(noise_level * math.pi / 2)
        x0, x1 = x - sigma * v, x + v * (1 - sigma)
        mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(sigma_prev**2 - std_dev_t**2)
        log_prob = -((prev_sample.detach() - mean) ** 2)
    return log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_dev_t, torch.sqrt(-1 * dt)


def fg_advantages(prompts, rewards, global_std):
    """FG flow_grpo/stat_tracking.py:11-31 (`PerPromptStatTracker.update`, type grpo): per prompt, (r − its mean)
    over the batch's std (global_std) or the prompt's, + 1e-4; float64."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        group = rewards[prompts == prompt]
        std = np.std(rewards, axis=0, keepdims=True) if global_std else np.std(group, axis=0, keepdims=True)
        advantages[prompts == prompt] = (group - np.mean(group, axis=0, keepdims=True)) / (std + 1e-4)
    return torch.as_tensor(advantages)


def miles_advantages(rewards, n_samples_per_prompt):
    """MILES loss_hub/advantages.py (`grpo_normalize_rewards` with --globalize-reward-std alone, std normalisation on):
    per prompt (n_samples_per_prompt consecutive samples) r − its mean, over the whole batch's torch std, which divides
    by n − 1, + 1e-4; float32. (Its clamp at --diffusion-adv-clip-max, 5, comes later, in the trainer, as FG's.)"""
    rewards_flat = torch.tensor(rewards, dtype=torch.float)
    rewards = rewards_flat.view(-1, n_samples_per_prompt)
    rewards = rewards - rewards.mean(dim=-1, keepdim=True)
    return (rewards / (rewards_flat.std() + 1e-4)).flatten()


def miles_sde_window(window_size, window_range, num_steps, seed):
    """MILES step_strategy_hub.py (`sde_window`): W consecutive steps, the first drawn by numpy's integers in [lo,
    hi − W] (its high bound exclusive) from the request's seed."""
    lo, hi = window_range if window_range else (0, num_steps)
    start = int(np.random.default_rng(seed).integers(lo, hi - window_size + 1))
    return list(range(start, start + window_size))


def fg_kept(advantages):
    """FG scripts/train_sd3.py:801-822: the samples kept for training, those whose advantage is not 0 at every trained
    step (its padding back to a multiple of num_batches_per_epoch, with randomly chosen dropped ones, is left out:
    the tests choose counts that need none)."""
    return advantages.abs() != 0


def fg_micro_batch_loss(adv, log_prob, old_log_prob, mean, old_mean, mean_ref, std_dev_t, sqrt_dt, *, clip_range,
                        adv_clip_max, beta, rationorm, as_shipped=False):
    """FG scripts/train_sd3.py:885-904 (the same lines in train_flux.py and train_qwenimage.py, which divides by its
    accumulation count here instead of in accelerate's backward) and, with rationorm, scripts/train_sd3_GRPO_Guard.py:
    915-939. Returns (loss, ratio, kl or None, divisor of the policy loss). The GRPO-Guard bias is averaged per
    sample, as its author confirmed it was meant (FG issue #244); as_shipped: over the whole batch, as the script's
    `.mean(dim=tuple(range(1, log_prob.ndim)))` of a (B,) log_prob does."""
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    divisor = 1.0
    if rationorm:
        sigma_t = std_dev_t.mean()
        dims = tuple(range(1, log_prob.ndim)) if as_shipped else tuple(range(1, mean.ndim))
        bias = (mean - old_mean).pow(2).mean(dim=dims)
        bias = bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
        ratio = torch.exp((log_prob - old_log_prob + bias) * (sqrt_dt.mean() * sigma_t))
        divisor = sqrt_dt.mean() ** 2
    else:
        ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped, clipped)) / divisor
    if beta == 0:
        return policy_loss, ratio, None, divisor
    kl = ((mean - mean_ref) ** 2).mean(dim=tuple(range(1, mean.ndim)), keepdim=True) / (2 * std_dev_t**2)
    return policy_loss + beta * torch.mean(kl), ratio, kl.reshape(-1), divisor


def unirl_sigma_t(sigmas, steps, eta):
    """UNIRL unirl/algorithms/flowdppo.py (`FlowDPPO._compute_sigma_t`, add_kl_coefficient true): the scale its KL
    divides by, std_dev_t·sqrt(−dt) of each trained step, with σ̃ = sigmas[1] where σ = 1. (S',)"""
    s, s_next = sigmas[list(steps)], sigmas[[i + 1 for i in steps]]
    std_dev_t = torch.sqrt(s / (1.0 - torch.where(s == 1.0, sigmas[1], s))) * eta
    return std_dev_t * torch.sqrt(-(s_next - s))


def unirl_advantages(rewards, branch, eps=1e-8):
    """UNIRL unirl/types/rollout_resp.py (`RolloutTrack.compute_advantages`, normalize and use_global_std true, as
    unirl/trainer/diffusion.py calls it for the Flow-DPPO recipe's `adv_use_global_std: true`): float32, each group's
    (branch consecutive samples) r − its mean, over the whole batch's torch std (n − 1) + eps; no clip."""
    rewards = torch.as_tensor(rewards).to(torch.float32)
    reshaped = rewards.view(-1, branch)
    return ((reshaped - reshaped.mean(dim=1, keepdim=True)) / (rewards.std() + eps)).flatten()


def unirl_dppo_loss(new_logp, old_logp, new_means, old_means, adv, sigma_t, threshold):
    """UNIRL unirl/algorithms/flowdppo.py (`_gaussian_kl_div`, `_flowdppo_kl_adv_loss`, and the `.mean()` of its
    caller `compute_loss_and_backward`) on one micro-batch: log-probs and advantages (B, S'), means (B, S', ...),
    sigma_t (S',). Returns (loss, the removed (image, step) pairs (B, S'))."""
    ratio = torch.exp(new_logp - old_logp)
    sigma = sigma_t.reshape(1, -1, *([1] * (new_means.ndim - 2)))
    kl = ((new_means - old_means) ** 2 / (2 * sigma**2)).mean(dim=tuple(range(2, new_means.ndim)))  # (B, S')
    high = ~(kl < threshold)
    removed = (high & (ratio > 1.0) & (adv > 0)) | (high & (ratio < 1.0) & (adv < 0))
    loss = torch.where(~removed, -adv * ratio, torch.zeros((), dtype=ratio.dtype))
    return loss.mean(), removed


class FgEMA:
    """FG flow_grpo/ema.py:8-56 (`EMAModuleWrapper`: __init__, get_current_decay, step)."""

    def __init__(self, parameters, decay, update_step_interval):
        self.ema_parameters = [p.clone().detach() for p in parameters]
        self.decay, self.update_step_interval = decay, update_step_interval

    @torch.no_grad()
    def step(self, parameters, optimization_step):
        one_minus_decay = 1 - min((1 + optimization_step) / (10 + optimization_step), self.decay)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters):
                ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


def dance_ema_update(ema_state, model_state, decay):
    """DANCE fastvideo/train_grpo_flux.py:76-86 (`FSDP_EMA.update`), called once per train_one_step (lines 866-867)."""
    for key in ema_state:
        ema_state[key].copy_(decay * ema_state[key] + (1 - decay) * model_state[key])


def mix_flash_post_sigmas(sigma_schedule, determistic, shift, ratio):
    """MIX fastvideo/utils/sampling_utils.py:29-59 (dpm_apply_strategy "post"): the σ points after the window, rebuilt
    from a linspace in unshifted time (num_post_steps of them, the window's end first, 0 last)."""
    last_false_index = next((i for i, value in enumerate(reversed(determistic)) if not value), None)
    last_false_index = len(determistic) - 1 - last_false_index
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index) * ratio, 1))
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0))[last_false_index + 1].item()
    return sch_shift(shift, torch.linspace(post_time_step, 0, num_post_steps))


def sch_shift(shift, t):
    """MIX fastvideo/utils/sampling_utils.py:9-10 (`sd3_time_shift`)."""
    return (shift * t) / (1 + (shift - 1) * t)


# ---- a stand-in transformer and engine ----------------------------------------------------------------------------

class Stub(torch.nn.Module):
    """v = x·(A + B) + σ·e: A frozen, B the trained adapter (the reference switches it off), e each image's prompt
    embedding. Both the project and the public re-typing call this same velocity."""

    def __init__(self, d, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.A = 0.3 * torch.randn(d, d, generator=g)
        self.B = torch.nn.Parameter(0.05 * torch.randn(d, d, generator=g))
        self.off = False

    def velocity(self, x, sigma, cond, cfg_scale, height, width):
        w = self.A if self.off else self.A + self.B
        return x @ w + sigma.reshape(-1, *([1] * (x.dim() - 1))) * cond["embeds"]


class StubEngine:
    """What train_on and policy_loss use of engine.Engine: the reference (adapter off) and step(), which here keeps
    each optimizer step's accumulated gradient instead of applying it."""
    skipped_steps = 0

    def __init__(self, model):
        self.model, self.grads = model, []

    @contextlib.contextmanager
    def reference(self):
        self.model.off = True
        try:
            yield
        finally:
            self.model.off = False

    def step(self):
        self.grads.append(self.model.B.grad.clone())
        self.model.B.grad.zero_()
        return 0.0, False


def sample(stub, a, sigmas, steps, n, shape, seed=0):
    """The behaviour policy's trajectories over the trained steps, as rollout.sample returns them (scheduler.step's
    states, log-probs and means), for n images."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    cond = {"embeds": 0.5 * torch.randn(n, *shape, generator=g)}
    states, lps, mus = [x], [], []
    with torch.no_grad():
        for i in steps:
            v = stub.velocity(x, sigmas[i].expand(n), cond, a.cfg_scale, a.height, a.width)
            x, lp, mu, _ = sch.step(v, x, sigmas[i], sigmas[i + 1], sigma_max=float(sigmas[1]),
                                    noise_level=a.noise_level, sde_type=a.sde_type, generator=g)
            states, lps, mus = states + [x], lps + [lp], mus + [mu]
    return rollout.Batch([f"p{i}" for i in range(n)], [{}] * n, torch.zeros(n, dtype=torch.long),
                         torch.stack(states, 1), torch.stack(lps, 1), sigmas[steps[0]:steps[-1] + 2].clone(),
                         float(sigmas[1]), cond, torch.zeros(n, 3, 1, 1), means=torch.stack(mus, 1))


def close(recipe, term, ours, theirs, rtol=1e-5, atol=1e-7):
    """Assert a term of the loss equals the public script's to float32 rounding, naming it if not."""
    ours, theirs = torch.as_tensor(ours).double(), torch.as_tensor(theirs).double()
    worst = (ours - theirs).abs().max().item() if ours.numel() else 0.0
    assert ours.shape == theirs.shape and torch.allclose(ours, theirs, rtol=rtol, atol=atol), \
        f"{recipe}: {term} differs from the public script's by up to {worst:.3g} (scale {theirs.abs().max():.3g})"


# ---- each public recipe: the public script's objective, term by term -----------------------------------------------

@pytest.mark.parametrize("recipe", PUBLIC_RECIPES)
def test_public_recipe_computes_the_public_scripts_loss(recipe):
    """4 prompts × 6 images (one group's rewards all equal, so its advantages are exactly 0), 2 optimizer steps of 4
    micro-batches of 3, the recipe's loss flags unchanged. The public script's side: its advantages, its zero-advantage
    filter (SD3 scripts), its step and loss on each of its micro-batches (2 of the kept images per optimizer step) and
    its gradient accumulation (each micro-batch·step loss / (accumulation · trained steps)). Compared term by term and
    as the gradient of each optimizer step."""
    a = dataclasses.replace(flowgrpo.RECIPES[recipe], prompts_per_iteration=4, group_size=6, micro_batch=3)
    family, pub = a.model, PUBLIC[recipe]
    assert a.ema_repeat == (pub["ema_repeat"] or 1) and (a.zero_advantage == "drop") == pub["drops"]
    assert (a.guard == "full") == (recipe == "sd3.5-medium-guard") and a.kl_form == "public"
    sigmas = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**SCHEDULERS[family]), a.num_steps, 1024)
    steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=5)
    n, W = a.prompts_per_iteration * a.group_size, len(steps)
    # one rank; a seeded assignment whose optimizer steps each keep an even number of images (the public side's 2
    # equal micro-batches per step need it; the public script would pad with dropped images otherwise)
    seed = next(s for s in range(100) if (eng.assign_images(n, 2, 1, seed=s)[0, :12] < 6).sum() % 2 == 0)
    assignment = eng.assign_images(n, 2, 1, seed=seed)
    mine = assignment[0]
    g = torch.Generator().manual_seed(1)
    r_all = torch.cat([torch.full((6,), 0.5), torch.rand(18, generator=g)])  # by image id; group 0 all equal

    # advantages and zero-advantage weights (loop phase 4), against the stat tracker and the filter
    adv, _ = algorithms.group_advantages(r_all, torch.arange(n) // 6, std=a.std, clip=a.adv_clip)
    theirs = pub["advantages"](r_all, a) if "advantages" in pub else fg_advantages(
        [f"prompt {i // 6}" for i in range(n)], r_all.numpy(), global_std=a.std == "global")
    close(recipe, "advantage", adv, theirs.clamp(-a.adv_clip, a.adv_clip))
    weights = algorithms.ZERO_ADVANTAGE[a.zero_advantage](adv, assignment, 2)
    kept = fg_kept(theirs) if pub["drops"] else torch.ones(n, dtype=torch.bool)
    assert torch.equal(weights > 0, kept), f"{recipe}: the zero-advantage mask differs from the public script's"
    assert (~kept).sum() == (6 if pub["drops"] else 0)

    stub = Stub(LATENT[family][-1])
    batch = sample(stub, a, sigmas, steps, n, LATENT[family])  # batch position p holds image mine[p]
    batch.advantages, batch.weights = adv[mine], weights[mine]
    theirs = theirs[mine]  # the public advantages, in batch order
    # the public side's rollout values, from the same states and velocities: its old log-probs and means
    old = []
    with torch.no_grad():
        for j, i in enumerate(steps):
            v = stub.velocity(batch.latents[:, j], sigmas[i].expand(n), batch.cond, 1, 0, 0)
            old.append(fg_sde_step(v, batch.latents[:, j], sigmas[i], sigmas[i + 1], float(sigmas[1]), a.noise_level,
                                   batch.latents[:, j + 1], a.sde_type)[:2])
    close(recipe, "behaviour log-prob", batch.log_probs, torch.stack([lp for lp, _ in old], 1), atol=2e-6)
    with torch.no_grad():  # the policy moves: ratios leave 1, some beyond the clip range
        stub.B.add_(torch.randn(stub.B.shape, generator=g) * (2e-3 if a.guard == "none" else 5e-4))

    # ours: train_on itself (the real loop's update), one gradient per optimizer step
    engine = StubEngine(stub)
    algorithms.train_on(stub, engine, batch, a, flowgrpo.batch_arithmetic(a, 1), progress=False)

    # theirs, term by term on each optimizer step's images, then its accumulated gradient
    clipped = []
    for k in range(2):
        positions = torch.arange(12 * k, 12 * (k + 1))
        positions = positions[kept[mine[positions]]]  # their filter
        total = 0.0
        for part in positions.chunk(2):  # their 2 micro-batches of this optimizer step
            mb = batch.chunk(0, n)
            mb = dataclasses.replace(mb, latents=mb.latents[part], log_probs=mb.log_probs[part], cond={
                "embeds": mb.cond["embeds"][part]}, advantages=mb.advantages[part], means=mb.means[part], weights=None)
            for j, i in enumerate(steps):
                x, x_next = mb.latents[:, j], mb.latents[:, j + 1]
                lp, mean, std_dev_t, sqrt_dt = fg_sde_step(stub.velocity(x, sigmas[i].expand(len(part)), mb.cond, 1, 0,
                                                                         0), x, sigmas[i], sigmas[i + 1],
                                                           float(sigmas[1]), a.noise_level, x_next, a.sde_type)
                mean_ref = None
                if a.kl_beta > 0:
                    with torch.no_grad(), engine.reference():
                        mean_ref = fg_sde_step(stub.velocity(x, sigmas[i].expand(len(part)), mb.cond, 1, 0, 0), x,
                                               sigmas[i], sigmas[i + 1], float(sigmas[1]), a.noise_level, x_next,
                                               a.sde_type)[1]
                loss, ratio, kl, divisor = fg_micro_batch_loss(
                    theirs[part], lp, old[j][0][part], mean, old[j][1][part], mean_ref, std_dev_t, sqrt_dt,
                    clip_range=a.clip_range, adv_clip_max=a.adv_clip, beta=a.kl_beta, rationorm=a.guard == "full")
                total = total + loss / (2 * W)  # accelerate's backward divides by the accumulation count
                # the same terms, ours (the functions policy_loss takes from its tables)
                with torch.no_grad():
                    v = stub.velocity(x, sigmas[i].expand(len(part)), mb.cond, 1, 0, 0)
                    _, logp, mu, std = sch.step(v, x, sigmas[i], sigmas[i + 1], sigma_max=mb.sigma_max,
                                                noise_level=a.noise_level, sde_type=a.sde_type, x_next=x_next)
                    ours = torch.exp(algorithms.LOG_RATIOS[a.guard](logp, mu, std, mb, j, a))
                    close(recipe, "ratio", ours, ratio, rtol=0, atol=1e-6)
                    close(recipe, "policy-loss divisor (GRPO-Guard reweight)",
                          algorithms.REWEIGHTS[a.guard](sigmas[i], sigmas[i + 1]), divisor)
                    if kl is not None:
                        close(recipe, "KL", algorithms.KL_FORMS[a.kl_form](mu, mean_ref, std,
                                                                           sigmas[i + 1] - sigmas[i], a.sde_type),
                              kl, rtol=1e-4)
                    clipped.append(((ratio - 1).abs() > a.clip_range).float())
                    assert torch.equal((ours - 1).abs() > a.clip_range, clipped[-1] > 0), \
                        f"{recipe}: a clip decision differs from the public script's (a ratio at the edge)"
        grad = torch.autograd.grad(total, stub.B)[0]
        close(recipe, f"gradient of optimizer step {k + 1}", engine.grads[k], grad, rtol=1e-4,
              atol=1e-6 * grad.abs().max())
    clipfrac = torch.cat(clipped).mean().item()
    print(f"\n{recipe}: {len(clipped)} public micro-batch·step losses, clip fraction {clipfrac:.2f}")
    assert 0.1 < clipfrac < 0.9, f"{recipe}: the inputs should clip some ratios and not others (clipfrac {clipfrac})"


def test_qwen_image_2_1_recipe_trains_miless_steps_with_its_advantages():
    """The two things miles_diffusion's recipe does that no FG script does: its window (2 steps in [3, 5): steps 3 and 4
    whatever the seed) and its batch std with n − 1, which `--std global-unbiased` reproduces on its 16 × 16 images
    and flow_grpo's population std (`global`) does not: its advantages √(256/255) − 1 ≈ 0.2% larger."""
    a = flowgrpo.RECIPES["qwen-image-2.1"]
    for seed in range(50):
        ours = sch.trained_steps(a.num_steps, a.window, a.window_range, seed, iteration=seed, schedule=a.window_schedule)
        assert ours == miles_sde_window(a.window, a.window_range, a.num_steps, seed) == [3, 4], (seed, ours)
    n = a.prompts_per_iteration * a.group_size
    r = torch.rand(n, generator=torch.Generator().manual_seed(0))
    r[:a.group_size] = 0.5  # a group whose advantages are all exactly 0
    theirs = miles_advantages(r.tolist(), a.group_size).clamp(-a.adv_clip, a.adv_clip)
    group = torch.arange(n) // a.group_size
    close("qwen-image-2.1", "advantage", algorithms.group_advantages(r, group, std=a.std, clip=a.adv_clip)[0], theirs)
    population = algorithms.group_advantages(r, group, std="global", clip=a.adv_clip)[0]
    gap = (population / theirs)[theirs != 0]
    expected = math.sqrt(n / (n - 1))
    assert torch.allclose(gap, torch.full_like(gap, expected), rtol=2e-4), \
        f"population ÷ Bessel std advantages: {gap.min():.6f}..{gap.max():.6f}, expected {expected:.6f}"


def test_keep_recipes_take_the_public_loss_on_the_very_same_micro_batch():
    """FLUX's and Qwen-Image's scripts train every sample: their micro-batch loss and this project's policy_loss on the
    same micro-batch (the rollout's chunk) are the same number."""
    for recipe in ("qwen-image", "flux.1-dev"):
        a = dataclasses.replace(flowgrpo.RECIPES[recipe], prompts_per_iteration=1, group_size=4, micro_batch=4)
        sigmas = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**SCHEDULERS[a.model]), a.num_steps, 1024)
        steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=2)
        stub = Stub(8)
        batch = sample(stub, a, sigmas, steps, 4, (16, 8))
        batch.advantages = torch.tensor([1.0, -0.5, 0.0, 2.0])
        old = [fg_sde_step(stub.velocity(batch.latents[:, j], sigmas[i].expand(4), batch.cond, 1, 0, 0).detach(),
                           batch.latents[:, j], sigmas[i], sigmas[i + 1], float(sigmas[1]), a.noise_level,
                           batch.latents[:, j + 1]) for j, i in enumerate(steps)]
        with torch.no_grad():
            stub.B.add_(1e-3)
        for j, i in enumerate(steps):
            ours, _ = algorithms.policy_loss(stub, StubEngine(stub), batch, j, a)
            x = batch.latents[:, j]
            lp, mean, s_t, sqrt_dt = fg_sde_step(stub.velocity(x, sigmas[i].expand(4), batch.cond, 1, 0, 0), x,
                                                 sigmas[i], sigmas[i + 1], float(sigmas[1]), a.noise_level,
                                                 batch.latents[:, j + 1])
            theirs = fg_micro_batch_loss(batch.advantages.double(), lp, old[j][0], mean, old[j][1], None, s_t, sqrt_dt,
                                         clip_range=a.clip_range, adv_clip_max=a.adv_clip, beta=0, rationorm=False)[0]
            close(recipe, f"micro-batch loss at trained step {i}", ours, theirs)


# ---- Flow-DPPO: UniRL's mask in place of the clip --------------------------------------------------------------------

def test_flow_dppo_recipe_computes_unirls_loss_its_mask_and_gradient():
    """`--trust-region dppo` (the sd3.5-medium-dppo recipe's loss flags; 2 prompts × 8 images, 2 optimizer steps of 2
    micro-batches of 4) against UniRL's FlowDPPO on the same micro-batches: the old log-probs the rollout's, the old
    means the policy's before it moved (its pre-update replay), its sigma_t, KL, mask and mean, each micro-batch's loss
    scaled by 1/2 (its accumulation). The threshold lies between the moved policy's two middle KLs, so that the mask
    removes some (image, step) pairs and keeps others, none at its edge."""
    a = dataclasses.replace(flowgrpo.RECIPES["sd3.5-medium-dppo"], prompts_per_iteration=2, group_size=8, micro_batch=4)
    assert (a.trust_region, a.dppo_threshold, a.zero_advantage, a.guard, a.kl_beta) == ("dppo", 1e-5, "keep", "none", 0)
    sigmas = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**SCHEDULERS["sd3.5-medium"]), a.num_steps, 1024)
    steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=5)
    n, shape, g = 16, (4, 4, 4), torch.Generator().manual_seed(2)
    stub = Stub(shape[-1])
    batch = sample(stub, a, sigmas, steps, n, shape)
    batch.advantages = torch.randn(n, generator=g)

    def replay():  # their replay of the trained steps: log-probs (n, S'), means (n, S', ...)
        out = [fg_sde_step(stub.velocity(batch.latents[:, j], sigmas[i].expand(n), batch.cond, 1, 0, 0),
                           batch.latents[:, j], sigmas[i], sigmas[i + 1], float(sigmas[1]), a.noise_level,
                           batch.latents[:, j + 1]) for j, i in enumerate(steps)]
        return torch.stack([o[0] for o in out], 1), torch.stack([o[1] for o in out], 1)

    with torch.no_grad():
        old_means = replay()[1]
        stub.B.add_(torch.randn(stub.B.shape, generator=g) * 2e-3)  # the policy moves
        new_logp, new_means = replay()
    sigma_t = unirl_sigma_t(sigmas, steps, a.noise_level)
    kl = ((new_means - old_means) ** 2 / (2 * sigma_t.reshape(1, -1, 1, 1, 1) ** 2)).mean(dim=(2, 3, 4))
    middle = kl.flatten().sort().values[kl.numel() // 2 - 1:kl.numel() // 2 + 1]  # the two middle KLs
    a = dataclasses.replace(a, dppo_threshold=middle.mean().item())  # between them: no pair at the edge

    engine = StubEngine(stub)  # ours: train_on, one gradient per optimizer step (the policy stays where it moved)
    algorithms.train_on(stub, engine, batch, a, flowgrpo.batch_arithmetic(a, 1), progress=False)
    removed = []
    for k in range(2):
        total = 0.0
        for part in torch.arange(8 * k, 8 * (k + 1)).chunk(2):
            logp, means = replay()
            loss, gone = unirl_dppo_loss(logp[part], batch.log_probs[part], means[part], old_means[part],
                                         batch.advantages[part, None].expand(-1, len(steps)), sigma_t,
                                         a.dppo_threshold)
            total, removed = total + loss / 2, removed + [gone]
            mb = batch.chunk(int(part[0]), int(part[-1]) + 1)
            for j, i in enumerate(steps):  # ours, step by step: the transition std and the mask
                with torch.no_grad():
                    v = stub.velocity(mb.latents[:, j], sigmas[i].expand(4), mb.cond, 1, 0, 0)
                    _, lp, mu, std = sch.step(v, mb.latents[:, j], sigmas[i], sigmas[i + 1], sigma_max=mb.sigma_max,
                                              noise_level=a.noise_level, x_next=mb.latents[:, j + 1])
                    close("sd3.5-medium-dppo", "sigma_t", std.reshape(-1), sigma_t[j:j + 1])
                    ratio = torch.exp(algorithms.LOG_RATIOS[a.guard](lp, mu, std, mb, j, a))
                    _, ours = algorithms.TRUST_REGIONS[a.trust_region](mb.advantages, ratio, mu, std, mb, j, a)
                    assert torch.equal(ours, gone[:, j]), f"step {i}: ours {ours}, UniRL's {gone[:, j]}"
        grad = torch.autograd.grad(total, stub.B)[0]
        close("sd3.5-medium-dppo", f"gradient of optimizer step {k + 1}", engine.grads[k], grad, rtol=1e-4,
              atol=1e-6 * grad.abs().max())
    fraction = torch.cat(removed).float().mean().item()
    print(f"\nFlow-DPPO: {fraction:.2f} of the (image, step) pairs removed")
    assert 0.1 < fraction < 0.5, f"the inputs should remove some pairs and keep others (removed {fraction:.2f})"


def test_flow_dppo_recipe_computes_unirls_advantages():
    """The sd3.5-medium-dppo recipe's advantages on its 48 × 16 images (one group of equal rewards among them) against
    UniRL's: per group r − its mean over the batch's n − 1 std + 1e-8, unclipped. Before, the recipe took Flow-GRPO's
    population std + 1e-4 and a clip at 5: 0.6% smaller advantages at PickScore's spread (std 0.015), not rounding."""
    a = flowgrpo.RECIPES["sd3.5-medium-dppo"]
    n = a.prompts_per_iteration * a.group_size
    r = 0.2 + 0.015 * torch.randn(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r[:a.group_size] = 0.25  # a group whose advantages are all exactly 0 (its float32 mean exact: theirs 0 too)
    theirs = unirl_advantages(r, a.group_size)
    ours, zero = algorithms.advantages(algorithms.ALGORITHMS[a.algorithm], r, a)
    # theirs in float32: its group means of rewards near 0.2 round by an ulp (1.5e-8), 1e-6 of A at σ 0.015
    close("sd3.5-medium-dppo", "advantage", ours, theirs, atol=1e-5)
    assert zero == 1 / a.prompts_per_iteration and torch.equal(ours[:a.group_size], torch.zeros(a.group_size))


# ---- the KL forms -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sde_type,level", [("sde", 0.7), ("cps", 0.8)])
def test_kl_forms_against_train_sd3s_kl(sde_type, level):
    """`public` is train_sd3.py's KL term (FG scripts/train_sd3.py:900-901) on the same means; `exact` is the Gaussian
    KL: for sde 1/|dt| times the public one (25× at SD3.5's first step, 3.7× at its ninth), for cps the same."""
    sigmas = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**models_sd3.SD3_SCHEDULER), 10, 1024)
    g = torch.Generator().manual_seed(0)
    ratios = []
    for i in range(9):
        v, v_ref, x = (torch.randn(3, 4, 4, 4, generator=g) for _ in range(3))
        x_next = torch.randn(3, 4, 4, 4, generator=g)
        kw = dict(sigma_max=float(sigmas[1]), noise_level=level, sde_type=sde_type, x_next=x_next)
        _, _, mean, std = sch.step(v, x, sigmas[i], sigmas[i + 1], **kw)
        _, _, mean_ref, _ = sch.step(v_ref, x, sigmas[i], sigmas[i + 1], **kw)
        pub = dict(sigma=sigmas[i], sigma_prev=sigmas[i + 1], sigma_max=float(sigmas[1]), noise_level=level,
                   prev_sample=x_next, sde_type=sde_type)
        _, pub_mean, std_dev_t, _ = fg_sde_step(v, x, **pub)
        _, pub_ref, _, _ = fg_sde_step(v_ref, x, **pub)
        theirs = ((pub_mean - pub_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
        dt = sigmas[i + 1] - sigmas[i]
        close(sde_type, f"public KL at step {i}", sch.kl_public(mean, mean_ref, std, dt, sde_type), theirs.reshape(-1),
              rtol=1e-5)
        ratios.append((sch.kl_exact(mean, mean_ref, std, dt, sde_type) / sch.kl_public(mean, mean_ref, std, dt,
                                                                                          sde_type)).mean().item())
    expected = [1.0] * 9 if sde_type == "cps" else (1 / (sigmas[:9] - sigmas[1:10])).tolist()
    assert ratios == pytest.approx(expected, rel=1e-4), ratios
    print(f"\nexact / public KL per step ({sde_type}): {[round(r, 2) for r in ratios]}")


def test_wan_recipes_kl_is_train_wan2_1s_over_the_transition_variance():
    """Flow-GRPO's Wan script divides its KL by the whole transition variance: `(std_dev_t * dt_ref) ** 2`, where its
    compute_log_prob returns sqrt(−dt) as `dt` (yifan123/flow_grpo scripts/train_wan2_1.py at 32b48fd, the loss block
    of its training loop; flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py `sde_step_with_logprob` with
    return_dt_and_std_dev_t, read in zhtmike/flow_grpo at def7b84). The wan2.1-t2v-1.3b recipe's KL on its own
    sampler's steps (dance, η 0.3, 20 steps) is that, which SD3's form (`public`, std_dev_t² alone) is not."""
    a = flowgrpo.RECIPES["wan2.1-t2v-1.3b"]
    sigmas = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**models_wan.WAN_SCHEDULER), a.num_steps, 1024)
    g = torch.Generator().manual_seed(0)
    for i in range(a.num_steps - 1):
        v, v_ref, x, x_next = (torch.randn(2, 4, 3, 4, 4, generator=g) for _ in range(4))  # (B, C, F', h, w)
        kw = dict(sigma_max=float(sigmas[1]), noise_level=a.noise_level, sde_type=a.sde_type, x_next=x_next)
        _, _, mean, std = sch.step(v, x, sigmas[i], sigmas[i + 1], **kw)
        _, _, mean_ref, _ = sch.step(v_ref, x, sigmas[i], sigmas[i + 1], **kw)
        std_dev_t, sqrt_dt = std / torch.sqrt(sigmas[i] - sigmas[i + 1]), torch.sqrt(sigmas[i] - sigmas[i + 1])
        theirs = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3, 4), keepdim=True) / (2 * (std_dev_t * sqrt_dt) ** 2)
        ours = algorithms.KL_FORMS[a.kl_form](mean, mean_ref, std, sigmas[i + 1] - sigmas[i], a.sde_type)
        close("wan2.1-t2v-1.3b", f"KL at step {i}", ours, theirs.reshape(-1), rtol=1e-5)


# ---- zero-advantage samples: a mask, normalised over the optimizer step ---------------------------------------------

def test_dropping_zero_advantages_is_the_mean_over_each_steps_kept_images_on_any_number_of_ranks():
    """The weights depend on the image, never on the ranks; each optimizer step's weighted mean is the mean over its
    kept images. The public script takes each rank's mean and averages the ranks (DDP): the same when every rank keeps
    as many images, otherwise a kept image weighs 1/(R·n_r) there instead of 1/Σn_r."""
    adv = torch.tensor([0.0, 1.0, -1.0, 0.0, 0.5, 0.0, 2.0, -0.5, 0.0, 0.0, 1.5, -2.0, 0.0, 1.0, 0.0, -1.0])
    losses = torch.linspace(-1, 2, 16) ** 2  # any per-image loss
    for world in (1, 2, 4):
        assignment = eng.assign_images(16, 2, world, seed=3)
        w = algorithms.drop_zero_advantage(adv, assignment, 2)
        assert torch.equal(w, algorithms.drop_zero_advantage(adv, eng.assign_images(16, 2, 1, seed=3), 2))
        for k in range(2):
            ids = assignment.view(world, 2, -1)[:, k]  # (ranks, images of step k on each)
            ours = (w[ids] * losses[ids]).mean()  # each rank's mean of w·loss, averaged over ranks (= over the step)
            kept = adv[ids.flatten()] != 0
            assert ours.item() == pytest.approx(losses[ids.flatten()][kept].mean().item(), rel=1e-6)
            per_rank = [losses[r][adv[r] != 0].mean() for r in ids]  # the public script's, rank by rank
            counts = [int((adv[r] != 0).sum()) for r in ids]
            public = torch.stack(per_rank).mean().item()
            assert (public == pytest.approx(ours.item(), rel=1e-6)) == (len(set(counts)) == 1), (world, k, counts)
    assert torch.equal(algorithms.keep_zero_advantage(adv, assignment, 2), torch.ones(16))


# ---- GRPO-Guard: the script as shipped averages its bias over the batch ----------------------------------------------

def test_guard_bias_per_image_is_the_intended_form_and_differs_from_the_shipped_batch_mean():
    g = torch.Generator().manual_seed(0)
    x, v_old = torch.randn(6, 16, 8, generator=g), torch.randn(6, 16, 8, generator=g)
    v = v_old + 0.05 * torch.randn(6, 16, 8, generator=g) * torch.arange(1, 7).view(6, 1, 1)  # images move unequally
    x_next, lp_old, mean_old, std = sch.step(v_old, x, 0.6, 0.5, sigma_max=0.95, noise_level=0.7, generator=g)
    _, lp, mean, _ = sch.step(v, x, 0.6, 0.5, sigma_max=0.95, noise_level=0.7, x_next=x_next)
    plp_old, pmean_old, s_t, sqrt_dt = fg_sde_step(v_old, x, 0.6, 0.5, 0.95, 0.7, x_next)
    plp, pmean, _, _ = fg_sde_step(v, x, 0.6, 0.5, 0.95, 0.7, x_next)
    kw = dict(clip_range=1.0, adv_clip_max=5, beta=0, rationorm=True)
    ones = torch.ones(6, dtype=torch.float64)
    intended = fg_micro_batch_loss(ones, plp, plp_old, pmean, pmean_old, None, s_t, sqrt_dt, **kw)[1]
    shipped = fg_micro_batch_loss(ones, plp, plp_old, pmean, pmean_old, None, s_t, sqrt_dt, as_shipped=True, **kw)[1]
    ours = torch.exp(sch.guard_log_ratio(lp, lp_old, mean, mean_old, std))
    close("sd3.5-medium-guard", "GRPO-Guard ratio", ours, intended, rtol=0, atol=1e-6)
    gap = (shipped.log() - intended.log()).abs().max().item()
    print(f"\nGRPO-Guard log-ratio, per-batch bias (as shipped) vs per image: up to {gap:.3g}")
    assert gap > 1e-3


# ---- EMA: Flow-GRPO's call pattern (M updates per firing) and DanceGRPO's -------------------------------------------

@pytest.mark.parametrize("M", [1, 2, 6])
def test_ema_repeat_is_flow_grpos_ema_step_once_per_micro_batch(M):
    """FG scripts/train_sd3.py:849-960: per epoch, num_batches_per_epoch = 2·M micro-batches and two optimizer steps
    (gradient accumulation M); after every micro-batch, ema.step(params, global_step), global_step counting the
    optimizer steps taken. Ours: EMA.step() once per optimizer step with repeat M. Bit for bit, after every epoch."""
    shapes = [(4, 3), (5,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    values = random_walk(200, shapes)
    with torch.no_grad():
        for p, v in zip(params, next(values)):
            p.copy_(v)
    theirs = FgEMA(params, decay=0.9, update_step_interval=8)
    ours = eng.EMA(zip(["a", "b"], params), decay=0.9, every=8, repeat=M)
    once = eng.EMA(zip(["a", "b"], params), decay=0.9, every=8)
    global_step, fired = 0, []
    for epoch in range(60):
        for i in range(2 * M):
            if (i + 1) % M == 0:  # accelerate's sync: the optimizer step
                with torch.no_grad():
                    for p, v in zip(params, next(values)):
                        p.copy_(v)
                global_step += 1
                before = ours.shadow[0].clone()
                ours.step()
                once.step()
                fired += [global_step] if not torch.equal(before, ours.shadow[0]) else []
            theirs.step(params, global_step)
        worst = max((a - b).abs().max().item() for a, b in zip(ours.shadow, theirs.ema_parameters))
        assert worst == 0, f"M = {M}, epoch {epoch}: EMA differs from Flow-GRPO's by {worst:.3g}"
    assert fired == list(range(7, 121, 8))  # after optimizer step n with (n + 1) % 8 == 0, skipped steps counting
    gap = max((a - b).abs().max().item() for a, b in zip(once.shadow, theirs.ema_parameters))
    assert (gap == 0) == (M == 1), gap  # the once-per-step form is a different average unless M = 1


def test_ema_form_dance_is_dancegrpos_ema():
    """DANCE: after each train_one_step (K optimizer steps of one rollout batch), ema ← d·ema + (1 − d)·θ, d = 0.995,
    no warm-up. Ours: --ema-form dance --ema-every K. Bit for bit."""
    shapes = [(4, 3), (5,)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    ours = eng.EMA(zip(["a", "b"], params), decay=0.995, every=2, form="dance")
    theirs = {"a": params[0].detach().clone(), "b": params[1].detach().clone()}
    values = random_walk(100, shapes)
    for n in range(1, 101):
        with torch.no_grad():
            for p, v in zip(params, next(values)):
                p.copy_(v)
        ours.step()
        if n % 2 == 0:  # the end of a train_one_step
            dance_ema_update(theirs, {"a": params[0].detach(), "b": params[1].detach()}, 0.995)
            worst = max((ours.shadow[i] - theirs[k]).abs().max().item() for i, k in enumerate("ab"))
            assert worst == 0, f"optimizer step {n}: EMA differs from DanceGRPO's by {worst:.3g}"


# ---- MixGRPO-Flash's step selection after the window -----------------------------------------------------------------

def test_flash_count_and_points_are_mixgrpo_flashs():
    """On MixGRPO's own schedule (25 steps, shift 3) for every window of 4 its progressive strategy places (starts 0 to
    19): ours calls the model flash_calls(K) times after the window, one fewer than Flash's σ points, and where those
    points are whole steps apart they are the very σ Flash rebuilds. Where Flash keeps a single point (K ≤ 3) it takes
    no step and decodes the window's noisy end state; ours takes one step to 0 (docs/algorithm.md §10)."""
    N, W = 25, 4
    sigmas = sch_shift(3, torch.linspace(1, 0, N + 1))
    same_points = 0
    for start in range(0, N - 2 - W + 1):
        determistic = [not start <= i < start + W for i in range(N)]
        theirs = mix_flash_post_sigmas(sigmas, determistic, shift=3, ratio=0.4)
        k = N - (start + W)  # schedule steps after the window
        assert sch.ode_calls("dpm2", k) == max(len(theirs) - 1, 1), (start, k, len(theirs))
        ours = sch.dpm2_sigmas(sigmas[start + W:])
        assert len(ours) == sch.ode_calls("dpm2", k) + 1 and ours[0] == sigmas[start + W] and ours[-1] == 0
        if len(theirs) > 1 and k % (len(theirs) - 1) == 0:
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
            same_points += 1
    assert same_points >= 3 and sch.ode_calls("dpm2", 21) == 7  # the window at 0–3: 7 calls where Euler takes 21
    sch.check_variants(N, W, (0, 23), sde_type="sde", noise_level=0.7, window_schedule="sliding", ode_solver="dpm2")


# ---- the public recipes' batch arithmetic, from each public config's own formulas --------------------------------

def fg_batches(gpus, per_gpu, group, prompts):
    """FG config/grpo.py (general_ocr_sd3 and alike): num_batches_per_epoch = int(prompts / (gpus·per_gpu / group)),
    gradient_accumulation_steps = num_batches_per_epoch // 2; the EMA steps once per micro-batch (M = accumulation)."""
    batches = int(prompts / (gpus * per_gpu / group))
    return dict(images=gpus * per_gpu * batches, group=group, micro=per_gpu, steps=batches // (batches // 2),
                ema_repeat=batches // 2)


def nft_batches(gpus, grad_steps):
    """NVlabs/DiffusionNFT config/nft.py _get_config: 48 groups of 24, the largest per-GPU batch ≤ 9 that divides them
    over the GPUs in whole groups and batches; accumulation = batches / gradient_step_per_epoch (EMA once a step)."""
    bsz = next(b for b in range(9, 0, -1) if 48 * 24 % (gpus * b) == 0 and b * gpus % 24 == 0
               and 48 * 24 // (gpus * b) % grad_steps == 0)
    return dict(images=48 * 24, group=24, micro=bsz, steps=grad_steps, ema_repeat=1)


def awm_batches(groups_per_24gpus):
    """scxue/advantage_weighted_matching config/dgx_awm.py *_sd3_no_cfg_1node: 8 GPUs, per-GPU sampling batch 6,
    num_batches_per_epoch = groups·24 // 8 // 2, every batch accumulated into one optimizer step."""
    return dict(images=8 * 6 * (groups_per_24gpus * 24 // 8 // 2), group=24, micro=6, steps=1, ema_repeat=1)


RECIPE_BATCHES = {  # images an iteration (all GPUs), group size, per-GPU micro-batch, optimizer steps, EMA repeat M
    "sd3.5-medium": fg_batches(32, 9, 24, 48),  # FG general_ocr_sd3: 4 batches, accumulation 2
    "flux.1-dev": fg_batches(32, 3, 24, 48),  # FG pickscore_flux: 12 batches, accumulation 6
    "flux.1-kontext-dev": fg_batches(28, 3, 21, 48),  # FG counting_flux_kontext: 12 batches, accumulation 6
    "qwen-image": dict(fg_batches(32, 4, 16, 32), ema_repeat=1),  # FG pickscore_qwenimage: 4 batches; no EMA
    "sd3.5-medium-guard": fg_batches(16, 9, 24, 48),  # FG config/grpo_guard.py general_ocr_sd3_rationorm: 8, 4
    "sd3.5-medium-gardo-ocr": fg_batches(8, 9, 24, 48),  # config/grpo_gardo.py general_ocr_sd3 at 94e23ee: 16, 8
    # FG general_ocr_wan2_1 on one GPU (its README): 2 batches of 8, 4 a prompt, accumulation 2 // 2 = 1: 2 steps
    "wan2.1-t2v-1.3b": dict(images=16, group=4, micro=8, steps=2, ema_repeat=1),
    "sd3.5-medium-nft-ocr": nft_batches(8, 2),  # sd3_ocr: 9 a GPU, 16 batches, 2 gradient steps
    "sd3.5-medium-nft-pickscore": nft_batches(8, 1),  # sd3_pickscore: 1 gradient step
    "sd3.5-medium-awm-ocr": awm_batches(24),  # 36 batches: 1728 images, 72 prompts
    "sd3.5-medium-awm-pickscore": awm_batches(8),  # 12 batches: 576 images, 24 prompts
    # Luo-Yihong/DGPO config/dgpo.py general_ocr_sd3_4gpu: 4 GPUs × 16 × int(8 / (4·16 / 16)) = 2 batches, one step
    # (accumulation = batches); its EMA steps once per micro-batch: M = 2
    "sd3.5-medium-dgpo-ocr": dict(images=4 * 16 * 2, group=16, micro=16, steps=1, ema_repeat=2),
    # FG config/dpo.py (ac4c86e) on one GPU: one batch of 24 per prompt, one step; EMA once per optimizer step
    "sd3.5-medium-dpo-pickscore": dict(images=24, group=24, micro=24, steps=1, ema_repeat=1),
    # UNIRL examples/diffusion/sd3_flowdppo.yaml: batch_size 48 prompts (global), samples_per_prompt 16,
    # micro_batch_size 8, num_updates_per_batch 2
    "sd3.5-medium-dppo": dict(images=48 * 16, group=16, micro=8, steps=2, ema_repeat=1),
    # MILES: --rollout-batch-size 16 --n-samples-per-prompt 16 --micro-batch-size-sample 4 --num-steps-per-rollout 2
    "qwen-image-2.1": dict(images=16 * 16, group=16, micro=4, steps=2, ema_repeat=1),
    # verl-omni a1139ba, qwen_image_edit/run_qwen_image_edit_lora.sh: train_batch_size 32, rollout.n 16,
    # ppo_mini_batch_size 16 (2 steps), ppo_micro_batch_size_per_gpu 16
    "qwen-image-edit": dict(images=32 * 16, group=16, micro=16, steps=2, ema_repeat=1),
    # verl-omni diffusionnft_trainer/qwen_image/run_qwen_image_ocr_lora.sh: train_batch_size 24, n 16, mini-batch 12
    # (its micro-batch, 12 a GPU, is a how-flag here: the recipe's 4 changes float rounding only)
    "qwen-image-nft-ocr": dict(images=24 * 16, group=16, micro=4, steps=2, ema_repeat=1),
}
# Flow-Factory a0b2bc5 examples/grpo/lora/*/default.yaml (qwen_image_2_1 at 5f6cda1): unique_sample_num_per_epoch 48,
# group_size 16, per_device_batch_size 1, gradient_step_per_epoch 2
RECIPE_BATCHES.update({r: dict(images=48 * 16, group=16, micro=1, steps=2, ema_repeat=1) for r in
                       ("z-image", "z-image-turbo", "flux.2-klein-base", "flux.2-klein", "qwen-image-2.1-edit")})


def test_public_recipes_batches_are_the_public_configs():
    """Each public recipe's images an iteration (P·G = the public run's global batch: per-GPU batch × GPUs × batches),
    group size, micro-batch (the public per-GPU batch), optimizer steps an iteration (batches / gradient accumulation)
    and EMA repeat M (micro-batches per optimizer step per GPU where its EMA steps once per micro-batch), computed
    from each public config's own formulas (docs/algorithm.md §7)."""
    wrong = {}
    for recipe, pub in RECIPE_BATCHES.items():
        a = flowgrpo.RECIPES[recipe]
        ours = dict(images=a.prompts_per_iteration * a.group_size, group=a.group_size, micro=a.micro_batch,
                    steps=a.optimizer_steps, ema_repeat=a.ema_repeat)
        wrong.update({recipe: f"{ours} where its public config has {pub}"} if ours != pub else {})
    assert not wrong, wrong
