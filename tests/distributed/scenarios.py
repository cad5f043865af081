"""Code shared by the distributed workers and the single-process references of the tests.

Every case trains the same small model (``Linear(5, 7) → tanh → Linear(7, 3)``; 7 and 3 rows split unevenly
over 2 ranks) for ``STEPS`` steps. The distributed run shards it with FSDP2 ``fully_shard`` and feeds rank
``r`` the batch ``batch(step, r)``; FSDP2 averages the gradients over ranks, so the single-process reference
trains on the mean of the per-rank losses and must end with the same parameters, optimizer state and gradient
norms (fp32 tolerance).

Worker functions (``run_*``) are called on every rank by ``_spawn.run_on_ranks`` and return plain Python /
NumPy values.
"""

from __future__ import annotations

import importlib
import os
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

STEPS = 3
WORLD = 2

# ----------------------------------------------------------------------------------------------------------
# model, data, optimizers


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 17 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return ((model(x.to(dtype)).float() - y) ** 2).mean()


def _maybe(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(f"optkit.{module}"), name)
    except (ImportError, AttributeError):
        return None


def _sgd(**kw: Any) -> Callable:
    return lambda model: SGD(model.named_parameters(), **kw)


def _lars(model: nn.Module) -> Any:
    lars = _maybe("lars", "LARS")
    return lars(model.named_parameters(), learning_rate=0.5, momentum=0.9, weight_decay=0.01, eeta=0.1)


def _lamb(model: nn.Module) -> Any:
    lamb = _maybe("lamb", "LAMB")
    # small blocks: chunked local shards, norms summed per tensor, then over the mesh
    return lamb(model.named_parameters(), learning_rate=0.05, weight_decay=0.01, use_ema=True,
                ema_warmup=True, block_numel=64)


def _larc(model: nn.Module) -> Any:
    larc = _maybe("larc", "LARC")
    return larc(SGD(model.named_parameters(), learning_rate=0.5, momentum=0.9), larc_eta=0.02)


def _loss_scale_opt(model: nn.Module) -> Any:
    lso = _maybe("loss_scale_optimizer", "LossScaleOptimizer")
    from optkit.loss_scale import DynamicLossScale

    inner = SGD(model.named_parameters(), learning_rate=0.1, momentum=0.9)
    return lso(inner, loss_scale=DynamicLossScale(initial_loss_scale=2.0**4, increment_period=2))


def _mixed_precision(model: nn.Module) -> Any:
    mpw = _maybe("mixed_precision", "MixedPrecisionOptimizerWrapper")
    from optkit.loss_scale import DynamicLossScale

    inner = SGD(model.named_parameters(), learning_rate=0.1, momentum=0.9, use_ema=True, ema_momentum=0.5)
    return mpw(inner, loss_scale=DynamicLossScale(initial_loss_scale=2.0**6, increment_period=2))


def _variable_clipping(model: nn.Module) -> Any:
    vco = _maybe("variable_clipping", "VariableClippingOptimizer")
    w0, w2 = model[0].weight, model[2].weight
    # dims [0] on a Shard(0) parameter: the clipping norm runs across the shard dimension
    return vco(SGD(model.named_parameters(), learning_rate=0.5, momentum=0.9), {w0: [0], w2: [1]}, 0.9)


#: name -> (factory(model) -> optimizer, module, class the case needs)
OPTIMIZERS: dict[str, tuple[Callable, str | None, str | None]] = {
    "sgd": (_sgd(learning_rate=0.1), None, None),
    "sgd_momentum": (_sgd(learning_rate=0.1, momentum=0.9), None, None),
    "sgd_nesterov_wd": (_sgd(learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=0.05), None, None),
    "sgd_global_clipnorm": (_sgd(learning_rate=0.1, momentum=0.9, global_clipnorm=0.05), None, None),
    "sgd_clipnorm": (_sgd(learning_rate=0.1, clipnorm=0.02), None, None),
    "sgd_ema": (_sgd(learning_rate=0.1, momentum=0.5, use_ema=True, ema_momentum=0.8,
                     ema_overwrite_frequency=2), None, None),
    "lars": (_lars, "lars", "LARS"),
    "lamb": (_lamb, "lamb", "LAMB"),
    "larc": (_larc, "larc", "LARC"),
    "loss_scale_optimizer": (_loss_scale_opt, "loss_scale_optimizer", "LossScaleOptimizer"),
    "variable_clipping": (_variable_clipping, "variable_clipping", "VariableClippingOptimizer"),
    "mixed_precision": (_mixed_precision, "mixed_precision", "MixedPrecisionOptimizerWrapper"),
}

#: cases also run with HSDP on a 2-D mesh (1x2: shard over both ranks; 2x1: replicate over both ranks)
HSDP_CASES = ("sgd_global_clipnorm", "sgd_ema", "lars", "loss_scale_optimizer")

#: cases whose model is not fp32 (fp16 parameters, fp32 masters in the optimizer)
MODEL_DTYPE = {"mixed_precision": torch.float16}


def make_case_model(case: str, seed: int = 0) -> nn.Sequential:
    return make_model(seed).to(MODEL_DTYPE.get(case, torch.float32))


def available(case: str) -> bool:
    _, module, cls = OPTIMIZERS[case]
    return module is None or _maybe(module, cls) is not None


# ----------------------------------------------------------------------------------------------------------
# snapshots


def full(t: torch.Tensor) -> np.ndarray:
    """The whole tensor as NumPy (DTensors are gathered: a collective; same order on every rank)."""
    if mt.is_dtensor(t):
        t = t.full_tensor()
    return t.detach().cpu().numpy().copy()


def snapshot(model: nn.Module, opt: Any) -> dict:
    params, state = {}, {}
    for name, p in model.named_parameters():
        params[name] = full(p)
        key = opt.master_of(p) if hasattr(opt, "master_of") and p.dtype != torch.float32 else p
        st = opt.state[key] if key in opt.state else {}
        state[name] = {k: full(v) for k, v in sorted(st.items()) if isinstance(v, torch.Tensor)}
        if key is not p:
            state[name]["master"] = full(key)
    its = getattr(opt, "iterations", None)
    scale = getattr(opt, "loss_scale", None)
    return {"params": params, "state": state,
            "iterations": None if its is None else int(torch.as_tensor(its).reshape(())),
            "loss_scale": float(scale) if isinstance(scale, torch.Tensor) else None}


def train(
    model: nn.Module, opt: Any, steps: int, rank: int | None, world: int = WORLD, start: int = 0
) -> dict:
    """``steps`` training steps from step index ``start``. ``rank`` None: one process on the mean of every
    rank's loss (the reference)."""
    norms = []
    for s in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        if rank is None:
            loss = sum(loss_fn(model, *batch(s, r)) for r in range(world)) / world
        else:
            loss = loss_fn(model, *batch(s, rank))
        scale_loss = getattr(opt, "scale_loss", None)
        (scale_loss(loss) if callable(scale_loss) else loss).backward()
        grads = [p.grad for p in model.parameters()]
        norms.append(float(optkit.global_norm(grads)))
        opt.step()
    out = snapshot(model, opt)
    out["norms"] = norms
    return out


def reference(case: str, steps: int = STEPS) -> dict:
    """The single-process run of ``case``."""
    model = make_case_model(case)
    return train(model, OPTIMIZERS[case][0](model), steps, None)


# ----------------------------------------------------------------------------------------------------------
# optimize_loss


TRAIN_CALLS = 4  # iter_size 2: two updates


def train_op_run(model: nn.Module, rank: int | None, on_horovod: bool, world: int = WORLD) -> dict:
    """``optimize_loss`` (Momentum, global-norm clip, Backoff scaling, iter_size 2) for TRAIN_CALLS calls.
    ``rank`` None: one process on the mean of every rank's loss (the reference)."""
    if rank is None:
        def loss(step):
            return sum(loss_fn(model, *batch(step, r)) for r in range(world)) / world
    else:
        def loss(step):
            return loss_fn(model, *batch(step, rank))
    from optkit.train import optimize_loss

    op = optimize_loss(loss, "Momentum", {"momentum": 0.9}, 0.2, model=model, clip_gradients=0.3,
                       loss_scaling="Backoff", iter_size=2, on_horovod=on_horovod)
    norms = []
    for step in range(TRAIN_CALLS):
        res = op(step)
        if res.grad_norm is not None:
            norms.append(float(res.grad_norm))
    return {"params": {n: full(p) for n, p in model.named_parameters()}, "norms": norms,
            "global_step": int(op.global_step)}


def train_op_reference() -> dict:
    return train_op_run(make_model(), None, False)


def train_op_cases(rank: int) -> dict:
    out = {}
    model = make_model()
    out["replicated_horovod"] = _case_runner(train_op_run)(model, rank, True)
    for label, hvd in (("fsdp", False), ("fsdp_horovod", True)):
        out[label] = _case_runner(train_op_run)(shard(make_model(), mesh_1d()), rank, hvd)
    return out


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def mesh_1d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,))


# ----------------------------------------------------------------------------------------------------------
# collective counting


class CollectiveCounter:
    """Counts process-group collectives: calls of ``torch.distributed.<collective>`` (the functions optkit's
    multi-tensor layer uses) and, through a profiler, backend collective ops (which also sees DTensor's own
    functional collectives)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
             "reduce", "all_to_all_single", "barrier")

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.profiled = 0

    @property
    def count(self) -> int:
        return len(self.calls)


_BACKEND_COLLECTIVE_KEYS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                            "broadcast", "alltoall")


@contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's native start/stop lines) for the block."""
    import sys

    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextmanager
def count_collectives() -> Iterator[CollectiveCounter]:
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
        activities = [torch.profiler.ProfilerActivity.CPU]
        with _quiet_stderr_fd(), torch.profiler.profile(activities=activities) as prof:
            yield counter
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    seen = 0
    for ev in prof.events():
        n = ev.name.lower()
        if n.startswith("c10d::") and any(key in n for key in _BACKEND_COLLECTIVE_KEYS):
            seen += 1
    counter.profiled = seen


# ----------------------------------------------------------------------------------------------------------
# worker entry points


def _case_runner(fn: Callable) -> Callable:
    """Run a scenario, turning an exception into ``{"error": traceback}`` so other scenarios still report."""

    def run(*a: Any, **k: Any) -> Any:
        try:
            return fn(*a, **k)
        except Exception:  # noqa: BLE001 - reported to the test in the parent
            return {"error": traceback.format_exc()}

    return run


def fsdp_case(case: str, rank: int, mesh_shape: tuple[int, ...] = (WORLD,)) -> dict:
    """``case`` trained for STEPS steps with FSDP2 (``mesh_shape`` of 2 dims: HSDP, replicate x shard),
    plus the placement of each state entry."""
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = shard(make_case_model(case), mesh)
    opt = OPTIMIZERS[case][0](model)
    placements = {}
    for name, p in model.named_parameters():
        key = opt.master_of(p) if hasattr(opt, "master_of") and p.dtype != torch.float32 else p
        for k, v in opt.state[key].items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                placements[f"{name}/{k}"] = (mt.is_dtensor(v) and v.placements == p.placements
                                             and v.device_mesh == p.device_mesh)
    out = train(model, opt, STEPS, rank)
    out["placements"] = placements
    # EMA: finalize without gathering (no collective) and keep the shards where they are
    if getattr(opt, "use_ema", False):
        with count_collectives() as cc:
            opt.finalize_variable_values()
        out["finalize_collectives"] = cc.count + cc.profiled
        out["finalized"] = {n: full(p) for n, p in model.named_parameters()}
        out["finalized_is_dtensor"] = all(mt.is_dtensor(p) for p in model.parameters())
    return out


def run_all(rank: int, world: int, workdir: str) -> dict:
    """Every scenario, in a fixed order (collectives must match across ranks)."""
    import time

    from . import mesh_scenarios

    results: dict[str, Any] = {}
    timings: dict[str, float] = {}
    for case in OPTIMIZERS:
        if available(case):
            t0 = time.perf_counter()
            results[f"fsdp/{case}"] = _case_runner(fsdp_case)(case, rank)
            timings[f"fsdp/{case}"] = time.perf_counter() - t0
    for case in HSDP_CASES:
        for shape in ((1, WORLD), (WORLD, 1)):
            if available(case):
                key = f"hsdp{shape[0]}x{shape[1]}/{case}"
                t0 = time.perf_counter()
                results[key] = _case_runner(fsdp_case)(case, rank, shape)
                timings[key] = time.perf_counter() - t0
    t0 = time.perf_counter()
    results["optimize_loss"] = _case_runner(train_op_cases)(rank)
    timings["optimize_loss"] = time.perf_counter() - t0
    for name, fn in mesh_scenarios.SCENARIOS.items():
        t0 = time.perf_counter()
        results[name] = _case_runner(fn)(rank, world, os.path.join(workdir, name.replace("/", "_")))
        timings[name] = time.perf_counter() - t0
    results["_timings"] = timings
    return results
