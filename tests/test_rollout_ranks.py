"""`--rollout-ranks R` on CPU (gloo, torchrun): the world's last R ranks sample for the others. With `--off-policy 0`
one training rank and one rollout rank take the synchronous loop's steps (the same rewards, the same LoRA); with
`--off-policy 1` the rollout rank samples iteration k+1 while iteration k trains (their intervals intersect) and the
run resumes to the bit from a checkpoint holding the batch in flight; two training ranks agree with one; a killed rollout rank or SIGTERM stops every
rank, naming the rank; the start-up refusals."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

import checkpoint
import cli
import flowgrpo
import rollout_ranks
import startup
from test_engine import ENV, ROOT, lora, relative_difference
from tiny_setup import main_here

FLAGS = ("--iterations", "3", "--eval-every", "0", "--group-size", "4", "--prompts-per-iteration", "2",
         "--micro-batch", "4")


# `torchrun ... --no-python python -c SAYING flowgrpo.py ...`: the script with a training rank's line while it waits on
# its rollout rank said every second, not every minute
SAYING = """
import runpy, sys
import rollout_ranks
rollout_ranks.SAY_EVERY = 1.0
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def torchrun(run_dir, *flags, n=2, wait=True, script=(os.path.join(ROOT, "flowgrpo.py"),)):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *script,
            "--no-wandb", "--run-dir", str(run_dir), *FLAGS, *flags]
    kw = dict(cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return subprocess.Popen(argv, start_new_session=True, **kw)
    out = subprocess.run(argv, timeout=600, **kw)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precision", [(), ("--mixed-precision",)], ids=["fp32", "mixed-precision"])
def test_a_rollout_rank_in_turn_takes_the_synchronous_loops_steps(tmp_path, precision):
    """The same images, rewards and LoRA as one process; with --mixed-precision too (the GPU recipes' dtypes: before,
    the rollout rank sampled in fp32, the first update's logp_gap 1.9e-4)."""
    plain = main_here(*FLAGS, *precision, "--run-dir", tmp_path / "plain")
    ranks = torchrun(tmp_path / "ranks", "--rollout-ranks", "1", *precision)
    assert [r["reward/mean"] for r in ranks] == [r["reward/mean"] for r in plain]
    assert all(r["train/logp_gap"] == 0 for r in ranks), [r["train/logp_gap"] for r in ranks]
    rel, worst = relative_difference(lora(tmp_path / "plain"), lora(tmp_path / "ranks"))
    assert rel < 1e-6, f"the LoRA differs by {rel:.3g} relative (max |Δ| {worst:.3g})"


def test_one_ahead_overlaps_and_resumes_to_the_bit(tmp_path, monkeypatch, capsys):
    """The rollout of k+1 overlaps the update of k; a checkpoint resumes to the bit. And start-up's checks of such a
    checkpoint (offpolicy.check_resume, in this process): its rollout in flight, over 1 training rank, is refused on 2
    in one line (before, once the model was built); the run's last, with nothing in flight, extended by a larger
    --iterations, says its next iteration is sampled on other weights than a straight run's."""
    run = tmp_path / "run"
    rows = torchrun(run, "--rollout-ranks", "1", "--off-policy", "1", "--checkpoint-every", "1",
                    "--keep-checkpoints", "3")
    assert [r["rollout_corr/staleness"] for r in rows] == [0, 1, 1]
    for this, following in zip(rows, rows[1:]):  # rollout of k+1 ∩ update of k
        assert max(this["time/train_start"], following["time/rollout_start"]) < \
            min(this["time/train_end"], following["time/rollout_end"]), (this, following)
    assert rows[0]["train/logp_gap"] == 0 and min(r["train/logp_gap"] for r in rows[1:]) > 0
    ahead, _, last = checkpoint.list_checkpoints(str(run / "checkpoints"))
    flags = [*FLAGS, "--rollout-ranks", "1", "--off-policy", "1", "--run-dir", str(tmp_path / "branch"),
             "--iterations", "5"]
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError) as e:
        startup.check_args(cli.parse_args(flowgrpo.Args, [*flags, "--resume", ahead]))
    assert str(e.value).startswith("the checkpoint holds a rollout in flight over 1 training rank(s), this run has 2"), \
        str(e.value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert startup.check_args(cli.parse_args(flowgrpo.Args, [*flags, "--resume", ahead]))
    assert "warning" not in capsys.readouterr().err
    assert startup.check_args(cli.parse_args(flowgrpo.Args, [*flags, "--resume", last]))
    assert "warning: the checkpoint ends its --off-policy 1 run: nothing was in flight, so iteration 3 is sampled" in \
        capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    first = lora(run)
    shutil.rmtree(last)  # stopped after iteration 1's
    again = torchrun(run, "--rollout-ranks", "1", "--off-policy", "1", "--checkpoint-every", "1",
                     "--keep-checkpoints", "3", "--resume", "auto")
    assert again[2]["reward/mean"] == rows[2]["reward/mean"] and again[2]["train/grad_norm"] == rows[2]["train/grad_norm"]
    rel, worst = relative_difference(first, lora(run))
    assert worst == 0, f"the resumed LoRA differs by {worst:.3g} (relative {rel:.3g})"


def test_two_training_ranks_agree_with_one(tmp_path):
    """One rollout rank serving two training ranks (3 processes) against serving one: the final LoRA within
    test_engine's 1e-3 relative (only the gradient sums' order differs)."""
    torchrun(tmp_path / "one", "--rollout-ranks", "1", "--off-policy", "1", "--micro-batch", "2")
    torchrun(tmp_path / "two", "--rollout-ranks", "1", "--off-policy", "1", "--micro-batch", "2", n=3)
    rel, worst = relative_difference(lora(tmp_path / "one"), lora(tmp_path / "two"))
    print(f"\n--rollout-ranks 1 --off-policy 1, 1 vs 2 training ranks: {rel:.3g} relative, max |Δ| {worst:.3g}")
    assert rel < 1e-3, f"1 vs 2 training ranks differ by {rel:.3g} relative (max |Δ| {worst:.3g})"


@pytest.mark.parametrize("how", ["freeze, then kill the rollout rank", "SIGTERM"])
def test_a_dead_rollout_rank_or_sigterm_stops_every_rank(tmp_path, how):
    """A rollout rank frozen (SIGSTOP) is waited for with a line every SAY_EVERY seconds naming it (before: in
    silence, up to the 30-minute bound), then killed: every rank stops, rank 0 naming it; SIGTERM stops every rank."""
    run, lines, outs = tmp_path / "run", [], []
    proc = torchrun(run, "--rollout-ranks", "1", "--off-policy", "1", "--iterations", "200", "--checkpoint-every", "1",
                    wait=False, script=("--no-python", sys.executable, "-c", SAYING, os.path.join(ROOT, "flowgrpo.py")))
    readers = [threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True),  # read as it comes
               threading.Thread(target=lambda: outs.extend(proc.stdout), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        # each phase its own bound, generous for a loaded machine (CI once spent ~300 s starting the two ranks beside
        # a vLLM-Omni test, and a deadline shared by both phases left the frozen rank's line 0.1 s)
        deadline = time.monotonic() + 900
        while not (run / "checkpoints" / f"{checkpoint.PREFIX}{0:06d}" / "meta.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        if how == "SIGTERM":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            sampler = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
            assert len(sampler) == 1, sampler
            sampler[0].suspend()
            deadline = time.monotonic() + 300  # the line is due every SAY_EVERY = 1 s once rank 0 waits
            while not any("has waited" in line for line in lines):
                assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
                time.sleep(0.2)
            sampler[0].kill()
        proc.wait(timeout=120)  # no hang: every rank ends
        for reader in readers:
            reader.join(10)
        out, err = "".join(outs), "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    said = out + err  # all of it: torchrun's own report follows the trainer's line
    assert proc.returncode != 0, said[-5000:]
    assert ("flowgrpo.py: interrupted" in said) if how == "SIGTERM" else ("rollout rank 1" in said or
                                                                           "local_rank: 1" in said), said[-5000:]
    if how != "SIGTERM":
        waited = [line for line in lines if "has waited" in line]
        assert waited[0].startswith("flowgrpo.py: rank 0 has waited 1 s for rollout rank 1 (iteration "), waited


def test_a_send_to_a_frozen_rollout_rank_says_it_waits(monkeypatch, capsys):
    """gloo sends once the peer has posted its receive (measured: 4 floats to a rank that posts it 8 s later take 8 s),
    so a rollout rank frozen between two iterations holds training rank 0 in its send of the weights: that wait is said
    as a receive's is (before: in silence up to the 30-minute bound; the CLI test above met it under load, at random).
    Here the peer is a stand-in whose send completes after 2.5 s, the line due every second."""
    class Work:
        def wait(self):
            time.sleep(2.5)

    class Group:
        def send(self, tensors, to, tag):
            return Work()

    monkeypatch.setattr(rollout_ranks, "SAY_EVERY", 1.0)
    x = rollout_ranks.Exchange.__new__(rollout_ranks.Exchange)  # its point-to-point half, without a world
    x.rank, x.trainers, x.group = 0, 1, Group()
    x.send([torch.zeros(2)], 1, rollout_ranks.WEIGHTS, "iteration 3's weights")
    said = capsys.readouterr().err
    assert "flowgrpo.py: rank 0 has waited 1 s for rollout rank 1 (iteration 3's weights)" in said, said


@pytest.mark.parametrize("world,flags,needle", [
    (2, ("--rollout-ranks", "2"), "leaves no rank to train"),
    (4, ("--rollout-ranks", "3"), "must split evenly"),
    (3, ("--rollout-ranks", "1", "--algorithm", "nft"), "--rollout-ranks: a local rollout of grpo"),
    (3, ("--rollout-ranks", "1", "--rollout", "vllm-omni", "--rollout-url", "http://127.0.0.1:9"), "--rollout-ranks"),
])
def test_impossible_splits_are_refused_in_one_line(monkeypatch, world, flags, needle):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ValueError) as e:
        startup.check_args(cli.parse_args(flowgrpo.Args, list(flags)))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_batch_the_training_ranks_cannot_split_is_refused_before_the_world_is_split(monkeypatch):
    """Every rank checks the batch arithmetic over the training ranks (the world less --rollout-ranks) before the world
    is split: before, the rollout ranks had started loading the model when training rank 0 refused the batch."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(rollout_ranks, "split", lambda r: pytest.fail("the world was split before the check"))
    with pytest.raises(ValueError, match=r"must split into \d+ optimizer step\(s\) × 3 rank\(s\)"):
        flowgrpo.main(cli.parse_args(flowgrpo.Args, ["--rollout-ranks", "1", "--off-policy", "1"]))
