"""What `--off-policy 1` buys and what it costs: the speed of overlapping rollout and update, and the learning kept.

    .venv/bin/python -m bench.overlap speed [--rounds 3] [--iterations 8] [--server-core 0] [--trainer-core 1]
    .venv/bin/python -m bench.overlap learning [--seeds 3] [--out runs/nano-off-policy]

`speed` times two ways of sampling elsewhere on this machine's two cores: a vLLM-Omni server (omni/serve_tiny.py, its
own venv: omni/setup_env.sh) serving the shipped nano weights on one core while the trainer (`flowgrpo.py --rollout
vllm-omni`) runs on the other; then, the server stopped, torchrun's two ranks on both cores, one sampling
(`--rollout-ranks 1`), one training. Each with TRAIN_FLAGS (and RANK_FLAGS), `--off-policy 0` and `1` in
alternating rounds (the machine's drift falls on both), each a run of its own; per mode the median of
`perf/iteration_s` over every round's iterations after the first two (start-up, the first rollout that nothing
overlaps), and the synchronous run's rollout and update seconds, which bound the gain: at best max(rollout, update) ÷
(rollout + update). `learning`: the nano task's recipe (tasks/nano.py) through the server, both
modes on each seed; each run's final LoRA judged by nano's held-out evaluation (nano_compare.final_evaluation, as the
method comparison does) and the loop's judge curves drawn in one figure.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

import matplotlib

import models_nano
import rundir
from tasks import nano, nano_compare

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The nano recipe with a KL to the base (one more forward per trained step), chosen so that sampling and the update
# take similar time on one core each: through a server in full mode (a server's rollout carries the HTTP and file
# exchange); on a rollout rank, which samples faster, with a window of 4 of the 10 steps trained (RANK_FLAGS).
TRAIN_FLAGS = ("--kl-beta", "0.04", "--eval-every", "0", "--checkpoint-every", "0")
RANK_FLAGS = ("--window", "4")
WARMUP = 2


def serve(model_dir: str, root: str, port: int, core: int, log: str) -> subprocess.Popen:
    """omni/serve_tiny.py on `core`, in a session of its own; returns once GET /health answers."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "omni", "serve_tiny.py"), "serve", model_dir,
                                 "--port", str(port), "--trajectory-root", root], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, {core}),
                                env=os.environ | {"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            if proc.poll() is not None:
                break
        time.sleep(1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"the vLLM-Omni server did not answer /health; its log: {log}")


def train(model_dir: str, run_dir: str, off_policy: int, cores: set, root: str, *flags, ranks: int = 1) -> list:
    """One run of flowgrpo.py (`ranks` > 1: under torchrun) on `cores`; its metrics rows."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    out = subprocess.run([sys.executable, *launch, os.path.join(ROOT, "flowgrpo.py"), "--model", "nano", "--model-path",
                          model_dir, "--run-dir", run_dir, "--no-wandb", "--off-policy", str(off_policy), *flags],
                         capture_output=True, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores),
                         env=os.environ | {"OMP_NUM_THREADS": "1", "FLOWGRPO_ROLLOUT_DIR": root})
    if out.returncode:
        raise RuntimeError(f"{run_dir}: {out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def speed(a, work: str, kind: str, cores: set, flags: tuple, model_dir: str, root: str, ranks: int = 1) -> None:
    """One way of sampling elsewhere, `--off-policy 0` and `1` in alternating rounds; the medians and the bound."""
    rows = {0: [], 1: []}
    for r in range(a.rounds):
        for mode in (0, 1):
            run = os.path.join(work, f"run{r}-{kind.replace(' ', '-')}-{mode}")
            rows[mode] += train(model_dir, run, mode, cores, root, "--iterations", str(a.iterations), *flags,
                                *TRAIN_FLAGS, ranks=ranks)[WARMUP:]
    med = [float(np.median([x["perf/iteration_s"] for x in rows[m]])) for m in (0, 1)]
    roll, upd = (float(np.median([x[k] for x in rows[0]])) for k in ("perf/rollout_s", "perf/train_s"))
    print(f"{kind}: iteration s (median of {len(rows[0])}): synchronous {med[0]:.3f} (rollout {roll:.3f} + update "
          f"{upd:.3f}), one ahead {med[1]:.3f}; ratio {med[1] / med[0]:.3f} (bound {max(roll, upd) / (roll + upd):.3f})",
          flush=True)


def learning(a, url: str, model_dir: str, root: str) -> None:
    judged, curves = {0: [], 1: []}, {0: [], 1: []}
    for seed in range(a.seeds):
        for mode in (0, 1):
            run = os.path.join(a.out, f"off-policy{mode}-seed{seed}")
            if not rundir.finished(run):  # a finished run is kept: the command continues
                shutil.rmtree(run, ignore_errors=True)
                train(model_dir, run, mode, {a.trainer_core}, root, "--seed", str(seed), "--rollout", "vllm-omni",
                      "--rollout-url", url)
            with open(os.path.join(run, "metrics.jsonl")) as f:  # the loop's judge on its eval images, by iteration
                rows = [r for r in map(json.loads, f) if f"eval/{nano.JUDGE}/mean" in r]
            curves[mode].append(([r["iteration"] for r in rows], [r[f"eval/{nano.JUDGE}/mean"] for r in rows]))
            judged[mode].append(nano_compare.final_evaluation(nano, run, 50)["judge_accuracy"])
            print(f"seed {seed}, --off-policy {mode}: held-out judge {judged[mode][-1]:.1%}", flush=True)
    base = nano.evaluate(nano.load(), 50)["judge_accuracy"]
    for mode in (0, 1):
        print(f"--off-policy {mode}: {np.mean(judged[mode]):.1%} ± {np.std(judged[mode], ddof=1):.1%} over "
              f"{a.seeds} seeds ({', '.join(f'{j:.1%}' for j in judged[mode])}); base {base:.1%}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, colour in ((0, "tab:blue"), (1, "tab:orange")):
        for i, (x, y) in enumerate(curves[mode]):
            ax.plot(x, y, color=colour, alpha=0.8, marker="o", ms=3,
                    label=("synchronous" if mode == 0 else "--off-policy 1") if i == 0 else None)
    ax.set_xlabel("iteration (the same images and updates per iteration in both)")
    ax.set_ylabel("judge accuracy (loop's eval images)")
    ax.set_title(f"nano through a vLLM-Omni server, {a.seeds} seeds each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.plot, dpi=120)
    print(f"curves: {a.plot}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("speed", "learning"))
    ap.add_argument("--rounds", type=int, default=3, help="speed: alternating rounds of both modes")
    ap.add_argument("--iterations", type=int, default=8, help="speed: iterations a run")
    ap.add_argument("--seeds", type=int, default=3, help="learning: seeds a mode")
    ap.add_argument("--out", default=os.path.join("runs", "nano-off-policy"), help="learning: its runs (kept)")
    ap.add_argument("--plot", default=os.path.join(ROOT, "assets", "nano", "off_policy.png"))
    ap.add_argument("--server-core", type=int, default=0)
    ap.add_argument("--trainer-core", type=int, default=1)
    ap.add_argument("--port", type=int, default=8093)
    a = ap.parse_args(argv)
    if a.iterations <= WARMUP or a.rounds < 1 or (a.seeds < 2 and a.what == "learning"):  # (std over the seeds)
        ap.error(f"--iterations must be > {WARMUP}, --rounds >= 1 and --seeds >= 2")
    cores = sorted(os.sched_getaffinity(0))  # else each process's pinning failed as it started, past the set-up
    if not {a.server_core, a.trainer_core} <= set(cores) or (a.server_core == a.trainer_core and a.what == "speed"):
        ap.error(f"--server-core and --trainer-core must be cores of {cores} (for speed, two different ones: what "
                 f"overlaps), got {a.server_core} and {a.trainer_core}")
    work = tempfile.mkdtemp(prefix="bench-overlap-")
    try:
        model_dir = os.path.join(work, "nano")  # the shipped nano weights as a whole pipeline, which the server loads
        models_nano.build_nano_pipeline().save_pretrained(model_dir)
        root = os.path.join(work, "exchange")
        os.makedirs(root)
        server = serve(model_dir, root, a.port, a.server_core, os.path.join(work, "server.log"))
        try:
            url = f"http://127.0.0.1:{a.port}"
            if a.what == "speed":  # the server on its core, the trainer on the other
                speed(a, work, "server", {a.trainer_core}, ("--rollout", "vllm-omni", "--rollout-url", url), model_dir,
                      root)
            else:
                learning(a, url, model_dir, root)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
        if a.what == "speed":  # torchrun's two ranks on the two cores, one sampling, one training; the server gone (it
            # takes ~7% of a core idle)
            speed(a, work, "rollout rank", {a.server_core, a.trainer_core}, ("--rollout-ranks", "1", *RANK_FLAGS),
                  model_dir, root, ranks=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
