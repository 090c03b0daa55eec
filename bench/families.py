"""bench/families.py: the 2026 families (Qwen-Image 2.1, Z-Image, FLUX.2 [klein]) at their real architecture with
random weights for bench/gpu.py --random-init, and the FLOPs of a velocity call as torch counts them.

Each family's adapter runs unchanged on a pipeline whose transformer and VAE are the published architectures built
from their configs (random weights, bf16, on the device) and whose text encoder is the tiny twin's: it gives each
prompt its true token count and mask through the pipeline's own template; the states are then replaced by random ones
at the real width (as bench_gpu.RandomText for Qwen-Image). `tiny-<family>`: the tiny twin whole (the dry run)."""
import dataclasses
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import models

# FLUX.1's VAE, which Z-Image's pipeline ships (an AutoencoderKL of 16 latent channels, 8× downsampling: 4 levels of
# 128-256-512-512, 2 residual blocks, no quant convs, scaling 0.3611 and shift 0.1159; models_zimage.py's tiny twin
# takes the same factors); diffusers' AutoencoderKL defaults are SD's 1-level toy, so the config is written out
FLUX1_VAE = dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                 block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16, sample_size=1024,
                 scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
# FLUX.2 [klein] 9B (models_flux2.py's default checkpoints; diffusers' defaults are FLUX.2 [dev], 32 B): 8 double-
# and 24 single-stream blocks of 32 heads × 128, the text 3 × 4096 wide (Qwen3-8B's layers 9, 18, 27), no guidance input
KLEIN_9B = dict(num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                guidance_embeds=False)


@dataclasses.dataclass(frozen=True)
class Family:
    transformer: Callable[[], torch.nn.Module]  # the published architecture, built where torch's defaults say
    vae: Callable[[], torch.nn.Module]  # the family's real VAE: its latent channels are the transformer's input
    text_width: str  # the transformer config's name for the width of the text states it takes
    text_length: int = 0  # a fixed text length the tiny tokenizer must pad to (FLUX.2 [klein]: 512), 0: its own


def _family(name: str) -> Family:  # diffusers imported here, where a model is built (as models_*.py do)
    import diffusers as d
    return {  # diffusers' defaults are the published configs where no config is written (BENCHMARKS.md: counts)
        "qwen-image-2.1": Family(d.QwenImage21Transformer2DModel, d.AutoencoderKLQwenImage21, "context_in_dim"),
        "z-image": Family(d.ZImageTransformer2DModel, lambda: d.AutoencoderKL(**FLUX1_VAE), "cap_feat_dim"),
        "flux.2-klein": Family(lambda: d.Flux2Transformer2DModel(**KLEIN_9B), d.AutoencoderKLFlux2,
                               "joint_attention_dim", 512)}[name]


NAMES = ("qwen-image-2.1", "z-image", "flux.2-klein")


class RandomStates:
    """Mixed into a family's adapter: its `encode` (the tiny encoder: token counts, masks), the states random."""

    @torch.no_grad()
    def encode(self, prompts, *args):
        out = super().encode(prompts, *args)
        shape, width = out["embeds"].shape[:2], getattr(self.transformer.config, self.text_width)
        mask = out.get("mask", torch.ones(shape)).cpu()  # FLUX.2 [klein] attends to its padding: no mask
        e = torch.randn(*shape, width, generator=torch.Generator()) * mask[..., None]
        return out | {"embeds": e.to(self.device, self.dtype)}


def family_model(name: str, device: str):
    """`name`'s adapter (with RandomStates) on its tiny pipeline, whose transformer and VAE are replaced by the real
    architectures (bf16 on a GPU; weights from torch's global generator) unless `name` is tiny-<family>."""
    real = name.removeprefix("tiny-")
    family, adapter = _family(real), models.adapter_class(real)
    pipe = adapter.build_tiny(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    if name != real:
        dtype = torch.float32
    else:
        default, _ = torch.get_default_dtype(), torch.set_default_dtype(dtype)
        with torch.device(device):
            pipe = type(pipe)(**pipe.components | dict(transformer=family.transformer(), vae=family.vae()))
        torch.set_default_dtype(default)
        if family.text_length:
            pipe.tokenizer.model_max_length = family.text_length
    cls = type(f"Random{adapter.__name__}", (RandomStates, adapter), {"text_width": family.text_width})
    return cls(pipe, device, dtype)


def velocity_flops(model, a, prompt: str) -> float:
    """FLOPs (multiply-add = 2) of one `velocity` call for one image at a's size and CFG (every branch), with what is
    attached (LoRA), as torch.utils.flop_counter counts the call: the math SDPA backend, so that attention counts."""
    x = model.noise([torch.Generator()], a.height, a.width)
    c = model.conditioning([prompt], a.negative_prompt, a.cfg_scale, None, a.height, a.width)
    model.transformer.eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.velocity(x, torch.full((1,), 0.5, device=model.device), c, a.cfg_scale, a.height, a.width)
    return float(counter.get_total_flops())
