"""Ulysses sequence parallelism (`--sp`, sequence_parallel.py) on CPU, gloo, 2 and 4 ranks: the split model's
rollout, velocities and LoRA gradients equal the unsplit model's to float32 rounding (tiny Qwen-Image and tiny FLUX);
CLI runs with --sp 2 take the same steps as one process and resume bit for bit; impossible --sp values are refused at
start-up, naming the flag and the numbers.

`--model tiny` has 3 attention heads, which --sp 2 cannot split (refused below): these tests use the same classes with
4 heads (`build_tiny_qwen_pipeline(heads=4)`, through --model-path for the CLI)."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import distribute_tensor

import engine as eng
import flowgrpo
import models
import rollout
from test_engine import (ENV, ROOT, SMALL, assert_same, free_port, lora, relative_difference, rows, train_state,
                         without_perf)

KEYS = {"reward/mean", "train/policy_loss", "train/grad_norm", "eval/reward_mean"}  # compared with 1 process
PROMPTS = ["a cat", "a cat", "a photo of a red bicycle", "a photo of a red bicycle"]  # 11 Qwen tokens: padded to 12


def tiny_qwen4(device):
    return models.QwenImage(models.build_tiny_qwen_pipeline(0, heads=4), device, torch.float32)


def tiny_flux78(device):
    """tiny-flux with a 78-token T5 text (its own 77 do not split in two, and FLUX masks no padding: refused on the
    CLI); the mechanism is the same as flux.1-dev's 128 tokens."""
    model = models.load_model("tiny-flux", None, device)
    model.max_sequence_length = 78
    return model


def rollout_and_gradients(build, cfg: float, sp: int, inputs=None, **engine_kw) -> dict:
    """One engine (--sp sp) on every rank, its LoRA set to the same seeded values: its own rollout of PROMPTS, then on
    `inputs` (the unsplit run's batch, or its own) the velocity at the second trained state and the LoRA gradients of
    the policy loss there, its KL to the reference (the adapter off) included. Gradients are gathered full tensors."""
    model = build(eng.init_distributed()[2])  # the engine's device: the CPU, or this rank's GPU
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0, sp=sp, **engine_kw)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B = 0 at init would leave A without a gradient
        for p in engine.params:
            full = (0.1 * torch.randn(p.shape, generator=g)).to(p.dtype)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    seen = []  # the image tokens the first block's attention gets on this rank
    model.blocks[0].attn.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["hidden_states"].shape[1]),
                                                   with_kwargs=True)
    ids = torch.arange(len(PROMPTS))
    model.transformer.eval()
    batch = rollout.sample(model, PROMPTS, [{}] * len(ids), ids // 2, ids, steps=[0, 1, 2], num_steps=4, height=32,
                           width=32, cfg_scale=cfg, negative_prompt=" ", noise_level=0.7, sde_type="sde", seed=0,
                           iteration=0, chunk=len(ids))
    batch.advantages = torch.linspace(-1, 1, len(ids), device=model.device)
    a = dataclasses.replace(flowgrpo.RECIPES["tiny"], cfg_scale=cfg, kl_beta=0.1)  # the reference pass too
    model.transformer.train()
    _, own = flowgrpo.policy_loss(model, engine, batch, 0, a)  # the rollout's own first transition: on-policy?
    given = dataclasses.replace(inputs or batch, cond=batch.cond)  # the split model keeps its own (padded) text
    loss, _ = flowgrpo.policy_loss(model, engine, given, 1, a)
    engine.optimizer.zero_grad(set_to_none=False)
    loss.backward()
    with torch.no_grad():
        v = model.velocity(given.latents[:, 1], given.sigmas[1].expand(len(ids)), given.cond, cfg, 32, 32)
    return dict(batch=batch, velocity=v.float(), gap=float(own["gap"]), text=batch.cond["embeds"].shape[1], seen=seen,
                grads=[p.grad.full_tensor().cpu() for p in engine.params])


def compare(build, cfg: float, **engine_kw) -> dict:
    one = rollout_and_gradients(build, cfg, 1, **engine_kw)
    two = rollout_and_gradients(build, cfg, 2, inputs=one["batch"], **engine_kw)
    g1, g2 = torch.cat([g.flatten() for g in one["grads"]]).double(), torch.cat([g.flatten() for g in two["grads"]])
    return dict(latents=(one["batch"].latents - two["batch"].latents).abs().max().item(),  # each its own rollout
                log_probs=(one["batch"].log_probs - two["batch"].log_probs).abs().max().item(),
                velocity=(one["velocity"] - two["velocity"]).abs().max().item(),
                velocity_scale=one["velocity"].abs().max().item(),
                grad_max=(g1 - g2.double()).abs().max().item(), grad_scale=g1.abs().max().item(),
                grad_rel=((g1 - g2.double()).norm() / g1.norm()).item(), gap=two["gap"],
                text=[one["text"], two["text"]], tokens=[sorted(set(one["seen"])), sorted(set(two["seen"]))])


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    torch.set_num_threads(1)
    results = {"qwen": compare(tiny_qwen4, 4.0), "flux": compare(tiny_flux78, 1.0),
               "qwen bf16": compare(tiny_qwen4, 1.0, mixed_precision=True, activation_checkpointing=True)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    eng.shutdown()
    eng.exit_process(0)  # as flowgrpo.py ends (engine.exit_process: why)


def run_split_vs_unsplit(directory) -> dict:
    """The comparisons of `_worker` on 2 ranks (gloo on CPU; on a machine with 2 GPUs, NCCL: tests/test_gpu.py)."""
    out = os.path.join(str(directory), "results.json")
    mp.spawn(_worker, args=(free_port(), out), nprocs=2)
    results = json.load(open(out))
    print("\n" + "\n".join(f"{k}: {v}" for k, v in results.items()))
    return results


@pytest.fixture(scope="module")
def split_vs_unsplit(tmp_path_factory):
    return run_split_vs_unsplit(tmp_path_factory.mktemp("sp"))


def check_float32(r: dict, family: str) -> None:
    assert r["latents"] < 1e-5 and r["log_probs"] < 1e-5, r
    assert r["velocity"] < 1e-5 * max(1.0, r["velocity_scale"]), f"velocity: max |Δ| {r['velocity']:.3g}"
    assert r["grad_rel"] < 1e-5 and r["grad_max"] < 1e-5 * r["grad_scale"], \
        f"LoRA gradient: max |Δ| {r['grad_max']:.3g} of {r['grad_scale']:.3g}, ‖Δ‖/‖g‖ {r['grad_rel']:.3g}"
    assert r["gap"] == 0
    assert r["tokens"] == [[16], [8]]  # the first attention gets 16 image tokens unsplit, 8 on each rank split
    if family == "qwen":
        assert r["text"] == [11, 12]  # the prompts' 11 tokens, padded (masked) to a multiple of 2


@pytest.mark.parametrize("family", ["qwen", "flux"])
def test_split_velocities_and_lora_gradients_equal_the_unsplit_models(split_vs_unsplit, family):
    """Tiny Qwen-Image (true CFG 4, text of 11 tokens padded to 12) and tiny FLUX (guidance embedding), float32: the
    rollout, the velocity on the same inputs and the LoRA gradient of the policy loss differ from the unsplit model's
    by float32 rounding only (attention sums taken in another order), and the first update stays exactly on-policy."""
    check_float32(split_vs_unsplit[family], family)


def test_split_training_under_mixed_precision_and_checkpointing(split_vs_unsplit):
    """bf16 compute (fp32 LoRA, FSDP2 mixed precision) with activation checkpointing: on-policy exactly, and within bf16
    rounding of the unsplit model."""
    r = split_vs_unsplit["qwen bf16"]
    assert r["gap"] == 0 and r["tokens"] == [[16], [8]]
    assert r["velocity"] < 3e-2 * r["velocity_scale"] and r["grad_rel"] < 5e-2, r


# ---- the CLI: --sp 2 on 2 ranks, and --sp 2 on 4 ranks (2 data-parallel groups), against one process ----------------

def launch(run_dir, pipeline, *flags, ranks=1):
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={ranks}"]
    cmd = launcher + [os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--model-path", str(pipeline), "--eval-every", "3",
                      "--eval-images", "4", "--run-dir", str(run_dir), *flags]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny4") / "pipeline"
    models.build_tiny_qwen_pipeline(0, heads=4).save_pretrained(str(path))
    return path


def test_cli_sp2_takes_the_steps_of_one_process_and_resumes_exactly(pipeline, tmp_path):
    """As test_engine.test_two_ranks_match_one_process, with its bound (1e-3 relative on the LoRA): 1 process; --sp 2 on
    2 ranks with activation checkpointing; --sp 2 on 4 ranks (2 data-parallel groups of 2); and the 2-rank run resumed
    from its checkpoint after 2 iterations, bit for bit."""
    runs = {name: tmp_path / name for name in ("one", "sp2", "dp2sp2", "resumed")}
    launch(runs["one"], pipeline, "--iterations", "4")
    out = launch(runs["sp2"], pipeline, "--iterations", "4", "--sp", "2", "--activation-checkpointing", ranks=2)
    assert "ranks=1, images_per_rank=8" in out.stdout  # the batch arithmetic counts data-parallel ranks
    out = launch(runs["dp2sp2"], pipeline, "--iterations", "2", "--sp", "2", ranks=4)  # 4 processes on 2 cores: short
    assert "ranks=2, images_per_rank=4" in out.stdout
    launch(runs["resumed"], pipeline, "--iterations", "4", "--sp", "2", "--activation-checkpointing", "--resume",
           str(runs["sp2"] / "checkpoints" / "iter_000001"), ranks=2)  # from iteration 2, in a directory of its own
    one = rows(runs["one"])
    for name, ckpt in (("sp2", "iter_000003"), ("dp2sp2", "iter_000001")):
        split = rows(runs[name])
        assert [r["iteration"] for r in split] == list(range(int(ckpt[-1]) + 1))
        assert split[0]["reward/mean"] == pytest.approx(one[0]["reward/mean"], rel=1e-6)
        for a, b in zip(one, split):
            assert b["train/logp_gap"] == 0
            for key in KEYS & a.keys() & b.keys():  # eval after iterations 0 and 3 (and at the end)
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, a["iteration"], key, a[key], b[key])
        rel, worst = relative_difference(lora(runs["one"], ckpt), lora(runs[name], ckpt))
        print(f"{name}: LoRA vs 1 process {rel:.3g} relative (max |Δ| {worst:.3g})")
        assert rel < 1e-3, f"{name}: LoRA differs from 1 process by {rel:.3g} relative (max |Δ| {worst:.3g})"
    assert_same(lora(runs["sp2"]), lora(runs["resumed"]), exact=True)
    ckpt = "iter_000003"
    assert_same(train_state(runs["sp2"], ckpt, tmp_path), train_state(runs["resumed"], ckpt, tmp_path), exact=True)
    assert [without_perf(r) for r in rows(runs["resumed"])] == [without_perf(r) for r in rows(runs["sp2"])]


# ---- refusals, at start-up ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (dict(model="tiny"), "--sp 2 must divide every count it splits, but --model tiny at --height 32 --width 32 has 3 "
                         "attention heads (QwenImageTransformer2DModel)"),
    (dict(model="tiny-flux"), "--model tiny-flux at --height 32 --width 32 has 77 T5 text tokens"),
    (dict(model="tiny", model_path="PIPELINE", height=40, width=40), "has 25 image tokens"),
    (dict(model="tiny-sd3"), "--sp: --model tiny-sd3 has no sequence parallelism: diffusers 0.42.1 has no "
                             "context-parallel plan for SD3Transformer2DModel"),
    (dict(model="tiny", rollout="vllm-omni", rollout_url="http://127.0.0.1:1"), "--sp > 1 needs --rollout local"),
])
def test_impossible_sp_is_refused_naming_the_numbers(pipeline, flags, message):
    flags = {k: str(pipeline) if v == "PIPELINE" else v for k, v in flags.items()}
    a = dataclasses.replace(flowgrpo.RECIPES[flags["model"]], sp=2, **flags)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        flowgrpo.check_args(a)


def test_sp_must_divide_the_world_and_is_refused_before_anything_is_built(pipeline, tmp_path):
    with pytest.raises(ValueError, match=r"--sp 2 must divide the number of ranks, 3 \(torchrun"):
        eng.data_parallel_size(3, 2)
    assert eng.data_parallel_size(4, 2) == 2
    out = subprocess.run([sys.executable, os.path.join(ROOT, "flowgrpo.py"), *SMALL, "--model-path", str(pipeline),
                          "--sp", "2", "--run-dir", str(tmp_path / "r")], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0 and "--sp 2 must divide the number of ranks, 1" in out.stderr, out.stderr[-2000:]
    assert "batch arithmetic" not in out.stdout and not (tmp_path / "r").exists()
