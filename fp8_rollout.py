"""--fp8-rollout (engine.py applies it after precision.py's working copies): in the rollout, each frozen linear layer of
the transformer's blocks multiplies in float8; in the update, every layer computes in bf16 as without the option.

Why: an image costs the rollout N transformer calls per CFG branch and the update 2·W, so the rollout is the larger
share of an iteration (57% in the first GPU run, BENCHMARKS.md), and an H200 multiplies float8 at twice bf16's rate.
Only the rollout: the update's gradients stay bf16's, and the frozen base is the one weight that never changes, so
its float8 copy is made once. Measured on an H100 (BENCHMARKS.md, 2026-12-06): in eager the rollout's forward was
1.2-2.4 x slower than bf16's, for a cause not yet known; under --compile, which fuses the quantisation, unmeasured.

What: each frozen `nn.Linear` of the blocks (a LoRA layer's base; its factors stay bf16) keeps a float8 e4m3 copy of
its weight, scaled per output row (its largest magnitude to e4m3's 448). In the rollout its input is scaled per token
the same way, `torch._scaled_mm` multiplies the two with float32 accumulation into bf16, and the bias is added after.
That is torch's own kernel, the one torchao's float8 inference calls on a GPU. torchao itself (0.18) refuses a CPU,
and a CPU is where CI must test the rounding. Layers whose widths are not multiples of 16, the kernel's need on a GPU,
stay bf16.

What it costs: one more byte per frozen weight. The rollout is then no longer the policy the update computes: its
log-probs differ from the update's (`train/logp_gap` > 0), and `--stale-correction decoupled` weighs the difference.
DiffusionNFT and AWM read no rollout log-prob, only its samples. A named option, off in every recipe.
"""
import contextlib
import types

import torch

import precision

E4M3 = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t / scale in float8 e4m3, scale): each row of t (..., K) scaled so that its largest magnitude is 448; scale
    (..., 1) in float32. A row of zeros keeps a tiny scale and stays zeros."""
    # Two passes over t, for its largest magnitudes (exact in bf16) and its quotient in float32 (t's type promotes),
    # cast as it is written: every quotient is at most 448 but for rounding, and from 448 to 464 the cast gives 448
    scale = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3
    return (t / scale).to(torch.float8_e4m3fn), scale


def _fp8_linear(self, x: torch.Tensor) -> torch.Tensor:
    """A frozen linear layer's forward in the rollout: x quantised per token, the weight's float8 copy, bf16 out."""
    xq, scale = quantise(x.reshape(-1, x.shape[-1]))
    y = torch._scaled_mm(xq, self.fp8_weight.t(), scale_a=scale, scale_b=self.fp8_scale, out_dtype=torch.bfloat16)
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if self.bias is None else y + self.bias


def quantise_frozen(blocks) -> list[torch.nn.Linear]:
    """Each frozen linear layer of `blocks` (in bf16, from precision.bf16_working_copies) given its float8 copy and
    per-row scale (buffers, not saved: moved with the module); the layers returned, for `rollout`."""
    layers = [m for block in blocks for m in block.modules() if isinstance(m, torch.nn.Linear)
              and not m.weight.requires_grad and m.in_features % 16 == 0 and m.out_features % 16 == 0]
    if not layers:
        raise ValueError("--fp8-rollout found no frozen linear layer whose widths are multiples of 16: run without it")
    precision.need_room(sum(m.weight.numel() + 4 * m.out_features for m in layers), layers[0].weight.device,
                        "--fp8-rollout keeps a float8 copy of every frozen linear weight of the blocks")
    for m in layers:
        with torch.no_grad():
            w, scale = quantise(m.weight)
        m.register_buffer("fp8_weight", w, persistent=False)
        m.register_buffer("fp8_scale", scale.t().contiguous(), persistent=False)  # (1, out): the kernel's row-wise form
    return layers


@contextlib.contextmanager
def rollout(layers: list[torch.nn.Linear]):
    """Within: `layers` compute through their float8 copies. After: their own forwards again (the update's bf16)."""
    for m in layers:
        m.forward = types.MethodType(_fp8_linear, m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward

