"""What a run leaves behind for people, written by rank 0 only, in the run directory it claimed (rundir.py): args.json,
metrics.jsonl (one line per iteration, mirrored to wandb), reward_curve.png (redrawn as rows arrive while that takes
at most 2% of the run's time, and at its end), captioned sample grids (for a video model the first frames' grid, and
the grid animated as a GIF; for an edit model each result beside its source image), and what it tells its user (a
warning when nothing can be learned, the closing summary)."""
import json
import os
import sys
import time

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

import atomic_files
import checkpoint
import source_images
from rundir import Claim


def wrap(text: str, font, width: float, max_lines: int) -> list[str]:
    """Words of `text` in at most `max_lines` lines no wider than `width` pixels in `font`; what does not fit
    ends the last line as "…"."""
    lines = []
    for word in text.split():
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    if len(lines) > max_lines:
        last = " ".join(lines[max_lines - 1:])
        while last and font.getlength(last + "…") > width:
            last = last[:-1]
        lines = lines[:max_lines - 1] + [last.rstrip() + "…"]
    return lines


def save_grid(path: str, images: torch.Tensor, captions: list[str], sources: list[str | None] | None = None) -> None:
    """Images (N, 3, H, W) in [0, 1] captioned `prompt | reward` as one readable PNG (grid_image), each beside its
    source image where `sources` names one (an edit model's)."""
    grid_image(images, captions, sources).save(path)


VIDEO_FPS = 16  # Wan2.1's frame rate


def save_video_grid(path: str, videos: torch.Tensor, captions: list[str], sources: list[str | None] | None = None):
    """Videos (N, F, 3, H, W) in [0, 1] as one animated GIF of captioned grids, frame by frame (diffusers' GIF
    writer, Pillow's encoder: no video codec needed), looping at VIDEO_FPS."""
    from diffusers.utils import export_to_gif
    export_to_gif([grid_image(videos[:, f], captions, sources) for f in range(videos.shape[1])], path, fps=VIDEO_FPS)


def beside_sources(images: torch.Tensor, sources: list[str | None]) -> torch.Tensor:
    """Each image (N, 3, H, W) in [0, 1] with its source image (a path, resized to H × W) on its left: (N, 3, H, 2W);
    grey where an image has no source."""
    n, _, h, w = images.shape
    left = torch.full_like(images, 0.5)
    for i, path in enumerate(sources):
        if path:
            pixels = np.array(source_images.read(path).resize((w, h), Image.LANCZOS))  # (H, W, 3) uint8
            left[i] = torch.from_numpy(pixels).permute(2, 0, 1) / 255
    return torch.cat([left, images], dim=-1)


ROWS, PER_ROW, FLAT = 16, 8, 32  # the most prompt rows, images per prompt row, and images of a flat grid shown


def grid_image(images: torch.Tensor, captions: list[str], sources: list[str | None] | None = None) -> Image.Image:
    """save_grid's picture, readable at any count: where prompts repeat (an eval set of few prompts, many seeds), one
    row per prompt under its text (at most ROWS rows of PER_ROW images), each image with its reward; otherwise 4 images
    a row, each under its prompt and reward, at most FLAT images, evenly spaced over the set. A first line says how
    many are shown. With `sources` (an edit model's source image paths, None where a prompt has none), each tile is the
    pair source | result, a white gap between them. A caption
    `prompt | reward\njudge score`: the judge's line under the reward's."""
    pairs = bool(sources and any(sources))
    images = beside_sources(images, sources) if pairs else images
    n, _, h, w = images.shape
    prompts = [c.rpartition(" | ")[0] for c in captions]
    keys = list(zip(prompts, sources or [None] * n))  # an edit's instruction on another source is another row
    rows = {k: [i for i, q in enumerate(keys) if q == k] for k in dict.fromkeys(keys)}
    per_prompt = len(rows) < n
    if per_prompt:
        rows = {p: ids[:PER_ROW] for p, ids in list(rows.items())[:ROWS]}
    else:  # spread over the set, whose prompts may come in blocks (nano-compose's categories): each block shown
        rows = {None: sorted(set(np.linspace(0, n - 1, min(n, FLAT)).round().astype(int).tolist()))}
    cols = max(map(len, rows.values())) if per_prompt else min(n, 4)
    cell = min(max(w, 96 if per_prompt else 192), 256 * (1 + pairs))  # a pair: two images of up to 256
    judges = max(c.rpartition(" | ")[2].count("\n") for c in captions)  # lines under the reward (a run's judges)
    tile_h, title_h, text_h = cell * h // w, 16 if per_prompt else 0, (14 if per_prompt else 44) + 12 * judges
    font = ImageFont.load_default(size=11)  # Pillow's bundled TrueType font: real word spacing, no system fonts needed
    inner, outer = (4, 12) if pairs else (0, 0)  # white between a source and its result, wider between pairs
    step = cell + inner + outer
    lines = [ids[j:j + cols] for ids in rows.values() for j in range(0, len(ids), cols)]
    grid = Image.new("RGB", (cols * step, 18 + len(lines) * (title_h + tile_h + text_h)), "white")
    draw, y = ImageDraw.Draw(grid), 18
    shown = sum(map(len, rows.values()))
    draw.text((2, 2), f"{shown} of {n} images" + (f", {len(rows)} prompts: one row each" if per_prompt else
                                                  ", evenly spaced over the set" if shown < n else "") +
              (", each as source | result" if pairs else ""), fill="black", font=font)
    for line in lines:
        if per_prompt:
            title = wrap(prompts[line[0]], font, cols * step - 4, max_lines=1)[0]
            draw.text((2, y + 2), title, fill="black", font=font)
        for k, i in enumerate(line):
            pil = Image.fromarray((images[i].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
            halves = [pil.crop((0, 0, w // 2, h)), pil.crop((w // 2, 0, w, h))] if pairs else [pil]
            for j, part in enumerate(halves):  # a pair's source, then its result after the gap
                grid.paste(part.resize((cell // len(halves), tile_h), Image.NEAREST),
                           (k * step + j * (cell // 2 + inner), y + title_h))
            prompt, _, score = captions[i].rpartition(" | ")
            text = [f"reward {score}"] if per_prompt else wrap(prompt, font, cell - 4, max_lines=2) + [f"reward {score}"]
            draw.multiline_text((k * step + 2, y + title_h + tile_h + 1), "\n".join(text), fill="black", font=font,
                                spacing=1)
        y += title_h + tile_h + text_h
    return grid


def plot_curve(path: str, rows: list[dict], judges: list[str]) -> None:
    """Left, the trained reward against the iteration: the mean over each iteration's images, its ± std band clamped to
    the rewards seen (a probability's band stays in [0, 1]), and the evaluations; right, each judge (a reward logged at
    weight 0, never trained on), which is the result to read: reward up with the judge flat is reward hacking."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    it = [r["iteration"] for r in rows]
    mean, std = np.array([r["reward/mean"] for r in rows]), np.array([r["reward/std"] for r in rows])
    low = np.array([r.get("reward/min", -np.inf) for r in rows])  # runs logged before these rows: unclamped
    high = np.array([r.get("reward/max", np.inf) for r in rows])
    fig, axes = plt.subplots(1, 1 + bool(judges), figsize=(6 + 5 * bool(judges), 3.5), dpi=100, squeeze=False)
    ax = axes[0, 0]
    # a line through one point, and a band of no width, draw nothing (a run of one iteration, or the curve as first
    # drawn): a lone point is marked, its band half an iteration to either side
    dot = "o" if len(it) == 1 else None
    ax.plot(it, mean, marker=dot, label="train reward (mean over the iteration)")
    ax.fill_between(np.array(it) + ([-0.5, 0.5] if dot else 0), np.maximum(mean - std, low),
                    np.minimum(mean + std, high), alpha=0.2, label="± std (within the rewards seen)")
    ev = [(r["iteration"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    if ev:
        ax.plot(*zip(*ev), "o--", label="eval reward (ODE, fixed seeds)")
    ax.set(xlabel="iteration", ylabel="reward", title="the reward (trained)")
    for i, k in enumerate(judges):
        train = [(r["iteration"], r[f"reward/{k}/mean"]) for r in rows if f"reward/{k}/mean" in r]
        judged = [(r["iteration"], r[f"eval/{k}/mean"]) for r in rows if f"eval/{k}/mean" in r]
        if train:
            axes[0, 1].plot(*zip(*train), color=f"C{i}", alpha=0.5, marker="o" if len(train) == 1 else None,
                            label=f"{k}: rollout images")
        if judged:
            axes[0, 1].plot(*zip(*judged), "o--", color=f"C{i}", label=f"{k}: eval (ODE, fixed seeds)")
        axes[0, 1].set(xlabel="iteration", ylabel="judge", title="judged at weight 0 (never trained on)")
    for ax in axes[0]:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # iterations: no tick at 0.25
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def metrics_until(path: str, last: int) -> list[dict]:
    """The rows of metrics.jsonl up to iteration `last` (a resumed run's checkpoint): a line cut off by a crash and
    rows logged after the checkpoint are dropped, and said so."""
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if n < len(lines):
                raise ValueError(f"{path}:{n} is not JSON: the metrics file is damaged; repair or remove it") from None
            print(f"{path}: dropped its last line, cut off by the interrupted run")
    kept = [r for r in rows if r["iteration"] <= last]
    if len(kept) < len(rows):
        print(f"{path}: dropped {len(rows) - len(kept)} row(s) logged after the checkpoint (iteration {last})")
    return kept


def _write(path: str, text: str) -> None:
    """Write text to path atomically (a temporary file of a unique name, on disk before the rename: a power loss
    leaves the old file or the new, never an empty one)."""
    tmp = atomic_files.temporary(path)
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunLog:
    """The run directory's human-facing files, on rank 0 (elsewhere every method does nothing): args.json,
    metrics.jsonl (a resumed run's rows up to its checkpoint, then one line per iteration), reward_curve.png, sample
    grids, wandb, a warning when nothing can be learned, a closing summary. Written from when training starts."""
    FLAT = 3  # iterations in a row without any reward spread after which the run says it learns nothing
    # reward_curve.png is redrawn after a row only while drawing has taken at most this share of the run's time: a
    # redraw costs ~0.1 s, which at each of a laptop run's ~1 s iterations would slow the run by 10%; always at close
    DRAW_SHARE = 0.02

    def __init__(self, claim: Claim, *, enabled: bool, use_wandb: bool, judges: list[str] = ()):
        self.run_dir, self.enabled, self.rows, self.wandb = claim.run_dir, enabled, [], None
        self.resumed_id = claim.wandb_id  # the wandb run this one continues, named again in its checkpoints
        self.judges = list(judges)  # the reward terms the loop names judges: at weight 0, read by nothing in training
        self.metrics, self.started = os.path.join(claim.run_dir, "metrics.jsonl"), time.time()
        self.args, self.flat, self.drawing = claim.args, 0, 0.0  # flat: iterations in a row without any reward spread
        if not enabled:
            return
        self.rows = metrics_until(claim.metrics, claim.until) if claim.metrics else []
        self.first_new = len(self.rows)
        for moved in checkpoint.set_aside_after(os.path.join(self.run_dir, "checkpoints"), claim.until):
            print(f"{moved}: set aside (kept, never resumed by --resume auto): it continued the run after iteration "
                  f"{claim.until}, the branch this resume abandons")
        os.makedirs(os.path.join(self.run_dir, "samples"), exist_ok=True)
        _write(os.path.join(self.run_dir, "args.json"), json.dumps(claim.args, indent=2))
        _write(self.metrics, "".join(json.dumps(r) + "\n" for r in self.rows))
        if use_wandb:  # offline unless the user configured wandb: no prompt, no network needed
            import wandb
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project="flowgrpo", dir=self.run_dir, mode=mode, config=claim.args,
                                    id=claim.wandb_id, name=os.path.basename(os.path.abspath(self.run_dir)),
                                    resume="allow" if claim.wandb_id else None)

    @property
    def wandb_id(self) -> str | None:
        """The wandb run a checkpoint names for its resume: this one's, or (logging off) the one it continued."""
        return self.wandb.id if self.wandb else self.resumed_id

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.flat = self.flat + 1 if row.get("reward/zero_std_ratio") == 1 else 0
        if self.flat == self.FLAT:  # once a streak
            print(f"warning: for {self.FLAT} iterations every group of {self.args['group_size']} images got equal "
                  f"rewards (reward/zero_std_ratio 1): the advantages are 0, nothing is learned. --reward "
                  f"{self.args['reward']} does not tell these images apart (ocr, say, on a model that draws no legible "
                  "text yet): choose a reward they differ in", file=sys.stderr, flush=True)
        if self.drawing <= self.DRAW_SHARE * (time.time() - self.started):  # else at a later row, or at close
            self.draw()
        if self.wandb:
            self.wandb.log(row, step=row["iteration"])

    def draw(self) -> None:
        """Redraw reward_curve.png from every row so far, and count the seconds spent drawing."""
        t0 = time.time()
        plot_curve(os.path.join(self.run_dir, "reward_curve.png"), self.rows, self.judges)
        self.drawing += time.time() - t0

    def samples(self, iteration: int, images: torch.Tensor, captions: list[str], metadata: list[dict] | None = None,
                parts: dict | None = None):
        """Images (N, 3, H, W) as eval_<it>.png; videos (N, F, 3, H, W) as eval_<it>.gif, their first frames as the
        .png grid. Each image's prompt `metadata` names its source image where it has one (an edit model's): each
        result is then drawn beside it. `parts`, the reward's terms per image: a line under each caption per judge."""
        if not self.enabled:
            return
        judged = [j for j in self.judges if j in parts] if parts else []  # the score the laptop tasks' claims are about
        captions = [c + "".join(f"\n{j} {float(parts[j][i]):.2f}" for j in judged) for i, c in enumerate(captions)]
        path = os.path.join(self.run_dir, "samples", f"eval_{iteration:05d}")
        video, sources = images.ndim == 5, [m.get("image") for m in metadata or ()]
        if video:
            save_video_grid(path + ".gif", images, captions, sources)
        save_grid(path + ".png", images[:, 0] if video else images, captions, sources)
        if self.wandb:
            import wandb
            videos = {"eval/videos": wandb.Video(path + ".gif", format="gif")} if video else {}
            self.wandb.log({"eval/samples": wandb.Image(path + ".png"), **videos}, step=iteration)

    def close(self, lora_dir: str | None = None) -> None:
        """Finish wandb and print what the run did and left: where, how long, how the reward moved, the LoRA."""
        if not self.enabled:
            return
        if self.rows:
            self.draw()
        if self.wandb:
            self.wandb.finish()
        new = self.rows[self.first_new:]
        # each judge on the eval images; in a run without evaluation (--eval-every 0), on the rollout images
        on = ["eval" if any(f"eval/{j}/mean" in r for r in self.rows) else "rollout" for j in self.judges]
        shown = [("reward/mean", "train reward"), ("eval/reward_mean", "eval reward")] + [
            (f"eval/{j}/mean" if o == "eval" else f"reward/{j}/mean",
             f"{j}, the judge (weight 0, never trained on), on the {o} images") for j, o in zip(self.judges, on)]
        lines = [f"run directory: {self.run_dir}",
                 f"iterations {new[0]['iteration']}–{new[-1]['iteration']} in {time.time() - self.started:.0f} s" if new
                 else "no iteration ran", *(self.moved(key, name) for key, name in shown)]
        if lora_dir:
            lines.append(f"LoRA: {lora_dir} (diffusers: pipe.load_lora_weights(dir))")
        print("\n".join(["== done"] + [f"  {line}" for line in lines if line]), flush=True)

    def moved(self, key: str, name: str) -> str:
        """"<name>: first (iteration i) → last (iteration j)" over the rows that logged `key` ("" if none did)."""
        seen = [r for r in self.rows if key in r]
        return f"{name}: {seen[0][key]:.4g} (iteration {seen[0]['iteration']}) → {seen[-1][key]:.4g} (iteration " \
               f"{seen[-1]['iteration']})" if seen else ""
