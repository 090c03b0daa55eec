"""`--micro-batch 0`: the micro-batch sized to the device's memory, measured once the model is built.

The micro-batch is the rollout's chunk and the update's micro-batch alike (that keeps the first update exactly on
policy); it changes the update only by rounding, and on a GPU it decides how full the GPU runs: at the public
Qwen-Image recipe's 4 the host's launches, not the GPU's arithmetic, set the pace (BENCHMARKS.md). `fit` measures the
peak memory of the largest thing one micro-batch does, a CFG velocity's forward and backward on real conditioning
and the VAE decode of its latents, at 1 and 2 images, extrapolates linearly, and takes the largest size that divides
a rank's share of an optimizer step (and that the algorithm accepts) within the budget, less AdamW's moments (made at
the first step, after this measures). With --reuse-rollout-forward the budget first gives up what the rollout keeps
for the update: the graph of every trained step of every image of the share, measured on one. Nothing it does changes
a weight, a gradient or a random state; every rank takes the smallest rank's choice.
"""
import dataclasses
import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import algorithms
from algorithms import need

CPU_MICRO_BATCH = 8  # on a CPU memory does not bind first; the default --micro-batch
HEADROOM = 0.9  # of the budget: the allocator's fragmentation and what the extrapolation misses


def check(a) -> None:
    """`--micro-batch 0` needs every chunk sampled here: refused where others sample."""
    need(a.micro_batch >= 0, f"--micro-batch must be >= 1, or 0 (sized to the device's memory), got {a.micro_batch}")
    need(a.micro_batch or (a.rollout == "local" and not a.rollout_ranks), "--micro-batch 0 sizes the micro-batch on "
         "the training ranks, which the samplers of --rollout vllm-omni and --rollout-ranks must know beforehand: "
         "give --micro-batch N")


def sizes(a, images_per_step: int) -> list[int]:
    """The micro-batches that split a rank's share of an optimizer step into whole ones the algorithm accepts."""
    return [b for b in range(1, images_per_step + 1) if images_per_step % b == 0 and _accepted(a, b)]


def _accepted(a, b: int) -> bool:
    try:
        algorithms.ALGORITHMS[a.algorithm].check(dataclasses.replace(a, micro_batch=b))
        return True
    except ValueError:
        return False


def fit(model, engine, a, images_per_step: int, prompts: list[tuple[str, dict]], limit_gib: float = 0.0) -> int:
    """The largest of `sizes` whose measured peak fits `limit_gib` (0: the device's memory) × HEADROOM; the
    smallest choice over the ranks. `prompts`: (text, metadata) pairs to condition on (an edit model's sources)."""
    fits = sizes(a, images_per_step)
    need(fits, f"no micro-batch splits {images_per_step} images per rank and optimizer step as --algorithm "
               f"{a.algorithm} needs: give --micro-batch N")
    if engine.device.type != "cuda":
        choice = max([b for b in fits if b <= CPU_MICRO_BATCH] or fits[:1])
    else:
        # Every figure the same on every rank (the least budget, the largest peak): each measurement runs FSDP2's
        # collectives, which ranks that decided apart, one measuring once more, would wait on for ever
        budget = _agreed(engine, HEADROOM * (limit_gib * 2**30 or torch.cuda.get_device_properties(engine.device)
                                             .total_memory) - _moments(engine), "min")
        measure = functools.cache(lambda b: _agreed(engine, _measured(model, engine, a, b, (prompts * b)[:b]), "max"))
        one, two = measure(1), measure(2)  # the allocator's peaks (infinite: out of memory)
        # --reuse-rollout-forward keeps one image's velocity call for each trained step of each image of the step
        steps = len(algorithms.ALGORITHMS[a.algorithm].rollout_steps(a, 0)) * images_per_step
        kept = _agreed(engine, _kept(model, a, prompts[:1]), "max") * steps if a.reuse_rollout_forward else 0
        choice = choose(fits, one, two - one if math.isfinite(two) else math.inf, kept, budget, measure)
    return int(_agreed(engine, choice, "min"))


def _moments(engine) -> int:
    """The bytes of AdamW's two moments of this rank's trained weights on the GPU, made at the first optimizer step and
    kept: left out, a full fine-tune's 8 bytes a weight could run the size chosen out of memory from the second step."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in engine.params]
    return 2 * sum(t.nbytes for t in local if t.is_cuda)


def _agreed(engine, value: float, op: str) -> float:
    """`value` over the ranks: their least (op "min") or largest ("max")."""
    box = torch.tensor([float(value)], dtype=torch.float64, device=engine.device)
    dist.all_reduce(box, op={"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return box.item()


def choose(fits: list[int], one: int, per_image: int, kept: int, budget: float, measure) -> int:
    """The largest of `fits` whose peak, foretold by the line through 1 and 2 images (`one`, + `per_image` each) and
    then `measure`d, fits `budget` beside the `kept` bytes that stay allocated throughout; else the smallest."""
    choice = max([b for b in fits if kept + one + (b - 1) * max(per_image, 1) <= budget] or fits[:1])
    # Measured, not only foretold: on the first GPU run an iteration at 16 images peaked at 61 GiB where the
    # line through 1 and 2 images put 16 within 54.
    while choice > fits[0] and kept + measure(choice) > budget:
        choice = max(b for b in fits if b < choice)
    if kept:  # beside them even the smallest may not fit: stopped before the rollout, not out of memory after it
        peak = measure(choice)
        need(kept + peak <= budget, f"--reuse-rollout-forward keeps the update's forwards of an optimizer step's "
             f"images from the rollout to the update, {kept / 2**30:.1f} GiB here, which with a micro-batch of {choice} "
             f"({peak / 2**30:.1f} GiB at its peak) passes the {budget / 2**30:.1f} GiB budget: leave it out, or raise "
             f"--optimizer-steps (fewer images a step)")
    return choice


def _inputs(model, a, prompts: list[tuple[str, dict]]) -> tuple:
    """A velocity call's inputs for len(prompts) images at the run's size: latents, σ, conditioning."""
    cond = model.conditioning([p for p, _ in prompts], a.negative_prompt, a.cfg_scale, [m for _, m in prompts],
                              a.height, a.width)
    x = model.noise([torch.Generator().manual_seed(i) for i in range(len(prompts))], a.height, a.width)
    return x, torch.full((len(prompts),), 0.5), cond


def _measured(model, engine, a, b: int, prompts: list[tuple[str, dict]]) -> float:
    """_peak, or infinity where the micro-batch ran out of memory: it does not fit (on one GPU; of several ranks, one
    that runs out inside FSDP2's collectives leaves the others waiting there, as any out-of-memory error does)."""
    try:
        return _peak(model, engine, a, b, prompts)
    except torch.cuda.OutOfMemoryError:
        engine.optimizer.zero_grad(set_to_none=False)  # what a backward cut short had accumulated
        torch.cuda.empty_cache()
        return math.inf


def _peak(model, engine, a, b: int, prompts: list[tuple[str, dict]]) -> int:
    """The allocator's peak bytes over one micro-batch of `b` images: velocity forward + backward, VAE decode."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    x, sigma, cond = _inputs(model, a, prompts)
    model.transformer.train()
    model.velocity(x, sigma, cond, a.cfg_scale, a.height, a.width).float().square().mean().backward()
    engine.optimizer.zero_grad(set_to_none=False)  # the gradients were zero: they are again, nothing trained
    model.decode(x, a.height, a.width)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _kept(model, a, prompts: list[tuple[str, dict]]) -> int:
    """The bytes one image's velocity call holds for its backward, graph and output: what the rollout keeps for each
    trained step of each image it samples for the first optimizer step under --reuse-rollout-forward (a little more:
    what a call's images share, RoPE's tables, counted for each; tests/test_gpu.py)."""
    x, sigma, cond = _inputs(model, a, prompts)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.enable_grad():
        v = model.velocity(x, sigma, cond, a.cfg_scale, a.height, a.width)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del v  # and its graph with it: nothing trained, nothing kept
    return kept
