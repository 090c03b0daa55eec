"""FLUX.2 [klein] (`flux.2-klein`: the step-distilled black-forest-labs/FLUX.2-klein-9B; `flux.2-klein-base`, its
undistilled base with CFG; `tiny-flux.2-klein`, the same classes at toy size, random weights) around diffusers'
Flux2KleinPipeline: packed latents (B, S, 4C) normalised by the VAE's batch-norm statistics, 4-axis position ids, the
prompt as three Qwen3 layers' states side by side (512 tokens, padding attended to as the pipeline does), no guidance
embedding, standard two-pass CFG with the negative prompt (the base model; the distilled one takes none).

The σ table is the pipeline's: linspace(1, 1/N, N) shifted with FLUX.2's `compute_empirical_mu`, which depends on the
image tokens and on N. scheduler.sigma_schedule derives mu with FLUX.1's rule instead, from the token count alone; the
adapter's own scheduler (`klein_scheduler_class`) takes the token count back out of that mu (the rule is linear in it)
and applies FLUX.2's, so that the ODE path equals `Flux2KleinPipeline.__call__` bit for bit (tests/test_models_zimage_flux2.py).
"""
import functools

import numpy as np
import torch

from models_base import Adapter, Spec
from models_qwen import last_logit_only, qwen_tokenizer_dir

# black-forest-labs/FLUX.2-klein's scheduler config (exponential dynamic shift); the tiny model uses it too
KLEIN_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential",
                       base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline's text length (every prompt padded to it), and Flow-Factory's
TINY_TEXT_LENGTH = 64  # the tiny twin's (its tokenizer's model_max_length): the toy's prompts fit, 28 layers stay cheap
TEXT_LAYERS = (9, 18, 27)  # the Qwen3 layers whose states make the prompt embedding (the pipeline's default)


@functools.lru_cache(maxsize=1)
def klein_scheduler_class() -> type:
    """FlowMatchEulerDiscreteScheduler on Flux2KleinPipeline's table. `sigma_schedule` passes mu = m·L + b (FLUX.1's
    calculate_shift of L image tokens, over this config's four values); L comes back exactly by rounding, and mu is
    recomputed as the pipeline computes it, compute_empirical_mu(L, N)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    class KleinScheduler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
            steps, cfg = num_inference_steps or len(sigmas), self.config
            if mu is not None:
                slope = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
                tokens = round((mu - (cfg.base_shift - slope * cfg.base_image_seq_len)) / slope)
                mu = compute_empirical_mu(image_seq_len=tokens, num_steps=steps)
            super().set_timesteps(device=device, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return KleinScheduler


def build_tiny_klein_pipeline(seed: int = 0):
    """A random-weight Flux2KleinPipeline with FLUX.2 [klein]'s structure at toy size: a 28-layer Qwen3 causal LM
    (hidden 16, so that layers 9, 18 and 27 exist as in the real one; the real Qwen BPE tokenizer of models_qwen.py), a
    Flux2Transformer2DModel with 1 double- and 2 single-stream blocks (2 heads of 16, 4 rope axes of 4, no guidance
    embedding), a 3-level AutoencoderKLFlux2 (4× downsampling, 4 latent channels: 16 after its 2×2 patching, whose
    batch-norm statistics stay 0 and 1). The base model's form: CFG applies. Deterministic given `seed`; leaves the
    global RNG untouched."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3ForCausalLM
    tokenizer = Qwen2Tokenizer.from_pretrained(qwen_tokenizer_dir(), model_max_length=TINY_TEXT_LENGTH)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                                    num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=2,
                                                    head_dim=8, max_position_embeddings=1024, tie_word_embeddings=True))
        transformer = Flux2Transformer2DModel(in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                                              num_attention_heads=2, joint_attention_dim=3 * 16,
                                              axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
        vae = AutoencoderKLFlux2(block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
                                 up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=4,
                                 norm_num_groups=2, use_quant_conv=False, use_post_quant_conv=False)
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**KLEIN_SCHEDULER), vae=vae,
                              text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


class Flux2Klein(Adapter):
    """FLUX.2 [klein] around Flux2KleinPipeline. Latents as the pipeline keeps them, packed (B, S, 4C) with
    S = (H/16)·(W/16), float32, cast to the model dtype at the transformer's input."""
    pipeline_class = "Flux2KleinPipeline"
    default_path = "black-forest-labs/FLUX.2-klein-base-9B"
    omni_pipeline_class = "omni.pipeline_2026.FlowGRPOFlux2KleinPipeline"
    # the distilled checkpoints take no CFG (model_checks.check_model_args refuses --cfg-scale > 1)
    step_distilled = False
    # Flow-Factory's FLUX.2 klein LoRA targets (models/flux/flux2_klein.py): both streams' attention and MLPs, and the
    # single-stream blocks' fused qkv+MLP input and output projections
    lora_targets = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                    "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                    "ff_context.linear_out", "attn.to_qkv_mlp_proj")
    build_tiny = staticmethod(build_tiny_klein_pipeline)

    def __init__(self, pipe, device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        self.scheduler = klein_scheduler_class().from_config(pipe.scheduler.config)  # the σ table only; the pipe's own
        pipe.text_encoder.register_forward_pre_hook(last_logit_only, with_kwargs=True)  # its states only are read
        self.max_sequence_length = min(MAX_SEQUENCE_LENGTH, pipe.tokenizer.model_max_length)
        self.distilled = bool(pipe.config.get("is_distilled", False))  # its pipeline then ignores guidance

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        """Image tokens and the 512 text tokens (the tiny twin's 64): Flux2Transformer2DModel's context-parallel plan
        splits both (and their position ids) at the model's input and gathers at `proj_out` (docs/algorithm.md §14)."""
        return {"image tokens": (height // spec.multiple) * (width // spec.multiple),
                "text tokens": TINY_TEXT_LENGTH if model.startswith("tiny") else MAX_SEQUENCE_LENGTH}

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, S, 4C) float32, as the pipeline's `prepare_latents` draws it, laid
        out contiguously (its packing is a transposed view; the stored trajectory is contiguous, and a reduction over
        the other layout rounds differently: the first update's log-probs would differ by an ulp)."""
        return self.pipe.prepare_latents(len(generators), self.transformer.config.in_channels // 4, height, width,
                                         torch.float32, self.device, generators)[0].contiguous()

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """`embeds` (B, L, 3D), L = 512: the pipeline's `encode_prompt` (chat template, Qwen3 layers 9, 18, 27)."""
        embeds, _ = self.pipe.encode_prompt(list(prompts), device=self.device,
                                            max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=TEXT_LAYERS)
        return {"embeds": embeds.to(self.dtype)}

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """Double-stream blocks, then single-stream blocks."""
        return [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """The frozen Qwen3's layers, then its root."""
        return [*self.pipe.text_encoder.model.layers, self.pipe.text_encoder]

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, S, 4C), two-pass CFG v_u + w·(v_c − v_u) when cfg_scale > 1, as the pipeline makes it: the time
        input σ·1000 cast to the latent dtype, then divided by 1000; no guidance embedding. cond: `embeds` (+
        `neg_embeds`)."""
        if cfg_scale > 1 and self.distilled:
            raise ValueError(f"--cfg-scale must be 1 for a step-distilled FLUX.2 [klein] (this --model-path's pipeline "
                             f"runs no CFG), got {cfg_scale}: use --model flux.2-klein, or a base checkpoint")
        t = (sigma.to(self.device, torch.float32) * self.scheduler.config.num_train_timesteps).to(self.dtype) / 1000
        grid = torch.empty(x.shape[0], 0, height // self.multiple, width // self.multiple)
        img_ids = self.pipe._prepare_latent_ids(grid).to(self.device)
        x = x.to(self.dtype)

        def forward(embeds):
            txt_ids = self.pipe._prepare_text_ids(embeds).to(self.device)
            return self.transformer(hidden_states=x, timestep=t, guidance=None, encoder_hidden_states=embeds,
                                    txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]
        v = forward(cond["embeds"])
        if cfg_scale > 1:
            v_uncond = forward(cond["neg_embeds"])
            v = v_uncond + cfg_scale * (v - v_uncond)
        return v

    def omni_request(self, cfg_scale: float, negative_prompt: str) -> dict:
        """The vLLM-Omni request fields that guide as `velocity` does: two-pass CFG when guidance_scale > 1, with the
        request's negative prompt (omni/pipeline_2026.py encodes it; 0.30.0's own pipeline encodes "")."""
        return {"guidance_scale": cfg_scale, **({"negative_prompt": negative_prompt} if cfg_scale > 1 else {})}

    def pipeline_kwargs(self, cond: dict, cfg_scale: float) -> dict:
        """The `Flux2KleinPipeline.__call__` arguments that sample from exactly these conditions."""
        kw = dict(prompt_embeds=cond["embeds"], guidance_scale=cfg_scale)
        return kw | (dict(negative_prompt_embeds=cond["neg_embeds"]) if cfg_scale > 1 else {})

    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents (B, S, 4C) → images (B, 3, H, W) float32 in [0, 1], as the pipeline decodes: unpacked, the
        batch-norm statistics undone, unpatchified, the VAE."""
        pipe, vae = self.pipe, self.pipe.vae
        h, w = height // self.multiple, width // self.multiple
        z = pipe._unpack_latents_with_ids(x, pipe._prepare_latent_ids(torch.empty(x.shape[0], 0, h, w)).to(x.device),
                                          h, w)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        image = vae.decode(pipe._unpatchify_latents(z * std + mean).to(vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt").float().cpu()


class Flux2KleinDistilled(Flux2Klein):
    """The step-distilled FLUX.2 [klein] (4 steps, no CFG: its pipeline ignores guidance, and so is --cfg-scale > 1
    refused here)."""
    default_path = "black-forest-labs/FLUX.2-klein-9B"
    step_distilled = True
