"""Rewards over HTTP, the client side of the transport: a client with a whole-request deadline, retries with backoff,
bounded replies and no proxy; the client end of POST /score; and the daemon workers that requests wait on. Nothing
here knows a reward: rewards.py builds the remote reward (score_client) and the judge on this. The server of POST
/score is reward_server.py's.

Clients connect directly: http_proxy, https_proxy and no_proxy are ignored, as by the vLLM-Omni rollout client
(the servers are on the trainer's own network). A request that has no complete answer within its deadline fails
as a connection error does: retried with exponential backoff, then the run stops with an error naming the server.
"""
from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import os
import queue
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, replace

import numpy as np
from PIL import Image


# ---------------------------------------------------------------- the client
class PeerError(RuntimeError):
    """A peer of the run failed or stayed down (a reward, judge or rollout server; a rollout rank): its message names it
    and what to check, and flowgrpo.py says it in one line, as it says bad input."""


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


class ReplyTooLarge(http.client.HTTPException):
    """A reply past the caller's bound: asked again, the same request gets the same answer, so it is not retried."""


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
        raise ReplyTooLarge(f"a reply of more than {max_reply} bytes")
    return status, raw


# The retry budget, 1 + 2 + 4 + 8 + 16 + 32 = 63 s of backoff, outlasts the longest a reward server keeps a request
# waiting for a working slot before it answers 503 (reward_server.Limits.request_timeout, 60 s), and the longest an
# idle connection keeps its seat (Limits.header_timeout, 10 s).
RETRIES = 6


@dataclass(frozen=True)
class Client:
    """JSON over HTTP to one kind of server (`what`, named in every error). Connection errors, the deadline and 5xx
    are retried with exponential backoff (backoff, 2·backoff, ...); 4xx, replies past max_reply and replies that are not
    JSON are not."""
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
            except ReplyTooLarge as e:
                raise PeerError(f"{self.what} {url}{path} answered{about} with {e}: is it the server this run "
                                f"expects? {self.hint}") from None
            except (OSError, http.client.HTTPException) as e:  # refused, reset, cut off, past the deadline
                last = f"{type(e).__name__}: {e}"
                continue
            text = raw.decode(errors="replace")
            if status >= 300:  # said in one line: a proxy's or web server's error page is HTML over many
                said = " ".join(text.split())
            if status >= 500:
                last = f"HTTP {status}: {said[:500]}"
                continue
            if status >= 300:
                raise ValueError(f"{self.what} {url}{path} refused the request{about}: HTTP {status}: {said[:2000]}")
            try:
                return json.loads(text)
            except (ValueError, RecursionError):
                raise ValueError(f"{self.what} {url}{path} answered{about} with a body that is not JSON: "
                                 f"{text[:300]!r}") from None
        raise PeerError(f"{self.what} {url}{path} failed {self.retries + 1} times{about} (last: {last}); {self.hint}")


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


def server_urls(text: str, item: str, one: str) -> list[str]:
    """The http(s)://HOST:PORT servers of `text` ("+"-separated), checked without touching the network; an error names
    `item` (the --reward item they came in) and `one` (how to write it)."""
    urls = [u.strip().rstrip("/") for u in text.split("+")]
    for url in urls:
        u = urllib.parse.urlsplit(url)
        try:
            port = u.port or 0  # None: none written (the error asks for one)
        except ValueError:  # not a number, or outside 0-65535
            port = 0
        if u.scheme not in ("http", "https") or not u.hostname or u.username or port == 0 or u.path or u.query \
                or u.fragment or urls.count(url) > 1:
            raise ValueError(f"--reward: bad server URL {url!r} in {item!r} (port 1-65535, no path, each server once); "
                             f"write {one}")
    return urls


def remote_knobs():
    """(client, images per request) of the remote reward, from FLOWGRPO_REMOTE_*: checked at start-up (rewards._parse).
    """
    return (client_from_env("FLOWGRPO_REMOTE", "remote reward server",
                            "is `python rewards.py serve` running and reachable there?"),
            knob("FLOWGRPO_REMOTE_BATCH", 16, 1, 4096))


def ask_once(flag: str, client: Client, ask, seconds: float = 10.0) -> None:
    """Start-up's question to the server that `flag` names ("--reward ITEM", "--rollout-url URL"), `ask(client)`, once,
    within `seconds`: a wrong answer raises (a ValueError: a 4xx, not JSON, not the server asked for); no answer yet
    (refused, a 5xx, past `seconds`) is a warning only, as a vLLM server opens its port once its model is loaded: the
    reward or the rollout backend, built after the policy, asks again under the full retry policy. One rank asks
    (torchrun's rank 0)."""
    if int(os.environ.get("RANK", 0)):
        return
    try:
        served = ask(replace(client, retries=0, deadline=min(client.deadline, seconds)))
    except PeerError as e:
        print(f"warning: {flag}: no answer yet ({str(e).split(';')[0]}); asked again once the model is loaded",
              file=sys.stderr, flush=True)
    else:
        print(f"{flag}: up" + (f", serving {served!r}" if served else ""), flush=True)


def check_health(url: str, client: Client) -> dict:
    """GET /health of a `python rewards.py serve` at `url`: its {"status": "ok", "reward": SPEC, "limits": {...}}; an
    answer without "status": "ok" is a ValueError (the wrong server), not retried."""
    reply = client.call(url, "/health")
    if not (isinstance(reply, dict) and reply.get("status") == "ok"):
        raise ValueError(f"{client.what} {url}/health answered {json.dumps(reply)[:200]}, not a `python rewards.py "
                         'serve`\'s {"status": "ok", ...}: is it the server this run expects?')
    return reply


def served_reward(url: str, client: Client) -> str | None:
    """Start-up's question to a reward server (rewards.probe): the reward it serves."""
    return check_health(url, client).get("reward")


def score_client(url: str, client: Client, batch: int):
    """The client end of reward_server.make_server's POST /score at `url`, the server checked up now (at start-up,
    not mid-run): fn(images (B, H, W, 3) uint8, prompts, metadata) -> B scores, `batch` images a request sent as PNGs
    (fewer where the server's /health says it takes fewer images or pixels a request: not a 413 mid-run), each answer
    checked to hold one number per image of its request."""
    limits = check_health(url, client).get("limits")
    most = {k: v for k, v in (limits if isinstance(limits, dict) else {}).items()
            if isinstance(v, int) and not isinstance(v, bool) and v > 0}

    def fn(images, prompts, metadata):
        scores, pixels = [], images.shape[1] * images.shape[2]
        per = max(1, min(batch, most.get("max_request_images", batch), most.get("max_request_pixels", 0) // pixels
                         or batch))
        for i in range(0, len(images), per):
            n = len(images[i:i + per])
            body = {"images": [png_base64(a) for a in images[i:i + per]], "prompts": prompts[i:i + per],
                    "metadata": metadata[i:i + per]}
            reply = client.call(url, "/score", body, f" for images {i}-{i + n - 1}")
            got = reply.get("scores") if isinstance(reply, dict) else None
            # finite and within float64: JSON parses NaN, Infinity and 1e999, and an int past 1.8e308 is no float64
            # (an OverflowError, with a traceback, where the scores are made an array)
            if not (isinstance(got, list) and len(got) == n and all(
                    isinstance(s, (int, float)) and not isinstance(s, bool) and abs(s) <= sys.float_info.max
                    for s in got)):
                raise ValueError(f"{client.what} {url}/score answered images {i}-{i + n - 1} with "
                                 f"{json.dumps(reply)[:300]}; expected {{\"scores\": [{n} finite numbers]}}")
            scores += got
        return scores
    return fn


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
