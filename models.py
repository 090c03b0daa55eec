"""The registry of `--model` names: what each is (its family's adapter, its pipeline, its size multiples) before
anything loads, and `load_model` (the start-up checks of the model flags, which read this table, are model_checks.py).

One adapter per family, each a small class in a file of its own around that family's diffusers pipeline (the base class
and the shared tiny parts in models_base.py): Qwen-Image with `tiny` (models_qwen.py; the laptop tasks' `nano*` in
models_nano.py), Stable Diffusion 3.5 (models_sd3.py), FLUX.1 (models_flux.py), Wan2.1 text-to-video (models_wan.py),
the edit families FLUX.1 Kontext (models_kontext.py) and Qwen-Image-Edit (models_qwen_edit.py): a source image per
prompt, Z-Image (models_zimage.py), FLUX.2 [klein] (models_flux2.py) and Qwen-Image 2.1 (models_qwen21.py: text to
image, and editing under the `-edit` names). Each family has a `tiny` variant: the same diffusers classes with toy
configs and random weights, built in code from a seed, no downloads. Importing this module loads neither diffusers nor
transformers (`--help` stays fast).
"""
import os

import atomic_files
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


# ---- the frames a model makes (also checked at start-up, model_checks.py) ------------------------------

def check_frames(model: str, num_frames: int) -> None:
    """An image model makes 1 frame; a video model 1 + k·frame_multiple (its VAE's temporal factor)."""
    k = SPECS[model].frame_multiple
    if not k and num_frames != 1:
        raise ValueError(f"--num-frames must be 1 for --model {model} (an image model), got {num_frames}")
    if k and (num_frames < 1 or (num_frames - 1) % k):
        raise ValueError(f"--num-frames must be {k}·n + 1 (1, {k + 1}, {2 * k + 1}, …) for --model {model}: its VAE "
                         f"compresses each {k} frames after the first into one latent frame, got {num_frames}")


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
    if adapter.multiple != SPECS[model].multiple:  # the table's sizes are checked at start-up: the VAE must agree
        raise ValueError(f"--model-path {path}: its VAE and patch make images in multiples of {adapter.multiple}, "
                         f"--model {model}'s are {SPECS[model].multiple}: it is another model of the family (a tiny one "
                         f"for a real one, or the reverse); give the --model it is")
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
