"""engine.py at work through the real CLI: 1 process vs torchrun (2 ranks, and 2 "nodes"), exact resume,
a crash while writing a checkpoint, LoRA export into a fresh diffusers pipeline, and bad --resume input."""
import dataclasses
import json
import math
import os
import pickle
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
import flowgrpo
import models
import models_qwen
import startup
from tiny_setup import tiny_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 images per iteration: 4 micro-batches of 2 on one rank, 2 on each of two ranks.
SMALL = ["--model", "tiny", "--prompts-per-iteration", "2", "--group-size", "4", "--micro-batch", "2",
         "--optimizer-steps", "2", "--eval-every", "0", "--no-wandb", "--checkpoint-every", "2", "--seed", "3"]
ENV = os.environ | {"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `python -c SLOW_CHECKPOINTS flowgrpo.py ...`: the script with each checkpoint write paused 3 s after its DCP shards, a
# window for the crash test to kill it in.
SLOW_CHECKPOINTS = """
import runpy, sys, time
import checkpoint
save_rng_state = checkpoint.save_rng_state
def slowly(path):
    time.sleep(3)
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


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 iterations in one process, checkpoints after iterations 2 and 4."""
    run = tmp_path_factory.mktemp("straight")
    launch(run, "--iterations", "4")
    return run


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("two_ranks")
    launch(run, "--iterations", "4", ranks=2)
    return run


def test_two_ranks_match_one_process(straight, two_ranks):
    """Both launches run one thread per process (ENV), so each micro-batch's gradient is computed with the same kernels
    and only the sums differ (one process accumulates, two ranks reduce-scatter). AdamW's first steps are about
    lr·sign(g), so an element whose gradient is at rounding level can move by up to 2·lr between the two: elementwise
    tolerances measure luck. The LoRA is compared as a whole instead: measured 4e-7 relative (1.8e-6 max) after 4
    iterations; with unequal thread counts 2e-3; a 1% larger learning rate 4e-3; one optimizer step instead of two
    0.26. The tolerance, 1e-3, is far above rounding and below any real change to the update."""
    one, two = rows(straight), rows(two_ranks)
    assert [r["iteration"] for r in two] == [0, 1, 2, 3]
    assert one[0]["reward/mean"] == two[0]["reward/mean"]  # identical images before any update
    for a, b in zip(one, two):
        for key in ("reward/mean", "reward/std", "train/policy_loss", "train/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["iteration"], key, a[key], b[key])
        assert a["train/logp_gap"] == b["train/logp_gap"] == 0
    for ckpt in ("iter_000001", None):  # after 2 and after 4 iterations
        rel, worst = relative_difference(lora(straight, ckpt), lora(two_ranks, ckpt))
        assert rel < 1e-3, f"{ckpt or 'final'} LoRA: 1 vs 2 ranks differ by {rel:.3g} relative (max |Δ| {worst:.3g})"


def test_resume_is_exact_in_one_process(straight, tmp_path):
    run = tmp_path / "resumed"
    launch(run, "--iterations", "2")  # a run stopped after 2 of 4 iterations ...
    launch(run, "--iterations", "4", "--resume", "auto")  # ... and continued
    assert_same(lora(straight), lora(run), exact=True)
    assert_same(train_state(straight, "iter_000003", tmp_path), train_state(run, "iter_000003", tmp_path), exact=True)
    assert [without_perf(r) for r in rows(run)[2:]] == [without_perf(r) for r in rows(straight)[2:]]
    assert [r["iteration"] for r in rows(run)] == [0, 1, 2, 3]


def test_resume_with_two_ranks(two_ranks, tmp_path):
    run = tmp_path / "resumed2"
    launch(run, "--iterations", "2", ranks=2)
    launch(run, "--iterations", "4", "--resume", os.path.join(run, "checkpoints", "iter_000001"), ranks=2)
    assert_same(lora(two_ranks), lora(run), exact=True)  # the same two ranks, the same sums: bit for bit
    assert_same(train_state(two_ranks, "iter_000003", tmp_path), train_state(run, "iter_000003", tmp_path), exact=True)
    assert [without_perf(r) for r in rows(run)[2:]] == [without_perf(r) for r in rows(two_ranks)[2:]]


def test_two_nodes_on_one_machine_match_two_ranks(two_ranks, tmp_path):
    """Two torchrun launchers (--nnodes=2, one process each) meeting at a rendezvous on 127.0.0.1."""
    run, port = tmp_path / "nodes", free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                               f"--node-rank={i}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                               "--rdzv-id=flowgrpo-test", os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--run-dir",
                               str(run), "--iterations", "4"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert_same(lora(two_ranks), lora(run), exact=False, tol=1e-4)
    for a, b in zip(rows(two_ranks), rows(run)):
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], rel=1e-5)


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(straight, tmp_path):
    run, ckpts = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    proc = launch(run, "--iterations", "4", "--checkpoint-every", "1", wait=False,
                  launcher=[sys.executable, "-c", SLOW_CHECKPOINTS])
    deadline = time.time() + 300
    while not list(ckpts.glob("iter_000001.tmp-*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # mid-write of the second checkpoint
    proc.wait()
    assert list(ckpts.glob("iter_000001.tmp-*")) and not (ckpts / "iter_000001").exists()
    previous = str(ckpts / "iter_000000")
    fp = startup.fingerprint(startup.parse_args(flowgrpo.Args, SMALL))
    assert checkpoint.resolve_resume("auto", str(run), fp)[0] == previous
    launch(run, "--iterations", "4", "--checkpoint-every", "1", "--resume", "auto")
    assert_same(lora(straight), lora(run), exact=True)
    assert [r["iteration"] for r in rows(run)] == [0, 1, 2, 3]
    assert not list(ckpts.glob("*.tmp-*"))  # what the killed write left was removed: the directory is this run's


def test_exported_lora_loads_into_a_fresh_diffusers_pipeline(tmp_path):
    """Train one iteration in-process, export, load into a fresh pipeline: the same transformer output."""
    args = dataclasses.replace(flowgrpo.RECIPES["tiny"], prompts_per_iteration=1, group_size=4, micro_batch=4,
                               optimizer_steps=1)
    model, engine, batch = tiny_setup(lora_alpha=16)
    algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), False)
    engine.export_lora(str(tmp_path / "lora"))
    with safe_open(str(tmp_path / "lora" / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.lora_alpha"] == 16
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
    good = os.path.join(straight, "checkpoints", "iter_000003")
    fp = startup.fingerprint(startup.parse_args(flowgrpo.Args, SMALL))
    assert checkpoint.resolve_resume("auto", str(straight), fp)[0] == good
    with pytest.raises(FileNotFoundError, match="no checkpoint directory /no/such"):
        checkpoint.resolve_resume("/no/such", None, fp)
    with pytest.raises(ValueError, match="--lora-rank: checkpoint 8, this run 4"):
        checkpoint.resolve_resume(good, None, fp | {"lora_rank": 4})
    with pytest.raises(ValueError, match="--model: checkpoint 'tiny', this run 'qwen-image'"):
        checkpoint.resolve_resume(good, None, fp | {"model": "qwen-image"})
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
    out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--lora-rank", "4", "--resume",
                          good], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--lora-rank: checkpoint 8, this run 4" in out.stderr
    assert "batch arithmetic" not in out.stdout  # refused before anything was built
    out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--iterations", "4", "--resume",
                          good, "--run-dir", str(tmp_path / "r")], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)  # the checkpoint ends iteration 3: nothing left of 4 iterations
    assert out.returncode != 0 and "--iterations 4 leaves nothing to train after" in out.stderr, out.stderr[-2000:]


def resume_cli(ckpt, tmp_path, *flags):
    return subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--iterations", "5", "--resume",
                           str(ckpt), "--run-dir", str(tmp_path / "r"), *flags], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("victim", ["dcp/.metadata", "rng_rank0.safetensors", "dcp/__0_0.distcp"])
def test_a_checkpoint_file_swapped_for_a_pickle_is_refused_before_it_is_read(straight, tmp_path, victim):
    """DCP unpickles dcp/.metadata and non-tensor values: a file replaced by a pickle whose loading would create a
    marker file must be refused by the manifest check, naming the file, and the marker must never appear."""
    bad = tmp_path / "iter_000003"
    shutil.copytree(os.path.join(straight, "checkpoints", "iter_000003"), bad)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    with open(bad / victim, "wb") as f:
        pickle.dump(Payload(), f)
    out = resume_cli(bad, tmp_path)
    assert out.returncode != 0 and f"{bad}/{victim} differs from its SHA-256 in the manifest" in out.stderr, out.stderr[-2000:]
    assert not marker.exists()
    os.remove(bad / victim)  # a missing file is named too, not skipped
    out = resume_cli(bad, tmp_path)
    assert out.returncode != 0 and f"{bad}/{victim} is missing" in out.stderr, out.stderr[-2000:]
    assert "batch arithmetic" not in out.stdout  # both refused before anything was built


# ---- the variants together keep the guarantees: on-policy, 1 vs 2 ranks, exact resume ----------------
VARIANTS = ["--num-steps", "6", "--window", "2", "--window-range", "0", "4", "--branch", "--ema-decay", "0.9",
            "--ema-every", "2", "--ema-repeat", "2", "--guard", "full"]


def one_two_resumed(tmp_path, *flags):
    """4 iterations in 1 process, on 2 ranks, and as 2 + resume + 2, with `flags`; checks what every configuration
    keeps: each first update exactly on-policy, 2 ranks as 1 process (the tolerance and reason of
    test_two_ranks_match_one_process), and resume bit for bit (LoRA, DCP state, metrics). Returns the run dirs."""
    runs = {name: tmp_path / name for name in ("one", "two", "resumed")}
    launch(runs["one"], "--iterations", "4", *flags)
    launch(runs["two"], "--iterations", "4", *flags, ranks=2)
    launch(runs["resumed"], "--iterations", "2", *flags)
    launch(runs["resumed"], "--iterations", "4", "--resume", "auto", *flags)
    assert all(r["train/logp_gap"] == 0 for run in runs.values() for r in rows(run))
    assert rows(runs["one"])[0]["reward/mean"] == rows(runs["two"])[0]["reward/mean"]
    rel, worst = relative_difference(lora(runs["one"]), lora(runs["two"]))
    assert rel < 1e-3, f"LoRA: 1 vs 2 ranks differ by {rel:.3g} relative (max |Δ| {worst:.3g}) with {flags}"
    assert_same(lora(runs["one"]), lora(runs["resumed"]), exact=True)
    assert_same(train_state(runs["one"], "iter_000003", tmp_path), train_state(runs["resumed"], "iter_000003", tmp_path),
                exact=True)
    assert [without_perf(r) for r in rows(runs["resumed"])] == [without_perf(r) for r in rows(runs["one"])]
    return runs


def test_variants_together_keep_on_policy_rank_invariance_and_exact_resume(tmp_path):
    """--branch --ema-decay 0.9 --ema-repeat 2 --guard full together keep the guarantees, the EMA included (it is in
    the checkpoint's DCP state, resumes exactly, and is what <run-dir>/lora exports)."""
    runs = one_two_resumed(tmp_path, *VARIANTS)
    saved = flat(train_state(runs["one"], "iter_000003", tmp_path))
    assert any(k.startswith("ema.") for k in saved)
    # The exported LoRA is the EMA, not the trained weights (the two differ after 8 optimizer steps).
    exported = lora(runs["one"], "iter_000003")
    for name in ("transformer_blocks.0.attn.to_q.lora_B", "transformer_blocks.1.img_mlp.net.2.lora_A"):
        ema, trained = saved[f"ema.{name}.default.weight"], saved[f"model.{name}.default.weight"]
        assert torch.equal(exported[f"transformer.{name}.weight"], ema), name
        assert not torch.equal(ema, trained), name


def test_flux_two_ranks_match_one_process_and_resume_exactly(tmp_path):
    """A second model family through the same engine (only the adapter's block list differs): FLUX's tiny recipe,
    its guidance embedding on, with DanceGRPO's EMA."""
    one_two_resumed(tmp_path, "--model", "tiny-flux", "--ema-decay", "0.995", "--ema-every", "2", "--ema-form",
                    "dance")  # after SMALL's `--model tiny`: the last one picks the recipe; DanceGRPO's EMA


# ---- a run directory belongs to one run ------------------------------------------------------------
def test_run_directories_never_mix_runs(straight, tmp_path):
    run = tmp_path / "run"
    launch(run, "--iterations", "2", "--checkpoint-every", "1", "--keep-checkpoints", "1")
    # A new run into it is refused before anything is built: it would prune the old run's checkpoints, append to
    # its metrics and become what --resume auto picks.
    out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--run-dir", str(run)], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and f"--run-dir {run} already holds a run: continue it with --resume auto" in out.stderr
    assert [r["iteration"] for r in rows(run)] == [0, 1]
    # A link to another run's checkpoint is not this run's: never pruned, never resumed from, no error.
    os.symlink(os.path.join(straight, "checkpoints", "iter_000003"), run / "checkpoints" / "iter_000001.link")
    # A crash cut the last metrics line; a row was logged after the last checkpoint.
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines + [lines[-1].replace('"iteration": 1', '"iteration": 2'),
                                                          lines[-1][:40]]))
    out = launch(run, "--iterations", "3", "--checkpoint-every", "1", "--keep-checkpoints", "1", "--resume", "auto")
    assert "dropped its last line, cut off by the interrupted run" in out.stdout
    assert "dropped 1 row(s) logged after the checkpoint (iteration 1)" in out.stdout
    assert [r["iteration"] for r in rows(run)] == [0, 1, 2]
    assert sorted(os.listdir(run / "checkpoints")) == ["iter_000001.link", "iter_000002"]
    assert (straight / "checkpoints" / "iter_000003" / "meta.json").exists()
    # A different seed would silently break exactness: refused, naming the flag; allowed only when named, and logged.
    out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--run-dir", str(run), "--resume",
                          "auto", "--iterations", "4", "--seed", "4"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "--seed: checkpoint 3, this run 4" in out.stderr and "--allow-change" in out.stderr
    # Resuming into a new directory branches the run there: the old directory is left as it was.
    branch = tmp_path / "branch"
    launch(branch, "--iterations", "4", "--resume", str(run / "checkpoints" / "iter_000002"), "--seed", "4",
           "--allow-change", "seed")
    assert [r["iteration"] for r in rows(branch)] == [0, 1, 2, 3] and [r["iteration"] for r in rows(run)] == [0, 1, 2]
    resumes = json.loads((branch / "args.json").read_text())["resumes"]
    assert resumes[-1]["changed"] == {"seed": [3, 4]}


@pytest.mark.parametrize("status,code,err", [(0, 0, ""), (3, 3, ""), ("flowgrpo.py: error: x", 1, "flowgrpo.py: error: x\n")])
def test_exit_process_ends_as_sys_exit_would_but_skips_the_teardown(status, code, err):
    """flowgrpo.py leaves through engine.exit_process: the code and message of sys.exit(status), the output flushed,
    and no interpreter teardown (an atexit hook stands for it; a gloo thread can abort the process there)."""
    script = f"import atexit, engine; atexit.register(print, 'teardown'); print('out', end=''); engine.exit_process({status!r})"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (code, "out", err), out


@pytest.mark.parametrize("flags,ranks", [(["--mixed-precision", "--offload", "--activation-checkpointing",
                                           "--shard-text-encoder"], 2),
                                         (["--full-finetune", "--offload"], 1)])
def test_memory_options_train(flags, ranks, tmp_path):
    """bf16 mixed precision + CPU offload + activation checkpointing + a sharded text encoder under FSDP2
    (2 ranks); full fine-tuning with offloaded optimizer state. (`--compile` also ran here once, ~4 min on CPU: not part of the suite.)"""
    run = tmp_path / "run"
    launch(run, "--iterations", "2", *flags, ranks=ranks)
    for r in rows(run):
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, float)), r
        assert r["train/grad_norm"] > 0 and r["train/skipped_steps"] == 0
    assert (run / "checkpoints" / "iter_000001" / "meta.json").exists()
    assert (run / "lora").exists() != ("--full-finetune" in flags)  # no adapter to export when all weights train
