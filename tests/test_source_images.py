"""An edit set's source images (`"image"` in a .jsonl line) under attack: text chunks bounded before Pillow reads them,
hostile names and bad lines refused in one line naming file and line, start-up that decodes nothing and bounds and
shows a long set, every reader bounded where a source is read (a file swapped after start-up), and a source whose
pixels changed named on --resume. Through the CLI where the promise is its output; elsewhere through its first check
(startup.check_args) or the reader the loop calls."""
import base64
import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

import cli
import flowgrpo
import prompts as prompt_sets
import reward_server
import rewards
import runlog
import source_images
import startup
from test_edit import edit_prompts, write_png
from test_engine import ENV, ROOT
from tiny_setup import main_here, raised_within
from tasks import nano_edit

KONTEXT = flowgrpo.RECIPES["tiny-flux-kontext"]


def start(prompts: str, **change):
    """startup.check_args for tiny-flux-kontext on `prompts` (the CLI's first check); what it refused, or None."""
    refused = raised_within(startup.check_args, dataclasses.replace(KONTEXT, prompts=prompts, **change))
    assert refused is None or (isinstance(refused, ValueError) and "\n" not in str(refused)), refused
    return refused and str(refused)


def with_chunk(path, kind: bytes, data: bytes) -> None:
    """The PNG at `path` with a chunk of `kind` holding `data` inserted after its header chunk (IHDR)."""
    raw = open(path, "rb").read()
    chunk = struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    open(path, "wb").write(raw[:33] + chunk + raw[33:])  # 8 bytes of signature, IHDR's 25


@pytest.mark.parametrize("key", [b"Comment", b""])
def test_png_text_chunks_are_bounded_before_pillow_reads_them(tmp_path, key):
    """A source with 256 KiB of text (with a key; with an empty one, which Pillow keeps no count of): refused at
    start-up, from the chunks' headers. Before, both were accepted (a 1 GiB chunk cost 3.5 GB before its refusal, and
    with an empty key was accepted at 2.5 GB and read again at every open)."""
    prompts = edit_prompts(tmp_path)
    with_chunk(tmp_path / "sources" / "1.png", b"tEXt", key + b"\0" + b"x" * 2**18)
    said = start(prompts)
    assert said and said.startswith(f"--prompts: {prompts}:2: source image sources/1.png holds more than 65536 bytes "
                                    "of PNG text chunks"), said
    size = tmp_path / "sources" / "0.png"  # a chunk whose header claims 1 GiB: refused on its header, nothing read
    with_chunk(size, b"zTXt", b"k\0\0" + b"x" * 100)
    raw = bytearray(open(size, "rb").read())
    raw[33:37] = struct.pack(">I", 2**30)
    open(size, "wb").write(raw)
    assert "edits.jsonl:1: source image sources/0.png holds more than 65536 bytes" in start(prompts)


def test_hostile_names_and_values_are_refused_in_one_line_through_the_cli(tmp_path):
    """A 5000-character name and a 300-character one (an OSError traceback before), a NUL byte ("embedded null byte", no file or line
    before), a number, a FIFO (whose read would block) and a directory: each one line naming file and line; the NUL
    byte through the CLI, its whole output one line."""
    prompts = edit_prompts(tmp_path)
    lines = open(prompts).read().splitlines()
    os.mkfifo(tmp_path / "sources" / "fifo.png")
    for name, needle in [("x" * 5000, "must be a path of 1 to 4096 characters"),
                         ("x" * 300, "cannot be opened (File name too long)"), ("a\0b.png", "without NUL"),
                         (7, "must be a path"), ("sources/fifo.png", "is not a regular file (mode p"),
                         ("sources", "is not a regular file (mode d")]:
        open(prompts, "w").write(json.dumps(json.loads(lines[0]) | {"image": name}) + "\n" + lines[1] + "\n")
        said = start(prompts)
        assert said and said.startswith(f"--prompts: {prompts}:1: source image") and needle in said, said
        assert len(said) < 600, said
    first = json.loads(lines[0]) | {"image": "a\0b.png"}
    open(prompts, "w").write(json.dumps(first) + "\n" + lines[1] + "\n")
    out = subprocess.run([sys.executable, "flowgrpo.py", "--model", "tiny-flux-kontext", "--prompts", prompts,
                          "--no-wandb", "--run-dir", str(tmp_path / "run")], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr.startswith(f"flowgrpo.py: error: --prompts: {prompts}:1: source image must be a path")


def test_start_up_decodes_no_source_bounds_the_lines_and_shows_a_long_set(tmp_path, monkeypatch, capsys):
    """Start-up reads each source's header, never its pixels (before: every source decoded, 20 ms a line at 1024²);
    a set of 1000 lines or more shows a progress bar; more than MAX_PROMPTS lines are refused in one line."""
    prompts = edit_prompts(tmp_path)
    line = open(prompts).read().splitlines()[0]
    open(prompts, "w").write((line + "\n") * 1000)

    def no_decoding(self, *args):
        raise AssertionError("a source was decoded at start-up")
    with monkeypatch.context() as m:
        m.setattr(ImageFile.ImageFile, "load", no_decoding)
        m.setattr(Image.Image, "load", no_decoding)
        assert start(prompts) is None
    assert "checking edits.jsonl" in capsys.readouterr().err
    monkeypatch.setattr(prompt_sets, "MAX_PROMPTS", 999)
    assert start(prompts) == f"--prompts: prompt file {prompts} has 1000 prompts (at most 999, blank lines skipped)"


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, past 89 M pixels: refused here
def test_every_reader_of_a_source_is_bounded_where_it_reads(tmp_path):
    """A source swapped after start-up meets the same bounds wherever it is read: the rewards and the judge that
    compare with it (reward_judge.source_image), nano-edit's judge (read_source) and a run's grids (beside_sources).
    A FIFO is refused at once (it hung the run, silently), a 13000² or 20000² header before its pixels are decoded
    (1.8 GB decoded at 13000², a traceback at 20000²), a non-image in one line; each naming the path."""
    fifo, text = tmp_path / "fifo.png", tmp_path / "text.png"
    os.mkfifo(fifo)
    text.write_text("not an image")
    bombs = {side: tmp_path / f"{side}.png" for side in (13000, 20000)}
    for side, bomb in bombs.items():  # an 8×8 PNG whose header says side × side
        raw = bytearray(open(write_png(bomb, 8, 8, 0), "rb").read())
        raw[16:24] = struct.pack(">II", side, side)
        raw[29:33] = struct.pack(">I", zlib.crc32(bytes(raw[12:29])))  # IHDR's CRC
        open(bomb, "wb").write(raw)
    preserve = rewards.make_reward("preserve")
    readers = [lambda p: preserve(torch.zeros(1, 3, 16, 16), ["make it red"], [{"image": p}]),
               nano_edit.read_source, lambda p: runlog.beside_sources(torch.zeros(1, 3, 8, 8), [p])]
    for path, needle in [(fifo, "is not a regular file"), (bombs[13000], "is 13000×13000, more than"),
                         (bombs[20000], "has more than 16777216 pixels"), (text, "cannot be read as an image")]:
        for read in readers:
            refused = raised_within(read, str(path))
            assert isinstance(refused, ValueError) and "\n" not in str(refused), refused
            assert re.search(f"source image {re.escape(str(path))} {needle}.*changed since", str(refused)), refused
    assert np.asarray(source_images.read(write_png(tmp_path / "ok.png", 8, 8, 1))).shape == (8, 8, 3)


def test_a_16_bit_source_is_refused_not_turned_white(tmp_path):
    """A 16-bit grey PNG passed the check, and its mid-grey read as white: RGB clips a value over 255. Refused now,
    at start-up and by the reward server."""
    grey = tmp_path / "grey16.png"
    Image.fromarray(np.full((4, 4), 32768, np.uint16)).save(grey)
    assert Image.open(grey).mode.startswith("I")
    with pytest.raises(ValueError, match=r"has pixel mode I.*save it as an 8-bit RGB PNG"):
        source_images.check(str(grey))
    with pytest.raises(reward_server.Refused, match=r"images\[0\] has pixel mode I.*send 8-bit channels"):
        reward_server.read_images([base64.b64encode(grey.read_bytes()).decode()], reward_server.Limits())


def test_a_source_whose_pixels_changed_is_named_on_resume(tmp_path):
    """The prompts' hash in a checkpoint covers each source's content (its SHA-256 travels with its path): pixels
    changed between a checkpoint and --resume are refused as changed prompts, or taken with --allow-change prompts.
    Before, only the path was hashed: the change went unnoticed."""
    prompts, run = edit_prompts(tmp_path), tmp_path / "run"
    flags = ["--model", "tiny-flux-kontext", "--prompts", prompts, "--group-size", "2", "--prompts-per-iteration", "2",
             "--micro-batch", "2", "--eval-every", "0", "--run-dir", str(run)]
    main_here(*flags, "--iterations", "1")
    resume = [*flags, "--iterations", "2", "--resume", "auto"]
    assert startup.check_args(cli.parse_args(flowgrpo.Args, resume))  # unchanged: resumes
    write_png(tmp_path / "sources" / "1.png", 32, 32, seed=7)  # the same name and size, other pixels
    with pytest.raises(ValueError, match=r"its training prompts differ from those of .*iter_000000 \(their SHA-256\)"):
        startup.check_args(cli.parse_args(flowgrpo.Args, resume))
    assert startup.check_args(cli.parse_args(flowgrpo.Args, [*resume, "--allow-change", "prompts"]))


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_a_source_is_read_upright_as_its_exif_orientation_says(tmp_path, orientation):
    """A phone stores a portrait photo as landscape pixels with an EXIF orientation (6): every viewer shows it upright,
    but the source was checked as landscape (a portrait run refused it, a landscape one took it) and read on its side."""
    pixels = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)  # stored 40 wide, 30 high
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(tmp_path / "phone.png", exif=exif.tobytes())
    shown = np.asarray(ImageOps.exif_transpose(Image.open(tmp_path / "phone.png")).convert("RGB"))
    assert source_images.check(str(tmp_path / "phone.png"))[:2] == shown.shape[1::-1]
    read = np.asarray(source_images.read(str(tmp_path / "phone.png")))
    assert read.shape == shown.shape, f"read {read.shape}, shown {shown.shape}"
    assert np.array_equal(read, shown), f"{(read != shown).mean():.0%} of the values differ from the image shown"
    line = {"prompt": "make it green", "image": "phone.png"}
    (tmp_path / "p.jsonl").write_text(json.dumps(line) + "\n")
    assert prompt_sets.read_prompt_file(tmp_path / "p.jsonl", shown.shape[:2])[0][1]["image"].endswith("phone.png")


def test_a_source_cut_short_is_refused_at_start_up_not_mid_run(tmp_path):
    """A PNG cut short (a copy or download stopped part way) keeps a whole header: start-up took it, and the run failed
    only where its pixels were first decoded, mid-run, saying it "was readable when the run started". Refused at
    start-up now, from its chunks' headers (nothing decoded): cut within its pixels, or just before its IEND chunk."""
    prompts, source = edit_prompts(tmp_path), tmp_path / "sources" / "1.png"
    raw = source.read_bytes()
    for cut in (len(raw) // 2, len(raw) - 12):
        source.write_bytes(raw[:cut])
        said = start(prompts)
        assert said == f"--prompts: {prompts}:2: source image sources/1.png is cut short: no IEND (paths are relative " \
                       "to the prompt file)", said
    source.write_bytes(raw)
    assert start(prompts) is None
