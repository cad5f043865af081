"""optkit: the TensorFlow-era optimizer suite rebuilt as a fast, idiomatic PyTorch library.

Everything public is importable from here. The modules are small and named for what they hold:
``clipping`` (global-norm and per-tensor clipping), ``lr_policies`` / ``schedules`` (OpenSeq2Seq learning-rate
policies), ``loss_scale`` (fixed, dynamic, Backoff and LogMax scalers), ``optimizer`` (the Keras-style base),
``sgd`` / ``lars`` / ``ftrl`` (optimizers), ``registry`` (optimizers by name), the wrappers
(``variable_clipping``, ``loss_scale_optimizer``, ``mixed_precision``, ``larc``) and ``train``
(``optimize_loss``). All per-parameter arithmetic lives in the private ``_multi_tensor`` layer.
"""

__version__ = "0.1.0"

# public imports: one line per module (keep sorted by layer)
# -- foundations
from .loss_scale import (  # noqa: F401
    AutomaticLossScaler,
    BackoffScaler,
    DynamicLossScale,
    FixedLossScale,
    LogMaxScaler,
    LossScale,
    LossScaleAtMinimumWarning,
    get_loss_scale,
)
from .clipping import (  # noqa: F401
    clip_by_global_norm,
    clip_by_norm,
    clip_coefficient,
    clip_gradients_by_norm,
    clip_grads_by_global_norm_,
    clip_grads_by_norm_,
    clip_grads_by_value_,
    global_norm,
)
from .lr_policies import (  # noqa: F401
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
from .schedules import LearningRateSchedule, PolicySchedule, ScheduleLR, build_schedule  # noqa: F401
