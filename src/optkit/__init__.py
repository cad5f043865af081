"""optkit: the TensorFlow-era optimizer suite rebuilt as a fast, idiomatic PyTorch library.

Everything public is importable from here. The modules are small and named for what they hold:
``clipping`` (global-norm and per-tensor clipping), ``lr_policies`` / ``schedules`` (OpenSeq2Seq learning-rate
policies), ``loss_scale`` (fixed, dynamic, Backoff and LogMax scalers), ``optimizer`` (the Keras-style base),
``sgd`` / ``momentum`` / ``adam`` / ``adagrad`` / ``rmsprop`` / ``ftrl`` / ``lars`` / ``lamb`` / ``lion``
(optimizers, one file each), ``registry`` (optimizers by name), ``param_rules`` (param groups by name,
layer-wise decay, ``create_optimizer``), the wrappers
(``variable_clipping``, ``loss_scale_optimizer``, ``mixed_precision``, ``larc``) and ``train``
(``optimize_loss``). All per-parameter arithmetic lives in the private ``_multi_tensor`` layer.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"

# The public face, by layer: foundations (multi-tensor math, clipping, schedules, loss scaling), optimizers,
# wrappers over any optimizer, and the one-call training step.
__all__ = [
    # clipping
    "global_norm", "clip_by_global_norm", "clip_by_norm", "clip_gradients_by_norm", "clip_coefficient",
    "clip_grads_by_global_norm_", "clip_grads_by_norm_", "clip_grads_by_value_",
    # learning-rate policies and schedules
    "fixed_lr", "piecewise_constant", "exp_decay", "poly_decay", "cosine_decay", "inv_poly_decay",
    "transformer_policy", "LR_POLICIES", "get_policy", "LearningRateSchedule", "PolicySchedule",
    "build_schedule", "ScheduleLR",
    # loss scaling
    "LossScale", "FixedLossScale", "DynamicLossScale", "BackoffScaler", "LogMaxScaler", "AutomaticLossScaler",
    "LossScaleAtMinimumWarning", "get_loss_scale",
    # optimizers
    "Optimizer", "SGD", "LARS", "LAMB", "Ftrl", "Momentum", "Adam", "AdamW", "Adagrad", "RMSProp", "Lion",
    "OPTIMIZER_CLS_NAMES", "get_optimizer",
    # parameter rules by name, layer-wise decay, the optimizer front door
    "param_groups", "ParamGroups", "create_optimizer",
    # wrappers
    "VariableClippingOptimizer", "LossScaleOptimizer", "MixedPrecisionLossScaleOptimizer",
    "MixedPrecisionOptimizerWrapper", "convert_model_to_half", "LARC",
    # flat buffers
    "flat_parameters", "FlatParameters",
    # training
    "optimize_loss", "TrainOp", "StepResult", "OPTIMIZER_SUMMARIES", "get_regularization_loss",
    "add_regularizer", "clear_regularizers", "l1_regularizer", "l2_regularizer",
    # distributed helpers and training recipes (modules)
    "distributed", "recipes",
]

# Where each public name lives. A module is imported the first time one of its names is used (PEP 562), so
# ``import optkit`` and ``optkit --version`` cost milliseconds and do not import torch until the library is
# touched; ``from optkit import X`` works as with eager imports. An empty tuple marks a public submodule.
_SOURCES: dict[str, tuple[str, ...]] = {
    ".distributed": (),  # the module itself
    ".recipes": (),  # the module itself
    ".adagrad": ("Adagrad",),
    ".adam": ("Adam", "AdamW"),
    ".clipping": (
        "clip_by_global_norm", "clip_by_norm", "clip_coefficient", "clip_gradients_by_norm",
        "clip_grads_by_global_norm_", "clip_grads_by_norm_", "clip_grads_by_value_", "global_norm",
    ),
    ".flat": ("FlatParameters", "flat_parameters"),
    ".ftrl": ("Ftrl",),
    ".lamb": ("LAMB",),
    ".larc": ("LARC",),
    ".lars": ("LARS",),
    ".lion": ("Lion",),
    ".loss_scale": (
        "AutomaticLossScaler", "BackoffScaler", "DynamicLossScale", "FixedLossScale", "LogMaxScaler",
        "LossScale", "LossScaleAtMinimumWarning", "get_loss_scale",
    ),
    ".loss_scale_optimizer": ("LossScaleOptimizer", "MixedPrecisionLossScaleOptimizer"),
    ".lr_policies": (
        "LR_POLICIES", "cosine_decay", "exp_decay", "fixed_lr", "get_policy", "inv_poly_decay",
        "piecewise_constant", "poly_decay", "transformer_policy",
    ),
    ".mixed_precision": ("MixedPrecisionOptimizerWrapper", "convert_model_to_half"),
    ".momentum": ("Momentum",),
    ".optimizer": ("Optimizer",),
    ".param_rules": ("ParamGroups", "create_optimizer", "param_groups"),
    ".registry": ("OPTIMIZER_CLS_NAMES", "get_optimizer"),
    ".regularization": (
        "add_regularizer", "clear_regularizers", "get_regularization_loss", "l1_regularizer",
        "l2_regularizer",
    ),
    ".rmsprop": ("RMSProp",),
    ".schedules": ("LearningRateSchedule", "PolicySchedule", "ScheduleLR", "build_schedule"),
    ".sgd": ("SGD",),
    ".summaries": ("OPTIMIZER_SUMMARIES",),
    ".train": ("StepResult", "TrainOp", "optimize_loss"),
    ".variable_clipping": ("VariableClippingOptimizer",),
}
_HOME = {name: module for module, names in _SOURCES.items() for name in names or (module[1:],)}


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:  # any other submodule (optkit.train, optkit.registry, ...), as eager imports set them
        if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'optkit' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    loaded = importlib.import_module(module, __name__)
    value = loaded if _SOURCES[module] == () else getattr(loaded, name)
    globals()[name] = value  # later look-ups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the same names, imported eagerly, for type checkers and IDEs
    from . import distributed, recipes
    from .adagrad import Adagrad
    from .adam import Adam, AdamW
    from .clipping import (
        clip_by_global_norm,
        clip_by_norm,
        clip_coefficient,
        clip_gradients_by_norm,
        clip_grads_by_global_norm_,
        clip_grads_by_norm_,
        clip_grads_by_value_,
        global_norm,
    )
    from .flat import FlatParameters, flat_parameters
    from .ftrl import Ftrl
    from .lamb import LAMB
    from .larc import LARC
    from .lars import LARS
    from .lion import Lion
    from .loss_scale import (
        AutomaticLossScaler,
        BackoffScaler,
        DynamicLossScale,
        FixedLossScale,
        LogMaxScaler,
        LossScale,
        LossScaleAtMinimumWarning,
        get_loss_scale,
    )
    from .loss_scale_optimizer import LossScaleOptimizer, MixedPrecisionLossScaleOptimizer
    from .lr_policies import (
        LR_POLICIES,
        cosine_decay,
        exp_decay,
        fixed_lr,
        get_policy,
        inv_poly_decay,
        piecewise_constant,
        poly_decay,
        transformer_policy,
    )
    from .mixed_precision import MixedPrecisionOptimizerWrapper, convert_model_to_half
    from .momentum import Momentum
    from .optimizer import Optimizer
    from .param_rules import ParamGroups, create_optimizer, param_groups
    from .registry import OPTIMIZER_CLS_NAMES, get_optimizer
    from .regularization import (
        add_regularizer,
        clear_regularizers,
        get_regularization_loss,
        l1_regularizer,
        l2_regularizer,
    )
    from .rmsprop import RMSProp
    from .schedules import LearningRateSchedule, PolicySchedule, ScheduleLR, build_schedule
    from .sgd import SGD
    from .summaries import OPTIMIZER_SUMMARIES
    from .train import StepResult, TrainOp, optimize_loss
    from .variable_clipping import VariableClippingOptimizer
