"""--merged-lora (engine.py applies it after precision.py's working copies): each LoRA linear layer computes through
one bf16 weight, its frozen base and its adapter summed, in the rollout and in training alike.

Why: on a GPU at the recipe's micro-batch the host's dispatch decides a forward's time, and peft's LoRA adds to every
adapted layer two matmuls with their views, a scale and a sum (bench/host.py: 1.55× a bare forward's aten ops per
block). Merged, a layer dispatches what the bare model's does: one linear. Its weight, bf16(W + s·B·A) with the product
and the sum in float32 from the float32 masters, is made again only when a factor changes (an optimizer step, an EMA or
old-policy swap, a checkpoint load), before the transformer's call, as precision.py's working copies are; the rollout
and the update's first forwards are then the same arithmetic, and the first update stays exactly on-policy. A
departure from the unmerged path (the adapter is rounded into each weight instead of added to each output), hence a
named option. Memory: one more bf16 copy of every adapted weight.
"""
import types

import torch
import torch.nn.functional as F

import precision


class _MergedLinear(torch.autograd.Function):
    """y = x·Wᵀ + bias through the merged weight W. The backward is the unmerged layer's, in bf16 matmuls over the
    flattened batch and tokens: x's through W, the factors' s·gᵀ·(x·Aᵀ) for B and s·(g·B)ᵀ·x for A handed to their
    float32 masters (as precision._Bf16Copy hands them; autograd sums CFG's two calls), none for the frozen base."""

    @staticmethod
    def forward(ctx, x, merged, bias, a_master, b_master, a_copy, b_copy, scaling):
        ctx.save_for_backward(x, merged, a_copy, b_copy)  # saved: a refresh before the backward would be an error
        ctx.scaling = scaling
        return F.linear(x, merged, bias)

    @staticmethod
    def backward(ctx, g):
        x, merged, a, b = ctx.saved_tensors
        grad_x = g @ merged if ctx.needs_input_grad[0] else None
        g, x = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_a = ((g @ b).t() @ x).float() * ctx.scaling
        grad_b = (g.t() @ (x @ a.t())).float() * ctx.scaling
        return grad_x, None, None, grad_a, grad_b, None, None, None


def _merged_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A peft LoRA Linear's forward through its merged weight; the base alone while its adapters are disabled (the
    reference, engine.reference). No check and no cast here, so that a compiled block traces it without a break."""
    base = self.base_layer
    if self.disable_adapters:
        return F.linear(x, base.weight, base.bias)
    if not torch.is_grad_enabled():  # the rollout: the same F.linear as _MergedLinear's forward
        return F.linear(x, self.merged_weight, base.bias)
    a, b = self.lora_A[self.merged_adapter], self.lora_B[self.merged_adapter]
    return _MergedLinear.apply(x, self.merged_weight, base.bias, a.weight, b.weight, a.working_copy, b.working_copy,
                               self.merged_scaling)


def _refresh(net, args) -> None:  # a forward pre-hook of the root
    """Each merged weight made again, in place, with its factors' working copies, where a factor changed since
    (precision._refresh's test: its storage or version). The base is frozen and the scale α/r fixed: not watched."""
    with torch.no_grad():
        for m, a, b in net.merged_parts:
            wa, wb = a.weight, b.weight
            key = (wa.data_ptr(), wa._version, wb.data_ptr(), wb._version)
            if m.merged_key != key:
                a.working_copy.copy_(wa)
                b.working_copy.copy_(wb)
                m.merged_weight.copy_(m.base_layer.weight.float() + m.merged_scaling * (wb.float() @ wa.float()))
                m.merged_key = key


def merge_adapters(net: torch.nn.Module) -> None:
    """Every peft LoRA layer of `net` (after precision.bf16_working_copies) computing through its merged weight, a
    buffer (not saved; an input of a compiled block, not a constant) that `_refresh` keeps up to date; its factors'
    working copies are refreshed there too, instead of by precision._refresh."""
    from peft.tuners.lora import Linear  # peft: only where a LoRA is being built
    layers = [m for m in net.modules() if hasattr(m, "lora_A")]
    plain = [m for m in layers if isinstance(m, Linear) and len(m.active_adapters) == 1 and not m.lora_variant
             and isinstance(m.lora_dropout[m.active_adapters[0]], torch.nn.Identity)
             and m.lora_B[m.active_adapters[0]].bias is None]
    if not layers or len(plain) != len(layers):
        raise ValueError("--merged-lora merges plain LoRA linear layers only (one adapter; no dropout, DoRA or bias)")
    precision.need_room(sum(m.base_layer.weight.nbytes for m in layers), layers[0].base_layer.weight.device,
                        "--merged-lora keeps a bf16 copy of every adapted weight")
    for m in layers:
        m.merged_adapter, m.merged_key = m.active_adapters[0], None
        m.merged_scaling = m.scaling[m.merged_adapter]
        m.register_buffer("merged_weight", torch.empty_like(m.base_layer.weight), persistent=False)
        m.forward = types.MethodType(_merged_forward, m)
    net.merged_parts = [(m, m.lora_A[m.merged_adapter], m.lora_B[m.merged_adapter]) for m in layers]
    covered = {id(f) for _, a, b in net.merged_parts for f in (a, b)}
    net.working_factors = [f for f in net.working_factors if id(f) not in covered]
    net.register_forward_pre_hook(_refresh)
