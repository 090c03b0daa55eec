"""bench.py, bench_gpu.py and bench_soak.py at their smallest sizes, and bench_gpu.py's FLOP formula against torch's
counter. No timing thresholds: these check that every row is produced and every figure is a finite positive number, not
how fast anything is. bench.py and bench_soak.py run as scripts; bench_gpu.py's main runs in this process (its import
is the heaviest of the three), and its --sp rows start the script itself on each rank."""
import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import bench
import bench_gpu
import engine as eng
import flowgrpo
import rollout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*flags: str, timeout: int = 900, script: str = "bench.py") -> str:  # 43 s idle: room for a loaded CI
    out = subprocess.run([sys.executable, script, *flags], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def run_bench_gpu(capsys, *flags: str) -> str:
    """What `python bench_gpu.py *flags` prints, from its main in this process. It sets torch's thread count to 1 on
    CPU and builds an engine (a process group of one): both put back after."""
    threads = torch.get_num_threads()
    try:
        bench_gpu.main(list(flags))
    finally:
        torch.set_num_threads(threads)
        eng.shutdown()
    return capsys.readouterr().out


def table_rows(text: str) -> dict[str, list[float]]:
    """{measurement: [median, min, max]} of the markdown table in `text`; every figure must parse and be finite > 0."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert lines and lines[0].startswith("| measurement | median | min | max |"), text[-2000:]
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        figures = [float(c) for c in cells[1:4]]
        assert all(math.isfinite(f) and f > 0 for f in figures), line
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
    assert written.startswith("`python bench.py --quick --markdown") and table_rows(written) == rows


def test_sp_rows_smallest(capsys):
    """bench_gpu.py's --sp 2 ÷ --sp 1 rows on CPU at their smallest (2 gloo ranks, 64²), as the CPU table had them."""
    rows = table_rows(run_bench_gpu(capsys, "--sp", "2", "--quick"))
    for name in ("SP: activation memory per rank, --sp 2 ÷ --sp 1", "SP: time per fwd+bwd, --sp 2 ÷ --sp 1"):
        assert name in rows, (name, list(rows))


ROWS = {"fitted": ["micro-batch fitted (--micro-batch 0)", "images/s per device, end to end (fitted)", "MFU (fitted)",
                   "peak memory (fitted)", "rollout share of the iteration", "reward wait share of the iteration",
                   "training share of the iteration"],
        "recipe": ["images/s per device, end to end (recipe)", "MFU (recipe)", "peak memory (recipe)"],
        "reuse": ["images/s per device, end to end (reuse)", "MFU (reuse)", "peak memory (reuse)"],
        "floor": ["transformer forward MFU, diffusers bare, B = 2", "transformer forward MFU, the loop, B = 2",
                  "transformer forward time, the loop ÷ diffusers bare, B = 2"],
        "offload": ["peak memory, parameter offload (FSDP2 CPUOffloadPolicy)"]}


@pytest.mark.parametrize("rows", ["fitted,recipe,reuse,floor", "offload"])
def test_random_init_dry_run(capsys, rows):
    """The GPU benchmark's path (random-weight model, text encoder bypassed) at toy size on CPU: the micro-batch fitted
    to the device, the recipe's, the update on the rollout's kept forwards, the floor; parameter offload alone."""
    got = table_rows(run_bench_gpu(capsys, "--model", "tiny", "--random-init", "--quick", "--rows", rows))
    expect = [name for r in rows.split(",") for name in ROWS[r]]
    assert sorted(got) == sorted(expect), list(got)
    if "fitted" in rows:
        shares = [got[f"{p} share of the iteration"][0] for p in ("rollout", "reward wait", "training")]
        assert 0.9 < sum(shares) < 1.1  # medians of shares that sum to 1 per iteration (one repeat: exactly)
        assert got["micro-batch fitted (--micro-batch 0)"][0] == 4  # a CPU: the largest up to 8 of [1, 2, 4]


def test_plain_update_at_the_real_width(capsys):
    """bench_gpu.py --plain on CPU: the loop's update and the plainest PyTorch's on one real-width Qwen-Image block
    (random weights, twins), which must first land on the same LoRA (bench.plain_rows asserts it), then the ratio."""
    rows = table_rows(run_bench_gpu(capsys, "--plain", "--quick"))
    assert list(rows) == ["real width, 1 of 60 blocks, 32², CFG 4: training ÷ plain PyTorch update"], list(rows)


def test_flop_formula_matches_torch_flop_counter():
    """pass_flops (the MFU numerator) equals what FlopCounterMode counts for one CFG velocity with LoRA: the math SDPA
    backend, so that attention is counted too (the fused CPU kernel is not)."""
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", height=32, width=48, lora_rank=8,
                            group_size=2, prompts_per_iteration=1, micro_batch=2, mixed_precision=False)
    model = bench_gpu.random_model("tiny", "cpu")
    bench.make_engine(a, model)
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


def test_soak_smallest():
    """`python bench_soak.py` at its smallest, every request followed by a hostile one: it exits 0 only if every valid
    request was answered once, correctly, none turned away, and the server's threads and memory came back
    (BENCHMARKS.md: the full one)."""
    rows = table_rows(run_bench("--clients", "2", "--requests", "5", "--hostile", "1", script="bench_soak.py"))
    assert rows["valid: answered, correct"][0] == 10 and "server threads, start → end" in rows, list(rows)
    assert any(k.startswith("hostile, ") for k in rows) and not any("lost" in k or "retried" in k for k in rows), rows
