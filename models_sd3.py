"""Stable Diffusion 3.5 (`sd3.5-medium`, `tiny-sd3`) around diffusers' StableDiffusion3Pipeline; its tiny variant is
built from the tiny CLIP/T5 text encoders, tokenizers and VAE that models_base.py shares among the families."""
import torch

from models_base import (Adapter, Spec, decode_scaled, tiny_clip, tiny_clip_tokenizer, tiny_t5, tiny_t5_tokenizer,
                         tiny_vae)

SD3_SCHEDULER = dict(shift=3.0, num_train_timesteps=1000)  # stabilityai/stable-diffusion-3.5-medium's scheduler
def build_tiny_sd3_pipeline(seed: int = 0):
    """A random-weight StableDiffusion3Pipeline with SD3.5-Medium's structure at toy size (RMS q/k norm, a
    dual-attention block, two CLIPs with projections, a T5, its scheduler). Deterministic given `seed`; leaves the
    global RNG untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    clip_tok, t5_tok = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder, text_encoder_2 = tiny_clip(clip_tok, True), tiny_clip(clip_tok, True)
        text_encoder_3 = tiny_t5(t5_tok)
        # pooled = both CLIP projections (16 + 16); joint_attention_dim = T5's d_model. Position table 64×64 patches:
        # images up to 512×512, the size of vLLM-Omni's start-up warm-up (a server of a smaller table never starts)
        transformer = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                            attention_head_dim=8, num_attention_heads=4, joint_attention_dim=32,
                                            caption_projection_dim=32, pooled_projection_dim=32, pos_embed_max_size=64,
                                            dual_attention_layers=(0,), qk_norm="rms_norm")
        # SD3.5's shift factor; its scaling factor (1.5305) would shrink the latents the random decoder sees until the
        # brightness reward barely moves. Rise in 30 iterations, in iteration-0 within-batch stds: without CFG 4.4 and
        # 2.6 (seeds 0, 1) against 5.5 and 5.1 with 0.5; with CFG 4.5 (seed 0) 0.7 against 22
        vae = tiny_vae(scaling_factor=0.5, shift_factor=0.0609)
    return StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER),
                                    vae=vae, text_encoder=text_encoder, tokenizer=clip_tok,
                                    text_encoder_2=text_encoder_2, tokenizer_2=clip_tok,
                                    text_encoder_3=text_encoder_3, tokenizer_3=t5_tok)


class SD3(Adapter):
    """SD3.5 around StableDiffusion3Pipeline. Latents as the pipeline keeps them, (B, C, H/8, W/8) at full size,
    here in float32 (cast to the model dtype at the transformer's input); standard CFG in one batched call."""
    pipeline_class = "StableDiffusion3Pipeline"
    default_path = "stabilityai/stable-diffusion-3.5-medium"
    omni_pipeline_class = "omni.pipeline.FlowGRPOSD3Pipeline"
    # Flow-GRPO's SD3 LoRA targets (scripts/train_sd3.py): the joint attention's projections, both streams.
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    build_tiny = staticmethod(build_tiny_sd3_pipeline)

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        raise ValueError(f"--sp: --model {model} has no sequence parallelism: diffusers 0.42.1 has no context-parallel "
                         "plan for SD3Transformer2DModel, and its JointAttnProcessor2_0 calls SDPA itself, outside the "
                         "dispatcher that does the all-to-alls. Use --sp 1 (FSDP2 alone: SD3.5 at 512² has 1024 image "
                         "tokens)")

    @classmethod
    def check_size(cls, model: str, spec: Spec, transformer, height: int, width: int, num_frames: int = 1) -> None:
        """SD3's transformer crops its position embedding from a table of `pos_embed_max_size` patches a side (SD3.5
        Medium's 384, the tiny one's 64): a larger image fails its first call. Unknown here (no config): unchecked."""
        table = getattr(getattr(transformer(), "config", None), "get", lambda k: None)("pos_embed_max_size")
        for flag, side in (("--height", height), ("--width", width)):
            if table and side // spec.multiple > table:
                raise ValueError(f"{flag} must be at most {table * spec.multiple} for --model {model}, got {side}: its "
                                 f"transformer's position table (pos_embed_max_size) holds {table} patches a side")

    def __init__(self, pipe, device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        self.multiple = pipe.vae_scale_factor * self.transformer.config.patch_size
        # Flow-GRPO encodes with T5 length 128 (the pipeline's default is 256); the tiny T5 has 77
        self.max_sequence_length = min(128, pipe.tokenizer_3.model_max_length)

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, C, H/f, W/f) float32, as the pipeline's `prepare_latents`."""
        return self.pipe.prepare_latents(len(generators), self.transformer.config.in_channels, height, width,
                                         torch.float32, self.device, generators)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """`embeds` (B, 77 + L, D): both CLIPs' penultimate states side by side, zero-padded to T5's width, then
        T5's; `pooled` (B, P): both CLIPs' projected pooled outputs. The pipeline's own `encode_prompt`."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompts, None, None, device=self.device,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=self.max_sequence_length)
        return {"embeds": embeds.to(self.dtype), "pooled": pooled.to(self.dtype)}

    @property
    def blocks(self) -> list[torch.nn.Module]:
        return list(self.transformer.transformer_blocks)

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """Each frozen text encoder's layers, then its root."""
        p = self.pipe
        return [*p.text_encoder.text_model.encoder.layers, p.text_encoder,
                *p.text_encoder_2.text_model.encoder.layers, p.text_encoder_2, *p.text_encoder_3.encoder.block,
                p.text_encoder_3]

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, C, h, w) with standard CFG when cfg_scale > 1: one transformer call on [uncond; cond]
        (2B), v = v_u + w·(v_c − v_u), exactly as the pipeline. cond: `embeds`, `pooled` (+ `neg_` ones)."""
        # = scheduler.timesteps, float32 (σ may come from the CPU: the schedule lives there)
        timestep = sigma.to(self.device, torch.float32) * self.scheduler.config.num_train_timesteps
        x, embeds, pooled = x.to(self.dtype), cond["embeds"], cond["pooled"]
        if cfg_scale > 1:
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
            embeds, pooled = torch.cat([cond["neg_embeds"], embeds]), torch.cat([cond["neg_pooled"], pooled])
        v = self.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds,
                             pooled_projections=pooled, return_dict=False)[0]
        if cfg_scale > 1:
            v_uncond, v_text = v.chunk(2)
            v = v_uncond + cfg_scale * (v_text - v_uncond)
        return v

    def pipeline_kwargs(self, cond: dict, cfg_scale: float) -> dict:
        """The `StableDiffusion3Pipeline.__call__` arguments that sample from exactly these conditions."""
        kw = dict(prompt_embeds=cond["embeds"], pooled_prompt_embeds=cond["pooled"], guidance_scale=cfg_scale)
        if cfg_scale > 1:
            kw |= dict(negative_prompt_embeds=cond["neg_embeds"], negative_pooled_prompt_embeds=cond["neg_pooled"])
        return kw

    def omni_request(self, cfg_scale: float, negative_prompt: str) -> dict:
        """The vLLM-Omni request fields that guide as `velocity` does: its SD3 runs CFG when guidance_scale > 1,
        with the request's negative prompt ("" if none is sent)."""
        return {"guidance_scale": cfg_scale, **({"negative_prompt": negative_prompt} if cfg_scale > 1 else {})}

    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_scaled(self.pipe, x)
