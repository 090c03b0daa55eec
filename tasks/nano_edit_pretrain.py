"""nano-edit's base model: nano's VAE (unchanged) and a transformer of nano's size trained here on every train glyph
under every instruction, (source latents, instruction) -> the exact target (`make it a d`: a train glyph of d in the
source's place), by rectified flow as nano's; what it reached written beside it.

    python -m tasks.nano_edit_pretrain [--out DIR] [--transformer-steps N] [--curve-every N]   # defaults: PRETRAIN

Apart from tasks/nano_edit.py (the task: edits, judge, reward, prompt set, evaluation), which it imports, because RL and the
comparison never train a base: the task's file reads without this one.
"""
import json
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import models_nano
from tasks import nano
from tasks import nano_edit as ne
from tasks import pretraining

PRETRAIN = dict(seed=0, transformer_steps=250, transformer_batch=128, transformer_lr=1e-3, ema=0.995,
                curve_every=0, curve_per_kind=10)
TEXTS = [*ne.GEOMETRIC, *(f"make it a {d}" for d in range(10))]  # every instruction pretraining conditions on


def training_pairs(pipe, gen: torch.Generator):
    """Every train glyph under every instruction: (source latents (N, S, C·4) normalised and packed as the adapter
    encodes them, target posterior (mean, std) (M, C, s, s), source index (M,), instruction index (M,)). `make it a
    d`'s target: a random train glyph of d whose box keeps the source's (`kept`)."""
    vae, (x_train, _, y_train, _) = pipe.vae, nano.split()
    src, x3 = ne.quantise(ne.render(x_train)), lambda x: x.expand(-1, 3, -1, -1) * 2 - 1
    mu, std = pretraining.latents(vae, x3(src))
    mean, scale = (torch.tensor(vae.config[k]).view(1, -1, 1, 1) for k in ("latents_mean", "latents_std"))
    z, mus, stds, sidx, tidx = (mu - mean) / scale, [], [], [], []
    source = pipe._pack_latents(z, len(z), z.shape[1], z.shape[2], z.shape[3])
    for k, text in enumerate(ne.GEOMETRIC):
        m, s = pretraining.latents(vae, x3(ne.quantise(ne.target(src, text))))
        mus.append(m), stds.append(s), sidx.append(torch.arange(len(src))), tidx.append(torch.full((len(src),), k))
    b = ne.box(src)[:, None] - ne.box(src)[None]  # (N, N, 3): glyph j in glyph i's place where `kept` would say so
    near = (b[..., :2].abs().amax(-1) <= ne.CENTRE) & (b[..., 2].abs() <= ne.HEIGHT)
    for i in range(len(src)):  # make it a d: d ≠ the source's digit, a glyph of d in the source's place
        for d in set(range(10)) - {int(y_train[i])}:
            ok = np.flatnonzero((y_train == d) & near[i].numpy())
            if len(ok):
                j = int(ok[torch.randint(len(ok), (1,), generator=gen)])
                mus.append(mu[j:j + 1]), stds.append(std[j:j + 1])
                sidx.append(torch.tensor([i])), tidx.append(torch.tensor([len(ne.GEOMETRIC) + d]))
    return source, torch.cat(mus), torch.cat(stds), torch.cat(sidx), torch.cat(tidx)


@pretraining.one_thread
def train_transformer(model, pairs_, texts: list[str], steps: int, batch: int, lr: float, ema: float,
                      gen: torch.Generator, measure=None, measure_every: int = 0) -> list[float]:
    """pretraining.train_transformer's rectified flow (the same σ draw, loss, EMA), each pair's target conditioned on
    its instruction and on its source's latents (`training_pairs`); the instruction kinds drawn equally often."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    source, mus, stds, sidx, tidx = pairs_
    pipe = model.pipe
    cond = pretraining.conditioning(models_nano.NanoQwenImage(pipe, "cpu", torch.float32), texts)
    net = model.transformer.requires_grad_(True).train()  # (the conditioning above: the instructions alone)
    mean, scale = (torch.tensor(pipe.vae.config[k]).view(1, -1, 1, 1) for k in ("latents_mean", "latents_std"))
    cfg = model.scheduler.config
    mu = calculate_shift(model.image_seq_len(ne.SIDE, ne.SIDE), cfg.base_image_seq_len, cfg.max_image_seq_len,
                         cfg.base_shift, cfg.max_shift)
    kinds = tidx.clamp(max=len(ne.GEOMETRIC))
    weights = 1 / torch.bincount(kinds).float()[kinds]  # each kind equally likely
    opt, losses = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.0), []
    averaged = {k: v.detach().clone() for k, v in net.state_dict().items()}
    for step in (bar := tqdm(range(steps), desc="pretrain edit transformer", unit="step")):
        idx = torch.multinomial(weights, batch, replacement=True, generator=gen)
        z = (mus[idx] + stds[idx] * torch.randn(mus[idx].shape, generator=gen) - mean) / scale
        x0 = pipe._pack_latents(z, batch, z.shape[1], z.shape[2], z.shape[3])
        u = torch.sigmoid(torch.randn(batch, generator=gen))
        sigma = np.exp(mu) / (np.exp(mu) + (1 / u - 1))
        eps = torch.randn(x0.shape, generator=gen)
        x = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * eps
        c = {k: t[tidx[idx]] for k, t in cond.items()} | {"source": source[sidx[idx]]}
        loss = (model.velocity(x, sigma, c, 1.0, ne.SIDE, ne.SIDE) - (eps - x0)).square().mean()
        opt.zero_grad(), loss.backward(), opt.step()
        with torch.no_grad():
            for k, t in net.state_dict().items():
                averaged[k].lerp_(t, 1 - min(ema, (1 + step) / (10 + step)))
        losses.append(loss.item())
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
        if measure_every and (step + 1) % measure_every == 0:
            live = {k: v.clone() for k, v in net.state_dict().items()}
            net.load_state_dict(averaged), measure(step + 1), net.load_state_dict(live)
    net.load_state_dict(averaged), net.requires_grad_(False).eval()
    return losses


def pretrain(out: str, per_kind: int = 40, *, seed: int, transformer_steps: int, transformer_batch: int,
             transformer_lr: float, ema: float, curve_every: int, curve_per_kind: int) -> dict:
    """Write the base to `out`: nano's VAE (copied) and a transformer of nano's size (4 + 4 tokens at 16×16) trained on
    the train glyphs' edits, float16; return what it reached (out/pretrain.json): the VAE's ceiling (`ceiling`), the
    loss, CPU seconds, the held-out judge per instruction (and with curve_every, its curve over the steps)."""
    used = {k: v for k, v in locals().items() if k in PRETRAIN or k.startswith("per_")}  # the values given
    pretraining.check_out(out)
    from diffusers import QwenImageTransformer2DModel
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    report = {"command": " ".join(["python -m tasks.nano_edit_pretrain", *sys.argv[1:]]), "config": used}
    vae = models_nano.build_nano_pipeline(models_nano.NANO_DIR).vae
    pipe = models_nano.build_nano_pipeline(None, vae=vae, transformer=QwenImageTransformer2DModel(**nano.TRANSFORMER))
    model, report["curve"] = models_nano.NanoEdit(pipe, "cpu", torch.float32), []
    pretraining.reached(report, "vae (nano's): the judge on its reconstructions of exact held-out targets",
                        **ceiling(vae))
    start, data = time.process_time(), training_pairs(pipe, gen)

    def measure(step: int) -> None:  # the budget curve: the EMA weights on curve_per_kind held-out prompts a kind
        report["curve"].append({"step": step, **ne.evaluate(model, curve_per_kind, seeds=1)})
        print("curve:", json.dumps({k: round(float(v), 3) for k, v in report["curve"][-1].items()}), flush=True)
    losses = train_transformer(model, data, TEXTS, transformer_steps, transformer_batch, transformer_lr, ema, gen,
                               measure, curve_every)
    pretraining.reached(report, "transformer", steps=transformer_steps, pairs=len(data[1]),
                        first_loss=np.mean(losses[:10]), last_loss=np.mean(losses[-20:]),
                        cpu_seconds=time.process_time() - start)
    pretraining.save_parts(out, vae=pipe.vae, transformer=pipe.transformer)
    pretraining.reached(report, "base model", **ne.evaluate(ne.load(out), per_kind))
    pretraining.save_report(out, report)
    return report


@torch.no_grad()
def ceiling(vae, per_kind: int = 100) -> dict:
    """The judge per kind on the VAE's reconstructions of exact held-out targets (`make it a d`: of the held-out
    source itself, asked for its own digit): what a perfect transformer on this VAE would score."""
    (_, x_test, _, y_test), result = nano.split(), {}
    src = ne.quantise(ne.render(x_test))
    for kind, rows in ne.by_kind(ne.pairs(True, per_kind)).items():
        i = torch.tensor([r[0] for r in rows])
        goal = src[i] if kind == "make it a {d}" else ne.target(src[i], kind)
        mu = pretraining.latents(vae, goal.expand(-1, 3, -1, -1) * 2 - 1)[0]
        seen = ne.quantise((pretraining.decode(vae, mu[:, :, None])[:, :, 0].mean(1, keepdim=True) + 1) / 2)
        texts = [f"make it a {y_test[n]}" if kind == "make it a {d}" else kind for n in i.tolist()]
        result[kind] = np.mean([ne.judge_one_kind(seen[n:n + 1], src[i[n:n + 1]], t)[0] for n, t in enumerate(texts)])
    return result


def main(argv=None) -> None:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m tasks.nano_edit_pretrain", description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=ne.BASE_DIR)
    ap.add_argument("--per-kind", type=int, default=20, help="held-out prompts of each kind the base is judged on")
    for key, value in PRETRAIN.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    a = ap.parse_args(argv)
    nano.check_numbers(ap, {"per_kind": (a.per_kind, 10**4)},
                       {k: getattr(a, k) for k in PRETRAIN})
    try:
        pretraining.check_out(a.out)
    except ValueError as e:
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    torch.set_num_threads(1)
    pretrain(a.out, a.per_kind, **{k: getattr(a, k) for k in PRETRAIN})


if __name__ == "__main__":
    main()
