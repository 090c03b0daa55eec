"""The vLLM-Omni tier: tests against a real `vllm serve … --omni` on 127.0.0.1 (harness.py).

They need vLLM-Omni's own virtual environment (built by omni/setup_env.sh, ~2 GB download, minutes);
without it every test here is skipped, so the main CPU suite never depends on it. OMNI_VENV points at
an environment elsewhere (default: <repo>/.venv-omni).

The server fixtures start the server in its own session (process group), wait for GET /health with a
deadline, and stop the whole group by PID when done: SIGTERM, then SIGKILL after a grace period.
"""
from pathlib import Path

import pytest

from harness import OMNI_VENV, OmniServer

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if (OMNI_VENV / "bin" / "vllm").exists():
        return
    skip = pytest.mark.skip(reason=f"vLLM-Omni env not found at {OMNI_VENV}: run omni/setup_env.sh (or set OMNI_VENV)")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory) -> Path:
    """`--model tiny --seed 0`'s pipeline on disk (models.save_tiny_pipeline): the trainer loads it with
    --model-path and the servers serve it, so both hold the same weights."""
    import models
    return Path(models.save_tiny_pipeline(str(tmp_path_factory.mktemp("omni") / "tiny-qwen-image"), seed=0))


_SHARED: list[OmniServer] = []  # the tier's shared server while it runs


@pytest.fixture
def omni_server(tiny_pipeline_dir, tmp_path_factory):
    """The tier's shared server. It fuses up to 4 waiting requests into one forward, waiting up to 50 ms for
    them (vLLM-Omni's defaults: 1, 0 ms), so the pipeline's multi-request path is exercised too. Its
    trajectory_root is pytest's base temporary directory: every test's tmp_path lies beneath it.
    The first test that asks starts it; it stops after the tier's last test (pytest_runtest_teardown), not at the
    session's end: idle, the server keeps a fifth of a core busy (measured 2026-12-06), which the rest of a 2-core
    suite would pay for."""
    if not _SHARED:
        _SHARED.append(OmniServer(tiny_pipeline_dir, tmp_path_factory.mktemp("omni-log") / "vllm-serve.log",
                                  extra_args=["--max-num-seqs", "4", "--request-batch-max-wait-ms", "50"],
                                  pipeline_args={"trajectory_root": str(tmp_path_factory.getbasetemp())}))
    return _SHARED[0]


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared server once the next test lies outside the tier (a later test of the tier starts another)."""
    if _SHARED and (nextitem is None or HERE not in Path(str(nextitem.fspath)).resolve().parents):
        _SHARED.pop().stop()


def pytest_sessionfinish(session):
    if _SHARED:  # an interrupted session
        _SHARED.pop().stop()
