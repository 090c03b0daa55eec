"""What a checkpoint is on disk, and the checks that make it data rather than code.

    <run-dir>/checkpoints/iter_<n>/     written as iter_<n>.tmp, renamed when complete (engine.save_checkpoint)
        dcp/                            trained weights, AdamW state (and EMA): torch.distributed.checkpoint, sharded
        rng_rank<r>.safetensors         each rank's torch RNG states
        lora/                           the adapter in diffusers' format
        meta.json                       run id, the flags that decide the result, the loop's state, world size, and
                                        the SHA-256 of every other file (the manifest)

torch's checkpoint format unpickles `dcp/.metadata` and non-tensor values, so a file swapped for a pickle would
run code: `resolve_resume` checks every file against the manifest before anything reads it. The manifest guards
against damaged or swapped files, not against whoever can rewrite meta.json too: a checkpoint from someone else
is code, to be trusted as such (README, "Reliability").
"""
import glob
import hashlib
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

PREFIX = "iter_"
META_KEYS = ("run_id", "flags", "loop", "world_size", "manifest")
LOOP_KEYS = ("iteration", "sampler", "skipped_steps", "wandb_id")


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
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state[f"cuda{i}"] for i in range(torch.cuda.device_count())])


def manifest(directory: str) -> dict[str, str]:
    """{relative path: SHA-256} of every file under directory except meta.json (which holds the manifest)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if rel != "meta.json":
                with open(path, "rb") as f:
                    out[rel] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def verify_checkpoint(directory: str) -> dict:
    """meta.json, after checking that every file of the checkpoint is exactly the one its manifest lists: DCP
    unpickles dcp/.metadata and non-tensor values, so a swapped file would run code. Errors name the file."""
    meta = read_checkpoint_meta(directory)
    found = manifest(directory)
    for rel in sorted(found.keys() | meta["manifest"].keys()):
        if found.get(rel) != meta["manifest"].get(rel):
            state = "is missing" if rel not in found else "is not in the manifest" if rel not in meta["manifest"] \
                else "differs from its SHA-256 in the manifest"
            raise ValueError(f"--resume: {os.path.join(directory, rel)} {state} ({os.path.join(directory, 'meta.json')})"
                             ": the checkpoint was altered or damaged; resume from another one")
    return meta


def replace_dir(src: str, dst: str) -> None:
    """Rename src to dst; an existing dst is moved aside first and removed only after the swap."""
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dst):
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: str, run_id: str | None = None) -> list[str]:
    """Complete checkpoints under root, oldest first: real directories (not links) with a meta.json (a `.tmp`
    directory is an interrupted write); with run_id, only that run's (pruning never touches another run's)."""
    paths = [p for p in glob.glob(os.path.join(root, PREFIX + "*")) if p[-4:] not in (".tmp", ".old")]
    done = [p for p in paths if not os.path.islink(p) and os.path.isfile(os.path.join(p, "meta.json"))]
    return sorted(p for p in done if run_id is None or _run_id_of(p) == run_id)


def _run_id_of(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def read_checkpoint_meta(directory: str) -> dict:
    """meta.json of a checkpoint, with a clear error for a missing, incomplete, corrupt or foreign one."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--resume: no checkpoint directory {directory}")
    for needed in (path, os.path.join(directory, "dcp", ".metadata")):
        if not os.path.exists(needed):
            raise ValueError(f"--resume: {directory} is incomplete ({needed} is missing): it was interrupted while being "
                             "written — resume from an earlier checkpoint")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume: {path} is corrupt ({e})") from e
    missing = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
    missing += [f"loop.{k}" for k in LOOP_KEYS if not missing and k not in meta["loop"]]
    if missing:
        raise ValueError(f"--resume: {path} lacks {', '.join(missing)}: not a checkpoint written by this version of "
                         "flowgrpo.py")
    return meta


def resolve_resume(resume: str, run_dir: str | None, flags: dict, may_change=()) -> tuple[str, dict]:
    """(checkpoint directory, its meta.json) for `--resume PATH|auto`, checked before anything is built: its files
    against its manifest, and its flags against this run's `flags` (those that decide the result), except the ones
    named in `may_change`."""
    if resume == "auto":
        if run_dir is None:
            raise ValueError("--resume auto needs --run-dir (the run whose newest checkpoint to continue)")
        found = list_checkpoints(os.path.join(run_dir, "checkpoints"))
        if not found:
            raise FileNotFoundError(f"--resume auto: no complete checkpoint in {os.path.join(run_dir, 'checkpoints')}")
        resume = found[-1]
    meta = verify_checkpoint(resume)
    saved = meta["flags"]
    diff = {k: (saved.get(k), v) for k, v in flags.items() if saved.get(k) != v and k not in may_change}
    if diff:
        raise ValueError(f"--resume: {os.path.join(resume, 'meta.json')} was written with different flags, which would "
                         "break exact resumption: " + "; ".join(f"--{k.replace('_', '-')}: checkpoint {a!r}, this run "
                                                               f"{b!r}" for k, (a, b) in diff.items())
                         + " (use the checkpoint's values, or name the flags in --allow-change to change them)")
    return resume, meta
