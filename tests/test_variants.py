"""The algorithm variants, each against an independent reference: DanceGRPO's SDE step against DanceGRPO's own
formula, MixGRPO's window schedule against its state machine, the dpm2 ODE path against diffusers' solver and the
exact ODE solution of a Gaussian toy, GRPO-Guard's ratio against its closed form, and branched rollouts (shared
prefix, model calls, rank invariance, exact on-policy first update)."""
import dataclasses
import functools
import math
import random

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

import algorithms
import engine as eng
import flowgrpo
import models
import models_qwen
import rollout
import scheduler as sch
from tiny_setup import main_here, random_walk

# ---- DanceGRPO's SDE ---------------------------------------------------------------------------------


def dance_reference(model_output, latents, eta, sigmas, index, prev_sample=None, noise=None):
    """DanceGRPO's `flux_step` (fastvideo/train_grpo_flux.py and train_grpo_qwenimage.py, grpo=True,
    sde_solver=True), its arithmetic re-typed as the oracle; its torch.randn_like draw is passed in as `noise`.
    Returns (prev_sample, mean, log_prob)."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    mean = latents + dsigma * model_output
    x0 = latents - sigma * model_output
    std = eta * math.sqrt(sigma - sigmas[index + 1])  # a Python float, as theirs
    score = -(latents - x0 * (1 - sigma)) / sigma**2
    mean = mean + (-0.5 * eta**2 * score) * dsigma
    if prev_sample is None:
        prev_sample = mean + noise * std
    log_prob = (-((prev_sample - mean) ** 2) / (2 * std**2) - math.log(std)
                - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi))))
    return prev_sample, mean, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def test_dance_step_matches_dancegrpo():
    """Same inputs (their SD3-shifted 20-step schedule, η = 0.3 as their scripts), every step but the last."""
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(1, 0, 21)
    sigmas = 3 * t / (1 + 2 * t)  # their sd3_time_shift(3, ·)
    worst = {"x_next": 0.0, "mean": 0.0, "log_prob (sampled)": 0.0, "log_prob (given x_next)": 0.0}
    for i in range(20 - 1):
        v, x = torch.randn(3, 16, 8, generator=g), torch.randn(3, 16, 8, generator=g)
        z = torch.randn(x.shape, generator=torch.Generator().manual_seed(100 + i))  # ours draws the same z below
        x_ref, mean_ref, lp_ref = dance_reference(v, x, 0.3, sigmas, i, noise=z)
        x_next, lp, mean, _ = sch.step(v, x, sigmas[i], sigmas[i + 1], sigma_max=float(sigmas[1]), noise_level=0.3,
                                       sde_type="dance", generator=torch.Generator().manual_seed(100 + i))
        _, lp_given, _, _ = sch.step(v, x, sigmas[i], sigmas[i + 1], sigma_max=float(sigmas[1]), noise_level=0.3,
                                     sde_type="dance", x_next=x_ref)
        _, _, lp_ref_given = dance_reference(v, x, 0.3, sigmas, i, prev_sample=x_ref)
        for key, a, b in (("x_next", x_next, x_ref), ("mean", mean, mean_ref), ("log_prob (sampled)", lp, lp_ref),
                          ("log_prob (given x_next)", lp_given, lp_ref_given)):
            worst[key] = max(worst[key], (a - b).abs().max().item())
    print(f"\nmax |ours − DanceGRPO| over 19 steps: {worst}")
    assert max(worst.values()) < 1e-5, worst


@pytest.mark.parametrize("level", [0.3, 0.7])
def test_dance_log_prob_is_the_gaussian_density_and_keeps_the_marginals(level):
    """Its log-prob is the exact Normal density; on the 1-D Gaussian toy (exact velocity) it keeps the marginals."""
    g = torch.Generator().manual_seed(0)
    v, x = torch.randn(4, 6, 3, generator=g), torch.randn(4, 6, 3, generator=g)
    x_next, logp, mean, std = sch.step(v, x, 0.7, 0.55, sigma_max=0.95, noise_level=level, sde_type="dance",
                                       generator=g)
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x_next).mean(dim=(1, 2))
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    m, s, n_steps = 1.5, 0.5, 40

    def velocity(x, sigma):  # E[ε − x0 | x_σ = x] for data N(m, s²)
        a = 1 - sigma
        return (sigma - a * s * s) / (a * a * s * s + sigma * sigma) * (x - a * m) - m
    sig = torch.linspace(1, 0, n_steps + 1)
    x = torch.randn(40_000, 1, generator=g)
    for i in range(n_steps):
        x, *_ = sch.step(velocity(x, float(sig[i])), x, sig[i], sig[i + 1], sigma_max=float(sig[1]),
                         noise_level=level if i < n_steps - 1 else 0, sde_type="dance", generator=g)
    assert abs(x.mean().item() - m) < 0.02 and abs(x.std().item() - s) < 0.02, (x.mean().item(), x.std().item())


# ---- MixGRPO's sliding window ------------------------------------------------------------------------

@pytest.mark.parametrize("every", [25, 20])  # MixGRPO's iters_per_group, MixGRPO-Flash's
def test_sliding_window_follows_mixgrpos_state_machine(every):
    """MixGRPO's GRPOTrainingStates (Tencent-Hunyuan/MixGRPO e5cdd6a, fastvideo/utils/grpo_states.py:85-99:
    sample_strategy "progressive", prog_overlap with step 1, roll_back), its start position re-typed as the oracle with
    max_timesteps = hi − W, the last start at which a whole window fits (MixGRPO lets the window shrink past it
    instead: docs/algorithm.md)."""
    lo, hi, w = 1, 6, 2
    cur, in_group, starts = lo, 0, []
    for _ in range(400):
        starts.append(cur)
        in_group += 1
        if in_group >= every:
            in_group, cur = 0, cur + 1
        if cur > hi - w:
            cur, in_group = lo, 0
    ours = [sch.trained_steps(10, w, (lo, hi), seed=it * 7, iteration=it, schedule="sliding", slide_every=every)
            for it in range(400)]
    assert [s[0] for s in ours] == starts and all(s == list(range(s[0], s[0] + w)) for s in ours)
    assert sorted(set(starts)) == [1, 2, 3, 4] and starts[4 * every - 1] == 4 and starts[4 * every] == 1  # rolls back
    # `random` is unchanged: the draw of random.Random(seed) whatever the iteration
    assert all(sch.trained_steps(10, 2, (0, 5), seed=s, iteration=9)[0] == random.Random(s).randint(0, 3)
               for s in range(50))


# ---- MixGRPO-Flash: diffusers' DPM-Solver++(2M) after the window -----------------------------------------

M, S = 1.5, 1.0  # the Gaussian toy: data N(M, S²), whose probability-flow ODE keeps z = (x − (1 − σ)M)/std_σ


def toy_velocity(x, sigma):
    sigma = sigma.reshape(-1, 1)
    a = 1 - sigma
    return (sigma - a * S * S) / (a * a * S * S + sigma * sigma) * (x - a * M) - M


def test_dpm2_reproduces_diffusers_solver_on_its_own_sigmas():
    ref = DPMSolverMultistepScheduler(solver_order=2, algorithm_type="dpmsolver++", solver_type="midpoint",
                                      prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    ref.set_timesteps(6)  # diffusers' own flow sigmas, untouched
    x0 = torch.randn(500, 1, generator=torch.Generator().manual_seed(0))
    x = x0.clone()
    for i, t in enumerate(ref.timesteps):
        x = ref.step(toy_velocity(x, ref.sigmas[i].expand(len(x))), t, x).prev_sample
    ours = sch.dpm_solver(ref.sigmas)
    y = x0.clone()
    for i in range(6):
        y = ours.step(toy_velocity(y, ref.sigmas[i].expand(len(y))), ours.timesteps[i], y, return_dict=False)[0]
    assert torch.equal(x, y), (x - y).abs().max()


def test_dpm2_takes_flashs_calls_and_is_more_accurate_than_euler():
    """On Qwen-Image's schedule at MixGRPO's 25 steps, after a window ending at step 3 (K = 21 ODE steps left): dpm2
    walks 8 of the schedule's own sigmas (Flash's int(0.4·22) points, 7 calls) and lands nearer the exact ODE solution
    than Euler with all 21 calls, and much nearer than Euler on the same 8 sigmas. At 10 steps (K = 7) Flash keeps 3
    points: 2 calls, both first order, i.e. Euler on those points."""
    sigmas = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**models_qwen.QWEN_SCHEDULER), 25, 1024)[4:]
    sub = sch.dpm2_sigmas(sigmas)
    assert len(sub) == 8 and sub[0] == sigmas[0] and sub[-1] == 0 and all(s in sigmas for s in sub)
    z = torch.randn(2000, 1, generator=torch.Generator().manual_seed(0))
    s0 = float(sigmas[0])
    x, exact = (1 - s0) * M + z * math.hypot((1 - s0) * S, s0), M + S * z
    calls = []

    def velocity(x, sigma):
        calls.append(len(x))
        return toy_velocity(x, sigma)
    err = {}
    for name, fn, sig in (("euler K", sch.ode_euler, sigmas), ("dpm2", sch.ode_dpm2, sigmas),
                          ("euler on dpm2's sigmas", sch.ode_euler, sub)):
        calls.clear()
        err[name] = ((fn(velocity, x, sig) - exact).abs().mean().item(), len(calls))
    print(f"\nmean |x − exact ODE solution| (model calls): {err}")
    assert err["dpm2"][1] == 7 == sch.ode_calls("dpm2", 21) and err["euler K"][1] == 21
    assert err["dpm2"][0] < 0.5 * err["euler K"][0] and err["dpm2"][0] < 0.2 * err["euler on dpm2's sigmas"][0], err
    short = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**models_qwen.QWEN_SCHEDULER), 10, 1024)[3:]
    x = (1 - float(short[0])) * M + z * math.hypot((1 - float(short[0])) * S, float(short[0]))
    euler = sch.ode_euler(toy_velocity, x, sch.dpm2_sigmas(short))  # first-order DPM-Solver++ is Euler, up to rounding
    torch.testing.assert_close(sch.ode_dpm2(toy_velocity, x, short), euler, rtol=1e-5, atol=1e-5)


# ---- GRPO-Guard's ratio normalisation ----------------------------------------------------------------

def _transition(seed, shape=(6, 32, 4), std=0.05, shift=0.02):
    """Behaviour mean μ_old, policy mean μ = μ_old + Δ, a draw x' = μ_old + std·z, and both element-averaged
    log-densities, through scheduler.step's own formula (Euler means here stand in for any SDE's)."""
    g = torch.Generator().manual_seed(seed)
    mean_old = torch.randn(shape, generator=g)
    mean = mean_old + shift * torch.randn(shape, generator=g)
    z = torch.randn(shape, generator=g)
    x_next = mean_old + std * z

    def logp(mu):
        return (-((x_next - mu) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(dim=(1, 2))
    return logp(mean), logp(mean_old), mean, mean_old, z


def test_guard_log_ratio_is_zero_on_policy_and_equals_its_closed_form():
    logp, logp_old, mean, mean_old, z = _transition(0)
    same = sch.guard_log_ratio(logp_old, logp_old, mean_old, mean_old, 0.05)
    assert torch.equal(same, torch.zeros(6))  # μ_θ = μ_old: exactly 0 (ratio exactly 1)
    guard = sch.guard_log_ratio(logp, logp_old, mean, mean_old, torch.full((6, 1, 1), 0.05))
    closed = (z * (mean - mean_old)).mean(dim=(1, 2))
    torch.testing.assert_close(guard, closed, rtol=1e-4, atol=1e-6)
    # the same through scheduler.step's own transition (its mean, std and log-prob), at two policies
    g = torch.Generator().manual_seed(1)
    v_old, x = torch.randn(6, 32, 4, generator=g), torch.randn(6, 32, 4, generator=g)
    v = v_old + 0.05 * torch.randn(6, 32, 4, generator=g)
    kw = dict(sigma_max=0.95, noise_level=0.7, sde_type="sde")
    x_next, lp_old, mu_old, std = sch.step(v_old, x, 0.6, 0.5, generator=g, **kw)
    _, lp, mu, _ = sch.step(v, x, 0.6, 0.5, x_next=x_next, **kw)
    z = (x_next - mu_old) / std
    torch.testing.assert_close(sch.guard_log_ratio(lp, lp_old, mu, mu_old, std), (z * (mu - mu_old)).mean(dim=(1, 2)),
                               rtol=1e-3, atol=1e-6)


def test_guard_removes_the_downward_bias_of_plain_ratios():
    """A low-noise step (std 0.05) and a policy that moved the mean by 0.02 per element: plain ratios of
    element-averaged log-densities have mean exp(−(1 − 1/D)·mean(Δ²)/(2·std²)) ≈ 0.92 under the behaviour
    policy; GRPO-Guard's have mean exp(mean(Δ²)/(2D)) ≈ 1."""
    plain, guard = [], []
    for seed in range(100):
        logp, logp_old, mean, mean_old, _ = _transition(seed, shape=(40, 128, 8))
        plain.append(torch.exp(logp - logp_old))
        guard.append(torch.exp(sch.guard_log_ratio(logp, logp_old, mean, mean_old, 0.05)))
    plain, guard = torch.cat(plain).mean().item(), torch.cat(guard).mean().item()
    print(f"\nmean ratio over 4000 draws: plain {plain:.4f}, GRPO-Guard {guard:.6f}")
    assert plain < 0.95 and abs(guard - 1) < 1e-3, (plain, guard)


# ---- impossible combinations are refused, naming the flags ---------------------------------------------

@pytest.mark.parametrize("kw,flags", [
    (dict(sde_type="dance", noise_level=0.0), "--noise-level.*--sde-type dance"),
    (dict(sde_type="cps", noise_level=1.2), "--noise-level.*--sde-type cps"),
    # beyond these every step of the tiny model is skipped (NaN) or its latents grow past any flow-matching latent
    (dict(noise_level=1e5), r"--noise-level must be in \(1e-06, 3\) for --sde-type sde, got 100000"),
    (dict(noise_level=1e-25), r"--noise-level must be in \(1e-06, 3\)"),
    (dict(sde_type="dance", noise_level=10.0), r"--noise-level must be in \(1e-06, 3\) for --sde-type dance"),
    (dict(sde_type="ddim"), "--sde-type"),
    (dict(window=0, window_schedule="sliding"), "--window-schedule sliding.*--window"),
    (dict(window_schedule="cosine"), "--window-schedule"),
    (dict(ode_solver="heun"), "--ode-solver")])
def test_impossible_variant_combinations_are_refused(kw, flags):
    args = dict(num_steps=10, window=2, window_range=(0, 5), sde_type="sde", noise_level=0.7,
                window_schedule="random", ode_solver="euler") | kw
    with pytest.raises(ValueError, match=flags):
        sch.check_variants(args.pop("num_steps"), args.pop("window"), args.pop("window_range"), **args)
    sch.check_variants(10, 2, (0, 5), sde_type="dance", noise_level=0.3, window_schedule="sliding", ode_solver="dpm2")
    for window_range, window in (((0, 9), 2), ((0, 9), 0)):  # dpm2 takes at least one call: any tail is possible
        sch.check_variants(10, window, window_range, sde_type="sde", noise_level=0.7, window_schedule="random",
                           ode_solver="dpm2")


# ---- branched rollouts and the dpm2 tail on the tiny model ---------------------------------------------

PROMPTS = ["a cat"] * 4 + ["a tall house"] * 4  # 2 groups of G = 4
KW = dict(num_steps=6, height=32, width=32, cfg_scale=1.0, negative_prompt=" ", noise_level=0.7, sde_type="sde",
          seed=0, iteration=1)


@pytest.fixture(scope="module")
def tiny():
    """The tiny model, whose velocity calls are counted (rows per call)."""
    model = models.load_model("tiny", None, "cpu", seed=0)
    model.calls = []
    velocity = model.velocity

    def counted(x, *args, **kwargs):
        model.calls.append(x.shape[0])
        return velocity(x, *args, **kwargs)
    model.velocity = counted
    return model


def run(model, ids, *, chunk=4, **kw):
    model.calls.clear()
    return rollout.sample(model, [PROMPTS[i] for i in ids], [{}] * len(ids), [i // 4 for i in ids], ids, chunk=chunk,
                          **(KW | kw))


def test_branched_groups_share_the_prefix_and_cost_s_plus_g_times_n_minus_s(tiny):
    s, n = 2, KW["num_steps"]
    b = run(tiny, list(range(8)), steps=[s, s + 1], branch=True)
    assert sum(tiny.calls) == 2 * s + 8 * (n - s)  # per group s + G·(N − s) image-steps, not G·N
    assert tiny.calls[:2 * s] == [1] * (2 * s)  # each group's prefix alone
    for g in (0, 4):
        group = b.latents[g:g + 4]
        assert all(torch.equal(group[0, 0], group[i, 0]) for i in range(4))  # identical up to the window start
        assert all(not torch.equal(group[0, 1], group[i, 1]) for i in range(1, 4))  # each its own SDE step
        assert all((b.images[g] - b.images[g + i]).abs().max() > 1e-3 for i in range(1, 4))
    assert not torch.equal(b.latents[0, 0], b.latents[4, 0])  # groups have their own noise
    indep = run(tiny, list(range(8)), steps=[s, s + 1])
    assert sum(tiny.calls) == 8 * n and not torch.equal(indep.latents[0, 0], indep.latents[1, 0])


def test_a_groups_images_do_not_depend_on_the_ranks(tiny):
    """One rank with all 8 images vs two "ranks" each holding half of each group (as a shuffled assignment does),
    at the same micro-batch size: the same bits, prefixes included."""
    whole = run(tiny, list(range(8)), steps=[2, 3], branch=True)
    order = [0, 5, 2, 7, 1, 4, 3, 6]
    parts = [run(tiny, order[:4], steps=[2, 3], branch=True), run(tiny, order[4:], steps=[2, 3], branch=True)]
    assert sum(tiny.calls) == 2 * 2 + 4 * 4  # the second rank computes both groups' prefixes too
    back = torch.argsort(torch.tensor(order))
    for key in ("latents", "log_probs", "images"):
        split = torch.cat([getattr(p, key) for p in parts])[back]
        assert torch.equal(split, getattr(whole, key)), (key, (split - getattr(whole, key)).abs().max())


def test_branched_first_update_is_exactly_on_policy(tiny):
    args = dataclasses.replace(flowgrpo.RECIPES["tiny"], num_steps=6, window=2, window_range=(0, 4), group_size=4,
                               prompts_per_iteration=2, micro_batch=4, optimizer_steps=2)
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0)
    batch = rollout.sample(model, PROMPTS, [{}] * 8, [0] * 4 + [1] * 4, range(8), steps=[2, 3], chunk=4, branch=True,
                           **(KW | dict(noise_level=args.noise_level)))
    batch.advantages = torch.linspace(-1, 1, 8)
    stats = algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0 and stats["train/grad_norm"] > 0


@pytest.mark.parametrize("steps,branch,cfg,kl,k", [([0, 1, 2, 3, 4], False, 3.0, 0.0, 2), ([2, 3], True, 1.0, 0.1, 2),
                                                    ([1, 2], False, 1.0, 0.0, 1)])
def test_reusing_the_rollouts_forward_gives_the_same_update_to_the_bit(steps, branch, cfg, kl, k):
    """--reuse-rollout-forward: the first optimizer step trains on the rollout's own forwards (kept with their graphs),
    so each trained step of its images costs one transformer forward less, and the update lands on the same weights,
    bit for bit, as recomputing them (full mode with CFG; a branched window with the KL term; one optimizer step)."""
    args = dataclasses.replace(flowgrpo.RECIPES["tiny"], num_steps=6, window=len(steps) if len(steps) < 5 else 0,
                               window_range=(0, 4), group_size=4, prompts_per_iteration=2, micro_batch=2,
                               optimizer_steps=k, cfg_scale=cfg, kl_beta=kl)
    loras, calls = [], []
    for keep in (0, 8 // k):
        model = models.load_model("tiny", None, "cpu", seed=0)
        engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2,
                            weight_decay=0, max_grad_norm=1.0, seed=0)
        passes = model.passes
        batch = rollout.sample(model, PROMPTS, [{}] * 8, [0] * 4 + [1] * 4, range(8), steps=steps, chunk=2,
                               branch=branch, keep=keep, **(KW | dict(noise_level=args.noise_level, cfg_scale=cfg)))
        assert len(batch.graphs) == keep // 2 * len(steps)  # one per (micro-batch, trained step) of the first step
        assert all(v.requires_grad for v in batch.graphs.values()) and not batch.latents.requires_grad
        batch.advantages = torch.linspace(-1, 1, 8)
        stats = algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), progress=False)
        assert stats["train/logp_gap"] == 0.0 and stats["train/grad_norm"] > 0 and not batch.graphs
        calls.append(model.passes - passes)
        loras.append({n: p.detach().clone() for n, p in model.transformer.named_parameters() if p.requires_grad})
    for name, p in loras[0].items():
        assert torch.equal(p, loras[1][name]), (name, (p - loras[1][name]).abs().max())
    assert any(p.abs().max() > 0 for n, p in loras[0].items() if "lora_B" in n)  # the update moved the weights
    cfg_rows = 2 if cfg > 1 else 1  # rows per image of one forward: a transformer call holds both CFG branches
    assert calls[0] - calls[1] == 8 // k * len(steps) * cfg_rows, calls


def test_dpm2_changes_only_the_tail(tiny):
    """dpm2 leaves the trained steps' data bit for bit and takes the 9 ODE steps after the window in Flash's 3 calls
    (int(0.4·10) = 4 points) of diffusers' solver, from the window's last state, on the schedule's own sigmas."""
    kw = dict(steps=[1, 2], num_steps=12)
    euler = run(tiny, list(range(8)), **kw)
    euler_calls = sum(tiny.calls)
    dpm2 = run(tiny, list(range(8)), ode_solver="dpm2", **kw)
    assert euler_calls == 8 * 12 and sum(tiny.calls) == 8 * (3 + 3)
    for key in ("latents", "log_probs", "sigmas"):
        assert torch.equal(getattr(euler, key), getattr(dpm2, key)), key
    assert (euler.images - dpm2.images).abs().max() > 1e-4
    sigmas = sch.sigma_schedule(tiny.scheduler, 12, tiny.image_seq_len(32, 32))[3:]
    sub = sch.dpm2_sigmas(sigmas)
    solver = sch.dpm_solver(sub)
    x = dpm2.latents[:4, -1]
    velocity = functools.partial(tiny.velocity, cond={k: v[:4] for k, v in dpm2.cond.items()}, cfg_scale=1.0,
                                 height=32, width=32)
    for t in range(len(sub) - 1):
        x = solver.step(velocity(x, sub[t].expand(4)), solver.timesteps[t], x).prev_sample
    assert torch.equal(tiny.decode(x, 32, 32), dpm2.images[:4])


# ---- EMA (engine.EMA): a bit-exact swap under FSDP2, DCP checkpoints, 1 vs 2 ranks (its forms: test_parity.py) ----

@pytest.fixture(scope="module")
def full_finetune():
    """The tiny model fully fine-tuned under FSDP2 (a world of one, sharded as on several ranks): the root module has
    trained weights too."""
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0, full_finetune=True, shard=True)
    names = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    return model, engine, names


def velocity_of(model):
    c = model.conditioning(["a cat", "a dog"], " ", 1.0)
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.velocity(x, torch.full((2,), 0.6), c, 1.0, 32, 32)


def test_ema_swap_is_what_the_forward_sees_and_restores_every_bit(full_finetune, tmp_path):
    import torch.distributed.checkpoint as dcp
    model, engine, names = full_finetune
    ema = eng.EMA(zip(names, engine.params), decay=0.9, every=2, repeat=2)
    with torch.no_grad():  # move the trained weights away from the average, as optimizer steps would
        for k in range(5):
            for p in engine.params:
                p.to_local().add_(0.01 * (k + 1))
            ema.step()
    trained, v_trained = [p.to_local().clone() for p in engine.params], velocity_of(model)
    with ema.swapped():
        v_ema = velocity_of(model)
    assert (v_ema - v_trained).abs().max() > 1e-3  # the forward saw the EMA weights ...
    assert all(torch.equal(p.to_local(), t) for p, t in zip(engine.params, trained))  # ... and gave them back
    assert torch.equal(velocity_of(model), v_trained)
    dcp.save({"ema": ema.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    fresh = eng.EMA(zip(names, engine.params), decay=0.9, every=2, repeat=2)  # starts at the current weights, step 0
    dcp.load({"ema": fresh.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))  # fills its tensors in place
    assert int(fresh.steps) == 5
    worst = max((a.to_local() - b.to_local()).abs().max().item() for a, b in zip(fresh.shadow, ema.shadow))
    assert worst == 0, f"EMA after a DCP round trip differs by {worst:.3g}"


EMA_KINDS = [dict(decay=0.9, every=3, repeat=2), dict(decay=0.995, every=1, form="dance")]  # Flow-GRPO's, DanceGRPO's


def _two_rank_ema(rank, port, out):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4))
    for layer in net[:2]:
        fully_shard(layer)
    fully_shard(net)  # the last layer belongs to the root
    params = list(net.parameters())
    walk = random_walk(31, [tuple(p.shape) for p in params])
    for i, values in enumerate(walk):
        with torch.no_grad():
            for p, v in zip(params, values):
                p.to_local().copy_(distribute_tensor(v, p.device_mesh, p.placements).to_local())
        if i == 0:
            emas = [eng.EMA(net.named_parameters(), **kw) for kw in EMA_KINDS]
        else:
            for ema in emas:
                ema.step()
    assert all(e.to_local().numel() * 2 == e.numel() for ema in emas for e in ema.shadow)  # each rank: half of each
    full = [e.full_tensor() for ema in emas for e in ema.shadow]
    if rank == 0:
        torch.save(full, out)
    eng.shutdown()
    eng.exit_process(0)  # as flowgrpo.py ends: the interpreter's teardown can abort a process that ran collectives


def test_ema_on_two_ranks_keeps_shards_and_matches_one_process(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_two_rank_ema, args=(port, str(tmp_path / "ema.pt")), nprocs=2)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4))
    params = list(net.parameters())
    for i, values in enumerate(random_walk(31, [tuple(p.shape) for p in params])):
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)
        if i == 0:
            emas = [eng.EMA(net.named_parameters(), **kw) for kw in EMA_KINDS]
        else:
            for ema in emas:
                ema.step()
    two = torch.load(str(tmp_path / "ema.pt"), weights_only=True)
    worst = max((a - b).abs().max().item() for a, b in zip(two, [e for ema in emas for e in ema.shadow]))
    assert worst == 0, f"2-rank EMA differs from one process's by {worst:.3g}"


@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_the_first_update_is_exactly_on_policy_when_an_image_is_one_token(tmp_path, model):
    """At 8×8 an image is one latent token: the update's velocity on a strided slice of the stored latents rounded
    otherwise than the rollout's on a contiguous tensor (logp_gap 2.5e-8 for tiny, 3.0e-8 for tiny-flux)."""
    rows = main_here("--model", model, "--iterations", "1", "--height", "8", "--width", "8", "--eval-every", "0",
                     "--run-dir", str(tmp_path / "run"))
    assert rows[0]["train/logp_gap"] == 0, rows[0]["train/logp_gap"]
