"""Continuing a run from a checkpoint: its configuration, what a continuation may change, where it may write,
and whether the saved state fits the train op it is loaded into (checked before anything is loaded).

* :func:`saved_config` is the checkpoint's configuration without the options a file must not decide: the
  run folder (it is where the checkpoint lies) and the pruning count (a resumed run deletes no checkpoint
  unless ``--keep-checkpoints`` is given again).
* :func:`check_continuation` refuses flags that would make the continuation another run (another optimizer,
  precision, network, loss scaling, data split...): the state would not fit, or ``metrics.json`` would claim
  a set-up that did not train the run.
* :func:`output_dir` is the run folder holding the checkpoint when it is a recognised optkit run, or a new
  folder given with ``--run-dir``; anything else is refused.
* :func:`check_state_fits` compares every tensor of the saved model and train op with a freshly built one
  (names, shapes, dtypes, the optimizer stack, one slot per parameter of the parameter's shape, no NaN or
  inf single number where the run's own is finite) and then loads it into that throw-away copy, so a misfit
  file is reported in one line instead of reaching a kernel.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .checkpoint import Checkpoint
from .config import FIELDS, ConfigError, TrainConfig, merge, same_name
from .run_folder import check_new_run_dir

__all__ = [
    "FIXED_ON_RESUME",
    "saved_config",
    "check_continuation",
    "check_progress",
    "output_dir",
    "check_state_fits",
]

_NOT_FROM_FILE = ("run_dir", "keep_checkpoints")


def saved_config(ckpt: Checkpoint) -> TrainConfig:
    """The checkpoint's configuration (unknown keys dropped), with ``run_dir`` set to the run folder holding
    the checkpoint (``None`` outside one) and ``keep_checkpoints`` 0: neither comes from the file."""
    data = {k: v for k, v in ckpt.config.items() if k in FIELDS and k not in _NOT_FROM_FILE}
    cfg = merge(TrainConfig(), data)
    run_dir = None if ckpt.run_dir is None else str(ckpt.run_dir)
    return dataclasses.replace(cfg, run_dir=run_dir, keep_checkpoints=0)


def _same_scaling(a: Any, b: Any) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return same_name(a, b)
    return a == b


FIXED_ON_RESUME: dict[str, tuple[str, Any]] = {
    "recipe": ("--recipe", same_name),
    "optimizer": ("--optimizer", same_name),
    "dtype": ("--dtype", same_name),
    "half_dtype": ("--half-dtype", same_name),
    "channels": ("--channels", lambda a, b: a == b),
    "freeze_variables_regex": ("--freeze-variables-regex", lambda a, b: a == b),
    "loss_scaling": ("--loss-scaling", _same_scaling),
    "ema_momentum": ("--ema-momentum", lambda a, b: (a is None) == (b is None)),
    "larc_params": ("--larc-param", lambda a, b: (a is None) == (b is None)),
    "iter_size": ("--iter-size", lambda a, b: a == b),
    "seed": ("--seed", lambda a, b: a == b),
    "test_fraction": ("--test-fraction", lambda a, b: a == b),
}
"""Options a resumed run keeps (flag, "is it the same" test): changing them would load state that does not
fit (optimizer, precision, network, trained parameters, scaler, EMA or LARC on/off, accumulation window) or
would evaluate on images the run trained on (seed, test split)."""


def _show(name: str, value: Any) -> str:
    if name == "ema_momentum":
        return "EMA off" if value is None else "EMA on"
    if name == "larc_params":
        return "LARC off" if value is None else "LARC on"
    return repr(value)


def check_continuation(ckpt: Checkpoint, cfg: TrainConfig) -> None:
    """Refuse a continuation of ``ckpt`` that changes any :data:`FIXED_ON_RESUME` option (``ConfigError``
    naming each flag). ``--half-dtype`` counts only under ``--dtype mixed``."""
    saved = saved_config(ckpt)
    problems = []
    for name, (flag, same) in FIXED_ON_RESUME.items():
        if name == "half_dtype" and not same_name(saved.dtype, "mixed"):
            continue
        old, new = getattr(saved, name), getattr(cfg, name)
        if not same(old, new):
            problems.append(
                f"{flag}: the run of {ckpt.path} was trained with {_show(name, old)}, not "
                f"{_show(name, new)}; a resumed run keeps it (start a new run without --resume to change it)"
            )
    if problems:
        raise ConfigError(*problems)


def check_progress(ckpt: Checkpoint, cfg: TrainConfig) -> None:
    """Refuse a checkpoint taken after the last step of the run ``cfg`` plans (``--max-steps``/``--epochs``
    shorter than what was trained): the run would end before it starts. At the last step exactly, the run
    trains nothing and reports again."""
    from .components import planned_steps

    total = planned_steps(cfg)[0]
    if ckpt.step > total:
        raise ConfigError(
            f"--max-steps/--epochs: {ckpt.path} is at step {ckpt.step}, past the end of this run ({total} "
            f"steps); give --max-steps {ckpt.step} or more to continue it"
        )


def output_dir(ckpt: Checkpoint, cfg: TrainConfig) -> tuple[Path, bool]:
    """``(folder, new)``: where the continuation of ``ckpt`` writes. The recognised run folder holding the
    checkpoint (``new`` false), or ``cfg.run_dir`` when it names another folder: then it must be new or empty
    (``new`` true). ``ConfigError`` when the checkpoint lies outside a run folder and no ``--run-dir`` is
    given."""
    if cfg.run_dir is not None:
        target = Path(cfg.run_dir).expanduser()
        if ckpt.run_dir is not None and target.exists() and target.resolve() == ckpt.run_dir.resolve():
            return ckpt.run_dir, False
        check_new_run_dir(target)
        return target, True
    if ckpt.run_dir is None:
        raise ConfigError(
            f"--resume: {ckpt.path} is not inside an optkit run folder (<run>/checkpoints/step_NNNNNN.pt "
            "next to <run>/optkit-run.json), so there is no run to continue in place; add --run-dir "
            "NEW_FOLDER to continue it in a new run folder"
        )
    return ckpt.run_dir, False


# ------------------------------------------------------------------------------------------------------------
# does the saved state fit?


class _Misfit(Exception):
    """Internal: the saved state differs from the reference at ``where``."""


def _is_scalar(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.dim() == 0
    return isinstance(value, numbers.Number)


def _is_finite(value: Any) -> bool:
    """Whether a single number (Python number or 0-d tensor) is finite; True for non-real values."""
    if isinstance(value, Tensor):
        if value.is_meta or value.layout != torch.strided:
            return False  # (no data to read: refused as not finite)
        if value.dtype == torch.bool or not (value.is_floating_point() or value.is_complex()):
            return True
        return bool(torch.isfinite(value).all())
    if isinstance(value, numbers.Complex) and not isinstance(value, bool):
        return math.isfinite(value.real) and math.isfinite(value.imag)
    return True


def _check_finite(saved: Any, ref: Any, where: str) -> None:
    """A saved single number must be finite unless the freshly built run's own value is not (a documented
    ``inf`` setting): no NaN/inf step, scale or hyperparameter reaches the continuation."""
    if not _is_finite(saved) and (ref is None or _is_finite(ref)):
        shown = saved if not isinstance(saved, Tensor) else (
            "a tensor without data" if saved.is_meta or saved.layout != torch.strided else saved.item())
        raise _Misfit(f"{where} is {shown!r}, it must be a finite number")


def _check_tensor(saved: Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, where: str) -> None:
    if saved.layout != torch.strided or saved.is_sparse:
        raise _Misfit(f"{where} is not a dense tensor")
    if saved.is_meta:
        raise _Misfit(f"{where} is a meta tensor (it holds no data)")
    if tuple(saved.shape) != tuple(shape):
        raise _Misfit(f"{where} has shape {tuple(saved.shape)}, the run needs {tuple(shape)}")
    if dtype is not None and saved.dtype != dtype:
        raise _Misfit(f"{where} has dtype {saved.dtype}, the run needs {dtype}")
    if saved.dim() > 0 and not saved.is_contiguous():
        raise _Misfit(f"{where} is not contiguous")


def _check_leaf(saved: Any, ref: Any, where: str, key: Any) -> None:
    if isinstance(ref, Tensor) and ref.dim() > 0:
        if not isinstance(saved, Tensor):
            raise _Misfit(f"{where} should be a tensor")
        _check_tensor(saved, tuple(ref.shape), ref.dtype, where)
    elif isinstance(ref, Tensor) or isinstance(ref, numbers.Number):
        if not _is_scalar(saved):
            raise _Misfit(f"{where} should be a single number")
        _check_finite(saved, ref, where)
    elif isinstance(ref, str) and key in ("type", "algorithm") and saved != ref:
        raise _Misfit(f"{where} is {saved!r}, the run has {ref!r} (another optimizer stack)")
    elif ref is not None and type(saved) is not type(ref) and not (_is_scalar(saved) and _is_scalar(ref)):
        raise _Misfit(f"{where} is a {type(saved).__name__}, the run has a {type(ref).__name__}")
    elif ref is None and _is_scalar(saved):
        _check_finite(saved, None, where)


def _check_slots(saved: Any, ref: Mapping, where: str, params: list[Tensor]) -> None:
    """Per-parameter optimizer state: one entry per parameter index, each slot a number or a tensor of the
    parameter's shape."""
    if not isinstance(saved, Mapping):
        raise _Misfit(f"{where} should be a table")
    for index, slots in saved.items():
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
            raise _Misfit(f"{where} has an entry for parameter {index!r}; the run has {len(params)}")
        if not isinstance(slots, Mapping):
            raise _Misfit(f"{where}[{index}] should be a table of slots")
        known = ref.get(index, {})
        for slot, value in slots.items():
            at = f"{where}[{index}].{slot}"
            if slot in known:
                _check_leaf(value, known[slot], at, slot)
            elif isinstance(value, Tensor) and value.dim() > 0:
                if not value.is_floating_point():
                    raise _Misfit(f"{at} is not a floating-point tensor")
                _check_tensor(value, tuple(params[index].shape), None, at)
            elif not (value is None or isinstance(value, (numbers.Number, str, Tensor))):
                raise _Misfit(f"{at} is a {type(value).__name__}")
            elif _is_scalar(value):
                _check_finite(value, None, at)


def _walk(saved: Any, ref: Any, where: str, params: list[Tensor], key: Any = None) -> None:
    if isinstance(ref, Mapping):
        if not isinstance(saved, Mapping):
            raise _Misfit(f"{where} should be a table")
        if key == "state" and all(isinstance(k, int) for k in ref) and all(isinstance(k, int) for k in saved):
            _check_slots(saved, ref, where, params)
            return
        if set(saved) != set(ref):
            extra, lacking = sorted(map(str, set(saved) - set(ref))), sorted(map(str, set(ref) - set(saved)))
            raise _Misfit(f"{where} has keys {extra} instead of {lacking} (state of another set-up)")
        for k in ref:
            _walk(saved[k], ref[k], f"{where}.{k}", params, k)
    elif isinstance(ref, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(ref):
            raise _Misfit(f"{where} should be a list of {len(ref)}")
        for i, (s, r) in enumerate(zip(saved, ref)):
            if r is None and isinstance(s, Tensor) and key == "accumulators":
                _check_tensor(s, tuple(params[i].shape), None, f"{where}[{i}]")
            else:
                _walk(s, r, f"{where}[{i}]", params, key)
    else:
        _check_leaf(saved, ref, where, key)


def check_state_fits(ckpt: Checkpoint, model: torch.nn.Module, train_op: Any) -> None:
    """Compare ``ckpt`` with a freshly built ``model`` and ``train_op`` of the run, then load it into them.

    Use throw-away objects: they are changed. ``ConfigError`` naming the file and the first misfit."""
    ref_model = model.state_dict()
    try:
        if set(ckpt.model) != set(ref_model):
            raise _Misfit(f"the model's tensors are {sorted(ckpt.model)}, the run's are {sorted(ref_model)}")
        for name, t in ref_model.items():
            _check_tensor(ckpt.model[name], tuple(t.shape), t.dtype, f"model.{name}")
        params = [m.detach() for m in train_op.masters]
        _walk(ckpt.train_op, train_op.state_dict(), "train_op", params)
    except _Misfit as err:
        raise ConfigError(f"--resume: {ckpt.path} does not fit this run: {err}") from None
    try:
        model.load_state_dict(ckpt.model)
        train_op.load_state_dict(ckpt.train_op)
    except Exception as err:  # noqa: BLE001 - any failure to load a foreign state is the file's problem
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--resume: {ckpt.path} does not fit this run: {text}") from None
