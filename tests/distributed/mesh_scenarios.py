"""Worker-side scenarios beyond "train and compare": meshes, non-finite skips, DCP, collective counts.

Each ``SCENARIOS`` entry is called as ``fn(rank, world, workdir)`` on every rank, in a fixed order, and
returns plain Python / NumPy values for the tests in the parent process.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch
from torch import nn

import optkit
from optkit import _multi_tensor as mt
from optkit.loss_scale import DynamicLossScale
from optkit.sgd import SGD

from .scenarios import (
    OPTIMIZERS,
    available,
    batch,
    count_collectives,
    full,
    loss_fn,
    make_case_model,
    make_model,
    mesh_1d,
    shard,
    snapshot,
    train,
)

# ----------------------------------------------------------------------------------------------------------
# several meshes in one global norm


def multi_mesh_fulls() -> list[torch.Tensor]:
    """The whole tensors of the multi-mesh case (identical on every rank and in the parent)."""
    g = torch.Generator().manual_seed(7)
    shapes = [(6, 4), (5,), (3, 7), (4, 4), (2, 3), (5, 3)]
    return [torch.randn(s, generator=g) for s in shapes]


def _multi_mesh_tensors(f: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    m1 = init_device_mesh("cpu", (2,))
    m12 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    m21 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    f = multi_mesh_fulls() if f is None else f
    return [
        distribute_tensor(f[0], m1, [Shard(0)]),
        distribute_tensor(f[1], m1, [Shard(0)]),  # 5 rows: uneven 3/2
        distribute_tensor(f[2], m12, [Replicate(), Shard(1)]),  # shard dim crosses columns
        distribute_tensor(f[3], m21, [Shard(0), Replicate()]),
        distribute_tensor(f[4], m1, [Replicate()]),
        f[5].clone(),  # a plain tensor, same on every rank
    ]


def _as_like(local_result: torch.Tensor, t: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """A keepdim norm over ``dims`` of DTensor ``t`` as a DTensor (Replicate where a reduced dim was cut)."""
    if not mt.is_dtensor(t):
        return local_result
    from torch.distributed.tensor import DTensor, Replicate

    pl = [Replicate() if p.is_shard() and p.dim in dims else p for p in t.placements]
    shape = tuple(1 if k in dims else t.shape[k] for k in range(t.ndim))
    return DTensor.from_local(local_result, t.device_mesh, pl, run_check=False, shape=shape,
                              stride=torch.empty(shape).stride())


def multi_mesh_norms(rank: int, world: int, workdir: str) -> dict:
    ts = _multi_mesh_tensors()
    with count_collectives() as cc:
        n = optkit.global_norm(ts)
    per = [float(x) for x in mt.norms(ts)]
    amax = float(mt.max_abs(ts))
    clipped, n2 = optkit.clip_by_global_norm(ts, 1.5)
    along_dims = [[0], [0], [1], [1], [0, 1], [0]]
    with count_collectives() as cc_along:
        along = mt.norms_along(ts, along_dims)
    along_full = [full(_as_like(a, t, d)) for a, t, d in zip(along, ts, along_dims)]
    flag0 = float(mt.any_non_finite(ts))
    # a NaN in rank 1's shard of the 2x1-mesh tensor only
    if rank == 1:
        mt.local(ts[3]).view(-1)[0] = float("nan")
    flag1 = float(mt.any_non_finite(ts))
    return {"norm": float(n), "norm_clip": float(n2), "per": per, "amax": amax,
            "clipped": [full(c) for c in clipped], "flag_finite": flag0, "flag_nan": flag1,
            "collectives": cc.count, "profiled": cc.profiled, "along_dims": along_dims,
            "along": along_full, "along_collectives": cc_along.count,
            "placements_kept": [mt.is_dtensor(c) == mt.is_dtensor(t) for c, t in zip(clipped, ts)]}


# ----------------------------------------------------------------------------------------------------------
# optimizers over parameters on several meshes at once (hand-made layouts)

MULTI_MESH_STEPS = 3


def multi_mesh_optimizers() -> dict[str, Any]:
    """name -> factory(named params) for the several-meshes step test."""
    out = {
        "sgd_global_clipnorm_ema": lambda ps: SGD(ps, learning_rate=0.1, momentum=0.9, global_clipnorm=2.0,
                                                  use_ema=True, ema_momentum=0.5),
        "sgd_clipnorm_wd": lambda ps: SGD(ps, learning_rate=0.1, momentum=0.5, nesterov=True, clipnorm=0.5,
                                          weight_decay=0.1),
    }
    if available("lars"):
        from optkit.lars import LARS

        out["lars"] = lambda ps: LARS(ps, learning_rate=0.5, momentum=0.9, weight_decay=0.01, eeta=0.1)
    return out


def multi_mesh_grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(t.shape, generator=g) for t in multi_mesh_fulls()]


def multi_mesh_train(distribute) -> dict[str, Any]:
    """Every optimizer of :func:`multi_mesh_optimizers` for MULTI_MESH_STEPS steps; ``distribute`` lays out
    a list of whole tensors (identity for the single-process reference)."""
    out = {}
    for name, factory in multi_mesh_optimizers().items():
        params = [nn.Parameter(t) for t in distribute(multi_mesh_fulls())]
        opt = factory([(f"p{i}", p) for i, p in enumerate(params)])
        for step in range(MULTI_MESH_STEPS):
            for p, g in zip(params, distribute(multi_mesh_grads(step))):
                p.grad = g
            opt.step()
        out[name] = {"params": [full(p) for p in params],
                     "state": [{k: full(v) for k, v in sorted(opt.state[p].items())} for p in params]}
    return out


def multi_mesh_step(rank: int, world: int, workdir: str) -> dict:
    return multi_mesh_train(_multi_mesh_tensors)


# ----------------------------------------------------------------------------------------------------------
# a non-finite gradient on one rank's shard


def _inject_inf(model: nn.Module, rank: int) -> None:
    if rank == 1:
        mt.local(model[2].bias.grad).view(-1)[0] = float("inf")


def nonfinite_skip(rank: int, world: int, workdir: str) -> dict:
    """Protocol level: DynamicLossScale.unscale_ on the DTensor grads, then optimizer.found_inf."""
    model = shard(make_model(), mesh_1d())
    opt = SGD(model.named_parameters(), learning_rate=0.1, momentum=0.9, use_ema=True)
    scaler = DynamicLossScale(initial_loss_scale=16.0, increment_period=100)
    before = snapshot(model, opt)
    out: dict[str, Any] = {"before": before}
    for step, inject in ((0, True), (1, False)):
        opt.zero_grad(set_to_none=True)
        scaler.scale_loss(loss_fn(model, *batch(step, rank))).backward()
        if inject:
            _inject_inf(model, rank)
        grads = [p.grad for p in model.parameters()]
        found_inf = scaler.unscale_(grads)
        should = scaler.update(found_inf)
        opt.found_inf = found_inf
        opt.step()
        del opt.found_inf
        out[f"step{step}"] = {"found_inf": float(found_inf), "should_apply": bool(should),
                              "applied": bool(opt.step_applied), "scale": float(scaler()),
                              "snap": snapshot(model, opt)}
    return out


def nonfinite_skip_wrapper(rank: int, world: int, workdir: str) -> dict | None:
    """The same through LossScaleOptimizer (when it exists)."""
    if not available("loss_scale_optimizer"):
        return None
    model = shard(make_model(), mesh_1d())
    opt = OPTIMIZERS["loss_scale_optimizer"][0](model)
    before = snapshot(model, opt)
    out: dict[str, Any] = {"before": before}
    for step, inject in ((0, True), (1, False)):
        opt.zero_grad(set_to_none=True)
        opt.scale_loss(loss_fn(model, *batch(step, rank))).backward()
        if inject:
            _inject_inf(model, rank)
        opt.step()
        out[f"step{step}"] = {"applied": bool(opt.step_applied), "scale": float(opt.loss_scale),
                              "snap": snapshot(model, opt)}
    return out


def grad_scaler_interop(rank: int, world: int, workdir: str) -> dict:
    """torch.amp.GradScaler driving an optkit optimizer on FSDP2 grads (its found_inf is mesh-reduced)."""
    model = shard(make_model(), mesh_1d())
    opt = SGD(model.named_parameters(), learning_rate=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=100)
    before = snapshot(model, opt)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss_fn(model, *batch(0, rank))).backward()
    _inject_inf(model, rank)
    scaler.step(opt)
    scaler.update()
    return {"before": before, "after": snapshot(model, opt), "scale": float(scaler.get_scale())}


# ----------------------------------------------------------------------------------------------------------
# DCP round trips


def _dcp_case(case: str, rank: int, workdir: str, full_state: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from optkit.distributed import get_optimizer_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=full_state) if full_state else None
    mesh = mesh_1d()
    model = shard(make_case_model(case), mesh)
    opt = OPTIMIZERS[case][0](model)
    train(model, opt, 2, rank)
    sd = {"model": get_model_state_dict(model, options=options),
          "optim": get_optimizer_state_dict(model, opt, options=options)}
    if full_state:
        sd = copy.deepcopy(sd)
    sharded_state = all(mt.is_dtensor(v) for st in sd["optim"]["state"].values() for k, v in st.items()
                        if isinstance(v, torch.Tensor) and v.ndim > 0)
    if not full_state:
        dcp.save(sd, checkpoint_id=workdir)
    cont = train(model, opt, 2, rank, start=2)

    model2 = shard(make_case_model(case, seed=123), mesh)
    opt2 = OPTIMIZERS[case][0](model2)
    if full_state:
        loaded = sd
    else:
        loaded = {"model": get_model_state_dict(model2),
                  "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(loaded, checkpoint_id=workdir)
    set_model_state_dict(model2, loaded["model"], options=options)
    set_optimizer_state_dict(model2, opt2, loaded["optim"], options=options)
    resumed_its = int(torch.as_tensor(opt2.iterations))
    steps_shared = len({id(st["step"]) for st in opt2.state.values() if "step" in st}) <= 1
    res = train(model2, opt2, 2, rank, start=2)
    return {"cont": cont, "resumed": res, "resumed_iterations": resumed_its, "steps_shared": steps_shared,
            "sharded_state": sharded_state}


def dcp_roundtrip(rank: int, world: int, workdir: str) -> dict:
    out = {"sgd_ema/sharded": _dcp_case("sgd_ema", rank, workdir + "_ema", False),
           "sgd_ema/full": _dcp_case("sgd_ema", rank, workdir + "_emafull", True)}
    for case in ("loss_scale_optimizer", "mixed_precision"):
        if available(case):
            out[f"{case}/sharded"] = _dcp_case(case, rank, f"{workdir}_{case}", False)
            out[f"{case}/full"] = _dcp_case(case, rank, f"{workdir}_{case}_full", True)
    return out


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    return []


def dcp_full_offload(rank: int, world: int, workdir: str) -> dict:
    """Full state dicts with cpu_offload keep the gathered fp32 masters on rank 0 only (torch's semantics);
    loading with broadcast_from_rank0 sends them tensor by tensor (no tensor inside an object broadcast) and
    resumes bit-identically."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from optkit.distributed import WRAPPERS_KEY, get_optimizer_state_dict, set_optimizer_state_dict

    case = "mixed_precision"
    mesh = mesh_1d()
    model = shard(make_case_model(case), mesh)
    opt = OPTIMIZERS[case][0](model)
    train(model, opt, 2, rank)
    save = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=save)
    osd = get_optimizer_state_dict(model, opt, options=save)
    wrappers = osd.get(WRAPPERS_KEY)
    masters = [] if wrappers is None else wrappers[0]["masters"]
    info = {"keys": sorted(osd), "tensors_held": len(_tensors_in(osd)),
            "masters": [(tuple(m.shape), m.device.type, mt.is_dtensor(m)) for m in masters]}
    msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)  # as if saved: CPU 0-d entries alias live counters
    cont = train(model, opt, 2, rank, start=2)

    model2 = shard(make_case_model(case, seed=123), mesh)
    opt2 = OPTIMIZERS[case][0](model2)
    load = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    arrays: list[int] = []  # tensors with ndim > 0 in each object broadcast, as sent (rank 0) or received
    real = dist.broadcast_object_list

    def recording(objs, *a, **k):
        if rank == 0:
            arrays.append(sum(1 for t in _tensors_in(list(objs)) if t.ndim > 0))
        out = real(objs, *a, **k)
        if rank != 0:
            arrays.append(sum(1 for t in _tensors_in(list(objs)) if t.ndim > 0))
        return out

    dist.broadcast_object_list = recording
    try:
        set_model_state_dict(model2, msd if rank == 0 else {}, options=load)
        set_optimizer_state_dict(model2, opt2, osd if rank == 0 else {}, options=load)
    finally:
        dist.broadcast_object_list = real
    # torch itself sends 0-d tensors (step counters) inside its object broadcasts; no array may travel so
    info["object_broadcast_tensors"] = sum(arrays)
    info["object_broadcasts"] = len(arrays)
    res = train(model2, opt2, 2, rank, start=2)
    return {"info": info, "cont": cont, "resumed": res}


def dcp_mismatch(rank: int, world: int, workdir: str) -> dict:
    """A wrapper checkpoint loaded into a bare optimizer raises ValueError and changes nothing."""
    from optkit.distributed import get_optimizer_state_dict, set_optimizer_state_dict

    model = shard(make_model(), mesh_1d())
    opt = SGD(model.named_parameters(), learning_rate=0.1, momentum=0.9)
    train(model, opt, 1, rank)
    sd = get_optimizer_state_dict(model, opt)
    sd["optkit_wrappers"] = [{"type": "LossScaleOptimizer"}]
    before = snapshot(model, opt)
    try:
        set_optimizer_state_dict(model, opt, sd)
        raised = None
    except ValueError as e:
        raised = str(e)
    return {"raised": raised, "before": before, "after": snapshot(model, opt)}


# ----------------------------------------------------------------------------------------------------------
# collectives per step


def _deep_model(depth: int) -> nn.Sequential:
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers)


def collectives_per_step(rank: int, world: int, workdir: str) -> dict:
    from optkit.clipping import clip_grads_by_global_norm_

    out: dict[str, dict[int, int]] = {}
    for depth in (2, 6):
        model = shard(_deep_model(depth), mesh_1d())
        params = list(model.parameters())

        def grads(model=model):
            for p in model.parameters():
                p.grad = None
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
            model(x).pow(2).mean().backward()

        cases: dict[str, Any] = {
            "sgd_global_clipnorm_ema": SGD(model.named_parameters(), 0.1, momentum=0.9, global_clipnorm=1.0,
                                           use_ema=True),
            "sgd_clipnorm": SGD(model.named_parameters(), 0.1, clipnorm=1.0),
        }
        for name in ("lars", "larc", "loss_scale_optimizer"):
            if available(name):
                cases[name] = OPTIMIZERS[name][0](model)
        for name, opt in cases.items():
            grads()
            if hasattr(opt, "grads_scaled"):  # an unscaled loss stands for scale_loss(loss) here
                opt.grads_scaled = True
            with count_collectives() as cc:
                opt.step()
            out.setdefault(name, {})[depth] = cc.count
            out.setdefault(name + "/profiled", {})[depth] = cc.profiled
        grads()
        with count_collectives() as cc:
            clip_grads_by_global_norm_(params, 1.0)
        out.setdefault("clip_grads_by_global_norm_", {})[depth] = cc.count
        grads()
        scaler = DynamicLossScale(initial_loss_scale=4.0)
        with count_collectives() as cc:
            scaler.update(scaler.unscale_([p.grad for p in params]))
        out.setdefault("loss_scale_unscale_update", {})[depth] = cc.count
    return out


# ----------------------------------------------------------------------------------------------------------
# the `mesh=` argument (seed 004 worked example on a 2x1 mesh)


def mesh_argument(rank: int, world: int, workdir: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    w = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()]))
    opt = SGD([("w", w)], learning_rate=0.01, momentum=0.1, mesh=mesh)
    w.grad = distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()])
    opt.step()
    m = opt.get_slot(w, "momentum")
    out: dict[str, Any] = {
        "iterations": int(opt.iterations), "m": full(m), "w": full(w),
        "m_layout_ok": mt.is_dtensor(m) and m.placements == w.placements and m.device_mesh == mesh,
        "iterations_device": opt.iterations.device.type,
        "replicated_iterations": None,
    }
    from optkit.distributed import replicated

    rit = replicated(opt.iterations, mesh)
    out["replicated_iterations"] = (int(rit.full_tensor()), tuple(str(p) for p in rit.placements))

    # a sharded parameter on the sub-mesh "dp" is on the (root) mesh too
    v = nn.Parameter(distribute_tensor(torch.ones(6, 2), mesh["dp"], [Shard(0)]))
    SGD([("v", v)], learning_rate=0.1, mesh=mesh)

    errors = {}
    other = init_device_mesh("cpu", (2,))
    other12 = init_device_mesh("cpu", (1, 2))
    u = nn.Parameter(distribute_tensor(torch.ones(4, 4), other12, [Replicate(), Shard(0)]))
    for label, params, msh in (("other_mesh", [("u", u)], mesh), ("plain", [("plain_p", nn.Parameter(
            torch.ones(3)))], other), ("not_a_mesh", [("w", w)], "cpu")):
        try:
            SGD(params, learning_rate=0.1, mesh=msh)
            errors[label] = None
        except (ValueError, TypeError) as e:
            errors[label] = (type(e).__name__, str(e))
    out["errors"] = errors
    return out


# ----------------------------------------------------------------------------------------------------------
# bucketed gradient averaging for plain replicated models


def all_reduce_gradients(rank: int, world: int, workdir: str) -> dict:
    from optkit.distributed import all_reduce_gradients_

    g = torch.Generator().manual_seed(11 + rank)
    grads = [torch.randn(5, 3, generator=g), None, torch.randn(7, generator=g),
             torch.randn(2, 2, 2, generator=g)]
    before = [None if t is None else t.numpy().copy() for t in grads]
    with count_collectives() as cc:
        n = all_reduce_gradients_(grads, bucket_numel=22)
    return {"before": before, "after": [None if t is None else t.numpy().copy() for t in grads],
            "calls": n, "counted": cc.count}


def tp_sequence_parallel(rank: int, world: int, workdir: str) -> dict:
    from .tp_scenarios import run_sp

    return run_sp(rank, world)


def lean_modes(rank: int, world: int, workdir: str) -> dict:
    from .lean_scenarios import run_lean

    return run_lean(rank, world, workdir)


def _train_op_scenario(name: str):
    def run(rank: int, world: int, workdir: str) -> Any:
        from . import train_op_scenarios

        return getattr(train_op_scenarios, name)(rank, world, workdir)

    return run


SCENARIOS = {
    "tp_sequence_parallel": tp_sequence_parallel,
    "summaries_rank0": _train_op_scenario("summaries_rank0"),
    "overflow_decision": _train_op_scenario("overflow_decision"),
    "pipeline_stages": _train_op_scenario("pipeline_stages"),
    "fsdp_midwindow_state": _train_op_scenario("fsdp_midwindow_state"),
    "dcp_full_offload": dcp_full_offload,
    "multi_mesh_norms": multi_mesh_norms,
    "multi_mesh_step": multi_mesh_step,
    "nonfinite_skip": nonfinite_skip,
    "nonfinite_skip_wrapper": nonfinite_skip_wrapper,
    "grad_scaler_interop": grad_scaler_interop,
    "dcp_roundtrip": dcp_roundtrip,
    "dcp_mismatch": dcp_mismatch,
    "collectives_per_step": collectives_per_step,
    "mesh_argument": mesh_argument,
    "all_reduce_gradients": all_reduce_gradients,
    "lean_modes": lean_modes,
}


def numpy_norm(ts: list[np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.asarray(t, dtype=np.float64) ** 2)) for t in ts))
