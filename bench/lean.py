"""Lean-memory precision: bytes per parameter and step time of every weight format x state dtype, for SGD
momentum, LARS, LAMB and Adam, beside torch.optim's fused steps and the 8-bit / bf16 optimizers of torchao,
optimi and bitsandbytes where they are installed.

Modes (rows of each optimizer's table), each with ``state_dtype`` float32 / bfloat16 / int8:

* ``fp32``: float32 parameters (``state_dtype`` None = float32 slots: the reference of the ratios);
* ``fp32-masters``: bfloat16 parameters under :class:`optkit.MixedPrecisionOptimizerWrapper` (fp32 masters,
  the inner optimizer's slots on the masters);
* ``bf16``: bfloat16 parameters, ``precision=None`` (rounded to nearest every step; ``state_dtype`` None =
  bfloat16 slots);
* ``split``, ``kahan``, ``stochastic``: bfloat16 parameters with that ``precision=`` (master-free).

**Bytes per parameter** = the bytes of the tensors actually held, over the number of parameters: the weights,
the fp32 masters, and every tensor in ``opt.state`` (slots, 8-bit block scales ``<slot>_absmax``,
``master_low``, ``kahan_comp``, step counters; a tensor subclass such as torchao's 8-bit state counted by its
inner tensors; a storage shared by several entries once). **Gradients are excluded** (the model's and the
wrapper's fp32 master gradient buffers), as is the transient fp32 scratch of the lean pass (one bunch of
``block_numel`` elements at a time). The *formula* column is the nominal figure: weights + masters + extras +
slots x (4 | 2 | 1 + 4/256 = 1.016); the measured figure is above it where tensors under 4,096 elements (the
norms and biases) keep float32 slots under ``int8``.

**Step time**: the median ms/step, all variants of one optimizer timed interleaved in one process
(:func:`bench._harness.compare`; every step starts from the same gradients, restored untimed); the ratio is
to the ``fp32`` / float32-state step of the same optimizer in the same table. The first step (state
creation; torchao's per-shape ``torch.compile``) is untimed.

Parameter set: the ResNet-50 shapes (:func:`bench._harness.resnet50_shapes`) at half width (every channel
count halved, fc 1024->1000): 161 tensors, 6,917,640 params, so that the 6 x 3 lean variants of four
optimizers time on two CPU cores in minutes (QUICK: 1/8 width, 631,152 params). ``python -m
bench.lean`` (``OPTKIT_BENCH_QUICK=1`` for a smoke run); ``python -m bench.run_all lean``.
"""

from __future__ import annotations

import gc
import importlib.util
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from unittest import mock

import torch

from bench import _harness as H

__all__ = ["MODES", "STATES", "lean_shapes", "held_bytes", "formula", "build_optkit", "optkit_specs",
           "anchor_specs", "realize", "main", "device_main"]

#: the weight formats (rows), in table order
MODES = ("fp32", "fp32-masters", "bf16", "split", "kahan", "stochastic")
#: the state dtypes of every mode (None: the optimizer's default for that mode)
STATES = (None, "bfloat16", "int8")
#: the optimizers: name -> (constructor keyword arguments, number of slots)
OPTIMIZERS = {
    "SGD momentum 0.9": ("SGD", dict(learning_rate=0.01, momentum=0.9), 1),
    "LARS (TF 1.15, momentum 0.9, wd 1e-4)": ("LARS", dict(learning_rate=0.1, momentum=0.9,
                                                           weight_decay=1e-4), 1),
    "LAMB (wd 0.01)": ("LAMB", dict(learning_rate=1e-3, weight_decay=0.01), 2),
    "Adam": ("Adam", dict(learning_rate=1e-3), 2),
}
INT8_BYTES = 1 + 4 / 256  # a code and its share of the block's fp32 scale

# bigger steps than the harness's other tables: fewer of them (the slowest lean steps take ~1 s here)
H.MIN_STEPS = 3 if H.QUICK else 5
H.WARMUP = 1
ROUNDS = 2 if H.QUICK else 5


#: the channel divisor of the set (QUICK: a smaller set for a smoke run)
SCALE = 8 if H.QUICK else 2


def lean_shapes(scale: int = SCALE) -> list[tuple[int, ...]]:
    """The ResNet-50 shapes with every channel count divided by ``scale`` (the 3 input channels and the 1,000
    classes kept): the same 161 tensors, the same mix of 3x3, 1x1 and vector shapes, fewer elements."""
    out = []
    shapes = H.resnet50_shapes()
    for i, s in enumerate(shapes):
        if i == len(shapes) - 2:  # fc weight (1000, 2048)
            out.append((s[0], s[1] // scale))
        elif i == len(shapes) - 1:  # fc bias
            out.append(s)
        elif len(s) == 4:
            out.append((s[0] // scale, s[1] if s[1] == 3 else s[1] // scale, *s[2:]))
        else:
            out.append((s[0] // scale,))
    return out


# ------------------------------------------------------------------------------------------------------------
# bytes held


def _leaves(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The plain tensors behind ``t`` (a traceable tensor subclass, such as torchao's 8-bit state, by its
    inner tensors)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for n in names:
            yield from _leaves(getattr(t, n))
    else:
        yield t


def _tensors(obj) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield from _leaves(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def held_bytes(opt, weights: Iterable[torch.Tensor], masters: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes held by ``weights``, ``masters`` and every tensor in ``opt.state`` (gradients excluded), as
    ``{"weights", "masters", "state", "total"}``: ``numel·element_size`` of each tensor, a storage that
    several tensors share counted once (optkit's step counter, bitsandbytes' quantisation map)."""
    seen: set[tuple[int, int]] = set()

    def count(ts: Iterable[torch.Tensor]) -> int:
        n = 0
        for t in ts:
            key = (t.untyped_storage().data_ptr(), t.numel() * t.element_size()) if t.numel() else (id(t), 0)
            if key in seen:
                continue
            seen.add(key)
            n += t.numel() * t.element_size()
        return n

    out = {"weights": count(_tensors(list(weights))), "masters": count(_tensors(list(masters))),
           "state": count(_tensors([opt.state[p] for p in list(opt.state)]))}
    out["total"] = out["weights"] + out["masters"] + out["state"]
    return out


def formula(mode: str, state: str | None, slots: int) -> tuple[str, float]:
    """The nominal bytes per parameter of ``mode`` with ``state`` (None: the mode's default) and ``slots``
    slots: ``(text, value)``, e.g. ``("2 + 2 + 1.016", 5.016)`` for split with one int8 slot."""
    w = 4 if mode == "fp32" else 2
    parts = [w]
    if mode == "fp32-masters":
        parts.append(4)
    if mode in ("split", "kahan"):
        parts.append(2)
    sd = state or ("bfloat16" if mode == "bf16" else "float32")
    per = {"float32": 4, "bfloat16": 2, "int8": INT8_BYTES}[sd]
    slot_txt = f"{per:.3f}".rstrip("0").rstrip(".")
    text = " + ".join(str(x) for x in parts) + " + " + (slot_txt if slots == 1 else f"{slots}×{slot_txt}")
    return text, sum(parts) + slots * per


# ------------------------------------------------------------------------------------------------------------
# variants


@dataclass
class Built:
    """One contender: its timed step, the untimed setup that restores the gradients, and its bytes."""

    name: str
    step: Callable[[], object]
    setup: Callable[[], None]
    nbytes: dict[str, int]
    formula: str = ""
    first_s: float = 0.0
    anchor: bool = False


@dataclass
class Spec:
    """How to build one contender: ``build(params) -> (optimizer, masters, step)`` over parameters of
    ``dtype``."""

    name: str
    formula: str
    dtype: torch.dtype
    build: Callable[[list], tuple]
    anchor: bool = False


_CPU_VALUES: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}


def _params(shapes, dtype: torch.dtype, device: str | torch.device = "cpu") -> list[torch.nn.Parameter]:
    """``randn·0.1`` parameters of ``dtype`` with ``randn·0.01`` gradients (seeded; the same values for
    every variant, rounded to ``dtype``), on ``device``: copies of values drawn once per set and dtype."""
    key = (tuple(map(tuple, shapes)), dtype)
    if key not in _CPU_VALUES:
        _CPU_VALUES[key] = (H.make_tensors(shapes, seed=0, scale=0.1, dtype=dtype),
                            H.make_tensors(shapes, seed=1, scale=0.01, dtype=dtype))
    values, grads = _CPU_VALUES[key]
    ps = [torch.nn.Parameter(t.to(device, copy=True)) for t in values]
    for p, g in zip(ps, grads):
        p.grad = g.to(device, copy=True)
    return ps


def _restorer(params) -> tuple[Callable[[], None], list[torch.Tensor], list[torch.Tensor]]:
    """``(setup, grads, copies)``: ``setup`` puts the first gradients back (the mixed-precision wrapper
    drops the model's ``.grad`` after folding it into the masters')."""
    grads = [p.grad for p in params]
    ref = [g.clone() for g in grads]

    def setup() -> None:
        for p, g, r in zip(params, grads, ref):
            if p.grad is None:
                p.grad = g
            p.grad.copy_(r)

    return setup, grads, ref


def realize(spec: Spec, shapes, device: str | torch.device = "cpu") -> tuple[Built, list, list]:
    """Build ``spec`` over fresh parameters on ``device`` and run its first step (untimed): ``(built,
    params, masters)``."""
    params = _params(shapes, spec.dtype, device)
    opt, masters, step = spec.build(params)
    setup, _, _ = _restorer(params)
    setup()
    t0 = time.perf_counter()
    step()  # builds the state
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    built = Built(spec.name, step, setup, held_bytes(opt, params, masters), spec.formula, first, spec.anchor)
    return built, params, masters


def build_optkit(opt_name: str, kwargs: dict, mode: str, state: str | None, params) -> tuple:
    """``(optimizer, masters, step)`` of one mode x state dtype over ``params`` (see the module doc)."""
    import optkit

    lean = {} if state is None else {"state_dtype": state}
    if mode in ("split", "kahan", "stochastic"):
        lean["precision"] = mode
    opt = getattr(optkit, opt_name)(params, **kwargs, **lean)
    masters: list[torch.Tensor] = []
    if mode == "fp32-masters":
        opt = optkit.MixedPrecisionOptimizerWrapper(opt)
        masters = list(opt.master_params)
    return opt, masters, opt.step


def _state_label(mode: str, state: str | None) -> str:
    if state is not None:
        return state
    return "bfloat16 (None)" if mode == "bf16" else "float32 (None)"


def optkit_specs(title: str) -> list[Spec]:
    """The 18 mode x state dtype rows of optimizer ``title`` (the first: fp32 / float32, the reference)."""
    opt_name, kwargs, slots = OPTIMIZERS[title]
    out = []
    for mode in MODES:
        for state in (STATES if mode != "bf16" else (None, "float32", "int8")):
            ftxt, fval = formula(mode, state, slots)
            out.append(Spec(f"{mode} / {_state_label(mode, state)}", f"{ftxt} = {fval:.3f}",
                            torch.float32 if mode == "fp32" else torch.bfloat16,
                            lambda ps, m=mode, s=state: build_optkit(opt_name, kwargs, m, s, ps)))
    return out


# ------------------------------------------------------------------------------------------------------------
# anchors


def _installed(mod: str) -> bool:
    return importlib.util.find_spec(mod) is not None


def _no_compile(step):
    """``step`` with ``torch.compile`` an identity while it runs (torchao compiles its per-parameter step
    once per shape: minutes on 2 CPU cores; with ``torch._dynamo`` disabled its ``fullgraph=True`` raises)."""
    def identity(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

    def run():
        with mock.patch.object(torch, "compile", identity):
            return step()
    return run


TORCHAO_NOTE = ("torchao's optimizers compile their per-parameter step with `torch.compile` once per shape "
                "(on two CPU cores: 34 s for 6 shapes), so they run eager here (`torch.compile` an identity "
                "around their step): their times are eager times.")


def anchor_specs(title: str) -> tuple[list[Spec], list[str]]:
    """torch.optim's fused step (always), and the third-party optimizers that apply and are installed."""
    out, notes = [], []
    opt_name, kwargs, _ = OPTIMIZERS[title]
    lr = kwargs["learning_rate"]

    def add(name, make, dtype, form, wrap=None):
        def build(ps):
            opt = make(ps)
            return opt, [], opt.step if wrap is None else wrap(opt.step)
        out.append(Spec(name, form, dtype, build, anchor=True))

    if opt_name in ("SGD", "LARS"):
        add("torch.optim.SGD(fused=True), fp32", lambda ps: torch.optim.SGD(
            ps, lr=lr, momentum=0.9, fused=True), torch.float32, "4 + 4 = 8")
        add("torch.optim.SGD(fused=True), bf16 params", lambda ps: torch.optim.SGD(
            ps, lr=lr, momentum=0.9, fused=True), torch.bfloat16, "2 + 2 = 4")
    else:
        add("torch.optim.AdamW(fused=True, wd 0), fp32", lambda ps: torch.optim.AdamW(
            ps, lr=lr, weight_decay=0.0, fused=True), torch.float32, "4 + 2×4 = 12")
        add("torch.optim.AdamW(fused=True, wd 0), bf16 params", lambda ps: torch.optim.AdamW(
            ps, lr=lr, weight_decay=0.0, fused=True), torch.bfloat16, "2 + 2×2 = 6")
    if opt_name == "Adam" and _installed("torchao"):
        def ao(cls, **kw):
            def make(ps):
                import torchao.optim
                return getattr(torchao.optim, cls)(ps, lr=lr, weight_decay=0.0, **kw)
            return make
        add("torchao AdamW8bit (fp32 params; eager)", ao("AdamW8bit"), torch.float32, "4 + 2×1.016",
            _no_compile)
        add("torchao _AdamW bf16_stochastic_round (eager)", ao("_AdamW", bf16_stochastic_round=True),
            torch.bfloat16, "2 + 2×2 = 6", _no_compile)
        notes.append(TORCHAO_NOTE)
    if _installed("optimi"):
        if opt_name == "Adam":
            add("optimi AdamW(kahan_sum=True), bf16", lambda ps: __import__("optimi").AdamW(
                ps, lr=lr, weight_decay=0.0, kahan_sum=True, foreach=True), torch.bfloat16,
                "2 + 2 + 2×2 = 8")
        if opt_name == "SGD":
            add("optimi SGD(kahan_sum=True), bf16", lambda ps: __import__("optimi").SGD(
                ps, lr=lr, momentum=0.9, kahan_sum=True, foreach=True), torch.bfloat16, "2 + 2 + 2 = 6")
    if _installed("bitsandbytes"):
        bform = "4 + 1.016" if opt_name in ("SGD", "LARS") else "4 + 2×1.016"
        cls = {"SGD": "SGD8bit", "LARS": "LARS8bit", "LAMB": "LAMB8bit", "Adam": "Adam8bit"}[opt_name]
        extra = dict(momentum=0.9) if opt_name in ("SGD", "LARS") else {}
        if opt_name == "LAMB":
            extra = dict(weight_decay=0.01)
        add(f"bitsandbytes {cls} (fp32 params)", lambda ps: getattr(__import__("bitsandbytes").optim, cls)(
            ps, lr=lr, **extra), torch.float32, bform)
    return out, notes


def realize_all(specs: list[Spec], shapes, title: str) -> tuple[list[Built], list[str]]:
    """Every spec built on the CPU (an anchor that fails is noted and left out)."""
    out, notes = [], []
    for spec in specs:
        try:
            built, _, _ = realize(spec, shapes)
        except Exception as err:  # noqa: BLE001 - an anchor that does not run here is noted, not fatal
            if not spec.anchor:
                raise
            notes.append(f"{spec.name} did not run ({type(err).__name__}: {str(err)[:120]}).")
            continue
        H.log(f"bench.lean: {title}: {built.name} first step {built.first_s:.2f} s")
        out.append(built)
    return out, notes


# ------------------------------------------------------------------------------------------------------------
# tables


def _fmt_ms(x: float) -> str:
    return f"{x:.2f}" if x < 100 else f"{x:.0f}"


def table(title: str, shapes) -> str:
    n = H.n_params(shapes)
    H.log(f"bench.lean: {title} ...")
    aspecs, notes = anchor_specs(title)
    every, fails = realize_all(optkit_specs(title) + aspecs, shapes, title)
    notes = fails + notes
    anchors = [b for b in every if b.anchor]
    rows = H.compare([H.Variant(b.name, b.step, b.setup) for b in every], n_params=n, bytes_per_param=0.0,
                     rounds=ROUNDS)
    lines = [f"### {title}", "",
             "| mode / state dtype | bytes/param held | formula | ms/step | × fp32 step | steps |",
             "|---|---:|---|---:|---:|---:|"]
    anchor_ids = {id(b) for b in anchors}
    for b, r in zip(every, rows):
        name = f"*{b.name}*" if id(b) in anchor_ids else b.name
        lines.append(f"| {name} | {b.nbytes['total'] / n:.3f} | {b.formula} | {_fmt_ms(r.ms)} | "
                     f"{r.ratio:.2f} | {r.steps} |")
    first = ", ".join(f"{b.name} {b.first_s:.1f} s" for b in anchors if b.first_s > 1.0)
    lines += ["", f"Anchors in italics. Floor of this table (the triad timed in each round): "
              f"{rows[0].floor_gbps:.1f} GB/s."]
    if first:
        lines.append(f"First (untimed) steps over 1 s: {first}.")
    lines += notes
    lines.append("")
    return "\n".join(lines)


def main() -> str:
    H.log("bench.lean: floor ...")
    floor = H.floor_gbps()
    shapes = lean_shapes()
    n = H.n_params(shapes)
    parts = [H.header("Lean-memory precision: bytes per parameter and step time", floor),
             f"Parameter set: ResNet-50 shapes at 1/{SCALE} width, {len(shapes)} tensors, "
             f"{n:,} params (bfloat16 rows: the same values rounded). Bytes/param held = weights + fp32 "
             f"masters + every tensor in `opt.state` (slots, 8-bit scales, `master_low`, `kahan_comp`, step "
             f"counters), **gradients excluded**; formula = the nominal figure (int8 = 1 + 4/256). "
             f"× fp32 step = ms / ms of the `fp32 / float32 (None)` row of the same table.\n"]
    for title in OPTIMIZERS:
        parts.append(table(title, shapes))
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------------------
# on a device: the allocator's figures


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _timed(built: Built, device: torch.device, warmup: int, steps: int) -> float:
    """Median ms/step (CUDA events on a GPU, else ``perf_counter``), the gradients restored before each."""
    for _ in range(warmup):
        built.setup()
        built.step()
    times = []
    for _ in range(steps):
        built.setup()
        if device.type == "cuda":
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            built.step()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1))
        else:
            c0 = time.perf_counter()
            built.step()
            times.append((time.perf_counter() - c0) * 1e3)
    return statistics.median(times)


def device_table(title: str, shapes, device: torch.device, *, warmup: int = 3, steps: int = 20,
                 deadline: float = math.inf) -> str:
    """One optimizer's rows measured one at a time on ``device``: the bytes of the tensors held, the
    allocator's bytes after the first step and its peak over the timed steps (both less the gradients, their
    restore copies and the fp32-masters wrapper's fp32 gradient buffers), and the median step time."""
    n = H.n_params(shapes)
    aspecs, notes = anchor_specs(title)
    lines = [f"### {title} ({device.type})", "",
             "| mode / state dtype | B/param tensors held | B/param allocated | B/param peak in step | "
             "formula | ms/step | × fp32 step |", "|---|---:|---:|---:|---|---:|---:|"]
    ref_ms = None
    for spec in optkit_specs(title) + aspecs:
        if time.perf_counter() > deadline:
            notes.append(f"Rows from {spec.name} on not run (the window's time).")
            break
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        base = _allocated(device)
        try:
            built, params, masters = realize(spec, shapes, device)
            _sync(device)
            grads = 2 * sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
            grads += sum(4 * m.numel() for m in masters)  # the wrapper's fp32 master gradient buffers
            after = _allocated(device) - base - grads
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = _timed(built, device, warmup, steps)
            peak = _peak(device) - base - grads
        except Exception as err:  # noqa: BLE001 - an anchor that does not run here is noted, not fatal
            if not spec.anchor:
                raise
            notes.append(f"{spec.name} did not run ({type(err).__name__}: {str(err)[:120]}).")
            continue
        ref_ms = ms if ref_ms is None else ref_ms
        name = f"*{spec.name}*" if spec.anchor else spec.name
        alloc = f"{after / n:.3f}" if device.type == "cuda" else "–"
        peak_s = f"{peak / n:.3f}" if device.type == "cuda" else "–"
        lines.append(f"| {name} | {built.nbytes['total'] / n:.3f} | {alloc} | {peak_s} | {spec.formula} | "
                     f"{_fmt_ms(ms)} | {ms / ref_ms:.2f} |")
        H.log(f"bench.lean[{device.type}]: {title}: {spec.name} {ms:.3f} ms")
        del built, params, masters
    lines += ["", *notes, ""]
    return "\n".join(lines)


def device_main(out: str | None = None, device: str = "cuda", shapes=None, budget_s: float = 60.0) -> str:
    """The rows of every optimizer on ``device`` (default: the 161 ResNet-50 shapes, 25,557,032 params),
    within about ``budget_s`` seconds; written to ``out`` table by table when given."""
    dev = torch.device(device)
    shapes = shapes if shapes is not None else H.resnet50_shapes()
    n = H.n_params(shapes)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    parts = [f"## Lean-memory precision on {name}\n\n"
             f"torch {torch.__version__}; {stamp} UTC; {len(shapes)} tensors, {n:,} params. B/param tensors "
             f"held = weights + fp32 masters + every tensor in `opt.state`; allocated = "
             f"`torch.cuda.memory_allocated` after the first step, peak = `torch.cuda.max_memory_allocated` "
             f"over the timed steps (the lean pass's scratch included), both less the gradients (and their "
             f"restore copies, and the wrapper's fp32 gradient buffers); ms/step: median of 10 steps (CUDA "
             f"events) after 2, rows run one after another.\n"]
    deadline = time.perf_counter() + budget_s
    for i, title in enumerate(OPTIMIZERS):
        share = (deadline - time.perf_counter()) / (len(OPTIMIZERS) - i)  # its share of the time left
        parts.append(device_table(title, shapes, dev, warmup=2, steps=10,
                                  deadline=time.perf_counter() + share))
        if out:
            with open(out, "w") as f:
                f.write("\n".join(parts))
    return "\n".join(parts)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Lean-memory precision: bytes per parameter and step time")
    parser.add_argument("--device", default=None, help="measure on this device one row at a time (cuda)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds for the --device rows")
    parser.add_argument("out", nargs="?", help="Markdown file for the --device rows")
    args = parser.parse_args()
    if args.device:
        print(device_main(args.out, args.device, budget_s=args.budget))
    else:
        print(main())
