"""Print every import cycle among optkit's modules; exit 1 when there is any.

    python tools/import_graph.py                    # the cycles of src/optkit (exit 1 when any)
    python tools/import_graph.py --edges            # also print every module's imports
    python tools/import_graph.py --type-checking    # also count imports under ``if TYPE_CHECKING:``

The graph is read from the source with :mod:`ast`, nothing is imported. An edge ``a -> b`` is any import of
``b`` written in ``a``: at module level, inside functions and methods, in ``try`` / ``if`` blocks alike
(an import inside a function still ties the two modules together; it only runs later). Importing a
submodule also imports its packages, so ``from optkit.demo.config import X`` is an edge to ``optkit.demo``
too, unless the importer lives in that package (then it is being imported already); a name imported from a
package itself (``from optkit import __version__``) is an edge to the package.
Imports under ``if TYPE_CHECKING:`` never run and are left out unless ``--type-checking`` is given; imports
by string (``importlib.import_module``) are not seen.

Each group of modules that import each other (a strongly connected component of the graph) is printed with
every elementary circle through it, ``a -> b -> c -> a`` (each once, from its alphabetically first module).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "optkit"


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``src``: dotted name -> file (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, type_checking: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth; the body of ``if TYPE_CHECKING:`` only when asked."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _targets(node: ast.Import | ast.ImportFrom, name: str, path: Path, modules: set[str]) -> set[str]:
    """The modules of the set that ``node`` (in module ``name`` at ``path``) imports."""
    wanted: list[str] = []
    if isinstance(node, ast.Import):
        wanted = [alias.name for alias in node.names]
    else:
        if node.level:
            base = _package_of(name, path)
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.module else base
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` imports pkg itself
            wanted.append(sub if sub in modules else base)
    own = set()
    package = _package_of(name, path)
    while package:
        own.add(package)
        package = package.rpartition(".")[0]
    out = set()
    for target in wanted:
        if target in modules and target != name:
            out.add(target)
        parent = target.rpartition(".")[0]
        while parent:  # the packages it lives in (executed first), unless ours (being executed already)
            if parent in modules and parent not in own:
                out.add(parent)
            parent = parent.rpartition(".")[0]
    return out


def import_graph(
    src: Path = SRC, package: str = PACKAGE, *, type_checking: bool = False
) -> dict[str, set[str]]:
    """``{module: modules it imports}`` for every module of ``package`` under ``src`` (read with ``ast``)."""
    files = module_files(src, package)
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = set()
        for node in _imports(tree, type_checking):
            graph[name] |= _targets(node, name, path, modules)
    return graph


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted; only those that hold a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1 or node in graph[node]:
                        out.append(sorted(component))
    return sorted(out)


def _circles(graph: dict[str, set[str]], component: list[str], limit: int = 1000) -> list[list[str]]:
    """Every elementary circle inside ``component`` (at most ``limit``), each closed (``[a, b, ..., a]``) and
    starting at its alphabetically first module, shortest first. A depth-first search from each module
    ``s`` in order through the modules after it, so each circle is found once."""
    order = {name: i for i, name in enumerate(component)}
    out: list[list[str]] = []
    for start in component:
        allowed = {n for n in component if order[n] >= order[start]}
        path, on_path = [start], {start}
        work = [iter(sorted(graph[start] & allowed))]
        while work and len(out) < limit:
            child = next(work[-1], None)
            if child is None:
                work.pop()
                on_path.discard(path.pop())
            elif child == start:
                out.append([*path, start])
            elif child not in on_path:
                path.append(child)
                on_path.add(child)
                work.append(iter(sorted(graph[child] & allowed)))
    return sorted(out, key=lambda c: (len(c), c))


def import_cycles(src: Path = SRC, package: str = PACKAGE, *, type_checking: bool = False) -> list[list[str]]:
    """Every import cycle of ``package``: each elementary circle ``[a, b, ..., a]`` of :func:`import_graph`,
    grouped by strongly connected component. Empty when the graph is acyclic."""
    graph = import_graph(src, package, type_checking=type_checking)
    return [circle for c in _components(graph) for circle in _circles(graph, c)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every module's imports too")
    parser.add_argument("--type-checking", action="store_true",
                        help="count imports under `if TYPE_CHECKING:` too")
    args = parser.parse_args(argv)
    graph = import_graph(type_checking=args.type_checking)
    if args.edges:
        for name in sorted(graph):
            print(f"{name} -> {', '.join(sorted(graph[name])) or '(nothing)'}")
    components = _components(graph)
    count = 0
    for component in components:
        circles = _circles(graph, component)
        count += len(circles)
        print(f"{len(component)} modules import each other: {', '.join(component)}")
        for circle in circles:
            print(f"  {' -> '.join(circle)}")
    print(f"{count} import cycle(s) among {len(graph)} modules of {PACKAGE}")
    return 1 if components else 0


if __name__ == "__main__":
    sys.exit(main())
