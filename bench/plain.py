"""bench/plain.py: the loop's Flow-GRPO update written as the plainest PyTorch, the yardstick of framework overhead.
A plain module with peft's LoRA, no engine and no FSDP; the SDE step's log-prob and the PPO-clip loss inline; clipping
and AdamW. bench/overhead.py runs it beside the loop's own update on the same batch (and checks that both land on the same LoRA);
BENCHMARKS.md has the figures."""
import numpy as np
import torch
from peft import LoraConfig

import flowgrpo


def setup(a: flowgrpo.Args, model) -> tuple:
    """`model`, a fresh twin of the loop's (the same weights), as a plain module: peft's LoRA added as the engine adds
    it (same seed, so the same initial weights), no engine, no FSDP; AdamW with the engine's hyper-parameters (foreach,
    as the engine's)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(a.seed)
        model.transformer.add_adapter(LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha,
                                                 target_modules=list(a.lora_targets)))
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay, foreach=True), params


def update(model, opt, params, batch, a):
    """bench.train's update in the plainest PyTorch: every micro-batch × trained step, Flow-GRPO's SDE step, log-prob
    and PPO-clip loss written out here, then clip_grad_norm_ and AdamW: what the loop's update costs without the loop."""
    model.transformer.train()
    chunks, W = range(0, len(batch.prompts), a.micro_batch), len(batch.sigmas) - 1
    for m in chunks:
        mb = batch.chunk(m, m + a.micro_batch)
        for j in range(W):
            x, x_next, s, s_next = mb.latents[:, j], mb.latents[:, j + 1], mb.sigmas[j], mb.sigmas[j + 1]
            v = model.velocity(x, s.expand(len(x)), mb.cond, a.cfg_scale, a.height, a.width).float()
            dt, s_t = s_next - s, a.noise_level * torch.sqrt(s / (1 - torch.where(s == 1, mb.sigma_max, s)))
            mean = x * (1 + s_t**2 * dt / (2 * s)) + v * (1 + s_t**2 * (1 - s) / (2 * s)) * dt
            std = s_t * torch.sqrt(-dt)
            logp = (-((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * np.log(2 * np.pi)).mean(
                dim=tuple(range(1, x.dim())))
            ratio, adv = torch.exp(logp - mb.log_probs[:, j]), mb.advantages
            loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - a.clip_range, 1 + a.clip_range)).mean()
            (loss / (len(chunks) * W)).backward()
    torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=False)
