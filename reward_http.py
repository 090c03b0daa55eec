"""Rewards over HTTP, transport only: the client (a whole-request deadline, retries with backoff, bounded replies,
no proxy), the daemon workers that requests wait on, and the bounded server of any scoring function with its command
line (`python rewards.py serve` hands it a reward). Nothing here knows a reward: rewards.py builds the remote-reward
and judge clients on this.

Clients connect directly: http_proxy, https_proxy and no_proxy are ignored, as by the vLLM-Omni rollout client
(the servers are on the trainer's own network). A request that has no complete answer within its deadline fails
as a connection error does: retried with exponential backoff, then the run stops with an error naming the server.
The server bounds what a request may cost: bytes, JSON values, images, decoded pixels (checked in the PNG headers
before decoding), the PNG text Pillow keeps, concurrent connections, and the time to send the headers and the whole
request; its errors carry a message, never a traceback.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import dataclasses
import http.client
import io
import json
import os
import queue
import socket
import threading
import time
import traceback
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image, PngImagePlugin


# ---------------------------------------------------------------- the client
class Watchdog:
    """Shuts a socket down `seconds` from now unless cancelled first: a read or write blocked on it in any thread then
    fails at once. (A socket timeout applies per read: a peer trickling one byte a second never reaches it.)"""

    def __init__(self, sock: socket.socket, seconds: float):
        self.sock, self.fired = sock, False
        self.timer = threading.Timer(max(seconds, 0.0), self._fire)
        self.timer.daemon = True
        self.timer.start()

    def _fire(self):
        self.fired = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def cancel(self):
        self.timer.cancel()


def exchange(url: str, path: str, body: bytes | None, deadline: float, max_reply: int) -> tuple[int, bytes]:
    """One GET (body None) or JSON POST -> (status, reply body), all of it within `deadline` seconds; a direct
    connection, whatever the proxy variables say. Raises OSError or HTTPException (TimeoutError past the deadline)."""
    u = urllib.parse.urlsplit(url)
    connection = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn, end = connection(u.hostname, u.port, timeout=deadline), time.monotonic() + deadline
    try:
        conn.connect()  # bounded by the socket timeout; the watchdog needs the socket
        dog = Watchdog(conn.sock, end - time.monotonic())
        try:
            conn.request("GET" if body is None else "POST", path or "/", body=body,
                         headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            status, raw = reply.status, reply.read(max_reply + 1)  # never more: a huge reply is refused, not held
        except (OSError, http.client.HTTPException) as e:  # a socket timeout too: one read took the whole deadline
            if dog.fired or isinstance(e, TimeoutError):
                raise TimeoutError(f"no complete answer within the {deadline:g} s deadline") from None
            raise
        finally:
            dog.cancel()
    finally:
        conn.close()
    if dog.fired:  # a reply without Content-Length ends at the shutdown as if complete
        raise TimeoutError(f"no complete answer within the {deadline:g} s deadline")
    if len(raw) > max_reply:
        raise http.client.HTTPException(f"a reply of more than {max_reply} bytes")
    return status, raw


# The retry budget, 1 + 2 + 4 + 8 + 16 + 32 = 63 s of backoff, outlasts the longest a reward server holds a slot
# for a client that never finishes its request (Limits.request_timeout, 60 s): filling the slots cannot stop a run.
RETRIES = 6


@dataclass(frozen=True)
class Client:
    """JSON over HTTP to one kind of server (`what`, named in every error). Connection errors, the deadline and 5xx
    are retried with exponential backoff (backoff, 2·backoff, ...); 4xx and replies that are not JSON are not."""
    what: str
    hint: str  # what to check when a server stays down
    deadline: float = 120.0  # seconds for one attempt: connect, send, wait, read
    retries: int = RETRIES
    backoff: float = 1.0
    max_reply: int = 2**20  # bytes: a reward's or a judge's answer is a few kB, and its JSON is parsed in memory

    def call(self, url: str, path: str, body: dict | None = None, about: str = ""):
        data, last = None if body is None else json.dumps(body).encode(), None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, raw = exchange(url, path, data, self.deadline, self.max_reply)
            except (OSError, http.client.HTTPException) as e:  # refused, reset, cut off, past the deadline, too long
                last = f"{type(e).__name__}: {e}"
                continue
            text = raw.decode(errors="replace")
            if status >= 500:
                last = f"HTTP {status}: {text[:500]}"
                continue
            if status >= 300:
                raise ValueError(f"{self.what} {url}{path} refused the request{about}: HTTP {status}: {text[:2000]}")
            try:
                return json.loads(text)
            except (ValueError, RecursionError):
                raise ValueError(f"{self.what} {url}{path} answered{about} with a body that is not JSON: "
                                 f"{text[:300]!r}") from None
        raise RuntimeError(f"{self.what} {url}{path} failed {self.retries + 1} times{about} (last: {last}); "
                           f"{self.hint}")


def knob(name: str, default, lo, hi):
    """The environment variable `name` as a number of default's type in [lo, hi] (unset: default), checked at
    start-up like a flag: a value that is not such a number (inf, nan, 1e999 too) is a ValueError naming it."""
    raw = os.environ.get(name, str(default))
    with contextlib.suppress(ValueError):
        if lo <= (value := type(default)(raw)) <= hi:  # nan compares false
            return value
    raise ValueError(f"{name}={raw!r}: must be a {type(default).__name__} in [{lo:g}, {hi:g}] (unset: {default})")


def client_from_env(prefix: str, what: str, hint: str) -> Client:
    """A Client with <prefix>_TIMEOUT (the whole-request deadline, s), _RETRIES and _BACKOFF (s), each a `knob`."""
    return Client(what, hint, knob(f"{prefix}_TIMEOUT", 120.0, 1e-3, 86400.0),
                  knob(f"{prefix}_RETRIES", RETRIES, 0, 20), knob(f"{prefix}_BACKOFF", 1.0, 0.0, 3600.0))


def png_base64(image: np.ndarray) -> str:
    """(H, W, 3) uint8 -> base64 PNG (fast compression: the pixels, not the bytes, matter)."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


class Workers:
    """Daemon threads taking jobs from one queue; thread i calls each of its jobs as fn(keys[i], *args) (a key is,
    e.g., a server URL, listed once per request that server may have in flight). Unlike ThreadPoolExecutor's threads,
    daemon threads are not joined at exit: a request stuck on a hung server cannot keep a stopped (Ctrl-C) run alive."""

    def __init__(self, keys, name: str):
        self.jobs, self.size = queue.SimpleQueue(), len(keys)
        for i, key in enumerate(keys):
            threading.Thread(target=self._work, args=(key,), name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future = Future()
        self.jobs.put((future, fn, args))
        return future

    def _work(self, key):
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(key, *args))
                except BaseException as e:  # handed to whoever waits on the future
                    future.set_exception(e)
            del job, future, fn, args  # hold no chunk of images while idle

    def close(self):
        for _ in range(self.size):
            self.jobs.put(None)


def gather(futures: list[Future]) -> list:
    """The futures' results, in order. The first to fail raises at once, without waiting for the others (a chunk or
    request stuck on a hung server); those not started yet are cancelled. The wait wakes every second: a signal the OS
    hands to another thread runs its handler (SIGTERM, Ctrl-C) only once the main thread runs Python code again."""
    while wait(futures, timeout=1.0, return_when=FIRST_EXCEPTION).not_done and not any(
            f.done() and f.exception() is not None for f in futures):
        pass
    failed = [f for f in futures if f.done() and f.exception() is not None]
    if failed:
        for f in futures:
            f.cancel()
        failed[0].result()  # raises its error
    return [f.result() for f in futures]


# ---------------------------------------------------------------- the server: python rewards.py serve
@dataclass(frozen=True)
class Limits:
    """What one request may cost the server (each is a `serve` flag). Memory: at most max_connections requests are held
    at once, each about 3× its body while it is parsed, then its images' pixels (3 bytes each) and what the reward
    itself takes: at most 16 bytes per pixel at the limit, 12 measured (docs/rewards.md)."""
    max_request_mb: float = 256.0  # request body
    max_json_values: int = 2**16  # JSON values in the body, counted before it is parsed (each costs up to ~72 bytes)
    max_request_images: int = 64  # images in one request
    max_image_pixels: int = 2048 * 2048  # per image, read from the PNG header before decoding
    max_request_pixels: int = 2**25  # per request (e.g. 16 images of 1448²)
    max_connections: int = 8  # more are answered 503 at once (clients retry with backoff)
    header_timeout: float = 10.0  # seconds to send the request line and headers: an idle connection's hold on a slot
    request_timeout: float = 60.0  # seconds to send a whole request; also each socket read and write


PNG_TEXT = 2**16  # bytes of PNG text (zTXt, iCCP, ...) Pillow may inflate per image (default: 64 MiB); ours have none


class Refused(Exception):
    def __init__(self, code: int, message: str):  # the HTTP status and the reply's message
        super().__init__(message)
        self.code = code


def _png(s: str, i: int, limits: Limits) -> Image.Image:
    """images[i] opened: its header read, its pixels not yet decoded."""
    try:
        return Image.open(io.BytesIO(base64.b64decode(s, validate=True)), formats=["PNG"])
    except Image.DecompressionBombError:  # a header of more than 2 * PIL's own limit (~179 M pixels)
        raise Refused(413, f"images[{i}] is over the server's limit of {limits.max_image_pixels} pixels per "
                           "image (--max-image-pixels)") from None
    except (binascii.Error, ValueError, OSError):  # ValueError: also Pillow's refusal of text over PNG_TEXT
        raise Refused(400, f"images[{i}] is not a base64-encoded PNG (with at most {PNG_TEXT} bytes of text "
                           "chunks)") from None


def read_images(encoded: list, limits: Limits) -> torch.Tensor:
    """base64 PNGs -> (B, 3, H, W) uint8, the pixels themselves (a reward takes them as they are). Every size is read
    from its PNG header and checked before any image is decoded; then each image is decoded, and held, only while it
    is copied into the batch, and its entry of `encoded` is dropped: the request's text goes as its pixels come."""
    if len(encoded) > limits.max_request_images:
        raise Refused(413, f"the request holds {len(encoded)} images, over the server's limit of "
                           f"{limits.max_request_images} (--max-request-images): lower FLOWGRPO_REMOTE_BATCH")
    sizes = []
    for i, s in enumerate(encoded):
        with _png(s, i, limits) as png:
            sizes.append(png.size)
        if png.width * png.height > limits.max_image_pixels:
            raise Refused(413, f"images[{i}] is {png.width}x{png.height}, over the server's limit of "
                               f"{limits.max_image_pixels} pixels per image (--max-image-pixels)")
    total = sum(w * h for w, h in sizes)
    if total > limits.max_request_pixels:
        raise Refused(413, f"the request holds {total} pixels, over the server's limit of {limits.max_request_pixels} "
                           "(--max-request-pixels): lower FLOWGRPO_REMOTE_BATCH")
    if len(set(sizes)) > 1:
        raise Refused(400, f"the images differ in size: {sorted(set(sizes))}")
    batch = np.empty((len(encoded), sizes[0][1], sizes[0][0], 3), np.uint8)
    for i, s in enumerate(encoded):
        try:
            with _png(s, i, limits) as png:
                batch[i] = png.convert("RGB")
        except (OSError, ValueError, SyntaxError) as e:  # a truncated or corrupt PNG body
            raise Refused(400, f"images[{i}] could not be decoded: {type(e).__name__}") from None
        encoded[i] = None  # its text goes
    return torch.from_numpy(batch).permute(0, 3, 1, 2)


def parse_request(raw: bytes, limits: Limits) -> tuple[list, list, list | None]:
    """The body of POST /score -> (base64 images, prompts, metadata), or Refused naming what is wrong."""
    # Every JSON value but a container's first follows a comma, and every container opens with a bracket: this count
    # (strings' own commas included) bounds the objects json.loads would make, ~72 bytes each ("{}," makes a dict).
    values = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
    if values > limits.max_json_values:
        raise Refused(413, f"the body holds up to {values} JSON values, over the server's limit of "
                           f"{limits.max_json_values} (--max-json-values)")
    try:
        req = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        raise Refused(400, "the body is not JSON") from None
    if not isinstance(req, dict):
        raise Refused(400, 'the body must be a JSON object {"images": [...], "prompts": [...], "metadata": [...]}')
    images, prompts, metadata = req.get("images"), req.get("prompts"), req.get("metadata")
    if not (isinstance(images, list) and images and all(isinstance(s, str) for s in images)):
        raise Refused(400, '"images" must be a non-empty list of base64 PNG strings')
    if not (isinstance(prompts, list) and len(prompts) == len(images) and all(isinstance(p, str) for p in prompts)):
        raise Refused(400, f'"prompts" must be a list of {len(images)} strings, one per image')
    if metadata is not None and not (isinstance(metadata, list) and len(metadata) == len(images)
                                     and all(isinstance(m, dict) for m in metadata)):
        raise Refused(400, f'"metadata" must be absent or a list of {len(images)} objects, one per image')
    return images, prompts, metadata


class _Server(ThreadingHTTPServer):
    daemon_threads, request_queue_size = True, 64  # the listen backlog: connections waiting to be accepted

    def __init__(self, address, handler, max_connections: int):
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):  # full: answer at once, hold no thread
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\n\r\n{\"error\": \"busy: too many connections\"}")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def make_server(score, name: str, host: str = "127.0.0.1", port: int = 0,
                limits: Limits = Limits()) -> ThreadingHTTPServer:
    """A server of `score(images (B, 3, H, W), prompts, metadata) -> (scores, info)`, named `name` at GET /health;
    POST /score takes JSON with base64 PNG images."""
    max_bytes = int(limits.max_request_mb * 2**20)
    PngImagePlugin.MAX_TEXT_CHUNK = PngImagePlugin.MAX_TEXT_MEMORY = PNG_TEXT  # read by Pillow at every open

    class Handler(BaseHTTPRequestHandler):
        timeout = limits.request_timeout  # each socket read and write

        def setup(self):
            super().setup()
            self.header_dog = Watchdog(self.connection, limits.header_timeout)  # until the headers are in
            self.dog = Watchdog(self.connection, limits.request_timeout)  # the whole request

        def finish(self):
            self.header_dog.cancel()
            self.dog.cancel()
            with contextlib.suppress(OSError):
                super().finish()

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.header_dog.cancel()
            ok = self.path == "/health"
            self._send(200 if ok else 404, {"status": "ok", "reward": name} if ok else {"error": "GET /health"})

        def _read(self):
            if self.path != "/score":
                raise Refused(404, "POST /score")
            size = self.headers.get("Content-Length")
            if size is None:
                raise Refused(411, "POST /score needs a Content-Length")
            if not (size.strip().isascii() and size.strip().isdigit()):  # '²'.isdigit() is True, int('²') fails
                raise Refused(400, f"Content-Length {size[:40]!r} is not a number of bytes")
            size = int(size)
            if size > max_bytes:
                # Read (and drop) what the client sends, so that it reads this reply rather than a reset; the loop
                # ends at end of stream, and the watchdog ends it at the request deadline.
                while size > 0 and (chunk := self.rfile.read(min(size, 2**16))):
                    size -= len(chunk)
                raise Refused(413, f"a request of {self.headers['Content-Length']} bytes is over the server's limit "
                                   f"of {max_bytes} (--max-request-mb): lower FLOWGRPO_REMOTE_BATCH")
            raw = self.rfile.read(size)
            if len(raw) < size:
                raise Refused(400, f"the body ended after {len(raw)} of {size} bytes")
            return raw

        def do_POST(self):
            self.header_dog.cancel()
            try:
                try:
                    encoded, prompts, metadata = parse_request(self._read(), limits)  # the body is freed here
                    images = read_images(encoded, limits)
                except Refused as e:
                    return self._send(e.code, {"error": str(e)})
                self.dog.cancel()  # the request is in; scoring takes what the reward takes
                try:
                    scores, info = score(images, prompts, metadata)
                except ValueError as e:  # the reward's own message about its input (e.g. no quoted text)
                    return self._send(422, {"error": str(e)})
                except Exception as e:
                    self.log_error("the reward failed:\n%s", traceback.format_exc())
                    return self._send(500, {"error": f"the reward failed ({type(e).__name__}); the server's log "
                                                     "has the traceback"})
                self._send(200, {"scores": scores.tolist(), "info": {k: v.tolist() for k, v in info.items()}})
            except OSError:  # the client left, was too slow, or passed the deadline: nobody to answer
                self.close_connection = True

    return _Server((host, port), Handler, limits.max_connections)


def serve_cli(build, check, argv=None) -> None:
    """`python rewards.py serve --reward SPEC --port P [limits]`: `check(SPEC)` refuses a bad spec in one line, then
    the server of `build(SPEC)` (a scoring function) runs until stopped."""
    p = argparse.ArgumentParser(prog="rewards.py", description="Serve a reward over HTTP for "
                                "`--reward remote=http://HOST:PORT`.")
    s = p.add_subparsers(dest="cmd", required=True).add_parser(
        "serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--reward", required=True, help="a reward spec, as for flowgrpo.py --reward")
    s.add_argument("--port", type=int, required=True, help="0 picks a free port (printed)")
    s.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes it to the network")
    helps = dict(max_request_mb="largest request body", max_json_values="most JSON values in a body",
                 max_request_images="most images in one request", max_image_pixels="largest image (width × height)",
                 max_request_pixels="most pixels in one request", max_connections="connections served at once",
                 header_timeout="seconds to send the headers", request_timeout="seconds to send the whole request")
    for f in dataclasses.fields(Limits):
        s.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=helps[f.name])
    a = p.parse_args(argv)
    limits = Limits(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Limits)})
    if not all(0 < v < float("inf") for v in vars(limits).values()):
        p.error(f"every limit must be a finite number > 0, got {vars(limits)}")
    try:
        check(a.reward)
    except ValueError as e:
        p.error(str(e))
    server = make_server(build(a.reward), a.reward, a.host, a.port, limits)
    print(f"serving reward {a.reward!r} on http://{a.host}:{server.server_address[1]} with limits {vars(limits)}",
          flush=True)
    server.serve_forever()
