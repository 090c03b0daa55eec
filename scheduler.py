"""The sampling step with its log-probability, the sigma schedule, the ODE solvers, and the trained steps.

Pure tensor functions; all step math runs in float32 whatever the model dtype (bf16 overflows in
s_t² / (2σ) terms). Notation and formulas: docs/algorithm.md §1–4, §10.
    x_σ = (1 − σ)·x0 + σ·ε,   v ≈ ε − x0,   σ_0 = 1 > σ_1 > … > σ_N = 0,   dt = σ' − σ < 0.
Variants are small functions in tables, chosen by name: SDE_TYPES, ODE_SOLVERS, WINDOW_SCHEDULES.
"""
import math
import random

import numpy as np
import torch


# ----------------------------------------------------------------------------------------------
# Sigma schedule: exactly what the model's diffusers pipeline would use, never re-derived.

def sigma_schedule(scheduler, num_steps: int, image_seq_len: int) -> torch.Tensor:
    """σ_0 … σ_N (N + 1 values, float32, last = 0) for `num_steps` steps at `image_seq_len` tokens.

    Qwen-Image and FLUX pipelines pass `sigmas = linspace(1, 1/N, N)` and a resolution-dependent
    `mu` (dynamic shift); diffusers' scheduler then applies the shift and the terminal stretch.
    """
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift  # diffusers: only where it is used
    scheduler = type(scheduler).from_config(scheduler.config)  # a copy (never mutate the caller's), of its own class
    cfg = scheduler.config
    if cfg.use_dynamic_shifting:
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    else:
        scheduler.set_timesteps(num_steps)
    return scheduler.sigmas.to(torch.float32).cpu()


# ----------------------------------------------------------------------------------------------
# One step x_σ → x_σ' with the Gaussian transition density. Each SDE type maps
# (v, x, σ, σ', dt, σ_1, noise level a), float32 and σ's broadcastable to x (B, ...), to (mean, std).

def sde_flow_grpo(v, x, sigma, sigma_next, dt, sigma_max, a):
    """Flow-GRPO's marginal-preserving SDE; σ̃ = σ_1 where σ = 1 (the std is 0/0 there otherwise)."""
    sigma_safe = torch.where(sigma == 1, torch.as_tensor(float(sigma_max), device=x.device), sigma)
    s_t = a * torch.sqrt(sigma / (1 - sigma_safe))
    mean = x * (1 + s_t**2 * dt / (2 * sigma)) + v * (1 + s_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, s_t * torch.sqrt(-dt)


def sde_cps(v, x, sigma, sigma_next, dt, sigma_max, a):
    """Coefficients-preserving sampling: re-noise the predicted x0 with coefficients whose squares sum to σ'²."""
    std = sigma_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    return (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std**2) * x1_hat, std


def sde_dance(v, x, sigma, sigma_next, dt, sigma_max, a):
    """DanceGRPO: constant diffusion a (= η), drift v − ½η²·score, with the score of x given the predicted x0,
    −(x − (1 − σ)·x̂0)/σ²; a proper Gaussian density."""
    x0_hat = x - sigma * v
    score = -(x - x0_hat * (1 - sigma)) / sigma**2
    return x + dt * v + (-0.5 * a**2 * score) * dt, a * torch.sqrt(-dt)


SDE_TYPES = {"sde": sde_flow_grpo, "cps": sde_cps, "dance": sde_dance}
NOISE_LEVELS = {"sde": (0.0, math.inf), "cps": (0.0, 1.0), "dance": (0.0, math.inf)}  # open intervals of a


def _like(s, x: torch.Tensor) -> torch.Tensor:
    """A float or per-sample (B,) sigma as a float32 tensor broadcastable to x (B, ...)."""
    s = torch.as_tensor(s, dtype=torch.float32, device=x.device)
    return s.reshape(s.shape + (1,) * (x.dim() - s.dim())) if s.dim() else s


def step(v, x, sigma, sigma_next, *, sigma_max, noise_level, sde_type="sde", generator=None, x_next=None):
    """One sampling step. Returns `(x_next, log_prob, mean, std)`.

    v, x: (B, ...) velocity and state (any dtype; math in float32). sigma, sigma_next: floats or (B,).
    sigma_max: the schedule's σ_1 (the `sde` type's σ̃ at σ = 1). noise_level == 0 is the Euler (ODE)
    step and log_prob is None. With `x_next` given nothing is drawn and log_prob is the density of that
    transition (how training recomputes it).
    log_prob: (B,), the exact Gaussian log-density averaged over all non-batch elements.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {tuple(SDE_TYPES)}, got {sde_type!r}")
    v, x = v.float(), x.float()
    sigma, sigma_next = _like(sigma, x), _like(sigma_next, x)
    dt = sigma_next - sigma
    if noise_level == 0:
        mean = x + v * dt  # the same expression as diffusers' FlowMatchEulerDiscreteScheduler.step
        return (mean if x_next is None else x_next.float()), None, mean, torch.zeros_like(dt)
    mean, std = SDE_TYPES[sde_type](v, x, sigma, sigma_next, dt, sigma_max, noise_level)
    if x_next is None:
        from diffusers.utils.torch_utils import randn_tensor  # one draw per generator, as the pipelines draw noise
        noise = randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        x_next = mean + std * noise
    x_next = x_next.float()
    # The log-density of the stored x_next (not of the drawn noise), so rollout and training compute
    # the very same expression from the very same tensors: on-policy ratios are exactly 1.
    log_prob = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return x_next, log_prob.mean(dim=tuple(range(1, x.dim()))), mean, std


def guard_log_ratio(logp, logp_old, mean, mean_old, std) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio (B,): std·(logp − logp_old) + mean((μ − μ_old)²)/(2·std).

    logp, logp_old: (B,) element-averaged log-densities of the same x' (μ = μ_θ, μ_old its behaviour mean
    (B, ...)); std: the transition's std, a float or (B, 1, ...). With x' = μ_old + std·z this equals
    mean(z·(μ − μ_old)): the −mean((μ − μ_old)²)/(2·std²) term that drags plain ratios below 1 where std
    is small is gone, and the scale no longer grows as 1/std across steps."""
    std = torch.as_tensor(std, dtype=torch.float32, device=logp.device).reshape(-1)  # (B,) or (1,)
    gap = ((mean.float() - mean_old.float()) ** 2).mean(dim=tuple(range(1, mean.dim())))
    return std * (logp - logp_old) + gap / (2 * std)


# ----------------------------------------------------------------------------------------------
# ODE solvers for the steps after the trained window (no log-prob needed there). Each takes
# velocity(x, sigma (B,)) -> v, the state x at sigmas[0] and the schedule's remaining sigmas (K + 1, last 0).

def ode_euler(velocity, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """K Euler steps, one model call each: diffusers' FlowMatchEulerDiscreteScheduler, bit for bit."""
    for i in range(len(sigmas) - 1):
        v = velocity(x, sigmas[i].expand(x.shape[0]))
        x = step(v, x, sigmas[i], sigmas[i + 1], sigma_max=1.0, noise_level=0)[0]
    return x


STEP_RATIO = {"euler": 1.0, "dpm2": 0.5}  # model calls per schedule step: dpm2 takes ceil(K/2) where Euler takes K


def dpm2_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """The ceil(K/2) + 1 of the K + 1 schedule sigmas that dpm2 steps between: the first and the last (0)
    always, the rest evenly spaced by index. Values of the model's own schedule, never re-derived."""
    k = len(sigmas) - 1
    idx = np.linspace(0, k, ode_calls("dpm2", k) + 1).round().astype(np.int64)
    return sigmas[torch.from_numpy(idx)]


def dpm_solver(sigmas: torch.Tensor):
    """diffusers' DPM-Solver++(2M) for flow matching (x0 = x − σ·v; MixGRPO-Flash's dpmsolver++, order 2,
    midpoint), set to step between `sigmas` (M + 1 values, last 0). Its `set_timesteps` takes no custom
    sigmas (diffusers 0.42), so the table it steps through is filled in after it."""
    from diffusers import DPMSolverMultistepScheduler
    solver = DPMSolverMultistepScheduler(solver_order=2, algorithm_type="dpmsolver++", solver_type="midpoint",
                                         prediction_type="flow_prediction", use_flow_sigmas=True,
                                         final_sigmas_type="zero", lower_order_final=True)
    solver.set_timesteps(len(sigmas) - 1)
    solver.sigmas = sigmas.to(torch.float32).cpu()
    solver.timesteps = sigmas[:-1] * solver.config.num_train_timesteps
    solver.set_begin_index(0)
    return solver


def ode_dpm2(velocity, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """MixGRPO-Flash: the same stretch in ceil(K/2) steps of diffusers' DPM-Solver++(2M), one model call each
    (the first step has no history and the last ends at σ = 0: both first order, i.e. Euler)."""
    if len(sigmas) < 2:  # nothing left (the window reached the end)
        return x
    sub = dpm2_sigmas(sigmas)
    solver = dpm_solver(sub)
    for t in range(len(sub) - 1):
        v = velocity(x, sub[t].expand(x.shape[0]))
        x = solver.step(v.float(), solver.timesteps[t], x.float(), return_dict=False)[0]
    return x


ODE_SOLVERS = {"euler": ode_euler, "dpm2": ode_dpm2}
MIN_ODE_STEPS = {"euler": 0, "dpm2": 5}  # dpm2: >= 3 steps, so that one (the middle) is of second order


def ode_calls(solver: str, k: int) -> int:
    """Model calls of `solver` for K steps of the schedule."""
    return math.ceil(k * STEP_RATIO[solver])


# ----------------------------------------------------------------------------------------------
# Which steps are stochastic (and trained): full mode, or a window placed by a schedule. A window
# schedule maps (num_steps, window, window_range, iteration, seed) to the window's first step.

def window_random(num_steps: int, window: int, window_range: tuple[int, int], iteration: int, seed: int) -> int:
    """Uniform in [lo, hi − W], drawn from `seed` alone (the loop passes one seed per iteration)."""
    lo, hi = window_range
    return random.Random(seed).randint(lo, hi - window)


SLIDE_EVERY, SLIDE_STRIDE = 25, 1  # MixGRPO's public recipe: iters_per_group 25, prog_overlap_step 1


def window_sliding(num_steps: int, window: int, window_range: tuple[int, int], iteration: int, seed: int) -> int:
    """MixGRPO's progressive window: starts at lo (the noisiest allowed step), moves SLIDE_STRIDE steps later
    every SLIDE_EVERY iterations, and rolls back to lo once a whole window no longer fits below hi."""
    lo, hi = window_range
    positions = (hi - window - lo) // SLIDE_STRIDE + 1
    return lo + SLIDE_STRIDE * ((iteration // SLIDE_EVERY) % positions)


WINDOW_SCHEDULES = {"random": window_random, "sliding": window_sliding}


def trained_steps(num_steps: int, window: int, window_range: tuple[int, int], seed: int, *, iteration: int = 0,
                  schedule: str = "random") -> list[int]:
    """Indices i of the SDE transitions σ_i → σ_{i+1}; every other step is ODE.

    window == 0: full mode, every step but the last (Flow-GRPO: 9 of 10).
    window == W > 0: W consecutive steps inside [lo, hi), placed by WINDOW_SCHEDULES[schedule].
    The last step (σ' = 0) is never trained: its transition density is singular.
    """
    check_window(num_steps, window, window_range)
    if window == 0:
        return list(range(num_steps - 1))
    start = WINDOW_SCHEDULES[schedule](num_steps, window, window_range, iteration, seed)
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


def check_variants(num_steps: int, window: int, window_range: tuple[int, int], *, sde_type: str, noise_level: float,
                   window_schedule: str, ode_solver: str) -> None:
    """Refuse, naming the flags, the sampler combinations that cannot work (before anything is built)."""
    check_window(num_steps, window, window_range)
    if sde_type not in SDE_TYPES:
        raise ValueError(f"--sde-type must be one of {tuple(SDE_TYPES)}, got {sde_type!r}")
    lo, hi = NOISE_LEVELS[sde_type]
    if not lo < noise_level < hi:
        raise ValueError(f"--noise-level must be in ({lo:g}, {hi:g}) for --sde-type {sde_type}, got {noise_level}")
    for flag, value, table in (("--window-schedule", window_schedule, WINDOW_SCHEDULES),
                               ("--ode-solver", ode_solver, ODE_SOLVERS)):
        if value not in table:
            raise ValueError(f"{flag} must be one of {tuple(table)}, got {value!r}")
    if window_schedule != "random" and window == 0:
        raise ValueError(f"--window-schedule {window_schedule} moves a window: it needs --window > 0")
    tail = num_steps - (window_range[1] if window else num_steps - 1)  # ODE steps after the latest window
    if tail < MIN_ODE_STEPS[ode_solver]:
        raise ValueError(f"--ode-solver {ode_solver} needs >= {MIN_ODE_STEPS[ode_solver]} ODE steps after the window, "
                         f"but a window reaching step {num_steps - tail - 1} of {num_steps} leaves {tail}: lower the "
                         "--window-range upper bound, raise --num-steps, or use --ode-solver euler")
