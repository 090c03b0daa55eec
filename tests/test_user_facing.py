"""What a user sees, tried as a newcomer would: a failed multi-rank start says one line, a refused start leaves the
lock of the run that is there, run directories get plain names, a run ends by telling its judge, its curve and sample
grid stay readable, a run whose every update is skipped stops, and the method comparison never touches a run it does
not own."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

import args
import cli
import engine as eng
import flowgrpo
import prompts
import rundir
import runlog
import startup
from tiny_setup import main_here
from tasks import nano, nano_compare, nano_compose, nano_edit

ROOT = Path(__file__).resolve().parents[1]
ENV = os.environ | {"WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
HOLD = "import sys, time, rundir\nrundir.lock_run_dir(sys.argv[1], True)\nprint('held', flush=True)\ntime.sleep(900)"


def test_a_failed_multi_rank_start_says_one_line_from_rank_0(tmp_path):
    """Weights that cannot be loaded, two ranks: before, rank 0 printed a run directory that was never made, its
    error, and each rank a false "interrupted … --resume auto continues"."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(ROOT / "flowgrpo.py"), "--model", "qwen-image", "--model-path", "nobody/no-such-model",
                          "--run-dir", str(run), "--no-wandb"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                         timeout=300)
    said = [line for line in (out.stdout + out.stderr).splitlines() if "flowgrpo.py:" in line or "run directory" in line]
    assert out.returncode != 0 and len(said) == 1 and said[0].startswith("flowgrpo.py: error: --model qwen-image"), said
    project_frames = re.findall(rf'File "{ROOT}/(?!\.venv)[^"]*"', out.stderr)
    assert not project_frames, project_frames  # no stack of the project's (torchrun's own report stays)
    assert not run.exists()


def test_a_refused_start_leaves_the_lock_line_of_the_run_there(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')
    (run / ".lock").write_text("the run on host h, PID 1, started then\n")
    with pytest.raises(ValueError, match="already holds a run"):
        rundir.claim_run_dir(str(run), "tiny-brightness", None, {}, {})
    rundir.release_run_dirs()
    assert (run / ".lock").read_text() == "the run on host h, PID 1, started then\n"


def test_a_run_dir_inside_a_runs_and_a_copied_checkpoint_without_one_are_refused(tmp_path):
    """`--run-dir A/checkpoints` was taken while A ran: each run's clean-up of interrupted writes removed the other's
    checkpoint or LoRA being written. A checkpoint copied out of its run's checkpoints/ folder, resumed without
    --run-dir, made its grandparent folder (whatever that was) the run directory. Both refused now, before anything is
    written; a comparison's locked directory (tasks/nano_compare.py) still takes its runs."""
    run = tmp_path / "a"
    run.mkdir()
    (run / "args.json").write_text('{"run_id": "r"}')
    with pytest.raises(ValueError, match=f"--run-dir {run}/checkpoints/x is inside the run directory {run}: give"):
        rundir.claim_run_dir(str(run / "checkpoints" / "x"), "tiny-brightness", None, {}, {})
    copy = tmp_path / "saved" / "ckpts" / "iter_000001"
    copy.mkdir(parents=True)
    with pytest.raises(ValueError, match=f"--resume {copy}: a checkpoint outside a run directory's checkpoints/ folder"
                                         r" \(a copy\) names no run directory to continue in: give --run-dir"):
        rundir.claim_run_dir(None, "tiny-brightness", str(copy), {"run_id": "r"}, {})
    rundir.release_run_dirs()
    assert os.listdir(run) == ["args.json"] and os.listdir(tmp_path / "saved") == ["ckpts"]
    rundir.lock_run_dir(str(tmp_path / "comparison"), True)
    try:
        assert rundir.claim_run_dir(str(tmp_path / "comparison" / "grpo" / "seed0"), "tiny-brightness", None, {}, {})
    finally:
        rundir.release_run_dirs()


CPS = "--sde-type cps --noise-level 0.5 --window 1"
GARDO = "--algorithm gardo --reward brightness=1,jpeg_compressibility=0 --gardo-proxies jpeg_compressibility"


@pytest.mark.parametrize("given, needle, accepted", [
    ("--window-range 1 3", "--window-range acts only with --window > 0", "--window-range 1 3 --window 1"),
    ("--full-finetune --lora-rank 4", "--lora-rank acts only with a LoRA", "--lora-rank 4"),
    ("--ema-every 3 --ema-form dance", "--ema-every acts only with --ema-decay > 0; --ema-form acts only",
     "--ema-every 3 --ema-form dance --ema-decay 0.9"),
    ("--is-cap 3", "--is-cap acts only with --stale-correction decoupled", "--is-cap 3 --stale-correction decoupled"),
    ("--dppo-threshold 0.5", "--dppo-threshold acts only with --trust-region dppo",
     "--dppo-threshold 0.5 --trust-region dppo"),
    ("--slide-every 3 --window 1", "--slide-every acts only with --window-schedule sliding",
     "--slide-every 3 --window 1 --window-schedule sliding"),
    ("--cps-density exact", "--cps-density acts only with --sde-type cps", "--cps-density exact --sde-type cps"),
    ("--kl-form exact", "--kl-form acts only with --kl-beta > 0", "--kl-form exact --kl-beta 0.01"),
    # encoded only for CFG's second branch; a margin of a hinge that is off (each ran bit for bit as without it)
    ("--negative-prompt blurry", "--negative-prompt acts only with --cfg-scale > 1",
     "--negative-prompt blurry --cfg-scale 2"),
    ("--normguard-margin 0.2", "--normguard-margin acts only with --normguard > 0",
     "--normguard-margin 0.2 --normguard 0.1"),
    # each of these also ran bit for bit as without it (metrics.jsonl and the LoRA, 2 iterations of tiny): full
    # mode's (and DPO's) one ODE step, to σ = 0, is Euler's in every solver; dppo's mask has no clip; cps's 2 KLs agree
    ("--ode-solver dpm2", "--ode-solver acts only with ODE steps after a window", "--ode-solver dpm2 --window 1"),
    ("--algorithm dpo --micro-batch 8 --ode-solver dpm2-full", "--ode-solver acts only with",
     "--algorithm dgpo --micro-batch 8 --ode-solver dpm2-full"),
    ("--trust-region dppo --clip-range 0.5", "--clip-range acts only with --trust-region clip", "--clip-range 0.5"),
    # one optimizer step on the trainer's own log-probs: every ratio is exactly 1, where no clip or mask acts
    ("--optimizer-steps 1 --clip-range 0.5", "--clip-range acts only with --trust-region clip (dppo's mask replaces "
     "it) and ratios that leave 1: --optimizer-steps > 1, or --off-policy 1 or --rollout vllm-omni with bypass",
     "--optimizer-steps 1 --algorithm dgpo --micro-batch 8 --clip-range 0.5"),
    ("--optimizer-steps 1 --trust-region dppo --dppo-threshold 0", "--trust-region acts only with ratios that leave 1"
     ": --optimizer-steps > 1, or --off-policy 1 or --rollout vllm-omni with bypass; --dppo-threshold acts only with "
     "--trust-region dppo and ratios", "--trust-region dppo --dppo-threshold 0"),
    (f"{CPS} --kl-beta 0.1 --kl-form exact", "--kl-form acts only with --kl-beta > 0 and --sde-type sde or dance",
     "--sde-type dance --kl-beta 0.1 --kl-form exact"),
    # GRPO-Guard's normalised ratio takes the exact density whatever --cps-density says; decoupled's weights read it
    (f"{CPS} --guard full --cps-density exact", "--cps-density acts only with --sde-type cps, and not with --guard",
     f"{CPS} --guard full --cps-density exact --stale-correction decoupled"),
    # GARDO's advantages divide by no std; DPO pairs each group's best and worst reward, its advantages unread
    (f"{GARDO} --kl-beta 0.04 --std group", "--std acts only with --algorithm grpo, nft, awm or dgpo", "--std group"),
    ("--algorithm dpo --micro-batch 8 --adv-eps 1e-8", "--adv-eps acts only with --algorithm grpo, nft, awm or dgpo",
     "--adv-eps 1e-8"),
    ("--algorithm dpo --micro-batch 8 --adv-clip 1", "--adv-clip acts only with --algorithm grpo, gardo, nft, awm",
     "--algorithm dgpo --micro-batch 8 --adv-clip 1"),
    (f"{GARDO} --gardo-kl-threshold 1e-5 --gardo-reset-every 3", "--gardo-kl-threshold acts only with --kl-beta > 0; "
     "--gardo-reset-every", f"{GARDO} --kl-beta 0.04 --gardo-reset-every 3"),
    ("--algorithm awm --old-kl 0 --old-decay nft0 --old-every 2", "--old-decay acts only with an old policy that is "
     "read (awm: --old-kl > 0); --old-every", "--algorithm awm --old-decay nft0 --old-every 2"),
    ("--eval-every 0 --eval-images 4 --eval-steps 4", "--eval-images acts only with --eval-every > 0; --eval-steps",
     "--eval-images 4 --eval-steps 4"),
])
def test_a_flag_given_without_the_flag_it_acts_with_is_refused_naming_it(given, needle, accepted):
    """Before, each ran to its end changing nothing (full mode trained every step; no EMA ran; ...). A recipe's own
    value is not a flag given: nano's --window-range (0, 5) in full mode starts."""
    with pytest.raises(ValueError) as e:
        startup.check_args(cli.parse_args(flowgrpo.Args, given.split()))
    assert str(e.value).startswith(needle) and "\n" not in str(e.value), str(e.value)
    startup.check_args(cli.parse_args(flowgrpo.Args, accepted.split()))
    nano = cli.parse_args(flowgrpo.Args, ["--model", "nano"])
    assert nano.window == 0 and nano.window_range != flowgrpo.Args.window_range
    startup.check_args(nano)


def test_a_flag_with_nothing_to_act_on_in_one_process_or_without_resume_is_refused(monkeypatch):
    """--shard-text-encoder in one process (the engine shards it only over several ranks) and --allow-change without
    --resume: before, each ran as without it."""
    for given, needle in (("--shard-text-encoder", "--shard-text-encoder acts only with several training ranks"),
                          ("--allow-change lr", "--allow-change acts only with --resume")):
        with pytest.raises(ValueError, match=re.escape(needle)):
            startup.check_args(cli.parse_args(flowgrpo.Args, given.split()))
    monkeypatch.setenv("WORLD_SIZE", "2")
    startup.check_args(cli.parse_args(flowgrpo.Args, ["--shard-text-encoder"]))


def test_one_optimizer_step_takes_a_clip_only_against_a_servers_or_stale_log_probs():
    """--optimizer-steps 1 --clip-range: a server's log-probs (its rounding) or an older rollout's (--off-policy 1)
    move the ratio under bypass, so the clip acts there; decoupled recomputes them, and every ratio is 1 again."""
    tiny = flowgrpo.RECIPES["tiny"]
    for change in (dict(rollout="vllm-omni"), dict(off_policy=1)):
        args.check_companions(dataclasses.replace(tiny, optimizer_steps=1, clip_range=0.5, **change), tiny)
        with pytest.raises(ValueError, match="^--clip-range acts only with"):
            args.check_companions(dataclasses.replace(tiny, optimizer_steps=1, clip_range=0.5,
                                                      stale_correction="decoupled", **change), tiny)


def test_gardos_kl_with_every_weight_trained_starts_its_reference_being_its_old_policy():
    """--full-finetune --kl-beta > 0 was refused for every algorithm ("the reference is the adapter off"); GARDO's KL
    is to its old policy, which a full fine-tune keeps (2 iterations of tiny ran, train/kl > 0)."""
    given = f"{GARDO} --full-finetune --kl-beta 0.04".split()
    startup.check_args(cli.parse_args(flowgrpo.Args, given))
    with pytest.raises(ValueError, match=r"--kl-beta > 0 needs a LoRA \(the reference is the adapter off\)"):
        startup.check_args(cli.parse_args(flowgrpo.Args, ["--full-finetune", "--kl-beta", "0.04"]))


def test_resuming_a_checkpoint_with_a_flag_this_version_lacks_records_it_as_changed(tmp_path):
    """A flag of the checkpoint's that this version no longer has (one removed since) goes into args.json's history
    as changed to null; before, a KeyError traceback stopped the start."""
    resumed = tmp_path / "src" / "checkpoints" / "iter_000003"
    resumed.mkdir(parents=True)
    (tmp_path / "src" / "args.json").write_text('{"run_id": "r"}')
    meta = {"run_id": "r", "flags": {"lr": 1e-4, "old_removed_flag": 1}, "loop": {"wandb_id": None, "iteration": 3}}
    claim = rundir.claim_run_dir(None, "tiny-x", str(resumed), meta, {"lr": 1e-4})
    rundir.release_run_dirs()
    assert claim.args["resumes"][-1]["changed"] == {"old_removed_flag": [1, None]}, claim.args


def test_run_directories_get_names_nothing_has_to_quote():
    assert rundir.safe_name("nano-digit=1,digit_judge=0") == "nano-digit+digit_judge"
    assert rundir.safe_name("tiny-ocr=1.0,pickscore=-0.5e-1") == "tiny-ocr+pickscore"
    assert rundir.safe_name("tiny-remote=http://127.0.0.1:8000/x") == "tiny-remote_http_127.0.0.1_8000_x"


def test_help_names_every_built_in_prompt_set_and_what_eval_images_are(capsys, monkeypatch):
    """flowgrpo.py's parse of `--help`, in this process (tests/test_loop.py::test_run_sh_recipes_launch runs it)."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as e:
        cli.parse_args(flowgrpo.Args, ["--help"])
    out = capsys.readouterr().out
    names = f"({', '.join(prompts.BUILTIN)})"  # every built-in set (compose was left out)
    assert e.value.code == 0 and names in out and "image i shows eval prompt i mod" in out, out


def test_a_run_ends_by_telling_its_judge_and_draws_it(tmp_path, capsys):
    """The closing summary names each weight-0 reward (the judge) from its first to its last evaluation; the curve has
    a second panel for it. Before: only the reward, and one panel."""
    claim = runlog.Claim(str(tmp_path), "id", None, {"group_size": 8, "reward": "digit=1,digit_judge=0"})
    log = runlog.RunLog(claim, enabled=True, use_wandb=False, judges=["digit_judge"])
    for it in range(3):
        log.log({"iteration": it, "reward/mean": 0.5, "reward/std": 0.4, "reward/min": 0.0, "reward/max": 1.0,
                 "reward/zero_std_ratio": 0.0, "reward/digit_judge/mean": 0.4 + 0.1 * it, "eval/reward_mean": 0.5,
                 "eval/digit_judge/mean": 0.45 + 0.1 * it})
    log.close()
    said = capsys.readouterr().out
    assert "digit_judge, the judge (weight 0, never trained on), on the eval images: 0.45 (iteration 0) → 0.65 " \
           "(iteration 2)" in said, said
    two_panels = Image.open(tmp_path / "reward_curve.png").size
    assert two_panels[0] > 1.5 * two_panels[1], two_panels


@pytest.mark.parametrize("omp,threads", [(None, 1), ("2", 2)])
def test_a_cpu_run_takes_one_torch_thread_unless_omp_num_threads_says(tmp_path, monkeypatch, omp, threads):
    """On CPU the loop runs one torch thread where OMP_NUM_THREADS is unset (the laptop models' operations are too
    small to share: on 2 idle cores nano's recipe took twice as long on two, BENCHMARKS.md), and as many as it says
    where it is set. Before: one a physical core, so two on the 2-core machines."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if omp:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what torch takes by itself on a 2-core machine, or OMP_NUM_THREADS=2
    try:
        flowgrpo.main(cli.parse_args(flowgrpo.Args, ["--no-wandb", "--iterations", "1", "--prompts-per-iteration", "1",
                                                     "--group-size", "2", "--micro-batch", "2", "--optimizer-steps", "1",
                                                     "--eval-every", "0", "--run-dir",
                                                     str(tmp_path / "run")]))
        seen = torch.get_num_threads()
    finally:
        eng.shutdown()
        rundir.release_run_dirs()
        torch.set_num_threads(before)
    assert seen == threads, f"OMP_NUM_THREADS={omp}: the run took {seen} torch threads, not {threads}"


def test_the_reward_curve_is_redrawn_only_while_drawing_is_cheap_and_always_at_the_end(tmp_path, monkeypatch):
    """reward_curve.png is redrawn after a row only while drawing has taken at most 2% of the run's time (a redraw
    costs ~0.1 s; a tiny run's iterations take ~1 s), and once more at close. Here each draw "takes" 1 s of a run that
    is 10 s old at the first row and 12 s old at the last: the first row draws, the next two do not (1 s > 2% of 11 s),
    close draws with every row. Before: every row drew (4 draws, the last from 3 rows, none at close)."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(runlog.time, "time", lambda: clock["now"])
    drawn = []

    def plot(path, rows, judges):
        drawn.append(len(rows))
        clock["now"] += 1.0
    monkeypatch.setattr(runlog, "plot_curve", plot)
    claim = runlog.Claim(str(tmp_path), "id", None, {"group_size": 8, "reward": "digit"})
    log = runlog.RunLog(claim, enabled=True, use_wandb=False)
    for it in range(3):
        clock["now"] = 1010.0 + it
        log.log({"iteration": it, "reward/mean": 0.5, "reward/std": 0.1, "reward/zero_std_ratio": 0.0})
    log.close()
    assert drawn == [1, 3], drawn


def test_a_sample_grid_of_many_images_stays_readable():
    """200 eval images of 10 prompts (the nano recipe's): one row per prompt, 8 images each. Before: a 768 × 11,800
    pixel column. 200 different prompts: the first 32, four a row."""
    images = torch.rand(200, 3, 16, 16)
    per_prompt = runlog.grid_image(images, [f"a handwritten digit {i % 10} | 0.5" for i in range(200)])
    assert per_prompt.size[0] <= 8 * 96 and per_prompt.size[1] <= 18 + 10 * (16 + 96 + 14), per_prompt.size
    flat = runlog.grid_image(images, [f"prompt {i} | 0.5" for i in range(200)])
    assert flat.size[0] == 4 * 192 and flat.size[1] <= 18 + 8 * (192 + 44), flat.size
    # the 32 shown are spread over the set (a set in blocks, nano-compose's categories, shows each): the last among them
    shades = torch.linspace(0, 1, 200)[:, None, None, None].expand(200, 3, 16, 16)
    red = np.asarray(runlog.grid_image(shades.clone(), [f"prompt {i} | 0.5" for i in range(200)]))[..., 0]
    tiles = [v for v, count in zip(*np.unique(red, return_counts=True)) if count >= 192 * 192]  # whole tiles' shades
    assert max(v for v in tiles if v < 255) > 240, tiles  # image 199's (before: the first 32, up to image 31's 40)


def test_the_eval_grid_captions_the_judge_the_claims_are_about(tmp_path, monkeypatch):
    """nano's eval grid, through its CLI: under each image its reward and, a line below, the judge's score (the
    weight-0 term the task's claims are about, never trained on). Before: the reward alone."""
    grids = []
    monkeypatch.setattr(runlog, "save_grid", lambda path, images, captions, sources=None: grids.append(captions))
    main_here("--model", "nano", "--iterations", "1", "--eval-every", "1", "--eval-images", "10", "--group-size", "2",
              "--prompts-per-iteration", "2", "--micro-batch", "2", "--run-dir", tmp_path / "run")
    captions = grids[-1]
    assert len(captions) == 10 and all(re.fullmatch(r"[^|]+ \| -?[0-9.]+\ndigit_judge [01]\.00", c) for c in captions), \
        captions
    judged = runlog.grid_image(torch.rand(10, 3, 16, 16), captions)
    plain = runlog.grid_image(torch.rand(10, 3, 16, 16), [c.split("\n")[0] for c in captions])
    assert judged.size[1] > plain.size[1], (judged.size, plain.size)  # room for the judge's line under each image


def test_a_run_whose_every_update_is_skipped_stops_naming_it(tmp_path, monkeypatch):
    """Every optimizer step of an iteration skipped (a gradient norm that is not finite) used to end with exit 0."""
    def never(self):
        self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=False)
        return float("nan"), True
    monkeypatch.setattr(eng.Engine, "step", never)
    a = dataclasses.replace(flowgrpo.Args(), run_dir=str(tmp_path / "run"), iterations=3, group_size=2,
                            prompts_per_iteration=2, micro_batch=2, eval_every=0, wandb=False)
    with pytest.raises(ValueError, match="iteration 0: all 2 optimizer steps were skipped"):
        flowgrpo.main(a)
    eng.shutdown()


# ---- the method comparison (tasks/nano_compare.py) honours run locks and flags ------------------------------------------

def hold(path: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_the_comparison_never_deletes_a_run_directory_a_live_trainer_holds(tmp_path):
    run = Path(nano_compare.run_path(str(tmp_path), "window 2", 0))
    holder = hold(run)
    (run / "metrics.jsonl").write_text('{"iteration": 0}\n')  # an unfinished run, in progress
    try:
        with pytest.raises(ValueError, match="is in use by the run on host"):
            nano_compare.run_method(nano, "window 2", ("--window", "2"), 0, str(tmp_path), 60, 10, 200)
        assert (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()


def test_a_second_comparison_into_the_same_out_is_refused_and_touches_nothing(tmp_path):
    (tmp_path / "window-2-seed0.log").write_text("the first comparison's log\n")
    holder = hold(tmp_path)
    try:
        out = subprocess.run([sys.executable, "-m", "tasks.nano_compare", "--out", str(tmp_path), "--seeds", "1", "--methods",
                              "window 2", "--iterations", "1"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                             timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2 and "python -m tasks.nano_compare: error: --out" in out.stderr and "in use" in out.stderr, out.stderr
    assert (tmp_path / "window-2-seed0.log").read_text() == "the first comparison's log\n"


def test_a_finished_run_is_reused_only_if_made_with_the_same_flags(tmp_path, monkeypatch):
    run = nano_compare.run_path(str(tmp_path), "window 2", 0)
    argv = nano_compare.command(nano, ("--window", "2"), 0, run, 3, 10, 200)
    os.makedirs(os.path.join(run, "lora"))
    Path(run, "metrics.jsonl").write_text("".join(f'{{"iteration": {i}}}\n' for i in range(3)))
    made = dataclasses.asdict(cli.parse_args(flowgrpo.Args, argv)) | {"run_id": "x", "batch_arithmetic": {}}
    Path(run, "args.json").write_text(json.dumps(made))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a finished run was run again"))
    assert nano_compare.run_method(nano, "window 2", ("--window", "2"), 0, str(tmp_path), 3, 10, 200) == run
    Path(run, "args.json").write_text(json.dumps({k: v for k, v in made.items() if k != "dgpo_beta"}))
    assert nano_compare.run_method(nano, "window 2", ("--window", "2"), 0, str(tmp_path), 3, 10, 200) == run  # a
    # flag added after the run was made counts as its default
    Path(run, "args.json").write_text(json.dumps(made | {"lr": 3e-3}))
    with pytest.raises(ValueError, match=r"made with other flags \(\{'lr': \[0.003, 0.001\]\}"):
        nano_compare.run_method(nano, "window 2", ("--window", "2"), 0, str(tmp_path), 3, 10, 200)
    # another --iterations is other flags too: refused, the finished run kept (it was deleted, hours of CPU with it)
    Path(run, "args.json").write_text(json.dumps(made))
    with pytest.raises(ValueError, match=r"made with other flags \(\{'iterations': \[3, 5\]\}"):
        nano_compare.run_method(nano, "window 2", ("--window", "2"), 0, str(tmp_path), 5, 10, 200)
    assert os.path.isdir(os.path.join(run, "lora")) and len(Path(run, "metrics.jsonl").read_text().splitlines()) == 3
    # a run stopped by Ctrl-C exports its LoRA too (flowgrpo.py): short of its --iterations it is an unfinished
    # attempt, started again (lora/ alone took it for a finished run, reused or refused)
    Path(run, "metrics.jsonl").write_text('{"iteration": 0}\n{"iteration": 1}\n')
    Path(run, "args.json").write_text(json.dumps(made | {"lr": 3e-3}))  # (other flags: a finished run's refusal)
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a) or subprocess.CompletedProcess(a, 1))
    with pytest.raises(ValueError, match="failed"):
        nano_compare.run_method(nano, "window 2", ("--window", "2"), 0, str(tmp_path), 3, 10, 200)
    assert len(started) == 1 and not os.path.exists(os.path.join(run, "lora"))


def test_a_comparison_whose_eval_images_miss_a_category_is_refused_before_its_runs(tmp_path):
    """The loop evaluates the first --eval-images held-out prompts, which come category by category: fewer than reach
    every category left the comparison's curves without one, a KeyError after every run had finished."""
    out = subprocess.run([sys.executable, "-m", "tasks.nano_compare", "--task", "nano-compose", "--out",
                          str(tmp_path / "c"), "--seeds", "1", "--methods", "window 2", "--eval-images", "64"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and not (tmp_path / "c").exists(), out.stderr[-2000:]
    assert "--eval-images 64 evaluates no held-out prompt of ['position', 'attribution', 'number']: give at least " \
           "111" in out.stderr, out.stderr[-2000:]
    nano_compare.check_categories(nano_compose, 111)
    with pytest.raises(ValueError, match=r"no held-out prompt of \['make it a \{d\}'\]: give at least 9"):
        nano_compare.check_categories(nano_edit, 8)


def test_a_runs_final_evaluation_is_kept_and_read_back(tmp_path):
    """The comparison evaluates a run's final LoRA once: run again (or resumed after an interruption there), it reads
    <run>/final-<per_prompt>.json; another --per-prompt is another evaluation."""
    calls = []
    task = SimpleNamespace(load=lambda lora: lora, evaluate=lambda pipe, n: calls.append(n) or {"judge_accuracy": 0.25})
    first = nano_compare.final_evaluation(task, str(tmp_path), 50)
    assert nano_compare.final_evaluation(task, str(tmp_path), 50) == first == {"judge_accuracy": 0.25}
    nano_compare.final_evaluation(task, str(tmp_path), 20)
    assert calls == [50, 20] and sorted(os.listdir(tmp_path)) == ["final-20.json", "final-50.json"]


def test_the_hacking_table_reads_where_the_reward_peaks_and_what_the_judge_lost(tmp_path):
    """`--hacking`'s table and curves on two made-up runs of one method: one whose reward rises to the end while its
    judge falls from 0.8 to 0.6 (hacking), one whose reward peaks at iteration 20; mean ± std over the two; then the
    same without a diversity logged."""
    def run(reward, judge, ratio):
        return {"reward_mean": np.array(reward), "judge": np.array(judge), "diversity": np.array([0.14, 0.12, 0.10]),
                "velocity_norm_ratio": np.array([1.0, 1.1, ratio]), "iterations": np.array([0, 20, 40]),
                "passes": np.array([100.0, 2000.0, 4000.0])}
    runs = {"X": [run([0.5, 0.7, 0.9], [0.5, 0.8, 0.6], 1.2), run([0.5, 0.8, 0.7], [0.5, 0.7, 0.7], 1.0)]}
    row = nano_compare.hacking_table(runs)[2].split(" | ")
    assert row[2] == "0.850 ± 0.050 (40, 20)" and row[3] == "65.0% ± 5.0%", row  # the reward's peak, the judge there
    assert row[7] == "-10.0% ± 10.0%" and row[10] == "1.100 ± 0.100 |", row  # final − peak of the judge; final ratio
    nano_compare.plot_hacking(str(tmp_path / "h.png"), runs)
    assert (tmp_path / "h.png").stat().st_size > 0
    for r in runs["X"]:  # a task whose evaluations log no diversity (nano-compose's): those columns say so, not nan
        r["diversity"] = np.full(3, np.nan)
    row = nano_compare.hacking_table(runs)[2].split(" | ")
    assert row[8] == row[9] == "—" and row[3] == "65.0% ± 5.0%", row
    nano_compare.plot_hacking(str(tmp_path / "h2.png"), runs)
    assert (tmp_path / "h2.png").stat().st_size > 0


def test_nano_grid_and_evaluate_name_a_run_without_a_lora_in_one_line(tmp_path, capsys):
    """`grid` through the script, `evaluate` through its main in this process: exit 2 and one line."""
    out = subprocess.run([sys.executable, "-m", "tasks.nano", "grid", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300)
    with pytest.raises(SystemExit) as e:
        nano.main(["evaluate", str(tmp_path)])
    for code, err in ((out.returncode, out.stderr), (e.value.code, capsys.readouterr().err)):
        assert code == 2 and err.strip().startswith("python -m tasks.nano: error:") and len(err.strip().splitlines()) == 1 and \
            "no exported LoRA" in err, err


# ---- the laptop tasks' CLIs: one line for each bad input, before anything runs -------------------------------------

def said(main, argv: list, capsys) -> str:
    """What a laptop CLI's `main(argv)` said as it stopped (its exit status 2, one line on stderr after any progress
    bar's, no traceback)."""
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    rundir.release_run_dirs()  # (a process's end lets go of tasks/nano_compare.py's lock on --out)
    lines = [line for line in capsys.readouterr().err.split("\n") if line and not line.startswith("\r")]
    assert stopped.value.code == 2 and len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def test_the_laptop_clis_refuse_what_could_not_finish_in_one_line(tmp_path, capsys):
    """Sizes without an upper bound (`python -m tasks.nano_compare --seeds 10⁹` held 3 GB after 79 s; `python -m tasks.nano_edit evaluate
    --seeds 10⁸`, `python -m tasks.nano_compose evaluate --per-category 10⁸`) and a step count of -1 (`tasks/nano_edit_pretrain.py` wrote
    an untrained base): each refused in one line, before anything starts."""
    from tasks import nano_compose
    from tasks import nano_edit
    from tasks import nano_edit_pretrain
    for main, argv, line in [
            (nano_compare.main, ["--seeds", "1000000000"], "python -m tasks.nano_compare: error: --seeds must be in [1, 100]"),
            (nano_compare.main, ["--jobs", "100000"], "python -m tasks.nano_compare: error: --jobs must be in [1, 64]"),
            (nano_edit.main, ["evaluate", "--seeds", "100000000"], "python -m tasks.nano_edit: error: --seeds must be in [1, 100]"),
            (nano_compose.main, ["evaluate", "--per-category", "100000000"],
             "python -m tasks.nano_compose: error: --per-category must be in [1, 10000]"),
            (nano_edit_pretrain.main, ["--transformer-steps", "-1", "--out", str(tmp_path / "base")],
             "python -m tasks.nano_edit_pretrain: error: --transformer-steps must be in [1, 1e7], got -1"),
            (nano.main, ["pretrain", "--vae-lr", "nan", "--out", str(tmp_path / "base")],
             "python -m tasks.nano: error: --vae-lr must be in [0, 1e7], got nan")]:
        assert said(main, argv, capsys).startswith(line)
    assert not (tmp_path / "base").exists()


def test_nano_compose_prompts_writes_the_shipped_set(tmp_path):
    """`python -m tasks.nano_compose prompts` (a documented command) failed every time: AttributeError, per_category."""
    out = subprocess.run([sys.executable, "-m", "tasks.nano_compose", "prompts", "--out", str(tmp_path / "p.jsonl")], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "p.jsonl").read_text() == (ROOT / "assets" / "nano-compose" / "prompts.jsonl").read_text()


def test_nano_compare_refuses_a_bad_out_plot_or_run_directory_before_any_run(tmp_path, capsys):
    """--out a file, --plot or --markdown into a missing folder (found only after every run, before), a run directory
    that is a symbolic link, and a run log planted there as a link (its target was overwritten): each one line,
    nothing run or written through a link."""
    (tmp_path / "file").write_text("")
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    one = ["--methods", "Flow-GRPO, full mode", "--seeds", "1"]
    assert said(nano_compare.main, ["--out", str(tmp_path / "file"), *one], capsys).endswith("is not a directory")
    for flag in ("--plot", "--markdown"):
        line = said(nano_compare.main, ["--out", str(tmp_path / "o"), flag, str(tmp_path / "no" / "x"), *one], capsys)
        assert line == f"python -m tasks.nano_compare: error: {flag} {tmp_path}/no/x: its folder {tmp_path}/no does not exist"
    out = tmp_path / "links"
    out.mkdir()
    run = nano_compare.run_path(str(out), "Flow-GRPO, full mode", 0)
    os.symlink(tmp_path / "elsewhere", run)
    assert said(nano_compare.main, ["--out", str(out), *one], capsys).startswith(
        f"python -m tasks.nano_compare: error: {run} is not a directory of this comparison (a symbolic link, a file)")
    os.unlink(run)
    os.symlink(victim, run + ".log")
    assert said(nano_compare.main, ["--out", str(out), *one], capsys).startswith(
        f"python -m tasks.nano_compare: error: {run}.log cannot be written (")
    assert victim.read_text() == "untouched" and not os.path.exists(run)


def test_nano_grid_names_a_run_of_another_model(tmp_path, capsys):
    """`python -m tasks.nano grid` on a tiny run's LoRA: before, a "size mismatch" traceback; now the run's model, named."""
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    (run / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (run / "args.json").write_text(json.dumps({"model": "tiny"}))
    assert said(nano.main, ["grid", str(run)], capsys) == f"python -m tasks.nano: error: {run} is a run of --model tiny, not nano: " \
                                                          "give a nano run"


@pytest.mark.parametrize("task", [nano, nano_compose, nano_edit], ids=lambda t: t.MODEL)
def test_each_laptop_task_grades_and_draws_a_run_given_by_its_directory_or_its_lora(task, tmp_path, capsys, monkeypatch):
    """`python -m tasks.<task> evaluate` and `grid` take a run of `flowgrpo.py --model <task>` (its directory or its
    lora/), the grid written beside the LoRA; another task's run is refused in one line. Before, nano-compose could
    evaluate only a base (no --lora) and neither nano-compose nor nano-edit had `grid`: a run was graded by hand."""
    run = tmp_path / "run"
    (run / "lora").mkdir(parents=True)
    (run / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    (run / "args.json").write_text(json.dumps({"model": task.MODEL}))
    calls = []
    monkeypatch.setattr(task, "load", lambda *a, lora=None: calls.append(("load", a[1:] or lora)) or "pipe")
    monkeypatch.setattr(task, "evaluate", lambda pipe, *a: calls.append(("evaluate", pipe)) or {"judge_accuracy": 0.5})
    monkeypatch.setattr(task, "grid", lambda run_dir, out, **k: calls.append(("grid", run_dir, out)) or {"after": 0.5})
    evaluate = ["evaluate", str(run / "lora")] if task is nano else ["evaluate", "--lora", str(run / "lora")]
    for argv in (evaluate, ["grid", str(run / "lora")]):
        task.main(argv)
    lora, printed = str(run / "lora"), capsys.readouterr().out
    assert ("load", (lora,)) in calls or ("load", lora) in calls, calls
    assert calls[-1] == ("grid", str(run / "lora"), str(run / "before_after.png")) and '"after": 0.5' in printed, calls
    (run / "args.json").write_text(json.dumps({"model": "tiny"}))
    for argv in (evaluate, ["grid", str(run)]):
        assert said(task.main, argv, capsys).endswith(f"{run} is a run of --model tiny, not {task.MODEL}: give a "
                                                     f"{task.MODEL} run")


def test_a_runs_prompt_file_is_read_once(tmp_path, monkeypatch):
    """Start-up's check read the file (a long edit set's every image hashed, behind a bar "checking …") and the loop
    read it again: two bars and twice the time. Now once."""
    (tmp_path / "p.txt").write_text("".join(f"a photo of {i} cats\n" for i in range(20)))
    calls, read = [], prompts.read_prompt_file
    monkeypatch.setattr(prompts, "read_prompt_file", lambda *x, **k: calls.append(x) or read(*x, **k))
    rows = main_here("--model", "tiny", "--prompts", tmp_path / "p.txt", "--iterations", 1, "--group-size", 2,
                     "--prompts-per-iteration", 2, "--micro-batch", 2, "--eval-every", 0, "--run-dir", tmp_path / "run")
    assert len(rows) == 1 and len(calls) == 1, calls


def test_a_flag_the_parser_refuses_is_one_line(tmp_path):
    """A typo'd flag, a bad value, a missing one, a model that does not exist: tyro's box of 9 to 16 lines before; now
    the message, and the flag it suggests, in one line like every other refusal. Through the CLI for the typo."""
    out = subprocess.run([sys.executable, "flowgrpo.py", "--modle", "nano", "--run-dir", str(tmp_path / "r")], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("flowgrpo.py: error: Unrecognized options: --modle, nano Perhaps you meant: --model {"), \
        out.stderr
    for argv, said in [(["--lr", "abc"], "Error parsing --lr: could not convert string to float: 'abc' (`--help`"),
                       (["--group-size"], "Missing value for argument '--group-size'. Expected 1 values."),
                       (["--model", "tinyy"], "invalid choice 'tinyy' for argument '--model'. Expected one of")]:
        with pytest.raises(ValueError) as refused:
            cli.parse_args(flowgrpo.Args, argv)
        assert str(refused.value).startswith(said) and "\n" not in str(refused.value), str(refused.value)


def test_help_lists_every_flag_once_under_its_phase():
    """`python flowgrpo.py --help` on a wide terminal: a section per group of args.py (ModelArgs: "model options", its
    docstring under the title), one under the other in the loop's order, each listing its group's flags; every field of
    Args is a flag exactly once. Before: one section of 88 flags in no order a reader of the loop would follow."""
    out = subprocess.run([sys.executable, "flowgrpo.py", "--help"], cwd=ROOT, env=ENV | {"COLUMNS": "200"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    listed, section = [], None  # (flag, the section it is listed in), in the order shown
    for line in out.stdout.splitlines():
        if title := re.fullmatch(r"[╭─ ]*(\w+) options[─╮ ]*", line):  # a section side by side with another: no match
            section = title[1]
        elif option := re.match(r"│? {1,2}(--[\w-]+)", line):  # a flag's line (its help text is indented further)
            listed.append((option[1], section))
    groups = list(reversed(flowgrpo.Args.__bases__))  # listed last phase first (args.py)
    expected = [(f"--{f.name.replace('_', '-')}", g.__name__.removesuffix("Args").lower())
                for g in groups for f in dataclasses.fields(g)]
    assert sorted(f for f, _ in expected) == sorted(f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(
        flowgrpo.Args)), "Args has fields of its own, outside its groups"
    assert listed == expected, (set(listed) ^ set(expected), out.stdout[-3000:])
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", out.stdout).split())
    assert all(" ".join(g.__doc__.split()) in text for g in groups), [g.__name__ for g in groups]


@pytest.mark.parametrize("targets, matched", [("attn", "attn (Attention)"), ("to_out", "to_out (ModuleList)"),
                                              ("transformer_blocks", "transformer_blocks (ModuleList)")])
def test_lora_targets_naming_a_whole_block_are_refused_before_the_model_loads(targets, matched):
    """`--lora-targets attn` matches modules by name, so start-up let it through; peft then refused the Attention
    block it names once the weights were loaded (minutes for a real model), in a 17-line message dumping the module."""
    with pytest.raises(ValueError) as e:
        startup.check_args(cli.parse_args(flowgrpo.Args, ["--lora-targets", "to_q", targets]))
    said = str(e.value)
    assert said.startswith(f"--lora-targets {targets}: matches ") and matched in said and "\n" not in said, said
    assert "cannot adapt" in said and "its default targets are to_q" in said, said
    startup.check_args(cli.parse_args(flowgrpo.Args, ["--lora-targets", "to_q", "to_out.0"]))  # its Linear: accepted


def test_a_resume_with_wandb_off_keeps_naming_the_wandb_run_it_continues(tmp_path):
    """A run resumed with --no-wandb wrote wandb_id null into its checkpoints, so resuming again with wandb on started
    a new wandb run, the history split in two. Its checkpoints name the run it continued now."""
    claim = rundir.Claim(str(tmp_path / "run"), "r", "abc123", {"group_size": 2, "reward": "brightness"})
    assert runlog.RunLog(claim, enabled=True, use_wandb=False).wandb_id == "abc123"
    assert runlog.RunLog(dataclasses.replace(claim, wandb_id=None), enabled=True, use_wandb=False).wandb_id is None
