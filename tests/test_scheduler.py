"""scheduler.py against closed forms: Gaussian densities, the Euler step, diffusers' schedule, and the
marginals of a 1-D Gaussian toy whose flow-matching velocity is known exactly."""
import json
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

import models
import models_flux
import models_qwen
import scheduler as sch
import tiny_setup


def _inputs(seed=0, shape=(5, 7, 3)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("sde_type,level", [("sde", 0.7), ("sde", 1.2), ("cps", 0.8)])
@pytest.mark.parametrize("per_sample", [False, True])
def test_log_prob_is_the_gaussian_density_averaged_per_sample(sde_type, level, per_sample):
    v, x = _inputs()
    sigma = torch.tensor([1.0, 0.9, 0.7, 0.5, 0.3]) if per_sample else 0.6
    sigma_next = torch.tensor([0.9, 0.8, 0.6, 0.3, 0.1]) if per_sample else 0.45
    x_next, logp, mean, std = sch.step(v, x, sigma, sigma_next, sigma_max=0.95, noise_level=level,
                                       sde_type=sde_type, generator=torch.Generator().manual_seed(1))
    ref = torch.distributions.Normal(mean, std.expand_as(mean)).log_prob(x_next).mean(dim=(1, 2))
    assert logp.shape == (5,)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    # given x_next, nothing is drawn and the same density comes back
    g = torch.Generator().manual_seed(2)
    state = g.get_state()
    _, logp2, _, _ = sch.step(v, x, sigma, sigma_next, sigma_max=0.95, noise_level=level, sde_type=sde_type,
                              generator=g, x_next=x_next)
    assert torch.equal(g.get_state(), state) and torch.equal(logp2, logp)


def test_sde_std_uses_sigma_max_at_sigma_one():
    v, x = _inputs()
    _, _, _, std = sch.step(v, x, 1.0, 0.9, sigma_max=0.95, noise_level=0.7)
    assert torch.allclose(std, torch.tensor(0.7 * math.sqrt(1 / (1 - 0.95)) * math.sqrt(0.1)))


def test_noise_level_zero_is_the_euler_step_of_diffusers():
    v, x = _inputs()
    x_next, logp, mean, _ = sch.step(v, x, 0.7, 0.4, sigma_max=0.9, noise_level=0)
    assert logp is None and torch.equal(x_next, mean)
    torch.testing.assert_close(x_next, x + v * (0.4 - 0.7))
    ref = FlowMatchEulerDiscreteScheduler()
    ref.set_timesteps(sigmas=[0.7, 0.4])
    assert torch.equal(ref.step(v, ref.timesteps[0], x, return_dict=False)[0], x_next)


def test_schedule_is_the_qwen_image_pipelines():
    s = FlowMatchEulerDiscreteScheduler(**models_qwen.QWEN_SCHEDULER)
    sig = sch.sigma_schedule(s, 10, 1024)
    mu = calculate_shift(1024, 256, 8192, 0.5, 0.9)
    timesteps, _ = retrieve_timesteps(s, 10, "cpu", sigmas=np.linspace(1.0, 0.1, 10), mu=mu)
    assert sig.shape == (11,) and sig[0] == 1 and sig[-1] == 0 and abs(sig[-2] - 0.02) < 1e-6  # shift_terminal
    torch.testing.assert_close(sig[:-1] * 1000, timesteps)
    assert torch.all(sig[1:] < sig[:-1])


def test_a_schedule_whose_shift_rounds_sigma_1_to_1_is_refused():
    """FLUX.1's dynamic shift at 4096² (65536 tokens, which start-up accepts): at 1000 steps σ_1 rounds to 1 in float32
    (the sde step's σ̃ = σ_1 then divides by 1 − 1 = 0), at 200 steps σ_1 = σ_2 (dt = 0, std 0): the rollout's log-probs
    were NaN. Refused in one line naming the flags; 2048² (16384 tokens) is untouched."""
    s = sch.linspace_scheduler_class(True)(**models_flux.FLUX_SCHEDULER)
    for n in (200, 1000):
        with pytest.raises(ValueError, match="not strictly decreasing.*--num-steps or --height/--width"):
            sch.sigma_schedule(s, n, 65536)
    assert torch.all(sch.sigma_schedule(s, 1000, 16384).diff() < 0)


@pytest.mark.parametrize("name", ["tiny", "tiny-flux", "tiny-qwen-image-2.1"])
def test_a_static_shift_config_gets_its_pipelines_table(name, tmp_path):
    """A --model-path whose scheduler shifts statically (use_dynamic_shifting false): the Qwen-Image, FLUX.1 and Qwen-Image
    2.1 pipelines shift their linspace(1, 1/N, N) by it, and the adapter's table is theirs (before: the scheduler's own
    spacing, FLUX.1's σ_1 0.858 against 0.9, and the ODE path another than the pipeline's)."""
    path = models.save_tiny_pipeline(str(tmp_path / name), model=name)
    config = tmp_path / name / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"use_dynamic_shifting": False, "shift": 3.0}))
    model = models.load_model(name, path, "cpu", seed=0)
    if name != "tiny-qwen-image-2.1":  # the ODE path too, bit for bit
        tiny_setup.check_ode_path_against_the_pipeline(model, ["a cat", "a dog"], 1.0, 32, 32)
        return
    model.pipe(prompt="a cat", height=32, width=32, num_inference_steps=4, output_type="latent", use_kv_cache=False)
    ours = sch.sigma_schedule(model.scheduler, 4, model.image_seq_len(32, 32))
    assert torch.equal(ours, model.pipe.scheduler.sigmas), (ours, model.pipe.scheduler.sigmas)


def test_an_sd3_dynamic_shift_config_gets_its_pipelines_table(tmp_path):
    """A --model-path SD3 whose scheduler shifts dynamically: SD3's pipeline passes no σ (the scheduler spaces its own N
    steps, then shifts them by mu), so the adapter's table must not be the linspace(1, 1/N, N) that sigma_schedule gives
    the Qwen-Image and FLUX.1 pipelines (before: σ 1, 0.826, 0.613, 0.345, 0 where the pipeline's are 1, 0.760, 0.443,
    0.0016, 0); the ODE path too, bit for bit."""
    path = models.save_tiny_pipeline(str(tmp_path / "tiny-sd3"), model="tiny-sd3")
    config = tmp_path / "tiny-sd3" / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"use_dynamic_shifting": True}))
    model = models.load_model("tiny-sd3", path, "cpu", seed=0)
    tiny_setup.check_ode_path_against_the_pipeline(model, ["a cat", "a dog"], 4.5, 32, 32)


# ---- the 1-D Gaussian toy: data N(m, s²), x_σ = (1−σ)x0 + σε --------------------------------------
M, S = 1.5, 0.5


def v_marginal(x, sigma):
    """E[ε − x0 | x_σ = x] for Gaussian data, in closed form."""
    a = 1 - sigma
    var = a * a * S * S + sigma * sigma
    return (sigma - a * S * S) / var * (x - a * M) - M


def simulate(step_fn, sde_type, level, n_steps=40, n=40_000):
    g = torch.Generator().manual_seed(0)
    sig = torch.linspace(1, 0, n_steps + 1)
    x = torch.randn(n, 1, generator=g)
    for i in range(n_steps):
        lvl = level if i < n_steps - 1 else 0  # the last step is always ODE
        x, *_ = step_fn(v_marginal(x, float(sig[i])), x, sig[i], sig[i + 1], sigma_max=float(sig[1]),
                        noise_level=lvl, sde_type=sde_type, generator=g)
    return x.mean().item(), x.std().item()


def wrong_sde_step(v, x, sigma, sigma_next, *, sigma_max, noise_level, sde_type, generator):
    """The sde step with the sign of the score correction flipped (a plausible transcription error)."""
    sigma, sigma_next = float(sigma), float(sigma_next)
    if noise_level == 0:
        return sch.step(v, x, sigma, sigma_next, sigma_max=sigma_max, noise_level=0)
    dt = sigma_next - sigma
    s_t = noise_level * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
    mean = x * (1 - s_t**2 * dt / (2 * sigma)) + v * (1 - s_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean + s_t * math.sqrt(-dt) * torch.randn(x.shape, generator=generator), None, mean, None


TOL = 0.02  # Monte-Carlo error of 40 000 samples is ~0.003; Euler error at 40 steps is ~0.003


@pytest.mark.parametrize("level", [0.7, 1.2])
def test_sde_preserves_the_marginals_of_a_gaussian(level):
    mean, std = simulate(sch.step, "sde", level)
    assert abs(mean - M) < TOL and abs(std - S) < TOL, (mean, std)
    wrong_mean, wrong_std = simulate(wrong_sde_step, "sde", level)
    assert abs(wrong_mean - M) > 5 * TOL or abs(wrong_std - S) > 5 * TOL, (wrong_mean, wrong_std)


def test_cps_preserves_the_mean_of_a_gaussian():
    """With the exact *marginal* velocity (a posterior mean), CPS keeps the data mean but not the std
    (it re-noises E[x0|x] as if it were x0: measured std ≈ 0.40 for s = 0.5, at 40 and at 1000 steps).
    Its defining property — the coefficients of x0 and of the noise stay those of x_σ' — is checked
    exactly below with the conditional velocity."""
    mean, _ = simulate(sch.step, "cps", 0.8)
    assert abs(mean - M) < TOL


@pytest.mark.parametrize("level", [0.5, 0.8])
def test_cps_preserves_the_coefficients_exactly_at_every_step(level):
    """Given x0, with the velocity that predicts it exactly (v = (x − x0)/σ), every CPS state must be
    distributed as (1 − σ)·x0 + σ·N(0, 1) at any step size (the sde sampler is exact only as dt → 0):
    the normalised noise (x − (1−σ)x0)/σ is standard normal."""
    g = torch.Generator().manual_seed(0)
    n, sig = 40_000, torch.linspace(1, 0, 21)
    x0 = M + S * torch.randn(n, 1, generator=g)
    x = torch.randn(n, 1, generator=g)
    for i in range(len(sig) - 2):
        s = float(sig[i])
        x, *_ = sch.step((x - x0) / s, x, sig[i], sig[i + 1], sigma_max=float(sig[1]), noise_level=level,
                         sde_type="cps", generator=g)
        eps = (x - (1 - sig[i + 1]) * x0) / sig[i + 1]
        assert abs(eps.mean().item()) < 0.03 and abs(eps.std().item() - 1) < 0.03, (i, eps.mean(), eps.std())


def test_trained_steps_full_and_window():
    assert sch.trained_steps(10, 0, (0, 5), seed=0) == list(range(9))
    starts = {sch.trained_steps(10, 2, (0, 5), seed=s)[0] for s in range(200)}
    assert starts == {0, 1, 2, 3}  # uniform over [lo, hi − W], never reaching step 5 or the last step
    assert sch.trained_steps(10, 2, (0, 5), seed=3) == sch.trained_steps(10, 2, (0, 5), seed=3)
    assert sch.trained_steps(4, 3, (0, 3), seed=0) == [0, 1, 2]


@pytest.mark.parametrize("n,w,rng,flag", [(10, 10, (0, 10), "--window"), (10, 2, (0, 10), "--window-range"),
                                          (10, 3, (2, 4), "--window-range"), (1, 0, (0, 1), "--num-steps"),
                                          (10, -1, (0, 5), "--window")])
def test_impossible_windows_are_rejected(n, w, rng, flag):
    with pytest.raises(ValueError, match=flag):
        sch.trained_steps(n, w, rng, seed=0)
