"""The nano-edit task: edit a real handwritten digit as an instruction says, at nano's 16×16, white on black.

    python -m tasks.nano_edit judge [--per-kind 300]    # judge and reward on exact targets, sources, noise, wrong edits
    python -m tasks.nano_edit prompts [--out FILE]      # write the prompt set and its source PNGs (train and held out)
    python -m tasks.nano_edit evaluate [--lora DIR]     # the judge per instruction on held-out glyphs and seeds
    python -m tasks.nano_edit_pretrain [--out DIR]      # the base: nano's VAE, a transformer trained here on edits

A source is a glyph of scikit-learn's `load_digits` (tasks/nano.py's split: train 1,437, held out 360) drawn at 12×12
(bilinear, its grey doubled and clipped: solid ink) in the middle of the 16×16 canvas, so that every edit stays on it.
Exact targets, computed from the source (`EDITS`): `make it bold` / `make it thin` grey dilation / erosion with the 3×3
plus; `mirror it` left-right; `turn it upside down` 180°; `move it left` (right, up, down) SHIFT pixels; `make it a
{d}` has none (no writer ids exist): another digit where the source was.

The judge (never a reward) reads 16×16 ink masks (above INK of 255): a geometric edit is right where the output's IoU
with the target is ≥ IOU, the target is its nearest among the source and every other instruction's target, and the
digit survives (an RBF SVM on 16×16 pixels reads in the output, mapped back through the edit, what it read in the
source); `make it a d` where the SVM reads d and the ink's box keeps the source's centre and height. The reward, built
differently and smooth, reads 8×8: the correlation with the target (≥ 0) × exp(−the ink's relative difference); for
`make it a d` a logistic regression's p(d) × a soft closeness of centre and height. Both read uint8 images (N, H, W,
3) and the source's path in the metadata.
"""
import functools
import json
import os
import re

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

import model_checks
import models_nano
import prompts as prompt_sets
import rollout
import source_images
from tasks import nano

SIDE, GLYPH, GAIN = 16, 12, 2.0  # canvas, glyph side (pixels), ink gain (the bilinear strokes' grey made solid)
SHIFT = 2  # pixels a move instruction moves the glyph
INK = 127  # the judge's ink threshold (of 255)
IOU, CENTRE, HEIGHT = 0.5, 1.5, 2.0  # the judge's tolerances: IoU with the target; make-it-a-d's centre and height
GEOMETRIC = {  # instruction -> (edit on images (N, 1, S, S), its inverse or None where the class is read as it stands)
    "make it bold": ("bold", None), "make it thin": ("thin", None),
    "mirror it": ("mirror", "mirror"), "turn it upside down": ("rot180", "rot180"),
    "move it left": ("left", "right"), "move it right": ("right", "left"),
    "move it up": ("up", "down"), "move it down": ("down", "up")}
_SEMANTIC = re.compile(r"make it an? (\d)")
INSTRUCTIONS = (*GEOMETRIC, "make it a {d}")  # the tags of the evaluation: one per instruction kind
BASE_DIR = models_nano.NanoEdit.default_path  # the shipped base (`python -m tasks.nano_edit_pretrain`)
PROMPTS = os.path.join(BASE_DIR, "prompts.jsonl")  # the prompt set (`python -m tasks.nano_edit prompts`)
MODEL, JUDGE, CATEGORIES = "nano-edit", "edit_judge", INSTRUCTIONS  # what tasks/nano_compare.py reads of a task
# its rows and seeds there (BENCHMARKS.md): nano-compose's seven, 3 seeds (64 prompts an iteration: 4.5 to 9.4 CPU-s an
# iteration, so BENCHMARKS ran them at 40 of the recipe's 80 iterations)
COMPARED = ("Flow-GRPO, full mode", "Flow-GRPO-Fast (--branch)", "Flow-DPPO (mask 1e-5)", "DiffusionNFT", "AWM", "DGPO",
            "Online DPO")
SEEDS = 3


# ---- sources, edits, instructions --------------------------------------------------------------------

def render(x8: np.ndarray) -> torch.Tensor:
    """8×8 digits in [0, 16] (N, 8, 8) -> sources (N, 1, 16, 16) float32 in [0, 1]: the glyph at GLYPH×GLYPH
    (bilinear, as nano.render), its grey × GAIN clipped, centred on the canvas."""
    x = torch.as_tensor(np.asarray(x8), dtype=torch.float32)[:, None] / 16
    g = (F.interpolate(x, size=(GLYPH, GLYPH), mode="bilinear", align_corners=False) * GAIN).clamp(0, 1)
    p = (SIDE - GLYPH) // 2
    return F.pad(g, (p, SIDE - GLYPH - p, p, SIDE - GLYPH - p))


def _plus(x: torch.Tensor, sign: float) -> torch.Tensor:
    """Grey dilation (sign 1) or erosion (sign −1) of (N, 1, S, S) with the 3×3 plus, black beyond the canvas."""
    p = F.pad(sign * x, (1, 1, 1, 1))
    return sign * torch.stack([sign * x, p[..., 1:-1, :-2], p[..., 1:-1, 2:], p[..., :-2, 1:-1], p[..., 2:, 1:-1]]).amax(0)


EDITS = {  # name -> the exact edit of (N, 1, S, S); a move is a pad on one side and a crop (negative pad) on the other
    "bold": lambda x: _plus(x, 1.0), "thin": lambda x: _plus(x, -1.0), "mirror": lambda x: x.flip(-1),
    "rot180": lambda x: x.flip(-1, -2), "left": lambda x: F.pad(x, (-SHIFT, SHIFT)),
    "right": lambda x: F.pad(x, (SHIFT, -SHIFT)), "up": lambda x: F.pad(x, (0, 0, -SHIFT, SHIFT)),
    "down": lambda x: F.pad(x, (0, 0, SHIFT, -SHIFT))}


def parse(prompt: str) -> dict:
    """An instruction -> {"kind": its INSTRUCTIONS entry, "edit": an EDITS name or None, "digit": d or None}; a
    ValueError naming the fix for anything else (the reward's start-up check)."""
    if prompt in GEOMETRIC:
        return {"kind": prompt, "edit": GEOMETRIC[prompt][0], "digit": None}
    if (m := _SEMANTIC.fullmatch(prompt)) is not None:
        return {"kind": "make it a {d}", "edit": None, "digit": int(m.group(1))}
    raise ValueError(f"nano-edit: instruction {prompt!r} is none of the task's; write one of {list(GEOMETRIC)} or "
                     "'make it a 7', or use the task's set: --prompts assets/nano-edit/prompts.jsonl")


def quantise(x: torch.Tensor) -> torch.Tensor:
    """(N, 1, S, S) in [0, 1] rounded to 8 bits, as a PNG holds it."""
    return torch.round(x * 255) / 255


def target(sources: torch.Tensor, prompt: str) -> torch.Tensor:
    """The exact target (N, 1, S, S) of a geometric instruction on sources (N, 1, S, S)."""
    return EDITS[parse(prompt)["edit"]](sources)


# ---- the judge and the reward ------------------------------------------------------------------------

def check_size(height: int, width: int) -> None:
    """The judge's and the reward's canvas, also checked at start-up (SIZE_CHECKS), before a model is built."""
    if (height, width) != (SIDE, SIDE):
        raise ValueError(f"nano-edit's judge and reward read {SIDE}×{SIDE} images (--height {SIDE} --width {SIDE}), "
                         f"got {height}×{width}")


def to_gray(images: np.ndarray) -> torch.Tensor:
    """uint8 images (N, H, W, 3) -> (N, 1, 16, 16) float in [0, 1]: the channel mean (a 16×16 canvas only)."""
    check_size(*images.shape[1:3])
    return torch.from_numpy(images.astype(np.float32).mean(-1) / 255)[:, None]


def read_source(path: str) -> torch.Tensor:
    """A source PNG -> (1, 1, 16, 16) in [0, 1], as the judge reads the output (uint8, channel mean)."""
    return to_gray(np.asarray(source_images.read(path))[None])


@functools.lru_cache(maxsize=1)
def classifiers():
    """(reward, judge): a logistic regression on 8×8 averages and an RBF SVM on all 16×16 pixels, fitted on the train
    split's sources and their bold and thin versions (uint8, as every reward sees them); both deterministic."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import SVC
    from threadpoolctl import threadpool_limits
    x_train, _, y_train, _ = nano.split()
    s = render(x_train)  # (N, 1, 16, 16)
    g, y = quantise(torch.cat([s, EDITS["bold"](s), EDITS["thin"](s)])), np.tile(y_train, 3)
    with threadpool_limits(1):
        reward = LogisticRegression(max_iter=5000).fit(F.avg_pool2d(g, 2).flatten(1).numpy() * 16, y)
        judge = SVC(kernel="rbf", C=10.0, gamma="scale").fit(g.flatten(1).numpy() * 16, y)
    return reward, judge


def read_digits(gray: torch.Tensor, by: str) -> np.ndarray:
    """The judge's SVM reading (N,) or the reward's class probabilities (N, 10) of (N, 1, 16, 16) in [0, 1]."""
    reward, judge = classifiers()
    return judge.predict(gray.flatten(1).numpy() * 16) if by == "judge" else reward.predict_proba(
        F.avg_pool2d(gray, 2).flatten(1).numpy() * 16)


def box(gray: torch.Tensor) -> torch.Tensor:
    """The ink's box (N, 3): centre row, centre column, height, in pixels (ink above INK; no ink: height < 0)."""
    m = gray[:, 0] * 255 > INK
    idx = torch.arange(m.shape[-1], dtype=torch.float32)
    span = lambda ink: ((idx + 100 * ~ink).amin(1), (idx - 100 * ~ink).amax(1))  # first and last inked row (column)
    (top, bottom), (left, right) = span(m.any(2)), span(m.any(1))
    return torch.stack([(top + bottom) / 2, (left + right) / 2, bottom - top + 1], 1)


def iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU (N,) of the ink masks of (N, 1, S, S) in [0, 1]; two empty masks: 0."""
    a, b = a * 255 > INK, b * 255 > INK
    return (a & b).flatten(1).sum(1) / (a | b).flatten(1).sum(1).clamp(min=1)


def kept(out: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Position and size kept (N,) bool: the ink boxes' centres within CENTRE px and heights within HEIGHT px."""
    a, b = box(out), box(source)
    return ((a[:, :2] - b[:, :2]).abs().amax(1) <= CENTRE) & ((a[:, 2] - b[:, 2]).abs() <= HEIGHT)


def judge_one_kind(out: torch.Tensor, sources: torch.Tensor, prompt: str) -> np.ndarray:
    """The judge (N,) in {0, 1} of outputs (N, 1, 16, 16) for one instruction on their sources (module docstring)."""
    spec = parse(prompt)
    if spec["edit"] is None:
        return ((read_digits(out, "judge") == spec["digit"]) & kept(out, sources).numpy()).astype(np.float64)
    near = iou(out, EDITS[spec["edit"]](sources))
    rivals = torch.stack([iou(out, sources)] + [iou(out, EDITS[e](sources)) for e in EDITS if e != spec["edit"]])
    back = out if GEOMETRIC[prompt][1] is None else EDITS[GEOMETRIC[prompt][1]](out)
    digit = read_digits(back, "judge") == read_digits(sources, "judge")  # the digit as the SVM read the source
    return ((near >= IOU) & (near > rivals.amax(0))).numpy() & digit


def reward_one_kind(out: torch.Tensor, sources: torch.Tensor, prompt: str) -> np.ndarray:
    """The reward (N,) in [0, 1] of outputs (N, 1, 16, 16) for one instruction on their sources (module docstring)."""
    spec = parse(prompt)
    o8 = F.avg_pool2d(out, 2).flatten(1)
    if spec["edit"] is None:
        a, b = box(out), box(sources)
        off = (a[:, :2] - b[:, :2]).square().sum(1) / 4 + (a[:, 2] - b[:, 2]).square() / 16
        return read_digits(out, "reward")[:, spec["digit"]] * torch.exp(-off).numpy()
    t8 = F.avg_pool2d(EDITS[spec["edit"]](sources), 2).flatten(1)
    oc, tc = o8 - o8.mean(1, keepdim=True), t8 - t8.mean(1, keepdim=True)
    corr = (oc * tc).sum(1) / (oc.norm(dim=1) * tc.norm(dim=1)).clamp(min=1e-8)
    ink = torch.exp(-(o8.mean(1) - t8.mean(1)).abs() / t8.mean(1).clamp(min=1e-3))
    return (corr.clamp(min=0) * ink).numpy()


def _by_kind(fn, images: np.ndarray, prompts: list[str], metadata: list[dict]) -> np.ndarray:
    """fn over each instruction's images at once: images uint8 (N, 16, 16, 3), each prompt's source in its metadata."""
    out = to_gray(images)
    missing = [i for i, m in enumerate(metadata or [{}] * len(prompts)) if not (m or {}).get("image")]
    if missing:
        raise ValueError(f"nano-edit's reward reads each prompt's source image (metadata \"image\"): prompt "
                         f"{missing[0]} has none; use the task's set, --prompts assets/nano-edit/prompts.jsonl")
    sources = torch.cat([read_source(m["image"]) for m in metadata])
    scores = np.zeros(len(prompts))
    for p in dict.fromkeys(prompts):
        idx = [i for i, q in enumerate(prompts) if q == p]
        scores[idx] = fn(out[idx], sources[idx], p)
    return scores


judge_scores = functools.partial(_by_kind, judge_one_kind)  # (images, prompts, metadata) -> (N,) in {0, 1}
reward_scores = functools.partial(_by_kind, reward_one_kind)  # (images, prompts, metadata) -> (N,) in [0, 1]


def fitted(scores):
    """A reward factory: the classifiers fitted when it is called (seconds: at start-up, not in the first rollout)."""
    return lambda: classifiers() and scores


# rewards.py's registry reads it: `--reward edit` the smooth 8×8 scorer; `edit_judge`, which the recipe logs at weight 0
REWARDS = {"edit": (fitted(reward_scores), parse), "edit_judge": (fitted(judge_scores), parse)}
SIZE_CHECKS = dict.fromkeys(REWARDS, check_size)  # (height, width) -> None or ValueError, as rewards.py reads it


# ---- the prompt set: train glyphs for RL, held-out glyphs for evaluation ---------------------------------

VISIBLE = 0.7  # a (source, instruction) pair is kept where the target's IoU with the source and every rival is below


def pairs(held_out: bool, per_kind: int, seed: int = 0) -> list[tuple[int, str]]:
    """(glyph index in its split, instruction): `per_kind` of each kind, kinds in turn, glyphs drawn without
    repetition within a kind. Kept only where the task is well posed: a geometric edit visible (the target's IoU with
    the source and with every other instruction's target below VISIBLE) and its exact target judged right; `make it
    a d` with d drawn among the other digits."""
    x_train, x_test, y_train, y_test = nano.split()
    src, y = (quantise(render(x_test)), y_test) if held_out else (quantise(render(x_train)), y_train)
    rng, out = np.random.default_rng([seed, held_out]), {k: [] for k in INSTRUCTIONS}
    for kind in INSTRUCTIONS:
        for i in rng.permutation(len(y)).tolist():
            if len(out[kind]) == per_kind:
                break
            if kind == "make it a {d}":
                out[kind].append((i, f"make it a {rng.choice([d for d in range(10) if d != y[i]])}"))
                continue
            s, goal = src[i:i + 1], target(src[i:i + 1], kind)
            rivals = [s] + [EDITS[e](s) for e in EDITS if e != GEOMETRIC[kind][0]]
            if max(iou(goal, r).item() for r in rivals) < VISIBLE and judge_one_kind(goal, s, kind)[0]:
                out[kind].append((i, kind))
    return [out[k][j] for j in range(per_kind) for k in INSTRUCTIONS if j < len(out[k])]  # kinds interleaved


def write_prompts(out: str, train_per_kind: int = 40, eval_per_kind: int = 20) -> dict:
    """The prompt file (`{"prompt", "image", "split", "tag"}` lines, train then eval) and its source PNGs
    (sources/{train,eval}_{index}.png, RGB, beside it)."""
    (x_train, x_test, _, _), folder, lines = nano.split(), os.path.dirname(os.path.abspath(out)), []
    os.makedirs(os.path.join(folder, "sources"), exist_ok=True)
    for split, x8, n in (("train", x_train, train_per_kind), ("eval", x_test, eval_per_kind)):
        for i, prompt in pairs(split == "eval", n):
            name, pixels = f"sources/{split}_{i}.png", (render(x8[i:i + 1])[0, 0] * 255).round().to(torch.uint8)
            Image.fromarray(np.repeat(pixels.numpy()[..., None], 3, -1)).save(os.path.join(folder, name))
            lines.append({"prompt": prompt, "image": name, "split": split, "tag": parse(prompt)["kind"]})
    with open(out + ".tmp", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    os.replace(out + ".tmp", out)
    return {s: sum(x["split"] == s for x in lines) for s in ("train", "eval")}


def by_kind(rows: list[tuple[int, str]]) -> dict[str, list]:
    """(glyph, instruction) rows grouped by their instruction kind, in INSTRUCTIONS' order."""
    return {k: [r for r in rows if parse(r[1])["kind"] == k] for k in INSTRUCTIONS}


# ---- evaluation: the held-out prompts from held-out seeds ----------------------------------------------------------

EVAL_SEED = 2**31  # the evaluation's seed (rollout.sample_ode, iteration −1); the loop's own evaluation uses --seed


def load(path: str | None = None, lora: str | None = None):
    """The nano-edit adapter on CPU (the shipped base or `path`), a run's exported LoRA loaded if given."""
    model = models_nano.NanoEdit.load(MODEL, path or BASE_DIR, "cpu")
    return model.pipe.load_lora_weights(lora) or model if lora else model


def held_out(per_kind: int) -> list[tuple[str, dict]]:
    """The first `per_kind` shipped held-out prompts (instruction, metadata with its source) of each kind, kind by kind."""
    rows = [r for r in prompt_sets.read_prompt_file(PROMPTS) if r[1]["split"] == "eval"]
    return [r for k in INSTRUCTIONS for r in [r for r in rows if r[1]["tag"] == k][:per_kind]]


def sample(model, rows: list[tuple[str, dict]], steps: int = 10) -> np.ndarray:
    """uint8 images (N, 16, 16, 3): ODE samples of (instruction, metadata) rows, image i from the evaluation's seed i."""
    return nano.quantised(rollout.sample_ode(model, [p for p, _ in rows], num_steps=steps, height=SIDE, width=SIDE,
                                             cfg_scale=1.0, negative_prompt=" ", seed=EVAL_SEED, chunk=64,
                                             metadata=[m for _, m in rows]))


def evaluate(model, per_kind: int = 20, seeds: int = 3, steps: int = 10) -> dict:
    """The judge per instruction kind (and overall: their mean), the mean reward and the diversity (nano.diversity:
    the per-pixel spread across one prompt's `seeds` images) of ODE samples of the held-out prompts (`held_out`)."""
    rows = held_out(per_kind) * seeds
    texts, meta, images = [p for p, _ in rows], [m for _, m in rows], sample(model, rows, steps)
    judged, tags = judge_scores(images, texts, meta), np.array([m["tag"] for m in meta])
    kinds = {k: float(judged[tags == k].mean()) for k in INSTRUCTIONS}
    prompt = np.arange(len(rows)) % (len(rows) // seeds)  # which held-out prompt each image answers
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2) / 255
    # one image a prompt (seeds 1): no spread to measure; 0 would read as collapse (the comparison's table shows "—")
    spread = nano.diversity(pixels, prompt) if seeds > 1 else float("nan")
    return {"images": len(rows), **kinds, "judge_accuracy": float(np.mean(list(kinds.values()))),
            "reward_mean": float(reward_scores(images, texts, meta).mean()), "diversity": spread}


def grid(run_dir: str, out: str, per_kind: int = 4, cell: int = 48, model_path: str | None = None) -> dict:
    """A PNG, one row per instruction kind of `per_kind` held-out prompts, each a triple: the source, the base model's
    edit (the shipped one or `model_path`), the run's (its exported LoRA), from the same seeds; an edit framed green
    where the judge says it is right. Returns the judge's mean on the base's and the run's edits."""
    from PIL import ImageDraw, ImageFont
    font, gap, label = ImageFont.load_default(size=13), 14, 150
    rows = held_out(per_kind)
    texts, meta = [p for p, _ in rows], [m for _, m in rows]
    sources = torch.cat([read_source(m["image"]) for m in meta]).expand(-1, 3, -1, -1)
    edits = {side: sample(load(model_path, lora), rows) for side, lora in (
        ("before", None), ("after", nano.run_lora(run_dir, MODEL)))}
    right = {side: judge_scores(images, texts, meta) for side, images in edits.items()}
    width = 3 * cell + gap
    canvas = Image.new("RGB", (label + per_kind * width, 40 + len(INSTRUCTIONS) * cell), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 3), f"source | base | after RL, {len(rows)} held-out prompts: the judge finds the base's "
              f"{right['before'].mean():.0%} and the run's {right['after'].mean():.0%} right", fill="black", font=font)
    for i, (text, tag) in enumerate(zip(texts, [m["tag"] for m in meta])):
        x, y = label + (i % per_kind) * width, 22 + (i // per_kind) * cell
        nano.framed(canvas, sources[i], x, y, cell, True, pad=4)
        draw.rectangle((x, y, x + cell - 1, y + cell - 1), outline="white", width=4)  # the source: no verdict
        for j, side in enumerate(("before", "after"), start=1):
            pixels = torch.from_numpy(edits[side][i]).permute(2, 0, 1) / 255
            nano.framed(canvas, pixels, x + j * cell, y, cell, bool(right[side][i]))
        if tag == "make it a {d}":  # which digit: in the gap after the triple
            draw.text((x + 3 * cell + 2, y + cell // 2 - 7), text[-1], fill="black", font=font)
    for r, kind in enumerate(INSTRUCTIONS):
        draw.text((4, 22 + r * cell + cell // 2 - 7), kind.replace("{d}", "d"), fill="black", font=font)
    canvas.save(out)
    return {side: float(v.mean()) for side, v in right.items()}


def measure(per_kind: int = 300, seed: int = 1) -> dict:
    """The judge and the reward, per kind, on held-out sources: the exact target, the unedited source, uniform noise,
    and a wrong edit (another geometric instruction's target), for every geometric kind."""
    rng, src, result = np.random.default_rng(seed), quantise(render(nano.split()[1])), {}
    for kind, rows in list(by_kind(pairs(True, per_kind, seed)).items())[:len(GEOMETRIC)]:
        i = torch.tensor([r[0] for r in rows])
        s, goal = src[i], target(src[i], kind)
        wrong = EDITS[rng.choice([e for e in EDITS if e != GEOMETRIC[kind][0]])](s)
        noise = torch.from_numpy(rng.integers(0, 256, s.shape).astype(np.float32) / 255)
        result[kind] = {f"{name}_{what}": float(fn(x, s, kind).mean()) for name, fn in (
            ("judge", judge_one_kind), ("reward", reward_one_kind)) for what, x in (
            ("target", goal), ("source", s), ("noise", noise), ("wrong", wrong))}
    return result


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tasks.nano_edit", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("evaluate", help="the base (or --model-path, with a run's --lora) per instruction, held out")
    e.add_argument("--lora", help="a run's directory (or its lora/): its exported LoRA on the base")
    e.add_argument("--seeds", type=int, default=3)
    g = sub.add_parser("grid", help="source, before and after as one PNG, one row per instruction")
    g.add_argument("run", help="a run directory of `flowgrpo.py --model nano-edit`")
    g.add_argument("--out", help="the PNG (default: <run>/before_after.png)")
    for q in (e, g):
        q.add_argument("--model-path", help="a directory `pretrain` wrote (default: the shipped one)")
    j = sub.add_parser("judge", help="the judge and the reward on exact targets, sources, noise and wrong edits")
    sub.add_parser("prompts", help="write the prompt set and its source PNGs").add_argument("--out", default=PROMPTS)
    for q, n in ((e, 20), (j, 300)):
        q.add_argument("--per-kind", type=int, default=n, help="held-out prompts (judge: sources) of each kind")
    a = ap.parse_args(argv)  # 10⁴ prompts of a kind, 100 seeds each: at most 10⁶ images
    nano.check_numbers(ap, {"per_kind": (getattr(a, "per_kind", 1), 10**4),
                                            "seeds": (getattr(a, "seeds", 1), 100)})
    torch.set_num_threads(1)
    if a.cmd in ("evaluate", "grid"):
        try:  # checked before anything loads: a LoRA of another task's run, a wrong directory, in one line
            a.model_path and model_checks.check_model_path(MODEL, a.model_path)
            given = a.run if a.cmd == "grid" else a.lora
            lora = given and nano.run_lora(given, MODEL)
        except ValueError as err:
            ap.exit(2, f"{ap.prog}: error: {err}\n")
        if a.cmd == "evaluate":
            print(json.dumps(evaluate(load(a.model_path, lora), a.per_kind, a.seeds)))
        else:
            out = a.out or os.path.join(os.path.dirname(lora), "before_after.png")
            print(json.dumps({"grid": out} | grid(a.run, out, model_path=a.model_path)))
    elif a.cmd == "judge":
        for kind, figures in measure(a.per_kind).items():
            print(f"{kind:20s}", json.dumps({k: round(v, 4) for k, v in figures.items()}), flush=True)
    else:
        print(f"{a.out}: {write_prompts(a.out)}")


if __name__ == "__main__":
    main()
