"""The engine's boundary: no module outside the engine (``optkit/optimizer.py`` and ``optkit/_core/``) reads
or writes a private name of the optimizer base through another object (``inner._current_lr``,
``getattr(opt, "_any_dtensor")``); wrappers, the train op and the checkpoint helpers go through
``apply_step(StepContext)`` and ``opt.engine``. (An optimizer subclass's own ``self._...`` hooks are its
rule, not a reach-in.)"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import optkit

PACKAGE = Path(optkit.__file__).resolve().parent
ENGINE = {PACKAGE / "optimizer.py", *(PACKAGE / "_core").glob("*.py")}

#: private names other classes define for themselves (a wrapper's own ``_current_lr`` and ``_all_params``,
#: which a wrapper calls on the wrapper it wraps)
OWN_NAMES = {"_current_lr", "_all_params", "_remap_params", "_record", "_step"}


def _private_engine_names() -> set[str]:
    """Private methods, class attributes and ``self._x`` attributes the engine defines."""
    names: set[str] = set()
    for path in ENGINE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        names.add(item.name)
                    elif isinstance(item, ast.Assign):
                        names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self":
                names.add(node.attr)
    # torch's own names (the optimizer's hook dicts, a tensor's ``_version``): torch's protocol, not optkit's
    torch_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch_names = set(dir(torch.optim.Optimizer)) | set(vars(torch_opt)) | set(dir(torch.Tensor))
    return {n for n in names - torch_names if n.startswith("_") and not n.startswith("__")}


def _reach_ins(source: str, names: set[str]) -> list[str]:
    """``obj._name`` (obj not ``self``/``cls``/``super()``) and ``getattr/setattr/hasattr/delattr(obj,
    "_name")`` with ``_name`` among ``names``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            base = node.value
            own = (isinstance(base, ast.Name) and base.id in ("self", "cls")) or (
                isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super")
            if not own:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in names \
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_engine_reaches_into_its_private_names():
    names = _private_engine_names() - OWN_NAMES
    assert {"_current_lr", "_zero_grad", "_flat_part", "_compiled_pass", "_any_dtensor"} & (
        _private_engine_names()), "the scan finds the engine's names"
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in ENGINE:
            continue
        hits = _reach_ins(path.read_text(), names)
        if hits:
            offenders[str(path.relative_to(PACKAGE))] = hits
    assert not offenders, offenders


def test_the_scan_finds_a_reach_in():
    """The check can fail: a wrapper that reads the inner optimizer's private state is found."""
    names = _private_engine_names() - OWN_NAMES
    src = ("def f(inner):\n    inner._zero_grad(True, set())\n"
           "    return getattr(inner, '_any_dtensor', True)\n")
    assert len(_reach_ins(src, names)) == 2
    assert _reach_ins("def f(self):\n    return self._zero_grad\n", names) == []
