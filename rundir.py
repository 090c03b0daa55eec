"""A run directory belongs to one run: claimed on rank 0 before anything is built, locked (flock) for the life of the
process that claimed it, refused to a new run when it holds another, continued by a resumed one, and removed again if
a start fails before anything was written. The project's other tools (nano_compare.py) honour the same lock."""
import contextlib
import fcntl
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass


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
    try:
        if resumed is None:
            made, now = run_dir is None or not os.path.exists(run_dir), time.strftime("%Y%m%d-%H%M%S")
            run_dir = run_dir or _new_dir(os.path.join("runs", f"{safe_name(name)}-{now}"))
            lock_run_dir(run_dir, made)
            if _holds_run(run_dir):
                raise ValueError(f"--run-dir {run_dir} already holds a run: continue it with --resume auto --run-dir "
                                 f"{run_dir}, or give a new directory")
            run_id = uuid.uuid4().hex
            _LOCKS[-1]["claimed"] = True
            return Claim(run_dir, run_id, None, config | {"run_id": run_id, "resumes": []})
        source = os.path.dirname(os.path.dirname(os.path.abspath(resumed)))  # <run-dir>/checkpoints/iter_N
        run_dir = run_dir or source
        lock_run_dir(run_dir, not os.path.exists(run_dir))
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir}: cannot write there ({e.strerror}); give a writable directory") from e
    previous = _read_json(os.path.join(run_dir, "args.json"))
    if _holds_run(run_dir) and previous.get("run_id") != meta["run_id"]:
        raise ValueError(f"--run-dir {run_dir} holds another run than the one {resumed} belongs to: resume in "
                         f"{source} or in a new directory")
    _LOCKS[-1]["claimed"] = True
    own = os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
    changed = {k: [v, config[k]] for k, v in meta["flags"].items() if json.loads(json.dumps(config[k])) != v}
    history = previous.get("resumes", []) + [{"checkpoint": os.path.abspath(resumed), "changed": changed}]
    return Claim(run_dir, meta["run_id"], meta["loop"]["wandb_id"] if own else None,
                 config | {"run_id": meta["run_id"], "resumes": history},
                 os.path.join(run_dir if own else source, "metrics.jsonl"), meta["loop"]["iteration"])


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
            return json.load(f)
    except (OSError, ValueError):
        return {}


def interrupted() -> str:
    """What an interrupted run leaves, said by rank 0: its run directory's checkpoints, or that none was written."""
    run_dir = _LOCKS[-1]["run_dir"] if _LOCKS else None
    names = os.listdir(os.path.join(run_dir, "checkpoints")) if run_dir and os.path.isdir(
        os.path.join(run_dir, "checkpoints")) else []
    if any(n.startswith("iter_") and ".tmp" not in n for n in names):
        return (f"flowgrpo.py: interrupted; {run_dir}'s checkpoints are as last written (--resume auto --run-dir "
                f"{run_dir} continues)")
    return "flowgrpo.py: interrupted before any checkpoint was written: nothing to resume"
