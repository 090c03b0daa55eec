"""Flow-GRPO: online reinforcement learning of a flow-matching text-to-image model, in one loop.

Each iteration samples G images for each of P prompts with a stochastic (SDE) sampler that records
the log-probability of every trained transition, scores the images, turns rewards into group-relative
advantages, and takes PPO-clip steps on the policy (a LoRA on the transformer). Math, recipes and
their sources: docs/algorithm.md. The flags, grouped by the phase that reads them, are in args.py and are
checked in startup.py before anything is built; the update rules, Flow-GRPO's loss among them, are in
algorithms.py.

Launch (the same file everywhere; parallelism lives in engine.py only):
    python flowgrpo.py                                           # = --model tiny: random weights, 1 CPU, ~1 min
    python flowgrpo.py --model qwen-image                        # 1 GPU (Qwen/Qwen-Image or --model-path); also
                                                                 # sd3.5-medium, flux.1-dev, tiny-sd3, tiny-flux
    torchrun --nproc_per_node=8 flowgrpo.py --model qwen-image   # 8 GPUs; add --nnodes/--rdzv-endpoint for more

Departures from the Flow-GRPO paper (arXiv 2505.05470) and its public code (docs/algorithm.md §8); the improvements
are named options, off in the public recipes:
1. `--cps-density exact`: the exact Gaussian log-density for `cps` as for `sde` (public: −(x' − μ)²), so a clip range
   means the same trust region for both; it weights step i by 1/(2·std_i²) relative to the public one.
2. `--kl-form exact`: the exact Gaussian KL mean((μ_θ − μ_ref)²)/(2·std²) (public, for sde: / (2·s_t²), |dt| times it).
3. `--ema-repeat 1`: the EMA updated once per firing (public: once per micro-batch, M times on the same weights).
4. `--zero-advantage keep`: images with A = 0 trained (Flow-GRPO's FLUX and Qwen-Image scripts do; its SD3 scripts
   drop them). `drop` leaves them out of the optimizer step's mean over all ranks (public: each rank's mean).
5. One window per iteration, shared by all images and ranks (public Qwen-Image: always step 3).
6. Images are shuffled only when assigned to optimizer steps and ranks; micro-batches are the rollout's
   chunks, never re-mixed, so each iteration's first update runs the rollout's shapes and kernels and is
   exactly on-policy (`train/logp_gap` == 0 in float32). The public code re-shuffles after the rollout.
7. Each image's noise comes from its own generator, seeded by (seed, iteration, image index): images do
   not depend on the number of ranks or the micro-batch size.
8. Qwen-Image's LoRA targets omit `to_out.0` (vLLM-Omni cannot serve it) and `to_add_out`; SD3.5 and FLUX keep
   the public ones. Every family trains in bf16 mixed precision (public SD3.5: fp16). `flux.1-dev` uses the
   built-in `general` prompts (the public PickScore prompt file is not shipped).
9. GRPO-Guard's bias term per image, as its author confirmed (the script averages it over the batch); MixGRPO-Flash
   takes at least one ODE call after the window (it decodes a noisy state where its count leaves none).
10. The `tiny` recipes are toys (32×32, 4 steps, a cheap image-space reward, a large learning rate, a clip range
   measured so that the clip acts in their second step) chosen so that learning is visible on a CPU in a minute or two.
11. `--reuse-rollout-forward`: the first optimizer step trains on the rollout's own forwards, kept with their graphs;
   the public code repeats them. The same update to the bit, 1/K of the training forwards fewer.
12. `--merged-lora` (one process): each LoRA layer computes through one bf16 weight, base and adapter summed, in the
   rollout and in training alike (still exactly on-policy); a layer dispatches what the bare model's does (host work
   per forward 1.16 × bare diffusers' against 1.75 ×; nano's held-out judge 55.7% ± 2.7 against 52.6% ± 2.1 in bf16,
   3 seeds; BENCHMARKS.md). The adapter is rounded into each weight.
13. `--fp8-rollout` (one process): the rollout's frozen linear layers multiply in float8, the update's in bf16. Its
   log-probs are then not the update's: Flow-GRPO needs `--stale-correction decoupled` with it (nano's held-out judge
   56.5% ± 3.4 against bf16's 52.6% ± 2.1; against the float8 log-probs directly, 27.6% ± 3.2); DiffusionNFT trains on
   its samples unchanged (84.9% ± 1.3 against 84.2% ± 1.7). 3 seeds each, BENCHMARKS.md.

Algorithms (`--algorithm`, docs/algorithm.md §12, algorithms.py): `grpo`, the above with its variants below, or the
forward-process `nft` (DiffusionNFT), `awm` (Advantage Weighted Matching), `dgpo` (DGPO, a group preference) and
`dpo` (online Diffusion-DPO, each group's best and worst): a flow-matching loss on the rollout's final latents
re-noised, weighted by the reward. The loop's phases are the same for each.

Variants, each one flag chosen by name from its table (docs/algorithm.md §10); any combination keeps
`train/logp_gap` == 0, 1-vs-N-rank agreement and exact resume:
    --sde-type dance             DanceGRPO's SDE: constant noise level η, score drift        scheduler.py
    --window-schedule sliding    MixGRPO: the window slides later every --slide-every        scheduler.py
    --ode-solver dpm2            MixGRPO-Flash: ODE after the window on 0.4 of its points    scheduler.py
    --branch                     Flow-GRPO-Fast: a group shares its prefix, branches at s     rollout.py
    --guard full                 GRPO-Guard: normalised log-ratio and 1/|dt| step reweight   algorithms.py
    --ema-decay D --ema-every K  EMA weights for evaluation and the exported LoRA             engine.py
"""
import contextlib
import dataclasses
import functools
import os
import time
import traceback

import numpy as np
import psutil
import torch
from tqdm import tqdm

import algorithms
import checkpoint
import cli
import engine as eng
import memory
import models
import offpolicy
import prompts as prompt_sets
import recipes
import regularisers
import reward_http
import rewards
import rollout
import rollout_backends
import rollout_ranks
import rundir
import runlog
import startup
from args import Args


RECIPES = {name: cli.recipe_args(Args, name) for name in recipes.RECIPES}  # recipes.py


def batch_arithmetic(a: Args, world_size: int) -> dict:
    """Derived sizes, asserted: images per iteration → optimizer steps → data-parallel ranks → micro-batches."""
    images, k, b = a.prompts_per_iteration * a.group_size, a.optimizer_steps, a.micro_batch or 1  # 0: sized later
    if images % (k * world_size * b):
        share = images // (k * world_size) if images % (k * world_size) == 0 else 0  # a rank's images a step
        fits = [m for m in range(1, share + 1) if share % m == 0]  # the micro-batches that would split it
        raise ValueError(f"P·G = {a.prompts_per_iteration}·{a.group_size} = {images} images per iteration must split "
                         f"into {k} optimizer step(s) × {world_size} rank(s) × whole micro-batches of {b}: "
                         f"choose P·G divisible by {k * world_size * b} (--prompts-per-iteration, "
                         "--group-size, --optimizer-steps, --micro-batch)"
                         + (f", or --micro-batch {', '.join(map(str, fits))}" if fits else ""))
    if a.eval_every and a.eval_images % world_size:
        raise ValueError(f"--eval-images {a.eval_images} must be divisible by the world size {world_size}")
    per_rank = images // world_size
    # A rank holds its images (3·H·W float32 each) and their trained states (at most 16 latent channels per 8×8
    # pixels, float32): refuse a batch that cannot fit in this machine's memory rather than die in the allocator.
    states = a.window + 1 if a.window else a.num_steps
    need_gib = per_rank * (12 + states) * a.height * a.width * a.num_frames / 2**30
    if need_gib > psutil.virtual_memory().total / 2**30:
        raise ValueError(f"{per_rank} images per rank need about {need_gib:.3g} GiB for their images and latents, more "
                         f"than this machine's {psutil.virtual_memory().total / 2**30:.3g} GiB: lower --group-size or "
                         "--prompts-per-iteration, or use more ranks")
    return dict(images_per_iteration=images, ranks=world_size, images_per_rank=per_rank, micro_batch=a.micro_batch,
                micro_batches_per_rank=per_rank // b, optimizer_steps=k, micro_batches_per_optimizer_step=per_rank // b // k)


# ---- an iteration's rollout phase -------------------------------------------------------------------

def draw(it: int, scorer, *, a: Args, algo, engine, model, backend, reward_fn, trainset, sampler,
         images: bool = True) -> offpolicy.Sampled:
    """Phases 1-3 of iteration `it` on this rank: its prompts and image assignment, the rollout and the rewards,
    scored chunk by chunk by `scorer` while the next chunk samples (or, without one, at the end). `images=False`: the
    plan and the prompts' conditioning only (a resumed rollout in flight, offpolicy.Rollouts.load)."""
    # --- 1. prompts: P per iteration, each repeated G times; a group may span ranks ---------
    span0, passes = time.time(), model.passes  # passes: models_base.Adapter counts
    assignment, steps, chosen = offpolicy.plan(it, a, algo, trainset, sampler, engine.dp_size)
    mine = assignment[engine.dp_rank]
    group = mine // a.group_size  # (B,) global prompt-group id of each of this rank's images
    texts, metadata = [chosen[g][0] for g in group], [chosen[g][1] for g in group]
    if not images:
        cond = model.conditioning(texts, a.negative_prompt, a.cfg_scale, metadata, a.height, a.width)
        batch = rollout.Batch(texts, metadata, group, None, None, None, 0.0, cond, None, ids=mine, iteration=it)
        return offpolicy.Sampled(it, assignment, mine, steps, batch, None, {}, 0.0, 0, version=it)

    # --- 2. rollout: SDE on the trained steps, ODE elsewhere; latents, log-probs, images ----
    def score_chunk(c, x):  # each decoded chunk is scored while the next one samples
        scorer.submit(x, texts[c:c + len(x)], metadata[c:c + len(x)])
    batch = backend.sample(model, texts, metadata, group, mine, steps=steps, num_steps=a.num_steps, height=a.height,
                           width=a.width, cfg_scale=a.cfg_scale, negative_prompt=a.negative_prompt,
                           noise_level=a.noise_level, sde_type=a.sde_type, seed=a.seed, iteration=it,
                           chunk=a.micro_batch, progress=engine.is_main and scorer is not None,
                           on_images=score_chunk if scorer else None, branch=a.branch, ode_solver=a.ode_solver,
                           keep=len(mine) // a.optimizer_steps if a.reuse_rollout_forward else 0)

    # --- 3. rewards: already running since each chunk was decoded (one ahead: scored here, in its thread) ----
    scores, info, wait = scorer.collect() if scorer else (*reward_fn(batch.images.detach().cpu().clone(), texts,
                                                                     [dict(m) for m in metadata]), 0.0)
    return offpolicy.Sampled(it, assignment, mine, steps, batch, scores, info, wait, model.passes - passes,
                             span=(span0, time.time()), version=it)


# ---- evaluation ------------------------------------------------------------------------------------

def seed_groups(evalset: list[tuple[str, dict]]) -> list[list[int]]:
    """The eval images of each (prompt, source image): they differ by their seeds alone (an edit's instruction on
    other sources differs by its source, no measure of diversity)."""
    keys = [(p, m.get("image_sha256")) for p, m in evalset]
    return [[i for i, k in enumerate(keys) if k == q] for q in dict.fromkeys(keys)]


def evaluate(model, engine, reward_fn, evalset, a: Args, it: int, log: runlog.RunLog) -> dict:
    """ODE samples of the eval prompts with fixed seeds, split over ranks; the captioned grid on rank 0."""
    share = a.eval_images // engine.dp_size
    mine = evalset[engine.dp_rank * share:(engine.dp_rank + 1) * share]
    images = rollout.sample_ode(model, [p for p, _ in mine], num_steps=a.eval_steps, height=a.height, width=a.width,
                                cfg_scale=a.cfg_scale, negative_prompt=a.negative_prompt, seed=a.seed,
                                chunk=a.micro_batch, first=engine.dp_rank * share, metadata=[m for _, m in mine])
    scores, info = reward_fn(images, [p for p, _ in mine], [m for _, m in mine])
    scores, images = engine.all_gather(scores), engine.all_gather(images)
    gathered = {k: engine.all_gather(v) for k, v in info.items()}  # (eval_images,) each, in evalset's order
    log.samples(it, images, [f"{p} | {s:.3f}" for (p, _), s in zip(evalset, scores.tolist())], [m for _, m in evalset],
                gathered)
    parts = {f"eval/{k}/mean": v.mean().item() for k, v in gathered.items()}  # e.g. a weight-0 judge
    tags = [m.get("tag") for _, m in evalset]  # GenEval-style categories, where the prompts carry them
    for tag in dict.fromkeys(t for t in tags if t):
        mask = torch.tensor([t == tag for t in tags])
        parts |= {f"eval/{k}/{tag}/mean": v[mask].mean().item() for k, v in gathered.items()}
    spread = [images[g].std(0).mean().item() for g in seed_groups(evalset) if len(g) > 1]  # pixel std across seeds
    parts |= regularisers.velocity_norm_ratio(model, engine, a, [p for p, _ in mine], [m for _, m in mine],
                                              engine.dp_rank * share)  # every run, regularised or not
    return {"eval/reward_mean": scores.mean().item(), **parts} | ({"eval/diversity": np.mean(spread)} if spread else {})


# ---- the loop --------------------------------------------------------------------------------------

def main(a: Args) -> list[dict]:
    prompt_set, resume = startup.check_args(a)  # before any model is built or process group joined
    world = int(os.environ.get("WORLD_SIZE", 1)) - a.rollout_ranks  # training ranks: checked before any group is joined
    arith = batch_arithmetic(a, eng.data_parallel_size(world, a.sp))
    algo = algorithms.ALGORITHMS[a.algorithm]  # what the rollout records, how advantages weigh, the update
    exchange = rollout_ranks.split(a.rollout_ranks)  # --rollout-ranks R: the world's last R ranks only sample
    if exchange and exchange.is_rollout:
        return rollout_ranks.serve(a, exchange, algo)
    rank, world, device = eng.init_distributed()
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # it wins when set (torchrun: 1 per rank)
        # one torch thread: the laptop models' operations are too small to share, and a team of threads waits on itself
        # (on 2 idle cores, nano's recipe took twice as long on two threads as on one: BENCHMARKS.md)
        torch.set_num_threads(1)
    ckpt, meta = resume or (None, {})
    # The run directory is made ours on rank 0 (a new run never writes into another run's), before anything is built.
    run = eng.on_main(rundir.claim_run_dir, a.run_dir, f"{a.model}-{a.reward}", ckpt, meta,
                      dataclasses.asdict(a) | {"batch_arithmetic": arith})  # a rundir.Claim
    run_dir = run.run_dir
    trainset, evalset = prompt_set.train, [prompt_set.eval[i % len(prompt_set.eval)] for i in range(a.eval_images)]
    if rank == 0:
        startup.warn(a)

    # --- build: model → engine (LoRA, FSDP2, optimizer) → reward → prompts → resume -----------------
    # (the reward after the policy: built before it, nano-compose's updates ran 5% slower on a CPU, measured)
    model = models.load_model(a.model, a.model_path, device, seed=a.seed, guidance=a.guidance,
                              num_frames=a.num_frames, prefix_kv_cache=a.prefix_kv_cache)
    engine = eng.Engine(model, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, lora_targets=a.lora_targets, lr=a.lr,
                        weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm, seed=a.seed,
                        full_finetune=a.full_finetune, activation_checkpointing=a.activation_checkpointing,
                        compile=a.compile, mixed_precision=a.mixed_precision, offload=a.offload,
                        shard_text_encoder=a.shard_text_encoder, ema_decay=a.ema_decay, ema_every=a.ema_every,
                        ema_repeat=a.ema_repeat, ema_form=a.ema_form, sp=a.sp, old_policy=algo.keeps_old,
                        merged_lora=a.merged_lora, fp8_rollout=a.fp8_rollout)
    reward_fn = rewards.make_reward(a.reward)  # before the fit: a reward model on the GPU (PickScore's) takes its room
    if not a.micro_batch:  # --micro-batch 0: the largest that fits this device's memory, measured (memory.py)
        a = dataclasses.replace(a, micro_batch=memory.fit(model, engine, a, arith["images_per_rank"] // a.optimizer_steps,
                                                          trainset))
        arith = run.args["batch_arithmetic"] = batch_arithmetic(a, eng.data_parallel_size(world, a.sp))  # args.json's
    scorer = rewards.AsyncRewards(reward_fn)  # scores rollout chunks in a thread while the next ones sample
    sampler = prompt_sets.PromptSampler(len(trainset), a.seed)  # (--seed, iteration): nothing of it to resume
    start = 0
    if ckpt:  # --iterations stays the total: continue after the checkpoint's iteration
        loop = engine.load_checkpoint(ckpt)["loop"]
        start, engine.skipped_steps = loop["iteration"] + 1, loop["skipped_steps"]
        algorithms.resume_state(algo, engine, loop, ckpt, meta["flags"].get("algorithm"))  # e.g. GARDO's controller
    backend = rollout_ranks.RankBackend(exchange, engine) if exchange else rollout_backends.make_backend(  # local, or
        a.rollout, a.rollout_url, run_dir, engine)  # vLLM-Omni servers (a collective)
    plan = functools.partial(draw, a=a, algo=algo, engine=engine, model=model, backend=backend, reward_fn=reward_fn,
                             trainset=trainset, sampler=sampler)

    @contextlib.contextmanager
    def publish(it):  # the weights that sample iteration `it`: current (or DiffusionNFT's old policy), and published
        with algo.behaviour(engine, a, it):
            backend.sync(engine, it)  # vllm-omni: as adapter version `it`
            yield
    rollouts = offpolicy.Rollouts(plan, publish, scorer, engine, a.off_policy, a.iterations)
    if ckpt:
        rollouts.load(ckpt, functools.partial(plan, scorer=None, images=False))  # --off-policy 1: the one in flight
    # the run's judges: its rewards at weight 0, which only people read (GARDO's proxies, also at 0, gate its KL: proxies
    # only where --algorithm reads them, not where a GARDO recipe's run switched to another algorithm)
    proxies = a.gardo_proxies if "gardo_proxies" in algo.flags else ()
    judges = [k for k, w in rewards.weights(a.reward).items() if w == 0 and k not in proxies]
    log = runlog.RunLog(run, enabled=engine.is_main, use_wandb=a.wandb, judges=judges)
    if rank == 0:  # the run directory exists from here on (a start that failed before left none to name)
        print(f"run directory: {run_dir}\nbatch arithmetic: " + ", ".join(f"{k}={v}" for k, v in arith.items()))
        if ckpt:  # said: a resume without --iterations takes the recipe's, which may extend a shorter run
            print(f"resuming {ckpt}: iterations {start}–{a.iterations - 1} of --iterations {a.iterations}")

    def save(it: int) -> int:  # --- 8. checkpoint: atomic, resumable exactly (all randomness: seed and iteration)
        loop = {"iteration": it, "sampler": sampler.state_dict(), "skipped_steps": engine.skipped_steps,
                "wandb_id": log.wandb_id, "prompts_sha256": checkpoint.json_sha256(prompt_set.train),
                **algorithms.saved_state(algo, engine)}  # the algorithm's own, if any (GARDO's gate's controller)
        engine.save_checkpoint(os.path.join(run_dir, "checkpoints", f"{checkpoint.PREFIX}{it:06d}"),
                               {"run_id": run.run_id, "flags": startup.fingerprint(a), "loop": loop},
                               a.keep_checkpoints, extra=rollouts.save)  # with the rollout in flight, if any
        return it

    bar = tqdm(range(start, a.iterations), desc="iterations", disable=not engine.is_main, initial=start,
               total=a.iterations)
    done = saved = start - 1  # the newest iteration trained, and the newest checkpointed
    stop = rundir.Stop(world == 1 and not exchange)  # one process: Ctrl-C keeps the iteration last trained
    previous = time.perf_counter()  # when the last iteration's row was made: perf/iteration_s counts from there
    try:
        for it in bar:
            # --- 1-3. prompts, rollout and rewards (draw): this iteration's, made now; or with --off-policy 1, made
            # under the weights before the last update while it ran (the next one's starts here, in a thread)
            t0, cpu0, passes = time.time(), time.process_time(), model.passes  # time.time(): the spans' clock
            model.transformer.eval()
            got = rollouts.get(it)
            t1, rollout_passes = time.time(), model.passes - passes
            batch, assignment, mine, steps, info, reward_wait = got.batch, got.assignment, got.mine, got.steps, got.info, \
                got.reward_wait
            gathered = engine.all_gather(got.scores)  # (P·G,) in assignment order
            r_all = torch.empty_like(gathered).index_copy_(0, assignment.flatten(), gathered)  # (P·G,) by image id
            rewards.check_iteration(r_all, a.reward)  # a finite mean and spread, or the run stops naming the reward

            stop.hold(it)  # from here to the checkpoint the state is between iterations (GARDO's advantages move its
            # gate's controller): a signal waits till then
            # --- 4. group-relative advantages over the whole iteration; keep this rank's images' ------
            adv, zero_std = algorithms.advantages(algo, r_all, a, engine=engine, batch=batch, info=info,
                                                  assignment=assignment)
            batch.advantages = algo.weights(adv[mine], r_all[mine], a).to(engine.device)  # grpo: A; nft: r ∈ [0, 1]; dpo: ±1
            weights = algorithms.ZERO_ADVANTAGE[a.zero_advantage](adv, assignment, a.optimizer_steps)  # (P·G,) by id
            batch.weights = weights[mine].to(engine.device)

            # --- 5. policy update: grpo's PPO-clip over the trained steps, or a forward-process loss ---------
            model.transformer.train()
            stats = engine.mean_over_ranks(algo.update(model, engine, batch, a, arith, engine.is_main))
            t2 = time.time()

            # --- 6. log -----------------------------------------------------------------------------
            comps = {f"reward/{k}/mean": engine.all_gather(v).mean().item() for k, v in info.items()}
            row = {"iteration": it, "reward/mean": r_all.mean().item(), "reward/std": r_all.std(unbiased=False).item(),
                   "reward/min": r_all.min().item(), "reward/max": r_all.max().item(),
                   "reward/zero_std_ratio": zero_std, **comps, **stats,
                   "perf/rollout_s": t1 - t0 - reward_wait, "perf/reward_wait_s": reward_wait, "perf/train_s": t2 - t1,
                   "perf/rollout_passes": rollout_passes, "perf/train_passes": model.passes - passes - rollout_passes,
                   "perf/cpu_s": time.process_time() - cpu0, "perf/iteration_s": time.perf_counter() - previous}
            previous = time.perf_counter()
            row |= {"train/window_start": steps[0]} if steps else {}  # an ODE-only rollout has no window
            row |= {"rollout_corr/staleness": it - got.version, "time/rollout_start": got.span[0],  # time.time()
                    "time/rollout_end": got.span[1], "time/train_start": t1, "time/train_end": t2} if a.off_policy else {}

            # --- 7. eval every K iterations and at the end ------------------------------------------
            if a.eval_every and (it % a.eval_every == 0 or it == a.iterations - 1):
                model.transformer.eval()
                with engine.ema_weights():
                    row |= evaluate(model, engine, reward_fn, evalset, a, it, log)
            log.log(row)
            if stats["train/skipped_fraction"] == 1:  # every step's gradient norm not finite: a run that learns nothing
                raise ValueError(f"iteration {it}: all {a.optimizer_steps} optimizer steps were skipped, their gradient "
                                 "norms not finite: the run would learn nothing; lower --lr or the flag that scales the "
                                 "loss (e.g. --nft-beta, --old-kl, --kl-beta); its checkpoints are as last written")
            bar.set_postfix(reward=f"{row['reward/mean']:.4f}", **{algo.watch.split("/")[-1]: f"{row[algo.watch]:.1e}"})

            # --- 8. checkpoint (save, above)
            if it == a.iterations - 1 or (a.checkpoint_every and (it + 1) % a.checkpoint_every == 0):
                saved = save(it)
            done = it
            stop.release()  # a Ctrl-C or SIGTERM noted since hold() stops the run here
    except KeyboardInterrupt:  # the iteration last trained is kept (rundir.Stop: when); the error goes on up
        if stop.keeps(done, saved):
            save(done)
        if stop.exports(done) and engine.lora_config:  # its LoRA too, as a finished run's: graded as it stands
            engine.export_lora(os.path.join(run_dir, "lora"))
            print(f"LoRA of iteration {done}: {os.path.join(run_dir, 'lora')} (diffusers: pipe.load_lora_weights(dir))",
                  flush=True)
        if log.rows:  # rank 0: the curve of every row logged (log.close, which draws it at a run's end, is not reached)
            log.draw()
        raise
    finally:  # an error or Ctrl-C too: stop scoring threads and remove exchange files; checkpoints stay as written
        stop.restore()
        rollouts.close()
        scorer.close()
        backend.close()

    # --- 9. the final LoRA, loadable with diffusers' `pipe.load_lora_weights(<run-dir>/lora)` ---------
    engine.export_lora(os.path.join(run_dir, "lora"))
    log.close(lora_dir=os.path.join(run_dir, "lora") if engine.lora_config else None)
    return log.rows


if __name__ == "__main__":
    status = 0
    try:
        eng.handle_signals()  # SIGTERM as Ctrl-C, on every rank; SIGUSR1 prints the stacks
        main(cli.parse_args(Args))
    # bad input, or a peer that failed (a server, a rollout rank): one line naming it (FLOWGRPO_TRACEBACK=1: the stack)
    except (ValueError, FileNotFoundError, reward_http.PeerError) as e:
        status = traceback.format_exc() if os.environ.get("FLOWGRPO_TRACEBACK") else f"flowgrpo.py: error: {e}"
    except KeyboardInterrupt:  # Ctrl-C, or torchrun's SIGTERM after another rank failed: rank 0 says what is left
        status = rundir.interrupted() if int(os.environ.get("RANK", 0)) == 0 else 1
    except Exception:  # anything else: its stack, and the same way out
        status = traceback.format_exc()
    finally:
        eng.shutdown()
        rundir.release_run_dirs()  # a start that failed before training leaves no directory behind
    eng.exit_process(rundir.said_once(status))  # not through the interpreter's teardown, which a gloo thread can abort
