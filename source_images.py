"""An edit prompt's source image (`"image"` in a .jsonl line: a path), read within bounds wherever it is read: at
start-up (`from_prompt_line` and its `check`, from prompts.py: nothing decoded; the ratio the run's) and wherever its
pixels are needed (`read`: the rewards and the judge that compare a result with it, nano-edit's judge, a run's grids).
One opener for both, so that a file swapped after start-up meets the same bounds where it is read: the path opened
without waiting (a FIFO is refused, not read from) as a regular file of at most MAX_BYTES; a PNG's chunks walked before
Pillow reads any, their text at most TEXT_BYTES (Pillow reads a text chunk whole before it checks its own limit: 3.5 GB
for one of 1 GiB); the image's format, size (at most SOURCE_PIXELS) and mode read from its header before a pixel is
decoded. `check` also gives the file's SHA-256, which a checkpoint's hash of its prompts covers, so that a source whose
pixels changed between a checkpoint and `--resume` is named."""
import hashlib
import os
import stat
import struct
from pathlib import Path

from PIL import Image, PngImagePlugin

SOURCE_PIXELS = 4096 * 4096  # the largest source image read (omni/pipeline_edit.py's servers take no larger)
MAX_BYTES = 2**27  # 128 MiB: a 4096² RGBA PNG stored without compression is 64 MiB
TEXT_BYTES = 2**16  # a PNG's text chunks and ICC profile, stored and inflated: as the reward server's PNG_TEXT
TEXT_CHUNKS = (b"tEXt", b"zTXt", b"iTXt", b"iCCP")
MAX_CHUNKS = 2**17  # a PNG's chunks walked (ours: a few; 8 KiB IDAT chunks of a 64 MiB image: 8192)
FORMATS = ("PNG", "JPEG")
# those PNG and JPEG have with 8 bits a channel (a 16-bit grey PNG's values over 255 turn white in RGB: refused)
MODES = ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr")
PNG = b"\x89PNG\r\n\x1a\n"
T = Image.Transpose  # _UPRIGHT: an EXIF orientation's transpose that shows a source upright, as viewers do
_UPRIGHT = {2: T.FLIP_LEFT_RIGHT, 3: T.ROTATE_180, 4: T.FLIP_TOP_BOTTOM, 5: T.TRANSPOSE, 6: T.ROTATE_270,
            7: T.TRANSVERSE, 8: T.ROTATE_90}
_CHECKED = {}  # (path, device, inode, size, modification time) -> check's answer


def _open(path: str):
    """`path` opened for reading as a regular file of at most MAX_BYTES, or ValueError saying what it is instead."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once, and is refused below
    except FileNotFoundError:
        raise ValueError("is missing") from None
    except (OSError, ValueError) as e:  # a name too long, a NUL byte, no permission, a loop of links
        raise ValueError(f"cannot be opened ({getattr(e, 'strerror', None) or e})") from None
    info = os.fstat(fd)
    problem = None if stat.S_ISREG(info.st_mode) else f"is not a regular file (mode {stat.filemode(info.st_mode)})"
    if not problem and info.st_size > MAX_BYTES:
        problem = f"is {info.st_size} bytes, more than {MAX_BYTES}"
    if problem:
        os.close(fd)
        raise ValueError(problem)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def check_png(f, max_chunks: int = MAX_CHUNKS) -> None:
    """A PNG's chunks walked from their headers (their data skipped, not read): ValueError if its text chunks hold more
    than TEXT_BYTES, it has more than `max_chunks` chunks (Pillow parses each in Python and keeps every unknown one:
    a million empty ones took 33 s and 222 MiB) or it ends before its IEND chunk. Anything but a PNG passes (Pillow
    reads the rest). Also the reward server's check of each image it is sent."""
    if f.read(8) == PNG:
        text = 0
        for n in range(max_chunks + 1):
            head = f.read(8)
            if head[4:] == b"IEND":
                break
            if len(head) < 8 or n == max_chunks:  # a partial copy: its header reads, its pixels fail only when decoded
                raise ValueError("is cut short: no IEND" if len(head) < 8 else f"has more than {max_chunks} PNG chunks")
            length = int.from_bytes(head[:4], "big")
            text += length if head[4:] in TEXT_CHUNKS else 0
            if text > TEXT_BYTES:
                raise ValueError(f"holds more than {TEXT_BYTES} bytes of PNG text chunks (tEXt, zTXt, iTXt, iCCP): "
                                 "save it without them")
            f.seek(length + 4, os.SEEK_CUR)  # the data and its CRC
    f.seek(0)


def _header(f) -> Image.Image:
    """The image of open file `f` with its header read and checked, its pixels not decoded."""
    check_png(f)
    PngImagePlugin.MAX_TEXT_CHUNK = PngImagePlugin.MAX_TEXT_MEMORY = TEXT_BYTES  # what Pillow inflates, as the server
    resize = "resize it (the edit models take a source at about a megapixel or less)"
    try:
        im = Image.open(f, formats=FORMATS)
    except Image.DecompressionBombError as e:  # Pillow's own refusal, from the header, past twice its 89 M pixels
        raise ValueError(f"has more than {SOURCE_PIXELS} pixels ({e}): {resize}") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ValueError(f"cannot be read as an image ({type(e).__name__}; PNG and JPEG are read): save it as a PNG") \
            from None
    w, h = im.size
    if w * h > SOURCE_PIXELS:
        raise ValueError(f"is {w}×{h}, more than {SOURCE_PIXELS} pixels: {resize}")
    if im.mode not in MODES:
        raise ValueError(f"has pixel mode {im.mode}, which is not one of {', '.join(MODES)}: save it as an 8-bit RGB "
                         "PNG")
    return im


def _orientation(im: Image.Image) -> int:
    """`im`'s EXIF orientation, from its header (1: as stored; 6: a phone's portrait photo, stored on its side)."""
    exif = Image.Exif()
    try:
        exif.load(im.info.get("exif") or b"")
        return exif.get(0x0112) if exif.get(0x0112) in _UPRIGHT else 1
    except (SyntaxError, ValueError, TypeError, struct.error):  # a corrupt EXIF: ignored, as viewers ignore it
        return 1


def check(path: str) -> tuple[int, int, str]:
    """(width, height, SHA-256 of the file) of source `path`, its pixels not decoded; ValueError saying what is wrong
    (the caller names the file and line). About 1.6 ms for a 1024² PNG of 2.4 MB, most of it the hash; a file
    unchanged since this process checked it (the same inode, size and modification time) is not read again: a run
    reads its prompt set twice as it starts (its check, then the loop)."""
    with _open(path) as f:
        info = os.fstat(f.fileno())
        key = (path, info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        if key not in _CHECKED:
            with _header(f) as im:
                f.seek(0)
                size = im.size[::-1] if _orientation(im) >= 5 else im.size  # 5 to 8 turn it a quarter: as shown
                _CHECKED[key] = (*size, hashlib.file_digest(f, "sha256").hexdigest())
        return _CHECKED[key]


def read(path: str, mode: str = "RGB") -> Image.Image:
    """Source `path` as pixels of `mode` (RGBA: Qwen-Image 2.1 keeps the alpha), through the same bounds as `check`;
    ValueError naming it (it was checked when the run started, so a problem here is a file changed since)."""
    try:
        with _open(path) as f, _header(f) as im:  # upright, as viewers show it and `check` measured it
            return (im.transpose(_UPRIGHT[_orientation(im)]) if _orientation(im) > 1 else im).convert(mode)
    except (OSError, ValueError, SyntaxError) as e:  # also a body that does not decode (truncated, corrupt)
        raise ValueError(f"source image {path} {e if isinstance(e, ValueError) else 'does not decode'}: it was "
                         "readable when the run started; was it changed since?") from None


def from_prompt_line(path: Path, n: int, name, size: tuple[int, int] | None) -> dict:
    """Line n of prompt file `path` (prompts.py reads it): its source image `name` as {"image": its absolute path,
    "image_sha256": its content's}, once `check` has read its header (nothing decoded) and its aspect ratio is the
    run's `size` (height, width): the edit model resizes it to the output size, so another ratio would distort. The
    content's hash is in the metadata so that the prompts' hash in a checkpoint covers it: `--resume` names a source
    changed since."""
    where = f"--prompts: {path}:{n}: source image"
    if not isinstance(name, str) or not 0 < len(name) <= 4096 or "\0" in name:
        raise ValueError(f'{where} must be a path of 1 to 4096 characters without NUL (relative to the prompt file), '
                         f"got {str(name)[:80]!r}{' (cut)' if len(str(name)) > 80 else ''}")
    file = os.path.join(path.parent.resolve(), name)
    try:
        w, h, digest = check(file)
    except ValueError as e:
        raise ValueError(f"{where} {name[:200]} {e} (paths are relative to the prompt file)") from None
    if size and w * size[0] != h * size[1]:
        raise ValueError(f"{where} {name} is {w}×{h}, not the run's aspect ratio (--width {size[1]} --height "
                         f"{size[0]}): crop it to {size[1]}:{size[0]}, or set --height/--width to its ratio")
    return {"image": os.path.realpath(file), "image_sha256": digest}
