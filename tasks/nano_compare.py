"""Every RL method of this repository on a laptop task: the same runs, seeds and compute, one table and one picture.

    python -m tasks.nano_compare [--task nano] [--seeds 5] [--jobs 2] [--markdown FILE]   # BENCHMARKS.md's tables

Each method of METHODS runs `flowgrpo.py --model TASK FLAGS --seed S` (one torch thread) into <out>/<method>-seed<S>;
then each run's judge curve (the loop's evaluations on held-out seeds) is read at the smallest compute every run
reached — rollout passes, all transformer passes, CPU seconds — and each run's final LoRA is evaluated by the task's
own evaluation on its held-out seeds, the same images as the base model's (paired). A task is a module (`nano`, …)
that names its `MODEL`, its `JUDGE` (a reward label logged at weight 0), its `CATEGORIES` (GenEval-style, or none)
and gives `load`, `evaluate`, `grid` (docs/algorithm.md §15).

The comparison owns its --out directory while it runs (a lock, as a run owns its run directory): a second comparison
into it is refused, a run directory another process holds is never touched, and a finished run is reused only if it
was made with the same flags (its args.json), so an interrupted or extended comparison continues and nothing else
is silently mixed in.
"""
import argparse
import dataclasses
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import cli
import flowgrpo
import models
import prompts as prompt_sets
import recipes
import rundir
import startup
from tasks import nano, nano_compose, nano_edit

TASKS = {"nano": nano, "nano-compose": nano_compose, "nano-edit": nano_edit}  # --task: a module per laptop task
METHODS = {  # name -> flowgrpo.py flags on top of the task's recipe; a later algorithm is one more row
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
    "Flow-DPPO (mask 1e-5)": ("--trust-region", "dppo"),  # UniRL's threshold, untuned; full mode as the recipe's rows
    # the forward-process algorithms (docs/algorithm.md §12) on their public samplers and old-policy schedules, scaled to
    # 10 steps: DiffusionNFT's sd3_pickscore (9 trained steps, beta 1), AWM's 6 strata (of [0, 9) here, [0, 12) of 14)
    "DiffusionNFT": ("--algorithm", "nft", "--ode-solver", "dpm2-full", "--nft-beta", "1", "--old-decay", "nft1",
                     "--train-timesteps", "9", "--train-timestep-range", "0", "10"),
    "AWM": ("--algorithm", "awm", "--ode-solver", "dpm2-full", "--old-decay", "awm", "--old-kl", "1",
            "--train-timesteps", "6", "--train-timestep-range", "0", "9"),
    # DGPO's general_ocr_sd3_4gpu at 10 steps as its own: 4 shared timesteps of [0, 7), β 100, clip 1e-2, KL 0.02, its
    # EMA reference's ramp; its switch to sampling with that reference (after 200 steps) lies beyond these runs
    "DGPO": ("--algorithm", "dgpo", "--ode-solver", "dpm2-full", "--old-decay", "dgpo", "--dgpo-beta", "100",
             "--clip-range", "1e-2", "--kl-beta", "0.02", "--train-timesteps", "4", "--train-timestep-range", "0", "7"),
    # flow_grpo's online DPO (train_sd3_dpo.py): each group's best and worst, β 100, int(10·0.99) = 9 timesteps, its
    # reference (the sampler) copied every 40 optimizer steps as its OnlineDPO note suggests (20 iterations of 2 steps)
    "Online DPO": ("--algorithm", "dpo", "--dpo-beta", "100", "--train-timesteps", "9", "--old-every", "20"),
    # its public configs' ref_update_step (10,000,000): the reference, which samples, stays the base model
    "DPO, reference never copied": ("--algorithm", "dpo", "--dpo-beta", "100", "--train-timesteps", "9", "--old-every",
                                    "10000000"),
    # the regularisers against reward hacking (docs/algorithm.md §17): NormGuard's hinge at its chosen λ 1, margin 0;
    # GARDO with the public KL β 0.04 and threshold 3e-4, the task's proxies (other readers of the reward's features)
    "Flow-GRPO + NormGuard": ("--normguard", "1"),
    "GARDO": lambda task: ("--algorithm", "gardo", "--reward", recipes.RECIPES[task.MODEL]["reward"] + "".join(
        f",{p}=0" for p in proxies(task)), "--gardo-proxies", *proxies(task), "--kl-beta", "0.04"),
}
METHODS |= {f"{name} + NormGuard": (*METHODS[name], "--normguard", "1")  # NormGuard on every velocity-local method
            for name in ("DiffusionNFT", "AWM", "DGPO", "Online DPO")}
# NormGuard's λ per method: λ 1 ends the norm ratio below 1 on nano (0.89 Flow-GRPO) at a cost in judge points, but
# leaves online DPO's at 1.07 (its gradient norms are hundreds of times AWM's): lower λ for the others, 10 for DPO
METHODS |= {f"{name} + NormGuard λ {lam}": (*METHODS[base], "--normguard", lam) for name, base, lam in
            (("Flow-GRPO", "Flow-GRPO, full mode", "0.1"), ("DiffusionNFT", "DiffusionNFT", "0.1"),
             ("Flow-GRPO", "Flow-GRPO, full mode", "0.01"), ("DiffusionNFT", "DiffusionNFT", "0.01"),
             ("AWM", "AWM", "0.1"), ("DGPO", "DGPO", "0.1"), ("Online DPO", "Online DPO", "10"),
             # Fast: its norm swung to 1.4 on nano-compose; λ 0.1 overshot (0.82) without stopping its collapse
             ("Flow-GRPO-Fast", "Flow-GRPO-Fast (--branch)", "0.1"),
             ("Flow-GRPO-Fast", "Flow-GRPO-Fast (--branch)", "0.01"),
             ("Flow-DPPO", "Flow-DPPO (mask 1e-5)", "0.01"))}  # Flow-GRPO's loss: its λ that held the ratio near 1
# GARDO's gate, KL and resets on Flow-GRPO-Fast's sampler, which collapsed on nano-compose at 2× the recipe
METHODS["GARDO on Flow-GRPO-Fast"] = lambda task: (*METHODS["GARDO"](task), *METHODS["Flow-GRPO-Fast (--branch)"])
# and a KL to the base model alone on Fast's sampler (GARDO's β, no gate, no resets): a pull GARDO's resets do not keep
METHODS["Flow-GRPO-Fast + KL 0.04"] = (*METHODS["Flow-GRPO-Fast (--branch)"], *METHODS["full mode + KL 0.04"])
# a margin: the hinge acts only above 1.05, where λ 0.1 alone ended the ratio at 0.97 (DiffusionNFT), 0.95 (AWM)
METHODS |= {f"{name} + NormGuard λ 0.1, margin 0.05": (*METHODS[name], "--normguard", "0.1", "--normguard-margin",
                                                       "0.05") for name in ("DiffusionNFT", "AWM")}
AXES = {"rollout_passes": "rollout transformer passes", "passes": "transformer passes (rollout + training)",
        "seconds": "CPU seconds of the iterations (all threads)"}  # not wall time: a shared machine's load varies
# args.json's entries that say where and how a run was recorded, not what it computed
UNCOMPARED = {"run_dir", "run_id", "resumes", "batch_arithmetic", "wandb"}


def proxies(task) -> tuple[str, ...]:
    """The task's proxy rewards for GARDO's gate (its module's PROXIES), refused where it has none."""
    if not getattr(task, "PROXIES", ()):
        raise ValueError(f"GARDO on {task.MODEL}: the task has no proxy rewards for its gate (PROXIES in its module): "
                         "compare another method there")
    return task.PROXIES


def flags_of(task, name: str) -> tuple[str, ...]:
    """A method's flowgrpo.py flags on `task`: its row, made for the task where the row is a function of it."""
    return METHODS[name](task) if callable(METHODS[name]) else METHODS[name]


def run_path(out: str, name: str, seed: int) -> str:
    return os.path.join(out, re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") + f"-seed{seed}")


def own_file(path: str, mode: str = "w"):
    """`path` opened for writing, created or emptied, without following a link there (as a run directory's files are
    written): a link planted in --out is refused, its target untouched."""
    try:
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644), mode)
    except OSError as e:
        raise ValueError(f"{path} cannot be written ({e.strerror}: a symbolic link there?): remove it, or give "
                         "another --out") from None


def command(task, flags, seed: int, run_dir: str, iterations: int, eval_every: int, eval_images: int) -> list[str]:
    """flowgrpo.py's arguments for one run of the comparison."""
    return ["--model", task.MODEL, "--seed", str(seed), "--iterations", str(iterations), "--eval-every",
            str(eval_every), "--eval-images", str(eval_images), "--checkpoint-every", "0", "--keep-checkpoints", "1",
            "--no-wandb", "--run-dir", run_dir, *flags]


def made_with_other_flags(run_dir: str, argv: list[str]) -> dict:
    """{flag: [found, wanted]} where the run in run_dir (its args.json) differs from what `argv` asks."""
    wanted = dataclasses.asdict(cli.parse_args(flowgrpo.Args, argv))
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {"args.json": ["missing or unreadable", "present"]}
    # a flag added after the run was made counts as its default (a new flag's default keeps what the code computed)
    defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(flowgrpo.Args)}, default=str))
    found = {**defaults, **found}
    wanted = json.loads(json.dumps(wanted))  # tuples as lists, as args.json holds them
    return {k: [found.get(k), v] for k, v in wanted.items() if k not in UNCOMPARED and found.get(k) != v}


def run_method(task, name: str, flags, seed: int, out: str, iterations: int, eval_every: int,
               eval_images: int) -> str:
    """One run into out/<name>-seed<S>, or the finished one there if it was made with the same flags; an unfinished
    attempt that no process holds is started again. Returns the run directory."""
    run_dir = os.path.abspath(run_path(out, name, seed))  # flowgrpo.py runs in the repository, not in our cwd
    argv = command(task, flags, seed, run_dir, iterations, eval_every, eval_images)
    if os.path.islink(run_dir) or (os.path.exists(run_dir) and not os.path.isdir(run_dir)):
        raise ValueError(f"{run_dir} is not a directory of this comparison (a symbolic link, a file): remove it, or "
                         "give another --out")
    holder = rundir.holder(run_dir)
    if holder:
        raise ValueError(f"{run_dir} is in use by {holder}: let that run end, or give another --out")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if rundir.finished(run_dir):  # a stopped run exports its LoRA too: an unfinished attempt, started again below
        # other flags (another --iterations among them) are refused, never deleted: the run may have cost CPU-hours
        if differs := made_with_other_flags(run_dir, argv):
            raise ValueError(f"{run_dir} holds a finished run made with other flags ({differs}, as [found, wanted]): "
                             "remove it, or give another --out")
        if sum(1 for _ in open(metrics)) == iterations:
            return run_dir
    if os.path.exists(run_dir):  # an unfinished attempt of this comparison (no process holds it): start it again
        shutil.rmtree(run_dir)
    with own_file(run_dir + ".log") as log:  # ours: the comparison holds <out>'s lock
        done = subprocess.run([sys.executable, os.path.join(nano.ROOT, "flowgrpo.py"), *argv], cwd=nano.ROOT,
                              env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode:
        with open(run_dir + ".log", errors="replace") as log:
            said = ([line.strip() for line in log if line.strip()] or ["(nothing)"])[-1][:300]
        raise ValueError(f"the run {run_dir} failed (exit {done.returncode}): {said} (its log: {run_dir}.log)")
    return run_dir


def check_categories(task, eval_images: int) -> None:
    """The loop evaluates the first `eval_images` of its held-out prompts, which come category by category: each
    category's curve (curve below) needs one of them at least."""
    if not task.CATEGORIES:
        return
    held = prompt_sets.load_prompts(recipes.RECIPES[task.MODEL]["prompts"]).eval
    tags = [held[i % len(held)][1].get("tag") for i in range(max(eval_images, len(held)))]
    needed = max(tags.index(c) for c in task.CATEGORIES) + 1
    if eval_images < needed:
        raise ValueError(f"--eval-images {eval_images} evaluates no held-out prompt of "
                         f"{[c for c in task.CATEGORIES if c not in tags[:eval_images]]}: give at least {needed}")


def curve(task, run_dir: str) -> dict:
    """A run's evaluations (the loop's, on its eval seeds) with the cumulative compute spent up to each; per category
    where the task has them (`eval/<judge>/<category>/mean`)."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    spent = {"rollout_passes": [r["perf/rollout_passes"] for r in rows],
             "passes": [r["perf/rollout_passes"] + r["perf/train_passes"] for r in rows],
             "seconds": [r["perf/cpu_s"] for r in rows]}
    at = [i for i, r in enumerate(rows) if f"eval/{task.JUDGE}/mean" in r]
    judged = {c: np.array([rows[i][f"eval/{task.JUDGE}/{c}/mean"] for i in at]) for c in task.CATEGORIES}
    overall = np.mean(list(judged.values()), 0) if judged else np.array([rows[i][f"eval/{task.JUDGE}/mean"] for i in at])
    read = {k: np.array([rows[i].get(f"eval/{k}", np.nan) for i in at])  # the reward on the eval images, and the rest
            for k in ("reward_mean", "diversity", "velocity_norm_ratio")}
    return {k: np.cumsum(v)[at] for k, v in spent.items()} | {
        "judge": overall, "categories": judged,  # with categories, their mean (GenEval's overall)
        "iterations": np.array([rows[i].get("iteration", i) for i in at]), **read,  # (a row made by hand: its index)
        "per_iteration": {k: float(np.mean(v)) for k, v in spent.items()}}


def hacking_table(runs: dict) -> list[str]:
    """Reward hacking, read from each run's evaluations: where the reward (on the eval images) peaks, the judge and the
    diversity there and at the end, the judge's own peak, and the velocity-norm ratio at the end; mean ± std over
    seeds. A judge that falls from its peak while the reward holds or rises is hacking."""
    lines = ["| method | runs | reward peak (iteration) | judge @ reward peak | judge peak | final reward | final judge | "
             "judge: final − peak | diversity @ reward peak | final diversity | final ‖v_θ‖/‖v_ref‖ |", "|---" * 11 + "|"]
    for name, cs in runs.items():
        peak = [int(np.argmax(c["reward_mean"])) for c in cs]

        def at(key, where):
            return [c[key][i] for c, i in zip(cs, where)]
        last = [-1] * len(cs)
        drop = [c["judge"][-1] - c["judge"].max() for c in cs]
        lines.append(f"| {name} | {len(cs)} | {pm(at('reward_mean', peak), '{:.3f}')} "
                     f"({', '.join(str(c['iterations'][i]) for c, i in zip(cs, peak))}) | {pm(at('judge', peak))} | "
                     f"{pm([c['judge'].max() for c in cs])} | {pm(at('reward_mean', last), '{:.3f}')} | "
                     f"{pm(at('judge', last))} | {pm(drop)} | {pm(at('diversity', peak), '{:.4f}')} | "
                     f"{pm(at('diversity', last), '{:.4f}')} | {pm(at('velocity_norm_ratio', last), '{:.3f}')} |")
    return lines


def plot_hacking(path: str, runs: dict) -> None:
    """The reward, the judge, the diversity and the velocity-norm ratio on the eval images against transformer passes,
    one line per method (the mean over seeds on a common grid, ± one std shaded)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = {"reward_mean": "reward (eval images)", "judge": "held-out judge", "diversity": "diversity (pixel std)",
            "velocity_norm_ratio": "‖v_θ‖ / ‖v_ref‖"}
    lines = -(-len(runs) // 3)  # the legend below the panels, three methods a line (inside a panel it hid a curve)
    fig, axes = plt.subplots(1, 4, figsize=(18, 4 + 0.3 * lines), dpi=100)
    for ax, (key, label) in zip(axes, keys.items()):
        for i, (name, cs) in enumerate(runs.items()):
            grid_x = np.linspace(max(c["passes"][0] for c in cs), min(c["passes"][-1] for c in cs), 50)
            ys = np.array([np.interp(grid_x, c["passes"], c[key]) for c in cs])
            ax.plot(grid_x, ys.mean(0), **line_style(i), lw=1.6, label=f"{name} ({len(cs)})")
            ax.fill_between(grid_x, ys.mean(0) - ys.std(0), ys.mean(0) + ys.std(0), color=line_style(i)["color"],
                            alpha=0.1)
        if all(np.isnan(c[key]).all() for cs in runs.values() for c in cs):
            ax.text(0.5, 0.5, "not logged by this task's evaluations", ha="center", transform=ax.transAxes)
            ax.set(xticks=[], yticks=[])
        ax.set(xlabel=AXES["passes"], title=label)
        ax.xaxis.set_major_formatter(lambda x, _: f"{x / 1000:.0f}k")  # full numbers run into each other
        ax.grid(alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, (0.3 * lines + 0.1) / (4 + 0.3 * lines), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def line_style(i: int) -> dict:
    """Method i's curve: ten colours, a dash per ten methods: no two of METHODS' rows (up to 40) look alike."""
    return {"color": f"C{i % 10}", "ls": ("-", "--", ":", "-.")[i // 10 % 4]}


def pm(values, fmt="{:.1%}") -> str:
    if np.isnan(np.asarray(values, dtype=float)).all():  # not logged (nano-compose's evaluations: no diversity)
        return "—"
    return f"{fmt.format(np.mean(values))} ± {fmt.format(np.std(values))}"


def table(task, methods: dict, measured: dict) -> list[str]:
    """The markdown table: per method, its cost per iteration, the judge at equal compute on each axis and at the end;
    with categories, a second table of each category at equal transformer passes and at the end (GenEval's columns)."""
    base, budget, runs = measured["base"], measured["budget"], measured["runs"]
    lines = [f"| method | flags | rollout / training passes per iteration | CPU s per iteration | judge @ "
             f"{budget['rollout_passes']:,.0f} rollout passes | judge @ {budget['passes']:,.0f} passes | judge @ "
             f"{budget['seconds']:.0f} CPU s | final judge | final reward | final diversity |", "|---" * 10 + "|",
             f"| base model | | | | {base['judge_accuracy']:.1%} | {base['judge_accuracy']:.1%} | "
             f"{base['judge_accuracy']:.1%} | {base['judge_accuracy']:.1%} | {base['reward_mean']:.3f} | "
             f"{'—' if np.isnan(base['diversity']) else format(base['diversity'], '.3f')} |"]
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
    if not task.CATEGORIES:
        return lines
    cats = task.CATEGORIES
    lines += ["", f"| method | when | {' | '.join(cats)} | overall |", "|---" * (len(cats) + 3) + "|",
              f"| base model | | {' | '.join(f'{base[c]:.1%}' for c in cats)} | {base['judge_accuracy']:.1%} |"]
    for name, cs in runs.items():
        at = [pm([np.interp(budget["passes"], c["passes"], c["categories"][k]) for c in cs]) for k in cats]
        overall = pm([np.interp(budget["passes"], c["passes"], c["judge"]) for c in cs])
        lines.append(f"| {name} | @ {budget['passes']:,.0f} passes | {' | '.join(at)} | {overall} |")
        lines.append(f"| {name} | final | {' | '.join(pm([c['final'][k] for c in cs]) for k in cats)} | "
                     f"{pm([c['final']['judge_accuracy'] for c in cs])} |")
    return lines


def check_base(task, out: str) -> None:
    """<out>/base.json: the digest of the base's files (the task's default directory, which every run and evaluation
    loads), written by the first comparison into `out`; a later one on another base (`pretrain` rewrites it in place)
    is refused: the runs and final evaluations it would reuse were made on the other."""
    base, digest = models.adapter_class(task.MODEL).default_path, hashlib.sha256()
    for part in ("vae", "transformer"):
        for name in sorted(os.listdir(os.path.join(base, part))):
            with open(os.path.join(base, part, name), "rb") as f:
                digest.update(name.encode() + f.read())
    path, found = os.path.join(out, "base.json"), digest.hexdigest()
    if os.path.isfile(path):  # written by an earlier comparison: the base its runs were made on
        with open(path) as f:
            known = str(json.load(f).get("sha256"))
        if known != found:
            raise ValueError(f"{out} holds runs made on another base ({base}: sha256 {known[:12]}, now "
                             f"{found[:12]}): give another --out, or remove it")
        return
    with own_file(path) as f:
        json.dump({"base": base, "sha256": found}, f)


def final_evaluation(task, run_dir: str, per_prompt: int) -> dict:
    """The task's evaluation of a run's final LoRA, kept in <run_dir>/final-<per_prompt>.json (written whole, then
    renamed) so that a comparison run again, or interrupted here, reads it rather than sampling it again."""
    path = os.path.join(run_dir, f"final-{per_prompt}.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    final = task.evaluate(task.load(lora=os.path.join(run_dir, "lora")), per_prompt)
    with own_file(path + ".tmp") as f:
        json.dump(final, f, default=float)
    os.replace(path + ".tmp", path)
    return final


def compare(task, out: str, seeds: int, iterations: int, eval_every: int, eval_images: int, methods: dict, jobs: int,
            per_prompt: int) -> dict:
    """Every method × seed, then each run's curve and final evaluation, the base model's, and the equal-compute budget
    (the smallest total any run reached on each axis)."""
    from concurrent.futures import ThreadPoolExecutor
    todo = [(name, flags, seed) for seed in range(seeds) for name, flags in methods.items()]
    with ThreadPoolExecutor(jobs) as pool:
        dirs = list(tqdm(pool.map(lambda job: run_method(task, *job, out, iterations, eval_every, eval_images), todo),
                         total=len(todo), desc="compare", unit="run"))
    runs = {name: [] for name in methods}
    for (name, _, _), run_dir in tqdm(list(zip(todo, dirs)), desc="final evaluations", unit="run"):
        runs[name].append(curve(task, run_dir) | {"final": final_evaluation(task, run_dir, per_prompt)})
    budget = {axis: min(c[axis][-1] for cs in runs.values() for c in cs) for axis in AXES}
    return {"base": task.evaluate(task.load(), per_prompt), "budget": budget, "runs": runs}


def plot(path: str, measured: dict) -> None:
    """Judge accuracy (the loop's evaluations) against transformer passes and against CPU seconds, one line per method:
    the mean over seeds on a common grid, ± one std shaded (clamped to [0, 1]); the base model dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), dpi=100, sharey=True)
    for ax, axis in zip(axes, ("passes", "seconds")):
        for i, (name, cs) in enumerate(measured["runs"].items()):
            grid_x = np.linspace(max(c[axis][0] for c in cs), min(c[axis][-1] for c in cs), 50)
            ys = np.array([np.interp(grid_x, c[axis], c["judge"]) for c in cs])
            ax.plot(grid_x, ys.mean(0), **line_style(i), lw=1.6, label=name)
            ax.fill_between(grid_x, (ys.mean(0) - ys.std(0)).clip(0, 1), (ys.mean(0) + ys.std(0)).clip(0, 1),
                            color=line_style(i)["color"], alpha=0.06)
        ax.axhline(measured["base"]["judge_accuracy"], color="gray", ls=":", label="base model")
        ax.set(xlabel=AXES[axis], title=f"held-out judge accuracy vs {AXES[axis].split(' (')[0]}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"judge accuracy (mean ± std, {len(cs)} seeds)")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_categories(path: str, task, measured: dict) -> None:
    """The final judge per category and overall (GenEval's columns), one bar per method, mean ± std over seeds; the
    base model's as the first, grey bar of each group."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cats, runs = [*task.CATEGORIES, "overall"], measured["runs"]
    key = {c: c for c in task.CATEGORIES} | {"overall": "judge_accuracy"}
    width = 0.8 / (len(runs) + 1)
    fig, ax = plt.subplots(figsize=(13, 4.5), dpi=100)
    ax.bar(np.arange(len(cats)), [measured["base"][key[c]] for c in cats], width, color="0.7", label="base model")
    for i, (name, cs) in enumerate(runs.items(), start=1):
        values = np.array([[c["final"][key[k]] for k in cats] for c in cs])  # (seeds, categories)
        ax.bar(np.arange(len(cats)) + i * width, values.mean(0), width, yerr=values.std(0), color=f"C{i - 1}",
               label=name, capsize=2, error_kw={"elinewidth": 0.8})
    ax.set_xticks(np.arange(len(cats)) + width * len(runs) / 2, cats)
    ax.set(ylabel=f"final judge accuracy (mean ± std, {len(cs)} seeds)", ylim=(0, 1),
           title="held-out judge per category after each method's run")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tasks.nano_compare", description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=list(TASKS), default="nano", help="the laptop task (its --model name)")
    ap.add_argument("--out", help="where the runs go (default: runs/<task>-compare); finished ones are reused")
    ap.add_argument("--seeds", type=int, help="seeds per method (default: the task's SEEDS, else 5)")
    ap.add_argument("--iterations", type=int, help="default: the task's recipe (recipes.py), as each flag below")
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--eval-images", type=int)
    ap.add_argument("--methods", nargs="*", choices=list(METHODS), help="default: the task's COMPARED, else all")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (each one torch thread)")
    ap.add_argument("--per-prompt", type=int, default=50, help="held-out images per prompt of each final evaluation")
    ap.add_argument("--markdown", help="also write the table, with the command, date and machine, to this file")
    ap.add_argument("--plot", help="the curves' PNG (default: assets/<task>/compare.png)")
    ap.add_argument("--hacking", help="also write the reward-hacking table (beside --markdown's) and its curves here")
    a = ap.parse_args(argv)
    task, out = TASKS[a.task], a.out or os.path.join("runs", f"{a.task}-compare")
    a.seeds = getattr(task, "SEEDS", 5) if a.seeds is None else a.seeds  # the defaults: BENCHMARKS.md's tables
    a.methods = list(getattr(task, "COMPARED", METHODS)) if a.methods is None else a.methods
    for flag in ("iterations", "eval_every", "eval_images"):  # the recipe's run: the comparison is its rows
        setattr(a, flag, recipes.RECIPES[task.MODEL][flag] if getattr(a, flag) is None else getattr(a, flag))
    counts = {"seeds": (a.seeds, 100), "iterations": (a.iterations, 10**5), "eval_every": (a.eval_every, 10**5),
              "eval_images": (a.eval_images, 1024), "jobs": (a.jobs, 64), "per_prompt": (a.per_prompt, 10**4)}
    nano.check_numbers(ap, counts)  # what could finish: seeds × methods runs, each a recipe's
    if not a.methods:
        ap.error("--methods: name at least one method")
    plot_path = a.plot or os.path.join(nano.ROOT, "assets", a.task, "compare.png")
    try:
        if os.path.exists(out) and not os.path.isdir(out):
            raise ValueError(f"--out {out} is not a directory")
        for flag, path in (("--plot", plot_path), ("--markdown", a.markdown), ("--hacking", a.hacking)):  # written after every run: checked now
            if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"{flag} {path}: its folder {os.path.dirname(os.path.abspath(path))} does not exist")
        check_categories(task, a.eval_images)
        methods = {m: flags_of(task, m) for m in a.methods}
        for flags in methods.values():  # what flowgrpo.py would refuse, refused before the first run
            startup.check_args(cli.parse_args(flowgrpo.Args, command(task, flags, 0, os.path.join(out, "x"),
                                                                     a.iterations, a.eval_every, a.eval_images)))
        rundir.lock_run_dir(out, not os.path.exists(out))  # this comparison's, until it ends
        check_base(task, out)
        start = time.time()
        measured = compare(task, out, a.seeds, a.iterations, a.eval_every, a.eval_images, methods, a.jobs,
                           a.per_prompt)
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {str(e).replace('--run-dir', '--out')}\n")
    lines = table(task, methods, measured)
    plot(plot_path, measured)
    if task.CATEGORIES:
        plot_categories(plot_path.removesuffix(".png") + "_categories.png", task, measured)
    if a.hacking:  # reward, judge, diversity and velocity-norm ratio over the runs' evaluations (docs/algorithm.md §17)
        plot_hacking(a.hacking, measured["runs"])
        lines += ["", *hacking_table(measured["runs"])]
    with own_file(os.path.join(out, "measured.json")) as f:  # every run's curve and final evaluation
        json.dump(measured, f, indent=1, default=lambda v: v.tolist())
    task.grid(run_path(out, a.methods[0], 0), os.path.join(os.path.dirname(plot_path), "before_after.png"))
    head = (f"`python -m tasks.nano_compare {shlex.join(sys.argv[1:] if argv is None else argv)}`, {time.ctime()}, "
            f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{(time.time() - start) / 60:.0f} min, load {os.getloadavg()[0]:.2f}")
    print(head, *lines, sep="\n")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("\n".join([head, "", *lines, ""]))


if __name__ == "__main__":
    main()
