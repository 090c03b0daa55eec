"""FLUX.1 (`flux.1-dev`, `tiny-flux`) around diffusers' FluxPipeline: packed latents with image ids, CLIP's
pooled + T5's embeddings, the distilled guidance embedding (one transformer pass, no CFG), and the dynamic
sigma shift from the image token count (scheduler.sigma_schedule computes it as the pipeline does)."""
import torch

from models_base import (TINY_MAX_LENGTH, Adapter, Spec, decode_scaled, tiny_clip, tiny_clip_tokenizer, tiny_t5,
                         tiny_t5_tokenizer, tiny_vae)

# black-forest-labs/FLUX.1-dev's scheduler config
FLUX_SCHEDULER = dict(use_dynamic_shifting=True, base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5,
                      max_shift=1.15, shift=3.0, num_train_timesteps=1000)
DEFAULT_GUIDANCE = 3.5  # FluxPipeline.__call__'s default guidance_scale, and Flow-GRPO's FLUX recipe
T5_LENGTH = 128  # Flow-GRPO encodes with T5 length 128 (the pipeline's default is 512); the tiny T5 has 77


def build_tiny_flux_pipeline(seed: int = 0, pipeline: str = "FluxPipeline"):
    """A random-weight FluxPipeline with FLUX.1-dev's structure at toy size (double- and single-stream blocks,
    a guidance embedding, CLIP + T5, its scheduler and VAE factors), sharing the tiny CLIP/T5/VAE of
    models_base.py. Deterministic given `seed`; leaves the global RNG untouched. `pipeline`: the diffusers class
    that holds the parts (FluxKontextPipeline for the edit twin, models_kontext.py: the same weights)."""
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder, text_encoder_2 = tiny_clip(clip_tok, False), tiny_t5(t5_tok)
        # 4 latent channels × 2×2 packing = 16 inputs; rope axes sum to the head dim; pooled = CLIP's hidden size
        transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                             attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                             pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
        vae = tiny_vae(scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE factors
    return getattr(diffusers, pipeline)(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=vae,
                                        text_encoder=text_encoder, tokenizer=clip_tok, text_encoder_2=text_encoder_2,
                                        tokenizer_2=t5_tok, transformer=transformer)


class Flux(Adapter):
    """FLUX.1 around FluxPipeline. Latents are kept packed as the pipeline keeps them, (B, S, C·4) with
    S = (H/16)·(W/16), in float32 (cast to the model dtype at the transformer's input)."""
    linspace_sigmas = True  # the pipeline passes σ = linspace(1, 1/N, N) (scheduler.linspace_scheduler_class)
    pipeline_class = "FluxPipeline"
    default_path = "black-forest-labs/FLUX.1-dev"
    omni_pipeline_class = "omni.pipeline.FlowGRPOFluxPipeline"
    # Flow-GRPO's FLUX LoRA targets (scripts/train_flux.py): attention projections of both streams (the single
    # blocks' to_q/k/v too) and the double blocks' MLPs.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                    "ff_context.net.2")
    build_tiny = staticmethod(build_tiny_flux_pipeline)

    def __init__(self, pipe, device, dtype: torch.dtype, guidance: float = DEFAULT_GUIDANCE):
        super().__init__(pipe, device, dtype)
        if not self.transformer.config.guidance_embeds:  # e.g. FLUX.1-schnell given as --model-path
            raise ValueError("--model-path: this FLUX transformer has no guidance embedding (FLUX.1-schnell?); "
                             "--model flux.1-dev needs FLUX.1-dev's")
        self.guidance = float(guidance)
        self.max_sequence_length = min(T5_LENGTH, pipe.tokenizer_2.model_max_length)

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """Image tokens and T5's text tokens, whose length is fixed: FLUX attends to T5's padding too (no mask), so the
        text cannot be padded further without changing the result (tiny-flux's 77 tokens: no --sp 2)."""
        return {"image tokens": (height // spec.multiple) * (width // spec.multiple),
                "T5 text tokens": min(T5_LENGTH, TINY_MAX_LENGTH) if model.startswith("tiny") else T5_LENGTH}

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, S, C·4) float32, as the pipeline's `prepare_latents`."""
        latents, _ = self.pipe.prepare_latents(len(generators), self.transformer.config.in_channels // 4, height,
                                               width, torch.float32, self.device, generators)
        return latents

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """`embeds` (B, L, D): T5's states; `pooled` (B, P): CLIP's pooled output. The pipeline's `encode_prompt`."""
        embeds, pooled, _ = self.pipe.encode_prompt(prompts, None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return {"embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """Double-stream blocks, then single-stream blocks."""
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """Each frozen text encoder's layers, then its root."""
        p = self.pipe
        return [*p.text_encoder.encoder.layers, p.text_encoder, *p.text_encoder_2.encoder.block, p.text_encoder_2]

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, C·4): one transformer call with the guidance embedding, as the pipeline makes it.
        cond: `embeds`, `pooled`. Two-pass CFG does not apply (model_checks.check_model_args refuses it)."""
        if cfg_scale > 1:
            raise ValueError(f"--cfg-scale must be 1 for FLUX (guidance-distilled), got {cfg_scale}")
        batch = x.shape[0]
        # The pipeline feeds timesteps = σ·1000 cast to the latent dtype, then divides by 1000; guidance in float32.
        timestep = (sigma.to(self.device, torch.float32) * 1000).to(self.dtype) / 1000
        guidance = torch.full([1], self.guidance, device=self.device, dtype=torch.float32).expand(batch)
        img_ids = self.image_ids(batch, height, width)  # text ids in the text encoder's dtype, as the pipeline's
        txt_ids = torch.zeros(cond["embeds"].shape[1], 3, device=self.device, dtype=self.pipe.text_encoder.dtype)
        return self.transformer(hidden_states=x.to(self.dtype), timestep=timestep, guidance=guidance,
                                pooled_projections=cond["pooled"], encoder_hidden_states=cond["embeds"],
                                txt_ids=txt_ids, img_ids=img_ids, joint_attention_kwargs={}, return_dict=False)[0]

    def image_ids(self, batch: int, height: int, width: int) -> torch.Tensor:
        """(S, 3) ids of the packed 2×2 patches, (0, row, column), in the latent dtype as the pipeline makes them."""
        return self.pipe._prepare_latent_image_ids(batch, height // self.multiple, width // self.multiple, self.device,
                                                   self.dtype)

    def pipeline_kwargs(self, cond: dict, cfg_scale: float) -> dict:
        """The `FluxPipeline.__call__` arguments that sample from exactly these conditions."""
        return dict(prompt_embeds=cond["embeds"], pooled_prompt_embeds=cond["pooled"], guidance_scale=self.guidance)

    def omni_request(self, cfg_scale: float, negative_prompt: str) -> dict:
        """The vLLM-Omni request fields that guide as `velocity` does: the guidance embedding's value, and no
        negative prompt (its FLUX would run true CFG with one)."""
        return {"guidance_scale": self.guidance}

    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (B, S, C·4) → images (B, 3, H, W) float32 in [0, 1], as the pipeline decodes."""
        return decode_scaled(self.pipe, self.pipe._unpack_latents(x, height, width, self.pipe.vae_scale_factor))
