"""Wan2.1 text-to-video (`wan2.1-t2v-1.3b`, `tiny-wan`) around diffusers' WanPipeline: UMT5 prompt embeddings
(zero-padded, no mask), 5-D video latents (B, C, F', H/8, W/8) with F' = (F − 1)/4 + 1 latent frames, standard CFG in
two transformer passes, the VAE's per-channel mean/std normalisation. docs/algorithm.md §13.

The sampler. The Wan checkpoints ship a UniPC multistep scheduler; this project's steps are Euler/SDE steps on a
flow-matching σ schedule (scheduler.py), so the adapter puts diffusers' FlowMatchEulerDiscreteScheduler (Wan's shift
3.0) into the pipeline, set to the σ table of the public Wan trainers (`wan_scheduler`). The ODE path then equals
`WanPipeline.__call__` run with that same scheduler bit for bit (tests/test_wan.py).
"""
import functools

import numpy as np
import torch

from models_base import Adapter, Spec, tiny_t5, tiny_t5_tokenizer

# FlowMatchEulerDiscreteScheduler's config: Wan's shift 3.0 (diffusers' Wan default for 480p, the `flow_shift` of the
# 1.3B checkpoint's UniPC config, DanceGRPO's --shift 3), σ·1000 as the timestep.
WAN_SCHEDULER = dict(shift=3.0, num_train_timesteps=1000)
MAX_SEQUENCE_LENGTH = 512  # WanPipeline.__call__'s text length, and Flow-GRPO's Wan script's


@functools.lru_cache(maxsize=1)
def wan_scheduler_class() -> type:
    """FlowMatchEulerDiscreteScheduler on the σ table of the public Wan trainers, σ_i = s(1 − i/N), i = 0 … N, s(t) =
    3t/(1 + 2t): `set_timesteps(N)` passes linspace(1, 1/N, N) as QwenImagePipeline and FluxPipeline do (DanceGRPO's
    table; vLLM-Omni's Euler Wan sampler's; Flow-GRPO's UniPC table within 0.003). diffusers' own table for the
    same config ends at s(0.003) = 0.009 instead of s(1/N) (0.136 at N = 20): docs/algorithm.md §13."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class WanEulerScheduler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, **kwargs):
            if sigmas is None and num_inference_steps:
                sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
            super().set_timesteps(num_inference_steps, device, sigmas, **kwargs)
    return WanEulerScheduler


def build_tiny_wan_pipeline(seed: int = 0):
    """A random-weight WanPipeline with Wan2.1's structure at toy size: a UMT5 text encoder and the tiny T5 tokenizer
    (models_base.py), a 2-block WanTransformer3DModel (RMS q/k norm across heads, 3-D rope, cross-attention to the text;
    the sizes of diffusers' own Wan test dummies), a 2-level AutoencoderKLWan (4× in space, 4× in time, Wan's latent
    mean/std), diffusers' Euler scheduler (saved as such; the adapter sets its table). Deterministic given `seed`;
    leaves the global RNG untouched."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    tokenizer = tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = tiny_t5(tokenizer, umt5=True)
        transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                            in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                            num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                            rope_max_seq_len=64)
        # The real VAE has 3 levels (8× in space); 2 keep 32² frames at 8×8 latents. Its scale factors are config.
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1], num_res_blocks=1,
                               temperal_downsample=[True, True], scale_factor_spatial=4, scale_factor_temporal=4)
        frame_wise_decoder(vae)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER))


@torch.no_grad()
def frame_wise_decoder(vae) -> None:
    """Make a random Wan VAE's decoder decode each latent frame on its own, as a trained one nearly does: its causal
    convolutions see only the current frame (their taps on earlier frames zeroed), and each temporal upsampling repeats
    its frame (both halves of its `time_conv` the same). With random weights those taps and halves decode every frame
    differently whatever the latents (the same latent frame three times moved as much as three independent ones):
    motion would be the decoder's, not the video's. Here frames change only where latent frames do (docs/algorithm.md
    §13)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
    for module in vae.decoder.modules():
        if isinstance(module, WanCausalConv3d):
            module.weight[:, :, :-1] = 0  # (out, in, t, h, w): the last tap is the current frame
        if hasattr(module, "time_conv"):  # (2·C, C, 3, 1, 1) → two frames of C channels
            half = module.time_conv.weight.shape[0] // 2
            module.time_conv.weight[half:] = module.time_conv.weight[:half]
            module.time_conv.bias[half:] = module.time_conv.bias[:half]


def check_wan21(config: dict, where: str) -> None:
    """A WanPipeline config (model_index.json's, or a loaded pipeline's) that sets Wan2.2's second expert or per-token
    timesteps samples otherwise than this adapter (one transformer, one timestep a call): refused, not sampled wrong."""
    extra = [k for k in ("transformer_2", "boundary_ratio", "expand_timesteps")  # model_index.json: [null, null]
             if config.get(k) not in (None, False, [None, None])]
    if extra:
        raise ValueError(f"{where} is a Wan2.2 pipeline ({', '.join(extra)} set), which the Wan adapter does not sample "
                         "(one transformer, one timestep a call): give a Wan2.1 checkpoint")


class Wan(Adapter):
    """Wan2.1 T2V around WanPipeline. Latents as the pipeline keeps them, (B, C, F', h, w), float32 (cast to the model
    dtype at the transformer's input); decoded samples are videos (B, F, 3, H, W) in [0, 1] (docs/algorithm.md §13)."""
    pipeline_class = "WanPipeline"
    default_path = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    omni_pipeline_class = "omni.pipeline.FlowGRPOWanPipeline"
    # Flow-GRPO's Wan LoRA targets (scripts/train_wan2_1.py) that a text-to-video Wan has (add_k_proj, add_v_proj exist
    # only in image-to-video Wan; add_q_proj, to_add_out in neither): the q/k/v projections of its self- and
    # cross-attention. `to_out.0` is left out, as for Qwen-Image: vLLM-Omni's Wan has one `to_out` layer and refuses it.
    lora_targets = ("to_q", "to_k", "to_v")
    build_tiny = staticmethod(build_tiny_wan_pipeline)

    def __init__(self, pipe, device, dtype: torch.dtype, num_frames: int = 1):
        check_wan21(dict(pipe.config, transformer_2=getattr(pipe, "transformer_2", None)), "the pipeline")
        pipe.scheduler = wan_scheduler_class()(**WAN_SCHEDULER)  # in place of the checkpoint's UniPC
        super().__init__(pipe, device, dtype)
        self.num_frames = num_frames
        self.max_sequence_length = min(MAX_SEQUENCE_LENGTH, pipe.tokenizer.model_max_length)  # the tiny one has 77

    def sample_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (self.num_frames, 3, height, width)

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """The video tokens, F'·(H/p)·(W/p) (`image_seq_len`'s count, from the model's name: p the VAE's spatial factor
        × the 2×2 patch): WanTransformer3DModel's context-parallel plan splits them and their rope at the first block
        and gathers them at `proj_out`; the text enters by cross-attention and is not split (docs/algorithm.md §14)."""
        frames = (num_frames - 1) // spec.frame_multiple + 1
        return {"video tokens": frames * (height // spec.multiple) * (width // spec.multiple)}

    @classmethod
    def check_size(cls, model: str, spec: Spec, transformer, height: int, width: int, num_frames: int = 1) -> None:
        """diffusers' WanRotaryPosEmbed holds `rope_max_seq_len` positions per axis (its default 1024; tiny-wan's 64):
        more latent frames (÷ p_t), rows or columns of patches than that crash the first transformer call."""
        cfg = getattr(transformer(), "config", {})  # diffusers' defaults when the config is not on this machine
        table, p_t, k = cfg.get("rope_max_seq_len", 1024), cfg.get("patch_size", (1, 2, 2))[0], spec.frame_multiple
        grid = {"--num-frames": (num_frames, ((num_frames - 1) // k + 1) // p_t, (table * p_t + p_t - 2) * k + 1),
                "--height": (height, height // spec.multiple, table * spec.multiple),
                "--width": (width, width // spec.multiple, table * spec.multiple)}
        for flag, (value, n, most) in grid.items():
            if n > table:
                raise ValueError(f"{flag} must be at most {most} for --model {model}, got {value}: its transformer's "
                                 f"rotary position table (rope_max_seq_len) holds {table} positions per axis")

    def side_multiple(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.transformer.config.patch_size[1]

    def latent_frames(self) -> int:
        return (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1

    def image_seq_len(self, height: int, width: int) -> int:
        """Video tokens the transformer's self-attention sees: latent frames × (H/16)·(W/16)."""
        return self.latent_frames() * super().image_seq_len(height, width)

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per video: (B, C, F', h, w) float32, as the pipeline's `prepare_latents`."""
        return self.pipe.prepare_latents(len(generators), self.transformer.config.in_channels, height, width,
                                         self.num_frames, torch.float32, self.device, generators)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """`embeds` (B, L, D): UMT5's states of the cleaned prompt, zero past its tokens. The pipeline's own
        `encode_prompt` (no mask: the transformer attends to the zeros, as in the pipeline)."""
        embeds, _ = self.pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=self.device,
                                            max_sequence_length=self.max_sequence_length)
        return {"embeds": embeds.to(self.dtype)}

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The transformer's blocks: self-attention over the one sequence of video tokens, cross-attention, MLP."""
        return list(self.transformer.blocks)

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """The frozen UMT5's layers, then its root."""
        return [*self.pipe.text_encoder.encoder.block, self.pipe.text_encoder]

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, C, F', h, w) with standard CFG when cfg_scale > 1: a conditional and an unconditional
        transformer call, v = v_u + w·(v_c − v_u), exactly as the pipeline makes them. cond: `embeds`, `neg_embeds`."""
        # = scheduler.timesteps, float32 (σ may come from the CPU: the schedule lives there)
        timestep = sigma.to(self.device, torch.float32) * self.scheduler.config.num_train_timesteps
        x = x.to(self.dtype)
        v = self.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond["embeds"],
                             return_dict=False)[0]
        if cfg_scale > 1:
            v_uncond = self.transformer(hidden_states=x, timestep=timestep, encoder_hidden_states=cond["neg_embeds"],
                                        return_dict=False)[0]
            v = v_uncond + cfg_scale * (v - v_uncond)
        return v

    def pipeline_kwargs(self, cond: dict, cfg_scale: float) -> dict:
        """The `WanPipeline.__call__` arguments that sample from exactly these conditions."""
        kw = dict(prompt_embeds=cond["embeds"], guidance_scale=cfg_scale, num_frames=self.num_frames)
        return kw | (dict(negative_prompt_embeds=cond["neg_embeds"]) if cfg_scale > 1 else {})

    def omni_request(self, cfg_scale: float, negative_prompt: str) -> dict:
        """The vLLM-Omni request fields that guide as `velocity` does (its Wan runs CFG when guidance_scale > 1 and
        a negative prompt is given)."""
        return {"guidance_scale": cfg_scale, **({"negative_prompt": negative_prompt} if cfg_scale > 1 else {})}

    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents (B, C, F', h, w) → videos (B, F, 3, H, W) float32 in [0, 1]: x·std + mean per channel, the VAE,
        the pipeline's video post-processing (its exact arithmetic)."""
        vae = self.pipe.vae
        z = x.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(z)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(z)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float().cpu()
