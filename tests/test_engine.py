"""engine.py at work: 1 process vs torchrun (2 ranks, and 2 "nodes"), exact resume, a crash while writing a
checkpoint, LoRA export into a fresh diffusers pipeline, and bad --resume input. A one-process run is flowgrpo.main in
this process (`train`: a process's start-up, ~10 s of imports, is what a test run mostly cost); the CLI runs where the
process is the point (torchrun, a SIGKILL, a refusal's one line)."""
import dataclasses
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import algorithms
import checkpoint
import cli
import engine as engine_module
import flowgrpo
import models_qwen
import startup
from tiny_setup import main_here, tiny_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 images per iteration: 4 micro-batches of 2 on one rank, 2 on each of two ranks; a checkpoint after each iteration.
SMALL = ["--model", "tiny", "--prompts-per-iteration", "2", "--group-size", "4", "--micro-batch", "2",
         "--optimizer-steps", "2", "--eval-every", "0", "--no-wandb", "--checkpoint-every", "1", "--seed", "3"]
ENV = os.environ | {"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `python -c SLOW_CHECKPOINTS flowgrpo.py ...`: the script with the second checkpoint's write (iter_000001) paused 3 s
# after its DCP shards, a window for the crash test to kill it in.
SLOW_CHECKPOINTS = """
import runpy, sys, time
import checkpoint
save_rng_state = checkpoint.save_rng_state
def slowly(path):
    time.sleep(3 if "iter_000001" in path else 0)
    save_rng_state(path)
checkpoint.save_rng_state = slowly
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def launch(run_dir, *flags, ranks=1, env=None, wait=True, launcher=None):
    launcher = (launcher or [sys.executable]) if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                                 "--standalone", f"--nproc_per_node={ranks}"]
    cmd = launcher + [os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--run-dir", str(run_dir), *flags]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    out = subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def train(run_dir, *flags):
    """`launch(run_dir, *flags)` in this process (tiny_setup.main_here); its rows."""
    return main_here(*SMALL, "--run-dir", run_dir, *flags)


def rows(run_dir):
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def lora(run_dir, ckpt=None):
    d = os.path.join(run_dir, "checkpoints", ckpt, "lora") if ckpt else os.path.join(run_dir, "lora")
    return load_file(os.path.join(d, "pytorch_lora_weights.safetensors"))


def train_state(run_dir, ckpt, tmp_path):
    """The checkpoint's DCP content (LoRA weights and AdamW state) as one plain dict."""
    out = tmp_path / f"{os.path.basename(str(run_dir))}-{ckpt}.pt"
    dcp_to_torch_save(os.path.join(run_dir, "checkpoints", ckpt, "dcp"), out)
    return torch.load(out, weights_only=True)


def flat(d, prefix=""):
    items = {}
    for k, v in d.items():
        if isinstance(v, dict):
            items |= flat(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            items[prefix + str(k)] = v
    return items


def assert_same(a, b, exact, tol=1e-5):
    a, b = flat(a), flat(b)
    assert a.keys() == b.keys()
    for k in a:
        diff = (a[k].double() - b[k].double()).abs().max().item() if a[k].numel() else 0.0
        if exact:
            assert torch.equal(a[k], b[k]), f"{k}: max |difference| {diff:.3g}"
        else:
            torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=f"{k}: max |difference| {diff:.3g}")


def relative_difference(a, b):
    """‖a − b‖ / ‖a‖ over all tensors of two state dicts (the global relative size of a mismatch), and the max |a − b|."""
    a, b = flat(a), flat(b)
    assert a.keys() == b.keys()
    num = sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt()
    den = sum((a[k].double() ** 2).sum() for k in a).sqrt()
    return (num / den).item(), max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def without_perf(r):
    return {k: v for k, v in r.items() if not k.startswith("perf/")}


def check_cli_resume(run: list, tmp_path) -> tuple:
    """flowgrpo.py with `run` (2 iterations, a checkpoint each) in this process for 2 iterations, and for 1 then
    `--resume auto` to 2: the same LoRA and AdamW state, bit for bit. -> the two run directories."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    main_here(*run, "--run-dir", straight)
    main_here(*run, "--run-dir", resumed, "--iterations", "1")
    main_here(*run, "--run-dir", resumed, "--resume", "auto")
    assert_same(lora(straight), lora(resumed), exact=True)
    assert_same(train_state(straight, "iter_000001", tmp_path), train_state(resumed, "iter_000001", tmp_path),
                exact=True)
    return straight, resumed


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """2 iterations in one process, checkpoints after each (iter_000000, iter_000001)."""
    run = tmp_path_factory.mktemp("straight")
    train(run, "--iterations", "2")
    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("two_ranks")
    launch(run, "--iterations", "2", ranks=2)
    return run


def test_two_ranks_match_one_process(straight, two_ranks):
    """Both runs use one thread per process (ENV, `train`), so each micro-batch's gradient is computed with the same
    kernels and only the sums differ (one process accumulates, two ranks reduce-scatter). AdamW's first steps are about
    lr·sign(g), so an element whose gradient is at rounding level can move by up to 2·lr between the two: elementwise
    tolerances measure luck. The LoRA is compared as a whole instead, after 1 and 2 iterations: measured 2.6e-7 and
    4.6e-5 relative (1.3e-6, 6.6e-5 max); with unequal thread counts (2 in the one process) 2.3e-3, 2.6e-3; a 1% larger
    learning rate 2.3e-3, 3.7e-3; one optimizer step instead of two 0.18, 0.26. The tolerance, 1e-3, is far above
    rounding and below any real change to the update."""
    one, two = rows(straight), rows(two_ranks)
    assert [r["iteration"] for r in two] == [0, 1]
    assert one[0]["reward/mean"] == two[0]["reward/mean"]  # identical images before any update
    for a, b in zip(one, two):
        for key in ("reward/mean", "reward/std", "train/policy_loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["iteration"], key, a[key], b[key])
        assert a["train/logp_gap"] == b["train/logp_gap"] == 0
    for ckpt in ("iter_000000", None):  # after 1 and after 2 iterations
        rel, worst = relative_difference(lora(straight, ckpt), lora(two_ranks, ckpt))
        assert rel < 1e-3, f"{ckpt or 'final'} LoRA: 1 vs 2 ranks differ by {rel:.3g} relative (max |Δ| {worst:.3g})"


def test_resume_is_exact_in_one_process(straight, tmp_path):
    run = tmp_path / "resumed"
    train(run, "--iterations", "1")  # a run stopped after 1 of 2 iterations ...
    train(run, "--iterations", "2", "--resume", "auto")  # ... and continued
    assert_same(lora(straight), lora(run), exact=True)
    assert_same(train_state(straight, "iter_000001", tmp_path), train_state(run, "iter_000001", tmp_path), exact=True)
    assert [without_perf(r) for r in rows(run)] == [without_perf(r) for r in rows(straight)]
    assert [r["iteration"] for r in rows(run)] == [0, 1]


def test_resume_with_the_rollouts_forward_reused_is_exact(straight, tmp_path):
    """--reuse-rollout-forward changes how the first update is computed, not one bit of it: a checkpoint written without
    it resumes with it (no --allow-change needed) and ends on the straight run's weights and AdamW state."""
    run = tmp_path / "reused"
    train(run, "--iterations", "2", "--resume", straight / "checkpoints" / "iter_000000", "--reuse-rollout-forward")
    assert_same(lora(straight), lora(run), exact=True)
    assert_same(train_state(straight, "iter_000001", tmp_path), train_state(run, "iter_000001", tmp_path), exact=True)
    assert [without_perf(r) for r in rows(run)] == [without_perf(r) for r in rows(straight)]


def test_resume_with_two_ranks(two_ranks, tmp_path):
    """Resumed by path into a new directory (a branch: its metrics start as the checkpoint's run's)."""
    run = tmp_path / "resumed2"
    launch(run, "--iterations", "2", "--resume", os.path.join(two_ranks, "checkpoints", "iter_000000"), ranks=2)
    assert_same(lora(two_ranks), lora(run), exact=True)  # the same two ranks, the same sums: bit for bit
    assert_same(train_state(two_ranks, "iter_000001", tmp_path), train_state(run, "iter_000001", tmp_path), exact=True)
    assert [without_perf(r) for r in rows(run)] == [without_perf(r) for r in rows(two_ranks)]


def test_a_checkpoint_resumes_on_another_number_of_ranks(straight, two_ranks, tmp_path):
    """One process trains a plain module (FSDP2 would shard nothing), 2 ranks train DTensor shards: a checkpoint of
    either resumes on the other (DCP converts between the two). The second iteration then runs as in the other
    launch: within test_two_ranks_match_one_process's bound of the run it continues, and of the other."""
    runs = {"1 as 2": tmp_path / "one_as_two", "2 as 1": tmp_path / "two_as_one"}
    launch(runs["1 as 2"], "--iterations", "2", "--resume", straight / "checkpoints" / "iter_000000", ranks=2)
    train(runs["2 as 1"], "--iterations", "2", "--resume", two_ranks / "checkpoints" / "iter_000000")
    for name, run in runs.items():
        assert rows(run)[1]["reward/mean"] == pytest.approx(rows(straight)[1]["reward/mean"], rel=1e-5)
        for other in (straight, two_ranks):
            rel, worst = relative_difference(lora(other), lora(run))
            assert rel < 1e-3, f"{name}: LoRA differs from {other.name}'s by {rel:.3g} relative (max |Δ| {worst:.3g})"


def test_two_nodes_on_one_machine_match_two_ranks(two_ranks, tmp_path):
    """Two torchrun launchers (--nnodes=2, one process each) meeting at a rendezvous on 127.0.0.1."""
    run, port = tmp_path / "nodes", free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node-rank={i}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                               "--rdzv-id=flowgrpo-test", os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--run-dir",
                               str(run), "--iterations", "2"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert_same(lora(two_ranks), lora(run), exact=False, tol=1e-4)
    for a, b in zip(rows(two_ranks), rows(run)):
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], rel=1e-5)


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(straight, tmp_path):
    run, ckpts = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    proc = launch(run, "--iterations", "2", wait=False, launcher=[sys.executable, "-c", SLOW_CHECKPOINTS])
    deadline = time.time() + 300
    while not list(ckpts.glob("iter_000001.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-write of the second checkpoint
    proc.wait()
    assert list(ckpts.glob("iter_000001.tmp-*")) and not (ckpts / "iter_000001").exists()
    previous = str(ckpts / "iter_000000")
    fp = startup.fingerprint(cli.parse_args(flowgrpo.Args, SMALL))
    assert checkpoint.resolve_resume("auto", str(run), fp)[0] == previous
    train(run, "--iterations", "2", "--resume", "auto")
    assert_same(lora(straight), lora(run), exact=True)
    assert [r["iteration"] for r in rows(run)] == [0, 1]
    assert not list(ckpts.glob("*.tmp-*"))  # what the killed write left was removed: the directory is this run's


def test_exported_lora_loads_into_a_fresh_diffusers_pipeline(tmp_path):
    """Train one iteration in-process, export, load into a fresh pipeline: the same transformer output. The metadata
    lists the targets sorted: peft holds them as a set, whose order changes with each process's hash seed, and two
    identical runs wrote different metadata (now equal; the file's bytes still differ in the order safetensors writes
    its metadata keys)."""
    args = dataclasses.replace(flowgrpo.RECIPES["tiny"], prompts_per_iteration=1, group_size=4, micro_batch=4,
                               optimizer_steps=1)
    model, engine, batch = tiny_setup(lora_alpha=16)
    algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), False)
    engine.export_lora(str(tmp_path / "lora"))
    with safe_open(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        metadata = json.loads(f.metadata()["lora_adapter_metadata"])
    assert metadata["transformer.lora_alpha"] == 16
    targets = metadata["transformer.target_modules"]
    assert targets == sorted(model.lora_targets) and len(targets) > 2, targets
    fresh = models_qwen.build_tiny_qwen_pipeline(seed=0)
    fresh.load_lora_weights(str(tmp_path / "lora"))
    x, sigma = batch.latents[:, 1], batch.sigmas[1].expand(4)
    with torch.no_grad():
        trained = model.velocity(x, sigma, batch.cond, 1.0, 32, 32)
        base = models_qwen.QwenImage(models_qwen.build_tiny_qwen_pipeline(seed=0), "cpu", torch.float32).velocity(
            x, sigma, batch.cond, 1.0, 32, 32)
        loaded = models_qwen.QwenImage(fresh, "cpu", torch.float32).velocity(x, sigma, batch.cond, 1.0, 32, 32)
    assert (trained - base).abs().max() > 1e-4  # the adapter changed the output ...
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)  # ... and the export carries it, alpha included


# ---- bad --resume input fails at start-up, naming the file and the mismatch -------------------------
def test_bad_resume_input(straight, tmp_path):
    good = os.path.join(straight, "checkpoints", "iter_000001")
    fp = startup.fingerprint(cli.parse_args(flowgrpo.Args, SMALL))
    assert checkpoint.resolve_resume("auto", str(straight), fp)[0] == good
    with pytest.raises(FileNotFoundError, match="no checkpoint directory /no/such$"):
        checkpoint.resolve_resume("/no/such", None, fp)
    typo = os.path.join(straight, "checkpoints", "iter_000009")  # an iteration never checkpointed: those there named
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint directory {typo}; {os.path.dirname(typo)} "
                                                          "holds iter_000000, iter_000001")):
        checkpoint.resolve_resume(typo, None, fp)
    with pytest.raises(ValueError, match="--lora-rank: checkpoint 8, this run 4"):
        checkpoint.resolve_resume(good, None, fp | {"lora_rank": 4})
    with pytest.raises(ValueError, match="--model: checkpoint 'tiny', this run 'qwen-image'"):
        checkpoint.resolve_resume(good, None, fp | {"model": "qwen-image"})
    newer = fp | {"a_newer_flag": True}  # a flag the checkpoint predates: compared at its default
    assert checkpoint.resolve_resume(good, None, newer, defaults={"a_newer_flag": True})[0] == good
    with pytest.raises(ValueError, match="--a-newer-flag: checkpoint False, this run True"):
        checkpoint.resolve_resume(good, None, newer, defaults={"a_newer_flag": False})
    bad = tmp_path / "iter_000009"
    shutil.copytree(good, bad)
    (bad / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{bad}/meta.json is corrupt"):
        checkpoint.resolve_resume(str(bad), None, fp)
    meta = json.loads(open(os.path.join(good, "meta.json")).read())
    for missing in ("manifest", "loop.iteration"):  # written by something else: named, not a KeyError
        part, _, key = missing.rpartition(".")
        broken = json.loads(json.dumps(meta))
        del (broken[part] if part else broken)[key]
        (bad / "meta.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=f"meta.json lacks {missing}: not a checkpoint written by"):
            checkpoint.resolve_resume(str(bad), None, fp)
    os.remove(bad / "meta.json")
    with pytest.raises(ValueError, match="incomplete"):
        checkpoint.resolve_resume(str(bad), None, fp)
    shutil.copy(os.path.join(good, "meta.json"), bad / "meta.json")
    # What flowgrpo.main checks first, before it builds anything (the CLI's line for such a refusal: the pickle test).
    with pytest.raises(ValueError, match="--lora-rank: checkpoint 8, this run 4"):
        startup.check_args(cli.parse_args(flowgrpo.Args, [*SMALL, "--lora-rank", "4", "--resume", good]))
    with pytest.raises(ValueError, match="--iterations 2 leaves nothing to train after"):  # it ends iteration 1
        startup.check_args(cli.parse_args(flowgrpo.Args, [*SMALL, "--iterations", "2", "--resume", good]))


def resume_args(ckpt):
    return cli.parse_args(flowgrpo.Args, [*SMALL, "--iterations", "3", "--resume", str(ckpt)])


def test_a_checkpoint_file_swapped_for_a_pickle_is_refused_before_it_is_read(straight, tmp_path):
    """DCP unpickles dcp/.metadata and non-tensor values: a file replaced by a pickle whose loading would create a
    marker file must be refused by the manifest check, naming the file, and the marker must never appear. Each file
    through what flowgrpo.main checks first (check_args); the first also through the CLI, its whole start."""
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    for victim in ("dcp/.metadata", "rng_rank0.safetensors", "dcp/__0_0.distcp"):
        bad = tmp_path / victim.replace("/", "_") / "iter_000001"
        shutil.copytree(os.path.join(straight, "checkpoints", "iter_000001"), bad)
        with open(bad / victim, "wb") as f:
            pickle.dump(Payload(), f)
        swapped = f"{bad}/{victim} differs from its SHA-256 in the manifest"
        if victim == "dcp/.metadata":
            out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--iterations", "3",
                                  "--resume", str(bad), "--run-dir", str(tmp_path / "r")], cwd=ROOT, env=ENV,
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode != 0 and swapped in out.stderr.splitlines()[-1], out.stderr[-2000:]
            assert "batch arithmetic" not in out.stdout  # refused before anything was built
        with pytest.raises(ValueError, match=re.escape(swapped)):
            startup.check_args(resume_args(bad))
        assert not marker.exists()
        os.remove(bad / victim)  # a missing file is named too, not skipped
        with pytest.raises(ValueError, match=re.escape(f"{bad}/{victim} is missing")):
            startup.check_args(resume_args(bad))


# ---- the variants together keep the guarantees: on-policy, 1 vs 2 ranks, exact resume ----------------
VARIANTS = ["--num-steps", "6", "--window", "2", "--window-range", "0", "4", "--branch", "--ema-decay", "0.9",
            "--ema-every", "2", "--ema-repeat", "2", "--guard", "full"]


def one_two_resumed(tmp_path, *flags):
    """2 iterations in 1 process, on 2 ranks, and resumed from the first's checkpoint of iteration 0 (into a
    directory of its own), with `flags`; checks what every configuration keeps: each first update exactly on-policy,
    2 ranks as 1 process (the tolerance and reason of test_two_ranks_match_one_process), and resume bit for bit (LoRA,
    DCP state, metrics). Returns the run dirs."""
    runs = {name: tmp_path / name for name in ("one", "two", "resumed")}
    train(runs["one"], "--iterations", "2", *flags)
    launch(runs["two"], "--iterations", "2", *flags, ranks=2)
    train(runs["resumed"], "--iterations", "2", "--resume", runs["one"] / "checkpoints" / "iter_000000", *flags)
    assert all(r["train/logp_gap"] == 0 for run in runs.values() for r in rows(run))
    assert rows(runs["one"])[0]["reward/mean"] == rows(runs["two"])[0]["reward/mean"]
    rel, worst = relative_difference(lora(runs["one"]), lora(runs["two"]))
    assert rel < 1e-3, f"LoRA: 1 vs 2 ranks differ by {rel:.3g} relative (max |Δ| {worst:.3g}) with {flags}"
    assert_same(lora(runs["one"]), lora(runs["resumed"]), exact=True)
    assert_same(train_state(runs["one"], "iter_000001", tmp_path), train_state(runs["resumed"], "iter_000001", tmp_path),
                exact=True)
    assert [without_perf(r) for r in rows(runs["resumed"])] == [without_perf(r) for r in rows(runs["one"])]
    return runs


def test_variants_together_keep_on_policy_rank_invariance_and_exact_resume(tmp_path):
    """--branch --ema-decay 0.9 --ema-repeat 2 --guard full together keep the guarantees, the EMA included (it is in
    the checkpoint's DCP state, resumes exactly, and is what <run-dir>/lora exports)."""
    runs = one_two_resumed(tmp_path, *VARIANTS)
    saved = flat(train_state(runs["one"], "iter_000001", tmp_path))
    assert any(k.startswith("ema.") for k in saved)
    # The exported LoRA is the EMA, not the trained weights (the two differ after 4 optimizer steps).
    exported = lora(runs["one"], "iter_000001")
    for name in ("transformer_blocks.0.attn.to_q.lora_B", "transformer_blocks.1.img_mlp.net.2.lora_A"):
        ema, trained = saved[f"ema.{name}.default.weight"], saved[f"model.{name}.default.weight"]
        assert torch.equal(exported[f"transformer.{name}.weight"], ema), name
        assert not torch.equal(ema, trained), name


def test_flux_two_ranks_match_one_process_and_resume_exactly(tmp_path):
    """A second model family through the same engine (only the adapter's block list differs): FLUX's tiny recipe,
    its guidance embedding on, with DanceGRPO's EMA and Flow-DPPO's trust region (at threshold 0 its mask acts on
    every pair whose ratio moved with its advantage: in the second optimizer step of each iteration)."""
    runs = one_two_resumed(tmp_path, "--model", "tiny-flux", "--ema-decay", "0.995", "--ema-every", "2", "--ema-form",
                           "dance", "--trust-region", "dppo", "--dppo-threshold", "0")  # after SMALL's `--model
    # tiny`: the last one picks the recipe
    masked = [r["train/clipfrac"] for r in rows(runs["one"])]
    print(f"\nFlow-DPPO's mask, the fraction of pairs removed per iteration: {masked}")
    assert all(0 < m <= 0.5 for m in masked), f"Flow-DPPO's mask should act in the second optimizer step: {masked}"


# ---- a run directory belongs to one run ------------------------------------------------------------
def test_run_directories_never_mix_runs(straight, two_ranks, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)  # a run of 2 iterations, a checkpoint after each
    # A new run into it is refused before anything is built: it would prune the old run's checkpoints, append to
    # its metrics and become what --resume auto picks. (The CLI's line for a refusal: the pickle test.)
    capsys.readouterr()
    with pytest.raises(ValueError, match=f"--run-dir {run} already holds a run: continue it with --resume auto --run-dir {run} with this run's flags"):
        train(run)
    assert "batch arithmetic" not in capsys.readouterr().out
    assert [r["iteration"] for r in rows(run)] == [0, 1]
    # A link to another run's checkpoint is not this run's: never pruned, never resumed from, no error.
    os.symlink(os.path.join(two_ranks, "checkpoints", "iter_000001"), run / "checkpoints" / "iter_000001.link")
    # A crash cut the last metrics line; a row was logged after the last checkpoint.
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines + [lines[-1].replace('"iteration": 1', '"iteration": 2'),
                                                          lines[-1][:40]]))
    train(run, "--iterations", "3", "--keep-checkpoints", "1", "--resume", "auto")
    said = capsys.readouterr().out
    assert "dropped its last line, cut off by the interrupted run" in said
    assert "dropped 1 row(s) logged after the checkpoint (iteration 1)" in said
    assert [r["iteration"] for r in rows(run)] == [0, 1, 2]
    assert sorted(os.listdir(run / "checkpoints")) == ["iter_000001.link", "iter_000002"]
    assert (two_ranks / "checkpoints" / "iter_000001" / "meta.json").exists()
    # A different seed would silently break exactness: refused (by what main checks first), naming the flag; allowed
    # only when named, and logged.
    with pytest.raises(ValueError, match="--seed: checkpoint 3, this run 4.*--allow-change"):
        startup.check_args(cli.parse_args(flowgrpo.Args, [*SMALL, "--run-dir", str(run), "--resume", "auto",
                                                          "--iterations", "4", "--seed", "4"]))
    # Resuming into a new directory branches the run there: the old directory is left as it was.
    branch = tmp_path / "branch"
    train(branch, "--iterations", "4", "--resume", run / "checkpoints" / "iter_000002", "--seed", "4",
          "--allow-change", "seed")
    assert [r["iteration"] for r in rows(branch)] == [0, 1, 2, 3] and [r["iteration"] for r in rows(run)] == [0, 1, 2]
    resumes = json.loads((branch / "args.json").read_text())["resumes"]
    assert resumes[-1]["changed"] == {"seed": [3, 4]}
    # Another prompt set, of another size, where docs/scaling.md says --allow-change prompts takes it: before, refused
    # once the model was built ("the checkpoint's prompt sampler was over 40 prompts")
    (tmp_path / "five.txt").write_text("".join(f"a photo of thing {i}\n" for i in range(5)))
    other = tmp_path / "other-prompts"
    train(other, "--iterations", "4", "--resume", run / "checkpoints" / "iter_000002", "--prompts",
          tmp_path / "five.txt", "--allow-change", "prompts")
    assert [r["iteration"] for r in rows(other)] == [0, 1, 2, 3]


# `python -c EXITS '[status, ...]'`: engine imported once, then a child forked for each status (no thread runs yet)
# that ends through engine.exit_process, its stdout and stderr in files; prints [[exit code, stdout, stderr], ...].
EXITS = """
import atexit, json, os, sys, tempfile
import engine
ended = []
for status in json.loads(sys.argv[1]):
    out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        atexit.register(print, "teardown")
        print("out", end="")
        engine.exit_process(status)
    ended.append([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])])
    for f in (out, err):
        f.seek(0)
        ended[-1].append(f.read().decode())
print(json.dumps(ended))
"""
STATUSES = [(0, 0, ""), (3, 3, ""), ("flowgrpo.py: error: x", 1, "flowgrpo.py: error: x\n")]


@pytest.fixture(scope="module")
def exits():
    """{status: [exit code, stdout, stderr]} of a process ended by engine.exit_process(status)."""
    out = subprocess.run([sys.executable, "-c", EXITS, json.dumps([s for s, _, _ in STATUSES])], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(zip((s for s, _, _ in STATUSES), json.loads(out.stdout)))


@pytest.mark.parametrize("status,code,err", STATUSES)
def test_exit_process_ends_as_sys_exit_would_but_skips_the_teardown(exits, status, code, err):
    """flowgrpo.py leaves through engine.exit_process: the code and message of sys.exit(status), the output flushed,
    and no interpreter teardown (an atexit hook stands for it; a gloo thread can abort the process there)."""
    assert exits[status] == [code, "out", err], exits[status]


def test_a_signal_during_a_shadow_swap_leaves_the_trained_weights(monkeypatch):
    """Ctrl-C stops a rollout at once, and the loop then checkpoints and exports the weights it holds; DiffusionNFT's
    rollout runs on its old policy swapped in (engine.old_weights). A signal's handler runs as the call it arrived in
    returns: here, after each copy of the swap or its restore in turn. The trained weights are whole afterwards, bit
    for bit (before, a signal after the first parameter's copy left it the old policy's, and the run saved that)."""
    from ema import OldPolicy
    params = [torch.nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    old = OldPolicy([(f"p{i}", p) for i, p in enumerate(params)])
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # trained on: the old policy differs from every weight
    trained, copies, at = [p.detach().clone() for p in params], [], [0]

    def interrupted(copy):
        def copy_then_signal(*args, **kwargs):
            result = copy(*args, **kwargs)
            copies.append(1)
            if len(copies) == at[0]:
                raise KeyboardInterrupt("SIGINT")
            return result
        return copy_then_signal
    monkeypatch.setattr(torch.Tensor, "copy_", interrupted(torch.Tensor.copy_))
    monkeypatch.setattr(torch, "_foreach_copy_", interrupted(torch._foreach_copy_))
    for at[0] in range(1, 8):  # 3 weights: at most 6 copies, the last round uninterrupted
        copies.clear()
        try:
            with old.swapped():
                assert all(torch.equal(p, s) for p, s in zip(params, old.shadow))  # within: the old policy's weights
        except KeyboardInterrupt:
            pass
        assert all(torch.equal(p, t) for p, t in zip(params, trained)), f"a signal after copy {at[0]} of the swap"


def test_full_finetune_steps_fp32_master_weights_of_a_model_loaded_in_bf16():
    """A GPU loads the model in bf16 (models_base), where --full-finetune's AdamW stepped the bf16 weights themselves:
    one step of lr 1e-5 moved 16% of weights of std 0.02, by 1.9e-6 on average (found by reading, 2026-12-07; the CPU
    runs load float32). The trained weights are float32 now, computed in bf16 as a LoRA is; one step moves them all."""
    pipe = models_qwen.build_tiny_qwen_pipeline(0)
    model = models_qwen.QwenImage(pipe.to(torch.bfloat16), "cpu", torch.bfloat16)
    trainer = engine_module.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=(), lr=1e-5, weight_decay=0,
                                   max_grad_norm=1e9, seed=0, full_finetune=True, mixed_precision=True)
    weights = [p for p in model.transformer.parameters() if p.requires_grad]
    assert {p.dtype for p in weights} == {torch.float32}
    before = [p.detach().full_tensor().clone() for p in weights]
    for p in weights:
        p.grad = torch.ones_like(p)
    trainer.step()
    moved = [(p.detach().full_tensor() != b).float().mean().item() for p, b in zip(weights, before)]
    assert min(moved) == 1.0, min(moved)


@pytest.mark.parametrize("flags,ranks", [(["--mixed-precision", "--offload", "--activation-checkpointing",
                                           "--shard-text-encoder", "--reuse-rollout-forward"], 2),
                                         (["--full-finetune", "--offload"], 1)])
def test_memory_options_train(flags, ranks, tmp_path):
    """bf16 mixed precision + CPU offload + activation checkpointing + a sharded text encoder under FSDP2
    (2 ranks), the first update on the rollout's kept forwards (their graphs' backward through FSDP2's hooks, after
    the other chunks' forwards); full fine-tuning with offloaded optimizer state. (`--compile` also ran here once,
    ~4 min on CPU: not part of the suite.)"""
    run = tmp_path / "run"
    if ranks == 1:
        train(run, "--iterations", "2", *flags)
    else:
        launch(run, "--iterations", "2", *flags, ranks=ranks)
    for r in rows(run):
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, float)), r
        assert r["train/grad_norm"] > 0 and r["train/skipped_steps"] == 0
    assert (run / "checkpoints" / "iter_000001" / "meta.json").exists()
    assert (run / "lora").exists() != ("--full-finetune" in flags)  # no adapter to export when all weights train


def compiled_rounds(a, blocks: int, *, reference: bool = False, **engine_flags) -> tuple[dict, list[torch.Tensor]]:
    """Two rounds on bench/host.py's deep narrow model of `blocks` blocks, its engine `make_engine(a, model,
    **engine_flags)`: a forward + backward and an optimizer step, then the rollout's forward on the new weights (and,
    with `reference`, the reference's: the adapter off) -> dynamo's graphs, breaks and frames over the rounds, and the
    forwards' outputs."""
    from torch._dynamo.utils import counters

    from bench.host import deep_narrow_model
    from bench.overhead import make_engine

    model = deep_narrow_model(blocks)
    engine = make_engine(a, model, **engine_flags)
    x = model.noise([torch.Generator().manual_seed(i) for i in range(2)], 32, 32)
    s, cond = torch.full((2,), 0.5), model.conditioning(["a sign that says hello"] * 2, " ", 1.0)
    torch._dynamo.reset()
    counters.clear()
    out = []
    for _ in range(2):
        model.transformer.train()
        model.velocity(x, s, cond, 1.0, 32, 32).float().square().mean().backward()
        engine.step()
        model.transformer.eval()
        with torch.no_grad():
            out.append(model.velocity(x, s, cond, 1.0, 32, 32).float())
            if reference:
                with engine.reference():
                    out.append(model.velocity(x, s, cond, 1.0, 32, 32).float())
    seen = {"graphs": counters["stats"]["unique_graphs"], "breaks": sum(counters["graph_break"].values()),
            "frames": counters["frames"]["total"]}
    return seen, out


def test_compile_traces_one_graph_for_every_block(monkeypatch):
    """--compile with the qwen-image recipe's bf16 compute and checkpointing: no graph break, and as many graphs at 6
    blocks as at 2 (one per call kind, reused by every block: before, a LoRA factor's working-copy check broke each
    block into pieces and recompiled per weight shape until dynamo's limit); after an optimizer step the compiled
    blocks read the new weights (their working copies are inputs, not constants): equal to the same engine in eager.
    (dynamo with aot_eager: its graphs and breaks are inductor's, without the C++ build, minutes on CPU.)"""
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend="aot_eager"))
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", lora_rank=4)
    shallow, _ = compiled_rounds(a, 2, compile=True)
    deep, compiled = compiled_rounds(a, 6, compile=True)
    _, eager = compiled_rounds(a, 6, compile=False)
    assert deep["breaks"] == 0 and deep == shallow, f"2 blocks: {shallow}; 6 blocks: {deep}"
    for c, e in zip(compiled, eager):
        assert (c - e).abs().max() <= 1e-2 * e.abs().max(), f"compiled vs eager: {(c - e).abs().max():.3g}"
    assert (compiled[1] - compiled[0]).abs().max() > 0  # the step moved the compiled model's output


def test_compiled_rollout_and_update_calls_round_alike_in_bf16():
    """--compile as a run compiles (inductor) with the qwen-image recipe's bf16 compute and checkpointing: the rollout's
    call (no grad) and the update's (grad, its graph saving for backward) give the same velocity to the bit, so each
    iteration's first update stays on-policy. Inductor's own rounding made them differ (`--model tiny --mixed-precision
    --compile`: train/logp_gap 1.1e-4, measured on CPU); engine.compile_blocks has it round as eager does."""
    from bench.host import deep_narrow_model
    from bench.overhead import make_engine

    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", lora_rank=4)
    model = deep_narrow_model(1)
    make_engine(a, model, compile=True)
    x = model.noise([torch.Generator().manual_seed(i) for i in range(2)], 32, 32)
    s, cond = torch.full((2,), 0.5), model.conditioning(["a sign that says hello"] * 2, " ", 1.0)
    model.transformer.eval()
    with torch.no_grad():
        rolled = model.velocity(x, s, cond, 1.0, 32, 32)
    model.transformer.train()
    # the update's forward graph, partitioned with what it saves for backward as it compiles; its backward compiles
    # at the first backward call and cannot change this velocity: not called (17 s of inductor's build on a CPU)
    trained = model.velocity(x, s, cond, 1.0, 32, 32)
    assert torch.equal(rolled, trained.detach()), f"rollout vs update: max |Δ| {(rolled - trained).abs().max():.3g}"
