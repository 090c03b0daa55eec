"""The vLLM-Omni tier: tests against a real `vllm serve … --omni` on 127.0.0.1 (harness.py).

They need vLLM-Omni's own virtual environment (built by omni/setup_env.sh, ~2 GB download, minutes);
without it every test here is skipped, so the main CPU suite never depends on it. OMNI_VENV points at
an environment elsewhere (default: <repo>/.venv-omni).

The server fixture starts the server in its own session (process group), waits for GET /health with a
deadline, and in its finalizer stops the whole group by PID: SIGTERM, then SIGKILL after a grace period.
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


@pytest.fixture(scope="session")
def omni_server(tiny_pipeline_dir, tmp_path_factory):
    """The tier's shared server. It fuses up to 4 waiting requests into one forward, waiting up to 50 ms for
    them (vLLM-Omni's defaults: 1, 0 ms), so the pipeline's multi-request path is exercised too. Its
    trajectory_root is pytest's base temporary directory: every test's tmp_path lies beneath it."""
    server = OmniServer(tiny_pipeline_dir, tmp_path_factory.mktemp("omni-log") / "vllm-serve.log",
                        extra_args=["--max-num-seqs", "4", "--request-batch-max-wait-ms", "50"],
                        pipeline_args={"trajectory_root": str(tmp_path_factory.getbasetemp())})
    yield server
    server.stop()
