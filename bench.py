"""bench.py: Flow-GRPO's cost against the floor set by the model itself, as ratios measured side by side.
    python bench.py [--quick] [--markdown FILE]                      # CPU, tiny model: the overhead table
    python bench.py soak [--clients C --requests R --hostile F]      # the reward server under load and attack
    python bench.py --device cuda --model qwen-image --random-init  # GPU: images/s, split, MFU, peak memory
    python bench.py --model tiny --random-init [--quick]            # that path on CPU at toy size (a dry run)
    python bench.py --sp 2 [--device cuda --model qwen-image]        # only the --sp 2 ÷ --sp 1 rows (CPU: in the table)
Rows: median, min, max over repeats after a warm-up, candidates alternating within a repeat. See BENCHMARKS.md."""
import argparse
import base64
import contextlib
import dataclasses
import gc
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from statistics import median as med

import numpy as np
import psutil
import torch
from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

import algorithms
import engine as eng
import flowgrpo
import models
import models_qwen
import prompts as prompt_sets
import reward_http
import rewards
import rollout
import scheduler as sch

ROOT = os.path.dirname(os.path.abspath(__file__))
CUDA = torch.cuda.is_available()
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}  # dense bf16 tensor-core peaks, vendor data sheets
HEAD = ["| measurement | median | min | max | unit | target / expected | note |", "|---" * 7 + "|"]
sync = torch.cuda.synchronize if CUDA else (lambda: None)

def ms(seconds) -> str:
    return f"{1e3 * med(seconds):.1f} ms"

def measure(fns: dict, repeats: int, warmup: int = 1) -> dict:
    """{name: [seconds]}: each fn timed `repeats` times after `warmup` untimed rounds, the fns interleaved."""
    times = {k: [] for k in fns}
    for r in range(warmup + repeats):
        for k, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if r >= warmup:
                times[k].append(time.perf_counter() - start)
    return times

def row(t: list, name, values, unit="×", expect="", note=""):
    v = [float(x) for x in values]  # printed as measured: a later failure (a GPU out of memory) loses no earlier row
    t.append(f"| {name} | {med(v):.4g} | {min(v):.4g} | {max(v):.4g} | {unit} | {expect} | {note} |")
    print(*t[-1 if len(t) > len(HEAD) + 1 else 0:], sep="\n", flush=True)  # the header with the first row

def make_engine(a: flowgrpo.Args, model, **extra) -> eng.Engine:  # extra: e.g. old_policy=True
    return eng.Engine(model, **extra, **{k: getattr(a, k) for k in ("lora_rank", "lora_alpha", "lora_targets", "lr",
                      "seed", "weight_decay", "max_grad_norm", "offload", "activation_checkpointing",
                      "mixed_precision")})

def texts_of(a: flowgrpo.Args) -> list[str]:  # the iteration's P·G prompts: image i shows the set's prompt i // G
    chosen = prompt_sets.load_prompts(a.prompts).train[:a.prompts_per_iteration]
    return [p for p, _ in chosen for _ in range(a.group_size)]

def sample(model, a, steps, cfg=None, on_images=None, **variant):  # rollout.sample on the iteration's images (branch=,
    ids = torch.arange(a.prompts_per_iteration * a.group_size)  # ode_solver= in `variant`); random advantages
    model.transformer.eval()
    b = rollout.sample(model, texts_of(a), [{}] * len(ids), ids // a.group_size, ids, steps=steps, height=a.height,
                       width=a.width, num_steps=a.num_steps, cfg_scale=a.cfg_scale if cfg is None else cfg,
                       negative_prompt=a.negative_prompt, noise_level=a.noise_level if steps else 0.0, seed=a.seed,
                       sde_type=a.sde_type, iteration=0, chunk=a.micro_batch, on_images=on_images, **variant)
    b.advantages = torch.randn(len(ids), generator=torch.Generator().manual_seed(1)).to(model.device)
    return b

def diffusers_call(model, a, cfg, prompts):
    """The pipeline's call on the same initial latents (generators) and embeddings (not strings: BENCHMARKS.md)."""
    c = model.conditioning(prompts, a.negative_prompt, cfg)
    return model.pipe(**model.pipeline_kwargs(c, cfg), num_inference_steps=a.num_steps, height=a.height, width=a.width,
                      output_type="pt", generator=rollout.image_generators(a.seed, 0, range(len(prompts)))).images

def train(model, engine, batch, a):  # one update as the loop takes it (every micro-batch × trained step), a.algorithm's
    a = dataclasses.replace(a, optimizer_steps=1, prompts_per_iteration=1, group_size=len(batch.prompts))
    model.transformer.train()
    algorithms.ALGORITHMS[a.algorithm].update(model, engine, batch, a, flowgrpo.batch_arithmetic(a, 1), False)

def bare_fwd_bwd(model, engine, batch, a):
    """`train`'s floor: the adapter's velocity alone (its transformer calls and the pipeline's own CFG arithmetic)
    on the same inputs, then backward."""
    model.transformer.train()
    for mb in (batch.chunk(m, m + a.micro_batch) for m in range(0, len(batch.prompts), a.micro_batch)):
        for j in range(len(mb.sigmas) - 1):
            v = model.velocity(mb.latents[:, j], mb.sigmas[j].expand(a.micro_batch), mb.cond, a.cfg_scale, a.height,
                               a.width)
            v.float().square().mean().backward()
    engine.optimizer.zero_grad(set_to_none=False)

def model_rows(t: list, o, a: flowgrpo.Args):
    model = models.load_model(a.model, None, o.device, seed=a.seed)
    engine, full = make_engine(a, model), list(range(a.num_steps - 1))
    window = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=0)
    ode = sample(model, a, [], 4.0)  # the same inputs, checked: our ODE path reproduces the pipeline's images
    assert torch.allclose(ode.images, diffusers_call(model, a, 4.0, ode.prompts).cpu(), atol=1e-5)
    for cfg in (1.0, 4.0):
        r = measure({"ours": lambda: sample(model, a, full, cfg),
                     "diffusers": lambda: diffusers_call(model, a, cfg, ode.prompts)}, o.repeats)
        row(t, f"rollout ÷ diffusers, CFG {'on (4)' if cfg > 1 else 'off'}", np.divide(r["ours"], r["diffusers"]), "×",
            "≤ 1.10", f"full SDE, {a.num_steps} steps, {len(ode.prompts)} images {a.height}²; {ms(r['ours'])} vs "
            f"{ms(r['diffusers'])}")
    full_b, window_b = sample(model, a, full), sample(model, a, window)
    r = measure({"train": lambda: train(model, engine, full_b, a), "window": lambda: train(model, engine, window_b, a),
                 "bare": lambda: bare_fwd_bwd(model, engine, full_b, a)}, o.repeats)
    row(t, "training ÷ bare fwd+bwd", np.divide(r["train"], r["bare"]), "×", "≤ 1.15", f"full mode, W = {len(full)}, "
        f"{len(full_b.prompts)} images; train {ms(r['train'])}, bare {ms(r['bare'])}")
    row(t, "window ÷ full training", np.divide(r["window"], r["train"]), "×", f"W/(N−1) = {a.window / len(full):.3f}"
        f" ± 10%", f"W = {a.window} of N = {a.num_steps} steps; window {ms(r['window'])}")
    r = measure({g: lambda ag=dataclasses.replace(a, group_size=g): train(model, engine, sample(model, ag, window), ag)
                 for g in o.groups}, o.repeats)
    cost = {g: np.divide(r[g], a.prompts_per_iteration * g) for g in o.groups}  # seconds per image
    for g in o.groups[1:]:
        row(t, f"cost per image (rollout + train), G = {g} ÷ G = {o.groups[0]}", cost[g] / cost[o.groups[0]], "×",
            "≈ 1", f"{a.prompts_per_iteration} prompts × G, window mode; {ms(cost[g])} vs {ms(cost[o.groups[0]])}")
    from PIL import Image, ImageDraw, ImageFont  # rewards see text at the recipe's size: OCR's cost is finding it
    prompts, size = [p for p, _ in prompt_sets.load_prompts("ocr").train[:o.reward_images]], o.reward_size
    im = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(im).text((size // 10, size // 2), rewards.ocr_target(prompts[0]), "black",
                            ImageFont.load_default(size=size // 12))
    images = (torch.from_numpy(np.array(im)).permute(2, 0, 1) / 255).expand(len(prompts), -1, -1, -1)
    fns = {k: rewards.make_reward(k) for k in ("jpeg_compressibility", "jpeg_incompressibility", "brightness", "ocr")}
    for k, v in measure({k: (lambda f=f: f(images, prompts)) for k, f in fns.items()}, o.repeats).items():
        row(t, f"reward {k}", np.multiply(v, 1e3 / len(prompts)), "ms/image", "", f"{len(prompts)} images {size}²")
    # As flowgrpo.main: OCR scores each decoded chunk (on_images) in AsyncRewards' thread while the next samples, vs one
    # after the other; on the images upscaled to 64², where it costs about the tiny rollout's time (at 32², ~8%).
    n, pool = a.micro_batch, rewards.AsyncRewards(fns["ocr"])
    ac = dataclasses.replace(a, prompts="ocr", prompts_per_iteration=o.chunks, group_size=n)  # a prompt per chunk
    texts = texts_of(ac)

    def up(x):
        return torch.nn.functional.interpolate(x, size=64)

    def rollout_only():
        return sample(model, ac, window)

    def submit(c, x):
        return pool.submit(up(x), texts[c:c + len(x)])
    r = measure({"rollout": rollout_only, "serial": lambda: fns["ocr"](up(rollout_only().images), texts),
                 "overlapped": lambda: (sample(model, ac, window, on_images=submit), pool.collect())}, o.repeats)
    roll, serial, over = (np.array(r[k]) for k in ("rollout", "serial", "overlapped"))
    best = 1 - np.minimum(serial - roll, roll * (o.chunks - 1) / o.chunks) / serial  # hidden behind all chunks but one
    row(t, "rollout + OCR reward: AsyncRewards overlapped ÷ serial", over / serial, "×", f"≥ {med(best):.2f} (perfect "
        f"overlap)", f"hides {med((serial - over) / (serial - roll)):.0%} of the reward time; {o.chunks} chunks × {n} "
        f"images {a.height}² (OCR at 64²); rollout {ms(roll)}, serial {ms(serial)}")
    pool.close()

def family_rows(t: list, o, a: flowgrpo.Args, name: str, cfg: float, guide: str):
    """The tiny SD3 (CFG 4.5) and FLUX (guidance embedding 3.5) models: rollout and training against their floors."""
    model = models.load_model(name, None, o.device, seed=a.seed)
    a = dataclasses.replace(a, model=name, lora_targets=model.lora_targets, cfg_scale=cfg, negative_prompt="")
    engine, full = make_engine(a, model), list(range(a.num_steps - 1))
    ode = sample(model, a, [])  # the same inputs, checked: our ODE path reproduces the pipeline's images
    assert torch.allclose(ode.images, diffusers_call(model, a, cfg, ode.prompts).cpu(), atol=1e-5)
    r = measure({"ours": lambda: sample(model, a, full),
                 "diffusers": lambda: diffusers_call(model, a, cfg, ode.prompts)}, o.repeats)
    row(t, f"{name}: rollout ÷ diffusers", np.divide(r["ours"], r["diffusers"]), "×", "≤ 1.10", f"full SDE, {guide}, "
        f"{a.num_steps} steps, {len(ode.prompts)} images {a.height}²; {ms(r['ours'])} vs {ms(r['diffusers'])}")
    full_b = sample(model, a, full)
    r = measure({"train": lambda: train(model, engine, full_b, a),
                 "bare": lambda: bare_fwd_bwd(model, engine, full_b, a)}, o.repeats)
    row(t, f"{name}: training ÷ bare fwd+bwd", np.divide(r["train"], r["bare"]), "×", "≤ 1.15", f"full mode, {guide}, "
        f"W = {len(full)}, {len(full_b.prompts)} images; train {ms(r['train'])}, bare {ms(r['bare'])}")

def variant_rows(t: list, o, a: flowgrpo.Args):
    """--branch and --ode-solver dpm2 against independent Euler rollouts of the same images, window and model: the
    rollout's transformer work per image (the VAE decode, the same per image in all three and most of the tiny model's
    rollout time, is skipped), G = 8, N = 10, window [s, s + 1]."""
    model, rows, s = models.load_model(a.model, None, o.device, seed=a.seed), [], 3
    a = dataclasses.replace(a, num_steps=10, group_size=8, micro_batch=8, cfg_scale=1.0, height=o.variant_size,
                            width=o.variant_size)
    velocity, images = model.velocity, a.prompts_per_iteration * a.group_size
    def counted(x, *args, **kwargs):  # image rows through the transformer  # noqa: E306
        rows.append(len(x))
        return velocity(x, *args, **kwargs)
    def no_decode(x, height, width):  # noqa: E306
        return x.new_zeros(len(x), 3, 1, 1)
    model.velocity, model.decode = counted, no_decode
    kinds = {"independent": {}, "branch": dict(branch=True), "dpm2": dict(ode_solver="dpm2")}
    calls = {}
    for k, kw in kinds.items():  # transformer rows per image, counted on one rollout
        rows.clear()
        sample(model, a, [s, s + 1], **kw)
        calls[k] = sum(rows) / images
    r = measure({k: (lambda kw=kw: sample(model, a, [s, s + 1], **kw)) for k, kw in kinds.items()}, o.repeats)
    expect = (s / a.group_size + a.num_steps - s) / a.num_steps
    row(t, "rollout per image, --branch ÷ independent", np.divide(r["branch"], r["independent"]), "×",
        f"(s/G + N − s)/N = {expect:.4f} ± 10%", f"s = {s}, G = {a.group_size}, N = {a.num_steps}, {images} images "
        f"{a.height}², VAE decode skipped; transformer rows per image {calls['branch']:.3f} vs "
        f"{calls['independent']:.0f}; {ms(r['branch'])} vs {ms(r['independent'])}")
    row(t, "rollout per image, --ode-solver dpm2 ÷ euler", np.divide(r["dpm2"], r["independent"]), "×",
        f"calls {calls['dpm2']:.0f}/{calls['independent']:.0f} = {calls['dpm2'] / calls['independent']:.2f}", f"window "
        f"[{s}, {s + 1}] of {a.num_steps} steps, the {a.num_steps - s - 2} ODE steps after it in "
        f"{sch.ode_calls('dpm2', a.num_steps - s - 2)} calls; {ms(r['dpm2'])} vs {ms(r['independent'])}")

def forward_rows(t: list, o, a: flowgrpo.Args):
    """DiffusionNFT (T = N − 1 timesteps per image, as its recipes: the trained policy with gradient, the old and the
    reference policy without) against Flow-GRPO (full mode, and a window of 2; its reference KL on, as in the SD3.5
    recipe) on the same model and images: training cost and transformer rows per image. And the rollout without
    log-probs (ODE on every step, only the final latents kept) against the SDE rollout, at variant_rows' 256², the VAE
    decode skipped."""
    model, rows = models.load_model(a.model, None, o.device, seed=a.seed), []
    velocity = model.velocity
    def counted(x, *args, **kwargs):  # image rows through the transformer  # noqa: E306
        rows.append(len(x))
        return velocity(x, *args, **kwargs)
    model.velocity, n = counted, a.prompts_per_iteration * a.group_size
    g = dataclasses.replace(a, kl_beta=0.01)
    kinds = {"full": (g, list(range(a.num_steps - 1))), "window": (g, [0, 1]),
             "nft": (dataclasses.replace(g, algorithm="nft", train_timesteps=a.num_steps - 1,
                                         train_timestep_range=(0, a.num_steps)), [])}
    engine, batches, calls = make_engine(a, model, old_policy=True), {}, {}
    for k, (ak, steps) in kinds.items():
        batches[k] = sample(model, ak, steps)
        batches[k].advantages = algorithms.ALGORITHMS[ak.algorithm].weights(batches[k].advantages, ak)
        rows.clear()
        train(model, engine, batches[k], ak)
        calls[k] = sum(rows) / n
    r = measure({k: (lambda k=k: train(model, engine, batches[k], kinds[k][0])) for k in kinds}, o.repeats)
    for k, what in (("full", "full mode"), ("window", "window 2")):
        row(t, f"training per image, nft ÷ grpo {what}", np.divide(r["nft"], r[k]), "×", f"rows {calls['nft']:.0f}/"
            f"{calls[k]:.0f} = {calls['nft'] / calls[k]:.2f}", f"transformer rows per image: nft {calls['nft']:.0f} "
            f"(T = {a.num_steps - 1} × 3, one with gradient), grpo {calls[k]:.0f} (W × 2); {n} images {a.height}², "
            f"{a.num_steps} steps; {ms(r['nft'])} vs {ms(r[k])}")
    v = dataclasses.replace(a, height=o.variant_size, width=o.variant_size, cfg_scale=1.0)
    def no_decode(x, height, width):  # the VAE: the same in both, and not what differs  # noqa: E306
        return x.new_zeros(len(x), 3, 1, 1)
    model.decode = no_decode
    r = measure({"sde": lambda: sample(model, v, list(range(a.num_steps - 1))), "ode": lambda: sample(model, v, []),
                 "dpm2-full": lambda: sample(model, v, [], ode_solver="dpm2-full")}, o.repeats)
    for k in ("ode", "dpm2-full"):
        row(t, f"rollout per image, ODE ({'euler' if k == 'ode' else k}) without log-probs ÷ SDE", np.divide(
            r[k], r["sde"]), "×", "≈ 1 (the same calls)", f"{a.num_steps} calls per image each, {n} images "
            f"{v.height}², VAE decode skipped; {ms(r[k])} vs {ms(r['sde'])}")

def vm_hwm(pid) -> int:  # a process's peak resident memory so far: the kernel's own high-water mark, no sampling gaps
    return next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmHWM:"))

def torchrun(n: int, o):  # flowgrpo.py on n gloo ranks -> (sum of perf/* per iteration but the first, {rank: VmHWM})
    with tempfile.TemporaryDirectory() as d, open(os.path.join(d, "log"), "w+") as log:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "flowgrpo.py",
               "--run-dir", d, *o.ranks]
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")  # one core per rank (main: why)
        proc, peak = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), {}
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error, OSError):  # a rank may exit between the listing and the read
                for child in psutil.Process(proc.pid).children(recursive=True):
                    if (rank := child.environ().get("RANK")) is not None:  # a worker, not torchrun's agent
                        peak[int(rank)] = max(peak.get(int(rank), 0), vm_hwm(child.pid))
            time.sleep(0.05)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{open(log.name).read()[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
        return [sum(v for k, v in r.items() if k.startswith("perf/")) for r in rows[1:] or rows], peak

def rank_rows(t: list, o):  # 1-rank and 2-rank launches alternate, as the load drifts between launches
    runs = [(torchrun(1, o), torchrun(2, o)) for _ in range(o.rank_pairs)]
    t1, t2 = [med(r1[0]) for r1, _ in runs], [med(r2[0]) for _, r2 in runs]

    def mib(v):
        return f"{v / 2**20:.0f} MiB"
    row(t, "ranks: time per iteration, 2 ÷ 1", np.divide(t2, t1), "×", "0.5 (half the images each)", f"flowgrpo.py "
        f"{' '.join(o.ranks)}, {o.rank_pairs} pair(s) of runs; 1 rank {ms(t1)}, 2 ranks {ms(t2)}")
    row(t, "ranks: peak RSS per rank, 2 ÷ 1", [v / r1[1][0] for r1, r2 in runs for v in r2[1].values()], "×",
        "≈ 1 at tiny size", f"VmHWM, last pair: {mib(runs[-1][0][1][0])} vs "
        f"{', '.join(mib(v) for v in runs[-1][1][1].values())}")

class RandomText(models_qwen.QwenImage):  # no 7B text encoder: the tiny one's token counts and masks, random values
    @torch.no_grad()
    def encode(self, prompts):
        mask = super().encode(prompts)["mask"]
        e = torch.randn(*mask.shape, self.transformer.config.joint_attention_dim, generator=torch.Generator())
        return {"embeds": (e * mask.cpu()[..., None]).to(self.device, self.dtype), "mask": mask}

def random_model(kind: str, device: str, heads: int = 3) -> RandomText:  # diffusers' defaults = the published configs
    pipe, dtype = models_qwen.build_tiny_qwen_pipeline(0, heads), torch.bfloat16 if device != "cpu" else torch.float32
    if kind != "tiny":
        default, _ = torch.get_default_dtype(), torch.set_default_dtype(dtype)
        with torch.device(device):
            pipe = QwenImagePipeline(pipe.scheduler, AutoencoderKLQwenImage(), pipe.text_encoder, pipe.tokenizer,
                                     QwenImageTransformer2DModel())
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
        b = sample(model, a, steps, on_images=lambda c, x: pool.submit(x, texts[c:c + len(x)]))
        rolled, scores = time.perf_counter(), torch.as_tensor(pool.collect()[0]).float()
        b.advantages = algorithms.group_advantages(scores, b.group, std=a.std, clip=a.adv_clip)[0].to(model.device)
        scored = time.perf_counter()
        train(model, engine, b, a)
        sync()
        ticks.append(np.diff([start, rolled, scored, time.perf_counter()]))
    pool.close()
    # An image: N rollout passes and W trained steps of forward + backward per CFG branch; LoRA's backward costs one
    # forward (activation gradients; the frozen weights need none); checkpointing's recompute is not counted (MFU).
    flops = sum(pass_flops(model.transformer.config, model.image_seq_len(a.height, a.width), b.cond[k].shape[1],
                           a.lora_rank) for k in ("embeds", "neg_embeds")[:1 + (a.cfg_scale > 1)])
    peak = torch.cuda.max_memory_allocated() if CUDA else vm_hwm(os.getpid())
    return ticks[1:], peak, flops * (a.num_steps + 2 * len(steps))

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
    """--sp n ÷ --sp 1: n ranks of `bench.py --sp-worker n` (CPU: gloo; CUDA: n GPUs, or --sp-fake on fewer), then
    --sp 1 in this process."""
    fake = CUDA and torch.cuda.device_count() < n
    ranks = [] if fake else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
    cmd = [sys.executable, *ranks, "bench.py", "--sp-worker", str(n), "--sp-side", str(o.sp_side), "--device", o.device, "--model",
           o.model, "--repeats", str(o.repeats), *(["--sp-fake"] if fake else [])]
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

def judge_rows(t: list, o):
    """Judge requests/s at concurrency 1 and at the default, against FLOWGRPO_BENCH_JUDGE_URL (e.g. a `vllm serve` of
    a VL model) or a stand-in that answers each request 20 ms after it arrives, in parallel, as a batching server
    does (then the row measures the client's concurrency, not a model)."""
    import http.server
    answer = json.dumps({"choices": [{"message": {"content": "Yes"}, "finish_reason": "stop", "logprobs": {"content": [
        {"top_logprobs": [{"token": "Yes", "logprob": -0.2}, {"token": "No", "logprob": -1.7}]}]}}]}).encode()

    class StandIn(http.server.BaseHTTPRequestHandler):
        def do_GET(self, body=b'{"data": [{"id": "stand-in"}]}'):  # GET /v1/models; do_POST's answer
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(0.02)
            self.do_GET(answer)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    given, n, c = os.environ.get("FLOWGRPO_BENCH_JUDGE_URL"), 16 if o.quick else 64, rewards.JUDGE_CONCURRENCY
    url = given or f"http://127.0.0.1:{server.server_address[1]}"
    images, prompts = rewards.to_uint8(torch.rand(n, 3, 64, 64)), [f"a photo of thing {i}" for i in range(n)]
    fns = {k: rewards.judge("match", [url], concurrency=k) for k in (1, c)}
    r = measure({k: lambda f=f: f(images, prompts, [{}] * n) for k, f in fns.items()}, o.repeats)
    row(t, f"judge requests/s, concurrency {c} ÷ 1", np.divide(r[1], r[c]), "×", f"≤ {c}",
        f"{n} requests (64² PNG) to {given or 'the stand-in'}; {n / med(r[1]):.0f} vs {n / med(r[c]):.0f} requests/s")
    server.shutdown()

def text_bomb() -> bytes:
    """A POST /score body of one 1×1 PNG carrying 64 zTXt chunks of 1 MiB of text each (64 kB on the wire)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    text = zlib.compress(b"a" * 2**20, 9)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)) + b"".join(
        chunk(b"zTXt", b"k%d\0\0" % k + text) for k in range(64)) + chunk(b"IDAT", zlib.compress(b"\0" * 4)) + \
        chunk(b"IEND", b"")
    return json.dumps({"images": [base64.b64encode(png).decode()], "prompts": ["p"]}).encode()

def soak(argv) -> None:
    """`python bench.py soak`: C clients × R valid requests to `python rewards.py serve --reward brightness` on
    127.0.0.1 (4 images of 64², each answer checked against the local reward, 503s retried with backoff), and after
    each a hostile request with probability --hostile (an idle socket, a Content-Length of 10¹² and no body, "{not
    json", a PNG of 64 MiB of zTXt text, a Content-Length of '²'). Reports what was served, errors by kind, latency,
    the server's memory and threads; fails if a valid request is lost or answered wrongly, or memory or threads stay."""
    p = argparse.ArgumentParser(prog="bench.py soak", description=soak.__doc__)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=50, help="valid requests per client")
    p.add_argument("--hostile", type=float, default=0.25, help="probability of a hostile request after each valid one")
    p.add_argument("--header-timeout", default="2", help="the server's (its default is 10 s)")
    p.add_argument("--markdown", help="also write the table, with the command, revision, date and load, to this file")
    o, t = p.parse_args(argv), list(HEAD)
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "rewards.py"), "serve", "--reward", "brightness",
                               "--port", "0", "--header-timeout", o.header_timeout], stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL)
    url = server.stdout.readline().split(" on ")[-1].split()[0]
    port, local, bomb = int(url.rsplit(":", 1)[1]), rewards.make_reward("brightness"), text_bomb()
    hostile = {"idle socket": b"", "Content-Length 10^12": b"POST /score HTTP/1.1\r\nContent-Length: 1" + b"0" * 12 +
               b"\r\n\r\n",
               "not JSON": b"POST /score HTTP/1.1\r\nContent-Length: 9\r\n\r\n{not json",
               "64 MiB of PNG text": b"POST /score HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(bomb) + bomb,
               "Content-Length '²'": "POST /score HTTP/1.1\r\nContent-Length: ²\r\n\r\n{}".encode()}
    answers, latency, lock = {}, [], threading.Lock()

    def status():  # the server's VmRSS, VmHWM (MiB) and thread count, from /proc
        f = dict(line.split(":", 1) for line in open(f"/proc/{server.pid}/status").read().splitlines())
        return int(f["VmRSS"].split()[0]) / 1024, int(f["VmHWM"].split()[0]) / 1024, int(f["Threads"])

    def count(key):
        with lock:
            answers[key] = answers.get(key, 0) + 1

    def send(data: bytes) -> str:  # a hostile request, then end of stream (the idle socket sends nothing, ends not)
        with socket.create_connection(("127.0.0.1", port), timeout=120) as c:
            with contextlib.suppress(OSError):
                c.sendall(data)
                if data:
                    c.shutdown(socket.SHUT_WR)
            return c.makefile("rb").read().split(b"\r\n")[0].decode()[9:] or "closed by the server"

    def client(c):
        rng = np.random.default_rng(c)
        for r in range(o.requests):
            images = torch.from_numpy(rng.random((4, 3, 64, 64), dtype=np.float32))
            body = json.dumps({"images": [reward_http.png_base64(x) for x in rewards.to_uint8(images)],
                               "prompts": ["p"] * 4}).encode()
            start = time.perf_counter()
            for attempt in range(12):  # as reward_http.Client retries, backoff 0.05 s doubling: 100 s in all
                try:
                    code, reply = reward_http.exchange(url, "/score", body, 120, 2**20)
                except OSError as e:  # a busy server's 503 and close can cut the body being sent
                    code, reply = type(e).__name__, b""
                if code != 503 and isinstance(code, int):
                    break
                count(f"valid: {code} (busy), retried")
                time.sleep(0.05 * 2 ** attempt)
            right = code == 200 and json.loads(reply)["scores"] == local(images, ["p"] * 4)[0].tolist()
            count("valid: answered, correct" if right else f"valid: lost or wrong (HTTP {code})")
            latency.append(time.perf_counter() - start)
            if rng.random() < o.hostile:
                kind = list(hostile)[rng.integers(len(hostile))]
                count(f"hostile, {kind}: {send(hostile[kind])}")
    start, threads = status(), [threading.Thread(target=client, args=(c,)) for c in range(o.clients)]
    wall = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - wall
    time.sleep(float(o.header_timeout) + 1)  # handlers of idle sockets end at the header deadline
    end = status()
    server.kill()
    for key, n in sorted(answers.items()):
        row(t, key, [n], "requests")
    row(t, "valid request latency, p50", [1e3 * np.percentile(latency, 50)], "ms", "", "503 retries included")
    row(t, "valid request latency, p99", [1e3 * np.percentile(latency, 99)], "ms")
    row(t, "server RSS, start → end", [start[0], end[0]], "MiB", "end within 50 MiB of start", f"{start[0]:.0f} → "
        f"{end[0]:.0f} MiB, peak {end[1]:.0f} MiB; {wall:.0f} s of soak")
    row(t, "server threads, start → end", [start[2], end[2]], "threads", "equal", f"{start[2]} → {end[2]}")
    if o.markdown:
        head = f"`python bench.py soak {' '.join(argv)}`, {time.ctime()}, load {os.getloadavg()[0]:.2f}"
        open(o.markdown, "w").write("\n".join([head + "\n", *t, ""]))
    whole = answers.get("valid: answered, correct") == o.clients * o.requests
    if not whole or end[2] != start[2] or end[0] > start[0] + 50:
        sys.exit("soak: a valid request was lost or answered wrongly, or the server's threads or memory did not return")

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["soak"]:
        return soak(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "qwen-image"), default="tiny")
    p.add_argument("--device", default="cuda" if CUDA else "cpu")
    p.add_argument("--random-init", action="store_true", help="the public recipe end to end, random weights (GPU)")
    p.add_argument("--quick", action="store_true", help="smallest sizes and one repeat (the smoke test)")
    p.add_argument("--repeats", type=int, help="timed repeats per row (default 9; --quick 1; --random-init 2)")
    p.add_argument("--reward", help="--random-init's reward (default: the recipe's, ocr)")
    p.add_argument("--markdown", help="also write the table, with the command, revision, date and load, to this file")
    p.add_argument("--sp", type=int, help="only the rows of Ulysses sequence parallelism: --sp N ÷ --sp 1")
    p.add_argument("--sp-side", type=int, help="their image side (default: CPU 512, --quick 64; CUDA 1024)")
    p.add_argument("--sp-worker", type=int, help=argparse.SUPPRESS)  # one rank of a sequence-parallel measurement
    p.add_argument("--sp-fake", action="store_true", help=argparse.SUPPRESS)
    o, t = p.parse_args(argv), list(HEAD)
    o.repeats, quick = o.repeats or (1 if o.quick else 2 if o.random_init else 9), o.quick
    if o.device == "cpu":
        torch.set_num_threads(1)  # 2 threads on the loaded 2-core box: 3-18× slower, erratic
    o.sp_side = o.sp_side or (1024 if CUDA else 64 if quick else 512)
    if o.sp_worker:  # one rank of sp_rows' measurement
        result = sp_measure(o, o.sp_worker)
        if result["main"]:
            print("SP-RESULT", json.dumps(result))
        return
    if o.sp:
        sp_rows(t, o, o.sp)
    elif o.random_init:  # the public recipe, one group per iteration; tiny: at the tiny model's sizes
        toy = dict(height=32, width=32, lora_rank=8, group_size=4 if quick else 8) if o.model == "tiny" else {}
        gpu_rows(t, o, dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model=o.model, prompts_per_iteration=1,
                                           reward=o.reward or flowgrpo.RECIPES["qwen-image"].reward, **toy))
    else:  # the tiny recipe with the public recipe's 10 steps and window 2 (W/(N−1) = 2/9)
        a = dataclasses.replace(flowgrpo.RECIPES[o.model], window=2, prompts_per_iteration=2, group_size=4,
                                num_steps=4 if quick else 10, window_range=(0, 3) if quick else (0, 5),
                                micro_batch=4 if quick else 8)
        o.groups, o.chunks, o.reward_images, o.reward_size, o.rank_pairs = \
            ((2, 4), 2, 2, 128, 1) if quick else ((4, 8, 16), 4, 4, 512, 3)
        o.ranks = ("--model tiny --no-wandb --eval-every 0 --checkpoint-every 0 --iterations " + ("1 --group-size 4 "
                   "--prompts-per-iteration 2 --micro-batch 2" if quick else "6")).split()
        model_rows(t, o, a)
        family_rows(t, o, a, "tiny-sd3", 4.5, "CFG 4.5")
        family_rows(t, o, a, "tiny-flux", 1.0, "guidance 3.5 (embedded)")
        o.variant_size = 32 if quick else 256  # 256² (1024 tokens): the transformer's work, not per-call overhead
        variant_rows(t, o, a)
        forward_rows(t, o, a)
        rank_rows(t, o)
        sp_rows(t, o, 2)
        judge_rows(t, o)
    if o.markdown:
        rev = subprocess.run("git rev-parse --short HEAD || true", shell=True, cwd=ROOT, capture_output=True, text=True)
        head = f"`python bench.py {' '.join(sys.argv[1:] if argv is None else argv)}` at {rev.stdout.strip() or '?'}"
        open(o.markdown, "w").write("\n".join([f"{head}, {time.ctime()}, load {os.getloadavg()[0]:.2f}\n", *t, ""]))

if __name__ == "__main__":
    main()
