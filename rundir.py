"""A run directory belongs to one run: claimed on rank 0 before anything is built, locked (flock) for the life of the
process that claimed it, refused to a new run when it holds another, continued by a resumed one, and removed again if
a start fails before anything was written. The project's other tools (tasks/nano_compare.py) honour the same lock. A run
stopped by Ctrl-C or SIGTERM keeps its last trained iteration there (Stop) and says what it left (interrupted)."""
import contextlib
import fcntl
import json
import os
import re
import shlex
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import checkpoint


@dataclass
class Claim:
    """A run directory claimed by claim_run_dir on rank 0, and what RunLog writes into it once training starts."""
    run_dir: str
    run_id: str
    wandb_id: str | None  # the wandb run to continue (a resume in place), else a new one
    args: dict  # args.json: the flags, the batch arithmetic, the run id and its resumes
    metrics: str | None = None  # a resumed run's metrics.jsonl: its rows up to `until` are continued
    until: int = -1  # the iteration of the checkpoint resumed from


def claim_run_dir(run_dir: str | None, name: str, resumed: str | None, meta: dict, config: dict) -> Claim:
    """The run directory made this run's, on rank 0, before anything is built: locked for the life of the process
    (lock_run_dir), and checked: a new run refuses a directory that holds a run; a run resumed from checkpoint
    `resumed` continues in its run directory (or a new one). Nothing is written but the lock (and a refused start puts
    the lock's line back as it found it): RunLog writes when training starts."""
    above = run_dir and _run_above(run_dir)
    if above:  # each run's clean-up of interrupted writes (atomic_files.remove_temporaries) would remove the other's
        raise ValueError(f"--run-dir {run_dir} is inside the run directory {above}: give a directory outside it")
    try:
        if resumed is None:
            made, now = run_dir is None or not os.path.exists(run_dir), time.strftime("%Y%m%d-%H%M%S")
            run_dir = run_dir or _new_dir(os.path.join("runs", f"{safe_name(name)}-{now}"))
            lock_run_dir(run_dir, made)
            if _holds_run(run_dir):
                raise ValueError(f"--run-dir {run_dir} already holds a run: continue it with {again(run_dir)}, or "
                                 "give a new directory")
            run_id = uuid.uuid4().hex
            _LOCKS[-1]["claimed"] = True
            return Claim(run_dir, run_id, None, config | {"run_id": run_id, "resumes": []})
        parent = os.path.dirname(os.path.abspath(resumed))  # <run-dir>/checkpoints/iter_N, or a copy elsewhere (None)
        source = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None
        if not (run_dir or source):
            raise ValueError(f"--resume {resumed}: a checkpoint outside a run directory's checkpoints/ folder (a copy) "
                             "names no run directory to continue in: give --run-dir")
        run_dir = run_dir or source
        lock_run_dir(run_dir, not os.path.exists(run_dir))
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir}: cannot write there ({e.strerror}); give a writable directory") from e
    previous = _read_json(os.path.join(run_dir, "args.json"))
    if _holds_run(run_dir) and previous.get("run_id") != meta["run_id"]:
        where = f"in {source} or in a new directory" if source else "in a new directory"
        raise ValueError(f"--run-dir {run_dir} holds another run than the one {resumed} belongs to: resume {where}")
    _LOCKS[-1]["claimed"] = True
    own = os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
    # A flag this version no longer has is recorded as changed to null (resolve_resume compares this run's flags only)
    changed = {k: [v, config.get(k)] for k, v in meta["flags"].items() if json.loads(json.dumps(config.get(k))) != v}
    history = previous.get("resumes", []) + [{"checkpoint": os.path.abspath(resumed), "changed": changed}]
    rows = run_dir if own else source  # the metrics to continue: here, else the checkpoint's run's (a copy: none)
    return Claim(run_dir, meta["run_id"], meta["loop"]["wandb_id"] if own else None,
                 config | {"run_id": meta["run_id"], "resumes": history},
                 os.path.join(rows, "metrics.jsonl") if rows else None, meta["loop"]["iteration"])


def safe_name(name: str) -> str:
    """A run directory's name from `<model>-<reward spec>`: weights dropped, terms joined by `+`, nothing a shell or
    a URL would have to quote ("nano-digit=1,digit_judge=0" -> "nano-digit+digit_judge")."""
    name = re.sub(r"=[-+.\deE]+(?=,|$)", "", name).replace(",", "+")
    return re.sub(r"[^\w.+-]+", "_", name)[:80]


_LOCKS = []  # the run directories this process holds: {fd, run_dir, made, previous (the lock's line), claimed}


def lock_run_dir(run_dir: str, made: bool) -> None:
    """Hold an OS lock (flock) on <run_dir>/.lock for as long as this process lives, its host and PID written in it:
    a second run into the directory is refused at once, naming them. The OS releases the lock of a process that ended,
    however it ended, so a crashed run's directory resumes. `made`: this start makes the directory."""
    path = os.path.join(run_dir, ".lock")
    while True:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = os.read(fd, 300).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"--run-dir {run_dir} is in use by {held}: wait for that run to end, or give another "
                             "directory") from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # not a lock file its last holder removed meanwhile
                break
        os.close(fd)
    previous = os.pread(fd, 300, 0)
    _write_line(fd, f"the run on host {socket.gethostname()}, PID {os.getpid()}, started {time.ctime()}\n".encode())
    _LOCKS.append({"fd": fd, "run_dir": run_dir, "made": made, "previous": previous, "claimed": False})


def _write_line(fd: int, line: bytes) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, line, 0)


def holder(run_dir: str) -> str | None:
    """Who holds run_dir's lock (its line), or None when no live process does (no lock file, or an ended holder's)."""
    try:
        fd = os.open(os.path.join(run_dir, ".lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted unless a live process holds it exclusively
        return None
    except BlockingIOError:
        return os.read(fd, 300).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)


def release_run_dirs() -> None:
    """Let go of this process's run directories; one in which nothing was written (a start that failed while
    loading weights) is removed with its lock if this process made it, so a failed start leaves nothing behind, and
    a refused start puts back the lock's line of the run the directory holds."""
    while _LOCKS:
        lock = _LOCKS.pop()
        with contextlib.suppress(OSError):
            if os.listdir(lock["run_dir"]) == [".lock"]:
                os.unlink(os.path.join(lock["run_dir"], ".lock"))
                if lock["made"]:
                    os.rmdir(lock["run_dir"])
            elif not lock["claimed"]:
                _write_line(lock["fd"], lock["previous"])
        os.close(lock["fd"])


def _holds_run(run_dir: str) -> bool:
    """A run that trained: a logged iteration or a checkpoint (one that failed while starting left no result)."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    checkpoints = os.path.join(run_dir, "checkpoints")
    logged = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    return logged or (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints)))


def _run_above(run_dir: str) -> str | None:
    """The nearest directory above run_dir that is a run's (an args.json with a run id), or None. (Not any locked one:
    a comparison's directory, locked while it runs (tasks/nano_compare.py), holds its runs.) Links and `..` resolved
    first: a link to another run's checkpoints/ is inside that run, wherever the link lies."""
    path = os.path.realpath(run_dir)
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        if "run_id" in _read_json(os.path.join(path, "args.json")):
            return path
    return None


def _new_dir(path: str) -> str:
    """path, or path-1, path-2, ..., made here (two runs started in the same second get different directories)."""
    for candidate in (path if i == 0 else f"{path}-{i}" for i in range(1000)):
        with contextlib.suppress(FileExistsError):
            os.makedirs(candidate)
            return candidate
    raise ValueError(f"{path}-*: a thousand run directories of this second already exist; give --run-dir")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}  # another tool's args.json (a list, null) is no run's


def finished(run_dir: str) -> bool:
    """Whether run_dir holds a run that trained its --iterations to the end and exported its LoRA (lora/ alone does
    not tell: a run stopped by Ctrl-C exports the LoRA of the iteration it last trained too, to be graded)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            last = json.loads(f.read().splitlines()[-1])["iteration"]
    except (OSError, IndexError, ValueError, KeyError, TypeError):  # none, empty, a line cut off, another tool's
        return False
    iterations = _read_json(os.path.join(run_dir, "args.json")).get("iterations")
    return last == (iterations or 0) - 1 and os.path.isdir(os.path.join(run_dir, "lora"))


def again(run_dir: str) -> str:
    """The command that continues the run in run_dir: this one's flags (its --model or --recipe and every change; the
    flags a checkpoint was written with are checked on resume) with `--resume auto --run-dir run_dir` for its own."""
    if os.path.basename(sys.argv[0]) != "flowgrpo.py":  # flowgrpo.main called in another program's process
        return f"--resume auto --run-dir {run_dir} with this run's flags"
    argv = sys.argv[1:]
    flags = [x for i, x in enumerate(argv) if x.split("=")[0] not in ("--resume", "--run-dir")
             and not (i and argv[i - 1] in ("--resume", "--run-dir"))]
    launcher = "torchrun ... flowgrpo.py" if "WORLD_SIZE" in os.environ else "python flowgrpo.py"
    return f"`{launcher} {shlex.join([*flags, '--resume', 'auto', '--run-dir', run_dir])}`"


def interrupted() -> str:
    """What an interrupted run leaves, said by rank 0: the newest checkpoint of its run directory, or that none was
    written."""
    run_dir = _LOCKS[-1]["run_dir"] if _LOCKS else None
    done = checkpoint.list_checkpoints(os.path.join(run_dir, "checkpoints")) if run_dir else []  # oldest first
    if done:
        return (f"flowgrpo.py: interrupted; its newest checkpoint is {done[-1]} (iteration "
                f"{checkpoint.iteration_of(done[-1])}): {again(run_dir)} continues after it")
    return "flowgrpo.py: interrupted before any checkpoint was written: nothing to resume"


class Stop:
    """Ctrl-C and SIGTERM in a run of one process keep the iteration last trained. Between `hold(it)` and `release()`
    (iteration it's update, evaluation and checkpoint: the weights are between two iterations' states) the first
    signal is noted, said, and acted on at `release()`: the iteration finishes and is checkpointed. Anywhere else it
    stops the run at once (the handler in force: engine.handle_signals), and the loop checkpoints the iteration last
    trained if it has no checkpoint yet (`keeps`). A second signal stops at once, keeping the checkpoints as written.
    Under torchrun nothing is held or written on the way out: a rank cannot tell that the others are alive to write
    with it (torchrun signals them all when one fails), and --checkpoint-every's checkpoints are what a run keeps."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()  # (signals: the main's)
        self.held, self.noted, self.it = False, None, -1
        self.previous = {s: signal.signal(s, self._note) for s in (signal.SIGINT, signal.SIGTERM)} if self.enabled \
            else {}

    def hold(self, it: int) -> None:
        self.held, self.it = self.enabled, it

    def _note(self, signum, frame):
        if self.noted or not self.held:
            raise KeyboardInterrupt(signal.Signals(signum).name)
        self.noted = signal.Signals(signum).name
        print(f"\nflowgrpo.py: {self.noted}: stopping once iteration {self.it} is trained and checkpointed (again: "
              "stop now, the checkpoints as written)", file=sys.stderr, flush=True)

    def release(self) -> None:
        self.held = False
        if self.noted:
            raise KeyboardInterrupt(self.noted)

    def keeps(self, done: int, saved: int) -> bool:
        """Whether the loop, stopped, writes iteration `done`'s checkpoint: one process, not stopped within an update,
        an iteration trained since the newest checkpoint `saved`."""
        return self.enabled and not self.held and done > saved

    def exports(self, done: int) -> bool:
        """Whether the loop, stopped, exports the LoRA of iteration `done`: one process, not stopped within an update
        (the weights are that iteration's), an iteration trained (this run's or its checkpoint's)."""
        return self.enabled and not self.held and done >= 0

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}


def said_once(status: int | str) -> int | str:
    """What this rank says as it ends. Every rank meets the same bad input, and torchrun stops the others once one
    ends, so a rank other than 0 holds its message back a while: rank 0 says it, torchrun stops this rank meanwhile
    (silently), and only a failure of this rank alone is said, after the wait, naming the rank. The wait is long (a
    minute) because on a loaded machine the ranks meet the same error seconds apart; a rank failing alone leaves the
    others blocked in a collective for longer than that anyway."""
    rank = int(os.environ.get("RANK", 0))
    if not isinstance(status, str) or rank == 0:
        return status
    try:
        time.sleep(60)
    except KeyboardInterrupt:  # torchrun's SIGTERM: another rank ended first and said why
        return 1
    return f"rank {rank}: {status}"
