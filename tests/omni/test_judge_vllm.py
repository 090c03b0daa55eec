"""The judge reward against a real vLLM server on 127.0.0.1: vLLM's CPU build (the vLLM-Omni tier's environment)
serving a tiny random-weight Qwen2.5-VL (omni/tiny_vl.py). Its judgements mean nothing; the protocol is real:
images reach the vision tower, constrained decoding makes every answer parse, the expectation over the answer
token's probabilities is computed, identical requests score identically, and a short training run completes."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from harness import OMNI_VENV, ROOT, OmniServer, free_port, http

import reward_http
import rewards


def load_tiny_vl():
    spec = importlib.util.spec_from_file_location("tiny_vl", ROOT / "omni" / "tiny_vl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class JudgeServer(OmniServer):
    """vLLM's OpenAI server (no --omni) of the tiny VL model, in its own process group; waited for and stopped as
    OmniServer does (GET /health with a deadline; SIGTERM, then SIGKILL). VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the
    `uni` executor that serve_command asks for (vLLM's CPU platform otherwise swaps in the `mp` one): the model runs
    in the engine's process, one process fewer to start (measured: 91 -> 74 CPU-seconds to healthy)."""

    def __init__(self, model_dir: Path, log_path: Path):
        port = free_port()
        self._start(load_tiny_vl().serve_command(str(model_dir), port, str(OMNI_VENV)), port, log_path,
                    VLLM_CPU_KVCACHE_SPACE="1",  # GiB of KV cache: plenty for 1024-token requests
                    VLLM_ENABLE_V1_MULTIPROCESSING="0")


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    model_dir = load_tiny_vl().build(str(tmp_path_factory.mktemp("judge") / "tiny-vl"))
    server = JudgeServer(Path(model_dir), tmp_path_factory.mktemp("judge-log") / "vllm-serve.log")
    print(f"vllm serve of the tiny VL judge healthy after {server.start_s:.0f} s")
    yield server.url
    server.stop()


def test_judge_protocol_against_real_vllm(judge_url):
    fn = rewards.make_reward(f"judge:match={judge_url}")
    torch.manual_seed(0)
    images = torch.rand(4, 3, 32, 32)
    images = torch.cat([images, images[:2]])  # images 4, 5 repeat images 0, 1
    prompts = ["a red fox in the snow", "a city street at night"] * 3
    scores, _ = fn(images, prompts)
    assert np.isfinite(scores).all() and ((scores >= 0) & (scores <= 1)).all(), scores
    np.testing.assert_array_equal(scores[4:], scores[:2])  # identical requests, identical scores
    np.testing.assert_array_equal(fn(images, prompts)[0], scores)  # and again, a second time
    assert len(set(scores[:4].round(12))) == 4, scores  # the images reach the model: each scores differently
    # The score is the expectation over the server's own answer-token probabilities: ask once by hand.
    body = {"model": "tiny-vl", "temperature": 0, **rewards.JUDGE_TASKS["match"].request,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                    reward_http.png_base64(rewards.to_uint8(images[:1])[0])}},
                {"type": "text", "text": rewards.JUDGE_TASKS["match"].question.format(prompt=prompts[0])}]}]}
    status, reply = http("POST", judge_url + "/v1/chat/completions", body)
    assert status == 200, reply
    choice = reply["choices"][0]
    top = {t["token"]: t["logprob"] for t in choice["logprobs"]["content"][0]["top_logprobs"]}
    allowed = {t: lp for t, lp in top.items() if lp > -9999}  # the constraint masks every other token
    assert choice["message"]["content"] in ("Yes", "No") and choice["finish_reason"] == "stop", choice
    assert allowed and all("Yes".startswith(t) or "No".startswith(t) for t in allowed), top
    yes = sum(math.exp(lp) for t, lp in allowed.items() if "Yes".startswith(t))
    no = sum(math.exp(lp) for t, lp in allowed.items() if "No".startswith(t))
    assert abs(yes + no - 1) < 1e-4, (yes, no)  # the probabilities are those of the constrained answer
    assert abs(scores[0] - yes / (yes + no)) < 1e-12, (scores[0], yes / (yes + no))
    # The ocr task: a constrained one-line reading, scored by the OCR formula.
    ocr_scores, _ = rewards.make_reward(f"judge:ocr={judge_url}")(images[:2], ['a sign that says "OPEN"'] * 2)
    assert ((ocr_scores >= 0) & (ocr_scores <= 1)).all(), ocr_scores


def test_training_run_with_the_judge(judge_url, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "flowgrpo.py"), "--model", "tiny", "--reward", f"judge:match={judge_url}",
           "--iterations", "2", "--group-size", "2", "--prompts-per-iteration", "2", "--micro-batch", "2",
           "--eval-every", "0", "--checkpoint-every", "0", "--no-wandb", "--run-dir", str(run)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    key = f"reward/judge:match@{judge_url[len('http://'):]}/mean"
    assert [r["iteration"] for r in rows] == [0, 1] and all(0 <= r[key] <= 1 for r in rows), rows
