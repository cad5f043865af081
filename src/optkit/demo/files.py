"""Writing files safely: every output of the demo is written whole or not at all.

:func:`atomic_write` writes to a hidden temporary file next to the target, flushes it to disk, and renames it
over the target; on any failure (a full disk, a read-only folder, an interrupt) the temporary file is removed
and the target is left as it was. An ``OSError`` becomes a :class:`~optkit.demo.config.ConfigError` naming
the file, which the command reports in one line (exit status 2); so does the ``RuntimeError`` that
``torch.save`` raises when its stream cannot be written (it reports a full disk as ``[enforce fail at
inline_container.cc] ... unexpected pos``, the ``OSError`` behind it only as its context).
:func:`check_writable` tells beforehand whether a folder takes new files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .config import ConfigError

__all__ = ["atomic_write", "write_bytes", "os_reason", "check_writable"]


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


_STREAM_FAILURES = ("inline_container", "PytorchStreamWriter", "unexpected pos")
"""Text of the ``RuntimeError`` torch's zip writer raises when the stream under it fails."""


def _write_failure(err: BaseException) -> str | None:
    """Why writing failed, when ``err`` (raised by a writer such as ``torch.save``) comes from the file
    rather than from the data: the ``OSError`` it was raised while handling, or torch's stream-writer
    failure. ``None`` for anything else (a bug, not the disk: it propagates)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return os_reason(cause)
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    text = str(err).strip()
    if isinstance(err, RuntimeError) and any(marker in text for marker in _STREAM_FAILURES):
        first = text.splitlines()[0]
        return f"the write failed (is the disk full?): {first}"
    return None


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(fh)`` on a temporary file in ``path``'s folder, then rename it to ``path``.

    Raises :class:`ConfigError` ("cannot write PATH: reason") on an ``OSError``, or on a writer's error that
    comes from the file (``torch.save``'s ``RuntimeError`` on a full disk); nothing is left behind (neither a
    partial ``path`` nor a temporary file)."""
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
    except Exception as err:
        reason = _write_failure(err)
        if reason is None:
            raise
        raise ConfigError(f"cannot write {target}: {reason}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return target


def write_bytes(path: str | Path, data: bytes) -> Path:
    """:func:`atomic_write` of ``data``."""
    return atomic_write(path, lambda fh: fh.write(data))


def check_writable(folder: str | Path) -> None:
    """Create and remove a hidden temporary file in ``folder``: :class:`ConfigError` ("cannot write FOLDER:
    reason") when the folder takes no new file (read-only, no permission, full), before anything that
    writes there in the background starts."""
    target = Path(folder)
    try:
        fd, name = _create_temporary(target / "write-test")
    except OSError as err:
        raise ConfigError(f"cannot write {target}: {os_reason(err)}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
