"""What a run checks before anything expensive starts: every impossible value or combination of its flags refused in
one line naming the flag and the fix, and on `--resume` the checkpoint whose result-deciding flags (its fingerprint)
match. `flowgrpo.main` calls `check_args` before it builds a model or joins a process group.

The loop's `Args` (an instance `a`) is read by field name, so that this file imports nothing of the loop; cli.py reads
the command line into it.
"""
import dataclasses
import math
import os
import sys

import algorithms
import args
import checkpoint
import cli
import memory
import model_checks
import models
import offpolicy
import prompts as prompt_sets
import recipes
import rewards
import rollout_backends
import rollout_ranks
from algorithms import need

# Flags that say only how the work is done or recorded: they may change on --resume without breaking exactness
# (micro-batches and ranks change float reduction order only). Every other flag decides the result.
HOW_FLAGS = {"recipe", "run_dir", "resume", "allow_change", "iterations", "wandb", "eval_every", "eval_images",
             "eval_steps", "checkpoint_every", "keep_checkpoints", "rollout", "rollout_url", "micro_batch", "offload",
             "activation_checkpointing", "compile", "shard_text_encoder", "sp", "rollout_ranks",
             "reuse_rollout_forward"}  # this one changes no bit of the updates
SHAPE_FLAGS = {"model", "full_finetune", "lora_rank", "lora_targets"}  # the checkpoint's tensors: never changeable


def check_args(a) -> tuple[prompt_sets.PromptSet, tuple[str, dict] | None]:
    """Reject impossible configurations before anything is built; each message names the flag. Returns the prompts
    (read once: a long edit set's images hashed in one pass) and the checkpoint to resume with its meta.json, or None."""
    for f in dataclasses.fields(a):  # inf or nan in any float flag
        need(not isinstance(getattr(a, f.name), float) or math.isfinite(getattr(a, f.name)),
             f"--{f.name.replace('_', '-')} must be a finite number, got {getattr(a, f.name)}")
    need(a.recipe in recipes.RECIPES, f"--recipe must be one of {tuple(recipes.RECIPES)}, got {a.recipe!r}")
    need(a.group_size >= 2, f"--group-size must be >= 2 (advantages compare images of a prompt), got {a.group_size}")
    memory.check(a)  # --micro-batch: N >= 1, or 0 (sized to the device) where the trainer samples
    for flag, v in (("--prompts-per-iteration", a.prompts_per_iteration),
                    ("--optimizer-steps", a.optimizer_steps), ("--iterations", a.iterations),
                    ("--keep-checkpoints", a.keep_checkpoints), ("--slide-every", a.slide_every),
                    ("--ema-repeat", a.ema_repeat), ("--sp", a.sp)):
        need(v >= 1, f"{flag} must be >= 1, got {v}")
    for flag, v in (("--lr", a.lr), ("--noise-level", a.noise_level), ("--clip-range", a.clip_range),
                    ("--lora-rank", a.lora_rank), ("--lora-alpha", a.lora_alpha), ("--max-grad-norm", a.max_grad_norm),
                    ("--adv-clip", a.adv_clip)):
        need(v > 0, f"{flag} must be > 0, got {v}")
    for flag, v in (("--kl-beta", a.kl_beta), ("--weight-decay", a.weight_decay),
                    ("--checkpoint-every", a.checkpoint_every), ("--eval-every", a.eval_every)):
        need(v >= 0, f"{flag} must be >= 0, got {v}")
    for flag, v, lo, hi in (("--lr", a.lr, 0, 1), ("--num-steps", a.num_steps, 2, 1000),  # beyond: typos, not runs
                            ("--cfg-scale", a.cfg_scale, 1, 100), ("--eval-steps", a.eval_steps, 2, 1000),
                            ("--eval-images", a.eval_images, 0, 1024), ("--guidance", a.guidance or 0.0, 0, 100)):
        need(lo <= v <= hi, f"{flag} must be in [{lo}, {hi}], got {v}")
    need(0 <= a.seed < 2**32, f"--seed must be in [0, 2**32), got {a.seed}")
    need(a.eval_images >= 1 or not a.eval_every,
         f"--eval-images must be >= 1 with --eval-every > 0, got {a.eval_images}")
    need(not (a.full_finetune and a.kl_beta > 0) or a.algorithm == "gardo",  # GARDO's reference: its old policy
         "--kl-beta > 0 needs a LoRA (the reference is the adapter off)")
    need(not a.branch or a.window > 0, "--branch needs a window (--window > 0): the group branches at its start")
    need(0 <= a.ema_decay < 1 and a.ema_every >= 1, f"--ema-decay must be in [0, 1) (0 = off) and --ema-every >= 1, "
         f"got {a.ema_decay}, {a.ema_every}")
    need(a.rollout == "local" or not (a.branch or algorithms.needs_means(a) or a.ode_solver != "euler"),
         "--branch, --ode-solver dpm2 or dpm2-full, --guard full/ratio-norm and --trust-region dppo need --rollout "
         "local (the vLLM-Omni pipeline has none yet)")
    need(a.rollout == "local" or a.sp == 1, "--sp > 1 needs --rollout local: the ranks of an --sp group must hold "
         "bit-identical rollouts, which the trainer's own sampling guarantees and separate servers do not")
    need(a.rollout == "local" or (not a.full_finetune and a.num_steps <= 200 and max(a.cfg_scale, a.guidance or 0) <= 20),
         f"--rollout vllm-omni: its servers sample with the policy as a LoRA (not --full-finetune), at most 200 steps "
         f"and guidance scales up to 20 (vLLM-Omni's request limits); got --num-steps {a.num_steps}, --cfg-scale "
         f"{a.cfg_scale}, --guidance {a.guidance}: lower them, or use --rollout local")
    alone = int(os.environ.get("WORLD_SIZE", 1)) == 1 and not (a.full_finetune or a.offload or a.sp > 1)
    for flag, on in (("--merged-lora", a.merged_lora), ("--fp8-rollout", a.fp8_rollout)):  # one bf16 process's own
        need(not on or (a.mixed_precision and alone and a.rollout == "local"), f"{flag} needs --mixed-precision in one "
             "process that shards nothing and samples itself: not with --full-finetune, --offload, --sp > 1, torchrun's "
             "ranks or --rollout vllm-omni (its servers compute in bf16, unmerged); run without it")
    need(not (a.merged_lora and a.fp8_rollout), "--fp8-rollout quantises the frozen base weights, which --merged-lora "
         "sums with the adapter: give one of them")
    unknown = {f.replace("-", "_").removeprefix("__") for f in a.allow_change} - {f.name for f in dataclasses.fields(a)}
    need(not unknown, f"--allow-change: unknown flag(s) {sorted(unknown)}; name flags such as lr or reward")
    need(not SHAPE_FLAGS & set(allowed(a)), f"--allow-change: {sorted(SHAPE_FLAGS & set(allowed(a)))} fix the "
         "checkpoint's tensor shapes and cannot change on --resume")
    recipe = cli.recipe_args(type(a), a.recipe)
    algorithms.check_flags(a, recipe)  # e.g. --clip-range with nft: refused, named
    args.check_companions(a, recipe)  # e.g. --window-range without --window: refused, named
    algorithms.ALGORITHMS[a.algorithm].check(a)
    model_checks.check_model_args(a.model, height=a.height, width=a.width, cfg_scale=a.cfg_scale, guidance=a.guidance,
                                  model_path=a.model_path, sp=a.sp, num_frames=a.num_frames)
    if not a.full_finetune:
        need(a.lora_targets, "--lora-targets must name at least one module of the transformer (or --full-finetune)")
        model_checks.check_lora_targets(a.model, a.model_path, a.lora_targets)
    rewards.check_reward_spec(a.reward, video=a.num_frames > 1)
    unknown = [p for p in a.gardo_proxies if p not in rewards.weights(a.reward)]
    need(not unknown, f"--gardo-proxies {unknown}: not rewards of --reward {a.reward!r} (add them at weight 0)")
    need(not a.normguard or (not a.full_finetune and not a.reuse_rollout_forward), "--normguard compares with the "
         "reference (the adapter off, so it needs a LoRA) on every trained forward (not with --reuse-rollout-forward)")
    prompts = prompt_sets.load_prompts(a.prompts, (a.height, a.width))  # source images too: readable, the run's ratio
    edits, missing = models.SPECS[a.model].edits, sum("image" not in m for _, m in prompts.train + prompts.eval)
    need(not edits or not missing, f"--prompts {a.prompts}: --model {a.model} edits a source image, and {missing} of "
         'its prompts have none: give it a .jsonl whose every line has "image": "path.png" (relative to the file)')
    need(edits or missing == len(prompts.train + prompts.eval), f"--prompts {a.prompts}: its prompts carry source "
         f'images ("image"), which --model {a.model} (text to image) cannot use: choose an edit model '
         f"({', '.join(m for m, spec in models.SPECS.items() if spec.edits)}) or prompts without images")
    adapter = models.adapter_class(a.model)
    need(not a.prefix_kv_cache or (a.rollout == "local" and adapter.prefix_kv_cache is not None),
         f"--prefix-kv-cache needs --rollout local and a family with a prefix-KV cache (Qwen-Image 2.1's); --model "
         f"{a.model} with --rollout {a.rollout} has none: run without it")
    need(a.rollout == "local" or adapter.omni_pipeline_class, f"--rollout vllm-omni: --model {a.model} "
         f"{adapter.omni_unserved}: use --rollout local")
    rewards.check_prompts_for_reward(a.reward, [p for p, _ in prompts.train + prompts.eval],  # ocr: quoted text?
                                     [m for _, m in prompts.train + prompts.eval])  # preserve: a source?
    rewards.check_size_for_reward(a.reward, a.height, a.width)  # the laptop tasks' readers: one size
    rollout_ranks.check(a, int(os.environ.get("WORLD_SIZE", 1)))  # --rollout-ranks, --off-policy (offpolicy.check)
    rollout_backends.probe(rollout_backends.check_backend(a.rollout, a.rollout_url))  # the servers asked once, and
    rewards.probe(a.reward)  # the reward's, before the model loads
    if not a.resume:
        return prompts, None
    ckpt, meta = checkpoint.resolve_resume(a.resume, a.run_dir, fingerprint(a), allowed(a),
                                           fingerprint(type(a)()))
    offpolicy.check_resume(a, meta, int(os.environ.get("WORLD_SIZE", 1)) - a.rollout_ranks)
    # The shadows this run keeps must be in the checkpoint (dcp.load is strict); one it holds and this run does not
    # keep is not loaded (nft -> grpo: the weights and AdamW state carry over, the old policy is dropped).
    old, then = [k for k, algo in algorithms.ALGORITHMS.items() if algo.keeps_old], meta["flags"]
    need(a.algorithm not in old or then.get("algorithm") in old, f"--algorithm {a.algorithm} keeps an old policy, "
         f"which {ckpt} (--algorithm {then.get('algorithm')!r:.20}) does not hold: resume with its --algorithm or "
         "start anew")
    need(not a.ema_decay or then.get("ema_decay") not in (None, 0), f"--ema-decay {a.ema_decay} keeps an EMA, which "
         f"{ckpt} (--ema-decay 0) does not hold: resume with --ema-decay 0 or start anew")
    need(meta["loop"]["iteration"] + 1 < a.iterations, f"--iterations {a.iterations} leaves nothing to train after "
         f"{ckpt}, which ends iteration {meta['loop']['iteration']}: --iterations is the total, pass more")
    need(meta["loop"]["prompts_sha256"] == checkpoint.json_sha256(prompts.train) or "prompts" in allowed(a),
         f"--prompts {a.prompts}: its training prompts differ from those of {ckpt} (their SHA-256): resume with "
         "those, or name prompts in --allow-change")
    return prompts, (ckpt, meta)


def warn(a) -> None:
    """Say on stderr what runs but is probably not meant (rank 0 calls it once)."""
    if a.sde_type == "cps" and not a.window and a.cps_density == "exact":
        print("warning: exact cps density in full mode: step i weighs 1/(2·std_i²), std_i = σ_{i+1}·sin(a·π/2), so the "
              "last trained step outweighs the first ~(σ_1/σ_{N-1})² times (2,157× for Qwen-Image at 10 steps); the "
              "public recipes use cps only with a window (--window 2)", file=sys.stderr)


def allowed(a) -> list[str]:
    return [f.replace("-", "_").removeprefix("__") for f in a.allow_change]


def fingerprint(a) -> dict:
    """The flags that decide a run's result, as JSON stores them: a checkpoint resumes only under the same."""
    flags = dataclasses.asdict(a)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in flags.items() if k not in HOW_FLAGS}

