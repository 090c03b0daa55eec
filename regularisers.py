"""Regularisers against reward hacking and the loss of diversity (docs/algorithm.md §17): what they compute, on given
tensors, and the little state they keep. algorithms.py wires them into the update; this file imports nothing of it.

- NormGuard (arXiv 2606.27771): RL inflates the velocity norm ‖v_θ‖ against the reference's; a hinge penalty
  λ·mean(max(0, ‖v_θ‖/‖v_ref‖ − 1 − m)) on every trained forward, composable with any --algorithm (`Watched`). The
  ratio itself is measured at every evaluation of every run, regularised or not (`velocity_norm_ratio`).
- GARDO (Flow-GRPO's `scripts/train_sd3_gardo.py`): diversity-aware advantages (`gardo_advantages`), a KL applied
  only to the images whose reward the proxies doubt (`uncertainty`, `RiskCompensator`, `gate`), against a reference
  that is reset to the current weights when the KL grows past a threshold or every few iterations (`GardoState`).
"""
import dataclasses

import numpy as np
import torch

import rollout
import scheduler as sch


# ---- NormGuard: the velocity-norm hinge -----------------------------------------------------------------------------

def norm_ratio(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """‖v_i‖/‖v_ref,i‖ per image (b,), the norms over every non-batch element, float32."""
    return v.float().flatten(1).norm(dim=1) / v_ref.float().flatten(1).norm(dim=1).clamp(min=1e-12)


def norm_hinge(v: torch.Tensor, v_ref: torch.Tensor, *, weight: float, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """NormGuard's penalty weight·mean(max(0, ‖v‖/‖v_ref‖ − 1 − margin)) (a scalar with v's gradient; v_ref detached)
    and the ratios (b,), detached."""
    ratio = norm_ratio(v, v_ref.detach())
    return weight * torch.relu(ratio - 1.0 - margin).mean(), ratio.detach()


def same_inputs(a: tuple, b: tuple) -> bool:
    """Whether two velocity calls' (x, σ, cond, cfg_scale, height, width) give the same velocity: x and σ equal, the same
    conditioning object, CFG and size."""
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] is b[2] and a[3:] == b[3:]


class Watched:
    """The model as an update's losses see it. With --normguard > 0 every velocity computed with gradients (the trained
    policy's forward; the old policy's and the reference's run without) is followed by the reference's at the same
    inputs (the adapter off, no gradient: after the forward, as Flow-GRPO's KL term) and its hinge is kept until the
    update adds it to that loss term before the backward (`added`). Where the loss runs the reference at those inputs
    itself (a KL to the base model: DGPO's before the forward, DiffusionNFT's after), the two share one pass:
    the same inputs, the same bits. With 0 it is the model: nothing is computed or added. Anything else is the model's."""

    def __init__(self, model, engine, a):
        self.model, self.engine, self.a = model, engine, a
        self.pending, self.ratios, self.known = None, [], None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def velocity(self, x, t, cond, cfg_scale, height, width):
        args = (x, t, cond, cfg_scale, height, width)
        if self.a.normguard > 0 and self.engine.referencing:  # a reference pass, the loss's or the hinge's: one per inputs
            if self.known is None or not same_inputs(self.known[0], args):
                self.known = (args, self.model.velocity(*args))
            return self.known[1]
        v = self.model.velocity(*args)
        if torch.is_grad_enabled() and self.a.normguard > 0:
            with torch.no_grad(), self.engine.reference():
                v_ref = self.velocity(*args)
            penalty, ratio = norm_hinge(v, v_ref, weight=self.a.normguard, margin=self.a.normguard_margin)
            self.pending = penalty if self.pending is None else self.pending + penalty
            self.ratios.append(ratio)
        return v

    def added(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` plus the hinge of the forwards since the last call (the loss itself when there were none)."""
        pending, self.pending, self.known = self.pending, None, None
        return loss if pending is None else loss + pending

    def stats(self) -> dict:
        if not self.ratios:
            return {}
        r = torch.cat(self.ratios)
        return {"train/velocity_norm_ratio": r.mean().item(), "train/normguard_active": (r > 1 + self.a.normguard_margin)
                .float().mean().item()}


@torch.no_grad()
def velocity_norm_ratio(model, engine, a, prompts: list[str], metadata: list[dict], first: int) -> dict:
    """eval/velocity_norm_ratio: ‖v_θ‖/‖v_ref‖ averaged over this rank's first micro-batch of evaluation images and over
    the rollout's σ_0 … σ_{N−1}, at x_σ = (1 − σ)·x0 + σ·ε (x0: the policy's own ODE sample of the image, ε from the
    evaluation seeds), then over ranks. Measured at evaluation, so the training compute the loop counts is unchanged;
    1.0 at the start (the adapter is zero). Costs 3·b·N transformer passes (6·b·N with CFG). {} without a LoRA."""
    if engine.lora_config is None:
        return {}
    n = min(a.micro_batch, len(prompts))
    ids = range(first, first + n)
    batch = rollout.sample(model, prompts[:n], metadata[:n], ids, ids, steps=[], num_steps=a.num_steps,
                           height=a.height, width=a.width, cfg_scale=a.cfg_scale, negative_prompt=a.negative_prompt,
                           noise_level=0.0, sde_type="sde", seed=a.seed, iteration=-1, chunk=n)
    sigmas = sch.sigma_schedule(model.scheduler, a.num_steps, model.image_seq_len(a.height, a.width))[:-1]
    g = torch.Generator().manual_seed(rollout.image_seed(a.seed, -1, first))
    ratios = []
    for sigma in sigmas.tolist():
        t = torch.full((n,), sigma, device=batch.x0.device)
        x = sch.noised(batch.x0, t, torch.randn(batch.x0.shape, generator=g).to(batch.x0.device))
        v = model.velocity(x, t, batch.cond, a.cfg_scale, a.height, a.width)
        with engine.reference():
            v_ref = model.velocity(x, t, batch.cond, a.cfg_scale, a.height, a.width)
        ratios.append(norm_ratio(v, v_ref).mean().item())
    return {"eval/velocity_norm_ratio": engine.mean_over_ranks({"r": float(np.mean(ratios))})["r"]}


# ---- GARDO (yifan123/flow_grpo scripts/train_sd3_gardo.py, flow_grpo/stat_tracking.py; tests/test_regularisers.py) --

def gardo_advantages(r: torch.Tensor, group: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """GARDO's diversity-aware advantages, (N,) float64: per group, A_i = (r_i − mean)·d_i/mean(d) where r_i is at or
    above the group's mean, else r_i − mean (no std: the public stat tracker's `gardo` type). d_i = the cosine distance
    of image i's features to its nearest other image of the group. r, group: (N,); features (N, D)."""
    r = r.double()
    f = features.double()
    f = f / f.norm(dim=1, keepdim=True).clamp_min(1e-12)  # an all-black image's pixels: 0, not 0/0
    adv = torch.zeros_like(r)
    for g in group.unique():
        idx = (group == g).nonzero()[:, 0]
        centred = (r[idx] - r[idx].mean()) * (r[idx].max() > r[idx].min())  # equal rewards: 0 exactly, as grpo's
        distance = 1 - (f[idx] @ f[idx].T).clamp(-1, 1)
        distance.fill_diagonal_(float("inf"))
        nearest = distance.min(dim=1).values
        scale = nearest / nearest.mean() if nearest.mean() > 0 else torch.ones_like(nearest)  # a collapsed group: 1
        adv[idx] = centred * torch.where(centred < 0, torch.ones_like(nearest), scale)
    return adv


def descending_ranks(x: torch.Tensor) -> torch.Tensor:
    """1 for the largest value, N for the smallest (ties as torch.sort orders them), (N,) float32."""
    _, order = torch.sort(x, descending=True)
    ranks = torch.empty_like(x).long()
    ranks[order] = torch.arange(1, len(x) + 1)
    return ranks.float()


def uncertainty(main: torch.Tensor, proxies: list[torch.Tensor]) -> torch.Tensor:
    """GARDO's uncertainty of each image's reward over the whole iteration, (N,): its rank under the trained reward
    minus the mean of its ranks under the proxy rewards (ranks from 1, the best; float32 scores as the script's)."""
    proxy = torch.stack([descending_ranks(p.float()) for p in proxies]).mean(0)
    return descending_ranks(main.float()) - proxy


@dataclasses.dataclass
class RiskCompensator:
    """The script's controller of the gated fraction β: ×1.1 when the mean non-negative uncertainty exceeds every one
    of the last 20 iterations', ×0.9 when below all of them, within [0.02, 0.2], 0.1 at the first."""
    beta: float = 0.1
    buffer: list = dataclasses.field(default_factory=list)
    base, alpha, lowest, highest, window = 0.1, 0.1, 0.02, 0.2, 20

    def update(self, u: np.ndarray) -> float:
        if not self.buffer:
            self.beta = self.base
        elif np.mean(u) > max(self.buffer):
            self.beta = self.beta * (1 + self.alpha)
        elif np.mean(u) < min(self.buffer):
            self.beta = self.beta * (1 - self.alpha)
        self.beta = float(np.clip(self.beta, self.lowest, self.highest))
        self.buffer = (self.buffer + [np.mean(u)])[-self.window:]
        return self.beta


def gate(u: torch.Tensor, compensator: RiskCompensator) -> torch.Tensor:
    """The images the KL regularises, (N,) bool: uncertainty above the (100 − 100·β)-th percentile of the iteration's
    non-negative uncertainties, β updated first by the compensator."""
    kept = u.numpy()[u.numpy() >= 0]
    beta = compensator.update(kept)
    return u > float(np.percentile(kept, 100 - beta * 100))


def gated_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The script's KL term of one micro-batch and step: the mean of the gated images' KL (b,), or 0 if none is."""
    return kl[mask].mean() if bool(mask.any()) else torch.zeros((), dtype=kl.dtype, device=kl.device)


@dataclasses.dataclass
class GardoState:
    """What GARDO carries between iterations: the gated fraction's controller, the gate of the iteration's images (by
    image id), whether the KL asked for a reset and when the reference was last reset. A checkpoint keeps all but the
    gate (`state_dict`); the reference, the engine's old policy, goes with the weights (docs/algorithm.md §17)."""
    compensator: RiskCompensator = dataclasses.field(default_factory=RiskCompensator)
    gate: torch.Tensor | None = None
    reset: bool = False
    last_reset: int = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps, as JSON (a float reads back to the bit); not the gate: each iteration draws one."""
        return {"beta": self.compensator.beta, "buffer": [float(m) for m in self.compensator.buffer],
                "reset": self.reset, "last_reset": self.last_reset}

    def load_state_dict(self, d, where: str) -> None:
        """`state_dict`'s JSON read back, each value of its type (`type()`: a bool is an int, an int no float), or a
        one-line error naming `where`."""
        kinds = {"beta": float, "buffer": list, "reset": bool, "last_reset": int}
        if not (isinstance(d, dict) and all(type(d.get(k)) is kind for k, kind in kinds.items())
                and all(type(m) is float for m in d["buffer"])):
            raise ValueError(f"{where}: {d!r:.60} is not GARDO's state (beta, a buffer of floats, reset, last_reset): "
                             "the checkpoint is damaged")
        self.compensator = RiskCompensator(d["beta"], d["buffer"])
        self.reset, self.last_reset = d["reset"], d["last_reset"]


def state(engine) -> GardoState:
    """The run's GARDO state, kept with its engine (one per run, whatever else runs in the process)."""
    return engine.__dict__.setdefault("gardo", GardoState())


def should_reset(s: GardoState, iteration: int, every: int) -> bool:
    """The script's rule, checked after sampling iteration `iteration` and before its update: reset the reference to
    the current weights if the KL of an optimizer step of an earlier iteration exceeded the threshold, or more than
    `every` iterations have passed since the last reset."""
    return (iteration != 0 and s.reset) or iteration - s.last_reset > every


FEATURES = {  # --gardo-features: what an image's diversity is measured on (the public script: DINOv3 ViT-L/16)
    "pixels": lambda images: images.float().flatten(1),  # the image itself, (B, 3·H·W)
}
