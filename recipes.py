"""Recipes: named configurations of `flowgrpo.Args`, each value of a public one with its source.

`python flowgrpo.py --recipe NAME` makes a recipe's values the defaults of every flag (`--help` then shows them);
flags given on the command line override them. Without `--recipe`, `--model NAME` picks the recipe named after
that model, and a bare `python flowgrpo.py` is `tiny`. A recipe is a plain dict of flag values (anything it does
not set keeps `Args`' own default), so this table imports nothing of the loop. Sources, value by value:
docs/algorithm.md §7. `ema_repeat` is the public run's micro-batches per optimizer step per GPU (its EMA fires that
many times per step), a fixed value of the recipe: the result does not depend on how many ranks run it.
"""
import os

import models

LORA_TARGETS = {m: models.adapter_class(m).lora_targets  # no diffusers
                for m in ("tiny-sd3", "tiny-flux", "tiny-wan", "tiny-z-image", "tiny-flux.2-klein",
                          "tiny-qwen-image-2.1")}

# What DiffusionNFT's and AWM's public SD3.5-M configs share: 512², no CFG, their DPM-Solver++(2M) on every step,
# LoRA r 32 on SD3's public targets, lr 3e-4, mixed precision, an EMA updated every step
SD3_FORWARD = dict(model="sd3.5-medium", iterations=300, group_size=24, height=512, width=512, eval_steps=40,
                   cfg_scale=1.0, negative_prompt="", ode_solver="dpm2-full", lr=3e-4, lora_rank=32, lora_alpha=64,
                   lora_targets=LORA_TARGETS["tiny-sd3"], mixed_precision=True, ema_every=1)

# What Flow-Factory's public Flow-GRPO LoRA configs (examples/grpo/lora/<model>/default.yaml) share: PickScore, 16
# images × 48 prompts, per-device batch 1, 2 optimizer steps, one SDE step an iteration drawn from steps 1-3, group std,
# clip 1e-4, lr 3e-4, LoRA r 64, bf16, EMA 0.9 every 4 iterations (docs/algorithm.md §7, "Flow-Factory's recipes")
FLOW_FACTORY = dict(iterations=300, prompts="general", reward="pickscore", group_size=16, prompts_per_iteration=48,
                    micro_batch=1, optimizer_steps=2, noise_level=0.7, window=1, window_range=(1, 4), std="group",
                    zero_advantage="keep", clip_range=1e-4, lr=3e-4, lora_rank=64, lora_alpha=128,
                    mixed_precision=True, ema_decay=0.9, ema_every=8)

RECIPES: dict[str, dict] = {
    # this project's CPU toys (docs/algorithm.md §7): random weights, a cheap image-space reward; each clip range is
    # the scale of its demo's second optimizer step's ratios, measured there, so that the clip acts in most iterations
    "tiny": {},  # Args' own defaults (clip ε 1e-3)
    "tiny-sd3": dict(model="tiny-sd3", cfg_scale=4.5, negative_prompt="", clip_range=2e-3,
                     lora_targets=LORA_TARGETS["tiny-sd3"]),
    "tiny-flux": dict(model="tiny-flux", guidance=3.5, lora_targets=LORA_TARGETS["tiny-flux"]),
    "tiny-flux-kontext": dict(model="tiny-flux-kontext", guidance=3.5, lora_targets=LORA_TARGETS["tiny-flux"]),
    "tiny-qwen-image-edit": dict(model="tiny-qwen-image-edit", cfg_scale=4.0),  # true CFG at the pipeline's default
    "tiny-z-image": dict(model="tiny-z-image", lora_targets=LORA_TARGETS["tiny-z-image"]),  # clip range: not measured
    "tiny-flux.2-klein": dict(model="tiny-flux.2-klein", lora_targets=LORA_TARGETS["tiny-flux.2-klein"]),  # nor here
    "tiny-qwen-image-2.1": dict(model="tiny-qwen-image-2.1", lora_targets=LORA_TARGETS["tiny-qwen-image-2.1"]),
    "tiny-qwen-image-2.1-edit": dict(model="tiny-qwen-image-2.1-edit",
                                     lora_targets=LORA_TARGETS["tiny-qwen-image-2.1"]),
    # 9 frames (3 latent frames), a reward on the frames' motion. Rise in 30 iterations (12) in iteration-0 within-
    # batch stds, seeds 0, 1, 2: 5.4 (1.0), 3.4 (1.4), 7.0 (3.0); at clip 0.2 (which never acted) 5.6 (4.1), 3.1
    # (3.6), 6.9 (4.7); at 0.2 with 8 videos per prompt 4.9, 3.1, 5.3; at 0.2 with the noise and lr of `tiny` (0.7,
    # 1e-2) and 8 videos 3.7, 1.7 (seeds 0, 1) (docs/algorithm.md §13)
    "tiny-wan": dict(model="tiny-wan", num_frames=9, reward="motion", group_size=16, noise_level=1.0, lr=5e-2,
                     clip_range=2e-4, lora_targets=LORA_TARGETS["tiny-wan"]),
    # the nano task (tasks/nano.py): tiny Qwen-Image pretrained here on digits; values measured in docs/algorithm.md §15
    "nano": dict(model="nano", iterations=60, prompts="digits", reward="digit=1,digit_judge=0", height=16, width=16,
                 num_steps=10, eval_steps=10, window_range=(0, 5), micro_batch=16, lr=1e-3, clip_range=2e-3,
                 lora_rank=32, lora_alpha=64, eval_every=10, eval_images=200),
    # the nano-compose task (tasks/nano_compose.py): the same classes at 32×32, GenEval's questions. nano's values but 16
    # prompts an iteration for 80 iterations: on an experimental base +16.9 ± 2.6 points in 13.5 min, where 8 prompts
    # gained 7.4 ± 2.1 in 40 and nano's 4 none in 30 (docs/tasks.md: the gradient's noise, not the step, held it back)
    "nano-compose": dict(model="nano-compose", iterations=80, prompts="compose", reward="compose=1,compose_judge=0",
                         height=32, width=32, num_steps=10, eval_steps=10, window_range=(0, 5), prompts_per_iteration=16,
                         micro_batch=32, lr=1e-3, clip_range=2e-3, lora_rank=32, lora_alpha=64, eval_every=10,
                         eval_images=130),
    # the nano-edit task (tasks/nano_edit.py): nano's classes editing a source digit, its shipped prompt set (held-out
    # glyphs for evaluation, each once). nano-compose's values but 64 prompts an iteration: held-out judge +14.1 ± 1.9
    # points in 16 CPU-min at seed 0, where 16 prompts gained +2.0 in 80 and 240 iterations, 32 +7.0 (docs/tasks.md)
    "nano-edit": dict(model="nano-edit", iterations=80, reward="edit=1,edit_judge=0",
                      prompts=os.path.join(models.adapter_class("nano-edit").default_path, "prompts.jsonl"),
                      height=16, width=16, num_steps=10, eval_steps=10, window_range=(0, 5), prompts_per_iteration=64,
                      micro_batch=32, lr=1e-3, clip_range=2e-3, lora_rank=32, lora_alpha=64, eval_every=10,
                      eval_images=180),
    # Flow-GRPO's public config pickscore_qwenimage with verl's Qwen-Image OCR LoRA example
    "qwen-image": dict(model="qwen-image", iterations=300, prompts="ocr", reward="ocr", group_size=16,
                       prompts_per_iteration=32, micro_batch=4, height=512, width=512, num_steps=10, eval_steps=50,
                       cfg_scale=4.0, noise_level=1.2, window=2, window_range=(0, 5), clip_range=1e-4, lr=3e-4,
                       lora_rank=64, lora_alpha=128, mixed_precision=True, activation_checkpointing=True,
                       zero_advantage="keep", checkpoint_every=30, eval_every=30),
    # Flow-GRPO's public config general_ocr_sd3 and scripts/train_sd3.py
    "sd3.5-medium": dict(model="sd3.5-medium", iterations=300, prompts="ocr", reward="ocr", group_size=24,
                         prompts_per_iteration=48, micro_batch=9, height=512, width=512, num_steps=10, eval_steps=40,
                         cfg_scale=4.5, negative_prompt="", window_range=(0, 5), clip_range=1e-4, kl_beta=0.04,
                         lr=3e-4, lora_rank=32, lora_alpha=64, lora_targets=LORA_TARGETS["tiny-sd3"],
                         mixed_precision=True, ema_decay=0.9, ema_every=8, ema_repeat=2, checkpoint_every=60,
                         eval_every=60),
    # Flow-GRPO's public config pickscore_flux and scripts/train_flux.py
    "flux.1-dev": dict(model="flux.1-dev", iterations=300, prompts="general", reward="pickscore", group_size=24,
                       prompts_per_iteration=48, micro_batch=3, height=512, width=512, num_steps=6, eval_steps=28,
                       guidance=3.5, noise_level=0.9, window_range=(0, 3), clip_range=1e-4, lr=3e-4, lora_rank=64,
                       lora_alpha=128, lora_targets=LORA_TARGETS["tiny-flux"], mixed_precision=True, ema_decay=0.9,
                       ema_every=8, ema_repeat=6, zero_advantage="keep", checkpoint_every=30, eval_every=30),
    # Flow-GRPO's public config counting_flux_kontext (config/grpo.py) and scripts/train_flux_kontext.py: FLUX.1-dev's
    # values at guidance 2.5, 21 images a prompt, LoRA also on the single blocks' MLP (proj_mlp), zero-advantage images
    # dropped. Departure: its reward (CLIP image similarity 0.5 + a GenEval counting check 0.5 on its counting_edit
    # set) is not here; a VL judge of the instruction (expected on 127.0.0.1:8000) and preserve, 0.5 each; its prompts
    # are a .jsonl edit set of the user's (--prompts). docs/algorithm.md §7
    "flux.1-kontext-dev": dict(model="flux.1-kontext-dev", iterations=300,
                               reward="judge:edit=http://127.0.0.1:8000=0.5,preserve=0.5", group_size=21,
                               prompts_per_iteration=48, micro_batch=3, height=512, width=512, num_steps=6,
                               eval_steps=28, guidance=2.5, noise_level=0.9, clip_range=1e-4, lr=3e-4, lora_rank=64,
                               lora_alpha=128, lora_targets=LORA_TARGETS["tiny-flux"] + ("proj_mlp",),
                               mixed_precision=True, ema_decay=0.9, ema_every=8, ema_repeat=6, checkpoint_every=30,
                               eval_every=30),
    # verl-omni's public Qwen-Image-Edit-2511 example (examples/flowgrpo_trainer/qwen_image_edit/
    # run_qwen_image_edit_lora.sh at a1139ba, as added in 01c87ee5): PickScore of result and instruction, 12 / 40
    # steps, true CFG 4, noise 0.7, window 3 in [0, 6), 16 × 32, 2 optimizer steps, group std, every image trained.
    # Departures: LoRA without to_out.0 and to_add_out, the group std over n (not n − 1), a source whose aspect is not
    # the run's refused (it letterboxes). Its prompts, as here, are the user's .jsonl (--prompts). docs/algorithm.md §7
    "qwen-image-edit": dict(model="qwen-image-edit", iterations=300, reward="pickscore", group_size=16,
                            prompts_per_iteration=32, micro_batch=16, height=512, width=512, num_steps=12,
                            eval_steps=40, cfg_scale=4.0, noise_level=0.7, window=3, window_range=(0, 6), std="group",
                            zero_advantage="keep", clip_range=1e-4, lr=3e-4, lora_rank=64, lora_alpha=128,
                            mixed_precision=True, activation_checkpointing=True, checkpoint_every=5, eval_every=20),
    # Flow-GRPO's public config grpo_guard.py:general_ocr_sd3_rationorm and scripts/train_sd3_GRPO_Guard.py
    "sd3.5-medium-guard": dict(model="sd3.5-medium", iterations=300, prompts="ocr", reward="ocr", group_size=24,
                               prompts_per_iteration=48, micro_batch=9, height=512, width=512, num_steps=10,
                               eval_steps=40, cfg_scale=4.5, negative_prompt="", guard="full", clip_range=2e-6,
                               std="group", lr=1e-4, lora_rank=32, lora_alpha=64, lora_targets=LORA_TARGETS["tiny-sd3"],
                               mixed_precision=True, ema_decay=0.9, ema_every=8, ema_repeat=4, checkpoint_every=30,
                               eval_every=30),
    # GARDO's public config general_ocr_sd3 (config/grpo_gardo.py) and scripts/train_sd3_gardo.py: the SD3 OCR run with
    # 8 of 10 steps trained (timestep_fraction 0.89), the KL β 0.04 to its reset old policy on the gated images, reset
    # above 3e-4 or every 15 iterations, M = 8 micro-batches an optimizer step. Departures (docs/algorithm.md §17): its
    # proxies aesthetic and ImageReward (here PickScore), its DINOv3 features (here pixels), steps 8-9 ODE here
    "sd3.5-medium-gardo-ocr": dict(model="sd3.5-medium", algorithm="gardo", iterations=300, prompts="ocr",
                                   reward="ocr=1,aesthetic=0,pickscore=0", gardo_proxies=("aesthetic", "pickscore"),
                                   group_size=24, prompts_per_iteration=48, micro_batch=9, height=512, width=512,
                                   num_steps=10, eval_steps=40, cfg_scale=4.5, negative_prompt="", window=8,
                                   window_range=(0, 8), clip_range=1e-4, kl_beta=0.04, lr=3e-4, lora_rank=32,
                                   lora_alpha=64, lora_targets=LORA_TARGETS["tiny-sd3"], mixed_precision=True,
                                   ema_decay=0.9, ema_every=8, ema_repeat=8, checkpoint_every=60, eval_every=60),
    # Flow-DPPO as UniRL's public recipe examples/diffusion/sd3/sd3_flowdppo.yaml trains SD3.5-M (its FlowDPPO/
    # config.yaml annotates it): Flow-GRPO's rollout, the clip replaced by the KL-and-advantage mask, 3 trained steps in
    # the first half, 2 optimizer steps a batch; every sample trained (its loss has no zero-advantage filter); its
    # advantages over the batch's n − 1 std + 1e-8, unclipped (1e4 clips none: |A| ≤ sqrt(N − 1)). Departure: its 3 steps
    # are drawn anywhere in [0, 5), here a contiguous window (docs/algorithm.md §8, 19)
    "sd3.5-medium-dppo": dict(model="sd3.5-medium", iterations=300, prompts="general", reward="pickscore",
                              group_size=16, prompts_per_iteration=48, micro_batch=8, optimizer_steps=2, height=512,
                              width=512, num_steps=10, eval_steps=40, cfg_scale=1.0, noise_level=0.7, window=3,
                              window_range=(0, 5), trust_region="dppo", dppo_threshold=1e-5, zero_advantage="keep",
                              std="global-unbiased", adv_eps=1e-8, adv_clip=1e4, lr=3e-4, weight_decay=0.0, lora_rank=32,
                              lora_alpha=64, lora_targets=LORA_TARGETS["tiny-sd3"], mixed_precision=True),
    # forward-process algorithms (docs/algorithm.md §12): DiffusionNFT's public configs sd3_ocr and sd3_pickscore
    # (config/nft.py), ODE rollouts of its all-steps DPM-Solver++(2M), 9 of the 10 steps trained per image
    "sd3.5-medium-nft-ocr": dict(SD3_FORWARD, algorithm="nft", prompts="ocr", reward="ocr", prompts_per_iteration=48,
                                 micro_batch=9, optimizer_steps=2, num_steps=10, kl_beta=1e-4, nft_beta=0.1,
                                 old_decay="nft2", train_timesteps=9, train_timestep_range=(0, 10), ema_decay=0.9,
                                 checkpoint_every=30, eval_every=10),
    "sd3.5-medium-nft-pickscore": dict(SD3_FORWARD, algorithm="nft", prompts="general", reward="pickscore",
                                       prompts_per_iteration=48, micro_batch=9, optimizer_steps=1, num_steps=10,
                                       kl_beta=1e-4, nft_beta=1.0, old_decay="nft1", train_timesteps=9,
                                       train_timestep_range=(0, 10), ema_decay=0.9, checkpoint_every=30, eval_every=10),
    # DiffusionNFT on Qwen-Image as verl-omni derives it (examples/diffusionnft_trainer/qwen_image/
    # run_qwen_image_ocr_lora.sh): the OCR recipe's β, KL and schedule, vLLM-Omni's Euler ODE, every step trained
    "qwen-image-nft-ocr": dict(model="qwen-image", algorithm="nft", iterations=300, prompts="ocr", reward="ocr",
                               group_size=16, prompts_per_iteration=24, micro_batch=4, optimizer_steps=2, height=512,
                               width=512, num_steps=10, eval_steps=40, cfg_scale=1.0, kl_beta=1e-4, nft_beta=0.1,
                               old_decay="nft2-iterations", old_every=2, train_timesteps=10,
                               train_timestep_range=(0, 10), lr=3e-4, lora_rank=64, lora_alpha=128,
                               mixed_precision=True, activation_checkpointing=True, checkpoint_every=60, eval_every=20),
    # Advantage Weighted Matching's public configs ocr_sd3_no_cfg_1node and pickscore_sd3_no_cfg_1node
    # (config/dgx_awm.py): 14 steps, 6 timesteps per image in strata of steps [1, 12) or [0, 12), on-policy
    "sd3.5-medium-awm-ocr": dict(SD3_FORWARD, algorithm="awm", prompts="ocr", reward="ocr", prompts_per_iteration=72,
                                 micro_batch=6, optimizer_steps=1, num_steps=14, kl_beta=0.003, old_kl=1.0,
                                 old_decay="awm", train_timesteps=6, train_timestep_range=(1, 12), ema_decay=0.99,
                                 checkpoint_every=20, eval_every=20),
    "sd3.5-medium-awm-pickscore": dict(SD3_FORWARD, algorithm="awm", prompts="general", reward="pickscore",
                                       prompts_per_iteration=24, micro_batch=6, optimizer_steps=1, num_steps=14,
                                       kl_beta=1e-4, old_kl=1.0, old_decay="awm", train_timesteps=6,
                                       train_timestep_range=(0, 12), ema_decay=0.99, checkpoint_every=50,
                                       eval_every=50),
    # DGPO's public config general_ocr_sd3_4gpu (config/dgpo.py, on its compressibility base): 8 groups of 16 an epoch,
    # one optimizer step, 4 timesteps shared by all of [0, 7) (trunc_steps 6), one noise per group, β 100, clip 1e-2,
    # KL 0.02, its EMA reference sampling after 200 steps; LoRA r 64 on SD3's targets. Departure: it samples with
    # diffusers' DPMSolverMultistepScheduler in Sana's flow configuration, here dpm2-full on SD3's σ points
    "sd3.5-medium-dgpo-ocr": dict(SD3_FORWARD, algorithm="dgpo", prompts="ocr", reward="ocr", group_size=16,
                                  prompts_per_iteration=8, micro_batch=16, optimizer_steps=1, num_steps=10, eval_steps=14,
                                  cfg_scale=4.5, clip_range=1e-2, kl_beta=0.02, dgpo_beta=100.0, dgpo_switch=200,
                                  old_decay="dgpo", train_timesteps=4, train_timestep_range=(0, 7), lora_rank=64,
                                  lora_alpha=128, ema_decay=0.9, ema_every=8, ema_repeat=2, checkpoint_every=60,
                                  eval_every=60),
    # flow_grpo's online Diffusion-DPO (scripts/train_sd3_dpo.py; config/dpo.py pickscore_sd3 on base.py, one GPU as
    # scripts/single_node/dpo.sh): one group of 24 an epoch, its best and worst image the pair, int(40·0.99) = 39
    # timesteps accumulated into its one step, β 100, its reference (which samples, SDE at noise 0.7) copied every
    # ref_update_step = 10,000,000 steps, i.e. never (its OnlineDPO: a small number, e.g. 40); EMA 0.9 every 8 steps
    "sd3.5-medium-dpo-pickscore": dict(model="sd3.5-medium", algorithm="dpo", iterations=300, prompts="general",
                                       reward="pickscore", group_size=24, prompts_per_iteration=1, micro_batch=24,
                                       optimizer_steps=1, height=512, width=512, num_steps=40, eval_steps=40,
                                       cfg_scale=4.5, negative_prompt="", noise_level=0.7, train_timesteps=39,
                                       dpo_beta=100.0, old_every=10_000_000, lr=3e-4,
                                       lora_rank=32, lora_alpha=64, lora_targets=LORA_TARGETS["tiny-sd3"],
                                       mixed_precision=True, ema_decay=0.9, ema_every=8, checkpoint_every=60,
                                       eval_every=60),
    # Flow-GRPO's public config general_ocr_wan2_1 and scripts/train_wan2_1.py (one GPU), with DanceGRPO's Wan2.1
    # sampler (fastvideo/train_grpo_wan_2_1.py: its SDE, η 0.3); docs/algorithm.md §7, §13
    "wan2.1-t2v-1.3b": dict(model="wan2.1-t2v-1.3b", iterations=300, prompts="ocr", reward="ocr", group_size=4,
                            prompts_per_iteration=4, micro_batch=8, height=240, width=416, num_frames=33, num_steps=20,
                            eval_steps=50, cfg_scale=4.5, negative_prompt="", sde_type="dance", noise_level=0.3,
                            std="group", clip_range=1e-3, kl_beta=0.004, kl_form="exact", lr=1e-4, lora_rank=32,
                            lora_alpha=64, lora_targets=LORA_TARGETS["tiny-wan"], mixed_precision=True,
                            activation_checkpointing=True, ema_decay=0.9, ema_every=8, checkpoint_every=60,
                            eval_every=30),
    # Flow-Factory's public configs (X-GenGroup/Flow-Factory at a0b2bc5: examples/grpo/lora/z_image, z_image_turbo,
    # flux2_klein_base, flux2_klein/default.yaml). Z-Image's guidance 4 is its form, CFG 5 here; departures: §7
    "z-image": dict(FLOW_FACTORY, model="z-image", height=512, width=512, num_steps=10, eval_steps=40, cfg_scale=5.0,
                    negative_prompt="", lora_targets=LORA_TARGETS["tiny-z-image"], checkpoint_every=40, eval_every=40),
    "z-image-turbo": dict(FLOW_FACTORY, model="z-image-turbo", height=512, width=512, num_steps=6, eval_steps=10,
                          lora_targets=LORA_TARGETS["tiny-z-image"], checkpoint_every=40, eval_every=40),
    "flux.2-klein-base": dict(FLOW_FACTORY, model="flux.2-klein-base", height=384, width=384, num_steps=8,
                              eval_steps=28, cfg_scale=4.0, negative_prompt="",
                              lora_targets=LORA_TARGETS["tiny-flux.2-klein"], checkpoint_every=20, eval_every=20),
    "flux.2-klein": dict(FLOW_FACTORY, model="flux.2-klein", height=384, width=384, num_steps=4, eval_steps=10,
                         noise_level=0.5, window_range=(1, 3), lora_targets=LORA_TARGETS["tiny-flux.2-klein"],
                         checkpoint_every=20, eval_every=20),
    # Qwen-Image 2.1 on one GPU. Editing: Flow-Factory's public edit config (examples/grpo/lora/qwen_image_2_1/
    # default.yaml at 5f6cda1), CFG-distilled (no CFG), noise 1.0, activation checkpointing
    "qwen-image-2.1-edit": dict(FLOW_FACTORY, model="qwen-image-2.1-edit", height=384, width=384, num_steps=10,
                                eval_steps=40, noise_level=1.0, lora_targets=LORA_TARGETS["tiny-qwen-image-2.1"],
                                activation_checkpointing=True, checkpoint_every=20, eval_every=20),
    # from text: miles_diffusion's (scripts/run_diffusion_grpo_qwenimage21_pickscore_1gpu_v2.py at 6120710), 16 × 16
    # images 512², 10 steps, no CFG, noise 1.2 on steps 3 and 4, its unbiased global std; evaluation (opt-in there): 20
    "qwen-image-2.1": dict(model="qwen-image-2.1", iterations=200, prompts="general", reward="pickscore", group_size=16,
                           prompts_per_iteration=16, micro_batch=4, height=512, width=512, num_steps=10, eval_steps=20,
                           noise_level=1.2, window=2, window_range=(3, 5), std="global-unbiased",
                           zero_advantage="keep", clip_range=1e-4, lr=1e-4, lora_rank=64, lora_alpha=128,
                           lora_targets=LORA_TARGETS["tiny-qwen-image-2.1"], mixed_precision=True,
                           activation_checkpointing=True, checkpoint_every=10, eval_every=20),
}
