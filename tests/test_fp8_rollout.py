"""--fp8-rollout (fp8_rollout.py): the rollout's frozen linear layers multiply in float8 through torch's scaled matmul;
the update's forwards are the bf16 ones, bit for bit; through the CLI the rollout's log-probs move off the update's by
the rounding, and --stale-correction decoupled runs with it."""
import pytest
import torch
import torch.nn.functional as F

import engine as eng
import fp8_rollout
import models
import precision
from test_engine import SMALL
from tiny_setup import main_here


def test_a_layer_multiplies_its_quantised_operands_and_is_itself_again_after():
    """Inside `rollout`: the product of the per-token and per-row float8 operands, scaled, into bf16 (the same values
    computed in float32 here, within one bf16 rounding), a few per cent from the bf16 product; a row of zeros stays
    zeros. After it: the layer's own bf16 forward, bit for bit."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48).to(torch.bfloat16).requires_grad_(False)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    x[1, 2] = 0
    layers = fp8_rollout.quantise_frozen([layer])
    with torch.no_grad(), fp8_rollout.rollout(layers):
        y = layer(x)
    xq, sx = fp8_rollout.quantise(x.reshape(-1, 64))
    by_hand = ((xq.float() @ layer.fp8_weight.float().t()) * sx * layer.fp8_scale).to(torch.bfloat16).view(2, 5, 48)
    by_hand = by_hand + layer.bias
    assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 48)
    off = (y.float() - by_hand.float()).abs().max().item()
    assert off <= 2 * 2**-8 * by_hand.float().abs().max().item(), f"scaled_mm vs by hand: {off:.3g}"
    assert torch.equal(y[1, 2], layer.bias)  # the zero token: bias only
    exact = F.linear(x, layer.weight, layer.bias)
    relative = ((y.float() - exact.float()).norm() / exact.float().norm()).item()
    print(f"\nfloat8 against bf16, relative: {relative:.4f}")
    assert 0 < relative < 0.06, f"float8 against bf16: {relative:.4f}"
    with torch.no_grad():
        assert torch.equal(layer(x), exact)


def test_cli_the_rollouts_log_probs_move_by_the_rounding(tmp_path):
    """`flowgrpo.py --mixed-precision --fp8-rollout --stale-correction decoupled`: the proximal pass recomputes the
    log-probs in bf16, the update's own arithmetic, so the first update's gap is 0, and the float8 rollout's rounding
    shows in the importance weights: the behaviour log-probs are off the update's, by little. DiffusionNFT, which reads
    no rollout log-prob, trains on the float8 rollout's samples as they are."""
    rows = main_here(*SMALL, "--iterations", "1", "--mixed-precision", "--fp8-rollout", "--stale-correction",
                     "decoupled", "--run-dir", tmp_path / "d")
    diff = [v for k, v in rows[0].items() if k.startswith("rollout_corr/logp_diff/")]
    assert rows[0]["train/logp_gap"] == 0 and diff and all(0 < d < 0.05 for d in diff), rows[0]
    assert rows[0]["rollout_corr/is_mean"] != 1 and rows[0]["train/grad_norm"] > 0, rows[0]
    rows = main_here(*SMALL, "--iterations", "1", "--mixed-precision", "--fp8-rollout", "--algorithm", "nft",
                     "--run-dir", tmp_path / "n")
    assert rows[0]["train/grad_norm"] > 0, rows[0]


@pytest.mark.parametrize("flags, error", [
    ([], "--fp8-rollout needs --stale-correction decoupled"), (["--merged-lora"], "--merged-lora sums"),
    *[(flags, "--fp8-rollout needs --mixed-precision") for flags in (
        ["--full-finetune"], ["--offload"], ["--no-mixed-precision"],
        ["--rollout", "vllm-omni", "--rollout-url", "http://127.0.0.1:9"])]])
def test_fp8_rollout_is_refused_where_it_would_not_apply(flags, error, tmp_path):
    with pytest.raises(ValueError, match=error):
        main_here(*SMALL, "--mixed-precision", "--fp8-rollout", *flags, "--run-dir", tmp_path / "r")


def test_fp8_rollout_without_room_for_its_copies_is_refused_in_a_line(tmp_path, monkeypatch):
    """The room asked for is what the float8 copies and their scales take; where the device has not that room, the
    engine says so as it is built, with their size, instead of running out of memory (the free memory faked)."""
    asked, need_room = [], precision.need_room
    monkeypatch.setattr(precision, "need_room", lambda n, device, what: asked.append(n) or need_room(n, device, what))
    blocks = [torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16)).to(torch.bfloat16)
              .requires_grad_(False)]
    layers = fp8_rollout.quantise_frozen(blocks)
    assert asked == [sum(m.fp8_weight.nbytes + m.fp8_scale.nbytes for m in layers)] == [32 * 48 + 48 * 4 + 48 * 16 +
                                                                                         16 * 4]
    monkeypatch.setattr(precision, "free_bytes", lambda device: 0)
    with pytest.raises(ValueError, match=r"--fp8-rollout keeps a float8 copy of every frozen linear weight of the "
                                         r"blocks, 0\.0 GiB here, and cpu has 0\.0 GiB free: leave it out"):
        main_here(*SMALL, "--mixed-precision", "--fp8-rollout", "--algorithm", "nft", "--run-dir", tmp_path / "r")


def test_only_the_rollout_computes_in_float8_and_compiled_blocks_trace_it(monkeypatch):
    """The engine's rollout (`rollout_weights`) on the tiny model with --fp8-rollout: its velocity differs from the
    update's by the rounding, and the update's is what the same engine without the option computes, to the bit. With
    --compile (dynamo with aot_eager, as test_engine's compile test) the rollout's float8 forwards (a graph of their
    own) and the update's trace without a graph break and give the eager engine's outputs to the bit; a second rollout
    after the update's forward is the float8 one again."""
    from torch._dynamo.utils import counters
    compile_ = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_(self, backend="aot_eager"))
    outputs = {}
    for fp8, compiled in ((False, False), (True, False), (True, True)):
        model = models.load_model("tiny", None, torch.device("cpu"), seed=0)
        engine = eng.Engine(model, lora_rank=4, lora_alpha=4, lora_targets=["to_q", "to_v"], lr=1e-3, weight_decay=0,
                            max_grad_norm=1, seed=0, mixed_precision=True, fp8_rollout=fp8, compile=compiled)
        x = model.noise([torch.Generator().manual_seed(1)], 32, 32)
        cond, sigma = model.conditioning(["a cat"], "", 1.0), torch.full((1,), 0.7)
        torch._dynamo.reset()
        counters.clear()
        with torch.no_grad():
            with engine.rollout_weights():
                rolled = model.velocity(x, sigma, cond, 1.0, 32, 32)
            trained = model.velocity(x, sigma, cond, 1.0, 32, 32)
            with engine.rollout_weights():
                again = model.velocity(x, sigma, cond, 1.0, 32, 32)
        outputs[fp8, compiled] = rolled, trained, again
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] > 0, dict(counters["graph_break"])
    rolled, trained, again = outputs[True, False]
    assert torch.equal(trained, outputs[False, False][1]) and torch.equal(rolled, again)
    relative = ((rolled - trained).norm() / trained.norm()).item()
    assert 0 < relative < 0.1, f"the float8 rollout's velocity against bf16's: {relative:.4g}"
    for c, e in zip(outputs[True, True], outputs[True, False]):
        assert torch.equal(c, e), f"compiled vs eager: {(c - e).abs().max():.3g}"
