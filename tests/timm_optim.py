"""timm's optimizer classes as references, loaded from ``timm/optim/<module>.py`` by file path (``import
timm`` needs torchvision, which does not import beside the CPU torch). ``None`` when timm is not installed
or the file does not load (tests then skip)."""

from __future__ import annotations

import importlib.util
import os
import sys
import types

_PKG = "_optkit_test_timm_optim"


def load_timm_optim(module: str, cls: str) -> type | None:
    """``timm.optim.<module>.<cls>`` without importing ``timm``, or None."""
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        return None
    folder = os.path.join(os.path.dirname(spec.origin), "optim")
    path = os.path.join(folder, f"{module}.py")
    if not os.path.exists(path):
        return None
    full = f"{_PKG}.{module}"
    if full not in sys.modules:
        if _PKG not in sys.modules:
            pkg = types.ModuleType(_PKG)
            pkg.__path__ = [folder]
            sys.modules[_PKG] = pkg
        file_spec = importlib.util.spec_from_file_location(full, path)
        mod = importlib.util.module_from_spec(file_spec)
        sys.modules[full] = mod
        try:
            file_spec.loader.exec_module(mod)
        except Exception:  # noqa: BLE001 - an incompatible timm: no reference
            del sys.modules[full]
            return None
    return getattr(sys.modules[full], cls, None)
