"""The flags of flowgrpo.py, each documented once: a dataclass per phase of the loop, in the order its reader meets
them, each read by cli.parse_args as a section of `--help` (titled by its name without `Args`, its docstring
below). The run's flags, `Args`, are all of them in one flat dataclass: the loop and every other file read them by name
(`a.lr`), and a checkpoint keeps them flat.
"""
import os
from dataclasses import dataclass
from typing import Literal

import models


@dataclass(frozen=True)
class ModelArgs:
    """The recipe and the model: its family and weights, the trained adapter (a LoRA or every weight), and how
    the engine holds it (FSDP2, precision, memory, sequence parallelism)."""
    recipe: str = "tiny"
    """the named configuration whose values are the defaults shown here (unset: --model's; all: docs/algorithm.md §7)"""
    model: Literal[models.MODELS] = "tiny"  # the registry's names (models.SPECS), each a choice of --model
    """Qwen-Image, SD3.5-Medium, FLUX.1-dev, Wan2.1 T2V, Z-Image, FLUX.2 [klein] or Qwen-Image 2.1; FLUX.1 Kontext-dev,
    Qwen-Image-Edit (and 2.1) edit (--prompts: a .jsonl, a source image a line); tiny*: their classes at toy size,
    random weights; nano: tiny Qwen-Image pretrained on handwritten digits (docs/algorithm.md §15); nano-compose,
    nano-edit: GenEval's questions drawn with them, instructions on a real digit (docs/tasks.md)"""
    model_path: str | None = None
    """hub id or local pipeline directory; unset: the family's published weights, or for `tiny` random ones"""
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
    """torch.compile each transformer block (one graph per kind of call, reused by all), inductor rounding as eager does
    so that the rollout's and the update's graphs agree (tiny in bf16 on CPU: logp_gap 0, 1.1e-4 without)"""
    merged_lora: bool = False
    """each LoRA layer computes through one bf16 weight, bf16(W + α/r·B·A) made again when the adapter changes, in
    rollout and update alike: a bare model's host work per layer (bench/host.py). A departure: the adapter is rounded
    into each weight, not added to each output (docs/scaling.md). Needs --mixed-precision on one process; one more
    bf16 copy of every adapted weight"""
    fp8_rollout: bool = False
    """the rollout's frozen linear layers multiply in float8 (e4m3, scaled per row and per token), the update's in bf16:
    twice bf16's matmul rate on an H100/H200, yet in eager its forward was slower there (the cause not yet known;
    with --compile unmeasured: BENCHMARKS.md). A departure: the rollout's log-probs are no longer the update's, so
    Flow-GRPO and GARDO need --stale-correction decoupled with it (docs/scaling.md). Needs --mixed-precision on one
    process"""
    shard_text_encoder: bool = False
    """shard the frozen text encoder with FSDP2 too (saves memory on every rank)"""
    sp: int = 1
    """Ulysses sequence parallelism: N ranks share each image, 1/N of its tokens each (docs/algorithm.md §14)"""


@dataclass(frozen=True)
class RolloutArgs:
    """Phases 1-3, prompts, rollout and rewards: G images for each of P prompts, sampled (SDE on the trained
    steps, ODE elsewhere) by the trainer, its rollout ranks or vLLM-Omni servers, and scored."""
    prompts: str = "general"
    """prompt set: a built-in name (ocr, general, digits, compose) or a .txt / .jsonl file (docs/rewards.md)"""
    reward: str = "brightness"
    """a reward, or a weighted list `ocr=1.0,pickscore=0.5`; also `remote=URL` and `judge:TASK=URL` (docs/rewards.md)"""
    group_size: int = 8
    """G: images per prompt; advantages compare images within a group"""
    prompts_per_iteration: int = 4
    """P: prompts per iteration (P·G images per iteration, split over ranks)"""
    micro_batch: int = 8
    """images per transformer call, in rollout and in training; 0: the largest that fits the device's memory, measured
    once the model is built (memory.py; a CPU: 8 or fewer)"""
    height: int = 32
    """image height in pixels"""
    width: int = 32
    """image width in pixels"""
    num_frames: int = 1
    """frames per video (4·k + 1) for a video --model; 1 for images"""
    num_steps: int = 4
    """sampling steps in rollout (training-time denoising reduction)"""
    cfg_scale: float = 1.0
    """two-pass CFG w: Qwen-Image's true CFG or SD3's standard CFG (1 = none; FLUX takes --guidance instead)"""
    guidance: float | None = None
    """FLUX's distilled guidance embedding, one pass per step (unset: the pipeline's 3.5; only for FLUX)"""
    negative_prompt: str = " "
    """negative prompt for two-pass CFG"""
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


@dataclass(frozen=True)
class UpdateArgs:
    """Phases 4-5, advantages and the policy update: the algorithm, its loss, its variants and regularisers."""
    algorithm: Literal["grpo", "gardo", "nft", "awm", "dgpo", "dpo"] = "grpo"
    """the update (docs/algorithm.md §12): Flow-GRPO's PPO-clip on SDE log-probs (GARDO: with its advantages and gated
    KL, §17), or DiffusionNFT, AWM, DGPO on ODE images, or online Diffusion-DPO on SDE ones"""
    adv_clip: float = 5.0
    """advantages are clipped to [−adv_clip, adv_clip] (> 0)"""
    std: Literal["global", "group", "global-unbiased"] = "global"
    """normalise advantages by the whole batch's reward std or by each group's (population std); global-unbiased: the
    batch's with Bessel's n − 1, as miles_diffusion divides"""
    adv_eps: float = 1e-4
    """ε in A = (r − the group's mean) / (std + ε): Flow-GRPO's 1e-4; UniRL's Flow-DPPO 1e-8"""
    zero_advantage: Literal["drop", "keep"] = "drop"
    """images whose advantage is exactly 0: left out of their optimizer step's loss mean, or trained with A = 0"""
    clip_range: float = 1e-3
    """PPO clip ε on the probability ratio (`tiny`'s: the scale of its second step's ratios, docs/algorithm.md §7)"""
    trust_region: Literal["clip", "dppo"] = "clip"
    """PPO's clip of the ratio at 1 ± --clip-range, or Flow-DPPO's mask: a step's −A·ratio is dropped where its exact
    KL to the behaviour transition exceeds --dppo-threshold and the ratio already moved the way A pushes it"""
    dppo_threshold: float = 1e-5
    """Flow-DPPO's KL threshold, per latent element of a transition (UniRL's kl_mask_threshold)"""
    guard: Literal["none", "full", "ratio-norm", "reweight"] = "none"
    """GRPO-Guard (`full`): its ratio normalisation and its per-step gradient reweight (1/|dt|); or one alone"""
    cps_density: Literal["public", "exact"] = "public"
    """the cps log-density in the ratio: Flow-GRPO's −mean((x' − μ)²), or the exact Gaussian one as for sde"""
    stale_correction: Literal["bypass", "decoupled"] = "bypass"
    """the ratio of samples from older weights: against their recorded log-probs (Flow-GRPO's, verl's bypass mode), or
    decoupled PPO (against log-probs recomputed under the update's starting weights, truncated importance weights)"""
    is_cap: float = 2.0
    """decoupled: each transition's importance weight π_current/π_behaviour is truncated at this (verl's default)"""
    reject_band: float = 0.0
    """decoupled: a transition whose |log π_current/π_behaviour| exceeds this weighs 0 in the loss (0 = off)"""
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
    """iterations between the old policy's updates (nft, awm, dgpo; dpo: copies of the trained weights, its
    reference)"""
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


@dataclass(frozen=True)
class OptimizerArgs:
    """Phase 5's optimizer: K steps an iteration, AdamW and its gradient clip, the EMA of the trained weights."""
    optimizer_steps: int = 2
    """K: optimizer steps per iteration, each on 1/K of its images (1: every ratio is 1, the clip never acts)"""
    reuse_rollout_forward: bool = False
    """grpo: the first optimizer step trains on the rollout's forwards of its images, kept with their graphs (their
    activations held until the rewards are in), not repeated: the same update to the bit (docs/algorithm.md §8)"""
    lr: float = 1e-2
    """AdamW learning rate"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient-norm clip; a non-finite norm skips the step"""
    ema_decay: float = 0.0
    """EMA decay of the trained weights in [0, 1), used for evaluation and <run-dir>/lora (0 = off; SD3 recipe: 0.9)"""
    ema_every: int = 8
    """optimizer steps between EMA updates (flow-grpo: decay min((1 + n)/(10 + n), --ema-decay) at step n)"""
    ema_repeat: int = 1
    """M: the update applied M times in a row where it fires (Flow-GRPO: once per micro-batch, M per optimizer step)"""
    ema_form: Literal["flow-grpo", "dance"] = "flow-grpo"
    """Flow-GRPO's EMA (a warm-up, when n + 1 is a multiple of K) or DanceGRPO's (constant decay, when K divides n)"""


@dataclass(frozen=True)
class EvalArgs:
    """Phase 7, evaluation: ODE images of the eval prompts from fixed seeds, every so many iterations."""
    eval_every: int = 20
    """evaluate (ODE, fixed seeds, eval prompts) every this many iterations and at the end; 0 = never"""
    eval_images: int = 8
    """evaluation images: image i shows eval prompt i mod their number, from its own fixed seed (split over ranks)"""
    eval_steps: int = 8
    """ODE steps for evaluation images"""


@dataclass(frozen=True)
class RunArgs:
    """The run: its directory, seed and length, its checkpoints (phase 8) and resume, its log."""
    run_dir: str | None = None
    """output directory; a new run refuses one that holds a run (unset: runs/<model>-<reward>-<timestamp>)"""
    seed: int = 0
    """seed of the model init (tiny), LoRA init, prompt order, windows and all sampling noise"""
    iterations: int = 30
    """total number of iterations (rollout + update), counting those before a --resume"""
    checkpoint_every: int = 10
    """write a checkpoint every this many iterations and at the end (one process: also when Ctrl-C stops it); 0 = at
    the end only"""
    keep_checkpoints: int = 2
    """how many of this run's newest checkpoints to keep in <run-dir>/checkpoints"""
    resume: str | None = None
    """continue from a checkpoint directory, or `auto` for the newest complete one in --run-dir"""
    allow_change: tuple[str, ...] = ()
    """flags that may differ from the checkpoint's on --resume (e.g. `lr reward`); others must match; args.json logs
    it"""
    wandb: bool = True
    """log to wandb on rank 0 (offline unless WANDB_MODE or WANDB_API_KEY says otherwise)"""


# The phases listed last to first: a dataclass takes its bases' fields from the last one listed to the first,
# so that Args' fields (args.json, --help) come in the loop's order.
@dataclass(frozen=True)
class Args(RunArgs, EvalArgs, OptimizerArgs, UpdateArgs, RolloutArgs, ModelArgs):
    """Flow-GRPO training (docs/algorithm.md). `--recipe` (or `--model` alone) picks a recipe, whose values are the
    defaults shown here. A bare `python flowgrpo.py` is `--model tiny`, the CPU demo; `--model qwen-image --help`
    shows that recipe. Flags given override the recipe. Recipes: recipes.py; their sources: docs/algorithm.md §7."""


# ---- flags that act only beside another -----------------------------------------------------------------------
# What each needs, and whether a run `a` has it. Given on the command line (unlike its recipe's value) without it, the
# flag would change nothing: start-up refuses it (startup.check_args), as algorithms.check_flags refuses the flags of
# another --algorithm.
LORA, EMA = ("a LoRA (not --full-finetune)", lambda a: not a.full_finetune), ("--ema-decay > 0", lambda a: a.ema_decay)
EVAL, GARDO_KL = ("--eval-every > 0", lambda a: a.eval_every), ("--kl-beta > 0", lambda a: a.kl_beta > 0)
OLD = ("an old policy that is read (awm: --old-kl > 0)", lambda a: a.algorithm != "awm" or a.old_kl > 0)
# A ratio leaves 1 in a later optimizer step or against a sampler's log-probs (bypass); at 1 no clip or mask acts
MOVES = ("ratios that leave 1: --optimizer-steps > 1, or --off-policy 1 or --rollout vllm-omni with bypass", lambda a:
         a.optimizer_steps > 1 or (a.stale_correction == "bypass" and (a.off_policy or a.rollout != "local")))
COMPANIONS = {"lora_rank": LORA, "lora_alpha": LORA, "lora_targets": LORA, "ema_every": EMA, "ema_repeat": EMA,
              "ema_form": EMA, "window_range": ("--window > 0", lambda a: a.window > 0), "trust_region": MOVES,
              "slide_every": ("--window-schedule sliding", lambda a: a.window_schedule == "sliding"),
              "is_cap": ("--stale-correction decoupled", lambda a: a.stale_correction == "decoupled"),
              "dppo_threshold": (f"--trust-region dppo and {MOVES[0]}",
                                 lambda a: a.trust_region == "dppo" and MOVES[1](a)),
              "clip_range": (f"--trust-region clip (dppo's mask replaces it) and {MOVES[0]}",  # DGPO's ratio: its own
                             lambda a: a.algorithm == "dgpo" or (a.trust_region == "clip" and MOVES[1](a))),
              # sde's densities are the exact ones; GRPO-Guard's normalised ratio takes the exact one whatever it says
              "cps_density": ("--sde-type cps, and not with --guard full or ratio-norm (their ratio takes the exact "
                              "density) unless --stale-correction decoupled (its weights read it)",
                              lambda a: a.sde_type == "cps" and (a.guard not in ("full", "ratio-norm")
                                                                 or a.stale_correction == "decoupled")),
              "kl_form": ("--kl-beta > 0 and --sde-type sde or dance", lambda a: a.kl_beta > 0 and a.sde_type != "cps"),
              # cps's two KL forms are one; full mode (DPO's always) leaves one ODE step, to σ = 0: Euler's in all
              "ode_solver": ("ODE steps after a window (--window > 0) or --algorithm nft, awm or dgpo",
                             lambda a: a.algorithm in ("nft", "awm", "dgpo") or a.window > 0 and a.algorithm != "dpo"),
              "std": ("--algorithm grpo, nft, awm or dgpo", lambda a: a.algorithm not in ("gardo", "dpo")),
              "adv_eps": ("--algorithm grpo, nft, awm or dgpo", lambda a: a.algorithm not in ("gardo", "dpo")),
              "adv_clip": ("--algorithm grpo, gardo, nft, awm or dgpo", lambda a: a.algorithm != "dpo"),  # DPO: rewards
              "gardo_kl_threshold": GARDO_KL, "gardo_reset_every": GARDO_KL, "old_decay": OLD, "old_every": OLD,
              "eval_images": EVAL, "eval_steps": EVAL, "allow_change": ("--resume", lambda a: a.resume),
              "shard_text_encoder": ("several training ranks (torchrun; one process has none to shard it over)",
                                     lambda a: int(os.environ.get("WORLD_SIZE", 1)) - a.rollout_ranks > 1),
              "negative_prompt": ("--cfg-scale > 1", lambda a: a.cfg_scale > 1),  # encoded only for CFG's second branch
              "normguard_margin": ("--normguard > 0", lambda a: a.normguard > 0)}


def check_companions(a: Args, recipe: Args) -> None:
    """Refuse, naming them, the flags given without the flag they act with (COMPANIONS)."""
    alone = [f"--{f.replace('_', '-')} acts only with {what}" for f, (what, used) in COMPANIONS.items()
             if getattr(a, f) != getattr(recipe, f) and not used(a)]
    if alone:
        raise ValueError(f"{'; '.join(alone)}: drop it, or give what it acts with")
