"""The bounded reward server: POST /score of any scoring function, and its command line (`python rewards.py serve`
hands it a reward). Nothing here knows a reward; the client end and the deadline watchdog are reward_http.py's.

The server bounds what a request may cost: bytes, JSON values, images, decoded pixels (checked in the PNG headers
before decoding), the PNG text and chunks Pillow parses, header bytes, requests worked on and connections open at once,
the time to send the headers and the whole request, and the rate its body comes at; its errors carry a message, never
a traceback. An idle connection holds no working slot (slots count requests, from their headers to their reply) and
gives its seat to a new connection when every seat is taken; so does one waiting for a slot, to a newcomer from an
address with fewer connections idle or waiting than its own.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import collections
import contextlib
import dataclasses
import http.client
import io
import json
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
from PIL import Image, PngImagePlugin

import source_images
from reward_http import PeerError, Watchdog


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server (each is a `serve` flag). Memory: at most max_requests requests are held
    at once, each about 3× its body while it is parsed, then its images' pixels (3 bytes each) and what the reward
    itself takes: at most 16 bytes per pixel at the limit, 12 measured (docs/rewards.md); and each open connection's
    request line and headers, at most HEADER_BYTES."""
    max_request_mb: float = 128.0  # request body (2**25 pixels of noise, the pixel limit, as base64 PNGs: 128 MiB)
    max_json_values: int = 2**16  # JSON values in the body, counted before it is parsed (each costs up to ~72 bytes)
    max_request_images: int = 64  # images in one request
    max_image_pixels: int = 2048 * 2048  # per image, read from the PNG header before decoding
    max_request_pixels: int = 2**25  # per request (e.g. 16 images of 1448²)
    max_requests: int = 8  # read, decoded and scored at once; more wait their turn (at most request_timeout)
    max_connections: int = 64  # open at once (a thread each); a new one closes one idle or waiting, else gets a 503
    header_timeout: float = 10.0  # seconds to send the request line and headers: how long an idle connection stays
    request_timeout: float = 60.0  # seconds to send a whole request, and to wait for a slot; each socket read and write
    body_rate: float = 2.0**22  # bytes a second a body must arrive at, after a second: a slot is not held for nothing


PNG_TEXT = 2**16  # bytes of PNG text (zTXt, iCCP, ...) Pillow may inflate per image (default: 64 MiB); ours have none
PNG_CHUNKS = 2**12  # chunks per image (Pillow writes one a 64 KiB of data: ~200 at 2048²), ~0.3 s of parsing at most
# Bytes of a request line and headers together (ours: ~150). http.server alone takes 100 header lines of 64 KiB: 37 MiB
# of server memory measured per connection, for as long as it stays open.
HEADER_BYTES = 2**17
LINGER = 1.0  # seconds a newcomer turned away with a 503 is read from (its request, sent meanwhile, is dropped)


class Refused(Exception):
    def __init__(self, code: int, message: str):  # the HTTP status and the reply's message
        super().__init__(message)
        self.code = code


def _png(s: str, i: int, limits: Limits) -> Image.Image:
    """images[i] opened: its chunks counted and its text measured from their headers (source_images.check_png), its
    header read, its pixels not yet decoded."""
    try:
        data = base64.b64decode(s, validate=True)
        source_images.check_png(io.BytesIO(data), PNG_CHUNKS)
    except ValueError as e:  # binascii.Error is one
        raise Refused(400, f"images[{i}] is not a base64-encoded PNG" if isinstance(e, binascii.Error) else
                      f"images[{i}] {e}") from None
    try:
        return Image.open(io.BytesIO(data), formats=["PNG"])
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
            if png.mode not in source_images.MODES:  # e.g. 16-bit grey, whose values over 255 RGB would turn white
                raise Refused(400, f"images[{i}] has pixel mode {png.mode}: send 8-bit channels")
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


class _HeaderBudget:
    """A connection's reader whose readline, with which http.server reads the request line and headers, stops at
    HEADER_BYTES in all (a 431 answer); read and the rest are the connection's own."""

    def __init__(self, raw):
        self.raw, self.left = raw, HEADER_BYTES

    def readline(self, limit: int = -1) -> bytes:
        line = self.raw.readline(self.left + 1 if limit < 0 else min(limit, self.left + 1))
        self.left -= len(line)
        if self.left < 0:  # http.server answers this exception 431
            raise http.client.HTTPException(f"a request line and headers of more than {HEADER_BYTES} bytes")
        return line

    def __getattr__(self, name):
        return getattr(self.raw, name)


class _Server(ThreadingHTTPServer):
    """A thread per open connection, at most max_connections of them; a request takes one of max_requests working
    slots only once its headers are in, and gives it back once its reply is built, before sending it. So idle
    connections hold no slot, and a client's next request never finds its last one still holding one. A connection
    is idle until its headers are in; when every seat is taken, a new connection closes the oldest idle one and takes
    its place (a client sends its headers at once: idle sockets reconnected whenever cut, 72 to 128 of them, held every
    seat and turned the trainer's client away for 63 s); with none idle, the oldest one waiting for a slot, if its
    address has more connections idle or waiting than the newcomer's will. Each is of the address with the most such:
    slow requests' headers from one address, reconnected when cut, turned a client away 20 times of 20, and closing any
    waiting one closed the client's in its turn, 7 of 7 (many addresses are not what this defends against). With none
    to close, the newcomer is answered 503. Threads of closed connections are ending: at most max_connections more."""
    daemon_threads, request_queue_size = True, 64  # the listen backlog: connections waiting to be accepted

    def __init__(self, address, handler, limits: Limits):
        self.seats, self.open, self.lock = limits.max_connections, 0, threading.Lock()
        self.idle, self.waiting = {}, {}  # oldest first, with their address: headers not in, and waiting for a slot
        self.lingering = threading.BoundedSemaphore(limits.max_connections)  # newcomers turned away, still read from
        self.slots = threading.BoundedSemaphore(limits.max_requests)  # requests being read, decoded and scored
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self.lock:
            unslotted = {**self.idle, **self.waiting}  # connections holding no slot, idle ones first: their address
            held = collections.Counter(unslotted.values())  # by address; max: the first of the address with the most
            oldest = max(unslotted, key=lambda r: held[unslotted[r]], default=None) if self.open >= self.seats else None
            if oldest in self.waiting and held[unslotted[oldest]] <= held[client_address[0]] + 1:
                oldest = None
            if self.open >= self.seats and (oldest is None or self.open >= 2 * self.seats):  # full, none to close
                if self.lingering.acquire(blocking=False):
                    threading.Thread(target=self._turn_away, args=(request,), daemon=True).start()
                else:
                    self.shutdown_request(request)
                return
            if oldest is not None:
                (self.idle if oldest in self.idle else self.waiting).pop(oldest)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread's read ends at once; the thread, and its count, go
            self.open += 1
            self.idle[request] = client_address[0]
        super().process_request(request, client_address)

    def _turn_away(self, request):
        """The 503, then what the client sends read and dropped until it closes (LINGER s, and one read, at most):
        closed unread, the connection answered the request with a reset, which the client read instead (20 of 20)."""
        end = time.monotonic() + LINGER
        with contextlib.suppress(OSError):  # TimeoutError is one
            request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\n\r\n{\"error\": \"busy: too many connections\"}")
            request.shutdown(socket.SHUT_WR)  # the reply ends here
            request.settimeout(LINGER)
            while request.recv(2**16) and time.monotonic() < end:  # b"": the client closed, nothing is left unread
                pass
        request.close()
        self.lingering.release()

    def busy(self, request, waiting: str | None = None) -> None:
        """The connection's headers are in: not idle, and `waiting` (its address) until it has a slot. Raises
        ConnectionAbortedError if it was closed for a newcomer meanwhile: its request has nobody to answer."""
        with self.lock:
            if self.idle.pop(request, None) is None and self.waiting.pop(request, None) is None:
                raise ConnectionAbortedError("closed for a newcomer")
            if waiting:
                self.waiting[request] = waiting

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.idle.pop(request, None)
                self.waiting.pop(request, None)
                self.open -= 1


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
            self.rfile = _HeaderBudget(self.rfile)
            self.header_dog = Watchdog(self.connection, limits.header_timeout)  # until the headers are in
            self.dog = Watchdog(self.connection, limits.request_timeout)  # the whole request (its body: in a slot)

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
            with contextlib.suppress(OSError):  # closed for a newcomer, or the client left: nobody to answer
                self.server.busy(self.request)
                self.header_dog.cancel()
                ok = self.path == "/health"
                self._send(200 if ok else 404, {"status": "ok", "reward": name, "limits": {  # the client sizes requests
                    k: getattr(limits, k) for k in ("max_request_images", "max_request_pixels")}} if ok else  # by these
                    {"error": "GET /health"})

        def _size(self) -> int:
            """The body's declared size, checked before the request waits for a working slot: a request refused by its
            headers holds none, nor does the draining of a body over the limit (within the request's deadline)."""
            if self.path != "/score":
                raise Refused(404, "POST /score")
            size = self.headers.get("Content-Length")
            if size is None:
                raise Refused(411, "POST /score needs a Content-Length")
            if not (size.strip().isascii() and size.strip().isdigit()):  # '²'.isdigit() is True, int('²') fails
                raise Refused(400, f"Content-Length {size[:40]!r} is not a number of bytes")
            try:
                size = int(size)
            except ValueError:  # past int()'s 4300 digits: no reply and a traceback before; far over any limit
                size = max_bytes + 1
            if size > max_bytes:  # read and dropped as it comes, so that the client reads this reply, not a reset
                with contextlib.suppress(Refused):
                    self._body(size, keep=False)
                raise Refused(413, f"a request of {self.headers['Content-Length']} bytes is over the server's limit "
                                   f"of {max_bytes} (--max-request-mb): lower FLOWGRPO_REMOTE_BATCH")
            return size

        def _body(self, size: int, keep: bool = True) -> bytes:
            """The body, its bytes arriving at limits.body_rate a second (a second's grace) at every moment: a sender
            that falls behind is cut, so that it cannot keep its slot (16 senders of a byte a second held the slots
            and delayed every score call to 148 s; a Content-Length of 100 MiB and then silence held one for the
            request's deadline). keep=False: read and dropped."""
            start, parts, got = time.monotonic(), [], 0
            while got < size:
                due = start + 1 + (got + 1) / limits.body_rate  # when the next byte must be in
                try:
                    if due <= time.monotonic():
                        raise TimeoutError
                    self.connection.settimeout(due - time.monotonic())
                    part = self.rfile.read1(min(size - got, 2**16))
                except (TimeoutError, ValueError):  # ValueError: settimeout's, had `due` passed meanwhile
                    raise Refused(408, f"the body came slower than {limits.body_rate:.0f} bytes a second "
                                       f"(--body-rate): {got} of {size} bytes in {time.monotonic() - start:.1f} s") \
                        from None
                if not part:
                    raise Refused(400, f"the body ended after {got} of {size} bytes")
                parts += [part] if keep else []
                got += len(part)
            self.connection.settimeout(limits.request_timeout)
            return b"".join(parts)

        def do_POST(self):
            with contextlib.suppress(OSError):  # the client left, was slow or late, or lost its seat: nobody to answer
                self._send(*self._in_a_slot())

        def _in_a_slot(self) -> tuple[int, dict]:
            """(status, reply) of POST /score, worked out in a working slot, waited for in turn: a request holds
            none until its headers are in, nor once its reply is built."""
            self.server.busy(self.request, waiting=self.client_address[0])
            self.header_dog.cancel()
            try:
                size = self._size()
            except Refused as e:
                return e.code, {"error": str(e)}
            self.dog.cancel()
            if not self.server.slots.acquire(timeout=limits.request_timeout):
                return 503, {"error": "busy: no slot came free within the request deadline (--request-timeout)"}
            self.dog = Watchdog(self.connection, limits.request_timeout)  # the body's deadline starts with its slot
            try:
                self.server.busy(self.request)  # no longer waiting (closable), unless it was closed meanwhile
                return self._score(size)  # the request's text and pixels go as it returns
            finally:
                self.server.slots.release()  # before the reply is sent: the client's next request finds it free

        def _score(self, size: int) -> tuple[int, dict]:
            try:
                encoded, prompts, metadata = parse_request(self._body(size), limits)  # the body is freed here
                images = read_images(encoded, limits)
            except Refused as e:
                return e.code, {"error": str(e)}
            self.dog.cancel()  # the request is in; scoring takes what the reward takes
            try:
                scores, info = score(images, prompts, metadata)
            except ValueError as e:  # the reward's own message about its input (e.g. no quoted text)
                return 422, {"error": str(e)}
            except Exception as e:
                self.log_error("the reward failed:\n%s", traceback.format_exc())
                return 500, {"error": f"the reward failed ({type(e).__name__}); the server's log has the traceback"}
            return 200, {"scores": scores.tolist(), "info": {k: v.tolist() for k, v in info.items()}}

    return _Server((host, port), Handler, limits)


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
                 max_request_pixels="most pixels in one request", max_requests="requests scored at once",
                 max_connections="connections open at once (a new one closes an idle or waiting one)",
                 header_timeout="seconds to send the headers",
                 request_timeout="seconds to send the whole request; the longest wait for a slot",
                 body_rate="bytes a second a request body must arrive at, after its first second")
    for f in dataclasses.fields(Limits):
        s.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default, help=helps[f.name])
    a = p.parse_args(argv)
    limits = Limits(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Limits)})
    if not all(0 < v < float("inf") for v in vars(limits).values()):
        p.error(f"every limit must be a finite number > 0, got {vars(limits)}")
    if max(limits.header_timeout, limits.request_timeout) > 86400 or limits.body_rate < 1 or \
            limits.max_request_mb > 2**20:  # past these, the server's clocks and socket timeouts overflow
        p.error(f"--header-timeout and --request-timeout are at most 86400 s, --body-rate at least 1 byte a second, "
                f"--max-request-mb at most 1048576; got {vars(limits)}")
    slowest = 1 + limits.max_request_mb * 2**20 / limits.body_rate  # s: the largest body at the slowest rate allowed
    if slowest > limits.request_timeout:  # its deadline would cut it (the old defaults': 257 s against 60)
        p.error(f"--max-request-mb {a.max_request_mb:g} at --body-rate {a.body_rate:.10g} takes {slowest:.0f} s, over "
                f"--request-timeout {a.request_timeout:g}: raise it or --body-rate, or lower --max-request-mb")
    if not 0 <= a.port < 2**16:
        p.error(f"--port {a.port} is not a port (0 to 65535; 0 picks a free one)")
    try:
        check(a.reward)
    except ValueError as e:
        p.error(str(e))
    built = []  # the reward, built once the address is bound: a port in use is said before a model loads
    try:
        server = make_server(lambda *request: built[0](*request), a.reward, a.host, a.port, limits)
    except OSError as e:
        p.error(f"--host {a.host} --port {a.port}: cannot listen there ({e.strerror or e})")
    try:
        built.append(build(a.reward))
    except (ValueError, OSError, PeerError) as e:  # e.g. remote= a server that does not answer, weights out of reach
        server.server_close()
        p.error(f"--reward {a.reward}: {e}")
    print(f"serving reward {a.reward!r} on http://{a.host}:{server.server_address[1]} with limits {vars(limits)}",
          flush=True)
    server.serve_forever()
