"""The training demo behind ``optkit train``: a small CNN on scikit-learn's bundled digits, trained with
:func:`optkit.optimize_loss`.

One module per concern: ``config`` (options, TOML, validation), ``components`` (options -> schedule, optimizer
arguments, train op), ``data`` (digits split, deterministic batches), ``model`` (the CNN), ``parallel``
(torchrun / gloo), ``training`` (the loop and evaluation with EMA weights), ``checkpoint`` (save / resume),
``report`` (metrics.json, report.png) and ``lr_plot`` (``optkit lr-plot``).

The demo needs the ``cli`` extra (matplotlib, tqdm, scikit-learn, tensorboard); the library itself does not.
"""

from .config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig"]
