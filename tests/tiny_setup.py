"""A shared starting point for in-process loop and engine tests (not a conftest: tests/omni has its own)."""
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


def random_walk(n_steps, shapes, seed=0):
    """Parameter values after each of n_steps optimizer steps: a seeded random walk (for EMA tests)."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=g) for s in shapes]
    for _ in range(n_steps):
        values = [v + 0.1 * torch.randn(v.shape, generator=g) for v in values]
        yield values
