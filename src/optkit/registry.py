"""Optimizers by name (OpenSeq2Seq's ``OPTIMIZER_CLS_NAMES``, ``open_seq2seq/optimizers/optimizers.py``).

Every class is an optkit optimizer (the Keras-style base: every option, a skipped step changes nothing, state
exists from construction), called as ``cls(params, learning_rate=..., **optimizer_params)`` (how
``optimize_loss`` builds them) with the TF argument names. Lookup is case-insensitive.

| name | class | TF1 original |
|---|---|---|
| SGD | :class:`optkit.SGD` (Keras form; momentum 0 by default) | ``GradientDescentOptimizer`` |
| Momentum | :class:`optkit.Momentum` (``torch.optim.SGD``'s rule) | ``MomentumOptimizer`` |
| Adam | :class:`optkit.Adam` (``torch.optim.Adam``'s rule) | ``AdamOptimizer`` |
| AdamW | :class:`optkit.AdamW` (``torch.optim.AdamW``'s rule) | ``contrib.opt.AdamWOptimizer`` |
| Adagrad | :class:`optkit.Adagrad` (``torch.optim.Adagrad``'s rule) | ``AdagradOptimizer`` |
| RMSProp | :class:`optkit.RMSProp` (TF rule) | ``RMSPropOptimizer`` |
| Ftrl | :class:`optkit.Ftrl` | ``FtrlOptimizer`` |
| LARS | :class:`optkit.LARS` | ``contrib.opt.LARSOptimizer`` |
| LAMB | :class:`optkit.LAMB` (You et al. 2019, Algorithm 2) | — (TF Addons ``LAMB``, Keras 3 ``Lamb``) |
| Lion | :class:`optkit.Lion` (Chen et al. 2023, Algorithm 2) | — (Keras 3 ``Lion``) |
"""

from __future__ import annotations

from typing import TypeVar, overload

import torch

from .adagrad import Adagrad
from .adam import Adam, AdamW
from .ftrl import Ftrl
from .lamb import LAMB
from .lars import LARS
from .lion import Lion
from .momentum import Momentum
from .optimizer import Optimizer
from .rmsprop import RMSProp
from .sgd import SGD

__all__ = ["OPTIMIZER_CLS_NAMES", "get_optimizer"]

_O = TypeVar("_O", bound=torch.optim.Optimizer)

OPTIMIZER_CLS_NAMES: dict[str, type[Optimizer]] = {
    "SGD": SGD,
    "Momentum": Momentum,
    "Adam": Adam,
    "AdamW": AdamW,
    "Adagrad": Adagrad,
    "RMSProp": RMSProp,
    "Ftrl": Ftrl,
    "LARS": LARS,
    "LAMB": LAMB,
    "Lion": Lion,
}


@overload
def get_optimizer(name: str) -> type[Optimizer]: ...


@overload
def get_optimizer(name: type[_O]) -> type[_O]: ...


def get_optimizer(name: str | type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """The optimizer class for a registry name (case-insensitive), or ``name`` itself if it is already a
    ``torch.optim.Optimizer`` subclass.

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
        TypeError: neither a string nor a ``torch.optim.Optimizer`` subclass.
    """
    if isinstance(name, str):
        wanted = name.lower()
        for key, cls in OPTIMIZER_CLS_NAMES.items():
            if key.lower() == wanted:
                return cls
        raise ValueError(
            f"Unknown optimizer name {name!r}; valid names are {sorted(OPTIMIZER_CLS_NAMES)} "
            "(case-insensitive), or pass a torch.optim.Optimizer subclass"
        )
    if isinstance(name, type) and issubclass(name, torch.optim.Optimizer):
        return name
    raise TypeError(
        "`optimizer` must be a registry name or a torch.optim.Optimizer subclass, "
        f"got {name!r} ({type(name).__name__})"
    )
