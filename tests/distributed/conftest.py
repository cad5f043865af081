"""One spawned 2-rank gloo run per test session feeds every distributed test.

Starting interpreters dominates the cost, so all scenarios (``scenarios.run_all``) run in one launch and
each test checks its part of the results. Under pytest-xdist the first worker to get here runs the launch
and the others read its results (a file lock in the session's shared temp dir).
"""

from __future__ import annotations

import os
import pickle

import pytest

from ._spawn import run_on_ranks
from .scenarios import run_all


def _launch(workdir: str) -> list[dict]:
    return run_on_ranks(run_all, workdir, world_size=2, timeout=240.0)


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """``[rank0_results, rank1_results]``: ``{scenario name: result}`` per rank."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _launch(str(tmp_path_factory.mktemp("dcp")))
    root = tmp_path_factory.getbasetemp().parent  # shared by the xdist workers of this session only
    cache = root / "optkit_distributed_results.pkl"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no sharing between xdist workers
        return _launch(str(tmp_path_factory.mktemp("dcp")))
    with open(root / "optkit_distributed.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if cache.exists():
                return pickle.loads(cache.read_bytes())
            results = _launch(str(tmp_path_factory.mktemp("dcp")))
            cache.write_bytes(pickle.dumps(results))
            return results
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
