"""A shared starting point for in-process loop and engine tests, and a way to stop a trainer that says where it was
(not a conftest: tests/omni has its own)."""
import signal
import subprocess
import time

import psutil
import torch

import engine as eng
import models
import rollout


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
