"""The checkpoint/resume path under an attack review: every value and size a checkpoint claims is bounded before
it is used (a world size of 10⁹ built ~100 bytes per claimed rank), names and sizes are checked before anything is
hashed (a sparse 64 GiB file was hashed for 150 s), meta.json's size before it is read (1 GiB read whole), the
directory walk has no recursion (1,500 nested directories: RecursionError), and a checkpoint without the old policy
or EMA a run keeps is refused up front (a grpo checkpoint resumed as nft: four tracebacks blaming the LoRA)."""
import dataclasses
import errno
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader

import algorithms
import atomic_files
import checkpoint
import engine as eng
import flowgrpo
import models
import prompts as prompt_sets
import rundir
import startup

ROOT = Path(__file__).resolve().parents[1]
TINY = dataclasses.replace(flowgrpo.RECIPES["tiny"], iterations=4)


def save(directory: Path, args, name: str = "iter_000000") -> str:
    """A checkpoint of a run with `args` after the iteration its `name` says, written by the engine as the loop
    writes one (after one optimizer step, so that AdamW has state), with the meta.json the loop writes; the run's
    newest kept."""
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_targets=args.lora_targets,
                        lr=args.lr, weight_decay=0, max_grad_norm=1.0, seed=0, ema_decay=args.ema_decay,
                        old_policy=algorithms.ALGORITHMS[args.algorithm].keeps_old)
    engine.step()
    train = prompt_sets.load_prompts(args.prompts).train
    loop = {"iteration": checkpoint.iteration_of(name), "skipped_steps": 0, "wandb_id": None,
            "sampler": prompt_sets.PromptSampler(len(train), args.seed).state_dict(),
            "prompts_sha256": checkpoint.json_sha256(train)}
    engine.save_checkpoint(str(directory / name), {"run_id": "r", "flags": startup.fingerprint(args), "loop": loop},
                           keep=1)
    return str(directory / name)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{algorithm: its checkpoint}: grpo's without an old policy, nft's with one."""
    root = tmp_path_factory.mktemp("saved")
    return {alg: save(root / alg, dataclasses.replace(TINY, algorithm=alg)) for alg in ("grpo", "nft")}


@pytest.fixture
def copy(saved, tmp_path) -> Path:
    shutil.copytree(saved["grpo"], tmp_path / "iter_000000")
    return tmp_path / "iter_000000"


def rewrite(directory: Path, change) -> None:
    """meta.json changed, its own SHA-256 redone (as an editor who knows the format would)."""
    meta = json.loads((directory / "meta.json").read_text())
    change(meta)
    meta["sha256"] = checkpoint.json_sha256({k: v for k, v in meta.items() if k != "sha256"})
    (directory / "meta.json").write_text(json.dumps(meta))


def capped(call: str, directory: Path) -> str:
    """`checkpoint.<call>(directory)` in a child process that may grow by at most 256 MiB beyond what importing
    checkpoint.py took (RLIMIT_DATA): what it raised, as `<type> <message>` (MemoryError where it built or read too
    much)."""
    code = ("import resource, sys, checkpoint\n"
            "used = int(next(l for l in open('/proc/self/status') if l.startswith('VmData')).split()[1]) << 10\n"
            "hard = resource.getrlimit(resource.RLIMIT_DATA)[1]\n"
            "resource.setrlimit(resource.RLIMIT_DATA, (used + (256 << 20), hard))\n"
            f"try:\n    checkpoint.{call}(sys.argv[1])\n    print('accepted')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code, str(directory)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    return out.stdout + out.stderr[-2000:]


# ---- 1. every value a checkpoint claims is bounded before it is used ----------------------------------------
def test_a_world_size_of_a_billion_is_refused_before_anything_is_built_per_rank(copy):
    """Before: --resume built a set of 10⁹ RNG file names (4 GB in 30 s and rising) to compare with the manifest.
    Now world_size is at most MAX_RANKS and is checked first: the child stays within 256 MiB."""
    rewrite(copy, lambda m: m.update(world_size=10**9))
    out = capped("read_checkpoint_meta", copy)
    assert out.startswith("ValueError") and "world_size is 1000000000: the wrong type or out of range (an integer " \
        f"in [1, {checkpoint.MAX_RANKS}])" in out, out


@pytest.mark.parametrize("field, change", [
    ("loop.iteration", lambda m: m["loop"].update(iteration=2**31)),
    ("loop.skipped_steps", lambda m: m["loop"].update(skipped_steps=10**30)),
    ("loop.sampler.n", lambda m: m["loop"]["sampler"].update(n=0)),
    ("loop.sampler.seed", lambda m: m["loop"]["sampler"].update(seed=2**32)),
])
def test_counts_out_of_range_are_refused_naming_the_field(copy, field, change):
    rewrite(copy, change)
    with pytest.raises(ValueError, match=rf"--resume: {copy}/meta.json: {field} is \d+: the wrong type or out of "
                                         r"range \(an integer in \["):
        checkpoint.read_checkpoint_meta(str(copy))


# ---- 2. sizes before contents -------------------------------------------------------------------------------
def test_a_1_gib_meta_json_is_refused_before_it_is_read(copy):
    """Before: read whole (1.8 GB of RSS) to fail as invalid JSON. Now its size is checked on the descriptor."""
    with open(copy / "meta.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: no disk used
    out = capped("read_checkpoint_meta", copy)
    assert out.startswith("ValueError") and "meta.json is corrupt (1073741824 bytes, more than the 4 MiB" in out, out


@pytest.mark.parametrize("victim, needle", [
    ("dcp/extra.distcp", "dcp/extra.distcp is not in the manifest"),  # not listed
    ("dcp/__0_0.distcp", r"dcp/__0_0.distcp differs from its SHA-256 in the manifest \(it has 68719476736 bytes, the "
                         r"manifest's file \d+\)"),  # listed, swapped
])
def test_a_sparse_64_gib_file_is_refused_before_any_file_is_hashed(copy, monkeypatch, victim, needle):
    """Before: every file was hashed, then names compared: 150 s on a sparse 64 GiB file not in the manifest.
    Now names and sizes (from the directory entries) come first, and nothing is hashed before the refusal."""
    with open(copy / victim, "ab") as f:
        f.truncate(64 << 30)

    def hashed(*args, **kwargs):
        raise AssertionError("a file was hashed before the names and sizes were checked")
    monkeypatch.setattr(checkpoint.hashlib, "file_digest", hashed)
    with pytest.raises(ValueError, match=rf"--resume: {copy}/{needle} \({copy}/meta.json\): the checkpoint was "
                                         "altered"):
        checkpoint.verify_checkpoint(str(copy))


def test_a_file_of_its_listed_size_but_other_bytes_is_still_refused_by_its_sha256(copy):
    path = copy / "rng_rank0.safetensors"
    path.write_bytes(bytes(path.stat().st_size))
    with pytest.raises(ValueError, match="rng_rank0.safetensors differs from its SHA-256 in the manifest"):
        checkpoint.verify_checkpoint(str(copy))


# ---- 3. the directory walk: bounded depth and entries, no recursion -----------------------------------------
def test_1500_nested_directories_are_refused_in_one_line(copy):
    """Before: a RecursionError out of os.walk in manifest(). Now an iterative walk refuses past MAX_DEPTH."""
    fd, made = os.open(copy / "dcp", os.O_RDONLY), 0
    try:
        while made < 1500:  # through descriptors: os.makedirs and shutil.rmtree recurse too
            os.mkdir("d", dir_fd=fd)
            fd, made = descend(fd, "d"), made + 1
        with pytest.raises(ValueError, match=rf"--resume: {copy}/dcp(/d)+ lies more than \d+ directories deep: not a "
                                             "checkpoint"):
            checkpoint.verify_checkpoint(str(copy))
    finally:
        for _ in range(made):
            fd = descend(fd, "..")
            os.rmdir("d", dir_fd=fd)
        os.close(fd)


def descend(fd: int, name: str) -> int:
    """The directory `name` under the open directory `fd`, opened; `fd` closed."""
    child = os.open(name, os.O_RDONLY, dir_fd=fd)
    os.close(fd)
    return child


def test_more_entries_than_the_bound_are_refused(copy, monkeypatch):
    """Before: any number of empty directories was walked, each one, and accepted (no file, so nothing to refuse).
    The bound is lowered here so that the test makes 20 directories rather than 32,769."""
    monkeypatch.setattr(checkpoint, "MAX_ENTRIES", 16, raising=False)
    for i in range(20):
        (copy / "lora" / f"empty{i}").mkdir()
    with pytest.raises(ValueError, match=f"--resume: {copy} holds more than 16 files and directories"):
        checkpoint.verify_checkpoint(str(copy))


def test_a_checkpoint_as_written_is_within_every_bound(saved):
    meta = checkpoint.verify_checkpoint(saved["nft"])
    assert meta["sizes"] == {k: os.path.getsize(os.path.join(saved["nft"], k)) for k in meta["manifest"]}
    assert os.path.getsize(os.path.join(saved["nft"], "meta.json")) < checkpoint.META_BYTES


# ---- 4. an algorithm or EMA change the checkpoint cannot serve ----------------------------------------------
@pytest.mark.parametrize("change, needle", [
    (dict(algorithm="nft"), r"--algorithm nft keeps an old policy, which .*iter_000000 \(--algorithm 'grpo'\) does "
                            "not hold: resume with its --algorithm or start anew"),
    (dict(algorithm="awm"), "--algorithm awm keeps an old policy"),
    (dict(ema_decay=0.9), r"--ema-decay 0.9 keeps an EMA, which .*iter_000000 \(--ema-decay 0\) does not hold"),
])
def test_a_shadow_the_checkpoint_lacks_is_refused_up_front(saved, change, needle):
    """Before: check_args passed, and the engine's strict dcp.load failed on the missing `old.*` (or `ema.*`) keys
    with four tracebacks saying the checkpoint was written by a different model/LoRA."""
    args = dataclasses.replace(TINY, **change, resume=saved["grpo"], allow_change=tuple(change))
    with pytest.raises(ValueError, match=needle):
        startup.check_args(args)


def test_an_nft_checkpoint_resumes_as_grpo_dropping_the_old_policy(saved):
    """The other direction is sound: grpo does not use the old policy; the weights and AdamW state carry over."""
    args = dataclasses.replace(TINY, resume=saved["nft"], allow_change=("algorithm",))
    assert startup.check_args(args)[1][0] == saved["nft"]  # (the prompts, (the checkpoint, its meta))
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha, lora_targets=args.lora_targets,
                        lr=args.lr, weight_decay=0, max_grad_norm=1.0, seed=0)
    assert engine.load_checkpoint(saved["nft"])["flags"]["algorithm"] == "nft"


def test_a_checkpoint_is_on_disk_before_it_is_named_and_named_before_the_last_one_goes(tmp_path, monkeypatch):
    """A power loss at any moment leaves a whole checkpoint (--keep-checkpoints 1 too): every file and directory of
    the new one is fsynced before the rename that names it, and that rename (its directory fsynced) before the
    previous checkpoint is removed. Before: the RNG state and the LoRA were renamed into place unsynced, and no
    directory was synced before the previous checkpoint was deleted."""
    root = os.path.realpath(tmp_path)
    save(Path(root), TINY)
    events, fsync, rename, rmtree = [], os.fsync, os.rename, shutil.rmtree
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b, **k: events.append(("rename", str(a), str(b))) or rename(a, b, **k))
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **k: events.append(("rmtree", str(p))) or rmtree(p, *a, **k))
    new = save(Path(root), TINY, "iter_000001")
    named = next(i for i, e in enumerate(events) if e[0] == "rename" and e[2] == new)
    tmp = events[named][1]
    tree = {str(p).replace(new, tmp, 1) for p in [Path(new), *Path(new).rglob("*")]}
    unsynced = tree - {e[1] for e in events[:named] if e[0] == "fsync"}
    assert not unsynced, f"{len(unsynced)} of {len(tree)} paths renamed into place unsynced: {sorted(unsynced)[:4]}"
    dir_synced = events.index(("fsync", root), named)
    # the previous one is renamed to a temporary name, then deleted (what a kill leaves there, the next save removes)
    going = next(i for i, e in enumerate(events) if e[:2] == ("rename", os.path.join(root, "iter_000000")))
    assert dir_synced < going < events.index(("rmtree", events[going][2])), events[named:]
    assert os.listdir(root) == ["iter_000001"]


def test_rng_states_resume_where_other_gpus_are_visible(tmp_path, monkeypatch):
    """A checkpoint written without a GPU, or with fewer, resumes on a machine with more (before: KeyError 'cuda0',
    after the model was built): the CPU's state is restored, and each GPU's that was saved where that GPU is."""
    checkpoint.save_rng_state(str(tmp_path / "cpu.safetensors"))
    cpu = torch.get_rng_state()
    save_file({"cpu": cpu, "cuda0": torch.full((16,), 7, dtype=torch.uint8)}, tmp_path / "one_gpu.safetensors")
    torch.rand(3)
    restored = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state.tolist())))
    checkpoint.load_rng_state(str(tmp_path / "cpu.safetensors"))
    assert restored == [] and torch.equal(torch.get_rng_state(), cpu)
    checkpoint.load_rng_state(str(tmp_path / "one_gpu.safetensors"))
    assert restored == [(0, [7] * 16)]


# ---- 5. a failure named for what failed, and nothing written lost -------------------------------------------
def test_an_older_checkpoint_that_cannot_be_pruned_is_named_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    """Pruning comes after the new checkpoint is renamed into place, whole. Before, a failure there (a file of an older
    checkpoint that another user owns, or that an NFS client holds open) stopped the run saying the new one "could not
    be written ... free space and continue with --resume auto", as if it were missing. Now one line says it was
    written, what could not be removed and why, and the run goes on; the next save removes what is left."""
    root = tmp_path / "checkpoints"
    save(root, TINY)
    rmtree = shutil.rmtree

    def denied(path, *args, **kwargs):  # the older checkpoint's delete, after its rename to a temporary name
        if os.path.basename(path).startswith("iter_000000.tmp-") and not kwargs.get("ignore_errors"):
            raise PermissionError(errno.EACCES, "Permission denied", os.path.join(path, "dcp", "__0_0.distcp"))
        return rmtree(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", denied)
    capsys.readouterr()
    save(root, TINY, "iter_000001")
    said = capsys.readouterr().err
    assert re.search(rf"^warning: checkpoint {root}/iter_000001 was written, but an older one could not be removed "
                     rf"\(\[Errno 13\] Permission denied: '{root}/iter_000000\.tmp-[^']+'\): the run goes on and the "
                     "next checkpoint tries again$", said, re.M), said
    monkeypatch.undo()
    assert checkpoint.list_checkpoints(str(root)) == [str(root / "iter_000001")]  # what --resume auto picks: whole
    assert checkpoint.verify_checkpoint(str(root / "iter_000001"))["loop"]["iteration"] == 1
    save(root, TINY, "iter_000002")  # what is left of the older one goes with the next save's clean-up
    assert os.listdir(root) == ["iter_000002"]


def test_a_checkpoint_its_run_prunes_while_this_run_loads_it_is_named_so(saved, tmp_path, monkeypatch):
    """--resume PATH --run-dir NEW of a run's checkpoint while that run still runs and prunes it (renamed, then
    deleted) during the load. Before: 25 lines of DCP's traceback ending "It was written by a different model/LoRA".
    Now one line: removed or changed while this run loaded it, and how to resume it. A real mismatch is still named."""
    source = tmp_path / "checkpoints" / "iter_000000"
    shutil.copytree(saved["grpo"], source)

    def pruned_by_its_run():  # what that run's engine.save_checkpoint does to an older checkpoint of its own
        gone = atomic_files.temporary(str(source))
        os.rename(source, gone)
        shutil.rmtree(gone)
    read = FileSystemReader.read_metadata
    monkeypatch.setattr(FileSystemReader, "read_metadata", lambda reader: (read(reader), pruned_by_its_run())[0])
    flags = dict(lora_alpha=TINY.lora_alpha, lora_targets=TINY.lora_targets, lr=TINY.lr, weight_decay=0,
                 max_grad_norm=1.0, seed=0)
    engine = eng.Engine(models.load_model("tiny", None, "cpu", seed=0), lora_rank=TINY.lora_rank, **flags)
    with pytest.raises(ValueError, match=rf"^--resume: {source} was removed or changed while this run loaded it \(the "
                                         r"run that wrote it prunes its older checkpoints\): copy it out of"):
        engine.load_checkpoint(str(source))
    monkeypatch.undo()
    other = eng.Engine(models.load_model("tiny", None, "cpu", seed=0), lora_rank=2 * TINY.lora_rank, **flags)
    with pytest.raises(RuntimeError, match="It was written by a different model/LoRA"):  # there, unchanged: the tensors
        other.load_checkpoint(saved["grpo"])


@pytest.mark.parametrize("text", ["null", "7", '["run_id"]'])
def test_an_args_json_that_is_no_object_is_no_run(tmp_path, text):
    """args.json is a common name: another tool's above --run-dir (null, a number) crashed the start with a TypeError,
    and a list holding "run_id" read as a run's, refusing the directory below it."""
    (tmp_path / "args.json").write_text(text)
    try:
        assert rundir.claim_run_dir(str(tmp_path / "run"), "m", None, {}, {}).run_dir == str(tmp_path / "run")
    finally:
        rundir.release_run_dirs()
