"""OpenSeq2Seq learning-rate policies (``optimizers/lr_policies.py``) as pure functions of the step.

Every policy takes ``global_step`` first, then its own arguments, with the names and defaults
of OpenSeq2Seq's documented API (``open_seq2seq/optimizers/lr_policies.py``). ``global_step`` counts
*applied* updates (update ``k``, 0-based, uses ``lr(k)``) and may be

* a python ``int`` or ``float`` (or a NumPy scalar): the policy computes in float64 and returns a python
  ``float``;
* a 0-d tensor of any real dtype: the policy runs torch ops only (``torch.where``/``clamp``/``minimum``, no
  ``.item()`` and no python branch on the tensor) and returns a 0-d tensor on the step's device, so it can
  run inside a compiled or captured training step without a host sync: ``float32``, or ``float64`` for a
  ``float64`` step (what an optkit optimizer passes for a group of float64 parameters). The math runs in
  float64 (float32 on MPS, which has no float64) and is rounded once at the end (not at all for a float64
  step).

Hyperparameters are python numbers and are validated on every call (cheap: no tensor is read). A bad value
raises ``ValueError`` (wrong value) or ``TypeError`` (wrong type) naming the argument. Python-number steps
must be finite and non-negative; tensor steps are not inspected (that would need a sync).

Differences from the original (see ``docs/compatibility.md``): ``inv_poly_decay`` honours ``begin_decay_at``
and ``warmup_steps`` and stays at ``min_lr`` after ``decay_steps``, as its docstring states; parameters are
validated up front.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = [
    "fixed_lr",
    "piecewise_constant",
    "exp_decay",
    "poly_decay",
    "cosine_decay",
    "inv_poly_decay",
    "transformer_policy",
    "LR_POLICIES",
    "get_policy",
]

Step = int | float | Tensor
LR = float | Tensor
#: the type of a policy's value is its step's: a python number gives a float, a 0-d tensor a tensor
StepT = TypeVar("StepT", float, Tensor)


# ----------------------------------------------------------------------------------------------------
# two arithmetic back-ends sharing one formula per policy


class _Scalar:
    """Python-number back-end: float64 math, python ``float`` out."""

    def __init__(self, step: float) -> None:
        self.step = float(step)

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def clip(x: Any, lo: float, hi: float) -> Any:
        return min(max(x, lo), hi)

    @staticmethod
    def minimum(x: Any, y: Any) -> Any:
        return min(x, y)

    @staticmethod
    def maximum(x: Any, y: Any) -> Any:
        return max(x, y)

    @staticmethod
    def floor(x: Any) -> Any:
        return float(math.floor(x))

    @staticmethod
    def cos(x: Any) -> Any:
        return math.cos(x)

    def out(self, x: Any, dtype: torch.dtype | None = None) -> float:
        return float(x)


class _Tensor:
    """Tensor back-end: torch ops only, 0-d tensor on the step's device out."""

    def __init__(self, step: Tensor) -> None:
        compute = torch.float32 if step.device.type == "mps" else torch.float64
        #: the result's dtype: float64 for a float64 step, else float32
        self.dtype = torch.float64 if step.dtype == torch.float64 else torch.float32
        self.step = step.detach().to(compute)

    def _t(self, x: Any) -> Tensor:
        return x if isinstance(x, Tensor) else torch.full_like(self.step, x)

    def where(self, cond: Any, a: Any, b: Any) -> Tensor:
        if not isinstance(a, Tensor) and not isinstance(b, Tensor):
            b = self._t(b)
        return torch.where(cond, a, b)

    def clip(self, x: Any, lo: float, hi: float) -> Tensor:
        return torch.clamp(self._t(x), lo, hi)

    def minimum(self, x: Any, y: Any) -> Tensor:
        if isinstance(y, Tensor):
            return torch.minimum(self._t(x), y)
        return torch.clamp(self._t(x), max=y)

    def maximum(self, x: Any, y: Any) -> Tensor:
        if isinstance(y, Tensor):
            return torch.maximum(self._t(x), y)
        return torch.clamp(self._t(x), min=y)

    def floor(self, x: Any) -> Tensor:
        return torch.floor(self._t(x))

    def cos(self, x: Any) -> Tensor:
        return torch.cos(self._t(x))

    def out(self, x: Any, dtype: torch.dtype | None = None) -> Tensor:
        return self._t(x).to(self.dtype if dtype is None else dtype)


def _backend(global_step: Any, fn: str) -> _Scalar | _Tensor:
    if global_step is None:
        raise ValueError(f"{fn}: global_step must not be None")
    if isinstance(global_step, Tensor):
        if global_step.dtype == torch.bool or global_step.is_complex():
            raise TypeError(f"{fn}: global_step must be a real tensor, got dtype {global_step.dtype}")
        if global_step.dim() != 0:
            raise ValueError(f"{fn}: global_step must be a 0-d tensor, got shape {tuple(global_step.shape)}")
        return _Tensor(global_step)
    if isinstance(global_step, bool) or not isinstance(global_step, numbers.Real):
        raise TypeError(f"{fn}: global_step must be an int, float or 0-d tensor, got {global_step!r}")
    if not math.isfinite(global_step) or global_step < 0:
        raise ValueError(f"{fn}: global_step must be finite and >= 0, got {global_step!r}")
    return _Scalar(global_step)


# ----------------------------------------------------------------------------------------------------
# validation


def _real(fn: str, name: str, value: Any, *, low: float | None = None, strict: bool = False) -> float:
    """``value`` as a finite float, optionally ``> low`` (strict) or ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{fn}: {name} must be a real number, got {value!r}")
    value = float(value)
    if value != value or value in (math.inf, -math.inf):  # (not math.isfinite: torch < 2.13 cannot trace it)
        raise ValueError(f"{fn}: {name} must be finite, got {value!r}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{fn}: {name} must be {'>' if strict else '>='} {low:g}, got {value!r}")
    return value


def _warmup(b: _Scalar | _Tensor, lr: float, warmup_steps: float) -> Any:
    """Linear warmup: ``lr·step/warmup_steps`` while ``step < warmup_steps`` (when > 0), else ``lr``."""
    if warmup_steps <= 0:
        return lr
    return b.where(b.step < warmup_steps, lr * b.step / warmup_steps, lr)


def _decay_common(fn: str, learning_rate: Any, decay_steps: Any, begin_decay_at: Any, warmup_steps: Any):
    lr = _real(fn, "learning_rate", learning_rate, low=0.0)
    ds = _real(fn, "decay_steps", decay_steps, low=0.0, strict=True)
    bda = _real(fn, "begin_decay_at", begin_decay_at, low=0.0)
    ws = _real(fn, "warmup_steps", warmup_steps, low=0.0)
    return lr, ds, bda, ws


# ----------------------------------------------------------------------------------------------------
# policies


def fixed_lr(global_step: StepT, learning_rate: float) -> StepT:
    """Fixed learning rate: ``lr(step) = learning_rate`` for every step."""
    b = _backend(global_step, "fixed_lr")
    lr = _real("fixed_lr", "learning_rate", learning_rate, low=0.0)
    return b.out(lr)


def piecewise_constant(
    global_step: StepT,
    learning_rate: float,
    boundaries: Sequence[int],
    decay_rates: Sequence[float],
    steps_per_epoch: int | None = None,
) -> StepT:
    """Piecewise-constant decay (TF ``piecewise_constant`` semantics, boundaries inclusive on the left piece).

    With ``b_j = boundaries[j]·steps_per_epoch`` (or ``boundaries[j]`` when ``steps_per_epoch`` is None) and
    ``v = [lr, lr·r_0, lr·r_1, ...]``: ``lr(step) = v_0`` if ``step <= b_0``; ``v_j`` if
    ``b_{j-1} < step <= b_j``; ``v_last`` if ``step > b_last``.

    ``boundaries`` must be non-decreasing ints (a float, e.g. a fractional epoch, raises ``ValueError``),
    as many as ``decay_rates``.
    """
    fn = "piecewise_constant"
    b = _backend(global_step, fn)
    lr = _real(fn, "learning_rate", learning_rate, low=0.0)
    if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, Sequence):
        raise TypeError(f"{fn}: boundaries must be a list of ints, got {boundaries!r}")
    if isinstance(decay_rates, (str, bytes)) or not isinstance(decay_rates, Sequence):
        raise TypeError(f"{fn}: decay_rates must be a list of numbers, got {decay_rates!r}")
    if len(boundaries) != len(decay_rates):
        raise ValueError(
            f"{fn}: boundaries and decay_rates must have the same length, got {len(boundaries)} and "
            f"{len(decay_rates)}"
        )
    spe = 1
    if steps_per_epoch is not None:
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, numbers.Integral):
            raise TypeError(f"{fn}: steps_per_epoch must be an int or None, got {steps_per_epoch!r}")
        if steps_per_epoch <= 0:
            raise ValueError(f"{fn}: steps_per_epoch must be > 0, got {steps_per_epoch!r}")
        spe = int(steps_per_epoch)
    bounds = []
    for x in boundaries:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise TypeError(f"{fn}: boundaries must be ints, got {x!r}")
        if not isinstance(x, numbers.Integral):
            raise ValueError(f"{fn}: boundaries must be ints (whole steps or epochs), got {x!r}")
        bounds.append(int(x) * spe)
    if any(hi < lo for lo, hi in zip(bounds, bounds[1:])):
        raise ValueError(f"{fn}: boundaries must be non-decreasing, got {list(boundaries)!r}")
    values = [lr] + [lr * _real(fn, "decay_rates", r, low=0.0) for r in decay_rates]
    out: Any = values[-1]
    for bound, value in zip(reversed(bounds), reversed(values[:-1])):
        out = b.where(b.step <= bound, value, out)
    return b.out(out)


def exp_decay(
    global_step: StepT,
    learning_rate: float,
    decay_steps: float,
    decay_rate: float,
    use_staircase_decay: bool,
    begin_decay_at: float = 0,
    min_lr: float = 0.0,
) -> StepT:
    """Exponential decay with a start step and a floor.

    ``p = (step − begin_decay_at)/decay_steps`` (floored when ``use_staircase_decay``);
    ``lr(step) = max(min_lr, lr₀)`` if ``step < begin_decay_at`` else ``max(min_lr, lr₀·decay_rate^p)``.
    """
    fn = "exp_decay"
    b = _backend(global_step, fn)
    lr, ds, bda, _ = _decay_common(fn, learning_rate, decay_steps, begin_decay_at, 0)
    rate = _real(fn, "decay_rate", decay_rate, low=0.0, strict=True)
    floor = _real(fn, "min_lr", min_lr, low=0.0)
    if not isinstance(use_staircase_decay, bool):
        raise TypeError(f"{fn}: use_staircase_decay must be a bool, got {use_staircase_decay!r}")
    p = b.maximum(b.step - bda, 0.0) / ds
    if use_staircase_decay:
        p = b.floor(p)
    decayed = b.where(b.step < bda, lr, lr * rate**p)
    return b.out(b.maximum(decayed, floor))


def poly_decay(
    global_step: StepT,
    learning_rate: float,
    decay_steps: float,
    power: float = 1.0,
    begin_decay_at: float = 0,
    min_lr: float = 0.0,
    warmup_steps: float = 0,
) -> StepT:
    """Polynomial decay after an optional linear warmup.

    Warmup: ``lr_w = lr₀·step/warmup_steps`` while ``step < warmup_steps`` (when > 0), else ``lr₀``.
    Decay: ``lr_w`` if ``step < begin_decay_at``, else with ``s = min(step − begin_decay_at, decay_steps)``:
    ``(lr_w − min_lr)·(1 − s/decay_steps)^power + min_lr`` (``min_lr`` is TF's ``end_learning_rate``).
    """
    fn = "poly_decay"
    b = _backend(global_step, fn)
    lr, ds, bda, ws = _decay_common(fn, learning_rate, decay_steps, begin_decay_at, warmup_steps)
    pw = _real(fn, "power", power, low=0.0, strict=True)
    end = _real(fn, "min_lr", min_lr, low=0.0)
    lr_w = _warmup(b, lr, ws)
    s = b.clip(b.step - bda, 0.0, ds)
    decayed = (lr_w - end) * (1.0 - s / ds) ** pw + end
    return b.out(b.where(b.step < bda, lr_w, decayed))


def cosine_decay(
    global_step: StepT,
    learning_rate: float,
    decay_steps: float,
    power: float = 1.0,
    begin_decay_at: float = 0,
    min_lr: float = 0.0,
    warmup_steps: float = 0,
) -> StepT:
    """Cosine decay after an optional linear warmup (TF ``cosine_decay`` with ``alpha = min_lr``).

    Warmup as in :func:`poly_decay`. ``lr_w`` if ``step < begin_decay_at``, else with
    ``s = min(step − begin_decay_at, decay_steps)`` and ``c = ½(1 + cos(π·s/decay_steps))``:
    ``lr_w·((1 − α)·c + α)``. ``α = min_lr`` is a *fraction* of the learning rate in [0, 1], not an absolute
    rate, and ``power`` is accepted but unused (both as in the original).
    """
    fn = "cosine_decay"
    b = _backend(global_step, fn)
    lr, ds, bda, ws = _decay_common(fn, learning_rate, decay_steps, begin_decay_at, warmup_steps)
    _real(fn, "power", power)
    alpha = _real(fn, "min_lr", min_lr, low=0.0)
    if alpha > 1.0:
        raise ValueError(f"{fn}: min_lr is a fraction of learning_rate and must be <= 1, got {min_lr!r}")
    lr_w = _warmup(b, lr, ws)
    s = b.clip(b.step - bda, 0.0, ds)
    c = 0.5 * (1.0 + b.cos(math.pi * s / ds))
    decayed = lr_w * ((1.0 - alpha) * c + alpha)
    return b.out(b.where(b.step < bda, lr_w, decayed))


def inv_poly_decay(
    global_step: StepT,
    learning_rate: float,
    decay_steps: float,
    min_lr: float,
    power: float = 1.0,
    begin_decay_at: float = 0,
    warmup_steps: float = 0,
    name: str = "learning_rate",
) -> StepT:
    """Inverse-polynomial decay ``lr₀/(1 + a·t)^power`` that reaches ``min_lr`` after ``decay_steps``.

    ``m = min(max(min_lr, 1e-8), lr₀)`` and ``a = ((lr₀/m)^(1/power) − 1)/decay_steps``. Warmup as in
    :func:`poly_decay`; ``lr_w`` if ``step < begin_decay_at``, else with
    ``s = min(step − begin_decay_at, decay_steps)``: ``lr_w/(1 + a·s)^power``, so the rate stays at ``m`` once
    decay is over. This follows the original's docstring (``begin_decay_at`` is the first decaying step,
    ``min_lr`` the end rate); the original ignored both step arguments and kept decreasing below ``min_lr``.
    ``name`` (TF's op name) is accepted and unused.
    """
    fn = "inv_poly_decay"
    b = _backend(global_step, fn)
    lr, ds, bda, ws = _decay_common(fn, learning_rate, decay_steps, begin_decay_at, warmup_steps)
    if lr == 0.0:
        raise ValueError(f"{fn}: learning_rate must be > 0, got {learning_rate!r}")
    pw = _real(fn, "power", power, low=0.0, strict=True)
    m = min(max(_real(fn, "min_lr", min_lr, low=0.0), 1e-8), lr)
    if not isinstance(name, str):
        raise TypeError(f"{fn}: name must be a str, got {name!r}")
    a = ((lr / m) ** (1.0 / pw) - 1.0) / ds
    lr_w = _warmup(b, lr, ws)
    s = b.clip(b.step - bda, 0.0, ds)
    decayed = lr_w / (1.0 + a * s) ** pw
    return b.out(b.where(b.step < bda, lr_w, decayed))


def transformer_policy(
    global_step: StepT,
    learning_rate: float,
    d_model: float,
    warmup_steps: float,
    max_lr: float | None = None,
    coefficient: float = 1.0,
    dtype: torch.dtype | None = None,
) -> StepT:
    """The Transformer ("Noam") schedule of https://arxiv.org/abs/1706.03762 with an optional cap.

    With ``n = step + 1``: ``lr = learning_rate·coefficient·d_model^(−½)·min(n·warmup_steps^(−1.5), n^(−½))``,
    then ``min(max_lr, lr)`` when ``max_lr`` is given. The peak is at ``step = warmup_steps − 1``.
    ``dtype`` is the dtype of the returned tensor on the tensor path (None: float32, float64 for a float64
    step).
    """
    fn = "transformer_policy"
    b = _backend(global_step, fn)
    lr = _real(fn, "learning_rate", learning_rate, low=0.0)
    dm = _real(fn, "d_model", d_model, low=0.0, strict=True)
    ws = _real(fn, "warmup_steps", warmup_steps, low=0.0, strict=True)
    coef = _real(fn, "coefficient", coefficient, low=0.0)
    cap = None if max_lr is None else _real(fn, "max_lr", max_lr, low=0.0, strict=True)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"{fn}: dtype must be a floating torch.dtype or None, got {dtype!r}")
    n = b.step + 1.0
    out = lr * coef * dm**-0.5 * b.minimum(n * ws**-1.5, n**-0.5)
    if cap is not None:
        out = b.minimum(out, cap)
    return b.out(out, dtype)


# ----------------------------------------------------------------------------------------------------
# registry

LR_POLICIES: dict[str, Callable[..., LR]] = {
    f.__name__: f
    for f in (
        fixed_lr,
        piecewise_constant,
        exp_decay,
        poly_decay,
        cosine_decay,
        inv_poly_decay,
        transformer_policy,
    )
}
"""The learning-rate policies by name. Add your own ``policy(global_step, **params)`` functions here to make
them available to :func:`get_policy` and to schedule configs."""


def get_policy(name: str) -> Callable[..., LR]:
    """The policy registered as ``name`` in :data:`LR_POLICIES` (case-insensitive)."""
    if not isinstance(name, str):
        raise TypeError(f"get_policy: name must be a str, got {name!r}")
    wanted = name.lower()
    for key, fn in LR_POLICIES.items():
        if key.lower() == wanted:
            return fn
    raise ValueError(f"get_policy: unknown learning-rate policy {name!r}; valid names: {sorted(LR_POLICIES)}")
