"""--merged-lora (merged_lora.py): a LoRA layer's forward through one bf16 weight, bf16(W + s·B·A), with the unmerged
layer's gradients for the factors; through the CLI, every first update exactly on-policy, the reference (the adapter
off) and exact resume."""
import copy
import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model

import flowgrpo
import merged_lora
import precision
from test_engine import SMALL, assert_same, compiled_rounds, lora, train_state
from tiny_setup import main_here


class Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(48, 40)

    def forward(self, x):
        return self.proj(x)


def merged_and_reference():
    """(a Proj whose LoRA layer computes merged in bf16, its float32 peft twin left unmerged), both with random factors
    (LoRA's B starts at 0: then the adapter would add nothing)."""
    torch.manual_seed(0)
    ref = Proj().requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["proj"]), ref)
    with torch.no_grad():
        ref.proj.lora_B["default"].weight.normal_(0, 0.3)
    net = copy.deepcopy(ref)
    precision.bf16_working_copies(net)
    merged_lora.merge_adapters(net)
    return net, ref


def expected(net, x):
    """F.linear(x, bf16(W + s·B·A)): the product and the sum in float32 from the float32 masters, cast once."""
    p = net.proj
    a, b, s = p.lora_A["default"].weight, p.lora_B["default"].weight, p.scaling["default"]
    return F.linear(x, (p.base_layer.weight.float() + s * (b @ a)).to(torch.bfloat16), p.base_layer.bias)


def test_forward_is_the_merged_weight_and_the_factors_gradients_are_loras():
    """Forward: bit for bit F.linear through bf16(W + s·B·A), with and without autograd (the rollout and the update),
    and the base alone with the adapter disabled; after an in-place change of a factor (an optimizer step, an EMA
    swap) the next call sees the new weight. Backward: the gradients of A, B (and x) those of peft's unmerged float32
    layer on the same inputs, to bf16 rounding: measured 3.2e-3 (A), 2.9e-3 (B), 3.1e-3 (x) relative."""
    net, ref = merged_and_reference()
    x = torch.randn(3, 5, 48).to(torch.bfloat16).requires_grad_(True)
    with torch.no_grad():
        rollout = net(x)
    y = net(x)
    assert torch.equal(rollout, expected(net, x)) and torch.equal(y, rollout)
    g = torch.randn(y.shape)
    (y.float() * g).sum().backward()
    x32 = x.detach().float().requires_grad_(True)
    (ref(x32) * g).sum().backward()
    errors = {}
    for name, got, want in (("A", net.proj.lora_A["default"].weight.grad, ref.proj.lora_A["default"].weight.grad),
                            ("B", net.proj.lora_B["default"].weight.grad, ref.proj.lora_B["default"].weight.grad),
                            ("x", x.grad, x32.grad)):
        assert got.dtype == (torch.float32 if name != "x" else torch.bfloat16)  # the masters' gradients in float32
        errors[name] = ((got.float() - want).norm() / want.norm()).item()
    print(f"\nrelative error against peft's unmerged float32 layer: {errors}")
    assert max(errors.values()) < 1e-2, f"gradients beyond bf16 rounding: {errors}"
    assert net.proj.base_layer.weight.grad is None  # the frozen base gets none
    net.proj.enable_adapters(False)  # the reference (engine.reference: diffusers' disable_adapters does this)
    base = net.proj.base_layer
    assert torch.equal(net(x), F.linear(x, base.weight, base.bias))
    net.proj.enable_adapters(True)
    with torch.no_grad():
        net.proj.lora_A["default"].weight.mul_(2)  # in place: the version changes, the storage does not
        after = net(x)
    assert torch.equal(after, expected(net, x)) and not torch.equal(after, rollout)


SMALL_MERGED = [*SMALL, "--iterations", "2", "--mixed-precision", "--merged-lora", "--activation-checkpointing",
                "--cfg-scale", "2", "--kl-beta", "0.01", "--ema-decay", "0.5", "--ema-every", "1"]


def rows(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def test_cli_first_updates_exactly_on_policy_with_the_reference_and_resume_exactly(tmp_path, monkeypatch):
    """`flowgrpo.py --mixed-precision --merged-lora` with activation checkpointing, CFG's two calls, a KL to the
    reference (the adapter off) and an EMA: every LoRA layer merged and used, train/logp_gap exactly 0 in both
    iterations, a KL > 0 once the adapter has moved; resumed from iteration 0's checkpoint, the same LoRA, AdamW state
    and metrics, bit for bit."""
    nets, merge = [], merged_lora.merge_adapters
    monkeypatch.setattr(merged_lora, "merge_adapters", lambda net: merge(net) or nets.append(net))
    one, resumed = tmp_path / "one", tmp_path / "resumed"
    main_here(*SMALL_MERGED, "--run-dir", one)
    layers = [m for m in nets[0].modules() if hasattr(m, "lora_A")]
    assert layers and [m for m, _, _ in nets[0].merged_parts] == layers and all(m.merged_key for m in layers)
    main_here(*SMALL_MERGED, "--run-dir", resumed, "--resume", one / "checkpoints" / "iter_000000")
    first = rows(one)
    assert [r["train/logp_gap"] for r in first] == [0.0, 0.0]
    assert first[1]["train/kl"] > 0, first[1]
    assert_same(lora(one), lora(resumed), exact=True)
    assert_same(train_state(one, "iter_000001", tmp_path), train_state(resumed, "iter_000001", tmp_path), exact=True)
    perf = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in first]
    assert perf == [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows(resumed)]


@pytest.mark.parametrize("flags", [["--full-finetune"], ["--offload"], ["--no-mixed-precision"],
                                   ["--rollout", "vllm-omni", "--rollout-url", "http://127.0.0.1:9"]])
def test_merged_lora_is_refused_where_it_would_not_apply(flags, tmp_path):
    with pytest.raises(ValueError, match="--merged-lora needs --mixed-precision"):
        main_here(*SMALL, "--mixed-precision", "--merged-lora", *flags, "--run-dir", tmp_path / "r")


def test_merged_lora_without_room_for_its_copies_is_refused_in_a_line(tmp_path, monkeypatch):
    """Where the device cannot hold the bf16 copies of the adapted weights, the engine says so as it is built, with
    their size, instead of running out of memory (precision.need_room; --fp8-rollout's in test_fp8_rollout.py). Here
    the free memory is faked: none; and a copy of exactly the free bytes is let through, one byte more refused."""
    monkeypatch.setattr(precision, "free_bytes", lambda device: 0)
    with pytest.raises(ValueError, match=r"--merged-lora keeps a bf16 copy of every adapted weight, 0\.0 GiB here, "
                                         r"and cpu has 0\.0 GiB free: leave it out"):
        main_here(*SMALL, "--mixed-precision", "--merged-lora", "--run-dir", tmp_path / "r")
    monkeypatch.setattr(precision, "free_bytes", lambda device: 3 * 2**30)
    precision.need_room(3 * 2**30, torch.device("cuda"), "a copy")
    with pytest.raises(ValueError, match=r"^a copy, 3\.0 GiB here, and cuda has 3\.0 GiB free: leave it out"):
        precision.need_room(3 * 2**30 + 1, torch.device("cuda"), "a copy")


def test_compile_traces_merged_blocks_without_a_graph_break(monkeypatch):
    """--compile with --merged-lora (the qwen-image recipe's bf16 compute and checkpointing, 2 blocks): no graph break
    in training, the rollout's forward or the reference's (the adapter off: a graph of its own), and after an
    optimizer step the compiled blocks read the new merged weights: the same outputs as the engine in eager (measured
    equal to the bit under aot_eager; the bound is test_engine's compile test's). (dynamo with aot_eager, as there.)"""
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend="aot_eager"))
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", lora_rank=4)
    (seen, compiled), (_, eager) = [compiled_rounds(a, 2, reference=True, compile=c, merged_lora=True)
                                    for c in (True, False)]
    assert seen["breaks"] == 0, seen
    for c, e in zip(compiled, eager):
        assert (c - e).abs().max() <= 1e-2 * e.abs().max(), f"compiled vs eager: {(c - e).abs().max():.3g}"
    assert (compiled[2] - compiled[0]).abs().max() > 0  # the step moved the compiled model's output
    assert torch.equal(compiled[1], compiled[3])  # ... and not the reference's
