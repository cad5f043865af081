"""optkit's modules import one another without a circle (``tools/import_graph.py``), imports inside functions
counted; and the script finds circles where there are some."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
assert _spec is not None and _spec.loader is not None
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_optkit_has_no_import_cycle(capsys):
    cycles = import_graph.import_cycles(ROOT / "src", "optkit")
    assert cycles == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
    assert import_graph.main([]) == 0
    assert "0 import cycle(s)" in capsys.readouterr().out


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_finds_every_circle(tmp_path):
    """Imports at module level, inside functions, relative at two levels, of a submodule by ``from pkg import
    sub`` and absolute; ``if TYPE_CHECKING:`` only when asked."""
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from . import b\nfrom .sub import e\n",
        "pkg/b.py": "def f():\n    from .a import x\n    return x\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/e.py": "class E:\n    def m(self):\n        from ..a import z\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\nelse:\n"
                    "    import json\n",
        "pkg/d.py": "import pkg.c\nfrom pkg import __version__\n",
        "pkg/f.py": "import os\nfrom pkg.sub import e\n",
    })
    graph = import_graph.import_graph(tmp_path, "pkg")
    assert graph == {
        "pkg": set(), "pkg.a": {"pkg.b", "pkg.sub", "pkg.sub.e"}, "pkg.b": {"pkg.a"}, "pkg.sub": set(),
        "pkg.sub.e": {"pkg.a"}, "pkg.c": set(), "pkg.d": {"pkg", "pkg.c"}, "pkg.f": {"pkg.sub", "pkg.sub.e"},
    }
    assert import_graph.import_cycles(tmp_path, "pkg") == [
        ["pkg.a", "pkg.b", "pkg.a"], ["pkg.a", "pkg.sub.e", "pkg.a"]]
    assert import_graph.import_cycles(tmp_path, "pkg", type_checking=True) == [
        ["pkg.a", "pkg.b", "pkg.a"], ["pkg.a", "pkg.sub.e", "pkg.a"], ["pkg.c", "pkg.d", "pkg.c"]]
