"""Process-group set-up for ``optkit train`` under ``torchrun`` (or any launcher that sets ``RANK`` and
``WORLD_SIZE``): the same command runs alone or as ``torchrun --nproc-per-node 2 -m optkit.cli train``.

With ``WORLD_SIZE > 1`` every process joins a gloo group (CPU), trains on its slice of each global batch, and
``optimize_loss(on_horovod=True)`` averages the gradients; rank 0 alone prints and writes files.

Joining is bounded: the rendezvous and every collective time out after ``OPTKIT_DIST_TIMEOUT`` seconds
(default :data:`DEFAULT_TIMEOUT_S`), and a failure names the address, port and rank instead of hanging.
``torchrun --master-port 0`` is refused at once: torchrun hands the workers port 0 itself, so they could never
find each other (use ``--standalone`` for a free port chosen by torchrun).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import ConfigError

__all__ = ["Processes", "start", "env_world", "DEFAULT_TIMEOUT_S"]

#: seconds allowed for joining the process group and for each collective (``OPTKIT_DIST_TIMEOUT``)
DEFAULT_TIMEOUT_S = 300.0


def env_world() -> tuple[int, int]:
    """``(rank, world_size)`` from the environment (``(0, 1)`` when not launched by torchrun)."""
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError("RANK and WORLD_SIZE must be integers when set (they are set by torchrun)") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} / WORLD_SIZE={world} is not a valid process layout")
    return rank, world


@dataclass
class Processes:
    """This process's place in the run."""

    rank: int
    world_size: int
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean_(self, t: torch.Tensor) -> torch.Tensor:
        """Average ``t`` over the ranks in place (one all-reduce)."""
        if self.distributed:
            dist.all_reduce(t)
            t.div_(self.world_size)
        return t

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _timeout_s(timeout: float | None) -> float:
    if timeout is None:
        raw = os.environ.get("OPTKIT_DIST_TIMEOUT")
        if raw is None:
            return DEFAULT_TIMEOUT_S
        try:
            timeout = float(raw)
        except ValueError:
            raise ConfigError(f"OPTKIT_DIST_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not timeout > 0:
        raise ConfigError(f"the process-group timeout must be > 0 seconds, got {timeout!r}")
    return float(timeout)


def start(timeout: float | None = None) -> Processes:
    """Join the process group described by the environment (gloo), or run alone.

    ``timeout`` (seconds; default ``OPTKIT_DIST_TIMEOUT`` or :data:`DEFAULT_TIMEOUT_S`) bounds the rendezvous
    and every later collective. Raises :class:`~optkit.demo.config.ConfigError` with the address, port and
    rank when the group cannot be joined, and at once for ``MASTER_PORT=0``.
    """
    rank, world = env_world()
    if world == 1:
        return Processes(0, 1)
    if dist.is_initialized():
        return Processes(dist.get_rank(), dist.get_world_size())
    seconds = _timeout_s(timeout)
    addr = os.environ.get("MASTER_ADDR", "")
    port = os.environ.get("MASTER_PORT", "")
    if port.strip() == "0":
        raise ConfigError(
            f"MASTER_PORT is 0 (rank {rank} of {world}): the processes cannot find each other on port 0 "
            "(torchrun --master-port 0 passes 0 on to them). Give a free port, e.g. --master-port 29500, "
            "or use torchrun --standalone"
        )
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=seconds))
    except (RuntimeError, ValueError) as err:  # the Dist*Error classes are RuntimeErrors
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(
            f"rank {rank} of {world} could not join the process group at {addr or '?'}:{port or '?'} within "
            f"{seconds:g} s ({first}). Start every process with the same --master-addr/--master-port "
            "(a reachable address and a free port) or use torchrun --standalone; OPTKIT_DIST_TIMEOUT sets "
            "the time limit"
        ) from None
    return Processes(rank, world, owns_group=True)
