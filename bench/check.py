"""bench/check.py: the GPU tier in one command, for a GPU machine at hand for minutes (`bash run.sh gpu-check OUT`).
    python -m bench.check OUT              # one CUDA GPU: every GPU row and test, at most 9 minutes in all
    python -m bench.check OUT --dry-run    # the same steps at toy size on the CPU (tests/test_bench.py)
    python -m bench.check OUT --more       # the second command: the steps that the first's 9 minutes leave out

Each step runs under its own bound, the most important first: the recipe end to end (the micro-batch fitted to the
device, the recipe's own, the update on the rollout's kept forwards, transformer forwards against diffusers' bare ones,
last the allocator held to 60 GiB), Qwen-Image 2.1's one-GPU recipe at the fitted micro-batch, the GPU tests
(tests/test_gpu.py, the Wan2.1 recipe at its real width among them), the --sp 2 rows, --compile's forwards. The second
command (--more, 10 minutes) takes what those 9 leave out: --merged-lora's and --fp8-rollout's rows, Z-Image's and
FLUX.2 [klein]'s recipes, Qwen-Image 2.1's at its own micro-batch, the update against plain PyTorch at the real width,
parameter offload. A step's output goes to OUT/<step>.log as it comes, and OUT/summary.md gains its verdict and table
rows as it ends, so a check cut short keeps everything measured until then. The summary closes with the steps that
passed; the exit status is 0 only if all did.
"""
import argparse
import ast
import os
import platform
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
GPU_BENCH = [PY, "-m", "bench.gpu"]  # from ROOT, as every step runs
GPU = [*GPU_BENCH, "--device", "cuda", "--model", "qwen-image"]
TOY = [*GPU_BENCH, "--model", "tiny", "--quick"]


def family(name: str, rows: str, gpu_extra=()) -> tuple[list[str], list[str]]:
    """A 2026 family's recipe on its real architecture (bench/families.py): the GPU command and its dry run's."""
    return ([*GPU_BENCH, "--device", "cuda", "--model", name, "--random-init", "--rows", rows, *gpu_extra],
            [*GPU_BENCH, "--model", f"tiny-{name}", "--quick", "--random-init", "--rows", rows])


SUMMARY = "OUT/summary.md"  # OUT: the folder named on the command line
# -v -s: each test's verdict and what it prints (the Wan2.1 recipe's rows) reach the log as they come, not at the end
TESTS = [PY, "-m", "pytest", "-v", "-s", "-n", "0", "-p", "no:cacheprovider"]
# tests/test_gpu.py's tests run the most important first, so that a step cut at its bound loses the least (the GPU run
# at 7c2fe69 cut it after 12 of 18, in the file's order, before the Wan2.1 recipe at its real width, the last there)
FIRST_TESTS = ("test_wan_recipe_memory_and_speed_at_the_real_width",
               "test_first_update_is_exactly_on_policy_at_the_recipe_dtypes",
               "test_wan_first_update_is_exactly_on_policy_at_the_recipe_dtypes",
               "test_velocity_takes_sigma_from_the_cpu_to_the_models_device")


def gpu_tests(path: str = "tests/test_gpu.py") -> list[str]:
    """The test functions of `path` as pytest node ids: FIRST_TESTS in their order, then every other one in the file's
    (pytest runs node ids in the order given)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    if set(FIRST_TESTS) - set(names):
        raise SystemExit(f"bench/check.py: FIRST_TESTS names {sorted(set(FIRST_TESTS) - set(names))}, not in {path}")
    first = {name: i for i, name in enumerate(FIRST_TESTS)}
    return [f"{path}::{name}" for name in sorted(names, key=lambda name: first.get(name, len(first)))]


# (name, what it shows, the GPU command, the dry run's, bound in seconds): the bounds sum to 9 minutes. Qwen-Image 2.1
# (the first of the 2026 families on one GPU) took its 70 s from plain and offload, which no check has yet run to their
# end within their bounds (BENCHMARKS.md): they moved, bounds and all, to MORE rather than every bound being cut. The
# recipe held to 60 GiB was a step of its own (55 s), which would have built the model and warmed up again: ~80 s by
# the H200's figures (an iteration at a micro-batch of 8 near 28 s, two of them); it is the recipe step's last row,
# one iteration in a warm process (~40 s), and its bound the recipe step's
STEPS = [
    ("recipe", "Qwen-Image's public recipe end to end, random weights at the real width, last held to 60 GiB",
     [*GPU, "--random-init", "--rows", "fitted,recipe,reuse,floor,held", "--repeats", "1"],
     [*TOY, "--random-init", "--rows", "fitted,recipe,reuse,floor,held"], 235),
    ("qwen21", "Qwen-Image 2.1's one-GPU recipe at the fitted micro-batch, random weights at the real width (7.1 B)",
     *family("qwen-image-2.1", "fitted", ["--repeats", "1"]), 70),
    ("tests", "tests/test_gpu.py, the Wan2.1 recipe at its real width and the first updates on CUDA first",
     [*TESTS, *gpu_tests()], [*TESTS, *gpu_tests(), "-k", "sigma and tiny-sd3"], 140),
    # (without --profile: the run at 7c2fe69 profiled the split, host-bound at this size, BENCHMARKS.md; two more
    # steps under the profiler, one a side, and their tables are time the rows need)
    ("sp", "--sp 2 ÷ --sp 1 at 1024² (768² on an 80-GB GPU), one GPU standing for rank 0 of 2",
     [*GPU, "--sp", "2", "--repeats", "2"], [*TOY, "--sp", "2"], 50),
    ("compiled", "--compile: the loop's forwards compiled, dynamo's graphs and breaks",
     [*GPU, "--random-init", "--rows", "compiled", "--repeats", "2"],
     [*TOY, "--random-init", "--rows", "compiled", "--compile-backend", "aot_eager"], 45),
]
# the second command (--more), 10 minutes: the speed options' rows first (--merged-lora, --fp8-rollout: the way to the
# goal of 1 image/s), the other families (bench/families.py), the two steps moved out of STEPS. A lent machine's call of 10
# minutes, start-up included, may cut the last step (offload): what it measured until then stays in OUT
MORE = [
    ("merged", "--merged-lora: the adapter in each bf16 weight, its forwards and the recipe at the fitted micro-batch",
     [*GPU, "--random-init", "--rows", "merged", "--repeats", "1"], [*TOY, "--random-init", "--rows", "merged"], 85),
    ("fp8", "--fp8-rollout (with --stale-correction decoupled): the rollout's frozen linear layers in float8, its "
     "forwards and the recipe at the fitted micro-batch", [*GPU, "--random-init", "--rows", "fp8", "--repeats", "1"],
     [*TOY, "--random-init", "--rows", "fp8"], 85),
    ("z-image", "Z-Image's recipe (Flow-Factory's), random weights at the real width (6.2 B), fitted and its own "
     "micro-batch", *family("z-image", "fitted,recipe", ["--repeats", "1"]), 150),
    ("flux2-klein", "FLUX.2 [klein] 9B's recipe (Flow-Factory's), random weights at the real width (9.1 B), fitted and "
     "its own micro-batch", *family("flux.2-klein", "fitted,recipe", ["--repeats", "1"]), 150),
    ("qwen21-recipe", "Qwen-Image 2.1's one-GPU recipe at its own micro-batch (4)",
     *family("qwen-image-2.1", "recipe", ["--repeats", "1"]), 60),
    ("plain", "the update ÷ plain PyTorch's, 4 of 60 blocks at the real width, fp32",
     [*GPU_BENCH, "--device", "cuda", "--plain", "--repeats", "2"], [*GPU_BENCH, "--plain", "--quick"],
     35),
    ("offload", "parameter offload, one micro-batch", [*GPU, "--random-init", "--rows", "offload"],
     [*TOY, "--random-init", "--rows", "offload"], 35),
]


def header(dry: bool, more: bool = False) -> str:
    """What the figures were measured on: date, machine, revision, versions."""
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True) if not dry else None
    packages = []
    for name in ("torch", "diffusers", "transformers", "peft"):
        try:
            packages.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            packages.append(f"{name} missing")
    rev = os.environ.get("FLOWGRPO_REV") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                           capture_output=True, text=True).stdout.strip() or "?"
    machine = smi.stdout.strip() if smi and smi.returncode == 0 else "CPU (dry run)" if dry else "no nvidia-smi"
    return (f"# GPU check{' (--more)' if more else ''}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\nrevision {rev}; "
            f"{machine}; Python {platform.python_version()}; {', '.join(packages)}\n")


def run_step(name: str, argv: list[str], bound: float, log_path: str) -> tuple[str, float]:
    """`argv` in its own process group, its output to `log_path` as it comes; killed, group and all, at `bound`."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            code = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"cut at its bound of {bound:.0f} s", time.perf_counter() - start
    return ("passed" if code == 0 else f"failed (exit {code})"), time.perf_counter() - start


def report(log_path: str) -> str:
    """A step's table rows (bench/gpu.py's), a test run's outcome lines, or its last lines."""
    text = open(log_path, errors="replace").read()
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| measurement")]
    outcome, node = [], None
    for line in text.splitlines():  # pytest -v -s: a test's node id, what it prints, then its verdict
        if re.match(r"\S+::\S+", line):
            node, _, line = line.partition(" ")
        verdict = re.match(r"(PASSED|FAILED|ERROR|SKIPPED)\b", line)
        if node and verdict:
            outcome.append(f"- {node}: {verdict[1]}")
            node = None
        elif re.match(r"(FAILED|ERROR) ", line) or re.search(r"\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s",
                                                             line):  # the short summary's failures, the closing count
            outcome.append(line)
    if node:  # a test without a verdict: the one running when the bound cut the step
        outcome.append(f"- {node}: running when the step ended")
    rows = (["| measurement | median | min | max | unit | target / expected | note |", "|---" * 7 + "|"] + rows
            if rows else [])
    return "\n".join(rows + outcome) or "last lines:\n```\n" + "\n".join(text.splitlines()[-12:]) + "\n```"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the folder OUT for OUT/<step>.log and OUT/summary.md (made; those files replaced)")
    p.add_argument("--dry-run", action="store_true", help="every step at toy size on the CPU")
    p.add_argument("--more", action="store_true", help="the second command's steps (MORE) instead of the first's")
    p.add_argument("--only", help="comma-separated step names (default: all, in order)")
    o = p.parse_args(argv)
    table = MORE if o.more else STEPS
    steps = [s for s in table if not o.only or s[0] in o.only.split(",")]
    unknown = set(o.only.split(",") if o.only else ()) - {s[0] for s in table}
    if unknown:
        p.error(f"--only: no step {sorted(unknown)}; the steps{' of --more' if o.more else ''}: "
                f"{', '.join(s[0] for s in table)}")
    os.makedirs(o.out, exist_ok=True)
    summary = os.path.join(o.out, os.path.basename(SUMMARY))
    with open(summary, "w") as f:
        f.write(header(o.dry_run, o.more))
    verdicts = []
    for name, what, gpu, dry, bound in steps:
        log = os.path.join(o.out, f"{name}.log")
        verdict, seconds = run_step(name, dry if o.dry_run else gpu, 600 if o.dry_run else bound, log)
        verdicts.append((name, verdict))
        with open(summary, "a") as f:
            f.write(f"\n## {name}: {verdict} in {seconds:.0f} s\n{what}; `{' '.join(dry if o.dry_run else gpu)}`\n\n"
                    f"{report(log)}\n")
        print(f"{name}: {verdict} in {seconds:.0f} s", flush=True)
    passed = [n for n, v in verdicts if v == "passed"]
    with open(summary, "a") as f:
        f.write(f"\n## {len(passed)} of {len(verdicts)} steps passed\n" + "".join(
            f"- {n}: {v}\n" for n, v in verdicts))
    print(f"{len(passed)} of {len(verdicts)} steps passed; {summary}")
    return 0 if len(passed) == len(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
