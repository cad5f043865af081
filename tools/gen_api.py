"""Write ``docs/api.md``, the API reference of everything in ``optkit.__all__``, from the docstrings.

    python tools/gen_api.py            # (re)write docs/api.md
    python tools/gen_api.py --check    # exit 1 when docs/api.md differs from what this script writes

Names are grouped by the module that defines them, in the order of ``optkit.__all__``. Each entry shows the
signature and the docstring as written; a class also lists the public methods and properties it defines
itself. Run it after changing a public docstring or signature (``make docs``).
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
HEADER = """\
# API reference

Everything below is importable from `optkit` directly (`optkit.__all__`), grouped by the module that defines
it. Generated from the docstrings by `tools/gen_api.py`; do not edit by hand (run `make docs`).
"""


def _clean(text: str) -> str:
    """Signatures without memory addresses (stable output) and without the quotes that postponed
    annotations carry (``x: 'Tensor'`` -> ``x: Tensor``)."""
    text = re.sub(r" at 0x[0-9a-f]+", "", text)
    return re.sub(r"(: |-> )'([^'\n]*)'", r"\1\2", text)


def _signature(obj: Any) -> str:
    try:
        return _clean(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(...)"


def _home(name: str, obj: Any, package: types.ModuleType) -> str:
    """The module that defines ``obj`` (for data: the first submodule holding that very object)."""
    module = getattr(obj, "__module__", None)
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if isinstance(module, str) and module.startswith(package.__name__ + "."):
        return module
    for mod_name, mod in sorted(sys.modules.items()):
        if mod_name.startswith(package.__name__ + ".") and getattr(mod, name, None) is obj:
            return mod_name
    return package.__name__


def _first_paragraph(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0].strip()


def _engine_part(base: type) -> bool:
    """Whether ``base`` is one of the engine's parts (:mod:`optkit._core`): its public members are documented
    with the class that composes them, and it is not listed as a base."""
    return base.__module__.startswith("optkit._core.")


def _members(cls: type) -> list[str]:
    """Markdown bullets for the public methods and properties ``cls`` defines itself or takes from the
    engine's parts."""
    lines = []
    own = [cls.__dict__] + [b.__dict__ for b in cls.__bases__ if _engine_part(b)]
    seen: set[str] = set()
    for name, member in (item for d in own for item in d.items()):
        if name.startswith("_") or name in seen:
            continue
        seen.add(name)
        if isinstance(member, property):
            lines.append(f"- `{name}` (property): {_first_paragraph(member.__doc__)}".rstrip(": "))
        elif isinstance(member, (staticmethod, classmethod)) or inspect.isfunction(member):
            func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            sig = _signature(func)
            if not isinstance(member, staticmethod):
                sig = re.sub(r"^\((self|cls)(, )?", "(", sig)
            lines.append(f"- `{name}{sig}`: {_first_paragraph(func.__doc__)}".rstrip(": "))
    return [" ".join(line.split()) for line in lines]


def _entry(name: str, obj: Any, package: types.ModuleType) -> list[str]:
    out = [f"### `{name}`", ""]
    if isinstance(obj, types.ModuleType):
        out += [f"Module `{obj.__name__}`.", "", inspect.getdoc(obj) or "", ""]
        public = getattr(obj, "__all__", None)
        if public:
            out += ["Names: " + ", ".join(f"`{n}`" for n in public), ""]
        return out
    if inspect.isclass(obj):
        canonical = getattr(package, obj.__name__, None) is obj and obj.__name__ != name
        if canonical:
            return out + [f"Alias of [`{obj.__name__}`](#{obj.__name__.lower()}).", ""]
        bases = ", ".join(b.__qualname__ for b in obj.__bases__ if b is not object and not _engine_part(b))
        out += [
            "```python",
            f"class {name}{_signature(obj)}" + (f"  # bases: {bases}" if bases else ""),
            "```",
        ]
        out += ["", inspect.getdoc(obj) or "", ""]
        members = _members(obj)
        if members:
            out += ["Members:", "", *members, ""]
        return out
    if callable(obj):
        return out + ["```python", f"{name}{_signature(obj)}", "```", "", inspect.getdoc(obj) or "", ""]
    summary = f"`{type(obj).__name__}`"
    if isinstance(obj, dict):
        summary += " with the keys " + ", ".join(f"`{k}`" for k in obj)
    elif isinstance(obj, (list, tuple)):
        summary += ": " + ", ".join(f"`{v}`" for v in obj)
    return out + [f"A constant: {summary}.", ""]


def render() -> str:
    """The whole page."""
    import optkit

    groups: dict[str, list[str]] = {}
    for name in optkit.__all__:
        obj = getattr(optkit, name)
        groups.setdefault(_home(name, obj, optkit), []).append(name)
    lines = [HEADER]
    lines += ["| module | names |", "|---|---|"]
    lines += [f"| `{mod}` | {', '.join(f'`{n}`' for n in names)} |" for mod, names in groups.items()]
    lines.append("")
    for mod, names in groups.items():
        module = sys.modules.get(mod)
        lines += [f"## `{mod}`", ""]
        if module is not None and mod != "optkit.distributed":
            lines += [_first_paragraph(inspect.getdoc(module)), ""]
        for name in names:
            lines += _entry(name, getattr(optkit, name), optkit)
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/api.md instead of writing it")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python tools/gen_api.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
