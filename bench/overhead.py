"""bench/overhead.py: Flow-GRPO's cost against the floor set by the model itself, as ratios measured side by side.
    python -m bench.overhead [--quick] [--markdown FILE]                      # CPU, tiny model: the overhead table
Rows: median, min, max over repeats after a warm-up, candidates alternating within a repeat. The GPU benchmark and the
--sp rows (random weights at real width) are bench/gpu.py's, the reward server's soak bench/soak.py's. See
BENCHMARKS.md."""
import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from statistics import median as med

import numpy as np
import psutil
import torch

import algorithms
import engine as eng
import flowgrpo
import models
import prompts as prompt_sets
import reward_judge
import rewards
import rollout
import scheduler as sch
from bench import plain as bench_plain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA = torch.cuda.is_available()
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

ARITHMETIC = {}  # flowgrpo.batch_arithmetic per Args: the loop computes it once a run (its memory check reads /proc)

def train(model, engine, batch, a) -> dict:  # one update as the loop takes it (every micro-batch × trained step), the
    a = dataclasses.replace(a, optimizer_steps=1, prompts_per_iteration=1, group_size=len(batch.prompts))  # algorithm's
    if (key := repr(a)) not in ARITHMETIC:
        ARITHMETIC[key] = flowgrpo.batch_arithmetic(a, 1)
    model.transformer.train()
    return algorithms.ALGORITHMS[a.algorithm].update(model, engine, batch, a, ARITHMETIC[key], False)  # its statistics

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

def plain_rows(t: list, o, a: flowgrpo.Args, build, batch, label: str, window_b=None, steps=None):
    """The loop's update ÷ the plain one on the same batch, each on a fresh copy of the model (`build()`: one, the same
    weights each call); first, one update of each from the same initial weights must land on the same LoRA (the plain
    loop computes the same update). With `window_b`, also the plain update's window ÷ full: the fixed cost per update
    that no framework adds. With `steps` (the batch's trained steps), also a whole iteration, the loop's rollout and
    update against diffusers' pipeline call for the same images (the sampling floor) and the plain update."""
    model = build()
    engine, (pm, opt, params) = make_engine(a, model), bench_plain.setup(a, build())
    start = [p.detach().clone() for p in params]
    train(model, engine, batch, a)
    bench_plain.update(pm, opt, params, batch, a)
    ours = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in engine.params]
    worst = max((x - y.detach()).abs().max().item() for x, y in zip(ours, params))
    moved = max((x - y).abs().max().item() for x, y in zip(ours, start))
    assert len(ours) == len(params) and worst <= 1e-3 * moved, \
        f"{label}the plain update lands {worst:.3g} from the loop's (the update moved the LoRA by {moved:.3g})"
    windowed = {} if window_b is None else {"plain window": lambda: bench_plain.update(pm, opt, params, window_b, a)}
    whole = {} if steps is None else {"iteration": lambda: train(model, engine, sample(model, a, steps), a),
                                      "plain iteration": lambda: (diffusers_call(pm, a, a.cfg_scale, batch.prompts),
                                                                  bench_plain.update(pm, opt, params, batch, a))}
    r = measure({"train": lambda: train(model, engine, batch, a),
                 "plain": lambda: bench_plain.update(pm, opt, params, batch, a), **windowed, **whole}, o.repeats)
    row(t, f"{label}training ÷ plain PyTorch update", np.divide(r["train"], r["plain"]), "×", "≤ 1.02",
        f"W = {len(batch.sigmas) - 1} trained steps, {len(batch.prompts)} images, each on a model of its own; one update "
        f"of each lands on the same LoRA (max |Δ| {worst:.2g}); train {ms(r['train'])}, plain {ms(r['plain'])}")
    if whole:
        row(t, f"{label}whole iteration ÷ diffusers' sampling + plain PyTorch update", np.divide(
            r["iteration"], r["plain iteration"]), "×", "≤ 1.02", f"the loop's rollout (SDE, log-probs) and update "
            f"against the pipeline's call for the same images (ODE) and the plain update; {ms(r['iteration'])} vs "
            f"{ms(r['plain iteration'])}")
    if windowed:
        W = len(window_b.sigmas) - 1
        row(t, f"{label}window ÷ full, plain PyTorch update", np.divide(r["plain window"], r["plain"]), "×",
            f"W/(N−1) = {W / (len(batch.sigmas) - 1):.3f} + its fixed cost", f"W = {W}: the same ratio in the plainest "
            f"PyTorch (clip, AdamW, zeroing once per update); window {ms(r['plain window'])}")

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
    n = len(full_b.prompts)  # train() takes one optimizer step: every image's forwards can be the rollout's
    r = measure({"reuse": lambda: train(model, engine, sample(model, a, full, keep=n), a),
                 "recompute": lambda: train(model, engine, sample(model, a, full), a)}, o.repeats)
    row(t, "rollout + update, --reuse-rollout-forward ÷ recomputed", np.divide(r["reuse"], r["recompute"]), "×",
        "< 1: no training forward", f"full mode, W = {len(full)}, {n} images, K = 1 (all in the first optimizer step); "
        f"{ms(r['reuse'])} vs {ms(r['recompute'])}")
    plain_rows(t, o, a, lambda: models.load_model(a.model, None, o.device, seed=a.seed), full_b, "", window_b, full)
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
    # at best a chunk's reward runs beside the next chunk's rollout: all but the last chunk's reward hidden (reward the
    # shorter), or all but the first chunk's rollout (rollout the shorter)
    best = 1 - (o.chunks - 1) / o.chunks * np.minimum(serial - roll, roll) / serial
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
    plain_rows(t, o, a, lambda: models.load_model(name, None, o.device, seed=a.seed), full_b, f"{name}: ", steps=full)

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
        adv = batches[k].advantages  # random, standing in for the rewards too
        batches[k].advantages = algorithms.ALGORITHMS[ak.algorithm].weights(adv, adv, ak)
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
    # (0 for a process already exiting: its status then lists no memory, and an earlier reading holds its peak)
    return next((int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmHWM:")), 0)

def torchrun(n: int, o):  # flowgrpo.py on n gloo ranks -> (wall s per iteration but the first, {rank: VmHWM})
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
        return [r["perf/iteration_s"] for r in rows[1:] or rows], peak  # the whole iteration, logging included

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
    given, n, c = os.environ.get("FLOWGRPO_BENCH_JUDGE_URL"), 16 if o.quick else 64, reward_judge.JUDGE_CONCURRENCY
    url = given or f"http://127.0.0.1:{server.server_address[1]}"
    images, prompts = rewards.to_uint8(torch.rand(n, 3, 64, 64)), [f"a photo of thing {i}" for i in range(n)]
    fns = {k: rewards.judge("match", [url], concurrency=k) for k in (1, c)}
    r = measure({k: lambda f=f: f(images, prompts, [{}] * n) for k, f in fns.items()}, o.repeats)
    row(t, f"judge requests/s, concurrency {c} ÷ 1", np.divide(r[1], r[c]), "×", f"≤ {c}",
        f"{n} requests (64² PNG) to {given or 'the stand-in'}; {n / med(r[1]):.0f} vs {n / med(r[c]):.0f} requests/s")
    server.shutdown()

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("tiny", "qwen-image"), default="tiny")
    p.add_argument("--device", default="cuda" if CUDA else "cpu")
    p.add_argument("--quick", action="store_true", help="smallest sizes and one repeat (the smoke test)")
    p.add_argument("--repeats", type=int, help="timed repeats per row (default 9; --quick 1)")
    p.add_argument("--markdown", help="also write the table, with the command, revision, date and load, to this file")
    o, t = p.parse_args(argv), list(HEAD)
    if o.repeats is not None and o.repeats < 1:  # 0 read as "unset" ran the default 9; below 0, no row had a median
        p.error(f"--repeats must be at least 1, got {o.repeats}")
    o.repeats, quick = o.repeats or (1 if o.quick else 9), o.quick
    if o.device == "cpu":
        torch.set_num_threads(1)  # 2 threads on the loaded 2-core box: 3-18× slower, erratic
    # The tiny recipe with the public recipe's 10 steps and window 2 (W/(N−1) = 2/9)
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
    judge_rows(t, o)
    if o.markdown:
        rev = subprocess.run("git rev-parse --short HEAD || true", shell=True, cwd=ROOT, capture_output=True, text=True)
        head = f"`python -m bench.overhead {' '.join(sys.argv[1:] if argv is None else argv)}` at {rev.stdout.strip() or '?'}"
        open(o.markdown, "w").write("\n".join([f"{head}, {time.ctime()}, load {os.getloadavg()[0]:.2f}\n", *t, ""]))

if __name__ == "__main__":
    main()
