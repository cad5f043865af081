"""Checkpoints of a demo run: ``<run>/checkpoints/step_NNNNNN.pt``.

A checkpoint holds the model, the train op (optimizer slots and EMA averages, fp32 master copies, loss-scale
state, step counters), the metrics recorded so far, the run's configuration (a plain dict) and the training
time spent: plain containers, tensors, numbers and strings only. The batch order is a pure function of the
seed and the step (:class:`~optkit.demo.data.BatchOrder`), so resuming from step ``n`` continues exactly as
the uninterrupted run would have.

Nothing in a checkpoint is trusted:

* it is read with ``torch.load(weights_only=True)``: a file that asks to build any Python object (the way a
  crafted pickle runs code) is refused before anything of it is used;
* its layout is checked (:func:`load_checkpoint`) before any value is used, and its tensors are checked
  against the run they are loaded into (:mod:`optkit.demo.resume`);
* where output goes and which checkpoints are pruned never come from it (:mod:`optkit.demo.run_folder`).

Checkpoints are written atomically (:func:`optkit.demo.files.atomic_write`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import ConfigError
from .files import atomic_write, os_reason
from .report import EVAL_KEYS, TRAIN_KEYS
from .run_folder import (
    CHECKPOINTS,
    MARKER,
    checkpoint_name,
    is_run_folder,
    list_checkpoints,
    prune_checkpoints,
    run_folder_of,
)

__all__ = [
    "FORMAT",
    "Checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "find_checkpoint",
    "list_checkpoints",
]

FORMAT = "optkit-demo-checkpoint/1"


@dataclass
class Checkpoint:
    """A checkpoint read by :func:`load_checkpoint`, its layout checked (its tensors are on the CPU)."""

    path: Path
    """The file (symbolic links resolved)."""
    run_dir: Path | None
    """The recognised optkit run folder holding the file, ``None`` when it lies anywhere else."""
    step: int
    model: dict[str, Tensor]
    train_op: dict[str, Any]
    history: dict[str, Any]
    config: dict[str, Any]
    train_seconds: float
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(run_dir: str | Path, step: int, payload: dict[str, Any], keep: int = 0) -> Path:
    """Write ``payload`` as the checkpoint of ``step`` (atomically), then keep the newest ``keep`` checkpoints
    of ``run_dir`` (0 keeps all). ``payload`` must be plain data (it is loaded with ``weights_only=True``)."""
    folder = Path(run_dir) / CHECKPOINTS
    try:
        folder.mkdir(exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create {folder}: {err.strerror or err}") from None
    path = folder / checkpoint_name(step)
    data = {"format": FORMAT, "step": step, **payload}
    atomic_write(path, lambda fh: torch.save(data, fh))
    prune_checkpoints(run_dir, keep)
    return path


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file, or the newest checkpoint of a recognised run folder; ``ConfigError`` otherwise."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not is_run_folder(p):
            hint = (
                f"; did you mean --resume {p.parent}?"
                if p.name == CHECKPOINTS and is_run_folder(p.parent)
                else " (give a run folder made by optkit train, or a checkpoint file)"
            )
            raise ConfigError(f"--resume: {p} is not an optkit run folder: it has no {MARKER}{hint}")
        found = list_checkpoints(p)
        if found:
            return found[-1].resolve()
        raise ConfigError(f"--resume: no checkpoint in {p} (expected {p / CHECKPOINTS / 'step_*.pt'})")
    if p.is_file():
        return p.resolve()
    raise ConfigError(f"--resume: {p} is neither a checkpoint file nor a run folder")


def _refusal(p: Path, err: BaseException) -> ConfigError:
    text = str(err)
    blocked = re.search(r"GLOBAL ([\w.]+)", text)
    if "weights only" in text.lower() or "weights_only" in text or blocked:
        what = f" (it asks to build {blocked.group(1)})" if blocked else ""
        return ConfigError(
            f"--resume: {p} is not a plain-data checkpoint{what}; optkit reads checkpoints with "
            "torch.load(weights_only=True) and runs no code from a file, so it refuses this one"
        )
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return ConfigError(f"--resume: cannot read {p} (truncated, or not a torch checkpoint): {first}")


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format (a zip archive) since torch 1.6
_PICKLE_MAGIC = b"\x80"  # torch.save(_use_new_zipfile_serialization=False): a pickle of protocol 2 or later


def _check_kind(p: Path) -> None:
    """Refuse a file that is no torch checkpoint at all (a TOML configuration, a text file) by its first
    bytes, before ``torch.load`` reads it and fails with an unpickler's internal error."""
    try:
        with p.open("rb") as fh:
            head = fh.read(len(_ZIP_MAGIC))
    except OSError as err:
        raise ConfigError(f"--resume: cannot read {p}: {os_reason(err)}") from None
    if not (head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGIC)):
        raise ConfigError(
            f"--resume: {p} is not a checkpoint: --resume takes a run folder made by optkit train or one of "
            "its checkpoint files (<run>/checkpoints/step_NNNNNN.pt); a TOML configuration goes to --config"
        )


def _read(p: Path) -> Any:
    _check_kind(p)
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to read a foreign file is the file's problem
        raise _refusal(p, err) from None


def _bad(p: Path, what: str) -> ConfigError:
    return ConfigError(f"--resume: {p} is not a valid optkit checkpoint: {what}")


def _column_ok(values: Any) -> bool:
    return isinstance(values, list) and all(v is None or isinstance(v, (bool, numbers.Real)) for v in values)


def _check_history(p: Path, history: Any) -> dict[str, Any]:
    if not isinstance(history, Mapping):
        raise _bad(p, "'history' is not a table")
    out: dict[str, Any] = {}
    for part, keys in (("train", TRAIN_KEYS), ("eval", EVAL_KEYS)):
        columns = history.get(part)
        if not isinstance(columns, Mapping) or set(columns) != set(keys):
            raise _bad(p, f"'history.{part}' must have the columns {', '.join(keys)}")
        if not all(_column_ok(v) for v in columns.values()) or len({len(v) for v in columns.values()}) > 1:
            raise _bad(p, f"'history.{part}' columns must be lists of numbers of one length")
        out[part] = {k: list(columns[k]) for k in keys}
    return out


def _check_tensors(p: Path, name: str, value: Any) -> dict[str, Tensor]:
    if not isinstance(value, Mapping) or not value:
        raise _bad(p, f"'{name}' is not a table of tensors")
    for key, t in value.items():
        if not isinstance(key, str) or not isinstance(t, Tensor):
            raise _bad(p, f"'{name}' entry {key!r} is not a named tensor")
    return dict(value)


def _integer(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < 2**62


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by :func:`save_checkpoint` (a file, or a run folder: its newest checkpoint)
    with ``weights_only=True`` and check its layout. ``ConfigError`` naming the file for anything else."""
    p = find_checkpoint(path)
    data = _read(p)
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise ConfigError(f"--resume: {p} is not an optkit demo checkpoint (no format {FORMAT!r})")
    if not _integer(data.get("step"), 0):
        raise _bad(p, "'step' is not a whole number >= 0")
    if not isinstance(data.get("train_op"), Mapping):
        raise _bad(p, "'train_op' is not a table")
    config = data.get("config")
    if not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config):
        raise _bad(p, "'config' is not a table of options")
    seconds = data.get("train_seconds", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not math.isfinite(seconds):
        raise _bad(p, "'train_seconds' is not a number")
    world = data.get("world_size", 1)
    if not _integer(world, 1):
        raise _bad(p, "'world_size' is not a whole number >= 1")
    known = {"format", "step", "model", "train_op", "history", "config", "train_seconds", "world_size"}
    return Checkpoint(
        path=p,
        run_dir=run_folder_of(p),
        step=data["step"],
        model=_check_tensors(p, "model", data.get("model")),
        train_op=dict(data["train_op"]),
        history=_check_history(p, data.get("history")),
        config=dict(config),
        train_seconds=max(0.0, float(seconds)),
        world_size=world,
        extra={k: v for k, v in data.items() if k not in known},
    )
