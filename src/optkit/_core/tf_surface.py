"""The TF/Keras surface of optkit optimizers, as thin layers over the PyTorch core.

``compute_gradients``/``apply_gradients``/``minimize`` (TF1), ``get_slot``/``get_slot_names``/``variables``/
``get_weights``/``set_weights``/``update_step`` (Keras) and ``get_config``/``from_config``. The helpers at the
top are shared with the wrappers (:mod:`optkit._wrapper`):

* :func:`autograd_pairs` — ``(dloss/dv, v)`` pairs, TF's ``compute_gradients``;
* :func:`check_pairs` — validation of ``grads_and_vars`` (TF's errors), before anything changes;
* :func:`gradients_installed` — ``apply_gradients`` steps through ``step()``: for its duration the listed
  variables get **copies** of the given gradients as ``.grad`` (the fused kernels write into ``.grad``, and
  clipping scales it in place, so the caller's tensors must never be handed over), every other parameter's
  ``.grad`` is hidden, and all ``.grad`` attributes are restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from typing_extensions import Self

from .. import _multi_tensor as mt
from ..schedules import LearningRateSchedule

__all__ = ["TFSurface", "autograd_pairs", "check_pairs", "gradients_installed", "is_schedule"]


def is_schedule(lr: object) -> bool:
    """Whether ``lr`` is an :class:`optkit.schedules.LearningRateSchedule`."""
    return isinstance(lr, LearningRateSchedule)


def autograd_pairs(
    loss: Tensor | Callable[[], Tensor], vs: list[Tensor]
) -> list[tuple[Tensor | None, Tensor]]:
    """``(dloss/dv, v)`` for each ``v`` in ``vs`` (``None`` where unused); ``loss`` is a scalar tensor or a
    zero-argument callable returning one (TF's ``compute_gradients``)."""
    if not vs:
        raise ValueError("`var_list` is empty")
    with torch.enable_grad():
        value = loss() if callable(loss) else loss
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise ValueError("`loss` must be (or return) a scalar tensor")
    grads = torch.autograd.grad(value, vs, allow_unused=True)
    return list(zip(grads, vs))


def check_pairs(
    grads_and_vars: Iterable[tuple[Tensor | None, Tensor]], known_params: Sequence[Tensor]
) -> list[tuple[Tensor | None, Tensor]]:
    """Validate ``(gradient, variable)`` pairs against the optimizer's parameters (TF's errors); returns them
    as a list of tuples. Nothing is changed."""
    pairs = list(grads_and_vars)
    known = {id(p) for p in known_params}
    seen: set[int] = set()
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"`grads_and_vars` must hold (gradient, variable) pairs, got {pair!r}")
        g, v = pair
        if not isinstance(v, Tensor) or id(v) not in known:
            raise ValueError("apply_gradients(): unknown variable (not one of the optimizer's parameters)")
        if id(v) in seen:
            # one update per variable and step (torch): a second pair would replace the first gradient
            raise ValueError(f"apply_gradients(): grads_and_vars[{i}] names a variable given before; sum its "
                             "gradients into one pair")
        seen.add(id(v))
        if g is not None and not isinstance(g, Tensor):
            raise TypeError(f"gradients must be Tensors or None, got {type(g).__name__}")
        if g is not None and g.shape != v.shape:
            raise ValueError(f"gradient shape {tuple(g.shape)} != variable shape {tuple(v.shape)}")
    if all(g is None for g, _ in pairs):
        raise ValueError("No gradients provided for any variable.")
    return [tuple(p) for p in pairs]  # type: ignore[misc]


@contextmanager
def gradients_installed(
    pairs: Sequence[tuple[Tensor | None, Tensor]], all_params: Sequence[Tensor]
) -> Iterator[None]:
    """For the ``with`` body: ``v.grad`` = a copy of ``g`` (cast to ``v``'s dtype; sparse gradients coalesced)
    for every pair, ``None`` for the other parameters; every ``.grad`` is restored afterwards (module doc)."""
    saved = [(p, p.grad) for p in all_params]
    try:
        with torch.no_grad():
            for p, _ in saved:
                p.grad = None
            for g, v in pairs:
                if g is None:
                    continue
                g = g.detach()
                if g.is_sparse:
                    copy = g.coalesce() if not g.is_coalesced() else g.clone()
                else:
                    copy = g.clone(memory_format=torch.preserve_format)
                v.grad = copy if copy.dtype == v.dtype else copy.to(v.dtype)
        yield
    finally:
        for p, g in saved:
            p.grad = g


class TFSurface:
    """Mixin of the TF/Keras methods for :class:`optkit.Optimizer` (module doc). Relies on the base's
    ``param_groups``, ``state``, ``slot_names``, ``use_ema``, ``_iterations``, ``_current_lr``, ``_prepare``,
    ``_update`` and ``step``."""

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]

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
        lr = self._current_lr(group, commit=True) if learning_rate is None else torch.as_tensor(
            learning_rate, dtype=torch.float32, device=self._state_device)
        g = gradient.to_dense() if gradient.is_sparse else gradient.detach().clone()
        g = g if g.dtype == variable.dtype else g.to(variable.dtype)
        index = next(i for i, p in enumerate(group["params"]) if p is variable)
        with torch.no_grad():
            self._update_one(group, index, variable, g, lr)

    def compute_gradients(
        self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None
    ) -> list[tuple[Tensor | None, Tensor]]:
        """Gradients of ``loss`` (a scalar tensor or a zero-argument callable) w.r.t. ``var_list``
        (default: every parameter) as ``(gradient, variable)`` pairs; unused variables get ``None``."""
        return autograd_pairs(loss, self._all_params() if var_list is None else list(var_list))

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Tensor | None, Tensor]]) -> Tensor:
        """Apply ``(gradient, variable)`` pairs (TF/Keras). Variables not listed are left alone this step; the
        given gradient tensors are never modified. Returns ``iterations``."""
        pairs = check_pairs(grads_and_vars, self._all_params())
        with gradients_installed(pairs, self._all_params()):
            self.step()
        return self._iterations

    def minimize(
        self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None
    ) -> Tensor:
        """``apply_gradients(compute_gradients(loss, var_list))``."""
        return self.apply_gradients(self.compute_gradients(loss, var_list))

    def get_slot_names(self) -> list[str]:
        """Names of the per-variable slots in use (``"average"`` included when EMA is on)."""
        used = {s for g in self.param_groups for s in self._active_slots(g)}
        return [s for s in self.slot_names if s in used] + (["average"] if self.use_ema else [])

    def get_slot(self, var: Tensor, name: str) -> Tensor:
        """The slot ``name`` of parameter ``var``: the stored tensor, or, for a slot kept in 8 bits
        (``state_dtype="int8"``), its values decoded into a new float32 tensor (:meth:`lean_slot_values`;
        writing into it does not change the slot)."""
        if name not in self.get_slot_names():
            raise ValueError(f"unknown slot {name!r}; slots are {self.get_slot_names()}")
        if var not in self.state:
            raise ValueError("get_slot(): `var` is not one of the optimizer's parameters")
        if name not in self.state[var]:  # a per-group slot (Adam's amsgrad, RMSProp's centered) it lacks
            raise ValueError(f"get_slot(): this parameter's group keeps no {name!r} slot; it keeps "
                             f"{[s for s in self.state[var] if s != 'step']}")
        slot = self.state[var][name]
        if mt.local(slot).dtype == torch.uint8:  # (8-bit codes: Keras users read a slot's values)
            return self.lean_slot_values(var, name)
        return slot

    def _variable_entries(self) -> list[tuple[Tensor, Tensor | None, str | None]]:
        """:meth:`variables` with, for each slot, its parameter and name (None for the others)."""
        ps = self._all_params()
        out: list[tuple[Tensor, Tensor | None, str | None]] = [(self._iterations, None, None)]
        if self.use_ema:
            out += [(self.state[p]["average"], None, None) for p in ps]
        for s in self.slot_names:
            out += [(self.state[p][s], p, s) for p in ps if s in self.state[p]]
        return out + [(v, None, None) for v in self._extra_variables]

    def variables(self) -> list[Tensor]:
        """Optimizer variables in Keras order: iterations, averages, then each slot per variable (as stored:
        an 8-bit slot's uint8 codes)."""
        return [v for v, _, _ in self._variable_entries()]

    def get_weights(self) -> list[Tensor]:
        """Copies of :meth:`variables`; an 8-bit slot as its values (float32, :meth:`lean_slot_values`)."""
        return [self.lean_slot_values(p, s) if s is not None and mt.local(v).dtype == torch.uint8
                else v.detach().clone() for v, p, s in self._variable_entries()]

    def set_weights(self, weights: Sequence[Tensor]) -> None:
        """Set :meth:`variables` from a list (same order, count and shapes; checked before any change); an
        8-bit slot takes values (as :meth:`get_weights` gives them), quantised."""
        entries = self._variable_entries()
        ws = list(weights)
        if len(ws) != len(entries):
            raise ValueError(f"set_weights(): expected {len(entries)} weights, got {len(ws)}")
        converted = []
        for (v, _, _), w in zip(entries, ws):
            w = torch.as_tensor(w)
            if tuple(w.shape) != tuple(v.shape):
                raise ValueError(f"set_weights(): shape {tuple(w.shape)} does not match {tuple(v.shape)}")
            if not (w.is_floating_point() or v.dtype == torch.int64) or w.is_complex():
                raise ValueError(f"set_weights(): dtype {w.dtype} does not fit {v.dtype}")
            converted.append(w)
        with torch.no_grad():
            for (v, p, s), w in zip(entries, converted):
                if s is not None and mt.local(v).dtype == torch.uint8:
                    self._write_slot(p, s, self.state[p], w.to(device=mt.local(v).device,
                                                              dtype=torch.float32).contiguous())
                else:
                    mt.local(v).copy_(w)
        self._host_iterations = int(self._iterations)
        self._mark_host_count()

    # ------------------------------------------------------------------------------------------------ config

    def _hyper_config(self) -> dict:
        """Subclass hyperparameters for get_config: by default every keyword argument a subclass passed on
        to ``Optimizer.__init__`` (its group defaults); optkit's own optimizers override this."""
        return {k: self.defaults[k] for k in getattr(self, "_hyper_keys", ()) if k in self.defaults}

    def get_config(self) -> dict:
        """Every hyperparameter as plain Python values; ``from_config(config, params)`` rebuilds it."""
        lr = self._learning_rate
        if is_schedule(lr):
            lr_cfg: Any = {"class_name": type(lr).__name__, "config": lr.get_config()}
        elif callable(lr) and not isinstance(lr, Tensor):
            lr_cfg = lr
        else:
            lr_cfg = float(self._default_lr())
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
            ema_warmup=self.ema_warmup,
            jit_compile=self.jit_compile,
        )
        if self.precision is not None or self.state_dtype is not None:
            cfg.update(precision=self.precision, state_dtype=self.state_dtype,
                       rounding_seed=self.rounding_seed)
        cfg.update(self._hyper_config())
        return cfg

    @classmethod
    def from_config(cls, config: dict, params: Any, custom_objects: dict[str, Any] | None = None) -> Self:
        """Rebuild an optimizer over ``params`` from :meth:`get_config` output. A schedule learning rate is
        rebuilt as the class its ``class_name`` names: ``custom_objects[class_name]`` (as in Keras), else the
        one :class:`~optkit.LearningRateSchedule` subclass of that name, else by its config's tag."""
        cfg = dict(config)
        lr = cfg.get("learning_rate")
        if isinstance(lr, dict) and "config" in lr:
            cfg["learning_rate"] = LearningRateSchedule._from_named_config(lr, custom_objects)
        return cls(params, **cfg)
