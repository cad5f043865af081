"""optkit on ``torch.distributed``: checkpointing, mesh checks and gradient averaging.

optkit optimizers run unchanged on ``DTensor`` parameters (FSDP2 ``fully_shard`` or a hand-made
``DeviceMesh`` layout): state is created with ``zeros_like(p)`` so it keeps the parameter's mesh and
placements, kernels run on the local shards, and every whole-tensor reduction (global norm, per-tensor norms,
max-abs, the non-finite flag) is combined across the mesh by ``_multi_tensor`` with one collective per
mesh-dim process group (placements read by meaning: ``Shard`` and ``_StridedShard`` split, ``Partial``
gradients are reduced first). This module adds what a distributed run needs around that:

* :func:`get_optimizer_state_dict` / :func:`set_optimizer_state_dict`: ``torch.distributed.checkpoint``
  (DCP) state dicts for optkit optimizers **and wrappers**. DCP only understands a flat
  ``{"state", "param_groups"}`` optimizer dict keyed by the model's parameter FQNs; an optkit wrapper's
  ``state_dict()`` nests its inner optimizer and adds its own state (loss scale, fp32 masters, ...). The
  adapter hands DCP the innermost optimizer (fp32 masters mapped back to their model parameters) and stores
  the wrappers' own state under the key ``"optkit_wrappers"`` (outermost first), so sharded (DTensor) and
  full state dicts round-trip through ``dcp.save``/``dcp.load``, EMA averages, loss-scale state and masters
  included. The shared ``step`` entry (``iterations``) is saved per parameter, as torch does, and re-shared
  on load.
* :func:`check_mesh`: the ``mesh=`` argument of the optimizers (as in tf.keras's DTensor optimizers,
  ``tf.keras.dtensor.experimental.optimizers``): every parameter must be a DTensor on that mesh or on a
  sub-mesh of it.
* :func:`replicated`: a 0-d scalar (``iterations``, a learning rate, a loss scale) as a DTensor replicated on
  a mesh. optkit keeps such scalars as plain tensors on the mesh's device type; they hold the same value on
  every rank because every skip decision is all-reduced, so this view is exact.
* :func:`all_reduce_gradients_`: bucketed all-reduce (average) of plain, replicated gradients (data parallel
  without DDP, ``optimize_loss(on_horovod=True)``); DTensor gradients are skipped, FSDP2 already reduced them.
* :func:`reduce_partial_grads_`: tensor-parallel ``Partial`` gradients reduced in place (batched) before any
  norm or update.
* :func:`set_pipeline_group` / :func:`pipeline_group`: with pipeline parallelism, every global reduction
  (global norm, overflow flag, ``max|g|``) also runs across the stages, so all stages clip and skip alike.

Full state dicts follow ``torch.distributed.checkpoint.state_dict.StateDictOptions``: with
``full_state_dict=True`` every DTensor of the wrappers' state (fp32 masters, loss-scale state) is gathered
one tensor at a time; with ``cpu_offload=True`` as well only rank 0 keeps the gathered copies (on the CPU) and
the other ranks get torch's empty dict. ``broadcast_from_rank0=True`` on load sends rank 0's wrapper state
tensor by tensor, each cut to the local shard as it arrives, so no rank holds more than one full tensor.
See ``docs/distributed.md`` for the collectives and memory per step at scale.

EMA under FSDP2 needs nothing here: the averages are DTensors sharded like the parameters, updated shard by
shard, and ``finalize_variable_values()`` copies shard into shard without any collective (unlike
``torch.optim.swa_utils.AveragedModel``, whose deep copy fails under FSDP: pytorch/pytorch#149138). Gather
them only when saving with ``full_state_dict=True``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._mesh import check_mesh, replicated

__all__ = [
    "WRAPPERS_KEY",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "check_mesh",
    "replicated",
    "all_reduce_gradients_",
    "reduce_partial_grads_",
    "set_pipeline_group",
    "get_pipeline_group",
    "pipeline_group",
]

reduce_partial_grads_ = mt.reduce_partial_grads_
get_pipeline_group = mt.get_pipeline_group

#: key of the wrappers' own state in a DCP optimizer state dict (outermost wrapper first)
WRAPPERS_KEY = "optkit_wrappers"
#: the key of an optkit optimizer's buffer averages (``ema_buffers``) in a DCP optimizer state dict
EMA_BUFFERS_KEY = "optkit_ema_buffers"


# ----------------------------------------------------------------------------------------------------------
# checkpointing through torch.distributed.checkpoint


def _wrapper_chain(optimizer: torch.optim.Optimizer) -> tuple[list[Any], torch.optim.Optimizer]:
    """(wrappers outermost first, innermost optimizer)."""
    from ._wrapper import OptimizerWrapper

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"`optimizer` must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    chain = []
    while isinstance(optimizer, OptimizerWrapper):
        chain.append(optimizer)
        optimizer = optimizer.optimizer
    return chain, optimizer


class _ModelParamView(torch.optim.Optimizer):
    """The innermost optimizer as DCP must see it: param groups and state keyed by the *model's* parameters.

    A ``MixedPrecisionOptimizerWrapper`` swaps fp32 masters into the inner optimizer; DCP names optimizer
    state by the model's parameter FQNs, so the view maps every master back to its model parameter.
    ``state_dict`` and ``load_state_dict`` are the inner optimizer's (positional: no translation needed).
    """

    def __init__(self, inner: torch.optim.Optimizer, to_model: dict[int, Tensor]) -> None:
        # a view, not a new optimizer: torch.optim.Optimizer.__init__ is deliberately not run
        self._inner = inner
        self.defaults = inner.defaults
        self.param_groups = [{**g, "params": [to_model.get(id(p), p) for p in g["params"]]}
                             for g in inner.param_groups]
        self.state = {to_model.get(id(p), p): st for p, st in inner.state.items()}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self._inner.load_state_dict(state_dict)


def _dcp_view(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[list[Any], Any]:
    """(wrapper chain, the optimizer handed to DCP), checking every parameter belongs to ``model``."""
    chain, inner = _wrapper_chain(optimizer)
    to_model: dict[int, Tensor] = {}
    for w in chain:
        if hasattr(w, "master_params") and hasattr(w, "model_params"):
            to_model.update({id(m): p for p, m in zip(w.model_params, w.master_params)})
    view = _ModelParamView(inner, to_model) if to_model else inner
    known = {id(p) for p in model.parameters()}
    for g in view.param_groups:
        for p in g["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"{type(inner).__name__} holds a parameter that is not one of `model`'s parameters; "
                    "DCP names optimizer state by the model's parameter names"
                )
    return chain, view


def _tree_map(fn, obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree_map(fn, v) for v in obj)
    return fn(obj)


def _gathered(obj: Any, cpu: bool, keep: bool = True) -> Any:
    """Wrapper state with every DTensor gathered to a full tensor (a collective per DTensor, one tensor at a
    time). ``keep=False`` (a rank other than 0 under ``cpu_offload``): take part in the gathers but keep
    nothing, as torch's ``ranks_only=(0,)``."""

    def full(v: Any) -> Any:
        if mt.is_dtensor(v):
            v = v.full_tensor()
            if not keep:
                return None
        return v.cpu() if cpu and isinstance(v, Tensor) else v

    return _tree_map(full, obj)


def _cut(full: Tensor, template: Tensor) -> Tensor:
    """The full tensor ``full`` as a DTensor laid out like ``template``: this rank's shard, copied out so the
    full tensor can be freed (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    dt = distribute_tensor(full.to(mt.local(template).device), template.device_mesh, template.placements,
                           src_data_rank=None)
    return DTensor.from_local(mt.local(dt).clone(), template.device_mesh, template.placements,
                              run_check=False, shape=dt.shape, stride=dt.stride())


def _placed_like(saved: Any, template: Any) -> Any:
    """``saved`` (full tensors) laid out like ``template`` (the wrapper's live state): a full tensor whose
    template is a DTensor becomes a DTensor with that mesh and placements, cut locally (no communication)."""
    if isinstance(saved, dict) and isinstance(template, dict):
        return {k: _placed_like(v, template.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(template, (list, tuple)) \
            and len(saved) == len(template):
        return type(saved)(_placed_like(v, t) for v, t in zip(saved, template))
    if isinstance(saved, Tensor) and not mt.is_dtensor(saved) and mt.is_dtensor(template):
        return _cut(saved, template)
    return saved


class _TensorSlot:
    """Stands for a tensor of rank 0's state while its structure is broadcast (shape and dtype only)."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _broadcast_placed(saved: Any, template: Any) -> Any:
    """Rank 0's ``saved`` wrapper state on every rank, laid out like ``template``: the structure by one
    ``broadcast_object_list`` (no tensor data), then one ``broadcast`` per tensor, each cut to its local shard
    as it arrives (one full tensor at a time in memory)."""
    import torch.distributed as dist

    tensors: list[Tensor] = []

    def strip(v: Any) -> Any:
        if isinstance(v, Tensor):
            tensors.append(v)
            return _TensorSlot(len(tensors) - 1, tuple(v.shape), v.dtype)
        return v

    box = [_tree_map(strip, saved) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    default_dev = (torch.device("cuda", torch.cuda.current_device())
                   if dist.get_backend() == "nccl" else torch.device("cpu"))

    def fill(skel: Any, tmpl: Any) -> Any:
        if isinstance(skel, dict):
            t = tmpl if isinstance(tmpl, dict) else {}
            return {k: fill(v, t.get(k)) for k, v in skel.items()}
        if isinstance(skel, (list, tuple)):
            t = tmpl if isinstance(tmpl, (list, tuple)) and len(tmpl) == len(skel) else [None] * len(skel)
            return type(skel)(fill(v, u) for v, u in zip(skel, t))
        if not isinstance(skel, _TensorSlot):
            return skel
        dev = mt.local(tmpl).device if isinstance(tmpl, Tensor) else default_dev
        if dist.get_rank() == 0:
            buf = tensors[skel.index].to(dev).contiguous()
        else:
            buf = torch.empty(skel.shape, dtype=skel.dtype, device=dev)
        dist.broadcast(buf, src=0)
        return _cut(buf, tmpl) if mt.is_dtensor(tmpl) else buf

    return fill(box[0], template)


def get_optimizer_state_dict(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, options: Any = None
) -> dict[str, Any]:
    """DCP optimizer state dict of ``optimizer`` (an optkit/torch optimizer or a stack of optkit wrappers).

    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` of the innermost optimizer (state
    keyed by the model's parameter FQNs, fp32 masters mapped back to their model parameters; DTensor state
    stays sharded unless ``options.full_state_dict``), plus ``state_dict[WRAPPERS_KEY]``: one
    ``{"type": class name, **own state}`` per wrapper, outermost first (gathered too for full state dicts),
    and ``state_dict[EMA_BUFFERS_KEY]``: the buffer averages of an optimizer built with ``ema_buffers``.
    Pass the result to ``dcp.save`` and, after ``dcp.load``, to :func:`set_optimizer_state_dict`.
    """
    from torch.distributed.checkpoint import state_dict as dsd

    chain, view = _dcp_view(model, optimizer)
    osd = dsd.get_optimizer_state_dict(model, view, options=options)
    parts: dict[str, Any] = {}
    if chain:
        parts[WRAPPERS_KEY] = [{"type": type(w).__name__, **w._own_state()} for w in chain]
    buffers = _ema_buffer_state(_wrapper_chain(optimizer)[1])
    if buffers is not None:  # (torch's state dict keeps only "state" and "param_groups")
        parts[EMA_BUFFERS_KEY] = buffers
    if parts and options is not None and options.full_state_dict:
        import torch.distributed as dist

        # torch: full + cpu_offload keeps the gathered state on rank 0 only (others get {})
        keep = not options.cpu_offload or not dist.is_initialized() or dist.get_rank() == 0
        parts = _gathered(parts, cpu=options.cpu_offload, keep=keep)
        if not keep:
            return osd
    osd.update(parts)
    return osd


def _ema_buffer_state(inner: Any) -> dict[str, Tensor] | None:
    """An optkit optimizer's buffer averages (``ema_buffers``) by name, copied; None without them (and for
    any other optimizer)."""
    engine = getattr(inner, "engine", None)
    return None if engine is None else engine.ema_buffer_state()


def set_optimizer_state_dict(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    *,
    options: Any = None,
) -> None:
    """Load a state dict made by :func:`get_optimizer_state_dict` (possibly through ``dcp.load``).

    The wrappers' part is validated (same wrapper types, outermost first, and each wrapper's own check)
    before anything is loaded, so a mismatched checkpoint raises ``ValueError`` and changes nothing. With
    ``options.broadcast_from_rank0`` the wrappers' part is taken from rank 0.
    """
    from torch.distributed.checkpoint import state_dict as dsd

    if not isinstance(optim_state_dict, dict):
        raise TypeError(f"`optim_state_dict` must be a dict, got {type(optim_state_dict).__name__}")
    chain, view = _dcp_view(model, optimizer)
    inner = _wrapper_chain(optimizer)[1]
    osd = dict(optim_state_dict)
    saved = osd.pop(WRAPPERS_KEY, [])
    saved_buffers = osd.pop(EMA_BUFFERS_KEY, None)
    live_buffers = _ema_buffer_state(inner)
    if live_buffers is not None and options is not None and options.broadcast_from_rank0:
        saved_buffers = _broadcast_placed(saved_buffers, live_buffers)
    elif live_buffers is not None and options is not None and options.full_state_dict:
        saved_buffers = _placed_like(saved_buffers, live_buffers)
    buffer_avgs = None
    if saved_buffers is not None or live_buffers is not None:  # checked before anything is loaded
        buffer_avgs = inner.engine.check_ema_buffers(saved_buffers)
    broadcast = bool(chain and options is not None and options.broadcast_from_rank0)
    if broadcast:
        saved = _broadcast_placed(saved, [{"type": type(w).__name__, **w._own_state()} for w in chain])
    saved_types = [s.get("type") if isinstance(s, dict) else None for s in saved]
    want_types = [type(w).__name__ for w in chain]
    if saved_types != want_types:
        raise ValueError(
            f"`optim_state_dict` holds wrapper state for {saved_types}, but `optimizer` is {want_types} "
            "(outermost first)"
        )
    owns = [{k: v for k, v in s.items() if k != "type"} for s in saved]
    if options is not None and options.full_state_dict and not broadcast:
        owns = [_placed_like(own, w._own_state()) for own, w in zip(owns, chain)]
    for w, own in zip(chain, owns):
        w._check_own_state(own)
    dsd.set_optimizer_state_dict(model, view, osd, options=options)
    if buffer_avgs is not None:
        inner.engine.load_ema_buffers(buffer_avgs)
    for w, own in zip(chain, owns):
        w._load_own_state(own)


# ----------------------------------------------------------------------------------------------------------
# data-parallel gradient averaging


def all_reduce_gradients_(
    grads: Sequence[Tensor | None],
    group: Any = None,
    *,
    average: bool = True,
    bucket_numel: int = 1 << 22,
) -> int:
    """All-reduce plain gradients in place over ``group`` (default: the world), averaged unless ``average``
    is False; returns the number of collectives issued.

    Dense gradients are packed per (device, dtype) into flat buckets of about ``bucket_numel`` elements, so
    a step costs a few collectives, not one per tensor (like DDP's buckets). ``None`` entries and DTensor
    gradients (already reduced by FSDP2 / their mesh) are skipped; sparse gradients are not supported
    (``TypeError``). Averaging divides by the group size after the sum.
    """
    import torch.distributed as dist

    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"`bucket_numel` must be a positive int, got {bucket_numel!r}")
    plain = [g for g in mt.present(grads) if not mt.is_dtensor(g)]
    for g in plain:
        if g.is_sparse:
            raise TypeError("all_reduce_gradients_: sparse gradients are not supported")
    if not plain:
        return 0
    size = dist.get_world_size(group)
    calls = 0
    for _, (_, (ts,)) in mt.group_by_device_dtype(plain).items():
        for bucket in _buckets(ts, bucket_numel):
            flat = torch.cat([t.reshape(-1) for t in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            calls += 1
            if average:
                flat.div_(size)
            if len(bucket) > 1 or flat.data_ptr() != bucket[0].data_ptr():
                parts = torch.split(flat, [t.numel() for t in bucket])
                torch._foreach_copy_(bucket, [v.view(t.shape) for v, t in zip(parts, bucket)])
    return calls


def _buckets(ts: list[Tensor], bucket_numel: int) -> list[list[Tensor]]:
    out: list[list[Tensor]] = []
    cur: list[Tensor] = []
    n = 0
    for t in ts:
        if cur and n + t.numel() > bucket_numel:
            out.append(cur)
            cur, n = [], 0
        cur.append(t)
        n += t.numel()
    if cur:
        out.append(cur)
    return out


# ----------------------------------------------------------------------------------------------------------
# pipeline parallelism


def set_pipeline_group(group: Any) -> Any:
    """Reduce every global quantity (global norm and ``global_clipnorm``, overflow flags, LogMax's
    ``max|g|``) across ``group`` too: the process group joining the ranks that hold the same position in each
    pipeline stage. ``None`` turns it off; returns the previous setting. Per-tensor norms (``clipnorm``,
    LARS/LARC trust ratios, variable clipping) stay within a stage. Every stage must then run the same
    sequence of optimizer steps (SPMD), stages without gradients included.
    ``optimize_loss(pipeline_group=...)`` sets it for one train op only.
    """
    return mt.set_pipeline_group(group)


@contextlib.contextmanager
def pipeline_group(group: Any) -> Iterator[None]:
    """``with pipeline_group(pp):`` :func:`set_pipeline_group` for the block, restored afterwards."""
    prior = mt.set_pipeline_group(group)
    try:
        yield
    finally:
        mt.set_pipeline_group(prior)
