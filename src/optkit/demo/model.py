"""The demo's model: a small convolutional network for 8x8 digit images.

``conv3x3(c) - ReLU - maxpool2 - conv3x3(2c) - ReLU - linear(4·4·2c → 4c) - ReLU - linear(4c → 10)``.
With the default ``c = 16`` it has about 38k parameters: big enough for 97-99% test accuracy on the digits,
small enough to train in seconds on a CPU even in half precision (the second convolution runs on the pooled
4x4 maps: CPUs without half-precision units run half convolutions on a slow generic path).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DigitsCNN", "make_model"]


class DigitsCNN(nn.Sequential):
    """The demo CNN; input ``(N, 1, 8, 8)``, output ``(N, 10)`` logits in the parameters' dtype."""

    def __init__(self, channels: int = 16) -> None:
        c = channels
        super().__init__(
            nn.Conv2d(1, c, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(2 * c * 16, 4 * c),
            nn.ReLU(),
            nn.Linear(4 * c, 10),
        )

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102 - inputs follow the parameters' dtype
        return super().forward(x.to(self.dtype))


def make_model(channels: int, seed: int, dtype: torch.dtype = torch.float32) -> DigitsCNN:
    """A freshly initialised model (weights drawn from ``seed``) in ``dtype``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DigitsCNN(channels)
    return model.to(dtype)
