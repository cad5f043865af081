"""Wrappers: a loss-scaled SGD step and LARC, optkit vs the PyTorch anchors, on the three parameter sets.

(a) ``LossScaleOptimizer(optkit SGD(momentum=0.9), DynamicLossScale)`` ``step()`` vs ``torch.amp.GradScaler``
    + ``torch.optim.SGD(momentum=0.9, fused=True)`` (``scaler.step(opt); scaler.update()``). Both do the
    whole step: read-only non-finite check of the scaled gradients (4 B/param), then one fused kernel that
    unscales and updates (read p, g, m; write p, m: 20 B/param), then the scale update. Minimal traffic
    24 B/param. The gradients carry the scale and are restored before every step (untimed: optkit's SGD
    writes ``−lr·g`` into ``.grad``), so each step does the same work with no growth or backoff.
    Target: ratio (optkit / torch) <= 1.05.
(b) ``LARC(optkit SGD(momentum=0.9), larc_eta=0.001)`` (clip mode) vs timm ``Lars(momentum=0.9,
    trust_coeff=0.001, trust_clip=True, always_adapt=True)`` (timm's LARC; ``always_adapt`` because it adapts
    only groups with weight decay otherwise). Minimal traffic 28 B/param (norms read p and g; the update reads
    p, g, m and writes p, m). timm is loaded from ``timm/optim/lars.py`` by file path (``import timm`` needs
    torchvision); the row is left out when timm is not installed. Also ``LARC(optkit SGD(momentum=0.9,
    jit_compile=True))`` (the compiled norm pass and update; compiled before timing, first-call time in the
    note) on the sets with few tensors. Target: optkit within 1.5× of the floor (% of floor >= 67).

Run ``python -m bench.bench_wrappers`` (``OPTKIT_BENCH_QUICK=1`` for a smoke run).
"""

from __future__ import annotations

import time

import torch

from bench import _harness as H
from optkit import LARC, LossScaleOptimizer, flat_parameters
from optkit.loss_scale import DynamicLossScale
from optkit.sgd import SGD

SCALE = 2.0**15
LS_NOTE = (
    "Loss-scaled step: gradients carry the scale 2^15 and are restored before every step (untimed); growth "
    "interval 2000, so no growth or backoff during the run. 24 B/param = 4 (check) + 20 (fused update)."
)
LARC_NOTE = ("LARC: clip mode, η = 0.001, lr 0.1, momentum 0.9; 28 B/param = 8 (two norm passes) + 20 "
             "(update).")




def _restore(grads: list[torch.Tensor], ref: list[torch.Tensor]):
    def setup() -> None:
        torch._foreach_copy_(grads, ref)

    return setup


def _two_param_copies(set_name: str, grad_scale: float = 1.0):
    a = H.make_params(set_name, seed=0)
    b = H.make_params(set_name, seed=0)
    for p in a + b:
        p.grad.mul_(grad_scale)
    ref = [p.grad.clone() for p in a]
    return a, b, ref


def bench_loss_scaled_step(set_name: str) -> str:
    pa, pb, ref = _two_param_copies(set_name, SCALE)
    total = H.n_params([p.shape for p in pa])
    torch_opt = torch.optim.SGD(pa, lr=0.01, momentum=0.9, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2000)
    scaler.scale(torch.ones(()))  # create GradScaler's lazy tensors (untimed)

    def torch_step() -> None:
        scaler.step(torch_opt)
        scaler.update()

    def optkit_variant(name, params, flat):
        if flat:
            flat_parameters(params)
        scale = DynamicLossScale(SCALE, increment_period=2000)
        opt = LossScaleOptimizer(SGD(params, 0.01, momentum=0.9), scale)
        restore = _restore([p.grad for p in params], ref)

        def setup() -> None:
            restore()
            opt.grads_scaled = True  # the restored gradients carry the scale, as after scale_loss(loss)

        return H.Variant(name, opt.step, setup)

    variants = [
        H.Variant("torch GradScaler + SGD(fused=True)", torch_step, _restore([p.grad for p in pa], ref)),
        optkit_variant("optkit LossScaleOptimizer(SGD)", pb, False),
    ]
    if set_name != "one_big":
        pc = H.make_params(set_name, seed=0)
        for p in pc:
            p.grad.mul_(SCALE)
        variants.append(optkit_variant("optkit LossScaleOptimizer(SGD) flat", pc, True))
    # the first torch step creates its momentum buffers; do it untimed so both sides start with state
    torch_step()
    rows = H.compare(variants, n_params=total, bytes_per_param=24)
    return H.markdown_table(rows, title=f"(a) loss-scaled SGD step, set `{set_name}` ({len(pa)} tensors, "
                                          f"{total:,} params)", note=H.x_floor_note(rows, total, 24))


def bench_larc(set_name: str, lars_cls) -> str:
    pa, pb, ref = _two_param_copies(set_name)
    total = H.n_params([p.shape for p in pa])
    opt = LARC(SGD(pa, 0.1, momentum=0.9), 0.001)
    variants = [H.Variant("optkit LARC(SGD)", opt.step, _restore([p.grad for p in pa], ref))]
    if set_name != "one_big":
        v, _ = H.step_variant("optkit LARC(SGD) flat", set_name,
                              lambda ps: LARC(SGD(ps, 0.1, momentum=0.9), 0.001).step, flat=True)
        variants.append(v)
    notes = []
    if set_name not in ("many_small", "tiny_10k"):  # (compiling thousands of graph inputs takes minutes)
        v, _ = H.step_variant("optkit LARC(SGD jit_compile=True)", set_name,
                              lambda ps: LARC(SGD(ps, 0.1, momentum=0.9, jit_compile=True), 0.001).step)
        v.setup()
        t0 = time.perf_counter()
        v.step()  # compiles (untimed)
        notes.append(f"`{v.name}` first call (compile) {time.perf_counter() - t0:.1f} s.")
        variants.append(v)
    if lars_cls is not None:
        timm_opt = lars_cls(pb, lr=0.1, momentum=0.9, trust_coeff=0.001, trust_clip=True, always_adapt=True)
        variants.insert(0, H.Variant("timm Lars(trust_clip=True)", timm_opt.step,
                                     _restore([p.grad for p in pb], ref)))
    rows = H.compare(variants, n_params=total, bytes_per_param=28)
    return H.markdown_table(rows, title=f"(b) LARC, set `{set_name}` ({len(pa)} tensors, {total:,} params)",
                            note=" ".join([H.x_floor_note(rows, total, 28), *notes]))


def main() -> str:
    H.log("bench_wrappers: floor ...")
    floor = H.floor_gbps()
    lars_cls = H.load_timm_lars()
    parts = [H.header("Wrappers: loss-scaled step and LARC (optkit / anchors)", floor)]
    ls, larc = [], []
    for set_name in H.SET_NAMES:
        H.log(f"bench_wrappers: loss-scaled step, {set_name} ...")
        ls.append(bench_loss_scaled_step(set_name))
        H.log(f"bench_wrappers: LARC, {set_name} ...")
        larc.append(bench_larc(set_name, lars_cls))
    if lars_cls is None:
        larc.append("timm is not installed: the timm Lars rows are missing.")
    parts += [*ls, LS_NOTE, "", *larc, LARC_NOTE, ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(main())
