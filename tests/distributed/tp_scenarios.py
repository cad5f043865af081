"""Tensor parallelism on 2-D and 1-D meshes: FSDP2 x TP (4 ranks, dp=2 x tp=2) and TP + sequence parallel
(2 ranks), each against the same training in one process on whole tensors.

The model is ``LayerNorm(8) -> Linear(8, 12) -> tanh -> Linear(12, 8) -> tanh -> Linear(8, 3)``. Tensor
parallel plan: the LayerNorm is sequence parallel (its input is cut along the sequence dim, its weight is
replicated, so its gradient is ``Partial``), ``up`` column-parallel, ``down`` row-parallel (output
replicated), ``head`` not parallelised. FSDP2 on the ``dp`` dim then shards everything: column-parallel
weights get ``_StridedShard`` on ``dp`` (not a ``Shard`` in torch 2.13), ``head`` lives on the 1-D ``dp``
sub-mesh. Data-parallel rank ``d`` trains on ``batch(step, d)``; the tensor-parallel ranks of a data-parallel
group see the same batch, each feeding its slice of the sequence. FSDP2 averages over ``dp``, so the
reference trains on the mean of the per-``dp`` losses.

Worker entry points return plain Python / NumPy values.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

import optkit
from optkit import _multi_tensor as mt
from optkit.sgd import SGD

from .scenarios import CollectiveCounter, count_collectives, full

STEPS = 3
DP, TP = 2, 2
SEQ = 4


class TPNet(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)
        self.head = nn.Linear(8, 3)
        with torch.no_grad():  # a LayerNorm that is not the identity at the start
            self.norm.weight.add_(torch.linspace(-0.5, 0.5, 8))
            self.norm.bias.add_(torch.linspace(0.2, -0.2, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.tanh(self.up(self.norm(x))))
        if mt.is_dtensor(h):
            h = h.full_tensor()
        return self.head(torch.tanh(h))


def batch(step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + 31 * step + dp)
    return torch.randn(2, SEQ, 8, generator=g), torch.randn(2, SEQ, 3, generator=g)


def loss_of(model: nn.Module, step: int, dp: int | None, tp: int | None, n_dp: int = DP,
            n_tp: int = TP) -> torch.Tensor:
    """This rank's loss; ``dp`` None: the mean over every data-parallel batch on whole sequences."""
    if dp is None:
        return sum(loss_of(model, step, d, None) for d in range(n_dp)) / n_dp
    x, y = batch(step, dp)
    if tp is not None:  # sequence parallel: this rank feeds its slice of the sequence
        cut = SEQ // n_tp
        x = x[:, tp * cut:(tp + 1) * cut]
    return ((model(x) - y) ** 2).mean()


def tp_plan() -> dict:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel()}


# ----------------------------------------------------------------------------------------------------------
# optimizers


def _named(model: nn.Module) -> list:
    return list(model.named_parameters())


def _sgd_global(model):
    return SGD(_named(model), learning_rate=0.1, momentum=0.9, global_clipnorm=0.05)


def _sgd_clipnorm(model):
    return SGD(_named(model), learning_rate=0.1, clipnorm=0.02)


def _lars(model):
    from optkit.lars import LARS

    return LARS(_named(model), learning_rate=0.5, momentum=0.9, weight_decay=0.01, eeta=0.1)


def _larc(model):
    from optkit.larc import LARC

    return LARC(SGD(_named(model), learning_rate=0.5, momentum=0.9), larc_eta=0.02)


def _variable_clipping(model):
    from optkit.variable_clipping import VariableClippingOptimizer

    # up.weight [0]: across _StridedShard(dp) and Shard(0)(tp); down.weight [1]: across Shard(1)(tp);
    # head.weight [0]: across Shard(0) on the dp sub-mesh; norm.weight whole (replicated on tp)
    dims = {model.up.weight: [0], model.down.weight: [1], model.head.weight: [0], model.norm.weight: [0]}
    return VariableClippingOptimizer(SGD(_named(model), learning_rate=0.5, momentum=0.9), dims, 0.45)


def _logmax(model):
    from optkit.loss_scale_optimizer import LossScaleOptimizer

    return LossScaleOptimizer(SGD(_named(model), learning_rate=0.1, momentum=0.9), loss_scale="logmax")


class _ClipThenSGD:
    """``clip_grads_by_global_norm_`` on the gradients, then plain SGD (the functional path)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.opt = SGD(_named(model), learning_rate=0.2)
        self.state = self.opt.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        from optkit.clipping import clip_grads_by_global_norm_

        clip_grads_by_global_norm_(self.params, 0.05)
        self.opt.step()


OPTIMIZERS: dict[str, Callable] = {
    "sgd_global_clipnorm": _sgd_global,
    "sgd_clipnorm": _sgd_clipnorm,
    "lars": _lars,
    "larc": _larc,
    "variable_clipping": _variable_clipping,
    "logmax": _logmax,
    "clip_grads_by_global_norm_": _ClipThenSGD,
}


def _state(opt: Any, model: nn.Module) -> dict:
    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p] if p in opt.state else {}
        out[name] = {k: full(v) for k, v in sorted(st.items()) if isinstance(v, torch.Tensor) and v.ndim > 0}
    return out


def train(model: nn.Module, opt: Any, dp: int | None, tp: int | None) -> dict:
    norms = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, s, dp, tp)
        scale_loss = getattr(opt, "scale_loss", None)
        (scale_loss(loss) if callable(scale_loss) else loss).backward()
        grads = [p.grad for p in model.parameters()]
        norms.append(float(optkit.global_norm(grads)))
        opt.step()
    scale = getattr(opt, "loss_scale", None)
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "state": _state(opt, model),
            "norms": norms, "loss_scale": float(scale) if isinstance(scale, torch.Tensor) else None}


# ----------------------------------------------------------------------------------------------------------
# optimize_loss


TRAIN_OP_CASES = {
    # (optimize_loss keyword arguments, calls)
    "clip_backoff_accum": ({"clip_gradients": 0.3, "loss_scaling": "Backoff", "iter_size": 2}, 4),
    "larc_logmax": ({"larc_params": {"larc_eta": 0.02}, "loss_scaling": "LogMax"}, 3),
}


def train_op_run(model: nn.Module, case: str, dp: int | None, tp: int | None) -> dict:
    from optkit.train import optimize_loss

    kw, calls = TRAIN_OP_CASES[case]
    op = optimize_loss(lambda step: loss_of(model, step, dp, tp), "SGD", {"momentum": 0.9}, 0.2,
                       model=model, summaries=[], **kw)
    norms, applied = [], []
    for step in range(calls):
        r = op(step)
        if r.grad_norm is not None:
            norms.append(float(r.grad_norm))
            applied.append(bool(r.applied))
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "norms": norms,
            "applied": applied, "global_step": int(op.global_step)}


# ----------------------------------------------------------------------------------------------------------
# references (one process, whole tensors)


def reference(case: str) -> dict:
    model = TPNet()
    return train(model, OPTIMIZERS[case](model), None, None)


def train_op_reference(case: str) -> dict:
    return train_op_run(TPNet(), case, None, None)


def sp_reference(case: str) -> dict:
    """TP + SP on one data-parallel group: the single batch ``batch(step, 0)``."""
    model = TPNet()
    if case in TRAIN_OP_CASES:
        return train_op_run_sp(model, case, None)
    opt = OPTIMIZERS[case](model)
    norms = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss_of(model, s, 0, None).backward()
        norms.append(float(optkit.global_norm([p.grad for p in model.parameters()])))
        opt.step()
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "norms": norms}


def train_op_run_sp(model: nn.Module, case: str, tp: int | None, n_tp: int = TP) -> dict:
    from optkit.train import optimize_loss

    kw, calls = TRAIN_OP_CASES[case]
    op = optimize_loss(lambda step: loss_of(model, step, 0, tp, n_tp=n_tp), "SGD", {"momentum": 0.9},
                       0.2, model=model, summaries=[], **kw)
    norms = []
    for step in range(calls):
        r = op(step)
        if r.grad_norm is not None:
            norms.append(float(r.grad_norm))
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "norms": norms,
            "global_step": int(op.global_step)}


# ----------------------------------------------------------------------------------------------------------
# workers


@contextmanager
def count_calls() -> Iterator[CollectiveCounter]:
    """Calls of ``torch.distributed`` collectives in the block (optkit issues every collective through them;
    no profiler, so it is cheap at 500 tensors)."""
    import torch.distributed as dist

    counter = CollectiveCounter()
    saved = {}
    for name in CollectiveCounter.NAMES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapped(*a, __fn=fn, __name=name, **k):
            counter.calls.append(__name)
            return __fn(*a, **k)

        setattr(dist, name, wrapped)
    try:
        yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _guard(fn: Callable) -> Callable:
    def run(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except Exception:  # noqa: BLE001 - reported to the test in the parent
            return {"error": traceback.format_exc()}

    return run


def _mesh_2d():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def fsdp_tp_model(mesh) -> TPNet:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = TPNet()
    parallelize_module(model, mesh["tp"], tp_plan())
    fully_shard(model, mesh=mesh["dp"])
    return model


def placements(model: nn.Module) -> dict:
    return {n: [str(p) for p in q.placements] for n, q in model.named_parameters()}


def collective_counts(rank: int, mesh) -> dict:
    """Collectives per optimizer step for 50 and 500 parameters on the 2-D mesh (hand-made layouts: every
    placement FSDP2 x TP produces, plus parameters on the 1-D ``dp`` sub-mesh)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from optkit.clipping import clip_grads_by_global_norm_
    from optkit.larc import LARC
    from optkit.lars import LARS
    from optkit.loss_scale_optimizer import LossScaleOptimizer
    from optkit.train import optimize_loss
    from optkit.variable_clipping import VariableClippingOptimizer

    layouts = [
        (mesh, [_StridedShard(0, split_factor=TP), Shard(0)]),  # column-parallel weight under FSDP2
        (mesh, [Shard(0), Shard(1)]),  # row-parallel weight
        (mesh, [Shard(0), Replicate()]),  # replicated on tp (norm, bias)
        (mesh["dp"], [Shard(0)]),  # FSDP2 only (a plain layer)
    ]
    out: dict[str, dict[int, int]] = {}
    for n in (50, 500):
        g = torch.Generator().manual_seed(n)
        fulls = [torch.randn(4, 4, generator=g) for _ in range(n)]
        grads_full = [torch.randn(4, 4, generator=g) for _ in range(n)]

        def params(fulls=fulls):
            return [nn.Parameter(distribute_tensor(f.clone(), *layouts[i % 4], src_data_rank=None))
                    for i, f in enumerate(fulls)]

        def set_grads(ps, grads_full=grads_full):
            for i, (p, gf) in enumerate(zip(ps, grads_full)):
                p.grad = distribute_tensor(gf.clone(), *layouts[i % 4], src_data_rank=None)

        def named(ps):
            return [(f"p{i}", p) for i, p in enumerate(ps)]

        cases = {
            "sgd_global_clipnorm": lambda ps: SGD(named(ps), 0.1, momentum=0.9, global_clipnorm=1.0),
            "sgd_clipnorm": lambda ps: SGD(named(ps), 0.1, clipnorm=1.0),
            "lars": lambda ps: LARS(named(ps), 0.1, eeta=0.01),
            "larc": lambda ps: LARC(SGD(named(ps), 0.1), larc_eta=0.02),
            "variable_clipping": lambda ps: VariableClippingOptimizer(
                SGD(named(ps), 0.1), {p: [0] for p in ps}, 1.0),
            "loss_scale_dynamic": lambda ps: LossScaleOptimizer(SGD(named(ps), 0.1), loss_scale="dynamic"),
            "loss_scale_logmax": lambda ps: LossScaleOptimizer(SGD(named(ps), 0.1), loss_scale="logmax"),
        }
        ps = params()
        set_grads(ps)
        for name, make in cases.items():
            opt = make(ps)
            if hasattr(opt, "grads_scaled"):  # hand-set gradients stand for scale_loss(loss).backward()
                opt.grads_scaled = True
            with count_calls() as cc:
                opt.step()
            out.setdefault(name, {})[n] = cc.count
        with count_calls() as cc:
            clip_grads_by_global_norm_(ps, 1.0)
        out.setdefault("clip_grads_by_global_norm_", {})[n] = cc.count
        # optimize_loss update (clip + dynamic scaling): gradients set by hand, a loss of no parameter
        for label, kw in (("optimize_loss_clip_dynamic", {"clip_gradients": 1.0, "loss_scaling": "dynamic"}),
                          ("optimize_loss_larc_logmax", {"larc_params": {"larc_eta": 0.02},
                                                         "loss_scaling": "LogMax"})):
            leaf = torch.zeros((), requires_grad=True)
            op = optimize_loss(lambda leaf=leaf: leaf * 1.0, "SGD", None, 0.1, var_list=named(ps),
                               summaries=[], **kw)
            set_grads(ps)  # the train op clears them after each update
            with count_calls() as cc:
                op()
            out.setdefault(label, {})[n] = cc.count
    return out


def run_fsdp_tp(rank: int, world: int) -> dict:
    """Every case on FSDP2 x TP (dp=2 x tp=2), plus collective counts on the 2-D mesh."""
    assert world == DP * TP
    dp, tp = rank // TP, rank % TP
    mesh = _mesh_2d()
    out: dict[str, Any] = {}
    layout = fsdp_tp_model(mesh)
    out["placements"] = placements(layout)
    timings = out["_timings"] = {}
    for case, make in OPTIMIZERS.items():
        def one(make=make):
            model = fsdp_tp_model(mesh)
            return train(model, make(model), dp, tp)

        t0 = time.perf_counter()
        out[f"opt/{case}"] = _guard(one)()
        timings[case] = time.perf_counter() - t0
    for case in TRAIN_OP_CASES:
        t0 = time.perf_counter()
        out[f"train_op/{case}"] = _guard(lambda case=case: train_op_run(fsdp_tp_model(mesh), case, dp, tp))()
        timings[case] = time.perf_counter() - t0

    def norm_functions():
        model = fsdp_tp_model(mesh)
        loss_of(model, 0, dp, tp).backward()
        grads = [p.grad for p in model.parameters()]
        from optkit.clipping import clip_by_global_norm

        clipped, n2 = clip_by_global_norm(grads, 0.01)
        return {"global_norm": float(optkit.global_norm(grads)), "clip_by_global_norm": float(n2),
                "per_tensor": [float(x) for x in mt.norms(grads)],
                "max_abs": float(mt.max_abs(grads)),
                "clipped": [full(c) for c in clipped]}

    t0 = time.perf_counter()
    out["norm_functions"] = _guard(norm_functions)()
    t1 = time.perf_counter()
    out["collectives"] = _guard(collective_counts)(rank, mesh)
    timings["norm_functions"], timings["collectives"] = t1 - t0, time.perf_counter() - t1
    return out


def run_all_4(rank: int, world: int) -> dict:
    """The 4-rank launch: FSDP2 x TP on 2 x 2, then TP + SP on a 1-D mesh of 4."""
    t0 = time.perf_counter()
    out = {"fsdp_tp": run_fsdp_tp(rank, world)}
    t1 = time.perf_counter()
    out["sp"] = run_sp(rank, world)
    out["_timings"] = {"fsdp_tp": t1 - t0, "sp": time.perf_counter() - t1}
    return out


def run_sp(rank: int, world: int) -> dict:
    """TP + sequence parallel without FSDP2 on a 1-D mesh of ``world`` ranks: the LayerNorm gradients are
    ``Partial``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))

    def model():
        m = TPNet()
        parallelize_module(m, mesh, tp_plan())
        return m

    out: dict[str, Any] = {}

    def partial_grads():
        m = model()
        loss_of(m, 0, 0, rank, n_tp=world).backward()
        before = {n: [str(p) for p in getattr(q.grad, "placements", ())] for n, q in m.named_parameters()}
        local_norm = float(mt.local(m.norm.weight.grad).norm())
        with count_collectives() as cc:
            reduced = mt.reduce_partial_grads_(m.parameters())
        after = {n: [str(p) for p in getattr(q.grad, "placements", ())] for n, q in m.named_parameters()}
        return {"before": before, "after": after, "reduced": reduced, "collectives": cc.count,
                "local_norm": local_norm, "norm_weight_grad": full(m.norm.weight.grad),
                "norm_bias_grad": full(m.norm.bias.grad)}

    out["partial_grads"] = _guard(partial_grads)()
    for case in ("sgd_global_clipnorm", "lars"):
        def one(case=case):
            m = model()
            opt = OPTIMIZERS[case](m)
            norms = []
            for s in range(STEPS):
                opt.zero_grad(set_to_none=True)
                loss_of(m, s, 0, rank, n_tp=world).backward()
                # global_norm reduces Partial inputs out of place; the optimizer reduces them first thing
                norms.append(float(optkit.global_norm([p.grad for p in m.parameters()])))
                opt.step()
            return {"params": {n: full(p) for n, p in m.named_parameters()}, "norms": norms,
                    "local": {n: mt.local(p).detach().numpy().copy() for n, p in m.named_parameters()}}

        out[f"opt/{case}"] = _guard(one)()
    for case in TRAIN_OP_CASES:
        out[f"train_op/{case}"] = _guard(lambda case=case: train_op_run_sp(model(), case, rank, world))()
    return out


def numpy_norm(ts: list[np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.asarray(t, dtype=np.float64) ** 2)) for t in ts))
