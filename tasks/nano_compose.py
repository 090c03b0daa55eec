"""The nano-compose task: GenEval's questions at toy size, drawn with real handwritten digits in colour.

    python -m tasks.nano_compose judge [--per-category 500]   # judge, reward, proxies: renders, noise, wrong prompts
    python -m tasks.nano_compose prompts [--out FILE]          # write the prompt set (train, held out, with categories)
    python -m tasks.nano_compose pretrain [--out DIR]          # the base: VAE, then transformer; its gates' figures
    python -m tasks.nano_compose evaluate [--model-path DIR]   # the judge per category on held-out prompts and seeds

A 32×32 image, black background, glyphs from scikit-learn's `load_digits` (tasks/nano.py's split: train 1,437, held out
360) in a palette of named colours (white where the prompt names none). Prompts follow TEMPLATES exactly (they and
the renders are tasks/nano_compose_render.py's):

    single       a 7                      exactly one digit, and it is 7
    two          a 3 and a 5              exactly two digits, {3, 5}
    counting     three 4s                 exactly three digits, all 4
    colours      a red 2                  one digit, 2, in red
    position     a 1 left of a 9          two digits, 1's centre left of 9's
    attribution  a red 1 and a blue 6     two digits, each in its own colour
    number       the number 407           three digits in one row, in that order

The judge (`judge_scores`, never a reward) is a program in GenEval's manner: find the digits (connected ink, merged
while their boxes nearly touch, specks and blobs dropped), read each (an RBF SVM on its crop stretched to 12×12), its
colour (the nearest palette entry to its mean colour) and its centre, and check the prompt's condition. The reward
(`reward_scores`) is built differently and smoother: its own ink threshold, a logistic regression on square crops
averaged to 8×8, soft colour and position terms, partial credit; so reward hacking shows as reward up, judge flat.
Both read uint8 images (N, H, W, 3). docs/tasks.md has what each measured. The base's pretraining is
tasks/nano_compose_pretrain.py, which this file's `pretrain` runs, handing it the judge and evaluation.
"""
import functools
import itertools
import json
import os

import numpy as np
import torch

import model_checks
import models_nano
from tasks import nano
from tasks import nano_compose_pretrain
from tasks import pretraining
from tasks.nano_compose_render import (CATEGORIES, GLYPH_SIZES, INK, NAMES, NUMBER_SIZES, OFFSET, PALETTE, SIDE,
                                       all_prompts, centre, glyphs, offset, parse, prompt_lines, prompt_sets, render)

BASE_DIR = models_nano.NanoComposeQwenImage.default_path  # the base (`python -m tasks.nano_compose pretrain` writes it)
PROMPTS = os.path.join(BASE_DIR, "prompts.jsonl")  # the prompt set (`python -m tasks.nano_compose prompts`)
REWARD_INK = 64  # the reward's own ink: a pixel whose brightest channel exceeds this (the judge's is INK)
ROW = 4  # the judge's "one row": the three centres within this many pixels vertically
# What the method comparison (tasks/nano_compare.py) reads: the task's --model, its judge's reward label, and
# CATEGORIES (the prompts' file's, imported above).
MODEL, JUDGE = "nano-compose", "compose_judge"
COMPARED = ("Flow-GRPO, full mode", "Flow-GRPO-Fast (--branch)", "Flow-DPPO (mask 1e-5)", "DiffusionNFT", "AWM",
            "DGPO", "Online DPO")
SEEDS = 3  # the comparison's rows and seeds: the methods that matter, within its 3-hour budget on 2 cores


# ---- finding and reading the digits of an image ------------------------------------------------------

def find(image: np.ndarray, ink: int = INK, speck: int = 8, blob: int = 16) -> list[dict]:
    """The digits of one uint8 image (H, W, 3): 8-connected ink (brightest channel > `ink`), components merged while
    their boxes are ≤ 1 pixel apart on both axes, then specks (< `speck` pixels) and blobs (a side > `blob`) dropped.
    Each: `box` (y0, y1, x0, x1 inclusive), `pixels`, `mask` (its ink) and `ink` (all of the image's)."""
    from scipy import ndimage
    labels, _ = ndimage.label(image.max(-1) > ink, structure=np.ones((3, 3)))
    objs = [{"box": (sl[0].start, sl[0].stop - 1, sl[1].start, sl[1].stop - 1), "pixels": int((labels[sl] == k).sum()),
             "labels": [k]} for k, sl in enumerate(ndimage.find_objects(labels), 1)]
    while pair := next(((a, b) for a, b in itertools.combinations(objs, 2) if _near(a["box"], b["box"])), None):
        a, b = pair
        objs.remove(b)
        (ay0, ay1, ax0, ax1), (by0, by1, bx0, bx1) = a["box"], b["box"]
        a["box"] = (min(ay0, by0), max(ay1, by1), min(ax0, bx0), max(ax1, bx1))
        a["pixels"], a["labels"] = a["pixels"] + b["pixels"], a["labels"] + b["labels"]
    keep = [o for o in objs
            if o["pixels"] >= speck and max(o["box"][1] - o["box"][0], o["box"][3] - o["box"][2]) < blob]
    for o in keep:
        o["mask"], o["ink"] = np.isin(labels, o["labels"]), labels > 0
    return keep


def _near(a, b) -> bool:
    """Boxes at most 1 empty pixel apart on both axes (they overlap once each grows by 1 pixel)."""
    return max(b[0] - a[1], a[0] - b[1]) - 1 <= 1 and max(b[2] - a[3], a[2] - b[3]) - 1 <= 1


def crop(image: np.ndarray, obj: dict, side: int, stretch: bool) -> np.ndarray:
    """An object's crop of the brightest channel (its box grown by 1 pixel, other digits' ink zeroed), stretched to
    side × side (bilinear, antialiased: the judge's) or padded to a square and averaged to side × side (the
    reward's), scaled to peak 1: (side²,) float32. Colour does not enter."""
    y0, y1, x0, x1 = obj["box"]
    bright = image.max(-1).astype(np.float32) / 255
    bright[obj["ink"] & ~obj["mask"]] = 0
    region = np.pad(bright, 1)[y0:y1 + 3, x0:x1 + 3]  # rows y0 − 1 … y1 + 1 of the image, zero outside it
    if not stretch:
        (h, w), m = region.shape, max(region.shape)
        region = np.pad(region, (((m - h) // 2, m - h - (m - h) // 2), ((m - w) // 2, m - w - (m - w) // 2)))
    kw = dict(mode="bilinear", antialias=True, align_corners=False) if stretch else dict(mode="area")
    small = torch.nn.functional.interpolate(torch.from_numpy(region)[None, None], size=(side, side), **kw)
    small = small.numpy().ravel()
    return small / max(small.max(), 1e-6)


_CHROMA = np.array([PALETTE[c] for c in NAMES], dtype=np.float64) / 255  # (5, 3), peak 1 each


def read(images: np.ndarray, reader: str) -> list[list[dict]]:
    """Every image's digits (`find` at the reader's threshold), each with the judge's `digit` or, for the reward and
    GARDO's proxies (PROXIES), `p` (10,) digit probabilities from that reader's classifier, its `chroma` (3,) (the
    ink's mean colour, brightness-weighted, peak 1), `colour` (the nearest palette name) and `centre` (y, x)."""
    found = [find(im, INK if reader == "judge" else REWARD_INK) for im in images]
    flat = [(im, o) for im, objs in zip(images, found) for o in objs]
    if not flat:
        return found
    judge, reward = classifiers()
    if reader == "judge":
        read_out = judge.predict(np.stack([crop(im, o, 12, True) for im, o in flat]))
    else:
        reads = reward if reader == "reward" else proxies()[reader]
        read_out = reads.predict_proba(np.stack([crop(im, o, 8, False) for im, o in flat]))
    for (im, o), r in zip(flat, read_out):
        o["digit" if reader == "judge" else "p"] = int(r) if reader == "judge" else r
        px = im[o["mask"]].astype(np.float64)  # (P, 3)
        mean = (px * px.max(1, keepdims=True)).sum(0) / max(px.max(1).sum(), 1e-6)
        o["chroma"] = mean / max(mean.max(), 1e-6)
        o["colour"] = NAMES[int(np.square(_CHROMA - o["chroma"]).sum(1).argmin())]
        o["centre"] = centre(o["box"])
    return found


@functools.lru_cache(maxsize=1)
def train_crops() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The train glyphs alone as `find` and `crop` make them (white, at every size; a glyph `find` splits is left
    out): (crops stretched to 12×12, square crops averaged to 8×8, labels), what every reader is fitted on."""
    g, images, labels = glyphs(False), [], []
    for s in sorted({*GLYPH_SIZES, *NUMBER_SIZES}):
        for k, ink in enumerate(g[s][0]):
            im = np.zeros((SIDE, SIDE, 3), dtype=np.uint8)
            im[4:4 + s, 4:4 + s] = np.round(ink * 255).astype(np.uint8)[..., None]
            images.append(im)
            labels.append(g["labels"][k])
    found = [find(im) for im in images]
    kept = [(im, objs[0], y) for im, objs, y in zip(images, found, labels) if len(objs) == 1]
    x12, x8 = (np.stack([crop(im, o, side, side == 12) for im, o, _ in kept]) for side in (12, 8))
    return x12, x8, np.array([k[2] for k in kept])


@functools.lru_cache(maxsize=1)
def classifiers():
    """(judge, reward): an RBF SVM on the 12×12 crops and a logistic regression on the 8×8 ones. Deterministic;
    seconds, once per process."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.svm import SVC
    from threadpoolctl import threadpool_limits
    x12, x8, y = train_crops()
    with threadpool_limits(1):  # small problems: more BLAS threads only wait on each other
        return SVC(kernel="rbf", C=10.0, gamma="scale").fit(x12, y), LogisticRegression(max_iter=5000).fit(x8, y)


@functools.lru_cache(maxsize=1)
def proxies() -> dict:
    """GARDO's proxy readers on nano-compose (--gardo-proxies): a 5-nearest-neighbour vote and Gaussian naive Bayes on
    the reward's own 8×8 crops, so they share its blind spots, as proxies do; the judge reads other features."""
    from sklearn.naive_bayes import GaussianNB
    from sklearn.neighbors import KNeighborsClassifier
    _, x8, y = train_crops()
    return {"compose_knn": KNeighborsClassifier(5).fit(x8, y), "compose_bayes": GaussianNB().fit(x8, y)}


# ---- the judge and the reward ------------------------------------------------------------------------

def judge_one(objs: list[dict], spec: dict) -> bool:
    """Whether the digits the judge read of one image satisfy the prompt's condition (the table above)."""
    want, colours, category = spec["digits"], spec["colours"], spec["category"]
    if len(objs) != len(want):
        return False
    if category == "number":
        objs = sorted(objs, key=lambda o: o["centre"][1])
        xs, ys = [o["centre"][1] for o in objs], [o["centre"][0] for o in objs]
        in_row = max(ys) - min(ys) <= ROW and all(b - a > OFFSET for a, b in zip(xs, xs[1:]))
        return in_row and tuple(o["digit"] for o in objs) == want
    for order in itertools.permutations(objs):
        if all(o["digit"] == d and (c is None or o["colour"] == c) for o, d, c in zip(order, want, colours)):
            if category != "position" or offset(spec["relation"], order[0]["centre"], order[1]["centre"]) > OFFSET:
                return True
    return False


def judge_scores(images: np.ndarray, prompts: list[str]) -> np.ndarray:
    """The judge: 1.0 where the image satisfies its prompt's condition, else 0.0, (N,)."""
    specs = [parse(p) for p in prompts]
    return np.array([float(judge_one(objs, s)) for objs, s in zip(read(images, "judge"), specs)])


def reward_one(objs: list[dict], spec: dict) -> float:
    """One image's reward: the best assignment of found digits to the prompt's, each scoring p(its digit) × p(its
    colour) (a softmax over palette distances), summed and divided by max(wanted, found) (a missing or extra digit
    costs its share), times a soft position or row term. In [0, 1]; 0 when nothing is found."""
    want, colours, category = spec["digits"], spec["colours"], spec["category"]
    best = 0.0
    for order in itertools.permutations(objs, min(len(objs), len(want))):
        if category == "number" and any(a["centre"][1] > b["centre"][1] for a, b in zip(order, order[1:])):
            continue  # a number is read left to right
        score = 0.0
        for o, d, c in zip(order, want, colours):
            q = np.exp(-np.square(_CHROMA - o["chroma"]).sum(1) / 0.1)
            score += o["p"][d] * (1.0 if c is None else q[NAMES.index(c)] / q.sum())
        score /= max(len(want), len(objs))
        if category == "position" and len(order) == 2:
            score /= 1 + np.exp((OFFSET - offset(spec["relation"], order[0]["centre"], order[1]["centre"])) / 1.5)
        if category == "number" and len(order) > 1:
            score /= 1 + np.exp(np.ptp([o["centre"][0] for o in order]) - ROW - 1)  # a sigmoid of the row's slack
        best = max(best, score)
    return float(best)


def reward_scores(images: np.ndarray, prompts: list[str], reader: str = "reward") -> np.ndarray:
    """The reward (`reward_one`) of each image for its prompt, (N,) in [0, 1]; a proxy's with `reader` one of
    PROXIES."""
    specs = [parse(p) for p in prompts]
    return np.array([reward_one(objs, s) for objs, s in zip(read(images, reader), specs)])


def compose():
    """`--reward compose`: the smooth scorer (`reward_one`): per-digit classifier probabilities, soft colour, place."""
    classifiers()  # fitted now (seconds): at start-up, not in the first rollout
    return lambda images, prompts, metadata: reward_scores(images, prompts)


def compose_judge():
    """`--reward compose_judge`: 1 where the judge finds the prompt's condition met, else 0. The task's recipe gives it
    weight 0: logged beside the reward (and per category at evaluation), never optimised."""
    classifiers()
    return lambda images, prompts, metadata: judge_scores(images, prompts)


def proxy(name: str):
    """`--reward compose_knn` / `compose_bayes`: the reward's program (`reward_one`), that proxy reading the digits."""
    proxies()
    return lambda images, prompts, metadata: reward_scores(images, prompts, name)


PROXIES = ("compose_knn", "compose_bayes")  # GARDO's proxy rewards here (tasks/nano_compare.py's GARDO row)
REWARDS = {"compose": (compose, parse), "compose_judge": (compose_judge, parse),  # rewards.py's registry reads it
           **{name: (functools.partial(proxy, name), parse) for name in PROXIES}}


# ---- the base (tasks/nano_compose_pretrain.py trains it): evaluation, grid ---------------------------

def by_category(scores: np.ndarray, prompts: list[str]) -> dict:
    """{category: mean score}, and "overall": their mean (GenEval's)."""
    cats = np.array([parse(p)["category"] for p in prompts])
    means = {c: float(scores[cats == c].mean()) for c in CATEGORIES if (cats == c).any()}
    return means | {"overall": float(np.mean(list(means.values())))}


def load(path: str | None = None, lora: str | None = None):
    """The nano-compose pipeline (the shipped weights, or `path`), with a run's exported LoRA directory if given."""
    return nano.load(path or BASE_DIR, lora)


def held_out_prompts(per_cat: int) -> list[str]:
    """`per_cat` held-out prompts of each category (its list in turn), category by category."""
    held_out = prompt_sets()[1]
    return [held_out[c][i % len(held_out[c])] for c in CATEGORIES for i in range(per_cat)]


def evaluate(pipe, per_cat: int = 50, steps: int = 10) -> dict:
    """ODE samples of the held-out prompts (`held_out_prompts`) from the held-out seeds (nano.sample), judged: per
    category, `judge_accuracy` (their mean, GenEval's overall), on the novel prompts and on the seen ones; the mean
    reward; the diversity across each prompt's images (nano.diversity)."""
    prompts = held_out_prompts(per_cat)
    pixels = nano.sample(pipe, prompts, SIDE, steps)
    images = nano.quantised(pixels)
    judged, seen = judge_scores(images, prompts), {p for v in prompt_sets()[0].values() for p in v}
    novel, cats = np.array([p not in seen for p in prompts]), by_category(judged, prompts)
    overall, repeated = cats.pop("overall"), [p for p in set(prompts) if prompts.count(p) > 1]
    keep = np.isin(prompts, repeated)  # the diversity of prompts drawn more than once
    return {"images": len(prompts), **cats, "judge_accuracy": overall, "novel": judged[novel].mean(),
            "seen": judged[~novel].mean(), "reward_mean": reward_scores(images, prompts).mean(),
            # NaN where no prompt repeats (per_cat up to 10): what nano_compare's table shows as "—"
            "diversity": nano.diversity(pixels[torch.from_numpy(keep)], np.array(prompts)[keep]) if keep.any() else
            float("nan")}


def grid(run_dir: str, out: str, per_cat: int = 6, cell: int = 64, model_path: str | None = None) -> dict:
    """A PNG of the base model's samples (left; the shipped one or `model_path`) and the run's (right, its exported
    LoRA) of the same held-out prompts and seeds: one row per category, each image's prompt under it, framed green
    where the judge says it is right."""
    from PIL import Image, ImageDraw, ImageFont
    font, small, gap, text = ImageFont.load_default(size=13), ImageFont.load_default(size=9), 24, 24
    prompts, result = held_out_prompts(per_cat), {}
    canvas = Image.new("RGB", (80 + 2 * per_cat * cell + gap, 22 + len(CATEGORIES) * (cell + text)), "white")
    draw = ImageDraw.Draw(canvas)
    for side, lora in enumerate((None, nano.run_lora(run_dir, MODEL))):
        images = nano.sample(load(model_path, lora), prompts, SIDE)
        right = judge_scores(nano.quantised(images), prompts)
        result["before" if side == 0 else "after"] = by_category(right, prompts)["overall"]
        x0 = 80 + side * (per_cat * cell + gap)
        draw.text((x0, 3), f"{'before (base)' if side == 0 else 'after (RL)'}: the judge finds {right.mean():.0%} of "
                  f"these {len(right)} right", fill="black", font=font)
        for i, (img, prompt, ok) in enumerate(zip(images, prompts, right)):
            x, y = x0 + (i % per_cat) * cell, 22 + (i // per_cat) * (cell + text)
            nano.framed(canvas, img, x, y, cell, ok)
            caption = prompt.removeprefix("the number ").replace(" and ", " and\n")  # two digits: two lines
            draw.multiline_text((x + cell // 2, y + cell + 1), caption, fill="black", font=small, anchor="ma",
                                align="center", spacing=1)
    for r, category in enumerate(CATEGORIES):
        draw.text((4, 22 + r * (cell + text) + cell // 2 - 7), category, fill="black", font=font)
    canvas.save(out)
    return result


# ---- measuring the judge and the reward --------------------------------------------------------------

def condition(prompt: str) -> tuple:
    """What a prompt asks, equal for equivalent wordings ("a 3 and a 5" = "a 5 and a 3", "a 1 left of a 9" = "a 9
    right of a 1"): a wrong prompt for an image is one whose condition differs."""
    spec = parse(prompt)
    d, c = spec["digits"], spec["colours"]
    if spec["category"] == "position":
        flip = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
        return min((d[0], spec["relation"], d[1]), (d[1], flip[spec["relation"]], d[0]))
    if spec["category"] in ("two", "attribution"):
        return (spec["category"], *sorted(zip(d, map(str, c))))
    return (spec["category"], d, c)


def measure(per_category: int = 500, seed: int = 1) -> dict:
    """The judge, the reward and GARDO's proxies on `per_category` renders of each category (its held-out prompts in
    turn, held-out glyphs), on uniform noise, and against a wrong prompt of the same category (one with another
    condition)."""
    held_out, every = prompt_sets()[1], all_prompts()
    rng = np.random.default_rng(seed)
    result = {}
    for category in CATEGORIES:
        prompts = [held_out[category][i % len(held_out[category])] for i in range(per_category)]
        images = render(prompts, held_out=True, seed=seed)
        wrong = []
        for p in prompts:
            while condition(q := every[category][rng.integers(len(every[category]))]) == condition(p):
                pass
            wrong.append(q)
        noise = rng.integers(0, 256, images.shape, dtype=np.uint8)
        readers = [("judge", judge_scores), ("reward", reward_scores),
                   *((p, functools.partial(reward_scores, reader=p)) for p in PROXIES)]
        result[category] = {f"{name}{suffix}": float(fn(x, ps).mean()) for name, fn in readers for suffix, x, ps in (
            ("", images, prompts), ("_wrong", images, wrong), ("_noise", noise, prompts))}
    return result


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tasks.nano_compose", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pretrain", help="train the base model (defaults: the shipped budget) and write it to --out")
    p.add_argument("--out", default=BASE_DIR, help="directory for vae/, transformer/, pretrain.json")
    for key, value in nano_compose_pretrain.PRETRAIN.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    e = sub.add_parser("evaluate", help="the base model (or --model-path, with a run's --lora) per category on the "
                       "held-out prompts")
    e.add_argument("--lora", help="a run's directory (or its lora/): its exported LoRA on the base")
    g = sub.add_parser("grid", help="before vs after as one PNG, one row per category")
    g.add_argument("run", help="a run directory of `flowgrpo.py --model nano-compose`")
    g.add_argument("--out", help="the PNG (default: <run>/before_after.png)")
    for q in (e, g):
        q.add_argument("--model-path", help="a directory `pretrain` wrote (default: the shipped one)")
    for q in (p, e):
        q.add_argument("--per-category", type=int, default=50, help="held-out images per category")
    j = sub.add_parser("judge", help="the judge, the reward and GARDO's proxies on held-out renders, noise and wrong "
                       "prompts")
    j.add_argument("--per-category", type=int, default=500, help="renders of each category")
    j.add_argument("--seed", type=int, default=1)
    w = sub.add_parser("prompts", help="write the prompt set: train and held out, each line with its category")
    w.add_argument("--out", default=PROMPTS)
    a = ap.parse_args(argv)  # at most 10⁴ images or renders of a category: minutes
    nano.check_numbers(ap, {"per_category": (getattr(a, "per_category", 1), 10**4)},
                       {k: getattr(a, k) for k in nano_compose_pretrain.PRETRAIN} if a.cmd == "pretrain" else None)
    if a.cmd == "pretrain":
        try:  # an --out it could not write: one line before the 88 CPU-minutes, not a traceback
            pretraining.check_out(a.out)
        except ValueError as err:
            ap.exit(2, f"{ap.prog}: error: {err}\n")
        nano_compose_pretrain.pretrain(a.out, lambda x, ps: by_category(judge_scores(x, ps), ps), evaluate,
                                       a.per_category, **{k: getattr(a, k) for k in nano_compose_pretrain.PRETRAIN})
    elif a.cmd in ("evaluate", "grid"):
        try:  # a wrong directory, another task's run: one line now, not a traceback (or a hub download) after imports
            a.model_path and model_checks.check_model_path(MODEL, a.model_path)
            given = a.run if a.cmd == "grid" else a.lora
            lora = given and nano.run_lora(given, MODEL)
        except ValueError as err:
            ap.exit(2, f"{ap.prog}: error: {err}\n")
        if a.cmd == "evaluate":
            print(json.dumps(evaluate(load(a.model_path, lora), a.per_category)))
        else:
            out = a.out or os.path.join(os.path.dirname(lora), "before_after.png")
            print(json.dumps({"grid": out} | grid(a.run, out, model_path=a.model_path)))
    elif a.cmd == "judge":
        for category, figures in measure(a.per_category, a.seed).items():
            print(category, json.dumps({k: round(v, 4) for k, v in figures.items()}), flush=True)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in prompt_lines())
        os.replace(a.out + ".tmp", a.out)
        counts = [f"{s} {sum(x['split'] == s for x in prompt_lines())}" for s in ("train", "eval")]
        print(f"{a.out}: " + ", ".join(counts))


if __name__ == "__main__":
    main()
