"""Every ```python block of README.md runs as written (each in a fresh namespace, in a temporary folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of every ```python block."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _BLOCK.finditer(text)]


def test_readme_has_the_tour():
    sources = "\n".join(src for _, src in python_blocks())
    for name in (
        "clip_by_global_norm",
        "poly_decay",
        "PolicySchedule",
        "optkit.SGD",
        "use_ema",
        "optkit.LARS",
        "LARC",
        "MixedPrecisionOptimizerWrapper",
        "optimize_loss",
    ):
        assert name in sources, name


_BLOCKS = python_blocks()


@pytest.mark.parametrize("line, source", _BLOCKS, ids=[f"line{line}" for line, _ in _BLOCKS])
def test_readme_block_runs(line, source, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"{README.name}:{line}", "exec")
    exec(code, {"__name__": f"readme_block_{line}"})
