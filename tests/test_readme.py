"""Every ```python block of README.md, and of the docs pages that hold runnable examples (``DOC_PAGES``: the
flat-buffer page and the migration guide, whose snippets moved out of or point from the README, the guide
to writing an optimizer and the lean-precision page), runs as written (each in a fresh namespace, in a
temporary folder)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: docs pages whose ```python blocks are complete examples (docs/api.md's blocks are signatures)
DOC_PAGES = ("docs/flat_buffers.md", "docs/migrating.md", "docs/extending.md", "docs/precision.md")
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(path: Path = README) -> list[tuple[int, str]]:
    """(line number, source) of every ```python block of ``path`` (the README by default)."""
    text = path.read_text(encoding="utf-8")
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


def test_docs_pages_have_their_examples():
    """The flat-buffer example moved from the README to its page; the migration guide opens with one."""
    def sources(page: str) -> str:
        return "\n".join(src for _, src in python_blocks(ROOT / page))

    assert "optkit.flat_parameters" in sources("docs/flat_buffers.md")
    assert "optkit.Momentum" in sources("docs/migrating.md")
    assert "class Lion(Optimizer)" in sources("docs/extending.md")


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_maps_every_docs_page_and_links_resolve():
    """The README's map of the docs links every page in docs/, and every relative link of the README and of
    the pages points at a file or folder of the checkout (anchors and web addresses aside)."""
    text = README.read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    linked = set(_LINK.findall(text))
    assert [p for p in pages if p not in linked] == []
    broken = []
    for doc in [README, *(ROOT / p for p in pages)]:
        for target in _LINK.findall(doc.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            if path and not re.match(r"[a-z]+:", path) and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []


_BLOCKS = python_blocks()


@pytest.mark.parametrize("line, source", _BLOCKS, ids=[f"line{line}" for line, _ in _BLOCKS])
def test_readme_block_runs(line, source, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"{README.name}:{line}", "exec")
    exec(code, {"__name__": f"readme_block_{line}"})


_DOC_BLOCKS = [(page, line, source) for page in DOC_PAGES for line, source in python_blocks(ROOT / page)]


@pytest.mark.parametrize("page, line, source", _DOC_BLOCKS,
                         ids=[f"{Path(page).stem}-line{line}" for page, line, _ in _DOC_BLOCKS])
def test_docs_block_runs(page, line, source, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = compile(source, f"{page}:{line}", "exec")
    exec(code, {"__name__": f"doc_block_{Path(page).stem}_{line}"})
