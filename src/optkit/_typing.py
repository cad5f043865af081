"""Type aliases of the optimizer constructors, for editors and type checkers (re-exported by
:mod:`optkit.optimizer`, as ``torch.optim.optimizer.ParamsT`` is by torch).

``ParamsT``: what every optimizer's ``params`` takes (tensors, ``(name, tensor)`` pairs such as
``model.named_parameters()``, or param-group dicts). ``LearningRate``: a number, a 0-d tensor, a
:class:`~optkit.schedules.LearningRateSchedule`, or a callable of no argument or of one (the count of applied
updates, an ``int`` or a 0-d int64 tensor). ``OptimizerOptions``: the keyword-only options every optimizer
passes on to :class:`optkit.Optimizer` (its ``**kwargs``), so that a checker flags a misspelt or foreign
keyword (``betas=``) and a wrong type (``learning_rate="fast"``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, Union

import torch
from torch import Tensor, nn
from typing_extensions import TypeAlias, TypedDict  # noqa: UP035 (TypeAlias: Python 3.10)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .schedules import LearningRateSchedule

__all__ = ["ParamsT", "LearningRate", "OptimizerOptions"]

# (typing.Union: the aliases are evaluated at run time, and a quoted name does not take `|` on Python 3.10)
ParamsT: TypeAlias = Union[Iterable[Tensor], Iterable[tuple[str, Tensor]], Iterable[dict[str, Any]]]  # noqa: UP007

LearningRate: TypeAlias = Union[  # noqa: UP007
    float,
    Tensor,
    "LearningRateSchedule",
    Callable[[], Union[float, Tensor]],  # noqa: UP007
    Callable[[Any], Union[float, Tensor]],  # noqa: UP007
]


class OptimizerOptions(TypedDict, total=False):
    """The base options of :class:`optkit.Optimizer` that every optimizer takes as keywords (see its
    docstring). ``lr`` is torch's name of ``learning_rate`` (give one of them)."""

    lr: LearningRate
    clipnorm: float | None
    clipvalue: float | None
    global_clipnorm: float | None
    use_ema: bool
    ema_momentum: float
    ema_overwrite_frequency: int | None
    ema_warmup: bool
    ema_buffers: nn.Module | Iterable[tuple[str, Tensor]] | None
    jit_compile: bool
    mesh: DeviceMesh | None
    name: str | None
    block_numel: int
    scratch_grads: bool
    precision: Literal["split", "kahan", "stochastic"] | None
    state_dtype: str | torch.dtype | None
    rounding_seed: int
