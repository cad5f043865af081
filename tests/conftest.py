"""Shared pytest fixtures. Keep this file minimal: module-specific helpers belong in the test modules."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A freshly seeded NumPy generator, so every test draws the same inputs on every run."""
    return np.random.default_rng(20261123)


# One intra-op thread per test process: the suite runs as `pytest -n 2` on 2 cores, and its tensors are tiny,
# so a second OpenMP thread per worker only adds barrier waits (5x slower under load).
import torch  # noqa: E402

torch.set_num_threads(1)
