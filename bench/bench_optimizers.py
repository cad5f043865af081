"""Optimizers: optkit SGD and LARS against torch.optim.SGD (fused) and timm's Lars, on the parameter sets.

(a) SGD, momentum 0.9: ``torch.optim.SGD(fused=True)`` (the ratio's reference), ``foreach=True``,
    ``optkit.SGD`` per tensor and over flat buffers (``optkit.flat_parameters``). 20 B/param (read p, g, m;
    write p, m).
(b) SGD, momentum 0.9 + weight decay 1e-4 + EMA 0.99: torch's fused SGD followed by a ``_foreach_lerp_``
    EMA (the reference, 20 + 12 = 32 B/param), ``optkit.SGD(weight_decay=..., use_ema=True)`` per tensor,
    flat, and with ``jit_compile=True`` (compiled before timing, first-call time reported; on the
    many-tensor sets over flat buffers, where one graph steps the whole buffer: per tensor, compilation
    time grows with the tensor count). torch's decay is coupled
    (``g + wd·w``), optkit's the Keras decoupled form (``w ← w − lr·wd·w``): different formulas, the same
    traffic. One fused pass would move 28 B/param.
(c) LARS, momentum 0.9, weight decay 1e-4, eeta/trust_coeff 0.001: timm's ``Lars(foreach=True)`` (the
    reference; loaded from its file without importing ``timm``, which needs torchvision), ``foreach=False``,
    ``optkit.LARS`` (TF 1.15 and TF 1.14 forms) per tensor and flat, and TF 1.15 with ``jit_compile=True`` on
    the large sets and over flat buffers on the many-tensor sets (first-call time reported). 28 B/param (two
    norm reads of p and g, then the 20-byte update).

Every step starts from the same gradients (restored, untimed, from a reference copy: optkit's SGD writes
``−lr·g`` back into ``.grad``, as torch's fused kernels do under a GradScaler). "× floor" = time ÷ (minimal
bytes ÷ the in-place triad bandwidth measured in the same run). Targets (issue #13): (a) ≤ 1.0× fused on the
large sets, ≤ 2× floor on all; (b) ≤ 1.0× the reference, ≤ 1.1× floor; (c) ≤ 1.3× floor large, ≤ 2× small.
Run ``python -m bench.bench_optimizers`` (``OPTKIT_BENCH_QUICK=1`` for a smoke run).
"""

from __future__ import annotations

import torch

from bench import _harness as H
from optkit import LARS, SGD

LR_SGD, LR_LARS = 0.01, 0.1
#: sets with many tensors: flat buffers matter there, and jit_compile would compile for minutes
MANY = ("many_small", "tiny_10k")


def bench_sgd(set_name: str) -> str:
    specs = [
        ("torch SGD fused=True",
         lambda ps: torch.optim.SGD(ps, lr=LR_SGD, momentum=0.9, fused=True).step, False),
        ("torch SGD foreach=True",
         lambda ps: torch.optim.SGD(ps, lr=LR_SGD, momentum=0.9, foreach=True).step, False),
        ("optkit SGD", lambda ps: SGD(ps, learning_rate=LR_SGD, momentum=0.9).step, False),
    ]
    if set_name != "one_big":
        specs.append(("optkit SGD flat", lambda ps: SGD(ps, learning_rate=LR_SGD, momentum=0.9).step, True))
    return H.variant_table(specs, set_name, 20, "(a) SGD momentum 0.9")


def bench_sgd_ema(set_name: str) -> str:
    kw = dict(learning_rate=LR_SGD, momentum=0.9, weight_decay=1e-4, use_ema=True, ema_momentum=0.99)
    specs = [("torch SGD fused + _foreach_lerp_ EMA", lambda ps: H.sgd_ema_reference(ps, LR_SGD), False),
             ("optkit SGD wd+EMA", lambda ps: SGD(ps, **kw).step, False)]
    if set_name != "one_big":
        specs.append(("optkit SGD wd+EMA flat", lambda ps: SGD(ps, **kw).step, True))
    if set_name not in MANY:
        specs.append(("optkit SGD wd+EMA jit_compile=True", lambda ps: SGD(ps, jit_compile=True, **kw).step,
                      False))
    else:  # the compiled chain over the whole flat buffer (one graph of a few inputs)
        specs.append(("optkit SGD wd+EMA flat jit_compile=True",
                      lambda ps: SGD(ps, jit_compile=True, **kw).step, True))
    return H.variant_table(specs, set_name, 32, "(b) SGD momentum 0.9 + weight decay 1e-4 + EMA 0.99",
                "Bytes/param count the reference pipeline's two passes (32); one fused pass would move 28.")


def bench_lars(set_name: str, timm_lars) -> str:
    specs = []
    if timm_lars is not None:
        tkw = dict(lr=LR_LARS, momentum=0.9, weight_decay=1e-4, trust_coeff=0.001)
        specs += [("timm Lars foreach=True", lambda ps: timm_lars(ps, foreach=True, **tkw).step, False),
                  ("timm Lars foreach=False", lambda ps: timm_lars(ps, foreach=False, **tkw).step, False)]
    okw = dict(momentum=0.9, weight_decay=1e-4, eeta=0.001)
    specs += [("optkit LARS tf1.15", lambda ps: LARS(ps, LR_LARS, **okw).step, False),
              ("optkit LARS tf1.14", lambda ps: LARS(ps, LR_LARS, variant="tf1.14", **okw).step, False)]
    if set_name != "one_big":
        specs.append(("optkit LARS tf1.15 flat", lambda ps: LARS(ps, LR_LARS, **okw).step, True))
    if set_name not in MANY:
        specs.append(("optkit LARS tf1.15 jit_compile=True",
                      lambda ps: LARS(ps, LR_LARS, jit_compile=True, **okw).step, False))
    else:  # the compiled rule over the flat buffer's row runs (one graph of a few inputs)
        specs.append(("optkit LARS tf1.15 flat jit_compile=True",
                      lambda ps: LARS(ps, LR_LARS, jit_compile=True, **okw).step, True))
    note = "" if timm_lars is not None else \
        "timm is not installed: no timm rows (`pip install --no-deps timm`)."
    return H.variant_table(specs, set_name, 28, "(c) LARS momentum 0.9, wd 1e-4, eeta 0.001", note)


def main() -> str:
    H.log("bench_optimizers: floor ...")
    floor = H.floor_gbps()
    timm_lars = H.load_timm_lars()
    parts = [H.header("Optimizers: optkit SGD / LARS vs torch.optim.SGD / timm Lars", floor)]
    sgd, ema, lars = [], [], []
    for set_name in H.SET_NAMES:
        H.log(f"bench_optimizers: SGD, {set_name} ...")
        sgd.append(bench_sgd(set_name))
        H.log(f"bench_optimizers: SGD + wd + EMA, {set_name} ...")
        ema.append(bench_sgd_ema(set_name))
        H.log(f"bench_optimizers: LARS, {set_name} ...")
        lars.append(bench_lars(set_name, timm_lars))
    parts += [*sgd, *ema, *lars]
    return "\n".join(parts)


if __name__ == "__main__":
    print(main())
