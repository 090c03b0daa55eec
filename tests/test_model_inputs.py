"""Model input that used to end in a traceback or a hang is refused at start-up in one line naming the file or flag
and the fix (model_checks.check_model_args, check_model_path): nano's files damaged or swapped, configs whose sizes
would build a huge model, a video or image beyond the transformer's position table, --sp without the ranks it needs."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

import model_checks
import models
import models_nano

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = "diffusion_pytorch_model.safetensors"
ARGS = dict(height=32, width=32, cfg_scale=1.0, guidance=None, model_path=None)


@pytest.fixture
def nano(tmp_path):
    """A copy of the shipped nano directory (vae/, transformer/), to damage."""
    shutil.copytree(models_nano.NANO_DIR, tmp_path / "nano", ignore=shutil.ignore_patterns("*.png"))
    return tmp_path / "nano"


CONFIG_CHANGES = {"more layers": dict(num_layers=6), "10^6 layers": dict(num_layers=10**6),
                  "a wider transformer": dict(num_attention_heads=8), "no _class_name": dict(_class_name=None)}


def damage(directory, case: str) -> None:
    """Each attack of the review on one file of a nano directory."""
    weights, config = directory / "transformer" / WEIGHTS, directory / "transformer" / "config.json"
    if case == "truncated":
        os.truncate(weights, os.path.getsize(weights) // 2)
    elif case == "vae cut to 100 bytes":
        os.truncate(directory / "vae" / WEIGHTS, 100)
    elif case == "an offset of 1e999":  # JSON's float infinity, which int() overflows on
        header = b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e999]}}'
        weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    elif case in ("missing", "fifo", "/dev/zero"):
        weights.unlink()
    if case == "fifo":
        os.mkfifo(weights)
    elif case == "/dev/zero":
        weights.symlink_to("/dev/zero")
    elif case == "config a fifo":
        config.unlink()
        os.mkfifo(config)
    elif case == "4 GiB sparse config":
        with open(config, "r+b") as f:
            f.truncate(4 << 30)
    elif case in CONFIG_CHANGES:
        changed = json.loads(config.read_text()) | CONFIG_CHANGES[case]
        config.write_text(json.dumps({k: v for k, v in changed.items() if v is not None}))


@pytest.mark.parametrize("case,file,problem", [
    ("truncated", f"transformer/{WEIGHTS}", "is truncated: 637220 bytes, where its header places 1274440"),
    ("vae cut to 100 bytes", f"vae/{WEIGHTS}", "is truncated or not safetensors (100 bytes"),
    ("an offset of 1e999", f"transformer/{WEIGHTS}", "is truncated or not safetensors (77 bytes, no readable header)"),
    ("missing", f"transformer/{WEIGHTS}", "is missing"),
    ("fifo", f"transformer/{WEIGHTS}", "is not a regular file (mode prw"),
    ("/dev/zero", f"transformer/{WEIGHTS}", "is not a regular file (mode crw"),
    ("config a fifo", "transformer/config.json", "is not a regular file (mode prw"),
    ("4 GiB sparse config", "transformer/config.json", "holds 4294967296 bytes, more than 1048576"),
    ("no _class_name", "transformer/config.json", "has no `_class_name`"),
    ("10^6 layers", "transformer/config.json", "has num_layers 1000000, more than 256"),
    ("more layers", f"transformer/{WEIGHTS}", "does not hold what transformer/config.json describes (64 tensors differ"),
    ("a wider transformer", f"transformer/{WEIGHTS}", "does not hold what transformer/config.json describes"),
])
def test_a_damaged_nano_directory_is_one_line_naming_the_file(nano, case, file, problem):
    """Before: tracebacks from diffusers at load (one naming diffusion_pytorch_model.bin for a FIFO or /dev/zero in
    place of the .safetensors), a KeyError, hours building 10⁶ layers, 4 GiB read; a FIFO is never opened blocking."""
    model_checks.check_model_path("nano", str(nano))  # the intact copy passes
    damage(nano, case)
    with pytest.raises(ValueError) as e:
        model_checks.check_model_path("nano", str(nano))
    message = str(e.value)
    assert message.startswith(f"--model-path {nano}: {file} {problem}"), message
    assert message.endswith(f"rerun `python -m tasks.nano pretrain --out {nano}`, or use the shipped assets/nano "
                            "(no --model-path)") and "\n" not in message, message


def test_the_cli_says_it_in_one_line_before_loading(nano):
    damage(nano, "truncated")
    out = subprocess.run([sys.executable, "flowgrpo.py", "--model", "nano", "--model-path", str(nano), "--run-dir",
                          str(nano / "run")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"flowgrpo.py: error: --model-path {nano}: transformer/{WEIGHTS} is truncated"), lines
    assert not (nano / "run").exists()


@pytest.mark.parametrize("model", ["nano", "nano-compose", "nano-edit"])
def test_the_command_a_damaged_base_is_told_to_rerun_exists(model):
    """The refusal's `python -m {pretrained_by} --out DIR` is a command that takes --out (before: nano-edit's named
    `nano_edit.py pretrain`, a subcommand it never had)."""
    command = models.adapter_class(model).pretrained_by.split()
    out = subprocess.run([sys.executable, "-m", *command, "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "--out" in out.stdout, (command, out.stderr[-2000:])


def wan_pipeline(directory, **transformer_config) -> str:
    """A Wan pipeline directory holding only what the start-up checks read."""
    (directory / "transformer").mkdir(parents=True)
    (directory / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    config = {"_class_name": "WanTransformer3DModel"} | transformer_config
    (directory / "transformer" / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_a_pipeline_directorys_configs_are_bounded_before_they_are_read_or_built(tmp_path):
    """Before: 10⁶ layers were built (weightless, for hours) to count heads; a model_index.json was read whole."""
    path = wan_pipeline(tmp_path / "deep", num_layers=10**6)
    with pytest.raises(ValueError, match=rf"^--model-path {path}: transformer/config.json has num_layers 1000000, "
                                         "more than 256$"):
        model_checks.check_model_args("wan2.1-t2v-1.3b", **ARGS | dict(model_path=path, num_frames=9))
    path = wan_pipeline(tmp_path / "big")
    with open(os.path.join(path, "model_index.json"), "r+b") as f:
        f.truncate(2 << 20)
    with pytest.raises(ValueError, match=rf"^--model-path {path}: model_index.json holds 2097152 bytes, more than"):
        model_checks.check_model_args("wan2.1-t2v-1.3b", **ARGS | dict(model_path=path, num_frames=9))


@pytest.mark.parametrize("flags,message", [
    (dict(num_frames=257), "--num-frames must be at most 253 for --model tiny-wan, got 257: its transformer's rotary "
                           "position table (rope_max_seq_len) holds 64 positions per axis"),
    (dict(height=520, num_frames=9), "--height must be at most 512 for --model tiny-wan, got 520"),
    (dict(width=1032, num_frames=9), "--width must be at most 512 for --model tiny-wan, got 1032"),
])
def test_a_video_beyond_wans_rotary_table_is_refused_at_start_up(flags, message):
    """Before: the start-up checks passed and the first transformer call of the rollout crashed on the table."""
    with pytest.raises(ValueError, match=re.escape(message)):
        model_checks.check_model_args("tiny-wan", **ARGS | flags)
    model_checks.check_model_args("tiny-wan", **ARGS | dict(height=512, width=512, num_frames=253))  # the largest


def test_wans_limits_are_its_rotary_tables_own():
    """At the largest size accepted (64 latent frames, 64 × 64 patches) the table covers every axis; one more latent
    frame, row or column of patches does not (diffusers raises: the crash the start-up check now prevents)."""
    rope = model_checks.meta_transformer("tiny-wan", None).rope
    cos, _ = rope(torch.empty(1, 16, 64, 128, 128, device="meta"))  # (F', H/4, W/4) latents of 253 × 512 × 512
    assert cos.shape[1] == 64 * 64 * 64, cos.shape
    for grid in ((65, 2, 2), (1, 130, 2), (1, 2, 130)):
        with pytest.raises(RuntimeError):
            rope(torch.empty(1, 16, *grid, device="meta"))


def test_a_pipeline_of_another_scale_in_the_family_is_said_in_one_line(tmp_path):
    """A tiny SD3 directory given to --model sd3.5-medium passes the start-up checks (the same pipeline class) and
    loads; its VAE makes images in multiples of 8 where the model's table says 16. That was a bare assert (gone under
    python -O, the run then going on with the table's multiple)."""
    path = models.save_tiny_pipeline(str(tmp_path / "t"), 0, "tiny-sd3")
    with pytest.raises(ValueError, match=re.escape("multiples of 8, --model sd3.5-medium's are 16")):
        models.load_model("sd3.5-medium", path, "cpu")


def test_an_image_beyond_sd3s_position_table_is_refused_at_start_up():
    """SD3 crops its position embedding from a table of pos_embed_max_size patches a side (the tiny one's 64): 528 px
    passed the start-up checks and the rollout's first call raised; the largest size accepted is the table's, and
    diffusers' transformer takes it."""
    with pytest.raises(ValueError, match=re.escape("--height must be at most 512 for --model tiny-sd3, got 528: its "
                                                   "transformer's position table (pos_embed_max_size) holds 64")):
        model_checks.check_model_args("tiny-sd3", **ARGS | dict(height=528))
    model_checks.check_model_args("tiny-sd3", **ARGS | dict(height=512, width=512))
    embed = model_checks.meta_transformer("tiny-sd3", None).pos_embed  # takes latent sides: 512 px, 128 latents
    assert embed.cropped_pos_embed(128, 128).shape[1] == 64 * 64
    with pytest.raises(ValueError, match="cannot be greater than `pos_embed_max_size`: 64"):
        embed.cropped_pos_embed(132, 128)  # 528 px


def test_an_image_beyond_qwen_images_rotary_table_is_refused_at_start_up():
    """QwenEmbedRope holds 4096 positions: a side of 4096 patches leaves 2·1024 for the text after it (its 1024 tokens,
    padded for --sp); at 6146 patches not even 1024 are left: the table ends and the attention would crash."""
    with pytest.raises(ValueError, match=re.escape("--width must be at most 32768 for --model tiny, got 32776")):
        model_checks.check_model_args("tiny", **ARGS | dict(width=32776))
    model_checks.check_model_args("tiny", **ARGS | dict(height=32768))
    rope = QwenEmbedRope(theta=10000, axes_dim=[8, 4, 4], scale_rope=True)
    _, text = rope([(1, 4096, 1)], device="cpu", max_txt_seq_len=2048)
    assert text.shape[0] == 2048, text.shape
    _, text = rope([(1, 6146, 1)], device="cpu", max_txt_seq_len=1024)
    assert text.shape[0] < 1024, text.shape


def test_sp_on_one_process_is_refused_for_its_ranks_first_naming_torchrun(monkeypatch):
    """Before: `--sp 2` on one process was refused for tiny's 3 heads; the fix it suggested then met the ranks."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=re.escape("--sp 2 must divide the number of ranks, 1 (WORLD_SIZE; 1 without "
                                                   "torchrun): launch a multiple of 2 processes, e.g. `torchrun "
                                                   "--nproc_per_node=2 flowgrpo.py … --sp 2`")):
        model_checks.check_model_args("tiny", **ARGS | dict(sp=2))


@pytest.mark.parametrize("model,world,sp,fix", [("tiny-wan", 4, 4, "choose --sp 2, which divides each"),
                                                ("tiny", 2, 2, "run without --sp")])
def test_the_heads_and_tokens_refusal_suggests_an_sp_that_passes(monkeypatch, model, world, sp, fix):
    """tiny-wan: 2 heads and 48 video tokens on 4 ranks: --sp 2 divides both and the ranks; tiny: 3 heads, none."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = ARGS | dict(num_frames=9 if model == "tiny-wan" else 1)
    with pytest.raises(ValueError, match=re.escape(fix)) as e:
        model_checks.check_model_args(model, **args | dict(sp=sp))
    suggested = re.search(r"choose --sp (\d+)", str(e.value))
    model_checks.check_model_args(model, **args | dict(sp=int(suggested[1]) if suggested else 1))  # passes
