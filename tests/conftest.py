import os
import sys

import pytest
import torch
from xdist.scheduler import LoadScopeScheduling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


class OneFileToAWorker(LoadScopeScheduling):
    """How the suite's two pytest-xdist workers (pytest.ini) share it: a test file to one worker, so that its module
    fixtures (shared runs) are built once; the vLLM-Omni tier, all its files, to one worker, so that its session's
    servers start once. (xdist's own `--dist loadgroup` marks do not reach its scheduler under pytest 9.2.)"""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return "tests/omni" if path.startswith("tests/omni/") else path


def pytest_xdist_make_scheduler(config, log):
    return OneFileToAWorker(config, log)


@pytest.fixture
def one_thread():
    """In-process sampling of a laptop task's model on one torch thread, as its runs have it: on a busy 2-core machine
    two threads wait on each other (7× slower, measured on nano); the figures do not depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
