"""The GPU test tier: what the CPU tests claim, at the GPU recipe's dtypes and, given a GPU, on its kernels.

The CUDA cases are skipped without a GPU (the sequence-parallel comparison without 2) and have not run yet: no task
so far was lent one. A session that is lent one runs this file right after `bash run.sh bench-gpu`, which installs
the packages (BENCHMARKS.md gives the call). The bf16 case runs on CPU too, in CI."""
import dataclasses

import pytest
import torch

import engine as eng
import flowgrpo
import models
import rollout
import scheduler as sch
import test_sp
from test_bench import run_bench, table_rows

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bf16_tiny(device: str) -> models.QwenImage:
    """The tiny model as the real one is loaded on a GPU (from_pretrained with torch_dtype=bf16)."""
    pipe = models.build_tiny_qwen_pipeline(0)
    pipe.transformer.to(torch.bfloat16), pipe.vae.to(torch.bfloat16)
    return models.QwenImage(pipe, device, torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_first_update_is_exactly_on_policy_at_the_recipe_dtypes(device):
    """bf16 frozen weights, an fp32 LoRA under FSDP2 mixed precision (bf16 compute), activation checkpointing, true
    CFG 4 and a window of 2, as the qwen-image recipe trains: the first update recomputes the rollout's log-probs bit
    for bit, because the rollout ran the same weights, shapes and kernels."""
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", height=32, width=32, lora_rank=8,
                            group_size=4, prompts_per_iteration=2, micro_batch=4, lr=1e-2)
    assert a.mixed_precision and a.activation_checkpointing and a.cfg_scale > 1 and a.window == 2
    model = bf16_tiny(device)
    engine = eng.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=model.lora_targets, lr=a.lr, weight_decay=0,
                        max_grad_norm=1.0, seed=0, mixed_precision=True, activation_checkpointing=True)
    steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=1)
    model.transformer.eval()
    batch = rollout.sample(model, ['a sign that says "A"'] * 4 + ['a mug with "B"'] * 4, [{}] * 8, [0] * 4 + [1] * 4,
                           range(8), steps=steps, num_steps=a.num_steps, height=32, width=32, cfg_scale=a.cfg_scale,
                           negative_prompt=" ", noise_level=a.noise_level, sde_type="sde", seed=0, iteration=0, chunk=4)
    batch.advantages = torch.linspace(-1, 1, 8, device=model.device)
    model.transformer.train()
    stats = flowgrpo.train_on(model, engine, batch, a, flowgrpo.batch_arithmetic(a, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0
    assert stats["train/grad_norm"] > 0
    _, after = flowgrpo.policy_loss(model, engine, batch.chunk(0, 4), 0, a)  # the check can fail: the policy moved
    assert float(after["gap"]) > 0


@CUDA
def test_bench_gpu_path_at_toy_size():
    """bench.py's GPU benchmark, at the tiny model's sizes, on the GPU: every row finite and positive."""
    rows = table_rows(run_bench("--model", "tiny", "--random-init", "--quick", "--device", "cuda"))
    assert rows["peak memory, no offload"][0] > 0 and 0 < rows["MFU"][0] < 1


@CUDA
def test_bench_sp_rows_at_toy_size():
    """bench.py's --sp 2 ÷ --sp 1 rows on the GPU at toy size: with fewer than 2 GPUs its --sp 2 side is one process
    standing for rank 0 of 2 (a fake process group: memory exact, time without communication)."""
    rows = table_rows(run_bench("--sp", "2", "--model", "tiny", "--device", "cuda", "--sp-side", "256", "--repeats", "2"))
    assert 0 < rows["SP: activation memory per rank, --sp 2 ÷ --sp 1"][0] < 0.75
    assert 0 < rows["SP: peak CUDA memory of the step per rank, --sp 2 ÷ --sp 1"][0] < 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)")
def test_sequence_parallel_equals_the_unsplit_model_on_two_gpus(tmp_path):
    """tests/test_sp.py's comparison with NCCL on 2 GPUs, float32: the same bounds as on CPU."""
    results = test_sp.run_split_vs_unsplit(tmp_path)
    for family in ("qwen", "flux"):
        test_sp.check_float32(results[family], family)
    assert results["qwen bf16"]["gap"] == 0
