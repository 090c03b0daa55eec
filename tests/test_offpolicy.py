"""`--off-policy` and `--stale-correction` without a server: the start-up refusals, the decoupled correction's
arithmetic (importance weights exactly 1 where the weights did not change, truncated and rejected where the behaviour
log-probs differ by a known amount), and offpolicy.Rollouts' order of work (which weights sample which iteration, the
thread overlapping the caller) and its checkpointed batch read back to the bit. Through real vLLM-Omni servers:
tests/omni/test_omni_offpolicy.py."""
import contextlib
import dataclasses
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import algorithms
import cli
import flowgrpo
import offpolicy
import rollout
import startup
from tiny_setup import main_here, tiny_setup

URL = ("--rollout", "vllm-omni", "--rollout-url", "http://127.0.0.1:9")  # checked for form only before the refusal


@pytest.mark.parametrize("flags,needle", [
    (("--off-policy", "1"), "--off-policy 1 needs someone else to sample"),
    (("--off-policy", "2", *URL), "--off-policy must be 0 (synchronous) or 1"),
    (("--off-policy", "1", "--algorithm", "nft", *URL), "--off-policy 1: --algorithm nft keeps an old policy"),
    (("--off-policy", "1", "--shard-text-encoder", *URL), "--shard-text-encoder"),
    (("--reject-band", "0.5"), "--reject-band needs --stale-correction decoupled"),
    (("--stale-correction", "decoupled", "--is-cap", "0.5"), "--is-cap must be >= 1"),
    (("--stale-correction", "decoupled", "--algorithm", "awm"), "--stale-correction: not used by --algorithm awm"),
])
def test_impossible_combinations_are_refused_in_one_line(flags, needle):
    with pytest.raises(ValueError) as e:
        startup.check_args(cli.parse_args(flowgrpo.Args, list(flags)))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def args(**kw):
    return dataclasses.replace(cli.parse_args(flowgrpo.Args, []), micro_batch=4, **kw)  # tiny_setup's chunk


def test_decoupled_weights_are_exactly_one_where_the_weights_did_not_move():
    """The proximal pass runs the rollout's chunks under the rollout's weights: log-probs equal to the bit, every
    importance weight 1, nothing rejected; the loss's first ratio is exactly 1 (train/logp_gap 0)."""
    model, engine, batch = tiny_setup()
    a = args(stale_correction="decoupled", reject_band=1e-3)
    behaviour = batch.log_probs.clone()
    model.transformer.train()
    stats = algorithms.correction_stats(*algorithms.decoupled(model, batch, a))
    assert torch.equal(batch.log_probs, behaviour) and torch.equal(batch.behaviour_log_probs, behaviour)
    assert torch.equal(batch.is_weights, torch.ones_like(behaviour)), (batch.is_weights - 1).abs().max()
    assert stats["rollout_corr/is_mean"] == 1 and stats["rollout_corr/ess"] == 1
    assert stats["rollout_corr/rejected_fraction"] == 0
    _, loss_stats = algorithms.policy_loss(model, engine, batch.chunk(0, 4), 0, a)
    assert float(loss_stats["gap"]) == 0


def test_decoupled_truncates_and_rejects_by_the_log_ratio_to_the_behaviour():
    """Behaviour log-probs shifted by known amounts δ: the weight is min(exp(−δ), cap), and 0 where |δ| > band; the
    ratio's reference becomes the recomputed log-probs (the unshifted ones)."""
    model, engine, batch = tiny_setup()
    exact, exact_means = batch.log_probs.clone(), batch.means.clone()  # (4, 3), (4, 3, S, C)
    shift = torch.tensor([[0.0, 0.1, -0.1], [-0.5, 0.3, 0.0], [-2.0, 0.0, 0.05], [0.0, 0.0, 0.0]])
    batch.log_probs, batch.means = exact + shift, exact_means + 0.01
    model.transformer.train()
    stats = algorithms.correction_stats(*algorithms.decoupled(model, batch, args(stale_correction="decoupled",
                                                                                 is_cap=1.5, reject_band=1.0)))
    want = (-shift).exp().clamp(max=1.5) * (shift.abs() <= 1.0)
    assert torch.equal(batch.log_probs, exact) and torch.equal(batch.behaviour_log_probs, exact + shift)
    # the means too (GRPO-Guard's ratio and DPPO's trust region read them): before, the sampler's stayed, and with
    # --fp8-rollout --guard full the first update's ratio was 1 + 3.6e-6, every image clipped at the recipe's ε
    assert torch.equal(batch.means, exact_means), (batch.means - exact_means).abs().max()
    guard = args(stale_correction="decoupled", guard="full")
    _, first = algorithms.policy_loss(model, engine, batch.chunk(0, 4), 0, guard)
    assert first["log_ratio"].abs().max() == 0, first["log_ratio"]
    assert torch.allclose(batch.is_weights, want, rtol=1e-6, atol=0), (batch.is_weights - want).abs().max()
    assert stats["rollout_corr/rejected_fraction"] == pytest.approx(1 / 12)
    assert stats["rollout_corr/is_max"] == pytest.approx(np.exp(2.0), rel=1e-6)  # untruncated, before the cap
    assert stats["rollout_corr/logp_diff/step0"] == pytest.approx(2.5 / 4, rel=1e-5)
    # the loss weighs each transition's term by it: weight 0 removes the term, the terms add up
    mb = batch.chunk(2, 4)
    mb.advantages = torch.tensor([1.0, 0.5])

    def loss_with(w2, w3):
        mb.is_weights = torch.tensor([[w2] * 3, [w3] * 3])
        return algorithms.policy_loss(model, engine, mb, 0, args(stale_correction="decoupled"))[0].item()
    assert loss_with(0.0, 0.0) == 0
    both, alone = loss_with(1.0, 1.0), loss_with(1.0, 0.0) + loss_with(0.0, 1.0)
    assert both != 0 and abs(both - alone) <= 1e-6 * abs(both), (both, alone)


def test_the_correction_metrics_are_the_whole_batchs_over_the_ranks(monkeypatch):
    """train_on measures rollout_corr/* over every rank's transitions (engine.all_gather), not per rank: the loop then
    averages ranks' values, which made a max a mean of maxima and the ESS not the batch's. Here a second rank's
    log-ratios stand in through all_gather: its larger maximum is the one logged."""
    model, engine, batch = tiny_setup()
    batch.log_probs = batch.log_probs - 0.25  # this rank's weights exp(0.25)
    other = torch.full_like(batch.log_probs, 1.5)  # "rank 1": exp(1.5), rejected by no band
    sent = iter([other, other.exp()])  # what rank 1 sends: its log-ratios, then its weights
    monkeypatch.setattr(engine, "all_gather", lambda x: torch.cat([x.cpu(), next(sent)]))
    arith = {"micro_batches_per_rank": 1, "micro_batches_per_optimizer_step": 1}
    model.transformer.train()
    stats = algorithms.train_on(model, engine, batch, args(stale_correction="decoupled", optimizer_steps=1), arith,
                                False)
    whole = torch.cat([torch.full_like(other, 0.25), other]).double().exp()
    assert stats["rollout_corr/is_max"] == pytest.approx(np.exp(1.5), rel=1e-6), stats["rollout_corr/is_max"]
    assert stats["rollout_corr/ess"] == pytest.approx((whole.sum() ** 2 / (whole.numel() * (whole ** 2).sum())).item())


def test_a_synchronous_decoupled_run_trains_as_bypass_does_with_logp_gap_zero(tmp_path):
    """--rollout local: nothing is stale, every weight 1: the decoupled run's rewards equal the bypass run's."""
    flags = ("--iterations", "2", "--eval-every", "0", "--group-size", "4", "--prompts-per-iteration", "2",
             "--micro-batch", "4")
    plain = main_here(*flags, "--run-dir", tmp_path / "a")
    corrected = main_here(*flags, "--run-dir", tmp_path / "b", "--stale-correction", "decoupled")
    assert [r["reward/mean"] for r in plain] == [r["reward/mean"] for r in corrected]
    assert all(r["train/logp_gap"] == 0 and r["rollout_corr/is_mean"] == 1 for r in corrected), corrected
    assert "rollout_corr/is_mean" not in plain[0]


# ---- offpolicy.Rollouts with a stand-in draw: the order of work, the overlap, the checkpointed batch --------------

def fake_sampled(it, images=True):
    g = torch.Generator().manual_seed(it)
    batch = rollout.Batch(["p"] * 2, [{}] * 2, torch.zeros(2, dtype=torch.long),
                          torch.randn(2, 3, 4, 5, generator=g), torch.randn(2, 2, generator=g),
                          torch.linspace(1, 0.5, 3), 1.0, {"embeds": torch.ones(2, 1, 1)},
                          torch.rand(2, 3, 8, 8, generator=g), x0=None, ids=torch.arange(2), iteration=it)
    return offpolicy.Sampled(it, torch.arange(2)[None], torch.arange(2), [0, 1], batch,
                             np.array([it + 0.25, it + 0.5]), {"r": np.array([1.0, 2.0 + it])}, 0.0, 0,
                             version=it)


class Recorder:
    def __init__(self, sample_s=0.0):
        self.events, self.sample_s, self.lock = [], sample_s, threading.Lock()

    def draw(self, it, scorer):
        with self.lock:
            self.events.append(("draw", it, threading.current_thread() is threading.main_thread()))
        time.sleep(self.sample_s)
        return fake_sampled(it)

    @contextlib.contextmanager
    def publish(self, it):
        self.events.append(("publish", it))
        yield


def engine_stub(others=()):
    """Rank 0 of a world of one; `others`: what the other ranks' all_gather adds (say, 0: a rank that disagrees)."""
    return SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"),
                           all_gather=lambda x: torch.cat([torch.as_tensor(x), torch.tensor(others, dtype=x.dtype)]))


def test_one_ahead_samples_the_next_iteration_under_the_weights_before_the_update():
    rec = Recorder(sample_s=0.3)
    rollouts = offpolicy.Rollouts(rec.draw, rec.publish, None, engine_stub(), ahead=1, iterations=3)
    try:
        got = [rollouts.get(0)]
        t = time.time()
        time.sleep(0.3)  # "training" while iteration 1 samples in its thread
        train_end = time.time()
        got.append(rollouts.get(1))
        got.append(rollouts.get(2))
    finally:
        rollouts.close()
    assert [g.it for g in got] == [0, 1, 2] and [g.version for g in got] == [0, 0, 1]
    publishes = [e for e in rec.events if e[0] == "publish"]
    assert publishes == [("publish", 0), ("publish", 1), ("publish", 2)]  # nothing is started after the last
    assert all(not main for kind, _, main in (e for e in rec.events if e[0] == "draw"))  # drawn in the thread
    start, end = got[1].span
    assert max(start, t) < min(end, train_end), (got[1].span, (t, train_end))  # the intervals intersect


def test_synchronous_draws_in_the_callers_thread_inside_publish():
    rec = Recorder()
    rollouts = offpolicy.Rollouts(rec.draw, rec.publish, "scorer", engine_stub(), ahead=0, iterations=2)
    assert [rollouts.get(i).version for i in range(2)] == [0, 1]
    assert rec.events == [("publish", 0), ("draw", 0, True), ("publish", 1), ("draw", 1, True)]


def test_the_rollout_in_flight_is_checkpointed_and_read_back_to_the_bit(tmp_path):
    rec = Recorder()
    rollouts = offpolicy.Rollouts(rec.draw, rec.publish, None, engine_stub(), ahead=1, iterations=5)
    rollouts.get(0)  # iteration 1 is in flight
    rollouts.save(str(tmp_path))
    rollouts.close()
    resumed = offpolicy.Rollouts(rec.draw, rec.publish, None, engine_stub(), ahead=1, iterations=5)

    def plan(it):  # what flowgrpo.draw(images=False) gives: the plan and conditioning, no tensors
        s = fake_sampled(it)
        s.batch.latents = s.batch.log_probs = s.batch.images = s.scores = None
        return s
    resumed.load(str(tmp_path), plan)
    got, want = resumed.get(1), fake_sampled(1)
    resumed.close()
    for k in ("latents", "log_probs", "images", "sigmas"):
        assert torch.equal(getattr(got.batch, k), getattr(want.batch, k)), k
    assert np.array_equal(got.scores, want.scores) and np.array_equal(got.info["r"], want.info["r"])
    assert got.version == 0 and got.batch.sigma_max == want.batch.sigma_max
    assert rec.events.count(("draw", 1, False)) == 1  # iteration 1 was not drawn again
    bad = offpolicy.Rollouts(rec.draw, rec.publish, None, SimpleNamespace(rank=0, world_size=2, device="cpu"),
                             ahead=1, iterations=5)
    with pytest.raises(ValueError, match="on as many training ranks"):
        bad.load(str(tmp_path), plan)
    bad.close()


def test_a_stop_while_the_next_iteration_is_published_checkpoints_the_rollout_in_hand(tmp_path, capsys):
    """A Ctrl-C while get(1) publishes iteration 2's weights (backend.sync writes the LoRA: seconds) ends the loop,
    which checkpoints iteration 0 with its rollout in flight: iteration 1's, sampled on version 0, already drawn. It was
    dropped before its successor had started, so nothing was written and the resumed run sampled iteration 1 again on
    newer weights (version 1), unsaid. One held for another iteration (a stop after the next had started) is said."""
    rec = Recorder()

    @contextlib.contextmanager
    def publish(it):
        if it == 2:
            raise KeyboardInterrupt("SIGINT")
        yield
    rollouts = offpolicy.Rollouts(rec.draw, publish, None, engine_stub(), ahead=1, iterations=5)
    rollouts.get(0)
    with pytest.raises(KeyboardInterrupt):
        rollouts.get(1)
    rollouts.save(str(tmp_path))  # the loop's save(done=0)
    rollouts.close()
    resumed = offpolicy.Rollouts(rec.draw, rec.publish, None, engine_stub(), ahead=1, iterations=5)
    resumed.load(str(tmp_path), fake_sampled)  # the plan; its tensors are the file's
    got = resumed.get(1)
    resumed.close()
    assert got.version == 0 and rec.events.count(("draw", 1, False)) == 1  # iteration 1 not drawn again
    assert torch.equal(got.batch.latents, fake_sampled(1).batch.latents)
    other = offpolicy.Rollouts(rec.draw, rec.publish, None, engine_stub(), ahead=1, iterations=5)
    other.load(str(tmp_path), fake_sampled)
    assert other.get(0).version == 0 and "the rollout in flight is iteration 1's, not 0's" in capsys.readouterr().err
    other.close()


def test_a_rollout_in_flight_resumes_with_its_sampling_times(tmp_path):
    """time/rollout_start and /rollout_end of the first iteration after a resume are the batch's own sampling times
    (its span, in the file): before, 0.0 and 0.0, as if it had been sampled in 1970."""
    rollouts = offpolicy.Rollouts(Recorder().draw, Recorder().publish, None, engine_stub(), ahead=1, iterations=5)
    rollouts.get(0)
    span = rollouts.pending[1].result().span
    rollouts.save(str(tmp_path))
    rollouts.close()
    resumed = offpolicy.Rollouts(Recorder().draw, Recorder().publish, None, engine_stub(), ahead=1, iterations=5)
    resumed.load(str(tmp_path), fake_sampled)
    got = resumed.get(1)
    resumed.close()
    assert span[0] > 0 and got.span == span, (got.span, span)


@pytest.mark.parametrize("change", ["prompts", "another rank's plan"])
def test_a_rollout_in_flight_planned_otherwise_is_sampled_again(tmp_path, capsys, change):
    """A resume whose flags plan iteration 1 otherwise (--allow-change prompts, seed, group size...): the file's latents
    and scores belong to other prompts, so iteration 1 is sampled again on the weights held now (staleness 0), said;
    before, the batch paired the new prompts' conditioning with the old prompts' images and scores, silently. Every
    rank decides alike: one whose plan is unchanged samples again too when another's changed (they publish together)."""
    rec = Recorder()
    rollouts = offpolicy.Rollouts(rec.draw, rec.publish, None, engine_stub(), ahead=1, iterations=5)
    rollouts.get(0)
    rollouts.save(str(tmp_path))
    rollouts.close()

    def replanned(it):
        s = fake_sampled(it)
        s.batch.prompts = ["another prompt"] * 2
        return s
    engine = engine_stub(others=(0.0,) if change == "another rank's plan" else ())
    resumed = offpolicy.Rollouts(rec.draw, rec.publish, None, engine, ahead=1, iterations=5)
    resumed.load(str(tmp_path), replanned if change == "prompts" else fake_sampled)
    got = resumed.get(1)
    resumed.close()
    assert got.version == 1 and rec.events.count(("draw", 1, False)) == 2, (got.version, rec.events)
    assert "was sampled for another plan of iteration 1" in capsys.readouterr().err
