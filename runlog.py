"""What a run leaves behind for people, written by rank 0 only: args.json, metrics.jsonl (one line per
iteration, mirrored to wandb), reward_curve.png (redrawn every iteration) and captioned sample grids (for a video
model the first frames' grid, and the grid animated as a GIF)."""
import json
import os
import time
import uuid

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


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


def save_grid(path: str, images: torch.Tensor, captions: list[str]) -> None:
    """Images (N, 3, H, W) in [0, 1], up to 4 per row, each captioned `prompt | reward` (wrapped at words)."""
    grid_image(images, captions).save(path)


VIDEO_FPS = 16  # Wan2.1's frame rate


def save_video_grid(path: str, videos: torch.Tensor, captions: list[str]) -> None:
    """Videos (N, F, 3, H, W) in [0, 1] as one animated GIF of captioned grids, frame by frame (diffusers' GIF
    writer, Pillow's encoder: no video codec needed), looping at VIDEO_FPS."""
    from diffusers.utils import export_to_gif
    export_to_gif([grid_image(videos[:, f], captions) for f in range(videos.shape[1])], path, fps=VIDEO_FPS)


def grid_image(images: torch.Tensor, captions: list[str]) -> Image.Image:
    """save_grid's picture."""
    n, _, h, w = images.shape
    cell, cols, text_h = max(w, 192), min(n, 4), 44
    font = ImageFont.load_default(size=11)  # Pillow's bundled TrueType font: real word spacing, no system fonts needed
    grid = Image.new("RGB", (cols * cell, ((n + cols - 1) // cols) * (cell * h // w + text_h)), "white")
    for i, (img, cap) in enumerate(zip(images, captions)):
        pil = Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        x, y = (i % cols) * cell, (i // cols) * (cell * h // w + text_h)
        grid.paste(pil.resize((cell, cell * h // w), Image.NEAREST), (x, y))
        prompt, _, score = cap.rpartition(" | ")
        lines = wrap(prompt, font, cell - 4, max_lines=2) + [f"reward {score}"]
        ImageDraw.Draw(grid).multiline_text((x + 2, y + cell * h // w + 1), "\n".join(lines), fill="black", font=font,
                                            spacing=1)
    return grid


def plot_curve(path: str, rows: list[dict]) -> None:
    """Train reward (mean ± std per iteration) and eval reward against the iteration, from metrics rows."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    it = [r["iteration"] for r in rows]
    mean, std = np.array([r["reward/mean"] for r in rows]), np.array([r["reward/std"] for r in rows])
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(it, mean, label="train reward (mean over the iteration)")
    ax.fill_between(it, mean - std, mean + std, alpha=0.2, label="± std")
    ev = [(r["iteration"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    if ev:
        ax.plot(*zip(*ev), "o--", label="eval reward (ODE, fixed seeds)")
    ax.set(xlabel="iteration", ylabel="reward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def claim_run_dir(run_dir: str | None, name: str, checkpoint: str | None, meta: dict, config: dict):
    """(run directory, run id, wandb id to continue): the run directory made ready for this run, on rank 0, before
    anything is built. A new run refuses a directory that holds a run; a resumed run continues in its checkpoint's
    run directory (or a new one), its metrics cut back to the checkpoint's iteration. args.json is written here."""
    if checkpoint is None:
        run_dir = run_dir or _unused(os.path.join("runs", f"{name.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"))
        if _holds_run(run_dir):
            raise ValueError(f"--run-dir {run_dir} already holds a run: continue it with --resume auto --run-dir "
                             f"{run_dir}, or give a new directory")
        run_id, wandb_id, rows, history = uuid.uuid4().hex, None, [], []
    else:
        source = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))  # <run-dir>/checkpoints/iter_N
        run_dir, run_id, previous = run_dir or source, meta["run_id"], _read_json(os.path.join(run_dir or source,
                                                                                                "args.json"))
        if _holds_run(run_dir) and previous.get("run_id") != run_id:
            raise ValueError(f"--run-dir {run_dir} holds another run than the one {checkpoint} belongs to: resume in "
                             f"{source} or in a new directory")
        own = os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
        rows = metrics_until(os.path.join(run_dir if own else source, "metrics.jsonl"), meta["loop"]["iteration"])
        wandb_id = meta["loop"]["wandb_id"] if own else None  # a new directory is a new wandb run
        changed = {k: [v, config[k]] for k, v in meta["flags"].items() if json.loads(json.dumps(config[k])) != v}
        history = previous.get("resumes", []) + [{"checkpoint": os.path.abspath(checkpoint), "changed": changed}]
    try:
        os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
        _write(os.path.join(run_dir, "args.json"), json.dumps(config | {"run_id": run_id, "resumes": history}, indent=2))
        _write(os.path.join(run_dir, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir}: cannot write there ({e.strerror}); give a writable directory") from e
    return run_dir, run_id, wandb_id


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


def _holds_run(run_dir: str) -> bool:
    """A run that trained: a logged iteration or a checkpoint (one that failed while starting left no result)."""
    metrics = os.path.join(run_dir, "metrics.jsonl")
    checkpoints = os.path.join(run_dir, "checkpoints")
    logged = os.path.isfile(metrics) and os.path.getsize(metrics) > 0
    return logged or (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints)))


def _unused(path: str) -> str:
    """path, or path-1, path-2, ... (two runs started in the same second get different directories)."""
    candidates = (path if i == 0 else f"{path}-{i}" for i in range(1000))
    return next(p for p in candidates if not os.path.exists(p))


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write(path: str, text: str) -> None:
    """Write text to path atomically (a temporary file, then a rename)."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class RunLog:
    """The run directory's human-facing files, on rank 0 (elsewhere every method does nothing): metrics.jsonl (as
    claim_run_dir left it, then one line per iteration), reward_curve.png, sample grids, wandb, a closing summary."""

    def __init__(self, run_dir: str, config: dict, *, enabled: bool, use_wandb: bool, wandb_id: str | None = None):
        self.run_dir, self.enabled, self.rows, self.wandb = run_dir, enabled, [], None
        self.metrics, self.started = os.path.join(run_dir, "metrics.jsonl"), time.time()
        if not enabled:
            return
        self.rows = [json.loads(line) for line in open(self.metrics)]
        self.first_new = len(self.rows)
        if use_wandb:  # offline unless the user configured wandb: no prompt, no network needed
            import wandb
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project="flowgrpo", dir=run_dir, mode=mode, config=config, id=wandb_id,
                                    name=os.path.basename(os.path.abspath(run_dir)),
                                    resume="allow" if wandb_id else None)

    @property
    def wandb_id(self) -> str | None:
        return self.wandb.id if self.wandb else None

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        with open(self.metrics, "a") as f:
            f.write(json.dumps(row) + "\n")
        plot_curve(os.path.join(self.run_dir, "reward_curve.png"), self.rows)
        if self.wandb:
            self.wandb.log(row, step=row["iteration"])

    def samples(self, iteration: int, images: torch.Tensor, captions: list[str]) -> None:
        """Images (N, 3, H, W) as eval_<it>.png; videos (N, F, 3, H, W) as eval_<it>.gif, their first frames as the
        .png grid."""
        if not self.enabled:
            return
        path = os.path.join(self.run_dir, "samples", f"eval_{iteration:05d}")
        video = images.ndim == 5
        if video:
            save_video_grid(path + ".gif", images, captions)
        save_grid(path + ".png", images[:, 0] if video else images, captions)
        if self.wandb:
            import wandb
            videos = {"eval/videos": wandb.Video(path + ".gif", format="gif")} if video else {}
            self.wandb.log({"eval/samples": wandb.Image(path + ".png"), **videos}, step=iteration)

    def close(self, lora_dir: str | None = None) -> None:
        """Finish wandb and print what the run did and left: where, how long, how the reward moved, the LoRA."""
        if not self.enabled:
            return
        if self.wandb:
            self.wandb.finish()
        new, evals = self.rows[self.first_new:], [r for r in self.rows if "eval/reward_mean" in r]
        lines = [f"run directory: {self.run_dir}",
                 f"iterations {new[0]['iteration']}–{new[-1]['iteration']} in {time.time() - self.started:.0f} s" if new
                 else "no iteration ran", f"train reward: {self.rows[0]['reward/mean']:.4g} (iteration 0) → "
                 f"{self.rows[-1]['reward/mean']:.4g} (iteration {self.rows[-1]['iteration']})" if self.rows else ""]
        if evals:
            lines.append(f"eval reward: {evals[-1]['eval/reward_mean']:.4g} (iteration {evals[-1]['iteration']})")
        if lora_dir:
            lines.append(f"LoRA: {lora_dir} (diffusers: pipe.load_lora_weights(dir))")
        print("\n".join(["== done"] + [f"  {line}" for line in lines if line]), flush=True)
