"""DGPO (algorithms_preference.py, docs/algorithm.md §12) against its authors' public code, re-typed below as an oracle
on the same tensors: the loss and its gradient, in both reference modes, with and without the KL; its old policy's
(EMA reference's) decay; what the loop gives it that the other rows do not: micro-batches of whole groups, timesteps
shared by the iteration and one noise per group; its start-up checks; and the real script (flowgrpo.main in this
process, torchrun for 2 ranks): 1 process vs 2 ranks, exact resume, a tiny run that learns.

Public code (re-typed, not copied):
  DGPO  Luo-Yihong/DGPO @ 01ceb4b (git log's head): scripts/train_sd3_dgpo.py (compute_group_dgpo_loss_allreduce,
        precompute_group_info and generate_shared_noise_for_groups; the training loop's clip, reference and KL
        around it; the ema_ref step after each optimizer step), config/dgpo.py (general_ocr_sd3_4gpu, the recipe's)
"""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import algorithms_forward as fwd
import algorithms_preference as pref
import engine as eng
import flowgrpo
import startup
from test_engine import rows
from test_nft_awm import forward_tensors, one_two_resumed, train_here, worst
from test_variants import random_walk

TINY = flowgrpo.RECIPES["tiny"]


def dgpo_public(model_v, ref_old_v, old_v, target_v, advantages, prompt_ids, *, beta_dpo, group_size, clip_range,
                beta_kl, use_ema_ref):
    """train_sd3_dgpo.py's loss on one micro-batch of one GPU (accelerator.gather and dist.all_reduce are then
    identities), re-typed: the PPO-style clip of dsm_loss (clip_dsm), compute_group_dgpo_loss_allreduce with
    precompute_group_info's groups (torch.unique over the prompts' token rows), and the KL to the adapter-off model."""
    b = model_v.shape[0]
    ref_dgpo_v = old_v if use_ema_ref else ref_old_v
    dsm_loss = (target_v - model_v).square().reshape(b, -1).mean(dim=1)
    old_dsm_loss = (target_v - old_v).square().reshape(b, -1).mean(dim=1)
    ratio = torch.exp(-dsm_loss + old_dsm_loss)
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    dsm_loss = torch.where(should_clip, dsm_loss.detach(), dsm_loss)
    # compute_group_dgpo_loss_allreduce
    with torch.no_grad():
        ref_dsm_loss = (target_v - ref_dgpo_v).square().reshape(b, -1).mean(dim=1)
    delta_diff = dsm_loss.detach() - ref_dsm_loss.detach()
    per_sample_term = advantages * beta_dpo * delta_diff / group_size
    _, inverse_indices = torch.unique(prompt_ids.view(b, -1), dim=0, return_inverse=True)
    num_groups = inverse_indices.max().item() + 1
    local_group_sums = torch.zeros(num_groups, dtype=per_sample_term.dtype)
    local_group_sums.scatter_add_(0, inverse_indices, per_sample_term)
    group_weights = torch.sigmoid(local_group_sums.clone().detach())
    loss = (group_weights[inverse_indices].detach() * advantages * dsm_loss).mean()
    if beta_kl > 0:
        kl_loss = torch.mean((model_v - ref_old_v).square().reshape(b, -1).mean(dim=1))
        loss = loss + beta_kl * kl_loss
    return loss, should_clip


@pytest.mark.parametrize("reference,kl_beta,clip_range", [("base", 0.0, 1e-2), ("base", 0.02, 1e-2),
                                                          ("old", 0.02, 5e-2), ("old", 0.0, 1e-4)])
def test_dgpo_loss_and_gradient_equal_the_authors_code(reference, kl_beta, clip_range):
    """12 images in 3 groups of 4, shuffled (a group's images need not be adjacent in a micro-batch), advantages of
    both signs, β 100 (the public recipes'); the loss and its gradient bit for bit, and the clip acting on some images
    and not on others."""
    x0, noise, _, _, v_old, v_ref = forward_tensors(seed=3, b=12)
    v = (v_old + 0.3 * torch.randn(v_old.shape, generator=torch.Generator().manual_seed(5))).requires_grad_()
    group = torch.tensor([2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 1, 2])
    prompt_ids = torch.stack([torch.tensor([7, 3, 9, 1]) * (g + 1) for g in group.tolist()])  # token rows per prompt
    adv = torch.randn(12, generator=torch.Generator().manual_seed(4)).clamp(-5, 5)
    ours, stats = pref.dgpo_objective(v, v_old, v_ref if reference == "base" or kl_beta > 0 else None, x0, noise, adv,
                                      group, beta=100.0, group_size=4, clip_range=clip_range, kl_beta=kl_beta,
                                      reference=reference)
    (grad_ours,) = torch.autograd.grad(ours, v)
    v2 = v.detach().clone().requires_grad_()
    theirs, clipped = dgpo_public(v2, v_ref, v_old, noise - x0, adv, prompt_ids, beta_dpo=100.0, group_size=4,
                                  clip_range=clip_range, beta_kl=kl_beta, use_ema_ref=reference == "old")
    (grad_theirs,) = torch.autograd.grad(theirs, v2)
    print(f"\nDGPO {reference}, kl {kl_beta}, clip {clip_range}: loss {ours.item():.6g}, clipped "
          f"{int(clipped.sum())}/12, loss gap {worst(ours, theirs):.3g}, gradient gap {worst(grad_ours, grad_theirs):.3g}")
    assert 0 < clipped.sum() < 12, "the clip should act on some images and not on others"
    assert stats["clipfrac"] == clipped.float().mean()
    assert worst(ours, theirs) == 0 and worst(grad_ours, grad_theirs) == 0, (worst(ours, theirs),
                                                                           worst(grad_ours, grad_theirs))


def test_the_ema_reference_follows_the_public_step_to_rounding():
    """After optimizer step n (its global_step before the increment) the public ema_ref steps with decay
    min(0.3, 0.001·n); the loop moves the old policy after each iteration of one optimizer step (the public recipes'
    one step an epoch) with `--old-decay dgpo`: 100 iterations on a random walk, within 1e-6 (the same update written
    old + (1 − d)(θ − old) there, old·d + θ·(1 − d) here)."""
    shapes = [(4, 3), (5,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(4))) for s in shapes]
    engine = SimpleNamespace(old=eng.OldPolicy(zip("ab", params)))
    theirs = [p.detach().clone() for p in params]
    for global_step, values in enumerate(random_walk(100, shapes, seed=5)):
        with torch.no_grad():
            for p, value in zip(params, values):
                p.copy_(value)
        fwd.move_old(engine, SimpleNamespace(old_decay="dgpo", optimizer_steps=1, old_every=1), global_step)
        one_minus_decay = 1 - min(0.3, 0.001 * global_step)  # EMAModuleWrapper.step(…, decay=…)
        for ema_parameter, parameter in zip(theirs, params):
            ema_parameter.add_(one_minus_decay * (parameter.detach() - ema_parameter))
        gap = max(worst(o, t) for o, t in zip(engine.old.shadow, theirs))
        assert gap < 1e-6, f"step {global_step}: the old policy differs from the public ema_ref by {gap:.3g}"


# ---- what the loop gives DGPO: whole groups, shared timesteps, a noise per group ------------------------------------

def test_whole_groups_are_assigned_to_micro_batches_and_unit_1_is_the_old_shuffle():
    """16 prompts of 8 over 2 optimizer steps and 2 ranks: every consecutive 8 of a rank's images is one whole group
    (so a micro-batch of any multiple of 8 holds whole groups); each image exactly once; unit 1 is the shuffle the
    other rows have always had."""
    G, n = 8, 128
    assignment = eng.assign_images(n, 2, 2, seed=11, unit=G)  # (2, 64)
    assert sorted(assignment.flatten().tolist()) == list(range(n))
    for row in assignment:
        for chunk in row.view(-1, G):
            assert (chunk // G == chunk[0] // G).all() and sorted(chunk.tolist()) == list(range(chunk[0], chunk[0] + G))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(11))
    assert torch.equal(eng.assign_images(n, 2, 2, seed=11), perm.view(2, 2, -1).transpose(0, 1).reshape(2, -1))


def test_timesteps_are_shared_by_the_iteration_and_noise_by_the_group():
    """Two micro-batches of one iteration (groups 0, 3 and 1 of 4 images): the same T distinct steps for all, one noise
    per group and timestep, different across groups, iterations and timesteps; and the draws do not depend on which
    micro-batch (so which rank) holds a group."""
    a = SimpleNamespace(seed=0, group_size=4, train_timesteps=3, train_timestep_range=(0, 5))
    schedule = torch.linspace(1, 0, 11)
    def drawn(ids, iteration=2):
        mb = SimpleNamespace(ids=torch.tensor(ids), iteration=iteration, x0=torch.zeros(len(ids), 2, 3))
        return pref.group_draws(mb, a, schedule, fwd.nft_timesteps)
    (s1, n1), (s2, n2) = drawn([12, 13, 14, 15, 0, 1, 2, 3]), drawn([4, 5, 6, 7])
    assert n1.shape == (8, 3, 2, 3) and s1.shape == (8, 3)
    assert (s1 == s1[0]).all() and (s2 == s1[0]).all() and len(set(s1[0].tolist())) == 3
    assert all(torch.equal(n1[i], n1[0]) for i in range(4)) and all(torch.equal(n1[i], n1[4]) for i in range(4, 8))
    assert not torch.equal(n1[0], n1[4]) and not torch.equal(n1[0], n2[0]) and not torch.equal(n1[0, 0], n1[0, 1])
    _, n3 = drawn([4, 5, 6, 7], iteration=3)
    assert not torch.equal(n3, n2)
    assert torch.equal(drawn([0, 1, 2, 3])[1], n1[4:])  # group 0 alone draws what it drew beside group 3


# ---- start-up --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,needle", [
    (dict(algorithm="dgpo", micro_batch=6, group_size=4), "--micro-batch 6: DGPO weighs each image by its whole group"),
    (dict(algorithm="dgpo", train_timesteps=5), "--train-timesteps 5: DGPO draws that many distinct steps"),
    (dict(algorithm="dgpo", nft_beta=0.5), "--nft-beta: not used by --algorithm dgpo"),
    (dict(dgpo_beta=50.0), "--dgpo-beta: not used by --algorithm grpo"),
    (dict(algorithm="dgpo", dgpo_beta=-1.0), r"--dgpo-beta must be in \[0, 1e\+06\], got -1"),
    # its base reference is the adapter off: a full fine-tune passed start-up, sampled, then failed in the first update
    # with engine.reference()'s "--kl-beta > 0 needs a LoRA" at --kl-beta 0
    (dict(algorithm="dgpo", full_finetune=True), "--dgpo-reference base with --full-finetune")])
def test_dgpo_flags_are_checked(change, needle):
    with pytest.raises(ValueError, match=needle):
        startup.check_args(dataclasses.replace(TINY, **change))


def test_dgpo_full_finetune_with_the_old_reference_passes_start_up():
    startup.check_args(dataclasses.replace(TINY, algorithm="dgpo", full_finetune=True, dgpo_reference="old"))


def test_the_public_recipe_passes_its_checks():
    """And its EMA fires as the public run's: train_sd3_dgpo.py:1215 steps the EMA once per micro-batch of the loop
    over samples_batched, and general_ocr_sd3_4gpu (config/dgpo.py:96-126) gives each GPU
    num_batches_per_epoch = int(8 / (4 * 16 / 16)) = 2 of them an optimizer step (gradient_accumulation_steps): M = 2."""
    recipe = flowgrpo.RECIPES["sd3.5-medium-dgpo-ocr"]
    startup.check_args(recipe)
    gpus, per_batch, group, groups = 4, 16, 16, 8
    assert (recipe.ema_decay, recipe.ema_every, recipe.ema_repeat) == (0.9, 8, int(groups / (gpus * per_batch / group)))


# ---- the script --------------------------------------------------------------------------------------------------------

def test_dgpo_two_ranks_and_resume(tmp_path):
    """DGPO with its KL and the old policy as the reference (use_ema_ref) and as the sampler from the second iteration
    (--dgpo-switch 0): 1 process and 2 ranks take the same steps, resume is exact (test_nft_awm.one_two_resumed). 4
    groups of 2, so that each rank's micro-batch of each optimizer step is one whole group. Whole groups put different
    prompts on each rank, and a rank encodes its prompts in one batch padded to its longest: prompts of one token
    length keep the padding, hence the first rollout's bits, the same on 1 and 2 ranks (with the built-in set, the
    first iteration's mean reward differed in the 7th digit)."""
    prompts = tmp_path / "animals.txt"
    prompts.write_text("".join(f"a photo of a {x}\n" for x in ("cat", "dog", "bird", "fish", "horse", "cow")))
    state = one_two_resumed(tmp_path, "--prompts", str(prompts), "--prompts-per-iteration", "4", "--group-size", "2",
                            "--algorithm", "dgpo", "--kl-beta", "0.01", "--dgpo-reference", "old", "--dgpo-switch", "0",
                            "--old-decay", "dgpo", "--clip-range", "0.05")
    name = "transformer_blocks.0.attn.to_q.lora_B.default.weight"
    assert not torch.equal(state[f"model.{name}"], state[f"old.{name}"])


def test_tiny_run_learns(tmp_path):
    """The tiny recipe (brightness reward) with DGPO's public loss values (β 100, clip 1e-2, its ema_ref schedule): the
    reward rises by test_nft_awm's margin, three within-batch stds (the first three iterations against the last three).
    Measured (seed 0, 10 iterations): 0.4960 → 0.5078, 4.2 stds; the clip acted from the third iteration (3–21%)."""
    train_here("--algorithm", "dgpo", "--old-decay", "dgpo", "--clip-range", "0.01", "--iterations", "10",
               "--micro-batch", "16", "--eval-every", "0", "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"))
    r = rows(tmp_path / "run")
    first, last = (sum(x["reward/mean"] for x in part) / 3 for part in (r[:3], r[-3:]))
    print(f"\ndgpo: reward {first:.4f} -> {last:.4f}, {(last - first) / r[0]['reward/std']:.2f} stds")
    assert last - first > 3 * r[0]["reward/std"], (first, last, r[0]["reward/std"])
    clipfrac = [x["train/clipfrac"] for x in r]
    assert max(clipfrac) > 0 and max(clipfrac) < 1, clipfrac  # the clip acts (once the weights have moved from old)
