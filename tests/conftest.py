"""Shared pytest fixtures. Keep this file minimal: module-specific helpers belong in the test modules."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture
def rng() -> np.random.Generator:
    """A freshly seeded NumPy generator, so every test draws the same inputs on every run."""
    return np.random.default_rng(20261123)
