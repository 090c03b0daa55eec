"""The judge reward (`--reward judge:TASK=URL[+URL...]`) against fake OpenAI-style servers on 127.0.0.1: the
score from known answer distributions and readings, what is sent, malformed replies, 5xx, hangs, refusals, and
requests in flight per server. The real vLLM server is in tests/omni/test_judge_vllm.py."""
import base64
import io
import json
import math
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

import reward_http
import rewards


class FakeJudge:
    """GET /v1/models lists `models`; POST /v1/chat/completions answers `answer(body) -> (status, dict or bytes)`.
    Records every request body and the most requests it ever held unanswered at once."""

    def __init__(self, answer, models=("judge-model",)):
        self.answer, self.models, self.bodies = answer, list(models), []
        self.lock, self.in_flight, self.max_in_flight = threading.Lock(), 0, 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                fake.send(self, 200, {"object": "list", "data": [{"id": m, "object": "model"} for m in fake.models]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.bodies.append(body)
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    status, payload = fake.answer(body)
                finally:  # answered: from here on the client may send its next request
                    with fake.lock:
                        fake.in_flight -= 1
                fake.send(self, status, payload)

            def log_message(self, *args):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    @staticmethod
    def send(handler, status, payload):
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(raw)))
            handler.end_headers()
            handler.wfile.write(raw)
        except OSError:  # the client gave up first (the deadline tests)
            pass

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judges():
    started = []

    def start(answer, **kw):
        started.append(FakeJudge(answer, **kw))
        return started[-1]
    yield start
    for j in started:
        j.close()


@pytest.fixture
def fast_retries(monkeypatch):
    monkeypatch.setenv("FLOWGRPO_JUDGE_RETRIES", "2")
    monkeypatch.setenv("FLOWGRPO_JUDGE_BACKOFF", "0.01")
    monkeypatch.setenv("FLOWGRPO_JUDGE_TIMEOUT", "20")
    sleeps = []  # reward_http's own `time` only
    monkeypatch.setattr(reward_http, "time", types.SimpleNamespace(sleep=sleeps.append, monotonic=time.monotonic))
    return sleeps


def question_prompt(body):
    """The image's prompt, read back from the question sent with it."""
    text = body["messages"][0]["content"][1]["text"]
    return text.split("Description: ", 1)[1].split("\n", 1)[0] if "Description: " in text else None


def chat_reply(content, top=None, finish="stop"):
    """A chat-completions reply; `top` = [(token, probability)] of the first answer token."""
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
    if top is not None:
        tops = [{"token": t, "logprob": math.log(p) if p > 0 else -9999.0} for t, p in top]
        choice["logprobs"] = {"content": [{"token": tops[0]["token"], "logprob": tops[0]["logprob"],
                                           "top_logprobs": tops}]}
    return 200, {"object": "chat.completion", "choices": [choice]}


def yes_mass(prompt):
    return 0.1 * (int(prompt.split()[-1]) + 1)  # "image i" -> P(Yes) = 0.1·(i+1)


def distribution(body):
    """For 'image i': Yes 0.1·(i+1) (as "Y", "Ye", "Yes"), No 0.9 − that (as "No", "N"), 0.1 on another token."""
    y = yes_mass(question_prompt(body))
    n = 0.9 - y
    return chat_reply("Yes" if y >= n else "No",
                      [("Yes", y / 2), ("No", n / 2), ("Y", y / 4), ("Ye", y / 4), ("N", n / 2), ("Maybe", 0.1)])


# ---------------------------------------------------------------- the scores and the requests

def test_match_is_the_expected_value_of_the_answer_distribution(judges, fast_retries):
    j = judges(distribution)
    fn = rewards.make_reward(f"judge:match={j.url}")
    images, prompts = torch.rand(6, 3, 20, 12), [f"image {i}" for i in range(6)]
    scores, info = fn(images, prompts)
    expected = [yes_mass(p) / 0.9 for p in prompts]  # E[value] over the answers: P(Yes) / (P(Yes) + P(No))
    np.testing.assert_allclose(scores, expected, rtol=1e-12, atol=0)
    assert list(info) == [f"judge:match@{j.url[len('http://'):]}"]
    np.testing.assert_array_equal(fn(images, prompts)[0], scores)  # identical inputs, identical scores
    # What was sent: the served model, temperature 0, the constrained answer with logprobs, and the PNG of exactly
    # the quantised pixels the other rewards see.
    pixels = rewards.to_uint8(images)
    for body in j.bodies[:6]:
        i = int(question_prompt(body).split()[-1])
        assert body["model"] == "judge-model" and body["temperature"] == 0 and body["logprobs"] is True
        assert body["structured_outputs"] == {"choice": ["Yes", "No"]} and body["top_logprobs"] == 20
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        sent = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
        np.testing.assert_array_equal(sent, pixels[i])
    assert fast_retries == []


def image_index(body):
    """Image i of solid_images(): its first pixel, read back from the PNG that was sent."""
    url = body["messages"][0]["content"][0]["image_url"]["url"]
    return int(np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))[0, 0, 0]) // 40


def solid_images(n):
    return torch.arange(n).mul(40 / 255).view(n, 1, 1, 1).expand(n, 3, 8, 8).clone()


def test_ocr_task_scores_the_judges_reading_with_the_ocr_formula(judges):
    prompts = ['a sign that says "Hello World"', 'a mug that says "hello"', 'a card that says "abc"']
    readings = ["BIG SALE hello world!", "helo", ""]
    j = judges(lambda body: chat_reply(readings[image_index(body)]))
    fn = rewards.make_reward(f"judge:ocr={j.url}")
    scores, _ = fn(solid_images(3), prompts)
    assert scores.tolist() == [rewards.ocr_score(r, rewards.ocr_target(p)) for r, p in zip(readings, prompts)]
    assert scores.tolist() == [1.0, 0.8, 0.0]  # contained; one edit of five; nothing read
    assert all(b["structured_outputs"] == {"regex": "[^\\n]{0,64}"} and b["max_completion_tokens"] == 257
               and "logprobs" not in b for b in j.bodies)
    # A prompt without quoted text fails before anything is sent.
    with pytest.raises(ValueError, match="no text between double quotes"):
        fn(solid_images(1), ["a sign"])
    assert len(j.bodies) == 3


# ---------------------------------------------------------------- broken judges

@pytest.mark.parametrize("reply, problem", [
    (chat_reply("Maybe", [("Yes", 0.5), ("No", 0.5)]), r"the answer is not one of \['Yes', 'No'\]"),
    (chat_reply("Yes"), "'logprobs'"),
    (chat_reply("Yes", [("Maybe", 0.9), ("Sure", 0.1)]), "no token of its top_logprobs begins an answer"),
    (chat_reply("Ye", [("Yes", 1.0)], finish="length"), "finish_reason 'length': the answer is cut or refused"),
    ((200, {"choices": []}), "list index out of range"),
    ((200, {"error": "overloaded"}), "'choices'"),
    # exp(1000) overflowed: an unnamed OverflowError
    ((200, {"choices": [{"message": {"content": "Yes"}, "finish_reason": "stop", "logprobs": {"content": [
        {"top_logprobs": [{"token": "Yes", "logprob": 1000}]}]}}]}), "logprob 1000 of token 'Yes' is not a log-prob"),
    # an int logprob past float64 (-1e400 written out): exp() raised an unnamed OverflowError
    ((200, {"choices": [{"message": {"content": "Yes"}, "finish_reason": "stop", "logprobs": {"content": [
        {"top_logprobs": [{"token": "Yes", "logprob": -10**400}]}]}}]}), "int too large to convert to float"),
])
def test_a_reply_that_does_not_parse_names_server_prompt_and_reply(judges, fast_retries, reply, problem):
    j = judges(lambda body: reply)
    fn = rewards.make_reward(f"judge:match={j.url}")
    with pytest.raises(ValueError, match=rf"judge server {j.url}: the reply for prompt 'image 3' does not parse "
                                         rf"\(.*{problem}.*\): \{{"):
        fn(torch.rand(1, 3, 8, 8), ["image 3"])
    assert fast_retries == []  # a well-formed wrong answer is not retried


def test_a_huge_reply_is_refused_unread(judges, fast_retries):
    """A 60 MB reply added 3.5 GB to the trainer's peak memory (parsed in full); replies are read up to 1 MiB, and one
    past it is said at once: asked again, the server would give the same (it was asked 3 times)."""
    padding = " " * 2**21  # 2 MiB of valid JSON whitespace in an otherwise well-formed answer
    j = judges(lambda body: (200, (json.dumps(distribution(body)[1])[:-1] + padding + "}").encode()))
    with pytest.raises(RuntimeError, match=rf"judge server {j.url}/v1/chat/completions answered for prompt 'image 0' "
                                           r"with a reply of more than 1048576 bytes"):
        rewards.make_reward(f"judge:match={j.url}")(torch.rand(1, 3, 8, 8), ["image 0"])
    assert len(j.bodies) == 1 and fast_retries == []


def test_a_reply_that_is_not_json_names_the_server(judges, fast_retries):
    j = judges(lambda body: (200, b"<html>gateway</html>"))
    with pytest.raises(ValueError, match=rf"judge server {j.url}/v1/chat/completions answered for prompt 'image 0' "
                                         "with a body that is not JSON: '<html>gateway"):
        rewards.make_reward(f"judge:match={j.url}")(torch.rand(1, 3, 8, 8), ["image 0"])


def test_5xx_is_retried_with_backoff_then_stops_naming_the_server(judges, fast_retries):
    failures = [500, 503]  # then healthy

    def flaky(body):
        return (failures.pop(0), b'{"error": "busy"}') if failures else distribution(body)
    j = judges(flaky)
    fn = rewards.make_reward(f"judge:match={j.url}")
    assert fn(torch.rand(1, 3, 8, 8), ["image 4"])[0].tolist() == [pytest.approx(0.5 / 0.9)]
    assert fast_retries == [0.01, 0.02]
    j.answer = lambda body: (503, b'{"error": "down"}')
    with pytest.raises(RuntimeError, match=rf"judge server {j.url}/v1/chat/completions failed 3 times for prompt "
                                           r"'image 4' \(last: HTTP 503.*is the judge .* running"):
        fn(torch.rand(1, 3, 8, 8), ["image 4"])


def test_a_hung_judge_hits_the_whole_request_deadline(judges, fast_retries, monkeypatch):
    monkeypatch.setenv("FLOWGRPO_JUDGE_TIMEOUT", "0.3")
    release = threading.Event()
    j = judges(lambda body: (release.wait(30), distribution(body))[1])  # accepts, then never answers (until teardown)
    fn = rewards.make_reward(f"judge:match={j.url}")
    try:
        with pytest.raises(RuntimeError, match=r"failed 3 times.*TimeoutError: no complete answer within the 0.3 s"):
            fn(torch.rand(1, 3, 8, 8), ["image 1"])
    finally:
        release.set()
    assert len(j.bodies) == 3 and fast_retries == [0.01, 0.02]


def test_refusals(judges, fast_retries):
    j = judges(lambda body: (400, b'{"error": "image too large"}'))
    fn = rewards.make_reward(f"judge:match={j.url}")
    with pytest.raises(ValueError, match=rf"judge server {j.url}/v1/chat/completions refused the request for prompt "
                                         "'image 1': HTTP 400: .*image too large"):
        fn(torch.rand(1, 3, 8, 8), ["image 1"])
    assert fast_retries == [] and len(j.bodies) == 1  # a 4xx is the request's fault: not retried
    j.close()  # a refused connection: the judge is checked at start-up
    with pytest.raises(RuntimeError, match=rf"judge server {j.url}/v1/models failed 3 times .*ConnectionRefusedError"):
        rewards.make_reward(f"judge:match={j.url}")


def test_the_served_model_is_found_or_named(judges, fast_retries, monkeypatch):
    j = judges(distribution, models=["a-7b", "b-7b"])
    with pytest.raises(ValueError, match=rf"judge server {j.url} serves \['a-7b', 'b-7b'\], not None: set "
                                         "FLOWGRPO_JUDGE_MODEL"):
        rewards.make_reward(f"judge:match={j.url}")
    monkeypatch.setenv("FLOWGRPO_JUDGE_MODEL", "b-7b")
    rewards.make_reward(f"judge:match={j.url}")(torch.rand(1, 3, 8, 8), ["image 0"])
    assert j.bodies[-1]["model"] == "b-7b"
    other = judges(distribution, models=["a-7b"])  # every server must serve it
    with pytest.raises(ValueError, match=rf"judge server {other.url} serves \['a-7b'\], not 'b-7b'"):
        rewards.make_reward(f"judge:match={j.url}+{other.url}")


def test_requests_in_flight_per_server_across_servers(judges, fast_retries, monkeypatch):
    # 2 requests per server, 2 servers: a request returns only when 4 are in flight at once (a barrier), so the
    # call completes only if both servers hold 2 at the same time; no server ever holds more than 2.
    monkeypatch.setenv("FLOWGRPO_JUDGE_CONCURRENCY", "2")
    barrier = threading.Barrier(4, timeout=60)

    def together(body):
        barrier.wait()
        return distribution(body)
    a, b = judges(together), judges(together)
    fn = rewards.make_reward(f"judge:match={a.url}+{b.url}")
    prompts = [f"image {i % 8}" for i in range(16)]
    scores, info = fn(torch.rand(16, 3, 8, 8), prompts)
    np.testing.assert_allclose(scores, [yes_mass(p) / 0.9 for p in prompts], rtol=1e-12)
    assert (a.max_in_flight, b.max_in_flight) == (2, 2) and len(a.bodies) + len(b.bodies) == 16
    assert list(info) == [f"judge:match@{a.url[7:]}+{b.url[7:]}"]
