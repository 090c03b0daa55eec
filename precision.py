"""bf16 compute without FSDP2 (used by engine.py): what FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32) computes, on a world of one that has nothing to shard.

On one rank FSDP2 gathers nothing, yet its hooks, buffer copies and per-forward casts nearly double the host's work
per transformer block (bench/overhead.py's "host" rows), which on a GPU is time the GPU waits. Here the same arithmetic comes
from plain modules: the frozen weights in bf16 once (the policy casts them at every forward, to the same values),
each LoRA factor through a bf16 copy of its float32 master weight that is made again only when the weight changes,
the gradient handed to the master in float32, and every block's inputs cast to bf16 as the policy casts them.
"""
import types

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only


def cast_inputs_to_bf16(modules) -> None:
    """Each module's floating inputs in bf16 (FSDP2's `cast_forward_inputs`), also when activation checkpointing
    recomputes it in the backward, where FSDP2 before torch 2.13 skips its own cast (pytorch#159359)."""
    for module in modules:
        module.register_forward_pre_hook(_cast_inputs, with_kwargs=True)


def _cast_inputs(module, args, kwargs) -> tuple:  # a forward pre-hook
    return tree_map_only(torch.Tensor, _to_bf16, (args, kwargs))


def _to_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


class _Bf16Copy(torch.autograd.Function):
    """The forward uses `copy`, a bf16 copy of the float32 `master`; the backward hands `master` the gradient cast to
    float32 (as FSDP2's policy reduces it), where autograd sums it with the other uses' (CFG's two calls)."""

    @staticmethod
    def forward(ctx, master, copy):
        return copy

    @staticmethod
    def backward(ctx, grad):
        return grad.float(), None


def _working_copy_linear(self, x: torch.Tensor) -> torch.Tensor:
    """A LoRA factor's forward in bf16 through its working copy (a buffer `_refresh` keeps equal to the float32 weight
    cast): no check and no cast here, so that a compiled block traces it without a break (`--compile`)."""
    copy = self.working_copy
    return F.linear(x, _Bf16Copy.apply(self.weight, copy) if torch.is_grad_enabled() else copy, self.bias)


def _refresh(net, args) -> None:  # a forward pre-hook of the root
    """Each factor's working copy made again, in place, where its float32 weight changed since (an optimizer step, an
    EMA swap or a checkpoint load bump its version or replace its storage): a rollout casts nothing. Runs before each
    transformer call, outside any compiled block; reads the factors from the module (a deep copy refreshes its own)."""
    with torch.no_grad():
        for m in net.working_factors:
            w = m.weight
            if m.working_key != (w.data_ptr(), w._version):
                m.working_copy.copy_(w)
                m.working_key = (w.data_ptr(), w._version)


def bf16_working_copies(net: torch.nn.Module) -> None:
    """`net`'s frozen weights cast to bf16 once, and each LoRA factor computing through its bf16 working copy
    (`_working_copy_linear`), peft's cast of the factor's input to the factor's dtype off; the trained weights stay
    float32 masters. Its inputs: `cast_inputs_to_bf16`."""
    trained = {id(p) for p in net.parameters() if p.requires_grad}
    factors = [m for m in net.modules() if isinstance(m, torch.nn.Linear) and id(m.weight) in trained]
    if {id(m.weight) for m in factors} | {id(m.bias) for m in factors if m.bias is not None} != trained:
        raise ValueError("bf16 working copies serve LoRA factors (linear layers) only: shard the model instead")
    for p in net.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    for m in net.modules():
        if hasattr(m, "cast_input_dtype_enabled"):  # a peft LoRA layer: its input stays bf16
            m.cast_input_dtype_enabled = False
    for m in factors:  # a buffer (not saved): moved with the module, and an input of a compiled block, not a constant
        m.register_buffer("working_copy", torch.empty_like(m.weight, dtype=torch.bfloat16), persistent=False)
        m.working_key = None
        m.forward = types.MethodType(_working_copy_linear, m)
    net.working_factors = factors
    net.register_forward_pre_hook(_refresh)


def free_bytes(device: torch.device) -> float:
    """What the allocator can still hand out on `device`: the GPU's free memory and its cache's unused part (a CPU's
    memory is the machine's, not bounded here)."""
    if device.type != "cuda":
        return float("inf")
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def need_room(nbytes: int, device: torch.device, what: str) -> None:
    """A copy of the weights that an option keeps (--merged-lora's, --fp8-rollout's) refused in a line where `device`
    cannot hold it, before it is made: out of memory there would end the run in a stack."""
    if nbytes > free_bytes(device):
        raise ValueError(f"{what}, {nbytes / 2**30:.1f} GiB here, and {device} has {free_bytes(device) / 2**30:.1f} GiB "
                         "free: leave it out, or use a GPU with more memory")
