"""An iteration's rollout phase (prompts → images → scores), now or one iteration ahead of the update (`--off-policy`,
docs/running.md#rollout-and-training-at-once).

`--off-policy 0` is the synchronous loop: iteration k publishes its weights, samples, scores, then trains. With
`--off-policy 1` the rollout of iteration k+1 runs while iteration k trains: before k's update the trainer publishes
the weights it holds then (version k+1 of the adapter) and sends k+1's requests to the vLLM-Omni servers from a
thread, which also scores the images; the update of k overlaps them. Every batch after the first is thus sampled by
weights one update older than those it trains (its staleness, 1); algorithms.py's --stale-correction decides what the
update makes of that. Weights are published in the main thread (a collective, on every rank), in the same order on
every rank; the thread runs no collective.

The in-flight rollout belongs to a checkpoint (`save`, `load`): each rank writes its share of it (the servers'
latents, log-probs, images and final latents, and the scores) into the checkpoint being written, and a resumed run
trains on exactly those. Sampling it again would need the weights before the last update and servers that repeat
themselves to the bit; the tensors of one iteration cost little.
"""
import fnmatch
import glob
import os
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import checkpoint
import engine as eng
import reward_http
import rollout
from algorithms import need

INFLIGHT = "inflight_rank{}.safetensors"  # a checkpoint's file of a rank's rollout in flight (--off-policy 1)
SAVED = ("latents", "log_probs", "images", "x0", "sigmas")  # the Batch fields the servers returned (x0 may be None)


@dataclass
class Sampled:
    """Iteration `it`'s rollout on this rank: what it trains on, and when it was made."""
    it: int
    assignment: torch.Tensor  # (dp ranks, images per rank): global image ids, the order optimizer steps take them in
    mine: torch.Tensor  # (B,) this rank's row of it
    steps: list[int]  # the recorded (SDE) step indices
    batch: rollout.Batch
    scores: np.ndarray  # (B,) the weighted reward of each of this rank's images
    info: dict  # {reward name: (B,)}
    reward_wait: float  # seconds the caller waited for the rewards after the images were made
    passes: int  # transformer passes the trainer's model made (local rollout)
    span: tuple = field(default=(0.0, 0.0))  # (start, end) of the sampling and scoring, time.time()
    version: int = 0  # the iteration whose weights sampled: `it` when synchronous, it − 1 when one ahead


def plan(it: int, a, algo, trainset: list, sampler, dp_size: int) -> tuple[torch.Tensor, list[int], list]:
    """Iteration it's work, a function of (--seed, it) alone: its image assignment (dp ranks, images per rank) of
    global image ids, the SDE (recorded) steps, and the P chosen (prompt, metadata) pairs, image i's being
    chosen[i // G] (a group may span ranks)."""
    chosen = [trainset[i] for i in sampler.sample(it, a.prompts_per_iteration)]
    assignment = eng.assign_images(a.prompts_per_iteration * a.group_size, a.optimizer_steps, dp_size,
                                   seed=a.seed * 7919 + it, unit=a.group_size if algo.whole_groups else 1)
    return assignment, algo.rollout_steps(a, it), chosen  # steps: grpo's trained ones; nft, awm: none


def check(a) -> None:
    """--off-policy and --stale-correction's start-up checks (startup.check_args)."""
    need(a.off_policy in (0, 1), f"--off-policy must be 0 (synchronous) or 1 (one iteration ahead), got {a.off_policy}")
    need(a.is_cap >= 1 and a.reject_band >= 0, f"--is-cap must be >= 1 and --reject-band >= 0 (0 = off), got "
         f"{a.is_cap}, {a.reject_band}")
    need(a.reject_band == 0 or a.stale_correction == "decoupled", "--reject-band needs --stale-correction decoupled: "
         "the staleness log-ratio it bounds is measured by that correction's proximal pass")
    need(a.algorithm == "grpo" or a.off_policy == 0, f"--off-policy 1: --algorithm {a.algorithm} keeps an old policy "
         "that lags on a schedule of its own (and but for gardo, its loss takes no behaviour log-probs to correct "
         "staleness with): use it with grpo")
    need(a.off_policy == 0 or a.rollout == "vllm-omni" or a.rollout_ranks, "--off-policy 1 needs someone else to "
         "sample while this process trains: --rollout vllm-omni (servers) or --rollout-ranks R (torchrun ranks)")
    need(a.off_policy == 0 or not a.shard_text_encoder, "--off-policy 1 with --shard-text-encoder: the prompts are "
         "encoded in the rollout thread, where a sharded encoder's collectives would interleave with training's")


def check_resume(a, meta: dict, training_ranks: int) -> None:
    """--off-policy 1's resume, at start-up: a checkpoint's rollout in flight is split over its training ranks, so it
    resumes on as many (before: refused once the model was built). One that holds none, though written one ahead, is a
    run's last: extended by a larger --iterations, its next iteration is sampled on the weights after the update
    before it, where the straight run's was sampled one update earlier: the runs part there, and it is said."""
    if not a.off_policy:
        return
    held = len(fnmatch.filter(meta["manifest"], INFLIGHT.format("*")))  # its files, as `load` finds them
    need(not held or held == training_ranks, f"the checkpoint holds a rollout in flight over {held} training rank(s), "
         f"this run has {training_ranks}: resume --off-policy 1 on as many (torchrun's ranks less --rollout-ranks)")
    if not held and meta["flags"].get("off_policy") == 1:
        print(f"warning: the checkpoint ends its --off-policy 1 run: nothing was in flight, so iteration "
              f"{meta['loop']['iteration'] + 1} is sampled on the weights after the update before it (staleness 0), "
              "not one update earlier as in a run that went on straight", file=sys.stderr, flush=True)


class Rollouts:
    """`get(it)`: iteration it's Sampled. `ahead` 0: made now, in this thread, as the loop always did (the local
    backend scores each chunk while the next samples). `ahead` 1: the one started before the previous update,
    and it+1's is started before returning. `draw(it, scorer)` makes one (flowgrpo.draw); `publish(it)` is the
    context in which the weights that sample iteration it are current and published (the behaviour policy, sync)."""

    def __init__(self, draw, publish, scorer, engine, ahead: int, iterations: int):
        self.draw, self.publish, self.scorer, self.engine = draw, publish, scorer, engine
        self.ahead, self.iterations, self.pending = ahead, iterations, None  # pending: (it, Future of Sampled)
        self.worker = reward_http.Workers([None], "rollout-ahead") if ahead else None

    def get(self, it: int) -> Sampled:
        if not self.ahead:
            with self.publish(it):
                return self.draw(it, self.scorer)
        if self.pending is not None and self.pending[0] != it:  # held for another iteration: not this one's rollout
            print(f"warning: the rollout in flight is iteration {self.pending[0]}'s, not {it}'s: iteration {it} is "
                  "sampled again, on the weights held now (staleness 0)", file=sys.stderr, flush=True)
            self.pending = None
        if self.pending is None:  # the first iteration (or a resume from a synchronous run)
            self._start(it, version=it)
        start = time.perf_counter()
        got = reward_http.gather([self.pending[1]])[0]  # the thread's error (a server down) raises here, named
        # in flight until the next one is started (its publish takes seconds): a Ctrl-C meanwhile checkpoints this one
        got.reward_wait, self.pending = time.perf_counter() - start, (it, done(got))
        if it + 1 < self.iterations:
            self._start(it + 1, version=it)
        else:
            self.pending = None
        return got

    def _start(self, it: int, version: int) -> None:
        with self.publish(it):  # the weights held now, as adapter version `it`: a collective, here on every rank
            pass
        self.pending = (it, self.worker.submit(self._sample, it, version))

    def _sample(self, _key, it: int, version: int) -> Sampled:
        span0 = time.time()
        got = self.draw(it, None)  # no scorer: the images are scored at the end, in this thread
        got.span, got.version = (span0, time.time()), version
        return got

    def save(self, directory: str) -> None:
        """Write this rank's rollout in flight (waiting for it) into the checkpoint being written, `directory`."""
        if self.pending is None:
            return
        got = reward_http.gather([self.pending[1]])[0]
        self.pending = (got.it, done(got))
        tensors = {k: getattr(got.batch, k).contiguous().cpu() for k in SAVED if getattr(got.batch, k) is not None}
        tensors |= {"scores": torch.tensor(got.scores)} | {f"info.{k}": torch.tensor(v) for k, v in got.info.items()}
        tensors |= {"span": torch.tensor(got.span, dtype=torch.float64)}  # its time/rollout_* (before: 0 on resume)
        save_file(tensors, os.path.join(directory, INFLIGHT.format(self.engine.rank)),
                  metadata={"iteration": str(got.it), "version": str(got.version), "sigma_max": repr(got.batch.sigma_max),
                            "plan": planned(got)})

    def load(self, directory: str, plan) -> None:
        """Take the rollout in flight that `directory` holds for this rank (--off-policy 1): `plan(it)` gives its
        prompts and conditioning again, the file the servers' tensors and the scores."""
        path, files = os.path.join(directory, INFLIGHT.format(self.engine.rank)), glob.glob(os.path.join(
            directory, INFLIGHT.format("*")))
        if not self.ahead or not files:  # a synchronous run's checkpoint, or the last of a run (nothing in flight)
            return
        need(len(files) == self.engine.world_size and os.path.exists(path), f"{directory} holds a rollout in flight "
             "split over another number of ranks: resume --off-policy 1 on as many training ranks")
        with safe_open(path, "pt") as f:  # its header: the iteration and version, as strings
            meta = f.metadata()
        t = load_file(path, device=str(self.engine.device))
        got = plan(int(meta["iteration"]))
        # A flag changed with --allow-change (--prompts, --seed, --group-size, a window) plans other images: the file's
        # latents and scores would be trained with another plan's prompts (before: silently). Sampled again, on every
        # rank alike (each publishes the weights): an older file, without its plan, is taken as it is.
        now = planned(got)
        if not self.engine.all_gather(torch.tensor([float(meta.get("plan", now) == now)])).all():
            print(f"warning: the rollout in flight in {directory} was sampled for another plan of iteration {got.it} "
                  "(flags changed with --allow-change): it is sampled again, on the weights held now (staleness 0)",
                  file=sys.stderr, flush=True)
            return
        got.batch.latents, got.batch.log_probs, got.batch.images = t["latents"], t["log_probs"], t["images"].cpu()
        got.batch.x0, got.batch.sigmas, got.batch.sigma_max = t.get("x0"), t["sigmas"].cpu(), float(meta["sigma_max"])
        got.scores = t["scores"].cpu().numpy()
        got.info = {k.removeprefix("info."): v.cpu().numpy() for k, v in t.items() if k.startswith("info.")}
        got.version, got.span = int(meta["version"]), tuple(t["span"].tolist()) if "span" in t else got.span
        self.pending = (got.it, done(got))

    def close(self) -> None:
        if self.pending is not None:
            self.pending[1].cancel()
        if self.worker is not None:
            self.worker.close()


def planned(got: Sampled) -> str:
    """What a rollout was sampled for, as a digest: this rank's image ids, the trained steps, prompts and metadata."""
    return checkpoint.json_sha256([got.mine.tolist(), [int(s) for s in got.steps], got.batch.prompts,
                                   got.batch.metadata])


def done(value):
    """A finished Future holding `value`."""
    future = Future()
    future.set_result(value)
    return future

