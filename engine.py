"""The training engine: the only file that knows how training is distributed.

It owns the process group, the trainable adapter (LoRA via peft), the optimizer, gradient clipping,
the reference model (the same network with the adapter disabled), collectives the loop needs, and
LoRA export. The loop calls `engine.step()`, `engine.reference()`, `engine.all_gather(x)` and never
branches on parallelism.
"""
import contextlib
import math
import os

import torch
import torch.distributed as dist
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; one process when not under torchrun.
    gloo on CPU, nccl on CUDA."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


class Engine:
    """Trains `model.transformer` (in place) with a LoRA adapter and AdamW."""

    def __init__(self, model, *, lora_rank: int, lora_alpha: float, lora_targets, lr: float, weight_decay: float,
                 max_grad_norm: float, seed: int):
        self.rank, self.world_size, self.device = init_distributed()
        self.model, self.max_grad_norm = model, max_grad_norm
        net = model.transformer
        # Every rank initialises the same adapter (LoRA B = 0, so the policy starts as the base model).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.lora_config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=list(lora_targets),
                                          init_lora_weights=True)
            net.add_adapter(self.lora_config)
        self.params = [p for p in net.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"--lora-targets {list(lora_targets)} matched no module of the transformer")
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)
        # Give every parameter a (zero) gradient: LoRA weights that never reach the output (the last
        # block's text stream) then still get optimizer state, so a strict optimizer reload works.
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.skipped_steps = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- optimisation ------------------------------------------------------------------------
    def step(self) -> tuple[float, bool]:
        """Clip the accumulated gradients and take one optimizer step; skip it when the norm is not finite.
        Returns (grad norm before clipping, skipped)."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        skipped = not math.isfinite(norm)
        if skipped:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return norm, skipped

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: the same network with the adapter disabled (no second copy in memory)."""
        self.model.transformer.disable_adapters()
        try:
            yield
        finally:
            self.model.transformer.enable_adapters()

    # --- collectives -------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's (n, ...) tensor in rank order: (world·n, ...)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts)

    def broadcast_object(self, obj):
        """Rank 0's value of a small picklable object (e.g. the run directory's time stamp)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return dict(zip(values, (t / self.world_size).tolist()))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- export ------------------------------------------------------------------------------
    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(self.model.transformer).items()}

    def export_lora(self, directory: str) -> None:
        """The adapter in diffusers' format (`pipe.load_lora_weights(directory)`), alpha kept in its metadata."""
        state = self.lora_state_dict()
        if self.is_main:
            self.model.save_lora(directory, state, self.lora_config.to_dict())
