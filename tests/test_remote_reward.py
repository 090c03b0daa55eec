"""The remote reward over real HTTP on 127.0.0.1: `python rewards.py serve` and the `remote=URL` client."""
import json
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import rewards  # noqa: E402


def draw(text):
    img = Image.new("RGB", (320, 96), "white")
    ImageDraw.Draw(img).text((12, 24), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255


@pytest.fixture
def serve():
    """Start make_server(spec) in a thread on a free port; yields a starter returning the base URL."""
    servers = []

    def start(spec, **kw):
        server = rewards.make_server(spec, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"  # loopback unless --host says otherwise
        return f"http://{host}:{port}", server
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fast_retries(monkeypatch):
    """Few, short retries; records the backoff sleeps instead of sleeping."""
    monkeypatch.setenv("FLOWGRPO_REMOTE_RETRIES", "2")
    monkeypatch.setenv("FLOWGRPO_REMOTE_BACKOFF", "0.01")
    monkeypatch.setenv("FLOWGRPO_REMOTE_TIMEOUT", "20")
    sleeps = []  # rewards' own `time` only, so servers and subprocesses sleep normally
    monkeypatch.setattr(rewards, "time", types.SimpleNamespace(sleep=sleeps.append, perf_counter=time.perf_counter))
    return sleeps


def test_remote_equals_in_process_with_batching(serve, fast_retries, monkeypatch):
    # JPEG size changes with any pixel change, so equal scores mean both sides scored identical pixels,
    # although the images are float noise, not uint8 values.
    monkeypatch.setenv("FLOWGRPO_REMOTE_BATCH", "3")  # 7 images -> requests of 3, 3 and 1
    url, _ = serve("jpeg_compressibility")
    images, prompts = torch.rand(7, 3, 40, 24), [f"p{i}" for i in range(7)]
    meta = [{"i": i} for i in range(7)]
    local, _ = rewards.make_reward("jpeg_compressibility")(images, prompts, meta)
    remote, info = rewards.make_reward(f"remote={url}")(images, prompts, meta)
    np.testing.assert_array_equal(remote, local)
    assert list(info) == [f"remote@{url[len('http://'):]}"]
    # Inside a weighted list, with its own weight.
    total, info = rewards.make_reward(f"jpeg_incompressibility=1,remote={url}=0.5")(images, prompts, meta)
    np.testing.assert_array_equal(total, -local + 0.5 * local)
    assert fast_retries == []


def test_remote_ocr_equals_in_process(serve, fast_retries):
    url, _ = serve("ocr")
    images = torch.stack([draw("HELLO"), draw("HELLO WORLD")])
    prompts = ['a sign "hello world"'] * 2
    local, _ = rewards.make_reward("ocr")(images, prompts, None)
    remote, _ = rewards.make_reward(f"remote={url}")(images, prompts, None)
    np.testing.assert_array_equal(remote, local)
    assert local.tolist() == [0.5, 1.0]
    # A reward error on the server (no quoted text) comes back at once, with its message, unretried.
    with pytest.raises(ValueError, match=r"HTTP 422.*no text between double quotes"):
        rewards.make_reward(f"remote={url}")(images[:1], ["no quotes"], None)
    assert fast_retries == []


def test_cli_server_stopped_mid_run_retries_then_names_url(fast_retries):
    proc = subprocess.Popen([sys.executable, "rewards.py", "serve", "--reward", "jpeg_compressibility", "--port", "0"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # "serving reward ... on http://127.0.0.1:PORT"
        url = line.split(" on ")[-1].strip()
        assert url.startswith("http://127.0.0.1:"), line
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert json.loads(r.read())["status"] == "ok"
        fn = rewards.make_reward(f"remote={url}")
        images = torch.rand(2, 3, 16, 16)
        np.testing.assert_array_equal(fn(images, ["a", "b"])[0],
                                      rewards.make_reward("jpeg_compressibility")(images, ["a", "b"])[0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with pytest.raises(RuntimeError, match=f"remote reward server {url}/score failed 3 times"):
        fn(images, ["a", "b"])
    assert fast_retries == [0.01, 0.02]  # exponential backoff between the 3 attempts


def test_unreachable_server_fails_at_make_reward(fast_retries, serve):
    url, server = serve("jpeg_compressibility")
    server.shutdown()
    server.server_close()
    with pytest.raises(RuntimeError, match=f"{url}/health failed 3 times.*rewards.py serve"):
        rewards.make_reward(f"remote={url}")


def test_oversized_and_malformed_requests_are_refused(serve, fast_retries):
    url, _ = serve("jpeg_compressibility", max_request_mb=0.05)  # ~52 kB
    fn = rewards.make_reward(f"remote={url}")
    fn(torch.rand(1, 3, 32, 32), ["small"])  # ~4 kB: fine
    with pytest.raises(ValueError, match=r"HTTP 413.*exceeds the server's limit.*FLOWGRPO_REMOTE_BATCH"):
        fn(torch.rand(4, 3, 128, 128), ["big"] * 4)  # ~260 kB of noise PNGs
    assert fast_retries == []  # refused, not retried

    def post(body):
        req = urllib.request.Request(url + "/score", data=body, headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        return e.value.code, json.loads(e.value.read())["error"]

    assert post(b"x" * 200_000)[0] == 413
    assert post(b"{not json")[0] == 400
    assert post(json.dumps({"images": ["not base64 png"], "prompts": ["a"]}).encode())[0] == 400
    # The server is still healthy afterwards.
    assert fn(torch.rand(1, 3, 32, 32), ["small"])[0].shape == (1,)


def test_training_run_whose_reward_server_dies_fails_clearly_and_keeps_its_checkpoint(tmp_path):
    """The real loop with `--reward remote=URL`: the server is killed after the first checkpoints; the run
    retries, stops with an error naming the server, and its newest complete checkpoint still resumes."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(ROOT / "rewards.py"), "serve", "--reward", "brightness", "--port",
                               str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "run"
    env = {**__import__("os").environ, "FLOWGRPO_REMOTE_RETRIES": "2", "FLOWGRPO_REMOTE_BACKOFF": "0.2",
           "WANDB_MODE": "offline"}
    try:
        assert "serving reward" in server.stdout.readline()
        trainer = subprocess.Popen([sys.executable, str(ROOT / "flowgrpo.py"), "--model", "tiny", "--reward",
                                    f"remote=http://127.0.0.1:{port}", "--iterations", "30", "--checkpoint-every", "1",
                                    "--eval-every", "0", "--no-wandb", "--run-dir", str(run)], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while not (run / "checkpoints" / "iter_000001" / "meta.json").exists() and time.time() < deadline:
            assert trainer.poll() is None, trainer.communicate()
            time.sleep(0.1)
    finally:
        server.kill()
        server.wait()
    _, err = trainer.communicate(timeout=300)
    assert trainer.returncode != 0
    assert f"remote reward server http://127.0.0.1:{port}/score failed 3 times" in err
    import engine
    last = engine.list_checkpoints(str(run / "checkpoints"))[-1]
    assert engine.read_checkpoint_meta(last)["loop"]["iteration"] >= 1
