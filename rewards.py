"""Rewards by name, weighted multi-reward, asynchronous scoring, and a remote-reward HTTP server and client.

--reward SPEC:  SPEC = ITEM[,ITEM...]   ITEM = NAME[:ARG][=WEIGHT] | remote=URL[=WEIGHT]   (ARG: no "," or "=")
  e.g. jpeg_compressibility | ocr=1.0,pickscore=0.5 | pickscore:/ckpt/pickscore | remote=http://host:8000
A reward: fn(images (B,3,H,W) float in [0,1] on CPU, prompts, metadata) -> (scores (B,) float64, info), info =
each component's unweighted scores by name; total = sum(weight * score). Images are first quantised to uint8
exactly as a PNG stores them, so a remote reward scores bit-identical pixels. ARG of the CLIP rewards: a hub id
or a directory holding a CLIPModel and its CLIPProcessor. Server: python rewards.py serve --reward SPEC --port P
"""
from __future__ import annotations

import argparse, base64, contextlib, inspect, io, json, os, re, threading, time, traceback  # noqa: E401
import urllib.error, urllib.parse, urllib.request  # noqa: E401
from concurrent.futures import ThreadPoolExecutor, wait
from functools import lru_cache
from http.client import HTTPException
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image

# ---------------------------------------------------------------- rewards without models (as ddpo-pytorch)
def _encode(img, fmt, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format=fmt, **kw)
    return buf.getvalue()

def _jpeg_kb(images):
    return np.array([len(_encode(img, "JPEG", quality=95)) / 1000 for img in images])

def jpeg_compressibility():
    return lambda images, prompts, metadata: -_jpeg_kb(images)

def jpeg_incompressibility():
    return lambda images, prompts, metadata: _jpeg_kb(images)

def brightness():
    """Mean pixel value in [0, 1]. The `tiny` demo's reward: its random-weight VAE can move overall brightness
    (hue-specific rewards such as redness did not move on CPU), so the learning it shows is real."""
    return lambda images, prompts, metadata: images.reshape(len(images), -1).mean(axis=1) / 255

# ---------------------------------------------------------------- OCR (rapidocr; its wheel ships the PP-OCR models)
_QUOTED = re.compile(r'["“”]([^"“”]*)["“”]')

def ocr_target(prompt: str) -> str:
    """The text in the prompt's first pair of double quotes ("..." or “...”); not single quotes, which
    apostrophes ("a baker's sign") would fake."""
    m = _QUOTED.search(prompt)
    if m is None or not m.group(1).strip():
        raise ValueError(f"ocr reward: prompt {prompt!r} has no text between double quotes; the target text "
                         'must be quoted, e.g. \'a shop sign that says "OPEN"\'')
    return m.group(1)

def ocr_score(recognised: str, target: str) -> float:
    """ALGORITHM.md §8: whitespace removed, case-folded; 1 if the target occurs in the recognised text, else
    1 - min(edit distance, len)/len (capped: much unrelated text costs no more than none)."""
    from rapidfuzz.distance import Levenshtein
    rec, tgt = "".join(recognised.split()).casefold(), "".join(target.split()).casefold()
    return 1.0 if tgt in rec else 1.0 - min(Levenshtein.distance(rec, tgt), len(tgt)) / len(tgt)

@lru_cache(maxsize=1)
def _ocr_engine():
    from rapidocr import RapidOCR
    # As Flow-GRPO's PaddleOCR 2.x call: no angle classifier; every line kept whatever its confidence, so partly
    # legible text earns partial credit; detection shrinks only images over 960 px (rapidocr's default enlarges
    # every image to >= 736 px, ~10x slower on small ones).
    return RapidOCR(params={"Global.log_level": "critical", "Global.use_cls": False, "Global.text_score": 0.0,
                            "Det.limit_type": "max", "Det.limit_side_len": 960})

def ocr_read(images: np.ndarray) -> list[str]:
    """The text recognised in each uint8 (B, H, W, 3) RGB image, its lines joined in reading order."""
    return ["".join(_ocr_engine()(Image.fromarray(img)).txts or ()) for img in images]

def ocr():
    _ocr_engine()  # load now: a broken install fails at start-up, not mid-run
    def fn(images, prompts, metadata):
        targets = [ocr_target(p) for p in prompts]  # before the slow part
        return [ocr_score(text, t) for text, t in zip(ocr_read(images), targets)]
    return fn

# ---------------------------------------------------------------- CLIP family (transformers' CLIP classes)
CLIP_L = "openai/clip-vit-large-patch14"

def _load_clip(model_id, processor_id):
    from transformers import CLIPModel, CLIPProcessor
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = CLIPModel.from_pretrained(model_id).eval().requires_grad_(False).to(device)
    return model, CLIPProcessor.from_pretrained(processor_id)

def _image_embeds(model, processor, images):
    pixels = processor(images=[Image.fromarray(a) for a in images], return_tensors="pt")["pixel_values"]
    e = model.visual_projection(model.vision_model(pixel_values=pixels.to(model.device, model.dtype)).pooler_output)
    return e / e.norm(dim=-1, keepdim=True)

def _text_embeds(model, processor, prompts):
    # Fixed-length padding: a prompt's tokens, and so its score, do not depend on the rest of the batch.
    t = processor.tokenizer(prompts, padding="max_length", truncation=True, return_tensors="pt",
                            max_length=model.config.text_config.max_position_embeddings).to(model.device)
    e = model.text_projection(model.text_model(input_ids=t.input_ids, attention_mask=t.attention_mask).pooler_output)
    return e / e.norm(dim=-1, keepdim=True)

def _clip_similarity(model_id, processor_id, divisor):
    model, processor = _load_clip(model_id, processor_id)
    @torch.no_grad()
    def fn(images, prompts, metadata):
        cos = (_image_embeds(model, processor, images) * _text_embeds(model, processor, prompts)).sum(-1)
        return (model.logit_scale.exp() * cos / divisor).double().cpu().numpy()
    return fn

def pickscore(model=None):
    processor = os.environ.get("FLOWGRPO_PICKSCORE_PROCESSOR") or model or "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
    return _clip_similarity(model or "yuvalkirstain/PickScore_v1", processor, 26.0)  # /26 as in Flow-GRPO

def clipscore(model=None):
    return _clip_similarity(model or CLIP_L, model or CLIP_L, 30.0)

def _aesthetic_head_path():
    path = os.environ.get("FLOWGRPO_AESTHETIC_HEAD")
    if not path or not os.path.isfile(path):
        raise ValueError(f"--reward aesthetic needs FLOWGRPO_AESTHETIC_HEAD (now {path!r}) = the path of LAION's head "
                         "sac+logos+ava1-l14-linearMSE.pth (christophschuhmann/improved-aesthetic-predictor)")
    return path

def aesthetic(model=None):
    path = _aesthetic_head_path()
    model, processor = _load_clip(model or CLIP_L, model or CLIP_L)
    # LAION's improved-aesthetic-predictor head, on the normalised CLIP image embedding: linear layers only,
    # its dropouts off in eval. Layer indices match the released state dict's `layers.N` keys.
    Linear, Dropout = torch.nn.Linear, torch.nn.Dropout
    head = torch.nn.Sequential(Linear(model.config.projection_dim, 1024), Dropout(0.2), Linear(1024, 128),
                               Dropout(0.2), Linear(128, 64), Dropout(0.1), Linear(64, 16), Linear(16, 1))
    from safetensors.torch import load_file
    state = load_file(path) if path.endswith(".safetensors") else torch.load(path, "cpu", weights_only=True)
    head.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    head = head.eval().to(model.device, model.dtype)
    @torch.no_grad()
    def fn(images, prompts, metadata):
        return head(_image_embeds(model, processor, images)).squeeze(1).double().cpu().numpy()
    return fn

# ---------------------------------------------------------------- remote rewards: client
def _env(name, default):
    try:
        return type(default)(os.environ.get(name, default))
    except ValueError:
        raise ValueError(f"{name}={os.environ[name]!r} is not a valid {type(default).__name__}") from None

def _http_json(url, body, timeout, retries, backoff):
    """GET (body None) or POST JSON; retries connection errors, timeouts and 5xx with exponential backoff, not 4xx."""
    last = None
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff * 2 ** (attempt - 1))
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            if e.code < 500:
                raise ValueError(f"remote reward {url} refused the request: HTTP {e.code}: {detail}") from None
            last = f"HTTP {e.code}: {detail}"
        except (OSError, HTTPException) as e:  # URLError, refused/reset connections, timeouts, cut-off replies
            last = repr(e)
    raise RuntimeError(f"remote reward server {url} failed {retries + 1} times (last: {last}); "
                       "is `python rewards.py serve` running and reachable there?")

def remote(url):
    base, timeout, retries = url.rstrip("/"), _env("FLOWGRPO_REMOTE_TIMEOUT", 120.0), _env("FLOWGRPO_REMOTE_RETRIES", 4)
    backoff, batch = _env("FLOWGRPO_REMOTE_BACKOFF", 1.0), _env("FLOWGRPO_REMOTE_BATCH", 16)
    if batch < 1 or retries < 0 or timeout <= 0:
        raise ValueError("FLOWGRPO_REMOTE_BATCH and _TIMEOUT must be positive, FLOWGRPO_REMOTE_RETRIES >= 0")
    _http_json(base + "/health", None, timeout, retries, backoff)  # fail at start-up, not mid-run
    def fn(images, prompts, metadata):
        scores = []
        for i in range(0, len(images), batch):
            body = json.dumps({"images": [base64.b64encode(_encode(a, "PNG", compress_level=1)).decode()
                                          for a in images[i:i + batch]],
                               "prompts": prompts[i:i + batch], "metadata": metadata[i:i + batch]}).encode()
            scores += _http_json(base + "/score", body, timeout, retries, backoff)["scores"]
        return scores
    return fn

# ---------------------------------------------------------------- make_reward: parse, quantise, call, check
def _parse(spec):
    """[(label, name, arg, weight)], validated without importing or building anything."""
    valid, items, parsed = ", ".join(sorted(REWARDS)), [s.strip() for s in spec.split(",")], []
    if not all(items):
        raise ValueError(f"--reward: empty reward in {spec!r}; write e.g. ocr=1.0,pickscore=0.5; valid: {valid}")
    for item in items:
        head, weight = (item.replace("=", ":", 1) if item.startswith("remote=") else item), 1.0
        if "=" in head:
            head, w = head.rsplit("=", 1)
            if not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", w.strip()):
                raise ValueError(f"--reward: bad weight {w!r} in {item!r}; write NAME=WEIGHT, e.g. ocr=1.0")
            weight = float(w)
        name, _, arg = head.partition(":")
        if name not in REWARDS:
            raise ValueError(f"--reward: unknown reward {name!r}; valid: {valid}")
        if arg and not inspect.signature(REWARDS[name]).parameters:
            raise ValueError(f"--reward: reward {name!r} takes no argument, got {item!r}")
        label = name
        if name == "remote":
            u = urllib.parse.urlsplit(arg)
            if u.scheme not in ("http", "https") or not u.hostname or u.path.strip("/") or u.query or \
                    not re.fullmatch(r"[^:]+(:\d{1,5})?|\[.*\](:\d{1,5})?", u.netloc):
                raise ValueError(f"--reward: bad remote URL {arg!r}; write remote=http://HOST:PORT")
            label = f"remote@{u.netloc}"
        if name == "aesthetic":
            _aesthetic_head_path()
        if label in [p[0] for p in parsed]:
            raise ValueError(f"--reward: reward {label!r} appears twice in {spec!r}")
        parsed.append((label, name, arg or None, weight))
    return parsed

def check_reward_spec(spec: str) -> None:
    """Start-up validation of --reward (names, weights, URLs, the aesthetic head's path); builds nothing."""
    _parse(spec)

def check_prompts_for_reward(spec: str, prompts: list[str]) -> None:
    """Start-up validation that every prompt suits every reward of spec (ocr needs quoted text)."""
    for _, name, _, _ in _parse(spec):
        if name in PROMPT_CHECKS:
            for prompt in prompts:
                PROMPT_CHECKS[name](prompt)

def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] -> (B, H, W, 3) uint8, rounded as ddpo-pytorch and a saved PNG do."""
    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"rewards take a (B, 3, H, W) image tensor, got {getattr(images, 'shape', type(images))}")
    if not torch.isfinite(images).all():
        raise ValueError("rewards: the images contain NaN or infinity")
    return (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()

def _checked(label, fn, serial):
    # Model rewards run one call at a time: they are not assumed thread-safe (transformers' fast tokenizers are
    # not, transformers#47085), and torch/onnxruntime use every core per call anyway. Remote calls may overlap.
    lock = threading.Lock() if serial else contextlib.nullcontext()

    def reward(images, prompts, metadata=None):
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(f"reward {label!r}: {len(images)} images, {len(prompts)} prompts, "
                             f"{len(metadata)} metadata")
        with lock:
            scores = np.asarray(fn(to_uint8(images), prompts, metadata), dtype=np.float64)
        if scores.shape != (len(prompts),):
            raise ValueError(f"reward {label!r} returned shape {scores.shape} for {len(prompts)} images")
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            raise ValueError(f"reward {label!r} returned {scores[bad[0]]} for prompt {prompts[bad[0]]!r}; "
                             "rewards must be finite")
        return scores, {label: scores}
    return reward

def make_reward(spec: str):
    """The RewardFn for --reward SPEC (grammar in the module docstring); builds every model it needs."""
    parts = [(label, w, _checked(label, REWARDS[name](*([arg] if arg else [])), serial=name != "remote"))
             for label, name, arg, w in _parse(spec)]
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][2]
    def weighted(images, prompts, metadata=None):
        total, info = np.zeros(len(prompts)), {}
        for label, w, fn in parts:
            scores, _ = fn(images, prompts, metadata)
            total, info[label] = total + w * scores, scores
        return total, info
    return weighted


class AsyncRewards:
    """Scores rollout chunks in background threads while the next chunk is sampled (the reward models release the
    GIL). A model reward still takes one chunk at a time (see _checked); workers > 1 helps remote rewards.
    collect() returns every chunk submitted since the last collect, in submission order."""

    def __init__(self, fn, workers: int = 1):
        self.fn, self.pool, self.pending = fn, ThreadPoolExecutor(workers, thread_name_prefix="reward"), []

    def submit(self, images, prompts, metadata=None):
        # A private CPU copy: the caller may overwrite its image buffer while this chunk is scored.
        future = self.pool.submit(self.fn, images.detach().cpu().clone(), list(prompts),
                                  None if metadata is None else [dict(m) for m in metadata])
        self.pending.append(future)
        return future

    def collect(self):
        """-> (scores (N,), info {name: (N,)}, seconds the caller waited here)."""
        pending, self.pending = self.pending, []
        if not pending:
            raise RuntimeError("AsyncRewards.collect(): nothing was submitted since the last collect")
        start = time.perf_counter()
        wait(pending)
        waited = time.perf_counter() - start
        results = [f.result() for f in pending]  # re-raises the first failed chunk's error
        info = {k: np.concatenate([r[1][k] for r in results]) for k in results[0][1]}
        return np.concatenate([r[0] for r in results]), info, waited

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)

# ---------------------------------------------------------------- the registry: one line per reward
REWARDS = {f.__name__: f for f in (jpeg_compressibility, jpeg_incompressibility, brightness, ocr, pickscore, clipscore,
                                    aesthetic, remote)}
PROMPT_CHECKS = {"ocr": ocr_target}  # cheap per-prompt checks for check_prompts_for_reward

# ---------------------------------------------------------------- remote rewards: server
def make_server(spec: str, host: str = "127.0.0.1", port: int = 0, max_request_mb: float = 256.0):
    """A ThreadingHTTPServer serving make_reward(spec): GET /health, POST /score (JSON, base64 PNG images)."""
    fn, limit = make_reward(spec), int(max_request_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            ok = self.path == "/health"
            self._send(200 if ok else 404, {"status": "ok", "reward": spec} if ok else {"error": "GET /health"})

        def do_POST(self):
            size = int(self.headers.get("Content-Length") or -1)
            if self.path != "/score" or size < 0:
                return self._send(404 if self.path != "/score" else 411, {"error": "POST /score with a Content-Length"})
            if size > limit:
                for start in range(0, size, 2**20):  # drain, not store, the body so that the client reads this reply
                    self.rfile.read(min(2**20, size - start))
                return self._send(413, {"error": f"request of {size} bytes exceeds the server's limit of {limit}: "
                                        "lower FLOWGRPO_REMOTE_BATCH or raise --max-request-mb"})
            try:
                req = json.loads(self.rfile.read(size))
                images = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(s))).convert("RGB"))
                                   for s in req["images"]])
                images = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255  # to_uint8 restores it exactly
                prompts, metadata = req["prompts"], req.get("metadata")
            except Exception as e:  # a malformed request: the client's fault
                return self._send(400, {"error": f"bad request: {e!r}"})
            try:
                scores, info = fn(images, prompts, metadata)
            except ValueError as e:
                return self._send(422, {"error": str(e)})
            except Exception:
                traceback.print_exc()
                return self._send(500, {"error": traceback.format_exc(limit=3)})
            self._send(200, {"scores": scores.tolist(), "info": {k: v.tolist() for k, v in info.items()}})

    return ThreadingHTTPServer((host, port), Handler)

def main(argv=None):
    p = argparse.ArgumentParser(description="Serve a reward over HTTP for `--reward remote=http://HOST:PORT`.")
    s = p.add_subparsers(dest="cmd", required=True).add_parser("serve")
    s.add_argument("--reward", required=True, help="a reward spec, as for flowgrpo.py --reward")
    s.add_argument("--port", type=int, required=True, help="0 picks a free port (printed)")
    s.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes it to the network")
    s.add_argument("--max-request-mb", type=float, default=256.0)
    a = p.parse_args(argv)
    check_reward_spec(a.reward)
    server = make_server(a.reward, a.host, a.port, a.max_request_mb)
    print(f"serving reward {a.reward!r} on http://{a.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()

if __name__ == "__main__":
    main()
