"""The nano task: real handwritten digits, a base model pretrained on them here, and two classifiers that read them.

    python nano.py pretrain [--out assets/nano]   # the shipped base model: VAE, then transformer (a few CPU-minutes)
    python nano.py classifiers                    # the reward's and the judge's held-out accuracy on real digits
    python nano.py evaluate [RUN_DIR ...]         # the base (and each run's LoRA) on held-out seeds
    python nano.py grid RUN_DIR [--out PNG]       # before vs after: one row per digit
    python nano.py compare [--seeds 3]            # every method of METHODS through flowgrpo.py: table and curves

Data: scikit-learn's `load_digits` (1,797 real 8×8 digits inside the wheel: nothing downloads), split 80/20,
stratified, seeded; an image is a digit upscaled bilinearly to 16×16, white on black, 3 channels. Both classifiers
are fitted on the train split only, on 8-bit images as every reward sees them: the reward (`--reward digit`), a
logistic regression's p(prompted digit) from the image averaged back to 8×8, and the judge (`digit_judge`), an RBF
SVM on all 16×16 pixels, which sees the detail the reward averages away. The base model
(models_qwen.build_nano_pipeline) is pretrained here with a fixed seed and step count, short of convergence so that RL
has room (docs/algorithm.md §15).
"""
import functools
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import models_qwen
import prompts as prompt_sets

ROOT = os.path.dirname(os.path.abspath(__file__))
SPLIT_SEED = 0  # the train / held-out split
SIDE = 16  # image side in pixels
# The architecture (diffusers' AutoencoderKLQwenImage and QwenImageTransformer2DModel): 0.46 M and 0.63 M parameters.
VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True])
TRANSFORMER = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=16,
                   num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
# The shipped budget (docs/algorithm.md §15): the VAE to convergence, the transformer far from it.
PRETRAIN = dict(seed=0, vae_steps=500, vae_batch=64, vae_lr=2e-3, kl_weight=1e-4, transformer_steps=80,
                transformer_batch=128, transformer_lr=1e-3, ema=0.995)
EVAL_SEED = 2**62  # evaluation image i draws its noise from seed EVAL_SEED + i: no RL run with --seed < 4·10^6 does
_DIGIT = re.compile(r"\bdigit (\d)\b")


# ---- data --------------------------------------------------------------------------------------------

def split(seed: int = SPLIT_SEED):
    """(x_train, x_test, y_train, y_test): load_digits' images (N, 8, 8) in [0, 16] and labels; 80/20, stratified."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    return train_test_split(data.images, data.target, test_size=0.2, stratify=data.target, random_state=seed)


def render(x8: np.ndarray) -> torch.Tensor:
    """8×8 digits in [0, 16] (N, 8, 8) -> images (N, 3, 16, 16) float32 in [0, 1]: bilinear, white on black."""
    x = torch.as_tensor(x8, dtype=torch.float32)[:, None] / 16
    up = torch.nn.functional.interpolate(x, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    return up.clamp(0, 1).expand(-1, 3, -1, -1).contiguous()


def quantised(images: torch.Tensor) -> np.ndarray:
    """(N, 3, H, W) in [0, 1] -> (N, H, W, 3) uint8, rounded as a saved PNG (and every reward) has it."""
    return (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def gray(images: np.ndarray, side: int) -> np.ndarray:
    """uint8 images (N, H, W, 3) -> (N, side²) float: the channel mean, averaged over blocks to side × side, on the
    data's 0–16 scale. H and W must be multiples of `side`."""
    n, h, w, _ = images.shape
    if h % side or w % side:
        raise ValueError(f"the digit classifiers read images whose sides are multiples of {side} (nano: "
                         f"--height {SIDE} --width {SIDE}), got {h}×{w}")
    g = images.astype(np.float64).mean(-1) * (16 / 255)
    return g.reshape(n, side, h // side, side, w // side).mean((2, 4)).reshape(n, side * side)


def target_digit(prompt: str) -> int:
    """The digit a prompt asks for ("a handwritten digit 7" -> 7): the start-up check of the digit rewards."""
    m = _DIGIT.search(prompt)
    if m is None:
        raise ValueError(f"digit reward: prompt {prompt!r} names no digit; write e.g. 'a handwritten digit 7' "
                         "(the built-in set: --prompts digits)")
    return int(m.group(1))


# ---- the reward and the judge ------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def classifiers():
    """(reward, judge), fitted on the train split's rendered, quantised digits (seconds; once per process): a
    logistic regression on 8×8 averages and an RBF SVM on all 16×16 pixels. Both are deterministic."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import SVC
    from threadpoolctl import threadpool_limits
    x_train, _, y_train, _ = split()
    images = quantised(render(x_train))
    with threadpool_limits(1):  # small problems: more BLAS threads only wait on each other (38 s instead of 1 here)
        reward = LogisticRegression(max_iter=5000).fit(gray(images, 8), y_train)
        judge = SVC(kernel="rbf", C=10.0, gamma="scale").fit(gray(images, SIDE), y_train)
    return reward, judge


def reward_scores(images: np.ndarray, digits) -> np.ndarray:
    """The reward: p(the prompted digit) under the logistic regression, (N,) in [0, 1]; images uint8 (N, H, W, 3)."""
    p = classifiers()[0].predict_proba(gray(images, 8))
    return p[np.arange(len(p)), np.asarray(digits)]


def judge_scores(images: np.ndarray, digits) -> np.ndarray:
    """The judge: 1.0 where the SVM reads the prompted digit, else 0.0, (N,); its mean is the judge's accuracy."""
    return (classifiers()[1].predict(gray(images, SIDE)) == np.asarray(digits)).astype(np.float64)


def held_out_accuracy() -> dict:
    """Both classifiers on the held-out split's real digits (rendered and quantised as in training)."""
    _, x_test, _, y_test = split()
    images = quantised(render(x_test))
    return {"n": len(y_test), "reward_accuracy": float((classifiers()[0].predict(gray(images, 8)) == y_test).mean()),
            "reward_p_true": float(reward_scores(images, y_test).mean()),
            "judge_accuracy": float(judge_scores(images, y_test).mean())}


# ---- pretraining: the VAE, then the transformer ------------------------------------------------------

def pretrain(out: str, per_digit: int = 50, *, seed: int, vae_steps: int, vae_batch: int, vae_lr: float,
             kl_weight: float, transformer_steps: int, transformer_batch: int, transformer_lr: float,
             ema: float) -> dict:
    """Train the nano VAE and transformer on the train split and write them to `out` (vae/, transformer/: diffusers'
    own format, float16) for `--model nano --model-path out`. Returns what each stage reached (out/pretrain.json)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x_train, x_test, y_train, y_test = split()
    train_images, test_images = render(x_train) * 2 - 1, render(x_test) * 2 - 1  # (N, 3, 16, 16) in [-1, 1]
    report, start = {"command": " ".join(["python nano.py pretrain", *sys.argv[2:]]), "config": PRETRAIN}, time.time()

    # 1. VAE: reconstruction MSE + a small KL to N(0, 1), on batches of the train split (5-D: one frame)
    vae = AutoencoderKLQwenImage(**VAE, latents_mean=[0.0] * VAE["z_dim"], latents_std=[1.0] * VAE["z_dim"])
    opt = torch.optim.AdamW(vae.parameters(), lr=vae_lr, weight_decay=0.0)
    losses = []
    for step in (bar := tqdm(range(vae_steps), desc="pretrain vae", unit="step")):
        x = train_images[torch.randint(len(train_images), (vae_batch,), generator=gen)][:, :, None]
        posterior = vae.encode(x).latent_dist
        mse = (vae.decode(posterior.sample(gen)).sample - x).square().mean()
        kl = 0.5 * (posterior.mean.square() + posterior.var - 1 - posterior.logvar).mean()
        opt.zero_grad()
        (mse + kl_weight * kl).backward()
        opt.step()
        losses.append(mse.item())
        bar.set_postfix(mse=f"{np.mean(losses[-20:]):.4f}")
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # the latents' per-channel mean and std over the train split: the pipeline normalises by them
        mean_z = vae.encode(train_images[:, :, None]).latent_dist.mean
        vae.register_to_config(latents_mean=mean_z.mean((0, 2, 3, 4)).tolist(),
                               latents_std=mean_z.std((0, 2, 3, 4)).tolist())
        recon = vae.decode(vae.encode(test_images[:, :, None]).latent_dist.mean).sample[:, :, 0]  # held out
    seen = quantised((recon + 1) / 2)  # what the classifiers read of a perfect transformer's output: the ceiling
    reached(report, "vae", steps=vae_steps, first_mse=np.mean(losses[:10]), last_mse=np.mean(losses[-20:]),
            held_out_mse=(recon - test_images).square().mean().item(), seconds=time.time() - start,
            judge_on_reconstructions=judge_scores(seen, y_test).mean(),
            reward_on_reconstructions=reward_scores(seen, y_test).mean())

    # 2. Transformer: rectified flow on the normalised, packed latents, x_σ = (1 − σ)·x0 + σ·ε, target ε − x0,
    #    σ logit-normal and shifted as the scheduler shifts it at this image size, conditioned on the frozen encoder
    pipe = models_qwen.build_nano_pipeline(None, vae=vae, transformer=QwenImageTransformer2DModel(**TRANSFORMER))
    model = models_qwen.QwenImage(pipe, "cpu", torch.float32)
    net = model.transformer.requires_grad_(True).train()
    with torch.no_grad():
        posterior = vae.encode(train_images[:, :, None]).latent_dist  # (N, 4, 1, 4, 4)
        mu_z, std_z = posterior.mean[:, :, 0], posterior.std[:, :, 0]
        scale = [torch.tensor(vae.config[k]).view(1, -1, 1, 1) for k in ("latents_mean", "latents_std")]
    cond = model.conditioning(prompt_texts(), " ", 1.0)  # the ten prompts' embeddings (10, L, D), indexed by digit
    cfg = model.scheduler.config
    mu = calculate_shift(model.image_seq_len(SIDE, SIDE), cfg.base_image_seq_len, cfg.max_image_seq_len,
                         cfg.base_shift, cfg.max_shift)
    opt = torch.optim.AdamW(net.parameters(), lr=transformer_lr, weight_decay=0.0)
    averaged = {k: v.detach().clone() for k, v in net.state_dict().items()}
    losses, start = [], time.time()
    for step in (bar := tqdm(range(transformer_steps), desc="pretrain transformer", unit="step")):
        idx = torch.randint(len(mu_z), (transformer_batch,), generator=gen)
        z = (mu_z[idx] + std_z[idx] * torch.randn(mu_z[idx].shape, generator=gen) - scale[0]) / scale[1]
        x0 = pipe._pack_latents(z, len(idx), VAE["z_dim"], z.shape[2], z.shape[3])  # (B, S, C·4)
        u = torch.sigmoid(torch.randn(len(idx), generator=gen))
        sigma = math.exp(mu) / (math.exp(mu) + (1 / u - 1))  # the scheduler's exponential time shift
        eps = torch.randn(x0.shape, generator=gen)
        x = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        labels = torch.as_tensor(y_train)[idx]
        v = model.velocity(x, sigma, {k: t[labels] for k, t in cond.items()}, 1.0, SIDE, SIDE)
        loss = (v - (eps - x0)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay = min(ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for k, t in net.state_dict().items():
                averaged[k].lerp_(t, 1 - decay)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    reached(report, "transformer", steps=transformer_steps, first_loss=np.mean(losses[:10]),
            last_loss=np.mean(losses[-20:]), seconds=time.time() - start)
    net.load_state_dict(averaged)

    # 3. Write (float16: half the bytes; what loads is what was measured), then measure what was written
    for name, part in (("vae", vae), ("transformer", net)):
        for t in [*part.parameters(), *part.buffers()]:  # (not .to(): diffusers warns about modules kept in fp32)
            t.data = t.data.half()
        part.save_pretrained(os.path.join(out, name))
    reached(report, "base model", **evaluate(load(out), per_digit))
    report["classifiers_held_out"] = held_out_accuracy()
    with open(os.path.join(out, "pretrain.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def reached(report: dict, stage: str, **figures) -> None:
    """Record what a stage of pretraining reached (report[stage]) and say it."""
    report[stage] = {k: v if isinstance(v, int) else round(float(v), 6) for k, v in figures.items()}
    print(f"{stage}: " + ", ".join(f"{k} {v:.4g}" for k, v in report[stage].items()), flush=True)


# ---- evaluation: ODE samples on held-out seeds, read by the reward and the judge ---------------------

def prompt_texts() -> list[str]:
    """The built-in `digits` prompt set, digit d at index d."""
    texts = [p for p, _ in prompt_sets.load_prompts("digits").train]
    assert [target_digit(p) for p in texts] == list(range(10)), texts
    return texts


def load(path: str | None = None, lora: str | None = None):
    """The nano pipeline (the shipped weights, or `path`), with a run's exported LoRA directory loaded if given."""
    pipe = models_qwen.build_nano_pipeline(path or models_qwen.NANO_DIR)
    if lora:
        pipe.load_lora_weights(lora)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def sample(pipe, per_digit: int, steps: int = 10, chunk: int = 100) -> tuple[torch.Tensor, np.ndarray]:
    """(images (10·per_digit, 3, 16, 16) in [0, 1], digits (10·per_digit,)): diffusers' own QwenImagePipeline call
    (the ODE, Euler, as the loop's evaluation); image i shows digit i mod 10 from seed EVAL_SEED + i, for any model."""
    digits = np.tile(np.arange(10), per_digit)
    texts, images = prompt_texts(), []
    for c in range(0, len(digits), chunk):
        ids = range(c, min(c + chunk, len(digits)))
        gens = [torch.Generator().manual_seed(EVAL_SEED + i) for i in ids]
        images.append(pipe([texts[digits[i]] for i in ids], true_cfg_scale=1.0, height=SIDE, width=SIDE,
                           num_inference_steps=steps, generator=gens, output_type="pt").images.float())
    return torch.cat(images), digits


def diversity(images: torch.Tensor, digits: np.ndarray) -> float:
    """Mean over digits of the per-pixel std across that digit's images (in [0, 1]): mode collapse drives it to 0."""
    return float(np.mean([images[digits == d].std(0).mean().item() for d in np.unique(digits)]))


def evaluate(pipe, per_digit: int = 50, steps: int = 10) -> dict:
    """Judge accuracy, mean reward and diversity of `per_digit` samples of each digit on the held-out seeds."""
    images, digits = sample(pipe, per_digit, steps)
    u8 = quantised(images)
    return {"images": len(digits), "judge_accuracy": float(judge_scores(u8, digits).mean()),
            "reward_mean": float(reward_scores(u8, digits).mean()), "diversity": diversity(images, digits)}


# ---- before vs after, one row per digit --------------------------------------------------------------

def grid(run_dir: str, out: str, per_digit: int = 8, cell: int = 48) -> dict:
    """A PNG of the base model's samples (left) and the run's (right, its exported LoRA) from the same held-out
    seeds: one row per digit, a green frame where the judge reads the prompted digit, red where it does not."""
    from PIL import Image, ImageDraw, ImageFont
    font, pad, gap = ImageFont.load_default(size=13), 4, 24
    canvas = Image.new("RGB", (24 + 2 * per_digit * cell + gap, 22 + 10 * cell), "white")
    draw, result = ImageDraw.Draw(canvas), {}
    for side, lora in enumerate((None, os.path.join(run_dir, "lora"))):
        images, digits = sample(load(lora=lora), per_digit)
        right = judge_scores(quantised(images), digits)
        result["before" if side == 0 else "after"] = float(right.mean())
        x0 = 24 + side * (per_digit * cell + gap)
        draw.text((x0, 3), f"{'before (base)' if side == 0 else 'after (RL)'}: the judge reads {right.mean():.0%}",
                  fill="black", font=font)
        for i, (img, d, ok) in enumerate(zip(images, digits, right)):
            x, y = x0 + (i // 10) * cell, 22 + d * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill="#2a2" if ok else "#d22")
            tile = Image.fromarray(quantised(img[None])[0]).resize((cell - 2 * pad, cell - 2 * pad), Image.NEAREST)
            canvas.paste(tile, (x + pad, y + pad))
    for d in range(10):
        draw.text((6, 22 + d * cell + cell // 2 - 7), str(d), fill="black", font=font)
    canvas.save(out)
    return result


# ---- the comparison: every method on the same task, seeds, and compute ------------------------------

METHODS = {  # name -> flowgrpo.py flags on top of `--model nano` (its recipe); a later algorithm is one more row
    "Flow-GRPO, full mode": (),
    "window 2": ("--window", "2"),
    "Flow-GRPO-Fast (--branch)": ("--window", "2", "--branch"),
    "MixGRPO-Flash (sliding, dpm2)": ("--window", "2", "--window-schedule", "sliding", "--ode-solver", "dpm2"),
    "GRPO-Guard (ratio-norm)": ("--guard", "ratio-norm"),
    "GRPO-Guard (full)": ("--guard", "full"),
    "DanceGRPO SDE": ("--sde-type", "dance"),
    "CPS, window 2": ("--sde-type", "cps", "--window", "2"),
    "full mode + KL 0.04": ("--kl-beta", "0.04"),
    "full mode + EMA 0.9": ("--ema-decay", "0.9", "--ema-every", "1"),
    # the forward-process algorithms (docs/algorithm.md §12) on their public samplers and old-policy schedules, scaled to
    # 10 steps: DiffusionNFT's sd3_pickscore (9 trained steps, beta 1), AWM's 6 strata (of [0, 9) here, [0, 12) of 14)
    "DiffusionNFT": ("--algorithm", "nft", "--ode-solver", "dpm2-full", "--nft-beta", "1", "--old-decay", "nft1",
                     "--train-timesteps", "9", "--train-timestep-range", "0", "10"),
    "AWM": ("--algorithm", "awm", "--ode-solver", "dpm2-full", "--old-decay", "awm", "--old-kl", "1",
            "--train-timesteps", "6", "--train-timestep-range", "0", "9"),
}
AXES = {"rollout_passes": "rollout transformer passes", "passes": "transformer passes (rollout + training)",
        "seconds": "CPU seconds of the iterations (all threads)"}  # not wall time: a shared machine's load varies


def run_path(out: str, name: str, seed: int) -> str:
    return os.path.join(out, re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + f"-seed{seed}")


def run_method(name: str, flags, seed: int, out: str, iterations: int, eval_every: int, eval_images: int) -> str:
    """`flowgrpo.py --model nano FLAGS --seed S` into out/<name>-seed<S> (one torch thread); a run already complete
    there is reused, so an interrupted comparison continues. Returns the run directory."""
    run_dir = run_path(out, name, seed)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and len(open(metrics).readlines()) == iterations and os.path.isdir(f"{run_dir}/lora"):
        return run_dir
    if os.path.exists(run_dir):  # an unfinished attempt of this comparison: start it again
        shutil.rmtree(run_dir)
    cmd = [sys.executable, os.path.join(ROOT, "flowgrpo.py"), "--model", "nano", "--seed",
           str(seed), "--iterations", str(iterations), "--eval-every", str(eval_every), "--eval-images",
           str(eval_images), "--checkpoint-every", "0", "--keep-checkpoints", "1", "--no-wandb", "--run-dir", run_dir,
           *flags]
    with open(run_dir + ".log", "w") as log:
        done = subprocess.run(cmd, cwd=ROOT, env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=log,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}); see {run_dir}.log")
    return run_dir


def curve(run_dir: str) -> dict[str, np.ndarray]:
    """A run's evaluations (the loop's, on its eval seeds) with the cumulative compute spent up to each."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    spent = {"rollout_passes": [r["perf/rollout_passes"] for r in rows],
             "passes": [r["perf/rollout_passes"] + r["perf/train_passes"] for r in rows],
             "seconds": [r["perf/cpu_s"] for r in rows]}
    at = [i for i, r in enumerate(rows) if "eval/digit_judge/mean" in r]
    return {k: np.cumsum(v)[at] for k, v in spent.items()} | {
        "judge": np.array([rows[i]["eval/digit_judge/mean"] for i in at]),
        "reward": np.array([rows[i]["eval/digit/mean"] for i in at]), "per_iteration": {
            k: float(np.mean(v)) for k, v in spent.items()}}


def compare(out: str, seeds: int, iterations: int, eval_every: int, eval_images: int, methods: dict, jobs: int,
            per_digit: int) -> tuple[list[str], dict]:
    """Every method × seed through flowgrpo.py, then: the judge's accuracy at equal compute on each axis (each run's
    curve interpolated at the smallest total any run reached), and each final LoRA on the held-out seeds (nano's own
    evaluation, the same images as the base's). Returns (markdown table lines, what was measured)."""
    from concurrent.futures import ThreadPoolExecutor
    os.makedirs(out, exist_ok=True)
    todo = [(name, flags, seed) for seed in range(seeds) for name, flags in methods.items()]
    with ThreadPoolExecutor(jobs) as pool:
        dirs = list(tqdm(pool.map(lambda job: run_method(*job, out, iterations, eval_every, eval_images), todo),
                         total=len(todo), desc="compare", unit="run"))
    runs = {name: [] for name in methods}
    for (name, _, _), run_dir in zip(todo, dirs):
        runs[name].append(curve(run_dir) | {"final": evaluate(load(lora=os.path.join(run_dir, "lora")), per_digit)})
    budget = {axis: min(c[axis][-1] for cs in runs.values() for c in cs) for axis in AXES}
    base = evaluate(load(), per_digit)

    def pm(values, fmt="{:.1%}"):
        return f"{fmt.format(np.mean(values))} ± {fmt.format(np.std(values))}"
    lines = [f"| method | flags | rollout / training passes per iteration | CPU s per iteration | judge @ "
             f"{budget['rollout_passes']:,.0f} rollout passes | judge @ {budget['passes']:,.0f} passes | judge @ "
             f"{budget['seconds']:.0f} CPU s | final judge | final reward | final diversity |", "|---" * 10 + "|",
             f"| base model | | | | {base['judge_accuracy']:.1%} | {base['judge_accuracy']:.1%} | "
             f"{base['judge_accuracy']:.1%} | {base['judge_accuracy']:.1%} | {base['reward_mean']:.3f} | "
             f"{base['diversity']:.3f} |"]
    for name, cs in runs.items():
        at = {axis: [np.interp(budget[axis], c[axis], c["judge"]) for c in cs] for axis in AXES}
        per = [c["per_iteration"] for c in cs]
        flags = f"`{' '.join(methods[name])}`" if methods[name] else "(the recipe)"
        lines.append(f"| {name} | {flags} | {np.mean([p['rollout_passes'] for p in per]):.0f} / "
                     f"{np.mean([p['passes'] - p['rollout_passes'] for p in per]):.0f} | "
                     f"{np.mean([p['seconds'] for p in per]):.2f} | " + " | ".join(pm(at[axis]) for axis in AXES) +
                     f" | {pm([c['final']['judge_accuracy'] for c in cs])} | "
                     f"{pm([c['final']['reward_mean'] for c in cs], '{:.3f}')} | "
                     f"{pm([c['final']['diversity'] for c in cs], '{:.3f}')} |")
    return lines, {"base": base, "budget": budget, "runs": runs}


def plot(path: str, measured: dict) -> None:
    """Judge accuracy (the loop's evaluations) against transformer passes and against seconds, one line per method:
    the mean over seeds on a common grid, ± one std shaded; the base model dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), dpi=100, sharey=True)
    for ax, axis in zip(axes, ("passes", "seconds")):
        for i, (name, cs) in enumerate(measured["runs"].items()):
            grid_x = np.linspace(max(c[axis][0] for c in cs), min(c[axis][-1] for c in cs), 50)
            ys = np.array([np.interp(grid_x, c[axis], c["judge"]) for c in cs])
            ax.plot(grid_x, ys.mean(0), color=f"C{i}", ls="-" if i < 5 else "--", lw=1.6, label=name)
            ax.fill_between(grid_x, ys.mean(0) - ys.std(0), ys.mean(0) + ys.std(0), color=f"C{i}", alpha=0.06)
        ax.axhline(measured["base"]["judge_accuracy"], color="gray", ls=":", label="base model")
        ax.set(xlabel=AXES[axis], title=f"held-out judge accuracy vs {AXES[axis].split(' (')[0]}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"judge accuracy (mean ± std, {len(cs)} seeds)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pretrain", help="train the base model (defaults: the shipped budget) and write it to --out")
    p.add_argument("--out", default=models_qwen.NANO_DIR, help="directory for vae/, transformer/, pretrain.json")
    for key, value in PRETRAIN.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    sub.add_parser("classifiers", help="the reward's and the judge's accuracy on the held-out real digits")
    e = sub.add_parser("evaluate", help="the base model and each run's LoRA on the held-out seeds")
    e.add_argument("runs", nargs="*", help="run directories of `flowgrpo.py --model nano` (their lora/)")
    g = sub.add_parser("grid", help="before vs after as one PNG, one row per digit")
    g.add_argument("run", help="a run directory of `flowgrpo.py --model nano`")
    g.add_argument("--out", help="the PNG (default: <run>/before_after.png)")
    c = sub.add_parser("compare", help="every method of METHODS, --seeds seeds each: table, curves, grid")
    c.add_argument("--out", default="runs/nano-compare", help="where the runs go (complete ones are reused)")
    c.add_argument("--seeds", type=int, default=5)  # the defaults: BENCHMARKS.md's table
    c.add_argument("--iterations", type=int, default=60)
    c.add_argument("--eval-every", type=int, default=10)
    c.add_argument("--eval-images", type=int, default=200)
    c.add_argument("--methods", nargs="*", choices=list(METHODS), default=list(METHODS))
    c.add_argument("--jobs", type=int, default=1, help="runs at a time (each one torch thread)")
    c.add_argument("--markdown", help="also write the table, with the command, date and machine, to this file")
    c.add_argument("--plot", default="assets/nano/compare.png")
    for q in (p, e, c):
        q.add_argument("--per-digit", type=int, default=50, help="held-out images per digit of each evaluation")
    a = ap.parse_args(argv)
    if a.cmd == "pretrain":
        pretrain(a.out, a.per_digit, **{k: getattr(a, k) for k in PRETRAIN})
    elif a.cmd == "classifiers":
        print(json.dumps(held_out_accuracy(), indent=2))
    elif a.cmd == "evaluate":
        for run in [None, *a.runs]:
            print(json.dumps({"run": run or "base"} | evaluate(load(lora=run and os.path.join(run, "lora")),
                                                               a.per_digit)), flush=True)
    elif a.cmd == "grid":
        out = a.out or os.path.join(a.run, "before_after.png")
        print(json.dumps({"grid": out} | grid(a.run, out)))
    else:
        start = time.time()
        lines, measured = compare(a.out, a.seeds, a.iterations, a.eval_every, a.eval_images,
                                  {m: METHODS[m] for m in a.methods}, a.jobs, a.per_digit)
        plot(a.plot, measured)
        with open(os.path.join(a.out, "measured.json"), "w") as f:  # every run's curve and final evaluation
            json.dump(measured, f, indent=1, default=lambda v: v.tolist())
        grid(run_path(a.out, a.methods[0], 0), os.path.join(os.path.dirname(a.plot), "before_after.png"))
        head = (f"`python nano.py {' '.join(sys.argv[1:] if argv is None else argv)}`, {time.ctime()}, "
                f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
                f"{(time.time() - start) / 60:.0f} min, load {os.getloadavg()[0]:.2f}")
        print(head, *lines, sep="\n")
        if a.markdown:
            with open(a.markdown, "w") as f:
                f.write("\n".join([head, "", *lines, ""]))


if __name__ == "__main__":
    main()
