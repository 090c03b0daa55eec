"""Rewards by name, weighted multi-reward, asynchronous scoring, and the rewards over HTTP (the client transport in
reward_http.py, the bounded server in reward_server.py): a remote reward (`remote=URL`), a vision-language judge
(`judge:TASK=URL`, its client and tasks in reward_judge.py), and `python rewards.py serve`.

--reward SPEC:  SPEC = ITEM[,ITEM...]
                ITEM = NAME[:ARG][=WEIGHT] | remote=URL[=WEIGHT] | judge:TASK=URL[+URL...][=WEIGHT]
  e.g. jpeg_compressibility | ocr=1.0,pickscore=0.5 | pickscore:/ckpt/pickscore | remote=http://host:8000
       | judge:ocr=http://h1:8000+http://h2:8000 | ocr=1,judge:match=http://h1:8000=0.5     (ARG: no "," or "=")
       | judge:edit=http://h1:8000=1,preserve=0.3      (an edit model: following against preservation of the source)
A reward: fn(images (B,3,H,W) float in [0,1] on CPU, or uint8 pixels, prompts, metadata) -> (scores (B,) float64,
info), info = each component's unweighted scores by name; total = sum(weight * score). Images are first quantised to
uint8 exactly as a PNG stores them, so a remote reward or a judge scores bit-identical pixels. Videos (B,F,3,H,W): an
image reward scores every FRAME_STRIDE-th frame (0, 4, 8, …) and averages (ocr: Flow-GRPO's video formula, its
`video`); a VIDEO_REWARDS one sees whole videos.
ARG of the CLIP rewards: a hub id or a directory holding a CLIPModel and its CLIPProcessor; of preserve, the side in
pixels at which result and source are compared; TASK of the judge: a key of JUDGE_TASKS.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import math
import os
import re
import threading
import time
import urllib.parse
from functools import lru_cache, partial

import numpy as np
import torch
from PIL import Image

import reward_http
import reward_judge
import reward_server
from tasks import nano, nano_compose, nano_edit

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

# ---------------------------------------------------------------- an edit against its source image
PRESERVE_SIDE = 64  # preserve compares result and source at PRESERVE_SIDE × PRESERVE_SIDE pixels, unless its ARG says

def _preserve_side(side=None) -> int:
    text = str(PRESERVE_SIDE if side is None else side)
    if not text.isdecimal() or not 4 <= int(text) <= 1024:  # isdigit() passes "²", which int() refuses
        raise ValueError(f"--reward preserve:{side}: ARG is the side in pixels at which result and source are "
                         "compared, a whole number in [4, 1024], e.g. preserve:64=0.3")
    return int(text)

def preserve(side=None):
    """1 − the mean absolute difference, in [0, 1], between the result and its prompt's source image
    (metadata["image"]), both averaged down to side × side pixels (PIL's box filter: each small pixel the mean of the
    area it covers); 1 is the source unchanged. Coarse on purpose: it scores what an edit changed of the layout and
    colours, not the texture a VAE round trip redraws (docs/rewards.md). Videos: each scored frame against the source."""
    n = _preserve_side(side)

    def small(pixels: np.ndarray) -> np.ndarray:  # (H, W, 3) uint8 -> (n, n, 3) float32 in [0, 255], unrounded
        return np.stack([np.asarray(Image.fromarray(c).resize((n, n), Image.BOX))
                         for c in pixels.astype(np.float32).transpose(2, 0, 1)], axis=-1)

    def fn(images, prompts, metadata):
        sources = [small(np.asarray(reward_judge.source_image(m, p, "preserve"))) for p, m in zip(prompts, metadata)]
        return [1 - np.abs(small(image) - source).mean(dtype=np.float64) / 255 for image, source in zip(images, sources)]
    return fn

# ---------------------------------------------------------------- rewards of videos (B, F, H, W, 3) uint8, F >= 2
FRAME_STRIDE = 4  # image rewards score frames 0, 4, 8, … of a video (Flow-GRPO's video OCR reward: every 4th frame)

def _frame_change(videos):
    """Mean |frame_{t+1} − frame_t| over consecutive frames, pixels and channels, in [0, 1]: (B,)."""
    return np.abs(np.diff(videos.astype(np.float32), axis=1)).reshape(len(videos), -1).mean(axis=1) / 255

def temporal_consistency():
    """1 − the mean change between consecutive frames, in [0, 1] (1: a still video). Computed on the frames alone."""
    return lambda videos, prompts, metadata: 1 - _frame_change(videos)

def motion():
    """The mean change between consecutive frames, in [0, 1] (0: a still video): the opposite pull."""
    return lambda videos, prompts, metadata: _frame_change(videos)

# ---------------------------------------------------------------- OCR (rapidocr; its wheel ships the PP-OCR models)
_QUOTED = re.compile(r'["“”]([^"“”]*)["“”]')

def ocr_target(prompt: str) -> str:
    """The text in the prompt's first pair of double quotes ("..." or “...”); not single quotes, which
    apostrophes ("a baker's sign") would fake."""
    m = _QUOTED.search(prompt)
    if m is None or not m.group(1).strip():
        raise ValueError(f"ocr reward: prompt {prompt!r} has no text between double quotes; the target text "
                         'must be quoted, e.g. \'a shop sign that says "OPEN"\' (the prompts of --prompts ocr are)')
    return m.group(1)

def ocr_score(recognised: str, target: str, containment: bool = True) -> float:
    """Whitespace removed, case-folded; 1 if the target occurs in the recognised text (unless not `containment`: its
    video reward's), else 1 - min(edit distance, len)/len (capped: much unrelated text costs no more than none), as
    Flow-GRPO's OCR reward."""
    from rapidfuzz.distance import Levenshtein
    rec, tgt = "".join(recognised.split()).casefold(), "".join(target.split()).casefold()
    return 1.0 if containment and tgt in rec else 1.0 - min(Levenshtein.distance(rec, tgt), len(tgt)) / len(tgt)

# PaddleOCR 2.x's `ocr()` (Flow-GRPO pins 2.9.1) keeps a line only if its confidence is >= its drop_score, 0.5 by
# default (tools/infer/predict_system.py, TextSystem.__call__); Flow-GRPO's own `> 0` test then drops nothing more
OCR_MIN_SCORE = 0.5

@lru_cache(maxsize=1)
def _ocr_engine():
    from rapidocr import RapidOCR
    # As Flow-GRPO's PaddleOCR 2.x call: no angle classifier; lines read with confidence under OCR_MIN_SCORE dropped
    # (rapidocr drops score < text_score, as Paddle); detection shrinks only images over 960 px (rapidocr's default
    # enlarges every image to >= 736 px, ~10x slower on small ones).
    return RapidOCR(params={"Global.log_level": "critical", "Global.use_cls": False,
                            "Global.text_score": OCR_MIN_SCORE, "Det.limit_type": "max", "Det.limit_side_len": 960})

def ocr_read(images: np.ndarray) -> list[str]:
    """The text recognised in each uint8 (B, H, W, 3) RGB image, its lines joined in reading order."""
    return ["".join(_ocr_engine()(Image.fromarray(img)).txts or ()) for img in images]

def ocr():
    _ocr_engine()  # load now: a broken install fails at start-up, not mid-run
    def fn(images, prompts, metadata):
        targets = [ocr_target(p) for p in prompts]  # before the slow part
        return [ocr_score(text, t) for text, t in zip(ocr_read(images), targets)]

    def video(videos, prompts, metadata):
        """Flow-GRPO's video OCR (flow_grpo/ocr.py, OcrScorer_video_or_image): frames 0, FRAME_STRIDE, … scored without
        the containment rule (text beside the target costs), averaged over the frames scoring above 0 (else 0)."""
        targets, frames = [ocr_target(p) for p in prompts], videos[:, ::FRAME_STRIDE]  # targets before the slow part
        read = iter(ocr_read(frames.reshape(-1, *frames.shape[2:])))
        scores = [[ocr_score(next(read), t, containment=False) for _ in range(frames.shape[1])] for t in targets]
        return [float(np.mean([s for s in per if s > 0])) if max(per) > 0 else 0.0 for per in scores]
    fn.video = video  # _checked's scorer of videos, in place of the image reward per frame
    return fn

# ---------------------------------------------------------------- CLIP family (transformers' CLIP classes)
CLIP_L = "openai/clip-vit-large-patch14"

def _load_clip(model_id, processor_id):
    from transformers import CLIPModel, CLIPProcessor
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = CLIPModel.from_pretrained(os.path.expanduser(model_id)).eval().requires_grad_(False).to(device)
    return model, CLIPProcessor.from_pretrained(os.path.expanduser(processor_id))  # ~/dir: as _local_model checks it

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

# ---------------------------------------------------------------- a vision-language judge reading text (reward_judge.py)
# The judge's task beside `ocr`, whose formula scores its reading; the other tasks and the client are reward_judge's.
READ_CHARS = 64  # the ocr task's longest reading (the ocr prompt set's targets have at most 14 characters)

def _score_reading(choice: dict, prompt: str) -> float:
    """ocr: the judge's reading of the image, scored by the OCR formula against the prompt's quoted text (as `ocr`)."""
    text = choice["message"]["content"]
    if not isinstance(text, str):
        raise ValueError("the reply has no text")
    return ocr_score(text, ocr_target(prompt))

JUDGE_TASKS = {
    "ocr": reward_judge.JudgeTask("Read the text in this image. Reply with the text only, on one line.",
                                  # A token holds >= 1 byte of UTF-8 (<= 4 a character): the regex ends the reply
                                  # within this length.
                                  {"max_completion_tokens": 4 * READ_CHARS + 1,
                                   "structured_outputs": {"regex": f"[^\\n]{{0,{READ_CHARS}}}"}},
                                  _score_reading, ocr_target),
    **reward_judge.TASKS,
}

# ---------------------------------------------------------------- rewards over HTTP (the transport: reward_http.py)
def probe(spec: str) -> None:
    """Start-up, before the policy loads: each remote= and judge: server asked once (reward_http.ask_once)."""
    for label, _, name, args, _ in _parse(spec):
        if name in URL_ITEMS:  # a reward server's /health, a judge's model list
            reward_http.ask_once(f"--reward {label}", URL_ITEMS[name][1]()[0], partial(URL_ITEMS[name][2], args[-1]))

def remote(url):
    """--reward remote=URL: POST /score of a `python rewards.py serve`, FLOWGRPO_REMOTE_BATCH images a request."""
    return reward_http.score_client(url, *reward_http.remote_knobs())

def judge(task: str, urls: list[str], concurrency: int | None = None):
    """--reward judge:TASK=URL[+URL...]: JUDGE_TASKS[task] asked of OpenAI-compatible servers (reward_judge.client);
    `concurrency` (FLOWGRPO_JUDGE_CONCURRENCY, reward_judge.JUDGE_CONCURRENCY) requests in flight per server."""
    return reward_judge.client(task, JUDGE_TASKS[task], urls, concurrency)

# ---------------------------------------------------------------- make_reward: parse, quantise, call, check
def _weight(text, item):
    w = float(text) if re.fullmatch(r"\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*", text) else math.nan
    if not math.isfinite(w):
        raise ValueError(f"--reward: bad weight {text!r} in {item!r}; write NAME=WEIGHT with a finite number, "
                         "e.g. ocr=1.0")
    return w

def _remote_item(arg, text, item):
    if arg:
        raise ValueError(f"--reward: remote takes no :ARG, got {item!r}; write remote=http://HOST:PORT")
    url = reward_http.server_urls(text, item, "remote=http://HOST:PORT")
    if len(url) > 1:
        raise ValueError(f"--reward: remote takes one server, got {item!r}")
    reward_http.remote_knobs()
    return f"remote@{urllib.parse.urlsplit(url[0]).netloc}", "remote", (url[0],)

def _judge_item(task, text, item):
    if task not in JUDGE_TASKS:
        raise ValueError(f"--reward: judge needs a task, one of {', '.join(JUDGE_TASKS)}, got {item!r}; write "
                         "judge:ocr=http://HOST:PORT[+http://HOST2:PORT]")
    urls = reward_http.server_urls(text, item, "judge:TASK=http://HOST:PORT[+http://HOST2:PORT...]")
    reward_judge.knobs()
    netlocs = "+".join(urllib.parse.urlsplit(u).netloc for u in urls)
    return f"judge:{task}@{netlocs}", f"judge:{task}", (task, urls)

URL_ITEMS = {"remote": (_remote_item, reward_http.remote_knobs, reward_http.served_reward),  # NAME[:ARG]=URL[=WEIGHT]:
             "judge": (_judge_item, reward_judge.knobs, reward_judge.served_model)}  # parse, knobs, start-up's ask

def _parse(spec):
    """[(label, kind, name, args, weight)], validated without importing or building anything. `kind` names the
    reward's prompt check (PROMPT_CHECKS): its name, or judge:TASK."""
    valid, items, parsed = ", ".join(sorted(REWARDS)), [s.strip() for s in spec.split(",")], []
    if not all(items):
        raise ValueError(f"--reward: empty reward in {spec!r}; write e.g. ocr=1.0,pickscore=0.5; valid: {valid}")
    for item in items:
        head, eq, rest = item.partition("=")
        name, _, arg = head.strip().partition(":")
        if name not in REWARDS:
            raise ValueError(f"--reward: unknown reward {name!r}; valid: {valid}")
        if name in URL_ITEMS:  # the first "=" begins the URL(s), a second one the weight
            urls, eq, rest = rest.partition("=")
            label, kind, args = URL_ITEMS[name][0](arg, urls, item)
        elif arg and not inspect.signature(REWARDS[name]).parameters:
            raise ValueError(f"--reward: reward {name!r} takes no argument, got {item!r}")
        else:
            label, kind, args = name, name, (arg,) if arg else ()
        if name in START_CHECKS:
            START_CHECKS[name](*args)
        if label in [p[0] for p in parsed]:
            raise ValueError(f"--reward: reward {label!r} appears twice in {spec!r}")
        parsed.append((label, kind, name, args, _weight(rest, item) if eq else 1.0))
    return parsed

def check_reward_spec(spec: str, video: bool = False) -> None:
    """Start-up validation of --reward (names, weights, URLs, the aesthetic head's path; video rewards need videos of
    several frames: `video`); builds nothing."""
    if all(w == 0 for *_, w in _parse(spec)):
        raise ValueError(f"--reward {spec}: every term has weight 0 (a judge: logged, never trained on), so every "
                         "advantage is 0 and nothing trains: give the reward to train on a weight, e.g. NAME=1")
    for _, _, name, _, _ in _parse(spec):
        if name in VIDEO_REWARDS and not video:
            raise ValueError(f"--reward {name} scores videos: it needs a video --model (tiny-wan, wan2.1-t2v-1.3b) "
                             "and --num-frames > 1")

def check_prompts_for_reward(spec: str, prompts: list[str], metadata: list[dict] | None = None) -> None:
    """Start-up validation that every prompt suits every reward of spec: ocr needs quoted text; preserve and
    judge:edit a source image in each prompt's metadata (checked when `metadata` is given)."""
    for _, kind, _, _, _ in _parse(spec):
        for prompt in prompts if kind in PROMPT_CHECKS else ():
            PROMPT_CHECKS[kind](prompt)
        missing = [p for p, m in zip(prompts, metadata or ()) if kind in SOURCE_REWARDS and "image" not in m]
        if missing:
            raise ValueError(f"--reward {kind} compares each result with its prompt's source image, and {len(missing)} "
                             f"of the {len(prompts)} prompts have none (the first: {missing[0]!r}): "
                             f"{reward_judge.SOURCE_FIX}")

def check_size_for_reward(spec: str, height: int, width: int) -> None:
    """Start-up validation that every reward of spec reads images of the run's size (the laptop tasks' readers)."""
    for _, kind, _, _, _ in _parse(spec):
        if kind in SIZE_CHECKS:
            SIZE_CHECKS[kind](height, width)

def check_servable(spec: str) -> None:
    """`python rewards.py serve`'s check: check_reward_spec, and no reward that reads a source image. Its path comes in
    each request's metadata: a server would open whatever file a client names, on the server's machine."""
    check_reward_spec(spec)
    for _, kind, _, _, _ in _parse(spec):
        if kind in SOURCE_REWARDS:
            raise ValueError(f"--reward {kind} reads each prompt's source image from a path in the request, which a "
                             "server would open for any client: score it in the trainer, not behind remote=URL")

def to_uint8(images: torch.Tensor) -> np.ndarray:
    """(B, 3, H, W) float in [0, 1] (or uint8) -> (B, H, W, 3) uint8, rounded as ddpo-pytorch and a saved PNG do;
    videos (B, F, 3, H, W) -> (B, F, H, W, 3)."""
    if not isinstance(images, torch.Tensor) or images.ndim not in (4, 5) or images.shape[-3] != 3:
        raise ValueError("rewards take a (B, 3, H, W) image or (B, F, 3, H, W) video tensor, got "
                         f"{getattr(images, 'shape', type(images))}")
    if images.dtype == torch.uint8:  # the pixels themselves (the reward server's, read from PNGs)
        return images.movedim(-3, -1).cpu().numpy()
    out = torch.empty(images.movedim(-3, -1).shape, dtype=torch.uint8)
    for i, image in enumerate(images.detach()):  # one image's temporaries at a time (the reward server's memory)
        if not torch.isfinite(image).all():
            raise ValueError("rewards: the images contain NaN or infinity")
        out[i] = (image.float().cpu() * 255).round_().clamp_(0, 255).to(torch.uint8).movedim(-3, -1)
    return out.numpy()

def _per_frame(fn):
    """An image reward applied to videos (B, F, H, W, 3): frames 0, FRAME_STRIDE, … scored as images, averaged."""
    def video_fn(videos, prompts, metadata):
        frames = videos[:, ::FRAME_STRIDE]  # (B, F', H, W, 3)
        n = frames.shape[1]
        scores = fn(frames.reshape(-1, *frames.shape[2:]), [p for p in prompts for _ in range(n)],
                    [m for m in metadata for _ in range(n)])
        return np.asarray(scores, dtype=np.float64).reshape(len(videos), n).mean(axis=1)
    return video_fn

def _checked(label, fn, serial, video=False):
    # Model rewards run one call at a time: they are not assumed thread-safe (transformers' fast tokenizers are
    # not, transformers#47085), and torch/onnxruntime use every core per call anyway. HTTP calls may overlap.
    lock = threading.Lock() if serial else contextlib.nullcontext()
    per_frame = getattr(fn, "video", None) or _per_frame(fn)  # a reward's own video form (ocr's), else per frame

    def reward(images, prompts, metadata=None):
        prompts = list(prompts)
        metadata = [{} for _ in prompts] if metadata is None else list(metadata)
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(f"reward {label!r}: {len(images)} images, {len(prompts)} prompts, "
                             f"{len(metadata)} metadata")
        pixels = to_uint8(images)
        if video and pixels.ndim == 4:  # check_reward_spec refuses it at start-up
            raise ValueError(f"reward {label!r} scores videos (B, F, 3, H, W), got images {tuple(images.shape)}")
        with lock:
            scores = np.asarray((per_frame if pixels.ndim == 5 and not video else fn)(pixels, prompts, metadata),
                                dtype=np.float64)
        if scores.shape != (len(prompts),):
            raise ValueError(f"reward {label!r} returned shape {scores.shape} for {len(prompts)} images")
        bad = np.flatnonzero(~np.isfinite(scores))
        if bad.size:
            raise ValueError(f"reward {label!r} returned {scores[bad[0]]} for prompt {prompts[bad[0]]!r}; "
                             "rewards must be finite")
        return scores, {label: scores}
    return reward

def weights(spec: str) -> dict[str, float]:
    """{label: weight} of --reward SPEC's terms; a weight-0 term is a judge: logged, never trained on."""
    return {label: w for label, _, _, _, w in _parse(spec)}


def _built(label: str, name: str, args: tuple):
    """REWARDS[name](*args): its model loaded, or one line naming the reward when it cannot be."""
    try:
        return REWARDS[name](*args)
    except OSError as e:  # transformers' hub, offline and missing-file errors
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ValueError(f"--reward {label}: its model cannot be loaded ({reason}): check its name, or download it "
                         f"where the hub is reachable and give the directory (--reward {name}:DIR)") from None

def make_reward(spec: str):
    """The RewardFn for --reward SPEC (grammar in the module docstring); builds every model it needs."""
    parts = [(label, w, _checked(label, _built(label, name, args), name not in URL_ITEMS, name in VIDEO_REWARDS))
             for label, _, name, args, w in _parse(spec)]
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][2]
    def weighted(images, prompts, metadata=None):
        total, info = np.zeros(len(prompts)), {}
        for label, w, fn in parts:
            scores, _ = fn(images, prompts, metadata)
            with np.errstate(over="ignore"):  # an overflow is refused below, naming its terms
                total, info[label] = total + w * scores, scores
        if not np.isfinite(total).all():  # finite terms can overflow: 2 × 1e308
            i = int(np.argmin(np.isfinite(total)))
            raise ValueError(f"--reward {spec}: the weighted total of {({k: float(v[i]) for k, v in info.items()})} is "
                             f"{total[i]}, for prompt {prompts[i]!r}: it must be finite")
        return total, info
    return weighted


def check_iteration(total: torch.Tensor, spec: str) -> None:
    """An iteration's total rewards (P·G,) need a finite mean and spread for their advantages: 1e308 is finite, twice
    it is not. Otherwise the loss is NaN, every step is skipped and the run learns nothing, silently."""
    r = total.double()
    if not (torch.isfinite(r.mean()) and torch.isfinite(r.std(unbiased=False))):
        raise ValueError(f"--reward {spec}: this iteration's rewards (largest |r| {r.abs().max().item():.3g}) have no "
                         "finite mean and spread, so no advantages: a reward that large is broken")


class AsyncRewards:
    """Scores rollout chunks in background threads while the next chunk is sampled (the reward models release the
    GIL). A model reward still takes one chunk at a time (see _checked); workers > 1 helps HTTP rewards.
    collect() returns every chunk submitted since the last collect, in submission order."""

    def __init__(self, fn, workers: int = 1):
        self.fn, self.workers, self.pending = fn, reward_http.Workers([None] * workers, "reward"), []

    def _score(self, _key, images, prompts, metadata):
        return self.fn(images, prompts, metadata)

    def submit(self, images, prompts, metadata=None):
        # A private CPU copy: the caller may overwrite its image buffer while this chunk is scored.
        future = self.workers.submit(self._score, images.detach().cpu().clone(), list(prompts),
                                     None if metadata is None else [dict(m) for m in metadata])
        self.pending.append(future)
        return future

    def collect(self):
        """-> (scores (N,), info {name: (N,)}, seconds the caller waited here). The first failed chunk raises at once,
        without waiting for the others (which are cancelled if not started)."""
        pending, self.pending = self.pending, []
        if not pending:
            raise RuntimeError("AsyncRewards.collect(): nothing was submitted since the last collect")
        start = time.perf_counter()
        results = reward_http.gather(pending)
        waited = time.perf_counter() - start
        info = {k: np.concatenate([r[1][k] for r in results]) for k in results[0][1]}
        return np.concatenate([r[0] for r in results]), info, waited

    def close(self):
        for f in self.pending:
            f.cancel()
        self.workers.close()

# ---------------------------------------------------------------- the registry: one line per reward
# The laptop tasks' readers (tasks/nano.py, …): each task file's reward and judge, name -> (factory, prompt check)
TASK_REWARDS = nano.REWARDS | nano_compose.REWARDS | nano_edit.REWARDS
REWARDS = {f.__name__: f for f in (jpeg_compressibility, jpeg_incompressibility, brightness, ocr, pickscore, clipscore,
                                    aesthetic, preserve, remote, judge, temporal_consistency, motion)} | {
    name: factory for name, (factory, _) in TASK_REWARDS.items()}
VIDEO_REWARDS = {"temporal_consistency", "motion"}  # they take whole videos (B, F, H, W, 3); the others images
# compare with the source image (nano-edit's reward and judge too): read from a path in each prompt's metadata
SOURCE_REWARDS = {"preserve", *nano_edit.REWARDS, *(f"judge:{k}" for k, t in JUDGE_TASKS.items() if t.source)}

def _local_model(name: str):
    """A CLIP reward's ARG written as a path (/…, ./…, ~/…) must be a directory: said at start-up, not after the
    policy model is built (a hub id, "owner/name", is looked up when the reward is built)."""
    def check(model=None):
        if model and model.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(model)):
            raise ValueError(f"--reward {name}:{model}: no such directory; give a directory holding the CLIP model and "
                             "its processor, or a hub id")
    return check

START_CHECKS = {"aesthetic": lambda model=None: (_local_model("aesthetic")(model), _aesthetic_head_path()),
                "pickscore": _local_model("pickscore"), "clipscore": _local_model("clipscore"),
                "preserve": _preserve_side}  # set-up, at start
SIZE_CHECKS = nano.SIZE_CHECKS | nano_edit.SIZE_CHECKS  # the task readers that take one image size: at start-up
PROMPT_CHECKS = {"ocr": ocr_target, **{name: check for name, (_, check) in TASK_REWARDS.items()},
                 **{f"judge:{k}": t.check for k, t in JUDGE_TASKS.items() if t.check}}

if __name__ == "__main__":  # python rewards.py serve --reward SPEC --port P: reward_server's server of this reward
    reward_server.serve_cli(make_reward, check_servable)
