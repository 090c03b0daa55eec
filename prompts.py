"""Prompt sets: `.txt` / `.jsonl` files, the built-in `ocr` and `general` sets, and a resumable sampler.

`load_prompts(spec)` takes a path ending in `.txt` (one prompt per line, blank lines skipped) or `.jsonl`
(one `{"prompt": ..., **metadata}` object per line; the metadata is handed to the reward), or a built-in
name. Every prompt is a `(prompt, metadata)` pair. Eval split of a file: a `.jsonl` may say it, line by line
(`"split": "train"` or `"eval"`, a GenEval-style split); otherwise, with fewer than 20 prompts the eval set is
the whole file (too few to hold any out), else every 10th distinct prompt (the 10th, 20th, ...), with every line
that repeats it, is held out for eval and never trained on. The built-in `ocr` and `general` sets have their own
disjoint eval splits; `digits` (the nano task's ten prompts) is evaluated on its training prompts, with seeds no
rollout uses; `compose` (the nano-compose task's) is a shipped `.jsonl` with its own split.

Editing: a `.jsonl` line may carry a source image, `{"prompt": ..., "image": "relative/path.png"}` (relative to the
file), checked as the file is read (`source_images.from_prompt_line`: nothing decoded); it travels in the metadata,
as an absolute path with its content's SHA-256, to the edit model's rollout and to every reward.
"""
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

import source_images

# The built-in OCR set: every scene x every phrase. Eval phrases never appear in training, so eval
# measures rendering of unseen text rather than memorised strings.
_SCENES = [
    'a wooden sign in a pine forest that reads "{}"', 'a neon sign glowing above a bar door saying "{}"',
    'a chalkboard menu outside a cafe with "{}" written on it', 'a birthday cake with "{}" piped in icing',
    'a white t-shirt printed with the words "{}"', 'a protest placard held high in a crowd, reading "{}"',
    'a vintage travel poster with the title "{}"', 'a street graffiti mural spelling "{}" on a brick wall',
    'a coffee mug on a desk with "{}" printed on its side', 'a book cover with the title "{}" in bold letters',
    'a highway billboard at sunset that says "{}"', 'a handwritten note on yellow paper saying "{}"',
    'a storefront window with "{}" painted in gold letters', 'a cinema marquee announcing "{}"',
    'a license plate that reads "{}"', 'a sand castle on a beach with "{}" written in the sand',
    'a laptop screen showing a slide titled "{}"', 'a vintage typewriter page with "{}" typed on it',
    'a cereal box on a kitchen table with the brand name "{}"', 'a sticky note on a fridge that says "{}"',
    'a hot air balloon with "{}" painted on it', 'a tote bag with "{}" embroidered on the front',
    'a retro arcade machine with "{}" on the marquee', 'a banner across a city street reading "{}"',
    'a glass bottle with a paper label that says "{}"', 'a classroom whiteboard with "{}" written in marker',
    'a road sign on a desert highway that reads "{}"', 'a stone monument engraved with the words "{}"',
    'a cardboard box stamped with "{}"', 'a smartphone lock screen displaying "{}"',
    'a pizza box lid with "{}" printed on it', 'a snowy mountain cabin with a carved sign reading "{}"',
]
_TRAIN_PHRASES = [
    "OPEN", "HELLO WORLD", "FRESH BREAD", "NO PARKING", "EXIT", "SALE", "GOOD MORNING", "THANK YOU", "COFFEE",
    "WELCOME HOME", "STOP", "DREAM BIG", "FLOW GRPO", "CLOSED", "HAPPY BIRTHDAY", "ROCK AND ROLL", "BOOKS",
    "SUMMER VIBES", "DANGER", "PIZZA", "LOVE", "MOUNTAIN VIEW", "NIGHT SHIFT", "STAY CURIOUS",
]
_EVAL_PHRASES = ["KEEP OUT", "FREE HUGS", "SEA BREEZE", "LEMONADE", "GAME OVER", "TEA TIME", "NORTH", "BE KIND"]

_GENERAL = [
    "a red fox sitting in fresh snow at dawn", "a bowl of ramen with a soft-boiled egg, top-down photo",
    "an astronaut riding a horse on the moon", "a lighthouse on a cliff during a storm",
    "a cozy reading nook with a cat asleep on a blanket", "a watercolor painting of a venetian canal",
    "a futuristic city skyline at night with flying cars", "a close-up of a dewdrop on a green leaf",
    "an old fisherman mending a net, black and white portrait", "a field of sunflowers under a blue sky",
    "a steaming cup of coffee on a rainy windowsill", "a medieval castle on a hill surrounded by fog",
    "a golden retriever puppy playing with a ball", "a minimalist living room with large windows",
    "a hummingbird drinking from a red flower", "a snowy mountain range reflected in a lake",
    "a basket of fresh strawberries on a wooden table", "a vintage red car parked on a cobblestone street",
    "an oil painting of a ship in rough seas", "a desert landscape with a lone cactus at sunset",
    "a child flying a kite on a windy beach", "a bustling night market with paper lanterns",
    "a bookshelf filled with colorful old books", "a tiger walking through tall grass",
    "a plate of pancakes with maple syrup and berries", "a treehouse in a giant oak tree",
    "a jellyfish glowing in the deep ocean", "a pixel art castle with a dragon",
    "a robot watering plants in a greenhouse", "a mountain cabin with smoke rising from the chimney",
    "a bicycle leaning against a yellow wall", "a bowl of fruit in the style of Cezanne",
    "an owl perched on a branch under a full moon", "a train crossing a stone bridge in autumn",
    "a chess board mid-game, shallow depth of field", "a waterfall in a lush tropical jungle",
    "a portrait of a woman with freckles in soft window light", "a sailboat on a calm lake at sunrise",
    "a snowman wearing a red scarf", "a busy kitchen in a restaurant, motion blur",
    "an isometric illustration of a small island town", "a pair of hiking boots on a rocky trail",
    "a koi pond with lily pads", "a violin resting on sheet music",
    "a city street in the rain reflecting neon lights", "a hedgehog holding a tiny umbrella",
    "a glass of orange juice on a sunny breakfast table", "a hot air balloon over a green valley",
]

@dataclass
class PromptSet:
    train: list[tuple[str, dict]]
    eval: list[tuple[str, dict]]

def _hold_out(pairs, every: int) -> PromptSet:
    """Every `every`-th distinct prompt (the every-th, 2*every-th, ...; an edit's with its source) for eval, with each
    line that repeats it, the rest for training: a file that repeats a prompt never trains on one held out. Fewer
    than `every` distinct prompts: all of them for both (too few to hold any out)."""
    keys = [(p, m.get("image_sha256")) for p, m in pairs]
    held = set(list(dict.fromkeys(keys))[every - 1::every])
    if not held:
        return PromptSet(pairs, list(pairs))
    return PromptSet([x for x, k in zip(pairs, keys) if k not in held], [x for x, k in zip(pairs, keys) if k in held])

_DIGITS = [(f"a handwritten digit {d}", {}) for d in range(10)]  # tasks/nano.py: digit d at index d
MAX_PROMPTS, MAX_FILE_BYTES = 10**6, 2**30  # a prompt file's lines and bytes
_COMPOSE = Path(__file__).parent / "assets" / "nano-compose" / "prompts.jsonl"
BUILTIN = {
    "ocr": lambda: PromptSet([(s.format(p), {}) for s in _SCENES for p in _TRAIN_PHRASES],
                             [(s.format(p), {}) for s in _SCENES[::4] for p in _EVAL_PHRASES]),
    "general": lambda: _hold_out([(p, {}) for p in _GENERAL], 6),
    "digits": lambda: PromptSet(list(_DIGITS), list(_DIGITS)),
    # tasks/nano_compose.py's GenEval-shaped set, as `python -m tasks.nano_compose prompts` wrote it: its own held-out split and
    # each prompt's category ("tag": the evaluation's per-category means)
    "compose": lambda: _by_split(read_prompt_file(_COMPOSE), "compose"),
}

def read_prompt_file(path: str | Path, size: tuple[int, int] | None = None) -> list[tuple[str, dict]]:
    """All (prompt, metadata) pairs of a `.txt` or `.jsonl` file, in file order; `size`: the run's (height, width),
    which a source image's aspect ratio must match (`source_images.from_prompt_line`)."""
    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"--prompts: {path}: expected a .txt or .jsonl file or one of {sorted(BUILTIN)}")
    if not path.is_file():  # a directory, a FIFO (whose read would block), a device: no prompt file
        kind = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise FileNotFoundError(f"--prompts: prompt file {path} {kind}")
    if path.stat().st_size > MAX_FILE_BYTES:  # read whole below
        raise ValueError(f"--prompts: {path} is {path.stat().st_size} bytes, more than {MAX_FILE_BYTES}: split it")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # an editor's byte-order mark is not part of the first prompt
    except UnicodeDecodeError as e:  # its line numbered as below (e.start counts the mark: "utf-8-sig"'s did not)
        line = raw[:e.start].replace(b"\r\n", b"\n").replace(b"\r", b"\n").count(b"\n") + 1
        raise ValueError(f"--prompts: {path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); save the file "
                         "as UTF-8") from None
    # lines end at "\n", "\r\n" or a lone "\r" (an old Mac editor's; never inside a prompt, nor raw in a JSON string)
    # only: str.splitlines also breaks at U+2028 and form feeds (legal in JSON strings)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not 0 < len(lines) <= MAX_PROMPTS:
        raise ValueError(f"--prompts: prompt file {path} has {len(lines) or 'no'} prompts (at most {MAX_PROMPTS}, "
                         "blank lines skipped)")
    if path.suffix == ".txt":
        return [(line.strip(), {}) for _, line in lines]
    out, quiet = [], len(lines) < 1000 or os.environ.get("RANK", "0") != "0"
    for n, line in tqdm(lines, f"checking {path.name}", disable=quiet):  # a long edit set's sources take a while
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep to parse
            raise ValueError(f"{path}:{n}: not valid JSON ({getattr(e, 'msg', 'nested too deep')}); each line must be "
                             'an object {"prompt": "...", ...metadata}') from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f'{path}:{n}: each line must be a JSON object with a non-empty string "prompt"')
        if "image" in row:
            row |= source_images.from_prompt_line(path, n, row["image"], size)
        out.append((row.pop("prompt").strip(), row))
    return out

def load_prompts(spec: str, size: tuple[int, int] | None = None) -> PromptSet:
    """A built-in set by name (`ocr`, `general`) or a `.txt`/`.jsonl` file (eval split: module docstring); `size`:
    the run's (height, width), checked against source images."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    pairs = read_prompt_file(spec, size)
    if any("split" in m for _, m in pairs):  # the file says which prompts are held out (GenEval-style sets)
        return _by_split(pairs, spec)
    return PromptSet(pairs, list(pairs)) if len(pairs) < 20 else _hold_out(pairs, 10)

def _by_split(pairs, spec) -> PromptSet:
    """A `.jsonl` whose lines say `"split": "train"` or `"eval"`: the eval ones are held out, never trained on."""
    bad = [m.get("split", "none") for _, m in pairs if m.get("split") not in ("train", "eval")]
    train, held = [x for x in pairs if x[1].get("split") == "train"], [x for x in pairs if x[1].get("split") == "eval"]
    if bad or not train or not held:
        raise ValueError(f"--prompts {spec}: where one line has a \"split\", every line needs \"train\" or \"eval\" "
                         f"and both must occur (found {bad[:1] or 'only one kind'})")
    return PromptSet(train, held)

class PromptSampler:
    """Which prompts iteration i trains on: a function of (seed, iteration, k) only, so a resumed run
    needs no other state. Position p = iteration*k + j walks a fresh permutation per epoch
    (p // n), i.e. every prompt is used once per epoch (without replacement) when k is constant."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError("PromptSampler: need at least one prompt")
        if seed < 0:
            raise ValueError(f"PromptSampler: seed must be >= 0, got {seed}")
        self.n, self.seed, self._cache = n, seed, (None, None)

    def _perm(self, epoch: int) -> np.ndarray:
        if self._cache[0] != epoch:
            self._cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n))
        return self._cache[1]

    def sample(self, iteration: int, k: int) -> list[int]:
        positions = range(iteration * k, (iteration + 1) * k)
        return [int(self._perm(p // self.n)[p % self.n]) for p in positions]

    def state_dict(self) -> dict:
        """What a checkpoint records of it (read back by nothing: a resumed run's sampler is its own flags', the same on
        every rank, rollout ranks included, and a prompt set changed by --allow-change prompts may have any size)."""
        return {"n": self.n, "seed": self.seed}
