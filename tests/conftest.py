import os
import sys

import torch
from xdist.scheduler import LoadScopeScheduling

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One torch thread in each worker, as the loop's own CPU runs have it (flowgrpo.main) and the runs the tests launch
# (OMP_NUM_THREADS=1): the suite's two workers share two cores, where a team of two threads in each waits on the
# other's (the in-process model files took 235 s of CPU on two threads, 188 on one, 2026-12-07); and a figure a test
# computes in-process then does not depend on the machine's number of cores.
torch.set_num_threads(1)


class OneFileToAWorker(LoadScopeScheduling):
    """How the suite's two pytest-xdist workers (pytest.ini) share it: a test file to one worker, so that its module
    fixtures (shared runs) are built once; the vLLM-Omni tier, all its files, to one worker, so that its session's
    servers start once. (xdist's own `--dist loadgroup` marks do not reach its scheduler under pytest 9.2.)"""

    # The longest scopes first (seconds of one core, measured 2026-12-04), so that no long file starts last and runs
    # alone at the end: xdist's own order, by number of tests, had nano-compose's 9-minute run among the last.
    LONGEST = ("tests/test_nano_compose.py", "tests/omni", "tests/test_variants.py", "tests/test_nano_edit.py",
               "tests/test_bench.py", "tests/test_sp.py", "tests/test_engine.py", "tests/test_nano.py")

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return "tests/omni" if path.startswith("tests/omni/") else path

    def _assign_work_unit(self, node) -> None:
        if not getattr(self, "ordered", False):  # once, before the first unit is handed out
            for scope in reversed(self.LONGEST):
                if scope in self.workqueue:
                    self.workqueue.move_to_end(scope, last=False)
            self.ordered = True
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config, log):
    return OneFileToAWorker(config, log)
