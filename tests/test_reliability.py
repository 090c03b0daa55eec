"""The trainer under a second attack review: a run directory locked by its run, checkpoints that are only regular
files with a checked meta.json, resume branches and prompt sets, flag and knob bounds, SIGTERM and a full disk,
and what a run says when it cannot learn. Through the real CLI where the promise is the CLI's or the process's;
elsewhere flowgrpo.main or its first check (startup.check_args) in this process, without a process's ~10 s start."""
import dataclasses
import errno
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

import atomic_files
import checkpoint
import cli
import engine as eng
import flowgrpo
import rewards
import rundir
import runlog
import startup
from tiny_setup import main_here, raised_within, stop, tiny_setup

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")} | {
    "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
TINY = ["--model", "tiny", "--group-size", "2", "--prompts-per-iteration", "2", "--micro-batch", "2",
        "--eval-every", "0", "--no-wandb", "--seed", "5"]


def launch(*flags, wait=True, launcher=(sys.executable,), env=None):
    cmd = [*launcher, str(ROOT / "flowgrpo.py"), *TINY, *map(str, flags)]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=600)


def here(*flags) -> list[dict]:
    """`launch(*flags)` in this process (tiny_setup.main_here), raising what the CLI would say in a line; its rows."""
    return main_here(*TINY, *flags)


def iterations(run) -> list[int]:
    return [json.loads(line)["iteration"] for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


# ---- 1. a run directory is locked by its run --------------------------------------------------------------
def test_two_runs_started_at_once_into_one_new_run_dir_exactly_one_proceeds(tmp_path):
    """Before, both exited 0 and metrics.jsonl read iterations [0, 0, 1, 1]: a directory held a run only once an
    iteration was logged. The first to start claims it with an OS lock; the other is refused (naming the holder, or,
    if it starts after the first ended, the run the directory holds)."""
    run = tmp_path / "run"
    procs = [launch("--run-dir", run, "--iterations", 1, wait=False) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert sorted(p.returncode for p in procs) == [0, 1], [err[-2000:] for _, err in outs]
    refused = next(err for p, (_, err) in zip(procs, outs) if p.returncode)
    assert "is in use by the run on host" in refused or "already holds a run" in refused, refused[-2000:]
    assert iterations(run) == [0]


def test_a_held_run_dir_is_refused_at_once_naming_the_holder_and_freed_when_it_dies(tmp_path):
    run = tmp_path / "run"
    code = ("import sys, time, rundir\nrundir.lock_run_dir(sys.argv[1], True)\nprint('held', flush=True)\n"
            "time.sleep(900)")  # killed below
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        out = launch("--run-dir", run, "--iterations", 1)
        named = f"host {socket.gethostname()}, PID {holder.pid}"
        assert out.returncode == 1 and named in out.stderr, out.stderr[-2000:]
        assert "batch arithmetic" not in out.stdout  # refused before anything was built
    finally:
        holder.kill()  # a lock left by a dead process: released by the OS
        holder.wait()
    here("--run-dir", run, "--iterations", 1)  # raises what the CLI would say if refused
    assert iterations(run) == [0]


def test_temporary_names_are_unique_to_their_writer(tmp_path):
    """Two writers of one file used to share `<name>.tmp`; another writer's temporary is left alone now."""
    (tmp_path / "args.json.tmp").mkdir()  # another writer's temporary under the old shared name
    runlog._write(str(tmp_path / "args.json"), "{}")
    assert json.loads((tmp_path / "args.json").read_text()) == {} and (tmp_path / "args.json.tmp").is_dir()
    names = {atomic_files.temporary(str(tmp_path / "x")) for _ in range(100)}
    assert len(names) == 100 and all(f".tmp-{os.getpid()}-" in n for n in names)


def test_a_swap_cut_between_its_renames_keeps_the_directory_it_replaced(tmp_path, monkeypatch):
    """replace_dir moved the old <run>/lora aside under a temporary's name, then renamed the new one in: cut between
    the two renames, it left no lora, and the next export's clean-up deleted the one moved aside. That one is put back
    now; and, after a swap that completed, removed."""
    dst = str(tmp_path / "lora")

    def written(text: str) -> str:  # as engine.export_lora writes: under a temporary name beside dst
        os.makedirs(tmp := atomic_files.temporary(dst))
        Path(tmp, "w").write_text(text)
        return tmp
    atomic_files.replace_dir(written("old"), dst)
    rename, calls = os.rename, []

    def cut_at_the_second(a, b):
        calls.append(a)
        if len(calls) == 2:
            raise OSError(errno.EIO, "cut")
        rename(a, b)
    monkeypatch.setattr(os, "rename", cut_at_the_second)
    with pytest.raises(OSError, match="cut"):
        atomic_files.replace_dir(written("new"), dst)
    monkeypatch.undo()
    assert not os.path.exists(dst)
    atomic_files.remove_temporaries(str(tmp_path))  # what the next export does first
    assert os.listdir(tmp_path) == ["lora"] and Path(dst, "w").read_text() == "old"
    atomic_files.replace_dir(written("newer"), dst)
    assert os.listdir(tmp_path) == ["lora"] and Path(dst, "w").read_text() == "newer"
    Path(atomic_files.temporary(str(tmp_path / "metrics.jsonl"))).write_text("{")  # a file's write, interrupted
    atomic_files.remove_temporaries(str(tmp_path))  # before, rmtree skipped files: they stayed in the run directory
    assert os.listdir(tmp_path) == ["lora"], os.listdir(tmp_path)


def test_the_clean_up_of_a_run_directory_touches_only_the_names_it_makes(tmp_path):
    """A --run-dir may be a directory of the user's (one that holds no run is taken). Each export's clean-up deleted
    every `*.tmp-*` there and put back or deleted every `*.old-*`: a run into a folder holding `notes/` and
    `notes.old-2023/` deleted the latter, and `draft.tmp-1` went too. Only the names made here are touched now."""
    for name in ("notes", "notes.old-2023", "results.old-v1", "data.tmp-keep"):
        (tmp_path / name).mkdir()
    (tmp_path / "draft.tmp-1").write_text("mine")
    os.makedirs(atomic_files.temporary(str(tmp_path / "lora")))  # an export interrupted, and its swap cut:
    os.makedirs(f"{tmp_path / 'lora'}.old-{os.getpid()}-0123abcd")  # what replace_dir moved aside
    atomic_files.remove_temporaries(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["data.tmp-keep", "draft.tmp-1", "lora", "notes", "notes.old-2023",
                                           "results.old-v1"]


def test_a_link_into_another_runs_directory_is_inside_it(tmp_path):
    """`--run-dir A/checkpoints` was refused, but a link to it (or `L/../checkpoints`, which the OS resolves through
    the link) was taken: the two runs' clean-ups then deleted each other's files being written."""
    run = tmp_path / "A"
    (run / "checkpoints").mkdir(parents=True)
    (run / "args.json").write_text('{"run_id": "a"}')
    os.symlink(run / "checkpoints", tmp_path / "link")
    refused = rf"is inside the run directory {os.path.realpath(run)}: give a directory outside it$"
    for given in ("link", "link/sub", "link/../checkpoints"):
        with pytest.raises(ValueError, match=rf"^--run-dir \S+{given} {refused}"):
            try:
                rundir.claim_run_dir(str(tmp_path / given), "m", None, {}, {})
            finally:
                rundir.release_run_dirs()


def test_checkpoints_are_ordered_by_iteration_not_name(tmp_path):
    """Sorted by name, iter_1000000 came before iter_999999: pruning removed the checkpoint just written, and
    --resume auto and an interrupted run's last line named the older one."""
    root = tmp_path / "run" / "checkpoints"
    for it in (999_999, 1_000_000, 2):
        (root / f"{checkpoint.PREFIX}{it:06d}").mkdir(parents=True)
        (root / f"{checkpoint.PREFIX}{it:06d}" / "meta.json").write_text("{}")
    assert [checkpoint.iteration_of(p) for p in checkpoint.list_checkpoints(str(root))] == [2, 999_999, 1_000_000]
    rundir.lock_run_dir(str(tmp_path / "run"), False)
    try:
        assert "iter_1000000 (iteration 1000000): --resume auto" in rundir.interrupted()
    finally:
        rundir.release_run_dirs()


# ---- 3-5. checkpoints: regular files only, meta.json checked, resume branches, prompt sets ------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """3 iterations with a checkpoint after each, on a prompt file of its own."""
    root = tmp_path_factory.mktemp("trained")
    (root / "prompts.txt").write_text("".join(f"a photo of thing {i}\n" for i in range(6)))
    flags = ["--prompts", root / "prompts.txt", "--checkpoint-every", 1, "--keep-checkpoints", 3]
    here("--run-dir", root / "run", "--iterations", 3, *flags)
    return root / "run", [str(f) for f in flags]


def copy_checkpoint(trained, tmp_path, name="iter_000001") -> Path:
    copy = tmp_path / name
    shutil.copytree(trained[0] / "checkpoints" / "iter_000001", copy)
    return copy


def link_to_dev_zero(path: str) -> None:
    os.symlink("/dev/zero", path)


def test_a_fifo_or_a_link_to_dev_zero_in_a_checkpoint_is_refused_not_read(trained, tmp_path):
    """The manifest check and meta.json read every file with a plain open(): a FIFO hung --resume (45 s and
    counting), a link to /dev/zero spun on it (30 CPU-s). Now only regular files are opened, without blocking. Each
    through what flowgrpo.main checks first (check_args, in a thread: a hang fails); the first also through the CLI."""
    for victim, plant, needle in [
        ("rng_rank0.safetensors", os.mkfifo, "rng_rank0.safetensors is not a regular file (mode p"),
        ("dcp/.metadata", link_to_dev_zero, "dcp/.metadata is not a regular file (mode l"),
        ("meta.json", os.mkfifo, "meta.json is corrupt"),
    ]:
        bad = copy_checkpoint(trained, tmp_path / victim.replace("/", "_"))
        os.remove(bad / victim)
        plant(str(bad / victim))
        flags = ["--resume", bad, "--run-dir", tmp_path / "r", "--iterations", 4, *trained[1]]
        if victim == "rng_rank0.safetensors":
            out = launch(*flags)  # 600 s: a hang fails
            assert out.returncode == 1 and f"{bad}/{needle}" in out.stderr.splitlines()[-1], out.stderr[-2000:]
            assert "Traceback" not in out.stderr
        error = raised_within(startup.check_args, cli.parse_args(flowgrpo.Args, [*TINY, *map(str, flags)]),
                              seconds=120)
        assert isinstance(error, ValueError) and f"{bad}/{needle}" in str(error), error


def edit(directory: Path, change) -> None:
    meta = json.loads((directory / "meta.json").read_text())
    change(meta)
    (directory / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("change, needle", [
    (lambda m: m["loop"].update(iteration=2), "loop.iteration is 2, but the directory is named for iteration 1"),
    (lambda m: m["flags"].update(lr=0.5), "was edited after it was written"),  # would have bypassed --allow-change
    (lambda m: m.update(world_size=2), r"world_size is 2, but its manifest lists \['rng_rank0.safetensors'\]"),
    (lambda m: m["loop"].update(iteration="1"), "loop.iteration is '1': the wrong type or out of range"),
    (lambda m: m["loop"].update(skipped_steps=-1), "loop.skipped_steps is -1: the wrong type or out of range"),
    (lambda m: m.update(manifest=[]), r"manifest is \[\]: the wrong type or out of range"),
    (lambda m: m["loop"]["sampler"].pop("n"), "lacks loop.sampler.n"),
])
def test_meta_json_is_checked_field_by_field(trained, tmp_path, change, needle):
    """meta.json is outside the manifest: an iteration moved forward retrained later weights, a changed flags.lr
    bypassed --allow-change, a world size changed skipped the RNG restore, wrong types gave tracebacks. Each is
    refused now, in one line naming the field (or, for any other edit, meta.json's own SHA-256)."""
    bad = copy_checkpoint(trained, tmp_path)
    edit(bad, change)
    with pytest.raises(ValueError, match=rf"--resume: {bad}/meta.json.*{needle}"):
        checkpoint.resolve_resume(str(bad), None, {})


def test_resuming_an_older_checkpoint_in_place_sets_its_successors_aside(trained, tmp_path, capsys):
    """Resuming iteration 0's checkpoint in place, then `--resume auto`, used to continue the abandoned branch
    (iter_000002: metrics [0, 1, 3]). Its successors are moved aside now, kept, and said so."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    capsys.readouterr()
    here("--run-dir", run, "--resume", run / "checkpoints" / "iter_000000", "--iterations", 2, *trained[1])
    said = capsys.readouterr().out
    assert "iter_000001" in said and "iter_000002" in said and "set aside" in said, said
    aside = sorted(p.name.split(".")[0] for p in (run / "checkpoints").glob("*.abandoned-*"))
    assert aside == ["iter_000001", "iter_000002"]
    # 3 iterations: had auto picked the abandoned iter_000002, nothing would be left to train (refused)
    here("--run-dir", run, "--resume", "auto", "--iterations", 3, *trained[1])
    assert iterations(run) == [0, 1, 2]


def test_a_changed_prompt_file_is_named_on_resume(trained):
    """Same path, same count, other prompts: resumed without notice before. The checkpoint keeps their SHA-256."""
    run, flags = trained
    prompts = Path(flags[1])
    original = prompts.read_text()
    args = cli.parse_args(flowgrpo.Args, [*TINY, *flags, "--resume", str(run / "checkpoints" / "iter_000001"),
                                          "--iterations", "4"])
    try:
        prompts.write_text(original.replace("thing 3", "thing 33"))
        with pytest.raises(ValueError, match=r"--prompts .*prompts.txt: its training prompts differ from those of "):
            startup.check_args(args)
        assert startup.check_args(dataclasses.replace(args, allow_change=("prompts",)))  # named: allowed
    finally:
        prompts.write_text(original)
    assert startup.check_args(args)


def test_a_run_directory_given_to_resume_is_named_with_the_commands_that_resume_it(trained):
    """`--resume RUN_DIR` (or RUN_DIR/checkpoints) was refused as a checkpoint "interrupted while being written"."""
    run, flags = trained
    for given in (run, run / "checkpoints"):
        args = cli.parse_args(flowgrpo.Args, [*TINY, *flags, "--resume", str(given), "--iterations", "4"])
        with pytest.raises(ValueError) as e:
            startup.check_args(args)
        assert str(e.value) == (f"--resume {given} is a run's, not a checkpoint: --resume auto --run-dir {run} continues "
                                f"its newest, --resume {run}/checkpoints/iter_<n> another"), str(e.value)


# ---- 6. flags and prompt files ------------------------------------------------------------------------------
@pytest.mark.parametrize("change, needle", [
    (dict(eval_steps=1), r"--eval-steps must be in \[2, 1000\]"), (dict(lora_targets=()), "--lora-targets must name"),
    (dict(eval_images=1_000_000), r"--eval-images must be in \[0, 1024\]"), (dict(eval_steps=10**9), "--eval-steps"),
    (dict(lr=1e308), r"--lr must be in \[0, 1\]"), (dict(num_steps=10**9), "--num-steps"),
    (dict(model="tiny-flux", guidance=-1000.0, lora_targets=flowgrpo.RECIPES["tiny-flux"].lora_targets),
     r"--guidance must be in \[0, 100\]"),
])
def test_flags_out_of_any_sensible_range_are_refused_naming_them(change, needle):
    with pytest.raises(ValueError, match=needle):
        startup.check_args(dataclasses.replace(flowgrpo.RECIPES["tiny"], **change))


def test_a_deeply_nested_jsonl_and_a_fifo_prompt_file_are_named(tmp_path):
    """Both by what flowgrpo.main checks first, as a ValueError (the CLI's one line, no traceback)."""
    (tmp_path / "deep.jsonl").write_text('{"prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ValueError, match=r"deep.jsonl:1: not valid JSON \(nested too deep\)"):
        startup.check_args(dataclasses.replace(flowgrpo.RECIPES["tiny"], prompts=str(tmp_path / "deep.jsonl")))
    os.mkfifo(tmp_path / "fifo.txt")
    with pytest.raises(FileNotFoundError, match="fifo.txt is not a regular file"):
        startup.check_args(dataclasses.replace(flowgrpo.RECIPES["tiny"], prompts=str(tmp_path / "fifo.txt")))


# ---- 9. SIGTERM on every rank, and a full disk --------------------------------------------------------------
class HungRollout(BaseHTTPRequestHandler):
    """A vLLM-Omni server that is up (GET /health) and never answers a rollout request."""
    posted = threading.Event()

    def do_GET(self):  # vLLM-Omni's /health (and /v1/models, which start-up also asks: said, not checked)
        self.send_response(200)
        self.send_header("Content-Length", "21")
        self.end_headers()
        self.wfile.write(b'{"status": "healthy"}')

    def do_POST(self):
        self.posted.set()
        threading.Event().wait(120)  # bounded: the daemon thread ends by itself after the test

    def log_message(self, *args):
        pass


def test_sigterm_stops_every_rank_like_ctrl_c_and_removes_the_exchange_directory(tmp_path):
    """torchrun sends SIGTERM to every worker when one fails, and schedulers send it before a kill. There was no
    handler: the workers died where they stood and the `rollout-*` exchange directory (RAM, on /dev/shm) leaked."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), HungRollout)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    exchange = tmp_path / "shm"
    exchange.mkdir()
    trainer = launch("--run-dir", tmp_path / "run", "--optimizer-steps", 1, "--rollout", "vllm-omni", "--rollout-url",
                     f"http://127.0.0.1:{server.server_address[1]}", wait=False,
                     launcher=[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
                     env=ENV | {"FLOWGRPO_ROLLOUT_DIR": str(exchange), "FLOWGRPO_ROLLOUT_TIMEOUT": "600"})
    try:
        for _ in range(3000):  # 300 s
            if HungRollout.posted.wait(0.1) or trainer.poll() is not None:
                break
        assert HungRollout.posted.is_set(), trainer.communicate()[1][-3000:] if trainer.poll() is not None else "slow"
        assert [p.name for p in exchange.iterdir()][0].startswith("rollout-")
        _, err = stop(trainer, signal.SIGTERM)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        server.shutdown()
        server.server_close()
    # each rank stops through the Ctrl-C path (the exchange directory goes); rank 0 alone says so, once
    assert err.count("flowgrpo.py: interrupted") == 1, err[-3000:]
    assert list(exchange.iterdir()) == [], "the exchange directory was left behind"


# `python -c STOPPED_AT WHERE SIGNAL flowgrpo.py ...`: the script, sent SIGNAL by itself in its second iteration (1):
# as its rollout starts ("rollout": the weights are still iteration 0's), or after the first of its two optimizer
# steps ("update": the weights half-way between iterations 0 and 1), or as its advantages are computed ("advantages"),
# as a user's Ctrl-C or a scheduler's SIGTERM.
STOPPED_AT = """
import os, runpy, signal, sys
import algorithms, engine, offpolicy
where, sig = sys.argv[1], getattr(signal, sys.argv[2])
get, step, steps, advantages = offpolicy.Rollouts.get, engine.Engine.step, [], algorithms.advantages
def advantages_stopped(*args, **kwargs):
    if where == "advantages" and kwargs["batch"].iteration == 1:
        os.kill(os.getpid(), sig)
    return advantages(*args, **kwargs)
def get_stopped(self, it):
    if where == "rollout" and it == 1:
        os.kill(os.getpid(), sig)
    return get(self, it)
def step_stopped(self):
    steps.append(step(self))
    if where == "update" and len(steps) == 3:
        os.kill(os.getpid(), sig)
    return steps[-1]
offpolicy.Rollouts.get, engine.Engine.step, algorithms.advantages = get_stopped, step_stopped, advantages_stopped
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
STOP_RUN = ("--iterations", 3, "--checkpoint-every", 0)  # a checkpoint at the end only, unless stopped


@pytest.fixture(scope="module")
def unstopped(tmp_path_factory):
    run = tmp_path_factory.mktemp("unstopped") / "run"
    here(*STOP_RUN, "--run-dir", run)
    return run


@pytest.mark.parametrize("where,sig,kept", [("rollout", "SIGINT", 0), ("update", "SIGTERM", 1), ("advantages", "SIGINT", 1)])
def test_a_stopped_run_keeps_its_last_trained_iteration_and_resume_auto_continues_exactly(tmp_path, unstopped, where,
                                                                                           sig, kept):
    """Ctrl-C (SIGINT) as iteration 1's rollout starts: iteration 0's checkpoint is written on the way out. SIGTERM
    half-way through iteration 1's update, or Ctrl-C as its advantages are computed (which move GARDO's gate's
    controller: before, that state was saved with iteration 0's weights): the iteration finishes, is logged and
    checkpointed, then the run stops.
    Either way `--resume auto` ends on the weights and rows of a run never stopped, bit for bit. Before, both said
    "interrupted before any checkpoint was written: nothing to resume" and the iterations were lost."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", STOPPED_AT, where, sig, str(ROOT / "flowgrpo.py"), *TINY, *map(str, STOP_RUN),
           "--run-dir", str(run)]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    kept_dir = run / "checkpoints" / f"iter_{kept:06d}"
    again = shlex.join([*TINY, *map(str, STOP_RUN), "--resume", "auto", "--run-dir", str(run)])
    hint = out.stderr.strip().splitlines()[-1]  # the whole command, its --model too (`--resume auto` alone: tiny's)
    assert out.returncode == 1 and hint == (f"flowgrpo.py: interrupted; its newest checkpoint is {kept_dir} (iteration "
                                            f"{kept}): `python flowgrpo.py {again}` continues after it"), out.stderr[-3000:]
    assert [p.name for p in (run / "checkpoints").iterdir()] == [kept_dir.name] and checkpoint.verify_checkpoint(
        str(kept_dir))["loop"]["iteration"] == kept
    assert ("stopping once iteration 1 is trained and checkpointed" in out.stderr) == (where != "rollout")
    # the curve drawn from every row logged on the way out (before, as last drawn: redraws are rate-limited, and the
    # run's closing draw is not reached)
    assert os.stat(run / "reward_curve.png").st_mtime_ns >= os.stat(run / "metrics.jsonl").st_mtime_ns
    # its LoRA exported on the way out, as a finished run's (`python -m tasks.nano evaluate RUN` grades a stopped run):
    # that of a run of kept + 1 iterations (before, a stopped run had no lora/ to grade)
    assert f"LoRA of iteration {kept}: {run / 'lora'} (diffusers" in out.stdout, out.stdout[-2000:]
    here("--iterations", kept + 1, *STOP_RUN[2:], "--run-dir", tmp_path / "short")
    weights = [load_file(str(r / "lora" / "pytorch_lora_weights.safetensors")) for r in (run, tmp_path / "short")]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    main_here(*shlex.split(hint.split("`")[1])[2:])  # the command it names
    weights = [load_file(str(r / "lora" / "pytorch_lora_weights.safetensors")) for r in (run, unstopped)]
    assert weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    logged = [[{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
               for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (run, unstopped)]
    assert logged[0] == logged[1]


def test_a_full_disk_while_checkpointing_stops_in_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """In a private tmpfs of 4 MiB: the first checkpoint fits, the second does not. DCP raises CheckpointException,
    a BaseException, which escaped every handler into the interpreter's teardown; now one line names the disk."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("no private mount namespace here (unshare -m); the injected test below covers the path")
    disk, out_dir = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    script = ('mount -t tmpfs -o size=4m tmpfs "$1" || exit 99; shift; "$@"; status=$?; '
              f'cp -r {disk}/run {out_dir}; exit $status')
    out = launch("--run-dir", disk / "run", "--iterations", 20, "--checkpoint-every", 1, "--keep-checkpoints", 20,
                 launcher=["unshare", "-m", "sh", "-c", script, "sh", str(disk), sys.executable])
    if out.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr[-300:]}")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and "No space left on device" in lines[-1], out.stderr[-3000:]
    assert lines[-1].startswith("flowgrpo.py: error: checkpoint ") and f"the disk holding {disk}/run" in lines[-1]
    assert "Traceback" not in out.stderr
    done = checkpoint.list_checkpoints(str(out_dir / "checkpoints"))
    assert done and checkpoint.verify_checkpoint(done[-1])  # the previous one is intact
    assert not list((out_dir / "checkpoints").glob("*.tmp-*"))


def test_checkpoint_exceptions_become_a_line_or_an_interrupt(tmp_path, monkeypatch):
    """The same path without a tmpfs: DCP's CheckpointException wrapping a full disk, then wrapping Ctrl-C."""
    import engine as eng
    _, engine, _ = tiny_setup()
    meta = {"run_id": "r", "flags": {}, "loop": {"iteration": 0, "sampler": {"n": 1, "seed": 0}, "skipped_steps": 0,
                                                  "wandb_id": None, "prompts_sha256": ""}}
    root = tmp_path / "checkpoints"
    engine.save_checkpoint(str(root / "iter_000000"), meta, keep=2)
    for error, raised, needle in [(OSError(errno.ENOSPC, "No space left on device"), ValueError,
                                   "the disk holding .*: free space and continue"),  # a read-only mount: not "free space"
                                  (OSError(errno.EROFS, "Read-only file system"), ValueError,
                                   f"could not be written \\(Read-only file system\\) on {root}; .*: make it writable"),
                                  (KeyboardInterrupt(), KeyboardInterrupt, None)]:
        def full(*args, error=error, **kwargs):
            raise CheckpointException("save failed", {0: (error, None)})
        monkeypatch.setattr(eng.dcp, "save", full)
        with pytest.raises(raised, match=needle):
            engine.save_checkpoint(str(root / "iter_000001"), meta | {"loop": meta["loop"] | {"iteration": 1}}, keep=2)
        assert [p.name for p in root.iterdir()] == ["iter_000000"]  # intact, and no temporary left
    assert checkpoint.verify_checkpoint(str(root / "iter_000000"))["loop"]["iteration"] == 0
    # A kill while the oldest is pruned (here after its meta.json went): what it leaves goes at the next save. Before,
    # an iter_N without meta.json, which no listing saw and nothing removed.
    monkeypatch.undo()
    engine.save_checkpoint(str(root / "iter_000001"), meta | {"loop": meta["loop"] | {"iteration": 1}}, keep=2)

    def killed(path, *args, rmtree=shutil.rmtree, **kwargs):  # the pruned checkpoint's delete only
        if not os.path.basename(path).startswith("iter_000000"):
            return rmtree(path, *args, **kwargs)
        os.remove(os.path.join(path, "meta.json"))
        raise KeyboardInterrupt
    monkeypatch.setattr(eng.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(str(root / "iter_000002"), meta | {"loop": meta["loop"] | {"iteration": 2}}, keep=2)
    monkeypatch.undo()
    engine.save_checkpoint(str(root / "iter_000003"), meta | {"loop": meta["loop"] | {"iteration": 3}}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["iter_000002", "iter_000003"]


# ---- 11. what a run says when it cannot learn ---------------------------------------------------------------
def test_a_run_without_reward_spread_says_so_once(tmp_path, capsys):
    claim = runlog.Claim(str(tmp_path), "id", None, {"group_size": 8, "reward": "ocr"})
    log = runlog.RunLog(claim, enabled=True, use_wandb=False)
    for it in range(6):
        log.log({"iteration": it, "reward/mean": 0.0, "reward/std": 0.0, "reward/zero_std_ratio": 1.0})
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "for 3 iterations every group of 8 images got equal rewards" in err, err
    assert "--reward ocr does not tell these images apart" in err
    with pytest.raises(ValueError, match="the prompts of --prompts ocr are"):
        rewards.check_prompts_for_reward("ocr", ["a cat"])
