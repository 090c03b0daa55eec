"""What a run leaves behind for people, written by rank 0 only: args.json, metrics.jsonl (one line per
iteration, mirrored to wandb), reward_curve.png (redrawn every iteration) and captioned sample grids."""
import json
import os
import textwrap

import matplotlib
import numpy as np
import torch
from PIL import Image, ImageDraw

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def save_grid(path: str, images: torch.Tensor, captions: list[str]) -> None:
    """Images (N, 3, H, W) in [0, 1], up to 4 per row, each captioned `prompt | reward` (wrapped)."""
    n, _, h, w = images.shape
    cell, cols, text_h = max(w, 192), min(n, 4), 40
    grid = Image.new("RGB", (cols * cell, ((n + cols - 1) // cols) * (cell * h // w + text_h)), "white")
    for i, (img, cap) in enumerate(zip(images, captions)):
        pil = Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8))
        x, y = (i % cols) * cell, (i // cols) * (cell * h // w + text_h)
        grid.paste(pil.resize((cell, cell * h // w), Image.NEAREST), (x, y))
        prompt, _, score = cap.rpartition(" | ")
        lines = textwrap.wrap(prompt, width=cell // 6)[:2] + [f"| {score}"]
        ImageDraw.Draw(grid).multiline_text((x + 2, y + cell * h // w + 1), "\n".join(lines), fill="black", spacing=1)
    grid.save(path)


def plot_curve(path: str, rows: list[dict]) -> None:
    """Train reward (mean ± std per iteration) and eval reward against the iteration, from metrics rows."""
    it = [r["iteration"] for r in rows]
    mean, std = np.array([r["reward/mean"] for r in rows]), np.array([r["reward/std"] for r in rows])
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(it, mean, label="train reward (mean over the iteration)")
    ax.fill_between(it, mean - std, mean + std, alpha=0.2, label="± std")
    ev = [(r["iteration"], r["eval/reward_mean"]) for r in rows if "eval/reward_mean" in r]
    if ev:
        ax.plot(*zip(*ev), "o--", label="eval reward (ODE, fixed seeds)")
    ax.set_xlabel("iteration"), ax.set_ylabel("reward"), ax.legend(fontsize=8), ax.grid(alpha=0.3)
    fig.tight_layout(), fig.savefig(path), plt.close(fig)


class RunLog:
    """The run directory's human-facing files. On ranks other than 0 every method does nothing."""

    def __init__(self, run_dir: str, config: dict, *, enabled: bool, start: int, use_wandb: bool,
                 wandb_id: str | None = None):
        self.run_dir, self.enabled, self.rows, self.wandb = run_dir, enabled, [], None
        self.metrics = os.path.join(run_dir, "metrics.jsonl")
        if not enabled:
            return
        os.makedirs(os.path.join(run_dir, "samples"), exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(config, f, indent=2)
        if start:  # resuming: drop the lines an interrupted run logged after its last checkpoint
            self.rows = [r for r in map(json.loads, open(self.metrics)) if r["iteration"] < start]
            with open(self.metrics + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in self.rows)
            os.replace(self.metrics + ".tmp", self.metrics)
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
        if not self.enabled:
            return
        path = os.path.join(self.run_dir, "samples", f"eval_{iteration:05d}.png")
        save_grid(path, images, captions)
        if self.wandb:
            import wandb
            self.wandb.log({"eval/samples": wandb.Image(path)}, step=iteration)

    def close(self) -> None:
        if self.wandb:
            self.wandb.finish()
