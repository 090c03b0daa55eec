"""bench/host.py: the host's work per transformer call, the loop's against bare diffusers', at real depth; and the
bytes a rollout gathers on 2 ranks.
    python -m bench.host [--quick] [--compile] [--markdown FILE]  # CPU: time and aten ops per call, loop ÷ bare

On a GPU at the recipe's micro-batch the transformer's kernels are short, and what the host does to launch them (the
adapter's layers, casts, hooks) decides the time: the first GPU run (BENCHMARKS.md) measured the loop's forward at
2.6× diffusers' bare one there. Its proxy on a CPU: Qwen-Image's real depth (60 blocks of its architecture) at a
negligible width (2 heads × 16), where a forward's time is dispatch, and the aten operations it dispatches, counted.
The loop's side is the qwen-image recipe's model as the engine leaves it on one rank (LoRA r64 on its targets, bf16
compute, activation checkpointing), and the same with --merged-lora; the floor is the same weights in diffusers' hands;
for forward + backward, the same LoRA added by peft to the bare model, trained in bf16, checkpointed alike (a plain
LoRA step). And the same forward + backward on one rank of 2 (a process whose collectives do nothing stands for it):
FSDP2 sharding over 2 ranks, and --sp 2's split of each image's tokens on top: what the split path adds per block."""
import argparse
import collections
import copy
import dataclasses
import functools
import json
import os
import subprocess
import sys

import numpy as np
import torch
import torch.distributed as dist
from diffusers import QwenImageTransformer2DModel
from torch.utils._python_dispatch import TorchDispatchMode

import engine as eng
import flowgrpo
import models
import models_qwen
import rollout_backends
import scheduler as sch
from bench.overhead import HEAD, make_engine, measure, ms, row, texts_of

BLOCKS, SIDE = 60, 64  # Qwen-Image's depth; the images' side


class CountOps(TorchDispatchMode):
    """The aten operations dispatched inside, by name (views and casts included: each is host work)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def deep_narrow_model(blocks: int = BLOCKS) -> models_qwen.QwenImage:
    """The tiny pipeline with a `blocks`-deep (Qwen-Image's 60), 2 × 16-wide Qwen-Image transformer in bf16 (as the
    real one is loaded)."""
    pipe = models_qwen.build_tiny_qwen_pipeline(0, 2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.transformer = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=blocks, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
    pipe.transformer.to(torch.bfloat16)
    return models_qwen.QwenImage(pipe, "cpu", torch.bfloat16)


def inputs(m, batch: int = 4) -> tuple:
    """Every row's call: `batch` images at SIDE² with σ 0.5 and a short prompt."""
    x = m.noise([torch.Generator().manual_seed(i) for i in range(batch)], SIDE, SIDE)
    return x, torch.full((batch,), 0.5), m.conditioning(["a sign that says hello"] * batch, " ", 1.0)


def step(m, x, s, cond):
    """A forward and backward: the update's call."""
    m.velocity(x, s, cond, 1.0, SIDE, SIDE).float().square().mean().backward()


def host_rows(t: list, o, batch: int = 4):
    a = flowgrpo.RECIPES["qwen-image"]
    bare = deep_narrow_model()

    def engine_model(**extra):  # the recipe's LoRA, bf16 compute and checkpointing, on a copy of the bare model
        m = copy.deepcopy(bare)
        make_engine(dataclasses.replace(a, model="tiny"), m, **extra)
        return m

    loop, loop_step, plain = engine_model(), engine_model(), copy.deepcopy(bare)
    merged, merged_step = engine_model(merged_lora=True), engine_model(merged_lora=True)  # each layer one weight
    fp8 = copy.deepcopy(bare)  # --fp8-rollout: the rollout's frozen layers in float8, inside the engine's rollout
    fp8_engine = make_engine(dataclasses.replace(a, model="tiny"), fp8, fp8_rollout=True)
    plain.transformer.add_adapter(loop.transformer.peft_config["default"])  # the same LoRA, bf16, no engine
    plain.transformer.enable_gradient_checkpointing()
    x, s, cond = inputs(bare, batch)

    def forward(m):
        with torch.no_grad():
            return m.velocity(x, s, cond, 1.0, SIDE, SIDE)

    def rollout(engine, m):
        with engine.rollout_weights():
            return forward(m)

    # A model each for forwards (eval) and steps (train), set once: the loop switches modes once a phase, not a call,
    # and Module.train walks every module: 26 ms a switch of the loop's 8,297 (peft's), 3.6 ms of the bare 2,297
    timed = {"bare": lambda: forward(bare), "loop": lambda: forward(loop), "merged": lambda: forward(merged),
             **{name: functools.partial(step, m, x, s, cond) for name, m in (
                 ("plain step", plain), ("loop step", loop_step), ("merged step", merged_step))},
             "fp8 rollout": lambda: rollout(fp8_engine, fp8)}
    for m in (bare, loop, merged, fp8):
        m.transformer.eval()
    ops = {}
    for name, fn in timed.items():
        fn()  # warm: the working copies made, the gradients allocated
        with CountOps() as counter:
            fn()
        ops[name] = counter.ops
    if o.compile:  # the loop's engine with --compile (inductor): what is left of the host's work once blocks are fused
        compiled, compiled_step = engine_model(compile=True), engine_model(compile=True)
        compiled.transformer.eval()
        timed |= {"compiled": lambda: forward(compiled), "compiled step": lambda: step(compiled_step, x, s, cond)}
        forward(compiled), step(compiled_step, x, s, cond)  # traced and compiled here, outside the timing
    r = measure(timed, o.repeats, warmup=0)  # each has run above: warm, then counted (the compiled ones, compiled)
    n = {k: sum(v.values()) for k, v in ops.items()}
    what = f"Qwen-Image's {BLOCKS} blocks at 2 heads × 16, {batch} images {SIDE}², one thread"
    # (timed name, its label, the targets, what it is): each against bare diffusers' forward, or a plain LoRA step
    for name, label, targets, how in (
            ("loop", "loop", ("≤ 1.25", "≤ 1.2"), f"the recipe's LoRA r{a.lora_rank}, bf16 compute, checkpointing"),
            ("loop step", "loop", ("≤ 1.25", "≤ 1.2"), "peft's LoRA in bf16 with checkpointing, no engine"),
            ("merged", "loop --merged-lora", ("≤ 1.25", "≤ 1.2"), "the same LoRA merged into each weight"),
            ("merged step", "loop --merged-lora", ("≤ 1.25", "≤ 1.2"), "the same LoRA merged into each weight"),
            ("fp8 rollout", "the loop's rollout --fp8-rollout", ("", ""), "each frozen linear layer in float8, its "
             "input quantised per token (on a CPU float8's matmul is no faster)")):
        floor, call = ("plain step", "forward + backward") if name.endswith("step") else ("bare", "forward")
        than = "plain LoRA step" if floor == "plain step" else "bare diffusers"
        row(t, f"host: time per {call}, {label} ÷ {than}", np.divide(r[name], r[floor]), "×", targets[0],
            f"{what}; {how}; {ms(r[name])} vs {ms(r[floor])}")
        added = ", ".join(f"{k} {v / BLOCKS:.0f}" for k, v in (ops[name] - ops[floor]).most_common(4) if v >= BLOCKS)
        row(t, f"host: aten ops {'per block' if floor == 'bare' else 'per ' + call}, {label} ÷ {than}",
            [n[name] / n[floor]], "×", targets[1], f"{n[name] / BLOCKS:.0f} vs {n[floor] / BLOCKS:.0f} per block"
            + (f"; the most added: {added}" if added else ""))
    if o.compile:
        row(t, "host: time per forward, loop --compile ÷ bare diffusers", np.divide(r["compiled"], r["bare"]), "×",
            "≤ 1.25", f"{what}; inductor; {ms(r['compiled'])}")
        row(t, "host: time per forward + backward, loop --compile ÷ plain LoRA step",
            np.divide(r["compiled step"], r["plain step"]), "×", "≤ 1.25", f"{what}; {ms(r['compiled step'])}")
    return ops["loop step"]


def worker(flag: str, marker: str, *launcher: str) -> dict:
    """`python [launcher] -m bench.host FLAG`, one thread a process: the JSON its main rank printed after `marker`."""
    cmd = [sys.executable, *launcher, "-m", "bench.host", flag]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    return json.loads(out.stdout.split(marker, 1)[1].splitlines()[0])


def split_worker() -> None:
    """Rank 0 of 2 through a process group whose collectives do nothing (bench/gpu.py's --sp-fake): the aten operations
    of host_rows' forward + backward (the recipe's LoRA, bf16, checkpointing) where FSDP2 shards over 2 ranks, and where
    --sp 2 also splits each image's tokens (Ulysses' all-to-alls, diffusers' context parallelism)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    os.environ.update(RANK="0", WORLD_SIZE="2")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    a, counts = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny"), {}
    for name, sp in (("fsdp2", 1), ("sp2", 2)):
        m = deep_narrow_model()
        make_engine(a, m, sp=sp)
        x, s, cond = inputs(m)
        step(m, x, s, cond)  # warm
        with CountOps() as counter:
            step(m, x, s, cond)
        counts[name] = dict(counter.ops)
    print("SPLIT", json.dumps(counts))


def split_rows(t: list, one: collections.Counter):
    """A rank of 2's aten operations per forward + backward ÷ one process's (`one`: host_rows' loop step)."""
    counts = worker("--split-worker", "SPLIT")
    for name, label, than, floor in (("fsdp2", "a rank of 2 (FSDP2)", "one process", one),
                                     ("sp2", "an --sp 2 rank", "a rank of 2", collections.Counter(counts["fsdp2"]))):
        ops = collections.Counter(counts[name])
        added = ", ".join(f"{k} {v / BLOCKS:.0f}" for k, v in (ops - floor).most_common(4) if v >= BLOCKS)
        row(t, f"host: aten ops per forward + backward, {label} ÷ {than}", [ops.total() / floor.total()], "×", "",
            f"{ops.total() / BLOCKS:.0f} vs {floor.total() / BLOCKS:.0f} per block; the most added: {added}")


def gather_worker() -> None:
    """One of 2 gloo ranks (torchrun): the tiny recipe's rollout of 8 images on each, FSDP2 gathering each block at every
    step and then keeping what it gathered (Engine.rollout_weights), the bytes every all-gather brought counted."""
    a = dataclasses.replace(flowgrpo.RECIPES["tiny"], group_size=4, prompts_per_iteration=4, micro_batch=4)
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine, gathered = make_engine(a, model), []
    for name in ("all_gather_single", "all_gather_into_tensor"):  # FSDP2's gather (torch 2.13; before)
        if hasattr(dist, name):
            def counted(out, *args, f=getattr(dist, name), **kwargs):
                gathered.append(out.numel() * out.element_size())
                return f(out, *args, **kwargs)
            setattr(dist, name, counted)
    ids = torch.arange(8) + 8 * engine.rank
    texts, steps, runs = (texts_of(a) * 2)[:8], sch.trained_steps(a.num_steps, a.window, a.window_range, seed=0), {}
    for keep in (False, True):
        engine.keep_gathered, gathered[:] = keep, []
        b = rollout_backends.LocalBackend(engine).sample(model, texts, [{}] * 8, ids // 4, ids, steps=steps,
                                                         height=a.height, width=a.width, num_steps=a.num_steps,
                                                         cfg_scale=a.cfg_scale, negative_prompt=a.negative_prompt,
                                                         noise_level=a.noise_level, seed=0, sde_type=a.sde_type,
                                                         iteration=0, chunk=a.micro_batch)
        runs[keep] = (sum(gathered), b)
    same = all(torch.equal(getattr(runs[0][1], k), getattr(runs[1][1], k)) for k in ("latents", "log_probs", "images"))
    if engine.is_main:
        print("GATHER", json.dumps(dict(step=runs[False][0] / 8, keep=runs[True][0] / 8, same=same,
                                        calls=a.num_steps * (1 + (a.cfg_scale > 1)) * 2)))
    eng.exit_process(0)


def gather_rows(t: list):
    """Engine.rollout_weights at 2 ranks: bytes gathered per image, kept ÷ gathered at every step, the same images."""
    r = worker("--gather-worker", "GATHER", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    assert r["same"], "the rollout on kept weights differs from the one gathering at every step"
    row(t, "rollout: bytes gathered per image at 2 ranks, weights kept ÷ gathered at every step", [r["keep"] / r["step"]],
        "×", "≪ 1: a rollout's gathers, not each call's", f"tiny recipe, 8 images a rank in chunks of 4, {r['calls']} "
        "transformer calls in all; "
        f"{r['step'] / 2**20:.2f} vs {r['keep'] / 2**20:.2f} MiB per image; the same latents, log-probs and images")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one repeat (the smoke test)")
    p.add_argument("--repeats", type=int, help="timed repeats per row (default 9; --quick 1)")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--compile", action="store_true", help="also the loop with --compile (inductor; compiling takes minutes)")
    p.add_argument("--gather-worker", action="store_true", help=argparse.SUPPRESS)  # one rank of gather_rows
    p.add_argument("--split-worker", action="store_true", help=argparse.SUPPRESS)  # split_rows' rank of 2
    o, t = p.parse_args(argv), list(HEAD)
    if o.repeats is not None and o.repeats < 1:  # 0 read as "unset" ran the default 9; below 0, no row had a median
        p.error(f"--repeats must be at least 1, got {o.repeats}")
    o.repeats = o.repeats or (1 if o.quick else 9)
    torch.set_num_threads(1)
    if o.gather_worker or o.split_worker:
        return gather_worker() if o.gather_worker else split_worker()
    split_rows(t, host_rows(t, o))
    gather_rows(t)
    if o.markdown:
        open(o.markdown, "w").write("\n".join([*t, ""]))


if __name__ == "__main__":
    main()
