"""Ulysses sequence parallelism (`--sp N`, docs/algorithm.md §14), used by engine.py: the ranks form a
(data-parallel × sequence-parallel) mesh; the N ranks of one sequence-parallel group hold the same images and each
keeps 1/N of every token sequence; attention runs on all tokens over H/N heads after an all-to-all, and the inverse
all-to-all brings each rank its tokens back.

diffusers' own context parallelism does that work: the transformer class's `_cp_plan` says where the sequences are
split (the first block's inputs, RoPE's outputs) and where they are gathered (the output projection), and the
attention dispatcher's `TemplatedUlyssesAttention` does both all-to-alls, in forward and in backward. Written here is
only what diffusers 0.42.1 cannot do in this setting:
1. `ModelMixin.enable_parallelism` resolves the device as `rank % torch.accelerator.device_count()`, which divides by
   zero on a machine without an accelerator (ZeroDivisionError on CPU). `enable_ulysses` replaces, on the one
   transformer instance, the method that does it (`_resolve_parallel_config`) by one that sets up the same config
   with our mesh and device, then calls diffusers' `enable_parallelism` unchanged: its backend check (the native
   SDPA backend supports context parallelism, on CPU too), its processors and its split/gather hooks.
2. The mesh: diffusers builds a ("ring", "ulysses") one; ours is ("dp", "ring", "ulysses") with ring 1, so that the
   data-parallel dimension, whose rank and size the loop uses, is part of it.
3. Gradients: each rank of a sequence-parallel group back-propagates through its own tokens only, so its gradient is a
   partial sum; the group's sum is the images' gradient. FSDP2, which shards over every rank (the whole mesh), averages
   over all of them by default: a 1/N too small. `sum_over_sequence` makes it divide by the data-parallel size only,
   with sum-only collectives, because its divide factor otherwise needs ReduceOp.PREMUL_SUM, which gloo lacks.
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("dp", "ring", "ulysses")  # diffusers' context parallelism needs "ring" and "ulysses"; ring stays 1


def data_parallel_size(world_size: int, sp: int) -> int:
    """The number of data-parallel groups, world ÷ --sp; an --sp that does not divide the world is refused."""
    if sp < 1 or world_size % sp:
        raise ValueError(f"--sp {sp} must divide the number of ranks, {world_size} (torchrun's --nnodes × "
                         f"--nproc_per_node): launch a multiple of {sp} processes, or choose another --sp")
    return world_size // sp


def device_mesh(world_size: int, sp: int, device: torch.device) -> DeviceMesh:
    """The (dp, 1, sp) mesh. Ranks g·sp … g·sp + sp − 1 form sequence-parallel group g: neighbours, so that on GPUs the
    all-to-alls run inside a node."""
    shape = (data_parallel_size(world_size, sp), 1, sp)
    return init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)


def enable_ulysses(model, mesh: DeviceMesh, device: torch.device) -> None:
    """Ulysses attention over the mesh's "ulysses" ranks in `model.transformer`, through diffusers' enable_parallelism
    (see the module docstring, 1.); the adapter learns the degree (`sp_degree`: Qwen-Image pads its text to it)."""
    from diffusers import ContextParallelConfig, ParallelConfig
    net, degree = model.transformer, mesh.size(MESH_DIMS.index("ulysses"))
    if net.config.num_attention_heads % degree:  # start-up checks them from the config when it is on this machine
        raise ValueError(f"--sp {degree} must divide the transformer's {net.config.num_attention_heads} attention heads")
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=degree, mesh=mesh))

    def resolve(cfg: ParallelConfig) -> ParallelConfig:  # diffusers' own, but with our mesh's device
        cfg.setup(dist.get_rank(), dist.get_world_size(), device, mesh=mesh)
        net._parallel_config = cfg
        return cfg
    net._resolve_parallel_config = resolve
    net.enable_parallelism(config=config)
    model.sp_degree = degree


def sum_over_sequence(fsdp_modules, dp_size: int) -> None:
    """FSDP2 reduces each gradient as sum over all ranks ÷ the data-parallel size (see the module docstring, 3.)."""
    for module in fsdp_modules:
        module.set_force_sum_reduction_for_comms(True)
        module.set_gradient_divide_factor(float(dp_size))
