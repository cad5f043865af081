"""The demo's optional dependencies (the ``cli`` extra): what each part needs, checked before any work.

The library needs only torch; ``optkit train`` and ``optkit lr-plot`` need some of numpy, scikit-learn (the
bundled digits), tqdm (progress bar), tensorboard (event files) and matplotlib (``report.png``, the lr plot).
:func:`require` finds the missing ones without importing anything and raises :class:`MissingExtra`, which
names them and the command that installs them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from .config import ConfigError

__all__ = ["CLI_EXTRA", "PACKAGES", "MissingExtra", "missing", "require", "extra_for"]

CLI_EXTRA = 'pip install -e ".[cli]" in the optkit checkout'
"""How to install the ``cli`` extra: optkit is installed from its source checkout (it is on no package
index), so the command runs there, from the repository root."""
PACKAGES = {
    "numpy": "numpy",
    "sklearn": "scikit-learn",
    "tqdm": "tqdm",
    "tensorboard": "tensorboard",
    "matplotlib": "matplotlib",
}
"""Importable module -> the package that provides it."""


class MissingExtra(ConfigError):
    """An optional module the command needs is not installed."""


def missing(modules: Iterable[str]) -> list[str]:
    """The modules of ``modules`` that cannot be imported (found without importing them)."""
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a broken or half-removed installation
            found = False
        if not found:
            absent.append(name)
    return absent


def extra_for(modules: Iterable[str], what: str) -> MissingExtra:
    """The error for ``what`` (e.g. ``"optkit train"``) lacking ``modules``."""
    names = [PACKAGES.get(m, m) for m in modules]
    verb = "is" if len(names) == 1 else "are"
    return MissingExtra(
        f"{what} needs {', '.join(names)}, which {verb} not installed: {CLI_EXTRA} "
        f"(or pip install {' '.join(names)})"
    )


def require(modules: Iterable[str], what: str) -> None:
    """Raise :class:`MissingExtra` if any of ``modules`` is not installed."""
    absent = missing(modules)
    if absent:
        raise extra_for(absent, what)
