"""What every laptop task's base model is trained with, step by step: the VAE's trainer, rectified flow for the
transformer on a training set's latents (conditioned on the frozen tiny text encoder, with an EMA of its weights), the
parts written in diffusers' format, and what each stage reached said as it ends. Each task's recipe is its own and
calls these: tasks/nano.py's `pretrain`, tasks/nano_compose_pretrain.py, tasks/nano_edit_pretrain.py.
"""
import functools
import json
import math
import os
import shutil

import numpy as np
import torch
from tqdm import tqdm

import atomic_files
import models_qwen


def one_thread(fn):
    """`fn` run on one torch thread, the caller's count restored after: how many threads split a convolution's or a
    matmul's sums changes the trained bits (from one seed, 1 and 2 threads wrote other weights), so a base is trained,
    and its latents' statistics taken, on one thread whatever OMP_NUM_THREADS says (as nano-compose's and nano-edit's
    shipped bases were)."""
    @functools.wraps(fn)
    def pinned(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return pinned


@one_thread
def train_vae(vae, draw, steps: int, batch: int, lr: float, kl_weight: float, gen: torch.Generator,
              weigh=None, schedule=None, clip: float = 0.0, unclamped: bool = False) -> list[float]:
    """Train `vae` (AutoencoderKLQwenImage) on batches `draw(n, gen)` -> images (n, 3, S, S) in [−1, 1]: reconstruction
    error (per pixel, weighted by `weigh(x)` if given, e.g. heavier on ink) + kl_weight · KL to N(0, 1). Options:
    `schedule(step)` multiplies lr, `clip` bounds the gradient norm, `unclamped` reads the decoder before its clamp to
    [−1, 1] (beyond which the clamp passes no gradient: a channel pushed below −1 early, e.g. red in a red glyph, never
    returns). Returns the (unweighted) MSE of each step."""
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    lr_at = torch.optim.lr_scheduler.LambdaLR(opt, schedule or (lambda step: 1.0))
    losses = []
    for _ in (bar := tqdm(range(steps), desc="pretrain vae", unit="step")):
        x = draw(batch, gen)[:, :, None]  # (n, 3, 1, S, S): the VAE takes one-frame videos
        posterior = vae.encode(x).latent_dist
        error = ((decode_unclamped if unclamped else decode)(vae, posterior.sample(gen)) - x).square()
        loss = error.mean() if weigh is None else (weigh(x) * error).mean()
        kl = 0.5 * (posterior.mean.square() + posterior.var - 1 - posterior.logvar).mean()
        opt.zero_grad()
        (loss + kl_weight * kl).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(vae.parameters(), clip)
        opt.step()
        lr_at.step()
        losses.append(error.mean().item())
        bar.set_postfix(mse=f"{np.mean(losses[-20:]):.4f}")
    vae.eval().requires_grad_(False)
    return losses


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z).sample


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """vae.decode(z) of one frame (N, C, 1, h, w) without its final clamp to [−1, 1] (diffusers'
    AutoencoderKLQwenImage._decode, less the clamp): what the VAE's training reads."""
    vae.clear_cache()
    out = vae.decoder(vae.post_quant_conv(z), feat_cache=vae._feat_map, feat_idx=[0])
    vae.clear_cache()
    return out


@one_thread
@torch.no_grad()
def latents(vae, images: torch.Tensor, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The posterior's (mean, std) of images (N, 3, S, S) in [−1, 1]: each (N, C, s, s)."""
    parts = [vae.encode(images[i:i + chunk, :, None]).latent_dist for i in range(0, len(images), chunk)]
    return torch.cat([p.mean[:, :, 0] for p in parts]), torch.cat([p.std[:, :, 0] for p in parts])


@one_thread
def train_transformer(pipe, mu_z: torch.Tensor, std_z: torch.Tensor, labels: torch.Tensor, texts: list[str],
                      side: int, steps: int, batch: int, lr: float, ema: float, gen: torch.Generator,
                      warmup: int = 0, clip: float = 0.0, measure=None, measure_every: int = 0) -> list[float]:
    """Rectified flow on the normalised, packed latents of a training set (posterior mean and std (N, C, s, s)), image
    i prompted with texts[labels[i]]: x_σ = (1 − σ)·x0 + σ·ε, target ε − x0, σ logit-normal and shifted as the
    scheduler shifts it at this image size, conditioned on the frozen text encoder; an EMA of the weights (decay
    min(ema, (1 + n)/(10 + n))) is loaded into the transformer at the end. Options: a linear lr `warmup` (steps), a
    gradient-norm `clip`, and `measure(step)`, called every `measure_every` steps with the EMA weights loaded (a
    budget curve). Returns each step's loss."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    model = models_qwen.QwenImage(pipe, "cpu", torch.float32)
    net = model.transformer.requires_grad_(True).train()
    scale = [torch.tensor(pipe.vae.config[k]).view(1, -1, 1, 1) for k in ("latents_mean", "latents_std")]
    cond = conditioning(model, texts)  # every prompt's embeddings (P, L, D), indexed by label
    cfg = model.scheduler.config
    mu = calculate_shift(model.image_seq_len(side, side), cfg.base_image_seq_len, cfg.max_image_seq_len,
                         cfg.base_shift, cfg.max_shift)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0)
    lr_at = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
    averaged = {k: v.detach().clone() for k, v in net.state_dict().items()}
    losses = []
    for step in (bar := tqdm(range(steps), desc="pretrain transformer", unit="step")):
        idx = torch.randint(len(mu_z), (batch,), generator=gen)
        z = (mu_z[idx] + std_z[idx] * torch.randn(mu_z[idx].shape, generator=gen) - scale[0]) / scale[1]
        x0 = pipe._pack_latents(z, len(idx), z.shape[1], z.shape[2], z.shape[3])  # (B, S, C·4)
        u = torch.sigmoid(torch.randn(len(idx), generator=gen))
        sigma = math.exp(mu) / (math.exp(mu) + (1 / u - 1))  # the scheduler's exponential time shift
        eps = torch.randn(x0.shape, generator=gen)
        x = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        v = model.velocity(x, sigma, {k: t[labels[idx]] for k, t in cond.items()}, 1.0, side, side)
        loss = (v - (eps - x0)).square().mean()
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        lr_at.step()
        decay = min(ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, t in net.state_dict().items():
                averaged[k].lerp_(t, 1 - decay)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
        if measure_every and (step + 1) % measure_every == 0:
            live = {k: v.clone() for k, v in net.state_dict().items()}
            net.load_state_dict(averaged)
            measure(step + 1)
            net.load_state_dict(live)
    net.load_state_dict(averaged)
    return losses


def conditioning(model, texts: list[str], chunk: int = 64) -> dict:
    """model.conditioning of many prompts, `chunk` at a time (the tiny text encoder also computes its 152k-word
    logits: 1,800 prompts at once would ask for 52 GB), zero-padded to the longest with mask 0 as one call pads."""
    parts = [model.conditioning(texts[i:i + chunk], " ", 1.0) for i in range(0, len(texts), chunk)]
    n = max(p["embeds"].shape[1] for p in parts)
    return {k: torch.cat([torch.nn.functional.pad(p[k], (0, 0) * (p[k].ndim - 2) + (0, n - p[k].shape[1]))
                          for p in parts]) for k in parts[0]}


def check_out(out: str) -> None:
    """Refuse, before any training, an `out` that save_parts could not write (a file, a path through one, a directory
    this user cannot write): found at the end, it cost the whole pretraining (nano-compose's: 88 CPU-minutes)."""
    there = os.path.abspath(out)
    while not os.path.lexists(there):  # the nearest part of the path that exists: what makedirs writes into
        there = os.path.dirname(there)
    if not os.path.isdir(there) or not os.access(there, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {there} is not a directory this user can write; give another --out")


def save_parts(out: str, **parts) -> None:
    """Write the trained parts (vae=…, transformer=…) in diffusers' own format, in float16: half the bytes, and what
    loads is what is measured next. Each is written whole beside its place, then put there (atomic_files): a crash
    leaves the base it replaces (by default the shipped one, assets/<task>) as it was."""
    os.makedirs(out, exist_ok=True)
    written = {}
    try:
        for name, part in parts.items():
            for t in [*part.parameters(), *part.buffers()]:  # (not .to(): diffusers warns about modules kept in fp32)
                t.data = t.data.half()
            written[name] = atomic_files.temporary(os.path.join(out, name))
            part.save_pretrained(written[name])
    except BaseException:  # a full disk: nothing half-written left beside the base
        for tmp in written.values():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.lexists(report := os.path.join(out, "pretrain.json")):  # the replaced base's figures: gone with it,
        os.remove(report)  # not left beside new weights if the new base's evaluation is cut before save_report
    for name, tmp in written.items():
        atomic_files.replace_dir(tmp, os.path.join(out, name))


def save_report(out: str, report: dict) -> None:
    """out/pretrain.json, what the stages reached, written whole, then renamed."""
    path = os.path.join(out, "pretrain.json")
    with open(tmp := atomic_files.temporary(path), "w") as f:
        json.dump(report, f, indent=2)
    os.replace(tmp, path)



def reached(report: dict, stage: str, **figures) -> None:
    """Record what a stage of pretraining reached (report[stage]) and say it."""
    report[stage] = {k: v if isinstance(v, int) else round(float(v), 6) for k, v in figures.items()}
    print(f"{stage}: " + ", ".join(f"{k} {v:.4g}" for k, v in report[stage].items()), flush=True)
