"""bench/soak.py: the reward server under load and attack, in a table like bench/overhead.py's (main says what it sends).
    python -m bench.soak [--clients C --requests R --hostile F --header-timeout S --markdown FILE]
See BENCHMARKS.md."""
import argparse
import base64
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import torch

import reward_http
import reward_server
import rewards
from bench.overhead import HEAD, ROOT, row

def text_bomb() -> bytes:
    """A POST /score body of one 1×1 PNG carrying 64 zTXt chunks of 1 MiB of text each (64 kB on the wire)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    text = zlib.compress(b"a" * 2**20, 9)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)) + b"".join(
        chunk(b"zTXt", b"k%d\0\0" % k + text) for k in range(64)) + chunk(b"IDAT", zlib.compress(b"\0" * 4)) + \
        chunk(b"IEND", b"")
    return json.dumps({"images": [base64.b64encode(png).decode()], "prompts": ["p"]}).encode()

def main(argv=None) -> None:
    """`python -m bench.soak`: C clients × R valid requests to `python rewards.py serve --reward brightness` on
    127.0.0.1 (4 images of 64², each answer checked against the local reward, 503s retried with backoff), and after
    each a hostile request with probability --hostile (an idle socket, a Content-Length of 10¹² and no body, "{not
    json", a PNG of 64 MiB of zTXt text, a Content-Length of '²'). Reports what was served, errors by kind, latency,
    the server's memory and threads; fails if a valid request is lost or answered wrongly, or refused while the
    clients are no more than the server's working slots, or if memory or threads stay."""
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=main.__doc__)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=50, help="valid requests per client")
    p.add_argument("--hostile", type=float, default=0.25, help="probability of a hostile request after each valid one")
    p.add_argument("--header-timeout", type=float, default=2.0, help="the server's (its default is 10 s)")
    p.add_argument("--markdown", help="also write the table, with the command, revision, date and load, to this file")
    argv = sys.argv[1:] if argv is None else argv
    o, t = p.parse_args(argv), list(HEAD)
    # (else: no valid request, no latency to take a percentile of; a timeout the server refuses, no address to read)
    if min(o.clients, o.requests) < 1 or not 0 < o.header_timeout <= 86400:
        p.error(f"--clients and --requests must be at least 1 and --header-timeout in (0, 86400] s (the server's "
                f"bounds); got {o.clients}, {o.requests}, {o.header_timeout:g}")
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "rewards.py"), "serve", "--reward", "brightness",
                               "--port", "0", "--header-timeout", str(o.header_timeout)], stdout=subprocess.PIPE,
                              text=True, stderr=subprocess.DEVNULL)
    url = server.stdout.readline().split(" on ")[-1].split()[0]
    port, local, bomb = int(url.rsplit(":", 1)[1]), rewards.make_reward("brightness"), text_bomb()
    hostile = {"idle socket": b"", "Content-Length 10^12": b"POST /score HTTP/1.1\r\nContent-Length: 1" + b"0" * 12 +
               b"\r\n\r\n",
               "not JSON": b"POST /score HTTP/1.1\r\nContent-Length: 9\r\n\r\n{not json",
               "64 MiB of PNG text": b"POST /score HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(bomb) + bomb,
               "Content-Length '²'": "POST /score HTTP/1.1\r\nContent-Length: ²\r\n\r\n{}".encode()}
    answers, latency, lock = {}, [], threading.Lock()

    def status():  # the server's VmRSS, VmHWM (MiB) and thread count, from /proc
        f = dict(line.split(":", 1) for line in open(f"/proc/{server.pid}/status").read().splitlines())
        return int(f["VmRSS"].split()[0]) / 1024, int(f["VmHWM"].split()[0]) / 1024, int(f["Threads"])

    def count(key):
        with lock:
            answers[key] = answers.get(key, 0) + 1

    def send(data: bytes) -> str:  # a hostile request, then end of stream (the idle socket sends nothing, ends not)
        with socket.create_connection(("127.0.0.1", port), timeout=120) as c:
            with contextlib.suppress(OSError):
                c.sendall(data)
                if data:
                    c.shutdown(socket.SHUT_WR)
            return c.makefile("rb").read().split(b"\r\n")[0].decode()[9:] or "closed by the server"

    def client(c):
        rng = np.random.default_rng(c)
        for r in range(o.requests):
            images = torch.from_numpy(rng.random((4, 3, 64, 64), dtype=np.float32))
            body = json.dumps({"images": [reward_http.png_base64(x) for x in rewards.to_uint8(images)],
                               "prompts": ["p"] * 4}).encode()
            start = time.perf_counter()
            for attempt in range(12):  # as reward_http.Client retries, backoff 0.05 s doubling: 100 s in all
                try:
                    code, reply = reward_http.exchange(url, "/score", body, 120, 2**20)
                except OSError as e:  # a busy server's 503 and close can cut the body being sent
                    code, reply = type(e).__name__, b""
                if code != 503 and isinstance(code, int):
                    break
                count(f"valid: {code} (busy), retried")
                time.sleep(0.05 * 2 ** attempt)
            right = code == 200 and json.loads(reply)["scores"] == local(images, ["p"] * 4)[0].tolist()
            count("valid: answered, correct" if right else f"valid: lost or wrong (HTTP {code})")
            latency.append(time.perf_counter() - start)
            if rng.random() < o.hostile:
                kind = list(hostile)[rng.integers(len(hostile))]
                count(f"hostile, {kind}: {send(hostile[kind])}")
    start, threads = status(), [threading.Thread(target=client, args=(c,)) for c in range(o.clients)]
    wall = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - wall
    time.sleep(o.header_timeout + 1)  # handlers of idle sockets end at the header deadline
    end = status()
    server.kill()
    for key, n in sorted(answers.items()):
        row(t, key, [n], "requests")
    row(t, "valid request latency, p50", [1e3 * np.percentile(latency, 50)], "ms", "", "503 retries included")
    row(t, "valid request latency, p99", [1e3 * np.percentile(latency, 99)], "ms")
    row(t, "server RSS, start → end", [start[0], end[0]], "MiB", "end within 50 MiB of start", f"{start[0]:.0f} → "
        f"{end[0]:.0f} MiB, peak {end[1]:.0f} MiB; {wall:.0f} s of soak")
    row(t, "server threads, start → end", [start[2], end[2]], "threads", "equal", f"{start[2]} → {end[2]}")
    if o.markdown:
        head = f"`python -m bench.soak {' '.join(argv)}`, {time.ctime()}, load {os.getloadavg()[0]:.2f}"
        open(o.markdown, "w").write("\n".join([head + "\n", *t, ""]))
    whole = answers.get("valid: answered, correct") == o.clients * o.requests
    # Clients no more than the slots (8) are never turned away: idle sockets hold none, and a slot is free again
    # before its answer is sent.
    refused = o.clients <= reward_server.Limits().max_requests and any(k.endswith("retried") for k in answers)
    if not whole or refused or end[2] != start[2] or end[0] > start[0] + 50:
        sys.exit("bench/soak.py: a valid request was lost, answered wrongly or turned away, or the server's threads or "
                 "memory did not return")

if __name__ == "__main__":
    main()
