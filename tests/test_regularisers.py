"""The regularisers against reward hacking (regularisers.py, docs/algorithm.md §17): GARDO's pieces against its public
script, re-typed below as oracles on the same tensors; NormGuard's hinge against its closed form; both options through
the real loop; and the scale of the Wan2.1 recipe's KL against the public Wan script's on the same velocity gap.

Public code (re-typed, not copied):
  GARDO  yifan123/flow_grpo @ 94e23ee5405ab7241fc1f75d30cac8147e2b1f53: scripts/train_sd3_gardo.py (RiskCompensator;
         the uncertainty gate after `stat_tracker.update(..., type='gardo')`; the reset of the "old" adapter before each
         epoch's training and `if info["kl_loss"] > thres: reset=True` after each optimizer step; the loss block's
         `kl_loss` over `idx = sample["reward_std"] > 0`), flow_grpo/stat_tracking.py (PerPromptStatTracker.update,
         type 'gardo'), config/grpo_gardo.py (general_ocr_sd3)
  Wan    zhtmike/flow_grpo @ def7b8403e9659aba03ba8d82bbd69a33fc58d00 (a mirror of yifan123/flow_grpo):
         flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py (sde_step_with_logprob: std_dev_t and the mean)
"""
import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

import algorithms
import checkpoint
import flowgrpo
import models_wan
import recipes
import regularisers as reg
import runlog
import scheduler as sch
import startup
from test_engine import lora, without_perf
from tiny_setup import main_here
from tasks import nano


# ---- GARDO's advantages: flow_grpo/stat_tracking.py, type 'gardo' -------------------------------------------------

def tracker_gardo(prompts, rewards, dists):
    """PerPromptStatTracker(global_std=True).update(prompts, rewards, dists, type='gardo'), re-typed; rewards (N, T)."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    dists = np.array(dists)
    dists = dists / np.linalg.norm(dists, ord=2, axis=1, keepdims=True)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        d = dists[prompts == prompt]
        distance = 1 - np.dot(d, d.T).clip(-1, 1)
        nearest = np.array([np.min(distance[i, np.arange(len(d)) != i]) for i in range(len(d))])
        nearest = np.repeat(nearest[:, None], prompt_rewards.shape[-1], axis=1)
        nearest = np.where((prompt_rewards - mean) < 0, np.ones_like(nearest), nearest / np.mean(nearest))
        advantages[prompts == prompt] = (prompt_rewards - mean) * nearest
    return advantages


def test_gardo_advantages_equal_the_public_stat_tracker():
    g = torch.Generator().manual_seed(0)
    G, P = 6, 4
    r = torch.rand(G * P, generator=g)
    features = torch.randn(G * P, 32, generator=g)  # the script's DINOv3 embeddings (float32)
    prompts = [f"p{i // G}" for i in range(G * P)]
    theirs = tracker_gardo(prompts, r.numpy()[:, None].repeat(8, 1), features.numpy())  # (N, T): T timesteps alike
    ours = reg.gardo_advantages(r, torch.arange(G * P) // G, features)
    diff = np.abs(ours.numpy() - theirs[:, 0]).max()
    print(f"\nGARDO advantages: max |ours − theirs| {diff:.2g} (|A| up to {np.abs(theirs).max():.3f})")
    assert diff < 1e-6, diff
    assert (theirs == theirs[:, :1]).all()  # the script's per-timestep copies are one advantage
    equal = torch.cat([torch.full((G,), 1 - 1 / 7, dtype=torch.float64), r[G:].double()])  # its mean misses by an ulp
    assert reg.gardo_advantages(equal, torch.arange(G * P) // G, features)[:G].abs().max() == 0  # A = 0 exactly
    # degenerate groups, which the script's DINOv3 features never give (here NaN spread to whole groups, and a NaN
    # loss skipped every step): an all-black image's pixels (features 0), a collapsed group (every distance 0)
    black = features.clone()
    black[1] = 0
    ours = reg.gardo_advantages(r, torch.arange(G * P) // G, black)
    assert torch.isfinite(ours).all() and torch.equal(ours[G:], reg.gardo_advantages(r, torch.arange(G * P) // G,
                                                                                       features)[G:])
    same = reg.gardo_advantages(r[:G], torch.zeros(G, dtype=torch.long), features[:1].repeat(G, 1))
    assert torch.equal(same, r[:G].double() - r[:G].double().mean())  # d_i / mean(d): 1 where every d is 0


# ---- GARDO's gate: scripts/train_sd3_gardo.py ----------------------------------------------------------------------

class RiskCompensatorPublic:
    """train_sd3_gardo.py's RiskCompensator, re-typed."""
    def __init__(self, base=0.1, beta=0.1):
        self.risk_buffer, self.base, self.alpha, self.beta, self.beta_min, self.beta_max = [], base, 0.1, beta, 0.02, 0.2

    def update(self, pad_scores):
        if len(self.risk_buffer) == 0:
            self.beta = self.base
        elif np.mean(pad_scores) > max(self.risk_buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(pad_scores) < min(self.risk_buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = np.clip(self.beta, self.beta_min, self.beta_max)
        self.risk_buffer.append(np.mean(pad_scores))
        if len(self.risk_buffer) > 20:
            self.risk_buffer = self.risk_buffer[-20:]


def gate_public(rewards: dict, main: str, controller) -> torch.Tensor:
    """The script's uncertainty block: ranks of 'aesthetic', 'imagereward' and the main reward, their gap, the
    controller's update and the percentile threshold; `reward_std > threshold`."""
    ranks_all = []
    for item in ["aesthetic", "imagereward", main]:
        _, indices = torch.sort(torch.tensor(rewards[item]), descending=True)
        ranks = torch.empty_like(torch.tensor(rewards[item])).long()
        ranks[indices] = torch.arange(1, len(rewards[item]) + 1)
        ranks_all.append(ranks.float())
    u = ranks_all[-1] - (ranks_all[0] + ranks_all[1]) / 2
    controller.update(np.array([p for p in u.cpu().numpy() if p >= 0]))
    threshold = np.percentile(np.array([p for p in u.cpu().numpy() if p >= 0]), 100 - controller.beta * 100)
    return u > threshold


def test_gardo_gate_and_its_controller_equal_the_script_over_30_iterations():
    """30 iterations of 48 images whose mean uncertainty drifts up, then down (so the controller raises β, then lowers
    it): each iteration's gate and β as the script's."""
    g = torch.Generator().manual_seed(1)
    theirs, ours = RiskCompensatorPublic(), reg.RiskCompensator()
    betas = []
    for it in range(30):
        main = torch.rand(48, generator=g)
        drift = (it if it < 15 else 30 - it) / 15  # the proxies disagree with the main reward more, then less
        rewards = {"ocr": main.numpy(), "aesthetic": (main * (1 - drift) + drift * torch.rand(48, generator=g)).numpy(),
                   "imagereward": torch.rand(48, generator=g).numpy()}
        want = gate_public(rewards, "ocr", theirs)
        got = reg.gate(reg.uncertainty(main, [torch.tensor(rewards["aesthetic"]), torch.tensor(rewards["imagereward"])]),
                       ours)
        assert torch.equal(got, want), f"iteration {it}: {int((got != want).sum())} images gated differently"
        assert ours.beta == pytest.approx(float(theirs.beta), rel=1e-12), (it, ours.beta, theirs.beta)
        betas.append(ours.beta)
    print(f"\nβ over the iterations: {[round(b, 3) for b in betas]}")
    assert max(betas) > 0.1 and min(betas) < 0.1  # both branches of the controller were exercised


def test_gardo_kl_term_is_the_scripts_over_the_gated_images():
    """The loss block's `torch.mean(square(μ[idx] − μ_ref[idx]) / (2·std_dev_t[idx]²))` (0 when no image is gated) on
    Flow-GRPO's SD3 step, against algorithms.gated_kl of the public KL form; the images the zero-advantage rule
    dropped are not in the script's batch, so the gate never reaches them here."""
    g = torch.Generator().manual_seed(2)
    b = 6
    x, v, v_ref, x_next = (torch.randn(b, 16, 8, generator=g) for _ in range(4))
    sigma, sigma_next = torch.tensor(0.8), torch.tensor(0.7)
    kw = dict(sigma_max=0.95, noise_level=0.7, sde_type="sde", x_next=x_next)
    _, _, mean, std = sch.step(v, x, sigma, sigma_next, **kw)
    _, _, mean_ref, _ = sch.step(v_ref, x, sigma, sigma_next, **kw)
    std_dev_t = std / torch.sqrt(sigma - sigma_next)  # the script's std_dev_t, (b, 1, 1) here
    gate = torch.tensor([True, False, True, False, False, True, True, False])  # by image id; ids 1..6 in this batch
    mb = type("MB", (), {"ids": torch.arange(1, 7)})()
    w = torch.tensor([1.0, 1, 1, 1, 1, 0])  # image id 6 dropped (A = 0): gated, but not in the script's batch
    idx = gate[1:7] & (w > 0)
    theirs = torch.mean(torch.square(mean[idx] - mean_ref[idx]) / (2 * std_dev_t.expand(b, 1, 1)[idx] ** 2))
    kl = sch.kl_public(mean, mean_ref, std, sigma_next - sigma, "sde")
    ours = algorithms.gated_kl(kl, mb, w, gate=gate)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6), (ours.item(), theirs.item())
    none = algorithms.gated_kl(kl, mb, w, gate=torch.zeros(8, dtype=torch.bool))
    assert none.item() == 0.0  # the script's `loss = torch.mean(policy_loss)` when no image is gated


def test_gardo_reset_rule_is_the_scripts():
    """The script's reset of the old adapter: before epoch e's training, if `(e != 0 and reset) or e − prev > 15`; an
    optimizer step whose KL exceeds the threshold sets `reset`. Replayed over 60 epochs of random KLs."""
    rng = np.random.default_rng(0)
    kls = rng.uniform(0, 4e-4, size=(60, 2)) * (rng.uniform(size=(60, 1)) < 0.3)  # some epochs far below 3e-4
    prev, reset, theirs = 0, False, []
    for epoch in range(60):
        if (epoch != 0 and reset) or (epoch - prev) > 15:
            reset, prev = False, epoch
            theirs.append(epoch)
        reset = reset or bool((kls[epoch] > 3e-4).any())
    s, ours = reg.GardoState(), []
    for epoch in range(60):
        if reg.should_reset(s, epoch, 15):
            s.reset, s.last_reset = False, epoch
            ours.append(epoch)
        s.reset = s.reset or max(kls[epoch]) > 3e-4
    print(f"\nresets at {theirs}")
    assert ours == theirs and len(theirs) >= 5


def test_nanos_gardo_proxies_read_real_digits():
    """nano's proxies (nano.proxies) on the held-out real digits: classifiers of the digit, as the reward is."""
    _, x_test, _, y_test = nano.split()
    images = nano.quantised(nano.render(x_test))
    for name in ("digit_knn", "digit_bayes"):
        p = nano.proxy(name)(images, [f"a handwritten digit {d}" for d in y_test], None)
        print(f"\n{name}: mean p(true digit) {p.mean():.3f} on {len(y_test)} held-out digits")
        assert p.mean() > 0.75, (name, p.mean())


# ---- GARDO through the loop: exact resume, and its proxies are not judges ------------------------------------------

# The tiny model with one proxy and one judge, 8 images an iteration in 2 optimizer steps: ~1 s an iteration here.
GARDO = ("--algorithm", "gardo", "--reward", "brightness=1,jpeg_compressibility=0,jpeg_incompressibility=0",
         "--gardo-proxies", "jpeg_compressibility", "--kl-beta", 0.04, "--prompts-per-iteration", 2, "--group-size", 4,
         "--micro-batch", 4)
# Chosen so that what GARDO carries over iteration 1's checkpoint decides iterations 2 and 3: the controller moves β
# at iteration 1 (its history decides the next move), an optimizer step of iteration 1 has a mean KL term ~3.3e-5,
# above the threshold (iteration 0's are 0: the reference is the weights they start from), which asks for the reset
# at 2, and from there --gardo-reset-every 2 puts none at 3 (a count from 0 would: 3 − 0 > 2).
GARDO_RESUMED = (*GARDO, "--gardo-reset-every", 2, "--gardo-kl-threshold", 1e-5, "--eval-every", 0)


@pytest.fixture(scope="module")
def gardo_runs(tmp_path_factory):
    """4 iterations straight; 2, then --resume auto to 4 (checkpoints after iterations 1 and 3). Their rows."""
    root = tmp_path_factory.mktemp("gardo")
    straight = main_here("--iterations", 4, "--run-dir", root / "straight", *GARDO_RESUMED)
    main_here("--iterations", 2, "--run-dir", root / "split", *GARDO_RESUMED)
    resumed = main_here("--iterations", 4, "--run-dir", root / "split", "--resume", "auto", *GARDO_RESUMED)
    return root, straight, resumed


def test_a_gardo_run_resumes_bit_for_bit(gardo_runs):
    """Resume is bitwise for GARDO too: its gate's controller (β and its 20-iteration history), the reset asked for and
    the last reset's iteration go with each checkpoint, the reference (the old policy) with the weights. Before, a
    --resume started them afresh: the resumed run put β back to 0.1, lost the reset at 2, reset at 3 instead, and
    ended on another LoRA (max |resumed − straight| 0.007 on LoRA weights of order 0.1)."""
    root, straight, resumed = gardo_runs
    betas, resets = [r["train/gardo_beta"] for r in straight], [r["train/gardo_last_reset"] for r in straight]
    print(f"\nstraight run: β {betas}, last reset {resets}")
    assert betas[1] != 0.1 and resets == [0, 0, 2, 2]  # what the split must carry is there to carry
    ours, theirs = lora(root / "split"), lora(root / "straight")
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), f"{k}: max |resumed − straight| {(ours[k] - theirs[k]).abs().max():.3g}"
    assert [without_perf(r) for r in resumed] == [without_perf(r) for r in straight]


def test_a_gardo_checkpoint_without_its_state_resumes_afresh_and_says_so(gardo_runs, tmp_path, capsys):
    """A GARDO checkpoint written before its state was saved (here: iteration 1's, its loop.algorithm_state removed and its
    meta.json's SHA-256 written anew) still resumes, as it always did: the controller and the reset count start afresh
    (β 0.1, no reset at 2: the one iteration 1 asked for is gone), and one line says the run will not match."""
    root, straight, _ = gardo_runs
    old = tmp_path / "iter_000001"
    shutil.copytree(root / "split" / "checkpoints" / "iter_000001", old)
    meta = json.loads((old / "meta.json").read_text())
    saved = meta["loop"].pop("algorithm_state")  # what iteration 1 left: β moved once, 2 means, a reset asked for, none yet
    got = (saved["beta"], len(saved["buffer"]), saved["reset"], saved["last_reset"])
    assert got == (straight[1]["train/gardo_beta"], 2, True, 0), saved
    meta["sha256"] = checkpoint.json_sha256({k: v for k, v in meta.items() if k != "sha256"})
    (old / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    rows = main_here("--iterations", 3, "--run-dir", tmp_path / "run", "--resume", old, *GARDO_RESUMED)
    said = capsys.readouterr().err
    assert f"--resume: {old} holds no state of the algorithm's own" in said and "starts afresh (GARDO" in said, said
    assert (rows[-1]["iteration"], rows[-1]["train/gardo_beta"], rows[-1]["train/gardo_last_reset"]) == (2, 0.1, 0)


def test_a_gardo_run_resumed_from_another_algorithms_checkpoint_says_so(tmp_path, capsys):
    """--resume of an nft run's checkpoint as GARDO (--allow-change algorithm and the flags GARDO adds): GARDO's state
    starts afresh, as it must, an nft run keeping none. Before, the line blamed an older version of flowgrpo.py
    ("written before checkpoints kept it"); now it names the checkpoint's --algorithm, and the checkpoint is intact."""
    shape = ("--prompts-per-iteration", 2, "--group-size", 4, "--micro-batch", 4, "--eval-every", 0)
    main_here("--iterations", 1, "--run-dir", tmp_path / "nft", "--algorithm", "nft", *shape)
    source = tmp_path / "nft" / "checkpoints" / "iter_000000"
    capsys.readouterr()
    rows = main_here("--iterations", 2, "--run-dir", tmp_path / "gardo", "--resume", source, *GARDO, "--eval-every", 0,
                     "--allow-change", "algorithm", "reward", "kl_beta", "gardo_proxies")
    said = capsys.readouterr().err
    assert (rows[-1]["iteration"], rows[-1]["train/gardo_beta"]) == (1, 0.1)
    assert checkpoint.verify_checkpoint(str(source))["flags"]["algorithm"] == "nft"
    assert f"--resume: {source} holds no state of the algorithm's own (written by a run of --algorithm nft, which " \
        "keeps none; to continue a run of this algorithm, resume its checkpoint): it starts afresh" in said, said


def test_a_gardo_runs_judges_leave_out_its_proxies(tmp_path, monkeypatch, capsys):
    """A weight-0 reward is a judge, read only by people, unless GARDO's gate reads it (--gardo-proxies): the closing
    summary, the eval grid's caption lines and the curve's judge panel name the judge alone; the proxy is still
    logged as a reward term. Before: both were "the judge (weight 0, never trained on)"."""
    captions, panels = [], []
    monkeypatch.setattr(runlog, "save_grid", lambda path, images, texts, sources=None: captions.extend(texts))
    monkeypatch.setattr(runlog, "plot_curve", lambda path, rows, judges: panels.append(list(judges)))
    capsys.readouterr()
    rows = main_here("--iterations", 1, "--run-dir", tmp_path / "run", *GARDO, "--eval-every", 1, "--eval-images", 4)
    said = capsys.readouterr().out
    judge, proxy = "jpeg_incompressibility", "jpeg_compressibility"
    assert f"{judge}, the judge" in said and f"{proxy}, the judge" not in said, said
    assert len(captions) == 4 and all(f"\n{judge} " in c and f"\n{proxy} " not in c for c in captions), captions
    assert panels and all(p == [judge] for p in panels), panels
    assert {f"reward/{proxy}/mean", f"eval/{proxy}/mean", f"reward/{judge}/mean"} <= rows[0].keys()


def test_a_gardo_recipe_run_with_another_algorithm_has_no_proxies(tmp_path, monkeypatch, capsys):
    """A GARDO recipe's run switched to --algorithm grpo carries the recipe's --gardo-proxies (equal to the recipe's,
    so not refused as given), which grpo never reads: its weight-0 rewards are all judges again, as in any grpo run.
    (A GARDO recipe of the tiny model, added to the table for the test; the public one needs SD3.5's weights.)"""
    flags = dict(zip(GARDO[::2], GARDO[1::2]))
    recipe = dict(recipes.RECIPES["tiny"], algorithm="gardo", reward=flags["--reward"], kl_beta=0.04,
                  gardo_proxies=("jpeg_compressibility",))
    monkeypatch.setitem(recipes.RECIPES, "tiny-gardo", recipe)
    capsys.readouterr()
    main_here("--recipe", "tiny-gardo", "--algorithm", "grpo", "--iterations", 1, "--run-dir", tmp_path / "run",
              "--prompts-per-iteration", 2, "--group-size", 4, "--micro-batch", 4, "--eval-every", 1,
              "--eval-images", 4)
    said = capsys.readouterr().out
    assert "jpeg_compressibility, the judge" in said and "jpeg_incompressibility, the judge" in said, said


# ---- NormGuard ----------------------------------------------------------------------------------------------------

def test_normguard_hinge_is_its_closed_form_and_acts_only_above_the_margin():
    g = torch.Generator().manual_seed(3)
    v_ref = torch.randn(4, 8, 8, generator=g)
    scale = torch.tensor([0.9, 1.0, 1.05, 1.2]).view(4, 1, 1)
    v = (v_ref * scale).requires_grad_()
    penalty, ratio = reg.norm_hinge(v, v_ref, weight=2.0, margin=0.1)
    assert torch.allclose(ratio, scale.flatten(), rtol=1e-6)
    assert penalty.item() == pytest.approx(2.0 * (1.2 - 1.1) / 4, rel=1e-5)
    (grad,) = torch.autograd.grad(penalty, v)
    assert grad[:3].abs().max() == 0 and (grad[3] * v[3]).sum() > 0  # only the inflated image is pushed, inwards


def test_both_regularisers_run_through_the_loop_and_log_the_velocity_norm_ratio(tmp_path):
    """GARDO (tiny: proxies two cheap image rewards at weight 0) and NormGuard on DiffusionNFT through flowgrpo.main;
    the plain recipe logs the ratio at every evaluation too, regularised or not."""
    gardo = main_here("--iterations", 3, "--run-dir", tmp_path / "gardo", "--algorithm", "gardo", "--reward",
                      "brightness=1,jpeg_compressibility=0,jpeg_incompressibility=0", "--gardo-proxies",
                      "jpeg_compressibility", "jpeg_incompressibility", "--kl-beta", "0.04", "--eval-every", 0)
    assert all(0 < r["train/gardo_gated_fraction"] <= 0.25 and r["train/kl"] >= 0 for r in gardo)
    nft = main_here("--iterations", 2, "--run-dir", tmp_path / "nft", "--algorithm", "nft", "--normguard", 1,
                    "--eval-every", 1, "--eval-images", 8)
    plain = main_here("--iterations", 2, "--run-dir", tmp_path / "plain", "--eval-every", 1, "--eval-images", 8)
    for rows in (nft, plain):
        ratios = [r["eval/velocity_norm_ratio"] for r in rows]
        print(f"\neval velocity-norm ratios: {ratios}")
        assert all(0.5 < x < 2 and x != 1.0 for x in ratios)
    assert "train/velocity_norm_ratio" in nft[0] and "train/velocity_norm_ratio" not in plain[0]
    with pytest.raises(ValueError, match="--gardo-proxies"):
        main_here("--run-dir", tmp_path / "x", "--algorithm", "gardo", "--gardo-proxies", "aesthetic")
    with pytest.raises(ValueError, match="--normguard"):
        main_here("--run-dir", tmp_path / "y", "--normguard", 1, "--reuse-rollout-forward")
    with pytest.raises(ValueError, match="--reuse-rollout-forward with GARDO's KL"):  # before: a RuntimeError in backward
        main_here("--run-dir", tmp_path / "z", "--algorithm", "gardo", "--reward", "brightness=1,jpeg_compressibility=0",
                  "--gardo-proxies", "jpeg_compressibility", "--kl-beta", "0.04", "--reuse-rollout-forward")


@pytest.mark.parametrize("flags,kinds", [
    (("--algorithm", "dgpo", "--micro-batch", 8), 3),  # the old policy's, the reference's (before), the trained one's
    (("--algorithm", "nft"), 3),  # the old policy's, the trained one's, the reference's (after)
    ((), 2)], ids=["dgpo", "nft", "grpo"])  # Flow-GRPO's: the reference's (before, on an equal slice), the trained one's
def test_normguard_shares_the_losss_reference_pass_to_the_bit(tmp_path, monkeypatch, flags, kinds):
    """Where a loss runs the reference itself (a KL to the base model) at a trained forward's inputs, NormGuard's hinge
    reads that pass instead of running its own: the same LoRA and logged values to the bit, and the training passes
    `kinds` forwards per trained one instead of kinds + 1. The control: every reference pass computed (nothing shared),
    as before they were shared."""
    argv = ("--iterations", 2, "--normguard", 1, "--kl-beta", 0.02, "--eval-every", 0, *flags)
    shared = main_here("--run-dir", tmp_path / "shared", *argv)
    monkeypatch.setattr(reg, "same_inputs", lambda *inputs: False)
    unshared = main_here("--run-dir", tmp_path / "unshared", *argv)
    assert [without_perf(r) for r in shared] == [without_perf(r) for r in unshared]
    ours, theirs = lora(tmp_path / "shared"), lora(tmp_path / "unshared")
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs), max((ours[k] - theirs[k]).abs().max() for k in theirs)
    passes = [(s["perf/train_passes"], u["perf/train_passes"]) for s, u in zip(shared, unshared)]
    print(f"\ntraining passes per iteration (shared, unshared): {passes}")
    assert all(s * (kinds + 1) == u * kinds for s, u in passes), passes


def test_every_recipe_leaves_the_regularisers_off_and_gardos_passes_its_checks(tmp_path, monkeypatch):
    for name, a in flowgrpo.RECIPES.items():
        assert a.normguard == 0 and (a.algorithm == "gardo") == name.endswith("-gardo-ocr"), name
    (tmp_path / "head.pth").write_bytes(b"")  # its aesthetic proxy's head: a file is named, as a run must
    monkeypatch.setenv("FLOWGRPO_AESTHETIC_HEAD", str(tmp_path / "head.pth"))
    startup.check_args(flowgrpo.RECIPES["sd3.5-medium-gardo-ocr"])
    a = flowgrpo.RECIPES["sd3.5-medium-gardo-ocr"]
    assert sch.trained_steps(a.num_steps, a.window, a.window_range, seed=0) == list(range(8))  # int(10·0.89) = 8


# ---- the Wan2.1 recipe's KL against the public Wan script's (docs/algorithm.md §8, item 17) --------------------------

def test_wan_recipes_kl_against_the_public_wan_steps_on_the_same_velocity_gap():
    """The recipe's KL (DanceGRPO's step, η 0.3, over the transition variance) against train_wan2_1.py's on its own
    step (std_dev_t = σ_min + (σ_max − σ_min)·σ, the Flow-GRPO drift), for the same velocity gap at every trained step
    of the recipe's σ table: the ratio the departure states, measured."""
    a = flowgrpo.RECIPES["wan2.1-t2v-1.3b"]
    sigmas = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**models_wan.WAN_SCHEDULER), a.num_steps, 1024)
    g = torch.Generator().manual_seed(0)
    x, v = (torch.randn(2, 4, 3, 4, 4, generator=g) for _ in range(2))
    gap = 0.01 * torch.randn(2, 4, 3, 4, 4, generator=g)
    s_max, s_min = float(sigmas[1]), float(sigmas[-1])
    ours_all, theirs_all = [], []
    for i in range(a.num_steps - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        kw = dict(sigma_max=s_max, noise_level=a.noise_level, sde_type=a.sde_type)
        _, _, mean, std = sch.step(v, x, s, s_next, **kw)
        _, _, mean_ref, _ = sch.step(v + gap, x, s, s_next, **kw)
        ours_all.append(algorithms.KL_FORMS[a.kl_form](mean, mean_ref, std, s_next - s, a.sde_type).mean().item())
        dt, std_dev_t = s_next - s, s_min + (s_max - s_min) * s

        def public_mean(velocity):
            return x * (1 + std_dev_t**2 / (2 * s) * dt) + velocity * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        theirs = ((public_mean(v) - public_mean(v + gap)) ** 2).mean() / (2 * (std_dev_t * torch.sqrt(-dt)) ** 2)
        theirs_all.append(theirs.item())
    ratios = np.array(ours_all) / np.array(theirs_all)
    print(f"\nrecipe KL / public Wan KL per trained step: {[round(float(r), 2) for r in ratios]}; mean "
          f"{ratios.mean():.2f}, ratio of the sums {sum(ours_all) / sum(theirs_all):.3f}")
    # the loss averages the KL over the trained steps: with one gap at every step, the recipe's mean is the public's
    assert sum(ours_all) / sum(theirs_all) == pytest.approx(1.04, abs=0.01)
    assert ratios[0] == pytest.approx(10.71, abs=0.01) and ratios[-1] == pytest.approx(0.336, abs=0.002)
    assert ratios.mean() == pytest.approx(5.51, abs=0.01)


@pytest.mark.parametrize("damaged", [None, [], {"beta": 0.1, "buffer": [], "reset": False},
                                     {"beta": 1, "buffer": [], "reset": False, "last_reset": 0},
                                     {"beta": 0.1, "buffer": ["x"], "reset": False, "last_reset": 0},
                                     {"beta": 0.1, "buffer": [], "reset": 0, "last_reset": 0}])
def test_gardos_state_read_back_is_checked_value_by_value(damaged):
    """A damaged `loop.algorithm_state` (a field missing, of another type) is one line naming the file, not a
    traceback later in the run; what `state_dict` wrote reads back to the bit."""
    s = reg.GardoState(reg.RiskCompensator(0.11, [0.25, 1 / 3]), reset=True, last_reset=7)
    back = reg.GardoState()
    back.load_state_dict(json.loads(json.dumps(s.state_dict())), "here")
    assert back.state_dict() == s.state_dict()
    with pytest.raises(ValueError, match=r"^here: .* is not GARDO's state .*the checkpoint is damaged$"):
        reg.GardoState().load_state_dict(damaged, "here")
