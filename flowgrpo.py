"""Flow-GRPO: online reinforcement learning of a flow-matching text-to-image model, in one loop.

Each iteration samples G images for each of P prompts with a stochastic (SDE) sampler that records
the log-probability of every trained transition, scores the images, turns rewards into group-relative
advantages, and takes PPO-clip steps on the policy (a LoRA on the transformer). Math, recipes and
their sources: docs/algorithm.md. The flags are checked in startup.py before anything is built; the
update rules, Flow-GRPO's loss among them, are in algorithms.py.

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
from dataclasses import dataclass
from typing import Literal

import numpy as np
import psutil
import torch
from tqdm import tqdm

import algorithms
import checkpoint
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
import rollout_ranks
import rundir
import runlog
import startup


@dataclass(frozen=True)
class Args:
    """Flow-GRPO training (docs/algorithm.md). `--recipe` (or `--model` alone) picks a recipe, whose values are the
    defaults shown here. A bare `python flowgrpo.py` is `--model tiny`, the CPU demo; `--model qwen-image --help`
    shows that recipe. Flags given override the recipe. Recipes: recipes.py; their sources: docs/algorithm.md §7."""
    recipe: str = "tiny"
    """the named configuration (recipes.py) whose values are the defaults shown here (unset: the one --model names)"""
    model: Literal[models.MODELS] = "tiny"  # the registry's names (models.SPECS), each a choice of --model
    """Qwen-Image, SD3.5-Medium, FLUX.1-dev or Wan2.1 T2V; FLUX.1 Kontext-dev, Qwen-Image-Edit edit (--prompts: a
    .jsonl, a source image a line); tiny*: their classes at toy size, random weights; nano: tiny Qwen-Image pretrained
    on handwritten digits (docs/algorithm.md §15); nano-compose: GenEval's questions drawn with them (docs/tasks.md)"""
    model_path: str | None = None
    """hub id or local pipeline directory; unset: the family's published weights, or for `tiny` random ones"""
    run_dir: str | None = None
    """output directory; a new run refuses one that holds a run (unset: runs/<model>-<reward>-<timestamp>)"""
    seed: int = 0
    """seed of the model init (tiny), LoRA init, prompt order, windows and all sampling noise"""
    iterations: int = 30
    """total number of iterations (rollout + update), counting those before a --resume"""
    prompts: str = "general"
    """prompt set: a built-in name (ocr, general, digits) or a .txt / .jsonl file (docs/running.md)"""
    reward: str = "brightness"
    """a reward, or a weighted list `ocr=1.0,pickscore=0.5`; also `remote=URL` and `judge:match=URL` (README)"""
    group_size: int = 8
    """G: images per prompt; advantages compare images within a group"""
    prompts_per_iteration: int = 4
    """P: prompts per iteration (P·G images per iteration, split over ranks)"""
    micro_batch: int = 8
    """images per transformer call, in rollout and in training; 0: the largest that fits the device's memory, measured
    once the model is built (memory.py; a CPU: 8 or fewer)"""
    rollout: Literal["local", "vllm-omni"] = "local"
    """who samples: the trainer's own model (`local`) or vLLM-Omni servers running omni/pipeline.py"""
    rollout_url: str | None = None
    """vLLM-Omni server URLs for `--rollout vllm-omni`, comma-separated (http://HOST:PORT,...)"""
    rollout_ranks: int = 0
    """with torchrun and --rollout local: the last R ranks only sample, receiving the LoRA after each update and sending
    the trajectories back (rollout_ranks.py); 0: every rank samples its own images"""
    off_policy: int = 0
    """1: iteration k+1 samples (on the vLLM-Omni servers or --rollout-ranks) under the weights before k's update while
    k trains; 0: in turn (docs/running.md#rollout-and-training-at-once)"""
    stale_correction: Literal["bypass", "decoupled"] = "bypass"
    """the ratio of samples from older weights: against their recorded log-probs (Flow-GRPO's, verl's bypass mode), or
    decoupled PPO (against log-probs recomputed under the update's starting weights, truncated importance weights)"""
    is_cap: float = 2.0
    """decoupled: each transition's importance weight π_current/π_behaviour is truncated at this (verl's default)"""
    reject_band: float = 0.0
    """decoupled: a transition whose |log π_current/π_behaviour| exceeds this weighs 0 in the loss (0 = off)"""
    optimizer_steps: int = 2
    """K: optimizer steps per iteration, each on 1/K of its images (1: every ratio is 1, the clip never acts)"""
    reuse_rollout_forward: bool = False
    """grpo: the first optimizer step trains on the rollout's forwards of its images, kept with their graphs (their
    activations held until the rewards are in), not repeated: the same update to the bit (docs/algorithm.md §8)"""
    height: int = 32
    """image height in pixels"""
    width: int = 32
    """image width in pixels"""
    num_frames: int = 1
    """frames per video (4·k + 1) for a video --model; 1 for images"""
    num_steps: int = 4
    """sampling steps in rollout (training-time denoising reduction)"""
    eval_steps: int = 8
    """ODE steps for evaluation images"""
    cfg_scale: float = 1.0
    """two-pass CFG w: Qwen-Image's true CFG or SD3's standard CFG (1 = none; FLUX takes --guidance instead)"""
    guidance: float | None = None
    """FLUX's distilled guidance embedding, one pass per step (unset: the pipeline's 3.5; only for FLUX)"""
    negative_prompt: str = " "
    """negative prompt for two-pass CFG"""
    algorithm: Literal["grpo", "gardo", "nft", "awm", "dgpo", "dpo"] = "grpo"
    """the update (docs/algorithm.md §12): Flow-GRPO's PPO-clip on SDE log-probs (GARDO: with its advantages and gated
    KL, §17), or DiffusionNFT, AWM, DGPO on ODE images, or online Diffusion-DPO on SDE ones"""
    sde_type: Literal["sde", "cps", "dance"] = "sde"
    """stochastic step (docs/algorithm.md §2, §10): Flow-GRPO's SDE, coefficients-preserving, or DanceGRPO's"""
    noise_level: float = 0.7
    """SDE noise level a (> 0; < 1 for cps)"""
    window: int = 0
    """trained SDE steps per image, consecutive; 0 = full mode (every step but the last)"""
    window_range: tuple[int, int] = (0, 3)
    """[lo, hi): the window lies inside these step indices"""
    window_schedule: Literal["random", "sliding"] = "random"
    """where each iteration's window lies: uniformly in --window-range, or MixGRPO's window sliding later"""
    slide_every: int = 25
    """iterations between moves of the sliding window (MixGRPO: 25, MixGRPO-Flash: 20)"""
    branch: bool = False
    """Flow-GRPO-Fast: a group shares its noise and ODE path up to the window, then branches (needs --window)"""
    prefix_kv_cache: bool = False
    """Qwen-Image 2.1: the rollout keeps each prompt's keys and values from its first step, the update recomputes them
    (train/logp_gap on the tiny twins in float32: 0, with --compile 4e-8; bf16 unmeasured: docs/algorithm.md §11)"""
    ode_solver: Literal["euler", "dpm2", "dpm2-full"] = "euler"
    """the ODE steps after the window (nft, awm: all): Euler, DPM-Solver++(2M) on MixGRPO-Flash's 0.4·(K + 1) σ
    points, or DPM-Solver++(2M) on every step"""
    guard: Literal["none", "full", "ratio-norm", "reweight"] = "none"
    """GRPO-Guard (`full`): its ratio normalisation and its per-step gradient reweight (1/|dt|); or one alone"""
    trust_region: Literal["clip", "dppo"] = "clip"
    """PPO's clip of the ratio at 1 ± --clip-range, or Flow-DPPO's mask: a step's −A·ratio is dropped where its exact
    KL to the behaviour transition exceeds --dppo-threshold and the ratio already moved the way A pushes it"""
    dppo_threshold: float = 1e-5
    """Flow-DPPO's KL threshold, per latent element of a transition (UniRL's kl_mask_threshold)"""
    cps_density: Literal["public", "exact"] = "public"
    """the cps log-density in the ratio: Flow-GRPO's −mean((x' − μ)²), or the exact Gaussian one as for sde"""
    ema_decay: float = 0.0
    """EMA decay of the trained weights in [0, 1), used for evaluation and <run-dir>/lora (0 = off; SD3 recipe: 0.9)"""
    ema_every: int = 8
    """optimizer steps between EMA updates (flow-grpo: decay min((1 + n)/(10 + n), --ema-decay) at step n)"""
    ema_repeat: int = 1
    """M: the update applied M times in a row where it fires (Flow-GRPO: once per micro-batch, M per optimizer step)"""
    ema_form: Literal["flow-grpo", "dance"] = "flow-grpo"
    """Flow-GRPO's EMA (a warm-up, when n + 1 is a multiple of K) or DanceGRPO's (constant decay, when K divides n)"""
    clip_range: float = 1e-3
    """PPO clip ε on the probability ratio (`tiny`'s: the scale of its second step's ratios, docs/algorithm.md §7)"""
    adv_clip: float = 5.0
    """advantages are clipped to [−adv_clip, adv_clip] (> 0)"""
    std: Literal["global", "group"] = "global"
    """normalise advantages by the whole batch's reward std or by each group's"""
    zero_advantage: Literal["drop", "keep"] = "drop"
    """images whose advantage is exactly 0: left out of their optimizer step's loss mean, or trained with A = 0"""
    kl_beta: float = 0.0
    """β of the KL to the reference model (adapter disabled); 0 skips the reference pass"""
    kl_form: Literal["public", "exact"] = "public"
    """the KL: Flow-GRPO's mean((μ − μ_ref)²)/(2·s_t²), or the exact Gaussian KL (sde: 1/|dt| times larger)"""
    normguard: float = 0.0
    """NormGuard's λ (any --algorithm; 0 = off): λ·mean(max(0, ‖v_θ‖/‖v_ref‖ − 1 − margin)) on every trained forward"""
    normguard_margin: float = 0.0
    """NormGuard's margin m: the relative velocity-norm excess over the reference that goes unpenalised"""
    gardo_proxies: tuple[str, ...] = ()
    """gardo: the rewards of --reward (weight 0) whose ranks against the trained reward's gate the KL (public: two)"""
    gardo_features: Literal["pixels"] = "pixels"
    """gardo: what an image's diversity in its group is measured on (public: DINOv3 features, not shipped)"""
    gardo_kl_threshold: float = 3e-4
    """gardo: an optimizer step's mean KL term above this resets the KL's reference to the trained weights"""
    gardo_reset_every: int = 15
    """gardo: the reference is reset at the latest when more than this many iterations have passed since the last"""
    nft_beta: float = 1.0
    """DiffusionNFT's β: the implicit policies β·v + (1 − β)·v_old and (1 + β)·v_old − β·v (> 0)"""
    old_decay: Literal["nft0", "nft1", "nft2", "nft2-iterations", "awm", "dgpo"] = "nft1"
    """the old policy's decay schedule (nft, awm, dgpo): DiffusionNFT's decay_type 0/1/2, verl-omni's, AWM's, DGPO's"""
    old_every: int = 1
    """iterations between the old policy's updates (nft, awm, dgpo; dpo: copies of the trained weights, its reference)"""
    old_kl: float = 1.0
    """AWM: weight of the mean squared velocity gap to the old policy (its ema_beta; 0 skips the old pass)"""
    dgpo_beta: float = 100.0
    """DGPO's β (its beta_dpo): the scale of a group's summed error gaps inside its weight σ(·)"""
    dgpo_reference: Literal["base", "old"] = "base"
    """DGPO's reference for those gaps: the model without the adapter, or the old policy (its use_ema_ref)"""
    dgpo_switch: int = 500
    """DGPO samples with its old policy once more than this many optimizer steps are done (its switch_ema_ref)"""
    dpo_beta: float = 100.0
    """DPO's β: the scale of the pair's error gaps to the reference inside −log σ(·)"""
    train_timesteps: int = 3
    """T: timesteps per image the forward-process update trains at (nft: distinct steps; awm: one per stratum)"""
    train_timestep_range: tuple[int, int] = (0, 4)
    """[lo, hi): the schedule steps (of --num-steps) the forward-process update draws its timesteps from"""
    lr: float = 1e-2
    """AdamW learning rate"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip; a non-finite norm skips the step"""
    lora_rank: int = 8
    """LoRA rank r"""
    lora_alpha: float = 16
    """LoRA α (scale α / r; > 0)"""
    lora_targets: tuple[str, ...] = models.QwenImage.lora_targets
    """transformer module names that get a LoRA"""
    full_finetune: bool = False
    """train every transformer weight instead of a LoRA (use --offload for optimizer-state offload)"""
    mixed_precision: bool = False
    """FSDP2 mixed precision: bf16 compute and gathers, fp32 gradient reduction and fp32 trained weights"""
    offload: bool = False
    """FSDP2 CPU offload of the sharded parameters, gradients and optimizer state"""
    activation_checkpointing: bool = False
    """recompute each transformer block's activations in backward instead of storing them"""
    compile: bool = False
    """torch.compile each transformer block (one graph per kind of call, reused by all; tiny: logp_gap 0 measured)"""
    shard_text_encoder: bool = False
    """shard the frozen text encoder with FSDP2 too (saves memory on every rank)"""
    sp: int = 1
    """Ulysses sequence parallelism: N ranks share each image, 1/N of its tokens each (docs/algorithm.md §14)"""
    checkpoint_every: int = 10
    """write a checkpoint every this many iterations and at the end (one process: also when Ctrl-C stops it); 0 = at
    the end only"""
    keep_checkpoints: int = 2
    """how many of this run's newest checkpoints to keep in <run-dir>/checkpoints"""
    resume: str | None = None
    """continue from a checkpoint directory, or `auto` for the newest complete one in --run-dir"""
    allow_change: tuple[str, ...] = ()
    """flags that may differ from the checkpoint's on --resume (e.g. `lr reward`); others must match; args.json logs it"""
    eval_every: int = 20
    """evaluate (ODE, fixed seeds, eval prompts) every this many iterations and at the end; 0 = never"""
    eval_images: int = 8
    """evaluation images: image i shows eval prompt i mod their number, from its own fixed seed (split over ranks)"""
    wandb: bool = True
    """log to wandb on rank 0 (offline unless WANDB_MODE or WANDB_API_KEY says otherwise)"""


RECIPES = {name: startup.recipe_args(Args, name) for name in recipes.RECIPES}  # recipes.py


def batch_arithmetic(a: Args, world_size: int) -> dict:
    """Derived sizes, asserted: images per iteration → optimizer steps → data-parallel ranks → micro-batches."""
    images, k, b = a.prompts_per_iteration * a.group_size, a.optimizer_steps, a.micro_batch or 1  # 0: sized later
    if images % (k * world_size * b):
        raise ValueError(f"P·G = {a.prompts_per_iteration}·{a.group_size} = {images} images per iteration must split "
                         f"into {k} optimizer step(s) × {world_size} rank(s) × whole micro-batches of {a.micro_batch}: "
                         f"choose P·G divisible by {k * world_size * a.micro_batch} (--prompts-per-iteration, "
                         "--group-size, --optimizer-steps, --micro-batch)")
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
    groups = [[i for i, (p, _) in enumerate(evalset) if p == q] for q in dict(evalset)]  # each eval prompt's images
    spread = [images[g].std(0).mean().item() for g in groups if len(g) > 1]  # pixel std across a prompt's images
    parts |= regularisers.velocity_norm_ratio(model, engine, a, [p for p, _ in mine], [m for _, m in mine],
                                              engine.dp_rank * share)  # every run, regularised or not
    return {"eval/reward_mean": scores.mean().item(), **parts} | ({"eval/diversity": np.mean(spread)} if spread else {})


# ---- the loop --------------------------------------------------------------------------------------

def main(a: Args) -> list[dict]:
    resume = startup.check_args(a)  # before any model is built or process group joined
    algo = algorithms.ALGORITHMS[a.algorithm]  # what the rollout records, how advantages weigh, the update
    exchange = rollout_ranks.split(a.rollout_ranks)  # --rollout-ranks R: the world's last R ranks only sample
    if exchange and exchange.is_rollout:
        return rollout_ranks.serve(a, exchange, algo)
    rank, world, device = eng.init_distributed()
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:  # it wins when set (torchrun: 1 per rank)
        # one thread per physical core it may use, split among the node's ranks; more wait on each other (BENCHMARKS.md)
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # (macOS)
        cores = usable * (psutil.cpu_count(logical=False) or 1) // (psutil.cpu_count() or 1)  # not hyper-threads
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    arith = batch_arithmetic(a, eng.data_parallel_size(world, a.sp))
    ckpt, meta = resume or (None, {})
    # The run directory is made ours on rank 0 (a new run never writes into another run's), before anything is built.
    run = eng.on_main(rundir.claim_run_dir, a.run_dir, f"{a.model}-{a.reward}", ckpt, meta,
                      dataclasses.asdict(a) | {"batch_arithmetic": arith})  # a rundir.Claim
    run_dir, prompt_set = run.run_dir, prompt_sets.load_prompts(a.prompts)
    trainset, evalset = prompt_set.train, [prompt_set.eval[i % len(prompt_set.eval)] for i in range(a.eval_images)]
    if rank == 0:
        startup.warn(a)

    # --- build: model → engine (LoRA, FSDP2, optimizer) → reward → prompts → resume -----------------
    model = models.load_model(a.model, a.model_path, device, seed=a.seed, guidance=a.guidance,
                              num_frames=a.num_frames, prefix_kv_cache=a.prefix_kv_cache)
    engine = eng.Engine(model, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, lora_targets=a.lora_targets, lr=a.lr,
                        weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm, seed=a.seed,
                        full_finetune=a.full_finetune, activation_checkpointing=a.activation_checkpointing,
                        compile=a.compile, mixed_precision=a.mixed_precision, offload=a.offload,
                        shard_text_encoder=a.shard_text_encoder, ema_decay=a.ema_decay, ema_every=a.ema_every,
                        ema_repeat=a.ema_repeat, ema_form=a.ema_form, sp=a.sp, old_policy=algo.keeps_old)
    if not a.micro_batch:  # --micro-batch 0: the largest that fits this device's memory, measured (memory.py)
        a = dataclasses.replace(a, micro_batch=memory.fit(model, engine, a, arith["images_per_rank"] // a.optimizer_steps,
                                                          trainset))
        arith = batch_arithmetic(a, eng.data_parallel_size(world, a.sp))
    reward_fn = rewards.make_reward(a.reward)
    scorer = rewards.AsyncRewards(reward_fn)  # scores rollout chunks in a thread while the next ones sample
    sampler = prompt_sets.PromptSampler(len(trainset), a.seed)
    start = 0
    if ckpt:  # --iterations stays the total: continue after the checkpoint's iteration
        loop = engine.load_checkpoint(ckpt)["loop"]
        start, engine.skipped_steps = loop["iteration"] + 1, loop["skipped_steps"]
        sampler.load_state_dict(loop["sampler"])
    backend = rollout_ranks.backend(a, exchange, run_dir, engine)  # its rollout rank, itself, or vLLM-Omni servers
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
    log = runlog.RunLog(run, enabled=engine.is_main, use_wandb=a.wandb, weights=rewards.weights(a.reward))
    if rank == 0:  # the run directory exists from here on (a start that failed before left none to name)
        print(f"run directory: {run_dir}\nbatch arithmetic: " + ", ".join(f"{k}={v}" for k, v in arith.items()))

    def save(it: int) -> int:  # --- 8. checkpoint: atomic, resumable exactly (all randomness: seed and iteration)
        loop = {"iteration": it, "sampler": sampler.state_dict(), "skipped_steps": engine.skipped_steps,
                "wandb_id": log.wandb_id, "prompts_sha256": checkpoint.json_sha256(prompt_set.train)}
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

            # --- 4. group-relative advantages over the whole iteration; keep this rank's images' ------
            adv, zero_std = algorithms.advantages(algo, r_all, a, engine=engine, batch=batch, info=info,
                                                  assignment=assignment)
            batch.advantages = algo.weights(adv[mine], r_all[mine], a).to(engine.device)  # grpo: A; nft: r ∈ [0, 1]; dpo: ±1
            weights = algorithms.ZERO_ADVANTAGE[a.zero_advantage](adv, assignment, a.optimizer_steps)  # (P·G,) by id
            batch.weights = weights[mine].to(engine.device)

            stop.hold(it)  # from the update to the checkpoint the weights are between iterations: finish first
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
        main(startup.parse_args(Args))
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
