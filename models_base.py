"""What every model family shares: the Adapter base class, loading a pipeline with one-line errors, and the tiny
parts the families' toy models are built from (CLIP and T5/UMT5 text encoders and tokenizers, an SD-style VAE).

An adapter loads the parts (transformer, VAE, text encoders, tokenizers, scheduler), freezes them, and offers exactly
what the loop needs: encode prompts, predict the velocity (with CFG or guidance), draw initial noise, decode latents to
images. It reuses the diffusers pipeline's own methods (prompt encoding, latent packing, VAE normalisation) rather than
copying them, so each ODE path reproduces its pipeline's `__call__` bit for bit (tests/test_models.py,
tests/test_models_sd3_flux.py). One file per family imports this one (models_qwen.py, models_sd3.py, models_flux.py,
models_wan.py); models.py, the registry of `--model` names, imports them. Importing it loads neither diffusers nor
transformers (`--help` stays fast): they are imported where a pipeline is built or loaded.
"""
import logging
import os
from dataclasses import dataclass

import torch

import model_files
import scheduler as sch

# diffusers' SD3 and FLUX pipelines import transformers' CLIP and Siglip image processors (for IP-adapters, unused
# here); without torchvision, transformers warns that it falls back to their PIL versions: not the user's concern.
logging.getLogger("transformers.utils.import_utils").addFilter(lambda r: "requires torchvision" not in r.getMessage())


@dataclass(frozen=True)
class Spec:
    """What is known about a `--model` before anything is loaded."""
    adapter: type  # its Adapter subclass (one file per family, models_*.py)
    pipeline: str  # the diffusers pipeline class, as a pipeline directory's model_index.json names it
    multiple: int  # VAE downsampling × patch size: image sides must be multiples of it
    guidance_embedding: bool = False  # a distilled guidance input (FLUX.1-dev): --guidance, not --cfg-scale
    frame_multiple: int = 0  # video: --num-frames − 1 must be a multiple of it (the VAE's temporal factor); 0: images
    trained_parts: tuple[str, ...] = ()  # --model-path holds only these (diffusers' format); the rest is built in code
    edits: bool = False  # an edit model: every prompt carries a source image (prompts.check_sources)


def from_pretrained(pipeline_class: str, model: str, path: str, **kwargs):
    """`<pipeline_class>.from_pretrained(path)`, with any failure to find or read the weights as one line."""
    import diffusers
    hub_notice = logging.getLogger("diffusers.pipelines.pipeline_utils")
    hub_notice.addFilter(_not_hub_notice)  # "Couldn't connect to the Hub ... will try the cache": our error says more
    try:
        if os.path.isfile(os.path.join(path, "model_index.json")):  # a tokenizer without its files loads unasked
            model_files.check_pipeline_parts(path, kwargs)
        return getattr(diffusers, pipeline_class).from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:  # hub, offline and missing-file errors are OSError or ValueError subclasses
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(" (")[0][:160]
        local = os.path.isabs(path) or path.startswith(".") or os.path.isdir(path)
        get = f"`hf download {path} --local-dir DIR` where the hub is reachable, then --model-path DIR"
        hint = ("not a complete pipeline directory: point --model-path at one (`hf download HUB_ID "
                "--local-dir DIR` makes one)" if local else f"HF_HUB_OFFLINE is set and the local cache lacks it: {get}"
                if offline else f"neither the hub nor the local cache gave it: check the name, or {get}")
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
    omni_pipeline_class: str | None = None  # the vLLM-Omni servers' pipeline_class for --rollout vllm-omni
    omni_unserved = "has no vLLM-Omni pipeline yet (docs/vllm-omni.md lists the families)"  # why None, for start-up
    max_sequence_length: int  # the prompts' text length (T5 pads to it); the servers are told it per request
    sp_degree = 1  # --sp N: each rank of a group holds 1/N of each sequence (set by sequence_parallel.enable_ulysses)
    num_frames: int = 1  # frames per sample: 1 for images (the servers are told it per request)
    prefix_kv_cache: bool | None = None  # --prefix-kv-cache where a family has one (off: False); None: it has none
    linspace_sigmas = False  # its pipeline passes σ = linspace(1, 1/N, N) to the scheduler (scheduler.linspace_scheduler_class)

    def rollout_cache(self) -> dict:
        """What one chunk's rollout calls share besides its conditioning (rollout.sample adds it to their `cond`, never
        to the batch's): nothing here; a family's prefix-KV cache with --prefix-kv-cache (models_qwen21.py)."""
        return {}

    def omni_knobs(self, metadata: dict, height: int, width: int) -> dict:
        """What a vLLM-Omni request adds to its knobs for one prompt's metadata: nothing for text to image (an edit
        family sends its source image)."""
        return {}

    def __init__(self, pipe, device, dtype: torch.dtype):
        self.pipe, self.device, self.dtype = pipe, torch.device(device), dtype
        pipe.set_progress_bar_config(disable=True)
        pipe.to(self.device)  # dtype was set at load time (from_pretrained's dtype keeps fp32-only modules)
        for part in pipe.components.values():
            if isinstance(part, torch.nn.Module):
                part.requires_grad_(False).eval()
        self.transformer, self.scheduler = pipe.transformer, pipe.scheduler  # the σ table only; the pipe's own
        if self.linspace_sigmas or pipe.scheduler.config.get("use_dynamic_shifting"):  # else the scheduler's own spacing
            self.scheduler = sch.linspace_scheduler_class(self.linspace_sigmas).from_config(pipe.scheduler.config)
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
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """{what: length} of the token sequences that --sp splits at this size (a video's frames too; `spec`: the
        model's multiples), known before anything loads (checked to divide by N at start-up). A family defines it
        once its transformer runs under diffusers' context parallelism here (docs/algorithm.md §14); until then --sp
        is refused."""
        raise ValueError(f"--sp: --model {model} has no sequence parallelism yet (its adapter defines no sp_sequences)")

    @classmethod
    def check_size(cls, model: str, spec: Spec, transformer, height: int, width: int, num_frames: int = 1) -> None:
        """Refuse, at start-up, a size beyond the transformer's position table (a family whose table bounds it defines
        this; others compute positions at any size). `transformer()`: the transformer built weightless from its
        config, None when that is not on this machine (model_checks.meta_transformer); called only where needed."""

    def image_seq_len(self, height: int, width: int) -> int:
        """Image tokens the transformer sees (what the dynamic sigma shift depends on)."""
        return (height // self.multiple) * (width // self.multiple)

    def conditioning(self, prompts: list[str], negative_prompt: str, cfg_scale: float,
                     metadata: list[dict] | None = None, height: int = 0, width: int = 0) -> dict:
        """Everything `velocity` needs besides x and σ, batch-first so a micro-batch is a slice: the family's
        `encode` tensors (B, ...) and, with two-pass CFG, the negative prompt's as `neg_<name>`. Each distinct
        prompt is encoded once. `metadata` (B,) and the output size: read by an edit family (its prompts' source
        images, models_kontext.py), unused by text-to-image ones."""
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


class EditAdapter:
    """What the edit families share, mixed in before the family's adapter (`FluxKontext(EditAdapter, Flux)`): their
    pipelines' `prepare_latents` take the source image first, and no --sp yet."""

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """No --sp yet: the source's tokens join the sequence, which is not tested under context parallelism."""
        raise ValueError(f"--sp: --model {model} has no sequence parallelism yet (its source image's tokens join the "
                         "sequence); run without --sp")

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, S, C·4) float32, as the pipeline's `prepare_latents` draws it."""
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(None, len(generators), channels, height, width, torch.float32, self.device,
                                         generators)[0]


# ---- tiny parts the families' toy models share (random weights, built in code, no downloads) -------------
# The tiny tokenizers are built in code: no installed wheel ships CLIP's BPE or T5's SentencePiece files.
#   - CLIP: `CLIPTokenizer` over CLIP's byte-level alphabet with no merges (every character one token, the word's
#     last one with CLIP's `</w>`), CLIP's own lower-casing and special tokens: 514 tokens, 77 positions.
#   - T5 (also Wan's UMT5): `T5Tokenizer` (a tokenizers Unigram model) over printable ASCII plus `▁`, one piece per
#     character; other characters become `<unk>`: 98 tokens.
# Every built-in prompt (≤ 68 characters) fits both in 77 tokens, so nothing is truncated.

TINY_MAX_LENGTH = 77  # the tiny tokenizers' length (CLIP's), and the tiny models' T5 sequence length


def decode_scaled(pipe, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, h, w) as the transformer sees them → images (B, 3, H, W) float32 in [0, 1], as an
    AutoencoderKL pipeline decodes (SD3's, FLUX.1's, Z-Image's): undo the VAE's scaling and shift, decode."""
    vae = pipe.vae
    image = vae.decode(z.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
    return pipe.image_processor.postprocess(image, output_type="pt").float().cpu()


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

