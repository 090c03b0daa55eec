"""Z-Image (`z-image`: Tongyi-MAI/Z-Image; `z-image-turbo`; `tiny-z-image`, the same classes at toy size, random
weights) around diffusers' ZImagePipeline: a single-stream DiT over the image patches and the prompt's Qwen3 states
(the second-to-last layer's, padding dropped: each prompt keeps its own length), unpacked latents (B, C, H/8, W/8), the
transformer's time input 1 − σ and its output the negative of the velocity, and CFG in Z-Image's own form
v_c + g·(v_c − v_u), which is `--cfg-scale` w = g + 1 in this project's form (docs/algorithm.md §11).

The σ table is the pipeline's: linspace(1, 1/N, N) computed by torch in float32 (`zimage_sigmas`), shifted by the
scheduler's config (Z-Image-Turbo's: a static shift 3). scheduler.sigma_schedule gives a scheduler without dynamic
shifting no table, and numpy's linspace where it has one; the adapter's own scheduler (`zimage_scheduler_class`) always
sets the pipeline's, so that the ODE path equals `ZImagePipeline.__call__` bit for bit (tests/test_models_zimage_flux2.py).
"""
import functools

import torch

from models_base import Adapter, Spec, decode_scaled, tiny_vae
from models_qwen import qwen_tokenizer_dir

# Tongyi-MAI/Z-Image-Turbo's scheduler config; the tiny model uses it too
ZIMAGE_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline.__call__'s default, and Flow-Factory's


def zimage_sigmas(num_steps: int) -> list[float]:
    """The pipeline's unshifted table (pipeline_z_image.get_default_z_image_sigmas): torch's float32 linspace."""
    return torch.linspace(1.0, 1 / num_steps, num_steps).tolist()


@functools.lru_cache(maxsize=1)
def zimage_scheduler_class() -> type:
    """FlowMatchEulerDiscreteScheduler whose `set_timesteps` always takes ZImagePipeline's table (`zimage_sigmas`), with
    or without sigmas given: the adapter's σ schedule (scheduler.sigma_schedule) is then the pipeline's."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    class ZImageScheduler(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, timesteps=None):
            steps = num_inference_steps or len(sigmas)
            super().set_timesteps(device=device, sigmas=zimage_sigmas(steps), mu=mu)
    return ZImageScheduler


def build_tiny_zimage_pipeline(seed: int = 0):
    """A random-weight ZImagePipeline with Z-Image's structure at toy size: a 2-layer Qwen3 text encoder (hidden 16;
    the real Qwen BPE tokenizer of models_qwen.py, whose 151,669-token table is most of the ~2.5 M parameters), a
    ZImageTransformer2DModel with one noise and one context refiner block and 2 main blocks (width 32, 2 heads of 16,
    its rope axes and tables), the tiny SD-style VAE of models_base.py (4 channels, 4×) with FLUX.1's VAE factors,
    which Z-Image's VAE shares. Deterministic given `seed`; leaves the global RNG untouched."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen2Tokenizer, Qwen3Config, Qwen3Model
    tokenizer = Qwen2Tokenizer.from_pretrained(qwen_tokenizer_dir())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                              head_dim=8, max_position_embeddings=1024))
        transformer = ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
                                               n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4])
        vae = tiny_vae(scaling_factor=0.3611, shift_factor=0.1159)
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**ZIMAGE_SCHEDULER), vae=vae,
                          text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


class ZImage(Adapter):
    """Z-Image around ZImagePipeline. Latents as the pipeline keeps them, (B, C, H/8, W/8) float32, cast to the model
    dtype at the transformer's input; the prompt states padded to the batch's longest with a `mask` (B, L) and unpadded
    again per image before the transformer, which takes each prompt at its own length as the pipeline gives it."""
    pipeline_class = "ZImagePipeline"
    default_path = "Tongyi-MAI/Z-Image"
    omni_pipeline_class = "omni.pipeline_2026.FlowGRPOZImagePipeline"
    max_sequence_length = MAX_SEQUENCE_LENGTH
    # Flow-Factory's Z-Image LoRA targets (models/z_image/z_image.py): attention and the SwiGLU MLP of every block
    lora_targets = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                    "feed_forward.w2", "feed_forward.w3")
    build_tiny = staticmethod(build_tiny_zimage_pipeline)

    def __init__(self, pipe, device, dtype: torch.dtype):
        super().__init__(pipe, device, dtype)
        self.scheduler = zimage_scheduler_class().from_config(pipe.scheduler.config)  # the σ table only; the pipe's own

    @classmethod
    def sp_sequences(cls, model: str, spec: Spec, height: int, width: int, num_frames: int = 1) -> dict[str, int]:
        raise ValueError(f"--sp: --model {model} has no sequence parallelism: diffusers 0.42.1 has no context-parallel "
                         "plan for ZImageTransformer2DModel; run without --sp (FSDP2 alone)")

    @classmethod
    def check_size(cls, model: str, spec: Spec, transformer, height: int, width: int, num_frames: int = 1) -> None:
        """ZImageTransformer2DModel's rotary tables hold `axes_lens` positions per axis (512 rows and 512 columns of
        2×2 patches): a larger image crashes its first call."""
        rows, columns = getattr(transformer(), "config", {}).get("axes_lens", [1024, 512, 512])[1:]
        for flag, side, table in (("--height", height, rows), ("--width", width, columns)):
            if side // spec.multiple > table:
                raise ValueError(f"{flag} must be at most {table * spec.multiple} for --model {model}, got {side}: its "
                                 f"transformer's rotary position table (axes_lens) holds {table} patches a side")

    def noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """x at σ = 1, one generator per image: (B, C, H/8, W/8) float32, as the pipeline's `prepare_latents`."""
        return self.pipe.prepare_latents(len(generators), self.transformer.config.in_channels, height, width,
                                         torch.float32, self.device, generators)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict:
        """`embeds` (B, L, D): each prompt's states through the pipeline's `encode_prompt` (chat template, padding to
        max_sequence_length dropped), zero-padded to the longest; `mask` (B, L) bool, True on a prompt's own tokens."""
        states, _ = self.pipe.encode_prompt(list(prompts), device=self.device, do_classifier_free_guidance=False,
                                            max_sequence_length=self.max_sequence_length)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.bool) for s in states], batch_first=True)
        return {"embeds": torch.nn.utils.rnn.pad_sequence(states, batch_first=True).to(self.dtype),
                "mask": mask.to(self.device)}

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """Every ZImageTransformerBlock: the image's refiners, the text's refiners, then the main blocks."""
        t = self.transformer
        return [*t.noise_refiner, *t.context_refiner, *t.layers]

    def text_encoder_shards(self) -> list[torch.nn.Module]:
        """The frozen Qwen3's layers, then its root."""
        return [*self.pipe.text_encoder.layers, self.pipe.text_encoder]

    def velocity(self, x, sigma, cond: dict, cfg_scale: float, height: int, width: int) -> torch.Tensor:
        """v(x, σ) (B, C, h, w). The pipeline's arithmetic: time input (1000 − σ·1000)/1000, one transformer call on the
        list of images (with CFG: conditional then unconditional, 2B), the outputs in float32, Z-Image's CFG
        v_c + (w − 1)·(v_c − v_u), and the sign flipped. cond: `embeds`, `mask` (+ `neg_` ones for CFG)."""
        t = sigma.to(self.device, torch.float32) * self.scheduler.config.num_train_timesteps
        t = (1000 - t) / 1000
        images = list(x.to(self.dtype).unsqueeze(2).unbind(0))  # (C, 1, h, w) each
        texts = [e[m] for e, m in zip(cond["embeds"], cond["mask"])]
        if cfg_scale > 1:
            images, t = images + images, t.repeat(2)
            texts += [e[m] for e, m in zip(cond["neg_embeds"], cond["neg_mask"])]
        out = torch.stack([o.float() for o in self.transformer(images, t, texts, return_dict=False)[0]])
        if cfg_scale > 1:
            pos, neg = out.chunk(2)
            out = pos + (cfg_scale - 1) * (pos - neg)
        return -out.squeeze(2)

    def omni_request(self, cfg_scale: float, negative_prompt: str) -> dict:
        """The vLLM-Omni request fields that guide as `velocity` does: its Z-Image runs CFG in Z-Image's form when
        guidance_scale g = w − 1 > 0 (always sent: it has no default there), with the request's negative prompt."""
        return {"guidance_scale": cfg_scale - 1, **({"negative_prompt": negative_prompt} if cfg_scale > 1 else {})}

    def pipeline_kwargs(self, cond: dict, cfg_scale: float) -> dict:
        """The `ZImagePipeline.__call__` arguments that sample from exactly these conditions (its guidance g = w − 1)."""
        kw = dict(prompt_embeds=[e[m] for e, m in zip(cond["embeds"], cond["mask"])], guidance_scale=cfg_scale - 1)
        if cfg_scale > 1:
            kw["negative_prompt_embeds"] = [e[m] for e, m in zip(cond["neg_embeds"], cond["neg_mask"])]
        return kw

    @torch.no_grad()
    def decode(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_scaled(self.pipe, x)


class ZImageTurbo(ZImage):
    """Z-Image-Turbo, the step-distilled Z-Image: the same classes, sampled in a few steps without CFG (its guidance
    is in its weights; --cfg-scale above 1 still runs Z-Image's CFG, as its pipeline does)."""
    default_path = "Tongyi-MAI/Z-Image-Turbo"
