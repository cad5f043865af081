"""How a :class:`~optkit.demo.config.TrainConfig` becomes library objects: the learning-rate schedule, the
optimizer arguments and the :func:`optkit.optimize_loss` train op.

The layer above ``config`` (which knows only option values): this module asks the library. :func:`canonical`
spells names as the registries do (``lars`` -> ``LARS``); :func:`check_components` runs every library
look-up and constructor on throw-away inputs (a one-parameter model, the demo's network) and evaluates the
learning-rate schedule over the run, so that a bad optimizer name, policy, parameter or loss-scaling setting
is reported with the flag it came from before any data is loaded or any file is written.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .config import FP32_MAX, TrainConfig

__all__ = [
    "canonical",
    "check_schedule",
    "trained_parameters",
    "HALF_DTYPES",
    "accepted_arguments",
    "planned_steps",
    "model_dtype",
    "policy_params",
    "optimizer_params",
    "build_schedule_for",
    "build_train_op",
    "check_components",
    "apply_recipe",
    "recipe_kwargs",
]

HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPES = {"float32": torch.float32, **HALF_DTYPES}


def planned_steps(cfg: TrainConfig) -> tuple[int, int]:
    """``(batches, updates)`` of the whole run: ``max_steps`` or ``epochs`` passes over the training split,
    and the optimizer updates they make (one per ``iter_size`` batches)."""
    from .data import train_size

    if cfg.max_steps is not None:
        batches = cfg.max_steps
    else:
        batches = cfg.epochs * math.ceil(train_size(cfg.test_fraction) / cfg.batch_size)
    return batches, max(1, batches // cfg.iter_size)


def model_dtype(cfg: TrainConfig) -> torch.dtype:
    """The precision the model's parameters are stored in (half under ``mixed``)."""
    if cfg.dtype == "mixed":
        return HALF_DTYPES[cfg.half_dtype]
    return _DTYPES[cfg.dtype]


def loss_dtype_arg(cfg: TrainConfig) -> torch.dtype | str:
    """The ``dtype`` argument of ``optimize_loss``."""
    return "mixed" if cfg.dtype == "mixed" else _DTYPES[cfg.dtype]


def policy_params(cfg: TrainConfig, total_updates: int) -> dict[str, Any]:
    """The policy's parameters with OpenSeq2Seq's default injection (its ``Model.compile``): when the
    policy takes ``decay_steps`` and it is not given, decay over the whole run after ``begin_decay_at``
    (itself raised to ``warmup_steps`` when the policy has both)."""
    from optkit.lr_policies import get_policy

    params = dict(cfg.lr_policy_params)
    sig = inspect.signature(get_policy(cfg.lr_policy)).parameters
    if "decay_steps" in sig and "decay_steps" not in params:
        if "begin_decay_at" in sig:
            if "warmup_steps" in sig:
                params["begin_decay_at"] = max(
                    params.get("begin_decay_at") or 0, params.get("warmup_steps") or 0
                )
            begin = params.get("begin_decay_at") or 0
        else:
            begin = 0
        params["decay_steps"] = max(1, total_updates - begin)
    return params


def optimizer_params(cfg: TrainConfig) -> dict[str, Any]:
    """The optimizer's constructor arguments, with ``--ema-momentum`` folded in."""
    params = dict(cfg.optimizer_params)
    if cfg.ema_momentum is not None:
        params.update(use_ema=True, ema_momentum=float(cfg.ema_momentum))
    return params


def build_schedule_for(cfg: TrainConfig, total_updates: int) -> Callable[[Any], Any]:
    """The run's learning-rate schedule (a :class:`~optkit.PolicySchedule`)."""
    from optkit.schedules import PolicySchedule

    return PolicySchedule(cfg.lr_policy, **policy_params(cfg, total_updates))


def trained_parameters(cfg: TrainConfig, model: nn.Module) -> list[tuple[str, Tensor]]:
    """``model``'s named parameters minus those ``freeze_variables_regex`` matches (``re.match``, a prefix
    match, as OpenSeq2Seq); the frozen ones get ``requires_grad=False``. ``ValueError`` if nothing is left."""
    pattern = None if cfg.freeze_variables_regex is None else re.compile(cfg.freeze_variables_regex)
    trained = []
    for name, p in model.named_parameters():
        if pattern is not None and pattern.match(name):
            p.requires_grad_(False)
        else:
            trained.append((name, p))
    if not trained:
        names = ", ".join(n for n, _ in model.named_parameters())
        raise ValueError(f"--freeze-variables-regex freezes every parameter ({names})")
    return trained


def _recipe_shape(cfg: TrainConfig) -> tuple[int, int, int]:
    """``(global batch per update, epochs, updates per epoch)`` the recipe is sized with: the run's planned
    updates cut into epochs of the training split (the last one partial under ``--max-steps``)."""
    from .data import train_size

    per_epoch = max(1, math.ceil(train_size(cfg.test_fraction) / cfg.batch_size) // cfg.iter_size)
    return cfg.batch_size * cfg.iter_size, math.ceil(planned_steps(cfg)[1] / per_epoch), per_epoch


def recipe_kwargs(cfg: TrainConfig, model: nn.Module) -> dict[str, Any]:
    """``optimize_loss`` keyword arguments of ``cfg.recipe`` for ``model`` (``{}`` without a recipe)."""
    if cfg.recipe is None:
        return {}
    from optkit.recipes import mlperf_resnet50_lars_kwargs

    return mlperf_resnet50_lars_kwargs(model, *_recipe_shape(cfg))


def apply_recipe(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """``cfg`` with its recipe spelled canonically and written out into ``optimizer``, ``optimizer_params``,
    ``lr_policy`` and ``lr_policy_params`` (so that ``--print-config``, the run's summary and
    ``metrics.json`` show what trains), and one message per problem (a run too short for the recipe's
    warm-up). Idempotent: a resumed run's saved configuration expands to itself."""
    if cfg.recipe is None:
        return cfg, []
    recipe = cfg.recipe.strip().lower()
    cfg = dataclasses.replace(cfg, recipe=recipe)
    try:
        kw = recipe_kwargs(cfg, nn.Module())
    except ValueError as err:
        batch, epochs, per_epoch = _recipe_shape(cfg)
        return cfg, [
            f"--recipe: {recipe} does not fit a run of {epochs} epoch(s) of {per_epoch} update(s) at batch "
            f"{batch}: {_first_line(err)}"
        ]
    policy = kw["learning_rate_decay_fn"].get_config()
    return dataclasses.replace(
        cfg,
        optimizer=kw["optimizer"],
        optimizer_params=dict(kw["optimizer_params"]),
        lr_policy=policy.pop("policy"),
        lr_policy_params=policy,
    ), []


def build_train_op(
    cfg: TrainConfig,
    model: nn.Module,
    total_updates: int,
    *,
    distributed: bool = False,
    summary_writer: Any = None,
) -> Any:
    """``optimize_loss`` for ``model`` on the cross-entropy of its logits, with every option of ``cfg``."""
    from optkit.train import optimize_loss

    def loss(x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(model(x).float(), y)

    scaling = cfg.loss_scaling
    grouping: dict[str, Any] = {}
    if cfg.recipe is not None:
        grouping["rules"] = recipe_kwargs(cfg, model)["rules"]
    if cfg.no_decay_1d:
        grouping.setdefault("rules", [])
    if grouping:
        grouping["no_decay_1d"] = cfg.no_decay_1d
    return optimize_loss(
        loss,
        cfg.optimizer,
        optimizer_params(cfg),
        learning_rate_decay_fn=build_schedule_for(cfg, total_updates),
        dtype=loss_dtype_arg(cfg),
        precision=cfg.precision,
        state_dtype=cfg.state_dtype,
        clip_gradients=cfg.clip_gradients,
        summaries=list(cfg.summaries),
        larc_params=None if cfg.larc_params is None else dict(cfg.larc_params),
        loss_scaling=scaling,
        loss_scaling_params=None
        if cfg.loss_scaling_params is None or isinstance(scaling, (int, float))
        else dict(cfg.loss_scaling_params),
        on_horovod=distributed,
        iter_size=cfg.iter_size,
        var_list=trained_parameters(cfg, model),
        model=model,
        bucket_numel=cfg.bucket_numel,
        summary_writer=summary_writer,
        summary_every=cfg.log_every,
        **grouping,
    )


def accepted_arguments(cls: type) -> set[str] | None:
    """The keyword arguments ``cls(params, learning_rate=..., **kw)`` really uses: the named parameters of
    each ``__init__`` along the MRO while they forward ``**kwargs``, ending at optkit's base ``Optimizer``
    (whose ``**hyper`` is plumbing for subclasses, not user options). ``None`` when it cannot be told."""
    from optkit.optimizer import Optimizer as OptkitOptimizer

    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            ps = list(inspect.signature(init).parameters.values())
        except (TypeError, ValueError):  # pragma: no cover - builtins
            return None
        names |= {
            p.name
            for p in ps[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and not p.name.startswith("_")
        }
        if klass is OptkitOptimizer or not any(p.kind is p.VAR_KEYWORD for p in ps):
            return names - {"params", "hyper", "learning_rate", "lr"}
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _registry_key(name: str, keys: Any) -> str | None:
    wanted = name.strip().lower()
    return next((k for k in keys if k.lower() == wanted), None)


def canonical(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """``cfg`` with its names spelled as the registries spell them (names are matched without regard to
    letter case, as :func:`optkit.get_optimizer` does) and its recipe written out (:func:`apply_recipe`),
    and one message per unknown name or misfit recipe."""
    from optkit.lr_policies import LR_POLICIES
    from optkit.registry import OPTIMIZER_CLS_NAMES

    cfg, errors = apply_recipe(cfg)
    changes: dict[str, Any] = {}
    optimizer = _registry_key(cfg.optimizer, OPTIMIZER_CLS_NAMES)
    if optimizer is None:
        errors.append(
            f"--optimizer: unknown optimizer {cfg.optimizer!r}; choose from "
            f"{', '.join(sorted(OPTIMIZER_CLS_NAMES))} (any letter case)"
        )
    else:
        changes["optimizer"] = optimizer
    policy = _registry_key(cfg.lr_policy, LR_POLICIES)
    if policy is None:
        errors.append(
            f"--lr-policy: unknown learning-rate policy {cfg.lr_policy!r}; choose from "
            f"{', '.join(sorted(LR_POLICIES))}"
        )
    else:
        changes["lr_policy"] = policy
    if isinstance(cfg.loss_scaling, str):
        scaling = _registry_key(cfg.loss_scaling, ("Backoff", "LogMax", "dynamic"))
        if scaling is None:
            errors.append(
                f"--loss-scaling: unknown loss scaling {cfg.loss_scaling!r}; give a number (a static scale) "
                "or one of Backoff, LogMax, dynamic (any letter case)"
            )
        else:
            changes["loss_scaling"] = scaling
    changes["dtype"] = cfg.dtype.strip().lower()
    changes["half_dtype"] = cfg.half_dtype.strip().lower()
    for name in ("precision", "state_dtype"):
        if isinstance(getattr(cfg, name), str):
            changes[name] = getattr(cfg, name).strip().lower()
    # --precision sets the model: bfloat16 with fp32 masters (fp32-masters) or without (the others)
    if changes.get("precision") == "fp32-masters":
        changes.update(dtype="mixed", half_dtype="bfloat16")
    elif changes.get("precision") is not None:
        changes["dtype"] = "bfloat16"
    return dataclasses.replace(cfg, **changes), errors


def _sample_steps(params: dict[str, Any], total_updates: int, count: int = 400) -> list[int]:
    """Steps at which to evaluate a schedule: evenly spaced over the run plus every boundary the parameters
    name (warm-up end, decay start and end), each with its neighbours."""
    total = max(1, total_updates)
    steps = {round(i * total / count) for i in range(count + 1)}
    for key in ("warmup_steps", "begin_decay_at", "decay_steps"):
        value = params.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            edge = int(value) + (int(params.get("begin_decay_at") or 0) if key == "decay_steps" else 0)
            steps |= {edge - 1, edge, edge + 1}
    return sorted(s for s in steps if 0 <= s <= total)


def check_schedule(cfg: TrainConfig, total_updates: int) -> list[str]:
    """Evaluate the run's learning-rate schedule over its updates: every value must be a finite float32
    number >= 0 (huge ``learning_rate`` or ``power`` values overflow; the policy functions themselves accept
    any finite argument)."""
    import torch

    params = policy_params(cfg, total_updates)
    schedule = build_schedule_for(cfg, total_updates)
    shown = ", ".join(f"{k}={v}" for k, v in cfg.lr_policy_params.items())
    for step in _sample_steps(params, total_updates):
        try:
            lr = schedule(step)
            value = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
        except (ArithmeticError, ValueError, TypeError) as err:  # OverflowError, ZeroDivisionError, ...
            return [f"--lr-policy-param: {cfg.lr_policy}({shown}) fails at update {step}: {_first_line(err)}"]
        if not (math.isfinite(value) and 0.0 <= value <= FP32_MAX):
            return [
                f"--lr-policy-param: {cfg.lr_policy}({shown}) gives the learning rate {value!r} at update "
                f"{step}; it must be a finite float32 number >= 0 (is a parameter too large?)"
            ]
    return []


def _probe_optimizer(cfg: TrainConfig, errors: list[str]) -> None:
    from optkit.registry import get_optimizer

    cls = get_optimizer(cfg.optimizer)
    params = optimizer_params(cfg)
    for key in ("learning_rate", "lr"):
        if key in params:
            errors.append(
                f"--optimizer-param: {key} comes from the learning-rate policy; set it with "
                f"--lr-policy-param learning_rate=..."
            )
    accepted = accepted_arguments(cls)
    unknown = sorted(set(params) - accepted - {"learning_rate", "lr"}) if accepted is not None else []
    if unknown:
        errors.append(
            f"--optimizer-param: unknown parameter(s) {unknown} for {cfg.optimizer}; accepted: "
            f"{', '.join(sorted(accepted or ()))}"
        )
    if any(e.startswith("--optimizer-param") for e in errors):
        return
    try:
        cls([("probe", nn.Parameter(torch.ones(2)))], learning_rate=0.1, **params)
    except Exception as err:  # noqa: BLE001 - whatever the constructor rejects, the user's values caused it
        errors.append(f"--optimizer-param: {cfg.optimizer} rejects {params}: {_first_line(err)}")


def _probe_schedule(cfg: TrainConfig, total_updates: int, errors: list[str]) -> None:
    from optkit.schedules import PolicySchedule

    try:
        PolicySchedule(cfg.lr_policy, **policy_params(cfg, total_updates))
    except Exception as err:  # noqa: BLE001 - the policy's parameters come from the user
        errors.append(f"--lr-policy-param: {_first_line(err)}")
    else:
        errors.extend(check_schedule(cfg, total_updates))


def _flag_of(err: BaseException) -> str:
    """The flag an error of ``optimize_loss`` is about (judged from its message)."""
    text = str(err).lower()
    for key, flag in (("--freeze", ""), ("larc", "--larc-param: "), ("scal", "--loss-scaling: ")):
        if key in text:
            return flag
    return "configuration: "


def check_components(cfg: TrainConfig, total_updates: int = 1000) -> list[str]:
    """Every library-side problem with ``cfg`` (names already :func:`canonical`), one message per problem,
    each naming its flag."""
    from optkit.summaries import validate_summaries

    errors: list[str] = []
    _probe_optimizer(cfg, errors)
    _probe_schedule(cfg, total_updates, errors)
    try:
        validate_summaries(cfg.summaries)
    except (TypeError, ValueError) as err:
        errors.append(f"--summaries: {_first_line(err)}")
    if errors:
        return errors
    # everything optimize_loss itself checks (LARC, loss scaling, dtype, iter_size, ...), on the demo's model
    # (a fresh one, never trained: building the train op costs milliseconds)
    from .model import make_model

    probe_model = make_model(cfg.channels, cfg.seed, model_dtype(cfg))
    try:
        build_train_op(cfg, probe_model, total_updates)
    except Exception as err:  # noqa: BLE001 - the train op is built from the user's values only
        errors.append(f"{_flag_of(err)}{_first_line(err)}")
    return errors
