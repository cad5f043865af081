"""``optkit train`` under torchrun joins its process group within a time limit and says why when it cannot
(issue #12 item 8): ``--master-port 0`` is refused at once; an unreachable rendezvous fails after
``OPTKIT_DIST_TIMEOUT`` seconds with the address, port and rank, instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ._spawn import free_port

_SCRIPT = """
from optkit.demo.config import ConfigError
from optkit.demo.parallel import start
try:
    procs = start()
except ConfigError as err:
    print("ConfigError:", err)
else:
    print("joined", procs.rank, procs.world_size)
    procs.close()
"""


def _start(env_extra: dict[str, str], limit: float) -> tuple[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC"))}
    env.update({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", **env_extra})
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True,
                         timeout=limit)
    return res.stdout + res.stderr, time.monotonic() - t0


def test_master_port_zero_is_refused_at_once():
    out, seconds = _start({"MASTER_PORT": "0"}, limit=60)
    assert "ConfigError" in out and "MASTER_PORT is 0" in out and "--standalone" in out, out
    assert seconds < 30  # no rendezvous attempted (interpreter start-up only)


def test_unreachable_rendezvous_fails_within_the_timeout():
    port = free_port()  # nothing listens there: rank 1 can never reach rank 0
    out, seconds = _start({"MASTER_PORT": str(port), "OPTKIT_DIST_TIMEOUT": "2"}, limit=90)
    assert "ConfigError" in out and "could not join" in out, out
    assert f"127.0.0.1:{port}" in out and "rank 1 of 2" in out, out
    assert seconds < 60


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_bad_timeout_setting(monkeypatch, value):
    from optkit.demo.config import ConfigError
    from optkit.demo.parallel import _timeout_s

    monkeypatch.setenv("OPTKIT_DIST_TIMEOUT", value)
    with pytest.raises(ConfigError, match="seconds"):
        _timeout_s(None)


def test_timeout_default_and_override(monkeypatch):
    from optkit.demo.parallel import DEFAULT_TIMEOUT_S, _timeout_s

    monkeypatch.delenv("OPTKIT_DIST_TIMEOUT", raising=False)
    assert _timeout_s(None) == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("OPTKIT_DIST_TIMEOUT", "12.5")
    assert _timeout_s(None) == 12.5 and _timeout_s(3) == 3.0


def _torchrun(*args: object, limit: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "TORCHELASTIC", "RANK",
                                                                     "WORLD_SIZE", "LOCAL_"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "optkit.cli", "train", *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit)


def test_a_checkpoint_inside_an_accumulation_window_of_two_processes_resumes_exactly(tmp_path):
    """torchrun, --iter-size 2, a checkpoint at step 3 (inside a window: each rank's unreduced sums are
    saved stacked): resuming it under torchrun continues exactly as the uninterrupted run (it was refused
    as "state of another set-up"); resuming it in one process is refused, naming the process count."""
    import torch

    flags = ["--iter-size", 2, "--dtype", "float32", "--loss-scaling", 1, "--loss-scaling-param", "none",
             "--no-progress", "--no-tensorboard", "--no-plot"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    res = _torchrun("--max-steps", 5, "--checkpoint-every", 3, "--keep-checkpoints", 0, *flags,
                    "--run-dir", whole)
    assert res.returncode == 0, res.stderr[-2000:]
    mid = whole / "checkpoints" / "step_000003.pt"
    assert torch.load(mid, weights_only=True)["train_op"]["accumulators_world_size"] == 2
    res = _torchrun("--resume", mid, "--max-steps", 5, "--no-progress", "--no-tensorboard", "--no-plot",
                    "--run-dir", resumed)
    assert res.returncode == 0, res.stderr[-2000:]
    a = torch.load(whole / "checkpoints" / "step_000005.pt", weights_only=True)["model"]
    b = torch.load(resumed / "checkpoints" / "step_000005.pt", weights_only=True)["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    alone = subprocess.run([sys.executable, "-m", "optkit.cli", "train", "--resume", str(mid), "--run-dir",
                            str(tmp_path / "alone"), "--no-progress"], capture_output=True, text=True,
                           timeout=120)
    assert alone.returncode == 2 and "torchrun --nproc-per-node 2" in alone.stderr, alone.stderr
