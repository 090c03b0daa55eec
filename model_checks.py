"""The start-up checks of the model flags (`--model`, `--model-path`, the size, `--num-frames`, `--sp`,
`--lora-targets`): from names and files only, before anything is loaded, each refusal in one line naming the flag and a
choice that passes. The registry they read is models.py's `SPECS`; a transformer's shape comes from its config alone,
built weightless on the meta device (model_files.py reads the files within bounds).
"""
import functools
import math
import os

import torch

import model_files
from models import MODELS, SPECS, adapter_class, check_frames
from models_wan import check_wan21


def check_resolution(model: str, height: int, width: int) -> None:
    """Image sides must be positive multiples of the model's `multiple`; checked before anything is built."""
    multiple = SPECS[model].multiple
    for flag, side in (("--height", height), ("--width", width)):
        if side <= 0 or side % multiple:
            raise ValueError(f"{flag} must be a positive multiple of {multiple} for --model {model} "
                             f"(VAE downsampling × 2×2 patches), got {side}")


def check_model_args(model: str, *, height: int, width: int, cfg_scale: float, guidance: float | None,
                     model_path: str | None, sp: int = 1, num_frames: int = 1) -> None:
    """Refuse flags that cannot apply to `model`, each error naming the flag and a valid choice."""
    if model not in SPECS:
        raise ValueError(f"--model must be one of {MODELS}, got {model!r}")
    spec = SPECS[model]
    check_resolution(model, height, width)
    if spec.guidance_embedding and cfg_scale > 1:
        raise ValueError(f"--cfg-scale must be 1 for --model {model}: it is guidance-distilled and has no second CFG "
                         f"pass; set its guidance embedding with --guidance (the recipe's 3.5), got {cfg_scale}")
    if not spec.guidance_embedding and guidance is not None:
        raise ValueError(f"--guidance applies only to models with a guidance embedding "
                         f"({', '.join(m for m, s in SPECS.items() if s.guidance_embedding)}); --model {model} takes "
                         "--cfg-scale instead")
    if cfg_scale > 1 and getattr(spec.adapter, "step_distilled", False):  # models_flux2.Flux2KleinDistilled
        raise ValueError(f"--cfg-scale must be 1 for --model {model}: it is step-distilled and its pipeline runs no CFG "
                         f"(its base model takes CFG), got {cfg_scale}")
    check_frames(model, num_frames)
    if model_path is not None or spec.trained_parts:  # nano's default is the shipped directory: check it too
        check_model_path(model, model_path or adapter_class(model).default_path)
    index = os.path.join(model_path or "", "model_index.json")
    config = model_files.read_config(index) if model_path and os.path.isfile(index) else {}
    if cfg_scale > 1 and config.get("is_distilled"):
        raise ValueError(f"--cfg-scale must be 1 with --model-path {model_path}: its pipeline is step-distilled "
                         f"(model_index.json: is_distilled) and runs no CFG, got {cfg_scale}: give a base checkpoint")
    if config.get("sample_sigmas"):  # a Turbo's grid, which its pipeline samples at any step count (models_qwen21.py)
        raise ValueError(f"--model-path {model_path}: its pipeline samples its own σ grid (model_index.json: "
                         f"sample_sigmas), which this project's schedules do not: give a checkpoint without one")
    transformer = functools.partial(meta_transformer, model, model_path)  # built only by a family with a rope table
    spec.adapter.check_size(model, spec, transformer, height, width, num_frames)
    if sp > 1:
        check_sequence_parallel(model, model_path, sp, height, width, num_frames)


def check_sequence_parallel(model: str, path: str | None, sp: int, height: int, width: int,
                            num_frames: int = 1) -> None:
    """--sp N (sequence_parallel.py), in a family that has it, needs a multiple of N ranks (WORLD_SIZE, which torchrun
    sets; 1 without it), checked first. It gives each rank of a group 1/N of every sequence the transformer splits and,
    inside attention, 1/N of its heads: N must divide each of them (the heads from the transformer's config, when it
    is on this machine; else its loading fails on them). A refusal names an --sp that passes both checks."""
    spec = SPECS[model]
    counts = spec.adapter.sp_sequences(model, spec, height, width, num_frames)  # refuses a family without SP
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % sp:
        raise ValueError(f"--sp {sp} must divide the number of ranks, {world} (WORLD_SIZE; 1 without torchrun): "
                         f"launch a multiple of {sp} processes, e.g. `torchrun --nproc_per_node={sp} flowgrpo.py … "
                         f"--sp {sp}`")
    transformer = meta_transformer(model, path)
    if transformer is not None:
        counts[f"attention heads ({type(transformer).__name__})"] = transformer.config.num_attention_heads
    bad = [f"{n} {what}" for what, n in counts.items() if n % sp]
    flags = {"--height": height, "--width": width} | ({"--num-frames": num_frames} if spec.frame_multiple else {})
    fits = math.gcd(world, *counts.values())  # the largest --sp that divides every count and the ranks
    fix = f"choose --sp {fits}, which divides each" if fits > 1 else "run without --sp"
    if bad:
        raise ValueError(f"--sp {sp} must divide every count it splits, but --model {model} at "
                         f"{' '.join(f'{f} {n}' for f, n in flags.items())} has {', '.join(bad)}: {fix} (the tokens "
                         f"also change with {', '.join(flags)})")


def check_model_path(model: str, path: str) -> None:
    """A local --model-path must be a diffusers pipeline directory of `model`'s family (its model_index.json
    names the pipeline class); anything else that does not exist locally is taken for a hub id. A model whose
    Spec lists `trained_parts` (nano) takes a local directory holding just those."""
    parts = SPECS[model].trained_parts
    missing = [p for p in parts if not os.path.lexists(os.path.join(path, p, "config.json"))]
    if parts and missing:
        raise ValueError(f"--model-path {path}: no {'/, '.join(missing)}/ with a config.json; --model {model} reads "
                         f"the directory that `python -m {adapter_class(model).pretrained_by} --out DIR` writes")
    for part in parts:
        check_trained_part(model, path, part)
    if parts:
        return
    index = os.path.join(path, "model_index.json")
    if os.path.exists(path) and not os.path.lexists(index):
        raise ValueError(f"--model-path {path}: not a diffusers pipeline directory (no model_index.json)")
    if not os.path.exists(path):
        if path.startswith(("/", "./", "../", "~")) or path.count("/") != 1:
            raise ValueError(f"--model-path {path}: no such directory, and not a hub id of the form org/name")
        return
    try:
        config = model_files.read_config(index)
    except ValueError as e:
        raise ValueError(f"--model-path {path}: model_index.json {e}") from None
    found, want = config["_class_name"], SPECS[model].pipeline
    if found != want:
        fits = [m for m, s in SPECS.items() if s.pipeline == found and not s.trained_parts]
        raise ValueError(f"--model-path {path} holds a {found}, but --model {model} needs a {want}"
                         + (f": use --model {' or '.join(fits)}" if fits else ""))
    check_wan21(config, f"--model-path {path}")  # (any pipeline: only WanPipeline's configs have its keys)


def check_trained_part(model: str, path: str, part: str) -> None:
    """A trained part (nano's vae/, transformer/) checked from its files before anything loads (model_files.check_part)."""
    try:
        model_files.check_part(path, part, adapter_class(model).trained_classes[part])
    except ValueError as e:
        cls = adapter_class(model)
        raise ValueError(f"--model-path {path}: {e}: rerun `python -m {cls.pretrained_by} --out {path}`, or use "
                         f"the shipped {os.path.relpath(cls.default_path)} (no --model-path)") from None


# The layers a LoRA adapts (peft's dispatch_default); peft refuses any other module a target matches, once loaded
LORA_LAYERS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
               torch.nn.MultiheadAttention)


def check_lora_targets(model: str, path: str | None, targets) -> None:
    """Each --lora-targets name must match a module of the transformer (peft's rule: the whole name, or its end after
    a dot), and only layers a LoRA adapts (LORA_LAYERS; `attn` matches a whole attention block), checked on a weightless
    copy (meta device) built from the transformer's config, before anything loads (unchecked when the config is not on
    this machine: a hub id not yet downloaded, for which loading then names the problem)."""
    transformer = meta_transformer(model, path)
    modules = {} if transformer is None else dict(transformer.named_modules())
    matched = {t: [n for n in modules if n == t or n.endswith("." + t)] for t in targets}
    unknown = [t for t in targets if transformer is not None and not matched[t]]
    if unknown:
        raise ValueError(f"--lora-targets {' '.join(unknown)}: no module of --model {model}'s transformer has that "
                         f"name; its default targets are {' '.join(adapter_class(model).lora_targets)}")
    bad = {t: n for t, names in matched.items() for n in names if not isinstance(modules[n], LORA_LAYERS)}
    where = ", ".join(f"{n} ({type(modules[n]).__name__})" for n in bad.values())
    if bad:
        raise ValueError(f"--lora-targets {' '.join(bad)}: matches {where}, which a LoRA cannot adapt (only Linear, "
                         f"Conv and Embedding layers): name the linear layers in it; its default targets are "
                         f"{' '.join(adapter_class(model).lora_targets)}")


@functools.lru_cache(maxsize=8)
def meta_transformer(model: str, path: str | None) -> torch.nn.Module | None:
    """The transformer built from its config alone (bounded: read_config), weightless (meta device); None when the
    config is not here."""
    if path is None and model.startswith("tiny"):
        with torch.device("meta"):
            return adapter_class(model).build_tiny(0).transformer
    path = path or adapter_class(model).default_path
    config = os.path.join(path, "transformer", "config.json")
    if not os.path.isdir(path):
        from huggingface_hub import try_to_load_from_cache
        config = try_to_load_from_cache(path, "transformer/config.json")
    if not isinstance(config, str) or not os.path.lexists(config):
        return None
    try:
        return model_files.build_weightless(model_files.read_config(config))
    except ValueError as e:
        raise ValueError(f"--model-path {path}: transformer/config.json {e}") from None
