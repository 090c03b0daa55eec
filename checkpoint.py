"""What a checkpoint is on disk, and the checks that make it data rather than code.

    <run-dir>/checkpoints/iter_<n>/     written under a unique temporary name, renamed when complete (engine.py)
        dcp/                            trained weights, AdamW state (and EMA): torch.distributed.checkpoint, sharded
        rng_rank<r>.safetensors         each rank's torch RNG states
        lora/                           the adapter in diffusers' format
        meta.json                       run id, the flags that decide the result, the loop's state, world size, the
                                        SHA-256 and size of every other file (the manifest) and the SHA-256 of the
                                        rest of meta.json itself

torch's checkpoint format unpickles `dcp/.metadata` and non-tensor values, so a file swapped for a pickle would
run code: `resolve_resume` checks every file against the manifest before anything reads it, reading only regular
files (never a FIFO, a device or a link), and nothing before its size is bounded: meta.json's size, its fields'
ranges, the directory's names and sizes (a bounded walk that opens nothing), and only then the files' SHA-256. The
manifest and meta.json's own SHA-256 guard against damaged, swapped or hand-edited files, not against whoever
rewrites them all consistently: a checkpoint from someone else is code, to be trusted as such (docs/reliability.md).
"""
import errno
import glob
import hashlib
import json
import os
import re
import secrets
import shutil
import stat

import torch
from safetensors.torch import load_file, save_file

import atomic_files

PREFIX = "iter_"
# What a checkpoint may claim, bounded before anything is read or built from it. A rank's two files (RNG state, DCP
# shard) take ~270 bytes of meta.json: MAX_RANKS ranks fill ~2.2 MB, under META_BYTES, whose worst-case JSON parses
# into ~100 MB. Files lie one directory deep (dcp/, lora/): MAX_DEPTH and MAX_ENTRIES leave room around that.
MAX_RANKS, META_BYTES, MAX_DEPTH, MAX_ENTRIES = 8192, 4 << 20, 4, 4 * 8192
COUNT = range(2**31)  # iterations, skipped steps, prompts
# meta.json's fields and their types (a range: an int within it); every other field is the loop's (flowgrpo.py), the
# flags' (their names) or the prompt sampler's (prompts.py). Read back, each is checked before anything uses it.
SCHEMA = {"run_id": str, "flags": dict, "loop": dict, "world_size": range(1, MAX_RANKS + 1), "manifest": dict,
          "sizes": dict, "sha256": str, "loop.iteration": COUNT, "loop.sampler": dict, "loop.skipped_steps": COUNT,
          "loop.wandb_id": (str, type(None)), "loop.prompts_sha256": str, "loop.sampler.n": range(1, 2**31),
          "loop.sampler.seed": range(2**32)}


def save_rng_state(path: str) -> None:
    """torch's global RNG states (CPU and every GPU) as safetensors. Python's and NumPy's global generators are not
    saved: nothing here draws from them (windows, prompt order and noise have their own seeded generators)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    save_file({"cpu": torch.get_rng_state(), **{f"cuda{i}": s for i, s in enumerate(cuda)}}, path)


def load_rng_state(path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"--resume: {path} is missing: the checkpoint is incomplete; resume from another one")
    state = load_file(path)
    torch.set_rng_state(state["cpu"])
    for i in range(torch.cuda.device_count()):  # each GPU's saved state where it is: the writer may have had others
        if f"cuda{i}" in state:
            torch.cuda.set_rng_state(state[f"cuda{i}"], i)


def json_sha256(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def listing(directory: str) -> dict[str, int]:
    """{relative path: size} of every file under directory except meta.json (which holds the manifest), from the
    directory entries alone (nothing is opened): a walk without recursion, refused in one line past MAX_DEPTH
    directories or MAX_ENTRIES entries, or at anything but a regular file or a directory (a FIFO, a device, a link)."""
    out, todo, seen = {}, [("", 0)], 0
    while todo:
        rel, depth = todo.pop()
        with os.scandir(os.path.join(directory, rel)) as entries:
            for entry in entries:
                seen, name = seen + 1, os.path.join(rel, entry.name)
                info, path = entry.stat(follow_symlinks=False), os.path.join(directory, name)
                if seen > MAX_ENTRIES:
                    raise _not_a_checkpoint(f"{directory} holds more than {MAX_ENTRIES} files and directories")
                if stat.S_ISDIR(info.st_mode) and depth == MAX_DEPTH:
                    raise _not_a_checkpoint(f"{path} lies more than {MAX_DEPTH} directories deep")
                if stat.S_ISDIR(info.st_mode):
                    todo.append((name, depth + 1))
                elif not stat.S_ISREG(info.st_mode):
                    raise _not_a_checkpoint(f"{path} is not a regular file (mode {stat.filemode(info.st_mode)})")
                elif name != "meta.json":
                    out[name] = info.st_size
    return out


def _not_a_checkpoint(problem: str) -> ValueError:
    return ValueError(f"--resume: {problem}: not a checkpoint flowgrpo.py wrote; resume from another one")


def write_meta(directory: str, meta: dict) -> None:
    """meta.json of a complete checkpoint directory: `meta`, the manifest of its files and their sizes, and the
    SHA-256 of all of it."""
    sizes = listing(directory)
    meta = dict(meta, manifest=atomic_files.manifest(directory, sizes), sizes=sizes)
    with open(os.path.join(directory, "meta.json"), "w") as f:  # on disk with the rest before the rename (replace_dir)
        json.dump(dict(meta, sha256=json_sha256(meta)), f, indent=1)


def read_json(path: str, below: str | None = None):
    """The JSON of `path`, a regular file (atomic_files.open_regular) of at most META_BYTES, its size checked before
    it is read."""
    with atomic_files.open_regular(path, below) as f:
        size = os.fstat(f.fileno()).st_size
        if size > META_BYTES:
            raise ValueError(f"{size} bytes, more than the {META_BYTES >> 20} MiB a meta.json ever holds")
        return json.loads(f.read(META_BYTES + 1))


def write_error(e: BaseException, directory: str) -> BaseException:
    """What stops a run whose checkpoint `directory` could not be written: DCP wraps each rank's error, Ctrl-C and a
    full disk too, in a CheckpointException (a BaseException); a full disk is one line naming it."""
    errors = [e] + [f[0] for f in getattr(e, "failures", {}).values() if isinstance(f, tuple)]
    if any(isinstance(x, KeyboardInterrupt) for x in errors):
        return KeyboardInterrupt()
    os_errors = [x for x in errors if isinstance(x, OSError)]
    if not os_errors:
        return RuntimeError(f"checkpoint {directory} could not be written: {e}")
    root, full = os.path.dirname(directory), os_errors[0].errno in (errno.ENOSPC, errno.EDQUOT)
    disk = f"the disk holding {root} ({shutil.disk_usage(root).free / 2**20:.0f} MiB free)" if full else root
    fix = "free space" if full else "make it writable"  # (before: "free space" for a read-only mount too)
    return ValueError(f"checkpoint {directory} could not be written ({os_errors[0].strerror}) on {disk}; the previous "
                      f"checkpoints are intact: {fix} and continue with --resume auto")


def iteration_of(path: str) -> int | None:
    """n of a checkpoint directory named iter_<n>; None for any other name (a temporary, a set-aside one, a copy)."""
    m = re.fullmatch(PREFIX + r"(\d+)", os.path.basename(path))
    return int(m.group(1)) if m else None


def list_checkpoints(root: str, run_id: str | None = None) -> list[str]:
    """Complete checkpoints under root, oldest first (by iteration, not name: iter_1000000 follows iter_999999): real
    directories (not links) named iter_<n> with a meta.json; with run_id, only that run's (pruning never touches another
    run's)."""
    paths = [p for p in glob.glob(os.path.join(root, PREFIX + "*")) if iteration_of(p) is not None]
    done = [p for p in paths if not os.path.islink(p) and os.path.isfile(os.path.join(p, "meta.json"))]
    return sorted((p for p in done if run_id is None or _run_id_of(p) == run_id), key=iteration_of)


def set_aside_after(root: str, iteration: int) -> list[str]:
    """Rename the checkpoints under root later than `iteration` (a branch abandoned by resuming an earlier one) to
    names --resume auto never picks, keeping them; returns their new names."""
    moved = []
    for p in list_checkpoints(root):
        if iteration_of(p) > iteration:
            moved.append(f"{p}.abandoned-{secrets.token_hex(4)}")
            os.rename(p, moved[-1])
    return moved


def _run_id_of(directory: str) -> str | None:
    try:
        return read_json(os.path.join(directory, "meta.json")).get("run_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None


def read_checkpoint_meta(directory: str) -> dict:
    """meta.json of a checkpoint, with one line naming the field or file for a missing, incomplete, corrupt, foreign
    or edited one: its size (META_BYTES, before it is read), its schema (SCHEMA: types and ranges), its SHA-256, its
    iteration against the directory's name, its world size against the RNG files of its manifest."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isdir(directory):  # a typo'd iteration: the ones beside it named (the newest last)
        parent = os.path.dirname(os.path.normpath(directory))
        there = [os.path.basename(p) for p in list_checkpoints(parent)]
        held = f"; {parent} holds {', '.join(there[-5:])}" if there else ""
        raise FileNotFoundError(f"--resume: no checkpoint directory {directory}{held}")
    for needed in (path, os.path.join(directory, "dcp", ".metadata")):
        if not os.path.lexists(needed):
            raise ValueError(f"--resume: {directory} is incomplete ({needed} is missing): it was interrupted while "
                             "being written — resume from an earlier checkpoint")
    try:
        meta = read_json(path, directory)
    except (UnicodeDecodeError, RecursionError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"--resume: {path} is corrupt ({e})") from e
    for field, kind in SCHEMA.items():  # a field's parent comes before it
        *parents, key = field.split(".")
        part = meta
        for p in parents:
            part = part[p]
        if not isinstance(part, dict) or key not in part:
            raise ValueError(f"--resume: {path} lacks {field}: not a checkpoint written by this version of flowgrpo.py")
        value, bounds = part[key], kind if isinstance(kind, range) else None
        wrong = not isinstance(value, int if bounds else kind) or isinstance(value, bool)
        if wrong or (bounds and value not in bounds):
            expected = f" (an integer in [{bounds.start}, {bounds.stop - 1}])" if bounds else ""
            raise ValueError(f"--resume: {path}: {field} is {value!r:.40}: the wrong type or out of range{expected}; "
                             "the checkpoint is damaged")
    n = iteration_of(directory)
    if n is not None and n != meta["loop"]["iteration"]:
        raise ValueError(f"--resume: {path}: loop.iteration is {meta['loop']['iteration']}, but the directory is named "
                         f"for iteration {n}: the checkpoint was renamed or edited")
    ranks = {k for k in meta["manifest"] if re.fullmatch(r"rng_rank\d+\.safetensors", k)}
    if ranks != {f"rng_rank{r}.safetensors" for r in range(meta["world_size"])}:  # world_size <= MAX_RANKS
        raise ValueError(f"--resume: {path}: world_size is {meta['world_size']}, but its manifest lists "
                         f"{sorted(ranks)[:8]}: the checkpoint was edited")
    if meta["sha256"] != json_sha256({k: v for k, v in meta.items() if k != "sha256"}):
        raise ValueError(f"--resume: {path} was edited after it was written (its sha256 does not match its content): "
                         "resume from another checkpoint")
    return meta


def verify_checkpoint(directory: str) -> dict:
    """meta.json, after checking that every file of the checkpoint is exactly the one its manifest lists: DCP
    unpickles dcp/.metadata and non-tensor values, so a swapped file would run code. Names and sizes are compared
    before any file is read (a 64 GiB file, listed or not, is refused at once), then contents. Errors name the file."""
    meta = read_checkpoint_meta(directory)
    sizes, listed = listing(directory), meta["manifest"]
    for rel in sorted(sizes.keys() | listed.keys()):
        state = "is missing" if rel not in sizes else "is not in the manifest" if rel not in listed else None
        if not state and sizes[rel] != meta["sizes"].get(rel):
            state = f"differs from its SHA-256 in the manifest (it has {sizes[rel]} bytes, the manifest's file " \
                f"{meta['sizes'].get(rel)!r:.20})"
        if state:
            raise _altered(directory, rel, state)
    for rel, sha256 in atomic_files.manifest(directory, sizes).items():
        if sha256 != listed[rel]:
            raise _altered(directory, rel, "differs from its SHA-256 in the manifest")
    return meta


def _altered(directory: str, rel: str, state: str) -> ValueError:
    return ValueError(f"--resume: {os.path.join(directory, rel)} {state} ({os.path.join(directory, 'meta.json')}): "
                      "the checkpoint was altered or damaged; resume from another one")


def resolve_resume(resume: str, run_dir: str | None, flags: dict, may_change=(), defaults=None) -> tuple[str, dict]:
    """(checkpoint directory, its meta.json) for `--resume PATH|auto`, checked before anything is built: its files
    against its manifest, its flags against this run's `flags` but `may_change`, one it predates at its `defaults`'
    value (a new flag's default is the behaviour before it)."""
    if resume == "auto":
        if run_dir is None:
            raise ValueError("--resume auto needs --run-dir (the run whose newest checkpoint to continue)")
        found = list_checkpoints(os.path.join(run_dir, "checkpoints"))
        if not found:
            raise FileNotFoundError(f"--resume auto: no complete checkpoint in {os.path.join(run_dir, 'checkpoints')}")
        resume = found[-1]
    held = resume if os.path.basename(os.path.normpath(resume)) == "checkpoints" else os.path.join(resume, "checkpoints")
    if os.path.isdir(held):  # a run's directory, or its checkpoints/, given for one of its checkpoints
        run = os.path.dirname(os.path.normpath(held))
        raise ValueError(f"--resume {resume} is a run's, not a checkpoint: --resume auto --run-dir {run} continues its "
                         f"newest, --resume {os.path.join(held, PREFIX)}<n> another")
    meta = verify_checkpoint(resume)
    saved = {**(defaults or {}), **meta["flags"]}
    diff = {k: (saved.get(k), v) for k, v in flags.items() if saved.get(k) != v and k not in may_change}
    if diff:
        raise ValueError(f"--resume: {os.path.join(resume, 'meta.json')} was written with different flags, which would "
                         "break exact resumption: " + "; ".join(f"--{k.replace('_', '-')}: checkpoint {a!r}, this run "
                                                               f"{b!r}" for k, (a, b) in diff.items())
                         + " (use the checkpoint's values, or name the flags in --allow-change to change them)")
    return resume, meta
