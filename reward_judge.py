"""A vision-language model as the judge (`--reward judge:TASK=URL[+URL...]`): the tasks (what is asked, with which
images, and how a reply becomes a score) and the client that asks an OpenAI-compatible chat-completions server, over
reward_http's transport. An edit's source image, which the `edit` task sends beside the result and the `preserve`
reward compares it with, is read here (`source_image`). rewards.py registers the judge by name and adds the task that
scores with the OCR formula (`ocr`).
"""
from __future__ import annotations

import json
import math
import os
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image

import reward_http
import source_images

# ---------------------------------------------------------------- an edit's source image
SOURCE_FIX = ('use an edit model (nano-edit, tiny-flux-kontext, flux.1-kontext-dev, ...) with a .jsonl prompt set whose '
              'every line has "image": "path.png"')


def source_image(metadata: dict, prompt: str, who: str) -> Image.Image:
    """The prompt's source image (`metadata["image"]`, a path; prompts.py reads it from a .jsonl) as RGB pixels, for
    reward `who`; a prompt without one is refused in one line (check_source does so at start-up)."""
    check_source(metadata, prompt, who)
    return source_images.read(metadata["image"])


def check_source(metadata: dict, prompt: str, who: str) -> None:
    if not isinstance(metadata.get("image"), str):
        raise ValueError(f"--reward {who} compares each result with its prompt's source image, and prompt {prompt!r} "
                         f"has none: {SOURCE_FIX}")


# ---------------------------------------------------------------- the tasks: questions and scores
YES_NO = {"Yes": 1.0, "No": 0.0}  # the Yes/No tasks' answers and their values


def score_yes_no(choice: dict, prompt: str) -> float:
    """match, edit: E[value] = P(Yes)·1 + P(No)·0 under the judge's probabilities for the answer's first token. A
    listed token counts for the one answer it begins ("Y", "Ye" and "Yes" all begin Yes); the sum is renormalised over
    the answers, so a server that reports unconstrained probabilities gives the same expectation."""
    if choice["message"]["content"] not in YES_NO:
        raise ValueError(f"the answer is not one of {list(YES_NO)}")
    mass = dict.fromkeys(YES_NO, 0.0)
    for top in choice["logprobs"]["content"][0]["top_logprobs"]:
        token = top["token"].strip()
        begun = [answer for answer in YES_NO if token and answer.startswith(token)]
        if not top["logprob"] <= 0:  # a log-probability; exp(1000) would overflow
            raise ValueError(f"logprob {top['logprob']!r} of token {token!r} is not a log-probability (<= 0)")
        if len(begun) == 1:
            mass[begun[0]] += math.exp(top["logprob"])
    total = sum(mass.values())
    if not total > 0:
        raise ValueError("no token of its top_logprobs begins an answer")
    return sum(YES_NO[answer] * p for answer, p in mass.items()) / total


@dataclass(frozen=True)
class JudgeTask:
    question: str  # sent after the image(s); {prompt} is the image's prompt
    request: dict  # decoding options: length, logprobs, and the constrained answer (vLLM's `structured_outputs`)
    score: Callable[[dict, str], float]  # (the reply's choices[0], prompt) -> score
    check: Callable[[str], object] | None = None  # a cheap start-up check of each prompt
    source: bool = False  # the prompt's source image is sent first, then the result (an edit task)


YES_NO_REQUEST = {"max_completion_tokens": 8, "logprobs": True, "top_logprobs": 20,
                  "structured_outputs": {"choice": list(YES_NO)}}
TASKS = {  # the tasks that need nothing but the reply; rewards.py adds `ocr`
    "match": JudgeTask("Description: {prompt}\nDoes this image match the description? Answer Yes or No.",
                       YES_NO_REQUEST, score_yes_no),
    "edit": JudgeTask("The first image is the original. The second image is meant to be the original edited as "
                      "instructed.\nInstruction: {prompt}\nDoes the second image carry out the instruction on the "
                      "original? Answer Yes or No.", YES_NO_REQUEST, score_yes_no, source=True),
}

# ---------------------------------------------------------------- the client
JUDGE_CONCURRENCY = 8  # requests in flight per judge server, unless FLOWGRPO_JUDGE_CONCURRENCY says otherwise


def knobs(concurrency=None):
    """(client, requests in flight per server), from FLOWGRPO_JUDGE_*: checked at start-up by rewards._parse."""
    return (reward_http.client_from_env("FLOWGRPO_JUDGE", "judge server",
                                        "is the judge (e.g. `vllm serve`) running and reachable there?"),
            concurrency or reward_http.knob("FLOWGRPO_JUDGE_CONCURRENCY", JUDGE_CONCURRENCY, 1, 256))


def served_model(urls: list[str], client) -> str:
    """The served model: FLOWGRPO_JUDGE_MODEL, else the one model every server lists at GET /v1/models."""
    want = os.environ.get("FLOWGRPO_JUDGE_MODEL")
    for url in urls:
        reply = client.call(url, "/v1/models")  # also: the server is up, at start-up
        data = reply.get("data") if isinstance(reply, dict) else None
        served = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if want is None and len(served) == 1:
            want = served[0]
        if want not in served:
            raise ValueError(f"judge server {url} serves {served}, not {want!r}: set FLOWGRPO_JUDGE_MODEL to the model "
                             "to use, served by every judge server")
    return want


def png_part(pixels: np.ndarray) -> dict:
    """A chat message's image part: (H, W, 3) uint8 as a PNG in a base64 data URL."""
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + reward_http.png_base64(pixels)}}


def client(task: str, spec: JudgeTask, urls: list[str], concurrency: int | None = None):
    """The judge of JudgeTask `spec` (named `task`): each image with the task's question in one user message to
    POST /v1/chat/completions, at temperature 0; an edit task's message holds the source image (resized to the
    result's size, as the edit model sees it) before the result. `concurrency` requests in flight per server, each to
    whichever server is free. -> fn(images (B, H, W, 3) uint8, prompts, metadata) -> scores (B,)."""
    http, per_server = knobs(concurrency)
    model = served_model(urls, http)
    workers = reward_http.Workers(urls * per_server, "judge")

    def ask(url, image, prompt, meta):
        shown = [image]
        if spec.source:
            source = source_image(meta, prompt, f"judge:{task}")
            shown.insert(0, np.asarray(source.resize(image.shape[1::-1], Image.LANCZOS)))
        content = [*map(png_part, shown), {"type": "text", "text": spec.question.format(prompt=prompt)}]
        body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, **spec.request}
        reply = http.call(url, "/v1/chat/completions", body, f" for prompt {prompt!r}")
        try:
            choice = reply["choices"][0]
            if choice["finish_reason"] != "stop":
                raise ValueError(f"finish_reason {choice['finish_reason']!r}: the answer is cut or refused")
            return spec.score(choice, prompt)
        # OverflowError: a logprob that is an int past float64's range (-1e400 written out), which exp() refuses
        except (LookupError, TypeError, AttributeError, ValueError, OverflowError) as e:
            raise ValueError(f"judge server {url}: the reply for prompt {prompt!r} does not parse ({e}): "
                             f"{json.dumps(reply)[:600]}") from None

    def fn(images, prompts, metadata):
        for prompt, meta in zip(prompts, metadata):  # before any request
            if spec.check:
                spec.check(prompt)
            if spec.source:
                check_source(meta, prompt, f"judge:{task}")
        return reward_http.gather([workers.submit(ask, *job) for job in zip(images, prompts, metadata)])
    weakref.finalize(fn, workers.close)
    return fn
