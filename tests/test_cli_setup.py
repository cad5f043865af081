"""Set-up and start-up of the command: the Makefile installs once per change of its inputs, ``--version`` and
``--help`` need no torch from the command's own code, missing optional packages are named with the install
command, the package ships ``py.typed`` and its licence, ``docs/api.md`` covers the public API, and the demo's
modules form layers (no import circle)."""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import optkit
from optkit import cli

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "optkit"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def run(*argv: object) -> int:
    return cli.main([str(a) for a in argv])


# ------------------------------------------------------------------------------------------------------------
# Makefile


def _dry_run(folder: Path, target: str) -> str:
    out = subprocess.run(
        ["make", "-n", target], cwd=folder, capture_output=True, text=True, timeout=60, check=True
    )
    return out.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_installs_once_per_change_of_pyproject(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")  # an existing virtual environment
    assert "pip install" in _dry_run(tmp_path, "test")  # never installed: install
    stamp = tmp_path / ".venv" / ".installed"
    stamp.write_text("")
    now = 2_000_000_000
    os.utime(tmp_path / "pyproject.toml", (now - 100, now - 100))
    os.utime(tmp_path / "Makefile", (now - 100, now - 100))
    os.utime(stamp, (now, now))
    for target in ("test", "demo", "lint"):
        plan = _dry_run(tmp_path, target)
        assert "pip" not in plan and "venv" not in plan.split(), (target, plan)  # offline-safe
    os.utime(tmp_path / "pyproject.toml", (now + 100, now + 100))
    assert "pip install" in _dry_run(tmp_path, "demo")  # pyproject.toml changed: install again


# ------------------------------------------------------------------------------------------------------------
# start-up

_LIGHT_START = f"""
import sys
sys.path.insert(0, {str(SRC.parent)!r})
import optkit  # the package body imports its modules on first use (PEP 562)
assert "torch" not in sys.modules
from optkit import cli
for argv in (["--version"], ["--help"], ["train", "--help"], ["lr-plot", "--help"], ["bench", "--help"]):
    try:
        cli.main(argv)
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
big = ("torch", "numpy", "matplotlib", "sklearn", "tqdm", "tensorboard")
heavy = sorted(m for m in big if m in sys.modules)
print("HEAVY", heavy)
"""


def test_version_and_help_import_no_torch_from_the_command():
    out = subprocess.run(
        [sys.executable, "-c", _LIGHT_START], capture_output=True, text=True, timeout=120, check=True
    )
    assert f"optkit {optkit.__version__}" in out.stdout
    assert "HEAVY []" in out.stdout, out.stdout


def test_public_names_load_lazily_from_their_modules():
    """``optkit.__all__`` resolves on first use to the objects its modules define; the eager imports kept for
    type checkers name the same objects from the same modules."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    eager = {}
    for node in guarded.body:
        for alias in node.names:
            eager[alias.name] = f"optkit.{node.module or alias.name}"
    assert set(eager) == set(optkit.__all__) and len(optkit.__all__) == len(set(optkit.__all__))
    for name in optkit.__all__:
        value = getattr(optkit, name)
        module = importlib.import_module(eager[name])
        assert value is (module if module.__name__ == f"optkit.{name}" else getattr(module, name)), name
        assert name in dir(optkit)
    assert optkit.registry.get_optimizer is optkit.get_optimizer  # other submodules as eager imports set them
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        getattr(optkit, "not_a_name")  # noqa: B009 - the attribute look-up is what is tested


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        run("--version")
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"optkit {optkit.__version__}"


# ------------------------------------------------------------------------------------------------------------
# missing optional packages (simulated: the real ones must be installed for the rest of each run)

needs_cli = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("matplotlib", "sklearn", "tqdm", "tensorboard")),
    reason="needs the cli extra",
)


@needs_cli
def test_lr_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails as if not installed
    out = tmp_path / "lr.png"
    assert run("lr-plot", "fixed_lr", "learning_rate=0.1", "--out", out) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "optkit lr-plot: error: optkit lr-plot needs matplotlib, which is not installed: "
        'pip install "optkit[cli]" (or pip install matplotlib)'
    )
    assert not out.exists()


@needs_cli
@pytest.mark.parametrize(
    "module, package, flags",
    [
        ("sklearn", "scikit-learn", ["--no-progress", "--no-tensorboard", "--no-plot"]),
        ("tqdm", "tqdm", ["--no-tensorboard", "--no-plot"]),
        ("tensorboard", "tensorboard", ["--no-progress", "--no-plot"]),
        ("matplotlib", "matplotlib", ["--no-progress", "--no-tensorboard"]),
    ],
)
def test_train_without_an_optional_package(tmp_path, monkeypatch, capsys, module, package, flags):
    monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "run"
    assert run("train", "--max-steps", 2, "--run-dir", out, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f'optkit train needs {package}, which is not installed: pip install "optkit[cli]"' in err
    assert not out.exists()


@needs_cli
def test_print_config_needs_no_optional_package(monkeypatch, capsys):
    for module in ("sklearn", "tqdm", "tensorboard", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)
    assert run("train", "--print-config") == 0
    assert 'optimizer = "LARS"' in capsys.readouterr().out


def test_a_missing_module_found_late_is_still_named(monkeypatch, capsys):
    def late(_args):
        raise ModuleNotFoundError("No module named 'tensorboard.compat'", name="tensorboard.compat")

    monkeypatch.setattr(cli, "_cmd_train", late)
    assert run("train") == 2
    assert 'needs tensorboard, which is not installed: pip install "optkit[cli]"' in capsys.readouterr().err

    def bug(_args):
        raise ModuleNotFoundError("No module named 'optkit.nothing'", name="optkit.nothing")

    monkeypatch.setattr(cli, "_cmd_train", bug)
    with pytest.raises(ModuleNotFoundError):  # not an optional package: a bug, shown as such
        run("train")


# ------------------------------------------------------------------------------------------------------------
# packaging and docs


def test_py_typed_and_licence_ship():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (SRC / "py.typed").is_file()
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["optkit"]
    assert meta["project"]["license"] == {"text": "Apache-2.0"}
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence


def test_api_reference_lists_every_public_name():
    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [name for name in optkit.__all__ if f"### `{name}`" not in page]
    assert not missing, f"docs/api.md lacks {missing}: run python tools/gen_api.py"


def test_api_reference_is_current():
    """``docs/api.md`` is exactly what ``tools/gen_api.py`` writes from today's docstrings and signatures (run
    in a fresh interpreter: torch wraps an optimizer class's ``step`` once an instance exists, which would
    add members to the page)."""
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_api.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------------------------------------------------
# the demo's layers


def _demo_imports(path: Path) -> set[str]:
    """Sibling demo modules and heavy packages ``path`` imports (at module level or inside functions)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                found.add(module.split(".")[0])
            elif module.startswith("optkit.demo."):
                found.add(module.split(".")[2])
            elif module.split(".")[0] in ("torch", "optkit"):
                found.add(module.split(".")[0] + ":")
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] + ":" for a in node.names if a.name.split(".")[0] == "torch"}
    return found


def test_demo_modules_form_layers():
    graph = {p.stem: _demo_imports(p) for p in (SRC / "demo").glob("*.py") if p.stem != "__init__"}
    assert graph["config"] <= set(), graph["config"]  # the bottom layer: option values, no torch, no library
    assert "components" not in graph["config"] and "validation" not in graph["components"]

    def visit(node: str, path: tuple[str, ...]) -> None:
        for dep in graph.get(node, ()):
            if dep in graph:
                assert dep not in path, f"import circle: {' -> '.join((*path, dep))}"
                visit(dep, (*path, dep))

    for module in graph:
        visit(module, (module,))


def test_digits_read_without_scikit_learn_match_its_loader():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    import numpy as np

    from optkit.demo import data

    images, labels = data._digits()
    bunch = sklearn_datasets.load_digits()
    assert len(labels) == data.N_DIGITS
    assert np.array_equal(images, bunch.images.astype(np.float32))
    assert np.array_equal(labels, bunch.target)
