"""optkit benchmarks: run ``python -m bench.run_all`` (or ``python -m bench.bench_<name>``) from the
repository root.

Shared machinery (parameter sets, floor, timing, interleaved comparison, tables) is in ``bench._harness``.
"""
