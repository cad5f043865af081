"""Spawned gloo runs that feed the distributed tests: one 2-rank launch per test session for the scenarios of
``scenarios.run_all`` and one 4-rank launch for tensor parallelism on a 2-D mesh (``tp_scenarios``).

Starting interpreters dominates the cost, so each launch runs all its scenarios and each test checks its
part of the results. Under pytest-xdist the first worker to ask for a launch runs it and the others read its
results (a file lock in the session's shared temp dir).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable

import pytest

from ._spawn import run_on_ranks
from .scenarios import run_all
from .tp_scenarios import run_all_4


def _shared(tmp_path_factory: pytest.TempPathFactory, name: str, launch: Callable[[str], list]) -> list:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return launch(str(tmp_path_factory.mktemp(name)))
    root = tmp_path_factory.getbasetemp().parent  # shared by the xdist workers of this session only
    cache = root / f"optkit_{name}_results.pkl"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX: no sharing between xdist workers
        return launch(str(tmp_path_factory.mktemp(name)))
    with open(root / f"optkit_{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if cache.exists():
                return pickle.loads(cache.read_bytes())
            results = launch(str(tmp_path_factory.mktemp(name)))
            cache.write_bytes(pickle.dumps(results))
            return results
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """``[rank0_results, rank1_results]``: ``{scenario name: result}`` per rank."""
    return _shared(tmp_path_factory, "distributed",
                   lambda workdir: run_on_ranks(run_all, workdir, world_size=2, timeout=300.0))


@pytest.fixture(scope="session")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Results of the 4-rank launch (dp=2 x tp=2 FSDP2 x TP, then TP + SP on 4 ranks), by rank."""
    return _shared(tmp_path_factory, "tensor_parallel",
                   lambda _workdir: run_on_ranks(run_all_4, world_size=4, timeout=400.0))
