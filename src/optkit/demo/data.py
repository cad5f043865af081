"""The demo's data: scikit-learn's bundled handwritten digits (1797 images of 8x8 pixels, 10 classes).

The images ship inside scikit-learn, so nothing is downloaded; they are read from scikit-learn's file
directly (importing scikit-learn takes seconds). :func:`load_split` shuffles them with the run's seed, holds
out a test split, and standardises the pixels with the training split's mean and standard deviation.

:class:`BatchOrder` gives the batches of every epoch as a pure function of ``(seed, epoch)``, so a run
resumed from a checkpoint sees exactly the batches the uninterrupted run would have seen. Under ``torchrun``
each process takes its own contiguous slice of every global batch (``rank``/``world_size``), so the global
batch and the number of steps are the same for any number of processes.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["N_DIGITS", "DigitsSplit", "load_split", "train_size", "BatchOrder"]


@dataclass(frozen=True)
class DigitsSplit:
    """Standardised images ``(N, 1, 8, 8)`` float32 and labels ``(N,)`` int64 for both splits."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor


N_DIGITS = 1797
"""Images in scikit-learn's bundled digits data set (a fixed file: the split sizes follow from it without
reading it)."""

_DIGITS_FILE = ("datasets", "data", "digits.csv.gz")


def _digits_file() -> Path | None:
    """The digits file inside the installed scikit-learn package, found without importing scikit-learn (whose
    import takes seconds); ``None`` when it is not there."""
    spec = importlib.util.find_spec("sklearn")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder).joinpath(*_DIGITS_FILE)
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """``(images (N, 8, 8) float32, labels (N,) int64)``: the arrays of ``sklearn.datasets.load_digits()``,
    read from its file directly (through scikit-learn's loader if the file is elsewhere)."""
    path = _digits_file()
    if path is not None:
        table = np.loadtxt(path, delimiter=",", dtype=np.float64)
        images, labels = table[:, :-1].reshape(-1, 8, 8), table[:, -1]
    else:
        from sklearn.datasets import load_digits  # an optional (cli) dependency

        bunch = load_digits()
        images, labels = bunch.images, bunch.target
    if len(labels) != N_DIGITS:
        raise ValueError(f"the bundled digits data set has {len(labels)} images, expected {N_DIGITS}")
    return images.astype(np.float32), labels.astype(np.int64)


def _n_test(test_fraction: float, n: int) -> int:
    return min(n - 1, max(1, round(test_fraction * n)))


def train_size(test_fraction: float) -> int:
    """Images in the training split (known without reading the data)."""
    return N_DIGITS - _n_test(test_fraction, N_DIGITS)


def load_split(test_fraction: float, seed: int) -> DigitsSplit:
    """Shuffle with ``seed``, hold out ``round(test_fraction·N)`` images, standardise with the training
    split's statistics."""
    images, labels = _digits()
    n = len(labels)
    n_test = _n_test(test_fraction, n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    test, train = order[:n_test], order[n_test:]
    x = torch.from_numpy(images).unsqueeze(1)  # (N, 1, 8, 8)
    y = torch.from_numpy(labels)
    mean = x[train].mean()
    std = x[train].std()
    x = (x - mean) / std
    return DigitsSplit(x[train].contiguous(), y[train], x[test].contiguous(), y[test])


class BatchOrder:
    """Deterministic mini-batches: epoch ``e`` is a permutation drawn from ``seed·1000003 + e``.

    ``steps_per_epoch = ceil(n / batch_size)`` (the last batch may be smaller). ``batch(step)`` gives the
    indices this process uses at global step ``step`` (0-based over the whole run).
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if batch_size < world_size:
            raise ValueError(
                f"batch_size ({batch_size}) must be at least the number of processes ({world_size})"
            )
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.steps_per_epoch = math.ceil(n / batch_size)
        self._epoch = -1
        self._perm: Tensor | None = None

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g), epoch
        assert self._perm is not None
        return self._perm

    def batch(self, step: int) -> Tensor:
        """Indices for this process at global step ``step``: its slice of the global batch."""
        epoch, pos = divmod(step, self.steps_per_epoch)
        global_batch = self._permutation(epoch)[pos * self.batch_size : (pos + 1) * self.batch_size]
        shards = torch.tensor_split(global_batch, self.world_size)
        return shards[self.rank]
