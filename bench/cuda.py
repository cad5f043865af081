"""CUDA: optkit's steps against torch.optim (fused), timm and GradScaler on one GPU, with the HBM floor.

Not part of ``make bench`` (which runs on the CPU): run ``python -m bench.cuda [out.md]`` on a machine with a
CUDA device; it prints the Markdown and writes it to ``bench/results/cuda.md`` (or ``out.md``).

* **Floor** = the in-place triad ``a.add_(c, alpha=s)`` on two 1 GiB fp32 arrays (3 streams counted), median
  of 20, measured in the same run; "× floor" = time ÷ (minimal bytes/param × params ÷ that bandwidth). The
  minimal bytes scale with the element size: SGD 5 elements per parameter (read p, g, m; write p, m), SGD +
  decay + EMA 8 (the reference pipeline: the SGD step, then the EMA's read of p and read-modify-write of
  the average), LARS 7 (norm reads of p and g, then the SGD update), LAMB 10 (two passes: read w, g, m, v,
  write m, v; read w, m, v, write w), loss-scaled SGD 6 (a read-only non-finite check, then the update).
* **Timing**: blocks of steps between two CUDA events (the step's host time counts whenever the host is
  slower than the device, as in training), median over blocks after warm-up. ``… CUDA graph`` rows capture
  one ``step()`` with ``torch.cuda.graph`` and time its replays: the device time alone, without launches.
* ``OPTKIT_BENCH_CUDA_JIT=1`` adds ``jit_compile=True`` rows to (b)-(d) (compiled in the warm-up, untimed).
* ``OPTKIT_BENCH_CUDA_SETS`` / ``OPTKIT_BENCH_CUDA_DTYPES`` (comma-separated) keep some parameter sets /
  dtypes only: ``bench/gpu_window.sh`` runs ``resnet50,tiny_10k`` in ``float32,bfloat16`` to fit a short GPU
  window.
* Parameters ``randn·0.1``, gradients ``randn·0.01`` (seeded), in the table's dtype; optimizer slots are
  those each implementation keeps. Sets as on the CPU (``bench/_harness.py``); the half-precision tables
  run on the two large sets only.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from bench import _harness as H

DEV = "cuda"
LR = 0.01
BLOCKS, WARMUP, BLOCK_MS = 7, 5, 40.0
#: ``jit_compile=True`` rows (minutes of compiling): opt-in
JIT = os.environ.get("OPTKIT_BENCH_CUDA_JIT", "") not in ("", "0")
ELEMENTS = {"sgd": 5, "ema": 8, "lars": 7, "lamb": 10, "lso": 6}
SETS = [x for x in os.environ.get("OPTKIT_BENCH_CUDA_SETS", ",".join(H.SET_NAMES)).split(",") if x]
DTYPES = [getattr(torch, x)
          for x in os.environ.get("OPTKIT_BENCH_CUDA_DTYPES", "float32,bfloat16,float16").split(",") if x]


def hbm_floor_gbps() -> float:
    n = (1 << 30) // 4
    a, c = torch.randn(n, device=DEV), torch.randn(n, device=DEV)
    times = []
    for i in range(24):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a.add_(c, alpha=1e-3 if i % 2 else -1e-3)
        e.record()
        e.synchronize()
        if i >= 4:
            times.append(s.elapsed_time(e))
    del a, c
    torch.cuda.empty_cache()
    return 3 * n * 4 / (statistics.median(times) * 1e6)


_HOST: dict[str, list[torch.nn.Parameter]] = {}


def make(set_name: str, dtype: torch.dtype, flat: bool = False) -> list[torch.nn.Parameter]:
    """The set's parameters and gradients on the device in ``dtype`` (drawn once per set on the host)."""
    ps = _HOST.get(set_name)
    if ps is None:
        ps = _HOST[set_name] = H.make_params(set_name, seed=0)
    out = []
    for p in ps:
        q = torch.nn.Parameter(p.detach().to(DEV, dtype))
        q.grad = p.grad.to(DEV, dtype)
        out.append(q)
    if flat:
        from optkit import flat_parameters

        flat_parameters(out)
    return out


def time_step(step: Callable[[], object], graph: bool = False) -> float:
    """ms per step: the median over blocks of ``n`` steps (``n`` fills about BLOCK_MS)."""
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        step = g.replay
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    one = max((time.perf_counter() - t0) * 1e3, 1e-3)
    slow = one > 50  # (timm's per-tensor loops on 10,000 tensors take seconds per step)
    for _ in range(1 if slow else WARMUP):
        step()
    n = 1 if slow else int(min(200, max(3, BLOCK_MS / one)))
    times = []
    for _ in range(3 if slow else BLOCKS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / n)
    return statistics.median(times)


def table(title: str, set_name: str, dtype: torch.dtype, kind: str, specs, floor: float) -> str:
    rows = []
    n_params = H.n_params(H.param_set(set_name))
    elt = torch.tensor([], dtype=dtype).element_size()
    bpp = ELEMENTS[kind] * elt
    floor_ms = n_params * bpp / (floor * 1e6)
    for name, build, flat, graph in specs:
        params = make(set_name, dtype, flat)
        try:
            ms = time_step(build(params), graph)
            rows.append((name, ms))
        except Exception as err:  # noqa: BLE001 - a variant that cannot run here is reported, not fatal
            rows.append((name, float("nan")))
            H.log(f"{title} {set_name} {name}: {type(err).__name__}: {err}")
        del params
        torch.cuda.empty_cache()
    ref = rows[0][1]
    lines = [f"### {title}, `{set_name}`, {str(dtype).replace('torch.', '')} ({n_params:,} params)", "",
             "| variant | ms/step | ratio vs ref | × floor |", "|---|---:|---:|---:|"]
    for name, ms in rows:
        lines.append(f"| {name} | {ms:.3f} | {ms / ref:.2f} | {ms / floor_ms:.2f} |")
    lines += ["", f"Floor for {bpp} B/param: {floor_ms:.3f} ms.", ""]
    H.log(f"done: {title} {set_name} {dtype}")
    return "\n".join(lines)


def main(out: str | None = None) -> str:
    """The Markdown of every table; written to ``out`` (when given) after each one."""
    from optkit import LAMB, LARS, SGD, DynamicLossScale, LossScaleOptimizer

    torch.manual_seed(0)
    floor = hbm_floor_gbps()
    timm_lars = H.load_timm_lars()
    timm_lamb = H.load_timm_optim("lamb", "Lamb")
    props = torch.cuda.get_device_properties(0)
    parts = [
        "## CUDA: optkit vs torch.optim (fused), timm, GradScaler\n",
        f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB), torch "
        f"{torch.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC. HBM floor (in-place triad, 1 GiB fp32 "
        f"arrays, median of 20): **{floor:.0f} GB/s**.\n",
    ]

    def sgd_specs(big: bool):
        def torch_sgd(**kw):
            return lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, **kw).step

        def optkit_sgd(ps):
            return SGD(ps, learning_rate=LR, momentum=0.9).step

        s = [("torch SGD fused=True", torch_sgd(fused=True), False, False),
             ("torch SGD foreach=True", torch_sgd(foreach=True), False, False),
             ("optkit SGD", optkit_sgd, False, False)]
        if not big:
            s.append(("optkit SGD flat", optkit_sgd, True, False))
        s += [("torch SGD fused, CUDA graph", torch_sgd(fused=True), False, True),
              ("optkit SGD, CUDA graph", optkit_sgd, False, True)]
        return s

    ekw = dict(learning_rate=LR, momentum=0.9, weight_decay=1e-4, use_ema=True, ema_momentum=0.99)

    def ema_specs(big: bool):
        s = [("torch SGD fused + _foreach_lerp_ EMA", lambda ps: H.sgd_ema_reference(ps, LR), False, False),
             ("optkit SGD wd+EMA", lambda ps: SGD(ps, **ekw).step, False, False)]
        if not big:
            s.append(("optkit SGD wd+EMA flat", lambda ps: SGD(ps, **ekw).step, True, False))
        s.append(("optkit SGD wd+EMA, CUDA graph", lambda ps: SGD(ps, **ekw).step, False, True))
        if JIT:
            s.append(("optkit SGD wd+EMA jit_compile=True", lambda ps: SGD(ps, jit_compile=True, **ekw).step,
                      False, False))
        return s

    lkw = dict(momentum=0.9, weight_decay=1e-4, eeta=0.001)

    def timm_lars_step(ps):
        kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coeff=0.001)
        try:
            return timm_lars(ps, foreach=True, **kw).step
        except TypeError:  # a timm without the foreach option
            return timm_lars(ps, **kw).step

    def lars_specs(big: bool):
        s = []
        if timm_lars is not None:
            s.append(("timm Lars", timm_lars_step, False, False))
        s.append(("optkit LARS", lambda ps: LARS(ps, 0.1, **lkw).step, False, False))
        if not big:
            s.append(("optkit LARS flat", lambda ps: LARS(ps, 0.1, **lkw).step, True, False))
        s.append(("optkit LARS, CUDA graph", lambda ps: LARS(ps, 0.1, **lkw).step, False, True))
        if JIT:
            s.append(("optkit LARS jit_compile=True", lambda ps: LARS(ps, 0.1, jit_compile=True, **lkw).step,
                      False, False))
        return s

    def lamb_specs(big: bool):
        s = []
        if timm_lamb is not None:
            s.append(("timm Lamb foreach=True", lambda ps: timm_lamb(ps, lr=LR, weight_decay=0.01, eps=1e-6,
                                                                     max_grad_norm=None,
                                                                     always_adapt=True).step, False, False))
        def lamb(ps):
            return LAMB(ps, LR, weight_decay=0.01, always_adapt=True).step

        s += [("torch AdamW fused=True (no trust ratio)",
               lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01, eps=1e-6, fused=True).step,
               False, False),
              ("optkit LAMB", lamb, False, False)]
        if not big:
            s.append(("optkit LAMB flat", lamb, True, False))
        s.append(("optkit LAMB, CUDA graph", lamb, False, True))
        if JIT:
            s.append(("optkit LAMB jit_compile=True",
                      lambda ps: LAMB(ps, LR, weight_decay=0.01, always_adapt=True, jit_compile=True).step,
                      False, False))
        return s

    def gradscaler(ps):
        opt = torch.optim.SGD(ps, lr=LR, momentum=0.9, fused=True)
        scaler = torch.amp.GradScaler(DEV, init_scale=2.0**15, growth_interval=10**9)
        scaler.scale(torch.ones((), device=DEV))  # (GradScaler.step needs a scale() first)

        def step():
            scaler.step(opt)
            scaler.update()

        return step

    def lso(ps):
        opt = LossScaleOptimizer(SGD(ps, learning_rate=LR, momentum=0.9),
                                 DynamicLossScale(2.0**15, increment_period=10**9))

        def step():
            opt.grads_scaled = True
            opt.step()

        return step

    def lso_specs(big: bool):
        return [("GradScaler + torch SGD fused", gradscaler, False, False),
                ("optkit LossScaleOptimizer(SGD, dynamic)", lso, False, False),
                ("optkit LossScaleOptimizer(SGD, dynamic), CUDA graph", lso, False, True)]

    plan = [("(a) SGD momentum 0.9", "sgd", sgd_specs), ("(b) SGD + wd 1e-4 + EMA 0.99", "ema", ema_specs),
            ("(c) LARS", "lars", lars_specs), ("(d) LAMB", "lamb", lamb_specs),
            ("(e) dynamic loss scale + SGD", "lso", lso_specs)]
    def emit(md: str) -> None:
        parts.append(md)
        if out is not None:  # as it goes: a run cut short keeps its finished tables
            with open(out, "w") as fh:
                fh.write("\n".join(parts))

    for title, kind, specs in plan:
        if torch.float32 in DTYPES:
            for set_name in SETS:
                big = set_name == "one_big"
                emit(table(title, set_name, torch.float32, kind, specs(big), floor))
        if kind == "lso":
            continue  # GradScaler refuses half gradients
        for dtype in (torch.bfloat16, torch.float16):
            if dtype not in DTYPES:
                continue
            for set_name in ("resnet50", "one_big"):
                if set_name in SETS:
                    emit(table(title, set_name, dtype, kind, specs(set_name == "one_big"), floor))
    return "\n".join(parts)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench.cuda: no CUDA device")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results", "cuda.md")
    print(main(out))
