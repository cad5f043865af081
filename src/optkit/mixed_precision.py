"""fp32 master weights for half-precision models (OpenSeq2Seq ``open_seq2seq/optimizers/mp_wrapper.py``).

:class:`MixedPrecisionOptimizerWrapper` keeps exactly one float32 master copy of every float16/bfloat16
parameter and runs the inner optimizer on the masters, so its state (momentum, moments, EMA) is float32.
One step, with ``S`` the loss scale (:mod:`optkit.loss_scale`)::

    master.grad ← fp32(p16.grad)                 (one reused fp32 buffer per master, no allocation)
    [+ S·λ·master                       with l2_regularization=λ: OpenSeq2Seq's diverted regularizer]
    found_inf = any(!isfinite(grads))            (read-only pass over the half gradients)
    inner step on masters with grad_scale = S, found_inf = !should_apply   (unscale folded into its pass)
    p16 ← clamp(half(master), ±finfo(half).max)  (saturating copy back: never ±inf)

Parameters that are already float32 (e.g. normalisation layers kept in fp32) are updated directly. A skipped
step (overflow under a dynamic scale) changes no master, no state and no model parameter.

**Without masters.** ``precision="split"``, ``"kahan"`` or ``"stochastic"`` keeps no fp32 copy: the wrapped
optkit optimizer is switched to that master-free bfloat16 format (:class:`optkit.Optimizer`'s ``precision``:
split keeps the low 16 bits of the fp32 master, 2 B/param, and follows the fp32 trajectory bit for bit;
Kahan a bfloat16 compensation, 2 B/param; stochastic rounding nothing) and steps the bfloat16 parameters in
place, with the same loss scaling, skipping and checkpoints; state it already built is converted
(``opt.engine.set_lean``). ``state_dtype`` (``"float32"``, ``"bfloat16"``, ``"int8"``) sets the inner
optimizer's slot storage in every mode (with fp32 masters: of the masters' slots). Both need an optkit
optimizer inside (``TypeError`` for a ``torch.optim`` one); the master-free formats are bfloat16's (a float16
parameter is refused) and take no ``l2_regularization`` (use the optimizer's ``weight_decay``); their
gradients accumulate in the parameters' own ``.grad`` (bfloat16).

**How the inner optimizer gets the masters.** Build the inner optimizer (and any optkit wrappers such as
``LARC`` or ``VariableClippingOptimizer``) on the model's parameters and wrap it: the constructor replaces
every half parameter in the param groups by its master, casts any existing per-parameter state of it to
float32 and tells the wrappers inside about the swap; an optkit optimizer's state that is still what its
construction built (no update applied, every slot still its initial fill) is built again on the masters in
float32, so that Adagrad's or Ftrl's ``initial_accumulator_value`` is not the half-rounded one (fp16(0.1) =
0.0999755859375) and the masters follow the float32 run exactly; state written since (a step, a loaded
checkpoint) is only cast. Or use :meth:`MixedPrecisionOptimizerWrapper.wrap`,
which builds the inner optimizer on the masters directly. Afterwards ``param_groups`` and ``state`` refer to
the masters; ``model_params``/``master_params`` give both sides. This wrapper must be the outermost optkit
wrapper (gradient-processing wrappers inside it see the fp32 master gradients, as in OpenSeq2Seq where LARC
runs on the masters). If you change the model's half weights yourself, call :meth:`sync_masters`.

Training loop: ``opt.scale_loss(loss).backward(); opt.step(); opt.zero_grad()`` or ``opt.step(closure)``
with a closure that returns the unscaled loss without calling ``backward`` (as ``LossScaleOptimizer``).
``zero_grad`` clears the model's gradients and keeps the master gradient buffers. For gradient accumulation
over micro-batches call :meth:`~MixedPrecisionOptimizerWrapper.accumulate_grads` after each ``backward``: the
half gradients are summed in the fp32 master buffers instead of in half precision.

:func:`convert_model_to_half` turns a model's parameters and buffers to float16/bfloat16, keeping
normalisation layers in float32 (inputs cast to fp32 and outputs back to the half type around them).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from . import _multi_tensor as mt
from ._core.context import StepContext, StepResult
from ._core.lean import PRECISIONS, normalize_state_dtype
from ._validation import ParameterTypeError, check_real
from ._wrapper import OptimizerWrapper, ScaledGradsFlag, _autograd_pairs, _check_pairs, _innermost
from .loss_scale import FixedLossScale, LossScale, get_loss_scale
from .loss_scale_optimizer import loss_scaled_step, scaled_apply_step, scaled_backward_step
from .optimizer import Optimizer, record_field

__all__ = ["MixedPrecisionOptimizerWrapper", "convert_model_to_half"]

_HALF = (torch.float16, torch.bfloat16)


class MixedPrecisionOptimizerWrapper(ScaledGradsFlag, OptimizerWrapper):
    """fp32 master weights and loss scaling for a half-precision model (module doc).

    Args:
        opt: the inner optimizer (optkit's, torch's, or optkit wrappers), built on the model's parameters.
        loss_scale: ``None`` (a fixed scale of 1.0, OpenSeq2Seq), a number (fixed), ``"dynamic"``,
            ``"backoff"``, ``"logmax"`` or a :class:`~optkit.loss_scale.LossScale` object.
        l2_regularization: ``λ`` of an L2 regularizer ``λ·Σw²/2`` on the half parameters, evaluated on the
            fp32 masters (OpenSeq2Seq ``mp_regularizer_wrapper``: in fp16 the gradient ``λ·w`` underflows).
        precision: ``"fp32-masters"`` (default: fp32 master copies), or ``"split"``, ``"kahan"``,
            ``"stochastic"``: no masters, the inner optkit optimizer updates the bfloat16 parameters in that
            format (module doc).
        state_dtype: ``None`` (the inner optimizer's own setting), ``"float32"``, ``"bfloat16"`` or
            ``"int8"`` (also ``"fp32"``, ``"bf16"``): how the inner optkit optimizer stores its slots.
    """

    _outermost_only = True
    #: "fp32-masters", or the master-free bfloat16 format of the inner optimizer (module doc); class defaults
    #: for wrappers pickled before the option
    precision: str = "fp32-masters"
    #: the inner optimizer's slot storage as asked (None: its own setting)
    state_dtype: str | None = None

    # the window flags, kept in the wrapper's record (torch.compile; OptimizerWrapper.__setstate__ fills it
    # for wrappers pickled before they existed; both start False):
    #: the pending accumulation folded gradients while grads_scaled was False
    _unscaled_fold = record_field("unscaled_fold")
    #: ... folded gradients from scale_loss: the fp32 parameters' gradients, which stay in their .grad through
    #: the window (and may be clipped or all-reduced in place before the step), count as scaled
    _scaled_fold = record_field("scaled_fold")

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        loss_scale: Any = None,
        *,
        l2_regularization: float | None = None,
        precision: str = "fp32-masters",
        state_dtype: str | torch.dtype | None = None,
        _masters: dict[int, Tensor] | None = None,
    ) -> None:
        scaler = FixedLossScale(1.0) if loss_scale is None else get_loss_scale(loss_scale)
        if l2_regularization is not None:
            check_real("l2_regularization", l2_regularization, where="MixedPrecisionOptimizerWrapper",
                       minimum=0.0)
        precision, state_dtype = _check_lean_options(opt, precision, state_dtype, l2_regularization)
        super().__init__(opt)
        self.precision = precision
        self.state_dtype = state_dtype
        self.loss_scaler: LossScale = scaler.to(self._device())
        self.l2_regularization = None if l2_regularization is None else float(l2_regularization)
        self._pairs: list[tuple[Tensor, Tensor]] = []  # (model half parameter, fp32 master)
        self._grad_bufs: list[Tensor] = []
        self._fp32_params: list[Tensor] = []
        self._accumulated: set[int] = set()  # pairs whose master gradient holds a pending accumulation
        # before any master replaces a parameter
        self._refuse_second_masters([p for g in self.param_groups for p in g["params"]],
                                    "MixedPrecisionOptimizerWrapper")
        self._adopt_groups(self.param_groups, _masters or {})
        if precision != "fp32-masters" or state_dtype is not None:
            inner = _innermost(self)
            lean = inner.precision if precision == "fp32-masters" else precision
            inner.engine.set_lean(lean, state_dtype)

    @property
    def _masters_on(self) -> bool:
        return self.precision == "fp32-masters"

    # ------------------------------------------------------------------------------------ masters

    def _adopt_groups(self, groups: list[dict], given: dict[int, Tensor]) -> None:
        mapping: dict[int, Tensor] = {}
        replaced = []
        for group in groups:
            ps = group["params"]
            for i, p in enumerate(ps):
                if id(p) in given:
                    self._add_pair(given[id(p)], p)
                elif p.dtype in _HALF and self._masters_on:
                    m = p.detach().to(torch.float32)
                    ps[i] = m
                    mapping[id(p)] = m
                    self._move_state(p, m)
                    self._add_pair(p, m)
                    replaced.append((p, m, group))
                else:
                    self._fp32_params.append(p)
        inner = _innermost(self)
        if replaced and isinstance(inner, Optimizer):
            # state the optimizer built on the half parameters and nothing has written since (no step, no
            # load) is built again on the masters, in fp32: the run then follows the one built on fp32
            # parameters (as ``wrap`` builds it), not one that started from half-rounded fills
            inner.engine.refill_initial_slots(replaced)
        if mapping:
            self._remap_params(mapping)

    def _add_pair(self, p: Tensor, m: Tensor) -> None:
        self._pairs.append((p, m))
        self._grad_bufs.append(torch.zeros_like(m))

    def _move_state(self, p: Tensor, m: Tensor) -> None:
        st = self.state
        if p not in st:
            return
        old = st.pop(p)
        st[m] = {k: (v.to(torch.float32) if isinstance(v, Tensor) and v.dtype in _HALF and v.shape == p.shape
                     else v) for k, v in old.items()}

    @property
    def model_params(self) -> list[Tensor]:
        """The half parameters that have masters, in master order."""
        return [p for p, _ in self._pairs]

    @property
    def master_params(self) -> list[Tensor]:
        """The fp32 masters (what ``param_groups`` holds in place of the half parameters)."""
        return [m for _, m in self._pairs]

    def master_of(self, p: Tensor) -> Tensor:
        """The fp32 master of half parameter ``p``."""
        for q, m in self._pairs:
            if q is p:
                return m
        raise ValueError("master_of(): not a half parameter of this wrapper")

    @torch.no_grad()
    def sync_masters(self) -> None:
        """Masters ← fp32(model half parameters) (after changing the model's weights yourself)."""
        if self._pairs:
            torch._foreach_copy_([mt.local(m) for _, m in self._pairs], [mt.local(p) for p, _ in self._pairs])

    @torch.no_grad()
    def _copy_back(self) -> None:
        if not self._pairs:
            return
        hp = [mt.local(p) for p, _ in self._pairs]
        ms = [mt.local(m) for _, m in self._pairs]
        for (_, dtype), (_, (lp, lm)) in mt.group_by_device_dtype(hp, ms).items():
            torch._foreach_copy_(lp, lm)
            big = float(torch.finfo(dtype).max)
            mt.clamp_(lp, -big, big)

    def finalize_variable_values(self, var_list: Sequence[Tensor] | None = None) -> None:
        """Swap the moving averages into the fp32 masters, then refresh the half parameters from them.

        ``var_list`` may name model (half) parameters; they are mapped to their masters."""
        masters = None
        if var_list is not None:
            half = {id(p): m for p, m in self._pairs}
            masters = [half.get(id(v), v) for v in var_list]
        self._inner_attr("finalize_variable_values")(masters)
        self._copy_back()

    @contextmanager
    def ema_weights(self, var_list: Sequence[Tensor] | None = None) -> Iterator[None]:
        """The inner optimizer's :meth:`optkit.Optimizer.ema_weights` on the fp32 masters, with the half
        parameters refreshed from them inside the block and restored on exit (``var_list`` may name model
        parameters)."""
        masters = None
        if var_list is not None:
            half = {id(p): m for p, m in self._pairs}
            masters = [half.get(id(v), v) for v in var_list]
        try:
            with self._inner_attr("ema_weights")(masters):
                self._copy_back()
                yield
        finally:
            self._copy_back()

    def _refuse_second_masters(self, params: list, where: str) -> None:
        """``ValueError`` when a half parameter of ``params`` already has an fp32 master (torch's "more than
        one parameter group") or is listed twice: it would get two masters that drift apart."""
        managed = {id(p) for p, _ in self._pairs}
        seen: set[int] = set()
        for i, p in enumerate(params):
            if not (isinstance(p, Tensor) and p.dtype in _HALF):
                continue
            if id(p) in managed:
                raise ValueError(f"{where}: some parameters appear in more than one parameter group "
                                 f"(params[{i}], a half-precision parameter, already has an fp32 master)")
            if id(p) in seen:
                raise ValueError(f"{where}: params[{i}], a half-precision parameter, is listed twice (it "
                                 "would get two fp32 masters that drift apart)")
            seen.add(id(p))

    def add_param_group(self, param_group: dict) -> None:
        """Add a group of model parameters; half ones get masters first.

        A half parameter that already has a master, or is listed twice in the group, raises ``ValueError``
        (torch's rule for parameters in more than one group) before anything changes."""
        g = dict(param_group)
        ps = g["params"]
        g["params"] = [ps] if isinstance(ps, Tensor) else list(ps)
        self._refuse_second_masters(g["params"], f"{type(self).__name__}.add_param_group")
        given = {}
        for i, p in enumerate(g["params"]):
            if isinstance(p, Tensor) and p.dtype in _HALF and self._masters_on:
                m = p.detach().to(torch.float32)
                given[id(m)] = p
                g["params"][i] = m
        self.optimizer.add_param_group(g)
        self._adopt_groups(self.param_groups[-1:], given)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (half and fp32 parameters) and drop any pending
        :meth:`accumulate_grads` sum; master gradient buffers are kept."""
        for j in self._accumulated:
            self._pairs[j][1].grad = None
        self._accumulated.clear()
        self._unscaled_fold = self._scaled_fold = False
        ps = [p for p, _ in self._pairs] + self._fp32_params
        if set_to_none:
            for p in ps:
                p.grad = None
        else:
            grads = [p.grad for p in ps if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)

    # --------------------------------------------------------------------------------------- step

    def scale_loss(self, loss: Tensor) -> Tensor:
        """``loss · S``: call ``backward()`` on this (it marks ``grads_scaled`` for the next ``step()``)."""
        self.grads_scaled = True
        return self.loss_scaler.scale_loss(loss)

    @property
    def loss_scale(self) -> Tensor:
        """The current loss scale ``S`` (0-d float32 tensor)."""
        return self.loss_scaler()

    def _unscaled_grads_present(self) -> bool:
        """Whether a ``step()`` without ``grads_scaled`` would divide gradients by ``S``
        (``loss_scale_optimizer.scaled_backward_step``): the pending :meth:`accumulate_grads` sum folded
        unscaled gradients, a half parameter has a gradient, or an fp32 one has one no scaled fold vouches
        for.
        The fp32 masters' own ``.grad`` does not count: it is this wrapper's reused buffer (kept after a
        step) or a sum restored with ``accumulate_grads(grads=...)``, which carries the scale it was saved
        with."""
        if self._unscaled_fold:
            return True
        return any(p.grad is not None for p, _ in self._pairs) or self._fp32_unscaled()

    def _fp32_unscaled(self) -> bool:
        """Whether an fp32 parameter holds a gradient no scaled fold vouches for. fp32 gradients stay in their
        ``.grad`` through a window; after a scaled fold they count as scaled (an unscaled backward added to
        them later cannot be told apart)."""
        return not self._scaled_fold and any(p.grad is not None for p in self._fp32_params)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step (module doc). A closure returns the unscaled loss and does not call ``backward``.
        Gradients that did not come from ``loss·S`` raise ``RuntimeError`` unless the scale is a fixed 1
        (``loss_scale_optimizer.scaled_backward_step``). When no parameter has a gradient (and no
        :meth:`accumulate_grads` sum is pending) the step changes nothing, as in ``torch.optim``: not the
        masters, the model, the inner optimizer (not called) or the scale; ``step_applied`` is False."""
        return scaled_backward_step(self, closure)

    @torch.no_grad()
    def apply_step(self, context: StepContext) -> StepResult:
        """One step under ``context`` (the step protocol as a value); as :meth:`step` without a closure."""
        return scaled_apply_step(self, context)

    @torch.no_grad()
    def accumulate_grads(self, grads: Sequence[Tensor | None] | None = None) -> None:
        """Gradient accumulation in fp32 (OpenSeq2Seq accumulates the master-precision gradients).

        Folds the model's half gradients into the masters' fp32 gradient buffers and clears them (``None``):
        ``master.grad ← fp32(p16.grad)`` on the first fold after a step, ``master.grad += fp32(p16.grad)``
        afterwards, so a sum over micro-batches never overflows or rounds in half precision. With ``grads``
        (one tensor or ``None`` per master, in :attr:`master_params` order, e.g. restored from a checkpoint)
        those are folded instead and the half gradients are left alone. The next :meth:`step` uses the
        accumulated sum (plus any half gradient that arrived since) and starts over; :meth:`zero_grad`
        drops it. fp32 parameters accumulate in their own ``.grad`` as usual. Folding the model's gradients
        while ``grads_scaled`` is False (an unscaled ``backward``) makes that :meth:`step` raise
        ``RuntimeError`` unless the scale is a fixed 1, whatever the other micro-batches of the window did;
        each fold clears ``grads_scaled``, so every micro-batch goes through :meth:`scale_loss` (or sets
        ``grads_scaled`` itself before its fold when it scaled the loss itself). Gradients given as ``grads``
        are taken to carry the scale. Without masters (a master-free ``precision``) there is no fp32 buffer:
        the gradients stay in the parameters' own ``.grad`` and only the window's flags are kept.
        """
        if grads is not None and len(grads) != len(self._pairs):
            raise ValueError(f"accumulate_grads: `grads` must hold {len(self._pairs)} entries "
                             f"(one per master), got {len(grads)}")
        copy_s, copy_d, add_s, add_d = [], [], [], []
        for j, ((p, m), buf) in enumerate(zip(self._pairs, self._grad_bufs)):
            g = p.grad if grads is None else grads[j]
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce().to_dense()
            if j in self._accumulated:
                add_s.append(mt.local(g))
                add_d.append(mt.local(buf))
            else:
                copy_s.append(mt.local(g))
                copy_d.append(mt.local(buf))
                self._accumulated.add(j)
                m.grad = buf
            if grads is None:
                p.grad = None
        for _, (_, (s, d)) in mt.group_by_device_dtype(copy_s, copy_d).items():
            torch._foreach_copy_(d, s)
        for _, (_, (s, d)) in mt.group_by_device_dtype(add_s, add_d).items():
            torch._foreach_add_(d, s)
        if grads is None:  # the model's gradients, from scale_loss or not; the next ones must say so again
            if self.grads_scaled:
                self._scaled_fold = True
            elif copy_s or add_s or self._fp32_unscaled():
                self._unscaled_fold = True
            self.grads_scaled = False

    def _wrapped_step(self, context: StepContext) -> StepResult:
        if self._accumulated:
            self.accumulate_grads()  # half gradients that arrived since the last fold
        pending, self._accumulated = self._accumulated, set()
        folds = (self._unscaled_fold, self._scaled_fold)
        self._unscaled_fold = self._scaled_fold = False
        try:
            return self._fold_and_step(pending, context)
        except BaseException:  # a step that raises keeps the window's fp32 sum for a retry
            self._accumulated |= pending
            self._unscaled_fold, self._scaled_fold = folds
            raise

    def _fold_and_step(self, pending: set[int], context: StepContext) -> StepResult:
        """The masters' gradients (the pending fp32 sums ``pending``, else the half gradients in fp32), the
        decay term, and the step; the decay term comes off again if the step raises."""
        src, dst, half_grads = [], [], []
        for j, ((p, m), buf) in enumerate(zip(self._pairs, self._grad_bufs)):
            g = p.grad
            if j in pending:
                half_grads.append(buf)  # m.grad is buf, holding the accumulated sum
            elif g is None:
                m.grad = None
            elif g.is_sparse:
                m.grad = g.coalesce().to_dense().to(torch.float32)
                half_grads.append(g)
            else:
                m.grad = buf
                src.append(mt.local(g))
                dst.append(mt.local(buf))
                half_grads.append(g)
        fp32_grads = [p.grad for p in self._fp32_params if p.grad is not None]
        if not half_grads and not fp32_grads:  # no gradient at all: a no-op (torch.optim), scale included
            self.step_applied = torch.zeros((), dtype=torch.bool, device=self._device())
            return StepResult(self.step_applied)
        for _, (_, (s, d)) in mt.group_by_device_dtype(src, dst).items():
            torch._foreach_copy_(d, s)
        scale = self.loss_scaler()
        self._add_regularization(scale)
        try:
            return self._step_masters(half_grads + fp32_grads, scale, context)
        except BaseException:
            self._add_regularization(scale, sign=-1.0)  # (the retry adds it again)
            raise

    def _add_regularization(self, scale: Tensor | None, sign: float = 1.0) -> None:
        lam = self.l2_regularization
        if not lam:
            return
        lam = sign * lam
        ms = [m for _, m in self._pairs if m.grad is not None]
        gs = [m.grad for m in ms]
        if not ms:
            return
        if scale is None:
            mt.add_scaled_(gs, ms, lam)
        else:  # g + S·λ·w (survives the division by S); one temporary per step when the option is used
            for (device, _), (_, (lg, lm)) in mt.group_by_device_dtype(gs, ms).items():
                torch._foreach_add_(lg, torch._foreach_mul(lm, (scale * lam).to(device)))

    def _step_masters(self, check_grads, scale, context: StepContext) -> StepResult:
        result = loss_scaled_step(self, self.loss_scaler, check_grads, scale, context,
                                  step_grads=self._params_with_grads()[1])
        self._copy_back()
        return result

    # --------------------------------------------------------------------------------- TF surface

    def compute_gradients(
        self, loss: Tensor | Callable[[], Tensor], var_list: Sequence[Tensor] | None = None
    ) -> list[tuple[Tensor | None, Tensor]]:
        """OpenSeq2Seq ``compute_gradients``: gradients of ``loss·S`` w.r.t. the model variables; a half
        variable's pair is ``(fp32(g)/S + λ·master, master)``, an fp32 variable's ``(g/S, v)``. ``None``
        gradients stay ``None`` (the original crashed)."""
        vs = [p for p, _ in self._pairs] + self._fp32_params if var_list is None else list(var_list)
        scale = self.loss_scaler()

        def scaled() -> Tensor:
            value = loss() if callable(loss) else loss
            if not isinstance(value, Tensor):
                raise ValueError("`loss` must be (or return) a scalar tensor")
            return value.float() * scale.to(value.device)

        pairs = _autograd_pairs(scaled, vs)
        masters = {id(p): m for p, m in self._pairs}
        inv = mt.inverse_scale(scale, [g for g, _ in pairs])  # (float64 for float64 variables)
        out: list[tuple[Tensor | None, Tensor]] = []
        with torch.no_grad():
            for g, v in pairs:
                m = masters.get(id(v))
                if g is None:
                    out.append((None, v if m is None else m))
                elif m is None:
                    out.append((mt.scaled_copies([g], inv)[0], v))
                else:
                    g32 = g.to(torch.float32)
                    if self.l2_regularization:
                        g32 = g32 + (scale * self.l2_regularization) * m
                    out.append((g32 * inv.to(torch.float32), m))
        return out

    def apply_gradients(self, grads_and_vars: Iterable[tuple[Tensor | None, Tensor]]) -> Any:
        """Apply **unscaled** gradients given for masters (or their half parameters) and fp32 variables;
        skipped when non-finite under a dynamic scale. Returns the inner ``iterations`` or
        ``step_applied``."""
        masters = {id(p): m for p, m in self._pairs}
        pairs = [(g, masters.get(id(v), v)) for g, v in grads_and_vars]
        pairs = _check_pairs(pairs, self._all_params())

        def run() -> None:
            _, grads = self._params_with_grads()
            self._step_masters(grads, None, StepContext.from_attributes(self))

        self._with_grads(pairs, run)
        return self._result()

    # -------------------------------------------------------------------------------------- state

    @classmethod
    def wrap(
        cls,
        opt_cls: Callable[..., torch.optim.Optimizer],
        params: Any,
        loss_scale: Any = None,
        *,
        l2_regularization: float | None = None,
        precision: str = "fp32-masters",
        state_dtype: str | torch.dtype | None = None,
        **kwargs: Any,
    ) -> MixedPrecisionOptimizerWrapper:
        """Build ``opt_cls(params_with_masters, **kwargs)`` on fp32 masters of the half parameters (so no
        half state is ever created) and wrap it. ``params``: tensors, ``named_parameters()`` pairs or group
        dicts; ``opt_cls`` may be any callable taking the params first (e.g. a lambda building
        ``LARC(SGD(ps, ...), 0.001)``). With a master-free ``precision`` the optimizer is built on the
        parameters themselves and then switched (constructor)."""
        if isinstance(params, Tensor):
            raise TypeError("`params` must be an iterable of tensors, (name, tensor) pairs or group dicts")
        if precision != "fp32-masters":
            _check_precision(precision)
            return cls(opt_cls(list(params), **kwargs), loss_scale, l2_regularization=l2_regularization,
                       precision=precision, state_dtype=state_dtype)
        given: dict[int, Tensor] = {}

        def conv(item: Any) -> Any:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Tensor):
                return (item[0], conv(item[1]))
            if isinstance(item, Tensor) and item.dtype in _HALF:
                m = item.detach().to(torch.float32)
                given[id(m)] = item
                return m
            return item

        converted = []
        for item in list(params):
            if isinstance(item, dict):
                g = dict(item)
                ps = g["params"]
                g["params"] = [conv(x) for x in ([ps] if isinstance(ps, Tensor) else list(ps))]
                converted.append(g)
            else:
                converted.append(conv(item))
        opt = opt_cls(converted, **kwargs)
        return cls(opt, loss_scale, l2_regularization=l2_regularization, precision=precision,
                   state_dtype=state_dtype, _masters=given)

    def _own_variables(self) -> list[Tensor]:
        sc = getattr(self.loss_scaler, "scaler", self.loss_scaler)
        return list(sc._state.values())

    def _own_config(self) -> dict:
        return {"loss_scale": {"class_name": type(self.loss_scaler).__name__,
                               "config": self.loss_scaler.get_config()},
                "l2_regularization": self.l2_regularization, "precision": self.precision,
                "state_dtype": self.state_dtype}

    def _own_state(self) -> dict[str, Any]:
        return {"masters": [m.detach().clone() for _, m in self._pairs],
                "loss_scale": self.loss_scaler.state_dict()}

    def _check_own_state(self, own: dict[str, Any]) -> None:
        """Validate the wrapper part before anything is loaded (the base class runs this before the inner
        optimizer's load): exactly ``'masters'`` and ``'loss_scale'``; one master per half parameter, each a
        dense, real floating tensor on a real device (not ``meta``) of its master's shape; the loss-scale
        state as :meth:`optkit.loss_scale.LossScale.load_state_dict` checks it (on a copy)."""
        where = f"{type(self).__name__}.load_state_dict"
        if set(own) != {"masters", "loss_scale"}:
            raise ValueError(f"{where}: wrapper part must hold 'masters' and 'loss_scale'")
        ms = own["masters"]
        if not isinstance(ms, (list, tuple)) or len(ms) != len(self._pairs):
            raise ValueError(f"{where}: expected {len(self._pairs)} masters")
        for i, (t, (_, m)) in enumerate(zip(ms, self._pairs)):
            entry = f"'masters'[{i}]"
            if not isinstance(t, Tensor):
                raise ParameterTypeError(f"{where}: {entry} must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != tuple(m.shape):
                raise ValueError(f"{where}: {entry} master shape mismatch: expected {tuple(m.shape)}, "
                                 f"got {tuple(t.shape)}")
            if t.layout != torch.strided:
                raise ValueError(f"{where}: {entry} must be a dense tensor, got layout {t.layout}")
            if t.is_meta:
                raise ValueError(f"{where}: {entry} is a meta tensor (no data)")
            if not t.is_floating_point():
                raise ParameterTypeError(f"{where}: {entry} must have a real floating dtype, got {t.dtype}")
        copy.deepcopy(self.loss_scaler).load_state_dict(own["loss_scale"])

    def _load_own_state(self, own: dict[str, Any]) -> None:
        with torch.no_grad():
            for t, (_, m) in zip(own["masters"], self._pairs):
                m.copy_(t)
        self.loss_scaler.load_state_dict(own["loss_scale"])
        self._copy_back()


# ------------------------------------------------------------------------------------------------

_PRECISIONS = ("fp32-masters",) + PRECISIONS


def _check_precision(precision: Any) -> str:
    if not isinstance(precision, str) or precision not in _PRECISIONS:
        raise ValueError(f"`precision` must be one of {list(_PRECISIONS)}, got {precision!r}")
    return precision


def _check_lean_options(opt: Any, precision: Any, state_dtype: Any,
                        l2_regularization: float | None) -> tuple[str, str | None]:
    """The wrapper's ``precision`` and ``state_dtype`` checked (nothing changed yet): known values, an
    optkit optimizer inside when either asks something of it (``TypeError``), no float16 parameter and no
    ``l2_regularization`` without masters, and no fp32 masters over an optimizer built master-free (its
    bfloat16 weights' low halves or compensations would be left behind on the masters) (``ValueError``)."""
    precision = _check_precision(precision)
    state_dtype = normalize_state_dtype(state_dtype)
    inner = _innermost(opt) if isinstance(opt, torch.optim.Optimizer) else None
    if inner is not None and not isinstance(inner, Optimizer):
        if precision != "fp32-masters":
            raise TypeError(f"`precision`={precision!r} needs an optkit optimizer inside (it updates the "
                            f"bfloat16 weights itself), got {type(inner).__name__}")
        if state_dtype is not None:
            raise TypeError(f"`state_dtype` needs an optkit optimizer inside, got {type(inner).__name__}")
    if precision == "fp32-masters" and isinstance(inner, Optimizer) and inner.precision is not None:
        raise ValueError(f"`precision`='fp32-masters' over an optimizer built with precision="
                         f"{inner.precision!r} (master-free bfloat16 weights): give the wrapper "
                         f"precision={inner.precision!r}, or build the optimizer without `precision`")
    if precision != "fp32-masters" and inner is not None:
        if any(p.dtype == torch.float16 for g in inner.param_groups for p in g["params"]):
            raise ValueError(f"`precision`={precision!r} is for bfloat16 parameters; float16 parameters "
                             "train with fp32 masters (precision='fp32-masters')")
        if l2_regularization:
            raise ValueError(f"`l2_regularization` needs fp32 masters (precision='fp32-masters'), got "
                             f"precision={precision!r}; use the optimizer's weight_decay")
    return precision, state_dtype


_NORM_TYPES: tuple[type, ...] = (
    nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm
)
if hasattr(nn, "RMSNorm"):
    _NORM_TYPES = _NORM_TYPES + (nn.RMSNorm,)


def _to_fp32_inputs(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if isinstance(a, Tensor) and a.dtype in _HALF else a for a in args)


def _make_cast_back(dtype: torch.dtype) -> Callable:
    def hook(module: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, Tensor) and out.is_floating_point():
            return out.to(dtype)
        return out
    return hook


def convert_model_to_half(
    model: nn.Module, dtype: torch.dtype = torch.float16, keep_norm_fp32: bool = True
) -> nn.Module:
    """Cast ``model``'s floating parameters and buffers to ``dtype`` (float16 or bfloat16), in place.

    With ``keep_norm_fp32`` (default) batch/layer/group/RMS normalisation layers stay float32 (OpenSeq2Seq
    keeps batch norm in fp32) and get hooks that cast their inputs to fp32 and their output back to
    ``dtype``. Returns ``model``.
    """
    if dtype not in _HALF:
        raise ValueError(f"`dtype` must be torch.float16 or torch.bfloat16, got {dtype}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module, got {type(model).__name__}")
    keep = [m for m in model.modules() if keep_norm_fp32 and isinstance(m, _NORM_TYPES)]
    kept = {id(t) for m in keep for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))}
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if id(t) not in kept and t.is_floating_point():
                t.data = t.data.to(dtype)
    for m in keep:
        m.register_forward_pre_hook(_to_fp32_inputs)
        m.register_forward_hook(_make_cast_back(dtype))
    return model
