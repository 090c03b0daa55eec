"""What one request may cost `python rewards.py serve`, measured (the server's own memory, in its own process), and
the client's bounds: hostile requests and replies on 127.0.0.1, bounded loops; the start-up check of every knob."""
import base64
import collections
import contextlib
import http.client
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import reward_http
import reward_server
import rewards
from test_nft_awm import train_here

ROOT = Path(__file__).resolve().parents[1]
NO_PROXY = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy")}


def png(width, height, noise=False) -> str:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8) if noise else \
        np.zeros((height, width, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_with_chunks(chunks) -> str:
    """A 1×1 PNG with `chunks` (bytes) between its header and its pixels."""
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)) + b"".join(chunks) + \
        chunk(b"IDAT", zlib.compress(b"\0\0\0\0")) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


def png_with_text(chunks: int, text_bytes: int) -> str:
    """A 1×1 PNG with `chunks` zTXt chunks of `text_bytes` each once decompressed (about 1 kB each on the wire)."""
    text = zlib.compress(b"a" * text_bytes, 9)
    return png_with_chunks(chunk(b"zTXt", b"key%d\0\0" % k + text) for k in range(chunks))  # kept: keywords differ


def body(images: list[str]) -> bytes:
    return json.dumps({"images": images, "prompts": ["p"] * len(images)}).encode()


def wait_until(condition, seconds=60.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.02)
    return condition()


def post(port: int, raw: bytes, headers: bytes = b"") -> tuple[int, str]:
    """(status, body) of a raw POST /score, on a socket (no urllib: the test controls every byte)."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n" + (headers or b"Content-Length: %d\r\n" % len(raw)) +
                  b"\r\n" + raw)
        answer = s.makefile("rb").read().decode(errors="replace")
    head, _, text = answer.partition("\r\n\r\n")
    return int(head.split()[1]) if head.startswith("HTTP/") else 0, text


class Server:
    """`python rewards.py serve --reward brightness` in its own process, with its memory from /proc."""

    def __init__(self, *flags):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "rewards.py"), "serve", "--reward", "brightness",
                                      "--port", "0", *flags], cwd=ROOT, stdout=subprocess.PIPE, text=True, env=NO_PROXY)
        self.port = int(self.proc.stdout.readline().split(" on ")[-1].split()[0].rsplit(":", 1)[1])
        assert post(self.port, body([png(8, 8)]))[0] == 200  # warmed up: imports and first allocations done

    def memory(self) -> dict[str, int]:
        """VmRSS (now) and VmHWM (the peak so far), bytes."""
        lines = Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

    def close(self):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def server():
    started = []

    def start(*flags):
        started.append(Server(*flags))
        return started[-1]
    yield start
    for s in started:
        s.close()


def test_text_chunks_and_flat_json_cost_the_server_little(server):
    """16 one-pixel PNGs with 64 zTXt chunks of 1 MiB each (1.4 MB on the wire): Pillow kept up to 64 MiB of text per
    image and every image was held, +945 MB measured before. A flat 24 MiB body of `{},` made ~8 M dicts, +578 MB.
    Both are refused now, for what the body itself costs."""
    s = server()
    hostile = body([png_with_text(64, 2**20)] * 16)
    assert len(hostile) < 1.5e6
    before = s.memory()["VmRSS"]
    status, text = post(s.port, hostile)
    assert status == 400 and "text chunks" in text, text
    flat = b"[" + b"{}," * (8 * 2**20) + b"{}]"
    status, text = post(s.port, flat)
    assert status == 413 and "--max-json-values" in text, text
    grown = (s.memory()["VmHWM"] - before) / 2**20
    assert grown < 100, f"the server's peak memory grew by {grown:.0f} MiB for a 1.4 MB and a 24 MiB request"
    assert post(s.port, body([png(8, 8)]))[0] == 200


def test_a_png_of_many_empty_chunks_is_refused_from_their_headers():
    """A 1×1 PNG with a million empty private chunks (15 MiB sent) took 33 s and +222 MiB to parse, twice, holding its
    working slot past its deadline; now refused from the chunks' headers, at the 4,097th chunk (header and pixels
    counted), while 4,096 are read."""
    many = png_with_chunks([chunk(b"prIv", b"")] * 2**20)
    with pytest.raises(reward_server.Refused, match=r"images\[0\] has more than 4096 PNG chunks"):
        reward_server.read_images([many], reward_server.Limits())
    with pytest.raises(reward_server.Refused, match="has more than 4096 PNG chunks"):
        reward_server.read_images([png_with_chunks([chunk(b"prIv", b"")] * 4095)], reward_server.Limits())
    ok = reward_server.read_images([png_with_chunks([chunk(b"prIv", b"")] * 4094)], reward_server.Limits())
    assert ok.shape == (1, 3, 1, 1)


def test_memory_per_pixel_at_the_limit_is_what_the_readme_says(server):
    """4 noise images of 1024² (4.2 M pixels, a 17 MB body) scored by brightness: the server's peak memory grows by
    at most the 16 bytes per pixel docs/rewards.md states (12 measured there; 31–35 before: every decoded image held
    twice over, two float copies of the batch)."""
    s = server("--max-request-pixels", str(4 * 1024**2))
    request = body([png(1024, 1024, noise=True)] * 4)
    before = s.memory()["VmRSS"]
    assert post(s.port, request)[0] == 200
    per_pixel = (s.memory()["VmHWM"] - before) / (4 * 1024**2)
    print(f"server memory at the pixel limit: {per_pixel:.1f} bytes per pixel ({len(request) / 2**20:.0f} MiB body)")
    assert per_pixel <= 16, f"{per_pixel:.1f} bytes per pixel, docs/rewards.md says at most 16"


def test_a_connections_headers_cost_the_server_little(server):
    """8 connections, each sending what http.server itself accepts, 98 headers of 64 kB, then waiting: +326 MiB
    measured before, held while they waited. The server keeps a thread for up to 64 connections now, so a request
    line and headers of more than HEADER_BYTES (128 KiB) are answered 431 and the connection closed."""
    s = server()
    head = b"POST /score HTTP/1.1\r\nContent-Length: 10\r\n" + b"".join(
        b"X-%d: %s\r\n" % (k, b"a" * 65000) for k in range(98)) + b"\r\n"
    before = s.memory()["VmRSS"]
    sockets = [socket.create_connection(("127.0.0.1", s.port), timeout=5) for _ in range(8)]
    for c in sockets:
        with contextlib.suppress(OSError):  # the server answers and closes before all of it is sent
            c.sendall(head)
    for c in sockets:
        with contextlib.suppress(OSError):  # its answer or end of stream; before, nothing for 60 s (this 5 s timeout)
            c.recv(1)
        c.close()
    grown = (s.memory()["VmHWM"] - before) / 2**20
    assert grown < 50, f"the server's peak memory grew by {grown:.0f} MiB for 8 connections' headers"
    assert post(s.port, body([png(8, 8)]))[0] == 200


# ---------------------------------------------------------------- in-process servers: refusals, slots, headers
@pytest.fixture
def serve():
    servers = []

    def start(spec="brightness", **limits):
        server = reward_server.make_server(rewards.make_reward(spec), spec, limits=reward_server.Limits(**limits))
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server.server_address[1]
    start.servers = servers  # for a test that looks inside the last one started
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_images_per_request_and_an_odd_content_length_are_refused_with_a_message(serve, capfd):
    port = serve(max_request_images=4)
    status, text = post(port, body([png(2, 2)] * 5))
    assert status == 413 and "5 images" in text and "--max-request-images" in text, text
    assert post(port, body([png(2, 2)] * 4))[0] == 200
    # '²'.isdigit() is True but int('²') raises: the old server answered nothing and logged a traceback.
    status, text = post(port, b"{}", "Content-Length: ²\r\n".encode())
    assert status == 400 and "is not a number of bytes" in text, text
    # Past int()'s 4300 digits: the old server answered nothing and logged a traceback (int() raised ValueError).
    status, text = post(port, b"{}", b"Content-Length: " + b"9" * 5000 + b"\r\n")
    assert status == 413 and "--max-request-mb" in text, text
    assert "Traceback" not in capfd.readouterr().err


def test_idle_connections_are_closed_at_the_header_deadline_and_the_client_outlasts_the_longest_wait(
        serve, monkeypatch):
    """Eight silent sockets held all eight slots for the whole request timeout (60 s) while the client gave up after
    15 s of 503s: a run stopped. Headers have a deadline of their own: silent sockets that take every connection the
    server keeps open (2 here) are closed then. And the client's default retries wait longer than the server keeps a
    request waiting for a working slot before it answers 503 (the request timeout)."""
    client = reward_http.client_from_env("FLOWGRPO_REMOTE", "remote reward server", "")
    budget = sum(client.backoff * 2**i for i in range(client.retries))
    assert budget > reward_server.Limits().request_timeout, (budget, reward_server.Limits().request_timeout)
    port = serve(max_connections=2, header_timeout=0.5)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    monkeypatch.setenv("FLOWGRPO_REMOTE_BACKOFF", "0.05")  # the default 6 retries, 20× faster: 3.15 s > 0.5 s
    scores, _ = rewards.make_reward(f"remote=http://127.0.0.1:{port}")(torch.zeros(1, 3, 8, 8), ["p"])
    assert scores.tolist() == [0.0]
    for s in idle:
        assert s.recv(1) == b"", "the server still holds a silent connection"  # closed by the server, not the 30 s
        s.close()


def exchanges(port: int, raw: bytes, times: int, before=lambda: None) -> dict[str, int]:
    """What `times` requests of the trainer's client (reward_http.exchange, one attempt each) got: "STATUS REPLY", or
    the exception's name where no reply could be read."""
    got = collections.Counter()
    for _ in range(times):
        before()
        try:
            status, reply = reward_http.exchange(f"http://127.0.0.1:{port}", "/score", raw, 60, 2**20)
            got[f"{status} {reply.decode()[:60]}"] += 1
        except (OSError, http.client.HTTPException) as e:
            got[type(e).__name__] += 1
    return dict(got)


def test_a_newcomer_to_a_full_house_reads_its_503(serve, monkeypatch):
    """Every seat held by a request whose body is awaited (none idle): a newcomer was written its 503 and closed unread,
    so its request met a reset, which the client read instead (20 attempts of 20: a broken pipe as it sent the
    request). Now what it sends is read and dropped after the 503 until it closes, whatever its size, for LINGER
    seconds at most (5 here, for a loaded machine; then the connection is closed, and a client still sending is reset).
    """
    monkeypatch.setattr(reward_server, "LINGER", 5.0, raising=False)
    port = serve(max_connections=2, body_rate=1e-3)  # a body of 100 bytes awaited for 1000 s: the seats stay held
    server = serve.servers[-1]
    held = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2)]
    for s in held:
        s.sendall(b"POST /score HTTP/1.0\r\nContent-Length: 100\r\n\r\n")
    assert wait_until(lambda: server.open == 2 and not server.idle), (server.open, len(server.idle))

    def gone():  # every turned-away connection closed
        return not any(t.name.endswith("(_turn_away)") for t in threading.enumerate())
    for size in (10, 8 * 2**20):  # a request the socket buffers hold, and one they do not
        got = exchanges(port, b"x" * size, 3, before=lambda: wait_until(gone))
        assert got == {'503 {"error": "busy: too many connections"}': 3}, (size, got)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # a newcomer that never stops sending
        start = time.monotonic()
        with contextlib.suppress(OSError):  # reset once the server stops reading
            while time.monotonic() - start < 60:
                s.sendall(b"x" * 2**16)
        took = time.monotonic() - start
    assert took < 30, f"a newcomer sending without end was read for {took:.1f} s (LINGER: 5 s)"
    assert wait_until(gone), "a turned-away connection is still read from"
    for s in held:
        s.close()


def test_slow_requests_waiting_for_slots_do_not_starve_a_client_of_another_address(serve):
    """Sockets from one address sending the headers of a slow POST, then waiting for a working slot, each reconnected
    whenever cut, more than the server has seats (9 for 8, 2 slots): a waiting connection was never given up for a
    newcomer, so they held every seat and the client was turned away (0 of 20 attempts scored, 16 seats and 2 slots:
    503s, broken pipes, its request closed unanswered as it waited). Now a newcomer closes the oldest waiting
    connection of the address with the most of them, if more than its own: the client's request waits its turn
    (each holder keeps the slot a second, cut for its missing body) and theirs cannot close it."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.2", 0))  # Linux routes all of 127/8 to the loopback
        except OSError:
            pytest.skip("no second loopback address (127.0.0.2) to send from")
    port = serve(max_connections=8, max_requests=2)
    stop, cut = threading.Event(), []

    def hold():
        while not stop.is_set():
            with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=("127.0.0.2", 0)) as s:
                with contextlib.suppress(OSError):
                    s.sendall(b"POST /score HTTP/1.0\r\nContent-Length: 1000\r\n\r\n")  # and no body
                    while s.recv(4096):
                        pass
            cut.append(1)
    holders = [threading.Thread(target=hold, daemon=True) for _ in range(9)]
    for t in holders:
        t.start()
    try:
        assert wait_until(lambda: len(cut) >= 20), len(cut)  # the ninth is turned away over and over: every seat taken
        got = exchanges(port, body([png(8, 8)]), 3)
        assert got == {'200 {"scores": [0.0], "info": {"brightness": [0.0]}}': 3}, got
    finally:
        stop.set()
        for t in holders:
            t.join(timeout=30)


def test_the_largest_body_at_the_slowest_rate_fits_the_request_deadline(capsys):
    """The defaults allowed a body of 256 MiB at 1 MiB/s, 257 s with the first second's grace, and cut any request at
    60 s (--request-timeout), a legal slow one too, with no answer. The defaults fit now, with room for a trainer's 16
    PNGs of 512² (16 MiB of noise as base64); a combination that does not is refused at start-up in one line."""
    limits = reward_server.Limits()
    slowest = 1 + limits.max_request_mb * 2**20 / limits.body_rate
    assert slowest <= limits.request_timeout, \
        f"the largest body at the slowest rate takes {slowest:.0f} s, {slowest - limits.request_timeout:.0f} s past " \
        f"the request timeout ({limits.request_timeout:g} s)"
    sixteen = len(body([png(512, 512, noise=True)] * 16))
    assert sixteen <= limits.max_request_mb * 2**20, f"16 noise PNGs of 512² are {sixteen / 2**20:.1f} MiB"

    def never(spec):
        raise AssertionError("the reward was built")
    with pytest.raises(SystemExit) as e:
        reward_server.serve_cli(never, lambda spec: None, ["serve", "--reward", "brightness", "--port", "0",
                                                           "--max-request-mb", "256", "--body-rate", "1048576"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.splitlines()[-1].endswith(
        "error: --max-request-mb 256 at --body-rate 1048576 takes 257 s, over --request-timeout 60: raise it or "
        "--body-rate, or lower --max-request-mb"), err


# ---------------------------------------------------------------- the client: huge scores, the knobs
class Fixed(BaseHTTPRequestHandler):
    """A remote reward server answering every image with SCORE."""
    SCORE = 1e308

    def do_GET(self):
        self.reply(b'{"status": "ok"}')

    def do_POST(self):
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompts"])
        self.reply(json.dumps({"scores": [self.SCORE] * n}).encode())

    def reply(self, raw):
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):
        pass


@pytest.fixture
def huge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Fixed)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_total_reward_that_overflows_stops_with_the_reward_named(huge):
    scores, _ = rewards.make_reward(f"remote={huge}")(torch.zeros(2, 3, 8, 8), ["a", "b"])  # 1e308 is finite ...
    with pytest.raises(ValueError, match=r"--reward remote=.*rewards \(largest \|r\| 1e\+308\) have no finite mean"):
        rewards.check_iteration(torch.as_tensor(scores), f"remote={huge}")  # ... twice it is not
    with pytest.raises(ValueError, match=r"--reward brightness,remote=.*=2: the weighted total of .* is inf"):
        rewards.make_reward(f"brightness,remote={huge}=2")(torch.zeros(1, 3, 8, 8), ["a"])


def test_a_run_whose_rewards_overflow_stops_naming_the_reward(huge, tmp_path):
    """Before: reward/mean inf, the loss NaN, every optimizer step skipped, and the run exited 0. Now the loop
    (flowgrpo.main, in this process: test_nft_awm.train_here) stops with a ValueError naming the reward, which
    flowgrpo.py prints in one line, exiting 1 (as test_knobs_are_refused_by_the_cli_before_anything_is_built sees)."""
    with pytest.raises(ValueError, match="^" + re.escape(f"--reward remote={huge}: this iteration's rewards")):
        train_here("--model", "tiny", "--reward", f"remote={huge}", "--iterations", "2", "--group-size", "2",
                   "--prompts-per-iteration", "2", "--micro-batch", "2", "--eval-every", "0",
                   "--run-dir", str(tmp_path / "run"))


@pytest.mark.parametrize("name, value", [("FLOWGRPO_REMOTE_TIMEOUT", "inf"), ("FLOWGRPO_REMOTE_RETRIES", "1e999"),
                                         ("FLOWGRPO_REMOTE_BACKOFF", "nan"), ("FLOWGRPO_REMOTE_BATCH", "0"),
                                         ("FLOWGRPO_JUDGE_CONCURRENCY", "many"), ("FLOWGRPO_JUDGE_TIMEOUT", "-1")])
def test_every_knob_is_checked_at_start_up_like_a_flag(monkeypatch, name, value):
    """FLOWGRPO_REMOTE_TIMEOUT=inf raised an OverflowError once the model was built; now the start-up check of
    --reward names the variable, before any connection."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"{name}='{value}': must be a"):
        rewards.check_reward_spec("brightness,remote=http://192.0.2.1:8000,judge:match=http://192.0.2.1:8001")


def test_knobs_are_refused_by_the_cli_before_anything_is_built(tmp_path, monkeypatch, capsys):
    """Through the CLI (one line, exit 1) for the reward's knob; the rollout's in this process (test_nft_awm.train_here:
    the same start-up, without a new interpreter's imports). Neither makes the run directory."""
    out = subprocess.run([sys.executable, str(ROOT / "flowgrpo.py"), "--reward", "remote=http://127.0.0.1:9",
                          "--run-dir", str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=NO_PROXY | {"FLOWGRPO_REMOTE_TIMEOUT": "inf"})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("flowgrpo.py: error: ") and \
        "FLOWGRPO_REMOTE_TIMEOUT='inf'" in out.stderr, out.stderr[-2000:]
    assert "batch arithmetic" not in out.stdout and not (tmp_path / "r").exists()
    monkeypatch.setenv("FLOWGRPO_ROLLOUT_TIMEOUT", "inf")
    with pytest.raises(ValueError, match="FLOWGRPO_ROLLOUT_TIMEOUT"):
        train_here("--rollout", "vllm-omni", "--rollout-url", "http://127.0.0.1:9", "--run-dir", str(tmp_path / "r"))
    assert "batch arithmetic" not in capsys.readouterr().out and not (tmp_path / "r").exists()
