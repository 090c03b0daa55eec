"""Start, query and stop a real `vllm serve … --omni` on 127.0.0.1 (the vLLM-Omni tier's harness).

An OmniServer runs in its own session (process group), is waited for with GET /health and a deadline, and
`stop()` ends the whole group by PID: SIGTERM, then SIGKILL after a grace period. A Forwarder is a second address of
a server, to kill instead of the server; train_here runs flowgrpo.py's training in this process.
"""
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from tiny_setup import main_here

ROOT = Path(__file__).resolve().parents[2]
OMNI_VENV = Path(os.environ.get("OMNI_VENV", ROOT / ".venv-omni"))

HEALTH_TIMEOUT_S = 600  # measured ~15-30 s on 2 cores idle, 221 s at a load of 8: generous for a loaded CI machine
STOP_GRACE_S = 30
# Loopback only: never route 127.0.0.1 through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# A TCP forwarder (python -c FORWARDER LISTEN_PORT TARGET_PORT): each connection to 127.0.0.1:LISTEN_PORT is piped to
# 127.0.0.1:TARGET_PORT, both ways, until both sides are done.
FORWARDER = """
import socket, sys, threading

def pipe(src, dst):
    try:
        while data := src.recv(1 << 16):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass

def connection(client, target):
    with client, socket.create_connection(target) as server:
        upstream = threading.Thread(target=pipe, args=(client, server), daemon=True)
        upstream.start()
        pipe(server, client)
        upstream.join()

listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    client, _ = listener.accept()
    threading.Thread(target=connection, args=(client, ("127.0.0.1", int(sys.argv[2]))), daemon=True).start()
"""


def _load_serve_tiny():
    spec = importlib.util.spec_from_file_location("serve_tiny", ROOT / "omni" / "serve_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: dict | None = None, timeout: float = 120.0) -> tuple[int, dict | str]:
    """One request to the loopback server: (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


train_here = main_here  # `python flowgrpo.py --no-wandb *flags`, in this process (tests/tiny_setup.py)


def set_lora_b(model, seed):
    """A policy that differs from the base model (LoRA B = 0 is the base): B ~ N(0, 0.05²), or 0 for seed None."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.zero_() if gen is None else p.normal_(0.0, 0.05, generator=gen)  # in place (a DTensor under FSDP2)


def _log_tail(path: Path, n: int = 60) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-n:])


class OmniServer:
    """A `vllm serve <dir> --omni` subprocess on 127.0.0.1, owning its process group."""

    def __init__(self, model_dir: Path, log_path: Path, extra_args: list[str] = (), pipeline_args: dict | None = None):
        port = free_port()
        # The project's pipeline class (omni/pipeline.py): it serves plain requests exactly as the stock one.
        self._start(_load_serve_tiny().serve_command(str(model_dir), port, str(OMNI_VENV), list(extra_args),
                                                     pipeline_args), port, log_path)

    def _start(self, argv: list[str], port: int, log_path: Path, **env_extra: str) -> None:
        """Run `argv` (a server on 127.0.0.1:port) in its own session and wait until GET /health answers."""
        self.argv, self.port, self.url, self.log_path = argv, port, f"http://127.0.0.1:{port}", log_path
        env = dict(os.environ,
                   # The model is a local directory; nothing may reach the network.
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
                   # The custom pipeline class (omni/pipeline.py) is imported from the project root.
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env_extra)
        env.pop("VIRTUAL_ENV", None)
        self._log = open(log_path, "w")
        t0 = time.monotonic()
        # start_new_session: the server and every worker it spawns share one process group, so the
        # finalizer can stop them all by this PID.
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                     start_new_session=True)
        self.pgid = self.proc.pid
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    def _wait_healthy(self, t0: float) -> None:
        deadline = t0 + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {self.proc.returncode} before becoming healthy:\n"
                                   f"{' '.join(self.argv)}\n{_log_tail(self.log_path)}")
            try:
                if http("GET", f"{self.url}/health", timeout=5)[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {HEALTH_TIMEOUT_S} s:\n{_log_tail(self.log_path)}")

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 120.0):
        return http(method, self.url + path, body, timeout)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self) -> None:
        """SIGTERM the process group, wait up to STOP_GRACE_S, then SIGKILL it; reap the server."""
        for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10)):
            if not self.group_alive():
                break
            os.killpg(self.pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not self.group_alive():
                    break
                time.sleep(0.2)
        try:
            self.proc.wait(timeout=10)
        finally:
            self._log.close()
        if self.group_alive():
            raise RuntimeError(f"processes of the vllm serve group {self.pgid} survived SIGKILL")


class Forwarder(OmniServer):
    """A second address of `target`'s server: a TCP forwarder process in its own process group, waited for and stopped
    as an OmniServer. Killing it is, to a client, that server dying (its connections reset, new ones refused),
    without starting another server (~30 s of CPU)."""

    def __init__(self, target: OmniServer, log_path: Path):
        port = free_port()
        self._start([sys.executable, "-c", FORWARDER, str(port), str(target.port)], port, log_path)
