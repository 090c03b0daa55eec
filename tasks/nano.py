"""The nano task: real handwritten digits, a base model pretrained on them here, and two classifiers that read them.

    python -m tasks.nano pretrain [--out assets/nano]   # the shipped base model: VAE, then transformer (a few CPU-minutes)
    python -m tasks.nano classifiers                    # the reward's and the judge's held-out accuracy on real digits
    python -m tasks.nano evaluate [RUN_DIR ...]         # the base (and each run's LoRA) on held-out seeds
    python -m tasks.nano grid RUN_DIR [--out PNG]       # before vs after: one row per digit
    python -m tasks.nano_compare --task nano            # every RL method on this task: table and curves (BENCHMARKS.md)

Data: scikit-learn's `load_digits` (1,797 real 8×8 digits inside the wheel: nothing downloads), split 80/20,
stratified, seeded; an image is a digit upscaled bilinearly to 16×16, white on black, 3 channels. Both classifiers
are fitted on the train split only, on 8-bit images as every reward sees them: the reward (`--reward digit`), a
logistic regression's p(prompted digit) from the image averaged back to 8×8, and the judge (`digit_judge`), an RBF
SVM on all 16×16 pixels, which sees the detail the reward averages away. The base model
(models_nano.build_nano_pipeline) is pretrained here with a fixed seed and step count, short of convergence so that RL
has room (docs/algorithm.md §15).
"""
import functools
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch

import models_nano
import prompts as prompt_sets
from tasks import pretraining

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLIT_SEED = 0  # the train / held-out split
SIDE = 16  # image side in pixels
# The architecture (diffusers' AutoencoderKLQwenImage and QwenImageTransformer2DModel): 0.46 M and 0.63 M parameters.
VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True])
TRANSFORMER = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=16,
                   num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4))
# The shipped budget (docs/algorithm.md §15): the VAE to convergence, the transformer far from it.
PRETRAIN = dict(seed=0, vae_steps=500, vae_batch=64, vae_lr=2e-3, kl_weight=1e-4, transformer_steps=80,
                transformer_batch=128, transformer_lr=1e-3, ema=0.995)
# What the method comparison (tasks/nano_compare.py) reads of a task: its --model, the judge's reward label (logged at weight
# 0 in the recipe's --reward) and its categories (none: one question, the prompted digit).
MODEL, JUDGE, CATEGORIES = "nano", "digit_judge", ()
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
    check_side(h, w, side)
    g = images.astype(np.float64).mean(-1) * (16 / 255)
    return g.reshape(n, side, h // side, side, w // side).mean((2, 4)).reshape(n, side * side)


def check_side(height: int, width: int, side: int = SIDE) -> None:
    """The digit readers' size rule, also checked at start-up (SIZE_CHECKS), before a model is built."""
    if height % side or width % side:
        raise ValueError(f"the digit classifiers read images whose sides are multiples of {side} (nano: "
                         f"--height {SIDE} --width {SIDE}), got {height}×{width}")


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


def digit():
    """`--reward digit`: p(the prompted digit) under the reward classifier (a logistic regression on 8×8 averages)."""
    classifiers()  # fitted now (seconds): at start-up, not in the first rollout
    return lambda images, prompts, metadata: reward_scores(images, [target_digit(p) for p in prompts])


def digit_judge():
    """`--reward digit_judge`: 1 if the judge (an RBF SVM on all 16×16 pixels) reads the prompted digit, else 0. The
    nano recipe gives it weight 0 (`digit=1,digit_judge=0`): logged beside the reward, never optimised."""
    classifiers()
    return lambda images, prompts, metadata: judge_scores(images, [target_digit(p) for p in prompts])


@functools.lru_cache(maxsize=1)
def proxies() -> dict:
    """GARDO's proxy rewards on nano (--gardo-proxies): a 5-nearest-neighbour vote and Gaussian naive Bayes, fitted on
    the reward's 8×8 averages (they share its blind spots, as proxies do; the judge reads other features)."""
    from sklearn.naive_bayes import GaussianNB
    from sklearn.neighbors import KNeighborsClassifier
    x_train, _, y_train, _ = split()
    x = gray(quantised(render(x_train)), 8)
    return {"digit_knn": KNeighborsClassifier(5).fit(x, y_train), "digit_bayes": GaussianNB().fit(x, y_train)}


def proxy(name: str):
    """`--reward digit_knn` / `digit_bayes`: p(the prompted digit) under that proxy classifier."""
    def score(images, prompts, metadata):
        p = proxies()[name].predict_proba(gray(images, 8))
        return p[np.arange(len(p)), [target_digit(q) for q in prompts]]
    return score


PROXIES = ("digit_knn", "digit_bayes")  # GARDO's proxy rewards here (tasks/nano_compare.py's GARDO row)
REWARDS = {"digit": (digit, target_digit), "digit_judge": (digit_judge, target_digit),  # rewards.py's registry reads it
           **{name: (functools.partial(proxy, name), target_digit) for name in PROXIES}}
SIZE_CHECKS = dict.fromkeys(REWARDS, check_side)  # (height, width) -> None or ValueError, as rewards.py reads it


def held_out_accuracy() -> dict:
    """Both classifiers on the held-out split's real digits (rendered and quantised as in training)."""
    _, x_test, _, y_test = split()
    images = quantised(render(x_test))
    return {"n": len(y_test), "reward_accuracy": float((classifiers()[0].predict(gray(images, 8)) == y_test).mean()),
            "reward_p_true": float(reward_scores(images, y_test).mean()),
            "judge_accuracy": float(judge_scores(images, y_test).mean())}


# ---- pretraining: the VAE, then the transformer (through tasks/pretraining.py, as every laptop task's base) ---

def pretrain(out: str, per_digit: int = 50, *, seed: int, vae_steps: int, vae_batch: int, vae_lr: float,
             kl_weight: float, transformer_steps: int, transformer_batch: int, transformer_lr: float,
             ema: float) -> dict:
    """Train the nano VAE and transformer on the train split and write them to `out` (vae/, transformer/: diffusers'
    own format, float16) for `--model nano --model-path out`. Returns what each stage reached (out/pretrain.json)."""
    used = {k: v for k, v in locals().items() if k in PRETRAIN or k.startswith("per_")}  # the values given
    pretraining.check_out(out)  # before the training, not after it
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    x_train, x_test, y_train, y_test = split()
    train_images, test_images = render(x_train) * 2 - 1, render(x_test) * 2 - 1  # (N, 3, 16, 16) in [-1, 1]
    report, start = {"command": " ".join(["python -m tasks.nano pretrain", *sys.argv[2:]]), "config": used}, time.time()

    # 1. VAE: reconstruction MSE + a small KL to N(0, 1), on batches of the train split; then its latents' per-channel
    #    mean and std over the train split, by which the pipeline normalises them
    vae = AutoencoderKLQwenImage(**VAE, latents_mean=[0.0] * VAE["z_dim"], latents_std=[1.0] * VAE["z_dim"])
    losses = pretraining.train_vae(
        vae, lambda n, g: train_images[torch.randint(len(train_images), (n,), generator=g)], vae_steps, vae_batch,
        vae_lr, kl_weight, gen)
    mu_z, std_z = pretraining.latents(vae, train_images)  # (N, 4, 4, 4)
    vae.register_to_config(latents_mean=mu_z.mean((0, 2, 3)).tolist(), latents_std=mu_z.std((0, 2, 3)).tolist())
    with torch.no_grad():
        recon = vae.decode(pretraining.latents(vae, test_images)[0][:, :, None]).sample[:, :, 0]  # held out
    seen = quantised((recon + 1) / 2)  # what the classifiers read of a perfect transformer's output: the ceiling
    pretraining.reached(report, "vae", steps=vae_steps, first_mse=np.mean(losses[:10]),
                        last_mse=np.mean(losses[-20:]), held_out_mse=(recon - test_images).square().mean().item(),
                        seconds=time.time() - start, judge_on_reconstructions=judge_scores(seen, y_test).mean(),
                        reward_on_reconstructions=reward_scores(seen, y_test).mean())

    # 2. Transformer: rectified flow on the normalised latents, each image prompted with its digit's prompt
    pipe = models_nano.build_nano_pipeline(None, vae=vae, transformer=QwenImageTransformer2DModel(**TRANSFORMER))
    start = time.time()
    losses = pretraining.train_transformer(pipe, mu_z, std_z, torch.as_tensor(y_train), prompt_texts(), SIDE,
                                           transformer_steps, transformer_batch, transformer_lr, ema, gen)
    pretraining.reached(report, "transformer", steps=transformer_steps, first_loss=np.mean(losses[:10]),
                        last_loss=np.mean(losses[-20:]), seconds=time.time() - start)

    # 3. Write, then measure what was written
    pretraining.save_parts(out, vae=vae, transformer=pipe.transformer)
    pretraining.reached(report, "base model", **evaluate(load(out), per_digit))
    report["classifiers_held_out"] = held_out_accuracy()
    pretraining.save_report(out, report)
    return report


# ---- evaluation: ODE samples on held-out seeds, read by the reward and the judge ---------------------

def prompt_texts() -> list[str]:
    """The built-in `digits` prompt set, digit d at index d."""
    texts = [p for p, _ in prompt_sets.load_prompts("digits").train]
    assert [target_digit(p) for p in texts] == list(range(10)), texts
    return texts


def load(path: str | None = None, lora: str | None = None):
    """The nano pipeline (the shipped weights, or `path`), with a run's exported LoRA directory loaded if given."""
    pipe = models_nano.build_nano_pipeline(path or models_nano.NANO_DIR)
    try:
        if lora:
            pipe.load_lora_weights(lora)
    except (RuntimeError, ValueError, KeyError) as e:  # another model's LoRA: "size mismatch", keys it does not have
        raise ValueError(f"{lora} does not fit the base in {path or models_nano.NANO_DIR} ({str(e).strip()[:150]}): "
                         "give a LoRA trained on that base") from None
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def sample(pipe, texts: list[str], side: int, steps: int = 10, chunk: int = 100) -> torch.Tensor:
    """Images (N, 3, side, side) in [0, 1] of prompts `texts`: diffusers' own QwenImagePipeline call (the ODE, Euler,
    as the loop's evaluation), image i from seed EVAL_SEED + i, for any model: every laptop task's held-out draws."""
    images = []
    for c in range(0, len(texts), chunk):
        ids = range(c, min(c + chunk, len(texts)))
        gens = [torch.Generator().manual_seed(EVAL_SEED + i) for i in ids]
        images.append(pipe([texts[i] for i in ids], true_cfg_scale=1.0, height=side, width=side,
                           num_inference_steps=steps, generator=gens, output_type="pt").images.float())
    return torch.cat(images)


def sample_digits(pipe, per_digit: int, steps: int = 10) -> tuple[torch.Tensor, np.ndarray]:
    """(images (10·per_digit, 3, 16, 16), digits (10·per_digit,)): image i shows digit i mod 10 (sample)."""
    digits = np.tile(np.arange(10), per_digit)
    return sample(pipe, [prompt_texts()[d] for d in digits], SIDE, steps), digits


def diversity(images: torch.Tensor, digits: np.ndarray) -> float:
    """Mean over digits of the per-pixel std across that digit's images (in [0, 1]): mode collapse drives it to 0."""
    return float(np.mean([images[digits == d].std(0).mean().item() for d in np.unique(digits)]))


def evaluate(pipe, per_digit: int = 50, steps: int = 10) -> dict:
    """Judge accuracy, mean reward and diversity of `per_digit` samples of each digit on the held-out seeds."""
    images, digits = sample_digits(pipe, per_digit, steps)
    u8 = quantised(images)
    return {"images": len(digits), "judge_accuracy": float(judge_scores(u8, digits).mean()),
            "reward_mean": float(reward_scores(u8, digits).mean()), "diversity": diversity(images, digits)}


# ---- before vs after, one row per digit --------------------------------------------------------------

def grid(run_dir: str, out: str, per_digit: int = 8, cell: int = 48) -> dict:
    """A PNG of the base model's samples (left) and the run's (right, its exported LoRA) from the same held-out
    seeds: one row per digit, a green frame where the judge reads the prompted digit, red where it does not."""
    from PIL import Image, ImageDraw, ImageFont
    font, gap = ImageFont.load_default(size=13), 24
    canvas = Image.new("RGB", (24 + 2 * per_digit * cell + gap, 22 + 10 * cell), "white")
    draw, result = ImageDraw.Draw(canvas), {}
    for side, lora in enumerate((None, run_lora(run_dir))):
        images, digits = sample_digits(load(lora=lora), per_digit)
        right = judge_scores(quantised(images), digits)
        result["before" if side == 0 else "after"] = float(right.mean())
        x0 = 24 + side * (per_digit * cell + gap)
        draw.text((x0, 3), f"{'before (base)' if side == 0 else 'after (RL)'}: the judge reads {right.mean():.0%} of "
                  f"these {len(right)}", fill="black", font=font)
        for i, (img, d, ok) in enumerate(zip(images, digits, right)):
            framed(canvas, img, x0 + (i // 10) * cell, 22 + d * cell, cell, ok)
    for d in range(10):
        draw.text((6, 22 + d * cell + cell // 2 - 7), str(d), fill="black", font=font)
    canvas.save(out)
    return result


def framed(canvas, image: torch.Tensor, x: int, y: int, cell: int, ok: bool, pad: int = 4) -> None:
    """Paste image (3, H, W) in [0, 1] into a cell × cell square of `canvas` at (x, y), framed green where the judge
    says it is right, red where it does not (the before/after grids)."""
    from PIL import Image, ImageDraw
    ImageDraw.Draw(canvas).rectangle((x, y, x + cell - 1, y + cell - 1), fill="#2a2" if ok else "#d22")
    tile = Image.fromarray(quantised(image[None])[0]).resize((cell - 2 * pad, cell - 2 * pad), Image.NEAREST)
    canvas.paste(tile, (x + pad, y + pad))


def run_lora(run_dir: str, model: str = MODEL) -> str:
    """<run_dir>/lora, the LoRA a `flowgrpo.py --model MODEL` run exported (finished or stopped), checked before anything
    loads. run_dir: the run's directory, or its lora/."""
    if os.path.basename(os.path.normpath(run_dir)) == "lora":
        run_dir = os.path.dirname(os.path.normpath(run_dir))
    lora = os.path.join(run_dir, "lora")
    if not os.path.isfile(os.path.join(lora, "pytorch_lora_weights.safetensors")):
        raise ValueError(f"{run_dir}: no exported LoRA ({lora}/pytorch_lora_weights.safetensors): give the directory of "
                         "a `flowgrpo.py` run (it exports the LoRA at its end, or once stopped by Ctrl-C in one process)")
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            trained = json.load(f).get("model", model)
    except (OSError, ValueError, AttributeError):  # a LoRA without its run's args.json: load() checks it fits
        trained = model
    if trained != model:
        raise ValueError(f"{run_dir} is a run of --model {str(trained)[:40]}, not {model}: give a {model} run")
    return lora


def check_numbers(ap, counts: dict, pretrain: dict | None = None) -> None:
    """A laptop CLI's numbers, refused in one line before anything starts: each of `counts`, {flag: (value, most)},
    in [1, most] (what could not finish, e.g. 10⁸ seeds, is refused rather than begun); each pretraining flag of
    `pretrain`, {name: value}, finite and in [1, 10⁷] (0 allowed for a seed, a float, a curve's period and
    nano-compose's optional decoder stage: a step count of -1 wrote an untrained base)."""
    bad = [f"--{k.replace('_', '-')} must be in [1, {most}], got {v}" for k, (v, most) in counts.items()
           if not 1 <= v <= most]
    for k, v in (pretrain or {}).items():
        low = 0 if isinstance(v, float) or k in ("seed", "curve_every", "decoder_steps") else 1  # 0: a stage skipped
        if not (math.isfinite(v) and low <= v <= 10**7):
            bad.append(f"--{k.replace('_', '-')} must be in [{low}, 1e7], got {v}")
    if bad:
        ap.exit(2, f"{ap.prog}: error: {bad[0]}\n")


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tasks.nano", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pretrain", help="train the base model (defaults: the shipped budget) and write it to --out")
    p.add_argument("--out", default=models_nano.NANO_DIR, help="directory for vae/, transformer/, pretrain.json")
    for key, value in PRETRAIN.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    sub.add_parser("classifiers", help="the reward's and the judge's accuracy on the held-out real digits")
    e = sub.add_parser("evaluate", help="the base model and each run's LoRA on the held-out seeds")
    e.add_argument("runs", nargs="*", help="run directories of `flowgrpo.py --model nano` (their lora/)")
    g = sub.add_parser("grid", help="before vs after as one PNG, one row per digit")
    g.add_argument("run", help="a run directory of `flowgrpo.py --model nano`")
    g.add_argument("--out", help="the PNG (default: <run>/before_after.png)")
    for q in (p, e):
        q.add_argument("--per-digit", type=int, default=50, help="held-out images per digit of each evaluation")
    a = ap.parse_args(argv)
    check_numbers(ap, {"per_digit": (getattr(a, "per_digit", 1), 10**4)},  # 10⁴: 10⁵ images, minutes
                  {k: getattr(a, k) for k in PRETRAIN} if a.cmd == "pretrain" else None)
    try:
        if a.cmd == "pretrain":
            pretrain(a.out, a.per_digit, **{k: getattr(a, k) for k in PRETRAIN})
        elif a.cmd == "classifiers":
            print(json.dumps(held_out_accuracy(), indent=2))
        elif a.cmd == "evaluate":
            loras = [run_lora(run) for run in a.runs]  # all checked before the first evaluation
            for run, lora in zip(["base", *a.runs], [None, *loras]):
                print(json.dumps({"run": run} | evaluate(load(lora=lora), a.per_digit)), flush=True)
        else:
            out = a.out or os.path.join(os.path.dirname(run_lora(a.run)), "before_after.png")
            print(json.dumps({"grid": out} | grid(a.run, out)))
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")


if __name__ == "__main__":
    main()
