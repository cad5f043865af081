"""Writing files safely: every output of the demo is written whole or not at all.

:func:`atomic_write` writes to a hidden temporary file next to the target, flushes it to disk, and renames it
over the target; on any failure (a full disk, a read-only folder, an interrupt) the temporary file is removed
and the target is left as it was. An ``OSError`` becomes a :class:`~optkit.demo.config.ConfigError` naming
the file, which the command reports in one line (exit status 2).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .config import ConfigError

__all__ = ["atomic_write", "write_bytes", "os_reason"]


def os_reason(err: OSError) -> str:
    """The human part of an ``OSError`` ("No space left on device"), without the file name."""
    return err.strerror or str(err) or type(err).__name__


def _create_temporary(target: Path) -> tuple[int, str]:
    """A new hidden file next to ``target`` (permissions from the umask, as a plain ``open`` gives)."""
    while True:
        name = str(target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp"))
        try:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), name
        except FileExistsError:  # pragma: no cover - a name collision
            continue


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(fh)`` on a temporary file in ``path``'s folder, then rename it to ``path``.

    Raises :class:`ConfigError` ("cannot write PATH: reason") on an ``OSError``; nothing is left behind
    (neither a partial ``path`` nor a temporary file)."""
    target = Path(path)
    tmp: str | None = None
    try:
        fd, tmp = _create_temporary(target)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as err:
        raise ConfigError(f"cannot write {target}: {os_reason(err)}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return target


def write_bytes(path: str | Path, data: bytes) -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda fh: fh.write(data))
