"""The lean modes (``precision=`` / ``state_dtype=``, :mod:`optkit._core.lean`) on DTensor parameters: FSDP2
(``fully_shard``, Shard(0) on 2 ranks) and tensor-parallel Shard(1) layouts, against the same optimizer on
the whole tensors in one process, fed the same gradients (so the comparison sees the optimizer only).

The bfloat16 parameters are chosen for the layouts' edge cases (global shapes; 2 ranks):

* ``w`` (63, 128): 8064 elements, rows split 32/31 (local 4096 and 3968 elements: the 8-bit threshold of
  4096 falls between the shards, so it must be decided on the global size, as the unsharded run decides);
* ``row`` (1, 4096): one row, rank 1 holds none (an empty local shard of an 8-bit slot);
* ``vec`` (4608,): 1-d and sharded, so its slots fall back to float32 (its block scales would not shard
  along with the elements: ``lean._quantizable``);
* ``bias`` (63,): below the 8-bit threshold (float32).

Worker functions return NumPy values (bfloat16 widened to float32, exactly) for the tests in the parent.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from optkit import _multi_tensor as mt

from .scenarios import _case_runner, mesh_1d

LEAN_STEPS = 3
SHAPES = {"w": (63, 128), "row": (1, 4096), "vec": (4608,), "bias": (63,)}
#: (precision, state_dtype) pairs under test
MODES = {"split_int8": ("split", "int8"), "kahan_bf16": ("kahan", "bfloat16"),
         "kahan_int8": ("kahan", "int8")}


def _optimizer(name: str) -> Callable:
    if name == "sgd":
        from optkit.sgd import SGD

        return lambda ps, **kw: SGD(ps, learning_rate=0.1, momentum=0.9, nesterov=True, weight_decay=0.01,
                                    **kw)
    if name == "adam":
        from optkit.adam import AdamW

        return lambda ps, **kw: AdamW(ps, learning_rate=0.01, weight_decay=0.1, **kw)
    if name == "lars":
        from optkit.lars import LARS

        return lambda ps, **kw: LARS(ps, learning_rate=0.5, momentum=0.9, weight_decay=0.01, eeta=0.1, **kw)
    from optkit.lamb import LAMB

    return lambda ps, **kw: LAMB(ps, learning_rate=0.01, weight_decay=0.01, **kw)


#: optimizer cases: elementwise rules (bit-identical to the unsharded run) and trust-ratio rules (mesh norms)
ELEMENTWISE = ("sgd", "adam")
NORMED = ("lars", "lamb")


def full_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in SHAPES.items()}


def full_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return {n: (0.1 * torch.randn(s, generator=g)).to(torch.bfloat16) for n, s in SHAPES.items()}


class LeanNet(nn.Module):
    """The parameters of :data:`SHAPES` (no forward: the tests feed gradients)."""

    def __init__(self) -> None:
        super().__init__()
        for n, t in full_params().items():
            self.register_parameter(n, nn.Parameter(t.clone()))


def _np(t: torch.Tensor, raw: bool = False) -> np.ndarray:
    """``t`` gathered, as NumPy; ``raw``: a 16-bit tensor's bits as int16 (``master_low``)."""
    if mt.is_dtensor(t):
        if t.dtype == torch.int16:  # (gloo and NCCL gather no int16: the values travel as int32)
            from torch.distributed.tensor import DTensor

            wide = DTensor.from_local(mt.local(t).to(torch.int32), t.device_mesh, t.placements,
                                      run_check=False, shape=t.shape, stride=t.stride())
            t = wide.full_tensor().to(torch.int16)
        else:
            t = t.full_tensor()
    t = t.detach().cpu()
    if raw:
        return t.view(torch.int16).numpy().copy()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy().copy()


def _layout(t: torch.Tensor) -> tuple:
    """(is DTensor, placements as strings, global shape, local shape)."""
    if not mt.is_dtensor(t):
        return (False, (), tuple(t.shape), tuple(t.shape))
    return (True, tuple(str(p) for p in t.placements), tuple(t.shape), tuple(mt.local(t).shape))


def lean_snapshot(named: dict[str, torch.Tensor], opt: Any) -> dict:
    """Parameters, every state entry (stored forms: codes, scales, low halves, compensations) and their
    layouts, plus the decoded fp32 slots, by parameter name."""
    out: dict[str, Any] = {"params": {}, "state": {}, "layout": {}, "decoded": {}}
    for n, p in named.items():
        st = opt.state[p]
        out["params"][n] = _np(p)
        out["state"][n] = {k: _np(v, raw=k == "master_low") for k, v in sorted(st.items())
                           if isinstance(v, torch.Tensor) and k != "step"}
        out["layout"][n] = {k: (str(v.dtype), *_layout(v)) for k, v in sorted(st.items())
                            if isinstance(v, torch.Tensor) and v.ndim > 0}
        out["layout"][n]["param"] = (str(p.dtype), *_layout(p))
        slots = [k for k in opt.slot_names if k in st]
        out["decoded"][n] = {k: _decoded(opt, p, k) for k in slots}
    return out


def _decoded(opt: Any, p: torch.Tensor, slot: str) -> np.ndarray:
    local = opt.lean_slot_values(p, slot)
    if not mt.is_dtensor(p):
        return local.numpy().copy()
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride()).full_tensor().numpy().copy()


def _set_grads(named: dict[str, torch.Tensor], step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    for n, g in full_grads(step).items():
        p = named[n]
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if mt.is_dtensor(p) else g


def _train(named: dict[str, torch.Tensor], opt: Any, steps: int, start: int = 0) -> dict:
    for s in range(start, start + steps):
        _set_grads(named, s)
        opt.step()
    return lean_snapshot(named, opt)


@functools.cache
def reference(opt_name: str, mode: str, fallback: tuple[str, ...] = ("vec",),
              steps: int = LEAN_STEPS) -> dict:
    """The whole tensors in one process: the parameters in ``fallback`` get their own optimizer with float32
    slots (what a sharded 1-d parameter falls back to), the others one with the mode's slots. The rules are
    per tensor (no global norm), so splitting the optimizer changes nothing else.
    Cached: treat as read-only."""
    precision, state_dtype = MODES[mode]
    factory = _optimizer(opt_name)
    named = {n: nn.Parameter(t) for n, t in full_params().items()}
    main = factory([(n, p) for n, p in named.items() if n not in fallback], precision=precision,
                   state_dtype=state_dtype)
    opts = [main]
    if fallback:
        fb_dtype = "float32" if state_dtype == "int8" else state_dtype
        opts.append(factory([(n, named[n]) for n in fallback], precision=precision, state_dtype=fb_dtype))
    for s in range(steps):
        _set_grads(named, s)
        for o in opts:
            o.step()

    class _Both:  # the snapshot reads state / slot values by parameter
        slot_names = main.slot_names
        state = {p: st for o in opts for p, st in o.state.items()}

        @staticmethod
        def lean_slot_values(p, slot):
            return next(o for o in opts if p in o.state).lean_slot_values(p, slot)

    return lean_snapshot(named, _Both)


def _fsdp_net() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard

    net = LeanNet()
    fully_shard(net, mesh=mesh_1d())
    return net, dict(net.named_parameters())


def fsdp_case(opt_name: str, mode: str) -> dict:
    precision, state_dtype = MODES[mode]
    net, named = _fsdp_net()
    opt = _optimizer(opt_name)(list(named.items()), precision=precision, state_dtype=state_dtype)
    return _train(named, opt, LEAN_STEPS)


def tp_case(opt_name: str, mode: str) -> dict:
    """Tensor-parallel layouts (hand-made): ``w`` and ``row`` Shard(1) (columns), ``vec`` Shard(0),
    ``bias`` replicated. 8-bit falls back to float32 for the Shard(1) and 1-d sharded parameters."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    precision, state_dtype = MODES[mode]
    mesh = mesh_1d()
    place = {"w": Shard(1), "row": Shard(1), "vec": Shard(0), "bias": Replicate()}
    named = {n: nn.Parameter(distribute_tensor(t, mesh, [place[n]])) for n, t in full_params().items()}
    opt = _optimizer(opt_name)(list(named.items()), precision=precision, state_dtype=state_dtype)
    return _train(named, opt, LEAN_STEPS)


def _dcp_case(opt_name: str, mode: str, workdir: str, full_sd: bool) -> dict:
    """2 steps, ``dcp.save`` of the sharded optimizer state (compact forms), 2 more steps; a fresh optimizer
    on fresh shards ``dcp.load``s it and takes the same 2 steps. Also the full (gathered) state dict, for a
    1-rank optimizer on the whole tensors to load in the parent."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from optkit.distributed import get_optimizer_state_dict, set_optimizer_state_dict

    precision, state_dtype = MODES[mode]
    factory = _optimizer(opt_name)
    net, named = _fsdp_net()
    opt = factory(list(named.items()), precision=precision, state_dtype=state_dtype)
    _train(named, opt, 2)
    sd = {"optim": get_optimizer_state_dict(net, opt)}
    saved_layout = {k: {s: (str(v.dtype), *_layout(v)) for s, v in st.items() if isinstance(v, torch.Tensor)}
                    for k, st in sd["optim"]["state"].items()}
    dcp.save(sd, checkpoint_id=workdir)
    gathered = None
    if full_sd:
        gathered = _plain(get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True)))
    params_at_save = {n: _np(p) for n, p in named.items()}
    cont = _train(named, opt, 2, start=2)

    net2, named2 = _fsdp_net()  # fresh (the initial weights): the weights come from the saved copy
    with torch.no_grad():
        for n, p in named2.items():
            from torch.distributed.tensor import distribute_tensor

            mt.local(p).copy_(mt.local(distribute_tensor(torch.from_numpy(params_at_save[n]).to(p.dtype),
                                                         p.device_mesh, p.placements)))
    opt2 = factory(list(named2.items()), precision=precision, state_dtype=state_dtype)
    loaded = {"optim": get_optimizer_state_dict(net2, opt2)}
    dcp.load(loaded, checkpoint_id=workdir)
    set_optimizer_state_dict(net2, opt2, loaded["optim"])
    resumed = _train(named2, opt2, 2, start=2)
    return {"cont": cont, "resumed": resumed, "saved_layout": saved_layout, "full_sd": gathered,
            "params_at_save": params_at_save}


def _plain(sd: dict) -> dict:
    """A full optimizer state dict as picklable NumPy values (dtype names beside them)."""
    return {"state": {k: {s: _np(v, raw=s == "master_low") if isinstance(v, torch.Tensor) else v
                          for s, v in st.items()}
                      for k, st in sd["state"].items()},
            "dtypes": {k: {s: str(v.dtype) for s, v in st.items() if isinstance(v, torch.Tensor)}
                       for k, st in sd["state"].items()},
            "param_groups": copy.deepcopy(sd["param_groups"])}


def run_lean(rank: int, world: int, workdir: str) -> dict:
    """Every lean scenario on this rank (a fixed order: the collectives must match across ranks)."""
    out: dict[str, Any] = {}
    for mode in MODES:
        for name in ELEMENTWISE + NORMED:
            out[f"fsdp/{name}/{mode}"] = _case_runner(fsdp_case)(name, mode)
    out["tp/adam/split_int8"] = _case_runner(tp_case)("adam", "split_int8")
    out["tp/lars/split_int8"] = _case_runner(tp_case)("lars", "split_int8")
    out["dcp/adam/split_int8"] = _case_runner(_dcp_case)("adam", "split_int8", workdir + "_adam", True)
    out["dcp/adam/kahan_int8"] = _case_runner(_dcp_case)("adam", "kahan_int8", workdir + "_adamk", True)
    out["dcp/sgd/kahan_bf16"] = _case_runner(_dcp_case)("sgd", "kahan_bf16", workdir + "_sgd", True)
    return out
