"""The run folder of ``optkit train`` and the rules for writing into it.

A run folder holds ``optkit-run.json`` (written when the run creates the folder: it is how a folder is
recognised as an optkit run), ``metrics.json``, ``report.png``, ``tensorboard/`` and
``checkpoints/step_NNNNNN.pt``. The rules:

* a new run writes only into a folder it creates, or into an existing *empty* one; a non-empty folder, a
  file, or a path under a file is refused (:func:`check_new_run_dir`), never overwritten. Without
  ``--run-dir`` the run creates a fresh ``runs/<date>-<time>`` (with a ``-2``, ``-3``... suffix when taken);
* a resumed run writes only into the recognised run folder that holds its checkpoint (or into a new folder
  given with ``--run-dir``); where output goes is never read from a checkpoint's contents;
* pruning deletes only regular files named ``step_NNNNNN.pt`` in the run's own ``checkpoints/`` folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from datetime import datetime
from pathlib import Path

from .config import ConfigError
from .files import os_reason, write_bytes

__all__ = [
    "MARKER",
    "RUN_FORMAT",
    "CHECKPOINTS",
    "CHECKPOINT_NAME",
    "checkpoint_name",
    "is_run_folder",
    "run_folder_of",
    "check_new_run_dir",
    "default_run_dir",
    "create_run_dir",
    "list_checkpoints",
    "prune_checkpoints",
]

MARKER = "optkit-run.json"
RUN_FORMAT = "optkit-demo-run/1"
CHECKPOINTS = "checkpoints"
CHECKPOINT_NAME = re.compile(r"^step_(\d{6,})\.pt$")
_MARKER_MAX_BYTES = 64 * 1024


def checkpoint_name(step: int) -> str:
    """``step_000042.pt``."""
    return f"step_{step:06d}.pt"


def is_run_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding an ``optkit-run.json`` marker of this format."""
    marker = Path(path) / MARKER
    try:
        info = marker.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MARKER_MAX_BYTES:
            return False
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == RUN_FORMAT


def run_folder_of(checkpoint: str | Path) -> Path | None:
    """The recognised run folder holding ``checkpoint`` (``<run>/checkpoints/step_NNNNNN.pt``, symbolic links
    resolved), or ``None`` when the file lies anywhere else."""
    real = Path(checkpoint).resolve()
    if real.parent.name != CHECKPOINTS or not CHECKPOINT_NAME.match(real.name):
        return None
    run = real.parent.parent
    return run if is_run_folder(run) else None


def _first_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(".")


def check_new_run_dir(path: str | Path, flag: str = "--run-dir") -> None:
    """Refuse (``ConfigError`` naming ``flag``) a folder a new run may not write into: an existing file, a
    non-empty folder, or a path below a file. Reads only."""
    p = Path(path)
    if p.is_dir():
        try:
            entries = sorted(e.name for e in os.scandir(p))
        except OSError as err:
            raise ConfigError(f"{flag}: cannot read {p}: {os_reason(err)}") from None
        if entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            what = "an optkit run" if MARKER in entries else f"not empty ({shown})"
            raise ConfigError(
                f"{flag}: {p} is {what}; a new run writes only into a new or empty folder "
                f"(continue that run with --resume {p}, or choose another --run-dir)"
            )
        return
    if os.path.lexists(p):
        raise ConfigError(f"{flag}: {p} exists and is not a folder; choose a new folder for the run")
    base = _first_existing(p.parent)
    if not base.is_dir():
        raise ConfigError(f"{flag}: cannot create {p}: {base} is not a folder")


def default_run_dir(root: str | Path = "runs") -> Path:
    """``runs/<date>-<time>`` (with a ``-2``, ``-3``... suffix if that folder exists)."""
    base = Path(root) / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while os.path.lexists(path):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _marker_bytes() -> bytes:
    from optkit import __version__

    data = {
        "format": RUN_FORMAT,
        "created": datetime.now().isoformat(timespec="seconds"),
        "optkit_version": __version__,
    }
    return (json.dumps(data, indent=1) + "\n").encode()


def _make_folder(path: Path, flag: str) -> list[Path]:
    """Create ``path`` (and missing parents); return the folders this call created, innermost first."""
    created = [q for q in (path, *path.parents) if not os.path.lexists(q)]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag}: cannot create {path}: {os_reason(err)}") from None
    return created


def create_run_dir(path: str | Path | None, flag: str = "--run-dir") -> Path:
    """Create the folder of a new run (``None``: a fresh :func:`default_run_dir`) and its marker.

    ``path`` must pass :func:`check_new_run_dir`. On any failure the folders this call created are removed
    again and :class:`ConfigError` names ``flag`` and the reason."""
    if path is None:
        flag = "--run-dir (default runs/<date>-<time>)"
        for _ in range(100):  # another run may take the same name between the look and the mkdir
            target = default_run_dir()
            check_new_run_dir(target, flag)
            created = _make_folder(target, flag)
            if created and created[0] == target:
                break
        else:  # pragma: no cover - a hundred collisions
            raise ConfigError(f"{flag}: cannot find a free folder name under runs/")
    else:
        target = Path(path)
        check_new_run_dir(target, flag)
        created = _make_folder(target, flag)
    try:
        write_bytes(target / MARKER, _marker_bytes())
    except ConfigError as err:
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise ConfigError(f"{flag}: {err}") from None
    return target


def _checkpoint_files(run_dir: str | Path) -> list[tuple[int, Path]]:
    folder = Path(run_dir) / CHECKPOINTS
    found = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        m = CHECKPOINT_NAME.match(entry.name)
        if m and entry.is_file(follow_symlinks=False):
            found.append((int(m.group(1)), Path(entry.path)))
    return sorted(found)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's checkpoints (regular files ``checkpoints/step_NNNNNN.pt``), oldest step first."""
    return [p for _, p in _checkpoint_files(run_dir)]


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest checkpoints of ``run_dir`` (``keep=0`` deletes nothing); return the
    deleted files. Only :func:`list_checkpoints` files are candidates."""
    if keep <= 0:
        return []
    doomed = list_checkpoints(run_dir)[:-keep]
    for path in doomed:
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot delete the old checkpoint {path}: {os_reason(err)}") from None
    return doomed
