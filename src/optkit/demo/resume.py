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
  inf in a single number where the run's own is finite, nor in the weights, master copies and optimizer
  slots) and then loads it into that throw-away copy, so a misfit file is reported in one line instead of
  reaching a kernel. Then it refuses values no run makes: a position past the end of the run that wrote the
  checkpoint, counters that the saved step and ``--iter-size`` cannot reach (applied updates, update
  attempts, the open window, the loss scaler's and the optimizer's counts), a loss scale outside its
  scaler's ``[min, max]``, and a mixed-precision wrapper's loss scale other than the fixed 1 it is built
  with.
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
from .config import FIELDS, FP32_MAX, ConfigError, TrainConfig, check_values, merge, same_name
from .run_folder import check_new_run_dir

__all__ = [
    "FIXED_ON_RESUME",
    "saved_config",
    "check_continuation",
    "check_progress",
    "nothing_to_do",
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
    "precision": ("--precision", same_name),
    "state_dtype": ("--state-dtype", same_name),
    "channels": ("--channels", lambda a, b: a == b),
    "freeze_variables_regex": ("--freeze-variables-regex", lambda a, b: a == b),
    "loss_scaling": ("--loss-scaling", _same_scaling),
    # the loaded scaler keeps the settings saved with its state
    "loss_scaling_params": ("--loss-scaling-param", lambda a, b: a == b),
    "ema_momentum": ("--ema-momentum", lambda a, b: (a is None) == (b is None)),
    "larc_params": ("--larc-param", lambda a, b: (a is None) == (b is None)),
    "iter_size": ("--iter-size", lambda a, b: a == b),
    "seed": ("--seed", lambda a, b: a == b),
    "test_fraction": ("--test-fraction", lambda a, b: a == b),
}
"""Options a resumed run keeps (flag, "is it the same" test): changing them would load state that does not
fit (optimizer, precision, network, trained parameters, scaler, EMA or LARC on/off, accumulation window),
would be ignored (the loaded scaler keeps its saved settings) or would evaluate on images the run trained on
(seed, test split)."""


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
    shorter than what was trained): the run would end before it starts. At the last step exactly there is
    nothing to train (:func:`nothing_to_do`)."""
    from .components import planned_steps

    total = planned_steps(cfg)[0]
    if ckpt.step > total:
        raise ConfigError(
            f"--max-steps/--epochs: {ckpt.path} is at step {ckpt.step}, past the end of this run ({total} "
            f"steps); give --max-steps {ckpt.step} or more to continue it"
        )


def nothing_to_do(ckpt: Checkpoint, cfg: TrainConfig) -> str | None:
    """The message for a continuation of ``ckpt`` that has nothing to train: the checkpoint is at the last
    step of the run ``cfg`` plans (a finished run, resumed without a longer ``--max-steps``/``--epochs``).
    Such a continuation writes nothing: the run folder keeps its ``metrics.json``, ``report.png`` and
    checkpoints, and no ``--run-dir`` is created. ``None`` when there are steps to train."""
    from .components import planned_steps

    total = planned_steps(cfg)[0]
    if ckpt.step < total:
        return None
    where = "" if ckpt.run_dir is None else f"; its results are in {ckpt.run_dir}"
    return (
        f"nothing to do: {ckpt.path} is at step {ckpt.step}, the last step of this run{where} (nothing "
        f"written; give --max-steps above {total} to train further)"
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


def _all_finite(t: Tensor, allow_inf: bool = False) -> bool:
    if not t.is_floating_point():
        return True
    return bool((~torch.isnan(t)).all()) if allow_inf else bool(torch.isfinite(t).all())


def _check_values_finite(saved: Tensor, ref: Tensor | None, where: str, allow_inf: bool = False) -> None:
    """A weight, master copy or EMA average holds finite values, another optimizer slot (``allow_inf``) no
    NaN, unless the freshly built run's own does not. A loss scaler that skips non-finite updates keeps them
    so; a run without one that diverged holds NaN, and a continuation cannot train from it. A slot may hold
    inf: a float16 second moment overflows from finite gradients (|g| > 256) and the run goes on."""
    if not _all_finite(saved, allow_inf) and (ref is None or _all_finite(ref)):
        what = "NaN" if allow_inf else "NaN or inf"
        raise _Misfit(
            f"{where} holds {what} values; a run cannot continue from non-finite weights or optimizer state"
        )


#: per-parameter entries that hold raw bits, not values (``--precision split``: the fp32 masters' low 16 bits,
#: kept in a bfloat16 tensor; any bits are valid, many read as NaN)
_RAW_BITS = frozenset({"master_low"})


def _check_leaf(saved: Any, ref: Any, where: str, key: Any, slot: bool = False) -> None:
    if isinstance(ref, Tensor) and ref.dim() > 0:
        if not isinstance(saved, Tensor):
            raise _Misfit(f"{where} should be a tensor")
        _check_tensor(saved, tuple(ref.shape), ref.dtype, where)
        if key not in _RAW_BITS:
            _check_values_finite(saved, ref, where, allow_inf=slot and key != "average")
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
                _check_leaf(value, known[slot], at, slot, slot=True)
            elif isinstance(value, Tensor) and value.dim() > 0:
                if not value.is_floating_point():
                    raise _Misfit(f"{at} is not a floating-point tensor")
                _check_tensor(value, tuple(params[index].shape), None, at)
                _check_values_finite(value, None, at, allow_inf=slot != "average")
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
        if key == "loss_scale":  # a wrapper's own scale: fixed at 1, the train op drives the loss scale
            _check_unchanged(saved, ref, where)
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


def _check_unchanged(saved: Mapping, ref: Mapping, where: str) -> None:
    """Every number of ``saved`` (already checked to have ``ref``'s layout) equals ``ref``'s: state that no
    run ever changes from what the run builds."""
    for k, r in ref.items():
        s, at = saved[k], f"{where}.{k}"
        if isinstance(r, Mapping):
            _check_unchanged(s, r, at)
            continue
        value = s.item() if isinstance(s, Tensor) else s
        expected = r.item() if isinstance(r, Tensor) else r
        if value != expected:
            raise _Misfit(f"{at} is {value!r}; a run keeps {expected!r} there (it never changes)")


def _count(value: Any) -> int:
    """A counter the library's own load has accepted (a whole number, possibly a 0-d tensor)."""
    return int(value.item()) if isinstance(value, Tensor) else int(value)


def _saved_length(ckpt: Checkpoint) -> tuple[int, int]:
    """``(steps, iter_size)`` of the run that wrote ``ckpt``, from the configuration it saved (the one a
    continuation ran with, so a longer ``--max-steps`` given on a resume is part of it)."""
    from .components import planned_steps

    saved = saved_config(ckpt)
    length = dataclasses.replace(
        TrainConfig(),
        **{k: getattr(saved, k) for k in ("max_steps", "epochs", "batch_size", "test_fraction", "iter_size")},
    )
    errors = check_values(length)
    if errors:
        raise ConfigError(
            f"--resume: {ckpt.path} is not a valid optkit checkpoint: its configuration says {errors[0]}"
        )
    return planned_steps(length)[0], length.iter_size


def _check_position(ckpt: Checkpoint) -> None:
    """The counters of a loaded (so well-typed) train op state against the checkpoint's step: the demo calls
    the train op once per step, and every ``iter_size``-th call is an update attempt."""
    total, iter_size = _saved_length(ckpt)
    step = ckpt.step
    if step > total:
        raise _Misfit(f"it is at step {step}, past the end of the run that wrote it ({total} steps)")
    attempts, micro = divmod(step, iter_size)
    at = f"at step {step} with --iter-size {iter_size}"
    state = ckpt.train_op
    counts = {k: _count(state[k]) for k in ("micro", "summary_attempts", "global_step", "host_step")}
    if counts["micro"] != micro:
        raise _Misfit(f"train_op.micro is {counts['micro']}, but {at} the open window holds {micro}")
    if counts["summary_attempts"] != attempts:
        raise _Misfit(
            f"train_op.summary_attempts is {counts['summary_attempts']}, but {at} the run has made "
            f"{attempts} update attempts"
        )
    for name in ("global_step", "host_step"):
        if counts[name] > attempts:
            raise _Misfit(
                f"train_op.{name} is {counts[name]}, but {at} the run has made at most {attempts} updates"
            )
    if micro == 0:  # a closed window: the update cleared (or zeroed) every gradient it summed
        for i, acc in enumerate(state["accumulators"]):
            if isinstance(acc, Tensor) and bool(acc.ne(0).any()):
                raise _Misfit(
                    f"train_op.accumulators[{i}] holds gradients, but {at} no accumulation window is open"
                )
    if state["host_exact"] is True and counts["global_step"] != attempts:
        raise _Misfit(
            f"train_op.global_step is {counts['global_step']}, but {at} a run that skips no update has made "
            f"{attempts}"
        )
    scaler = state["scaler"]
    for name, value in scaler.items():
        if isinstance(value, Tensor) and not value.is_floating_point() and _count(value) > attempts:
            raise _Misfit(f"train_op.scaler.{name} is {_count(value)}, but {at} the run has made {attempts} "
                          "update attempts")
    if "iteration" in scaler and "last_overflow_iteration" in scaler:
        last, it = _count(scaler["last_overflow_iteration"]), _count(scaler["iteration"])
        if last >= it:
            raise _Misfit(f"train_op.scaler.last_overflow_iteration is {last}, not before iteration {it}")
    _check_optimizer_counts(state["optimizer"], "train_op.optimizer", attempts, at)


def _check_optimizer_counts(state: Any, where: str, attempts: int, at: str) -> None:
    """Each parameter's ``step`` slot (optimizer steps taken) anywhere in the optimizer stack's state."""
    if not isinstance(state, Mapping):
        return
    for key, value in state.items():
        if key == "state" and isinstance(value, Mapping):
            for index, slots in value.items():
                step = slots.get("step") if isinstance(slots, Mapping) else None
                if _is_scalar(step) and _is_finite(step) and float(step) > attempts:
                    raise _Misfit(
                        f"{where}.state[{index}].step is {float(step):g}, but {at} the run has made "
                        f"{attempts} update attempts"
                    )
        else:
            _check_optimizer_counts(value, f"{where}.{key}", attempts, at)


def _scale_range(scaler: Any) -> tuple[float, float] | None:
    """``[min, max]`` of a loss-scale object's scale under its (loaded) hyperparameters, None if unknown."""
    inner = getattr(scaler, "scaler", scaler)  # AutomaticLossScaler: the algorithm's scaler
    if hasattr(inner, "scale_min") and hasattr(inner, "scale_max"):  # Backoff, LogMax
        return float(inner.scale_min), float(inner.scale_max)
    if hasattr(inner, "min_loss_scale"):  # DynamicLossScale (no maximum: finite in float32)
        high = inner.max_loss_scale
        return float(inner.min_loss_scale), float(FP32_MAX if high is None else high)
    if hasattr(inner, "loss_scale_value"):  # FixedLossScale
        return float(inner.loss_scale_value), float(inner.loss_scale_value)
    return None


def _check_scale(train_op: Any) -> None:
    """The loaded loss scale lies in its scaler's range (compared in float32, the scale's dtype)."""
    bounds = _scale_range(train_op.scaler)
    if bounds is None:
        return
    scale = train_op.scaler().detach().float().cpu().reshape(())
    low, high = (torch.tensor(b, dtype=torch.float32) for b in bounds)
    if not bool((low <= scale) & (scale <= high)):
        raise _Misfit(
            f"train_op.scaler.scale is {scale.item():g}, outside the scaler's range [{bounds[0]:g}, "
            f"{bounds[1]:g}]"
        )


def _one_rank(saved: Any) -> Any:
    """A train-op state saved inside an accumulation window of a data-parallel run holds every rank's
    accumulators stacked (``[world, *shape]``, with ``accumulators_present`` ``[n, world]`` and
    ``accumulators_world_size``) and item counts (``[world]``): checked for that layout, then seen as rank 0's
    row, which has the layout of
    a single process's state (the library's load then takes this rank's row and checks the world size)."""
    if not isinstance(saved, Mapping) or "accumulators_world_size" not in saved:
        return saved
    world, present, accs = (saved.get(k) for k in ("accumulators_world_size", "accumulators_present",
                                                    "accumulators"))
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise _Misfit(f"train_op.accumulators_world_size is {world!r}, not a number of processes")
    from .parallel import env_world

    if world != env_world()[1]:
        raise _Misfit(f"it was saved inside an accumulation window of {world} processes, whose partial sums "
                      f"continue only on as many: resume it with torchrun --nproc-per-node {world}")
    if not isinstance(accs, (list, tuple)):
        raise _Misfit("train_op.accumulators should be a list")
    if not isinstance(present, Tensor) or present.dtype != torch.bool \
            or tuple(present.shape) != (len(accs), world):
        raise _Misfit(f"train_op.accumulators_present should be a [{len(accs)}, {world}] bool tensor")
    rows = []
    for i, acc in enumerate(accs):
        if acc is not None and not (isinstance(acc, Tensor) and acc.dim() >= 1 and acc.shape[0] == world):
            raise _Misfit(f"train_op.accumulators[{i}] should hold {world} processes' sums")
        rows.append(None if acc is None else acc[0])
    out = {k: v for k, v in saved.items() if k not in ("accumulators_world_size", "accumulators_present")}
    out["accumulators"] = rows
    items = saved.get("items")  # each rank's item count of the window (token-weighted accumulation)
    if isinstance(items, Tensor) and items.dim() == 1:
        if items.shape[0] != world:
            raise _Misfit(f"train_op.items should hold {world} processes' counts")
        out["items"] = items[0]
    return out


def check_state_fits(ckpt: Checkpoint, model: torch.nn.Module, train_op: Any) -> None:
    """Compare ``ckpt`` with a freshly built ``model`` and ``train_op`` of the run, load it into them, then
    check the loaded values against what a run can reach (its position, counters and loss scale).

    Use throw-away objects: they are changed. ``ConfigError`` naming the file and the first misfit."""
    ref_model = model.state_dict()
    try:
        if set(ckpt.model) != set(ref_model):
            raise _Misfit(f"the model's tensors are {sorted(ckpt.model)}, the run's are {sorted(ref_model)}")
        for name, t in ref_model.items():
            _check_tensor(ckpt.model[name], tuple(t.shape), t.dtype, f"model.{name}")
            _check_values_finite(ckpt.model[name], t, f"model.{name}")
        params = [m.detach() for m in train_op.masters]
        view = _one_rank(ckpt.train_op)
        _walk(view, train_op.state_dict(), "train_op", params)
    except _Misfit as err:
        raise ConfigError(f"--resume: {ckpt.path} does not fit this run: {err}") from None
    try:
        model.load_state_dict(ckpt.model)
        train_op.load_state_dict(view)  # (the run itself loads every rank's row into its process group)
    except Exception as err:  # noqa: BLE001 - any failure to load a foreign state is the file's problem
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--resume: {ckpt.path} does not fit this run: {text}") from None
    try:
        _check_position(ckpt)
        _check_scale(train_op)
    except _Misfit as err:
        raise ConfigError(f"--resume: {ckpt.path} holds values no run makes: {err}") from None
