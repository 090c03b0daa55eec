"""bench_gpu.py: the public recipe on random weights at real width (images/s, MFU, peak memory), and the --sp rows.
    python bench_gpu.py --device cuda --model qwen-image --random-init  # GPU: images/s, split, MFU, peak memory
    python bench_gpu.py --model tiny --random-init [--quick]            # that path on CPU at toy size (a dry run)
    python bench_gpu.py --sp 2 [--device cuda --model qwen-image]        # the --sp 2 ÷ --sp 1 rows (CPU too)
    python bench_gpu.py --plain [--device cuda] [--layers N]             # the update ÷ plain PyTorch, real width
Rows: median, min, max over repeats after a warm-up, as bench.py's. See BENCHMARKS.md."""
import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from statistics import median as med

import numpy as np
import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

import algorithms
import bench
import engine as eng
import flowgrpo
import models_qwen
import rewards
import scheduler as sch
from bench import CUDA, HEAD, ROOT, make_engine, measure, ms, row, sample, sync, texts_of, train, vm_hwm

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16 tensor-core peaks, vendor data sheets

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

def pass_flops(c, s_img: int, s_txt: int, r: int) -> float:
    """FLOPs (multiply-add = 2) of one forward of Qwen-Image's MMDiT for one image; d = heads × head_dim, L blocks,
    S = s_img + s_txt tokens, each through its own stream's weights (tests/test_bench.py checks it: FlopCounterMode):
      L·(24·d²·S [q, k, v, out 4d²; MLP d→4d→d 8d²] + 4·d·S² [joint attention] + 32·r·d·S [LoRA rank r on q, k, v,
      MLP] + 24·d² [modulations]) + 2·d·(c_in·s_img + D_txt·s_txt + 4·c_out·s_img) + 2·(256·d + d²) + 4·d²"""
    d, S, io = c.num_attention_heads * c.attention_head_dim, s_img + s_txt, c.in_channels + 4 * c.out_channels
    blocks = c.num_layers * (24 * d * d * S + 4 * d * S * S + 32 * r * d * S + 24 * d * d)
    return blocks + 2 * d * (io * s_img + c.joint_attention_dim * s_txt) + 2 * (256 * d + d * d) + 4 * d * d

def end_to_end(o, a: flowgrpo.Args):  # iterations as flowgrpo.main's -> (seconds per phase, peak memory, FLOPs/image)
    gc.collect()  # the previous run's model is garbage now
    if CUDA:
        torch.cuda.empty_cache()
    model, texts, ticks = random_model(a.model, o.device), texts_of(a), []
    engine, pool = make_engine(a, model), rewards.AsyncRewards(rewards.make_reward(a.reward))
    # The peak of training, not of building: the model is built on the device even when offload then moves it out.
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset VmHWM
    steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=0)
    for _ in range(1 + o.repeats):
        start = time.perf_counter()
        b = sample(model, a, steps, on_images=lambda c, x: pool.submit(x, texts[c:c + len(x)]),
                   keep=len(texts) if a.reuse_rollout_forward else 0)  # train() takes one optimizer step: all images
        rolled, scores = time.perf_counter(), torch.as_tensor(pool.collect()[0]).float()
        b.advantages = algorithms.group_advantages(scores, b.group, std=a.std, clip=a.adv_clip)[0].to(model.device)
        scored = time.perf_counter()
        train(model, engine, b, a)
        sync()
        ticks.append(np.diff([start, rolled, scored, time.perf_counter()]))
    pool.close()
    # An image: N rollout passes and W trained steps of forward + backward per CFG branch; LoRA's backward costs one
    # forward (activation gradients; the frozen weights need none); checkpointing's recompute is not counted (MFU).
    # --reuse-rollout-forward: the trained steps' forwards are rollout passes already, the backward alone is added.
    flops = sum(pass_flops(model.transformer.config, model.image_seq_len(a.height, a.width), b.cond[k].shape[1],
                           a.lora_rank) for k in ("embeds", "neg_embeds")[:1 + (a.cfg_scale > 1)])
    peak = torch.cuda.max_memory_allocated() if CUDA else vm_hwm(os.getpid())
    return ticks[1:], peak, flops * (a.num_steps + (1 if a.reuse_rollout_forward else 2) * len(steps))

def gpu_rows(t: list, o, a: flowgrpo.Args):
    name, x = torch.cuda.get_device_name() if CUDA else "cpu", torch.randn(2048, 2048, device=o.device)
    peak = 1e12 * next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0) or \
        2 * 2048 ** 3 / min(measure({0: lambda: x @ x}, 5)[0])  # no data sheet (CPU): the measured matmul rate
    splits, mem, flops = end_to_end(o, a)
    n, total = a.prompts_per_iteration * a.group_size, [s.sum() for s in splits]
    row(t, "images/s per device, end to end", np.divide(n, total), "images/s", "≥ 0.5 on an H200", f"{name}; {n} "
        f"images {a.height}², {a.num_steps} steps, W {a.window}, CFG {a.cfg_scale:g}, r{a.lora_rank}, {a.reward}")
    for i, phase in enumerate(("rollout", "reward wait", "training")):  # the reward is scored during the rollout
        row(t, f"{phase} share of the iteration", np.divide(p := [s[i] for s in splits], total), "share", "", ms(p))
    row(t, "MFU", np.divide(flops * n / peak, total), "of peak", "", f"transformer FLOPs (pass_flops) "
        f"{flops / 1e12:.4g} T/image; VAE, text encoder, reward not counted; peak {peak / 1e12:.4g} T/s")
    row(t, "peak memory, no offload", [mem / 2**30], "GiB", "", "CUDA allocator peak" if CUDA else "process VmHWM")
    splits, mem, _ = end_to_end(o, dataclasses.replace(a, offload=True, group_size=a.micro_batch))
    row(t, "peak memory, parameter offload (FSDP2 CPUOffloadPolicy)", [mem / 2**30], "GiB", "", f"one micro-batch of "
        f"{a.micro_batch} images: {a.micro_batch / med([s.sum() for s in splits]):.3g} images/s")

def plain_rows(t: list, o, a: flowgrpo.Args):
    """bench.py's "training ÷ plain PyTorch update" at Qwen-Image's real width (24 heads × 128, text 3584; random
    weights, fp32, no mixed precision or checkpointing, which the plain update lacks): `--layers` of its 60 blocks, so
    that two copies fit (CPU: one block, in seconds an update)."""
    def build():
        torch.manual_seed(a.seed)  # the same weights for the loop's model and the plain one
        return random_model("qwen-image", o.device, layers=o.layers, fp32=True)
    b = sample(build(), a, sch.trained_steps(a.num_steps, a.window, a.window_range, seed=0))  # that copy then freed
    bench.plain_rows(t, o, a, build, b, f"real width, {o.layers} of 60 blocks, {a.height}², CFG {a.cfg_scale:g}: ")

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
    return dict(saved=sum(seen.values()), peak=torch.cuda.max_memory_allocated() - before if CUDA else 0,
                seconds=seconds[1:], tokens=x.shape[1], main=engine.is_main)

def sp_rows(t: list, o, n: int):
    """--sp n ÷ --sp 1: n ranks of `bench_gpu.py --sp-worker n` (CPU: gloo; CUDA: n GPUs, or --sp-fake on fewer), then
    --sp 1 in this process."""
    fake = CUDA and torch.cuda.device_count() < n
    ranks = [] if fake else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    cmd = [sys.executable, *ranks, "bench_gpu.py", "--sp-worker", str(n), "--sp-side", str(o.sp_side), "--device",
           o.device, "--model", o.model, "--repeats", str(o.repeats), *(["--sp-fake"] if fake else [])]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    gc.collect()  # the earlier rows' models are garbage by now
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
    p.add_argument("--model", choices=("tiny", "qwen-image"), default="tiny")
    p.add_argument("--device", default="cuda" if CUDA else "cpu")
    p.add_argument("--random-init", action="store_true", help="the public recipe end to end, random weights (GPU)")
    p.add_argument("--plain", action="store_true", help="the loop's update ÷ the plainest PyTorch's at the real width")
    p.add_argument("--layers", type=int, help="--plain: transformer blocks (default: CPU 1, CUDA 4)")
    p.add_argument("--quick", action="store_true", help="smallest sizes and one repeat (the smoke test)")
    p.add_argument("--repeats", type=int, help="timed repeats per row (default 9; --quick 1; --random-init 2)")
    p.add_argument("--reward", help="--random-init's reward (default: the recipe's, ocr)")
    p.add_argument("--reuse-rollout-forward", action="store_true", help="--random-init: the update on the rollout's "
                   "kept forwards (flowgrpo.py's flag; here every image, one optimizer step)")
    p.add_argument("--markdown", help="also write the table, with the command, revision, date and load, to this file")
    p.add_argument("--sp", type=int, help="the rows of Ulysses sequence parallelism, --sp N ÷ --sp 1, instead of "
                   "--random-init's")
    p.add_argument("--sp-side", type=int, help="their image side (default: CPU 512, --quick 64; CUDA 1024)")
    p.add_argument("--sp-worker", type=int, help=argparse.SUPPRESS)  # one rank of a sequence-parallel measurement
    p.add_argument("--sp-fake", action="store_true", help=argparse.SUPPRESS)
    o, t = p.parse_args(argv), list(HEAD)
    if not (o.random_init or o.sp or o.sp_worker or o.plain):
        p.error("give --random-init (images/s, MFU, peak memory), --plain (the update ÷ plain PyTorch at the real "
                "width) or --sp N (the --sp N ÷ --sp 1 rows); the CPU overhead table is `python bench.py`")
    o.repeats, quick = o.repeats or (1 if o.quick else 2 if o.random_init else 9), o.quick
    if o.device == "cpu":
        torch.set_num_threads(1)  # 2 threads on the loaded 2-core box: 3-18× slower, erratic
    o.sp_side = o.sp_side or (1024 if CUDA else 64 if quick else 512)
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
        toy = dict(height=32, width=32, lora_rank=8, group_size=4 if quick else 8) if o.model == "tiny" else {}
        gpu_rows(t, o, dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model=o.model, prompts_per_iteration=1,
                                           reward=o.reward or flowgrpo.RECIPES["qwen-image"].reward,
                                           reuse_rollout_forward=o.reuse_rollout_forward, **toy))
    if o.markdown:
        rev = subprocess.run("git rev-parse --short HEAD || true", shell=True, cwd=ROOT, capture_output=True, text=True)
        command = f"python bench_gpu.py {' '.join(sys.argv[1:] if argv is None else argv)}"
        head = f"`{command}` at {rev.stdout.strip() or '?'}"
        open(o.markdown, "w").write("\n".join([f"{head}, {time.ctime()}, load {os.getloadavg()[0]:.2f}\n", *t, ""]))

if __name__ == "__main__":
    main()
