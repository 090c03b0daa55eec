"""A shared starting point for in-process loop and engine tests, the training script run in this process, and a way to
stop a trainer that says where it was (not a conftest: tests/omni has its own)."""
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from unittest import mock

import psutil
import torch

import algorithms
import cli
import engine as eng
import flowgrpo
import models
import rollout
import rundir
import scheduler as sch
import startup


def main_here(*argv) -> list[dict]:
    """`python flowgrpo.py --no-wandb *argv`, run by flowgrpo.main in this process: the same training, files and server
    requests without a new interpreter's imports (most of a tiny run's cost). The worker's one thread
    (tests/conftest.py; OMP_NUM_THREADS=1, so main leaves the count as it is), as a launched test process has; the
    global RNG seeded afresh and given back after; and what flowgrpo.py does as it ends (leave the process group, let go
    of the run directory). The rows it logged; a refusal is raised as the error whose line the CLI prints."""
    try:
        with mock.patch.dict(os.environ, OMP_NUM_THREADS="1"), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return flowgrpo.main(cli.parse_args(flowgrpo.Args, ["--no-wandb", *map(str, argv)]))
    finally:
        eng.shutdown()
        rundir.release_run_dirs()


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `python -c CPU_BOUND SECONDS SCRIPT ARGS...`: SCRIPT's (a path, or a module's name) __main__ with the process's CPU time bounded (RLIMIT_CPU).
CPU_BOUND = """
import resource
import runpy
import sys
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 10))
sys.argv = sys.argv[2:]
if sys.argv[0].endswith(".py"):
    runpy.run_path(sys.argv[0], run_name="__main__")
else:  # a module, as `python -m` runs it
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def run_cpu_bounded(script: str, *args, cpu_seconds: int) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in the repository on one torch thread, its output captured, bounded by its CPU time and not
    by the wall clock: a loaded machine (two busy processes a core) stretches a long run's wall-clock time past any
    fixed limit (nano-compose's RL run hit 1,800 s so), and a test that fails by its machine's load tests the machine.
    The CPU time a run needs hardly changes with load; past `cpu_seconds` the kernel ends it (SIGXCPU)."""
    out = subprocess.run([sys.executable, "-c", CPU_BOUND, str(cpu_seconds), script, *map(str, args)], cwd=ROOT,
                         capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    if out.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        out.stderr += f"\n{script} ended by the kernel at its CPU-time bound, {cpu_seconds} s"
    return out


def tiny_setup(lora_alpha=8, lr=5e-2, advantages=(1.0, -1.0, 0.5, -0.5)):
    """The tiny model with a fresh LoRA engine and a 4-image rollout of one prompt (full mode, 4 steps, no CFG)
    whose advantages are set: the starting point of the in-process loop and engine tests."""
    model = models.load_model("tiny", None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=lora_alpha, lora_targets=model.lora_targets, lr=lr,
                        weight_decay=0, max_grad_norm=1.0, seed=0)
    batch = rollout.sample(model, ["a cat"] * 4, [{}] * 4, [0] * 4, range(4), steps=[0, 1, 2], num_steps=4, height=32,
                           width=32, cfg_scale=1.0, negative_prompt=" ", noise_level=0.7, sde_type="sde", seed=0,
                           iteration=0, chunk=4)
    batch.advantages = torch.tensor(advantages)
    return model, engine, batch


def random_walk(n_steps, shapes, seed=0):
    """Parameter values after each of n_steps optimizer steps: a seeded random walk (for EMA tests)."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=g) for s in shapes]
    for _ in range(n_steps):
        values = [v + 0.1 * torch.randn(v.shape, generator=g) for v in values]
        yield values


def check_ode_path_against_the_pipeline(model, prompts: list[str], cfg: float, height: int, width: int,
                                        n_steps: int = 4) -> float:
    """From the same initial latents and embeddings, `model`'s ODE path against its diffusers pipeline's `__call__`:
    the σ schedule is the one the pipeline set, the latents are equal bit for bit, the decoded samples (images, or a
    video model's frames) within 1e-6 (rollout.sample's and the adapter's decode of the pipeline's latents). Returns
    the samples' max |ours − pipeline's|."""
    n = len(prompts)
    batch = rollout.sample(model, prompts, [{}] * n, range(n), range(n), steps=[], num_steps=n_steps, height=height,
                           width=width, cfg_scale=cfg, negative_prompt="", noise_level=0.0, sde_type="sde", seed=3,
                           iteration=5, chunk=n)
    x1 = model.noise(rollout.image_generators(3, 5, range(n)), height, width)
    cond = model.conditioning(prompts, "", cfg)
    kw = dict(model.pipeline_kwargs(cond, cfg), height=height, width=width, num_inference_steps=n_steps)

    def pipeline(output_type):  # the output's `images`, or `frames` for a video pipeline
        out = model.pipe(latents=x1.clone(), output_type=output_type, **kw)
        return out.frames if hasattr(out, "frames") else out.images
    ref_latents = pipeline("latent")
    sig = sch.sigma_schedule(model.scheduler, n_steps, model.image_seq_len(height, width))
    assert torch.equal(sig, model.pipe.scheduler.sigmas), (sig, model.pipe.scheduler.sigmas)
    ref_samples = pipeline("pt")
    assert batch.images.shape == ref_samples.shape == (n, *model.sample_shape(height, width))
    torch.testing.assert_close(model.decode(ref_latents, height, width), ref_samples, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch.images, ref_samples, rtol=0, atol=1e-6)
    x = x1
    with torch.no_grad():
        for i in range(n_steps):
            v = model.velocity(x, sig[i].expand(n), cond, cfg, height, width)
            x, *_ = sch.step(v, x, sig[i], sig[i + 1], sigma_max=sig[1], noise_level=0)
    assert torch.equal(x, ref_latents), (x - ref_latents).abs().max()  # bit for bit
    return (batch.images - ref_samples).abs().max().item()
def check_lora_export(name: str, directory: str, metadata: list[dict], cfg: float = 1.0, negative: str = "") -> None:
    """One update of tiny model `name` (4 images of one prompt with `metadata`, full mode, 4 steps, 32²), exported and
    loaded by its pipeline's `load_lora_weights` into a fresh tiny pipeline: the loaded velocity is the trained one
    (alpha included), which the update moved away from the base one."""
    args = dataclasses.replace(flowgrpo.RECIPES[name], group_size=4, prompts_per_iteration=1, micro_batch=4,
                               optimizer_steps=1, cfg_scale=cfg)
    model = models.load_model(name, None, "cpu", seed=0)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=16, lora_targets=model.lora_targets, lr=5e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0)
    batch = rollout.sample(model, ["make it red"] * 4, metadata, [0] * 4, range(4), steps=[0, 1, 2], num_steps=4,
                           height=32, width=32, cfg_scale=cfg, negative_prompt=negative, noise_level=0.7,
                           sde_type="sde", seed=0, iteration=0, chunk=4)
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    algorithms.train_on(model, engine, batch, args, flowgrpo.batch_arithmetic(args, 1), False)
    engine.export_lora(os.path.join(directory, "lora"))
    family = models.adapter_class(name)
    fresh = family.build_tiny(0)
    fresh.load_lora_weights(os.path.join(directory, "lora"))
    x, sigma = batch.latents[:, 1], batch.sigmas[1].expand(4)
    with torch.no_grad():
        trained, base, loaded = (m.velocity(x, sigma, batch.cond, cfg, 32, 32) for m in (
            model, family(family.build_tiny(0), "cpu", torch.float32), family(fresh, "cpu", torch.float32)))
    assert (trained - base).abs().max() > 1e-4  # the adapter changed the output ...
    torch.testing.assert_close(loaded, trained, rtol=1e-5, atol=1e-6)  # ... and the export carries it


def stop(proc, sig, seconds: float = 60) -> tuple[str, str]:
    """(stdout, stderr) of `proc` once `sig` ended it, which must be within `seconds`; else the test fails saying where
    the trainer was: every thread's stack, which it prints on SIGUSR1 (engine.handle_signals), for it and its
    children (a torchrun launcher's workers)."""
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        children = psutil.Process(proc.pid).children(recursive=True)
        for p in children or [psutil.Process(proc.pid)]:
            p.send_signal(signal.SIGUSR1)
        time.sleep(3)
        for p in children + [psutil.Process(proc.pid)]:
            p.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running {seconds} s after {signal.Signals(sig).name}; its threads:\n{err[-8000:]}")


def check_pretrained(model: str, out, prompt: str, side: int) -> None:
    """A laptop task's `pretrain --out OUT` output: --model MODEL --model-path OUT starts, loads exactly the weights
    written (float16 on disk) and draws finite side × side images of `prompt`."""
    from safetensors.torch import load_file
    startup.check_args(dataclasses.replace(flowgrpo.RECIPES[model], model_path=str(out)))
    adapter = models.load_model(model, str(out), "cpu")
    saved = load_file(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    assert all(torch.equal(v.float(), adapter.transformer.state_dict()[k]) for k, v in saved.items())
    images = rollout.sample_ode(adapter, [prompt] * 2, num_steps=4, height=side, width=side, cfg_scale=1.0,
                                negative_prompt=" ", seed=0, chunk=2)
    assert images.shape == (2, 3, side, side) and bool(torch.isfinite(images).all())


def raised_within(call, *args, seconds: float = 60):
    """What call(*args) raised (None if nothing), run in a thread given `seconds`: a call that blocks (a FIFO opened
    for reading waits for a writer for good) fails the test instead of stopping the suite."""
    raised = []

    def run():
        try:
            call(*args)
            raised.append(None)
        except Exception as e:
            raised.append(e)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert raised, f"{getattr(call, '__name__', call)} still ran after {seconds} s (blocked on a read?)"
    return raised[0]
