"""LAMB: optkit.LAMB against timm's ``Lamb`` and a plain foreach LAMB, on the four parameter sets.

Every variant runs the same rule: Adam moments (β 0.9/0.999, ε 1e-6, bias correction), weight decay 0.01
inside the direction, the per-tensor trust ratio ‖w‖/‖u‖ on every tensor, lr 0.01, no gradient
pre-normalisation (timm ``max_grad_norm=None``). Variants:

* ``timm Lamb foreach=True`` (the reference; timm's ``lamb.py`` loaded from its file in site-packages without
  importing ``timm``, which needs torchvision) and ``foreach=False`` on the small sets;
* ``foreach LAMB (plain torch)``: a straightforward chain of ``torch._foreach_*`` ops (moments, direction,
  norms, trust ratios, update), the form most ports take — the stand-in when timm is not installed;
* ``optkit LAMB`` eager (two blocked passes through the fused-kernel gate), and with ``jit_compile=True``
  on the sets of few tensors; over flat buffers (``optkit.flat_parameters``) on ``many_small`` and
  ``tiny_10k``, eager and with ``jit_compile=True`` (there the compiled passes run over the buffer's row
  runs: one graph of a few inputs; per tensor, compiling would trace one graph input per tensor, minutes
  for 10k tensors).

Minimal traffic of any two-pass LAMB: 40 B/param (pass 1 reads w, g, m, v and writes m, v: 24; pass 2
reads w, m, v and writes w: 16), so "× floor" = ms / (params·40 B / floor GB/s). Targets (issue #14, quiet
machine): within 1.5× of the floor on resnet50, many_small and one_big, and faster than timm (met with
``jit_compile=True``, over flat buffers on many_small; the eager steps are at about 1.6-1.9×). Every step
starts from the same gradients (restored, untimed). Run ``python -m bench.bench_lamb``
(``OPTKIT_BENCH_QUICK=1`` for a smoke run).
"""

from __future__ import annotations

import torch

from bench import _harness as H
from optkit import LAMB

LR, WD, BETAS, EPS = 0.01, 0.01, (0.9, 0.999), 1e-6
BYTES = 40


class ForeachLamb:
    """LAMB as a plain chain of foreach ops (one full pass over memory per op on CPU)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.m = [torch.zeros_like(p) for p in params]
        self.v = [torch.zeros_like(p) for p in params]
        self.t = 0

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        b1, b2 = BETAS
        ps, gs = self.params, [p.grad for p in self.params]
        torch._foreach_lerp_(self.m, gs, 1 - b1)
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, gs, gs, value=1 - b2)
        denom = torch._foreach_sqrt(self.v)
        torch._foreach_div_(denom, (1 - b2**self.t) ** 0.5)
        torch._foreach_add_(denom, EPS)
        upd = torch._foreach_div(self.m, denom)
        torch._foreach_div_(upd, 1 - b1**self.t)
        torch._foreach_add_(upd, ps, alpha=WD)
        wn = torch.stack(torch._foreach_norm(ps))
        un = torch.stack(torch._foreach_norm(upd))
        r = torch.where((wn > 0) & (un > 0), wn / un, torch.ones_like(wn))
        torch._foreach_mul_(upd, list((-LR * r).unbind()))
        torch._foreach_add_(ps, upd)


#: sets with many tensors: flat buffers matter there, and jit_compile would trace one graph input per tensor
#: for many minutes
MANY = ("many_small", "tiny_10k")


def bench_lamb(set_name: str, timm_lamb) -> str:
    specs = []
    if timm_lamb is not None:
        tkw = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=None)
        specs.append(("timm Lamb foreach=True", lambda ps: timm_lamb(ps, foreach=True, **tkw).step, False))
        if set_name != "many_small" or H.QUICK:
            specs.append(("timm Lamb foreach=False", lambda ps: timm_lamb(ps, foreach=False, **tkw).step,
                          False))
    specs.append(("foreach LAMB (plain torch)", lambda ps: ForeachLamb(ps).step, False))
    okw = dict(beta1=BETAS[0], beta2=BETAS[1], epsilon=EPS, weight_decay=WD)
    specs.append(("optkit LAMB (eager)", lambda ps: LAMB(ps, LR, **okw).step, False))
    if set_name in MANY:
        specs.append(("optkit LAMB flat", lambda ps: LAMB(ps, LR, **okw).step, True))
        specs.append(("optkit LAMB flat jit_compile=True",
                      lambda ps: LAMB(ps, LR, jit_compile=True, **okw).step, True))
    else:
        specs.append(("optkit LAMB jit_compile=True", lambda ps: LAMB(ps, LR, jit_compile=True, **okw).step,
                      False))
    missing = "" if timm_lamb is not None else (
        "timm is not installed: no timm rows (`pip install --no-deps timm`); the plain foreach LAMB is the "
        "reference.")
    return H.variant_table(specs, set_name, BYTES, "LAMB β 0.9/0.999, ε 1e-6, wd 0.01", missing)


def main() -> str:
    H.log("bench_lamb: floor ...")
    floor = H.floor_gbps()
    timm_lamb = H.load_timm_optim("lamb", "Lamb")
    parts = [H.header("LAMB: optkit.LAMB vs timm Lamb vs a plain foreach LAMB", floor)]
    for set_name in H.SET_NAMES:
        H.log(f"bench_lamb: {set_name} ...")
        parts.append(bench_lamb(set_name, timm_lamb))
    return "\n".join(parts)


if __name__ == "__main__":
    print(main())
