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


def _timm_file(relpath: str) -> str | None:
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), relpath)
    return path if os.path.exists(path) else None


def _exec_nodes(path: str, keep, namespace: dict) -> dict:
    """Run the top-level statements of ``path`` that ``keep(node)`` accepts in ``namespace`` (so that a
    function can be taken from a timm file whose imports need the whole of timm)."""
    import ast

    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    body = [n for n in tree.body if keep(n)]
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), namespace)  # noqa: S102
    return namespace


def load_timm_vit_layer_decay():
    """``(param_groups_layer_decay, vit_group_matcher)``: timm's ``timm.optim._param_groups.
    param_groups_layer_decay`` (over timm's own ``group_parameters``) and the dict that timm's
    ``VisionTransformer.group_matcher()`` returns, both taken from timm's source files without importing
    ``timm``; None when timm is not installed or its files have changed shape."""
    import ast

    manip = _timm_file(os.path.join("models", "_manipulate.py"))
    groups = _timm_file(os.path.join("optim", "_param_groups.py"))
    vit = _timm_file(os.path.join("models", "vision_transformer.py"))
    if manip is None or groups is None or vit is None:
        return None

    def plain_import(n) -> bool:  # stdlib / torch imports only
        if isinstance(n, ast.Import):
            return all(not a.name.startswith("timm") for a in n.names)
        return isinstance(n, ast.ImportFrom) and n.level == 0 and not (n.module or "").startswith("timm")

    try:
        def wanted(n) -> bool:
            if isinstance(n, ast.FunctionDef):
                return n.name in ("group_with_matcher", "group_parameters")
            if isinstance(n, ast.Assign):
                return any(getattr(t, "id", None) == "MATCH_PREV_GROUP" for t in n.targets)
            return plain_import(n)

        m = _exec_nodes(manip, wanted, {})
        g = _exec_nodes(groups, lambda n: plain_import(n) or isinstance(n, (ast.FunctionDef, ast.Assign)),
                        {"group_parameters": m["group_parameters"]})
        with open(vit, encoding="utf-8") as f:
            tree = ast.parse(f.read(), vit)
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VisionTransformer")
        fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "group_matcher")
        fn.decorator_list = []
        fn.returns = None
        ns: dict = {}
        exec(compile(ast.Module(body=[fn], type_ignores=[]), vit, "exec"), ns)  # noqa: S102
        matcher = ns["group_matcher"](None, coarse=False)
        return g["param_groups_layer_decay"], matcher
    except Exception:  # noqa: BLE001 - another timm layout: no reference
        return None
