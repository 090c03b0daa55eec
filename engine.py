"""The training engine: the only file that knows how training is distributed.

It owns the process group, the trainable weights (LoRA via peft, or the full transformer), FSDP2
sharding, the optimizer, gradient clipping, the reference model (the same network with the adapter
disabled), the few collectives the loop needs, checkpoints (torch.distributed.checkpoint) and LoRA
export. The loop calls `engine.step()`, `engine.reference()`, `engine.all_gather(x)`, ... and never
branches on parallelism: one process is simply a world of size 1 (same FSDP2 code path).
"""
import contextlib
import glob
import json
import math
import os
import random
import shutil
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

CKPT_PREFIX = "iter_"
# FSDP2 warns on every call that the transformer returns a view; the loop never modifies outputs in place.
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def init_distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment (env:// rendezvous, any number of nodes);
    a single process gets a world of one through an in-memory store. gloo on CPU, nccl on CUDA
    (with gloo beside it for CPU tensors)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world > 1:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return rank, world, device


def assign_images(n_images: int, optimizer_steps: int, world_size: int, seed: int) -> torch.Tensor:
    """(world, images per rank) image indices: a seeded shuffle of the iteration's images, cut into optimizer
    steps, each step split evenly over the ranks. Optimizer step k trains the same images whatever the world
    size, so one process and N ranks take the same steps (up to the order of floating-point sums)."""
    perm = torch.randperm(n_images, generator=torch.Generator().manual_seed(seed))
    return perm.view(optimizer_steps, world_size, -1).transpose(0, 1).reshape(world_size, -1)


class Engine:
    """Trains `model.transformer` in place: LoRA → activation checkpointing → compile → FSDP2 → AdamW."""

    def __init__(self, model, *, lora_rank: int, lora_alpha: float, lora_targets, lr: float, weight_decay: float,
                 max_grad_norm: float, seed: int, full_finetune: bool = False, activation_checkpointing: bool = False,
                 compile: bool = False, mixed_precision: bool = False, offload: bool = False,
                 shard_text_encoder: bool = False):
        self.rank, self.world_size, self.device = init_distributed()
        self.model, self.max_grad_norm, self.skipped_steps = model, max_grad_norm, 0
        net = model.transformer
        # 1. What is trained. Every rank initialises the same adapter (LoRA B = 0: the policy starts as the
        #    base model). LoRA comes first so that checkpointing, compile and sharding all see its layers.
        self.lora_config = None
        if full_finetune:
            net.requires_grad_(True)
        else:
            self.lora_config = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=list(lora_targets))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                net.add_adapter(self.lora_config)
            if mixed_precision:  # fp32 master weights for the adapter; FSDP computes in bf16
                for p in net.parameters():
                    if p.requires_grad:
                        p.data = p.data.float()
        # 2. Activation checkpointing inside each block (before compile, so the recompute is compiled too).
        if activation_checkpointing:
            net.enable_gradient_checkpointing()
        # 3. Compile each block separately (small graphs, compiled once, reused by every block).
        if compile:
            for block in model.blocks:
                block.compile()
        # 4–5. Shard each block, then the root (its remaining parameters: embeddings, norms, projections),
        #      so a block's parameters are gathered just before it runs and freed right after.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
            else MixedPrecisionPolicy()
        kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if offload
                  else OffloadPolicy())  # pinned memory needs an accelerator
        for block in model.blocks:
            fully_shard(block, **kw)
        fully_shard(net, **kw)
        if shard_text_encoder:  # frozen, only forwards: shard it to save memory on every rank
            for module in model.text_encoder_shards():
                fully_shard(module)
        self.params = [p for p in net.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError(f"--lora-targets {list(lora_targets)} matched no module of the transformer")
        # foreach: batched over parameters (on CPU the default per-tensor loop cost ~4× more per step, bench.py);
        # `fused` was faster still but moved 1-vs-2-rank results apart by more than float32 rounding.
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, foreach=True)
        # Give every parameter a (zero) gradient: LoRA weights that never reach the output (the last
        # block's text stream) then still get optimizer state, so a strict optimizer reload works.
        for p in self.params:
            p.grad = torch.zeros_like(p)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --- optimisation ------------------------------------------------------------------------
    def step(self) -> tuple[float, bool]:
        """Clip the accumulated gradients (the norm is over all shards) and take one optimizer step; skip
        it, on every rank alike, when the norm is not finite. Returns (norm before clipping, skipped)."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
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
        if self.lora_config is None:
            raise ValueError("--kl-beta > 0 needs a LoRA (the reference is the network with the adapter off)")
        self.model.transformer.disable_adapters()
        try:
            yield
        finally:
            self.model.transformer.enable_adapters()

    # --- collectives -------------------------------------------------------------------------
    def all_gather(self, x) -> torch.Tensor:
        """Every rank's (n, ...) tensor or array, concatenated in rank order: (world·n, ...), on the CPU."""
        x = torch.as_tensor(x).to(self.device).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return torch.cat(parts).cpu()

    def broadcast_object(self, obj):
        """Rank 0's value of a small picklable object (e.g. the run directory's time stamp)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        t = torch.tensor(list(values.values()), dtype=torch.float64)
        dist.all_reduce(t)
        return dict(zip(values, (t / self.world_size).tolist()))

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- LoRA export -------------------------------------------------------------------------
    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's full tensors (gathered from the shards; a collective: call on every rank)."""
        sd = get_peft_model_state_dict(self.model.transformer)
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu() for k, v in sd.items()}

    def export_lora(self, directory: str) -> None:
        """The adapter in diffusers' format (`pipe.load_lora_weights(directory)`), α kept in its metadata;
        written atomically by rank 0."""
        if self.lora_config is None:
            return
        state = self.lora_state_dict()
        if self.is_main:
            tmp = directory + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            self.model.save_lora(tmp, state, self.lora_config.to_dict())
            _replace_dir(tmp, directory)
        self.barrier()

    # --- checkpoints -------------------------------------------------------------------------
    # Trainable weights and optimizer state only: the frozen base model comes from its weights. Loading is
    # strict through dcp.load (every requested key must be in the checkpoint, with its shape); `strict=False`
    # only lets `set_state_dict` accept a state dict without the frozen keys.
    _OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)

    def _state(self):
        return get_state_dict(self.model.transformer, self.optimizer, options=self._OPTIONS)

    def save_checkpoint(self, directory: str, loop_state: dict, fingerprint: dict, keep: int) -> None:
        """Write `directory` atomically: everything goes to `<directory>.tmp` and is renamed when complete,
        so a crash at any moment leaves the previous checkpoints intact. Keeps the newest `keep`."""
        tmp = directory + ".tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self.barrier()
        model_sd, optim_sd = self._state()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp"))
        time.sleep(float(os.environ.get("FLOWGRPO_CHECKPOINT_DELAY", 0)))  # widens the window for crash tests
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   os.path.join(tmp, f"rng_rank{self.rank}.pt"))
        self.export_lora(os.path.join(tmp, "lora"))
        if self.is_main:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({"fingerprint": fingerprint, "loop": loop_state, "world_size": self.world_size}, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _replace_dir(tmp, directory)
            for old in list_checkpoints(os.path.dirname(directory))[:-keep]:
                shutil.rmtree(old)
        self.barrier()

    def load_checkpoint(self, directory: str) -> dict:
        """Restore the trained weights, optimizer and RNG states (strictly); returns the loop's state."""
        meta = read_checkpoint_meta(directory)
        if not self.optimizer.state:  # AdamW creates its state lazily: make it (lr 0, zero grads) so it can be filled
            lrs = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = 0.0
            self.optimizer.step()
            for g, lr in zip(self.optimizer.param_groups, lrs):
                g["lr"] = lr
        model_sd, optim_sd = self._state()
        try:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(directory, "dcp"))
            set_state_dict(self.model.transformer, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=self._OPTIONS)
        except (Exception, CheckpointException) as e:  # DCP's error is a BaseException; we name the file and the fix
            raise RuntimeError(f"checkpoint {os.path.join(directory, 'dcp')} could not be loaded: {e}. It is corrupt or "
                               "was written by a different model/LoRA; resume from another checkpoint") from e
        rng_file = os.path.join(directory, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng_file):  # absent when resuming with more ranks than were saved
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"]), random.setstate(rng["python"]), np.random.set_state(rng["numpy"])
            if rng["cuda"] is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        return meta["loop"]


def _replace_dir(src: str, dst: str) -> None:
    """Rename src to dst; an existing dst is moved aside first and removed only after the swap."""
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dst):
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under root, oldest first (a `.tmp` directory is an interrupted write)."""
    paths = [p for p in glob.glob(os.path.join(root, CKPT_PREFIX + "*")) if p[-4:] not in (".tmp", ".old")]
    return sorted(p for p in paths if os.path.exists(os.path.join(p, "meta.json")))


def read_checkpoint_meta(directory: str) -> dict:
    """meta.json of a checkpoint, with a clear error for a missing, incomplete or corrupt one."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--resume: no checkpoint directory {directory}")
    if not os.path.exists(path) or not os.path.exists(os.path.join(directory, "dcp", ".metadata")):
        raise ValueError(f"--resume: {directory} is incomplete (no {path if not os.path.exists(path) else 'dcp/.metadata'}); "
                         "it was interrupted while being written — resume from an earlier checkpoint")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume: {path} is corrupt ({e})") from e


def resolve_resume(resume: str, run_dir: str | None, fingerprint: dict) -> str:
    """The checkpoint directory for `--resume PATH|auto`, checked against this run's fingerprint (model and
    trained-weight shapes) before anything is built."""
    if resume == "auto":
        if run_dir is None:
            raise ValueError("--resume auto needs --run-dir (the run whose newest checkpoint to continue)")
        found = list_checkpoints(os.path.join(run_dir, "checkpoints"))
        if not found:
            raise FileNotFoundError(f"--resume auto: no complete checkpoint in {os.path.join(run_dir, 'checkpoints')}")
        resume = found[-1]
    saved = read_checkpoint_meta(resume)["fingerprint"]
    diff = {k: (saved.get(k), v) for k, v in fingerprint.items() if saved.get(k) != v}
    if diff:
        raise ValueError(f"--resume: {os.path.join(resume, 'meta.json')} was written with a different configuration: "
                         + "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in diff.items()))
    return resume
