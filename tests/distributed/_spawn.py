"""Spawn a small gloo process group on 127.0.0.1 and run a function on every rank.

``run_on_ranks(fn, world_size=2)`` starts ``world_size`` fresh interpreters (``spawn``), each joins a gloo
group on a free local port, runs ``fn(rank, world_size, *args)`` and sends its (picklable) result back. The
parent waits at most ``timeout`` seconds in all; the group itself has a shorter collective timeout, so a
mismatched collective raises on the ranks instead of hanging, and a rank that dies or a run past the deadline
fails the caller (children are terminated) rather than blocking CI.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 30.0


class DistributedRunError(RuntimeError):
    """A rank raised, died, or the run exceeded its deadline."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, out: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        out.put((rank, False, traceback.format_exc()))


def run_on_ranks(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; return results by rank.

    ``fn`` must be importable by name (a module-level function). Raises :class:`DistributedRunError` with the
    failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        deadline = _now() + timeout
        while len(results) + len(errors) < world_size:
            left = deadline - _now()
            if left <= 0:
                raise DistributedRunError(f"distributed run exceeded {timeout:.0f} s")
            try:
                rank, ok, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise DistributedRunError(
                        f"rank process exited with code {dead[0].exitcode} before reporting") from None
                continue
            if ok:
                results[rank] = payload
            else:
                errors.append(f"rank {rank}:\n{payload}")
        if errors:
            raise DistributedRunError("\n".join(errors))
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)


def _now() -> float:
    import time

    return time.monotonic()
