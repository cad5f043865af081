"""The training demo behind ``optkit train``: a small CNN on scikit-learn's bundled digits, trained with
:func:`optkit.optimize_loss`.

One module per concern, in layers (each imports only modules listed before it):

* ``config``: option values, TOML, type and range checks (no torch, no library);
* inputs: ``extras`` (optional packages), ``data`` (digits split, deterministic batches), ``model`` (the
  CNN), ``parallel`` (torchrun / gloo);
* ``components`` (options -> schedule, optimizer arguments, train op; the library's checks), then
  ``validation`` (every check before any work);
* files: ``files`` (atomic writes), ``run_folder`` (run-folder rules, pruning), ``report`` (metrics.json,
  report.png), ``checkpoint`` (save; load with ``weights_only=True``), ``resume`` (what a continuation may
  change, where it writes, whether the saved state fits);
* ``training`` (the loop and evaluation with EMA weights) and ``lr_plot`` (``optkit lr-plot``).

The demo needs the ``cli`` extra (matplotlib, tqdm, scikit-learn, tensorboard); the library itself does not.
"""

from .config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig"]
