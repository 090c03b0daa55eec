"""The sampling step with its log-probability, the sigma schedule, the ODE solvers, and the trained steps.

Pure tensor functions; all step math runs in float32 whatever the model dtype (bf16 overflows in
s_t² / (2σ) terms). Notation and formulas: docs/algorithm.md §1–4, §10.
    x_σ = (1 − σ)·x0 + σ·ε,   v ≈ ε − x0,   σ_0 = 1 > σ_1 > … > σ_N = 0,   dt = σ' − σ < 0.
Variants are small functions in tables, chosen by name: SDE_TYPES, ODE_SOLVERS, WINDOW_SCHEDULES; the step-level
pieces of the policy loss (KL forms, the public log-densities, GRPO-Guard's ratio and reweight) live here too.
"""
import functools
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
    sigmas = scheduler.sigmas.to(torch.float32).cpu()
    if not bool((sigmas[1:] < sigmas[:-1]).all()):  # a huge dynamic shift rounds σ_1, … to 1: 0/0 in SDE steps
        raise ValueError(f"the σ schedule of --num-steps {num_steps} at {image_seq_len} image tokens is not strictly "
                         f"decreasing in float32 ({sigmas[:3].tolist()}, …): lower --num-steps or --height/--width")
    return sigmas


@functools.lru_cache(maxsize=2)
def linspace_scheduler_class(linspace: bool = True) -> type:
    """FlowMatchEulerDiscreteScheduler as the Qwen-Image, FLUX.1 and Qwen-Image 2.1 pipelines call it: σ given as
    linspace(1, 1/N, N), then shifted by the config, by mu where it shifts dynamically, else by its static shift.
    Asked for N steps, the scheduler itself spaces σ from its own σ_max to σ_min: `sigma_schedule` does so for a
    static config (SD3.5's pipeline does too), which for these pipelines was another table (a FLUX.1 config of static
    shift 3 under --model-path: σ_1 0.858 where the pipeline's is 0.9). linspace False: as SD3.5's pipeline calls it,
    no σ given even where the config shifts dynamically (sigma_schedule's linspace is dropped: it was another table)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class LinspaceScheduler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
            if not linspace:
                num_inference_steps, sigmas = num_inference_steps or len(sigmas), None
            elif sigmas is None and timesteps is None:
                sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
            super().set_timesteps(num_inference_steps, device=device, sigmas=sigmas, mu=mu, timesteps=timesteps)
    return LinspaceScheduler


def noised(x0, t, noise):
    """The forward process x_t = (1 − t)·x0 + t·ε for t (b,) σ and x0, ε (b, *L)."""
    te = t.view(-1, *[1] * (x0.dim() - 1))
    return (1 - te) * x0 + te * noise


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
# Open intervals of a (docs/methods.md). Above 3 the sde step amplifies the latents (tiny-sd3, 4 to 200 steps: at
# most 663 at 3, 7e4 at 4, NaN at 30; dance: 20 at 3); below 1e-6, no gradient (0 from ~1e-12, NaN from ~1e-21).
NOISE_LEVELS = {"sde": (1e-6, 3.0), "cps": (1e-6, 1.0), "dance": (1e-6, 3.0)}


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


def _sq_gap(mean, mean_ref) -> torch.Tensor:
    """mean((μ − μ_ref)²) over the non-batch elements, (B,)."""
    return ((mean.float() - mean_ref.float()) ** 2).mean(dim=tuple(range(1, mean.dim())))


def std_dev_t(std, dt, sde_type: str) -> torch.Tensor:
    """The `std_dev_t` of Flow-GRPO's step, which its KL divides by: the noise per unit √time s_t = std/√−dt for `sde`
    (DanceGRPO's η for `dance`, which has no KL of its own), the step's std itself for `cps`. (B,) or (1,)."""
    std = torch.as_tensor(std, dtype=torch.float32).reshape(-1)  # dt: from the schedule, on the CPU; std: the model's
    return std if sde_type == "cps" else std / torch.sqrt(-torch.as_tensor(dt, dtype=torch.float32,
                                                                          device=std.device).reshape(-1))


def kl_exact(mean, mean_ref, std, dt, sde_type: str) -> torch.Tensor:
    """The exact KL of two Gaussian transitions of one std, per latent element: mean((μ − μ_ref)²)/(2·std²), (B,)."""
    return _sq_gap(mean, mean_ref) / (2 * torch.as_tensor(std, dtype=torch.float32).reshape(-1) ** 2)


def kl_public(mean, mean_ref, std, dt, sde_type: str) -> torch.Tensor:
    """Flow-GRPO's KL term, mean((μ − μ_ref)²)/(2·std_dev_t²), (B,): for `sde` the exact KL times |dt| (25× smaller at
    SD3.5's first step, 3.7× at its ninth), for `cps` the exact KL."""
    return _sq_gap(mean, mean_ref) / (2 * std_dev_t(std, dt, sde_type) ** 2)


def exact_log_ratio(log_ratio, std, sde_type: str) -> torch.Tensor:
    """The log-ratio of the exact Gaussian densities (§2), unchanged."""
    return log_ratio


def public_log_ratio(log_ratio, std, sde_type: str) -> torch.Tensor:
    """The log-ratio of Flow-GRPO's densities, from the exact one: its `cps` log-prob is −mean((x' − μ)²) (no variance,
    no constants), whose log-ratio is 2·std² times the exact one (std is the policy's and the behaviour's alike); its
    `sde` density, and DanceGRPO's, are the exact ones."""
    if sde_type != "cps":
        return log_ratio
    return log_ratio * (2 * torch.as_tensor(std, dtype=torch.float32).reshape(-1) ** 2)


def no_reweight(sigma, sigma_next) -> float:
    """The divisor of a step's policy loss without GRPO-Guard's reweight: 1."""
    return 1.0


def guard_reweight(sigma, sigma_next) -> torch.Tensor:
    """GRPO-Guard's divisor of a step's policy loss, (√(σ − σ'))² = |dt| as its script computes it: step i then weighs
    1/|dt_i|, which evens out the per-step gradient scale (whose spread over SD3.5's 10 steps is 6.7× without it)."""
    sigma, sigma_next = (torch.as_tensor(s, dtype=torch.float32) for s in (sigma, sigma_next))
    return torch.sqrt(sigma - sigma_next) ** 2


def guard_log_ratio(logp, logp_old, mean, mean_old, std) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio (B,): std·(logp − logp_old) + mean((μ − μ_old)²)/(2·std).

    logp, logp_old: (B,) element-averaged log-densities of the same x' (μ = μ_θ, μ_old its behaviour mean
    (B, ...)); std: the transition's std, a float or (B, 1, ...). With x' = μ_old + std·z this equals
    mean(z·(μ − μ_old)): the −mean((μ − μ_old)²)/(2·std²) term that drags plain ratios below 1 where std
    is small is gone, and the scale no longer grows as 1/std across steps."""
    std = torch.as_tensor(std, dtype=torch.float32, device=logp.device).reshape(-1)  # (B,) or (1,)
    return std * (logp - logp_old) + _sq_gap(mean, mean_old) / (2 * std)


# ----------------------------------------------------------------------------------------------
# ODE solvers for the steps after the trained window (no log-prob needed there). Each takes
# velocity(x, sigma (B,)) -> v, the state x at sigmas[0] and the schedule's remaining sigmas (K + 1, last 0).

def ode_euler(velocity, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """K Euler steps, one model call each: diffusers' FlowMatchEulerDiscreteScheduler, bit for bit."""
    for i in range(len(sigmas) - 1):
        v = velocity(x, sigmas[i].expand(x.shape[0]))
        x = step(v, x, sigmas[i], sigmas[i + 1], sigma_max=1.0, noise_level=0)[0]
    return x


FLASH_POST_RATIO = 0.4  # MixGRPO-Flash's dpm_post_compress_ratio


def euler_calls(k: int) -> int:
    """Euler: one model call per schedule step."""
    return k


def flash_calls(k: int) -> int:
    """MixGRPO-Flash's count for the K steps after the window: int(max(0.4·(K + 1), 1)) σ points from the window's end
    to 0, i.e. one call fewer; at least one call (where Flash keeps a single point, K <= 3, it decodes the window's
    noisy end state: docs/algorithm.md §10). K = 21 (25 steps, window 0–3): 7 calls."""
    return max(int(max((k + 1) * FLASH_POST_RATIO, 1)) - 1, 1) if k else 0


def dpm2_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """The flash_calls(K) + 1 of the K + 1 schedule sigmas that dpm2 steps between: the first and the last (0)
    always, the rest evenly spaced by index (Flash spaces them evenly in unshifted time, which is the index on its
    own schedule: the same points where the spacing is whole). Values of the model's own schedule, never re-derived."""
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
    """MixGRPO-Flash: the same stretch in flash_calls(K) steps of diffusers' DPM-Solver++(2M), one model call each
    (the first step has no history and the last ends at σ = 0: both first order, i.e. Euler; so with fewer than 3
    calls it is Euler on Flash's points)."""
    if len(sigmas) < 2:  # nothing left (the window reached the end)
        return x
    return ode_dpm2_full(velocity, x, dpm2_sigmas(sigmas))


def ode_dpm2_full(velocity, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """DPM-Solver++(2M) on every one of the K steps, one model call each: DiffusionNFT's `dpm2` sampler
    (docs/algorithm.md §12; the first and the last step are first order, the others second)."""
    solver = dpm_solver(sigmas)
    for t in range(len(sigmas) - 1):
        v = velocity(x, sigmas[t].expand(x.shape[0]))
        x = solver.step(v.float(), solver.timesteps[t], x.float(), return_dict=False)[0]
    return x


ODE_SOLVERS = {"euler": ode_euler, "dpm2": ode_dpm2, "dpm2-full": ode_dpm2_full}
ODE_CALLS = {"euler": euler_calls, "dpm2": flash_calls, "dpm2-full": euler_calls}  # dpm2-full: one call per step


def ode_calls(solver: str, k: int) -> int:
    """Model calls of `solver` for K steps of the schedule."""
    return ODE_CALLS[solver](k)


# ----------------------------------------------------------------------------------------------
# Which steps are stochastic (and trained): full mode, or a window placed by a schedule. A window
# schedule maps (num_steps, window, window_range, iteration, seed, slide_every) to the window's first step.

def window_random(num_steps: int, window: int, window_range: tuple[int, int], iteration: int, seed: int,
                  slide_every: int) -> int:
    """Uniform in [lo, hi − W], drawn from `seed` alone (the loop passes one seed per iteration)."""
    lo, hi = window_range
    return random.Random(seed).randint(lo, hi - window)


SLIDE_STRIDE = 1  # MixGRPO's and MixGRPO-Flash's prog_overlap_step


def window_sliding(num_steps: int, window: int, window_range: tuple[int, int], iteration: int, seed: int,
                   slide_every: int) -> int:
    """MixGRPO's progressive window: starts at lo (the noisiest allowed step), moves SLIDE_STRIDE steps later
    every `slide_every` iterations, and rolls back to lo once a whole window no longer fits below hi."""
    lo, hi = window_range
    positions = (hi - window - lo) // SLIDE_STRIDE + 1
    return lo + SLIDE_STRIDE * ((iteration // slide_every) % positions)


WINDOW_SCHEDULES = {"random": window_random, "sliding": window_sliding}


def trained_steps(num_steps: int, window: int, window_range: tuple[int, int], seed: int, *, iteration: int = 0,
                  schedule: str = "random", slide_every: int = 25) -> list[int]:
    """Indices i of the SDE transitions σ_i → σ_{i+1}; every other step is ODE.

    window == 0: full mode, every step but the last (Flow-GRPO: 9 of 10).
    window == W > 0: W consecutive steps inside [lo, hi), placed by WINDOW_SCHEDULES[schedule].
    The last step (σ' = 0) is never trained: its transition density is singular.
    """
    check_window(num_steps, window, window_range)
    if window == 0:
        return list(range(num_steps - 1))
    start = WINDOW_SCHEDULES[schedule](num_steps, window, window_range, iteration, seed, slide_every)
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
    """Refuse, naming the flags, the sampler combinations that cannot work (before anything is built). Any number of
    ODE steps after the window (or, for the forward-process algorithms, on the whole schedule) works with every solver
    (dpm2 takes at least one call; with fewer than 3 steps DPM-Solver++(2M) is Euler)."""
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
