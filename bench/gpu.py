"""bench/gpu.py: the public recipe on random weights at real width (images/s, MFU, peak memory), and the --sp rows.
    python -m bench.gpu --device cuda --model qwen-image --random-init  # GPU: images/s, split, MFU, peak memory
    python -m bench.gpu --model tiny --random-init [--quick]            # that path on CPU at toy size (a dry run)
    python -m bench.gpu --device cuda --model qwen-image-2.1 --random-init  # z-image, flux.2-klein; tiny-<name>: CPU
    python -m bench.gpu --sp 2 [--device cuda --model qwen-image]        # the --sp 2 ÷ --sp 1 rows (CPU too)
    python -m bench.gpu --plain [--device cuda] [--layers N]             # the update ÷ plain PyTorch, real width
Rows: median, min, max over repeats after a warm-up, as bench/overhead.py's. See BENCHMARKS.md."""
import argparse
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

import algorithms
import engine as eng
import flowgrpo
import memory
import models_qwen
import rewards
import scheduler as sch
from bench import overhead
from bench import families as bench_families
from bench.overhead import CUDA, HEAD, ROOT, make_engine, measure, ms, row, sample, sync, texts_of, train, vm_hwm

# dense bf16 tensor-core peaks, vendor data sheets; the first name the device's contains (the H100 SXM as "H100")
PEAK_TFLOPS = {"H200 NVL": 835.0, "H200": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "A100": 312.0}

class RandomText(models_qwen.QwenImage):  # no 7B text encoder: the tiny one's token counts and masks, random values
    @torch.no_grad()
    def encode(self, prompts):
        mask = super().encode(prompts)["mask"]
        e = torch.randn(*mask.shape, self.transformer.config.joint_attention_dim, generator=torch.Generator())
        return {"embeds": (e * mask.cpu()[..., None]).to(self.device, self.dtype), "mask": mask}

def random_model(kind: str, device: str, heads: int = 3, layers: int = 0, fp32: bool = False) -> RandomText:
    """diffusers' defaults = the published configs (`layers` > 0: that many blocks; `fp32`: also on a GPU); the
    transformer's weights drawn from torch's global generator (seed it for twins)."""
    pipe = models_qwen.build_tiny_qwen_pipeline(0, heads)
    dtype = torch.bfloat16 if device != "cpu" and not fp32 else torch.float32
    if kind != "tiny":
        default, _ = torch.get_default_dtype(), torch.set_default_dtype(dtype)
        with torch.device(device):
            pipe = QwenImagePipeline(pipe.scheduler, AutoencoderKLQwenImage(), pipe.text_encoder, pipe.tokenizer,
                                     QwenImageTransformer2DModel(**({"num_layers": layers} if layers else {})))
        torch.set_default_dtype(default)
    return RandomText(pipe, device, dtype if kind != "tiny" else torch.float32)

def model_of(name: str, device: str):
    """Qwen-Image's random_model, or a 2026 family's (bench/families.py)."""
    return random_model(name, device) if name in ("tiny", "qwen-image") else bench_families.family_model(name, device)

def pass_flops(c, s_img: int, s_txt: int, r: int) -> float:
    """FLOPs (multiply-add = 2) of one forward of Qwen-Image's MMDiT for one image; d = heads × head_dim, L blocks,
    S = s_img + s_txt tokens, each through its own stream's weights (tests/test_bench.py checks it: FlopCounterMode):
      L·(24·d²·S [q, k, v, out 4d²; MLP d→4d→d 8d²] + 4·d·S² [joint attention] + 32·r·d·S [LoRA rank r on q, k, v,
      MLP] + 24·d² [modulations]) + 2·d·(c_in·s_img + D_txt·s_txt + 4·c_out·s_img) + 2·(256·d + d²) + 4·d²"""
    d, S, io = c.num_attention_heads * c.attention_head_dim, s_img + s_txt, c.in_channels + 4 * c.out_channels
    blocks = c.num_layers * (24 * d * d * S + 4 * d * S * S + 32 * r * d * S + 24 * d * d)
    return blocks + 2 * d * (io * s_img + c.joint_attention_dim * s_txt) + 2 * (256 * d + d * d) + 4 * d * d

def end_to_end(o, a: flowgrpo.Args, model, engine, iterations: int):
    """`iterations` of the loop's phases as flowgrpo.main runs them (rollout, reward, one optimizer step on all images)
    -> (seconds per phase of each, the allocator's peak, transformer FLOPs per image, the largest first update's
    train/logp_gap: each first update is on the policy that sampled its images, so 0 but for a float8 rollout)."""
    texts, ticks, gaps, pool = texts_of(a), [], [], rewards.AsyncRewards(rewards.make_reward(a.reward))
    reset_peak()
    steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=0)
    for _ in range(iterations):
        start = time.perf_counter()
        with engine.rollout_weights():  # as the loop's local backend samples (--fp8-rollout's float8 within)
            b = sample(model, a, steps, on_images=lambda c, x: pool.submit(x, texts[c:c + len(x)]),
                       keep=len(texts) if a.reuse_rollout_forward else 0)  # train() takes one optimizer step: all images
        rolled, scores = time.perf_counter(), torch.as_tensor(pool.collect()[0]).float()
        b.advantages = algorithms.group_advantages(scores, b.group, std=a.std, clip=a.adv_clip)[0].to(model.device)
        scored = time.perf_counter()
        gaps.append(train(model, engine, b, a).get("train/logp_gap", np.nan))
        sync()
        ticks.append(np.diff([start, rolled, scored, time.perf_counter()]))
    pool.close()
    # An image: N rollout passes and W trained steps of forward + backward per CFG branch; LoRA's backward costs one
    # forward (activation gradients; the frozen weights need none); checkpointing's recompute is not counted (MFU).
    # --reuse-rollout-forward: the trained steps' forwards are rollout passes already, the backward alone is added.
    peak = torch.cuda.max_memory_allocated() if CUDA else vm_hwm(os.getpid())
    flops = sum(pass_flops(model.transformer.config, model.image_seq_len(a.height, a.width), b.cond[k].shape[1],
                           a.lora_rank) for k in ("embeds", "neg_embeds")[:1 + (a.cfg_scale > 1)]) \
        if isinstance(model, RandomText) else bench_families.velocity_flops(model, a, texts[0])  # the others: counted
    return ticks, peak, flops * (a.num_steps + (1 if a.reuse_rollout_forward else 2) * len(steps)), max(gaps)

def reset_peak():
    gc.collect()  # an earlier row's model is garbage now
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset VmHWM

def print_profile(label: str, fn, show: bool = True):
    """fn once under torch's profiler; its costliest operators by device time (a CPU: host time) printed, to the log."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if CUDA else [])) as prof:
        fn()
        sync()
    if show:
        print(f"profile, {label}:\n" + prof.key_averages().table(
            sort_by="cuda_time_total" if CUDA else "cpu_time_total", row_limit=15), flush=True)

def engine_of(o, a: flowgrpo.Args, model, **extra) -> eng.Engine:
    """make_engine; with --compile, each block then compiled as Engine(compile=True) compiles it (one rank: nothing is
    sharded after), on --compile-backend."""
    engine = make_engine(a, model, **extra)
    if o.compile:
        eng.compile_blocks(model.blocks, o.compile_backend)
    return engine

def forward_rows(t: list, o, a: flowgrpo.Args, model, label: str, sizes: list[int], peak: float):
    """One transformer call of one CFG branch (no gradient) at each batch size: its seconds and MFU, per `label`."""
    texts, side, seconds = texts_of(a), a.height, {}
    model.transformer.eval()
    for b in sizes:
        x = model.noise([torch.Generator().manual_seed(i) for i in range(b)], side, side)
        s, c = torch.full((b,), 0.5, device=model.device), model.conditioning((texts * b)[:b], a.negative_prompt, 1.0)
        with torch.no_grad():
            seconds[b] = measure({0: lambda: model.velocity(x, s, c, 1.0, side, side)}, o.repeats + 1)[0]
            if o.profile and b == sizes[0]:  # where the smallest batch's time goes
                print_profile(f"{label}, B = {b}", lambda: model.velocity(x, s, c, 1.0, side, side))
        rank = 0 if label.startswith("diffusers") else a.lora_rank
        flops = b * (pass_flops(model.transformer.config, model.image_seq_len(side, side), c["embeds"].shape[1], rank)
                     if isinstance(model, RandomText) else bench_families.velocity_flops(
                         model, dataclasses.replace(a, cfg_scale=1.0), texts[0]))
        row(t, f"transformer forward MFU, {label}, B = {b}", np.divide(flops / peak, seconds[b]), "of peak",
            "", f"one CFG branch, {side}², no gradient; {ms(seconds[b])}")
    return seconds

def peak_flops(o) -> tuple[str, float]:
    """The device's name and its dense bf16 peak in FLOP/s (no data sheet, a CPU: its measured matmul rate)."""
    name, x = torch.cuda.get_device_name() if CUDA else "cpu", torch.randn(2048, 2048, device=o.device)
    return name, 1e12 * next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0) or \
        2 * 2048 ** 3 / min(measure({0: lambda: x @ x}, 5)[0])

def gpu_rows(t: list, o, a: flowgrpo.Args):
    """The recipe end to end on one model and engine: at the micro-batch fitted to the device (memory.py), at the
    recipe's own, with --reuse-rollout-forward, held to --memory-limit GiB (last: the allocator is held to it from
    there on); transformer forwards against diffusers' bare ones (a model of its own, built and freed first) as the
    floor."""
    name, peak = peak_flops(o)
    texts, sizes = texts_of(a), sorted({4, len(texts_of(a))} if CUDA else {2})
    if "floor" in o.rows:
        bare = forward_rows(t, o, a, model_of(a.model, o.device), "diffusers bare", sizes, peak)
    reset_peak()
    model = model_of(a.model, o.device)
    engine, n = engine_of(o, a, model), len(texts)
    fitted = memory.fit(model, engine, a, n, [(p, {}) for p in texts])
    row(t, "micro-batch fitted (--micro-batch 0)", [fitted], "images", "", f"largest of {memory.sizes(a, n)} that "
        f"fits the device's memory ({memory.HEADROOM:.0%}); the recipe's: {a.micro_batch}")
    if "floor" in o.rows:
        loop = forward_rows(t, o, a, model, "the loop" + (", --compile" if o.compile else ""), sizes, peak)
        for b in sizes:
            row(t, f"transformer forward time, the loop ÷ diffusers bare, B = {b}", np.divide(loop[b], bare[b]), "×",
                "≤ 1.1", f"LoRA r{a.lora_rank} on {len(a.lora_targets)} targets, bf16 compute, one rank")
    how = "pass_flops" if isinstance(model, RandomText) else "FlopCounterMode, one call"
    goal = "≥ 1.0 on an H200" if isinstance(model, RandomText) else ""  # Qwen-Image's goal; the others have none
    configs = {"fitted": dict(micro_batch=fitted), "recipe": {}}
    if "reuse" in o.rows:  # the option keeps the graphs of a step's images from the rollout to the update: fitted with them
        try:
            reused = memory.fit(model, engine, dataclasses.replace(a, reuse_rollout_forward=True), n,
                                [(p, {}) for p in texts])
            configs["reuse"] = dict(micro_batch=reused, reuse_rollout_forward=True)
            row(t, "micro-batch fitted with --reuse-rollout-forward", [reused], "images", "", f"as above, the budget "
                f"less what the rollout keeps for the update: each trained step's graph of each of the {n} images")
        except ValueError as e:
            print(f"no reuse row: {e}", flush=True)
    if "held" in o.rows:  # an 80-GB GPU's room on a larger one, in this warm process (a process of its own would build
        # the model and warm up again), after the rows that need more: the allocator stays held from its row on
        held = memory.fit(model, engine, a, n, [(p, {}) for p in texts], o.memory_limit)
        configs["held"] = dict(micro_batch=held)
        row(t, f"micro-batch fitted within {o.memory_limit:g} GiB", [held], "images", "", f"as the first, the budget "
            f"{o.memory_limit:g} GiB ({memory.HEADROOM:.0%})")
    for i, key in enumerate([k for k in configs if k in o.rows]):  # the first one warms up (untimed) for all
        if key == "held" and CUDA:  # beyond it, out of memory, as on a smaller GPU
            reset_peak()
            torch.cuda.set_per_process_memory_fraction(o.memory_limit * 2**30 / torch.cuda.mem_get_info()[1])
        c, tag = dataclasses.replace(a, **configs[key]), key + (", --compile" if o.compile else "")
        ticks, mem, flops, gap = end_to_end(o, c, model, engine, (i == 0) + o.repeats)
        splits, total = ticks[i == 0:], [s.sum() for s in ticks[i == 0:]]
        held_to = f", the allocator held to {o.memory_limit:g} GiB" + ("" if CUDA else " on CUDA (here: not)")
        what = f"{n} images {a.height}², {a.num_steps} steps, W {a.window}, CFG {a.cfg_scale:g}, r{a.lora_rank}, " \
               f"{a.reward}, micro-batch {c.micro_batch}" + (", --reuse-rollout-forward" if c.reuse_rollout_forward
                                                             else "") + (held_to if key == "held" else "")
        row(t, f"images/s per device, end to end ({tag})", np.divide(n, total), "images/s", goal,
            f"{name}; {what}")
        row(t, f"MFU ({tag})", np.divide(flops * n / peak, total), "of peak", "≥ 0.45", f"transformer FLOPs "
            f"({how}) {flops / 1e12:.4g} T/image; VAE, text encoder, reward not counted; peak {peak / 1e12:.4g} T/s")
        row(t, f"peak memory ({tag})", [mem / 2**30], "GiB", "", "CUDA allocator peak" if CUDA else "process VmHWM")
        row(t, f"first update's logp_gap ({tag})", [gap], "", "0", "the largest over the iterations: each first "
            "update recomputes the log-probs its rollout recorded, on the same weights")
        if key == "fitted":
            for i, phase in enumerate(("rollout", "reward wait", "training")):  # the reward scored during the rollout
                row(t, f"{phase} share of the iteration", np.divide(p := [s[i] for s in splits], total), "share", "",
                    ms(p))

def compiled_rows(t: list, o, a: flowgrpo.Args):
    """--compile (each block compiled once, reused by all): the loop's forwards compiled, their first call, and dynamo's
    graphs and breaks; alone, on a model of its own."""
    from torch._dynamo.utils import counters
    _, peak = peak_flops(o)
    model, o.compile = model_of(a.model, o.device), True
    engine_of(o, a, model)
    model.transformer.eval()
    x = model.noise([torch.Generator()], a.height, a.width)
    s, c = torch.full((1,), 0.5, device=model.device), model.conditioning(texts_of(a)[:1], a.negative_prompt, 1.0)
    torch._dynamo.reset()
    counters.clear()
    start = time.perf_counter()
    with torch.no_grad():
        model.velocity(x, s, c, 1.0, a.height, a.width)
    sync()
    row(t, "--compile: first call (tracing and compiling)", [time.perf_counter() - start], "s", "", "B = 1")
    forward_rows(t, o, a, model, "the loop, --compile", sorted({4, len(texts_of(a))} if CUDA else {2}), peak)
    assert not counters["graph_break"], f"--compile: graph breaks {dict(counters['graph_break'])}"
    row(t, "--compile: dynamo graphs", [counters["stats"]["unique_graphs"]], "graphs", "", f"{len(model.blocks)} "
        "blocks, every size measured (a new size: a new graph); no graph break (asserted)")

# the engine's named options measured on a model of their own: (flag, the engine's keywords, the loop's flags that go
# with it, what its memory costs); --fp8-rollout's decoupled correction is the proximal pass Flow-GRPO needs with it
OPTIONS = {"merged": ("--merged-lora", dict(merged_lora=True), {}, "one more bf16 copy of every adapted weight"),
           "fp8": ("--fp8-rollout", dict(fp8_rollout=True), dict(stale_correction="decoupled"),
                   "one more byte per frozen weight of the blocks")}

def option_rows(t: list, o, a: flowgrpo.Args, key: str):
    """An option of OPTIONS (--merged-lora: merged_lora.py; --fp8-rollout: fp8_rollout.py) on a model of its own: the
    rollout's transformer forwards (the floor's sizes), then the recipe end to end at the micro-batch fitted to the
    device with the option (the `fitted` row's, which it is to be read against)."""
    flag, fields, loop_flags, cost = OPTIONS[key]
    _, peak, flag = *peak_flops(o), flag + (" --compile" if o.compile else "")
    a = dataclasses.replace(a, mixed_precision=True, **fields, **loop_flags)
    model, texts = model_of(a.model, o.device), texts_of(a)
    engine = engine_of(o, a, model, **fields)
    with engine.rollout_weights():
        forward_rows(t, o, a, model, f"the loop's rollout, {flag}", sorted({4, len(texts)} if CUDA else {2}), peak)
    a = dataclasses.replace(a, micro_batch=memory.fit(model, engine, a, len(texts), [(p, {}) for p in texts]))
    ticks, mem, flops, gap = end_to_end(o, a, model, engine, 1 + o.repeats)  # the first warms up, untimed
    total = [s.sum() for s in ticks[1:]]
    row(t, f"images/s per device, end to end ({flag})", np.divide(len(texts), total), "images/s", "≥ 1.0 on an H200",
        f"{a.model}; micro-batch {a.micro_batch} (fitted with the option)"
        + "".join(f", --{k.replace('_', '-')} {v}" for k, v in loop_flags.items()))
    row(t, f"peak memory ({flag})", [mem / 2**30], "GiB", "", cost)
    row(t, f"first update's logp_gap ({flag})", [gap], "", "0", "the largest over the iterations" + (
        " (the decoupled correction's proximal pass recomputes the log-probs in bf16)" if key == "fp8" else ""))

def offload_rows(t: list, o, a: flowgrpo.Args):
    """Parameter offload (FSDP2's CPUOffloadPolicy) on one micro-batch of the recipe's size: its peak and speed."""
    a = dataclasses.replace(a, offload=True, group_size=a.micro_batch)
    reset_peak()
    model = model_of(a.model, o.device)
    ticks, mem, *_ = end_to_end(o, a, model, make_engine(a, model), 1)
    row(t, "peak memory, parameter offload (FSDP2 CPUOffloadPolicy)", [mem / 2**30], "GiB", "", f"one micro-batch of "
        f"{a.micro_batch} images: {a.micro_batch / ticks[0].sum():.3g} images/s, one iteration")

def plain_rows(t: list, o, a: flowgrpo.Args):
    """bench/overhead.py's "training ÷ plain PyTorch update" at Qwen-Image's real width (24 heads × 128, text 3584; random
    weights, fp32, no mixed precision or checkpointing, which the plain update lacks): `--layers` of its 60 blocks, so
    that two copies fit (CPU: one block, in seconds an update)."""
    def build():
        torch.manual_seed(a.seed)  # the same weights for the loop's model and the plain one
        return random_model("qwen-image", o.device, layers=o.layers, fp32=True)
    b = sample(build(), a, sch.trained_steps(a.num_steps, a.window, a.window_range, seed=0))  # that copy then freed
    overhead.plain_rows(t, o, a, build, b, f"real width, {o.layers} of 60 blocks, {a.height}², CFG {a.cfg_scale:g}: ")

def sp_measure(o, sp: int) -> dict:
    """One rank of --sp sp (a torchrun rank; alone with --sp-fake, standing for rank 0 of sp through a process group
    whose collectives do nothing: the memory and compute of one rank, without the communication): the forward and
    backward of one training velocity of one image at --sp-side² (no activation checkpointing). Activation memory:
    the bytes of the distinct storages autograd saves for backward in the forward, parameters (and views of them) not
    counted; that is the activation peak, which backward then frees; on CUDA also the allocator's peak over the step,
    less what was allocated before it."""
    if o.sp_fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore
        os.environ.update(RANK="0", WORLD_SIZE=str(sp))
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=sp)
    model = random_model(o.model, o.device, heads=4)  # tiny: 4 heads (its recipe's 3 do not split); qwen-image: 24
    engine = eng.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=model.lora_targets, lr=1e-4, weight_decay=0,
                        max_grad_norm=1.0, seed=0, sp=sp, mixed_precision=CUDA)
    x = model.noise([torch.Generator().manual_seed(0)], o.sp_side, o.sp_side)
    sigma, cond = torch.full((1,), 0.5, device=o.device), model.conditioning(["a red cat"], " ", 1.0)  # 8 tokens
    seen, seconds = {}, []

    def pack(t):  # a tensor saved for backward: its storage, once
        if not isinstance(t if t._base is None else t._base, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    model.transformer.train()
    for _ in range(1 + o.repeats):
        seen.clear()
        sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if CUDA else 0
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            v = model.velocity(x, sigma, cond, 1.0, o.sp_side, o.sp_side)
        v.float().square().mean().backward()
        sync()
        seconds.append(time.perf_counter() - start)
    if o.profile:  # one more step on every rank (their collectives), printed by the first
        print_profile(f"--sp {sp}", lambda: model.velocity(x, sigma, cond, 1.0, o.sp_side, o.sp_side).float().square()
                      .mean().backward(), engine.is_main)
    return dict(saved=sum(seen.values()), peak=torch.cuda.max_memory_allocated() - before if CUDA else 0,
                seconds=seconds[1:], tokens=x.shape[1], main=engine.is_main)

def sp_rows(t: list, o, n: int):
    """--sp n ÷ --sp 1: n ranks of `python -m bench.gpu --sp-worker n` (CPU: gloo; CUDA: n GPUs, or --sp-fake on fewer), then
    --sp 1 in this process."""
    fake = CUDA and torch.cuda.device_count() < n
    ranks = [] if fake else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    cmd = [sys.executable, *ranks, "-m", "bench.gpu", "--sp-worker", str(n), "--sp-side", str(o.sp_side), "--device",
           o.device, "--model", o.model, "--repeats", str(o.repeats), *(["--sp-fake"] if fake else []),
           *(["--profile"] if o.profile else [])]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    gc.collect()  # the earlier rows' models are garbage by now
    print(out.stdout.split("SP-RESULT", 1)[0], end="", flush=True)  # the split's profile, with --profile
    split = json.loads(out.stdout.split("SP-RESULT", 1)[1].splitlines()[0])
    one = sp_measure(o, 1)
    how = f"one GPU standing for rank 0 of {n} (--sp-fake)" if fake else f"{n} ranks"
    what = f"{o.model}, 1 image {o.sp_side}² ({one['tokens']} image tokens), fwd+bwd, no checkpointing, {how}"
    row(t, f"SP: activation memory per rank, --sp {n} ÷ --sp 1", [split["saved"] / one["saved"]], "×",
        f"≈ 1/{n} (attention: exactly)", f"bytes saved for backward; {what}; {one['saved'] / 2**20:.1f} vs "
        f"{split['saved'] / 2**20:.1f} MiB")
    if CUDA:
        row(t, f"SP: peak CUDA memory of the step per rank, --sp {n} ÷ --sp 1", [split["peak"] / one["peak"]], "×",
            f"≈ 1/{n}", f"allocator peak less what was allocated before; {one['peak'] / 2**30:.2f} vs "
                        f"{split['peak'] / 2**30:.2f} GiB")
    row(t, f"SP: time per fwd+bwd, --sp {n} ÷ --sp 1", np.divide(split["seconds"], one["seconds"]), "×",
        f"≥ 1/{n}", f"{what}; {ms(one['seconds'])} vs {ms(split['seconds'])}" + (", no communication" if fake else ""))

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    families = [f"{t}{n}" for n in bench_families.NAMES for t in ("", "tiny-")]  # tiny-<name>: its dry run on CPU
    p.add_argument("--model", choices=("tiny", "qwen-image", *families), default="tiny", help="--random-init: the "
                   "architecture and its recipe (recipes.py); --sp, --plain: Qwen-Image's only")
    p.add_argument("--device", default="cuda" if CUDA else "cpu")
    p.add_argument("--random-init", action="store_true", help="the public recipe end to end, random weights (GPU)")
    p.add_argument("--plain", action="store_true", help="the loop's update ÷ the plainest PyTorch's at the real width")
    p.add_argument("--layers", type=int, help="--plain: transformer blocks (default: CPU 1, CUDA 4)")
    p.add_argument("--quick", action="store_true", help="smallest sizes and one repeat (the smoke test)")
    p.add_argument("--repeats", type=int, help="timed repeats per row (default 9; --quick 1; --random-init 2)")
    p.add_argument("--reward", help="--random-init's reward (default: the recipe's, OCR; for PickScore, whose CLIP "
                   "weights are a download, jpeg_compressibility)")
    p.add_argument("--rows", default="fitted,recipe,floor", help="--random-init's rows, comma-separated: fitted "
                   "(--micro-batch 0), recipe (its micro-batch), reuse (fitted, --reuse-rollout-forward: the update on "
                   "the rollout's kept forwards, every image in one optimizer step), held (fitted within "
                   "--memory-limit, the allocator held to it; after the others), floor (forwards, the loop ÷ "
                   "diffusers' bare), offload (FSDP2 parameter offload, one micro-batch; alone, a model of its own), compiled (--compile: the loop's "
                   "forwards compiled, dynamo's graphs and breaks; alone), merged (--merged-lora) and fp8 (--fp8-rollout): "
                   "the option's rollout forwards and the recipe end to end; each alone")
    p.add_argument("--compile", action="store_true", help="--random-init's rows with the loop's blocks compiled (the "
                   "loop's --compile), bare diffusers' not")
    p.add_argument("--compile-backend", default="inductor", help="--compile's and --rows compiled's torch.compile "
                   "backend (the dry run's aot_eager: dynamo's graphs without inductor's C++ build)")
    p.add_argument("--memory-limit", type=float, default=60.0, help="--rows held: GiB the allocator is held to and "
                   "the micro-batch fitted within (default: an 80-GB GPU less the 16-GB text encoder and room)")
    p.add_argument("--markdown", help="also write the table, with the command, revision, date and load, to this file")
    p.add_argument("--sp", type=int, help="the rows of Ulysses sequence parallelism, --sp N ÷ --sp 1, instead of "
                   "--random-init's")
    p.add_argument("--sp-side", type=int, help="their image side (default: CPU 512, --quick 64; CUDA 1024, or 768 on "
                   "a GPU of under 100 GiB)")
    p.add_argument("--profile", action="store_true", help="also print the costliest operators of --sp's step on each "
                   "side, or of the forward rows' smallest batch")
    p.add_argument("--sp-worker", type=int, help=argparse.SUPPRESS)  # one rank of a sequence-parallel measurement
    p.add_argument("--sp-fake", action="store_true", help=argparse.SUPPRESS)
    o, t = p.parse_args(argv), list(HEAD)
    if not (o.random_init or o.sp or o.sp_worker or o.plain):
        p.error("give --random-init (images/s, MFU, peak memory), --plain (the update ÷ plain PyTorch at the real "
                "width) or --sp N (the --sp N ÷ --sp 1 rows); the CPU overhead table is `python -m bench.overhead`")
    if (o.sp or o.sp_worker or o.plain) and o.model not in ("tiny", "qwen-image"):
        p.error(f"--sp and --plain measure Qwen-Image (--model tiny or qwen-image), got --model {o.model}: give "
                "--random-init for its recipe")
    o.repeats, quick = o.repeats or (1 if o.quick else 2 if o.random_init else 9), o.quick
    if o.device == "cpu":
        torch.set_num_threads(1)  # 2 threads on the loaded 2-core box: 3-18× slower, erratic
    # CUDA: 1024², whose --sp 1 side (one image of the 20 B model without checkpointing: 41 GiB of weights and 32 of
    # activations on the H200) an 80-GB GPU could not be sure to hold; 768² there (about 18 GiB of activations)
    big = CUDA and torch.cuda.get_device_properties(0).total_memory >= 100 * 2**30
    o.sp_side = o.sp_side or ((1024 if big else 768) if CUDA else 64 if quick else 512)
    if o.sp_worker:  # one rank of sp_rows' measurement
        result = sp_measure(o, o.sp_worker)
        if result["main"]:
            print("SP-RESULT", json.dumps(result))
        eng.exit_process(0)  # a rank that ran collectives ends without the interpreter's teardown (engine.exit_process)
    if o.sp:
        sp_rows(t, o, o.sp)
    elif o.plain:  # the recipe without its GPU memory savers; CPU: 32², 2 images, 4 steps; CUDA: 512², 8 images
        o.layers = o.layers or (4 if CUDA else 1)
        size = dict(height=512, width=512, group_size=8, micro_batch=4) if CUDA else dict(
            height=32, width=32, group_size=2, micro_batch=2, num_steps=4, window_range=(0, 3))
        plain_rows(t, o, dataclasses.replace(flowgrpo.RECIPES["qwen-image"], prompts_per_iteration=1,
                                             mixed_precision=False, activation_checkpointing=False, **size))
    else:  # --random-init: the public recipe, one group per iteration; tiny: at the tiny model's sizes
        toy = dict(height=32, width=32, lora_rank=8, group_size=4 if quick else 8) if o.model.startswith("tiny") else {}
        r = flowgrpo.RECIPES["qwen-image" if o.model in ("tiny", "qwen-image") else o.model.removeprefix("tiny-")]
        # a reward that needs no weights: the recipe's OCR, or in place of PickScore (its CLIP weights a download)
        reward = o.reward or (r.reward if r.reward == "ocr" else "jpeg_compressibility")
        a = dataclasses.replace(r, model=o.model, prompts_per_iteration=1, reward=reward, **toy)
        o.rows = o.rows.split(",")
        alone = {"offload": offload_rows, "compiled": compiled_rows,
                 **{key: functools.partial(option_rows, key=key) for key in OPTIONS}}
        alone.get(",".join(o.rows), gpu_rows)(t, o, a)
    if o.markdown:
        rev = subprocess.run("git rev-parse --short HEAD || true", shell=True, cwd=ROOT, capture_output=True, text=True)
        command = f"python -m bench.gpu {' '.join(sys.argv[1:] if argv is None else argv)}"
        head = f"`{command}` at {rev.stdout.strip() or '?'}"
        open(o.markdown, "w").write("\n".join([f"{head}, {time.ctime()}, load {os.getloadavg()[0]:.2f}\n", *t, ""]))

if __name__ == "__main__":
    main()
