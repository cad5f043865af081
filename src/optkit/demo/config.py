"""The training demo's configuration: one table of options, readable from TOML and from command-line flags.

This is the bottom layer of the demo: it knows the options and their values, and nothing of torch or of the
library (``components`` turns a configuration into library objects, ``validation`` runs every check).

Every option is a field of :class:`TrainConfig`. The same field is

* a key of a TOML file given with ``--config`` (tables for the dict options, e.g. ``[optimizer_params]``);
* a command-line flag (``learning_rate`` -> ``--learning-rate``; dict options take repeatable
  ``KEY=VALUE`` flags, e.g. ``--optimizer-param momentum=0.9``).

Precedence: built-in defaults < TOML file < flags (another ``optimizer``, ``lr_policy`` or ``loss_scaling``
without its parameters starts them afresh, see :func:`merge`). For a dict option the flags update the keys
one by one; ``none`` clears it first (``--larc-param none`` turns LARC off, ``--optimizer-param none
--optimizer-param momentum=0.9`` replaces the optimizer's arguments). Names (optimizer, policy, loss-scaling
algorithm, dtypes) are matched without regard to letter case, as :func:`optkit.get_optimizer` does.

:func:`check_values` checks the types and ranges of every value (cheap, no library import) and returns one
message per problem; :class:`ConfigError` carries them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
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

__all__ = [
    "TrainConfig",
    "ConfigError",
    "FIELDS",
    "DICT_FIELDS",
    "LOSS_SCALING_DEFAULTS",
    "default_loss_scaling_params",
    "same_name",
    "max_threads",
    "parse_value",
    "parse_assignment",
    "load_toml",
    "merge",
    "check_values",
]


class ConfigError(ValueError):
    """A bad configuration value, or an input the command refuses; the message names the flag or the file.

    ``problems`` lists every problem found (one line each); ``str(err)`` is that line when there is one, and a
    count followed by the lines when there are several.
    """

    def __init__(self, *problems: str) -> None:
        self.problems = [" ".join(str(p).split()) for p in problems] or ["invalid configuration"]
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems:\n" + "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(text)


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
    recipe: str | None = _opt(
        None,
        "a documented training recipe from optkit.recipes, which sets --optimizer, --optimizer-param, "
        "--lr-policy and --lr-policy-param (the other options apply as given). mlperf-lars: the MLPerf "
        "ResNet-50 LARS recipe (LARS in its TF 1.15 form, eeta 0.001, epsilon 1e-7 as in mlcommons' TF2 "
        "reference, momentum 0.9, weight decay 1e-4, no trust ratio and no decay on biases and normalisation "
        "parameters, poly-2 decay to 1e-4 after 5 warm-up epochs, base learning rate 10 below a batch of "
        "16k); 'none' for no recipe",
        "optimize_loss",
        choices=("mlperf-lars",),
        metavar="NAME|none",
        nullable=True,
    )
    optimizer: str = _opt(
        "LARS",
        "optimizer name from optkit's registry (OPTIMIZER_CLS_NAMES: SGD, Momentum, Adam, AdamW, Adagrad, "
        "RMSProp, Ftrl, LARS, LAMB, Lion; any letter case)",
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
    no_decay_1d: bool = _opt(
        False,
        "group the parameters by name (optkit.param_groups) and take weight decay off the 1-D ones "
        "(biases, normalisation scales), as optimize_loss(rules=[], no_decay_1d=True)",
        "optimize_loss",
    )
    ema_momentum: float | None = _opt(
        0.98,
        "keep an exponential moving average of the weights with this momentum and evaluate with it "
        "(sets the optimizer's use_ema/ema_momentum; 'none' turns EMA off; every registry optimizer keeps "
        "one)",
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
    precision: str | None = _opt(
        None,
        "weights of a bfloat16 model: fp32-masters (fp32 master copies, MixedPrecisionOptimizerWrapper), or "
        "no masters: split (the fp32 master's low 16 bits kept beside the weight, 2 B/param: the fp32 "
        "trajectory exactly), kahan (a bfloat16 compensation, 2 B/param) or stochastic (stochastic rounding, "
        "0 B); sets the model to bfloat16 (--dtype mixed or bfloat16 only; fp32-masters: --dtype mixed); "
        "'none': as --dtype says",
        "optimize_loss",
        choices=("fp32-masters", "split", "kahan", "stochastic"),
        metavar="NAME|none",
        nullable=True,
    )
    state_dtype: str | None = _opt(
        None,
        "how the optimizer stores its slots (momentum, moments, accumulators): fp32, bf16, or int8 (8 bits "
        "with block-wise scales, for tensors of 4096 elements and more; the others fp32); 'none': like the "
        "weights it updates (fp32 under --precision)",
        "optimize_loss",
        choices=("fp32", "bf16", "int8"),
        metavar="NAME|none",
        nullable=True,
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
        "a number for a static loss scale, or Backoff, LogMax or dynamic (TF) for automatic scaling "
        "(any letter case)",
        "optimize_loss",
    )
    loss_scaling_params: dict | None = _opt(
        {"scale_max": 2.0**24, "step_window": 100},
        "parameters of the automatic loss scaler (Backoff: scale_min, scale_max, step_factor, step_window; "
        "LogMax: scale_min, scale_max, log_max, beta1, beta2, overflow_std_dev; dynamic: initial_loss_scale, "
        "increment_period, multiplier, ...); another --loss-scaling starts from that algorithm's defaults",
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
    seed: int = _opt(
        0, "seed for the split, the initial weights and the batch order (0 .. 2**32-1)", "training"
    )
    threads: int = _opt(
        1,
        "torch CPU threads per process (one is fastest for this small network: more threads only add "
        "synchronisation to its tiny kernels; under torchrun each process takes one core; at most 4 per "
        "CPU core)",
        "training",
    )

    # -- outputs --------------------------------------------------------------------------------------------
    run_dir: str | None = _opt(
        None,
        "folder for this run: a new or empty folder (default: a fresh runs/<date>-<time>); with --resume, a "
        "new folder to continue the checkpoint in",
        "outputs",
        nullable=True,
    )
    eval_every: int = _opt(25, "evaluate test accuracy every N steps (and at the end)", "outputs")
    log_every: int = _opt(5, "record metrics and refresh the progress bar every N steps", "outputs")
    checkpoint_every: int = _opt(100, "save a checkpoint every N steps (and at the end)", "outputs")
    keep_checkpoints: int = _opt(
        3,
        "how many recent checkpoints of this run to keep (0 keeps all; a resumed run deletes none unless "
        "this is given again)",
        "outputs",
    )
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
    """Read a TOML config file; unknown keys and unreadable files raise ``ConfigError`` naming the file."""
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
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config: cannot read {p}: {getattr(err, 'strerror', None) or err}") from None
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ConfigError(f"--config: unknown key(s) {unknown} in {p}; valid keys: {sorted(FIELDS)}")
    return data


# ------------------------------------------------------------------------------------------------------------
# merging


LOSS_SCALING_DEFAULTS: dict[str, dict[str, Any]] = {
    "backoff": {"scale_max": 2.0**24, "step_window": 100},
    "logmax": {"scale_max": 2.0**24},
    "dynamic": {"initial_loss_scale": 2.0**24, "increment_period": 100},
}
"""The demo's parameters for each automatic loss-scaling algorithm: every one starts at 2^24, so a run shows
the scale backing off to what float16 gradients bear, and the growing ones try a larger scale every 100 clean
updates. A static (numeric) loss scale takes no parameters."""


def default_loss_scaling_params(loss_scaling: Any) -> dict[str, Any] | None:
    """The demo's parameters for ``loss_scaling`` (``None`` for a static scale, ``{}`` for an unknown name,
    which validation then reports)."""
    if isinstance(loss_scaling, str):
        return dict(LOSS_SCALING_DEFAULTS.get(loss_scaling.strip().lower(), {}))
    return None


def same_name(a: Any, b: Any) -> bool:
    """Whether two option values name the same thing: strings without regard to letter case (the registry's
    rule), numbers when both are numbers (any two static loss scales), anything else when equal."""
    if isinstance(a, str) and isinstance(b, str):
        return a.strip().lower() == b.strip().lower()
    if _is_number(a) and _is_number(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - exotic values from a file: treat as different
        return False


def merge(
    base: TrainConfig,
    updates: Mapping[str, Any],
    dict_ops: Mapping[str, list[tuple[str, Any] | None]] | None = None,
) -> TrainConfig:
    """``base`` with ``updates`` replacing whole fields, then ``dict_ops`` applied to dict fields in order:
    ``(key, value)`` sets one key, ``None`` clears the dict (to ``None`` for optional dicts, else ``{}``).

    Parameters belong to their optimizer, policy and loss-scaling algorithm: when ``updates`` switches to
    another optimizer without giving ``optimizer_params`` these start empty, another policy without
    ``lr_policy_params`` keeps only ``learning_rate``, and another loss scaling without
    ``loss_scaling_params`` starts from :data:`LOSS_SCALING_DEFAULTS` (``dict_ops`` then apply on top). Names
    are compared without regard to letter case (``lars`` is ``LARS``).
    """
    values = {name: getattr(base, name) for name in FIELDS}
    for name, value in updates.items():
        if name not in FIELDS:
            raise ConfigError(f"unknown option {name!r}")
        values[name] = dict(value) if isinstance(value, Mapping) else value
    if not same_name(values["optimizer"], base.optimizer) and "optimizer_params" not in updates:
        values["optimizer_params"] = {}
    if not same_name(values["lr_policy"], base.lr_policy) and "lr_policy_params" not in updates:
        kept = base.lr_policy_params if isinstance(base.lr_policy_params, Mapping) else {}
        values["lr_policy_params"] = {k: v for k, v in kept.items() if k == "learning_rate"}
    if not same_name(values["loss_scaling"], base.loss_scaling) and "loss_scaling_params" not in updates:
        values["loss_scaling_params"] = default_loss_scaling_params(values["loss_scaling"])
    elif _is_number(values["loss_scaling"]) and "loss_scaling_params" not in updates:
        values["loss_scaling_params"] = None  # a static scale takes no parameters
    for name, ops in (dict_ops or {}).items():
        value = values[name]
        for op in ops:
            if op is None:
                value = None if FIELDS[name].metadata.get("nullable") else {}
            else:
                value = {**(value if isinstance(value, Mapping) else {}), op[0]: op[1]}
        values[name] = value
    return TrainConfig(**values)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------------------
# checking values (types and ranges; the library-side checks are in ``validation``)

FP16_MAX = 65504.0
FP32_MAX = 3.4028234663852886e38


def max_threads() -> int:
    """The largest ``--threads`` accepted: 4 per CPU core this process may use (at least 4)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return 4 * max(1, cores)


def _flag(name: str) -> str:
    return FIELDS[name].metadata.get("flag", f"--{name.replace('_', '-')}")


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
    why_high: str = "",
) -> None:
    if value is None and nullable:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or (integer and not isinstance(value, numbers.Integral))
    ):
        kind = "an integer" if integer else "a number"
        errors.append(f"{_label(name)} must be {kind}, got {_short(value)}")
        return
    if not math.isfinite(value):
        errors.append(f"{_label(name)} must be finite, got {value!r}")
    elif low is not None and (value < low or (low_open and value == low)):
        errors.append(f"{_label(name)} must be {'>' if low_open else '>='} {low}, got {value!r}")
    elif high is not None and value > high:
        shown = str(high) if isinstance(high, int) else f"{high:g}"
        errors.append(f"{_label(name)} must be <= {shown}{why_high}, got {value!r}")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _integer_ranges() -> dict[str, tuple[int, int, str]]:
    """``name -> (low, high, reason for high)`` of the integer options; the upper bounds keep every value
    inside what torch and the host can take (a seed beyond 64 bits, a billion threads)."""
    return {
        "epochs": (1, 100_000, ""),
        "max_steps": (1, 10**9, ""),
        "batch_size": (1, 1_000_000, ""),
        "channels": (1, 256, " (the network grows with its square)"),
        "seed": (0, 2**32 - 1, ""),
        "threads": (1, max_threads(), " (4 per CPU core of this machine)"),
        "eval_every": (1, 10**9, ""),
        "log_every": (1, 10**9, ""),
        "checkpoint_every": (1, 10**9, ""),
        "keep_checkpoints": (0, 1_000_000, ""),
        "bucket_numel": (1, 2**40, ""),
        "iter_size": (1, 1_000_000, ""),
    }


def _check_numbers(cfg: TrainConfig, errors: list[str]) -> None:
    for name, (low, high, why) in _integer_ranges().items():
        nullable = bool(FIELDS[name].metadata.get("nullable"))
        _number(
            errors,
            name,
            getattr(cfg, name),
            integer=True,
            low=low,
            high=high,
            nullable=nullable,
            why_high=why,
        )
    _number(errors, "test_fraction", cfg.test_fraction, low=0.0, low_open=True, high=0.9)
    _number(errors, "ema_momentum", cfg.ema_momentum, low=0.0, high=1.0, nullable=True)
    fp16 = isinstance(cfg.dtype, str) and cfg.dtype.strip().lower() == "float16"
    _number(
        errors,
        "clip_gradients",
        cfg.clip_gradients,
        low=0.0,
        low_open=True,
        nullable=True,
        high=FP16_MAX if fp16 else FP32_MAX,
        why_high=" (the largest float16 number: under --dtype float16 the gradients are float16, so a larger "
        "norm cannot occur; use --dtype mixed or --clip-gradients none)"
        if fp16
        else " (the largest float32 number)",
    )


def _check_names(cfg: TrainConfig, errors: list[str]) -> None:
    for name in ("optimizer", "lr_policy", "dtype", "half_dtype"):
        if not isinstance(getattr(cfg, name), str):
            errors.append(f"{_label(name)} must be a name (a string), got {_short(getattr(cfg, name))}")
    recipes = FIELDS["recipe"].metadata["choices"]
    recipe = cfg.recipe.strip().lower() if isinstance(cfg.recipe, str) else cfg.recipe
    if recipe is not None and recipe not in recipes:
        allowed = ", ".join(recipes)
        errors.append(f"{_label('recipe')} must be one of {allowed} or none, got {_short(cfg.recipe)}")
    for name in ("dtype", "half_dtype"):
        allowed = FIELDS[name].metadata["choices"]
        value = getattr(cfg, name)
        if isinstance(value, str) and value.strip().lower() not in allowed:
            errors.append(f"{_label(name)} must be one of {', '.join(allowed)}, got {value!r}")
    for name in ("precision", "state_dtype"):
        allowed = FIELDS[name].metadata["choices"]
        value = getattr(cfg, name)
        if value is not None and not (isinstance(value, str) and value.strip().lower() in allowed):
            errors.append(f"{_label(name)} must be one of {', '.join(allowed)} or none, got {_short(value)}")
    _check_precision(cfg, errors)
    if isinstance(cfg.loss_scaling, bool) or not isinstance(cfg.loss_scaling, (str, numbers.Real)):
        errors.append(
            f"{_label('loss_scaling')} must be a number or Backoff/LogMax/dynamic, "
            f"got {_short(cfg.loss_scaling)}"
        )
    elif isinstance(cfg.loss_scaling, numbers.Real):
        _number(
            errors,
            "loss_scaling",
            cfg.loss_scaling,
            low=0.0,
            low_open=True,
            high=FP32_MAX,
            why_high=" (the largest float32 number)",
        )


def _check_precision(cfg: TrainConfig, errors: list[str]) -> None:
    """``--precision`` trains a bfloat16 model: it goes with ``--dtype mixed`` (the default) or, without
    masters, ``--dtype bfloat16``."""
    precision, dtype = cfg.precision, cfg.dtype
    if not (isinstance(precision, str) and isinstance(dtype, str)):
        return
    precision, dtype = precision.strip().lower(), dtype.strip().lower()
    if precision == "fp32-masters" and dtype != "mixed":
        errors.append(f"{_label('precision')} fp32-masters is --dtype mixed with bfloat16 weights, got "
                      f"--dtype {dtype}")
    elif precision in ("split", "kahan", "stochastic") and dtype not in ("mixed", "bfloat16"):
        errors.append(f"{_label('precision')} {precision} trains a bfloat16 model without fp32 masters "
                      f"(--dtype bfloat16 or mixed), got --dtype {dtype}")


def _check_containers(cfg: TrainConfig, errors: list[str]) -> None:
    for name in ("progress", "tensorboard", "plot", "no_decay_1d"):
        if not isinstance(getattr(cfg, name), bool):
            errors.append(f"{_label(name)} must be true or false, got {_short(getattr(cfg, name))}")
    for name in DICT_FIELDS:
        value = getattr(cfg, name)
        nullable = FIELDS[name].metadata.get("nullable", False)
        if not (isinstance(value, dict) or (value is None and nullable)):
            errors.append(f"{_label(name)} must be a table of KEY=VALUE pairs, got {_short(value)}")
        elif isinstance(value, dict) and not all(isinstance(k, str) for k in value):
            errors.append(f"{_label(name)} must have names as keys, got {_short(value)}")
    if not isinstance(cfg.summaries, list) or not all(isinstance(s, str) for s in cfg.summaries):
        errors.append(f"{_label('summaries')} must be a list of names, got {_short(cfg.summaries)}")
    if cfg.freeze_variables_regex is not None:
        if not isinstance(cfg.freeze_variables_regex, str):
            errors.append(
                f"{_label('freeze_variables_regex')} must be a regular expression (a string), "
                f"got {_short(cfg.freeze_variables_regex)}"
            )
        else:
            try:
                re.compile(cfg.freeze_variables_regex)
            except re.error as err:
                errors.append(f"{_label('freeze_variables_regex')} is not a valid regular expression: {err}")
    if not isinstance(cfg.run_dir, (str, type(None))) or cfg.run_dir == "":
        errors.append(f"{_label('run_dir')} must be a path, got {_short(cfg.run_dir)}")


def check_values(cfg: TrainConfig) -> list[str]:
    """Every type and range problem of ``cfg``, one message per problem, each naming its flag (and TOML key).
    Cheap: imports nothing of the library; :func:`optkit.demo.validation.validate` adds the library's
    checks."""
    errors: list[str] = []
    _check_numbers(cfg, errors)
    _check_names(cfg, errors)
    _check_containers(cfg, errors)
    if isinstance(cfg.optimizer_params, dict):
        for key in ("use_ema", "ema_momentum"):
            if key in cfg.optimizer_params:  # --ema-momentum sets both, and evaluation follows it
                errors.append(f"{_label('optimizer_params')} must not set {key}: the EMA of the weights is "
                              f"{_label('ema_momentum')} (a momentum, or none for off)")
        for key in ("precision", "state_dtype"):
            if key in cfg.optimizer_params:  # the flags set them (and the model's dtype with them)
                errors.append(f"{_label('optimizer_params')} must not set {key}: give {_label(key)}")
    if cfg.clip_gradients is not None and cfg.larc_params is not None:
        errors.append(
            "--clip-gradients and LARC cannot be used together (OpenSeq2Seq forbids it): "
            "pass --larc-param none to turn LARC off, or drop --clip-gradients"
        )
    return errors
