"""nano-compose's prompts and their renders: the grammar every other part of the task reads (TEMPLATES, `parse`, the
train and held-out prompt sets) and a correct composition drawn for any prompt (`render`, `pool`), with real handwritten
digits in colour. tasks/nano_compose.py (the judge, the reward, evaluation) and tasks/nano_compose_pretrain.py (the
base, trained on `pool`) stand on it.

Why 32: the smallest side at which every category is drawn with glyphs that stay readable — "the number ddd" needs
three 10–11 px glyphs side by side with 3 px between their ink (their ink is 7–10 px wide), "four ds" a 2×2 grid of
16-px cells, the position words a few pixels between two centres on either axis; 16×16 holds one glyph (tasks/nano.py).
"""
import functools
import itertools
import re

import numpy as np
import torch

from tasks import nano

SIDE = 32  # image side in pixels
SET_SEED = 0  # which combinations the held-out prompt set keeps for itself
PALETTE = {"white": (255, 255, 255), "red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255),
           "yellow": (255, 255, 0)}  # every entry has a channel at 255: the brightest channel is a glyph's ink
NAMES = list(PALETTE)  # the palette's order: what a glyph's colour draw indexes, and the judge's nearest colour
COLOURS = ("red", "green", "blue", "yellow")  # the named colours; white is the colour of a digit named without one
RELATIONS = ("left of", "right of", "above", "below")
COUNTS = {"two": 2, "three": 3, "four": 4}
CATEGORIES = ("single", "two", "counting", "colours", "position", "attribution", "number")
_C, _R = "|".join(COLOURS), "|".join(RELATIONS)
TEMPLATES = {  # category -> the one template its prompts follow (a full match)
    "single": re.compile(r"a (\d)"), "two": re.compile(r"a (\d) and a (\d)"),
    "counting": re.compile(r"(two|three|four) (\d)s"), "colours": re.compile(rf"a ({_C}) (\d)"),
    "position": re.compile(rf"a (\d) ({_R}) a (\d)"), "attribution": re.compile(rf"a ({_C}) (\d) and a ({_C}) (\d)"),
    "number": re.compile(r"the number (\d)(\d)(\d)")}
INK = 80  # a pixel is ink where its brightest channel exceeds this (of 255): the judge's, and a glyph's ink box's
GLYPH_SIZES = (10, 11, 12)  # a glyph is its 8×8 digit upscaled bilinearly to one of these sides
NUMBER_SIZES = (10, 11)  # "the number ddd": three in a row, all of one of these sizes
GAP = 3  # empty pixels at least between the ink boxes of two glyphs of a render (the judge merges boxes ≤ 1 apart)
OFFSET = 3  # the judge's position: centres more than this many pixels apart in the named direction


# ---- prompts -----------------------------------------------------------------------------------------

def parse(prompt: str) -> dict:
    """A prompt -> its `category`, `digits` (counting repeats d), `colours` (one per digit, None where unnamed) and
    `relation` (position). Raises ValueError, naming the fix, for a prompt outside TEMPLATES."""
    for category, template in TEMPLATES.items():
        if (m := template.fullmatch(prompt)) is None:
            continue
        g = m.groups()
        if category == "counting":
            return {"category": category, "digits": (int(g[1]),) * COUNTS[g[0]], "colours": (None,) * COUNTS[g[0]]}
        if category == "position":
            return {"category": category, "digits": (int(g[0]), int(g[2])), "colours": (None, None), "relation": g[1]}
        named = [x for x in g if x in COLOURS]  # colours and attribution name one colour per digit
        digits = tuple(int(x) for x in g if x.isdigit())
        return {"category": category, "digits": digits, "colours": tuple(named) or (None,) * len(digits)}
    raise ValueError(f"nano-compose: prompt {prompt!r} follows none of the task's templates; write e.g. 'a red 3 and "
                     "a blue 5' (nano_compose_render.TEMPLATES), or use the task's set: --prompts compose")


def all_prompts() -> dict[str, list[str]]:
    """Every prompt of every category: the task's whole prompt space (10 + 90 + 30 + 40 + 360 + 1,080 + 1,000)."""
    pairs = [(a, b) for a in range(10) for b in range(10) if a != b]  # the two digits of a prompt always differ
    return {"single": [f"a {d}" for d in range(10)], "two": [f"a {a} and a {b}" for a, b in pairs],
            "counting": [f"{n} {d}s" for n in COUNTS for d in range(10)],
            "colours": [f"a {c} {d}" for c in COLOURS for d in range(10)],
            "position": [f"a {a} {r} a {b}" for r in RELATIONS for a, b in pairs],
            "attribution": [f"a {c} {a} and a {e} {b}" for c in COLOURS for e in COLOURS if c != e for a, b in pairs],
            "number": [f"the number {n:03d}" for n in range(1000)]}


@functools.lru_cache(maxsize=2)
def prompt_sets(seed: int = SET_SEED, per_category: int = 20) -> tuple[dict, dict]:
    """(train, held_out): {category: [prompt, ...]}. Held out from `seed`, never trained on (pretraining or RL): 9 of
    the 45 digit pairs (two, position, attribution), 2 digits per named colour (8 of the 40 colour–digit bindings),
    2 digits per count (6 of 30) and 200 of the 1,000 numbers; train is every prompt free of those. The held-out set
    is `per_category` prompts of each category (single: its 10): half of them novel (holding a held-out combination;
    counting has 6, colours 8), the rest drawn from train, so novel and seen can be read apart."""
    rng = np.random.default_rng(seed)
    pairs = [(a, b) for a in range(10) for b in range(a + 1, 10)]
    held_pairs = {pairs[i] for i in rng.choice(len(pairs), 9, replace=False)}
    perm = rng.permutation(10)
    held_bindings = {(c, int(d)) for i, c in enumerate(COLOURS) for d in perm[2 * i:2 * i + 2]}
    perm = rng.permutation(10)
    held_counts = {(n, int(d)) for i, n in enumerate(COUNTS.values()) for d in perm[2 * i:2 * i + 2]}
    held_numbers = set(rng.choice(1000, 200, replace=False).tolist())

    def novel(prompt: str) -> bool:
        spec = parse(prompt)
        d = spec["digits"]
        return ((spec["category"] in ("two", "position", "attribution") and tuple(sorted(d)) in held_pairs)
                or any((c, x) in held_bindings for c, x in zip(spec["colours"], d))
                or (spec["category"] == "counting" and (len(d), d[0]) in held_counts)
                or (spec["category"] == "number" and int("".join(map(str, d))) in held_numbers))
    train, held_out = {}, {}
    for category, texts in all_prompts().items():
        train[category] = [p for p in texts if not novel(p)]
        new = [p for p in texts if novel(p)]
        k = min(len(new), per_category // 2)
        picks = [new[i] for i in sorted(rng.choice(len(new), k, replace=False))] if k else []
        seen = train[category] if category == "single" else [
            train[category][i] for i in sorted(rng.choice(len(train[category]), per_category - k, replace=False))]
        held_out[category] = picks + seen
    return train, held_out


def prompt_lines() -> list[dict]:
    """The prompt file's lines: every train prompt, then the held-out ones, each with its split and category."""
    train, held_out = prompt_sets()
    return [{"prompt": p, "split": split, "tag": c} for split, sets in (("train", train), ("eval", held_out))
            for c in CATEGORIES for p in sets[c]]


# ---- glyphs and renders ------------------------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def glyphs(held_out: bool) -> dict:
    """One split's glyphs at every size: {size: (ink (N, s, s) float32 in [0, 1], ink boxes (N, 4) as y0, y1, x0, x1
    inclusive)}, with "labels" (N,) and "by_digit" (the indices of each digit). Bilinear, as nano.render."""
    x_train, x_test, y_train, y_test = nano.split()
    x8, labels = (x_test, y_test) if held_out else (x_train, y_train)
    out = {"labels": labels, "by_digit": [np.flatnonzero(labels == d) for d in range(10)]}
    for s in sorted({*GLYPH_SIZES, *NUMBER_SIZES}):
        x = torch.as_tensor(x8, dtype=torch.float32)[:, None] / 16
        ink = torch.nn.functional.interpolate(x, size=(s, s), mode="bilinear", align_corners=False)[:, 0]
        ink = ink.clamp(0, 1).numpy()
        rows, cols = (mask := np.round(ink * 255) > INK).any(2), mask.any(1)
        out[s] = (ink, np.stack([rows.argmax(1), s - 1 - rows[:, ::-1].argmax(1), cols.argmax(1),
                                 s - 1 - cols[:, ::-1].argmax(1)], 1))
    return out


def _separated(a, b, gap: int = GAP) -> bool:
    """Boxes (y0, y1, x0, x1) with at least `gap` empty pixels between them on one axis."""
    return max(b[0] - a[1], a[0] - b[1], b[2] - a[3], a[2] - b[3]) - 1 >= gap


def centre(box) -> tuple[float, float]:
    return (box[0] + box[1]) / 2, (box[2] + box[3]) / 2  # (y, x)


def offset(relation: str, a, b) -> float:
    """How far centre a (y, x) lies on the named side of centre b, in pixels (negative: the other side)."""
    (ya, xa), (yb, xb) = a, b
    return {"left of": xb - xa, "right of": xa - xb, "above": yb - ya, "below": ya - yb}[relation]


def _layout(rng, spec: dict, dims: list) -> list | None:
    """Top-left corners (y, x) of ink boxes of sizes `dims` [(h, w)], placed as the category places them, or None
    when this draw failed (the caller draws again)."""
    if spec["category"] == "number":  # one row, left to right, the slack spread over the margin and the two gaps
        slack = SIDE - sum(w for _, w in dims) - 2 * GAP
        if slack < 0:
            return None
        cuts = np.sort(rng.integers(0, slack + 1, 3))
        xs = [int(cuts[0]), int(cuts[0] + dims[0][1] + GAP + cuts[1] - cuts[0])]
        xs.append(int(xs[1] + dims[1][1] + GAP + cuts[2] - cuts[1]))
        tallest = max(h for h, _ in dims)
        cy = rng.uniform(tallest / 2, SIDE - tallest / 2)
        corners = [(int(round(cy - h / 2 + rng.integers(-1, 2))), x) for (h, _), x in zip(dims, xs)]
    elif spec["category"] == "counting":  # jittered cells of a 2×2 grid
        corners = [(16 * (c // 2) + int(rng.integers(0, 16 - h + 1)), 16 * (c % 2) + int(rng.integers(0, 16 - w + 1)))
                   for c, (h, w) in zip(rng.permutation(4), dims)]
    else:
        corners = [(int(rng.integers(0, SIDE - h + 1)), int(rng.integers(0, SIDE - w + 1))) for h, w in dims]
    boxes = [(y, y + h - 1, x, x + w - 1) for (y, x), (h, w) in zip(corners, dims)]
    if any(min(b) < 0 or max(b) >= SIDE for b in boxes):
        return None
    if not all(_separated(a, b) for a, b in itertools.combinations(boxes, 2)):
        return None
    if spec["category"] == "position":  # d1 on the named side of d2 by 6 px or more, that axis the dominant one
        a, b = centre(boxes[0]), centre(boxes[1])
        along = offset(spec["relation"], a, b)
        across = abs(a[1] - b[1]) if spec["relation"] in ("above", "below") else abs(a[0] - b[0])
        if along < 2 * OFFSET or across > along:
            return None
    return corners


def render(prompts: list[str], held_out: bool = False, seed: int = 0, any_colour: bool = False) -> np.ndarray:
    """One correct composition per prompt, uint8 (N, SIDE, SIDE, 3), from the train or held-out glyphs; instances,
    sizes and places drawn from `seed` (the same prompts and seed give the same images). `any_colour`: each glyph in a
    colour drawn from the whole palette instead (the VAE's training images, so that every colour is common)."""
    rng, g = np.random.default_rng(seed), glyphs(held_out)
    out = np.zeros((len(prompts), SIDE, SIDE, 3), dtype=np.float32)
    for i, spec in enumerate(map(parse, prompts)):
        for attempt in itertools.count():
            if attempt % 50 == 0:  # some glyphs never fit together (three wide ones in a row): draw others
                picks = [int(rng.choice(g["by_digit"][d])) for d in spec["digits"]]
            number = spec["category"] == "number"
            sizes = [int(rng.choice(NUMBER_SIZES))] * 3 if number else [int(rng.choice(GLYPH_SIZES)) for _ in picks]
            boxes = [g[s][1][k] for s, k in zip(sizes, picks)]
            if (corners := _layout(rng, spec, [(b[1] - b[0] + 1, b[3] - b[2] + 1) for b in boxes])) is not None:
                break
        colours = [NAMES[rng.integers(len(NAMES))] for _ in picks] if any_colour else spec["colours"]
        for (y, x), s, k, box, colour in zip(corners, sizes, picks, boxes, colours):
            top, left = y - box[0], x - box[2]  # the glyph's s × s square, placed so that its ink box is at (y, x)
            ys, xs = slice(max(top, 0), min(top + s, SIDE)), slice(max(left, 0), min(left + s, SIDE))
            patch = g[s][0][k][ys.start - top:ys.stop - top, xs.start - left:xs.stop - left]
            rgb = np.asarray(PALETTE[colour or "white"], dtype=np.float32) / 255
            out[i, ys, xs] = np.maximum(out[i, ys, xs], patch[..., None] * rgb)
    return np.round(out * 255).astype(np.uint8)


def pool(n: int, seed: int, held_out: bool = False, any_colour: bool = False) -> tuple[np.ndarray, list[str]]:
    """n renders (`render`), the categories in turn, each prompt uniform within its category's train (or held-out)
    set: (uint8 (n, SIDE, SIDE, 3), prompts). What the base is trained on (tasks/nano_compose_pretrain.py)."""
    sets, rng = prompt_sets()[held_out], np.random.default_rng(seed)
    prompts = [sets[c][rng.integers(len(sets[c]))] for c in itertools.islice(itertools.cycle(CATEGORIES), n)]
    return render(prompts, held_out, seed, any_colour), prompts
