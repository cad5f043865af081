"""Process-group set-up for ``optkit train`` under ``torchrun`` (or any launcher that sets ``RANK`` and
``WORLD_SIZE``): the same command runs alone or as ``torchrun --nproc-per-node 2 -m optkit.cli train``.

With ``WORLD_SIZE > 1`` every process joins a gloo group (CPU), trains on its slice of each global batch, and
``optimize_loss(on_horovod=True)`` averages the gradients; rank 0 alone prints and writes files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Processes", "start", "env_world"]


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


def start() -> Processes:
    """Join the process group described by the environment (gloo), or run alone."""
    rank, world = env_world()
    if world == 1:
        return Processes(0, 1)
    if dist.is_initialized():
        return Processes(dist.get_rank(), dist.get_world_size())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Processes(rank, world, owns_group=True)
