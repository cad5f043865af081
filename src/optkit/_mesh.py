"""Device-mesh helpers that the optimizer base needs (below it in the layering; ``distributed`` re-exports
them).

* :func:`check_mesh`: the ``mesh=`` argument of the optimizers (as in tf.keras's DTensor optimizers,
  ``tf.keras.dtensor.experimental.optimizers``): every parameter must be a DTensor on that mesh or on a
  sub-mesh sliced from it.
* :func:`replicated`: a 0-d scalar (``iterations``, a learning rate, a loss scale) as a DTensor replicated on
  a mesh. optkit keeps such scalars as plain tensors on the mesh's device type; they hold the same value on
  every rank because every skip decision is all-reduced, so this view is exact.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from . import _multi_tensor as mt

__all__ = ["check_mesh", "replicated", "is_mesh"]



def is_mesh(obj: object) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except Exception:  # pragma: no cover - torch without distributed
        return False
    return isinstance(obj, DeviceMesh)


def _on_mesh(t: Tensor, mesh: Any) -> bool:
    m = t.device_mesh
    if m == mesh:
        return True
    root = m._get_root_mesh() if hasattr(m, "_get_root_mesh") else m
    return root is not m and root == mesh


def check_mesh(named_params: Iterable[tuple[str, Tensor]], mesh: Any) -> None:
    """Raise unless every parameter is a DTensor on ``mesh`` (or on a sub-mesh sliced from it).

    ``TypeError`` when ``mesh`` is not a ``DeviceMesh``; ``ValueError`` naming the first parameter that is a
    plain tensor or lives on another mesh.
    """
    if not is_mesh(mesh):
        raise TypeError(
            f"`mesh` must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}"
        )
    for name, p in named_params:
        if not mt.is_dtensor(p):
            raise ValueError(
                f"parameter {name!r} is a plain tensor, not a DTensor on the optimizer's `mesh` {mesh} "
                "(distribute it, e.g. with fully_shard or distribute_tensor, or leave `mesh` None)"
            )
        if not _on_mesh(p, mesh):
            raise ValueError(
                f"parameter {name!r} lives on mesh {p.device_mesh}, not on the optimizer's `mesh` {mesh}"
            )


def replicated(t: Tensor, mesh: Any) -> Tensor:
    """``t`` (a tensor holding the same value on every rank) as a DTensor replicated on every dim of ``mesh``.

    No communication; the local tensor is shared, so the view follows later in-place changes of ``t``.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not is_mesh(mesh):
        raise TypeError(f"`mesh` must be a DeviceMesh, got {type(mesh).__name__}")
    if mt.is_dtensor(t):
        raise TypeError("`t` is already a DTensor")
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


