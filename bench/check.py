"""bench/check.py: the GPU tier in one command, for a GPU machine at hand for minutes (`bash run.sh gpu-check OUT`).
    python -m bench.check OUT              # one CUDA GPU: every GPU row and test, at most 9 minutes in all
    python -m bench.check OUT --dry-run    # the same steps at toy size on the CPU (tests/test_bench.py)
    python -m bench.check OUT --more       # the speed options end to end, offload, --plain: 10 minutes
    python -m bench.check OUT --families   # the 2026 families' recipes: 6 minutes

Each step runs under its own bound, the most important first: the recipe end to end (the micro-batch fitted to the
device, the recipe's own, the update on the rollout's kept forwards, transformer forwards against diffusers' bare ones,
last the allocator held to 60 GiB), Qwen-Image 2.1's one-GPU recipe at the fitted micro-batch, the GPU tests
(tests/test_gpu.py, the Wan2.1 recipe at its real width among them), the --sp 2 rows, --compile's forwards. --more:
the speed options end to end (--compile, --fp8-rollout compiled, --merged-lora), --plain, offload; --families: Z-Image,
FLUX.2 [klein], Qwen-Image 2.1 at its own micro-batch. A step's output goes to OUT/<step>.log as it comes, and
OUT/summary.md gains its verdict and table rows as it ends, so a check cut short keeps what it measured. The summary
closes with the steps that passed; the exit status is 0 only if all did.
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
# tests/test_gpu.py's most important first: a step cut at its bound loses the least (7c2fe69's lost its Wan2.1 test)
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


# (name, what it shows, the GPU command, the dry run's, bound in seconds): the bounds sum to 9 minutes, set from the
# first check that ran through, on an H100 (2026-12-06: recipe 202 s, qwen21 47, tests 115, sp 42; compiled cut at
# its 45 after its last row), each with a margin, compiled's from what the others leave (BENCHMARKS.md)
STEPS = [
    ("recipe", "Qwen-Image's public recipe end to end, random weights at the real width, last held to 60 GiB",
     [*GPU, "--random-init", "--rows", "fitted,recipe,reuse,floor,held", "--repeats", "1"],
     [*TOY, "--random-init", "--rows", "fitted,recipe,reuse,floor,held"], 230),
    ("qwen21", "Qwen-Image 2.1's one-GPU recipe at the fitted micro-batch, random weights at the real width (7.1 B)",
     *family("qwen-image-2.1", "fitted", ["--repeats", "1"]), 55),
    ("tests", "tests/test_gpu.py, the Wan2.1 recipe at its real width and the first updates on CUDA first",
     [*TESTS, *gpu_tests()], [*TESTS, *gpu_tests(), "-k", "sigma and tiny-sd3"], 125),
    ("sp", "--sp 2 ÷ --sp 1 at 1024² (768² on an 80-GB GPU), one GPU standing for rank 0 of 2",
     [*GPU, "--sp", "2", "--repeats", "2"], [*TOY, "--sp", "2"], 50),
    ("compiled", "--compile: the loop's forwards compiled, dynamo's graphs and breaks",
     [*GPU, "--random-init", "--rows", "compiled", "--repeats", "2"],
     [*TOY, "--random-init", "--rows", "compiled", "--compile-backend", "aot_eager"], 80),
]
# --more (10 minutes), the way to 1 image/s first: on the H100 (2026-12-06) --compile's forwards took 0.85 x the bare
# ones, --fp8-rollout's in eager 1.2-2.4 x the loop's: compiled and profiled here. Bounds estimated (a fit, two
# iterations of ~20 s, graphs compiled; offload's 40 GB a call over PCIe): none of these steps has run to its end
MORE = [
    ("compiled-recipe", "--compile end to end: the recipe at the micro-batch fitted with the loop's blocks compiled",
     [*GPU, "--random-init", "--rows", "fitted", "--compile", "--repeats", "1"],
     [*TOY, "--random-init", "--rows", "fitted", "--compile", "--compile-backend", "aot_eager"], 150),
    ("fp8", "--fp8-rollout compiled, --stale-correction decoupled: its forwards, the recipe at the fitted micro-batch",
     [*GPU, "--random-init", "--rows", "fp8", "--compile", "--profile", "--repeats", "1"],
     [*TOY, "--random-init", "--rows", "fp8", "--profile"], 170),  # dry: eager (compiled-recipe compiles; 30 s less)
    ("merged", "--merged-lora: the adapter in each bf16 weight, its forwards and the recipe at the fitted micro-batch",
     [*GPU, "--random-init", "--rows", "merged", "--repeats", "1"], [*TOY, "--random-init", "--rows", "merged"], 110),
    ("plain", "the update ÷ plain PyTorch's, 4 of 60 blocks at the real width, fp32",
     [*GPU_BENCH, "--device", "cuda", "--plain", "--repeats", "2"], [*GPU_BENCH, "--plain", "--quick"], 45),
    ("offload", "parameter offload, one micro-batch", [*GPU, "--random-init", "--rows", "offload"],
     [*TOY, "--random-init", "--rows", "offload"], 100),
]
# --families (6 minutes): the 2026 families' recipes on their real architectures (bench/families.py); bounds estimated
FAMILIES = [
    ("z-image", "Z-Image's recipe (Flow-Factory's), random weights at the real width (6.2 B), fitted and its own "
     "micro-batch", *family("z-image", "fitted,recipe", ["--repeats", "1"]), 150),
    ("flux2-klein", "FLUX.2 [klein] 9B's recipe (Flow-Factory's), random weights at the real width (9.1 B), fitted and "
     "its own micro-batch", *family("flux.2-klein", "fitted,recipe", ["--repeats", "1"]), 150),
    ("qwen21-recipe", "Qwen-Image 2.1's one-GPU recipe at its own micro-batch (4)",
     *family("qwen-image-2.1", "recipe", ["--repeats", "1"]), 60),
]


def header(dry: bool, which: str = "") -> str:
    """What the figures were measured on: date, machine, revision, versions."""
    smi = subprocess.run("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader", shell=True,
                         capture_output=True, text=True) if not dry else None  # (a shell: a command missing, 127)
    packages = []
    for name in ("torch", "diffusers", "transformers", "peft"):
        try:
            packages.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            packages.append(f"{name} missing")
    rev = os.environ.get("FLOWGRPO_REV") or subprocess.run("git rev-parse --short HEAD", shell=True, cwd=ROOT,
                                                           capture_output=True, text=True).stdout.strip() or "?"
    machine = smi.stdout.strip() if smi and smi.returncode == 0 else "CPU (dry run)" if dry else "no nvidia-smi"
    return (f"# GPU check{f' ({which})' if which else ''}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n\nrevision {rev}; "
            f"{machine}; Python {platform.python_version()}; {', '.join(packages)}\n")


def run_step(name: str, argv: list[str], bound: float, log_path: str) -> tuple[str, float]:
    """`argv` in its own process group, its output to `log_path` as it comes; killed, group and all, at `bound`."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, process_group=0,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))  # the check's session: ended with it
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
    g = p.add_mutually_exclusive_group()
    g.add_argument("--more", action="store_true", help="the speed options' steps (MORE) instead of the first's")
    g.add_argument("--families", action="store_true", help="the 2026 families' steps (FAMILIES) instead")
    p.add_argument("--only", help="comma-separated step names (default: all, in order)")
    o = p.parse_args(argv)
    which = "--more" if o.more else "--families" if o.families else ""
    table = {"--more": MORE, "--families": FAMILIES, "": STEPS}[which]
    steps = [s for s in table if not o.only or s[0] in o.only.split(",")]
    unknown = set(o.only.split(",") if o.only else ()) - {s[0] for s in table}
    if unknown:
        p.error(f"--only: no step {sorted(unknown)}; the steps{f' of {which}' if which else ''}: "
                f"{', '.join(s[0] for s in table)}")
    os.makedirs(o.out, exist_ok=True)
    summary = os.path.join(o.out, os.path.basename(SUMMARY))
    with open(summary, "w") as f:
        f.write(header(o.dry_run, which))
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
