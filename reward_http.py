"""Rewards over HTTP: one client (a whole-request deadline, retries with backoff, no proxy), the remote-reward
client (`--reward remote=URL`), the vision-language judge client (`--reward judge:TASK=URL[+URL...]`), and the
reward server behind `python rewards.py serve`.

Both clients connect directly: http_proxy, https_proxy and no_proxy are ignored, as by the vLLM-Omni rollout client
(the servers are on the trainer's own network). A request that has no complete answer within its deadline fails
as a connection error does: retried with exponential backoff, then the run stops with an error naming the server.
The server bounds what a request may cost: bytes, decoded pixels (checked in the PNG header before decoding),
concurrent connections, and the time to send the request; its errors carry a message, never a traceback.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import http.client
import io
import json
import os
import socket
import threading
import time
import traceback
import urllib.parse
import weakref
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image

import rewards


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
            status, raw = reply.status, reply.read(max_reply + 1)
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


@dataclass(frozen=True)
class Client:
    """JSON over HTTP to one kind of server (`what`, named in every error). Connection errors, the deadline and 5xx
    are retried with exponential backoff (backoff, 2·backoff, ...); 4xx and replies that are not JSON are not."""
    what: str
    hint: str  # what to check when a server stays down
    deadline: float = 120.0  # seconds for one attempt: connect, send, wait, read
    retries: int = 4
    backoff: float = 1.0
    max_reply: int = 64 * 2**20

    def call(self, url: str, path: str, body: dict | None = None, about: str = ""):
        data, last = None if body is None else json.dumps(body).encode(), None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, raw = exchange(url, path, data, self.deadline, self.max_reply)
            except (OSError, http.client.HTTPException) as e:  # refused, reset, cut off, past the deadline
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
            except ValueError:
                raise ValueError(f"{self.what} {url}{path} answered{about} with a body that is not JSON: "
                                 f"{text[:300]!r}") from None
        raise RuntimeError(f"{self.what} {url}{path} failed {self.retries + 1} times{about} (last: {last}); "
                           f"{self.hint}")


def client_from_env(prefix: str, what: str, hint: str) -> Client:
    """A Client with <prefix>_TIMEOUT (the whole-request deadline, s), _RETRIES and _BACKOFF (s) from the
    environment."""
    c = Client(what, hint, rewards._env(f"{prefix}_TIMEOUT", 120.0), rewards._env(f"{prefix}_RETRIES", 4),
               rewards._env(f"{prefix}_BACKOFF", 1.0))
    if not (c.deadline > 0 and c.retries >= 0 and c.backoff >= 0):
        raise ValueError(f"{prefix}_TIMEOUT must be > 0, {prefix}_RETRIES >= 0 and {prefix}_BACKOFF >= 0")
    return c


def png_base64(image: np.ndarray) -> str:
    """(H, W, 3) uint8 -> base64 PNG (fast compression: the pixels, not the bytes, matter)."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------- remote rewards: the client
def remote(url: str):
    """--reward remote=URL: POST /score of a `python rewards.py serve`, FLOWGRPO_REMOTE_BATCH images a request."""
    client = client_from_env("FLOWGRPO_REMOTE", "remote reward server",
                             "is `python rewards.py serve` running and reachable there?")
    batch = rewards._env("FLOWGRPO_REMOTE_BATCH", 16)
    if batch < 1:
        raise ValueError(f"FLOWGRPO_REMOTE_BATCH must be >= 1, got {batch}")
    client.call(url, "/health")  # fail at start-up, not mid-run

    def fn(images, prompts, metadata):
        scores = []
        for i in range(0, len(images), batch):
            n = len(images[i:i + batch])
            body = {"images": [png_base64(a) for a in images[i:i + batch]], "prompts": prompts[i:i + batch],
                    "metadata": metadata[i:i + batch]}
            reply = client.call(url, "/score", body, f" for images {i}-{i + n - 1}")
            got = reply.get("scores") if isinstance(reply, dict) else None
            if not (isinstance(got, list) and len(got) == n
                    and all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in got)):
                raise ValueError(f"remote reward server {url}/score answered images {i}-{i + n - 1} with "
                                 f"{json.dumps(reply)[:300]}; expected {{\"scores\": [{n} numbers]}}")
            scores += got
        return scores
    return fn


# ---------------------------------------------------------------- the judge: a vision-language model over HTTP
def _judge_model(client: Client, urls: list[str]) -> str:
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


JUDGE_CONCURRENCY = 8  # requests in flight per judge server, unless FLOWGRPO_JUDGE_CONCURRENCY says otherwise


def judge(task: str, urls: list[str], concurrency: int | None = None):
    """--reward judge:TASK=URL[+URL...]: each image, with rewards.JUDGE_TASKS[task]'s question, to POST
    /v1/chat/completions of an OpenAI-compatible server (vLLM's `structured_outputs` constrain the answer), at
    temperature 0; `concurrency` (FLOWGRPO_JUDGE_CONCURRENCY, JUDGE_CONCURRENCY) requests in flight per server,
    each to whichever server is free."""
    spec = rewards.JUDGE_TASKS[task]
    client = client_from_env("FLOWGRPO_JUDGE", "judge server",
                             "is the judge (e.g. `vllm serve`) running and reachable there?")
    per_server = concurrency or rewards._env("FLOWGRPO_JUDGE_CONCURRENCY", JUDGE_CONCURRENCY)
    if per_server < 1:
        raise ValueError(f"FLOWGRPO_JUDGE_CONCURRENCY must be >= 1, got {per_server}")
    model = _judge_model(client, urls)
    workers = rewards.Workers(urls * per_server, "judge")

    def ask(url, image, prompt):
        content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_base64(image)}},
                   {"type": "text", "text": spec.question.format(prompt=prompt)}]
        body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, **spec.request}
        reply = client.call(url, "/v1/chat/completions", body, f" for prompt {prompt!r}")
        try:
            choice = reply["choices"][0]
            if choice["finish_reason"] != "stop":
                raise ValueError(f"finish_reason {choice['finish_reason']!r}: the answer is cut or refused")
            return spec.score(choice, prompt)
        except (LookupError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"judge server {url}: the reply for prompt {prompt!r} does not parse ({e}): "
                             f"{json.dumps(reply)[:600]}") from None

    def fn(images, prompts, metadata):
        for prompt in prompts if spec.check else ():
            spec.check(prompt)  # before any request
        return rewards.gather([workers.submit(ask, image, prompt) for image, prompt in zip(images, prompts)])
    weakref.finalize(fn, workers.close)
    return fn


# ---------------------------------------------------------------- the server: python rewards.py serve
@dataclass(frozen=True)
class Limits:
    """What one request may cost the server (each is a `serve` flag). Memory: at most max_connections requests are
    held at once, each up to max_request_mb of body plus ~16 bytes per decoded pixel while it is scored."""
    max_request_mb: float = 256.0  # request body
    max_image_pixels: int = 2048 * 2048  # per image, read from the PNG header before decoding
    max_request_pixels: int = 2**25  # per request (e.g. 16 images of 1448²)
    max_connections: int = 8  # more are answered 503 at once (clients retry with backoff)
    request_timeout: float = 60.0  # seconds to send a whole request; also each socket read and write


class Refused(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def read_images(encoded, limits: Limits) -> torch.Tensor:
    """base64 PNGs -> (B, 3, H, W) float in [0, 1]; sizes are checked in the PNG headers before anything is decoded."""
    headers = []
    for i, s in enumerate(encoded):
        try:
            headers.append(Image.open(io.BytesIO(base64.b64decode(s, validate=True)), formats=["PNG"]))
        except Image.DecompressionBombError:  # a header of more than 2 * PIL's own limit (~179 M pixels)
            raise Refused(413, f"images[{i}] is over the server's limit of {limits.max_image_pixels} pixels per "
                               "image (--max-image-pixels)") from None
        except (binascii.Error, ValueError, OSError):
            raise Refused(400, f"images[{i}] is not a base64-encoded PNG") from None
        if headers[-1].width * headers[-1].height > limits.max_image_pixels:
            raise Refused(413, f"images[{i}] is {headers[-1].width}x{headers[-1].height}, over the server's limit of "
                               f"{limits.max_image_pixels} pixels per image (--max-image-pixels)")
    total = sum(h.width * h.height for h in headers)
    if total > limits.max_request_pixels:
        raise Refused(413, f"the request holds {total} pixels, over the server's limit of {limits.max_request_pixels} "
                           "(--max-request-pixels): lower FLOWGRPO_REMOTE_BATCH")
    if len({h.size for h in headers}) > 1:
        raise Refused(400, f"the images differ in size: {sorted({h.size for h in headers})}")
    try:
        pixels = np.stack([np.asarray(h.convert("RGB")) for h in headers])
    except (OSError, ValueError, SyntaxError) as e:  # a truncated or corrupt PNG body
        raise Refused(400, f"an image could not be decoded: {type(e).__name__}") from None
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 255  # to_uint8 restores the pixels exactly


def parse_request(raw: bytes, limits: Limits):
    """The body of POST /score -> (images, prompts, metadata), or Refused naming what is wrong."""
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
    return read_images(images, limits), prompts, metadata


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


def make_server(spec: str, host: str = "127.0.0.1", port: int = 0, limits: Limits = Limits()) -> ThreadingHTTPServer:
    """A server of rewards.make_reward(spec): GET /health, POST /score (JSON, base64 PNG images)."""
    fn, max_bytes = rewards.make_reward(spec), int(limits.max_request_mb * 2**20)

    class Handler(BaseHTTPRequestHandler):
        timeout = limits.request_timeout  # each socket read and write

        def setup(self):
            super().setup()
            self.dog = Watchdog(self.connection, limits.request_timeout)  # the whole request

        def finish(self):
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
            ok = self.path == "/health"
            self._send(200 if ok else 404, {"status": "ok", "reward": spec} if ok else {"error": "GET /health"})

        def _read(self):
            if self.path != "/score":
                raise Refused(404, "POST /score")
            size = self.headers.get("Content-Length")
            if size is None:
                raise Refused(411, "POST /score needs a Content-Length")
            if not size.strip().isdigit():
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
            return parse_request(raw, limits)

        def do_POST(self):
            try:
                try:
                    images, prompts, metadata = self._read()
                except Refused as e:
                    return self._send(e.code, {"error": str(e)})
                self.dog.cancel()  # the request is in; scoring takes what the reward takes
                try:
                    scores, info = fn(images, prompts, metadata)
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


def main(argv=None):
    p = argparse.ArgumentParser(prog="rewards.py", description="Serve a reward over HTTP for "
                                "`--reward remote=http://HOST:PORT`.")
    s = p.add_subparsers(dest="cmd", required=True).add_parser(
        "serve", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--reward", required=True, help="a reward spec, as for flowgrpo.py --reward")
    s.add_argument("--port", type=int, required=True, help="0 picks a free port (printed)")
    s.add_argument("--host", default="127.0.0.1", help="bind address; 0.0.0.0 exposes it to the network")
    d = Limits()
    s.add_argument("--max-request-mb", type=float, default=d.max_request_mb, help="largest request body")
    s.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, help="largest image (width × height)")
    s.add_argument("--max-request-pixels", type=int, default=d.max_request_pixels, help="most pixels in one request")
    s.add_argument("--max-connections", type=int, default=d.max_connections, help="connections served at once")
    s.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a client has to send its whole request")
    a = p.parse_args(argv)
    limits = Limits(a.max_request_mb, a.max_image_pixels, a.max_request_pixels, a.max_connections, a.request_timeout)
    if min(vars(limits).values()) <= 0:
        p.error(f"every limit must be > 0, got {vars(limits)}")
    try:
        rewards.check_reward_spec(a.reward)
    except ValueError as e:
        p.error(str(e))
    server = make_server(a.reward, a.host, a.port, limits)
    print(f"serving reward {a.reward!r} on http://{a.host}:{server.server_address[1]} with limits {vars(limits)}",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
