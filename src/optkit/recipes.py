"""Documented, tested training configurations.

:func:`mlperf_resnet50_lars` — the MLPerf ResNet-50 v1.5 LARS recipe of mlcommons' TensorFlow 2 reference
(``mlcommons/training``, ``image_classification/tensorflow2``: ``lars_optimizer.LARSOptimizer(lr_schedule,
momentum, weight_decay, skip_list=['batch_normalization', 'bias', 'bn'], epsilon=lars_epsilon)`` with the
``PolynomialDecayWithWarmup`` schedule of its ``lars_util.py``):

* LARS, TF 1.15 form (``a ← m·a + s·(g + wd·w); w ← w − a``), ``eeta = 0.001``, momentum 0.9, weight
  decay 1e-4 (the reference's flag default; submissions tune it), ``epsilon = 1e-7``: the reference's
  ``lars_epsilon`` flag defaults to 0, but its optimizer takes ``epsilon or backend_config.epsilon()``
  (Keras's ``1e-7``), so every reference run has ε = 1e-7 in the trust-ratio denominator
  ``‖g‖ + wd·‖w‖ + ε`` (a flag of 0 cannot turn it off). ``epsilon=0.0`` gives the earlier rounds' TF 1
  references (``tf.contrib.opt.LARSOptimizer``, whose ε = 0 is used as given). Batch-norm parameters and
  biases get no trust ratio and no weight decay (TF's ``skip_list``; in PyTorch the batch-norm parameters
  are found by module type, since their names do not say ``batch_normalization``);
* the learning rate, with ``W`` warm-up steps (``warmup_epochs·steps_per_epoch``) and ``T`` total steps
  (``epochs·steps_per_epoch``), at update ``k`` (0-based, applied updates)::

      lr(k) = base_lr·k/W                                                  k <= W (k < W when W = 0)
      lr(k) = (base_lr − end_lr)·(1 − min(k − W, D)/D)² + end_lr,  D = T − W + 1      otherwise

  (TF ``polynomial_decay`` of power 2 to ``end_lr = 1e-4``; the first update runs with lr 0), with the
  reference's defaults by global batch size: ``base_lr`` 10 and 5 warm-up epochs below 16k, 25 and 5
  below 32k, 31.2 and 25 from 32k on.

It comes in two forms over the same pieces: :func:`mlperf_resnet50_lars` returns the optimizer (its
``learning_rate`` is the schedule, evaluated at the applied-update count) and
:func:`mlperf_resnet50_lars_kwargs` returns ``optimize_loss`` keyword arguments (what ``optkit train
--recipe mlperf-lars`` is to use).
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from torch import nn

from .lars import LARS
from .param_rules import build_optimizer, param_groups
from .schedules import PolicySchedule

__all__ = ["mlperf_resnet50_lars", "mlperf_resnet50_lars_kwargs", "mlperf_lars_defaults", "LarsRecipe"]


class LarsRecipe(NamedTuple):
    """What :func:`mlperf_resnet50_lars` built."""

    optimizer: LARS
    schedule: PolicySchedule
    warmup_steps: int
    total_steps: int
    skipped: list[str]  # parameter names without trust ratio and weight decay


def mlperf_lars_defaults(batch_size: int) -> tuple[float, int]:
    """``(base_lr, warmup_epochs)`` of the MLPerf LARS reference for a global batch size."""
    _check_int("batch_size", batch_size)
    if batch_size < 16384:
        return 10.0, 5
    if batch_size < 32768:
        return 25.0, 5
    return 31.2, 25


def _check_int(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"`{name}` must be >= {low}, got {value!r}")
    return int(value)


def _check_float(name: str, value: Any, low: float = 0.0, open_low: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a number, got {value!r}")
    if value < low or (open_low and value == low):
        raise ValueError(f"`{name}` must be {'>' if open_low else '>='} {low}, got {value!r}")
    return float(value)


def _skipped_names(model: nn.Module, skip_list: Sequence[str] | None) -> list[str]:
    """Names of the parameters LARS skips: those of batch-norm modules and every ``*bias`` (or, with
    ``skip_list``, TF's rule: names containing one of its strings)."""
    if skip_list is not None:
        if isinstance(skip_list, str) or not all(isinstance(s, str) for s in skip_list):
            raise TypeError(f"`skip_list` must be a list of strings, got {skip_list!r}")
        return [n for n, _ in model.named_parameters() if any(s in n for s in skip_list)]
    bn = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            bn.update(f"{mod_name}.{p}" if mod_name else p for p, _ in mod.named_parameters(recurse=False))
    return [n for n, _ in model.named_parameters() if n in bn or n.endswith("bias")]


def mlperf_resnet50_lars_kwargs(
    model: nn.Module,
    batch_size: int,
    epochs: int,
    steps_per_epoch: int,
    *,
    base_lr: float | None = None,
    warmup_epochs: int | None = None,
    end_lr: float = 1e-4,
    momentum: float = 0.9,
    weight_decay: float = 1e-4,
    eeta: float = 0.001,
    epsilon: float = 1e-7,
    skip_list: Sequence[str] | None = None,
) -> dict[str, Any]:
    """``optimize_loss`` keyword arguments for the recipe (module doc): ``optimizer="LARS"``,
    ``optimizer_params``, ``learning_rate_decay_fn`` (the schedule), ``rules`` (batch norm and biases
    excluded from adaptation, which for LARS also drops their decay) and ``no_decay_1d=False``; ``epsilon``
    defaults to the reference's effective 1e-7 (module doc; 0 for the TF 1 references). Use as
    ``optimize_loss(loss, model=model, **mlperf_resnet50_lars_kwargs(model, ...), ...)``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"`model` must be an nn.Module, got {type(model).__name__}")
    _check_int("batch_size", batch_size)
    epochs = _check_int("epochs", epochs)
    steps_per_epoch = _check_int("steps_per_epoch", steps_per_epoch)
    default_lr, default_warmup = mlperf_lars_defaults(batch_size)
    base_lr = default_lr if base_lr is None else _check_float("base_lr", base_lr, open_low=True)
    warmup_epochs = default_warmup if warmup_epochs is None else _check_int("warmup_epochs", warmup_epochs, 0)
    end_lr = _check_float("end_lr", end_lr)
    if end_lr > base_lr:
        raise ValueError(f"`end_lr` ({end_lr}) must be <= `base_lr` ({base_lr})")
    if warmup_epochs >= epochs:
        raise ValueError(f"`warmup_epochs` ({warmup_epochs}) must be < `epochs` ({epochs})")
    total = epochs * steps_per_epoch
    warm = warmup_epochs * steps_per_epoch
    schedule = PolicySchedule("poly_decay", learning_rate=base_lr, decay_steps=total - warm + 1, power=2.0,
                              begin_decay_at=warm, min_lr=end_lr, warmup_steps=warm)
    skipped = _skipped_names(model, skip_list)
    rules = []
    if skipped:
        pattern = "^(?:" + "|".join(re.escape(n) for n in skipped) + ")$"
        rules.append((pattern, {"exclude_from_adaptation": True}))
    params = {"momentum": _check_float("momentum", momentum), "weight_decay": _check_float(
        "weight_decay", weight_decay), "eeta": _check_float("eeta", eeta), "epsilon": _check_float(
        "epsilon", epsilon)}
    return {"optimizer": "LARS", "optimizer_params": params, "learning_rate_decay_fn": schedule,
            "rules": rules, "no_decay_1d": False}


def mlperf_resnet50_lars(
    model: nn.Module,
    batch_size: int,
    epochs: int,
    steps_per_epoch: int,
    **options: Any,
) -> LarsRecipe:
    """The MLPerf ResNet-50 LARS optimizer and schedule for ``model`` (module doc; ``options`` as in
    :func:`mlperf_resnet50_lars_kwargs`: ``base_lr``, ``warmup_epochs``, ``end_lr``, ``momentum``,
    ``weight_decay``, ``eeta``, ``epsilon``, ``skip_list``). The optimizer's learning rate is the schedule;
    call ``step()`` once per update (no scheduler needed)."""
    kw = mlperf_resnet50_lars_kwargs(model, batch_size, epochs, steps_per_epoch, **options)
    schedule = kw["learning_rate_decay_fn"]
    groups = param_groups(model, kw["rules"] or None, no_decay_1d=False)
    opt = build_optimizer(LARS, groups, schedule, **kw["optimizer_params"])
    skipped = [n for g in opt.param_groups if g.get("skip_list") == [""] for n in g["param_names"]]
    warm = int(schedule.params["warmup_steps"])
    return LarsRecipe(opt, schedule, warm, epochs * steps_per_epoch, skipped)
