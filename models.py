"""The registry of `--model` names: what each is (its family's adapter, its pipeline, its size multiples) before
anything loads, the start-up checks of the model flags, and `load_model`.

One adapter per family, each a small class in a file of its own around that family's diffusers pipeline (the base class
and the shared tiny parts in models_base.py): Qwen-Image with `tiny` (models_qwen.py; the laptop tasks' `nano*` in
models_nano.py), Stable Diffusion 3.5 (models_sd3.py), FLUX.1 (models_flux.py), Wan2.1 text-to-video (models_wan.py),
the edit families FLUX.1 Kontext (models_kontext.py) and Qwen-Image-Edit (models_qwen_edit.py): a source image per
prompt, Z-Image (models_zimage.py), FLUX.2 [klein] (models_flux2.py) and Qwen-Image 2.1 (models_qwen21.py: text to
image, and editing under the `-edit` names). Each family has a `tiny` variant: the same diffusers classes with toy
configs and random weights, built in code from a seed, no downloads. Importing this module loads neither diffusers nor
transformers (`--help` stays fast).
"""
import functools
import math
import os

import torch

import atomic_files
import model_files
from models_base import Adapter, Spec
from models_flux import Flux
from models_flux2 import Flux2Klein, Flux2KleinDistilled
from models_kontext import FluxKontext
from models_nano import NanoComposeQwenImage, NanoEdit, NanoQwenImage
from models_qwen import QwenImage
from models_qwen21 import QwenImage21
from models_qwen_edit import QwenImageEdit
from models_sd3 import SD3
from models_wan import Wan
from models_zimage import ZImage, ZImageTurbo

SPECS = {
    "tiny": Spec(QwenImage, "QwenImagePipeline", 8),
    "nano": Spec(NanoQwenImage, "QwenImagePipeline", 8, trained_parts=("vae", "transformer")),
    "nano-compose": Spec(NanoComposeQwenImage, "QwenImagePipeline", 8, trained_parts=("vae", "transformer")),
    "nano-edit": Spec(NanoEdit, "QwenImagePipeline", 8, trained_parts=("vae", "transformer"), edits=True),
    "qwen-image": Spec(QwenImage, "QwenImagePipeline", 16),
    "tiny-sd3": Spec(SD3, "StableDiffusion3Pipeline", 8),
    "sd3.5-medium": Spec(SD3, "StableDiffusion3Pipeline", 16),
    "tiny-flux": Spec(Flux, "FluxPipeline", 8, guidance_embedding=True),
    "flux.1-dev": Spec(Flux, "FluxPipeline", 16, guidance_embedding=True),
    "tiny-flux-kontext": Spec(FluxKontext, "FluxKontextPipeline", 8, guidance_embedding=True, edits=True),
    "flux.1-kontext-dev": Spec(FluxKontext, "FluxKontextPipeline", 16, guidance_embedding=True, edits=True),
    "tiny-qwen-image-edit": Spec(QwenImageEdit, "QwenImageEditPlusPipeline", 8, edits=True),
    "qwen-image-edit": Spec(QwenImageEdit, "QwenImageEditPlusPipeline", 16, edits=True),
    "tiny-wan": Spec(Wan, "WanPipeline", 8, frame_multiple=4),
    "wan2.1-t2v-1.3b": Spec(Wan, "WanPipeline", 16, frame_multiple=4),
    "tiny-z-image": Spec(ZImage, "ZImagePipeline", 8),
    "z-image": Spec(ZImage, "ZImagePipeline", 16),
    "z-image-turbo": Spec(ZImageTurbo, "ZImagePipeline", 16),
    "tiny-flux.2-klein": Spec(Flux2Klein, "Flux2KleinPipeline", 8),
    "flux.2-klein": Spec(Flux2KleinDistilled, "Flux2KleinPipeline", 16),
    "flux.2-klein-base": Spec(Flux2Klein, "Flux2KleinPipeline", 16),
    "tiny-qwen-image-2.1": Spec(QwenImage21, "QwenImage21Pipeline", 32),
    "tiny-qwen-image-2.1-edit": Spec(QwenImage21, "QwenImage21Pipeline", 32, edits=True),
    "qwen-image-2.1": Spec(QwenImage21, "QwenImage21Pipeline", 32),
    "qwen-image-2.1-edit": Spec(QwenImage21, "QwenImage21Pipeline", 32, edits=True),
}
MODELS = tuple(SPECS)
TINY = tuple(m for m in MODELS if m.startswith("tiny"))


# ---- start-up checks: from names and files only, before anything is loaded ---------------------------

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
        raise ValueError(f"--guidance applies only to models with a guidance embedding (tiny-flux, flux.1-dev); "
                         f"--model {model} takes --cfg-scale instead")
    if cfg_scale > 1 and getattr(spec.adapter, "step_distilled", False):  # models_flux2.Flux2KleinDistilled
        raise ValueError(f"--cfg-scale must be 1 for --model {model}: it is step-distilled and its pipeline runs no CFG "
                         f"(its base model takes CFG), got {cfg_scale}")
    check_frames(model, num_frames)
    if model_path is not None or spec.trained_parts:  # nano's default is the shipped directory: check it too
        check_model_path(model, model_path or adapter_class(model).default_path)
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


def check_frames(model: str, num_frames: int) -> None:
    """An image model makes 1 frame; a video model 1 + k·frame_multiple (its VAE's temporal factor)."""
    k = SPECS[model].frame_multiple
    if not k and num_frames != 1:
        raise ValueError(f"--num-frames must be 1 for --model {model} (an image model), got {num_frames}")
    if k and (num_frames < 1 or (num_frames - 1) % k):
        raise ValueError(f"--num-frames must be {k}·n + 1 (1, {k + 1}, {2 * k + 1}, …) for --model {model}: its VAE "
                         f"compresses each {k} frames after the first into one latent frame, got {num_frames}")


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
        found = model_files.read_config(index)["_class_name"]
    except ValueError as e:
        raise ValueError(f"--model-path {path}: model_index.json {e}") from None
    want = SPECS[model].pipeline
    if found != want:
        fits = [m for m, s in SPECS.items() if s.pipeline == found and not s.trained_parts]
        raise ValueError(f"--model-path {path} holds a {found}, but --model {model} needs a {want}"
                         + (f": use --model {' or '.join(fits)}" if fits else ""))


def check_trained_part(model: str, path: str, part: str) -> None:
    """A trained part (nano's vae/, transformer/) checked from its files before anything loads (model_files.check_part)."""
    try:
        model_files.check_part(path, part, adapter_class(model).trained_classes[part])
    except ValueError as e:
        cls = adapter_class(model)
        raise ValueError(f"--model-path {path}: {e}: rerun `python -m {cls.pretrained_by} --out {path}`, or use "
                         f"the shipped {os.path.relpath(cls.default_path)} (no --model-path)") from None


def check_lora_targets(model: str, path: str | None, targets) -> None:
    """Each --lora-targets name must match a module of the transformer (peft's rule: the whole name, or its end after
    a dot), checked on a weightless copy (meta device) built from the transformer's config, before anything loads."""
    names = transformer_module_names(model, path)
    unknown = [t for t in targets if names is not None and not any(n == t or n.endswith("." + t) for n in names)]
    if unknown:
        raise ValueError(f"--lora-targets {' '.join(unknown)}: no module of --model {model}'s transformer has that "
                         f"name; its default targets are {' '.join(adapter_class(model).lora_targets)}")


def transformer_module_names(model: str, path: str | None) -> tuple[str, ...] | None:
    """The transformer's module names, from its config alone (None when the config is not on this machine: a hub id
    not yet downloaded, for which loading then names the problem)."""
    transformer = meta_transformer(model, path)
    return None if transformer is None else tuple(n for n, _ in transformer.named_modules())


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


# ---- loading ----------------------------------------------------------------------------------------

def adapter_class(model: str) -> type[Adapter]:
    """The adapter class of `model`."""
    return SPECS[model].adapter


def load_model(model: str, path: str | None, device, seed: int = 0, guidance: float | None = None,
               num_frames: int = 1, prefix_kv_cache: bool = False) -> Adapter:
    """The adapter of `--model` with its pipeline loaded (or, for the tiny ones, built from `seed`).
    `guidance` is FLUX's guidance embedding (None: the pipeline's default); other families take none. `num_frames`:
    a video model's frames per sample (images: 1). `prefix_kv_cache`: the rollout's, where the family has one."""
    if model not in SPECS:
        raise ValueError(f"--model must be one of {MODELS}, got {model!r}")
    if guidance is not None and not SPECS[model].guidance_embedding:
        raise ValueError(f"--guidance applies only to models with a guidance embedding; --model {model} has none")
    check_frames(model, num_frames)
    if prefix_kv_cache and adapter_class(model).prefix_kv_cache is None:
        raise ValueError(f"--prefix-kv-cache: --model {model} has no prefix-KV cache (Qwen-Image 2.1's family has one)")
    options = {} if guidance is None else {"guidance": guidance}
    if SPECS[model].frame_multiple:
        options["num_frames"] = num_frames
    adapter = adapter_class(model).load(model, path, device, seed, **options)
    assert adapter.multiple == SPECS[model].multiple, (adapter.multiple, model)  # the table matches the VAE
    if prefix_kv_cache:
        adapter.prefix_kv_cache = True
    return adapter


# ---- `python models.py save-tiny DIR`: a tiny pipeline on disk, for vLLM-Omni to serve ---------------

def save_tiny_pipeline(directory: str, seed: int = 0, model: str = "tiny") -> str:
    """Write `--model MODEL --seed S`'s tiny pipeline (float32) as a diffusers directory: what vLLM-Omni serves
    (`vllm serve DIR --omni --dtype float32`) and `--model MODEL --model-path DIR` loads. Built under a temporary name
    of its own and renamed, so a server never sees half a pipeline; an existing pipeline directory is replaced."""
    import shutil
    if model not in TINY:
        raise ValueError(f"--model must be one of {TINY}, got {model!r}")
    directory = os.path.abspath(directory)
    if os.path.isdir(directory) and os.listdir(directory) and not os.path.exists(f"{directory}/model_index.json"):
        raise FileExistsError(f"{directory} exists and is not a pipeline directory: choose an empty or new one")
    tmp = atomic_files.temporary(directory)
    adapter_class(model).build_tiny(seed).save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(tmp, directory)
    return directory


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="python models.py save-tiny DIR [--model M] [--seed S]: write a tiny "
                                             "random-weight pipeline to DIR, for vLLM-Omni to serve")
    sub = ap.add_subparsers(dest="cmd", required=True)
    save = sub.add_parser("save-tiny", help="write a tiny pipeline (the weights of --model M --seed S) to DIR")
    save.add_argument("dir")
    save.add_argument("--model", choices=TINY, default="tiny")
    save.add_argument("--seed", type=int, default=0)
    cli = ap.parse_args()
    print(save_tiny_pipeline(cli.dir, cli.seed, cli.model))
