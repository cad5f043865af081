"""Foundations: global-norm clipping and loss-scale unscale+check+update, optkit vs torch, on the three sets.

(a) ``optkit.clip_grads_by_global_norm_(params, c)`` vs ``torch.nn.utils.clip_grad_norm_(params, c,
    foreach=True)``. Both take the same parameter list and read ``.grad``. Minimal traffic 12 B/param (norm
    pass reads g; scale pass reads and writes g). ``c`` is half the initial global norm and the grads are
    restored from a reference copy before every step (untimed, ``torch._foreach_copy_``), so the coefficient
    is 0.5 on every timed step: each step does the full scale work, on the same values, and repeated
    scaling cannot drift the grads toward denormals.
(b) ``optkit.DynamicLossScale``: ``found_inf = s.unscale_(grads); s.update(found_inf)`` vs
    ``torch.amp.GradScaler("cpu")``: ``scaler.unscale_(opt); scaler.update()`` on an ``SGD`` over the same
    parameters whose ``step`` is never called (GradScaler's ``unscale_`` runs its ``_unscale_grads_`` path:
    the fused ``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group, after grouping the
    optimizer's grads in Python). Same initial scale (2^15) and growth interval (2000) on both; the grads are
    restored before every step (untimed) so each step unscales the same finite values and no growth or
    backoff happens during the run. Minimal traffic 8 B/param.

Target: ratio (optkit / torch) <= 1.05 on every set. Run ``python -m bench.bench_foundations``.
"""

from __future__ import annotations

import torch

from bench import _harness as H
from optkit import clip_grads_by_global_norm_
from optkit.loss_scale import DynamicLossScale

CLIP_NOTE = (
    "Clip: c = 0.5 × the initial global norm; grads restored from a reference copy before every step "
    "(untimed), so the coefficient is 0.5 on every timed step."
)
SCALER_NOTE = (
    "Loss scale: initial scale 2^15, growth interval 2000 on both; grads restored before every step "
    "(untimed): every step unscales the same finite grads, no growth or backoff."
)


def _restore(grads: list[torch.Tensor], ref: list[torch.Tensor]):
    def setup() -> None:
        torch._foreach_copy_(grads, ref)

    return setup


def bench_clip(set_name: str) -> str:
    params = H.make_params(set_name, seed=0)
    grads = [p.grad for p in params]
    ref = [g.clone() for g in grads]
    total = H.n_params([p.shape for p in params])
    c = 0.5 * float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))))
    setup = _restore(grads, ref)
    variants = [
        H.Variant("torch clip_grad_norm_(foreach=True)",
                  lambda: torch.nn.utils.clip_grad_norm_(params, c, foreach=True), setup),
        H.Variant("optkit clip_grads_by_global_norm_", lambda: clip_grads_by_global_norm_(params, c), setup),
    ]
    rows = H.compare(variants, n_params=total, bytes_per_param=12)
    return H.markdown_table(rows, title=f"(a) global-norm clip, set `{set_name}` ({len(params)} tensors, "
                                          f"{total:,} params)")


def bench_scaler(set_name: str) -> str:
    params = H.make_params(set_name, seed=0)
    grads = [p.grad for p in params]
    ref = [g.clone() for g in grads]
    total = H.n_params([p.shape for p in params])
    setup = _restore(grads, ref)

    opt = torch.optim.SGD(params, lr=0.1)  # never stepped: only carries the grads for GradScaler
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=2000)
    scaler.scale(torch.ones(()))  # creates GradScaler's lazy scale/growth tensors (once, untimed)

    def torch_step() -> None:
        scaler.unscale_(opt)
        scaler.update()

    scale = DynamicLossScale(initial_loss_scale=2.0**15, increment_period=2000)

    def optkit_step() -> None:
        found_inf = scale.unscale_(grads)
        scale.update(found_inf)

    variants = [
        H.Variant("torch GradScaler unscale_ + update", torch_step, setup),
        H.Variant("optkit DynamicLossScale unscale_ + update", optkit_step, setup),
    ]
    rows = H.compare(variants, n_params=total, bytes_per_param=8)
    return H.markdown_table(rows, title=f"(b) loss-scale unscale + check + update, set `{set_name}` "
                                          f"({len(params)} tensors, {total:,} params)")


def main() -> str:
    H.log("bench_foundations: floor ...")
    floor = H.floor_gbps()
    parts = [H.header("Foundations: clipping and loss scaling (optkit / torch)", floor)]
    clip, scal = [], []
    for set_name in H.SET_NAMES:
        H.log(f"bench_foundations: clip, {set_name} ...")
        clip.append(bench_clip(set_name))
        H.log(f"bench_foundations: loss scale, {set_name} ...")
        scal.append(bench_scaler(set_name))
    parts += [*clip, CLIP_NOTE, "", *scal, SCALER_NOTE, ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(main())
