"""The GPU test tier: what the CPU tests claim, at the GPU recipe's dtypes and, given a GPU, on its kernels.

The CUDA cases are skipped without a GPU (the sequence-parallel comparison without 2). On a GPU machine the check's
tests step runs them, the most important first (`bash run.sh gpu-check OUT`, bench/check.py's FIRST_TESTS); they
first ran on an H200 on 2026-12-04 (BENCHMARKS.md). The bf16 cases run on CPU too, in CI."""
import dataclasses
import time

import pytest
import torch

import algorithms
import engine as eng
import flowgrpo
import memory
import models
import models_qwen
import models_wan
import rollout
import scheduler as sch
import test_edit
import test_sp
from bench.overhead import HEAD, row
from test_bench import run_bench, table_rows
from test_edit_qwen import small_sources  # noqa: F401 (an autouse fixture: Qwen-Image-Edit's sources at 32² here)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def bf16_tiny(device: str) -> models_qwen.QwenImage:
    """The tiny model as the real one is loaded on a GPU (from_pretrained with torch_dtype=bf16)."""
    pipe = models_qwen.build_tiny_qwen_pipeline(0)
    pipe.transformer.to(torch.bfloat16), pipe.vae.to(torch.bfloat16)
    return models_qwen.QwenImage(pipe, device, torch.bfloat16)


@pytest.fixture
def cuda_elsewhere(monkeypatch):
    """On a machine without a GPU, one that has one as far as `torch.cuda.is_available` says, where putting anything on
    it fails: a model built on the CPU must stay there (the first GPU run found the engine moving it to cuda:0 because
    a GPU existed). The process group is joined first, as on a GPU machine."""
    eng.init_distributed(torch.device("cpu"))
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "set_device", lambda *a: pytest.fail("the CPU model's engine chose a GPU"))


@pytest.fixture
def fsdp2_before_torch_2_13(monkeypatch):
    """FSDP2 as torch 2.11 and 2.12 have it (pytorch#159359): no cast of a module's inputs to the policy's dtype while
    activation checkpointing recomputes it in the backward. The first GPU run met it there: the recompute saw float32
    RoPE tables where the forward had bf16, and torch.utils.checkpoint refused (CheckpointError)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    cast = getattr(FSDPState, "_cast_forward_inputs", None)  # torch >= 2.13; before, the code in question is inline
    if cast:
        monkeypatch.setattr(FSDPState, "_cast_forward_inputs", lambda self, args, kwargs: (args, kwargs) if
                            self._training_state == TrainingState.PRE_BACKWARD else cast(self, args, kwargs))


@pytest.mark.parametrize("shard", [None, True], ids=["plain", "fsdp2"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_first_update_is_exactly_on_policy_at_the_recipe_dtypes(device, shard, request):
    """bf16 frozen weights, an fp32 LoRA computing in bf16, activation checkpointing, true CFG 4 and a window of 2, as
    the qwen-image recipe trains, on one rank (bf16 working copies, precision.py) and sharded as on several (FSDP2's
    mixed precision): the first update recomputes the rollout's log-probs bit for bit, because the rollout ran the
    same weights, shapes and kernels. On the CPU, where a GPU is said to exist (`cuda_elsewhere`)."""
    if device == "cpu":
        request.getfixturevalue("cuda_elsewhere")
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", height=32, width=32, lora_rank=8,
                            group_size=4, prompts_per_iteration=2, micro_batch=4, lr=1e-2)
    assert a.mixed_precision and a.activation_checkpointing and a.cfg_scale > 1 and a.window == 2
    model = bf16_tiny(device)
    engine = eng.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=model.lora_targets, lr=a.lr, weight_decay=0,
                        max_grad_norm=1.0, seed=0, mixed_precision=True, activation_checkpointing=True, shard=shard)
    assert engine.device.type == device and {p.device.type for p in model.transformer.parameters()} == {device}
    steps = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=1)
    model.transformer.eval()
    batch = rollout.sample(model, ['a sign that says "A"'] * 4 + ['a mug with "B"'] * 4, [{}] * 8, [0] * 4 + [1] * 4,
                           range(8), steps=steps, num_steps=a.num_steps, height=32, width=32, cfg_scale=a.cfg_scale,
                           negative_prompt=" ", noise_level=a.noise_level, sde_type="sde", seed=0, iteration=0, chunk=4)
    batch.advantages = torch.linspace(-1, 1, 8, device=model.device)
    model.transformer.train()
    stats = algorithms.train_on(model, engine, batch, a, flowgrpo.batch_arithmetic(a, 1), progress=False)
    assert stats["train/logp_gap"] == 0.0
    assert stats["train/grad_norm"] > 0
    _, after = algorithms.policy_loss(model, engine, batch.chunk(0, 4), 0, a)  # the check can fail: the policy moved
    assert float(after["gap"]) > 0


@CUDA
def test_bench_gpu_path_at_toy_size():
    """bench/gpu.py's GPU benchmark, at the tiny model's sizes, on the GPU: every row finite and positive."""
    rows = table_rows(run_bench("--model", "tiny", "--random-init", "--quick", "--device", "cuda",
                                module="bench.gpu"))
    assert rows["peak memory (fitted)"][0] > 0 and 0 < rows["MFU (fitted)"][0] < 1
    assert rows["micro-batch fitted (--micro-batch 0)"][0] == 4  # all of the 4 images: a tiny model fits


@CUDA
def test_micro_batch_0_foretells_the_graphs_reuse_rollout_forward_keeps():
    """--micro-batch 0 with --reuse-rollout-forward (memory.fit): the graphs the rollout keeps for the update, foretold
    from one image's velocity call × the trained steps × the images, against what a rollout that keeps them holds
    beyond one that does not, at the recipe's dtypes (bf16, LoRA in bf16 copies, checkpointing, CFG 4), 256². Measured on
    one image, a call's tables shared by its images (RoPE's) count once an image: 15% over at this toy width with the
    CPU's allocations counted by the profiler (chunks of 4; about 0.1% at Qwen-Image's width), never under."""
    a = dataclasses.replace(flowgrpo.RECIPES["qwen-image"], model="tiny", height=256, width=256, lora_rank=8,
                            reuse_rollout_forward=True)
    model = bf16_tiny("cuda")
    eng.Engine(model, lora_rank=8, lora_alpha=16, lora_targets=model.lora_targets, lr=a.lr, weight_decay=0,
               max_grad_norm=1.0, seed=0, mixed_precision=True, activation_checkpointing=True)
    steps, texts = algorithms.ALGORITHMS["grpo"].rollout_steps(a, 0), ['a sign that says "A"'] * 8
    model.transformer.eval()

    def held(keep: int) -> int:  # the bytes a rollout's batch holds
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        batch = rollout.sample(model, texts, [{}] * 8, [0] * 8, range(8), steps=steps, num_steps=a.num_steps,
                               height=256, width=256, cfg_scale=a.cfg_scale, negative_prompt=" ",
                               noise_level=a.noise_level, sde_type="sde", seed=0, iteration=0, chunk=4, keep=keep)
        assert len(batch.graphs) == (2 if keep else 0) * len(steps)  # two chunks of 4
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before
    held(0)  # first: what a first call allocates once (the bf16 copies, the BLAS workspace) is not a graph
    kept = held(8) - held(0)
    foretold = memory._kept(model, a, [(texts[0], {})]) * len(steps) * 8
    assert 0.9 < foretold / kept < 1.4, f"foretold {foretold / 2**20:.2f} MiB, kept {kept / 2**20:.2f} MiB"


@CUDA
def test_bench_sp_rows_at_toy_size():
    """bench/gpu.py's --sp 2 ÷ --sp 1 rows on the GPU at toy size: with fewer than 2 GPUs its --sp 2 side is one process
    standing for rank 0 of 2 (a fake process group: memory exact, time without communication)."""
    rows = table_rows(run_bench("--sp", "2", "--model", "tiny", "--device", "cuda", "--sp-side", "256", "--repeats",
                                "2", module="bench.gpu"))
    assert 0 < rows["SP: activation memory per rank, --sp 2 ÷ --sp 1"][0] < 0.75
    assert 0 < rows["SP: peak CUDA memory of the step per rank, --sp 2 ÷ --sp 1"][0] < 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)")
def test_sequence_parallel_equals_the_unsplit_model_on_two_gpus(tmp_path):
    """tests/test_sp.py's comparison with NCCL on 2 GPUs, float32: the same bounds as on CPU."""
    results = test_sp.run_split_vs_unsplit(tmp_path)
    for family in test_sp.FAMILIES:  # qwen, flux, wan
        test_sp.check_float32(results[family], family)
    assert results["qwen bf16"]["gap"] == 0


def as_loaded_in_bf16(module: torch.nn.Module) -> torch.nn.Module:
    """`module` in bf16 as from_pretrained(torch_dtype=bf16) leaves it: its `_keep_in_fp32_modules` stay float32."""
    keep = getattr(module, "_keep_in_fp32_modules", None) or ()
    module.to(torch.bfloat16)
    for name, sub in module.named_modules():
        if any(k in name.split(".") for k in keep):
            sub.float()
    return module


def bf16_tiny_wan(device: str, num_frames: int) -> models_wan.Wan:
    """tiny-wan with its transformer and VAE in bf16, as the real one loads on a GPU."""
    pipe = models_wan.build_tiny_wan_pipeline(0)
    as_loaded_in_bf16(pipe.transformer), as_loaded_in_bf16(pipe.vae)
    return models_wan.Wan(pipe, device, torch.bfloat16, num_frames)


def wan_first_update(model, a: flowgrpo.Args, prompts: list[str], trained: int, shard=None) -> tuple[dict, dict]:
    """The Wan recipe's rollout of len(prompts) videos (full mode: every step but the last is SDE), then one optimizer
    step on the first `trained` of its transitions: (train_on's stats, seconds and peak memory of each phase)."""
    engine = eng.Engine(model, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha, lora_targets=a.lora_targets, lr=a.lr,
                        weight_decay=a.weight_decay, max_grad_norm=1.0, seed=0, mixed_precision=True,
                        activation_checkpointing=True, ema_decay=a.ema_decay, ema_every=a.ema_every, shard=shard)
    assert engine.device.type == model.device.type  # ("cuda" is the engine's cuda:0)
    n, cuda = len(prompts), model.device.type == "cuda"
    steps, sync = sch.trained_steps(a.num_steps, a.window, a.window_range, seed=1), torch.cuda.synchronize if cuda \
        else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    model.transformer.eval()
    start = time.perf_counter()
    batch = rollout.sample(model, prompts, [{}] * n, [0] * n, range(n), steps=steps, num_steps=a.num_steps,
                           height=a.height, width=a.width, cfg_scale=a.cfg_scale, negative_prompt=a.negative_prompt,
                           noise_level=a.noise_level, sde_type=a.sde_type, seed=0, iteration=0, chunk=a.micro_batch)
    sync()
    rolled, peak = time.perf_counter(), torch.cuda.max_memory_allocated() if cuda else 0
    w = slice(0, trained + 1)  # the first `trained` transitions: each is a forward and backward of its own
    batch = rollout.Batch(batch.prompts, batch.metadata, batch.group, batch.latents[:, w], batch.log_probs[:, :trained],
                          batch.sigmas[w], batch.sigma_max, batch.cond, batch.images, means=batch.means[:, :trained])
    batch.advantages = torch.linspace(-1, 1, n, device=model.device)
    model.transformer.train()
    one = dataclasses.replace(a, group_size=n, prompts_per_iteration=1, micro_batch=n, optimizer_steps=1)
    stats = algorithms.train_on(model, engine, batch, one, flowgrpo.batch_arithmetic(one, 1), progress=False)
    sync()
    return stats, dict(rollout_s=rolled - start, train_s=time.perf_counter() - rolled, rollout_peak=peak,
                       train_peak=torch.cuda.max_memory_allocated() if cuda else 0)


@pytest.mark.parametrize("shard", [None, True], ids=["plain", "fsdp2"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_wan_first_update_is_exactly_on_policy_at_the_recipe_dtypes(device, shard, request, fsdp2_before_torch_2_13):
    """The wan2.1-t2v-1.3b recipe (CFG 4.5, negative prompt "", DanceGRPO's SDE at η 0.3, full mode, LoRA r 32 on
    q/k/v, bf16 mixed precision, activation checkpointing, EMA) on tiny-wan's bf16 weights, 5 frames at 32², 4 steps,
    on one rank and sharded, under the FSDP2 of torch < 2.13 (`fsdp2_before_torch_2_13`): the first update recomputes
    the rollout's log-probs bit for bit."""
    if device == "cpu":
        request.getfixturevalue("cuda_elsewhere")
    a = dataclasses.replace(flowgrpo.RECIPES["wan2.1-t2v-1.3b"], height=32, width=32, num_frames=5, num_steps=4,
                            micro_batch=4)
    assert a.mixed_precision and a.activation_checkpointing and a.cfg_scale > 1 and a.sde_type == "dance"
    model = bf16_tiny_wan(device, a.num_frames)
    stats, _ = wan_first_update(model, a, ["a cat", "a sign that says \"A\""] * 2, 3, shard=shard)
    assert stats["train/logp_gap"] == 0.0 and stats["train/grad_norm"] > 0


# (Qwen-Image 2.1's transformer reads its image mask's values, which the meta device cannot give: its σ is moved as here)
@pytest.mark.parametrize("model", [m for m in models.TINY if not m.startswith("tiny-qwen-image-2.1")])
def test_velocity_takes_sigma_from_the_cpu_to_the_models_device(model, tmp_path):
    """The rollout and the update hand `velocity` σ from the CPU (the schedule lives there). The first GPU run found
    a model left unsharded on cuda:0 (no FSDP2 to move its inputs) meeting that σ in its time embedding. Here the
    model stands on the meta device, its inputs there too but σ: every family must move σ itself. (Qwen-Image-Edit's
    source at 32² (small_sources): at the pipeline's 1024² its tiny VAE took 31 s to encode it.)"""
    spec = models.SPECS[model]
    m = models.load_model(model, None, "cpu", **({"guidance": 3.5} if spec.guidance_embedding else {}))
    cfg, source = 1.0 if spec.guidance_embedding else 4.0, test_edit.write_png(tmp_path / "source.png", 64, 64, 0)
    cond = m.conditioning(["a cat", "a dog"], " ", cfg, [{"image": source} if spec.edits else {}] * 2, 64, 64)
    x = m.noise([torch.Generator().manual_seed(i) for i in range(2)], 64, 64)
    m.transformer.to("meta")
    m.device = torch.device("meta")
    cond = {k: v if "mask" in k or "grid" in k else v.to("meta") for k, v in cond.items()}  # (these are read)
    v = m.velocity(x.to("meta"), torch.full((2,), 0.5), cond, cfg, 64, 64)
    assert v.device.type == "meta" and v.shape == x.shape


class MetaVelocity:
    """A model whose velocity is made on the meta device from the state there, σ taken from the CPU as given."""

    def velocity(self, x, sigma, cond, cfg_scale, height, width):
        assert sigma.device.type == "cpu" and x.device.type == "meta"
        return x * 0.5


@pytest.mark.parametrize("sde_type", sorted(sch.SDE_TYPES))
def test_every_policy_loss_takes_the_schedule_from_the_cpu_and_the_step_on_the_models_device(sde_type):
    """The update's loss (algorithms.policy_loss) in each combination of its tables (--kl-form, --guard,
    --trust-region, --cps-density, --zero-advantage's weights, --stale-correction's importance weights) with a KL
    term: the schedule's σ stay on the CPU (Batch.sigmas), the states, log-probs, means and advantages on the model's
    device, here meta, which refuses a (1,) CPU tensor beside its own as CUDA does. The SD3.5 recipe's --kl-form public
    divided by a (1,) CPU √−dt: every GPU run with a KL term under sde or dance would have stopped at its first step
    (found by reading, 2026-12-07; no GPU had run one)."""
    meta, b, W = torch.device("meta"), 2, 2
    mb = rollout.Batch(["a", "b"], [{}] * b, torch.tensor([0, 0]), torch.empty(b, W + 1, 4, 8, device=meta),
                       torch.empty(b, W, device=meta), torch.tensor([1.0, 0.9, 0.75]), 1.0, {}, None,
                       advantages=torch.empty(b, device=meta), means=torch.empty(b, W, 4, 8, device=meta),
                       ids=torch.tensor([0, 1]))
    engine = type("Engine", (), {"reference": lambda self: torch.enable_grad(),
                                 "old_weights": lambda self: torch.enable_grad()})()
    combos = [(kl, guard, trust, density) for kl in algorithms.KL_FORMS for guard in algorithms.LOG_RATIOS
              for trust in algorithms.TRUST_REGIONS for density in algorithms.CPS_DENSITIES]
    for (kl, guard, trust, density), weighted in zip(combos * 2, [False] * len(combos) + [True] * len(combos)):
        a = dataclasses.replace(flowgrpo.RECIPES["sd3.5-medium"], sde_type=sde_type, kl_form=kl, guard=guard,
                                trust_region=trust, cps_density=density, noise_level=0.5)
        mb.weights, mb.is_weights = (torch.empty(b, device=meta), torch.empty(b, W, device=meta)) if weighted else \
            (None, None)
        for j in range(W):  # (GARDO's gated mean is not here: it reads its mask's values, which meta has not)
            loss, stats = algorithms.policy_loss(MetaVelocity(), engine, mb, j, a)
            assert loss.device == meta and loss.shape == () and stats["kl_term"].device == meta, (kl, guard, trust)


@CUDA
@pytest.mark.parametrize("name", ["nft", "awm", "dgpo", "dpo"])
def test_every_forward_process_loss_runs_on_cuda(name):
    """Each forward-process loss on a micro-batch on the GPU, Batch.ids on the CPU as every Batch has them, and one
    conditioning entry on the CPU as Qwen-Image 2.1 keeps its source_grid. DGPO's scatter of its group sums with a CPU
    index would have stopped its recipe's first update, DPO's pairs indexing a CPU source_grid with CUDA indices a
    Qwen-Image 2.1 run's (found by reading, 2026-12-07). Not on the CPU: neither meta nor FakeTensorMode (on a CPU
    build of torch) moves a CPU tensor to CUDA, which each fix does."""
    loss = {"nft": algorithms.fwd.nft_loss, "awm": algorithms.fwd.awm_loss, "dgpo": algorithms.pref.dgpo_loss,
            "dpo": algorithms.pref.dpo_loss}[name]
    a = dataclasses.replace(flowgrpo.RECIPES["tiny"], algorithm=name, group_size=2, kl_beta=0.0)
    engine = type("Engine", (), {"reference": lambda self: torch.no_grad(),
                                 "old_weights": lambda self: torch.no_grad()})()
    w = torch.nn.Parameter(torch.ones((), device="cuda"))
    model = type("Model", (), {"velocity": lambda self, x, t, cond, cfg, h, w_: x * cond["embeds"].mean() * w})()
    cuda, b = torch.device("cuda"), 4
    mb = rollout.Batch(["a"] * b, [{}] * b, torch.tensor([0, 0, 1, 1]), None, None, torch.tensor([1.0, 0.0]), 1.0,
                       {"embeds": torch.rand(b, 3, 8, device=cuda), "source_grid": torch.tensor([[2, 2]] * b)}, None,
                       advantages=torch.tensor([1.0, -1.0, -1.0, 1.0], device=cuda),
                       x0=torch.rand(b, 4, 8, device=cuda), ids=torch.arange(b))
    value, _ = loss(model, engine, mb, torch.full((b,), 0.5, device=cuda), torch.randn(b, 4, 8, device=cuda), a)
    value.backward()
    assert value.device == w.grad.device and w.grad.isfinite(), (value, w.grad)


class RandomTextWan(models_wan.Wan):
    """Wan with UMT5-XXL's output shape, 512 × 4096 random states per prompt, in place of its 5.7 B-parameter
    encoder (as bench/gpu.py's RandomText for Qwen-Image): what the transformer sees, not what the text means."""

    def encode(self, prompts: list[str]) -> dict:
        g = torch.Generator().manual_seed(len(prompts))
        return {"embeds": torch.randn(len(prompts), 512, 4096, generator=g).to(self.device, self.dtype)}


@CUDA
def test_wan_recipe_memory_and_speed_at_the_real_width():
    """The wan2.1-t2v-1.3b recipe on one GPU, Wan2.1-T2V-1.3B's architecture with random weights (diffusers'
    WanTransformer3DModel at 12 heads × 128, 30 blocks, FFN 8960, text 4096: 1.42 B parameters; the default
    AutoencoderKLWan, Wan2.1's VAE; bf16): one micro-batch of 8 videos, 240 × 416 × 33 frames (3,510 tokens), 20 steps
    with CFG 4.5 in two passes, then one optimizer step on 2 of its 19 trained transitions. Prints the peak memory
    and the seconds the recipe's iteration (16 videos, 19 trained steps) takes per GPU, extrapolated, as bench/gpu.py's
    table rows (the GPU check's summary gathers them); asserts the first update is exactly on-policy at the real width
    in bf16."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    a = flowgrpo.RECIPES["wan2.1-t2v-1.3b"]
    tiny = models_wan.build_tiny_wan_pipeline(0)  # its tokenizer and encoder are placeholders RandomTextWan bypasses
    with torch.device("cuda"):
        transformer = as_loaded_in_bf16(WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128,
                                                              ffn_dim=8960, num_layers=30, text_dim=4096))
        vae = as_loaded_in_bf16(AutoencoderKLWan())
    pipe = WanPipeline(tokenizer=tiny.tokenizer, text_encoder=tiny.text_encoder, vae=vae, transformer=transformer,
                       scheduler=tiny.scheduler)
    model = RandomTextWan(pipe, "cuda", torch.bfloat16, a.num_frames)
    assert 1.4e9 < sum(p.numel() for p in transformer.parameters()) < 1.45e9
    assert model.image_seq_len(a.height, a.width) == 9 * 15 * 26
    stats, m = wan_first_update(model, a, [f'a sign that says "WAN {i}"' for i in range(a.micro_batch)], 2)
    videos, calls = a.prompts_per_iteration * a.group_size, a.num_steps - 1
    iteration_s = videos / a.micro_batch * (m["rollout_s"] + m["train_s"] * calls / 2)
    what = f"{torch.cuda.get_device_name()}, 1.42 B parameters, {a.height} × {a.width} × {a.num_frames} frames"
    t = list(HEAD)
    print()  # (after pytest -v's node id)
    for name, value, unit, note in (
            ("peak memory, rollout", m["rollout_peak"] / 2**30, "GiB", f"a micro-batch of {a.micro_batch} videos"),
            ("peak memory, training", m["train_peak"] / 2**30, "GiB", "one optimizer step on 2 trained transitions"),
            ("rollout of a micro-batch", m["rollout_s"], "s", f"{a.micro_batch} videos, {a.num_steps} steps, CFG "
             f"{a.cfg_scale:g} in two passes"),
            ("training per trained step", m["train_s"] / 2, "s", f"{a.micro_batch} videos, forward and backward"),
            ("the recipe's iteration per GPU, extrapolated", iteration_s, "s", f"{videos} videos, {calls} trained "
             "steps"),
            ("first update's logp_gap", stats["train/logp_gap"], "", "bf16, activation checkpointing, EMA")):
        row(t, f"wan2.1-t2v-1.3b recipe: {name}", [value], unit, "0" if "gap" in name else "", f"{what}; {note}")
    assert stats["train/logp_gap"] == 0.0 and stats["train/grad_norm"] > 0
