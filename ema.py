"""The shadows of the trained parameters that engine.py keeps: the EMA of the weights (--ema-decay) and the
forward-process algorithms' old policy. Each is a float32 copy of the parameters, sharded exactly as they are under
FSDP2 (each rank averages its own shards: no communication, the same bits whatever the number of ranks), swapped into
the model for a while and checkpointed beside the weights.
"""
import contextlib

import torch
from torch.distributed.tensor import DTensor


def ema_flow_grpo(ema: torch.Tensor, p: torch.Tensor, n: int, every: int, decay: float) -> None:
    """Flow-GRPO's EMAModuleWrapper: after optimizer step n, when n + 1 is a multiple of `every`,
    ema ← ema + (1 − d)·(θ − ema) with the warm-up d = min((1 + n)/(10 + n), decay)."""
    if (n + 1) % every == 0:
        ema.add_((p - ema) * (1 - min((1 + n) / (10 + n), decay)))


def ema_dance(ema: torch.Tensor, p: torch.Tensor, n: int, every: int, decay: float) -> None:
    """DanceGRPO's FSDP_EMA: after optimizer step n, when n is a multiple of `every` (every = optimizer steps per
    iteration: once per rollout batch, as its train_one_step), ema ← d·ema + (1 − d)·θ, constant d, no warm-up."""
    if n % every == 0:
        ema.copy_(ema * decay + p * (1 - decay))


EMA_FORMS = {"flow-grpo": ema_flow_grpo, "dance": ema_dance}


class EMA:
    """An exponential moving average of the trained parameters (docs/algorithm.md §10, "EMA"). After optimizer step n
    (n = 1, 2, …; skipped steps count) EMA_FORMS[form] updates it, `repeat` times in a row where it fires: Flow-GRPO's
    SD3 and FLUX scripts call the update once per micro-batch with an unchanged step counter, i.e. M times per firing
    on the same weights (an effective decay d^M; M = 1: once per optimizer step). Under FSDP2 the parameters are
    DTensors and each rank averages its own shards in float32, element-wise: no communication, and the same bits
    whatever the number of ranks."""

    def __init__(self, named_params, decay: float, every: int, repeat: int = 1, form: str = "flow-grpo"):
        self.names, self.params = map(list, zip(*named_params))
        self.decay, self.every, self.steps = decay, every, torch.zeros((), dtype=torch.int64)
        self.repeat, self.update = repeat, EMA_FORMS[form]
        with torch.no_grad():  # starts at the initial weights (a LoRA's B = 0: the base model); DTensors stay sharded
            self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        n = int(self.steps)
        for ema, p in zip(self.shadow, self.params):
            for _ in range(self.repeat):  # element-wise: the same bits as M whole passes in a row
                self.update(local_shard(ema), local_shard(p).float(), n, self.every, self.decay)

    @contextlib.contextmanager
    def swapped(self):
        """The EMA weights in the model for the duration; the trained ones come back bit for bit. (FSDP2 keeps its root
        module's shards gathered after a forward: engine._swapped reshards it around the swap.)"""
        # Ctrl-C stops a rollout at once (rundir.Stop), and the loop then saves and exports the weights: a signal
        # half-way through a swap or its restore left some of them the shadow's. So the swap is inside the try, and
        # each copy is one call (a signal's handler runs between calls), into detached views (no autograd to turn off;
        # their version is the parameter's, which the bf16 working copies and merged weights watch).
        targets = [local_shard(p).detach() for p in self.params]
        backup = [t.clone() for t in targets]
        try:
            torch._foreach_copy_(targets, [local_shard(ema) for ema in self.shadow])
            yield
        finally:
            torch._foreach_copy_(targets, backup)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds (DTensors under FSDP2): dcp.save writes them beside the weights, and dcp.load
        fills these very tensors in place, strictly."""
        return {"step": self.steps, **dict(zip(self.names, self.shadow))}


class OldPolicy(EMA):
    """The forward-process algorithms' "old" policy v_old (docs/algorithm.md §12): a float32 shadow of the trained
    parameters, stored, swapped in and checkpointed as the EMA is (a shadow rather than a second peft adapter: one
    mechanism for LoRA and full fine-tuning, sharded exactly as the parameters, and nothing a LoRA export could pick
    up). The algorithm moves it once per iteration, `blend(d)`: old ← old·d + θ·(1 − d), DiffusionNFT's arithmetic
    to the bit, element-wise on each rank's shards (the same bits whatever the number of ranks)."""

    def __init__(self, named_params):
        super().__init__(named_params, decay=0.0, every=1)  # EMA's storage; its own step() is never called

    @torch.no_grad()
    def blend(self, decay: float) -> None:
        for old, p in zip(self.shadow, self.params):
            local_shard(old).copy_(local_shard(old) * decay + local_shard(p).float() * (1.0 - decay))


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the storage FSDP2 gathers from: in-place writes reach the parameter)."""
    return t.to_local() if isinstance(t, DTensor) else t
