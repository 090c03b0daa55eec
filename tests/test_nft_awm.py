"""DiffusionNFT and Advantage Weighted Matching (algorithms.py, docs/algorithm.md §12) against their authors' public
code, re-typed below as oracles on the same tensors: the losses and their gradients, the old policy's decay and copy
loop, the timestep sampling and DiffusionNFT's sampler; the ODE-only rollout; the old policy as engine state (swapped
into the forward, FSDP2's root included); and the real script (flowgrpo.main in this process, torchrun for 2 ranks):
every family, LoRA and full fine-tuning, 1 process vs 2 ranks, exact resume, and the flags each algorithm refuses.

Public code (re-typed, not copied):
  NFT  NVlabs/DiffusionNFT @ 24af5554898d85e93efa492f42b5e9cdf4156e9b: scripts/train_nft_sd3.py (return_decay,
       lines 169–189; the loss block, 862–975; the old-policy copy loop, 1034–1039), flow_grpo/diffusers_patch/solver.py
       (run_sampling with solver "dpm2", dpm_step and its updates)
  AWM  scxue/advantage_weighted_matching @ be5137232e33a21b449ed65a533211d0deb97ed8:
       advantage_weighted_matching/scripts/train_sd3_awm.py (compute_log_prob_awm, 210–252; the discrete timestep
       strata, 1172–1205; the loss, 1292–1354; the "ema" adapter's decay, 1409–1419)
  verl-omni  verl-project/verl-omni @ 1561b12ffed4141a31b071783376eb596134128a:
       verl_omni/trainer/diffusion/direct_preference_handlers.py (post_actor_update: the old policy every
       old_policy_update_interval steps, decayed at the step count)
"""
import dataclasses
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import algorithms
import algorithms_forward
import engine as eng
import flowgrpo
import models
import rollout
import scheduler as sch
import startup
from test_engine import ENV, ROOT, SMALL, flat, launch, relative_difference, rows, train_state, without_perf
from test_variants import random_walk, toy_velocity
from tiny_setup import main_here

TINY = flowgrpo.RECIPES["tiny"]


def forward_tensors(seed=0, b=4, shape=(16, 8, 8)):
    """x0, noise, t (one at σ = 1), and the trained (a leaf), old and reference velocities, SD3-shaped latents."""
    g = torch.Generator().manual_seed(seed)
    x0, noise, v_old, v_ref = (torch.randn(b, *shape, generator=g) for _ in range(4))
    v = (v_old + 0.1 * torch.randn(b, *shape, generator=g)).requires_grad_()
    t = torch.cat([torch.ones(1), torch.rand(b - 1, generator=g) * 0.98 + 0.01])
    return x0, noise, t, v, v_old, v_ref


def worst(a, b):
    return (a.double() - b.double()).abs().max().item()


# ---- DiffusionNFT's loss -------------------------------------------------------------------------------------------

def nft_public(x0, noise, t, forward, old, ref, adv, *, beta, clip, kl_beta):
    """train_nft_sd3.py's loss block (adv_mode "all"), re-typed: t is its timesteps / 1000 (b,)."""
    dims = tuple(range(1, x0.ndim))
    te = t.view(-1, *([1] * (x0.ndim - 1)))
    xt = (1 - te) * x0 + te * noise
    r = torch.clamp((torch.clamp(adv, -clip, clip) / clip) / 2.0 + 0.5, 0, 1)
    pos = beta * forward + (1 - beta) * old.detach()
    neg = (1.0 + beta) * old.detach() - beta * forward

    def weighted(pred):  # their positive_loss / negative_loss with the adaptive weight factor
        x0_pred = xt - te * pred
        with torch.no_grad():
            factor = torch.abs(x0_pred.double() - x0.double()).mean(dim=dims, keepdim=True).clip(min=0.00001)
        return ((x0_pred - x0) ** 2 / factor).mean(dim=dims)
    loss = ((r * weighted(pos) / beta + (1.0 - r) * weighted(neg) / beta) * clip).mean()
    loss = loss + kl_beta * torch.mean(((forward - ref) ** 2).mean(dim=dims))
    return loss, xt


@pytest.mark.parametrize("beta,kl_beta", [(1.0, 1e-4), (0.1, 1e-4), (0.1, 0.0)])
def test_nft_loss_and_gradient_equal_diffusionnft(beta, kl_beta):
    x0, noise, t, v, v_old, v_ref = forward_tensors()
    adv = torch.tensor([-7.0, -2.0, 0.5, 6.0])  # beyond the clip on both sides
    a = SimpleNamespace(adv_clip=5.0)
    theirs, xt = nft_public(x0, noise, t, v, v_old, v_ref, adv, beta=beta, clip=5.0, kl_beta=kl_beta)
    (g_theirs,) = torch.autograd.grad(theirs, v)
    ours, stats = algorithms_forward.nft_objective(v, v_old, v_ref if kl_beta else None, x0, sch.noised(x0, t, noise),
                                           t, algorithms_forward.nft_weights(adv, None, a), beta=beta, adv_clip=5.0, kl_beta=kl_beta)
    (g_ours,) = torch.autograd.grad(ours, v)
    loss_rel, grad_rel = abs(ours.item() - theirs.item()) / abs(theirs.item()), worst(g_ours, g_theirs) / g_theirs.abs().max().item()
    print(f"\nβ {beta}, KL {kl_beta}: loss {ours.item():.6g} (rel. diff {loss_rel:.2g}), gradient max rel. diff {grad_rel:.2g}")
    assert torch.equal(sch.noised(x0, t, noise), xt)
    assert loss_rel < 1e-6 and grad_rel < 1e-6, (loss_rel, grad_rel)
    assert float(stats["old_kl"]) > 0 and (float(stats["kl"]) > 0) == (kl_beta > 0)


def test_advantages_are_the_public_per_prompt_tracker_with_global_std():
    """Both public scripts turn rewards into advantages with flow_grpo's PerPromptStatTracker(global_std=True):
    (r − the prompt's mean) / (the population std of all rewards + 1e-4), re-typed here; the loop's group_advantages
    with --std global is that (then clipped to ±5, as both losses clip it again)."""
    g = torch.Generator().manual_seed(2)
    rewards = torch.rand(6 * 4, generator=g).double() * torch.tensor([0.0, 1, 1, 1, 1, 1]).repeat_interleave(4)
    prompts = torch.arange(24) // 4  # group 0: all rewards equal (0), its advantages 0
    std = rewards.numpy().std() + 1e-4
    theirs = torch.tensor([(rewards[i] - rewards[prompts == prompts[i]].mean()).item() / std for i in range(24)])
    ours, zero = algorithms.group_advantages(rewards.float(), prompts, std="global", clip=5.0)
    assert worst(ours, theirs.clamp(-5, 5)) < 1e-6 and zero == 1 / 6


# ---- AWM's loss ----------------------------------------------------------------------------------------------------

def awm_public(x0, noise, t, v, v_ref, v_ema, adv, *, T, clip, beta, ema_beta, power=0.25):
    """train_sd3_awm.py, on-policy (`old_log_probs` = the log-probs detached), ghuber weighting, exp_first, clip range
    1, advantage_max 1, Uniform KLs, re-typed. Inputs hold the T timesteps stacked: (T·B, …), slot-major; adv (B,)."""
    B = len(adv)
    dims = tuple(range(1, x0.ndim))
    out = v.double()
    log_prob = (-(out - (noise.double() - x0.double())) ** 2).mean(dim=dims)
    eps = torch.tensor(1e-10, dtype=torch.float64)
    log_prob = -(torch.pow(-log_prob + 1e-10, power) - torch.pow(eps, power)) * t.view(-1) / power
    ratio = torch.exp(log_prob - log_prob.detach())
    a = (torch.clamp(adv, -clip, clip) / clip * 1).unsqueeze(0).repeat(T, 1).view(-1)
    policy = torch.mean(torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1.0 - 1, 1.0 + 1)))

    def uniform_kl(other):  # ((v − other)²).mean over C, H, W per (t, b), then over t, then over b
        gap = ((out.reshape(T, B, *x0.shape[1:]) - other.double().reshape(T, B, *x0.shape[1:])) ** 2)
        return gap.mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
    return policy + beta * uniform_kl(v_ref) + ema_beta * uniform_kl(v_ema)


@pytest.mark.parametrize("beta,ema_beta", [(0.003, 1.0), (1e-4, 0.0)])
def test_awm_loss_and_gradient_equal_the_authors_code(beta, ema_beta):
    T, B = 3, 4
    x0, noise, t, v, v_old, v_ref = forward_tensors(seed=1, b=T * B)
    adv = torch.tensor([-7.0, -1.5, 0.3, 4.0])
    theirs = awm_public(x0, noise, t, v, v_ref, v_old, adv, T=T, clip=5.0, beta=beta, ema_beta=ema_beta)
    (g_theirs,) = torch.autograd.grad(theirs, v)
    w = algorithms_forward.awm_weights(adv, None, SimpleNamespace(adv_clip=5.0))
    ours = sum(algorithms_forward.awm_objective(v[s], v_ref[s], v_old[s] if ema_beta else None, x0[s], noise[s], t[s], w,
                                        kl_beta=beta, old_kl=ema_beta)[0] for s in (slice(j * B, (j + 1) * B)
                                                                                     for j in range(T))) / T
    (g_ours,) = torch.autograd.grad(ours, v)
    loss_diff, grad_rel = abs(ours.item() - theirs.item()), worst(g_ours, g_theirs) / g_theirs.abs().max().item()
    print(f"\nβ {beta}, old-KL {ema_beta}: loss {ours.item():.6g} (|diff| {loss_diff:.2g}), gradient max rel. diff "
          f"{grad_rel:.2g}")
    assert loss_diff < 1e-12 and grad_rel < 1e-12, (loss_diff, grad_rel)  # both in float64, as the public code
    assert abs(ours.item() - (-w.mean().item() + beta * ((v - v_ref) ** 2).mean().item() + ema_beta * (
        (v - v_old) ** 2).mean().item())) < 1e-5  # the ratio is 1 on-policy: the value is −mean(w) + the regularisers


# ---- the old policy: decay schedules and the copy loop, bit for bit ---------------------------------------------------

def public_decay(schedule, n):
    """return_decay(step, decay_type) of train_nft_sd3.py (types 0/1/2), AWM's linear kl_ema_decay 0.3, re-typed."""
    if schedule == "awm":
        return min(0.3, 0.001 * n)
    flat, uprate, uphold = {"nft0": (0, 0.0, 0.0), "nft1": (0, 0.001, 0.5), "nft2": (75, 0.0075, 0.999),
                            "nft2-iterations": (75, 0.0075, 0.999)}[schedule]
    return 0.0 if n < flat else min((n - flat) * uprate, uphold)


@pytest.mark.parametrize("schedule,K,every", [("nft0", 1, 1), ("nft1", 1, 1), ("nft2", 2, 1), ("awm", 1, 1),
                                              ("nft2-iterations", 2, 2)])
def test_old_policy_follows_the_public_decay_and_copy_loop_bit_for_bit(schedule, K, every):
    """100 iterations of K optimizer steps on a random walk of the weights. DiffusionNFT and AWM move the old policy
    after each iteration with the decay at their optimizer-step count; verl-omni every `every` iterations, at the
    iteration count (its global_steps, from 1)."""
    shapes = [(4, 3), (5,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(4))) for s in shapes]
    engine = SimpleNamespace(old=eng.OldPolicy(zip("ab", params)))
    theirs = [p.detach().clone() for p in params]
    a = SimpleNamespace(old_decay=schedule, optimizer_steps=K, old_every=every)
    decays = set()
    for it, values in enumerate(random_walk(100, shapes, seed=5)):
        with torch.no_grad():
            for p, value in zip(params, values):
                p.copy_(value)
        algorithms_forward.move_old(engine, a, it)
        step = it + 1 if schedule == "nft2-iterations" else (it + 1) * K
        if (it + 1) % every == 0:
            decay = public_decay(schedule, step)
            decays.add(decay)
            for tgt, src in zip(theirs, params):
                tgt.data.copy_(tgt.detach().data * decay + src.detach().clone().data * (1.0 - decay))
        gap = max(worst(o, t) for o, t in zip(engine.old.shadow, theirs))
        assert gap == 0, f"iteration {it}: the old policy differs from the public loop's by {gap:.3g}"
    assert len(decays) > (1 if schedule != "nft0" else 0)  # the ramp moved (and nft0 stays a copy: decay 0)
    assert not torch.equal(engine.old.shadow[0], params[0]) or schedule == "nft0"


# ---- timestep sampling ----------------------------------------------------------------------------------------------

def awm_public_strata(lo, hi, T):
    """train_sd3_awm.py's discrete (lo 0) and discrete_wo_init (lo 1) boundaries, hi = int(num_steps·0.9), re-typed."""
    boundaries = torch.linspace(lo, hi, steps=T + 1)
    return boundaries[:-1].long(), boundaries[1:].long()


@pytest.mark.parametrize("lo", [0, 1])
def test_timesteps_are_drawn_as_the_public_code_per_image(lo):
    a = SimpleNamespace(train_timesteps=6, train_timestep_range=(lo, int(14 * 0.9)), seed=3)
    lower, upper = algorithms_forward.awm_strata(a)
    assert all(torch.equal(x, y) for x, y in zip((lower, upper), awm_public_strata(lo, 12, 6)))
    g = torch.Generator().manual_seed(0)
    drawn = torch.stack([algorithms_forward.awm_timesteps(g, a) for _ in range(2000)])  # (2000, T)
    assert bool(((drawn >= lower) & (drawn < upper)).all())
    assert all(set(drawn[:, k].tolist()) == set(range(lower[k], upper[k])) for k in range(6))  # every step reached
    a = SimpleNamespace(train_timesteps=9, train_timestep_range=(0, 10), seed=3)
    nft = torch.stack([algorithms_forward.nft_timesteps(g, a) for _ in range(2000)])
    assert all(len(set(row.tolist())) == 9 for row in nft) and set(nft.flatten().tolist()) == set(range(10))
    # an image's draws depend on (seed, iteration, image id) only: not on the micro-batch it is in
    mb = SimpleNamespace(ids=torch.tensor([7, 2]), iteration=4, x0=torch.zeros(2, 16, 4))
    one = SimpleNamespace(ids=torch.tensor([2]), iteration=4, x0=torch.zeros(1, 16, 4))
    schedule = torch.linspace(1, 0, 11)
    both, alone = algorithms_forward.draws(mb, a, schedule, algorithms_forward.nft_timesteps), \
        algorithms_forward.draws(one, a, schedule, algorithms_forward.nft_timesteps)
    assert torch.equal(both[0][1], alone[0][0]) and torch.equal(both[1][1], alone[1][0])
    assert not torch.equal(both[1][0], both[1][1])
    later = algorithms_forward.draws(SimpleNamespace(ids=torch.tensor([2]), iteration=5, x0=one.x0), a, schedule,
                             algorithms_forward.nft_timesteps)
    assert not torch.equal(later[1], alone[1])


# ---- the ODE-only rollout and DiffusionNFT's sampler -------------------------------------------------------------------

def nft_dpm2_public(velocity, z, sigmas):
    """DiffusionNFT's run_sampling(solver="dpm2", deterministic=True) (solver.py), re-typed: per step x̂0 = z − σ·v; the
    first and the last step its DDIM update at η = 0, the others DPM-Solver++(2M) (midpoint), σ in float64."""
    s64, history = sigmas.to(torch.float64), []
    for i in range(len(sigmas) - 1):
        x0 = z.float() - sigmas[i] * velocity(z, sigmas[i].expand(len(z))).float()
        history.append(x0)
        t, s = s64[i + 1], s64[i]
        if i == 0 or i == len(sigmas) - 2:
            z = (1 - t) * x0 + torch.sqrt(t ** 2) * ((z - (1 - s) * x0) / s)
            continue

        def lam(sig):  # log α − log σ, α = 1 − σ
            return torch.log(1 - sig) - torch.log(sig)
        h, h0 = lam(t) - lam(s), lam(s) - lam(s64[i - 1])
        d0, d1 = history[-1], (1.0 / (h0 / h)) * (history[-1] - history[-2])
        z = (t / s) * z - ((1 - t) * (torch.exp(-h) - 1.0)) * d0 - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
    return z


def test_dpm2_full_is_diffusionnfts_sampler_to_rounding():
    """The Gaussian toy on SD3's 10-step schedule: our dpm2-full (diffusers' DPM-Solver++(2M) on every step) against
    DiffusionNFT's own solver: the same update in other arithmetic (diffusers' first-order DPM++ form where it writes
    DDIM, float32 σ where it upcasts them to float64). Measured and printed, not asserted: the distance of each to
    the exact ODE solution, and Euler's (on this schedule the second-order step from σ 0.28 to 0.009 extrapolates
    the x0 predictions 4.6-fold, and both end farther from the exact solution than Euler)."""
    sigmas = sch.sigma_schedule(models.adapter_class("tiny-sd3").build_tiny(0).scheduler, 10, 16)
    z = torch.randn(4000, 1, generator=torch.Generator().manual_seed(0))
    exact = 1.5 + 1.0 * z  # toy_velocity's data N(1.5, 1): the ODE maps x at σ = 1 (= z) to M + S·z
    ours, theirs = sch.ode_dpm2_full(toy_velocity, z, sigmas), nft_dpm2_public(toy_velocity, z, sigmas)
    errors = {k: (x - exact).abs().mean().item() for k, x in (("dpm2-full", ours), ("public", theirs),
                                                              ("euler", sch.ode_euler(toy_velocity, z, sigmas)))}
    print(f"\nmax |ours − DiffusionNFT's| {worst(ours, theirs):.2g}; mean |x − exact|: {errors}")
    assert worst(ours, theirs) < 1e-5, worst(ours, theirs)


@pytest.fixture(scope="module")
def tiny():
    return models.load_model("tiny", None, "cpu", seed=0)


@pytest.mark.parametrize("solver", ["euler", "dpm2-full"])
def test_the_ode_rollout_records_images_and_final_latents_only(tiny, solver):
    kw = dict(steps=[], num_steps=6, height=32, width=32, cfg_scale=1.0, negative_prompt=" ", noise_level=0.7,
              sde_type="sde", seed=0, iteration=2, chunk=2, ode_solver=solver)
    ids = [5, 1, 6]
    b = rollout.sample(tiny, ["a cat", "a dog", "a cat"], [{}] * 3, [1, 0, 1], ids, **kw)
    assert b.latents.shape == (3, 0, 16, 16) and b.log_probs.shape == (3, 0) and len(b.sigmas) == 0
    assert b.x0.shape == (3, 16, 16) and b.ids.tolist() == ids and b.iteration == 2
    cond = tiny.conditioning(["a cat", "a dog", "a cat"], " ", 1.0)
    sigmas = sch.sigma_schedule(tiny.scheduler, 6, tiny.image_seq_len(32, 32))
    x = tiny.noise(rollout.image_generators(0, 2, ids), 32, 32)
    with torch.no_grad():
        x0 = sch.ODE_SOLVERS[solver](lambda x, s: tiny.velocity(x, s, cond, 1.0, 32, 32), x, sigmas)
    assert worst(b.x0, x0) < 1e-6 and worst(b.images, tiny.decode(b.x0, 32, 32)) < 1e-6
    assert b.chunk(1, 3).ids.tolist() == [1, 6] and torch.equal(b.chunk(1, 3).x0, b.x0[1:])


# ---- the old policy is engine state: swapped into every forward, the FSDP2 root included -------------------------------

def test_old_and_ema_weights_reach_the_root_module_under_fsdp2():
    """Full fine-tuning: the root module (embeddings, norms, the output projection) has trained weights of its own.
    FSDP2 keeps the root's gathered weights after a forward, so a swap of its shards alone is not seen unless the root
    is resharded: here a shadow that differs from the trained weights only in the root's parameters must change the
    velocity, and the trained velocity must come back bit for bit."""
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0, full_finetune=True, ema_decay=0.9, ema_every=1, old_policy=True,
                        shard=True)  # FSDP2 in a world of one, as on several ranks
    blocks = {id(p) for block in model.blocks for p in block.parameters()}
    c, x = model.conditioning(["a cat", "a dog"], " ", 1.0), torch.randn(2, 16, 16, generator=torch.Generator())

    def velocity():
        with torch.no_grad():
            return model.velocity(x, torch.full((2,), 0.6), c, 1.0, 32, 32)
    trained = velocity()
    for shadow, swapped in ((engine.old, engine.old_weights), (engine.ema, engine.ema_weights)):
        with torch.no_grad():
            for s, p in zip(shadow.shadow, engine.params):
                if id(p) not in blocks:  # the root's own parameters only
                    s.to_local().add_(0.05)
        with swapped():
            moved = velocity()
        assert worst(moved, trained) > 1e-3, "the forward did not see the swapped root parameters"
        assert torch.equal(velocity(), trained)


# ---- the script: every family, LoRA and full fine-tuning, 1 vs 2 ranks (torchrun), exact resume --------------------

train_here = main_here  # `python flowgrpo.py --no-wandb *flags`, in this process


def one_two_resumed(tmp_path, *flags):
    """2 iterations in 1 process (this one: train_here) and on 2 ranks (torchrun), and the 1-process run resumed from
    its checkpoint after the first iteration into a directory of its own, with `flags`. 2 ranks as 1 process: the
    trained weights and the old policy in the checkpoint's DCP state within test_engine's bound (1e-3 relative, as a
    whole; its test_two_ranks_match_one_process says why), the first rollout's images the same; resume: the DCP state
    (the old policy included) and the metrics bit for bit. Two iterations are enough for both: the second starts from
    trained weights, a moved old policy and AdamW state, which the resumed run must load. Returns the final DCP
    state."""
    runs = {name: tmp_path / name for name in ("one", "two", "resumed")}
    flags, every = ("--iterations", "2", *flags), ("--checkpoint-every", "1")  # SMALL's 2: only at the end
    train_here(*SMALL, "--run-dir", str(runs["one"]), *flags, *every)
    launch(runs["two"], *flags, ranks=2)
    train_here(*SMALL, "--run-dir", str(runs["resumed"]), "--resume", str(runs["one"] / "checkpoints" / "iter_000000"),
               *flags, *every)
    state = {k: flat(train_state(run, "iter_000001", tmp_path)) for k, run in runs.items()}
    assert rows(runs["one"])[0]["reward/mean"] == rows(runs["two"])[0]["reward/mean"]
    for part in ("model.", "old."):
        one, two = ({k: v for k, v in state[r].items() if k.startswith(part)} for r in ("one", "two"))
        rel, gap = relative_difference(one, two)
        print(f"{part}*: 1 vs 2 ranks {rel:.3g} relative (max |Δ| {gap:.3g}), {flags}")
        assert one and rel < 1e-3, f"{part}*: 1 vs 2 ranks differ by {rel:.3g} relative (max |Δ| {gap:.3g}), {flags}"
    assert state["one"].keys() == state["resumed"].keys()
    changed = [k for k in state["one"] if not torch.equal(state["one"][k], state["resumed"][k])]
    assert not changed, f"resume is not exact: {changed[:5]}"
    assert [without_perf(r) for r in rows(runs["resumed"])] == [without_perf(r) for r in rows(runs["one"])]
    return state["one"]


def test_nft_lora_two_ranks_and_resume(tmp_path):
    """DiffusionNFT with its reference KL, the evaluation EMA and a ramped old policy on the tiny model: the old policy
    lags the trained weights, sits in the checkpoint, and the exported LoRA is the EMA, never the old policy."""
    state = one_two_resumed(tmp_path, "--algorithm", "nft", "--kl-beta", "0.01", "--ema-decay", "0.5", "--ema-every",
                            "1", "--old-decay", "nft1", "--nft-beta", "0.5")
    name = "transformer_blocks.0.attn.to_q.lora_B.default.weight"
    trained, old, ema = (state[f"{k}.{name}"] for k in ("model", "old", "ema"))
    assert not torch.equal(trained, old) and not torch.equal(old, ema)


def test_awm_full_finetune_two_ranks_and_resume(tmp_path):
    """AWM on the tiny FLUX (its guidance embedding), every transformer weight trained: the old policy shadows all of
    them, sharded as they are (the root module's too: engine._swapped)."""
    state = one_two_resumed(tmp_path, "--algorithm", "awm", "--model", "tiny-flux", "--full-finetune", "--old-decay",
                            "nft1")
    shadowed = {k.removeprefix("old.") for k in state if k.startswith("old.")} - {"step"}
    assert "proj_out.weight" in shadowed and shadowed == {k.removeprefix("model.") for k in state if k.startswith(
        "model.")}


def cli(*flags, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), "--no-wandb", *flags], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("algorithm,flags", [
    ("nft", ["--model", "tiny-flux", "--kl-beta", "0.01"]),
    ("nft", ["--model", "tiny-sd3", "--full-finetune", "--ode-solver", "dpm2-full", "--num-steps", "6",
             "--train-timestep-range", "0", "6"]),
    ("awm", ["--model", "tiny-sd3", "--ode-solver", "dpm2-full", "--kl-beta", "0.01"]),
    ("nft", ["--model", "tiny-wan", "--reward", "brightness"]),  # an image reward, on every 4th frame
    ("awm", ["--model", "tiny-wan"])])  # the recipe's motion reward
def test_every_family_trains(algorithm, flags, tmp_path):
    """The families and modes the two-rank tests leave out (nft: tiny; awm: tiny-flux full fine-tuning), one iteration
    each with its checkpoint (the old policy in it) and an evaluation; tiny-wan's on 5-D final latents (9 frames),
    its evaluation an animated GIF. 4 images (2 prompts of 2) a run, in this process (train_here): the CLI of nft and
    awm is run by the two-rank tests."""
    train_here("--algorithm", algorithm, *flags, "--iterations", "1", "--eval-every", "1", "--eval-images", "2",
               "--prompts-per-iteration", "2", "--group-size", "2", "--micro-batch", "2",
               "--run-dir", str(tmp_path / "run"))
    for r in rows(tmp_path / "run"):
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["train/grad_norm"] > 0 and r["train/old_kl"] >= 0 and "train/logp_gap" not in r
        assert math.isfinite(r["eval/reward_mean"])
    assert (tmp_path / "run" / "lora").exists() != ("--full-finetune" in flags)
    assert (tmp_path / "run" / "checkpoints" / "iter_000000" / "meta.json").exists()
    assert (tmp_path / "run" / "samples" / "eval_00000.gif").exists() == ("tiny-wan" in flags)


@pytest.mark.parametrize("algorithm,flags,iterations", [("nft", ["--nft-beta", "0.1"], 10),
                                                        ("awm", ["--old-kl", "0.1"], 13)])
def test_tiny_run_learns(algorithm, flags, iterations, tmp_path):
    """The tiny recipe (brightness reward), in this process (train_here): the reward rises by the margin test_loop's
    Flow-GRPO run must beat, three within-batch stds (first three iterations against the last three). Measured (seed
    0) after 10, 13 and 15 iterations: nft at its OCR recipe's β 0.1 4.5, 7.1, 7.9 (at β 1: 1.6 after 15 iterations,
    4.3 after 30); awm with its old-policy regulariser at 0.1 2.6, 4.5, 5.2 (at its public weight 1, 1.6 after 30: on
    this toy, at lr 1e-2, it holds each update near the last one). Each runs the fewest iterations that clear the
    margin by half again: nft 10, awm 13. Micro-batches of 16 rather than the recipe's 8 (the same updates but for
    float rounding: the same rewards to 4 digits, measured) take half the transformer calls."""
    train_here("--algorithm", algorithm, *flags, "--iterations", str(iterations), "--micro-batch", "16",
               "--eval-every", "0", "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"))
    r = rows(tmp_path / "run")
    first, last = (sum(x["reward/mean"] for x in part) / 3 for part in (r[:3], r[-3:]))
    print(f"\n{algorithm}: reward {first:.4f} -> {last:.4f}, {(last - first) / r[0]['reward/std']:.2f} stds")
    assert len(r) == iterations and last - first > 3 * r[0]["reward/std"], (first, last, r[0]["reward/std"])


# ---- start-up: each algorithm refuses the flags that mean nothing for it, naming them ---------------------------------

@pytest.mark.parametrize("change,needle", [
    (dict(algorithm="nft", clip_range=0.1, window=2), "--clip-range, --window: not used by --algorithm nft"),
    (dict(algorithm="nft", guard="full"), "--guard: not used by --algorithm nft"),
    (dict(algorithm="nft", old_kl=0.5), "--old-kl: not used by --algorithm nft"),
    (dict(algorithm="awm", nft_beta=0.1, noise_level=0.5), "--nft-beta, --noise-level: not used by --algorithm awm"),
    (dict(nft_beta=0.1), "--nft-beta: not used by --algorithm grpo"),
    (dict(train_timesteps=2), "--train-timesteps: not used by --algorithm grpo"),
    (dict(algorithm="nft", train_timesteps=5), "--train-timesteps 5: DiffusionNFT draws that many distinct"),
    (dict(algorithm="awm", train_timesteps=5), "--train-timesteps 5: AWM cuts"),
    (dict(algorithm="nft", train_timestep_range=(2, 5)), r"--train-timestep-range \[2, 5\)"),
    (dict(algorithm="nft", nft_beta=0.0), r"--nft-beta must be in \[1e-06, 1e\+06\], got 0"),
    (dict(algorithm="awm", old_every=0), "--old-every must be >= 1"),
    (dict(algorithm="nft", trust_region="dppo"), "--trust-region: not used by --algorithm nft"),
    (dict(trust_region="dppo", guard="full"), "--trust-region dppo replaces the ratio clip that --guard full reshapes"),
    (dict(trust_region="dppo", dppo_threshold=-1e-5), r"--dppo-threshold must be in \[0, 1e\+06\], got -1e-05"),
    (dict(trust_region="dppo", rollout="vllm-omni", rollout_url="http://127.0.0.1:1"),
     "--trust-region dppo need --rollout local")])
def test_flags_an_algorithm_does_not_use_are_refused(change, needle):
    with pytest.raises(ValueError, match=needle):
        startup.check_args(dataclasses.replace(TINY, **change))


def test_the_public_recipes_pass_their_checks_and_the_cli_names_refused_flags():
    for name in ("sd3.5-medium-nft-ocr", "sd3.5-medium-nft-pickscore", "qwen-image-nft-ocr", "sd3.5-medium-awm-ocr",
                 "sd3.5-medium-awm-pickscore", "sd3.5-medium-dppo"):
        startup.check_args(flowgrpo.RECIPES[name])
    out = cli(*SMALL, "--algorithm", "nft", "--window", "2", "--clip-range", "0.5")
    assert out.returncode != 0 and "batch arithmetic" not in out.stdout
    assert out.stderr.strip().splitlines() == ["flowgrpo.py: error: --clip-range, --window: not used by --algorithm "
                                               "nft (it uses --nft-beta, --old-decay, --old-every, --train-timestep-"
                                               "range, --train-timesteps): drop the flag or choose the algorithm that "
                                               "uses it"], out.stderr


# ---- the losses' scale flags: bounded at start-up; the update says how many of its steps were skipped ------------------

@pytest.mark.parametrize("change,needle", [
    (dict(algorithm="nft", nft_beta=1e300), r"--nft-beta must be in \[1e-06, 1e\+06\], got 1e\+300: far beyond"),
    (dict(algorithm="nft", nft_beta=1e-300), r"--nft-beta must be in \[1e-06, 1e\+06\], got 1e-300"),
    (dict(algorithm="awm", old_kl=1e300), r"--old-kl must be in \[0, 1e\+06\], got 1e\+300"),
    (dict(algorithm="nft", kl_beta=1e30), r"--kl-beta must be in \[0, 1e\+06\], got 1e\+30"),
    (dict(algorithm="awm", adv_clip=1e-300), r"--adv-clip must be in \[1e-06, 10000\], got 1e-300"),
    (dict(clip_range=1e40), r"--clip-range must be in \[0, 1e\+06\], got 1e\+40")])
def test_loss_flags_far_outside_their_range_are_refused(change, needle):
    """The attack's values (each skipped every optimizer step and exited 0; --clip-range 1e40 crashed in the loss) are
    refused at start-up in one line giving the range."""
    with pytest.raises(ValueError, match=needle):
        startup.check_args(dataclasses.replace(TINY, **change))


def test_the_cli_refuses_the_attacks_nft_beta_in_one_line_before_anything_is_built(tmp_path):
    """The attack's repro, `--algorithm nft --nft-beta 1e300`: it trained with every step skipped and exited 0."""
    out = cli(*SMALL, "--algorithm", "nft", "--nft-beta", "1e300", "--run-dir", str(tmp_path / "run"))
    assert out.returncode != 0 and "batch arithmetic" not in out.stdout and not (tmp_path / "run").exists()
    assert out.stderr.strip().splitlines() == ["flowgrpo.py: error: --nft-beta must be in [1e-06, 1e+06], got 1e+300: "
                                               "far beyond, the loss or its gradient overflows or vanishes "
                                               "(docs/methods.md)"], out.stderr


def test_the_edges_of_the_loss_flags_ranges_pass_start_up():
    for edge in (dict(algorithm="nft", nft_beta=1e-6), dict(algorithm="nft", nft_beta=1e6, kl_beta=1e6),
                 dict(algorithm="awm", old_kl=0.0), dict(algorithm="awm", old_kl=1e6), dict(adv_clip=1e-6),
                 dict(adv_clip=1e4), dict(clip_range=1e-300), dict(clip_range=1e6)):
        startup.check_args(dataclasses.replace(TINY, **edge))


@pytest.mark.parametrize("algorithm,change,skipped", [
    ("nft", dict(nft_beta=1e-6, adv_clip=1e-6), 0.0), ("nft", dict(nft_beta=1e6, kl_beta=1e6, adv_clip=1e4), 0.0),
    ("awm", dict(adv_clip=1e-6), 0.0), ("awm", dict(old_kl=1e6, kl_beta=1e6, adv_clip=1e4), 0.0),
    ("nft", dict(nft_beta=1e300), 1.0), ("awm", dict(old_kl=1e300), 0.5)])
def test_the_update_reports_its_skipped_fraction_and_the_range_edges_skip_none(algorithm, change, skipped):
    """One iteration of 2 optimizer steps (T = 1) on the tiny model. At the edges of FLAG_RANGES every step is taken, the loss
    finite; past start-up, the attack's values skip steps and `train/skipped_fraction` says how many (the loop stops
    at 1). AWM's first step is on-policy (v = v_old: its old-policy term and that term's gradient are 0), so at
    --old-kl 1e300 only the second is skipped."""
    a = dataclasses.replace(TINY, algorithm=algorithm, **change, prompts_per_iteration=1, group_size=4, micro_batch=2,
                            optimizer_steps=2, train_timesteps=1)
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0, old_policy=True)
    batch = rollout.sample(model, ["a cat"] * 4, [{}] * 4, [0] * 4, range(4), steps=[], num_steps=a.num_steps,
                           height=32, width=32, cfg_scale=1.0, negative_prompt=" ", noise_level=0.7, sde_type="sde",
                           seed=0, iteration=0, chunk=2)
    algo = algorithms.ALGORITHMS[algorithm]
    batch.advantages = algo.weights(torch.tensor([1.0, -1.0, 0.5, -0.5]), None, a)
    stats = algo.update(model, engine, batch, a, flowgrpo.batch_arithmetic(a, 1), False)
    assert (stats["train/skipped_fraction"], stats["train/skipped_steps"]) == (skipped, 2 * skipped), stats
    assert skipped or math.isfinite(stats["train/policy_loss"] + stats["train/grad_norm"]), stats
