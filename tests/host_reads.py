"""A dispatch mode that counts host reads of tensor values, for the tests that a step makes none."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host: ``.item()``, ``float(t)``, ``bool(t)``, and a
    0-d tensor that Python's overload resolution passed as a Scalar. On a GPU each one is a device sync."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("_local_scalar_dense", "is_nonzero"):
            self.reads += 1
        return func(*args, **(kwargs or {}))


__all__ = ["HostReads"]
