"""Optimizers: optkit SGD and LARS against torch.optim.SGD and timm's Lars, on the three parameter sets.

(a) SGD, momentum 0.9, Nesterov, weight decay 1e-4: ``torch.optim.SGD(foreach=True)``,
    ``torch.optim.SGD(fused=True)`` (the ratio's reference), ``optkit.SGD`` eager and with
    ``jit_compile=True``. torch's ``weight_decay`` is coupled (``g + wd·w``) and optkit's is the Keras
    decoupled form (``w ← w − lr·wd·w``): different formulas, the same minimal traffic, 20 B/param
    (read p, g, m; write p, m).
(b) LARS, momentum 0.9, weight decay 1e-4, eeta/trust_coeff 0.001: timm's ``Lars(foreach=True)`` (the
    reference; loaded from its file in site-packages without importing ``timm``, which needs torchvision),
    ``Lars(foreach=False)``, and ``optkit.LARS`` (TF 1.15 and TF 1.14 forms). Minimal traffic 28 B/param
    (two norm reads of p and g, then the 20-byte update).

Every step starts from the same gradients (restored, untimed, from a reference copy: optkit's SGD writes
``−lr·g`` back into ``.grad``, as torch's fused kernels do under a GradScaler). The ``jit_compile`` variant is
compiled before timing (its first-call time is reported) and is skipped on ``many_small``, where compilation
time grows with the tensor count (perf_baseline.md: 254 s for 2,000 tensors). Targets (eager, quiet machine):
SGD ≤ 1.1× fused on resnet50 / one_big and ≤ 1.0× on many_small; LARS ≥ 67% of floor (within 1.5×) on
resnet50 and one_big. Run ``python -m bench.bench_optimizers`` (``OPTKIT_BENCH_QUICK=1`` for a smoke run).
"""

from __future__ import annotations

import time

import torch

from bench import _harness as H
from optkit import LARS, SGD

LR_SGD, LR_LARS = 0.01, 0.1


def _variant(name, set_name, build):
    """A variant over its own copy of the parameter set; ``build(params) -> step callable``."""
    params = H.make_params(set_name, seed=0)
    grads = [p.grad for p in params]
    ref = [g.clone() for g in grads]

    def setup() -> None:
        torch._foreach_copy_(grads, ref)

    return H.Variant(name, build(params), setup), params


def bench_sgd(set_name: str, floor: float) -> str:
    kw = dict(momentum=0.9, nesterov=True, weight_decay=1e-4)
    variants, notes = [], []
    specs = [
        ("torch SGD fused=True", lambda ps: torch.optim.SGD(ps, lr=LR_SGD, fused=True, **kw).step),
        ("torch SGD foreach=True", lambda ps: torch.optim.SGD(ps, lr=LR_SGD, foreach=True, **kw).step),
        ("optkit SGD (eager)", lambda ps: SGD(ps, learning_rate=LR_SGD, **kw).step),
    ]
    if set_name != "many_small":
        specs.append(("optkit SGD jit_compile=True",
                      lambda ps: SGD(ps, learning_rate=LR_SGD, jit_compile=True, **kw).step))
    for name, build in specs:
        v, params = _variant(name, set_name, build)
        if "jit" in name:
            v.setup()
            t0 = time.perf_counter()
            v.step()  # compiles (untimed)
            notes.append(f"`{name}` first call (compile) {time.perf_counter() - t0:.1f} s.")
        variants.append(v)
    total = H.n_params([p.shape for p in params])
    rows = H.compare(variants, n_params=total, bytes_per_param=20, floor=floor)
    title = (f"(a) SGD momentum 0.9 + Nesterov + wd 1e-4, set `{set_name}` "
             f"({len(params)} tensors, {total:,} params)")
    return H.markdown_table(rows, title=title, note=" ".join(notes) or None)


def bench_lars(set_name: str, floor: float, timm_lars) -> str:
    variants = []
    specs = []
    if timm_lars is not None:
        tkw = dict(lr=LR_LARS, momentum=0.9, weight_decay=1e-4, trust_coeff=0.001)
        specs += [("timm Lars foreach=True", lambda ps: timm_lars(ps, foreach=True, **tkw).step),
                  ("timm Lars foreach=False", lambda ps: timm_lars(ps, foreach=False, **tkw).step)]
    okw = dict(momentum=0.9, weight_decay=1e-4, eeta=0.001)
    specs += [("optkit LARS tf1.15", lambda ps: LARS(ps, LR_LARS, **okw).step),
              ("optkit LARS tf1.14", lambda ps: LARS(ps, LR_LARS, variant="tf1.14", **okw).step)]
    for name, build in specs:
        v, params = _variant(name, set_name, build)
        variants.append(v)
    total = H.n_params([p.shape for p in params])
    rows = H.compare(variants, n_params=total, bytes_per_param=28, floor=floor)
    floor_ms = total * 28 / (floor * 1e6)
    note = (f"Floor time for 28 B/param: {floor_ms:.2f} ms; × floor = ms / floor time: "
            + ", ".join(f"{r.variant} {r.ms / floor_ms:.2f}×" for r in rows) + ".")
    if timm_lars is None:
        note += " timm is not installed: no timm rows (`pip install --no-deps timm`)."
    title = (f"(b) LARS momentum 0.9, wd 1e-4, eeta 0.001, set `{set_name}` "
             f"({len(params)} tensors, {total:,} params)")
    return H.markdown_table(rows, title=title, note=note)


def main() -> str:
    H.log("bench_optimizers: floor ...")
    floor = H.floor_gbps()
    timm_lars = H.load_timm_lars()
    parts = [H.header("Optimizers: optkit SGD / LARS vs torch.optim.SGD / timm Lars", floor)]
    sgd, lars = [], []
    for set_name in H.SET_NAMES:
        H.log(f"bench_optimizers: SGD, {set_name} ...")
        sgd.append(bench_sgd(set_name, floor))
        H.log(f"bench_optimizers: LARS, {set_name} ...")
        lars.append(bench_lars(set_name, floor, timm_lars))
    parts += [*sgd, *lars]
    return "\n".join(parts)


if __name__ == "__main__":
    print(main())
