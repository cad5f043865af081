"""``jit_compile``: the optimizer's pointwise rule run as one ``torch.compile``-d chain (decay → rule → EMA)
per param group, with every changing hyperparameter a tensor input (no recompiles), falling back to the eager
pass with one warning when compiling fails; and the compiled read-only passes wrappers ask for."""

from __future__ import annotations

import functools
import itertools
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from .chain import chain, compiled_chain, compiled_function, warn_compile_fallback

#: ``jit_compile=True`` warns before compiling a group of more tensors than this: torch.compile traces one
#: graph input per tensor (minutes at 10,000 tensors on this project's 2-core CPU)
COMPILE_WARN_TENSORS = 1000


class CompiledMixin:
    """The compiled path: the pointwise rule through ``torch.compile`` (``jit_compile=True``). A part of
    :class:`optkit.optimizer.Optimizer`."""

    def _jit_active(self) -> bool:
        """Whether this step may take the compiled path: ``jit_compile`` is on and compiling has not failed
        (after a failure the optimizer is eager for good). For rules with compiled passes of their own."""
        return self.jit_compile and self._compile_state != "failed"

    def _run_compiled(self, group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                      mult, aux, avgs=None, zero=False) -> bool:
        """Run decay → update → EMA of one group as one ``torch.compile``-d function. Hyperparameters that
        change during training (learning rate, clip/unscale factor, skip flag, EMA weight) are tensor inputs,
        so they never trigger a recompile. Returns False (after a RuntimeWarning) if compilation fails."""
        rule = type(self)._pointwise
        if rule is None:
            self._compile_state = "failed"
            warn_compile_fallback(TypeError(f"{type(self).__name__} has no pointwise update rule"))
            return False
        fn = compiled_chain()
        if fn is None:
            self._compile_state = "failed"
            warn_compile_fallback(RuntimeError("torch.compile is not available"))
            return False
        if self._compile_state == "untried" and len(params) > COMPILE_WARN_TENSORS:
            warnings.warn(
                f"jit_compile=True over {len(params)} tensors in one param group: torch.compile traces one "
                "graph input per tensor, so the first step may take minutes; for thousands of small "
                "tensors the eager step over optkit.flat_parameters() buffers is the fast path",
                RuntimeWarning, stacklevel=5)
        try:
            self._run_chain(fn, group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                            mult, aux, avgs=avgs, zero=zero)
        except Exception as err:  # compilation unavailable or failed: eager from now on
            self._compile_state = "failed"
            warn_compile_fallback(err)
            return False
        self._compile_state = "ok"
        return True

    def _compiled_pass(self, fn: Callable, n_tensors: int) -> Callable | None:
        """For a wrapper or the train op around this optimizer: ``fn`` (a read-only pass over ``n_tensors``
        plain tensors) compiled as this optimizer's own passes are, as a callable that gives None once
        compiling failed (:meth:`_call_compiled`), when ``jit_compile`` is on and has not failed, outside a
        compiled region, without DTensor parameters and for at most :data:`COMPILE_WARN_TENSORS` tensors
        (one graph input each: more would take minutes to compile); else None (take the eager pass)."""
        if not self._jit_active() or self._any_dtensor \
                or n_tensors > COMPILE_WARN_TENSORS or torch.compiler.is_compiling():
            return None
        return functools.partial(self._call_compiled, fn)

    def _call_compiled(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` compiled as the chain is (:func:`optkit._core.chain.compiled_function`), for an
        optimizer's own read-only compiled pass; None, after one ``RuntimeWarning`` and eager from then on,
        when compiling fails (such a pass writes nothing, so the eager step can follow)."""
        compiled = compiled_function(fn)
        if compiled is None:  # pragma: no cover - torch without a working compile stack
            return None
        try:
            return compiled(*args)
        except Exception as err:
            self._compile_state = "failed"
            warn_compile_fallback(err)
            return None

    @staticmethod
    def _flat_whole(plan, aux, decay_mask) -> bool:
        """Whether this step may treat the flat part as one tensor: it is active, ``_prepare`` gave every
        tensor the same entry (or none) and the decoupled decay applies to all of them or to none."""
        return plan.flat_active and (aux is None or all(map(operator.is_, aux, itertools.repeat(aux[0])))) \
            and (decay_mask is None or plan.uniform_wd is not None)

    def _run_compiled_rows(self, group, idx, flat, lr, k, found_inf, applied, aux, zero=False) -> None:
        """The compiled rule over a flat part's whole run matrices (``aux.per_run``: one ``(count, 1)``
        column entry per run, as LARS's and LAMB's :meth:`_prepare` give under ``jit_compile``): one graph
        of a few inputs whatever the number of parameters. If compiling fails, the same chain runs eagerly
        on the same runs (nothing was written) and the optimizer is eager from the next step on."""
        w, g, slots, avgs = flat.run_lists()
        if self._run_compiled(group, idx, w, g, slots, lr, k, 0.0, None, found_inf, applied, None, aux.items,
                              avgs=avgs, zero=zero):
            return
        self._run_chain(chain, group, idx, w, g, slots, lr, k, 0.0, None, found_inf, applied, None, aux.items,
                        avgs=avgs, upcast=True, zero=zero)

    def _run_chain(self, fn, group, idx, params, grads, slots, lr, k, wd, decay_mask, found_inf, applied,
                   mult, aux, avgs=None, upcast=False, zero=False) -> None:
        """decay → rule → EMA of one group through :func:`optkit._core.chain.chain` (``fn``: it, or its
        ``torch.compile``-d form), with every changing hyperparameter as a tensor input. ``avgs``: the
        averages when ``params`` are not the group's tensors (a flat part's run matrices); ``zero``: the
        chain zeroes the gradients after reading them (flat gradients that the train op clears next)."""
        rule = type(self)._pointwise

        def loc(t: Tensor) -> Tensor:
            # a 0-d tensor goes in as a (1,) view of itself: inductor drops the in-place writes to 0-d float64
            # CPU inputs (torch 2.13), so their slots and weights would never change
            t = mt.local(t)
            return t.view(1) if t.dim() == 0 else t

        slot_lists = tuple([loc(t) for t in slots[s]] for s in self._active_slots(group))
        if self.use_ema and avgs is None:
            avgs = [loc(self.state[p]["average"]) for p in params]
        dev = loc(params[0]).device
        ema_w = self._ema_weight(None).to(dev) if self.use_ema else None
        # (in the lr's dtype: float64 for a group holding float64 parameters)
        wd_t = None if decay_mask is None else mt.scalar(wd, lr.dtype, dev)
        fn(rule, self._pointwise_hyper(group), [loc(p) for p in params], [loc(g) for g in grads],
           slot_lists, avgs, lr.to(dev), None if k is None else k.to(dev), wd_t,
           None if decay_mask is None else tuple(decay_mask), ema_w,
           None if found_inf is None else found_inf.to(dev),
           None if mult is None else tuple(mult), aux, **({"upcast": True} if upcast else {}),
           **({"zero_grads": True} if zero else {}))
        if self.use_ema:
            self._ema_rest(group, idx, applied)
