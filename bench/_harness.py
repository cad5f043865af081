"""Benchmark harness: parameter sets, tensor builders, bandwidth floor, step timing, interleaved comparison.

The method follows ``shared/spec/perf_baseline.md``:

* **Parameter sets** (fp32): ``resnet50`` = the 161 real ResNet-50 parameter shapes (25,557,032 params),
  ``many_small`` = 2,000 tensors of 4,096, ``one_big`` = one tensor of 25,000,000, ``tiny_10k`` = 10,000
  tensors of 256 (host work per tensor dominates: the case for flat buffers). Params are ``randn·0.1``
  and grads ``randn·0.01`` from a seeded generator (never zero).
* **Floor** = the in-place triad ``a.add_(c, alpha=s)`` on 256 MiB arrays (reads a and c, writes a: the access
  pattern of an optimizer update), in GB/s (1e9 bytes/s), timed in every round of each table's comparison
  beside its variants (the VM's bandwidth drifts). "% of floor" = a variant's effective GB/s over it.
* **Timing** = the median of per-step ``perf_counter_ns`` after 3 warm-up steps, with the number of steps
  chosen to fill about 0.8 s (at least 15, at most 400). Minor page faults per step come from
  ``resource.getrusage``: a non-zero value means the step touches freshly mapped memory every time.
* **Comparisons** run their variants in rotation in one process (:func:`compare`): each round runs a slice
  of every variant's steps, so bandwidth drift on this shared VM hits all variants alike. Ratios are only
  meaningful between rows of one table.
* ``torch.set_num_threads(2)`` on import (the baseline's setting).

``OPTKIT_BENCH_QUICK=1`` is a smoke run: ``many_small`` shrinks to 200 tensors and ``one_big`` to 2.5M params
(``resnet50`` keeps its real shapes), about 0.1 s per variant, 2 rounds, a 5-repeat floor.

Bench modules (``bench/bench_*.py``) each define ``main() -> str`` returning their Markdown; progress goes to
stderr. ``python -m bench.run_all`` runs them all and stores the tables in ``bench/results/``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import platform
import resource
import statistics
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = [
    "QUICK",
    "THREADS",
    "SET_NAMES",
    "resnet50_shapes",
    "param_set",
    "n_params",
    "make_tensors",
    "make_params",
    "floor_gbps",
    "Timing",
    "time_steps",
    "Variant",
    "Row",
    "compare",
    "markdown_table",
    "x_floor_note",
    "header",
    "log",
    "sgd_ema_reference",
]

QUICK: bool = os.environ.get("OPTKIT_BENCH_QUICK", "") not in ("", "0")
THREADS = 2
torch.set_num_threads(THREADS)

SET_NAMES = ("resnet50", "many_small", "one_big", "tiny_10k")
RESNET50_PARAMS = 25_557_032

# timing knobs (perf_baseline.md "Method"); QUICK shrinks them for a smoke run
TARGET_S = 0.1 if QUICK else 0.8
MIN_STEPS = 3 if QUICK else 15
MAX_STEPS = 40 if QUICK else 400
WARMUP = 2 if QUICK else 3
ROUNDS = 2 if QUICK else 5
FLOOR_REPEATS = 5 if QUICK else 15
FLOOR_MIB = 256
TRIADS_PER_ROUND = 1 if QUICK else 3


def log(msg: str) -> None:
    """Progress message on stderr (stdout is reserved for the Markdown result)."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------
# parameter sets


def resnet50_shapes() -> list[tuple[int, ...]]:
    """The 161 parameter shapes of ResNet-50 (torchvision v1.5 layout: stride on the 3x3 conv), in order.

    conv1 7x7/2 (3→64) and its BatchNorm (weight, bias); 4 stages of bottlenecks ([3, 4, 6, 3] blocks,
    widths 64/128/256/512, expansion 4), each block conv 1x1 → BN → conv 3x3 → BN → conv 1x1 → BN, and the
    first block of every stage a 1x1 projection conv + BN on the shortcut; then fc 2048→1000 with bias.
    Convs have no bias. 1 + 2 + 16·9 + 4·3 + 2 = 161 tensors, 25,557,032 parameters.
    """
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        out_ch = width * 4
        for b in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if b == 0:
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    shapes += [(1000, 2048), (1000,)]
    assert len(shapes) == 161, len(shapes)
    assert n_params(shapes) == RESNET50_PARAMS, n_params(shapes)
    return shapes


def param_set(name: str) -> list[tuple[int, ...]]:
    """Shapes of a named parameter set (QUICK shrinks ``many_small`` and ``one_big``)."""
    if name == "resnet50":
        return resnet50_shapes()
    if name == "many_small":
        return [(4096,)] * (200 if QUICK else 2000)
    if name == "one_big":
        return [(2_500_000 if QUICK else 25_000_000,)]
    if name == "tiny_10k":
        return [(256,)] * (1000 if QUICK else 10_000)
    if name == "transformer":
        return transformer_shapes()
    raise ValueError(f"param_set: unknown set {name!r}; known: {SET_NAMES}")


def transformer_shapes() -> list[tuple[int, ...]]:
    """A small transformer's parameter shapes (the ``transformer`` set, not in ``SET_NAMES``): token and
    position embeddings, then per layer fused QKV weight and bias, output projection, two LayerNorms and a
    4x MLP; d = 512, 6 layers, a 32k vocabulary: 76 tensors, 35.8M params (QUICK: 2 layers, 4k vocabulary)."""
    d, ff = 512, 2048
    layers, vocab = (2, 4000) if QUICK else (6, 32000)
    shapes: list[tuple[int, ...]] = [(vocab, d), (1024, d)]
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (ff, d), (ff,), (d, ff), (d,), (d,), (d,)]
    return shapes + [(d,), (d,)]


def n_params(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(s) for s in shapes)


def make_tensors(
    shapes: Sequence[Sequence[int]], *, seed: int, scale: float, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """``randn(shape)·scale`` for every shape, from a generator seeded with ``seed`` (reproducible)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tuple(s), generator=g) * scale).to(dtype) for s in shapes]


def make_params(
    name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[torch.nn.Parameter]:
    """Parameters of set ``name`` (``randn·0.1``) with ``.grad`` set (``randn·0.01``, another seed)."""
    shapes = param_set(name)
    params = [torch.nn.Parameter(t) for t in make_tensors(shapes, seed=seed, scale=0.1, dtype=dtype)]
    for p, g in zip(params, make_tensors(shapes, seed=seed + 1, scale=0.01, dtype=dtype)):
        p.grad = g
    return params


# ------------------------------------------------------------------------------------------------------------
# floor and timing


_TRIAD: list[torch.Tensor] = []  # the triad's two arrays, made once per process (no table times fresh pages)


def _triad_ns(repeats: int, out: list[int], mib: int = FLOOR_MIB) -> int:
    """Time ``repeats`` in-place triads ``a.add_(c, alpha=s)`` on two ``mib``-MiB fp32 arrays into ``out``
    (ns each); returns the bytes one triad moves (3 streams). ``s`` alternates in sign so ``a`` does not
    drift."""
    n = mib * (1 << 20) // 4
    if not _TRIAD or _TRIAD[0].numel() != n:
        _TRIAD[:] = [torch.randn(n), torch.randn(n)]
        for _ in range(2):
            _TRIAD[0].add_(_TRIAD[1], alpha=1e-3)
    a, c = _TRIAD
    start = len(out)
    for i in range(repeats):
        s = 1e-3 if (start + i) % 2 else -1e-3
        t0 = time.perf_counter_ns()
        a.add_(c, alpha=s)
        out.append(time.perf_counter_ns() - t0)
    return 3 * n * 4


def floor_gbps(mib: int = FLOOR_MIB, repeats: int = FLOOR_REPEATS) -> float:
    """In-place triad ``a.add_(c, alpha=s)`` on two ``mib``-MiB fp32 arrays: median GB/s (3 streams counted).
    The header's figure; each table's own floor is timed interleaved with its variants (:func:`compare`)."""
    times: list[int] = []
    nbytes = _triad_ns(repeats, times, mib)
    return nbytes / statistics.median(times)  # bytes per ns == GB/s


def _minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@dataclass
class Timing:
    """Per-step samples of one variant (ns) and the minor page faults they took."""

    samples: list[int] = field(default_factory=list)
    faults: int = 0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples) / 1e6

    @property
    def faults_per_step(self) -> float:
        return self.faults / max(len(self.samples), 1)


def _run(step: Callable[[], object], setup: Callable[[], object] | None, n: int, out: Timing) -> None:
    for _ in range(n):
        if setup is not None:
            setup()
        f0 = _minflt()
        t0 = time.perf_counter_ns()
        step()
        t1 = time.perf_counter_ns()
        out.faults += _minflt() - f0
        out.samples.append(t1 - t0)


def _calibrate(step: Callable[[], object], setup: Callable[[], object] | None) -> int:
    """Run the warm-up steps and return how many steps fill ``TARGET_S`` (within [MIN_STEPS, MAX_STEPS])."""
    warm = Timing()
    _run(step, setup, WARMUP, warm)
    per_step = max(statistics.median(warm.samples), 1) / 1e9
    return int(min(MAX_STEPS, max(MIN_STEPS, round(TARGET_S / per_step))))


def time_steps(step: Callable[[], object], setup: Callable[[], object] | None = None) -> Timing:
    """Time ``step`` alone: warm-up, then enough steps for ``TARGET_S``; ``setup`` runs untimed first."""
    n = _calibrate(step, setup)
    out = Timing()
    _run(step, setup, n, out)
    return out


# ------------------------------------------------------------------------------------------------------------
# interleaved comparison and tables


@dataclass
class Variant:
    """One contender: ``step`` is timed; ``setup`` (untimed) runs before every step, e.g. to restore grads."""

    name: str
    step: Callable[[], object]
    setup: Callable[[], object] | None = None


@dataclass
class Row:
    variant: str
    ms: float
    ratio: float
    bytes_per_param: float
    gbps: float
    pct_floor: float
    faults_per_step: float
    steps: int
    #: the floor of the row's table: the triad timed in every round of its comparison (median GB/s); None
    #: where the rows come from elsewhere (their % of floor then uses the header's floor)
    floor_gbps: float | None = None


def compare(
    variants: Sequence[Variant],
    *,
    n_params: int,
    bytes_per_param: float,
    reference: str | None = None,
    rounds: int = ROUNDS,
) -> list[Row]:
    """Time ``variants`` interleaved in this process; the first (or ``reference``) is the ratio's base.

    Each variant is warmed up and calibrated, then ``rounds`` rounds each run ``ceil(steps/rounds)`` steps of
    every variant, the starting variant rotating from round to round. A variant's time is the median over all
    its per-step samples. GB/s = ``n_params·bytes_per_param`` (the minimal traffic) / time.

    The floor is timed the same way: ``TRIADS_PER_ROUND`` in-place triads open every round, and "% of floor"
    divides by their median GB/s. The bandwidth this VM gives drifts by up to 2x over minutes
    (perf_baseline.md: 37.6-84.9 GB/s), so a floor timed once before the table can sit in another phase than
    its variants.
    """
    if not variants:
        return []
    names = [v.name for v in variants]
    ref = reference if reference is not None else names[0]
    if ref not in names:
        raise ValueError(f"compare: reference {ref!r} is not one of {names}")
    per_round = {}
    for v in variants:
        per_round[v.name] = max(1, math.ceil(_calibrate(v.step, v.setup) / rounds))
    timings = {v.name: Timing() for v in variants}
    triads: list[int] = []
    triad_bytes = 0
    for r in range(rounds):
        triad_bytes = _triad_ns(TRIADS_PER_ROUND, triads)
        k = r % len(variants)
        for v in [*variants[k:], *variants[:k]]:
            _run(v.step, v.setup, per_round[v.name], timings[v.name])
    ref_ms = timings[ref].median_ms
    floor = triad_bytes / statistics.median(triads)
    rows = []
    total_bytes = n_params * bytes_per_param
    for v in variants:
        t = timings[v.name]
        gbps = total_bytes / (t.median_ms * 1e6)
        rows.append(Row(v.name, t.median_ms, t.median_ms / ref_ms, bytes_per_param, gbps,
                        100.0 * gbps / floor, t.faults_per_step, len(t.samples), floor))
    return rows


def _fmt_ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def markdown_table(rows: Sequence[Row], title: str | None = None, note: str | None = None) -> str:
    """Rows as a Markdown table: variant, ms/step, ratio vs the reference, bytes/param, GB/s, % of floor,
    faults/step (and the number of timed steps)."""
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines.append(
        "| variant | ms/step | ratio vs ref | bytes/param | GB/s | % of floor | faults/step | steps |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lines.append(
            f"| {r.variant} | {_fmt_ms(r.ms)} | {r.ratio:.3f} | {r.bytes_per_param:g} | {r.gbps:.1f} | "
            f"{r.pct_floor:.0f} | {r.faults_per_step:.0f} | {r.steps} |"
        )
    if rows and rows[0].floor_gbps is not None:
        floor = (f"Floor of this table (the triad timed in each round, {TRIADS_PER_ROUND} per round, "
                 f"median): **{rows[0].floor_gbps:.1f} GB/s**.")
        note = f"{floor} {note}" if note else floor
    if note:
        lines += ["", note]
    lines.append("")
    return "\n".join(lines)


def x_floor_note(rows: Sequence[Row], total: int, bytes_per_param: float) -> str:
    """"× floor" of every row: its time over (minimal bytes ÷ the table's floor bandwidth)."""
    floor_ms = total * bytes_per_param / (rows[0].floor_gbps * 1e6)
    return (f"Floor time for {bytes_per_param:g} B/param: {floor_ms:.2f} ms; × floor: "
            + ", ".join(f"{r.variant} {r.ms / floor_ms:.2f}×" for r in rows) + ".")


def header(title: str, floor: float) -> str:
    """Environment line for the top of a bench's Markdown."""
    mode = "QUICK (smoke run: shrunken sets, few steps; not for conclusions)" if QUICK else "full"
    return (
        f"## {title}\n\n"
        f"torch {torch.__version__}, python {platform.python_version()}, threads={torch.get_num_threads()}, "
        f"{os.cpu_count()} cpus, {platform.machine()}; mode: {mode}; "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC; load average at start "
        f"{os.getloadavg()[0]:.2f}\n\n"
        f"Floor at the start (in-place triad `a.add_(c, alpha=s)`, {FLOOR_MIB} MiB arrays, median of "
        f"{FLOOR_REPEATS}): **{floor:.1f} GB/s**. Each table times the same triad in every round of its "
        f"comparison and takes its % of floor and × floor from that (its note gives it), since this VM's "
        f"bandwidth drifts. Times are medians of per-step `perf_counter_ns`; variants of one table ran "
        f"interleaved in one process ({ROUNDS} rounds), so compare ratios within a table only.\n"
    )


def step_variant(name: str, set_name: str, build, *, flat: bool = False):
    """``(Variant, params)``: ``build(params) -> step callable`` over a fresh copy of the parameter set whose
    gradients are restored before every step (untimed); ``flat``: the parameters are first moved into flat
    buffers (``optkit.flat_parameters``)."""
    import torch

    params = make_params(set_name, seed=0)
    if flat:
        from optkit import flat_parameters

        flat_parameters(params)
    grads = [p.grad for p in params]
    ref = [g.clone() for g in grads]

    def setup() -> None:
        torch._foreach_copy_(grads, ref)

    return Variant(name, build(params), setup), params


def variant_table(specs, set_name: str, bytes_per_param: float, title: str,
                  extra_note: str = "") -> str:
    """One Markdown table: ``specs`` are ``(name, build, flat)`` (see :func:`step_variant`), timed
    interleaved with :func:`compare`; a variant whose name says ``jit`` is compiled first (untimed, the
    compile time goes into the note)."""
    variants, notes = [], []
    for name, build, flat in specs:
        v, params = step_variant(name, set_name, build, flat=flat)
        if "jit" in name:
            v.setup()
            t0 = time.perf_counter()
            v.step()  # compiles (untimed)
            notes.append(f"`{name}` first call (compile) {time.perf_counter() - t0:.1f} s.")
        variants.append(v)
    total = n_params([p.shape for p in params])
    rows = compare(variants, n_params=total, bytes_per_param=bytes_per_param)
    note = " ".join([x_floor_note(rows, total, bytes_per_param), *notes, extra_note]).strip()
    full = f"{title}, set `{set_name}` ({len(params)} tensors, {total:,} params)"
    return markdown_table(rows, title=full, note=note)


def sgd_ema_reference(params, lr: float):
    """The anchor of the SGD + decay + EMA tables: ``torch.optim.SGD(momentum=0.9, weight_decay=1e-4,
    fused=True)`` followed by a ``_foreach_lerp_`` EMA (decay 0.99) of the weights; returns its step."""
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4, fused=True)
    avgs = [p.detach().clone() for p in params]

    def step() -> None:
        opt.step()
        torch._foreach_lerp_(avgs, params, 0.01)

    return step


def load_timm_optim(module: str, cls: str):
    """``timm.optim.<module>.<cls>`` loaded from its file (``import timm`` needs torchvision, which does not
    import beside the CPU torch), or None when timm is missing or the file does not load (no timm rows)."""
    spec = importlib.util.find_spec("timm")
    if spec is None or spec.origin is None:
        return None
    optim_dir = os.path.join(os.path.dirname(spec.origin), "optim")
    path = os.path.join(optim_dir, f"{module}.py")
    if not os.path.exists(path):
        return None
    pkg_name = "_optkit_bench_timm_optim"
    full = f"{pkg_name}.{module}"
    if full not in sys.modules:
        if pkg_name not in sys.modules:
            pkg = types.ModuleType(pkg_name)
            pkg.__path__ = [optim_dir]
            sys.modules[pkg_name] = pkg
        lspec = importlib.util.spec_from_file_location(full, path)
        mod = importlib.util.module_from_spec(lspec)
        sys.modules[full] = mod
        try:
            lspec.loader.exec_module(mod)
        except Exception as err:  # noqa: BLE001 - an incompatible timm
            del sys.modules[full]
            log(f"timm's {module}.py did not load ({type(err).__name__}: {err})")
            return None
    return getattr(sys.modules[full], cls, None)


def load_timm_lars():
    """timm's ``Lars`` class (see :func:`load_timm_optim`), or None."""
    return load_timm_optim("lars", "Lars")
