"""The command line read: `--recipe`'s (or `--model`'s) values as the defaults, the flags over them, in `Args`' groups
(args.py: a section of `--help` each), and tyro's error box said in one line, as every refusal is (startup.py).

`Args` is passed in (the class), so that this file imports nothing of the loop.
"""
import contextlib
import dataclasses
import io
import os
import re
import shutil
import sys

import tyro

import recipes


def recipe_args(cls, name: str):
    """Recipe `name` as an instance of `cls` (flowgrpo.Args): its values (recipes.py) over the class's defaults."""
    return cls(**recipes.RECIPES[name], recipe=name)


def parse_args(cls, argv: list[str] | None = None):
    """The command line as an instance of `cls` (flowgrpo.Args), read in the groups it is made of (its dataclass
    bases, args.py), each a section of `--help`. `--recipe` (or else `--model`; the last one given, as for every flag)
    picks the recipe whose values become the defaults; the other flags override them."""
    argv = sys.argv[1:] if argv is None else argv
    name = _last_value(argv, "--recipe") or _last_value(argv, "--model") or "tiny"
    default = recipe_args(cls, name if name in recipes.RECIPES else "tiny")
    groups = [g for g in reversed(cls.__bases__) if dataclasses.is_dataclass(g)]  # in the order of cls's fields
    # tyro's input: a field per group, named as its section of --help (ModelArgs: "model options", the class's
    # docstring under the title), its flags unprefixed (--lr, not --update.lr), filled with the recipe's values
    named = [(g.__name__.removesuffix("Args").lower(), tyro.conf.OmitArgPrefixes[g]) for g in groups]
    form = dataclasses.make_dataclass(cls.__name__, named, frozen=True, namespace={"__doc__": cls.__doc__})
    filled = form(*(g(**{f.name: getattr(default, f.name) for f in dataclasses.fields(g)}) for g in groups))
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box), _columns_at_most(129):  # tyro's error box (--help goes to stdout)
            parsed = tyro.cli(form, default=filled, args=argv)
    except SystemExit as e:
        if not e.code:
            raise
        raise ValueError(f"{_one_line(box.getvalue())} (`--help` lists every flag)") from None
    return cls(**{k: v for part in vars(parsed).values() for k, v in vars(part).items()})


@contextlib.contextmanager
def _columns_at_most(n: int):
    """The terminal's width as tyro reads it (shutil: $COLUMNS first), at most `n` inside. From 130 columns on, tyro
    sets --help's sections side by side, placed by height; at most 129 keeps them one under the other, in Args'
    order."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(min(shutil.get_terminal_size().columns, n))
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def _one_line(box: str) -> str:
    """tyro's error box (a typo'd flag, a bad value: 9 to 16 lines) as one line: its message and the flags it
    suggests, without the border, the rules, the suggestions' help text or the pointer to --help."""
    kept, keep = [], "all"  # the first section whole; of a "Perhaps you meant" one, its flags (indented 4)
    for line in box.splitlines()[1:-1]:  # the borders' first and last lines go
        text = re.sub(r"^\s*│ ?|\s*│\s*$", "", line)
        if set(text.strip()) <= {"─"}:
            keep = "next"
            continue
        if keep == "next":
            keep = "flags" if text.startswith("Perhaps") else "none"
        if keep == "all" or (keep == "flags" and len(text) - len(text.lstrip()) <= 4):
            kept.append(text.strip())
    return " ".join(" ".join(kept).split()) or box.strip()[-300:]


def _last_value(argv: list[str], flag: str) -> str | None:
    """The value of the last `flag VALUE` or `flag=VALUE` in argv."""
    values = [a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
              if a.split("=")[0] == flag and ("=" in a or i + 1 < len(argv))]
    return values[-1] if values else None
