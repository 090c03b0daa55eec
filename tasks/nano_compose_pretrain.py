"""nano-compose's base model: Qwen-Image's classes at 32×32, pretrained in gated stages on the task's renders (the VAE,
its decoder alone, then the transformer), each stage's gate read by the task's judge; what it reached written beside it.

    python -m tasks.nano_compose pretrain [--out DIR] [--transformer-steps N ...]   # defaults: PRETRAIN (the shipped)

Between tasks/nano_compose_render.py, whose renders (`pool`) it trains on, and tasks/nano_compose.py (the task: judge,
reward, evaluation), whose CLI runs it and hands it the judge and the evaluation that gate its stages: imports run one
way, from the task's file to this.
"""
import json
import math
import os
import sys
import time
from typing import Callable

import numpy as np
import torch

import models_nano
from tasks import nano, pretraining
from tasks.nano_compose_render import CATEGORIES, SIDE, pool

# Qwen-Image's classes (docs/tasks.md): a VAE 4× down to 8×8×8 latents (1.80 M parameters), its decoder then trained
# alone, and a transformer of 16 tokens (2×2 patches). 8 channels are the latents this transformer learns within the
# budget (32, which a VAE reconstructs more easily, it learns far slower); the decoder's own stage brings the judge on
# its reconstructions to ≥ 90% in every category (gate (a)).
VAE = dict(base_dim=16, z_dim=8, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, False])
TRANSFORMER = dict(patch_size=2, in_channels=32, out_channels=8, num_layers=6, attention_head_dim=32,
                   num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 12, 12))
PRETRAIN = dict(seed=0, pool_size=20000, vae_steps=1500, vae_batch=32, vae_lr=2e-3, bright=10.0, kl_weight=1e-4,
                decoder_steps=3000, decoder_lr=1e-3, transformer_steps=10000, transformer_batch=64,
                transformer_lr=1e-3, warmup=200, clip=1.0, ema=0.995, curve_every=1000, curve_per_category=30)


def to_x(images: np.ndarray) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> (N, 3, H, W) in [−1, 1], as the VAE takes images."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1


def pretrain(out: str, judge: Callable, evaluate: Callable, per_cat: int = 50, *, seed: int, pool_size: int,
             vae_steps: int, vae_batch: int, vae_lr: float, bright: float, kl_weight: float, decoder_steps: int,
             decoder_lr: float, transformer_steps: int, transformer_batch: int, transformer_lr: float, warmup: int,
             clip: float, ema: float, curve_every: int, curve_per_category: int) -> dict:
    """Train the VAE, its decoder alone, then the transformer, on train renders; write them to `out` (vae/,
    transformer/: diffusers' format, float16) for `--model nano-compose --model-path out`; return what each stage
    reached (out/pretrain.json). The task's gates: `judge(uint8 images, prompts)` -> {category: the judge's mean,
    "overall": their mean} (gate (a)); `evaluate(pipe, per_category)` -> a pipeline's figures on the held-out prompts
    (gates (b) and (c))."""
    used = {k: v for k, v in locals().items() if k in PRETRAIN or k.startswith("per_")}  # the values given
    pretraining.check_out(out)
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    report = {"command": " ".join(["python -m tasks.nano_compose pretrain", *sys.argv[2:]]), "config": used}

    # 1. VAE on renders whose every glyph takes a random palette colour (so that no colour is rare), the error weighed
    #    1 + bright·ink (the canvas is mostly black: unweighted, black is the best first answer), the decoder read
    #    before its clamp, lr warmed up over 50 steps then cosine to a tenth; gate (a): the judge on held-out
    #    reconstructions
    start, x = time.process_time(), to_x(pool(pool_size, seed, any_colour=True)[0])
    vae = AutoencoderKLQwenImage(**VAE, latents_mean=[0.0] * VAE["z_dim"], latents_std=[1.0] * VAE["z_dim"])

    def train(steps: int, lr: float) -> list[float]:
        return pretraining.train_vae(
            vae, lambda n, g: x[torch.randint(len(x), (n,), generator=g)], steps, vae_batch, lr, kl_weight, gen,
            weigh=lambda b: (w := 1 + bright * (b.amax(1, keepdim=True) + 1) / 2) / w.mean(), clip=clip, unclamped=True,
            schedule=lambda s: min(1.0, (s + 1) / 50) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s / steps, 1)))))
    losses = train(vae_steps, vae_lr)
    # ... then the decoder alone, the encoder frozen (as Stable Diffusion's fine-tuned decoders were made): it learns to
    # read more of the same latents, which stay as learnable as an 8-channel encoder makes them (docs/tasks.md)
    vae.decoder.requires_grad_(True)
    vae.post_quant_conv.requires_grad_(True)
    losses += train(decoder_steps, decoder_lr) if decoder_steps else []
    held, held_prompts = pool(100 * len(CATEGORIES), 10_000 + seed, held_out=True)
    with torch.no_grad():
        recon = pretraining.decode(vae, pretraining.latents(vae, to_x(held), chunk=500)[0][:, :, None])[:, :, 0]
    judged = judge(nano.quantised((recon + 1) / 2), held_prompts)
    pretraining.reached(report, "vae", steps=vae_steps, decoder_steps=decoder_steps, first_mse=np.mean(losses[:10]),
                        last_mse=np.mean(losses[-20:]), cpu_seconds=time.process_time() - start,
                        **{f"judge_on_reconstructions/{k}": v for k, v in judged.items()})

    # 2. Transformer: rectified flow on the latents of other train renders (pretraining.train_transformer), each with
    #    its prompt
    start, (images, prompts) = time.process_time(), pool(pool_size, 1000 + seed)
    mu_z, std_z = pretraining.latents(vae, to_x(images), chunk=500)  # (N, 8, 8, 8)
    vae.register_to_config(latents_mean=mu_z.mean((0, 2, 3)).tolist(), latents_std=mu_z.std((0, 2, 3)).tolist())
    texts = sorted(set(prompts))
    index = {p: i for i, p in enumerate(texts)}
    labels = torch.tensor([index[p] for p in prompts])
    pipe = models_nano.build_nano_pipeline(None, vae=vae, transformer=QwenImageTransformer2DModel(**TRANSFORMER))
    pipe.set_progress_bar_config(disable=True)
    report["curve"], measuring = [], [0.0]  # gate (b): the EMA weights judged every curve_every steps; their CPU time

    def measure(step: int) -> None:
        t = time.process_time()
        report["curve"].append({"step": step, "cpu_seconds": t - start - measuring[0],
                                **evaluate(pipe, curve_per_category)})
        measuring[0] += time.process_time() - t
        print("curve:", json.dumps({k: round(float(v), 4) for k, v in report["curve"][-1].items()}), flush=True)
    losses = pretraining.train_transformer(pipe, mu_z, std_z, labels, texts, SIDE, transformer_steps,
                                           transformer_batch, transformer_lr, ema, gen, warmup=warmup, clip=clip,
                                           measure=measure, measure_every=curve_every)
    pretraining.reached(report, "transformer", steps=transformer_steps, first_loss=np.mean(losses[:10]),
                        last_loss=np.mean(losses[-20:]), cpu_seconds=time.process_time() - start - measuring[0])

    # 3. Write, then measure what was written: gate (c), the held-out prompts' judge per category
    pretraining.save_parts(out, vae=vae, transformer=pipe.transformer)
    pretraining.reached(report, "base model", **evaluate(nano.load(out), per_cat))
    pretraining.save_report(out, report)
    return report
