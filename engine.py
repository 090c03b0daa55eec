"""The training engine: the only file that knows how training is distributed.

It owns the process group, the trainable weights (LoRA via peft, or the full transformer), FSDP2 sharding where there
is something to shard (else bf16 compute from working copies, precision.py), the (data-parallel × sequence-parallel)
mesh (`--sp`: sequence_parallel.py), the optimizer, gradient clipping, the EMA of the weights and the old policy
(their shadows: ema.py), the reference model (the same network with the adapter disabled), the rollout's gathered
weights, the few collectives the loop needs, saving and loading checkpoints (torch.distributed.checkpoint; their files
and checks: checkpoint.py) and LoRA export. The loop calls `engine.step()`, `engine.reference()`,
`engine.all_gather(x)`, ... and never branches on parallelism: one process is simply a world of size 1.
"""
import contextlib
import faulthandler
import math
import os
import shutil
import signal
import sys
import warnings
from typing import NoReturn

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import atomic_files
import checkpoint as ckpt
import fp8_rollout as fp8
import merged_lora as merged
import precision
from ema import EMA, OldPolicy
import sequence_parallel as seqpar
from sequence_parallel import data_parallel_size  # noqa: F401 (the loop's batch arithmetic counts data-parallel ranks)

# FSDP2 warns on every call that the transformer returns a view; the loop never modifies outputs in place.
warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def init_distributed(device: torch.device | None = None) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment (env:// rendezvous, any number of nodes); a single process
    gets a world of one through an in-memory store. `device`: the one asked for (the engine's: its model's; "cuda": the
    current GPU), else this process's own. gloo for CPU tensors, and nccl for CUDA ones wherever there are some."""
    world, device = int(os.environ.get("WORLD_SIZE", 1)), torch.device(device or local_device())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():  # (rollout_ranks.split initialised it for the training ranks alone)
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if world > 1:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def local_device() -> torch.device:
    """This process's device: its node-local rank's GPU, or the CPU."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")


def handle_signals() -> None:
    """SIGTERM (torchrun's to every worker when one fails; a scheduler's before a kill) and SIGINT, even inherited
    ignored (a shell's background job), stop a run as Ctrl-C does, on every rank; SIGUSR1 prints all threads' stacks."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def shutdown() -> None:
    """Leave the process group (idempotent); also after an error."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(status: int | str) -> NoReturn:
    """End a process that ran collectives, as `sys.exit(status)` would, but without the interpreter's teardown.

    Why: a gloo worker thread drops its reference to a collective's tensors a moment after `wait()` has returned,
    and that needs the GIL. If the main thread reaches the interpreter's teardown first (an error right after a
    collective, a short rank), the thread asking for the GIL is ended mid-destructor and the process aborts with
    "terminate called without an active exception" (SIGABRT, exit 134), after a run that succeeded: about one in
    twenty two-rank runs of a short test on 2 cores. `destroy_process_group` does not stop those threads. Files
    the project writes are closed when written; here stdout and stderr are flushed."""
    if isinstance(status, str):
        sys.stderr.write(status.rstrip("\n") + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 1)


def assign_images(n_images: int, optimizer_steps: int, world_size: int, seed: int, unit: int = 1) -> torch.Tensor:
    """(world, images per rank) image indices (dp, B): a seeded shuffle of the iteration's images in units of `unit`
    consecutive ids kept together (1; a group's G images for DGPO), cut into optimizer steps, each step split evenly
    over the ranks. Optimizer step k trains the same images whatever the world size, so one process and N ranks take
    the same steps (up to the order of floating-point sums)."""
    perm = torch.randperm(n_images // unit, generator=torch.Generator().manual_seed(seed))
    perm = (perm[:, None] * unit + torch.arange(unit)).flatten()  # unit 1: the shuffle itself
    return perm.view(optimizer_steps, world_size, -1).transpose(0, 1).reshape(world_size, -1)


def compile_blocks(blocks, backend: str = "inductor") -> None:
    """torch.compile each block: one code object, several graphs, the rollout's (no grad) and the update's, the first
    block's input without grad and the others' with, a text mask or none, a new text length (then dynamic): 7 for the
    tiny recipe (TORCH_LOGS=recompiles), one short of dynamo's default limit, past which it runs the rest eager.
    Inductor rounds as eager does: in bf16 it otherwise keeps a fused chain of operations in float32 where eager rounds
    each output, and the update's graph rounds what it saves for backward where the rollout's does not, so the two
    graphs' log-probs differ (`--model tiny --mixed-precision --compile`: train/logp_gap 1.1e-4 and 8.5e-5 on CPU,
    0 with the casts emulated) and the first update would not be on-policy."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._inductor.config.emulate_precision_casts = True
    for block in blocks:
        block.compile(backend=backend)


class Engine:
    """Trains `model.transformer` in place: LoRA → activation checkpointing → sequence parallelism → compile → FSDP2
    (where it shards; `shard=True` forces it on a world of one) → AdamW. `dp_rank`, `dp_size`: the data-parallel rank
    and size, which the loop splits images by (an --sp group's ranks hold the same images)."""

    def __init__(self, model, *, lora_rank: int, lora_alpha: float, lora_targets, lr: float, weight_decay: float,
                 max_grad_norm: float, seed: int, full_finetune: bool = False, activation_checkpointing: bool = False,
                 compile: bool = False, mixed_precision: bool = False, offload: bool = False,
                 shard_text_encoder: bool = False, ema_decay: float = 0.0, ema_every: int = 8, ema_repeat: int = 1,
                 ema_form: str = "flow-grpo", sp: int = 1, old_policy: bool = False, shard: bool | None = None,
                 merged_lora: bool = False, fp8_rollout: bool = False):
        self.rank, self.world_size, self.device = init_distributed(model.device)  # the model's device, as asked
        self.mesh = seqpar.device_mesh(self.world_size, sp, self.device)  # (dp, 1, sp); FSDP2 shards over all of it
        self.dp_rank, self.dp_size = self.mesh.get_local_rank("dp"), self.mesh.size(0)
        self.model, self.max_grad_norm, self.skipped_steps, self.referencing = model, max_grad_norm, 0, False
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
        if mixed_precision:  # fp32 master weights for what trains (a GPU loads the model in bf16, where AdamW's steps
            for p in net.parameters():  # of lr 1e-5 moved 16% of full-finetune weights); FSDP computes in bf16
                if p.requires_grad:
                    p.data = p.data.float()
        # 2. Activation checkpointing inside each block (before compile, so the recompute is compiled too).
        if activation_checkpointing:
            net.enable_gradient_checkpointing()
        if sp > 1:  # 2b. diffusers' Ulysses attention over each --sp group (hooks inside the blocks, before sharding)
            seqpar.enable_ulysses(model, self.mesh, self.device)
        # 2c. bf16 compute: the root and every block receive their floating inputs in bf16, as FSDP2's policy casts
        #     them, and also when activation checkpointing recomputes a block in the backward, where FSDP2 before torch
        #     2.13 skips its cast (pytorch#159359: the recompute saw float32 RoPE tables where the forward had bf16).
        if mixed_precision:
            precision.cast_inputs_to_bf16([*model.blocks, net])
        # 3. Compile each block separately (small graphs, compiled once, reused by every block).
        if compile:
            compile_blocks(model.blocks)
        # 4–5. Shard each block, then the root (its remaining parameters: embeddings, norms, projections),
        #      so a block's parameters are gathered just before it runs and freed right after. Only where sharding
        #      does something (`shard` None: several ranks, CPU offload, --sp, or all weights trained in bf16): over a
        #      world of one FSDP2 shards nothing, yet its hooks, copies and casts nearly double the host's work per
        #      block (bench/overhead.py, "host ops per block"), so the module stays plain and a LoRA computes in bf16 from
        #      working copies (precision.py: FSDP2's mixed precision without FSDP2).
        self.sharded = (self.world_size > 1 or offload or sp > 1 or (mixed_precision and full_finetune)) \
            if shard is None else shard
        if mixed_precision and not self.sharded:
            precision.bf16_working_copies(net)
        if merged_lora:  # --merged-lora: each LoRA layer through one bf16 weight, base and adapter summed
            if self.sharded or not mixed_precision or full_finetune:
                raise ValueError("--merged-lora needs --mixed-precision, a LoRA and one process that shards nothing")
            merged.merge_adapters(net)
        self.fp8_layers = []  # --fp8-rollout: the rollout's frozen linear layers in float8, the update's in bf16
        if fp8_rollout:
            if self.sharded or not mixed_precision or full_finetune or merged_lora:
                raise ValueError("--fp8-rollout needs --mixed-precision, a LoRA unmerged and one process that shards "
                                 "nothing")
            self.fp8_layers = fp8.quantise_frozen(model.blocks)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
            else MixedPrecisionPolicy()
        kw = dict(mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if offload
                  else OffloadPolicy(), mesh=init_device_mesh(self.device.type, (self.world_size,)))  # this device's
        for module in [*model.blocks, net] if self.sharded else []:
            fully_shard(module, **kw)
        # The rollout keeps what it gathers (rollout_weights) where the whole transformer, unsharded, takes at most half
        # of the device's memory free now (the least of any rank's: ranks that kept and ranks that gathered would call
        # FSDP2's collectives apart, and wait on each other for ever), and nothing is offloaded
        free = torch.tensor([float(torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else
                                   psutil.virtual_memory().available)], dtype=torch.float64, device=self.device)
        dist.all_reduce(free, op=dist.ReduceOp.MIN)
        whole = sum(p.numel() for p in net.parameters()) * (2 if mixed_precision else 4)
        self.keep_gathered = self.sharded and not offload and whole <= free.item() / 2
        if sp > 1:  # an --sp rank's gradient is a partial sum over its tokens: sum them, average over data parallelism
            seqpar.sum_over_sequence([*model.blocks, net], self.dp_size)
        if shard_text_encoder and self.sharded:  # frozen, only forwards: shard it to save memory on every rank
            for module in model.text_encoder_shards():
                fully_shard(module, mesh=kw["mesh"])
        named = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]  # (of this rank's shards)
        self.ema = EMA(named, ema_decay, ema_every, ema_repeat, ema_form) if ema_decay > 0 else None
        self.old = OldPolicy(named) if old_policy else None  # DiffusionNFT's and AWM's v_old, likewise
        if not self.params:
            raise ValueError(f"--lora-targets {list(lora_targets)} matched no module of the transformer")
        # foreach: batched over parameters (on CPU the default per-tensor loop cost ~4× more per step, bench/overhead.py);
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
        if self.ema:  # skipped steps count, as Flow-GRPO's step counter
            self.ema.step()
        return norm, skipped

    def ema_weights(self):
        """The EMA weights for the duration (evaluation, export) with --ema-decay > 0; the trained ones otherwise."""
        return self._swapped(self.ema)

    def old_weights(self):
        """The old policy's weights for the duration (the forward-process algorithms' v_old; DiffusionNFT's rollout)."""
        return self._swapped(self.old)

    @contextlib.contextmanager
    def _swapped(self, shadow: EMA | None):
        """`shadow`'s weights in the model for the duration (none: the trained ones). FSDP2 keeps the root module's
        gathered parameters after a forward (it expects the backward next), so a forward would not see the root's
        swapped shards: the root is resharded as the weights change, and re-gathers them at its next forward."""
        if shadow is None:
            yield
            return
        with shadow.swapped():
            reshard = self.model.transformer.reshard if self.sharded else (lambda: None)  # a plain module: nothing kept
            reshard()
            try:
                yield
            finally:
                reshard()  # before the restore: after it, the trained ones are gathered anew

    @contextlib.contextmanager
    def rollout_weights(self):
        """The rollout's forwards on each block's weights gathered once, freed at the end (`keep_gathered`). Without,
        FSDP2 gathers a block before each forward and frees it after: the whole model at each of a rollout's steps and
        CFG branches, 40 GB per pass and rank for Qwen-Image. The same values either way: the same bits. With
        --fp8-rollout, the frozen linear layers multiply in float8 here (fp8_rollout.py)."""
        if not self.keep_gathered:
            with fp8.rollout(self.fp8_layers):
                yield
            return
        for block in self.model.blocks:
            block.set_reshard_after_forward(False)
        try:
            yield
        finally:
            for block in self.model.blocks:
                block.set_reshard_after_forward(True)
                block.reshard()

    @contextlib.contextmanager
    def reference(self):
        """The reference policy: the same network with the adapter disabled (no second copy in memory)."""
        if self.lora_config is None:
            raise ValueError("--kl-beta > 0 needs a LoRA (the reference is the network with the adapter off)")
        self.model.transformer.disable_adapters()
        self.referencing = True  # read by regularisers.Watched: a reference pass the loss and NormGuard can share
        try:
            yield
        finally:
            self.referencing = False
            self.model.transformer.enable_adapters()

    # --- collectives -------------------------------------------------------------------------
    def all_gather(self, x) -> torch.Tensor:
        """Every data-parallel rank's (n, ...) tensor or array, in dp-rank order: (dp_size·n, ...), on the CPU."""
        x = torch.as_tensor(x).to(self.device).contiguous()
        parts = [torch.empty_like(x) for _ in range(self.dp_size)]
        dist.all_gather(parts, x, group=self.mesh.get_group("dp"))
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

    # --- LoRA export -------------------------------------------------------------------------
    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's full tensors (gathered from the shards; a collective: call on every rank)."""
        from peft.utils import get_peft_model_state_dict
        sd = get_peft_model_state_dict(self.model.transformer)
        return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().float().cpu() for k, v in sd.items()}

    def export_lora(self, directory: str) -> None:
        """The adapter in diffusers' format (`pipe.load_lora_weights(directory)`), α kept in its metadata;
        written atomically by rank 0. Ends with a barrier, also without an adapter (save_checkpoint relies on it)."""
        if self.lora_config is None:
            return self.barrier()
        with self.ema_weights():  # written inside: in a world of one the state's tensors are the live weights
            state = self.lora_state_dict()
            if self.is_main:
                atomic_files.remove_temporaries(os.path.dirname(directory))  # what an interrupted export left
                tmp = atomic_files.temporary(directory)
                config = self.lora_config.to_dict()  # peft keeps target_modules as a set: listed in hash order,
                config["target_modules"] = sorted(config["target_modules"])  # another each process, unless sorted
                self.model.save_lora(tmp, state, config)
                atomic_files.replace_dir(tmp, directory)
        self.barrier()

    # --- checkpoints -------------------------------------------------------------------------
    # Trainable weights and optimizer state only: the frozen base model comes from its weights. Loading is
    # strict through dcp.load (every requested key must be in the checkpoint, with its shape); `strict=False`
    # only lets `set_state_dict` accept a state dict without the frozen keys.
    _OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)

    def _ema_state(self) -> dict:  # the shadows' own tensors: the EMA and the old policy
        return {k: v.state_dict() for k, v in (("ema", self.ema), ("old", self.old)) if v}

    def _state(self):
        return get_state_dict(self.model.transformer, self.optimizer, options=self._OPTIONS)

    def save_checkpoint(self, directory: str, meta: dict, keep: int, extra=None) -> None:
        """Write `directory` atomically: everything goes to a temporary directory renamed when complete, so a crash at
        any moment leaves the previous checkpoints intact; `extra(dir)`, if given, adds a rank's own files to it. `meta` (JSON: the loop's state, the run's flags and id)
        goes to meta.json with a SHA-256 manifest of every other file. Keeps this run's newest `keep`. A failure to
        write (a full disk) removes the temporary directory and stops the run in one line (checkpoint.write_error)."""
        root = os.path.dirname(directory)
        tmp = self.broadcast_object(atomic_files.temporary(directory))  # rank 0's name
        try:
            if self.is_main:
                atomic_files.remove_temporaries(root)  # what an interrupted write left (no other run writes here)
                os.makedirs(tmp)
            self.barrier()
            model_sd, optim_sd = self._state()
            dcp.save({"model": model_sd, "optim": optim_sd, **self._ema_state()},
                     checkpoint_id=os.path.join(tmp, "dcp"))
            ckpt.save_rng_state(os.path.join(tmp, f"rng_rank{self.rank}.safetensors"))
            if extra is not None:
                extra(tmp)
            self.export_lora(os.path.join(tmp, "lora"))  # ends with a barrier: every rank's files are written
            if self.is_main:
                ckpt.write_meta(tmp, dict(meta, world_size=self.world_size))
                atomic_files.replace_dir(tmp, directory)
        except (OSError, CheckpointException) as e:
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise ckpt.write_error(e, directory) from None
        if self.is_main:  # the new checkpoint is whole: an older one that cannot be removed is said, the run goes on
            for old in ckpt.list_checkpoints(root, run_id=meta["run_id"])[:-keep]:
                gone = atomic_files.temporary(old)  # renamed first: what a kill mid-delete leaves, the next save's
                try:  # remove_temporaries finishes (an iter_N without its meta.json: nothing did)
                    os.rename(old, gone)
                    shutil.rmtree(gone)
                except OSError as e:  # the next save tries again; a disk that fills meanwhile stops the run, naming it
                    print(f"warning: checkpoint {directory} was written, but an older one could not be removed ({e}): "
                          "the run goes on and the next checkpoint tries again", file=sys.stderr)
        self.barrier()

    def load_checkpoint(self, directory: str) -> dict:
        """Restore the trained weights, optimizer and RNG states (strictly) from a checkpoint that resolve_resume
        checked against its manifest; returns meta.json's content."""
        meta = ckpt.read_checkpoint_meta(directory)
        if not self.optimizer.state:  # AdamW creates its state lazily: make it (lr 0, no decay) so it can be filled
            for group in self.optimizer.param_groups:
                group.update(lr=0.0, weight_decay=0.0)
            self.optimizer.step()
        model_sd, optim_sd = self._state()
        ema = self._ema_state()  # the EMA's own tensors: dcp.load fills them in place
        try:
            dcp.load({"model": model_sd, "optim": optim_sd, **ema}, checkpoint_id=os.path.join(directory, "dcp"))
            set_state_dict(self.model.transformer, self.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                           options=self._OPTIONS)
            if meta["world_size"] == self.world_size:
                ckpt.load_rng_state(os.path.join(directory, f"rng_rank{self.rank}.safetensors"))
        except (Exception, CheckpointException) as e:  # DCP's error is a BaseException; we name the file and the fix
            try:  # removed or rewritten since its meta.json was read above: pruned by its own run, still running
                same = ckpt.read_checkpoint_meta(directory)["sha256"] == meta["sha256"] and \
                    ckpt.listing(directory) == meta["sizes"]
            except (OSError, ValueError):
                same = False
            if not same:
                raise ValueError(f"--resume: {directory} was removed or changed while this run loaded it (the run that "
                                 "wrote it prunes its older checkpoints): copy it out of that run's directory while it "
                                 "is there and --resume the copy, or resume one that run keeps") from None
            raise RuntimeError(f"checkpoint {os.path.join(directory, 'dcp')} could not be loaded: {e}. It was written "
                               "by a different model/LoRA; resume from another checkpoint") from e
        for group in self.optimizer.param_groups:  # the checkpoint's hyper-parameters yield to this run's flags
            group.update(self.hyper)
        # on another number of ranks every random draw of the loop derives from (seed, iteration): exact, up to rounding
        if meta["world_size"] != self.world_size and self.is_main:
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


