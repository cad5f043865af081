"""optimize_loss: the whole train-op update (all but forward and backward) vs the best hand-written torch.

Both sides do, per update, on the same parameter set with the same gradients:
dynamic loss scaling (unscale + non-finite check + scale update), global-norm clipping, SGD with Nesterov
momentum 0.9 and weight decay, an EMA of the weights (momentum 0.99) and a learning-rate schedule step.

* **torch**: ``GradScaler.unscale_`` (fused check+unscale), ``clip_grad_norm_(foreach=True)``,
  ``GradScaler.step`` on ``torch.optim.SGD(fused=True)`` (found_inf handed to the fused kernel, no sync),
  ``GradScaler.update``, EMA by ``torch._foreach_lerp_``, ``LambdaLR.step``.
* **optkit**: ``optimize_loss(loss, "SGD", {momentum, nesterov, weight_decay, use_ema}, poly_decay schedule,
  clip_gradients=c, loss_scaling="dynamic", summaries=[])``; ``train_op()`` with a loss that depends on no
  parameter (a 0-d leaf), so forward/backward cost a few microseconds and the parameters' ``.grad`` are the
  restored gradients. Unscale, mean and clip fold into the fused SGD kernel's ``grad_scale``, the skip into
  its ``found_inf``; the update and the EMA run block by block. Also with ``jit_compile=True`` in the SGD
  options (the norm and overflow check in one compiled read, decay → update → EMA in one compiled loop;
  compiled before timing, first-call time in the note): per tensor on the sets with few tensors, and over
  flat buffers.

Gradients (``randn·0.01``, treated as loss-scaled by 2^15 on both sides) are restored before every step
(untimed); ``c`` is half the unscaled global norm, so every step clips by 0.5. Minimal traffic 32 B/param
(a 4 B/param norm/check read plus the 28 B/param fused update+EMA). Target: optkit/torch <= 0.75.
Run ``python -m bench.bench_train`` (``OPTKIT_BENCH_QUICK=1`` for a smoke run).
"""

from __future__ import annotations

import time

import torch

from bench import _harness as H
from optkit import flat_parameters, optimize_loss, poly_decay

SCALE = 2.0**15
LR, MOMENTUM, WD, EMA = 0.1, 0.9, 1e-4, 0.99
NOTE = (
    "Both: initial loss scale 2^15, growth interval 2000 (no growth or backoff during the run); clip factor "
    "0.5 on every step; SGD lr 0.1 (poly decay over 10^6 steps), Nesterov 0.9, weight decay 1e-4 (torch "
    "coupled L2, optkit Keras decoupled: same traffic); EMA 0.99. Grads restored before every step (untimed)."
)


def _grad_restorer(params: list[torch.nn.Parameter], ref: list[torch.Tensor]):
    bufs = [g.clone() for g in ref]

    def setup() -> None:
        torch._foreach_copy_(bufs, ref)
        for p, b in zip(params, bufs):
            p.grad = b

    return setup


def _torch_variant(set_name: str, clip: float) -> H.Variant:
    params = H.make_params(set_name, seed=0)
    ref = [p.grad.clone() for p in params]
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WD, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: float(poly_decay(k, 1.0, 10**6)))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2000)
    scaler.scale(torch.ones(()))  # creates the lazy scale tensors (untimed)
    ema = [p.detach().clone() for p in params]

    def step() -> None:
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
        scaler.step(opt)
        scaler.update()
        torch._foreach_lerp_(ema, params, 1.0 - EMA)
        sched.step()

    name = "torch GradScaler + clip_grad_norm_(foreach) + SGD(fused) + _foreach_lerp_ EMA + LambdaLR"
    return H.Variant(name, step, _grad_restorer(params, ref))


def _optkit_variant(set_name: str, clip: float, flat: bool = False, jit: bool = False) -> H.Variant:
    params = H.make_params(set_name, seed=0)
    if flat:
        flat_parameters(params)
    ref = [p.grad.clone() for p in params]
    dummy = torch.zeros((), requires_grad=True)
    hp = {"momentum": MOMENTUM, "nesterov": True, "weight_decay": WD, "use_ema": True, "ema_momentum": EMA}
    op = optimize_loss(
        lambda: dummy * 1.0, "SGD", {**hp, "jit_compile": True} if jit else hp,
        lambda k: poly_decay(k, LR, 10**6), var_list=params, clip_gradients=clip, loss_scaling="dynamic",
        loss_scaling_params={"initial_loss_scale": SCALE, "increment_period": 2000}, summaries=[],
    )
    name = "optkit optimize_loss train op (same pipeline)" + (", flat buffers" if flat else "") + (
        ", SGD jit_compile=True" if jit else "")
    restore = _grad_restorer(params, ref) if not flat else _copy_restorer([p.grad for p in params], ref)
    return H.Variant(name, op, restore)


def _compiled_first(v: H.Variant, notes: list[str]) -> H.Variant:
    """Run a ``jit_compile`` variant's first update (it compiles; untimed) and note how long it took."""
    v.setup()
    t0 = time.perf_counter()
    v.step()
    notes.append(f"`{v.name}` first call (compile) {time.perf_counter() - t0:.1f} s.")
    return v


def _copy_restorer(grads: list[torch.Tensor], ref: list[torch.Tensor]):
    """Restore flat gradients in place (their views must stay the parameters' ``.grad``)."""
    def setup() -> None:
        torch._foreach_copy_(grads, ref)

    return setup


def bench_set(set_name: str) -> str:
    probe = H.make_params(set_name, seed=0)
    total = H.n_params([p.shape for p in probe])
    norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in probe]))))
    clip = 0.5 * norm / SCALE
    n_tensors = len(probe)
    del probe
    variants = [_torch_variant(set_name, clip), _optkit_variant(set_name, clip)]
    notes: list[str] = []
    if set_name not in ("many_small", "tiny_10k"):  # (compiling thousands of graph inputs takes minutes)
        variants.append(_compiled_first(_optkit_variant(set_name, clip, jit=True), notes))
    if set_name != "one_big":
        variants.append(_optkit_variant(set_name, clip, flat=True))
        variants.append(_compiled_first(_optkit_variant(set_name, clip, flat=True, jit=True), notes))
    rows = H.compare(variants, n_params=total, bytes_per_param=32)
    title = f"train-op update, set `{set_name}` ({n_tensors} tensors, {total:,} params)"
    note = " ".join([H.x_floor_note(rows, total, 32), *notes])
    return H.markdown_table(rows, title=title, note=note)


def _encoder(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.0,
                                             batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2 if H.QUICK else 4, enable_nested_tensor=False)


def bench_end_to_end() -> str:
    """Forward + backward + update of a small transformer encoder (d 128, 4 layers, batch 16 x 64 tokens):
    the train op against the hand-written torch pipeline, each on its own copy of the model."""
    x = torch.randn(16, 64, 128, generator=torch.Generator().manual_seed(1))

    def loss_of(model):
        return lambda: model(x).pow(2).mean()

    tm = _encoder()
    params = list(tm.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=WD, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: float(poly_decay(k, 1.0, 10**6)))
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2000)
    ema = [p.detach().clone() for p in params]

    def torch_step() -> None:
        opt.zero_grad()
        scaler.scale(loss_of(tm)()).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        scaler.step(opt)
        scaler.update()
        torch._foreach_lerp_(ema, params, 1.0 - EMA)
        sched.step()

    variants = [H.Variant("torch pipeline (GradScaler, clip_grad_norm_, fused SGD, lerp EMA, LambdaLR)",
                          torch_step)]
    for flat in (False, True):
        om = _encoder()
        if flat:
            flat_parameters(om)
        sgd = {"momentum": MOMENTUM, "nesterov": True, "weight_decay": WD, "use_ema": True,
               "ema_momentum": EMA}
        op = optimize_loss(
            loss_of(om), "SGD", sgd,
            lambda k: poly_decay(k, LR, 10**6), model=om, clip_gradients=1.0, loss_scaling="dynamic",
            loss_scaling_params={"initial_loss_scale": SCALE, "increment_period": 2000}, summaries=[])
        variants.append(H.Variant("optkit optimize_loss" + (" (flat buffers)" if flat else ""), op))
    n = H.n_params([p.shape for p in params])
    rows = H.compare(variants, n_params=n, bytes_per_param=32)
    return H.markdown_table(rows, title=f"end to end: forward, backward and update, transformer encoder "
                                        f"({len(params)} tensors, {n:,} params)",
                            note="Bytes/param and % of floor count the update only; forward and backward "
                                 "dominate here, the ratio is what matters.")


def main() -> str:
    H.log("bench_train: floor ...")
    floor = H.floor_gbps()
    parts = [H.header("optimize_loss train op vs hand-written torch (optkit / torch)", floor)]
    for set_name in (*H.SET_NAMES, "transformer"):
        H.log(f"bench_train: {set_name} ...")
        parts.append(bench_set(set_name))
    parts += [NOTE, ""]
    H.log("bench_train: end to end ...")
    parts += [bench_end_to_end(), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(main())
