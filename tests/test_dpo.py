"""Online Diffusion-DPO (algorithms_preference.py, docs/algorithm.md §12) against flow_grpo's public code, re-typed below
as an oracle on the same tensors: which images pair (its stat tracker's "dpo" branch, ties included), how the pairs
are gathered and ordered, and the loss and its gradient; the draws the loop gives it (one σ of the scheduler's 1000
training σ and one noise per pair); its reference's copies; its start-up checks; and the real script (flowgrpo.main
in this process, torchrun for 2 ranks): 1 process vs 2 ranks, exact resume, a tiny run that learns.

Public code (re-typed, not copied):
  DPO  yifan123/flow_grpo @ ac4c86e (git log's head): scripts/train_sd3_dpo.py (the pairs' filtering, grouping by
       prompt_ids and swap; the training loop's loss block; copy_learner_to_ref), flow_grpo/stat_tracking.py
       (PerPromptStatTracker.update, type "dpo"), config/dpo.py (pickscore_sd3, geneval_sd3)
"""
import contextlib
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import algorithms_preference as pref
import engine as eng
import flowgrpo
import models
import startup
from test_engine import rows
from test_nft_awm import one_two_resumed, train_here, worst

TINY = flowgrpo.RECIPES["tiny"]


def tracker_dpo(prompts, rewards):
    """stat_tracking.py's PerPromptStatTracker.update(prompts, rewards, type='dpo') on one epoch (a fresh tracker)."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in np.unique(prompts):
        prompt_advantages = torch.tensor(rewards[prompts == prompt])
        max_idx, min_idx = torch.argmax(prompt_advantages), torch.argmin(prompt_advantages)
        if max_idx == min_idx:
            min_idx, max_idx = 0, 1
        result = torch.zeros_like(prompt_advantages).float()
        result[max_idx] = 1.0
        result[min_idx] = -1.0
        advantages[prompts == prompt] = result.numpy()
    return advantages


def dpo_public(prompts, prompt_ids, rewards, latents, embeds, draw, learner, ref, beta):
    """train_sd3_dpo.py on one GPU (accelerator.gather is then the identity): the tracker's pairs, the filter of
    A != 0, the grouping by prompt_ids (np.unique over the token rows, so the pairs come in the rows' sorted order),
    the swap that puts the winner first, the [winners; losers] layout, and its loss block at one timestep, the pair's
    σ and noise given by `draw(prompt_id_row)` (its compute_density_for_timestep_sampling and randn_like draws)."""
    advantages = tracker_dpo(prompts, rewards)
    non_zero_indices = np.where(advantages != 0)[0]
    filtered_advantages, filtered_latents = advantages[non_zero_indices], latents[non_zero_indices]
    filtered_prompt_ids, filtered_embeds = prompt_ids[non_zero_indices], embeds[non_zero_indices]
    concat_advantages, concat_latent, concat_embeds, pair_ids = [], [], [], []
    for prompt_id in np.unique(filtered_prompt_ids, axis=0):
        matches = np.where(np.all(filtered_prompt_ids == prompt_id, axis=1))[0]
        concat_advantages.append(filtered_advantages[matches])
        concat_latent.append(filtered_latents[matches])
        concat_embeds.append(filtered_embeds[matches])
        pair_ids.append(prompt_id)
    advantages = torch.as_tensor(np.stack(concat_advantages, axis=0))
    latents = torch.as_tensor(np.stack(concat_latent, axis=0))
    embeds = torch.as_tensor(np.stack(concat_embeds, axis=0))
    for i in range(advantages.shape[0]):
        if advantages[i, 0] == -1:
            temp = latents[i, 0].clone()
            latents[i, 0] = latents[i, 1].clone()
            latents[i, 1] = temp
    model_input = latents.permute(1, 0, *range(2, latents.dim())).reshape(-1, *latents.shape[2:])
    embeds = embeds.permute(1, 0, *range(2, embeds.dim())).reshape(-1, *embeds.shape[2:])
    bsz = model_input.shape[0] // 2
    sigma, noise = (torch.stack([draw(p)[k] for p in pair_ids]) for k in (0, 1))
    noise = torch.cat([noise[:bsz], noise[:bsz]], dim=0)
    sigmas = torch.cat([sigma, sigma], dim=0).view(-1, *[1] * (model_input.dim() - 1))
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    model_pred = learner(noisy_model_input, sigmas.flatten(), embeds)
    with torch.no_grad():
        model_pred_ref = ref(noisy_model_input, sigmas.flatten(), embeds).detach()
    target = noise - model_input
    theta_mse = ((model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    ref_mse = ((model_pred_ref.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    w_diff = theta_mse[:bsz] - ref_mse[:bsz]
    l_diff = theta_mse[bsz:] - ref_mse[bsz:]
    inside_term = -0.5 * beta * (w_diff - l_diff)
    return torch.mean(-F.logsigmoid(inside_term)), inside_term


class ToyModel:
    """A velocity that reads the noised latents, σ and the prompt's embeddings through a trained weight w (a leaf) or,
    under `old_weights` (the engine's swap of the reference into the weights), the reference's weight."""

    def __init__(self, w, w_ref):
        self.w, self.w_ref, self.swapped = w, w_ref, False

    def field(self, xt, t, embeds, w):
        return xt * w + t.view(-1, 1, 1, 1) * embeds.mean(1, keepdim=True)

    def velocity(self, xt, t, cond, cfg_scale, height, width):
        return self.field(xt, t, cond["embeds"], self.w_ref if self.swapped else self.w)

    @contextlib.contextmanager
    def old_weights(self):
        self.swapped = True
        try:
            yield
        finally:
            self.swapped = False


def test_pairs_follow_the_public_tracker_ties_included():
    """Five groups of 4: a strict order, a tied maximum and a tied minimum (the first of each), all equal (images 1 and
    0), two equal halves; and 30 random groups of rewards on a grid of 3 values (ties everywhere)."""
    a = SimpleNamespace(group_size=4)
    r = torch.tensor([0.1, 0.7, 0.3, 0.5, 0.2, 0.9, 0.9, 0.1, 0.4, 0.1, 0.8, 0.1, 0.5, 0.5, 0.5, 0.5,
                      0.3, 0.3, 0.1, 0.1])
    ours = pref.dpo_pairs(torch.zeros(20), r, a)
    assert ours.tolist() == [-1, 1, 0, 0, 0, 1, 0, -1, 0, -1, 1, 0, -1, 1, 0, 0, 1, 0, -1, 0], ours.tolist()
    r = torch.randint(0, 3, (120,), generator=torch.Generator().manual_seed(0)).float() / 2
    prompts = [f"prompt {i // 4}" for i in range(120)]
    assert pref.dpo_pairs(torch.zeros(120), r, a).tolist() == tracker_dpo(prompts, r.tolist()).tolist()


@pytest.mark.parametrize("beta", [100.0, 5000.0])
def test_dpo_loss_and_gradient_equal_the_public_code(beta):
    """One rank's micro-batch of 3 whole groups of 4 (one of equal rewards, one with a tied maximum), SD3-shaped
    latents, each group's own σ and noise: dpo_pairs then dpo_loss against the re-typed script, the loss and the
    gradient on the trained weight bit for bit. The public code orders the pairs by their prompts' token rows; the
    prompts here are named so that this is the groups' order, which the mean's rounding depends on. At β 5000 the
    pairs' terms lie on both sides of 0."""
    g = torch.Generator().manual_seed(3)
    G, n, shape = 4, 12, (16, 8, 8)
    x0 = torch.randn(n, *shape, generator=g)
    embeds = torch.randn(n, 5, *shape[1:], generator=g)
    for i in range(n):  # a group's images share their prompt's embeddings
        embeds[i] = embeds[i // G * G]
    r = torch.tensor([0.2, 0.6, 0.4, 0.1, 0.5, 0.5, 0.5, 0.5, 0.3, 0.9, 0.9, 0.2])
    draws = {grp: (torch.rand((), generator=g) * 0.98 + 0.01, torch.randn(*shape, generator=g)) for grp in range(3)}
    w = (1.0 + 0.1 * torch.randn(shape, generator=g)).requires_grad_()
    w_ref = 1.0 + 0.1 * torch.randn(shape, generator=g)
    model = ToyModel(w, w_ref)
    a = SimpleNamespace(group_size=G, dpo_beta=beta, height=8, width=8)
    weights = pref.dpo_pairs(torch.zeros(n), r, a)
    mb = SimpleNamespace(advantages=weights, x0=x0, cond={"embeds": embeds})
    t = torch.stack([draws[i // G][0] for i in range(n)])
    noise = torch.stack([draws[i // G][1] for i in range(n)])
    ours, stats = pref.dpo_loss(model, model, mb, t, noise, a)
    (grad_ours,) = torch.autograd.grad(ours, w)

    w2 = w.detach().clone().requires_grad_()
    prompt_ids = np.array([[7, 1 + i // G, 9] for i in range(n)])  # token rows, sorted as the groups
    theirs, inside = dpo_public([f"p{i // G}" for i in range(n)], prompt_ids, r.tolist(), x0.numpy(), embeds.numpy(),
                                lambda row: draws[int(row[1]) - 1],
                                lambda x, s, e: model.field(x, s, torch.as_tensor(e), w2),
                                lambda x, s, e: model.field(x, s, torch.as_tensor(e), w_ref), beta)
    (grad_theirs,) = torch.autograd.grad(theirs, w2)
    print(f"\nDPO β {beta}: loss {ours.item():.6g}, implicit accuracy {stats['implicit_acc']:.3g}, loss gap "
          f"{worst(ours, theirs):.3g}, gradient gap {worst(grad_ours, grad_theirs):.3g}")
    assert grad_ours.abs().max() > 0
    assert stats["implicit_acc"] == (inside > 0).float().mean()
    assert worst(ours, theirs) == 0 and worst(grad_ours, grad_theirs) == 0, (worst(ours, theirs),
                                                                           worst(grad_ours, grad_theirs))


# ---- the draws and the reference --------------------------------------------------------------------------------------

def test_a_pair_shares_its_draws_from_the_training_sigmas():
    """Two micro-batches of one iteration (groups 3, 0 and group 1, of 4): each group's T σ are among the scheduler's
    1000 training σ (SD3.5's, shifted by 3, for the tiny-sd3 model) and its noises are its own, the same for its images
    and for whichever micro-batch (so rank) holds it; other iterations draw others."""
    sigmas = pref.train_sigmas(models.load_model("tiny-sd3", None, torch.device("cpu"), seed=0), None)
    assert sigmas.shape == (1000,) and abs(float(sigmas[500]) - 3 * 0.5 / (1 + 2 * 0.5)) < 2e-3
    a = SimpleNamespace(seed=0, group_size=4, train_timesteps=5)

    def drawn(ids, iteration=2):
        mb = SimpleNamespace(ids=torch.tensor(ids), iteration=iteration, x0=torch.zeros(len(ids), 2, 3))
        return pref.dpo_draws(mb, a, sigmas, pref.logit_normal)
    (s1, n1), (s2, n2) = drawn([12, 13, 14, 15, 0, 1, 2, 3]), drawn([4, 5, 6, 7])
    assert s1.shape == (8, 5) and n1.shape == (8, 5, 2, 3)
    assert torch.isin(s1, sigmas).all() and len(set(s1[0].tolist())) == 5
    for s, x in ((s1, n1), (s2, n2)):
        assert all(torch.equal(s[i], s[i // 4 * 4]) and torch.equal(x[i], x[i // 4 * 4]) for i in range(len(s)))
    assert not torch.equal(n1[0], n1[4]) and not torch.equal(s1[0], s2[0])
    assert torch.equal(drawn([0, 1, 2, 3])[1], n1[4:]) and not torch.equal(drawn([4, 5, 6, 7], 3)[1], n2)


def test_the_reference_is_copied_every_old_every_iterations():
    """copy_learner_to_ref as the loop calls it: after iterations 2, 5, 8 for --old-every 3 the reference equals the
    trained weights bit for bit, and is left as it was after the others."""
    params = [torch.nn.Parameter(torch.zeros(3))]
    engine = SimpleNamespace(old=eng.OldPolicy([("w", params[0])]))
    for iteration in range(9):
        before = engine.old.shadow[0].clone()
        with torch.no_grad():
            params[0].add_(1.0)
        pref.copy_reference(engine, SimpleNamespace(old_every=3), iteration)
        expected = params[0].detach() if iteration % 3 == 2 else before
        assert torch.equal(engine.old.shadow[0], expected), (iteration, engine.old.shadow[0], expected)


# ---- start-up --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,needle", [
    (dict(algorithm="dpo", micro_batch=6, group_size=4), "--micro-batch 6, --group-size 4: DPO pairs the best"),
    (dict(algorithm="dpo", train_timesteps=0), "--train-timesteps and --old-every must be >= 1, got 0"),
    (dict(algorithm="dpo", window=2), "--window: not used by --algorithm dpo"),
    (dict(algorithm="dpo", old_decay="awm"), "--old-decay: not used by --algorithm dpo"),
    (dict(algorithm="dpo", noise_level=0.0), "--noise-level must be > 0"),
    (dict(algorithm="dpo", kl_beta=0.01), "--kl-beta 0.01: DPO's loss has no KL term"),
    (dict(dpo_beta=50.0), "--dpo-beta: not used by --algorithm grpo"),
    (dict(algorithm="dpo", dpo_beta=-1.0), r"--dpo-beta must be in \[0, 1e\+06\], got -1")])
def test_dpo_flags_are_checked(change, needle):
    with pytest.raises(ValueError, match=needle):
        startup.check_args(dataclasses.replace(TINY, **change))


def test_the_public_recipe_passes_its_checks():
    startup.check_args(flowgrpo.RECIPES["sd3.5-medium-dpo-pickscore"])


# ---- the script --------------------------------------------------------------------------------------------------------

def test_dpo_two_ranks_and_resume(tmp_path):
    """DPO with its reference copied after every iteration: 1 process and 2 ranks take the same steps, resume is exact
    (test_nft_awm.one_two_resumed), and the last copy left the reference equal to the trained weights. 4 groups of 2,
    so that each rank's micro-batch of each optimizer step is one pair; prompts of one token length, as
    test_dgpo.test_dgpo_two_ranks_and_resume says why."""
    prompts = tmp_path / "animals.txt"
    prompts.write_text("".join(f"a photo of a {x}\n" for x in ("cat", "dog", "bird", "fish", "horse", "cow")))
    state = one_two_resumed(tmp_path, "--prompts", str(prompts), "--prompts-per-iteration", "4", "--group-size", "2",
                            "--algorithm", "dpo", "--old-every", "1", "--train-timesteps", "2")
    name = "transformer_blocks.0.attn.to_q.lora_B.default.weight"
    assert state[f"model.{name}"].abs().max() > 0 and torch.equal(state[f"model.{name}"], state[f"old.{name}"])


def test_tiny_run_learns(tmp_path):
    """The tiny recipe (brightness reward) with DPO's public β 100 and its reference copied every iteration: the reward
    rises by test_nft_awm's margin, three within-batch stds (the first three iterations against the last three).
    Measured (seed 0, 10 iterations): 0.4952 → 0.5140, 6.1 stds."""
    train_here("--algorithm", "dpo", "--iterations", "10", "--micro-batch", "16", "--eval-every", "0",
               "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"))
    r = rows(tmp_path / "run")
    first, last = (sum(x["reward/mean"] for x in part) / 3 for part in (r[:3], r[-3:]))
    print(f"\ndpo: reward {first:.4f} -> {last:.4f}, {(last - first) / r[0]['reward/std']:.2f} stds")
    assert last - first > 3 * r[0]["reward/std"], (first, last, r[0]["reward/std"])
