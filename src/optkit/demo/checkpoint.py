"""Checkpoints of a demo run: ``<run>/checkpoints/step_<NNNNNN>.pt``.

A checkpoint holds the model, the train op (optimizer slots and EMA averages, fp32 master copies, loss-scale
state, step counters), the metrics recorded so far, the run's configuration and the training time spent.
The batch order is a pure function of the seed and the step (:class:`~optkit.demo.data.BatchOrder`), so
resuming from step ``n`` continues exactly as the uninterrupted run would have.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError

__all__ = ["FORMAT", "save_checkpoint", "load_checkpoint", "find_checkpoint", "list_checkpoints"]

FORMAT = "optkit-demo-checkpoint/1"
_NAME = re.compile(r"^step_(\d+)\.pt$")


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: str | Path, step: int, payload: dict[str, Any], keep: int = 0) -> Path:
    """Write ``payload`` as the checkpoint of ``step`` (atomically: temp file, then rename); keep the newest
    ``keep`` checkpoints (0 keeps all)."""
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save({"format": FORMAT, "step": step, **payload}, tmp)
    os.replace(tmp, path)
    if keep:
        for old in list_checkpoints(run_dir)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the newest checkpoint of a run folder; ``ConfigError`` if there is none."""
    p = Path(path)
    if p.is_file():
        return p
    if p.is_dir():
        found = list_checkpoints(p)
        if found:
            return found[-1]
        raise ConfigError(f"--resume: no checkpoint in {p} (expected {p / 'checkpoints' / 'step_*.pt'})")
    raise ConfigError(f"--resume: {p} is neither a checkpoint file nor a run folder")


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` (CPU tensors)."""
    p = find_checkpoint(path)
    try:
        data = torch.load(p, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file
        raise ConfigError(f"--resume: cannot read {p}: {err}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"--resume: {p} is not an optkit demo checkpoint")
    data["path"] = str(p)
    return data
