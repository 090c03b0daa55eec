"""`--off-policy 1` through the real vLLM-Omni 0.30.0 server: the next iteration samples while this one trains.

A run's rollout of iteration k+1 overlaps iteration k's update (their logged intervals intersect), samples under the
adapter published before that update (one version a batch, in order), and every batch after the first is one update
stale; with weights that do not move (--lr 1e-30) the decoupled correction's importance weights are 1 to the server's
rounding and `train/logp_gap` is 0. Two training ranks agree with one. A run resumed from a checkpoint holding the rollout in flight ends with the same
LoRA to the bit; a server error and SIGTERM stop the run, the error naming the server. Without a server:
tests/test_offpolicy.py.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from harness import ROOT, train_here

import checkpoint
from test_engine import ENV, lora, relative_difference


def off_policy_run(server, pipeline_dir, run, *flags):
    return train_here("--model", "tiny", "--model-path", str(pipeline_dir), "--rollout", "vllm-omni", "--rollout-url",
                      server.url, "--run-dir", str(run), "--eval-every", "0", "--off-policy", "1", *flags)


def test_the_next_rollout_overlaps_this_update_under_the_weights_before_it(omni_server, tiny_pipeline_dir, tmp_path):
    log_start = len(omni_server.log_text())
    rows = off_policy_run(omni_server, tiny_pipeline_dir, tmp_path / "run", "--iterations", "4", "--lr", "3e-2",
                          "--clip-range", "0.2")
    assert [r["rollout_corr/staleness"] for r in rows] == [0, 1, 1, 1]
    for this, following in zip(rows, rows[1:]):  # rollout of k+1 ∩ update of k: not empty
        start = max(this["time/train_start"], following["time/rollout_start"])
        end = min(this["time/train_end"], following["time/rollout_end"])
        assert start < end, (this, following)
    loaded = re.findall(r"Loading new adapter: id=(\d+), name=flowgrpo-v(\d+)", omni_server.log_text()[log_start:])
    assert [int(v) for _, v in loaded] == [0, 1, 2, 3]  # batch k by version k: θ_0, θ_0, θ_1, θ_2
    gaps = [r["train/logp_gap"] for r in rows]
    print(f"\noff-policy 1: train/logp_gap {[f'{g:.1e}' for g in gaps]}, is_mean "
          f"{[round(r['rollout_corr/is_mean'], 6) for r in rows]}, ess {[round(r['rollout_corr/ess'], 6) for r in rows]}")
    assert gaps[0] < 1e-5 and min(gaps[1:]) > 100 * gaps[0], gaps  # batch 0 is on-policy; the others a step stale
    assert all(0 < r["rollout_corr/ess"] <= 1 and r["rollout_corr/is_max"] >= r["rollout_corr/is_mean"] for r in rows)


def test_weights_that_do_not_move_give_importance_weights_of_one(omni_server, tiny_pipeline_dir, tmp_path):
    rows = off_policy_run(omni_server, tiny_pipeline_dir, tmp_path / "run", "--iterations", "3", "--lr", "1e-30",
                          "--stale-correction", "decoupled", "--reject-band", "1e-3")
    worst = max(abs(r["rollout_corr/is_mean"] - 1) + abs(r["rollout_corr/is_max"] - 1) for r in rows)
    print(f"\nlr 1e-30, decoupled: importance weights within {worst:.1e} of 1 (the server's rounding)")
    assert worst < 1e-5 and all(r["rollout_corr/rejected_fraction"] == 0 for r in rows), rows
    assert all(r["train/logp_gap"] == 0 for r in rows)  # the recomputed log-probs are the first update's to the bit


def test_a_resume_trains_on_the_checkpointed_rollout_and_ends_with_the_same_lora(omni_server, tiny_pipeline_dir,
                                                                                 tmp_path):
    run, flags = tmp_path / "run", ("--iterations", "3", "--checkpoint-every", "1", "--keep-checkpoints", "3")
    off_policy_run(omni_server, tiny_pipeline_dir, run, *flags)
    first = load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    newest = checkpoint.list_checkpoints(str(run / "checkpoints"))
    assert (Path(newest[1]) / "inflight_rank0.safetensors").exists()  # iteration 2's batch, sampled under θ_1
    shutil.rmtree(newest[-1])  # as if the run had stopped after iteration 1's checkpoint
    again = off_policy_run(omni_server, tiny_pipeline_dir, run, *flags, "--resume", "auto")
    second = load_file(str(run / "lora" / "pytorch_lora_weights.safetensors"))
    assert [r["iteration"] for r in again] == [0, 1, 2]  # the first two read back from metrics.jsonl
    for key in ("reward/mean", "train/policy_loss", "train/grad_norm", "train/logp_gap"):
        assert again[2][key] == rows[2][key], (key, again[2][key], rows[2][key])
    assert first.keys() == second.keys() and all((first[k] == second[k]).all() for k in first)


def test_a_server_error_or_sigterm_stops_the_run(omni_server, tiny_pipeline_dir, tmp_path):
    with pytest.raises(RuntimeError) as err:  # HTTP 500 (a LoRA on to_out.0), raised from the rollout's thread
        off_policy_run(omni_server, tiny_pipeline_dir, tmp_path / "a", "--iterations", "2", "--lora-targets", "to_q",
                       "to_out.0")
    assert f"vLLM-Omni server {omni_server.url} answered HTTP 500" in str(err.value), str(err.value)
    run = tmp_path / "b"
    proc = subprocess.Popen([sys.executable, str(ROOT / "flowgrpo.py"), "--no-wandb", "--model", "tiny", "--model-path",
                             str(tiny_pipeline_dir), "--rollout", "vllm-omni", "--rollout-url", omni_server.url,
                             "--run-dir", str(run), "--eval-every", "0", "--off-policy", "1", "--iterations", "100",
                             "--checkpoint-every", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=os.environ | {"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / f"{checkpoint.PREFIX}{1:06d}" / "meta.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # mid-iteration: a rollout is in flight in its thread
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0 and "flowgrpo.py: interrupted" in stderr, stderr[-3000:]


def test_two_training_ranks_agree_with_one(omni_server, tiny_pipeline_dir, tmp_path):
    """`torchrun --nproc_per_node 2` against one process, both --off-policy 1: each rank sends its share of the next
    iteration's requests from its own thread, publishing stays a collective of the main threads. The final LoRA
    within test_engine's 1e-3 relative (the gradient sums' order differs, and the server's rounding between runs)."""
    flags = ["--model", "tiny", "--model-path", str(tiny_pipeline_dir), "--rollout", "vllm-omni", "--rollout-url",
             omni_server.url, "--eval-every", "0", "--off-policy", "1", "--iterations", "3", "--micro-batch", "4"]
    off_policy_run(omni_server, tiny_pipeline_dir, tmp_path / "one", "--iterations", "3", "--micro-batch", "4")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "flowgrpo.py"), "--no-wandb", *flags, "--run-dir", str(tmp_path / "two")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rel, worst = relative_difference(lora(tmp_path / "one"), lora(tmp_path / "two"))
    print(f"\n--off-policy 1, 1 vs 2 ranks: final LoRA {rel:.3g} relative, max |Δ| {worst:.3g}")
    assert rel < 1e-3, f"1 vs 2 ranks differ by {rel:.3g} relative (max |Δ| {worst:.3g})"
