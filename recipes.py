"""Recipes: named configurations of `flowgrpo.Args`, each value of a public one with its source.

`python flowgrpo.py --recipe NAME` makes a recipe's values the defaults of every flag (`--help` then shows them);
flags given on the command line override them. Without `--recipe`, `--model NAME` picks the recipe named after
that model, and a bare `python flowgrpo.py` is `tiny`. A recipe is a plain dict of flag values (anything it does
not set keeps `Args`' own default), so this table imports nothing of the loop. Sources, value by value:
docs/algorithm.md §7.
"""
import models

LORA_TARGETS = {m: models.adapter_class(m).lora_targets for m in ("tiny-sd3", "tiny-flux")}  # cheap: no diffusers

RECIPES: dict[str, dict] = {
    # this project's CPU toys (docs/algorithm.md §7): random weights, a cheap image-space reward
    "tiny": {},  # Args' own defaults
    "tiny-sd3": dict(model="tiny-sd3", cfg_scale=4.5, negative_prompt="", lora_targets=LORA_TARGETS["tiny-sd3"]),
    "tiny-flux": dict(model="tiny-flux", guidance=3.5, lora_targets=LORA_TARGETS["tiny-flux"]),
    # the nano task (nano.py): tiny Qwen-Image pretrained here on digits; values measured in docs/algorithm.md §15
    "nano": dict(model="nano", iterations=60, prompts="digits", reward="digit=1,digit_judge=0", height=16, width=16,
                 num_steps=10, eval_steps=10, window_range=(0, 5), micro_batch=16, lr=1e-3, clip_range=2e-3,
                 lora_rank=32, lora_alpha=64, eval_every=10, eval_images=200),
    # Flow-GRPO's public config pickscore_qwenimage with verl's Qwen-Image OCR LoRA example
    "qwen-image": dict(model="qwen-image", iterations=300, prompts="ocr", reward="ocr", group_size=16,
                       prompts_per_iteration=32, micro_batch=4, height=512, width=512, num_steps=10, eval_steps=50,
                       cfg_scale=4.0, noise_level=1.2, window=2, window_range=(0, 5), clip_range=1e-4, lr=3e-4,
                       lora_rank=64, lora_alpha=128, mixed_precision=True, activation_checkpointing=True,
                       checkpoint_every=20),
    # Flow-GRPO's public config general_ocr_sd3 and scripts/train_sd3.py
    "sd3.5-medium": dict(model="sd3.5-medium", iterations=300, prompts="ocr", reward="ocr", group_size=24,
                         prompts_per_iteration=48, micro_batch=9, height=512, width=512, num_steps=10, eval_steps=40,
                         cfg_scale=4.5, negative_prompt="", window_range=(0, 5), clip_range=1e-4, kl_beta=0.04,
                         lr=3e-4, lora_rank=32, lora_alpha=64, lora_targets=LORA_TARGETS["tiny-sd3"],
                         mixed_precision=True, ema_decay=0.9, ema_every=8, checkpoint_every=60, eval_every=60),
    # Flow-GRPO's public config pickscore_flux and scripts/train_flux.py
    "flux.1-dev": dict(model="flux.1-dev", iterations=300, prompts="general", reward="pickscore", group_size=24,
                       prompts_per_iteration=48, micro_batch=3, height=512, width=512, num_steps=6, eval_steps=28,
                       guidance=3.5, noise_level=0.9, window_range=(0, 3), clip_range=1e-4, lr=3e-4, lora_rank=64,
                       lora_alpha=128, lora_targets=LORA_TARGETS["tiny-flux"], mixed_precision=True, ema_decay=0.9,
                       ema_every=8, checkpoint_every=30, eval_every=30),
}
