"""The sampling step with its log-probability, the sigma schedule, and the choice of trained steps.

Pure tensor functions; all step math runs in float32 whatever the model dtype (bf16 overflows in
s_t² / (2σ) terms). Notation and formulas: ALGORITHM.md §1–3.
    x_σ = (1 − σ)·x0 + σ·ε,   v ≈ ε − x0,   σ_0 = 1 > σ_1 > … > σ_N = 0,   dt = σ' − σ < 0.
"""
import math
import random

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from diffusers.utils.torch_utils import randn_tensor

SDE_TYPES = ("sde", "cps")


# ----------------------------------------------------------------------------------------------
# Sigma schedule: exactly what the model's diffusers pipeline would use, never re-derived.

def sigma_schedule(scheduler: FlowMatchEulerDiscreteScheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """σ_0 … σ_N (N + 1 values, float32, last = 0) for `num_steps` steps at `image_seq_len` tokens.

    Qwen-Image and FLUX pipelines pass `sigmas = linspace(1, 1/N, N)` and a resolution-dependent
    `mu` (dynamic shift); diffusers' scheduler then applies the shift and the terminal stretch.
    """
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)  # never mutate the caller's
    cfg = scheduler.config
    if cfg.use_dynamic_shifting:
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    else:
        scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.to(torch.float32).cpu()


# ----------------------------------------------------------------------------------------------
# One step x_σ → x_σ' with the Gaussian transition density.

def _like(s, x: torch.Tensor) -> torch.Tensor:
    """A float or per-sample (B,) sigma as a float32 tensor broadcastable to x (B, ...)."""
    s = torch.as_tensor(s, dtype=torch.float32, device=x.device)
    return s.reshape(s.shape + (1,) * (x.dim() - s.dim())) if s.dim() else s


def step(v, x, sigma, sigma_next, *, sigma_max, noise_level, sde_type="sde", generator=None, x_next=None):
    """One sampling step. Returns `(x_next, log_prob, mean, std)`.

    v, x: (B, ...) velocity and state (any dtype; math in float32). sigma, sigma_next: floats or (B,).
    sigma_max: the schedule's σ_1, used for σ̃ where σ = 1 (the `sde` std is 0/0 there otherwise).
    noise_level == 0 is the Euler (ODE) step and log_prob is None. With `x_next` given nothing is
    drawn and log_prob is the density of that transition (how training recomputes it).
    log_prob: (B,), the exact Gaussian log-density averaged over all non-batch elements.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    v, x = v.float(), x.float()
    sigma, sigma_next = _like(sigma, x), _like(sigma_next, x)
    dt = sigma_next - sigma
    if noise_level == 0:
        mean = x + v * dt  # the same expression as diffusers' FlowMatchEulerDiscreteScheduler.step
        return (mean if x_next is None else x_next.float()), None, mean, torch.zeros_like(dt)

    if sde_type == "sde":
        sigma_safe = torch.where(sigma == 1, torch.as_tensor(float(sigma_max), device=x.device), sigma)
        s_t = noise_level * torch.sqrt(sigma / (1 - sigma_safe))
        mean = x * (1 + s_t**2 * dt / (2 * sigma)) + v * (1 + s_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = s_t * torch.sqrt(-dt)
    else:  # cps: re-noise the predicted x0 with coefficients whose squares still sum to σ'²
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std**2) * x1_hat

    if x_next is None:
        noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        x_next = mean + std * noise
    x_next = x_next.float()
    # The log-density of the stored x_next (not of the drawn noise), so rollout and training compute
    # the very same expression from the very same tensors: on-policy ratios are exactly 1.
    log_prob = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return x_next, log_prob.mean(dim=tuple(range(1, x.dim()))), mean, std


# ----------------------------------------------------------------------------------------------
# Which steps are stochastic (and trained).

def trained_steps(num_steps: int, window: int, window_range: tuple[int, int], seed: int) -> list[int]:
    """Indices i of the SDE transitions σ_i → σ_{i+1}; every other step is ODE.

    window == 0: full mode, every step but the last (Flow-GRPO: 9 of 10).
    window == W > 0: W consecutive steps starting uniformly in [lo, hi − W] (Flow-GRPO-Fast).
    The last step (σ' = 0) is never trained: its transition density is singular.
    """
    check_window(num_steps, window, window_range)
    if window == 0:
        return list(range(num_steps - 1))
    lo, hi = window_range
    start = random.Random(seed).randint(lo, hi - window)
    return list(range(start, start + window))


def check_window(num_steps: int, window: int, window_range: tuple[int, int]) -> None:
    """Raise a ValueError naming the flag and the valid range for an impossible window."""
    if num_steps < 2:
        raise ValueError(f"--num-steps must be >= 2 (one SDE step plus the final ODE step), got {num_steps}")
    if window < 0 or window > num_steps - 1:
        raise ValueError(f"--window must be in [0, {num_steps - 1}] for {num_steps} steps "
                         f"(0 = full mode; the last step is never trained), got {window}")
    lo, hi = window_range
    if window and not (0 <= lo and lo + window <= hi <= num_steps - 1):
        raise ValueError(f"--window-range [{lo}, {hi}) must satisfy 0 <= lo, lo + window <= hi <= {num_steps - 1} "
                         f"(window {window}, {num_steps} steps; the last step is never trained)")
