"""Wan2.1 text-to-video (tiny-wan) against diffusers' own WanPipeline, and the loop on 5-D video latents.

The pipeline is compared with the scheduler the adapter puts into it, FlowMatchEulerDiscreteScheduler with Wan's shift
3.0 on the public Wan trainers' σ table (models_wan.wan_scheduler_class), not the checkpoints' UniPC: this project's
sampler takes Euler/SDE steps on that σ schedule, and WanPipeline.__call__ steps with whatever scheduler it holds
(docs/algorithm.md §13)."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image, ImageSequence

import algorithms
import cli
import engine as eng
import flowgrpo
import model_checks
import models
import models_wan
import rewards
import rollout
import runlog
import scheduler as sch
import startup
from tiny_setup import check_ode_path_against_the_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H = W = 32
FRAMES = 9  # 3 latent frames: the first alone, then 4 frames each
PROMPTS = ["a red cat", "a blue dog sitting on a green hill at sunset"]
TINY_WAN = flowgrpo.RECIPES["tiny-wan"]


@pytest.fixture(scope="module")
def wan():
    return models.load_model("tiny-wan", None, "cpu", seed=0, num_frames=FRAMES)


def test_tiny_is_deterministic_saves_and_reloads_and_encodes_as_the_pipeline(wan, tmp_path):
    """The same seed builds the same weights, another seed others; `save-tiny` writes a directory that --model-path
    loads back exactly (the tokenizer built in code included); prompts encode through the pipeline's encode_prompt."""
    other = models.adapter_class("tiny-wan").build_tiny(1)
    assert any(not torch.equal(p, other.transformer.state_dict()[n]) for n, p in wan.transformer.state_dict().items())
    again = models.load_model("tiny-wan", models.save_tiny_pipeline(str(tmp_path / "w"), 0, "tiny-wan"), "cpu",
                              num_frames=FRAMES)
    for part in ("transformer", "vae", "text_encoder"):
        theirs = getattr(again.pipe, part).state_dict()
        assert all(torch.equal(p, theirs[k]) for k, p in getattr(wan.pipe, part).state_dict().items()), part
    mine = wan.encode(PROMPTS)["embeds"]
    embeds, _ = wan.pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=77)
    assert torch.equal(mine, embeds) and torch.equal(again.encode(PROMPTS)["embeds"], mine)
    assert (mine[0] - mine[1]).abs().max() > 1e-3
    assert wan.noise([torch.Generator()], H, W).shape == (1, 16, 3, 8, 8)  # (C, F', H/4, W/4): the toy VAE's 4×
    assert wan.image_seq_len(H, W) == 3 * 4 * 4  # latent frames × 2×2 patches
    # --sp's start-up count, from the name and flags before anything loads, is the loaded model's (docs §14)
    counted = models.adapter_class("tiny-wan").sp_sequences("tiny-wan", models.SPECS["tiny-wan"], H, W, FRAMES)
    assert counted == {"video tokens": wan.image_seq_len(H, W)}


def test_a_wan22_pipeline_is_refused_at_start_up_and_when_loaded(tmp_path):
    """WanPipeline also loads Wan2.2: a second expert below a boundary σ (A14B) or a timestep per token (TI2V-5B), which
    the adapter (one transformer, one timestep a call) would have sampled and trained wrong without a word: its
    model_index.json is refused before anything loads, and a loaded pipeline by the adapter."""
    path = models.save_tiny_pipeline(str(tmp_path / "w"), 0, "tiny-wan")
    model_checks.check_model_path("tiny-wan", path)  # Wan2.1's: its keys unset (null, false)
    index = json.loads(Path(path, "model_index.json").read_text())
    assert {"transformer_2", "boundary_ratio", "expand_timesteps"} <= set(index), sorted(index)  # diffusers writes them
    for change in ({"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875},
                   {"expand_timesteps": True}):
        Path(path, "model_index.json").write_text(json.dumps(index | change))
        with pytest.raises(ValueError, match=f"is a Wan2.2 pipeline \\({', '.join(change)} set\\).*Wan2.1"):
            model_checks.check_model_path("tiny-wan", path)
    pipe = models.adapter_class("tiny-wan").build_tiny(0)
    pipe.register_to_config(expand_timesteps=True)
    with pytest.raises(ValueError, match="the pipeline is a Wan2.2 pipeline"):
        models_wan.Wan(pipe, torch.device("cpu"), torch.float32, num_frames=FRAMES)


@pytest.mark.parametrize("cfg", [1.0, 4.5])
def test_ode_rollout_reproduces_the_diffusers_pipeline(wan, cfg):
    """From the same initial latents and embeddings, CFG off and on: our ODE sampler's latents equal
    WanPipeline.__call__'s bit for bit (run with the adapter's Euler scheduler), its frames within 1e-6, and the σ
    schedule is the one the pipeline set."""
    assert isinstance(wan.pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    frames_diff = check_ode_path_against_the_pipeline(wan, PROMPTS, cfg, H, W)
    print(f"\ncfg {cfg}: frames max |ours − pipeline's| {frames_diff:.3g}")


def test_cfg_changes_the_velocity_and_frames_change_where_latent_frames_do(wan):
    """Neither check above is vacuous: CFG changes v. The toy's frame-wise decoder (models_wan.frame_wise_decoder):
    the 4 frames of a latent frame are equal, consecutive latent frames decode to different frames, and the same
    latent frame repeated decodes to the same frames (the first one aside: it is decoded alone)."""
    x, sigma = wan.noise(rollout.image_generators(0, 0, [0, 1]), H, W), torch.full((2,), 0.6)
    v1, v4 = (wan.velocity(x, sigma, wan.conditioning(PROMPTS, "", c), c, H, W) for c in (1.0, 4.5))
    assert (v1 - v4).abs().max() > 1e-3

    def change(latents):  # (F − 1,) max |frame_{t+1} − frame_t|
        frames = wan.decode(latents, H, W)
        return (frames[:, 1:] - frames[:, :-1]).abs().amax(dim=(0, 2, 3, 4))
    moving, still = change(x), change(x[:, :, :1].expand_as(x).contiguous())
    within = [1, 2, 3, 5, 6, 7]  # pairs inside latent frames 1 (frames 1-4) and 2 (frames 5-8)
    assert moving[within].max() == 0 and still[within].max() == 0
    assert moving[4] > 1e-2 and still[4] == 0, (moving, still)  # frame 4 → 5 crosses latent frames 1 → 2


def test_the_step_treats_5d_latents_as_their_flattened_elements():
    """scheduler.step's mean and log-prob on (B, C, F', h, w) are those of the same elements laid out flat: the
    element mean runs over every non-batch dimension."""
    g = torch.Generator().manual_seed(0)
    x, v, x_next = (torch.randn(3, 16, 3, 8, 8, generator=g) for _ in range(3))
    kw = dict(sigma_max=0.86, noise_level=0.7, x_next=x_next)
    _, lp5, mean5, _ = sch.step(v, x, 0.6, 0.4, **kw)
    _, lp2, mean2, _ = sch.step(v.flatten(1), x.flatten(1), 0.6, 0.4, **(kw | dict(x_next=x_next.flatten(1))))
    assert lp5.shape == (3,) and torch.equal(lp5, lp2) and torch.equal(mean5.flatten(1), mean2)


# (flags, engine options): full mode with CFG; a window with the frozen UMT5 sharded; a branched window; and the
# variants (DanceGRPO's SDE as the recipe, cps, GRPO-Guard, MixGRPO-Flash's dpm2 tail, EMA) on video latents
VARIANTS = [
    (dict(cfg_scale=4.5), {}),
    (dict(window=2, window_range=(0, 3)), dict(shard_text_encoder=True)),
    (dict(window=2, window_range=(1, 3), branch=True), {}),
    (dict(sde_type="dance", noise_level=0.3, num_steps=8, window=2, window_range=(0, 3), ode_solver="dpm2",
          guard="full"), dict(ema_decay=0.9, ema_every=1)),
    (dict(sde_type="cps", noise_level=0.5, window=1, window_range=(0, 2)), {}),
]


@pytest.mark.parametrize("change,options", VARIANTS)
def test_first_update_is_exactly_on_policy_on_video_latents(change, options):
    """`train/logp_gap` is exactly 0 in float32 with 5-D latents, whatever the variant; the second optimizer step
    runs on moved weights (its gap is not 0), so the check can fail."""
    a = dataclasses.replace(TINY_WAN, num_frames=5, group_size=4, prompts_per_iteration=2, micro_batch=4,
                            negative_prompt="", **change)
    model = models.load_model("tiny-wan", None, "cpu", seed=0, num_frames=a.num_frames)
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=a.lr, weight_decay=0,
                        max_grad_norm=1.0, seed=0, **options)
    steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=1)
    batch = rollout.sample(model, ["a cat"] * 4 + ["a tall house"] * 4, [{}] * 8, [0] * 4 + [1] * 4, range(8),
                           steps=steps, num_steps=a.num_steps, height=H, width=W, cfg_scale=a.cfg_scale,
                           negative_prompt="", noise_level=a.noise_level, sde_type=a.sde_type, seed=0, iteration=0,
                           chunk=4, branch=a.branch, ode_solver=a.ode_solver)
    assert batch.latents.shape == (8, len(steps) + 1, 16, 2, 8, 8) and batch.images.shape == (8, 5, 3, H, W)
    if a.branch:  # a group's videos share the state at the window start and branch there
        assert all(torch.equal(batch.latents[0, 0], batch.latents[i, 0]) for i in range(4))
        assert not torch.equal(batch.latents[0, 1], batch.latents[1, 1])
    batch.advantages = torch.linspace(-1, 1, 8)
    stats = algorithms.train_on(model, engine, batch, a, flowgrpo.batch_arithmetic(a, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0 and stats["train/grad_norm"] > 0
    _, after = algorithms.policy_loss(model, engine, batch.chunk(0, 4), 0, a)
    assert float(after["gap"]) > 0
    if engine.ema is not None:  # evaluation under the EMA weights samples videos that differ from the trained ones
        ode = eval_videos(model, a)
        with engine.ema_weights():
            assert (eval_videos(model, a) - ode).abs().max() > 0


def eval_videos(model, a):
    return rollout.sample_ode(model, ["a cat", "a tall house"], num_steps=a.eval_steps, height=H, width=W,
                              cfg_scale=a.cfg_scale, negative_prompt="", seed=0, chunk=2)


# ---- rewards on videos ---------------------------------------------------------------------------------------------
def test_image_rewards_score_every_fourth_frame_and_average_video_rewards_see_motion():
    g = torch.Generator().manual_seed(0)
    videos = torch.rand(2, 9, 3, 8, 8, generator=g)
    videos[1] = videos[1, :1]  # a still video
    u8 = rewards.to_uint8(videos)  # (B, F, H, W, 3)
    assert u8.shape == (2, 9, 8, 8, 3)
    bright, _ = rewards.make_reward("brightness")(videos, PROMPTS)
    by_hand = [np.mean([u8[b, f].mean() / 255 for f in (0, 4, 8)]) for b in range(2)]  # frames 0, 4, 8
    np.testing.assert_allclose(bright, by_hand, rtol=1e-12)
    assert abs(bright[0] - u8[0].mean() / 255) > 1e-4  # not simply the mean over all frames
    change = [np.abs(np.diff(u8[b].astype(np.float64), axis=0)).mean() / 255 for b in range(2)]
    motion, _ = rewards.make_reward("motion")(videos, PROMPTS)
    still, _ = rewards.make_reward("temporal_consistency")(videos, PROMPTS)
    np.testing.assert_allclose(motion, change, rtol=1e-6)
    np.testing.assert_allclose(still, 1 - np.array(change), rtol=1e-6)
    assert motion[1] == 0 and motion[0] > 0.2  # the still video does not move
    total, info = rewards.make_reward("brightness=1,motion=2")(videos, PROMPTS)
    np.testing.assert_allclose(total, bright + 2 * motion) and set(info) == {"brightness", "motion"}


def test_video_samples_are_an_animated_gif_and_a_first_frame_grid(tmp_path):
    (tmp_path / "samples").mkdir()
    log = runlog.RunLog.__new__(runlog.RunLog)
    log.run_dir, log.enabled, log.wandb = str(tmp_path), True, None
    videos = torch.rand(3, 5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    log.samples(7, videos, ["a cat | 0.1", "a dog | 0.2", "a house | 0.3"])
    gif = Image.open(tmp_path / "samples" / "eval_00007.gif")
    # GIF stores frame durations in hundredths of a second: 1000 / 16 ms becomes 60 ms
    assert gif.n_frames == 5 and gif.info["loop"] == 0 and abs(gif.info["duration"] - 1000 / runlog.VIDEO_FPS) < 10
    first = Image.open(tmp_path / "samples" / "eval_00007.png")
    assert first.size == gif.size


# ---- flags, and the real CLI ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--model", "tiny-wan", "--num-frames", "8"], "--num-frames must be 4·n \\+ 1"),
    (["--model", "tiny", "--num-frames", "5"], "--num-frames must be 1 for --model tiny"),
    (["--model", "tiny", "--reward", "motion"], "--reward motion scores videos"),
    (["--model", "tiny-wan", "--num-frames", "1", "--reward", "temporal_consistency"], "--num-frames > 1"),
    (["--model", "wan2.1-t2v-1.3b", "--height", "232"], "--height must be a positive multiple of 16"),
])
def test_video_flags_are_refused_before_anything_is_built(flags, needle):
    with pytest.raises(ValueError, match=needle):
        startup.check_args(cli.parse_args(flowgrpo.Args, flags))


# 18 iterations of the recipe, not its 30, at seed 2: the rise (mean motion reward of the last 3 iterations − of the
# first 3, in iteration-0 within-batch stds) measured 5.0 at 18 (4.0 at 15, 3.0 at 12). Seed 2 is the fastest of the
# three seeds measured in docs/algorithm.md §13 (7.0, against 5.4 and 3.4 for seeds 0 and 1 at 30); seed 0 needs 26
# iterations for 4.7 (3.1 at 20, 1.0 at 12). The threshold stays at 3 stds, the 30-iteration test's: 5.0 clears it by
# 1.67×, and it can fail: seed 0 does not clear it in these 18 iterations (2.3).
WAN_ITERATIONS, WAN_SEED = 18, 2


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    """The tiny-wan recipe through the CLI (seed 2, 18 iterations), evaluated at its first and last iteration (4
    videos; wandb offline, which gets the GIFs too): (its directory, its metrics rows)."""
    run = tmp_path_factory.mktemp("wan") / "run"
    out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), "--model", "tiny-wan", "--run-dir",
                          str(run), "--seed", str(WAN_SEED), "--iterations", str(WAN_ITERATIONS), "--eval-every",
                          str(WAN_ITERATIONS - 1), "--eval-images", "4"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=os.environ | {"WANDB_MODE": "offline"})
    assert out.returncode == 0, out.stderr[-3000:]
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tiny_wan_learns_motion_exactly_on_policy_and_leaves_videos(wan_run):
    """The tiny-wan recipe through the CLI: the motion reward (mean change between consecutive frames) rises by more
    than 3 within-batch stds (measured 5.0, above), every first update is exactly on-policy, and the evaluations are
    GIFs with first-frame grids."""
    run, rows = wan_run
    assert len(rows) == WAN_ITERATIONS
    assert all(r["train/logp_gap"] == 0 for r in rows) and all(r["train/approx_kl"] > 0 for r in rows)
    first, last = (sum(r["reward/mean"] for r in part) / 3 for part in (rows[:3], rows[-3:]))
    print(f"\nmotion: {[round(r['reward/mean'], 4) for r in rows]} (iteration-0 std {rows[0]['reward/std']:.4f})")
    assert last - first > 3 * rows[0]["reward/std"], (first, last, rows[0]["reward/std"])
    last_eval = f"eval_{WAN_ITERATIONS - 1:05d}"
    assert sorted(os.listdir(run / "samples")) == ["eval_00000.gif", "eval_00000.png", f"{last_eval}.gif",
                                                   f"{last_eval}.png"]
    assert (run / "wandb").is_dir() and (run / "reward_curve.png").stat().st_size > 5000
    gif = Image.open(run / "samples" / f"{last_eval}.gif")  # Pillow merges equal consecutive frames, adding durations
    shown = sum(frame.info["duration"] for frame in ImageSequence.Iterator(gif))
    want = TINY_WAN.num_frames * 1000 / runlog.VIDEO_FPS  # ms, each frame's rounded to 10 ms in the file
    assert 1 < gif.n_frames <= TINY_WAN.num_frames and abs(shown - want) <= 10 * gif.n_frames, (gif.n_frames, shown)


def test_the_tiny_wan_clip_acts_in_its_second_optimizer_step(wan_run):
    """tiny-wan's clip range is the scale of its second optimizer step's ratios (docs/algorithm.md §7): the first step
    is exactly on-policy (every ratio 1, none clipped) and the clip acts on some of the second step's ratios, in
    iteration 0 and in most iterations (measured: 18 of 18; at 0.2 in none of them). tiny's, tiny-sd3's and
    tiny-flux's: tests/test_loop.py."""
    clipfrac = [r["train/clipfrac"] for r in wan_run[1]]
    acted = sum(c > 0 for c in clipfrac)
    assert clipfrac[0] > 0 and sum(c > 0 for c in clipfrac[:3]) >= 2 and acted >= 0.8 * len(clipfrac), clipfrac
    assert max(clipfrac) <= 0.5, clipfrac  # the first step's half of the ratios are 1: at most half are clipped


def test_the_sigma_table_is_the_public_wan_trainers():
    """σ_i = s(1 − i/N), s(t) = 3t/(1 + 2t): DanceGRPO's table (fastvideo/train_grpo_wan_2_1.py, `sd3_time_shift(3,
    linspace(1, 0, N + 1))`, re-typed here), to float32 rounding; diffusers' own for the same config ends elsewhere."""
    for n in (4, 20, 50):
        t = torch.linspace(1, 0, n + 1)
        public = 3 * t / (1 + 2 * t)
        ours = sch.sigma_schedule(models_wan.wan_scheduler_class()(**models_wan.WAN_SCHEDULER), n, 0)
        torch.testing.assert_close(ours, public, rtol=0, atol=1e-6)
    ours = sch.sigma_schedule(models_wan.wan_scheduler_class()(**models_wan.WAN_SCHEDULER), 20, 0)
    stock = sch.sigma_schedule(FlowMatchEulerDiscreteScheduler(**models_wan.WAN_SCHEDULER), 20, 0)
    assert abs(ours[-2].item() - 3 / 22) < 1e-6 and abs(stock[-2].item() - 0.0089) < 1e-4, (ours, stock)  # s(1/20)
