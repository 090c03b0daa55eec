"""Files written atomically and read back as regular files. Each file or directory is written under a name of its
own (`temporary`) and renamed when complete, so a crash at any moment leaves the previous one whole and what it left
is known by its name (`remove_temporaries`); `replace_dir` puts the new tree on disk before the rename and the rename
before what it replaces is removed, so a power loss does not either. What is read back is opened only as a regular
file reached without a link (`open_regular`): a FIFO would block the reader, a link to /dev/zero never ends, a link
elsewhere reads a file this project never wrote. `manifest` hashes a directory's files, each opened so."""
import glob
import hashlib
import os
import secrets
import shutil
import stat

HEX8 = "[0-9a-f]" * 8  # the end of the names made here (`.tmp-<pid>-<hex>`): a run dir's `x.old-2023` is the user's


def temporary(path: str) -> str:
    """A name beside `path` for writing it: unique to this process and call, so no two writers ever share one."""
    return f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def _fsync(path: str, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: str) -> None:
    """fsync every file and directory under `path`, itself included: a rename published after it names data that is
    on disk. Without it the OS may write the rename first, and a power loss leave the new name over empty files."""
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root, os.O_DIRECTORY)


def replace_dir(src: str, dst: str) -> None:
    """Rename src to dst, src's files on disk first (sync_tree); an existing dst is moved aside first (to a name
    remove_temporaries puts back where a crash left no dst) and removed only after the swap is on disk (its directory
    synced), and so is what the caller removes after this returns."""
    sync_tree(src)
    old = f"{dst}.old-{os.getpid()}-{secrets.token_hex(4)}"
    if os.path.exists(dst):
        os.rename(dst, old)
    os.rename(src, dst)
    _fsync(os.path.dirname(dst) or ".", os.O_DIRECTORY)
    shutil.rmtree(old, ignore_errors=True)


def remove_temporaries(directory: str) -> None:
    """Delete the temporary directories (`temporary` names) interrupted writes left in `directory`, and put back what
    a replace_dir cut between its two renames had moved aside (or delete it, where the new one is in place): the run
    directory is locked by its run, so no other process is writing them."""
    for stale in glob.glob(os.path.join(glob.escape(directory), f"*.tmp-[0-9]*-{HEX8}")):
        if os.path.isdir(stale) and not os.path.islink(stale):
            shutil.rmtree(stale, ignore_errors=True)
        elif os.path.lexists(stale):  # a file's (runlog's args.json, metrics.jsonl), which rmtree skipped
            os.remove(stale)
    for old in glob.glob(os.path.join(glob.escape(directory), f"*.old-[0-9]*-{HEX8}")):
        dst = old.rpartition(".old-")[0]
        if os.path.exists(dst):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, dst)


def open_regular(path: str, below: str | None = None):
    """`path` opened for reading (binary) if it is a regular file, reached without following a symbolic link at it or
    at any directory beneath `below` (default: its own directory), opened without blocking and checked on the
    descriptor: a plain open of a FIFO waits for a writer, a link to /dev/zero never ends. FileNotFoundError if it is
    missing; a ValueError naming it if it is anything else."""
    below = below or os.path.dirname(path) or "."
    parts = os.path.relpath(path, below).split(os.sep)
    fd = os.open(below, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i, part in enumerate(parts):
            kind = os.O_NONBLOCK if i == len(parts) - 1 else os.O_DIRECTORY
            fd, parent = os.open(part, os.O_RDONLY | os.O_NOFOLLOW | kind, dir_fd=fd), fd
            os.close(parent)
    except OSError as e:
        os.close(fd)
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path} cannot be opened ({e.strerror}: a symbolic link on the way?)") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError(f"{path} is not a regular file (mode {stat.filemode(mode)})")
    return open(fd, "rb")


def manifest(directory: str, files) -> dict[str, str]:
    """{relative path: SHA-256} of `files` (relative paths) under directory, each opened as a regular file."""
    out = {}
    for rel in sorted(files):
        with open_regular(os.path.join(directory, rel), directory) as f:
            out[rel] = hashlib.file_digest(f, "sha256").hexdigest()
    return out
