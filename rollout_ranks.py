"""A local rollout on torchrun ranks of its own (`--rollout-ranks R`, docs/running.md#rollout-and-training-at-once).

    torchrun --nproc_per_node=8 flowgrpo.py --model qwen-image --rollout-ranks 2 --off-policy 1   # 6 train, 2 sample

The world's last R ranks only sample; the first T = world − R train (FSDP2, the engine's data-parallel ranks, as if
the world had T ranks: their default process group holds only them). A second process group of every rank, gloo
(CPU tensors, also on GPUs: a LoRA and one iteration's trajectories are small next to the model), carries, point to
point, the weights from training rank 0 to each rollout rank after every update (`RankBackend.sync`: an iteration
number, then the LoRA's tensors in name order), and from each rollout rank to each training rank it serves
(training rank t by rollout rank T + t mod R) that rank's images: latents, log-probs and images (`sample`). A rollout
rank computes each iteration's plan itself (offpolicy.plan: a function of the seed and the iteration), so only
tensors cross; the training rank encodes its prompts and scores its images, as with a vLLM-Omni server. With
`--off-policy 1` the training ranks train while the rollout ranks sample the next iteration; with 0 they wait.
Across nodes: the rollout ranks are the last R of the world, so `--nnodes 2 --nproc_per_node 8 --rollout-ranks 8`
puts sampling on the second node.
"""
import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist

import algorithms
import engine as eng
import models
import offpolicy
import precision
import prompts as prompt_sets
import reward_http
import rollout
import scheduler as sch
from algorithms import need

WEIGHTS, DATA = 1, 2  # the tags of the two kinds of message
TIMEOUT = datetime.timedelta(minutes=30)  # a rollout of one iteration on a GPU takes minutes, not this
SAY_EVERY = 60.0  # seconds between a training rank's lines while it waits on its rollout rank


def check(a, world: int) -> None:
    """--rollout-ranks' start-up checks, before any process group is joined (`world`: torchrun's WORLD_SIZE), and
    --off-policy's (offpolicy.check)."""
    offpolicy.check(a)
    need(a.rollout_ranks >= 0, f"--rollout-ranks must be >= 0, got {a.rollout_ranks}")
    if not a.rollout_ranks:
        return
    need(a.rollout_ranks < world, f"--rollout-ranks {a.rollout_ranks} leaves no rank to train: torchrun gives "
         f"{world}; launch more (--nproc_per_node) or take fewer")
    need((world - a.rollout_ranks) % a.rollout_ranks == 0, f"--rollout-ranks {a.rollout_ranks}: the "
         f"{world - a.rollout_ranks} training ranks must split evenly over them (each serves as many)")
    need(a.rollout == "local" and a.algorithm == "grpo" and not a.full_finetune and a.sp == 1 and
         not algorithms.needs_means(a), "--rollout-ranks: a local rollout of grpo's trajectories with a LoRA, "
         "without --rollout vllm-omni, --full-finetune, --sp, --guard full/ratio-norm or --trust-region dppo (their "
         "transition means are not sent)")


class Exchange:
    """This rank's place in the split world and the group of every rank (raw gloo: no collective of it is used, so
    the training ranks' default group and it never wait on each other)."""

    def __init__(self, rollout_ranks: int):
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.trainers, self.rollout_ranks = self.world - rollout_ranks, rollout_ranks
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world,
                              is_master=self.rank == 0 and not agent, timeout=TIMEOUT)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("flowgrpo-exchange/", store), self.rank, self.world,
                                           TIMEOUT)
        self.is_rollout = self.rank >= self.trainers
        cuda = eng.local_device() if torch.cuda.is_available() else None
        if cuda is not None:  # every rank's, a rollout rank's too: what is made on "cuda" lands on its own GPU
            torch.cuda.set_device(cuda)
        if not self.is_rollout:  # the engine's world: the training ranks alone (engine.init_distributed finds it)
            dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", device_id=cuda, rank=self.rank,
                                    store=dist.PrefixStore("flowgrpo-train/", store), world_size=self.trainers)

    def server(self, trainer: int) -> int:
        return self.trainers + trainer % self.rollout_ranks

    def send(self, tensors, to: int, tag: int, what: str = "") -> None:
        """A training rank's send to a rollout rank (`what`: the weights) waits, and says so, as a receive does: gloo
        sends once the peer has posted its receive, which a frozen rollout rank never does (before: a wait in
        silence, up to TIMEOUT, whenever the rank froze between two iterations' weights)."""
        peer = f"{'rollout' if to >= self.trainers else 'training'} rank {to}"
        try:
            for t in tensors:
                self._wait(self.group.send([t.detach().float().cpu().contiguous()], to, tag),
                           f"{peer} ({what})" if to >= self.trainers else None)
        except RuntimeError as e:  # as in recv
            raise reward_http.PeerError(f"{peer} ({what}): {str(e).splitlines()[0]}") from None

    def recv(self, shapes, source: int, tag: int, what: str) -> list[torch.Tensor]:
        out, peer = [torch.empty(s) for s in shapes], f"{'rollout' if source >= self.trainers else 'training'} rank {source}"
        try:
            for t in out:
                self._wait(self.group.recv([t], source, tag), f"{peer} ({what})" if tag == DATA else None)
        except RuntimeError as e:  # a rank that died: gloo's "connection closed by peer", or the timeout
            raise reward_http.PeerError(f"{peer} ({what}): {str(e).splitlines()[0]}") from None
        return out

    def _wait(self, work, waited_on: str | None) -> None:
        """work.wait(); while it waits on `waited_on` (a training rank on its rollout rank; None: a rollout rank on the
        weights, which wait on training), a thread says so on stderr every SAY_EVERY seconds: a frozen rollout rank
        was waited for in silence up to TIMEOUT. (gloo's work neither completes before wait() nor survives a wait()
        that times out: the wait itself cannot be cut into minutes.)"""
        done = threading.Event()
        if waited_on:
            threading.Thread(target=self._say, args=(done, waited_on), daemon=True).start()
        try:
            work.wait()
        finally:
            done.set()

    def _say(self, done: threading.Event, waited_on: str) -> None:
        said = 0
        while not done.wait(SAY_EVERY):
            said += 1
            print(f"\nflowgrpo.py: rank {self.rank} has waited {said * SAY_EVERY:.0f} s for {waited_on}; it gives up "
                  f"after {TIMEOUT.total_seconds():.0f} s", file=sys.stderr, flush=True)


def split(rollout_ranks: int) -> Exchange | None:
    """Join the split world (before engine.init_distributed, which then finds the training ranks' group)."""
    return Exchange(rollout_ranks) if rollout_ranks else None


class RankBackend:
    """The training ranks' side: `sync` (training rank 0 sends the LoRA to every rollout rank) and `sample` (the rank's
    images from its rollout rank), the local backend's contract; `close` tells the rollout ranks to stop."""

    def __init__(self, exchange: Exchange, engine):
        self.x, self.engine = exchange, engine

    def sync(self, engine, iteration: int) -> None:
        state = engine.lora_state_dict()  # a collective of the training ranks
        if engine.is_main:
            for r in range(self.x.trainers, self.x.world):
                self.x.send([torch.tensor([iteration, len(state)])], r, WEIGHTS, f"iteration {iteration}'s weights")
                self.x.send([state[k] for k in sorted(state)], r, WEIGHTS, f"iteration {iteration}'s weights")

    def sample(self, model, prompts, metadata, group, image_ids, *, steps, num_steps, height, width, cfg_scale,
               negative_prompt, noise_level, sde_type, seed, iteration, chunk, progress=False, on_images=None,
               branch=False, ode_solver="euler", keep=0) -> rollout.Batch:
        b, source = len(prompts), self.x.server(self.engine.dp_rank)
        latent = tuple(model.noise([torch.Generator()], height, width).shape[1:])  # one image's (S, C)
        latents, log_probs, images = self.x.recv([(b, len(steps) + 1, *latent), (b, len(steps)),
                                                  (b, *model.sample_shape(height, width))], source, DATA,
                                                 f"iteration {iteration}'s images")
        sigmas = sch.sigma_schedule(model.scheduler, num_steps, model.image_seq_len(height, width))
        batch = rollout.Batch(list(prompts), list(metadata), torch.as_tensor(group), latents.to(model.device),
                              log_probs.to(model.device), sigmas[steps[0]:steps[-1] + 2], float(sigmas[1]),
                              model.conditioning(list(prompts), negative_prompt, cfg_scale, list(metadata), height,
                                                 width), images, ids=torch.as_tensor(image_ids), iteration=iteration)
        if on_images:
            on_images(0, batch.images)
        return batch

    def close(self) -> None:
        if self.engine.is_main:  # iteration −1: stop (best effort: after an error torchrun stops them anyway)
            try:
                for r in range(self.x.trainers, self.x.world):
                    self.x.group.send([torch.tensor([-1.0, 0.0])], r, WEIGHTS).wait(datetime.timedelta(seconds=10))
            except RuntimeError:
                pass


def serve(a, x: Exchange, algo) -> None:
    """A rollout rank's life: the model with the training ranks' LoRA; for each iteration the weights arrive for,
    the images of the training ranks it serves, sampled by the local backend and sent to each."""
    from peft import LoraConfig  # as the engine does: peft loads diffusers and transformers
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    model = models.load_model(a.model, a.model_path, eng.local_device(), seed=a.seed, guidance=a.guidance,
                              num_frames=a.num_frames, prefix_kv_cache=a.prefix_kv_cache)
    model.transformer.add_adapter(LoraConfig(r=a.lora_rank, lora_alpha=a.lora_alpha, target_modules=list(a.lora_targets)))
    if a.mixed_precision:  # computed as a training rank's Engine computes, to the bit: fp32 masters for the LoRA, bf16
        for p in model.transformer.parameters():  # inputs and working copies (before, fp32 throughout: the first
            if p.requires_grad:  # update's logp_gap 1.9e-4 where it is 0)
                p.data = p.data.float()
        precision.cast_inputs_to_bf16([*model.blocks, model.transformer])
    if a.compile:  # the Engine's order: casts, compile, working copies
        eng.compile_blocks(model.blocks)
    if a.mixed_precision:
        precision.bf16_working_copies(model.transformer)
    model.transformer.eval()
    own = get_peft_model_state_dict(model.transformer)
    names = sorted(own)
    trainset = prompt_sets.load_prompts(a.prompts).train
    sampler = prompt_sets.PromptSampler(len(trainset), a.seed)
    served = [t for t in range(x.trainers) if x.server(t) == x.rank]
    while True:
        head = x.recv([(2,)], 0, WEIGHTS, "the weights")[0]
        it = int(head[0])
        if it < 0:
            return
        got = x.recv([own[k].shape for k in names], 0, WEIGHTS, "the weights")
        set_peft_model_state_dict(model.transformer, {k: v.to(own[k].dtype) for k, v in zip(names, got)})
        assignment, steps, chosen = offpolicy.plan(it, a, algo, trainset, sampler, x.trainers)
        for t in served:
            mine = assignment[t]
            group = mine // a.group_size
            with torch.no_grad():
                batch = rollout.sample(model, [chosen[g][0] for g in group], [chosen[g][1] for g in group], group, mine,
                                       steps=steps, num_steps=a.num_steps, height=a.height, width=a.width,
                                       cfg_scale=a.cfg_scale, negative_prompt=a.negative_prompt,
                                       noise_level=a.noise_level, sde_type=a.sde_type, seed=a.seed, iteration=it,
                                       chunk=a.micro_batch, branch=a.branch, ode_solver=a.ode_solver)
            x.send([batch.latents, batch.log_probs, batch.images], t, DATA, f"iteration {it}'s images")
