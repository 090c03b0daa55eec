"""The training engine: the only file that knows how training is distributed.

It owns the process group, the trainable weights (LoRA via peft, or the full transformer), FSDP2
sharding, the optimizer, gradient clipping, the reference model (the same network with the adapter
disabled), the few collectives the loop needs, checkpoints (torch.distributed.checkpoint) and LoRA
export. The loop calls `engine.step()`, `engine.reference()`, `engine.all_gather(x)`, ... and never
branches on parallelism: one process is simply a world of size 1 (same FSDP2 code path).
"""
import contextlib
import glob
import hashlib
import json
import math
import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
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
            from peft import LoraConfig  # peft loads diffusers and transformers: only when a model is being built
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
        self.hyper = dict(lr=lr, weight_decay=weight_decay)  # --allow-change may change them on --resume
        self.optimizer = torch.optim.AdamW(self.params, **self.hyper, foreach=True)
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
        from peft.utils import get_peft_model_state_dict
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

    def save_checkpoint(self, directory: str, meta: dict, keep: int) -> None:
        """Write `directory` atomically: everything goes to `<directory>.tmp` and is renamed when complete, so a
        crash at any moment leaves the previous checkpoints intact. `meta` (JSON: the loop's state, the run's
        flags and id) goes to meta.json with a SHA-256 manifest of every other file. Keeps this run's newest `keep`."""
        tmp = directory + ".tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        self.barrier()
        model_sd, optim_sd = self._state()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, "dcp"))
        time.sleep(float(os.environ.get("FLOWGRPO_CHECKPOINT_DELAY", 0)))  # widens the window for crash tests
        save_rng_state(os.path.join(tmp, f"rng_rank{self.rank}.safetensors"))
        self.export_lora(os.path.join(tmp, "lora"))  # ends with a barrier: every rank's files are written
        if self.is_main:
            meta = dict(meta, world_size=self.world_size, manifest=manifest(tmp))
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _replace_dir(tmp, directory)
            for old in list_checkpoints(os.path.dirname(directory), run_id=meta["run_id"])[:-keep]:
                shutil.rmtree(old)
        self.barrier()

    def load_checkpoint(self, directory: str) -> dict:
        """Restore the trained weights, optimizer and RNG states (strictly) from a checkpoint that resolve_resume
        checked against its manifest; returns meta.json's content."""
        meta = read_checkpoint_meta(directory)
        if not self.optimizer.state:  # AdamW creates its state lazily: make it (lr 0, no decay) so it can be filled
            for group in self.optimizer.param_groups:
                group.update(lr=0.0, weight_decay=0.0)
            self.optimizer.step()
        model_sd, optim_sd = self._state()
        try:
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(directory, "dcp"))
            set_state_dict(self.model.transformer, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=self._OPTIONS)
        except (Exception, CheckpointException) as e:  # DCP's error is a BaseException; we name the file and the fix
            raise RuntimeError(f"checkpoint {os.path.join(directory, 'dcp')} could not be loaded: {e}. It was written "
                               "by a different model/LoRA; resume from another checkpoint") from e
        for group in self.optimizer.param_groups:  # the checkpoint's hyper-parameters yield to this run's flags
            group.update(self.hyper)
        if meta["world_size"] == self.world_size:
            load_rng_state(os.path.join(directory, f"rng_rank{self.rank}.safetensors"))
        elif self.is_main:  # every random draw of the loop derives from (seed, iteration): still exact, up to rounding
            print(f"resuming {meta['world_size']} rank(s) as {self.world_size}: the per-rank global RNG states are "
                  "not restored (the loop's noise, windows and shuffles derive from --seed and the iteration)")
        return meta


def on_main(fn, *args):
    """fn(*args) on rank 0 only; every rank returns its result, or raises its error (a ValueError or OSError,
    re-raised as ValueError with the same message): start-up work on shared files happens once, and a refusal
    stops every rank alike."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [(True, fn(*args))]
        except (ValueError, OSError) as e:
            box = [(False, str(e))]
    dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise ValueError(value)
    return value


# ---- checkpoint files: data only (safetensors, JSON); what DCP must unpickle is checked against a manifest first

def save_rng_state(path: str) -> None:
    """torch's global RNG states (CPU and every GPU) as safetensors. Python's and NumPy's global generators are not
    saved: nothing here draws from them (windows, prompt order and noise have their own seeded generators)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    save_file({"cpu": torch.get_rng_state(), **{f"cuda{i}": s for i, s in enumerate(cuda)}}, path)


def load_rng_state(path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"--resume: {path} is missing: the checkpoint is incomplete; resume from another one")
    state = load_file(path)
    torch.set_rng_state(state["cpu"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state[f"cuda{i}"] for i in range(torch.cuda.device_count())])


def manifest(directory: str) -> dict[str, str]:
    """{relative path: SHA-256} of every file under directory except meta.json (which holds the manifest)."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if rel != "meta.json":
                with open(path, "rb") as f:
                    out[rel] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


META_KEYS = ("run_id", "flags", "loop", "world_size", "manifest")
LOOP_KEYS = ("iteration", "sampler", "skipped_steps", "wandb_id")


def verify_checkpoint(directory: str) -> dict:
    """meta.json, after checking that every file of the checkpoint is exactly the one its manifest lists: DCP
    unpickles dcp/.metadata and non-tensor values, so a swapped file would run code. Errors name the file."""
    meta = read_checkpoint_meta(directory)
    found = manifest(directory)
    for rel in sorted(found.keys() | meta["manifest"].keys()):
        if found.get(rel) != meta["manifest"].get(rel):
            state = "is missing" if rel not in found else "is not in the manifest" if rel not in meta["manifest"] \
                else "differs from its SHA-256 in the manifest"
            raise ValueError(f"--resume: {os.path.join(directory, rel)} {state} ({os.path.join(directory, 'meta.json')})"
                             ": the checkpoint was altered or damaged; resume from another one")
    return meta


def _replace_dir(src: str, dst: str) -> None:
    """Rename src to dst; an existing dst is moved aside first and removed only after the swap."""
    old = dst + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(dst):
        os.rename(dst, old)
    os.rename(src, dst)
    shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(root: str, run_id: str | None = None) -> list[str]:
    """Complete checkpoints under root, oldest first: real directories (not links) with a meta.json (a `.tmp`
    directory is an interrupted write); with run_id, only that run's (pruning never touches another run's)."""
    paths = [p for p in glob.glob(os.path.join(root, CKPT_PREFIX + "*")) if p[-4:] not in (".tmp", ".old")]
    done = [p for p in paths if not os.path.islink(p) and os.path.isfile(os.path.join(p, "meta.json"))]
    return sorted(p for p in done if run_id is None or _run_id_of(p) == run_id)


def _run_id_of(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            return json.load(f).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def read_checkpoint_meta(directory: str) -> dict:
    """meta.json of a checkpoint, with a clear error for a missing, incomplete, corrupt or foreign one."""
    path = os.path.join(directory, "meta.json")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--resume: no checkpoint directory {directory}")
    for needed in (path, os.path.join(directory, "dcp", ".metadata")):
        if not os.path.exists(needed):
            raise ValueError(f"--resume: {directory} is incomplete ({needed} is missing): it was interrupted while being "
                             "written — resume from an earlier checkpoint")
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--resume: {path} is corrupt ({e})") from e
    missing = [k for k in META_KEYS if k not in meta] if isinstance(meta, dict) else list(META_KEYS)
    missing += [f"loop.{k}" for k in LOOP_KEYS if not missing and k not in meta["loop"]]
    if missing:
        raise ValueError(f"--resume: {path} lacks {', '.join(missing)}: not a checkpoint written by this version of "
                         "flowgrpo.py")
    return meta


def resolve_resume(resume: str, run_dir: str | None, flags: dict, may_change=()) -> tuple[str, dict]:
    """(checkpoint directory, its meta.json) for `--resume PATH|auto`, checked before anything is built: its files
    against its manifest, and its flags against this run's `flags` (those that decide the result), except the ones
    named in `may_change`."""
    if resume == "auto":
        if run_dir is None:
            raise ValueError("--resume auto needs --run-dir (the run whose newest checkpoint to continue)")
        found = list_checkpoints(os.path.join(run_dir, "checkpoints"))
        if not found:
            raise FileNotFoundError(f"--resume auto: no complete checkpoint in {os.path.join(run_dir, 'checkpoints')}")
        resume = found[-1]
    meta = verify_checkpoint(resume)
    saved = meta["flags"]
    diff = {k: (saved.get(k), v) for k, v in flags.items() if saved.get(k) != v and k not in may_change}
    if diff:
        raise ValueError(f"--resume: {os.path.join(resume, 'meta.json')} was written with different flags, which would "
                         "break exact resumption: " + "; ".join(f"--{k.replace('_', '-')}: checkpoint {a!r}, this run "
                                                               f"{b!r}" for k, (a, b) in diff.items())
                         + " (use the checkpoint's values, or name the flags in --allow-change to change them)")
    return resume, meta
