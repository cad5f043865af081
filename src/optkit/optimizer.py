"""The Keras-style optimizer base: a ``torch.optim.Optimizer`` with the TF surface on top.

Every optkit optimizer derives from :class:`Optimizer` and writes only its update rule over grouped tensor
lists (:meth:`Optimizer._update`). The base runs the Keras 3 pipeline (``spec/tf_keras.md`` §4.1) once per
``step()``, with optkit's own rules where DESIGN §1 says so:

1. gradients: ``None`` skipped; sparse COO densified (unless the optimizer has a sparse rule);
2. unscale by ``grad_scale`` (set by a loss-scale wrapper or ``torch.amp.GradScaler``);
3. clip: ``clipvalue`` (elementwise), ``clipnorm`` (each tensor: g·c/max(‖g‖, c)) or ``global_clipnorm``
   (g·c/max(N, c), all NaN for a non-finite N) — mutually exclusive;
4. decoupled weight decay ``w ← w − w·wd·lr`` on the parameters not excluded;
5. the optimizer's update rule with the current learning rate;
6. EMA ``avg ← μ·avg + (1−μ)·w`` over all parameters (the first applied step copies ``w``), and the optional
   overwrite ``w ← avg`` every ``ema_overwrite_frequency`` applied steps;
7. ``iterations += 1``.

When ``found_inf`` (a 0-d tensor, 1.0 = skip) is set by a wrapper, the whole pipeline is a no-op on device
(no host sync): the fused kernels take ``found_inf``, and every other factor is blended with it, so a skipped
step changes no parameter, slot, average or counter. ``step_applied`` holds the outcome as a 0-d bool tensor.

Performance: unscaling and global clipping fold into the optimizer's fused kernel as one scalar factor, so the
only extra traffic is one read-only norm pass; weight decay, the update and the EMA run block by block over
cache-sized chunks (``_multi_tensor.blocks``) so their chain costs about one sweep over memory.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt

__all__ = ["Optimizer"]


# ------------------------------------------------------------------------------------------------------------
# argument checks (raise before any state is touched)


def _is_number(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    allow_none: bool = False,
    integer: bool = False,
) -> None:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``value`` is a number in range."""
    if value is None and allow_none:
        return
    if integer:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"`{name}` must be an int, got {value!r} ({type(value).__name__})")
    elif not _is_number(value):
        raise TypeError(f"`{name}` must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)  # type: ignore[arg-type]
    if math.isnan(v):
        raise ValueError(f"`{name}` must not be NaN")
    if low is not None and (v < low or (low_open and v == low)):
        op = ">" if low_open else ">="
        raise ValueError(f"`{name}` must be {op} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"`{name}` must be <= {high}, got {value!r}")


def _is_schedule(lr: object) -> bool:
    try:
        from .schedules import LearningRateSchedule
    except Exception:  # pragma: no cover - schedules module unavailable
        return False
    return isinstance(lr, LearningRateSchedule)


def _callable_arity(fn: Callable) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return 0
    required = [
        p
        for p in sig.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(required)


def autograd_pairs(
    loss: Tensor | Callable[[], Tensor], vs: list[Tensor]
) -> list[tuple[Tensor | None, Tensor]]:
    """``(dloss/dv, v)`` for each ``v`` in ``vs`` (``None`` where unused); ``loss`` is a scalar tensor or a
    zero-argument callable returning one (TF's ``compute_gradients``). Shared by optimizers and wrappers."""
    if not vs:
        raise ValueError("`var_list` is empty")
    with torch.enable_grad():
        value = loss() if callable(loss) else loss
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise ValueError("`loss` must be (or return) a scalar tensor")
    grads = torch.autograd.grad(value, vs, allow_unused=True)
    return list(zip(grads, vs))


def _normalize_param_groups(params: Any) -> list[dict]:
    """Accept tensors, ``named_parameters()`` pairs, or param-group dicts; return groups with names."""
    if isinstance(params, Tensor):
        raise TypeError(
            "`params` must be an iterable of tensors, (name, tensor) pairs or param-group dicts, "
            "got a single Tensor"
        )
    items = list(params)
    if not items:
        raise ValueError("`params` is empty: the optimizer got no parameters")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    counter = 0
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError("every param group must be a dict with a 'params' entry")
        ps = g["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        given = g.get("param_names")
        tensors, names = [], []
        for j, item in enumerate(ps):
            if isinstance(item, tuple):
                if len(item) != 2 or not isinstance(item[1], Tensor):
                    raise TypeError(f"named parameters must be (str, Tensor) pairs, got {item!r}")
                name, t = item
            elif isinstance(item, Tensor):
                name, t = (given[j] if given is not None else None), item
            else:
                raise TypeError(f"`params` entries must be Tensors, got {type(item).__name__}")
            if not t.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor")
            tensors.append(t)
            names.append(str(name) if name is not None else f"param_{counter}")
            counter += 1
        g["params"] = tensors
        g["param_names"] = names
    return groups


# ------------------------------------------------------------------------------------------------------------


def _data_ptrs(params: list[Tensor], dtensor: bool) -> list[int]:
    return [mt.local(p).data_ptr() for p in params] if dtensor else [p.data_ptr() for p in params]


class _Block:
    """One block of the dense pass: owner indices, the chunks of params/slots/averages (static views), how to
    cut each owner's gradient (``split[j]`` = (start, stop) of the flat gradient, or None for the whole
    tensor; ``split`` None when nothing is cut) and the block's (device, dtype) when homogeneous."""

    __slots__ = ("owners", "params", "slots", "averages", "split", "key", "identity", "all_wd", "avg_same")


class _Plan:
    """Per-group structure of the dense pass, cached across steps: names, slot lists, weight-decay mask and
    the cache-sized blocks. Building it costs Python work per parameter; reusing it costs O(1) per step plus
    one check per chunked gradient."""

    def __init__(self, opt: Optimizer, group: dict, idx, params, grads, blocked: bool, key) -> None:
        self.key = key
        self.names = [group["param_names"][i] for i in idx]
        st = opt.state
        self.slots = {s: [st[p][s] for p in params] for s in opt.slot_names}
        self.averages = [st[p]["average"] for p in params] if opt.use_ema else None
        self.use_wd = [opt._use_weight_decay(p, n) for p, n in zip(params, self.names)]
        self.any_wd = any(self.use_wd)
        self.any_dtensor = any(mt.is_dtensor(t) for t in params) or any(mt.is_dtensor(g) for g in grads)
        self._ptrs = _data_ptrs(params, self.any_dtensor)
        loc = mt.local
        slot_keys = list(opt.slot_names)
        lists = [[loc(p) for p in params], [loc(g) for g in grads]]
        lists += [[loc(t) for t in self.slots[s]] for s in slot_keys]
        if self.averages is not None:
            lists.append([loc(a) for a in self.averages])
        on_cpu = lists[0][0].device.type == "cpu"
        if blocked and on_cpu:
            raw = mt.blocks(lists, opt.block_numel)
        else:
            raw = [(list(range(len(params))), tuple(lists))]
        self.blocks = []
        self._split_owners: list[tuple[int, torch.Size]] = []
        n = len(params)
        for owners, chunk_lists in raw:
            b = _Block()
            b.owners = owners
            b.params = chunk_lists[0]
            b.slots = {s: chunk_lists[2 + j] for j, s in enumerate(slot_keys)}
            b.averages = chunk_lists[-1] if self.averages is not None else None
            split = []
            for o, chunk in zip(owners, chunk_lists[1]):
                g = lists[1][o]
                if chunk.numel() == g.numel() and chunk.data_ptr() == g.data_ptr():
                    split.append(None)
                else:
                    start = chunk.storage_offset() - g.storage_offset()
                    split.append((start, start + chunk.numel()))
                    self._split_owners.append((o, g.shape))
            b.split = None if all(r is None for r in split) else split
            kinds = {(t.device, t.dtype) for t in b.params}
            b.key = next(iter(kinds)) if len(kinds) == 1 else None
            b.identity = len(owners) == n and owners == list(range(n))
            b.all_wd = all(self.use_wd[o] for o in owners)
            b.avg_same = b.averages is not None and all(
                a.dtype == p.dtype for a, p in zip(b.averages, b.params))
            self.blocks.append(b)
        self._split_owners = list(dict(self._split_owners).items())

    def params_fit(self, params: list[Tensor]) -> bool:
        """Whether the parameters still live where the plan's chunk views point (``p.data = ...`` or a move
        to another device replaces the storage)."""
        return self._ptrs == _data_ptrs(params, self.any_dtensor)

    def grads_fit(self, grads: list[Tensor]) -> bool:
        """Whether this step's gradients can be cut like the plan's (contiguous, same shape)."""
        for o, shape in self._split_owners:
            g = mt.local(grads[o])
            if not g.is_contiguous() or g.shape != shape:
                return False
        return True


class Optimizer(torch.optim.Optimizer):
    """Base class of optkit optimizers (Keras 3 semantics on a ``torch.optim.Optimizer``).

    Args:
        params: tensors, ``model.named_parameters()`` or param-group dicts. Names are used by
            :meth:`exclude_from_weight_decay` and by name-based options such as LARS ``skip_list``.
        learning_rate: a number, a :class:`~optkit.schedules.LearningRateSchedule` (called with
            ``iterations``, the count of applied updates) or a callable (zero arguments, or one: the step).
        weight_decay: decoupled decay, ``w ← w − w·weight_decay·lr`` before the update (Keras form).
        clipnorm / clipvalue / global_clipnorm: gradient clipping; at most one may be set.
        use_ema, ema_momentum, ema_overwrite_frequency: exponential moving average of the weights
            (Keras 3: the first applied step copies the weights; ``finalize_variable_values()`` swaps in).
        jit_compile: compile the grouped update with ``torch.compile`` (falls back to eager with a warning).
        mesh: a ``DeviceMesh`` all DTensor parameters must live on (scalar state is kept on its device type).
        name: the optimizer's name (defaults to the class name).
        amsgrad: accepted and ignored, as in the seed.

    Subclasses set ``slot_names`` and implement :meth:`_update` (and optionally :meth:`_prepare`).
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler may pass grad_scale / found_inf
    slot_names: tuple[str, ...] = ()
    #: whether the group key ``weight_decay`` means Keras decoupled decay (LARS uses it for its own rule)
    _decoupled_weight_decay = True
    #: whether _update is purely elementwise given per-tensor aux values (may run on chunk views)
    _blockable = True
    #: run the blocked pass even for a one-kernel chain (update rules made of several in-cache kernels)
    _always_block = False
    #: whether the optimizer has its own rule for sparse gradients (:meth:`_sparse_update`)
    _sparse_rule = False

    def __init__(
        self,
        params: Any,
        learning_rate: float | Callable | Tensor = 0.01,
        *,
        weight_decay: float | None = None,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
        use_ema: bool = False,
        ema_momentum: float = 0.99,
        ema_overwrite_frequency: int | None = None,
        jit_compile: bool = False,
        mesh: Any = None,
        name: str | None = None,
        amsgrad: bool = False,
        block_numel: int = 1 << 20,
        **hyper: Any,
    ) -> None:
        # ---- validation first: nothing is created if an argument is bad
        lr_value = self._validate_learning_rate(learning_rate)
        check_number("weight_decay", weight_decay, low=0.0, allow_none=True)
        check_number("clipnorm", clipnorm, low=0.0, low_open=True, allow_none=True)
        check_number("clipvalue", clipvalue, low=0.0, low_open=True, allow_none=True)
        check_number("global_clipnorm", global_clipnorm, low=0.0, low_open=True, allow_none=True)
        set_clips = [n for n, v in (("clipnorm", clipnorm), ("clipvalue", clipvalue),
                                    ("global_clipnorm", global_clipnorm)) if v is not None]
        if len(set_clips) > 1:
            raise ValueError(
                f"Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set, got {set_clips}"
            )
        if not isinstance(use_ema, bool):
            raise TypeError(f"`use_ema` must be a bool, got {use_ema!r}")
        check_number("ema_momentum", ema_momentum, low=0.0, high=1.0)
        if ema_overwrite_frequency is not None:
            check_number("ema_overwrite_frequency", ema_overwrite_frequency, low=1, integer=True)
        if not isinstance(jit_compile, bool):
            raise TypeError(f"`jit_compile` must be a bool, got {jit_compile!r}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"`name` must be a str, got {name!r}")
        check_number("block_numel", block_numel, low=1, integer=True)
        declared = set(inspect.signature(type(self).__init__).parameters)
        unknown = sorted(k for k in hyper if k not in declared)
        if unknown:  # a typo such as LARS(eta=...) must not train silently with the default
            raise ValueError(f"{type(self).__name__}: argument(s) not recognized: {unknown}")
        groups = _normalize_param_groups(params)
        if mesh is not None:
            self._check_mesh(mesh, groups)

        self.name = name or type(self).__name__
        self.clipnorm = clipnorm
        self.clipvalue = clipvalue
        self.global_clipnorm = global_clipnorm
        self.use_ema = use_ema
        self.ema_momentum = float(ema_momentum)
        self.ema_overwrite_frequency = ema_overwrite_frequency
        self.jit_compile = jit_compile
        self.mesh = mesh
        self.amsgrad = amsgrad
        self.block_numel = int(block_numel)
        self._learning_rate = learning_rate if lr_value is None else lr_value
        self._wd_exclude_ids: set[int] = set()
        self._wd_exclude_regex: re.Pattern | None = None
        self._extra_variables: list[Tensor] = []
        self._compile_state = "untried"  # "ok" once a compiled step ran, "failed" after a fallback
        self._plans: dict[int, _Plan] = {}  # id(group) -> cached structure of the dense pass
        self._plan_version = 0
        self._fp64_cache: dict[int, tuple] = {}
        self._block_key: tuple | None = None
        self._host_iterations = 0  # exact while no found_inf was ever given
        self._host_exact = True

        first = groups[0]["params"][0]
        self._state_device = mt.local(first).device
        self._iterations = torch.zeros((), dtype=torch.int64, device=self._state_device)
        self.step_applied = torch.ones((), dtype=torch.bool, device=self._state_device)

        initial_lr = lr_value if lr_value is not None else self._evaluate_lr_host(0)
        defaults = dict(lr=initial_lr, weight_decay=0.0 if weight_decay is None else float(weight_decay))
        defaults.update(hyper)
        self._weight_decay_arg = weight_decay
        super().__init__(groups, defaults)

    # ------------------------------------------------------------------------------------------------ set-up

    @staticmethod
    def _validate_learning_rate(lr: Any) -> float | None:
        if _is_schedule(lr) or (callable(lr) and not isinstance(lr, Tensor)):
            return None
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError(f"`learning_rate` tensor must have one element, got shape {tuple(lr.shape)}")
            lr = float(lr.detach().cpu())
        if not _is_number(lr):
            raise TypeError(
                "`learning_rate` must be a number, a LearningRateSchedule or a callable, "
                f"got {lr!r} ({type(lr).__name__})"
            )
        check_number("learning_rate", lr, low=0.0)
        return float(lr)

    @staticmethod
    def _check_mesh(mesh: Any, groups: list[dict]) -> None:
        """Every parameter must be a DTensor on ``mesh`` or a sub-mesh of it
        (``optkit.distributed.check_mesh``)."""
        from .distributed import check_mesh

        check_mesh(((n, p) for g in groups for n, p in zip(g["param_names"], g["params"])), mesh)

    def add_param_group(self, param_group: dict) -> None:
        """Add a param group (torch API); its parameters get their optimizer state right away."""
        if "param_names" not in param_group:
            (param_group,) = _normalize_param_groups([param_group])
        super().add_param_group(param_group)
        self._invalidate_plans()
        self._build_group(self.param_groups[-1])

    def _build_group(self, group: dict) -> None:
        for p in group["params"]:
            self._init_state(p, group)

    def _init_state(self, p: Tensor, group: dict) -> None:
        st = self.state[p]
        st["step"] = self._iterations
        for slot in self.slot_names:
            if slot not in st:
                st[slot] = self._make_slot(p, slot, group)
        if self.use_ema and "average" not in st:
            st["average"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _make_slot(self, p: Tensor, slot: str, group: dict) -> Tensor:
        """Create one slot for ``p`` (zeros with the parameter's placement). Subclasses may override."""
        return torch.zeros_like(p, memory_format=torch.preserve_format)

    def build(self, var_list: Iterable[Tensor] | None = None) -> None:
        """Create missing optimizer state for ``var_list`` (default: every parameter). Idempotent.

        optkit builds state at construction so a skipped first step creates nothing (DESIGN §1.4); this exists
        for the seed's API and for parameters whose state was removed.
        """
        known = {id(p): g for g in self.param_groups for p in g["params"]}
        vs = [p for g in self.param_groups for p in g["params"]] if var_list is None else list(var_list)
        for v in vs:
            if id(v) not in known:
                raise ValueError("build(): variable is not one of the optimizer's parameters")
            self._init_state(v, known[id(v)])
        self._invalidate_plans()

    def add_variable(
        self,
        shape: Sequence[int] | int = (),
        dtype: torch.dtype | None = None,
        initializer: str | Callable = "zeros",
        name: str | None = None,
    ) -> Tensor:
        """Create an extra optimizer variable (kept in :meth:`variables`); ``initializer`` is
        ``"zeros"``, ``"ones"`` or a callable ``(shape, dtype) -> Tensor``."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = dtype or torch.get_default_dtype()
        if initializer == "zeros":
            v = torch.zeros(shape, dtype=dtype, device=self._state_device)
        elif initializer == "ones":
            v = torch.ones(shape, dtype=dtype, device=self._state_device)
        elif callable(initializer):
            v = torch.as_tensor(initializer(shape, dtype), dtype=dtype, device=self._state_device)
        else:
            raise ValueError(f"`initializer` must be 'zeros', 'ones' or a callable, got {initializer!r}")
        v._optkit_name = name  # type: ignore[attr-defined]
        self._extra_variables.append(v)
        return v

    # ------------------------------------------------------------------------------------------------ lr

    @property
    def learning_rate(self) -> float | Callable:
        """The learning rate as given: a number, a schedule or a callable."""
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value: Any) -> None:
        lr = self._validate_learning_rate(value)
        self._learning_rate = value if lr is None else lr
        if lr is not None:
            for g in self.param_groups:
                g["lr"] = lr

    def _evaluate_lr_host(self, step: int) -> float:
        fn = self._learning_rate
        v = fn(step) if (_is_schedule(fn) or _callable_arity(fn) >= 1) else fn()
        return float(v)

    def _current_lr(self, group: dict) -> Tensor:
        """The learning rate of this step as a 0-d fp32 tensor on the state device (fp64 when the group holds
        fp64 parameters)."""
        fn = self._learning_rate
        if isinstance(fn, float):
            lr = group["lr"]
        elif _is_schedule(fn) or _callable_arity(fn) >= 1:
            lr = fn(self._iterations)
            group["lr"] = lr
        else:
            lr = fn()
            group["lr"] = lr
        dtype = torch.float64 if self._has_fp64(group) else torch.float32
        if isinstance(lr, Tensor):
            return lr.detach().to(device=self._state_device, dtype=dtype).reshape(())
        return torch.tensor(float(lr), dtype=dtype, device=self._state_device)

    def _has_fp64(self, group: dict) -> bool:
        """Whether ``group`` holds float64 parameters (they get float64 hyperparameters); cached per group
        until the plans are invalidated."""
        key = (self._plan_version, len(group["params"]))
        hit = self._fp64_cache.get(id(group))
        if hit is not None and hit[0] == key:
            return hit[1]
        value = self._state_device.type in ("cpu", "cuda") and any(
            mt.local(p).dtype == torch.float64 for p in group["params"]
        )
        self._fp64_cache[id(group)] = (key, value)
        return value

    @property
    def iterations(self) -> Tensor:
        """Number of applied updates (0-d int64 tensor; skipped steps do not count)."""
        return self._iterations

    # ------------------------------------------------------------------------------------------------ decay

    def exclude_from_weight_decay(
        self, var_list: Iterable[Tensor] | None = None, var_names: Iterable[str] | None = None
    ) -> None:
        """Exclude parameters from decoupled weight decay: ``var_list`` by identity, ``var_names`` as regexes
        searched (``re.search``) in each parameter's name (from ``named_parameters()``)."""
        if var_list is not None:
            vl = list(var_list)
            if not all(isinstance(v, Tensor) for v in vl):
                raise TypeError("`var_list` must contain Tensors")
            self._wd_exclude_ids.update(id(v) for v in vl)
            self._invalidate_plans()
        if var_names is not None:
            if isinstance(var_names, str):
                raise TypeError("`var_names` must be a list of strings, not a single string")
            names = sorted(set(var_names))
            if not all(isinstance(n, str) for n in names):
                raise TypeError("`var_names` must contain strings")
            if names:
                pattern = "|".join(names)
                if self._wd_exclude_regex is not None:
                    pattern = self._wd_exclude_regex.pattern + "|" + pattern
                self._wd_exclude_regex = re.compile(pattern)
                self._invalidate_plans()

    def _use_weight_decay(self, p: Tensor, name: str) -> bool:
        if id(p) in self._wd_exclude_ids:
            return False
        if self._wd_exclude_regex is not None and self._wd_exclude_regex.search(name):
            return False
        return True

    # ------------------------------------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update over every parameter with a gradient; returns the closure's loss (torch semantics).

        ``grad_scale`` / ``found_inf`` attributes (set by a loss-scale wrapper or ``torch.amp.GradScaler``)
        are honoured: gradients are divided by ``grad_scale`` and the step is a no-op when ``found_inf`` is 1.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        multipliers = getattr(self, "grad_multipliers", None)
        self._apply(grad_scale, found_inf, multipliers)
        return loss

    def _gather(self, group: dict) -> tuple[list[int], list[Tensor], list[Tensor]]:
        idx, params, grads = [], [], []
        for i, p in enumerate(group["params"]):
            g = p.grad
            if g is not None:
                idx.append(i)
                params.append(p)
                grads.append(g)
        return idx, params, grads

    def _apply(
        self, grad_scale: Tensor | None, found_inf: Tensor | None, multipliers: dict | None = None
    ) -> None:
        """The pipeline. ``multipliers`` maps ``id(param)`` to a 0-d tensor that multiplies that parameter's
        gradient before clipping (used by wrappers such as LARC to fold a per-tensor factor into the blocked
        pass instead of a separate sweep)."""
        dev = self._state_device
        gathered = [self._gather(g) for g in self.param_groups]
        all_grads = [g for _, _, gs in gathered for g in gs]
        if found_inf is not None:
            found_inf = found_inf.detach().to(device=dev, dtype=torch.float32).reshape(())
            self._host_exact = False
        if not all_grads:
            self.step_applied = torch.zeros((), dtype=torch.bool, device=dev)
            return

        # dense fallback for sparse gradients (subclasses with a sparse rule handle them in _sparse_update)
        sparse_handled = self._handle_sparse(gathered, found_inf)

        inv = None
        if grad_scale is not None:
            inv = torch.reciprocal(grad_scale.detach().to(device=dev, dtype=torch.float32).reshape(()))
        k = inv  # factor applied to raw gradients (unscale and global clip), folded into the kernels

        dense_grads = [g for (_, _, gs) in gathered for g in gs]
        if self.clipvalue is not None:
            if inv is not None:
                mt.scale_(dense_grads, inv)
                k = None
            mt.clamp_(dense_grads, -self.clipvalue, self.clipvalue)
        elif self.clipnorm is not None:
            ns = mt.norms(dense_grads)
            if len({(x.device, x.dtype) for x in ns}) > 1:
                n_all = torch.stack([x.to(device=dev, dtype=torch.float64) for x in ns])
            else:
                n_all = torch.stack(ns).to(device=dev)
            c = self.clipnorm
            n_true = n_all if inv is None else n_all * inv
            coef = c / torch.clamp(n_true, min=c)  # g·c/max(‖g‖, c), per tensor
            if inv is not None:
                coef = coef * inv
            mt.scale_(dense_grads, list(coef.unbind()))
            k = None
        elif self.global_clipnorm is not None:
            n = mt.global_norm(dense_grads).to(device=dev)  # fp32, or fp64 for fp64 gradients
            if inv is not None:
                n = n * inv
            c = self.global_clipnorm
            coef = c / torch.clamp(n, min=c) + (n - n)  # non-finite norm -> NaN everywhere (Keras)
            k = coef if k is None else k * coef

        applied = None if found_inf is None else (1.0 - found_inf)
        for group, (idx, params, grads) in zip(self.param_groups, gathered):
            if not params:
                if self.use_ema:
                    self._ema_group(group, list(range(len(group["params"]))), applied)
                continue
            lr = self._current_lr(group)
            mult = None if multipliers is None else [multipliers.get(id(p)) for p in params]
            self._run_group(group, idx, params, grads, lr, k, found_inf, applied, sparse_handled, mult)

        self._after_update(found_inf, applied)

    def _handle_sparse(self, gathered, found_inf) -> set[int]:
        """Prepare sparse COO gradients before clipping.

        Default (the dense fallback): densify, which sums duplicate indices. Optimizers with a sparse rule
        (``_sparse_rule = True``) get their sparse gradients coalesced instead (duplicates summed, as TF1
        de-duplicates ``IndexedSlices``); those stay sparse through unscaling and clipping and are updated by
        :meth:`_sparse_update`. Returns the ids of the parameters handled by the sparse rule.
        """
        handled: set[int] = set()
        for _, params, grads in gathered:
            for j, g in enumerate(grads):
                if g.is_sparse:
                    if self._sparse_rule:
                        grads[j] = g.coalesce()
                        handled.add(id(params[j]))
                    else:
                        grads[j] = g.to_dense()
        return handled

    def _sparse_update(self, group, params, grads, slots, lr, k, found_inf) -> None:
        """The update rule for coalesced sparse gradients (only called when ``_sparse_rule`` is True)."""
        raise TypeError(f"{type(self).__name__} sets _sparse_rule but does not implement _sparse_update()")

    def _run_group(
        self, group, idx, params, grads, lr, k, found_inf, applied, sparse_handled, mult=None
    ) -> None:
        if mult is not None and all(m is None for m in mult):
            mult = None
        if sparse_handled and any(id(p) in sparse_handled for p in params):
            sp = [j for j, p in enumerate(params) if id(p) in sparse_handled]
            sp_grads = [grads[j] for j in sp]
            if mult is not None:
                sel = [(sp_grads[n], mult[j]) for n, j in enumerate(sp) if mult[j] is not None]
                if sel:
                    mt.scale_([t for t, _ in sel], [m for _, m in sel])
            sp_params = [params[j] for j in sp]
            self._sparse_update(group, sp_params, sp_grads,
                                {s: [self.state[p][s] for p in sp_params] for s in self.slot_names},
                                lr, k, found_inf)
            keep = [j for j, p in enumerate(params) if id(p) not in sparse_handled]
            idx, params, grads = [idx[j] for j in keep], [params[j] for j in keep], [grads[j] for j in keep]
            mult = None if mult is None else [mult[j] for j in keep]
            if not params:
                if self.use_ema:
                    self._ema_group(group, list(range(len(group["params"]))), applied)
                return
        wd = group.get("weight_decay", 0.0) if self._decoupled_weight_decay else 0.0
        blocked = self._blockable and (
            self._always_block or bool(wd) or self.use_ema or mult is not None
        )
        plan = self._plan_for(group, idx, params, grads, blocked)
        names, slots = plan.names, plan.slots
        if mult is not None and type(self)._prepare is not Optimizer._prepare:
            # _prepare reads whole-tensor quantities (norms): it must see the multiplied gradients
            sel = [(g, m) for g, m in zip(grads, mult) if m is not None]
            mt.scale_([g for g, _ in sel], [m for _, m in sel])
            mult = None
        aux = self._prepare(group, names, params, grads, slots, lr, k)

        decay_mask = plan.use_wd if (wd and plan.any_wd) else None

        if self.jit_compile and self._compile_state != "failed":
            if self._run_compiled(group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                                  mult, aux):
                return

        # decoupled weight decay factor, 1 − lr·wd (1 on a skipped step)
        decay = None
        if decay_mask is not None:
            decay = 1.0 - lr * wd if applied is None else 1.0 - lr * wd * applied
        ema_w = self._ema_weight(applied) if self.use_ema else None

        glocal = grads if not plan.any_dtensor else [mt.local(g) for g in grads]
        for blk in plan.blocks:
            owners, bp, bslots, bavg = blk.owners, blk.params, blk.slots, blk.averages
            if blk.split is None:
                bg = [glocal[o] for o in owners]
            else:
                bg = [glocal[o] if rng is None else glocal[o].view(-1)[rng[0]:rng[1]]
                      for o, rng in zip(owners, blk.split)]
            if mult is not None:
                sel = [(t, mult[o]) for t, o in zip(bg, owners) if mult[o] is not None]
                if sel:
                    mt.scale_([t for t, _ in sel], [m for _, m in sel])
            if decay is not None:
                dp = bp if blk.all_wd else [t for t, o in zip(bp, owners) if plan.use_wd[o]]
                if dp:
                    mt.scale_local_(dp, decay, blk.key)
            baux = None if aux is None else (aux if blk.identity else [aux[o] for o in owners])
            self._block_key = blk.key
            try:
                self._update(group, bp, bg, bslots, lr, k, found_inf, baux)
            finally:
                self._block_key = None
            if ema_w is not None:
                mt.lerp_local_(bavg, bp, ema_w, blk.key if blk.avg_same else None)

        if self.use_ema:
            self._ema_rest(group, idx, applied)

    def _plan_for(self, group: dict, idx: list[int], params: list[Tensor], grads: list[Tensor],
                  blocked: bool) -> _Plan:
        """The cached :class:`_Plan` of this group for this set of parameters with gradients (rebuilt when
        the set, the optimizer state or the exclusions change, or a gradient no longer fits a chunking)."""
        key = (tuple(idx), self._plan_version, blocked, self.block_numel)
        plan = self._plans.get(id(group))
        if plan is not None and plan.key == key and plan.grads_fit(grads) and plan.params_fit(params):
            return plan
        plan = _Plan(self, group, idx, params, grads, blocked, key)
        self._plans[id(group)] = plan
        return plan

    def _invalidate_plans(self) -> None:
        self._plan_version += 1
        self._plans.clear()

    def _by_device_dtype(self, *lists: Sequence[Tensor]) -> dict:
        """``_multi_tensor.group_by_device_dtype`` with a fast path: inside the base's blocked pass the
        block's (device, dtype) is known when it is homogeneous, and the lists come back as they are."""
        key = self._block_key
        if key is not None:
            return {key: (list(range(len(lists[0]))), tuple(lists))}
        return mt.group_by_device_dtype(*lists)

    def _ema_rest(self, group: dict, idx: list[int], applied: Tensor | None) -> None:
        """EMA over the group's parameters that took no part in this step's dense pass (Keras averages every
        variable, with or without a gradient)."""
        have = set(idx)
        rest = [i for i in range(len(group["params"])) if i not in have]
        if rest:
            self._ema_group(group, rest, applied)

    # ------------------------------------------------------------------------------------------------ jit

    def _pointwise_hyper(self, group: dict) -> tuple:
        """The group's static hyperparameters for :meth:`_pointwise` (Python constants; compile guards)."""
        return ()

    #: the update rule as out-of-place pointwise math for ``jit_compile`` (a staticmethod
    #: ``(hyper, w, g, slots, lr, k, aux) -> (new_w, new_slots)``; ``g`` is the raw gradient, the true
    #: gradient is ``k·g``); None means the optimizer has no compilable form and runs eagerly.
    _pointwise: Callable | None = None

    def _run_compiled(self, group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                      mult, aux) -> bool:
        """Run decay → update → EMA of one group as one ``torch.compile``-d function. Hyperparameters that
        change during training (learning rate, clip/unscale factor, skip flag, EMA weight) are tensor inputs,
        so they never trigger a recompile. Returns False (after a RuntimeWarning) if compilation fails."""
        rule = type(self)._pointwise
        if rule is None:
            self._compile_state = "failed"
            _warn_compile_fallback(TypeError(f"{type(self).__name__} has no pointwise update rule"))
            return False
        fn = _compiled_chain()
        if fn is None:
            self._compile_state = "failed"
            _warn_compile_fallback(RuntimeError("torch.compile is not available"))
            return False
        loc = mt.local
        slot_lists = tuple([loc(t) for t in slots[s]] for s in self.slot_names)
        avgs = [loc(self.state[p]["average"]) for p in params] if self.use_ema else None
        dev = loc(params[0]).device
        ema_w = self._ema_weight(None).to(dev) if self.use_ema else None
        wd_t = None if decay_mask is None else torch.tensor(float(wd), dtype=torch.float32, device=dev)
        try:
            fn(rule, self._pointwise_hyper(group), [loc(p) for p in params], [loc(g) for g in grads],
               slot_lists, avgs, lr.to(dev), None if k is None else k.to(dev), wd_t,
               None if decay_mask is None else tuple(decay_mask), ema_w,
               None if found_inf is None else found_inf.to(dev),
               None if mult is None else tuple(mult), aux)
        except Exception as err:  # compilation unavailable or failed: eager from now on
            self._compile_state = "failed"
            _warn_compile_fallback(err)
            return False
        self._compile_state = "ok"
        if self.use_ema:
            self._ema_rest(group, idx, applied)
        return True

    def _ema_weight(self, applied: Tensor | None) -> Tensor:
        hp = torch.float64 if self._state_device.type in ("cpu", "cuda") else torch.float32
        first = (self._iterations == 0).to(hp)
        w = first + (1.0 - first) * (1.0 - self.ema_momentum)
        return w if applied is None else w * applied

    def _ema_group(self, group: dict, indices: list[int], applied: Tensor | None) -> None:
        ps = [group["params"][i] for i in indices]
        avgs = [self.state[p]["average"] for p in ps]
        mt.lerp_([mt.local(a) for a in avgs], [mt.local(p) for p in ps], self._ema_weight(applied))

    def _after_update(self, found_inf: Tensor | None, applied: Tensor | None) -> None:
        f = self.ema_overwrite_frequency
        if self.use_ema and f:
            if self._host_exact:
                if (self._host_iterations + 1) % f == 0:
                    self._overwrite_with_averages(None)
            else:
                cond = (((self._iterations + 1) % f) == 0).to(torch.float32)
                self._overwrite_with_averages(cond if applied is None else cond * applied)
        if applied is None:
            self._iterations.add_(1)
            self._host_iterations += 1
            self.step_applied = torch.ones((), dtype=torch.bool, device=self._state_device)
        else:
            self._iterations.add_(applied.to(torch.int64))
            self.step_applied = applied > 0.5

    def _overwrite_with_averages(self, weight: Tensor | None) -> None:
        ps = [p for g in self.param_groups for p in g["params"]]
        avgs = [self.state[p]["average"] for p in ps]
        lp, la = [mt.local(p) for p in ps], [mt.local(a) for a in avgs]
        if weight is None:
            torch._foreach_copy_(lp, la)
        else:
            mt.lerp_(lp, la, weight)

    # ------------------------------------------------------------------------------------------------ hooks

    def _prepare(self, group, names, params, grads, slots, lr, k) -> list | None:
        """Per-tensor values the update needs (e.g. LARS trust ratios), computed on whole tensors before the
        blocked elementwise pass. Default: none."""
        return None

    def _update(
        self,
        group: dict,
        params: list[Tensor],
        grads: list[Tensor],
        slots: dict[str, list[Tensor]],
        lr: Tensor,
        k: Tensor | None,
        found_inf: Tensor | None,
        aux: list | None,
    ) -> None:
        """The update rule over (chunks of) local tensors. The true gradient is ``k·grads`` (``k`` None
        means 1); when ``found_inf`` is 1 nothing may change. Subclasses implement this."""
        raise TypeError(f"{type(self).__name__} must implement _update()")

    # --------------------------------------------------------------------------------------- Keras/TF surface

    def update_step(
        self, gradient: Tensor, variable: Tensor, learning_rate: float | Tensor | None = None
    ) -> None:
        """Apply the update rule to one variable (no clipping, decay, EMA or iteration count)."""
        group = next((g for g in self.param_groups if any(p is variable for p in g["params"])), None)
        if group is None:
            raise ValueError("update_step(): `variable` is not one of the optimizer's parameters")
        if gradient.shape != variable.shape:
            raise ValueError(
                f"gradient shape {tuple(gradient.shape)} != variable shape {tuple(variable.shape)}"
            )
        lr = self._current_lr(group) if learning_rate is None else torch.as_tensor(
            learning_rate, dtype=torch.float32, device=self._state_device)
        g = gradient.to_dense() if gradient.is_sparse else gradient.detach().clone()
        name = group["param_names"][next(i for i, p in enumerate(group["params"]) if p is variable)]
        slots = {s: [self.state[variable][s]] for s in self.slot_names}
        with torch.no_grad():
            aux = self._prepare(group, [name], [variable], [g], slots, lr, None)
            self._update(group, [mt.local(variable)], [mt.local(g)],
                         {s: [mt.local(t) for t in v] for s, v in slots.items()}, lr, None, None, aux)

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def compute_gradients(
        self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None
    ) -> list[tuple[Tensor | None, Tensor]]:
        """Gradients of ``loss`` (a scalar tensor or a zero-argument callable) w.r.t. ``var_list``
        (default: every parameter) as ``(gradient, variable)`` pairs; unused variables get ``None``."""
        return autograd_pairs(loss, self._all_params() if var_list is None else list(var_list))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Tensor | None, Tensor]]) -> Tensor:
        """Apply ``(gradient, variable)`` pairs (TF/Keras). Variables not listed are left alone this step.
        Returns ``iterations``."""
        pairs = list(grads_and_vars)
        known = {id(p) for p in self._all_params()}
        for pair in pairs:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise TypeError(f"`grads_and_vars` must hold (gradient, variable) pairs, got {pair!r}")
            g, v = pair
            if not isinstance(v, Tensor) or id(v) not in known:
                raise ValueError(
                    "apply_gradients(): unknown variable (not one of the optimizer's parameters)"
                )
            if g is not None and not isinstance(g, Tensor):
                raise TypeError(f"gradients must be Tensors or None, got {type(g).__name__}")
            if g is not None and g.shape != v.shape:
                raise ValueError(f"gradient shape {tuple(g.shape)} != variable shape {tuple(v.shape)}")
        if all(g is None for g, _ in pairs):
            raise ValueError("No gradients provided for any variable.")
        saved = [(p, p.grad) for p in self._all_params()]
        try:
            for p, _ in saved:
                p.grad = None
            for g, v in pairs:
                if g is not None:
                    v.grad = g if g.dtype == v.dtype or g.is_sparse else g.to(v.dtype)
            self.step()
        finally:
            for p, g in saved:
                p.grad = g
        return self._iterations

    def minimize(
        self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None
    ) -> Tensor:
        """``apply_gradients(compute_gradients(loss, var_list))``."""
        return self.apply_gradients(self.compute_gradients(loss, var_list))

    def get_slot_names(self) -> list[str]:
        """Names of the per-variable slots (``"average"`` included when EMA is on)."""
        return list(self.slot_names) + (["average"] if self.use_ema else [])

    def get_slot(self, var: Tensor, name: str) -> Tensor:
        """The slot ``name`` of parameter ``var``."""
        if name not in self.get_slot_names():
            raise ValueError(f"unknown slot {name!r}; slots are {self.get_slot_names()}")
        if var not in self.state:
            raise ValueError("get_slot(): `var` is not one of the optimizer's parameters")
        return self.state[var][name]

    def variables(self) -> list[Tensor]:
        """Optimizer variables in Keras order: iterations, averages, then each slot per variable."""
        ps = self._all_params()
        out: list[Tensor] = [self._iterations]
        if self.use_ema:
            out += [self.state[p]["average"] for p in ps]
        for s in self.slot_names:
            out += [self.state[p][s] for p in ps]
        return out + list(self._extra_variables)

    def get_weights(self) -> list[Tensor]:
        """Copies of :meth:`variables`."""
        return [v.detach().clone() for v in self.variables()]

    def set_weights(self, weights: Sequence[Tensor]) -> None:
        """Set :meth:`variables` from a list (same order, count and shapes; checked before any change)."""
        vs = self.variables()
        ws = list(weights)
        if len(ws) != len(vs):
            raise ValueError(f"set_weights(): expected {len(vs)} weights, got {len(ws)}")
        converted = []
        for v, w in zip(vs, ws):
            w = torch.as_tensor(w)
            if tuple(w.shape) != tuple(v.shape):
                raise ValueError(f"set_weights(): shape {tuple(w.shape)} does not match {tuple(v.shape)}")
            converted.append(w)
        with torch.no_grad():
            for v, w in zip(vs, converted):
                v.copy_(w)
        self._host_iterations = int(self._iterations)

    def finalize_variable_values(self, var_list: Sequence[Tensor] | None = None) -> None:
        """With EMA on, set every parameter (or those in ``var_list``) to its moving average."""
        if not self.use_ema:
            return
        ps = self._all_params() if var_list is None else list(var_list)
        for p in ps:
            if p not in self.state or "average" not in self.state[p]:
                raise ValueError("finalize_variable_values(): variable has no moving average")
        with torch.no_grad():
            torch._foreach_copy_([mt.local(p) for p in ps], [mt.local(self.state[p]["average"]) for p in ps])

    # ------------------------------------------------------------------------------------------------ config

    def _hyper_config(self) -> dict:
        """Subclass hyperparameters for get_config (taken from ``defaults``)."""
        return {}

    def get_config(self) -> dict:
        """Every hyperparameter as plain Python values; ``from_config(config, params)`` rebuilds it."""
        lr = self._learning_rate
        if _is_schedule(lr):
            lr_cfg: Any = {"class_name": type(lr).__name__, "config": lr.get_config()}
        elif callable(lr):
            lr_cfg = lr
        else:
            lr_cfg = float(self.param_groups[0]["lr"]) if self.param_groups else float(lr)
        cfg = dict(
            name=self.name,
            learning_rate=lr_cfg,
            weight_decay=self._weight_decay_arg,
            clipnorm=self.clipnorm,
            clipvalue=self.clipvalue,
            global_clipnorm=self.global_clipnorm,
            use_ema=self.use_ema,
            ema_momentum=self.ema_momentum,
            ema_overwrite_frequency=self.ema_overwrite_frequency,
            jit_compile=self.jit_compile,
        )
        cfg.update(self._hyper_config())
        return cfg

    @classmethod
    def from_config(cls, config: dict, params: Any) -> Optimizer:
        """Rebuild an optimizer over ``params`` from :meth:`get_config` output."""
        cfg = dict(config)
        lr = cfg.get("learning_rate")
        if isinstance(lr, dict) and "config" in lr:
            from .schedules import LearningRateSchedule

            cfg["learning_rate"] = LearningRateSchedule.from_config(lr["config"])
        return cls(params, **cfg)

    # --------------------------------------------------------------------------------------------- checkpoint

    def __getstate__(self) -> dict:
        """Everything (torch's own version keeps only defaults, state and param_groups, which would lose the
        Keras options and the counters); cached plans are rebuilt on the next step."""
        state = dict(self.__dict__)
        state["_plans"] = {}
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_iterations" not in state:  # torch's load_state_dict also lands here; it re-links afterwards
            return
        # a copy or unpickle: the state entries each got their own 'step' tensor, share the counter again
        for g in self.param_groups:
            for p in g["params"]:
                if p in self.state:
                    self.state[p]["step"] = self._iterations

    def load_state_dict(self, state_dict: dict) -> None:
        """torch semantics; afterwards every parameter shares one ``iterations`` counter again."""
        super().load_state_dict(state_dict)
        self._invalidate_plans()
        steps = [st["step"] for st in self.state.values() if isinstance(st, dict) and "step" in st]
        it = steps[0] if steps else torch.zeros((), dtype=torch.int64)
        self._iterations = it.detach().to(device=self._state_device, dtype=torch.int64).clone()
        for g in self.param_groups:
            for p in g["params"]:
                self._init_state(p, g)
        self._host_iterations = int(self._iterations)
        self._host_exact = True
        if isinstance(self._learning_rate, float) and self.param_groups:
            lr0 = self.param_groups[0]["lr"]
            self._learning_rate = float(lr0) if not isinstance(lr0, Tensor) else float(lr0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, config={self.get_config()!r})"


def _warn_compile_fallback(err: Exception) -> None:
    warnings.warn(
        f"jit_compile=True: torch.compile unavailable ({type(err).__name__}: {err}); running eagerly",
        RuntimeWarning, stacklevel=4,
    )


def _chain_eager(rule, hyper, params, grads, slots, avgs, lr, k, wd, decay_mask, ema_w, found_inf, mult, aux):
    """decay → update → EMA for one group, out of place per tensor, then written back (the body that
    ``jit_compile`` hands to ``torch.compile``; inductor fuses each tensor's chain into one loop).

    Keras order: ``w ← w − w·wd·lr`` (masked), the rule, ``avg ← avg + ema_w·(w − avg)``; when ``found_inf``
    is 1 every result is replaced by its old value with ``torch.where`` (non-finite gradients leave no
    trace).
    """
    skip = None if found_inf is None else found_inf > 0.5
    for i in range(len(params)):
        p = params[i]
        g = grads[i]
        if mult is not None and mult[i] is not None:
            g = g * mult[i]
        w = p
        if decay_mask is not None and decay_mask[i]:
            w = w - w * (wd * lr)
        old_slots = [s[i] for s in slots]
        new_w, new_slots = rule(hyper, w, g, old_slots, lr, k, None if aux is None else aux[i])
        if skip is not None:
            new_w = torch.where(skip, p, new_w)
            new_slots = [torch.where(skip, o, n) for o, n in zip(old_slots, new_slots)]
        for o, n in zip(old_slots, new_slots):
            o.copy_(n)
        if avgs is not None:
            a = avgs[i]
            w_ = ema_w if skip is None else torch.where(skip, torch.zeros_like(ema_w), ema_w)
            a.copy_(a + w_ * (new_w.to(a.dtype) - a))
        p.copy_(new_w)


_COMPILED: list = []


def _compiled_chain() -> Callable | None:
    """The ``torch.compile``-d :func:`_chain_eager` (built once per process; None where unavailable)."""
    if not _COMPILED:
        try:
            _COMPILED.append(torch.compile(_chain_eager, fullgraph=True, dynamic=False))
        except Exception:  # pragma: no cover - torch without a working compile stack
            _COMPILED.append(None)
    return _COMPILED[0]
