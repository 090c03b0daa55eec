"""Who samples, chosen by `--rollout`: `local`, the trainer's own transformer (rollout.sample, on the weights the
engine gathers once for all its steps), or `vllm-omni`, vLLM-Omni servers running `omni/pipeline.py` (the same
`scheduler.step` inside vLLM-Omni's pipeline) through `OmniBackend`, their HTTP client. Both return rollout.Batch.
This module never imports vllm_omni.
"""
import contextlib
import glob
import http.client
import json
import os
import random
import shutil
import time
import urllib.parse
import uuid
from functools import partial

import torch
from safetensors.torch import load, save_file
from tqdm import tqdm

import atomic_files
import reward_http
import scheduler as sch
from rollout import Batch, image_seed, sample

BACKENDS = ("local", "vllm-omni")
KEY, FORMAT = "flowgrpo", "flowgrpo-trajectory-v2"  # as in omni/pipeline.py (not imported: it needs vllm_omni)
MAX_N = 10  # vLLM-Omni's limit on images per request (ImageGenerationRequest.n <= 10)
# An answer's images are never read (the trajectory file holds them): asked as JPEG at quality 1, 10 images of 1328²
# are kB; as PNG at vLLM-Omni's default (no compression) they were 67 MiB, past this bound
MAX_REPLY = 64 * 2**20
# FLOWGRPO_ROLLOUT_<NAME>: (default, lowest, highest), checked at start-up; and FLOWGRPO_ROLLOUT_DIR (a path)
OMNI_KNOBS = dict(timeout=(600.0, 1e-3, 86400.0), retries=(3, 0, 20), backoff=(2.0, 0.0, 3600.0),
                  concurrency=(2, 1, 256))
# |x| beyond which a trajectory's tensor is no sample (docs/methods.md): a log-prob, a Gaussian log-density averaged
# over elements (a float32 std is >= e^-104; ~45 stds off is no sample of the step); a latent x_σ = (1 − σ)·x0 + σ·ε,
# x0 a VAE latent scaled to about unit variance, ε ~ N(0, 1) (at most 663 measured: tiny models, every allowed noise).
MAX_ABS = {"log_probs": 1e3, "latents": 1e4, "x0": 1e4}


def check_backend(kind: str, urls: str | None) -> list[str]:
    """The server URLs of `--rollout KIND --rollout-url URLS`, checked without touching the network."""
    if kind not in BACKENDS:
        raise ValueError(f"--rollout must be one of {BACKENDS}, got {kind!r}")
    given = [u.strip().rstrip("/") for u in (urls or "").split(",") if u.strip()]
    if kind == "local" and given:
        raise ValueError("--rollout-url is only used with --rollout vllm-omni")
    if kind == "vllm-omni" and not given:
        raise ValueError("--rollout vllm-omni needs --rollout-url http://HOST:PORT[,http://HOST:PORT...]: vLLM-Omni "
                         "servers running the model's pipeline of omni/pipeline.py with a trajectory_root "
                         "(docs/vllm-omni.md)")
    for i, url in enumerate(given):
        p = urllib.parse.urlsplit(url)
        try:
            ok = p.scheme in ("http", "https") and p.hostname and not (p.path or p.query) and p.port  # None: none given
        except ValueError:  # a port that is not a number
            ok = False
        if not ok or url in given[:i]:
            raise ValueError(f"--rollout-url: {url!r} is not of the form http://HOST:PORT, or is listed twice")
    if given:
        omni_options()  # the knobs too, before anything is built
    return given


def served_pipeline(url: str, client: reward_http.Client) -> list[str]:
    """GET /health and /v1/models of a vLLM-Omni server: the models it serves (their paths). A /health that is not
    vLLM-Omni's {"status": "healthy"} (a reward server's "ok", a web page) is a ValueError: the wrong server."""
    health = client.call(url, "/health")
    if not (isinstance(health, dict) and health.get("status") == "healthy"):
        raise ValueError(f"--rollout-url {url}: GET /health answered {json.dumps(health)[:200]}, not vLLM-Omni's "
                         '{"status": "healthy"}: is it a vLLM-Omni server running omni/pipeline.py (docs/vllm-omni.md)?')
    try:
        listed = client.call(url, "/v1/models")  # what it serves is said, not checked: a path here, a hub id there
    except ValueError:
        return []
    cards = listed.get("data") if isinstance(listed, dict) else None
    return [str(c.get("root") or c.get("id")) for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []


def probe(urls: list[str]) -> None:
    """Start-up, before the policy loads: each --rollout-url server asked once (reward_http.ask_once): the wrong server
    is refused in one line there, not after minutes of loading; one still loading its model (its port closed) warns."""
    client = reward_http.Client("vLLM-Omni server", "is it running, reachable from here (docs/vllm-omni.md)?")
    for url in urls:
        reward_http.ask_once(f"--rollout-url {url}", client, partial(served_pipeline, url))


def omni_options() -> dict:
    """OmniBackend's keyword arguments from FLOWGRPO_ROLLOUT_* (OMNI_KNOBS; _DIR: the run directory if unset)."""
    options = {k: reward_http.knob(f"FLOWGRPO_ROLLOUT_{k.upper()}", *v) for k, v in OMNI_KNOBS.items()}
    exchange = os.environ.get("FLOWGRPO_ROLLOUT_DIR") or None
    if exchange and os.path.exists(exchange) and not os.path.isdir(exchange):
        raise ValueError(f"FLOWGRPO_ROLLOUT_DIR={exchange!r} is not a directory: give one beneath the servers' root")
    return options | {"exchange_dir": exchange}


def make_backend(kind: str, urls: str | None, run_dir: str, engine):
    """The backend of `--rollout`. vllm-omni: a collective (every rank calls it), with `omni_options`; the run's
    adapters and trajectories go to a directory of its own beneath FLOWGRPO_ROLLOUT_DIR (default: the run
    directory), which must lie beneath the servers' trajectory_root."""
    if not check_backend(kind, urls):
        return LocalBackend(engine)
    return OmniBackend(urls, run_dir, engine, **omni_options())


class LocalBackend:  # the trainer's own model samples (`sample`), on weights the engine gathers once for all its steps
    sync = close = staticmethod(lambda *args: None)

    def __init__(self, engine):
        self.engine = engine

    def sample(self, *args, **kwargs) -> Batch:
        with self.engine.rollout_weights():
            return sample(*args, **kwargs)


def build_requests(model, prompts, image_ids, *, steps, num_steps, height, width, cfg_scale, negative_prompt,
                   noise_level, sde_type, seed, iteration, lora: dict, prefix: str,
                   metadata: list[dict] | None = None) -> list[tuple[list[int], dict]]:
    """(positions in the batch, body) of each POST /v1/images/generations: the images of one prompt, <= MAX_N
    a request. Each image has its own seed (`image_seed`), from which the server draws its initial and SDE
    noise: images do not depend on the grouping and equal the local backend's, draw for draw. The model's
    adapter gives what differs by family: how CFG or guidance is asked for, the text length, an edit model's source
    image (a request is one prompt and one source image, prompts.py's "image")."""
    where, metadata = {}, metadata or [{}] * len(prompts)
    for pos, (prompt, meta) in enumerate(zip(prompts, metadata)):
        where.setdefault((prompt, meta.get("image")), []).append(pos)
    jobs = []
    for (prompt, _), all_pos in where.items():
        extra = model.omni_knobs(metadata[all_pos[0]], height, width)
        for pos in (all_pos[c:c + MAX_N] for c in range(0, len(all_pos), MAX_N)):
            seeds = [image_seed(seed, iteration, image_ids[i]) for i in pos]
            knobs = dict(trajectory=f"{prefix}-{len(jobs):04d}.safetensors", seeds=seeds, steps=list(steps),
                         noise_level=noise_level, sde_type=sde_type, max_sequence_length=model.max_sequence_length,
                         num_frames=model.num_frames, **extra)
            jobs.append((pos, dict(prompt=prompt, n=len(pos), size=f"{width}x{height}", num_inference_steps=num_steps,
                                   seed=seeds[0], output_format="jpeg", output_compression=1,  # unread: smallest
                                   extra_params={KEY: knobs}, lora=lora,
                                   **model.omni_request(cfg_scale, negative_prompt))))
    return jobs


def read_trajectory(path: str, *, seeds: list[int], prompt: str, sigmas, sigma_max: float, latent_shape,
                    image_shape, pipeline: str, root: str | None = None) -> dict:
    """The tensors of a trajectory file written by omni/pipeline.py, checked against the request and against the
    trainer's σ, `sigmas` (W+1,) and `sigma_max`: the server's come from the same scheduler config and formula, so
    they must be equal to the bit (tests/omni: they are); else it serves another model, or is not to be trusted.
    No symbolic link is followed beneath `root` (the run's exchange directory)."""
    n, states, W = len(seeds), len(sigmas), max(len(sigmas) - 1, 0)  # ODE only (W = 0): no states, as `sample`
    want = {"latents": (n, states, *latent_shape), "log_probs": (n, W), "sigmas": (states,), "sigma_max": (),
            "images": (n, *image_shape), "x0": (n, *latent_shape)}
    # float32 data, plus the header: 6 tensor entries, the seeds and the prompt (JSON-escaped: <= 6 bytes a byte)
    limit = 4 * sum(torch.Size(s).numel() for s in want.values()) + 8 + 4096 + 6 * len(prompt.encode())
    data = _read_regular(path, limit, pipeline, root)
    try:  # the safetensors layout: an 8-byte little-endian header size, the JSON header, then the data
        t = load(data)
        meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__") or {}
    except Exception as e:  # safetensors' own error types (truncated header, bad JSON, short data)
        raise ValueError(f"malformed trajectory file {path}: {e}") from None
    bad = [f"{k} missing" if k not in t else f"{k} has shape {tuple(t[k].shape)} {t[k].dtype}, expected {s} float32"
           for k, s in want.items() if k not in t or tuple(t[k].shape) != s or t[k].dtype != torch.float32]
    bad += [f"{k} is not finite" for k in want if k in t and not bool(torch.isfinite(t[k]).all())]
    bad += [f"{k} reach {t[k].abs().max().item():.3g}, beyond ±{limit:g} (no sample)" for k, limit in MAX_ABS.items()
            if not bad and t[k].numel() and t[k].abs().max() > limit]
    if meta.get("format") != FORMAT:
        bad.append(f"format {meta.get('format')!r:.100}, expected {FORMAT!r}")
    elif meta.get("seeds") != json.dumps(list(seeds)) or meta.get("prompt") != prompt:  # as text, never parsed
        bad.append(f"written for prompt {meta.get('prompt')!r}, seeds {meta.get('seeds')!r:.100}")
    if not bad and not (torch.equal(t["sigmas"], sigmas) and t["sigma_max"].item() == sigma_max):
        gap = max([abs(t["sigma_max"].item() - sigma_max), *(t["sigmas"] - sigmas).abs().tolist()])
        bad.append(f"sampled with sigmas {t['sigmas'].tolist()}, sigma_max {t['sigma_max'].item()}; the trainer's are "
                   f"{sigmas.tolist()}, {sigma_max} (max |diff| {gap:.3g}: does the server serve --model-path?)")
    if bad:
        raise ValueError(f"malformed trajectory file {path}: " + "; ".join(bad))
    return t


def _read_regular(path: str, limit: int, pipeline: str, root: str | None) -> bytes:
    """The bytes of `path` (at most `limit`), a regular file reached without a link (atomic_files.open_regular)."""
    try:
        with atomic_files.open_regular(path, root) as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"no trajectory file {path}: the server must run {pipeline} (docs/vllm-omni.md) and "
                                "see this path (the same machine, or a shared filesystem)") from None
    except ValueError as e:  # a FIFO, a directory, a device, a link on the way
        raise ValueError(f"trajectory file {e}") from None
    if len(data) > limit:
        raise ValueError(f"trajectory file {path} has more than the {limit} bytes a trajectory of this request takes "
                         "(a server with another model, or a broken one?)")
    return data


def _exchange_dir(base: str) -> tuple[str | None, str | None]:
    """(a new directory beneath `base` for one run's files, None), or (None, why it could not be made). New: runs
    sharing FLOWGRPO_ROLLOUT_DIR, or a resumed run and its predecessor, never touch each other's files."""
    path = os.path.join(base, f"rollout-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(base, exist_ok=True)
        os.mkdir(path)  # fails if it exists: the directory is this run's alone
        for sub in ("policy", "trajectories"):
            os.mkdir(os.path.join(path, sub))
    except OSError as e:
        return None, f"FLOWGRPO_ROLLOUT_DIR (default: the run directory) {base}: cannot create {path}: {e}"
    return path, None


class OmniBackend:
    """Rollout on vLLM-Omni servers. The run's files go to a directory of its own, `<exchange>/rollout-<time>-<hex>`
    (`_exchange_dir`; `close` removes it). `sync` exports the policy as `policy/v<k>` there; `sample` sends the
    rank's requests (<= `concurrency` in flight per server, to whichever is free), reads and deletes the files
    `trajectories/*`, and returns the local backend's Batch: the servers' latents, log-probs, images (float32 from
    the file, not the response's 8-bit PNGs) and final latents, the trainer's own σ and prompt conditioning."""

    def __init__(self, urls: str, run_dir: str, engine, *, exchange_dir: str | None = None, timeout: float = 600.0,
                 retries: int = 3, backoff: float = 2.0, concurrency: int = 2):
        self.urls = check_backend("vllm-omni", urls)
        if engine.lora_config is None:
            raise ValueError("--rollout vllm-omni hands the policy to the servers as a LoRA: not with --full-finetune")
        if not (timeout > 0 and retries >= 0 and backoff >= 0 and concurrency >= 1):
            raise ValueError("FLOWGRPO_ROLLOUT_TIMEOUT > 0, _RETRIES >= 0, _BACKOFF >= 0, _CONCURRENCY >= 1 needed")
        self.timeout, self.retries, self.backoff, self.concurrency = timeout, retries, backoff, concurrency
        self.lora, self.rank, self.is_main = None, engine.rank, engine.is_main
        for url in self.urls:  # fail at start-up, not in the first iteration
            self._call(url, "/health", None, "GET /health")
        # vLLM-Omni caches adapters by int_id: an id reused for other weights serves the stale ones, also across
        # restarts of the trainer against a long-lived server. int_id = base + version, base drawn per start.
        # Rank 0 makes the run's directory (absolute: the server resolves the paths, not our cwd) and names it,
        # or its error, to all ranks: none waits for a directory that failed.
        made = _exchange_dir(os.path.abspath(exchange_dir or run_dir)) if engine.is_main else None
        id_base = random.SystemRandom().randrange(1, 2**31) << 24
        (self.root, error), self.id_base = engine.broadcast_object((made, id_base))
        if error:
            raise OSError(error)
        self.policy_dir, self.traj_dir = os.path.join(self.root, "policy"), os.path.join(self.root, "trajectories")

    def sync(self, engine, iteration: int) -> None:
        """Export the current policy as version `iteration`. Every rank calls it: lora_state_dict is a collective,
        so every rank has finished the previous rollout and no request uses an older version any more."""
        state = engine.lora_state_dict()
        path = os.path.join(self.policy_dir, f"v{iteration}")
        if engine.is_main:  # PEFT's layout, which vLLM-Omni loads; built under a temporary name, renamed when complete
            tmp = atomic_files.temporary(path)
            engine.lora_config.save_pretrained(tmp)  # adapter_config.json: r, lora_alpha, targets
            save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()},
                      os.path.join(tmp, "adapter_model.safetensors"))
            os.rename(tmp, path)
            for old in set(glob.glob(os.path.join(self.policy_dir, "v*"))) - {path}:
                shutil.rmtree(old, ignore_errors=True)
        engine.barrier()  # the adapter exists before any rank names it
        self.lora = {"name": f"flowgrpo-v{iteration}", "local_path": path, "int_id": self.id_base + iteration}

    def sample(self, model, prompts, metadata, group, image_ids, *, steps, num_steps, height, width, cfg_scale,
               negative_prompt, noise_level, sde_type, seed, iteration, chunk, progress=False, on_images=None,
               branch=False, ode_solver="euler", keep=0) -> Batch:
        """`sample`'s contract; `chunk` is unused (a request is one prompt's run of at most MAX_N images);
        `on_images` gets the whole batch at the end (the servers already overlap with each other)."""
        if branch or ode_solver != "euler" or keep:  # startup.check_args refuses them before anything is built
            raise ValueError("the vLLM-Omni pipeline samples independent images with Euler ODE steps: no --branch, "
                             "no --ode-solver but euler, no --reuse-rollout-forward")
        if self.lora is None:
            raise RuntimeError("OmniBackend.sample before sync(): the servers need the current policy")
        jobs = build_requests(model, list(prompts), [int(i) for i in image_ids], steps=steps, num_steps=num_steps,
                              height=height, width=width, cfg_scale=cfg_scale, negative_prompt=negative_prompt,
                              noise_level=noise_level, sde_type=sde_type, seed=seed, iteration=iteration,
                              lora=self.lora, prefix=os.path.join(self.traj_dir, f"it{iteration:06d}-r{self.rank}-"
                                                                                  f"{uuid.uuid4().hex[:8]}"),
                              metadata=list(metadata))
        sigmas = sch.sigma_schedule(model.scheduler, num_steps, model.image_seq_len(height, width))
        expect = dict(sigmas=sigmas[steps[0]:steps[-1] + 2] if steps else sigmas[:0], sigma_max=float(sigmas[1]),
                      image_shape=model.sample_shape(height, width), pipeline=model.omni_pipeline_class, root=self.root,
                      latent_shape=tuple(model.noise([torch.Generator()], height, width).shape[1:]))  # one noise's
        # Each server `concurrency` times: a request goes to whichever slot is free. Daemon threads (reward_http's
        # Workers): a request stuck on a hung server cannot hold up a stopped (Ctrl-C) run.
        workers = reward_http.Workers(self.urls * self.concurrency, "rollout")
        with tqdm(total=len(prompts), desc="rollout", unit="img", disable=not progress, leave=False) as bar:
            futures = [workers.submit(self._generate, body, expect) for _, body in jobs]
            for future, (_, body) in zip(futures, jobs):
                future.add_done_callback(lambda _, n=body["n"]: bar.update(n))
            try:
                parts = reward_http.gather(futures)  # the first error ends the rollout; requests not sent are cancelled
            finally:
                workers.close()
        order = torch.tensor([i for pos, _ in jobs for i in pos]).argsort()  # requests' rows -> batch order

        def cat(k):  # one field of every request's rows, in batch order
            return torch.cat([p[k] for p in parts])[order]
        batch = Batch(list(prompts), list(metadata), torch.as_tensor(group), cat("latents").to(model.device),
                      cat("log_probs").to(model.device), expect["sigmas"], expect["sigma_max"],
                      model.conditioning(list(prompts), negative_prompt, cfg_scale, list(metadata), height, width),
                      cat("images"),
                      x0=cat("x0").to(model.device), ids=torch.as_tensor(image_ids), iteration=iteration)
        if on_images:
            on_images(0, batch.images)
        return batch

    def close(self) -> None:
        """Remove the run's directory (rank 0): its adapters and what requests may have left (one that timed out on
        the client). Every rank has read its last rollout by now: the loop all-gathers the rewards after it."""
        if self.is_main:
            shutil.rmtree(self.root, ignore_errors=True)

    def _generate(self, url: str, body: dict, expect: dict) -> dict:
        knobs = body["extra_params"][KEY]
        what = f"the request for prompt {body['prompt']!r}, seeds {knobs['seeds']}"
        try:
            resp = json.loads(self._call(url, "/v1/images/generations", body, what))  # too deep: RecursionError
            if not (isinstance(resp, dict) and isinstance(resp.get("data"), list) and len(resp["data"]) == body["n"]):
                raise ValueError(f"the answer lacks its {body['n']} images: {str(resp)[:300]}")
            return read_trajectory(knobs["trajectory"], seeds=knobs["seeds"], prompt=body["prompt"], **expect)
        except (FileNotFoundError, ValueError, RecursionError) as e:  # an answer not JSON, or nested past the parser
            raise reward_http.PeerError(f"vLLM-Omni server {url}, {what}: {e}") from None
        finally:  # never over the request's own error: what cannot be unlinked (a directory) goes with close()
            with contextlib.suppress(OSError):
                os.unlink(knobs["trajectory"])

    def _call(self, url: str, path: str, body: dict | None, what: str) -> bytes:
        """GET (body None) or POST JSON -> the body, all of it within the timeout (reward_http.exchange: a direct
        connection, a whole-request deadline); connection errors, 502/503/504 and a GET's deadline retried with
        backoff (a POST's deadline is not: the server may still be generating it)."""
        data, last = None if body is None else json.dumps(body).encode(), None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, raw = reward_http.exchange(url, path, data, self.timeout, max_reply=MAX_REPLY)
            except reward_http.ReplyTooLarge as e:  # the same request would get the same answer: not retried
                raise reward_http.PeerError(f"vLLM-Omni server {url} answered {what} with {e}") from None
            except TimeoutError as e:  # a generation past the deadline still runs there: asked again, it would run twice
                if body is None or not str(e).startswith("no complete answer"):  # or connecting timed out: never sent
                    last = f"{type(e).__name__}: {e}"
                    continue
                raise reward_http.PeerError(f"vLLM-Omni server {url}, {what}: {e} (FLOWGRPO_ROLLOUT_TIMEOUT), and "
                                            "may still be generating it: raise FLOWGRPO_ROLLOUT_TIMEOUT, or serve "
                                            "with more servers (--rollout-url)") from None
            except (OSError, http.client.HTTPException) as e:  # refused/reset connections, the deadline, cut replies
                last = f"{type(e).__name__}: {e}"
                continue
            if status < 300:
                return raw
            detail = raw.decode(errors="replace")
            with contextlib.suppress(ValueError, TypeError, KeyError):  # vLLM-Omni's {"error": {"message": …}}
                detail = str(json.loads(detail)["error"]["message"])
            if status not in (502, 503, 504):
                raise reward_http.PeerError(f"vLLM-Omni server {url} answered HTTP {status} to {what}: {detail[:2000]}")
            last = f"HTTP {status}: {detail[:2000]}"
        raise reward_http.PeerError(f"vLLM-Omni server {url} stayed down for {what}: {self.retries + 1} attempts "
                                    f"failed (last: {last}); is it running, reachable from here (docs/vllm-omni.md)?")
