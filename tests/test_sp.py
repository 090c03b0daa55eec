"""Ulysses sequence parallelism (`--sp`, sequence_parallel.py) on CPU, gloo, 2 and 4 ranks: the split model's
rollout, velocities and LoRA gradients equal the unsplit model's to float32 rounding (tiny Qwen-Image, tiny FLUX,
tiny-wan's video tokens, tiny FLUX.2 [klein] and nano-edit, its source's tokens in the sequence);
training runs with --sp 2 (on 2 ranks in the comparisons' processes; on 4 through the CLI and torchrun) take the same
steps as one process and resume bit for bit; impossible --sp values are refused at start-up, naming the flag and the
numbers.

`--model tiny` has 3 attention heads, which --sp 2 cannot split (refused below): these tests use the same classes with
4 heads (`build_tiny_qwen_pipeline(heads=4)`, through --model-path for the CLI)."""
import dataclasses
import json
import os
import subprocess
import sys
from typing import Callable

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.tensor import distribute_tensor

import algorithms
import cli
import engine as eng
import flowgrpo
import models
import models_qwen
import rollout
import startup
from test_engine import (ENV, ROOT, SMALL, assert_same, flat, free_port, lora, relative_difference, rows,
                         train_state, without_perf)
from test_nft_awm import train_here

KEYS = {"reward/mean", "train/policy_loss", "train/grad_norm", "eval/reward_mean"}  # compared with 1 process
NFT_BOUND = 2e-2  # DiffusionNFT's runs against 1 process (test_cli_nft_sp2_takes_the_steps_of_one_process: why)
PROMPTS = ["a cat", "a cat", "a photo of a red bicycle", "a photo of a red bicycle"]  # 11 Qwen tokens: padded to 12


def tiny_qwen4(device):
    return models_qwen.QwenImage(models_qwen.build_tiny_qwen_pipeline(0, heads=4), device, torch.float32)


def tiny_flux78(device):
    """tiny-flux with a 78-token T5 text (its own 77 do not split in two, and FLUX masks no padding: refused on the
    CLI); the mechanism is the same as flux.1-dev's 128 tokens."""
    model = models.load_model("tiny-flux", None, device)
    model.max_sequence_length = 78
    return model


def tiny_klein(device):
    """tiny-flux.2-klein: its 64 text tokens (512 at full size) and the image tokens, both split by FLUX.2's plan."""
    return models.load_model("tiny-flux.2-klein", None, device)


def tiny_wan5(device):
    """tiny-wan with 5 frames: 2 latent frames of 4×4 patches, 32 video tokens."""
    return models.load_model("tiny-wan", None, device, num_frames=5)


def nano_edit(device):
    """nano-edit (4 heads): each source's 4 tokens at 16×16 join the 4 noisy ones, so a rank at --sp 2 holds all the
    noisy tokens or all the source's."""
    return models.load_model("nano-edit", None, device)


# one source digit per prompt (nano-edit), each distinct: a row that got another's source would show
SOURCES = tuple({"image": os.path.join(ROOT, "assets", "nano-edit", "sources", f"train_{n}.png")}
                for n in (1, 8, 12, 14))


@dataclasses.dataclass(frozen=True)
class Family:
    """One family's comparison: its model, its guidance, the first block's self-attention (whose input shows the split:
    `tokens` unsplit, half of them a rank at --sp 2) and the text length each side encodes."""
    build: Callable
    cfg: float
    attention: str
    tokens: int
    text: tuple[int, int]
    float64: bool = False  # also in float64: the split exact there, and float32's own rounding measured
    side: int = 32  # the images' height and width
    metadata: tuple[dict, ...] = ({},) * len(PROMPTS)  # each prompt's (an edit model's source image)


FAMILIES = {"qwen": Family(tiny_qwen4, 4.0, "attn", 16, (11, 12)),  # the prompts' 11 tokens, padded (masked) to 12
            "flux": Family(tiny_flux78, 1.0, "attn", 16, (78, 78)),
            "wan": Family(tiny_wan5, 4.5, "attn1", 32, (77, 77), float64=True),  # text by cross-attention: not split
            "klein": Family(tiny_klein, 4.0, "attn", 16, (64, 64)),  # FLUX.2 [klein]: two-pass CFG
            "nano-edit": Family(nano_edit, 4.0, "attn", 8, (11, 12), side=16, metadata=SOURCES)}  # 4 noisy + 4 source


def in_float64(build: Callable) -> Callable:
    def build64(device):
        model = build(device)
        model.pipe.to(torch.float64)  # weights and compute; the rollout's noise stays float32, as the inputs given
        model.dtype = torch.float64
        return model
    return build64


def rollout_and_gradients(family: Family, sp: int, inputs=None, terms=False, **engine_kw) -> dict:
    """One engine (--sp sp) on every rank, its LoRA set to the same seeded values: its own rollout of PROMPTS, then on
    `inputs` (the unsplit run's batch, or its own) the velocity at the second trained state and the LoRA gradients of
    the policy loss there, its KL to the reference (the adapter off) included. Gradients are gathered full tensors."""
    model = family.build(eng.init_distributed()[2])  # the engine's device: the CPU, or this rank's GPU
    engine = eng.Engine(model, lora_rank=4, lora_alpha=8, lora_targets=model.lora_targets, lr=1e-2, weight_decay=0,
                        max_grad_norm=1.0, seed=0, sp=sp, **engine_kw)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # B = 0 at init would leave A without a gradient
        for p in engine.params:
            full = (0.1 * torch.randn(p.shape, generator=g)).to(p.dtype)
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    seen = []  # the tokens the first block's self-attention gets on this rank (Wan calls it with positional arguments)
    getattr(model.blocks[0], family.attention).register_forward_pre_hook(
        lambda m, args, kw: seen.append((args[0] if args else kw["hidden_states"]).shape[1]), with_kwargs=True)
    ids, cfg = torch.arange(len(PROMPTS)), family.cfg
    model.transformer.eval()
    side = family.side
    batch = rollout.sample(model, PROMPTS, list(family.metadata), ids // 2, ids, steps=[0, 1, 2], num_steps=4,
                           height=side, width=side, cfg_scale=cfg, negative_prompt=" ", noise_level=0.7, sde_type="sde",
                           seed=0, iteration=0, chunk=len(ids))
    batch.advantages = torch.linspace(-1, 1, len(ids), device=model.device)
    a = dataclasses.replace(flowgrpo.RECIPES["tiny"], cfg_scale=cfg, kl_beta=0.1, height=side,  # the reference too
                            width=side)
    model.transformer.train()
    _, own = algorithms.policy_loss(model, engine, batch, 0, a)  # the rollout's own first transition: on-policy?
    given = dataclasses.replace(inputs or batch, cond=batch.cond)  # the split model keeps its own (padded) text
    hooks = summed_terms(engine) if terms else None
    loss, _ = algorithms.policy_loss(model, engine, given, 1, a)
    engine.optimizer.zero_grad(set_to_none=False)
    loss.backward()
    extra = {} if hooks is None else hooks()
    with torch.no_grad():
        v = model.velocity(given.latents[:, 1], given.sigmas[1].expand(len(ids)), given.cond, cfg, side, side)
    return dict(batch=batch, velocity=v.double(), gap=float(own["gap"]), text=batch.cond["embeds"].shape[1], seen=seen,
                grads=[p.grad.full_tensor().cpu() for p in engine.params], **extra)


def summed_terms(engine) -> Callable:
    """Hooks on every LoRA linear layer, whose weight's gradient is a sum over the rows (tokens) it saw,
    g = Σ_t go_t x_tᵀ: -> a function that removes them and gives each parameter's Σ_t |go_t| |x_t|ᵀ (float64) and the
    number of rows summed (a layer that never got a gradient, as the last block's text stream: zeros and 0)."""
    found, handles = {}, []

    def forward(module, args, out):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().double()

        def backward(go):
            sums = found.setdefault(module.weight_name, [0, 0])
            sums[0] = sums[0] + go.detach().reshape(-1, go.shape[-1]).abs().double().T @ x
            sums[1] += x.shape[0]
        out.register_hook(backward)
    for name, m in engine.model.transformer.named_modules():
        if isinstance(m, torch.nn.Linear) and ("lora_A" in name or "lora_B" in name):
            m.weight_name = name + ".weight"  # FSDP2 swaps the parameter objects around a forward: names stay
            handles.append(m.register_forward_hook(forward))
    names = {id(p): name for name, p in engine.model.transformer.named_parameters()}

    def done():
        for h in handles:
            h.remove()
        sums = [found.get(names[id(p)], (torch.zeros(p.shape, dtype=torch.float64), 0)) for p in engine.params]
        return dict(abs_terms=[s for s, _ in sums], rows=[n for _, n in sums])
    return done


def grad_gap(one: dict, two: dict) -> tuple[float, float, float]:
    """The LoRA gradients' max |Δ|, the largest |g| of `one`, and ‖Δ‖/‖g‖, in float64."""
    g1, g2 = (torch.cat([g.flatten() for g in r["grads"]]).double() for r in (one, two))
    return (g1 - g2).abs().max().item(), g1.abs().max().item(), ((g1 - g2).norm() / g1.norm()).item()


def summation_bound(one: dict, two: dict) -> float:
    """The largest |Δ| of the two LoRA gradients as a fraction of what float32 summation allows, elementwise.
    Split and unsplit sum the same float32 terms go_t x_tᵀ (the forward and each row's backward are the same kernels
    on the same rows; the split only changes which rank sums which rows, then adds the two partial sums), each in
    some order: a sum of n products computed in float32 in any order is within γ_n·Σ|terms| of the exact sum
    (γ_n = nu/(1 − nu), u = 2⁻²⁴; Higham, Accuracy and Stability of Numerical Algorithms, §3.1 and §4.2), one more
    rounding for the ranks' addition, so the two differ by at most 2·γ_{n+1}·Σ|terms|. The order (hence the actual
    difference) depends on the machine's vector width and BLAS kernels; this bound does not. 1 means it is reached."""
    g1, g2 = (torch.cat([g.flatten() for g in r["grads"]]).double() for r in (one, two))
    u = 2.0 ** -24
    gamma = torch.tensor([(n + 1) * u / (1 - (n + 1) * u) for n in one["rows"]], dtype=torch.float64)
    bound = 2 * gamma.repeat_interleave(torch.tensor([s.numel() for s in one["abs_terms"]])) * torch.cat(
        [s.flatten() for s in one["abs_terms"]])
    diff = (g1 - g2).abs()
    if (diff[bound == 0] > 0).any():  # no terms (a layer without a gradient): both must be exactly 0
        return float("inf")
    return (diff[bound > 0] / bound[bound > 0]).max().item()


def compare(family: Family, **engine_kw) -> dict:
    one = rollout_and_gradients(family, 1, terms=True, **engine_kw)
    two = rollout_and_gradients(family, 2, inputs=one["batch"], **engine_kw)
    grad_max, grad_scale, grad_rel = grad_gap(one, two)
    r = dict(latents=(one["batch"].latents - two["batch"].latents).abs().max().item(),  # each its own rollout
             log_probs=(one["batch"].log_probs - two["batch"].log_probs).abs().max().item(),
             velocity=(one["velocity"] - two["velocity"]).abs().max().item(),
             velocity_scale=one["velocity"].abs().max().item(), grad_max=grad_max, grad_scale=grad_scale,
             grad_rel=grad_rel, summed=summation_bound(one, two), gap=two["gap"], text=[one["text"], two["text"]],
             tokens=[sorted(set(one["seen"])), sorted(set(two["seen"]))])
    if family.float64:  # the unsplit run's inputs in float64, unsplit and split
        exact = dataclasses.replace(family, build=in_float64(family.build))
        one64 = rollout_and_gradients(exact, 1, inputs=one["batch"], **engine_kw)
        two64 = rollout_and_gradients(exact, 2, inputs=one["batch"], **engine_kw)
        r |= dict(rounding=grad_gap(one, one64)[0], exact_grad_rel=grad_gap(one64, two64)[2],
                  exact_velocity=(one64["velocity"] - two64["velocity"]).abs().max().item())
    return r


def _worker(rank: int, port: int, out: str, runs: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", OMP_NUM_THREADS="1")  # (flowgrpo.main then keeps the 1 thread set here)
    torch.set_num_threads(1)
    results = {name: compare(family) for name, family in FAMILIES.items()}
    bf16 = dataclasses.replace(FAMILIES["qwen"], cfg=1.0)
    results["qwen bf16"] = compare(bf16, mixed_precision=True, activation_checkpointing=True)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    for argv in runs:  # in the process group joined above, as under torchrun
        flowgrpo.main(cli.parse_args(flowgrpo.Args, argv))
    eng.shutdown()
    eng.exit_process(0)  # as flowgrpo.py ends (engine.exit_process: why)


def run_split_vs_unsplit(directory, runs=()) -> dict:
    """The comparisons of `_worker` on 2 ranks (gloo on CPU; on a machine with 2 GPUs, NCCL: tests/test_gpu.py), then
    the trainings `runs` (flowgrpo.py argument lists: flowgrpo.main on each rank), one after another on the same 2
    ranks: one start-up (a process's imports, most of a tiny run's cost) for all."""
    out = os.path.join(str(directory), "results.json")
    mp.spawn(_worker, args=(free_port(), out, list(runs)), nprocs=2)
    results = json.load(open(out))
    print("\n" + "\n".join(f"{k}: {v}" for k, v in results.items()))
    return results


# The runs the training section checks: 2 iterations (the second starts from trained weights and AdamW state, which a
# resumed run loads), checkpointed at the end (SMALL); DiffusionNFT with its reference KL.
GRPO = ("--iterations", "2")
NFT = ("--iterations", "2", "--algorithm", "nft", "--kl-beta", "0.01")
DPPO = ("--iterations", "2", "--trust-region", "dppo", "--dppo-threshold", "0")  # at 0 the mask acts in every update
DPO = ("--iterations", "2", "--algorithm", "dpo", "--micro-batch", "4", "--train-timesteps", "2")  # a pair per group
DGPO = ("--iterations", "2", "--algorithm", "dgpo", "--micro-batch", "4", "--kl-beta", "0.01")  # whole groups
NANO_EDIT = ("--model", "nano-edit", *SMALL[2:], "--iterations", "1")  # the shipped model and prompts, 8 images


def sp_argv(pipeline, run_dir, *flags) -> list[str]:
    """flowgrpo.py's arguments for a run on the 4-head pipeline, evaluated after the first iteration and at the end."""
    return [*SMALL, "--model-path", str(pipeline), "--eval-every", "3", "--eval-images", "4", "--run-dir", str(run_dir),
            *flags]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, pipeline):
    """All of this file's work on 2 ranks, in one pair of processes: the comparisons, then GRPO with --sp 2 and
    activation checkpointing, that run resumed from its checkpoint after the first iteration (in a directory of its
    own), DiffusionNFT, Flow-DPPO's trust region, DPO and DGPO with --sp 2, and nano-edit with --sp 2. -> (the
    comparisons, the run directories)."""
    directory = tmp_path_factory.mktemp("sp")
    runs = {name: directory / name for name in ("sp2", "resumed", "nft", "dppo", "dpo", "dgpo", "nano-edit")}
    sp2 = (*GRPO, "--sp", "2", "--activation-checkpointing", "--checkpoint-every", "1")  # also after the first
    resume = ("--resume", str(runs["sp2"] / "checkpoints" / "iter_000000"))
    argvs = [sp_argv(pipeline, runs["sp2"], *sp2),  # the resumed run reuses the rollout's forwards: no bit changes
             sp_argv(pipeline, runs["resumed"], *sp2, *resume, "--reuse-rollout-forward"),
             sp_argv(pipeline, runs["nft"], *NFT, "--sp", "2"), sp_argv(pipeline, runs["dppo"], *DPPO, "--sp", "2"),
             sp_argv(pipeline, runs["dpo"], *DPO, "--sp", "2"), sp_argv(pipeline, runs["dgpo"], *DGPO, "--sp", "2"),
             [*NANO_EDIT, "--sp", "2", "--run-dir", str(runs["nano-edit"])]]
    return run_split_vs_unsplit(directory, argvs), runs


@pytest.fixture(scope="module")
def split_vs_unsplit(two_ranks):
    return two_ranks[0]


def check_float32(r: dict, family: str) -> None:
    assert r["latents"] < 1e-5 and r["log_probs"] < 1e-5, r
    assert r["velocity"] < 1e-5 * max(1.0, r["velocity_scale"]), f"velocity: max |Δ| {r['velocity']:.3g}"
    assert r["summed"] <= 1, f"LoRA gradient: max |Δ| {r['grad_max']:.3g} of {r['grad_scale']:.3g} (‖Δ‖/‖g‖ " \
        f"{r['grad_rel']:.3g}), {r['summed']:.3g} of float32 summation's bound at the worst element"
    assert r["gap"] == 0
    n = FAMILIES[family].tokens  # the first self-attention gets n image (video) tokens unsplit, n/2 a rank split
    assert r["tokens"] == [[n], [n // 2]] and r["text"] == list(FAMILIES[family].text), r


@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_velocities_and_lora_gradients_equal_the_unsplit_models(split_vs_unsplit, family):
    """Tiny Qwen-Image (true CFG 4, text of 11 tokens padded to 12), tiny FLUX (guidance embedding), tiny-wan (CFG
    4.5, 5 frames: 32 video tokens split, the text unsplit), tiny FLUX.2 [klein] (CFG 4, 16 image and 64 text tokens
    split) and nano-edit (CFG 4, 16×16: 4 noisy tokens and its source's 4 after them, one rank each), float32: the
    rollout, the velocity on the same inputs and the LoRA gradient of the policy loss differ from the unsplit model's
    by float32 rounding only, and the first update stays exactly on-policy. The gradient's bound is float32
    summation's (summation_bound), not a measured difference: which order the kernels sum in depends on the machine
    (AVX-512 or AVX2), and with it the difference (tiny-wan's max |Δ| 4.5e-9 with AVX-512, 4.3e-9 with AVX2, where the
    unsplit float32 gradient's own error was 3.1e-9 and 1.9e-9); measured at 0.05–0.11 of the bound on both, and with
    SSE4 kernels (nano-edit: 0.23–0.30 with the three; in float64 its split and unsplit agree to 1.2e-15)."""
    check_float32(split_vs_unsplit[family], family)


def test_wan_split_is_exact_in_float64(split_vs_unsplit):
    """That the split costs nothing beyond rounding shows in float64, where split and unsplit agree to 1e-12 (tiny-wan:
    its gradient is the families' most cancelled, S/|g| up to 2.6e4); float32 rounds it at its own precision."""
    r = split_vs_unsplit["wan"]
    assert r["exact_grad_rel"] < 1e-12 and r["exact_velocity"] < 1e-12 * r["velocity_scale"], r
    assert 0 < r["rounding"] < 1e-4 * r["grad_scale"], r  # float32 does round, and only at its own precision


def test_split_training_under_mixed_precision_and_checkpointing(split_vs_unsplit):
    """bf16 compute (fp32 LoRA, FSDP2 mixed precision) with activation checkpointing: on-policy exactly, and within bf16
    rounding of the unsplit model."""
    r = split_vs_unsplit["qwen bf16"]
    assert r["gap"] == 0 and r["tokens"] == [[16], [8]]
    assert r["velocity"] < 3e-2 * r["velocity_scale"] and r["grad_rel"] < 5e-2, r


# ---- training with --sp 2 on 2 ranks, and --sp 2 on 4 ranks (2 data-parallel groups), against one process ----------

def launch(run_dir, pipeline, *flags, ranks=1):
    """A run on the 4-head pipeline (sp_argv): on `ranks` ranks through the CLI (torchrun; its output returned), or
    in this process (test_nft_awm.train_here: one thread, as each rank)."""
    argv = sp_argv(pipeline, run_dir, *flags)
    if ranks == 1:
        return train_here(*argv)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           os.path.join(ROOT, "flowgrpo.py"), *argv]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny4") / "pipeline"
    models_qwen.build_tiny_qwen_pipeline(0, heads=4).save_pretrained(str(path))
    return path


def test_cli_sp2_takes_the_steps_of_one_process_and_resumes_exactly(pipeline, two_ranks, tmp_path):
    """As test_engine.test_two_ranks_match_one_process, with its bound (1e-3 relative on the LoRA): 1 process; --sp 2 on
    2 ranks with activation checkpointing (two_ranks: flowgrpo.main on each rank, as torchrun runs it); --sp 2 on 4
    ranks (2 data-parallel groups of 2), through the CLI and torchrun; and the 2-rank run resumed from its checkpoint
    after the first iteration, bit for bit, with --reuse-rollout-forward (its kept graphs' backward runs Ulysses'
    all-to-alls after the rollout's other forwards)."""
    runs = two_ranks[1] | {name: tmp_path / name for name in ("one", "dp2sp2")}
    launch(runs["one"], pipeline, *GRPO)
    out = launch(runs["dp2sp2"], pipeline, *GRPO, "--sp", "2", ranks=4)
    assert "ranks=2, images_per_rank=4" in out.stdout  # the batch arithmetic counts data-parallel ranks
    arith = json.loads((runs["sp2"] / "args.json").read_text())["batch_arithmetic"]
    assert (arith["ranks"], arith["images_per_rank"]) == (1, 8), arith
    one, ckpt = rows(runs["one"]), "iter_000001"
    for name in ("sp2", "dp2sp2"):
        split = rows(runs[name])
        assert [r["iteration"] for r in split] == [0, 1]
        assert split[0]["reward/mean"] == pytest.approx(one[0]["reward/mean"], rel=1e-6)
        for a, b in zip(one, split):
            assert b["train/logp_gap"] == 0
            for key in KEYS & a.keys() & b.keys():  # eval after iterations 0 and 1 (the end)
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (name, a["iteration"], key, a[key], b[key])
        assert "eval/reward_mean" in split[1]
        rel, worst = relative_difference(lora(runs["one"], ckpt), lora(runs[name], ckpt))
        print(f"{name}: LoRA vs 1 process {rel:.3g} relative (max |Δ| {worst:.3g})")
        assert rel < 1e-3, f"{name}: LoRA differs from 1 process by {rel:.3g} relative (max |Δ| {worst:.3g})"
    assert_same(lora(runs["sp2"]), lora(runs["resumed"]), exact=True)
    assert_same(train_state(runs["sp2"], ckpt, tmp_path), train_state(runs["resumed"], ckpt, tmp_path), exact=True)
    assert [without_perf(r) for r in rows(runs["resumed"])] == [without_perf(r) for r in rows(runs["sp2"])]


def test_cli_nft_sp2_takes_the_steps_of_one_process(pipeline, two_ranks, tmp_path):
    """DiffusionNFT (--algorithm nft, with its reference KL) through the split model: the ODE rollout under the old
    policy, the forward-process update on the re-noised final latents. --sp 2 on 2 ranks (two_ranks) takes the steps
    of one process: the first rollout's rewards to rounding, and the trained weights and the old policy in the
    checkpoint within NFT_BOUND.

    Why NFT_BOUND is 2e-2 and not the 1e-3 of Flow-GRPO's runs: a few LoRA elements get a gradient at float32's
    rounding level (√v in AdamW's state 1e-10 to 1e-8, near its eps), and AdamW moves such an element by about the
    learning rate whichever sign the rounding gave it: up to 2·lr (0.02 here) between two runs that sum in another
    order. Which elements, and how many, depends on the machine's kernels: with AVX-512 the two runs agreed to 1.4e-5
    relative; with the AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2),
    2.8e-3 after 2 steps and 3.6e-3 after 4 (max |Δ| 0.015, 0.021: ten of the 32 768 elements moved by 1.5–2 lr, the
    LoRA's norm ‖w‖ 7.9). The bound admits (2e-2·‖w‖ / 2·lr)² ≈ 60 elements moved by 2·lr; one optimizer step
    instead of two differs by 0.18 (test_engine.test_two_ranks_match_one_process). The
    metrics after the first optimizer step are functions of weights that agree only that far, so they are compared
    within the same bound; the first rollout's reward precedes any update and agrees to rounding."""
    runs = {"one": tmp_path / "one", "sp2": two_ranks[1]["nft"]}
    launch(runs["one"], pipeline, *NFT)
    one, split = rows(runs["one"]), rows(runs["sp2"])
    assert len(split) == 2 and split[0]["reward/mean"] == pytest.approx(one[0]["reward/mean"], rel=1e-6)
    for a, b in zip(one, split):
        for key in (KEYS | {"train/kl", "train/old_kl"}) & a.keys() & b.keys():
            assert b[key] == pytest.approx(a[key], rel=NFT_BOUND, abs=1e-6), (a["iteration"], key, a[key], b[key])
    state = {name: flat(train_state(run, "iter_000001", tmp_path)) for name, run in runs.items()}
    for part in ("model.", "old."):
        mine, theirs = ({k: v for k, v in state[r].items() if k.startswith(part)} for r in runs)
        rel, worst = relative_difference(mine, theirs)
        print(f"nft --sp 2, {part}*: {rel:.3g} relative to 1 process (max |Δ| {worst:.3g})")
        assert mine and rel < NFT_BOUND, f"{part}*: --sp 2 is {rel:.3g} relative from 1 process (max |Δ| {worst:.3g})"


def test_cli_dppo_sp2_takes_the_steps_of_one_process(pipeline, two_ranks, tmp_path):
    """Flow-DPPO's mask (--trust-region dppo) reads the behaviour means, which each rank of an --sp group holds whole:
    --sp 2 on 2 ranks (two_ranks) removes the same pairs and takes the steps of one process (the 1e-3 bound)."""
    runs = {"one": tmp_path / "one", "sp2": two_ranks[1]["dppo"]}
    launch(runs["one"], pipeline, *DPPO)
    one, split = rows(runs["one"]), rows(runs["sp2"])
    assert [r["train/clipfrac"] for r in split] == [r["train/clipfrac"] for r in one] and one[1]["train/clipfrac"] > 0
    for a, b in zip(one, split):
        assert b["train/logp_gap"] == 0 and b["reward/mean"] == pytest.approx(a["reward/mean"], rel=1e-6)
    rel, worst = relative_difference(lora(runs["one"]), lora(runs["sp2"]))
    assert rel < 1e-3, f"dppo --sp 2: LoRA {rel:.3g} relative from 1 process (max |Δ| {worst:.3g})"


@pytest.mark.parametrize("name,flags,bound", [("dpo", DPO, 1e-2), ("dgpo", DGPO, 1e-2)])
def test_cli_preference_sp2_takes_the_steps_of_one_process(pipeline, two_ranks, tmp_path, name, flags, bound):
    """Online DPO (the full-mode SDE rollout under its reference, one pair per group at a shared noise and timestep)
    and DGPO (whole groups, timesteps shared by the iteration, its KL) through the split model: --sp 2 on 2 ranks
    (two_ranks) takes the steps of one process: the rewards and the loss, and the trained weights within 1e-2.
    DGPO's loss is what is left of terms A·d of order 1 that nearly cancel in a group (its
    advantages sum to 0; its noise and timesteps are shared by the group): its rounding is the terms', so it is
    compared within 1e-5 absolute (measured: 3.3e-6 on a loss of 5.1e-3). The same cancellation leaves some LoRA
    gradients at the size of the split attention's rounding, and AdamW moves a parameter by about the learning rate
    whatever its gradient's size: measured 2.5e-3 relative (max |Δ| 0.015, the tiny recipe's lr 1e-2) after 4 steps,
    hence its bound. DPO's loss is a difference of the pair's two terms, and its LoRA agreed within 1e-3 on one
    machine but measured 1.95e-3 (max |Δ| 0.0148, again about 1.5 lr) on another with the same packages: the same
    mechanism, so the same bound. A wrong draw, pair or group would differ by order 1."""
    runs = {"one": tmp_path / "one", "sp2": two_ranks[1][name]}
    launch(runs["one"], pipeline, *flags)
    one, split = rows(runs["one"]), rows(runs["sp2"])
    for a, b in zip(one, split):
        for key in ("reward/mean", "train/policy_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-5), (a["iteration"], key, a[key], b[key])
    rel, worst = relative_difference(lora(runs["one"]), lora(runs["sp2"]))
    assert len(split) == 2 and rel < bound, f"{name} --sp 2: LoRA {rel:.3g} relative from 1 process (max |Δ| {worst:.3g})"


def test_cli_nano_edit_sp2_takes_the_steps_of_one_process(two_ranks, tmp_path):
    """nano-edit, whose source tokens join the sequence after the noisy ones (at --sp 2 one rank holds the noisy tokens,
    the other the source's), through the CLI: --sp 2 on 2 ranks (two_ranks) samples the first rollout's rewards to
    rounding, its first update on-policy, and its LoRA after one iteration's two optimizer steps is within the 1e-3
    bound of one process (measured 2.8e-6 relative)."""
    runs = {"one": tmp_path / "one", "sp2": two_ranks[1]["nano-edit"]}
    train_here(*NANO_EDIT, "--run-dir", str(runs["one"]))
    one, split = rows(runs["one"]), rows(runs["sp2"])
    assert len(split) == 1 and split[0]["train/logp_gap"] == 0
    assert split[0]["reward/mean"] == pytest.approx(one[0]["reward/mean"], rel=1e-6)
    rel, worst = relative_difference(lora(runs["one"]), lora(runs["sp2"]))
    assert rel < 1e-3, f"nano-edit --sp 2: LoRA {rel:.3g} relative from 1 process (max |Δ| {worst:.3g})"


# ---- refusals, at start-up ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,message", [
    (dict(model="tiny"), "--sp 2 must divide every count it splits, but --model tiny at --height 32 --width 32 has 3 "
                         "attention heads (QwenImageTransformer2DModel)"),
    (dict(model="tiny-flux"), "--model tiny-flux at --height 32 --width 32 has 77 T5 text tokens"),
    (dict(model="tiny", model_path="PIPELINE", height=40, width=40), "has 25 image tokens"),
    (dict(model="tiny-sd3"), "--sp: --model tiny-sd3 has no sequence parallelism: diffusers 0.42.1 has no "
                             "context-parallel plan for SD3Transformer2DModel"),
    (dict(model="tiny", rollout="vllm-omni", rollout_url="http://127.0.0.1:1"), "--sp > 1 needs --rollout local"),
    (dict(model="tiny-wan", sp=4), "--sp 4 must divide every count it splits, but --model tiny-wan at --height 32 "
                                   "--width 32 --num-frames 9 has 2 attention heads (WanTransformer3DModel)"),
    (dict(model="wan2.1-t2v-1.3b", sp=4), "--model wan2.1-t2v-1.3b at --height 240 --width 416 --num-frames 33 has "
                                          "3510 video tokens"),  # 9 latent frames of 15 × 26 patches
])
def test_impossible_sp_is_refused_naming_the_numbers(pipeline, flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")  # as under torchrun: the ranks' own check passes, the counts are refused
    flags = {k: str(pipeline) if v == "PIPELINE" else v for k, v in flags.items()}
    a = dataclasses.replace(flowgrpo.RECIPES[flags["model"]], **(dict(sp=2) | flags))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        startup.check_args(a)


@pytest.mark.parametrize("heads,sp,refused", [(12, 8, True), (12, 4, False), (40, 8, False)])
def test_wan_checkpoints_heads_are_read_from_their_config(tmp_path, heads, sp, refused, monkeypatch):
    """Wan2.1 1.3B has 12 attention heads, 14B 40: read from the transformer's config in a pipeline directory (written
    here with the head count alone; the start-up check builds a weightless copy from it), at 480 × 832 × 81 frames:
    32 760 video tokens, which 8 divides."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    config = {"_class_name": "WanTransformer3DModel", "num_attention_heads": heads}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    a = dataclasses.replace(flowgrpo.RECIPES["wan2.1-t2v-1.3b"], model_path=str(tmp_path), sp=sp, height=480,
                            width=832, num_frames=81)
    if refused:
        with pytest.raises(ValueError, match=rf"--num-frames 81 has {heads} attention heads \(WanTransformer3DModel\)"):
            startup.check_args(a)
    else:
        startup.check_args(a)


def test_sp_must_divide_the_world_and_is_refused_before_anything_is_built(pipeline, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--sp 2 must divide the number of ranks, 3 \(torchrun"):
        eng.data_parallel_size(3, 2)
    assert eng.data_parallel_size(4, 2) == 2
    with pytest.raises(ValueError, match="--sp 2 must divide the number of ranks, 1"):  # flowgrpo.main, this process
        train_here(*SMALL, "--model-path", str(pipeline), "--sp", "2", "--run-dir", str(tmp_path / "r"))
    assert "batch arithmetic" not in capsys.readouterr().out and not (tmp_path / "r").exists()
