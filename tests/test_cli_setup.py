"""Set-up and start-up of the command: the Makefile installs once per change of its inputs, ``--version`` and
``--help`` need no torch from the command's own code, missing optional packages are named with the install
command, the package ships ``py.typed`` and its licence, ``docs/api.md`` covers the public API, and the demo's
modules form layers (no import circle)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
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


_LOGGER = """#!/bin/sh
echo "$(basename "$0") $*" >> "$(dirname "$0")/../../calls.log"
"""


def _fake_checkout(folder: Path) -> Path:
    """The Makefile and pyproject.toml in ``folder`` with a ``.venv`` whose pip, python, optkit and ruff only
    log their calls (to ``calls.log``): the targets run for real, installing nothing."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, folder / name)
    bin_dir = folder / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for tool in ("pip", "python", "optkit", "ruff"):
        (bin_dir / tool).write_text(_LOGGER)
        (bin_dir / tool).chmod(0o755)
    return folder / "calls.log"


def _make(folder: Path, log: Path, target: str) -> list[str]:
    """Run ``make target`` in ``folder``; the logged calls it made."""
    log.write_text("")
    subprocess.run(["make", "-s", target], cwd=folder, capture_output=True, text=True, timeout=60, check=True)
    return log.read_text().splitlines()


def _installs(calls: list[str]) -> list[str]:
    return [c for c in calls if c.startswith("pip ")]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_installs_once_per_change_of_pyproject(tmp_path):
    """``make demo`` installs optkit with the cli extra only (not the test extra's lightning, transformers and
    accelerate); ``make test`` installs everything; each install runs once per change of pyproject.toml or the
    Makefile (its stamp), in either order of the targets, and later calls go straight to the work."""
    log = _fake_checkout(tmp_path)
    then = time.time() - 10_000  # the inputs' time: older than any stamp make writes now
    for name in ("pyproject.toml", "Makefile"):
        os.utime(tmp_path / name, (then, then))

    demo = _make(tmp_path, log, "demo")
    assert any('-e .[cli]' in c for c in _installs(demo)), demo
    assert not any("test" in c or "dev" in c or "timm" in c for c in _installs(demo)), demo
    assert demo[-1] == "optkit train"
    assert _make(tmp_path, log, "demo") == ["optkit train"]  # installed: straight to the work, also offline

    test = _make(tmp_path, log, "test")  # after the demo's install: the rest is installed
    assert any('-e .[dev,cli,test]' in c for c in _installs(test)), test
    assert any("--no-deps timm" in c for c in _installs(test)), test
    assert test[-1] == "python -m pytest -n 2 tests"
    for target in ("test", "demo", "lint", "docs"):  # the full install also serves the demo
        assert not _installs(_make(tmp_path, log, target)), target

    stamp = tmp_path / ".venv" / ".installed"
    os.utime(stamp, (then + 100, then + 100))
    os.utime(tmp_path / ".venv" / ".installed-demo", (then + 100, then + 100))
    os.utime(tmp_path / "pyproject.toml", (then + 200, then + 200))  # pyproject.toml changed: install again
    assert any('-e .[cli]' in c for c in _installs(_make(tmp_path, log, "demo")))
    assert any('-e .[dev,cli,test]' in c for c in _installs(_make(tmp_path, log, "test")))
    assert not _installs(_make(tmp_path, log, "demo"))
    (tmp_path / ".venv" / ".installed-demo").unlink()  # a fresh clone, make test first: demo ready too
    stamp.unlink()
    _make(tmp_path, log, "test")
    assert not _installs(_make(tmp_path, log, "demo"))


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
        'pip install -e ".[cli]" in the optkit checkout (or pip install matplotlib)'
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
    assert f'optkit train needs {package}, which is not installed: pip install -e ".[cli]" in the optkit ' \
        f"checkout (or pip install {package})" in err
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
    err = capsys.readouterr().err
    assert 'needs tensorboard, which is not installed: pip install -e ".[cli]" in the optkit checkout' in err

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
    assert meta["project"]["license"] == "Apache-2.0"  # an SPDX expression (the table form is deprecated)
    assert meta["project"]["license-files"] == ["LICENSE"]
    licence = (ROOT / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert "END OF TERMS AND CONDITIONS" in licence


_NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
    ".ruff_cache",
)


def test_sdist_ships_the_test_suite_and_what_it_reads(tmp_path):
    """The sdist (built from a copy of the checkout with setuptools' own backend, as ``python -m build
    --sdist`` does) ships the whole test suite with every helper module it imports, the files tests read
    (README.md, Makefile, docs/api.md, tools/gen_api.py), the README's images, ``py.typed`` and the licence
    as an SPDX expression; no bytecode."""
    pytest.importorskip("setuptools", minversion="77")  # the SPDX license string (PEP 639)
    tree = tmp_path / "checkout"
    shutil.copytree(ROOT, tree, ignore=_NOT_COPIED)
    code = "import sys, setuptools.build_meta as b; print(b.build_sdist(sys.argv[1]))"
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=tree, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    with tarfile.open(tmp_path / "dist" / res.stdout.split()[-1]) as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        top = members[0].name.split("/")[0]
        shipped = {m.name.split("/", 1)[1] for m in members}
        pkg_info = tar.extractfile(f"{top}/PKG-INFO").read().decode()
    suite = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*.py")
             if "__pycache__" not in p.parts}
    assert {"tests/conftest.py", "tests/contract_table.py", "tests/reference_rules.py"} <= suite
    read = {"README.md", "Makefile", "pyproject.toml", "LICENSE", "docs/api.md", "tools/gen_api.py",
            "src/optkit/py.typed"}
    images = set(re.findall(r"!\[[^\]]*\]\((?!https?:)([^)\s]+)\)", (ROOT / "README.md").read_text("utf-8")))
    assert images, "README.md shows no image?"
    missing = sorted((suite | read | images) - shipped)
    assert not missing, f"the sdist lacks {missing}: MANIFEST.in"
    assert not [name for name in shipped if name.endswith((".pyc", ".pyo"))]
    assert "License-Expression: Apache-2.0" in pkg_info and "License-File: LICENSE" in pkg_info


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


def test_api_docs_cite_no_file_outside_the_package():
    """Docstrings and comments cite the paper or the original source (or docs/), never the project's
    working notes, which a user of the package does not have."""
    banned = re.compile(r"spec/|DESIGN §|shared/|seed \d{3}")
    hits = []
    for path in sorted(SRC.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for no, line in enumerate(text.splitlines(), 1):
            if banned.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not hits, "cite the original source instead:\n" + "\n".join(hits)


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
