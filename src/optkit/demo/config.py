"""The training demo's configuration: one table of options, readable from TOML and from command-line flags.

Every option is a field of :class:`TrainConfig`. The same field is

* a key of a TOML file given with ``--config`` (tables for the dict options, e.g. ``[optimizer_params]``);
* a command-line flag (``learning_rate`` -> ``--learning-rate``; dict options take repeatable
  ``KEY=VALUE`` flags, e.g. ``--optimizer-param momentum=0.9``).

Precedence: built-in defaults < TOML file < flags (another ``optimizer`` or ``lr_policy`` without its
parameters starts them afresh, see :func:`merge`). For a dict option the flags update the keys one by one;
``none`` clears it first (``--larc-param none`` turns LARC off, ``--optimizer-param none
--optimizer-param momentum=0.9`` replaces the optimizer's arguments).

:func:`validate` checks every value before any work starts (types, ranges, names of optimizers, policies,
loss-scaling algorithms and summaries, the optimizer's and the policy's parameter names, LARC vs clipping) and
raises :class:`ConfigError` with one message per problem found.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

__all__ = ["TrainConfig", "ConfigError", "parse_value", "parse_assignment", "load_toml", "merge", "validate"]


class ConfigError(ValueError):
    """A bad configuration value; the message names the option (as flag and as TOML key)."""


def _opt(default: Any, help: str, group: str, **extra: Any) -> Any:
    """A dataclass field carrying its help text and flag group (used to build the argparse parser)."""
    meta = {"help": help, "group": group, **extra}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)  # fresh copy
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Everything ``optkit train`` does, with the defaults of the embedded demo run."""

    # -- what optimize_loss gets ----------------------------------------------------------------------------
    optimizer: str = _opt(
        "LARS",
        "optimizer name from optkit's registry (OPTIMIZER_CLS_NAMES: SGD, Momentum, Adam, AdamW, Adagrad, "
        "RMSProp, Ftrl, LARS)",
        "optimize_loss",
    )
    optimizer_params: dict = _opt(
        {"momentum": 0.9, "eeta": 0.01, "weight_decay": 1e-4},
        "constructor arguments of the optimizer (the learning rate comes from the policy; choosing another "
        "optimizer starts them empty)",
        "optimize_loss",
        metavar="KEY=VALUE",
        flag="--optimizer-param",
    )
    ema_momentum: float | None = _opt(
        0.98,
        "keep an exponential moving average of the weights with this momentum and evaluate with it "
        "(sets the optimizer's use_ema/ema_momentum; 'none' turns EMA off; off by default for optimizers "
        "without EMA, such as Momentum or Adam)",
        "optimize_loss",
        nullable=True,
    )
    lr_policy: str = _opt(
        "poly_decay",
        "learning-rate policy (fixed_lr, piecewise_constant, exp_decay, poly_decay, cosine_decay, "
        "inv_poly_decay, transformer_policy)",
        "optimize_loss",
    )
    lr_policy_params: dict = _opt(
        {"learning_rate": 2.0, "warmup_steps": 30, "power": 2.0, "min_lr": 1e-4},
        "parameters of the policy (another policy keeps only learning_rate); decay_steps defaults to the "
        "run's length minus begin_decay_at (OpenSeq2Seq's rule)",
        "optimize_loss",
        metavar="KEY=VALUE",
        flag="--lr-policy-param",
    )
    dtype: str = _opt(
        "mixed",
        "precision of the model (mixed: a half-precision model with fp32 master weights)",
        "optimize_loss",
        choices=("float32", "float16", "bfloat16", "mixed"),
    )
    half_dtype: str = _opt(
        "float16", "the model's precision under dtype=mixed", "optimize_loss", choices=("float16", "bfloat16")
    )
    clip_gradients: float | None = _opt(
        2.0, "clip gradients to this global L2 norm (not together with LARC)", "optimize_loss", nullable=True
    )
    larc_params: dict | None = _opt(
        None,
        "LARC: larc_eta, larc_mode (clip|scale), min_update, epsilon; 'none' disables LARC",
        "optimize_loss",
        metavar="KEY=VALUE",
        flag="--larc-param",
        nullable=True,
    )
    loss_scaling: str | float = _opt(
        "Backoff",
        "a number for a static loss scale, or Backoff, LogMax or dynamic (TF) for automatic scaling",
        "optimize_loss",
    )
    loss_scaling_params: dict | None = _opt(
        {"scale_max": 2.0**24, "step_window": 100},
        "parameters of the automatic loss scaler (scale_min, scale_max, step_factor, step_window, ...)",
        "optimize_loss",
        metavar="KEY=VALUE",
        flag="--loss-scaling-param",
        nullable=True,
    )
    iter_size: int = _opt(1, "accumulate gradients over this many batches per update", "optimize_loss")
    freeze_variables_regex: str | None = _opt(
        None,
        "train only the parameters whose names (e.g. 0.weight, 8.bias) do not match this regular expression "
        "at their start (OpenSeq2Seq's option; becomes optimize_loss's var_list)",
        "optimize_loss",
        nullable=True,
    )
    bucket_numel: int = _opt(
        1 << 22, "elements per all-reduce bucket when averaging gradients under torchrun", "optimize_loss"
    )
    summaries: list = _opt(
        ["learning_rate", "global_gradient_norm", "loss_scale"],
        "optimize_loss summaries written to TensorBoard (comma-separated, from OPTIMIZER_SUMMARIES)",
        "optimize_loss",
        metavar="NAME,NAME",
    )

    # -- data, model, length --------------------------------------------------------------------------------
    epochs: int = _opt(12, "passes over the training split", "training")
    max_steps: int | None = _opt(
        None, "stop after this many batches instead (overrides epochs)", "training", nullable=True
    )
    batch_size: int = _opt(
        64, "global batch size (split evenly over the processes under torchrun)", "training"
    )
    test_fraction: float = _opt(0.2, "fraction of the digits held out as the test split", "training")
    channels: int = _opt(
        16, "width of the CNN (channels of the first conv; the second has twice as many)", "training"
    )
    seed: int = _opt(0, "seed for the split, the initial weights and the batch order", "training")
    threads: int = _opt(
        1,
        "torch CPU threads per process (one is fastest for this small network: more threads only add "
        "synchronisation to its tiny kernels; under torchrun each process takes one core)",
        "training",
    )

    # -- outputs --------------------------------------------------------------------------------------------
    run_dir: str | None = _opt(
        None, "folder for this run (default: runs/<date>-<time>)", "outputs", nullable=True
    )
    eval_every: int = _opt(25, "evaluate test accuracy every N steps (and at the end)", "outputs")
    log_every: int = _opt(5, "record metrics and refresh the progress bar every N steps", "outputs")
    checkpoint_every: int = _opt(100, "save a checkpoint every N steps (and at the end)", "outputs")
    keep_checkpoints: int = _opt(3, "how many recent checkpoints to keep (0 keeps all)", "outputs")
    progress: bool = _opt(True, "show a progress bar", "outputs")
    tensorboard: bool = _opt(True, "write TensorBoard event files", "outputs")
    plot: bool = _opt(True, "write report.png at the end", "outputs")


FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(TrainConfig)}
DICT_FIELDS = ("optimizer_params", "lr_policy_params", "larc_params", "loss_scaling_params")


# ------------------------------------------------------------------------------------------------------------
# parsing values


def parse_value(text: str) -> Any:
    """A flag value as TOML would read it: ``3`` -> int, ``0.1``/``1e-3`` -> float, ``true`` -> bool,
    ``[1, 2]`` -> list, ``none`` -> None, anything else the string itself."""
    s = text.strip()
    if s.lower() in ("none", "null"):
        return None
    if s.lower() in ("true", "false"):
        return s.lower() == "true"
    if tomllib is not None:
        try:
            return tomllib.loads(f"v = {s}")["v"]
        except tomllib.TOMLDecodeError:
            pass
    try:
        return float(s)  # also "inf", "nan": validation rejects them where they make no sense
    except ValueError:
        return s


def parse_assignment(text: str, where: str) -> tuple[str, Any]:
    """``"key=value"`` -> ``(key, parse_value(value))``; ``ConfigError`` naming ``where`` otherwise."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or not key.replace("_", "").isalnum():
        raise ConfigError(f"{where}: expected KEY=VALUE, got {text!r}")
    return key, parse_value(value)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML config file; unknown keys and unreadable files raise ``ConfigError``."""
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise ConfigError("--config needs Python >= 3.11 (tomllib) or the tomli package")
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file not found: {p}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config: {p} is not valid TOML: {err}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"--config: unknown key(s) {unknown} in {p}; valid keys: {sorted(FIELDS)}")
    return data


def merge(
    base: TrainConfig,
    updates: Mapping[str, Any],
    dict_ops: Mapping[str, list[tuple[str, Any] | None]] | None = None,
) -> TrainConfig:
    """``base`` with ``updates`` replacing whole fields, then ``dict_ops`` applied to dict fields in order:
    ``(key, value)`` sets one key, ``None`` clears the dict (to ``None`` for optional dicts, else ``{}``).

    Parameters belong to their optimizer and policy: when ``updates`` switches to another optimizer without
    giving ``optimizer_params`` these start empty, and another policy without ``lr_policy_params`` keeps only
    ``learning_rate`` (``dict_ops`` then apply on top).
    """
    values = {name: getattr(base, name) for name in FIELDS}
    for name, value in updates.items():
        if name not in FIELDS:
            raise ConfigError(f"unknown option {name!r}")
        values[name] = dict(value) if isinstance(value, Mapping) else value
    if values["optimizer"] != base.optimizer and "optimizer_params" not in updates:
        values["optimizer_params"] = {}
    if values["lr_policy"] != base.lr_policy and "lr_policy_params" not in updates:
        kept = base.lr_policy_params if isinstance(base.lr_policy_params, Mapping) else {}
        values["lr_policy_params"] = {k: v for k, v in kept.items() if k == "learning_rate"}
    for name, ops in (dict_ops or {}).items():
        value = values[name]
        for op in ops:
            if op is None:
                value = None if FIELDS[name].metadata.get("nullable") else {}
            else:
                value = {**(value or {}), op[0]: op[1]}
        values[name] = value
    return TrainConfig(**values)


# ------------------------------------------------------------------------------------------------------------
# validation


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _label(name: str) -> str:
    return f"{_flag(name)} ({name})"


def _number(
    errors: list[str],
    name: str,
    value: Any,
    *,
    integer: bool = False,
    low: float | None = None,
    low_open: bool = False,
    high: float | None = None,
    nullable: bool = False,
) -> None:
    if value is None and nullable:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or (integer and not isinstance(value, numbers.Integral))
    ):
        kind = "an integer" if integer else "a number"
        errors.append(f"{_label(name)} must be {kind}, got {value!r}")
        return
    if not math.isfinite(value):
        errors.append(f"{_label(name)} must be finite, got {value!r}")
    elif low is not None and (value < low or (low_open and value == low)):
        errors.append(f"{_label(name)} must be {'>' if low_open else '>='} {low}, got {value!r}")
    elif high is not None and value > high:
        errors.append(f"{_label(name)} must be <= {high}, got {value!r}")


def validate(cfg: TrainConfig) -> None:
    """Check every option; raise :class:`ConfigError` listing all problems. Cheap: builds no model."""
    errors: list[str] = []
    for name, kw in {
        "epochs": dict(integer=True, low=1),
        "max_steps": dict(integer=True, low=1, nullable=True),
        "batch_size": dict(integer=True, low=1),
        "test_fraction": dict(low=0.0, low_open=True, high=0.9),
        "channels": dict(integer=True, low=1),
        "seed": dict(integer=True, low=0),
        "threads": dict(integer=True, low=1),
        "eval_every": dict(integer=True, low=1),
        "log_every": dict(integer=True, low=1),
        "checkpoint_every": dict(integer=True, low=1),
        "keep_checkpoints": dict(integer=True, low=0),
        "bucket_numel": dict(integer=True, low=1),
        "iter_size": dict(integer=True, low=1),
        "clip_gradients": dict(low=0.0, low_open=True, nullable=True),
        "ema_momentum": dict(low=0.0, high=1.0, nullable=True),
    }.items():
        _number(errors, name, getattr(cfg, name), **kw)
    for name in ("progress", "tensorboard", "plot"):
        if not isinstance(getattr(cfg, name), bool):
            errors.append(f"{_label(name)} must be true or false, got {getattr(cfg, name)!r}")
    for name in ("optimizer", "lr_policy", "dtype", "half_dtype"):
        if not isinstance(getattr(cfg, name), str):
            errors.append(f"{_label(name)} must be a string, got {getattr(cfg, name)!r}")
    choices = {n: FIELDS[n].metadata["choices"] for n in ("dtype", "half_dtype")}
    for name, allowed in choices.items():
        if isinstance(getattr(cfg, name), str) and getattr(cfg, name) not in allowed:
            errors.append(f"{_label(name)} must be one of {', '.join(allowed)}, got {getattr(cfg, name)!r}")
    for name in DICT_FIELDS:
        value = getattr(cfg, name)
        nullable = FIELDS[name].metadata.get("nullable", False)
        if not (isinstance(value, dict) or (value is None and nullable)):
            errors.append(f"{_label(name)} must be a table of KEY=VALUE pairs, got {value!r}")
    if not isinstance(cfg.summaries, list) or not all(isinstance(s, str) for s in cfg.summaries):
        errors.append(f"{_label('summaries')} must be a list of names, got {cfg.summaries!r}")
    if cfg.freeze_variables_regex is not None:
        try:
            re.compile(cfg.freeze_variables_regex)
        except (re.error, TypeError) as err:
            errors.append(f"{_label('freeze_variables_regex')} is not a valid regular expression: {err}")
    if not isinstance(cfg.run_dir, (str, type(None))):
        errors.append(f"{_label('run_dir')} must be a path, got {cfg.run_dir!r}")
    if isinstance(cfg.loss_scaling, bool) or not isinstance(cfg.loss_scaling, (str, numbers.Real)):
        errors.append(
            f"{_label('loss_scaling')} must be a number or Backoff/LogMax, got {cfg.loss_scaling!r}"
        )
    elif isinstance(cfg.loss_scaling, numbers.Real):
        _number(errors, "loss_scaling", cfg.loss_scaling, low=0.0, low_open=True)
    if cfg.clip_gradients is not None and cfg.larc_params is not None:
        errors.append(
            "--clip-gradients and LARC cannot be used together (OpenSeq2Seq forbids it): "
            "pass --larc-param none to turn LARC off, or drop --clip-gradients"
        )
    if not errors:
        from .components import check_components, planned_steps  # registry, policies, scalers

        errors.extend(check_components(cfg, planned_steps(cfg)[1]))
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
