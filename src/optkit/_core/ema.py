"""Exponential moving averages of the parameters (Keras ``use_ema``): ``avg ← avg + (1 − μ)·(w − avg)`` after
each applied update (the first copies ``w``), the ``ema_overwrite_frequency`` overwrite, ``ema_weights()`` and
``finalize_variable_values()``, and the averages of module buffers (``ema_buffers``)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from .state_dict import (
    check_loaded_slot,
)


def ema_rate(count: Tensor, momentum: float, warmup: bool, dtype: torch.dtype) -> Tensor:
    """The EMA's lerp weight for the update after ``count`` applied ones (Keras ``use_ema``), computed in
    ``dtype``: 1 for the first (the average starts as the weights), else ``1 − μ``, with ``ema_warmup``
    ``μ = min(momentum, (1 + k)/(10 + k))`` (TF's ``ExponentialMovingAverage(num_updates=k)``), else
    ``μ = momentum``. ``count``: a 0-d int64 tensor, the device count or the host's on the CPU."""
    first = (count == 0).to(dtype)
    if warmup:
        k = count.to(dtype)
        mu = torch.clamp((1.0 + k) / (10.0 + k), max=momentum)
        return first + (1.0 - first) * (1.0 - mu)
    return first + (1.0 - first) * (1.0 - momentum)


def _rate_dtype(device: torch.device) -> torch.dtype:
    """The dtype :func:`ema_rate` is computed in on ``device`` (float64 where the device has it)."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


@functools.lru_cache(maxsize=256)
def _host_rate(count: int, momentum: float, warmup: bool, dtype: torch.dtype) -> float:
    """:func:`ema_rate` of a host count, by the same ops on a CPU tensor (so the same bits as on the
    device), as a float."""
    return ema_rate(torch.tensor(count, dtype=torch.int64), momentum, warmup, dtype).item()


class EmaMixin:
    """The parameters' moving averages (Keras ``use_ema``). A part of
    :class:`optkit.optimizer.Optimizer`."""

    def _ema_rest(self, group: dict, idx: list[int], applied: Tensor | None) -> None:
        """EMA over the group's parameters that took no part in this step's dense pass (Keras averages every
        variable, with or without a gradient)."""
        if len(idx) == len(group["params"]):  # every parameter took part (indices are distinct)
            return
        have = set(idx)
        rest = [i for i in range(len(group["params"])) if i not in have]
        if rest:
            self._ema_group(group, rest, applied)

    @staticmethod
    def _collect_ema_buffers(source: Any, use_ema: bool) -> list[tuple[str, Tensor]]:
        """``ema_buffers`` as ``[(name, buffer)]``: a module's floating-point buffers, or the given pairs."""
        if source is None:
            return []
        if not use_ema:
            raise ValueError("`ema_buffers` needs `use_ema=True`")
        if isinstance(source, torch.nn.Module):
            pairs = [(n, b) for n, b in source.named_buffers() if b.is_floating_point()]
        elif isinstance(source, Tensor) or isinstance(source, (str, bytes)):
            raise TypeError("`ema_buffers` must be an nn.Module or (name, tensor) pairs")
        else:
            pairs = list(source)
            for item in pairs:
                if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                        and isinstance(item[1], Tensor) and item[1].is_floating_point()):
                    raise TypeError(f"`ema_buffers` entries must be (name, floating-point tensor) pairs, "
                                    f"got {item!r}")
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError("`ema_buffers`: duplicate names")
        return pairs

    def _ema_weight(self, applied: Tensor | None) -> Tensor:
        """The weight of this step's EMA lerp as a 0-d device tensor (:func:`ema_rate` of the device count),
        times ``applied`` (0 on a skipped step: the averages keep their bits)."""
        w = ema_rate(self._iterations, self.ema_momentum, self.ema_warmup, _rate_dtype(self._state_device))
        return w if applied is None else w * applied

    def _ema_lerp_weight(self, applied: Tensor | None) -> float | Tensor:
        """The weight of this step's EMA lerps: a float when the host knows it without reading the device
        (no skip flag this step, ``applied`` None; the host's count exact, :meth:`_host_count_exact`; not
        traced, nor captured into a CUDA graph, whose replays would keep a host value), which torch's
        multi-tensor ``lerp`` takes as one kernel per (device, dtype); else :meth:`_ema_weight`. The float is
        :func:`ema_rate` of the host count by the same ops in the same precision, so both give the same
        bits (:func:`optkit._multi_tensor.lerp_group_`)."""
        if applied is not None or torch.compiler.is_compiling() or mt.capturing(self._state_device) \
                or not self._host_count_exact():
            return self._ema_weight(applied)
        k = self._host_iterations
        return _host_rate(k if self.ema_warmup else min(k, 1), self.ema_momentum, self.ema_warmup,
                          _rate_dtype(self._state_device))

    def _ema_group(self, group: dict, indices: list[int], applied: Tensor | None) -> None:
        ps = [group["params"][i] for i in indices]
        avgs = [mt.local(self.state[p]["average"]) for p in ps]
        # (a master-free bfloat16 weight's average is float32: optkit._core.lean)
        lps = [lp if lp.dtype == a.dtype else lp.to(a.dtype) for lp, a in zip(map(mt.local, ps), avgs)]
        mt.lerp_(avgs, lps, self._ema_lerp_weight(applied))

    def _overwrite_with_averages(self, weight: Tensor | None) -> None:
        ps = [p for g in self.param_groups for p in g["params"]]
        lean = [p for p in ps if self._weight_form(p) is not None]
        if lean:  # (their float32 averages become their masters: optkit._core.lean)
            self._lean_overwrite(lean, weight)
            ps = [p for p in ps if self._weight_form(p) is None]
        avgs = [self.state[p]["average"] for p in ps] + self._ema_buffer_avgs
        ps += [b for _, b in self._ema_buffers]
        lp, la = [mt.local(p) for p in ps], [mt.local(a) for a in avgs]
        if not lp:
            return
        if weight is None:
            torch._foreach_copy_(lp, la)
        else:
            mt.lerp_(lp, la, weight)

    def finalize_variable_values(self, var_list: Sequence[Tensor] | None = None) -> None:
        """With EMA on, set every parameter (or those in ``var_list``) to its moving average (one way: see
        :meth:`ema_weights` to evaluate with the averages and continue training)."""
        if not self.use_ema:
            return
        ps = self._with_averages(var_list, "finalize_variable_values")
        with torch.no_grad():
            if ps:
                torch._foreach_copy_([mt.local(p) for p in ps],
                                     [mt.local(self.state[p]["average"]) for p in ps])
            if var_list is None and self._ema_buffers:
                torch._foreach_copy_([mt.local(b) for _, b in self._ema_buffers],
                                     [mt.local(a) for a in self._ema_buffer_avgs])

    def _refuse_inside_ema_weights(self) -> None:
        """``RuntimeError`` inside an :meth:`ema_weights` block (a step there would train the averages); the
        steps of wrappers and train ops over this optimizer ask first, before they change anything."""
        if self._ema_swapped:
            raise RuntimeError("step() inside ema_weights(): the parameters hold their moving averages; "
                               "leave the block before training on")

    def _with_averages(self, var_list: Sequence[Tensor] | None, where: str) -> list[Tensor]:
        ps = self._all_params() if var_list is None else list(var_list)
        for p in ps:
            if p not in self.state or "average" not in self.state[p]:
                raise ValueError(f"{where}(): variable has no moving average")
        return ps

    @contextmanager
    def ema_weights(self, var_list: Sequence[Tensor] | None = None) -> Iterator[None]:
        """Inside the ``with`` block every parameter (or those in ``var_list``) holds its moving average; on
        exit, also after an exception, the training weights come back bit for bit. For evaluation and
        checkpoints of the averaged model in the middle of training; ``step()`` inside the block raises.

        Costs one copy of the parameters. The ``ema_buffers`` are swapped as well (without ``var_list``).
        ``ValueError`` without ``use_ema=True``."""
        if not self.use_ema:
            raise ValueError("ema_weights(): the optimizer keeps no moving averages (use_ema=False)")
        if self._ema_swapped:
            raise RuntimeError("ema_weights(): already inside an ema_weights() block")
        chosen = self._with_averages(var_list, "ema_weights")  # (a generator is read once)
        ps = [mt.local(p) for p in chosen]
        avgs = [mt.local(self.state[p]["average"]) for p in chosen]
        if var_list is None:  # the registered buffers (BatchNorm statistics) too
            ps += [mt.local(b) for _, b in self._ema_buffers]
            avgs += [mt.local(a) for a in self._ema_buffer_avgs]
        with torch.no_grad():
            saved = [p.detach().clone(memory_format=torch.preserve_format) for p in ps]
            if ps:
                torch._foreach_copy_(ps, avgs)
        self._ema_swapped = True
        try:
            yield
        finally:
            with torch.no_grad():
                if ps:
                    torch._foreach_copy_(ps, saved)
            self._ema_swapped = False

    def _check_ema_buffers(self, saved: Any) -> list[Tensor] | None:
        """The saved buffer averages in this optimizer's order, checked (``ValueError`` naming the buffer);
        None when there are none to load (saved without them: the averages restart from the buffers)."""
        if saved is None:
            return None
        if not self._ema_buffers:
            raise ValueError("load_state_dict: the state holds 'ema_buffers' but this optimizer averages no "
                             "buffers (pass ema_buffers=...)")
        if not isinstance(saved, dict) or set(saved) != {n for n, _ in self._ema_buffers}:
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            want = sorted(n for n, _ in self._ema_buffers)
            raise ValueError(f"load_state_dict: 'ema_buffers' must hold {want}, got {got}")
        out = []
        for n, b in self._ema_buffers:  # (the checks of a loaded slot: dense, real floating, data, shape)
            check_loaded_slot(f"{type(self).__name__}.load_state_dict", n, "average", b, saved[n])
            out.append(saved[n])
        return out
