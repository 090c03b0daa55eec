"""What `--off-policy 1` buys and what it costs: the speed of overlapping rollout and update, and the learning kept.

    .venv/bin/python bench_overlap.py speed [--rounds 3] [--iterations 8] [--server-core 0] [--trainer-core 1]
    .venv/bin/python bench_overlap.py learning [--seeds 3] [--out runs/nano-off-policy]

Both serve a pipeline with vLLM-Omni (omni/serve_tiny.py, its own venv: omni/setup_env.sh) pinned to one core and
train against it (`flowgrpo.py --rollout vllm-omni`) on another. `speed`: the tiny pipeline with TRAIN_FLAGS,
`--off-policy 0` and `1` in alternating rounds (the machine's drift falls on both), each a run of its own; per mode
the median of `perf/iteration_s` over every round's iterations after the first two (start-up, the first rollout that
nothing overlaps), and the synchronous run's rollout and update seconds, which bound the gain: at best
max(rollout, update) ÷ (rollout + update). `learning`: the nano task's recipe (nano.py) through the server, both
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

import models
import models_nano
import nano
import nano_compare

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))
# the tiny recipe with one trained step of four (--window 1): the server's rollout (4 steps, no gradient) and the
# update (1 step, forward and backward, 2 optimizer steps) take similar time on one core each
TRAIN_FLAGS = ("--height", "64", "--width", "64", "--kl-beta", "0.04", "--eval-every", "0", "--checkpoint-every", "0")
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


def train(model: str, model_dir: str, url: str, run_dir: str, off_policy: int, core: int, root: str, *flags) -> list:
    """One run of flowgrpo.py on `core`; its metrics rows."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), "--model", model, "--model-path",
                          model_dir, "--rollout", "vllm-omni", "--rollout-url", url, "--run-dir", run_dir, "--no-wandb",
                          "--off-policy", str(off_policy), *flags], capture_output=True, text=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, {core}),
                         env=os.environ | {"OMP_NUM_THREADS": "1", "FLOWGRPO_ROLLOUT_DIR": root})
    if out.returncode:
        raise RuntimeError(f"{run_dir}: {out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def speed(a, work: str, url: str, model_dir: str, root: str) -> None:
    rows = {0: [], 1: []}
    for r in range(a.rounds):
        for mode in (0, 1):
            got = train("tiny", model_dir, url, os.path.join(work, f"run{r}-{mode}"), mode, a.trainer_core, root,
                        "--iterations", str(a.iterations), *TRAIN_FLAGS)
            rows[mode] += got[WARMUP:]
    med = {m: float(np.median([x["perf/iteration_s"] for x in rows[m]])) for m in rows}
    roll, upd = (float(np.median([x[k] for x in rows[0]])) for k in ("perf/rollout_s", "perf/train_s"))
    print(f"iteration s (median of {len(rows[0])}): synchronous {med[0]:.3f} (rollout {roll:.3f} + update "
          f"{upd:.3f}), one ahead {med[1]:.3f}; ratio {med[1] / med[0]:.3f} (bound {max(roll, upd) / (roll + upd):.3f})")


def learning(a, url: str, model_dir: str, root: str) -> None:
    judged, curves = {0: [], 1: []}, {0: [], 1: []}
    for seed in range(a.seeds):
        for mode in (0, 1):
            run = os.path.join(a.out, f"off-policy{mode}-seed{seed}")
            if not os.path.exists(os.path.join(run, "lora")):  # a finished run is kept: the command continues
                shutil.rmtree(run, ignore_errors=True)
                train("nano", model_dir, url, run, mode, a.trainer_core, root, "--seed", str(seed))
            curves[mode].append(nano_compare.curve(nano, run))
            judged[mode].append(nano_compare.final_evaluation(nano, run, 50)["judge_accuracy"])
            print(f"seed {seed}, --off-policy {mode}: held-out judge {judged[mode][-1]:.1%}", flush=True)
    base = nano.evaluate(nano.load(), 50)["judge_accuracy"]
    for mode in (0, 1):
        print(f"--off-policy {mode}: {np.mean(judged[mode]):.1%} ± {np.std(judged[mode], ddof=1):.1%} over "
              f"{a.seeds} seeds ({', '.join(f'{j:.1%}' for j in judged[mode])}); base {base:.1%}")
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, colour in ((0, "tab:blue"), (1, "tab:orange")):
        for i, c in enumerate(curves[mode]):
            ax.plot(c["rollout_passes"] / 1e3, c["judge"], color=colour, alpha=0.8,
                    label=("synchronous" if mode == 0 else "--off-policy 1") if i == 0 else None)
    ax.set_xlabel("rollout transformer passes (thousands)")
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
    if a.iterations <= WARMUP or a.rounds < 1 or a.seeds < 2:
        ap.error(f"--iterations must be > {WARMUP}, --rounds >= 1 and --seeds >= 2")
    work = tempfile.mkdtemp(prefix="bench-overlap-")
    try:
        model_dir = os.path.join(work, a.what)
        if a.what == "speed":
            models.save_tiny_pipeline(model_dir, 0, "tiny")
        else:  # the shipped nano weights as a whole pipeline directory, which the server loads
            models_nano.build_nano_pipeline().save_pretrained(model_dir)
        root = os.path.join(work, "exchange")
        os.makedirs(root)
        server = serve(model_dir, root, a.port, a.server_core, os.path.join(work, "server.log"))
        try:
            url = f"http://127.0.0.1:{a.port}"
            speed(a, work, url, model_dir, root) if a.what == "speed" else learning(a, url, model_dir, root)
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
