"""Run every ``bench/bench_*.py`` and collect their Markdown tables.

Also runs the modules named in :data:`EXTRA` (``bench/lean.py``: the lean-memory precision table).

Each bench module runs in its own Python process (a fresh heap, so one bench's allocations cannot change
another's page-fault behaviour) and must define ``main() -> str``. The Markdown goes to stdout and to
``bench/results/<name>.md``; progress messages of the benches pass through on stderr.

Usage, from the repository root: ``python -m bench.run_all [name ...]`` where a name selects
``bench_<name>.py``. Set ``OPTKIT_BENCH_QUICK=1`` for a smoke run. Exits non-zero when a bench fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
#: bench modules run besides ``bench_*.py`` (selected by their own name)
EXTRA = ("lean",)


def discover(selected: list[str] | None = None) -> list[str]:
    """Module names ``bench_*`` in ``bench/``, sorted, then :data:`EXTRA`; ``selected`` filters by name with
    or without prefix."""
    names = sorted(p.stem for p in BENCH_DIR.glob("bench_*.py")) + list(EXTRA)
    if selected:
        want = {s if s.startswith("bench_") or s in EXTRA else f"bench_{s}" for s in selected}
        unknown = want - set(names)
        if unknown:
            raise SystemExit(f"run_all: no such bench: {sorted(unknown)}; available: {names}")
        names = [n for n in names if n in want]
    return names


def run_one(name: str) -> tuple[int, str]:
    """Run ``bench.<name>.main()`` in a child process; return (exit code, its Markdown)."""
    code = f"import sys, bench.{name} as m; sys.stdout.write(m.main())"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    return res.returncode, res.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="benches to run (default: all)")
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    failed = []
    for name in discover(args.names):
        print(f"[run_all] {name} ...", file=sys.stderr, flush=True)
        rc, md = run_one(name)
        if rc != 0:
            failed.append(name)
            print(f"[run_all] {name} FAILED (exit {rc})", file=sys.stderr, flush=True)
            continue
        (RESULTS / f"{name}.md").write_text(md)
        sys.stdout.write(md + "\n")
        sys.stdout.flush()
    if failed:
        print(f"[run_all] failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
