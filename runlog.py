"""What a run leaves behind for people, written by rank 0 only: its run directory (locked by the run), args.json,
metrics.jsonl (one line per iteration, mirrored to wandb), reward_curve.png (redrawn every iteration), captioned
sample grids (for a video model the first frames' grid, and the grid animated as a GIF), and what it tells its user
(a warning when nothing can be learned, the closing summary)."""
import contextlib
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

import checkpoint


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


@dataclass
class Claim:
    """A run directory claimed by claim_run_dir on rank 0, and what RunLog writes into it once training starts."""
    run_dir: str
    run_id: str
    wandb_id: str | None  # the wandb run to continue (a resume in place), else a new one
    args: dict  # args.json: the flags, the batch arithmetic, the run id and its resumes
    metrics: str | None = None  # a resumed run's metrics.jsonl: its rows up to `until` are continued
    until: int = -1  # the iteration of the checkpoint resumed from


def claim_run_dir(run_dir: str | None, name: str, resumed: str | None, meta: dict, config: dict) -> Claim:
    """The run directory made this run's, on rank 0, before anything is built: locked for the life of the process
    (lock_run_dir), and checked: a new run refuses a directory that holds a run; a run resumed from checkpoint
    `resumed` continues in its run directory (or a new one). Nothing is written but the lock: RunLog writes when training starts."""
    try:
        if resumed is None:
            made, stamp = run_dir is None or not os.path.exists(run_dir), time.strftime("%Y%m%d-%H%M%S")
            run_dir = run_dir or _new_dir(os.path.join("runs", f"{name.replace('/', '_')}-{stamp}"))
            lock_run_dir(run_dir, made)
            if _holds_run(run_dir):
                raise ValueError(f"--run-dir {run_dir} already holds a run: continue it with --resume auto --run-dir "
                                 f"{run_dir}, or give a new directory")
            run_id = uuid.uuid4().hex
            return Claim(run_dir, run_id, None, config | {"run_id": run_id, "resumes": []})
        source = os.path.dirname(os.path.dirname(os.path.abspath(resumed)))  # <run-dir>/checkpoints/iter_N
        run_dir = run_dir or source
        lock_run_dir(run_dir, not os.path.exists(run_dir))
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir}: cannot write there ({e.strerror}); give a writable directory") from e
    previous = _read_json(os.path.join(run_dir, "args.json"))
    if _holds_run(run_dir) and previous.get("run_id") != meta["run_id"]:
        raise ValueError(f"--run-dir {run_dir} holds another run than the one {resumed} belongs to: resume in "
                         f"{source} or in a new directory")
    own = os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
    changed = {k: [v, config[k]] for k, v in meta["flags"].items() if json.loads(json.dumps(config[k])) != v}
    history = previous.get("resumes", []) + [{"checkpoint": os.path.abspath(resumed), "changed": changed}]
    return Claim(run_dir, meta["run_id"], meta["loop"]["wandb_id"] if own else None,
                 config | {"run_id": meta["run_id"], "resumes": history},
                 os.path.join(run_dir if own else source, "metrics.jsonl"), meta["loop"]["iteration"])


_LOCKS = []  # (descriptor, run directory, whether this process made it) of the run directories this process holds


def lock_run_dir(run_dir: str, made: bool) -> None:
    """Hold an OS lock (flock) on <run_dir>/.lock for as long as this process lives, its host and PID written in it:
    a second run into the directory is refused at once, naming them. The OS releases the lock of a process that
    ended, however it ended, so a crashed run's directory resumes. `made`: this start makes the directory."""
    path = os.path.join(run_dir, ".lock")
    while True:
        os.makedirs(run_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 300).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ValueError(f"--run-dir {run_dir} is in use by {holder}: wait for that run to end, or give another "
                             "directory") from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):  # not a lock file its last holder removed meanwhile
                break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"the run on host {socket.gethostname()}, PID {os.getpid()}, started {time.ctime()}\n".encode())
    _LOCKS.append((fd, run_dir, made))


def release_run_dirs() -> None:
    """Let go of this process's run directories; one in which nothing was written (a start that failed while
    loading weights) is removed with its lock if this process made it, so a failed start leaves nothing behind."""
    while _LOCKS:
        fd, run_dir, made = _LOCKS.pop()
        with contextlib.suppress(OSError):
            if os.listdir(run_dir) == [".lock"]:
                os.unlink(os.path.join(run_dir, ".lock"))
                if made:
                    os.rmdir(run_dir)
        os.close(fd)


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


def _new_dir(path: str) -> str:
    """path, or path-1, path-2, ..., made here (two runs started in the same second get different directories)."""
    for candidate in (path if i == 0 else f"{path}-{i}" for i in range(1000)):
        with contextlib.suppress(FileExistsError):
            os.makedirs(candidate)
            return candidate
    raise ValueError(f"{path}-*: a thousand run directories of this second already exist; give --run-dir")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _write(path: str, text: str) -> None:
    """Write text to path atomically (a temporary file of a unique name, then a rename)."""
    tmp = checkpoint.temporary(path)
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class RunLog:
    """The run directory's human-facing files, on rank 0 (elsewhere every method does nothing): args.json,
    metrics.jsonl (a resumed run's rows up to its checkpoint, then one line per iteration), reward_curve.png, sample
    grids, wandb, a warning when nothing can be learned, a closing summary. Written from when training starts."""
    FLAT = 3  # iterations in a row without any reward spread after which the run says it learns nothing

    def __init__(self, claim: Claim, *, enabled: bool, use_wandb: bool):
        self.run_dir, self.enabled, self.rows, self.wandb = claim.run_dir, enabled, [], None
        self.metrics, self.started = os.path.join(claim.run_dir, "metrics.jsonl"), time.time()
        self.args, self.flat = claim.args, 0  # flat: iterations in a row without any reward spread
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
        return self.wandb.id if self.wandb else None

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
