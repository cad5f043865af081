"""Loss scaling: fixed, dynamic (TF/Keras, with DeepSpeed hysteresis), OpenSeq2Seq Backoff and LogMax.

Loss scaling multiplies the loss by ``S`` before ``backward`` so that small fp16 gradients do not underflow,
then multiplies every gradient by ``1/S`` (TF ``MixedPrecisionLossScaleOptimizer``). A dynamic scaler also
watches the gradients: a step whose gradients hold a NaN or an inf is skipped and ``S`` shrinks; after enough
clean steps ``S`` grows again.

Every scale object is a :class:`LossScale`:

* ``scale()`` / ``scale.loss_scale``: the current ``S``, a 0-d float32 tensor (a snapshot);
* ``scale_loss(loss)``: ``loss · S``;
* ``unscale_(grads)``: ``g ← g · (1/S)`` in place with the fused non-finite check (one pass over the
  gradients, ``torch._amp_foreach_non_finite_check_and_unscale_``); returns ``found_inf`` (0-d float32,
  1.0 = NaN/inf seen); LogMax also records ``last_amax = max|g|`` of the unscaled gradients (a second,
  read-only pass);
* ``update(found_inf, amax=None)``: advance the state machine once per update attempt; returns
  ``should_apply`` (0-d bool tensor). A non-finite ``amax`` also counts as an overflow;
* ``update_from_grads(grads)``: TF1 ``LossScale.update(grads)`` on already-unscaled gradients.

All state (scale, counters, EMAs) are tensors updated in place with ``torch.where``: no host sync, no Python
branch on a tensor value. The scale is float32 and counters int64. LogMax keeps its 0-d statistics (EMAs, bias
corrections) in float64 (float32 on devices without float64, such as MPS): the original's float32 variables
make ``σ`` noisy through the cancellation in ``E[x²] − μ²``.

State machines (``i`` = update attempt, ``overflow`` = NaN or ±inf in the gradients):

``FixedLossScale`` (TF1 ``tf.train.experimental.FixedLossScale``): ``S`` constant; ``should_apply`` is always
True, even for non-finite gradients, as in TF (opt in to skipping with ``skip_non_finite=True``).

``DynamicLossScale`` (TF1 ``tf.train.experimental.DynamicLossScale``; hysteresis from DeepSpeed's
``DynamicLossScaler``)::

    finite:   if good + 1 >= period: S ← min(S·m, max_loss_scale) if S·m is finite else S; good ← 0
              else good ← good + 1;                            run ← 0
    overflow: run ← run + 1; if run >= hysteresis: S ← max(S / m, min_loss_scale);   good ← 0
    should_apply = finite

``BackoffScaler`` (OpenSeq2Seq ``open_seq2seq/optimizers/automatic_loss_scaler.py``), starting at
``S = scale_max``::

    overflow: S ← clip(S / f, min, max); last ← i
    finite:   if (i − last) mod window == 0: S ← clip(S · f, min, max)
    i ← i + 1

``LogMaxScaler`` (OpenSeq2Seq, bugs fixed), starting at ``S = 1``. With ``x = log_max`` on overflow,
else ``x = log2(amax)``: ``x̂ ← β1 x̂ + (1−β1) x``, ``μ = x̂ / (1 − β1^t)``; ``s ← β2 s + (1−β2) x``,
``q ← β2 q + (1−β2) x²``, ``μ_s = s / (1 − β2^t)``, ``σ = sqrt(max(q/(1 − β2^t) − μ_s², 0))``;
``S ← clip(2^(log_max − (μ + z σ)), min, max)``. A finite step with ``amax == 0`` (every scaled gradient
underflowed) leaves the EMAs unchanged and grows the scale: ``S ← clip(S·2^(log_max − log_min), min, max)``
(the original took ``log2(0) = −inf`` and became NaN).

Floor warning: when a step overflows while ``S`` already sits at its minimum, the scaler cannot help any more
(DeepSpeed raises here). optkit counts these events on the device (``floor_overflow_count``) and emits a
:class:`LossScaleAtMinimumWarning`. The count is read on the host after every update when the state lives on
the CPU (a CPU read is not a device sync) and every ``floor_check_interval`` updates (default 1000; 0 turns
the check off) when it lives on an accelerator, so the hot path does not synchronise.
"""

from __future__ import annotations

import math
import numbers
import struct
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt
from ._validation import ParameterTypeError, check_count, check_int, check_params, check_real

__all__ = [
    "LossScaleAtMinimumWarning",
    "LossScale",
    "FixedLossScale",
    "DynamicLossScale",
    "BackoffScaler",
    "LogMaxScaler",
    "AutomaticLossScaler",
    "get_loss_scale",
]

_FP32_MAX = float(torch.finfo(torch.float32).max)
_INT = torch.int64
_F32 = torch.float32
_F64 = torch.float64
# attributes that are run-time bookkeeping, not hyperparameters (see LossScale._adopt_hyperparameters)
_RUNTIME_ATTRS = frozenset({"_state", "last_amax", "_updates", "_floor_seen", "floor_check_interval",
                            "_amp_domain", "_tracker"})
# what LossScale.load_state_dict accepts: integer dtypes of a counter, ranges of the floating state entries
_INT_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_STATE_BOUNDS: dict[str, dict[str, Any]] = {
    "scale": {"minimum": 0.0, "min_inclusive": False, "maximum": _FP32_MAX},
    "b1_correction": {"minimum": 0.0, "maximum": 1.0},
    "b2_correction": {"minimum": 0.0, "maximum": 1.0},
    "xsquared_hat": {"minimum": 0.0},
}


class LossScaleAtMinimumWarning(RuntimeWarning):
    """Gradients overflowed while the loss scale was already at its minimum: scaling can no longer help."""


def _grad_list(grads: Iterable[Tensor | None]) -> list[Tensor | None]:
    if isinstance(grads, Tensor):
        return [grads]
    return list(grads)


class LossScale(ABC):
    """Base of every loss-scale object (see the module docstring for the protocol and the formulas).

    Subclasses keep their tensors in ``self._state`` (name → 0-d tensor, all on one device) and implement
    :meth:`_transition` and :meth:`get_config`.
    """

    dynamic: bool = True
    needs_amax: bool = False
    floor_check_interval: int = 1000

    def __init__(self) -> None:
        self._state: dict[str, Tensor] = {}
        self.last_amax: Tensor | None = None
        self._updates = 0
        self._floor_seen = 0

    # ---- reading and applying the scale ------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Device holding the state tensors."""
        return self._state["scale"].device

    def __call__(self) -> Tensor:
        """The current loss scale as a 0-d float32 tensor (a snapshot: later updates do not change it)."""
        return self._state["scale"].clone()

    @property
    def loss_scale(self) -> Tensor:
        """Same as ``self()``."""
        return self()

    @property
    def scale_tensor(self) -> Tensor:
        """The state's scale itself (0-d float32, changed in place by :meth:`update`), for kernels queued
        before the update (a wrapper's step: no snapshot copy); ``self()`` is a snapshot."""
        return self._state["scale"]

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss · S`` (``S`` moved to the loss's device; the dtype follows torch's type promotion)."""
        if not isinstance(loss, Tensor):
            raise TypeError(f"scale_loss: loss must be a torch.Tensor, got {type(loss).__name__}")
        return loss * self._state["scale"].to(loss.device, non_blocking=True)

    def unscale_(self, grads: Sequence[Tensor | None]) -> Tensor:
        """``g ← g · (1/S)`` in place for every non-``None`` gradient (sparse COO: its values), fused with the
        non-finite check; returns ``found_inf`` (0-d float32 on the state's device, 1.0 if any NaN/±inf).

        One pass over the gradients (``torch._amp_foreach_non_finite_check_and_unscale_``). When
        ``needs_amax`` a second, read-only pass records ``self.last_amax = max|g|`` of the unscaled gradients
        for the next :meth:`update`.
        """
        gl = _grad_list(grads)
        scale = self._state["scale"]
        found_inf = torch.zeros((), dtype=_F32, device=scale.device)
        inv_scale = mt.inverse_scale(scale, gl)  # (float64 for float64 gradients)
        mt.non_finite_check_and_unscale_(gl, found_inf, inv_scale)
        if self.needs_amax:
            self.last_amax = mt.max_abs(gl).to(scale.device, non_blocking=True)
        return found_inf

    # ---- the state machine --------------------------------------------------------------------------------

    def _as_state_tensor(self, name: str, value: Any) -> Tensor:
        if isinstance(value, Tensor):
            if value.numel() != 1:
                shape = tuple(value.shape)
                raise ValueError(f"update: {name} must have exactly one element, got shape {shape}")
            return value.to(self.device, non_blocking=True).reshape(())
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return mt.scalar(value, _F32, self.device)
        raise TypeError(f"update: {name} must be a 0-d torch.Tensor, got {type(value).__name__}")

    def _overflow(self, found_inf: Tensor, amax: Tensor | None) -> Tensor:
        overflow = self._as_state_tensor("found_inf", found_inf) != 0
        if amax is not None:
            overflow = overflow | ~torch.isfinite(amax)
        return overflow

    def update(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        """Advance the scale once per update attempt; returns ``should_apply`` (0-d bool tensor).

        ``found_inf``: 0-d tensor, non-zero when the gradients held a NaN/inf (from :meth:`unscale_`).
        ``amax``: optional max|unscaled gradient|; a non-finite value counts as an overflow. Scalers with
        ``needs_amax`` use it (or ``last_amax`` recorded by :meth:`unscale_`, consumed here). No host sync.
        """
        found = self._as_state_tensor("found_inf", found_inf)
        amax_t = None if amax is None else self._as_state_tensor("amax", amax)
        if self.needs_amax and amax_t is None:
            if self.last_amax is None:
                raise ValueError(f"{type(self).__name__}.update needs amax (max |unscaled gradient|): "
                                 "pass amax or call unscale_ first")
            amax_t = self.last_amax.to(self.device, non_blocking=True)
        overflow = self._overflow(found, amax_t)
        self.last_amax = None
        should_apply, floor_hit = self._transition(overflow, amax_t)
        if floor_hit is not None:
            self._count_floor(floor_hit)
        return should_apply

    def _count_floor(self, floor_hit: Tensor) -> None:
        """``floor_overflows += floor_hit`` (0-d bool; int64 plus bool needs no cast) and the warning."""
        self._state["floor_overflows"].add_(floor_hit)
        self._maybe_warn_floor()

    def would_apply(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        """What :meth:`update` will return for these arguments (0-d bool tensor), without changing any state:
        ``not overflow`` (a fixed scale without ``skip_non_finite``: True). Wrappers decide the step with it
        and update the scale after the step ran, so a step that raises leaves the scale as it was."""
        found = self._as_state_tensor("found_inf", found_inf)
        amax_t = None if amax is None else self._as_state_tensor("amax", amax)
        return ~self._overflow(found, amax_t)

    def skip_flag(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        """``not would_apply(found_inf, amax)`` as a 0-d float32 0/1 flag on the state's device: the
        ``found_inf`` a wrapped step takes (torch's fused kernels skip on 1.0). For a float32 ``found_inf``
        that is a 0/1 flag (what :meth:`unscale_` and optkit's non-finite checks give) and no ``amax``, a
        scale whose :meth:`would_apply` is ``found_inf == 0`` returns ``found_inf`` itself, without a kernel.
        A subclass that overrides :meth:`would_apply` gets the generic form."""
        found = self._as_state_tensor("found_inf", found_inf)
        if amax is None and not self.needs_amax and found.dtype == _F32 \
                and type(self).would_apply is LossScale.would_apply:
            return found
        return (~self.would_apply(found_inf, amax)).to(_F32)

    def update_from_grads(self, grads: Sequence[Tensor | None]) -> Tensor:
        """TF1 ``LossScale.update(grads)``: check the (already unscaled) gradients and update; returns
        ``should_apply``. One read-only pass: ``amax = max|g|`` (NaN if any NaN); overflow = ``amax`` is not
        finite. An empty or all-``None`` list counts as finite."""
        gl = _grad_list(grads)
        amax = mt.max_abs(gl).to(self.device, non_blocking=True)
        found_inf = (~torch.isfinite(amax)).to(_F32)
        return self.update(found_inf, amax if self.needs_amax else None)

    @abstractmethod
    def _transition(self, overflow: Tensor, amax: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Update ``self._state`` in place for one attempt; return ``(should_apply, overflowed_at_minimum)``
        (the second is ``None`` for scalers without a minimum)."""

    @property
    def floor_overflow_count(self) -> Tensor:
        """Number of overflows that happened while the scale was at its minimum (0-d int64 tensor)."""
        return self._state["floor_overflows"].clone()

    def _state_on_host(self) -> bool:
        """True when the state lives in host memory, where reading it costs no device sync."""
        return self._state["floor_overflows"].device.type == "cpu"

    def _maybe_warn_floor(self) -> None:
        self._updates += 1
        if not self._state_on_host():
            interval = self.floor_check_interval
            if not interval or self._updates % interval or mt.capturing(self.device):
                return  # (no read inside a CUDA graph capture: it would fail the capture)
        # a CPU read, or one accelerator read every `floor_check_interval` updates
        count = int(self._state["floor_overflows"])
        if count > self._floor_seen:
            self._floor_seen = count
            warnings.warn(
                LossScaleAtMinimumWarning(
                    f"{type(self).__name__}: gradients overflowed (NaN/inf) while the loss scale was "
                    "already at its minimum, so the update was skipped and the scale cannot decrease "
                    "further. The model or data produces non-finite gradients regardless of scaling "
                    "(check the learning rate, inputs and fp16 ranges); see `floor_overflow_count`."
                ),
                stacklevel=3,
            )

    # ---- device, checkpointing, config ------------------------------------------------------------------

    def to(self, device: torch.device | str) -> LossScale:
        """Move the state to ``device`` (in place); returns ``self``."""
        device = torch.device(device)
        # devices without float64 (MPS) keep LogMax's statistics in float32
        narrow = device.type == "mps"
        self._state = {k: v.to(device, dtype=_F32 if narrow and v.dtype == _F64 else v.dtype)
                       for k, v in self._state.items()}
        if self.last_amax is not None:
            self.last_amax = self.last_amax.to(device)
        return self

    def state_dict(self) -> dict[str, Any]:
        """Every state tensor (cloned) plus ``"config"`` (the hyperparameters)."""
        sd: dict[str, Any] = {k: v.clone() for k, v in self._state.items()}
        sd["config"] = self.get_config()
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore state (and hyperparameters, when ``"config"`` is present). Continuation is bit-identical.

        Nothing in ``state_dict`` is trusted. Checked, all before anything is changed (a failed load leaves
        the scaler exactly as it was): exactly this scaler's state keys (plus an optional ``"config"``);
        every entry a dense one-element tensor on a real device (not ``meta``), real, floating where the
        state is floating and integer (not bool) where it is an int64 counter; the value after conversion to
        the state's dtype: the scale finite and in ``(0, float32 max]``, counters integers in ``[0, 2^62)``
        (``last_overflow_iteration`` from -1), LogMax's statistics finite (bias corrections in ``[0, 1]``,
        ``xsquared_hat >= 0``); ``"config"`` a dict with this class's keys in the ranges the constructor
        accepts. Wrong types raise :class:`~optkit._validation.ParameterTypeError` (a ``TypeError`` and a
        ``ValueError``), bad values ``ValueError``, each naming the entry.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
        where = f"{type(self).__name__}.load_state_dict"
        names = set(self._state)
        extra = set(state_dict) - names - {"config"}
        if extra:
            raise ValueError(f"load_state_dict: unknown keys {', '.join(sorted(map(repr, extra)))} for "
                             f"{type(self).__name__}")
        missing = names - set(state_dict)
        if missing:
            raise ValueError(f"load_state_dict: missing keys {sorted(missing)} for {type(self).__name__}")
        values = {k: self._checked_state_entry(k, state_dict[k], where) for k in sorted(names)}
        template = None
        if "config" in state_dict:
            config = state_dict["config"]
            if not isinstance(config, Mapping):
                raise ParameterTypeError(f"{where}: 'config' must be a dict, got {type(config).__name__}")
            unknown = [key for key in config if key not in self.get_config()]
            if unknown:
                names_bad = ", ".join(sorted(map(repr, unknown)))
                raise ValueError(f"{where}: 'config' has unknown keys {names_bad}; "
                                 f"allowed: {sorted(self.get_config())}")
            template = type(self).from_config(dict(config))  # the constructor validates the hyperparameters
        # everything is valid: assign
        if template is not None:
            self._adopt_hyperparameters(template)
        for k, v in values.items():
            self._state[k].copy_(v)
        self.last_amax = None
        if "floor_overflows" in self._state:
            self._floor_seen = int(self._state["floor_overflows"])
        self._loaded(values)

    def _loaded(self, values: Mapping[str, Tensor]) -> None:
        """Called at the end of :meth:`load_state_dict` with the loaded state (0-d CPU tensors). Default:
        nothing."""
        return

    def _checked_state_entry(self, name: str, value: Any, where: str) -> Tensor:
        """``value`` checked as the state entry ``name`` (see :meth:`load_state_dict`), returned as a 0-d CPU
        tensor of the state's dtype, ready to copy."""
        target = self._state[name]
        entry = f"'{name}'"
        if not isinstance(value, Tensor):
            raise ParameterTypeError(f"{where}: {entry} must be a one-element tensor, got "
                                     f"{type(value).__name__} ({value!r})")
        if value.numel() != 1:
            raise ValueError(f"{where}: {entry} must be a one-element tensor, got shape {tuple(value.shape)}")
        if value.layout != torch.strided:
            raise ValueError(f"{where}: {entry} must be a dense tensor, got layout {value.layout}")
        if value.is_meta:
            raise ValueError(f"{where}: {entry} is a meta tensor (no data)")
        if target.is_floating_point():
            if not value.is_floating_point():
                raise ParameterTypeError(f"{where}: {entry} must have a real floating dtype like "
                                         f"{target.dtype}, got {value.dtype}")
        elif value.dtype not in _INT_DTYPES:
            raise ParameterTypeError(f"{where}: {entry} must have an integer dtype like {target.dtype}, got "
                                     f"{value.dtype}")
        v = value.detach().reshape(()).to("cpu", dtype=target.dtype)
        x = v.item()
        if target.is_floating_point():
            check_real(entry, x, where=where, **_STATE_BOUNDS.get(name, {}))
        else:
            check_count(entry, x, where=where, minimum=-1 if name == "last_overflow_iteration" else 0)
        return v

    def _adopt_hyperparameters(self, other: LossScale) -> None:
        for k, v in vars(other).items():
            if k not in _RUNTIME_ATTRS:
                setattr(self, k, v)

    @abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The constructor arguments, so that ``type(s).from_config(s.get_config())`` rebuilds ``s``."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LossScale:
        """``cls(**config)``."""
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


# ------------------------------------------------------------------------------------------------------------


class FixedLossScale(LossScale):
    """A constant loss scale (TF1 ``FixedLossScale``).

    ``loss_scale_value`` must be a Python int or float, finite and ``>= 1`` (else ``ValueError``, as in TF).
    ``update`` never changes the scale and, as in TF, returns ``should_apply = True`` even when the gradients
    are not finite; pass ``skip_non_finite=True`` to skip such steps instead (``should_apply = not
    found_inf``).
    """

    dynamic = False

    def __init__(self, loss_scale_value: float, *, skip_non_finite: bool = False) -> None:
        super().__init__()
        if isinstance(loss_scale_value, bool) or not isinstance(loss_scale_value, (int, float)):
            raise ValueError(f"loss_scale_value must be a Python int or float, got {loss_scale_value!r}")
        value = float(loss_scale_value)
        if not value >= 1:
            raise ValueError(f"loss_scale_value must be at least 1, got {loss_scale_value!r}")
        if not math.isfinite(value) or value > _FP32_MAX:
            raise ValueError(f"loss_scale_value must be finite in float32, got {loss_scale_value!r}")
        if not isinstance(skip_non_finite, bool):
            raise TypeError(f"skip_non_finite must be a bool, got {skip_non_finite!r}")
        self.loss_scale_value = value
        self.skip_non_finite = skip_non_finite
        self._state = {"scale": torch.tensor(value, dtype=_F32)}

    def _transition(self, overflow: Tensor, amax: Tensor | None) -> tuple[Tensor, None]:
        """No state change; ``should_apply`` is True (TF), or ``not overflow`` with ``skip_non_finite``."""
        if self.skip_non_finite:
            return ~overflow, None
        return torch.ones((), dtype=torch.bool, device=self.device), None

    def would_apply(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        if self.skip_non_finite:
            return super().would_apply(found_inf, amax)
        return torch.ones((), dtype=torch.bool, device=self.device)

    def skip_flag(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        """0.0 (TF applies every step), or with ``skip_non_finite`` as :meth:`LossScale.skip_flag` for a
        scale whose :meth:`would_apply` is ``found_inf == 0``."""
        found = self._as_state_tensor("found_inf", found_inf)
        if not self.skip_non_finite:
            return torch.zeros((), dtype=_F32, device=self.device)
        if amax is None and found.dtype == _F32:
            return found
        return (~self.would_apply(found_inf, amax)).to(_F32)

    def update_from_grads(self, grads: Sequence[Tensor | None]) -> Tensor:
        """TF1 ``FixedLossScale.update``: True without looking at the gradients (unless
        ``skip_non_finite``)."""
        if not self.skip_non_finite:
            return torch.ones((), dtype=torch.bool, device=self.device)
        return super().update_from_grads(grads)

    @property
    def floor_overflow_count(self) -> Tensor:
        """Always 0: a fixed scale has no minimum to sit at."""
        return torch.zeros((), dtype=_INT, device=self.device)

    def get_config(self) -> dict[str, Any]:
        return {"loss_scale_value": self.loss_scale_value, "skip_non_finite": self.skip_non_finite}


class DynamicLossScale(LossScale):
    """TF1 ``DynamicLossScale`` with optional DeepSpeed-style hysteresis and clamps.

    Growth ``S ← S·multiplier`` happens on the ``increment_period``-th consecutive finite step and is skipped
    when the candidate is not finite (TF; torch PR #98876); with ``max_loss_scale`` the candidate is capped
    there. On an overflow the step is skipped and ``good_steps`` resets; the scale is reduced to
    ``max(S/multiplier, min_loss_scale)`` only on the ``hysteresis``-th consecutive overflow and on every one
    after it (DeepSpeed ``delayed_shift`` with ``consecutive_hysteresis=True``: a finite step resets the
    count). Defaults (``hysteresis=1``, ``min_loss_scale=1``, no max) are exactly TF's rule.
    """

    def __init__(
        self,
        initial_loss_scale: float = 2.0**15,
        increment_period: int = 2000,
        multiplier: float = 2.0,
        *,
        hysteresis: int = 1,
        min_loss_scale: float = 1.0,
        max_loss_scale: float | None = None,
    ) -> None:
        super().__init__()
        where = "DynamicLossScale"
        init = check_real("initial_loss_scale", initial_loss_scale, where=where, minimum=0.0,
                          min_inclusive=False, maximum=_FP32_MAX)
        period = check_int("increment_period", increment_period, where=where, minimum=1)
        mult = check_real("multiplier", multiplier, where=where, minimum=1.0, min_inclusive=False,
                          maximum=_FP32_MAX)
        hyst = check_int("hysteresis", hysteresis, where=where, minimum=1)
        lo = check_real("min_loss_scale", min_loss_scale, where=where, minimum=0.0, min_inclusive=False,
                        maximum=_FP32_MAX)
        hi = None
        if max_loss_scale is not None:
            hi = check_real("max_loss_scale", max_loss_scale, where=where, minimum=lo, maximum=_FP32_MAX)
        if init < lo:
            raise ValueError(f"{where}: initial_loss_scale ({initial_loss_scale!r}) must be >= "
                             f"min_loss_scale ({min_loss_scale!r})")
        if hi is not None and init > hi:
            raise ValueError(f"{where}: initial_loss_scale ({initial_loss_scale!r}) must be <= "
                             f"max_loss_scale ({max_loss_scale!r})")
        self.initial_loss_scale = init
        self.increment_period = period
        self.multiplier = mult
        self.hysteresis = hyst
        self.min_loss_scale = lo
        self.max_loss_scale = hi
        self._state = {
            "scale": torch.tensor(init, dtype=_F32),
            "good_steps": torch.zeros((), dtype=_INT),
            "overflow_run": torch.zeros((), dtype=_INT),
            "floor_overflows": torch.zeros((), dtype=_INT),
        }
        self._amp_domain = self._amp_key()  # (init in [min, max], good_steps 0)

    @property
    def good_steps(self) -> Tensor:
        """Consecutive finite steps since the last growth or overflow (0-d int64)."""
        return self._state["good_steps"].clone()

    def _amp_key(self) -> tuple | None:
        """The hyperparameters under which torch's AMP scale update (:meth:`_amp_update`) is this rule
        exactly, or None: ``hysteresis`` 1 (the run is the last attempt's overflow), a power-of-two
        ``multiplier`` (``S·m`` and ``S·(1/m)`` are exact in float32 and in the kernel's double arithmetic),
        an ``increment_period`` below 2^31 (the kernel's counter is 32-bit) and no ``max_loss_scale`` or one
        whose ``max·m`` is finite (the kernel drops an infinite ``S·m`` where the clamp to the maximum would
        keep the maximum). Kept in ``_amp_domain`` while the state is in the kernel's domain too
        (``min <= S <= max``, ``good_steps < increment_period``: true at construction and kept by every
        update; checked again by :meth:`load_state_dict`)."""
        m, hi = self.multiplier, self.max_loss_scale
        if self.hysteresis != 1 or math.frexp(m)[0] != 0.5 or self.increment_period >= 2**31 - 1 \
                or sys.byteorder != "little":
            return None
        if hi is not None and not math.isfinite(float(torch.tensor(hi, dtype=_F32) * m)):
            return None
        return (self.increment_period, m, self.min_loss_scale, hi)

    def _loaded(self, values: Mapping[str, Tensor]) -> None:
        key = self._amp_key()
        hi = _FP32_MAX if self.max_loss_scale is None else self.max_loss_scale
        inside = self.min_loss_scale <= float(values["scale"]) <= hi \
            and int(values["good_steps"]) < self.increment_period
        self._amp_domain = key if inside else None

    def update(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        """As :meth:`LossScale.update`; without ``amax``, under the hyperparameters and in the state domain
        of :meth:`_amp_key`, the transition is torch's fused AMP scale update (:meth:`_amp_update`)."""
        if amax is None and self._amp_domain is not None and self._amp_domain == self._amp_key():
            found = self._as_state_tensor("found_inf", found_inf).to(_F32)
            self.last_amax = None
            self._count_floor(self._amp_update(found))
            return found == 0
        return super().update(found_inf, amax)

    def _amp_update(self, found: Tensor) -> Tensor:
        """One attempt (the rule of the class docstring) as torch's ``_amp_update_scale_`` (``torch.amp.
        GradScaler``'s update, one kernel: overflow ``S ← S·(1/m)``, counter 0; finite ``c ← c + 1``, and at
        ``c = period`` ``S ← S·m`` if finite, counter 0) and one ``clamp_(min, max)``, which is TF's rule
        exactly under :meth:`_amp_key`: ``max(S/m, min)`` on an overflow, ``min(S·m, max)`` on growth, and
        otherwise a no-op for ``S`` in ``[min, max]``. The kernel's 32-bit counter is the low word of the
        int64 ``good_steps`` (little-endian; counts stay below 2^31, so the high word stays 0). ``found``:
        0-d float32, non-zero on overflow. Returns the floor hit (overflow at ``S <= min``, 0-d bool)."""
        st = self._state
        scale, good = st["scale"], st["good_steps"]
        floor_hit = torch.logical_and(scale <= self.min_loss_scale, found)
        torch._amp_update_scale_(scale, good.reshape(1).view(torch.int32)[0], found, self.multiplier,
                                 1.0 / self.multiplier, self.increment_period)
        scale.clamp_(self.min_loss_scale, self.max_loss_scale)
        torch.ne(found, 0, out=st["overflow_run"])  # (hysteresis 1: the run is this attempt's overflow)
        return floor_hit

    def _transition(self, overflow: Tensor, amax: Tensor | None) -> tuple[Tensor, Tensor]:
        # (each line a kernel or two on a 0-d tensor: on a GPU their launches are the cost, so few of them)
        st = self._state
        scale, good, run = st["scale"], st["good_steps"], st["overflow_run"]
        grow_now = good >= self.increment_period - 1  # (good + 1 >= period)
        candidate = scale * self.multiplier
        if self.max_loss_scale is not None:
            candidate = torch.clamp(candidate, max=self.max_loss_scale)
        # S > 0 is finite and so is the multiplier: the candidate is finite or +inf, never NaN
        grown = torch.where(candidate <= _FP32_MAX, candidate, scale)
        shrunk = torch.clamp(scale / self.multiplier, min=self.min_loss_scale)
        if self.hysteresis == 1:  # every overflow shrinks; the run is 1 after an overflow, else 0
            scale_overflow, new_run = shrunk, overflow
        else:
            run_next = torch.clamp(run + 1, max=self.hysteresis)
            scale_overflow = torch.where(run_next >= self.hysteresis, shrunk, scale)
            new_run = torch.where(overflow, run_next, 0)
        new_scale = torch.where(overflow, scale_overflow, torch.where(grow_now, grown, scale))
        new_good = torch.where(overflow | grow_now, 0, good + 1)
        floor_hit = overflow & (scale <= self.min_loss_scale)
        scale.copy_(new_scale)
        good.copy_(new_good)
        run.copy_(new_run)
        return ~overflow, floor_hit

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_loss_scale": self.initial_loss_scale,
            "increment_period": self.increment_period,
            "multiplier": self.multiplier,
            "hysteresis": self.hysteresis,
            "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale,
        }


# ---- OpenSeq2Seq scalers -----------------------------------------------------------------------------------

_BACKOFF_PARAMS = {"scale_min": float, "scale_max": float, "step_factor": float, "step_window": int}
_BACKOFF_DEFAULTS = {"scale_min": 1.0, "scale_max": 2.0**14, "step_factor": 2.0, "step_window": 2000}
_LOGMAX_PARAMS = {"scale_min": float, "scale_max": float, "log_max": float, "beta1": float, "beta2": float,
                  "overflow_std_dev": float, "log_min": float}
_LOGMAX_DEFAULTS = {"scale_min": 1.0, "scale_max": 2.0**14, "log_max": 16.0, "beta1": 0.99, "beta2": 0.999,
                    "overflow_std_dev": 3.09, "log_min": -24.0}


def _clamp_params(p: dict[str, Any], where: str) -> tuple[float, float]:
    lo = check_real("scale_min", p["scale_min"], where=where, minimum=0.0, min_inclusive=False,
                    maximum=_FP32_MAX)
    hi = check_real("scale_max", p["scale_max"], where=where, minimum=lo, maximum=_FP32_MAX)
    return lo, hi


class BackoffScaler(LossScale):
    """OpenSeq2Seq ``BackoffScaler(params)`` (``open_seq2seq/optimizers/automatic_loss_scaler.py``).

    ``params`` (all optional, strict types): ``scale_min`` float 1.0, ``scale_max`` float 2^14,
    ``step_factor`` float 2.0, ``step_window`` int 2000. The scale starts at ``scale_max``; growth happens on
    every ``step_window``-th clean update counted from the last overflow (or from the start), and the scale is
    clipped to ``[scale_min, scale_max]`` after every change. ``iteration`` is read before its increment (the
    original left that order unspecified).
    """

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        where = "BackoffScaler params"
        check_params(params, {}, _BACKOFF_PARAMS, where)
        p = {**_BACKOFF_DEFAULTS, **(params or {})}
        lo, hi = _clamp_params(p, where)
        check_real("step_factor", p["step_factor"], where=where, minimum=1.0, min_inclusive=False,
                   maximum=_FP32_MAX)
        check_int("step_window", p["step_window"], where=where, minimum=1)
        self.params = p
        self.scale_min, self.scale_max = lo, hi
        self.step_factor = float(p["step_factor"])
        self.step_window = int(p["step_window"])
        self._state = {
            "scale": torch.tensor(hi, dtype=_F32),
            "iteration": torch.zeros((), dtype=_INT),
            "last_overflow_iteration": torch.full((), -1, dtype=_INT),
            "floor_overflows": torch.zeros((), dtype=_INT),
        }
        #: torch's AMP growth tracker (int32): ``(iteration − last_overflow_iteration − 1) mod step_window``,
        #: the clean attempts since the last overflow or growth; derived from the state (not in
        #: ``state_dict``) when None: at the first AMP update, after a load, a move or a generic update
        self._tracker: Tensor | None = None
        self._amp_domain = self._amp_key()  # (the scale starts at scale_max)

    @property
    def iteration(self) -> Tensor:
        """Update attempts so far (0-d int64)."""
        return self._state["iteration"].clone()

    def _amp_key(self) -> tuple | None:
        """The hyperparameters under which torch's AMP scale update (:meth:`update`) is this rule exactly, or
        None: a power-of-two ``step_factor`` (``S·f`` and ``S·(1/f)`` exact in float32 and in the kernel's
        double arithmetic), a ``step_window`` below 2^31 (the kernel's counter is 32-bit) and a finite
        ``scale_max·f`` (the kernel keeps ``S`` where ``S·f`` is infinite; the clamp would give
        ``scale_max``). Kept in ``_amp_domain`` while the scale is in ``[scale_min, scale_max]`` (true at
        construction and kept by every update; checked again by :meth:`load_state_dict`)."""
        f = self.step_factor
        # (scale_max in float32, read on the host: struct rounds as the state's tensor does; ·f is exact)
        if math.frexp(f)[0] != 0.5 or self.step_window >= 2**31 - 1 \
                or struct.unpack("f", struct.pack("f", self.scale_max))[0] * f > _FP32_MAX:
            return None
        return (self.step_window, f, self.scale_min, self.scale_max)

    def _loaded(self, values: Mapping[str, Tensor]) -> None:
        self._tracker = None
        inside = self.scale_min <= float(values["scale"]) <= self.scale_max
        self._amp_domain = self._amp_key() if inside else None

    def to(self, device: torch.device | str) -> BackoffScaler:
        super().to(device)
        self._tracker = None
        return self

    def update(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        """As :meth:`LossScale.update`; under the hyperparameters and in the state domain of
        :meth:`_amp_key`, the scale's transition is torch's ``_amp_update_scale_`` (overflow ``S ← S·(1/f)``,
        tracker 0; clean: tracker + 1, and at ``step_window`` ``S ← S·f``, tracker 0) and one
        ``clamp_(scale_min, scale_max)``: the rule of :meth:`_transition` exactly (growth is due when
        ``(iteration − last_overflow_iteration) mod step_window = 0``, i.e. on the ``step_window``-th clean
        attempt since the last overflow or growth), in fewer one-element kernels."""
        if amax is None and self._amp_domain is not None and self._amp_domain == self._amp_key():
            found = self._as_state_tensor("found_inf", found_inf).to(_F32)
            self.last_amax = None
            st = self._state
            scale, it, last = st["scale"], st["iteration"], st["last_overflow_iteration"]
            if self._tracker is None:  # (torch.remainder: non-negative, as Python's %)
                self._tracker = torch.remainder(it - last - 1, self.step_window).to(torch.int32)
            overflow = found != 0
            floor_hit = overflow & (scale <= self.scale_min)
            torch._amp_update_scale_(scale, self._tracker, found, self.step_factor, 1.0 / self.step_factor,
                                     self.step_window)
            scale.clamp_(self.scale_min, self.scale_max)
            last.copy_(torch.where(overflow, it, last))
            it.add_(1)
            self._count_floor(floor_hit)
            return ~overflow
        return super().update(found_inf, amax)

    def _transition(self, overflow: Tensor, amax: Tensor | None) -> tuple[Tensor, Tensor]:
        st = self._state
        scale, it, last = st["scale"], st["iteration"], st["last_overflow_iteration"]
        shrunk = torch.clamp(scale / self.step_factor, self.scale_min, self.scale_max)
        grown = torch.clamp(scale * self.step_factor, self.scale_min, self.scale_max)
        grow_due = torch.remainder(it - last, self.step_window) == 0
        new_scale = torch.where(overflow, shrunk, torch.where(grow_due, grown, scale))
        new_last = torch.where(overflow, it, last)
        floor_hit = overflow & (scale <= self.scale_min)
        scale.copy_(new_scale)
        last.copy_(new_last)
        it.add_(1)
        self._tracker = None  # (the AMP form's tracker is derived again when next needed)
        return ~overflow, floor_hit

    def get_config(self) -> dict[str, Any]:
        return {"params": dict(self.params)}


class LogMaxScaler(LossScale):
    """OpenSeq2Seq ``LogMaxScaler(params)``, with the original's bugs fixed (see docs/compatibility.md).

    ``params`` (all optional, all float): ``scale_min`` 1.0, ``scale_max`` 2^14, ``log_max`` 16.0, ``beta1``
    0.99, ``beta2`` 0.999, ``overflow_std_dev`` 3.09. It tracks the mean and spread of ``log2(amax)``
    (``amax`` = max |unscaled gradient|) and sets ``S = clip(2^(log_max − μ − z·σ), scale_min, scale_max)``;
    formulas in the module docstring. Fixes (each a row in ``docs/compatibility.md``): an overflow feeds ``x =
    log_max`` (the original fed ``2^log_max = 65536`` into the log-domain EMA and sat at ``scale_min`` for
    ~11.5k updates); the target exponent is ``log_max`` (the original hard-coded 16, equal by default); a
    finite step with ``amax == 0`` means every scaled gradient underflowed the half format (below
    ``2^log_min``, ``log_min`` −24.0: float16's smallest subnormal), so ``S·2^(log_max − log_min)`` cannot
    overflow: the scale grows that far (clipped to ``scale_max``) and the statistics are left alone (the
    original took ``log2(0) = −inf`` and became NaN forever; ignoring the step kept a run that starts at
    ``S = 1`` with underflowing gradients at 1 forever); the initial scale 1.0 is clipped into
    ``[scale_min, scale_max]``.
    """

    needs_amax = True

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        where = "LogMaxScaler params"
        check_params(params, {}, _LOGMAX_PARAMS, where)
        p = {**_LOGMAX_DEFAULTS, **(params or {})}
        lo, hi = _clamp_params(p, where)
        check_real("log_max", p["log_max"], where=where)
        check_real("beta1", p["beta1"], where=where, minimum=0.0, maximum=1.0, max_inclusive=False)
        check_real("beta2", p["beta2"], where=where, minimum=0.0, maximum=1.0, max_inclusive=False)
        check_real("overflow_std_dev", p["overflow_std_dev"], where=where, minimum=0.0)
        check_real("log_min", p["log_min"], where=where, maximum=float(p["log_max"]), max_inclusive=False)
        self.params = p
        self.log_min = float(p["log_min"])
        self.scale_min, self.scale_max = lo, hi
        self.log_max = float(p["log_max"])
        self.beta1 = float(p["beta1"])
        self.beta2 = float(p["beta2"])
        self.overflow_std_dev = float(p["overflow_std_dev"])
        self._state = {
            "scale": torch.tensor(min(max(1.0, lo), hi), dtype=_F32),
            "iteration": torch.zeros((), dtype=_INT),
            "x_hat": torch.zeros((), dtype=_F64),
            "slow_x_hat": torch.zeros((), dtype=_F64),
            "xsquared_hat": torch.zeros((), dtype=_F64),
            "b1_correction": torch.ones((), dtype=_F64),
            "b2_correction": torch.ones((), dtype=_F64),
            "floor_overflows": torch.zeros((), dtype=_INT),
        }

    @property
    def iteration(self) -> Tensor:
        """Update attempts so far (0-d int64)."""
        return self._state["iteration"].clone()

    def _transition(self, overflow: Tensor, amax: Tensor | None) -> tuple[Tensor, Tensor]:
        st = self._state
        b1, b2 = self.beta1, self.beta2
        valid = ~overflow & (amax > 0)
        informative = overflow | valid
        stat = st["x_hat"]
        safe_amax = torch.where(valid, amax.to(stat.dtype), torch.ones_like(stat))
        x = torch.where(overflow, torch.full_like(stat, self.log_max), torch.log2(safe_amax))
        x_hat = b1 * st["x_hat"] + (1.0 - b1) * x
        b1c = st["b1_correction"] * b1
        mu = x_hat / (1.0 - b1c)
        slow = b2 * st["slow_x_hat"] + (1.0 - b2) * x
        sq = b2 * st["xsquared_hat"] + (1.0 - b2) * x * x
        b2c = st["b2_correction"] * b2
        e_x2 = sq / (1.0 - b2c)
        mu_slow = slow / (1.0 - b2c)
        sigma = torch.sqrt(torch.clamp(e_x2 - mu_slow * mu_slow, min=0.0))
        cutoff = mu + self.overflow_std_dev * sigma
        new_scale = torch.clamp(torch.exp2(self.log_max - cutoff), self.scale_min, self.scale_max).to(_F32)
        floor_hit = overflow & (st["scale"] <= self.scale_min)
        for name, new in (("x_hat", x_hat), ("b1_correction", b1c), ("slow_x_hat", slow),
                          ("xsquared_hat", sq), ("b2_correction", b2c), ("scale", new_scale)):
            st[name].copy_(torch.where(informative, new, st[name]))
        # amax == 0: every scaled gradient fell below 2^log_min, so even S·2^(log_max − log_min) overflows
        # nothing: grow the scale that far (clipped), statistics unchanged
        underflow = ~overflow & (amax == 0)
        growth = 2.0 ** (self.log_max - self.log_min)
        grown = torch.clamp(st["scale"] * growth, self.scale_min, self.scale_max)
        st["scale"].copy_(torch.where(underflow, grown.to(_F32), st["scale"]))
        st["iteration"].add_(1)
        return ~overflow, floor_hit

    def get_config(self) -> dict[str, Any]:
        return {"params": dict(self.params)}


class AutomaticLossScaler(LossScale):
    """OpenSeq2Seq ``AutomaticLossScaler(algorithm='Backoff', params=None)``
    (``open_seq2seq/optimizers/automatic_loss_scaler.py``).

    ``algorithm.lower().strip()`` picks ``BackoffScaler`` (``'backoff'``) or ``LogMaxScaler`` (``'logmax'``),
    built with ``params``; the chosen scaler is ``self.scaler``. The OpenSeq2Seq surface is ``loss_scale``,
    the static :meth:`check_grads` and :meth:`update_op`; the :class:`LossScale` protocol is delegated to the
    scaler, so wrappers can take an ``AutomaticLossScaler`` like any other scale object.
    """

    SUPPORTED_ALGOS = ["backoff", "logmax"]
    _CLASSES = {"backoff": BackoffScaler, "logmax": LogMaxScaler}

    def __init__(self, algorithm: str = "Backoff", params: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(algorithm, str):
            raise TypeError(f"AutomaticLossScaler: algorithm must be a str, got {type(algorithm).__name__}")
        name = algorithm.lower().strip()
        if name not in self._CLASSES:
            raise ValueError(f"Unknown scaling algorithm {algorithm!r}; supported: {self.SUPPORTED_ALGOS}")
        self.algorithm = name
        self.scaler: LossScale = self._CLASSES[name](params)

    @property
    def needs_amax(self) -> bool:  # type: ignore[override]
        return self.scaler.needs_amax

    @property
    def device(self) -> torch.device:
        return self.scaler.device

    @property
    def last_amax(self) -> Tensor | None:  # type: ignore[override]
        return self.scaler.last_amax

    @last_amax.setter
    def last_amax(self, value: Tensor | None) -> None:
        if "scaler" in vars(self):
            self.scaler.last_amax = value

    def __call__(self) -> Tensor:
        return self.scaler()

    @property
    def scale_tensor(self) -> Tensor:
        return self.scaler.scale_tensor

    def scale_loss(self, loss: Tensor) -> Tensor:
        return self.scaler.scale_loss(loss)

    def unscale_(self, grads: Sequence[Tensor | None]) -> Tensor:
        return self.scaler.unscale_(grads)

    def update(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        return self.scaler.update(found_inf, amax)

    def would_apply(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        return self.scaler.would_apply(found_inf, amax)

    def skip_flag(self, found_inf: Tensor, amax: Tensor | None = None) -> Tensor:
        return self.scaler.skip_flag(found_inf, amax)

    def update_from_grads(self, grads: Sequence[Tensor | None]) -> Tensor:
        return self.scaler.update_from_grads(grads)

    def _transition(self, overflow: Tensor, amax: Tensor | None) -> tuple[Tensor, Tensor | None]:
        return self.scaler._transition(overflow, amax)

    @property
    def floor_overflow_count(self) -> Tensor:
        return self.scaler.floor_overflow_count

    @staticmethod
    def check_grads(grads_and_vars: Iterable[Any]) -> tuple[Tensor, Tensor]:
        """``(has_nan, amax)`` over the non-``None`` gradients (sparse: their values), in one read pass.

        Entries are ``(grad, var)`` pairs or bare gradients. ``amax = max|g|`` (0-d float32; NaN when a NaN is
        present, 0.0 for no gradients) and ``has_nan = isnan(amax)`` (0-d bool). Overflow is
        ``has_nan | isinf(amax)``.
        """
        grads = [gv[0] if isinstance(gv, (tuple, list)) else gv for gv in grads_and_vars]
        amax = mt.max_abs(grads)
        return torch.isnan(amax), amax

    def update_op(self, has_nan: Tensor, amax: Tensor) -> Tensor:
        """The original ``update_op``: ``scaler.update(has_nan, amax)``; returns ``should_apply``."""
        return self.scaler.update(has_nan, amax)

    def to(self, device: torch.device | str) -> AutomaticLossScaler:
        self.scaler.to(device)
        return self

    def state_dict(self) -> dict[str, Any]:
        sd = self.scaler.state_dict()
        sd["algorithm"] = self.algorithm
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict: state_dict must be a dict, got {type(state_dict).__name__}")
        algo = state_dict.get("algorithm", self.algorithm)
        if algo != self.algorithm:
            raise ValueError(f"load_state_dict: state is for algorithm {algo!r}, this scaler is "
                             f"{self.algorithm!r}")
        self.scaler.load_state_dict({k: v for k, v in state_dict.items() if k != "algorithm"})

    def get_config(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "params": self.scaler.get_config()["params"]}


def get_loss_scale(identifier: Any) -> LossScale | None:
    """Build a loss-scale object from an identifier (TF1 ``loss_scale_module.get`` plus OpenSeq2Seq names).

    A Python int or float gives ``FixedLossScale``; ``"dynamic"`` gives ``DynamicLossScale()``; ``"backoff"``
    and ``"logmax"`` give ``AutomaticLossScaler`` (strings are matched after ``strip().lower()``); a
    :class:`LossScale` is returned as is; ``None`` gives ``None``. Anything else raises ``ValueError``.
    """
    if identifier is None:
        return None
    if isinstance(identifier, LossScale):
        return identifier
    if isinstance(identifier, (int, float)) and not isinstance(identifier, bool):
        return FixedLossScale(identifier)
    if isinstance(identifier, str):
        name = identifier.strip().lower()
        if name == "dynamic":
            return DynamicLossScale()
        if name in AutomaticLossScaler.SUPPORTED_ALGOS:
            return AutomaticLossScaler(name)
    names = ", ".join(repr(a) for a in ("dynamic", *AutomaticLossScaler.SUPPORTED_ALGOS))
    raise ValueError(f"Could not interpret loss scale identifier: {identifier!r} (a number, a LossScale, "
                     f"None or one of {names} in any letter case)")
