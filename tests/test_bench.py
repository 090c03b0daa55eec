"""bench/overhead.py, bench/check.py's dry run (bench/gpu.py's rows at toy size) and bench/soak.py at their smallest sizes,
bench/host.py's rows, and bench/gpu.py's FLOP formula against torch's counter. No timing thresholds: these check that
every row is produced and every figure is a finite positive number, not how fast anything is. Each runs as a script."""
import argparse
import ast
import contextlib
import dataclasses
import math
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from peft import LoraConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import flowgrpo
import rollout
from bench import overhead
from bench import check as bench_check
from bench import families as bench_families
from bench import gpu as bench_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*flags: str, timeout: int = 900, module: str = "bench.overhead") -> str:  # 43 s idle: room for a loaded CI
    out = subprocess.run([sys.executable, "-m", module, *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def table_rows(text: str) -> dict[str, list[float]]:
    """{measurement: [median, min, max]} of the markdown table in `text`; every figure must parse and be finite > 0 (or
    ≥ 0 where the row expects 0: a first update's logp_gap)."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines and lines[0].startswith("| measurement | median | min | max |"), text[-2000:]
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        figures = [float(c) for c in cells[1:4]]
        assert all(math.isfinite(f) and (f > 0 or f == 0 and cells[5] == "0") for f in figures), line
        assert figures[1] <= figures[0] <= figures[2], line  # min <= median <= max
        rows[cells[0]] = figures
    return rows


def test_cpu_table_smallest(tmp_path):
    md = tmp_path / "bench.md"
    rows = table_rows(run_bench("--quick", "--markdown", str(md)))
    for name in ("rollout ÷ diffusers, CFG off", "rollout ÷ diffusers, CFG on (4)", "training ÷ bare fwd+bwd",
                 "window ÷ full training", "cost per image (rollout + train), G = 4 ÷ G = 2",
                 "reward jpeg_compressibility", "reward jpeg_incompressibility", "reward brightness", "reward ocr",
                 "rollout + OCR reward: AsyncRewards overlapped ÷ serial", "ranks: time per iteration, 2 ÷ 1",
                 "tiny-sd3: rollout ÷ diffusers", "tiny-sd3: training ÷ bare fwd+bwd", "tiny-flux: rollout ÷ diffusers",
                 "tiny-flux: training ÷ bare fwd+bwd", "training per image, nft ÷ grpo full mode",
                 "training per image, nft ÷ grpo window 2", "rollout per image, ODE (euler) without log-probs ÷ SDE",
                 "rollout per image, ODE (dpm2-full) without log-probs ÷ SDE", "ranks: peak RSS per rank, 2 ÷ 1",
                 "training ÷ plain PyTorch update", "tiny-sd3: training ÷ plain PyTorch update",
                 "tiny-flux: training ÷ plain PyTorch update", "window ÷ full, plain PyTorch update",
                 "whole iteration ÷ diffusers' sampling + plain PyTorch update",
                 "tiny-sd3: whole iteration ÷ diffusers' sampling + plain PyTorch update",
                 "tiny-flux: whole iteration ÷ diffusers' sampling + plain PyTorch update",
                 "rollout + update, --reuse-rollout-forward ÷ recomputed"):
        assert name in rows, (name, list(rows))
    written = md.read_text()
    assert written.startswith("`python -m bench.overhead --quick --markdown") and table_rows(written) == rows


def end_to_end(key: str) -> list[str]:  # bench/gpu.py's rows of one end-to-end configuration
    return [f"images/s per device, end to end ({key})", f"MFU ({key})", f"peak memory ({key})",
            f"first update's logp_gap ({key})"]


SHARES = ["rollout share of the iteration", "reward wait share of the iteration", "training share of the iteration"]
FITTED = ["micro-batch fitted (--micro-batch 0)", *end_to_end("fitted"), *SHARES]
OWN = end_to_end("recipe")  # at the recipe's micro-batch
ROWS = {"recipe": [*FITTED, *OWN, "micro-batch fitted with --reuse-rollout-forward", *end_to_end("reuse"),
                   "transformer forward MFU, diffusers bare, B = 2", "transformer forward MFU, the loop, B = 2",
                   "transformer forward time, the loop ÷ diffusers bare, B = 2", "micro-batch fitted within 60 GiB",
                   *end_to_end("held")],
        "qwen21": FITTED,
        "sp": ["SP: activation memory per rank, --sp 2 ÷ --sp 1", "SP: time per fwd+bwd, --sp 2 ÷ --sp 1"],
        "compiled": ["--compile: first call (tracing and compiling)", "transformer forward MFU, the loop, --compile, "
                     "B = 2", "--compile: dynamo graphs"]}
MORE_ROWS = {"compiled-recipe": ["micro-batch fitted (--micro-batch 0)", *end_to_end("fitted, --compile"), *SHARES],
             "plain": ["real width, 1 of 60 blocks, 32², CFG 4: training ÷ plain PyTorch update"],
             "offload": ["peak memory, parameter offload (FSDP2 CPUOffloadPolicy)"],
             **{key: [f"transformer forward MFU, the loop's rollout, {flag}, B = 2",
                      f"images/s per device, end to end ({flag})", f"peak memory ({flag})",
                      f"first update's logp_gap ({flag})"]
                for key, flag in (("merged", "--merged-lora"), ("fp8", "--fp8-rollout"))}}  # the dry run's fp8: eager
FAMILIES_ROWS = {"z-image": FITTED + OWN, "flux2-klein": FITTED + OWN, "qwen21-recipe": FITTED[:1] + OWN}


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """`python -m bench.check OUT --dry-run`: every step of the GPU check at toy size on the CPU, through its CLI; then its
    other two commands' (`--more`, `--families`) into OUT/more and OUT/families."""
    out = tmp_path_factory.mktemp("check")
    run_bench(str(out), "--dry-run", module="bench.check", timeout=1800)
    for which in ("more", "families"):
        run_bench(str(out / which), "--dry-run", f"--{which}", module="bench.check", timeout=1800)
    return out


def test_the_gpu_checks_dry_run_passes_every_step_and_writes_as_it_goes(check):
    """OUT/summary.md: the header (revision, machine, versions), each step's verdict, the closing count; a log per
    step."""
    for folder, table, title in ((check, bench_check.STEPS, "# GPU check, "),
                                 (check / "more", bench_check.MORE, "# GPU check (--more), "),
                                 (check / "families", bench_check.FAMILIES, "# GPU check (--families), ")):
        summary = (folder / os.path.basename(bench_check.SUMMARY)).read_text()
        assert summary.startswith(title) and "torch 2." in summary and "diffusers 0.42" in summary, summary[:500]
        steps = [s[0] for s in table]
        for name in steps:
            assert f"## {name}: passed in " in summary and (folder / f"{name}.log").exists(), (name, summary[-3000:])
        assert summary.rstrip().endswith(f"- {steps[-1]}: passed") and \
            f"## {len(steps)} of {len(steps)} steps passed" in summary
    assert "1 passed" in (check / os.path.basename(bench_check.SUMMARY)).read_text()  # the tests step's outcome line
    assert sum(s[4] for s in bench_check.STEPS) == 540  # the one command: 9 minutes of a lent machine
    assert sum(s[4] for s in bench_check.MORE) <= 580 and sum(s[4] for s in bench_check.FAMILIES) <= 580  # a call's 10


def test_the_gpu_checks_tests_step_runs_every_gpu_test_the_most_important_first(tmp_path):
    """The tests step names every test of tests/test_gpu.py once, FIRST_TESTS first (the GPU run at 7c2fe69 cut the step
    before its last test, the Wan2.1 recipe at its real width); a cut step's summary still says which tests passed, which
    failed, which printed rows, and which was running when its bound came."""
    tree = ast.parse(open(os.path.join(bench_check.ROOT, "tests", "test_gpu.py")).read())
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    ids = bench_check.gpu_tests()
    assert sorted(i.split("::")[1] for i in ids) == sorted(names)
    assert [i.split("::")[1] for i in ids[:len(bench_check.FIRST_TESTS)]] == list(bench_check.FIRST_TESTS)
    node = "tests/test_gpu.py::test_first_update_is_exactly_on_policy_at_the_recipe_dtypes"
    (tmp_path / "tests.log").write_text(  # pytest -v -s, cut at the bound during the fourth test
        f"collecting ... collected 20 items\n\n{ids[0]} \n{overhead.HEAD[0]}\n{overhead.HEAD[1]}\n"
        "| wan2.1-t2v-1.3b recipe: peak memory, rollout | 30 | 30 | 30 | GiB |  | a micro-batch of 8 videos |\nPASSED\n"
        f"{node}[cuda-plain] FAILED\n{node}[cuda-fsdp2] SKIPPED (needs a CUDA GPU)\n{node}[cpu-plain] ")
    assert bench_check.report(str(tmp_path / "tests.log")).splitlines()[2:] == [
        "| wan2.1-t2v-1.3b recipe: peak memory, rollout | 30 | 30 | 30 | GiB |  | a micro-batch of 8 videos |",
        f"- {ids[0]}: PASSED", f"- {node}[cuda-plain]: FAILED", f"- {node}[cuda-fsdp2]: SKIPPED",
        f"- {node}[cpu-plain]: running when the step ended"]


def test_a_step_runs_in_a_group_of_its_own_within_the_checks_session_killed_whole_at_its_bound(tmp_path):
    """bench/check.py's run_step: a step and what it starts are killed together at its bound, and the step stays in the
    check's session. A lent machine's call that ends at its limit ends the processes of its command's session: a step
    in a session of its own (start_new_session) ran on past the check, on the GPU, into the machine's next call."""
    child = tmp_path / "child"
    script = ("import os, subprocess, sys, time; print(os.getsid(0), os.getpgid(0), os.getpid(), flush=True); "
              f"open({str(child)!r}, 'w').write(str(subprocess.Popen(['sleep', '60']).pid)); time.sleep(60)")
    verdict, seconds = bench_check.run_step("s", [sys.executable, "-c", script], 5, str(tmp_path / "s.log"))
    sid, pgid, pid = map(int, (tmp_path / "s.log").read_text().splitlines()[1].split())
    assert verdict == "cut at its bound of 5 s" and seconds < 30 and pgid == pid and sid == os.getsid(0), (sid, pgid)
    time.sleep(0.5)  # the grandchild killed: gone, or a zombie where no init reaps it
    with contextlib.suppress(psutil.NoSuchProcess):
        assert psutil.Process(int(child.read_text())).status() == psutil.STATUS_ZOMBIE


def test_the_checks_header_without_git_or_nvidia_smi(monkeypatch, tmp_path):
    """A machine without git (FLOWGRPO_REV unset) or nvidia-smi on its PATH: the summary's header says so, where it
    raised FileNotFoundError before the first step and the check measured nothing."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("FLOWGRPO_REV", raising=False)
    head = bench_check.header(False)
    assert "revision ?; no nvidia-smi; Python" in head, head


@pytest.mark.parametrize("name, tflops", [("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA H100 80GB HBM3", 989),
                                          ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835)])
def test_the_mfu_peak_of_each_gpu_by_its_name(monkeypatch, name, tflops):
    """The dense bf16 peak MFU divides by, from the device's name (data sheets: an NVL card's is its SXM twin's less a
    sixth, 1,671 against 1,979 TFLOP/s with sparsity for the H200)."""
    monkeypatch.setattr(bench_gpu, "CUDA", True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    assert bench_gpu.peak_flops(argparse.Namespace(device="cpu")) == (name, tflops * 1e12)


@pytest.mark.parametrize("step", [*ROWS, *(f"more/{k}" for k in MORE_ROWS), *(f"families/{k}" for k in FAMILIES_ROWS)])
def test_the_gpu_checks_dry_run_rows(check, step):
    """The GPU benchmark's paths (random-weight model, text encoder bypassed) at toy size: the recipe at the fitted
    micro-batch (a CPU: the largest up to 8 of [1, 2, 4]), at its own, on the rollout's kept forwards, against the bare
    forward; --sp 2 on 2 gloo ranks; the update against plain PyTorch at the real width (which must first land on the
    same LoRA: bench.plain_rows asserts it); the 60 GiB cap; parameter offload; --compile's forwards, without a graph
    break, and the recipe compiled end to end; Qwen-Image 2.1, Z-Image and FLUX.2 [klein] (bench/families.py: the tiny
    twins here) on their recipes. Every end-to-end row's first update is on the rollout's policy (its logp_gap 0)."""
    log = (check / f"{step}.log").read_text()
    rows, (which, _, key) = table_rows(log), step.rpartition("/")
    if step == "more/fp8":  # --profile: where the float8 forward's time goes (in eager on an H100: 1.2-2.4 x bf16's)
        assert "profile, the loop's rollout, --fp8-rollout, B = 2:" in log and "_scaled_mm" in log, log[-3000:]
    assert sorted(rows) == sorted({"": ROWS, "more": MORE_ROWS, "families": FAMILIES_ROWS}[which][key]), list(rows)
    for name, values in rows.items():  # each first update recomputes its rollout's log-probs on the same weights
        if name.startswith("first update's logp_gap"):
            assert values[0] == 0, (name, values)
    if "rollout share of the iteration" in rows:
        shares = [rows[f"{p} share of the iteration"][0] for p in ("rollout", "reward wait", "training")]
        assert 0.9 < sum(shares) < 1.1  # medians of shares that sum to 1 per iteration (one repeat: exactly)
        assert rows["micro-batch fitted (--micro-batch 0)"][0] == 4


def test_host_rows_and_the_ops_they_count():
    """bench/host.py at its smallest: its rows; and, since aten operations and bytes are counted, not timed, bounds that
    fails the day the host's work per block comes back (FSDP2's hooks and copies on one rank made it 2.4× diffusers'
    forward, 443 against 182 per block; peft's LoRA alone, 10 layers a block, 1.55×; --merged-lora, 182: 1.0×, and
    771 against 1084 for forward + backward, 0.71×; --fp8-rollout's rollout in eager, 384: 2.11×; a rank of 2, 1.12×,
    and an --sp 2 rank on top, 1.10×)."""
    rows = table_rows(run_bench("--quick", module="bench.host"))
    assert list(rows) == ["host: time per forward, loop ÷ bare diffusers", "host: aten ops per block, loop ÷ bare "
                          "diffusers", "host: time per forward + backward, loop ÷ plain LoRA step",
                          "host: aten ops per forward + backward, loop ÷ plain LoRA step",
                          "host: time per forward, loop --merged-lora ÷ bare diffusers",
                          "host: aten ops per block, loop --merged-lora ÷ bare diffusers",
                          "host: time per forward + backward, loop --merged-lora ÷ plain LoRA step",
                          "host: aten ops per forward + backward, loop --merged-lora ÷ plain LoRA step",
                          "host: time per forward, the loop's rollout --fp8-rollout ÷ bare diffusers",
                          "host: aten ops per block, the loop's rollout --fp8-rollout ÷ bare diffusers",
                          "host: aten ops per forward + backward, a rank of 2 (FSDP2) ÷ one process",
                          "host: aten ops per forward + backward, an --sp 2 rank ÷ a rank of 2",
                          "rollout: bytes gathered per image at 2 ranks, weights kept ÷ gathered at every step"], \
        list(rows)
    assert rows["host: aten ops per block, loop ÷ bare diffusers"][0] <= 1.6
    assert rows["host: aten ops per forward + backward, loop ÷ plain LoRA step"][0] <= 1.1
    assert rows["host: aten ops per block, loop --merged-lora ÷ bare diffusers"][0] <= 1.05  # a layer's ops: one linear
    assert rows["host: aten ops per forward + backward, loop --merged-lora ÷ plain LoRA step"][0] <= 0.8
    # --fp8-rollout in eager: each frozen layer's input quantised per token, 7 more operations (384 a block)
    assert rows["host: aten ops per block, the loop's rollout --fp8-rollout ÷ bare diffusers"][0] <= 2.2
    # a rank of 2: FSDP2's hooks and views (1279 a block against 1144); --sp 2 on top, Ulysses' 12 all-to-alls a block
    # in forward, recompute and backward, each with its views, permutes and copy (1410)
    assert rows["host: aten ops per forward + backward, a rank of 2 (FSDP2) ÷ one process"][0] <= 1.2
    assert rows["host: aten ops per forward + backward, an --sp 2 rank ÷ a rank of 2"][0] <= 1.2
    # bytes, counted: 8 calls gather the model 8 times, a rollout on kept weights once (bench_host asserts the
    # same latents, log-probs and images)
    assert rows["rollout: bytes gathered per image at 2 ranks, weights kept ÷ gathered at every step"][0] < 0.2


def test_flop_formula_matches_torch_flop_counter():
    """pass_flops (the MFU numerator) equals what FlopCounterMode counts for one CFG velocity with LoRA: the math SDPA
    backend, so that attention is counted too (the fused CPU kernel is not)."""
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", height=32, width=48, lora_rank=8,
                            group_size=2, prompts_per_iteration=1, micro_batch=2, mixed_precision=False)
    model = bench_gpu.random_model("tiny", "cpu")
    overhead.make_engine(a, model)
    c = model.conditioning(['a sign that says "HI"', 'a mug with "A LONGER TEXT" on it'], " ", 4.0)
    x = model.noise(rollout.image_generators(0, 0, range(2)), a.height, a.width)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model.velocity(x, torch.full((2,), 0.5), c, 4.0, a.height, a.width)
    formula = sum(bench_gpu.pass_flops(model.transformer.config, model.image_seq_len(a.height, a.width), c[k].shape[1],
                                       8) for k in ("embeds", "neg_embeds"))
    assert formula == counter.get_total_flops() / 2
    # The real size on the meta device (nothing allocated, shapes only; diffusers' defaults are the published config):
    # ~20 B parameters, and the formula equals the counter for one 512² pass with the recipe's rank-64 LoRA too.
    with torch.device("meta"):
        net = bench_gpu.QwenImageTransformer2DModel()
        assert 20.0e9 < sum(p.numel() for p in net.parameters()) < 20.9e9
        net.add_adapter(LoraConfig(r=64, lora_alpha=128, target_modules=list(flowgrpo.Args.lora_targets)))
        x, embeds, t = torch.empty(1, 1024, 64), torch.empty(1, 30, net.config.joint_attention_dim), torch.ones(1)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        net(hidden_states=x, timestep=t, encoder_hidden_states=embeds, img_shapes=[[(1, 32, 32)]], return_dict=False)
    assert bench_gpu.pass_flops(net.config, 1024, 30, 64) == counter.get_total_flops()  # 15.6 TFLOP


def test_counted_flops_equal_the_formula():
    """bench_families.velocity_flops, the other families' MFU numerator (torch's counter on one velocity call), gives
    on Qwen-Image what its checked formula gives: one image, both CFG branches, the LoRA, attention."""
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", height=32, width=48, lora_rank=8,
                            mixed_precision=False)
    model = bench_gpu.random_model("tiny", "cpu")
    overhead.make_engine(a, model)
    prompt = 'a mug with "A LONGER TEXT" on it'
    c = model.conditioning([prompt], a.negative_prompt, 4.0)
    formula = sum(bench_gpu.pass_flops(model.transformer.config, model.image_seq_len(a.height, a.width), c[k].shape[1],
                                       8) for k in ("embeds", "neg_embeds"))
    counted = bench_families.velocity_flops(model, a, prompt)
    assert counted == formula, (counted, formula)


def test_sp_and_plain_refuse_another_family(capsys):
    """--sp and --plain build Qwen-Image's model: another family's name is refused in one line, not measured as it."""
    with pytest.raises(SystemExit):
        bench_gpu.main(["--sp", "2", "--model", "z-image"])
    assert "--sp and --plain measure Qwen-Image (--model tiny or qwen-image), got --model z-image" in \
        capsys.readouterr().err


@pytest.mark.parametrize("gib, side", [(141, 1024), (80, 768)])
def test_the_sp_rows_side_on_a_gpu_follows_its_memory(monkeypatch, gib, side):
    """On CUDA the --sp rows measure one image of 1024² on an H200; on a GPU of under 100 GiB, 768², where the --sp 1
    side at 1024² (41 GiB of weights, 32 of activations) might not fit. Here the GPU is faked and the rows not run."""
    class Props:
        total_memory = gib * 2**30
    seen = []
    monkeypatch.setattr(bench_gpu, "CUDA", True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    monkeypatch.setattr(bench_gpu, "sp_rows", lambda t, o, n: seen.append((o.sp_side, o.device, n)))
    bench_gpu.main(["--sp", "2"])
    assert seen == [(side, "cuda", 2)], seen


def test_soak_smallest():
    """`python -m bench.soak` at its smallest, every request followed by a hostile one: it exits 0 only if every valid
    request was answered once, correctly, none turned away, and the server's threads and memory came back
    (BENCHMARKS.md: the full one)."""
    rows = table_rows(run_bench("--clients", "2", "--requests", "5", "--hostile", "1", module="bench.soak"))
    assert rows["valid: answered, correct"][0] == 10 and "server threads, start → end" in rows, list(rows)
    assert any(k.startswith("hostile, ") for k in rows) and not any("lost" in k or "retried" in k for k in rows), rows


class Ran(Exception):
    """Raised where a bench would start measuring: a refused command line never gets there."""


def ran(*args, **kwargs):
    raise Ran


@pytest.mark.parametrize("module, starts", [("overhead", "model_rows"), ("host", "host_rows")])
def test_repeats_below_one_are_refused(monkeypatch, capsys, module, starts):
    """--repeats 0 was read as unset and ran the default 9 repeats; a negative one ran every set-up and then failed on
    the first row's median of no timings."""
    bench = __import__(f"bench.{module}", fromlist=["main"])
    monkeypatch.setattr(bench, starts, ran)
    for repeats in ("0", "-1"):
        with pytest.raises(SystemExit):
            bench.main(["--repeats", repeats])
        assert f"--repeats must be at least 1, got {repeats}" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--clients", "0"], ["--requests", "0"], ["--header-timeout", "0"],
                                   ["--header-timeout", "abc"]])
def test_soak_refuses_what_it_cannot_measure(capsys, flags):
    """No client or request: the soak ran, then failed on the percentile of no latency (IndexError); a header timeout
    the server refuses: the server exited unseen and the soak failed reading its address (IndexError)."""
    from bench import soak
    with pytest.raises(SystemExit):
        soak.main(flags)
    err = capsys.readouterr().err
    assert "--clients and --requests must be at least 1" in err or "invalid float value: 'abc'" in err, err


def test_overlap_refuses_cores_it_cannot_pin(monkeypatch, capsys):
    """A core this process may not run on failed in the first server's start ('Exception occurred in preexec_fn'),
    after the pipeline was built; one core for both, in `speed`, measured no overlap at all. `speed` needs no
    --seeds."""
    from bench import overlap
    monkeypatch.setattr(overlap.models_nano, "build_nano_pipeline", ran)
    cores = sorted(os.sched_getaffinity(0))
    one = ["--server-core", str(cores[0]), "--trainer-core", str(cores[0])]
    for flags in (["--server-core", str(cores[-1] + 1)], one):
        with pytest.raises(SystemExit):
            overlap.main(["speed", *flags])
        assert "--server-core and --trainer-core must be cores of" in capsys.readouterr().err
    if len(cores) > 1:  # two cores: past the checks, where the set-up starts
        with pytest.raises(Ran):
            overlap.main(["speed", "--seeds", "1", "--server-core", str(cores[0]), "--trainer-core", str(cores[-1])])
