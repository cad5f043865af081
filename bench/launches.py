"""Kernel launches per step on a GPU, counted on the CPU.

optkit's non-CPU branches are its CUDA branches (it tests ``device.type == "cpu"``), so a step over ``meta``
tensors takes the CUDA path without a GPU: :class:`LaunchCounter` watches the ops it dispatches and counts
the kernels each would launch on CUDA, by this model (torch 2.13):

* an op whose outputs are views, or that only allocates (``empty*``, ``detach``, ``set_``), launches nothing;
  an op on host tensors only (a CPU scalar) launches nothing on the device;
* a multi-tensor (``_foreach_*``) op launches one kernel when torch's fast route holds (``ForeachUtils.h``:
  every tensor of every list on one device, strided, non-overlapping and dense, of the list's dtype and of
  one dtype across lists; tensors at one position of equal sizes and strides; a ``Tensor`` scalar 0-d and in
  the tensors' dtype), and one per tensor otherwise (torch then loops over the tensors). Its packing into
  launches of ~50 tensors or 20 M elements (``multi_tensor_apply``) is not counted: torch's fused kernels
  pack the same way;
* a fused optimizer kernel (``_fused_sgd_``, ``_fused_adam_`` ...) and ``_amp_foreach_non_finite_check_and_
  unscale_`` launch one; ``cat`` / ``stack`` one per 128 inputs (CUDA's batched copy); any other op one;
* a host read of a device value (``.item()``, ``bool(t)``) is counted apart, as a sync.

:func:`cuda_like` lets the fused-kernel gate treat ``meta`` as ``cuda``, so the count includes the fused
kernels a CUDA step takes (they have no meta kernel; the counter skips running them). Run ``python -m
bench.launches`` for the table of launches per step of the CUDA benchmark's rows (``bench/cuda.py``), on the
161 ResNet-50 shapes and on 10,000 tensors of 256, with and without flat buffers; the tests pin the same
counts (``tests/test_launches.py``).
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from optkit._tensors import is_dense

#: ops that allocate or alias without a kernel
_NO_KERNEL = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "set_",
    "resize_", "lift_fresh", "_local_scalar_dense", "is_nonzero", "is_same_size", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "_has_compatible_shallow_copy_type",
}
_HOST_READS = {"_local_scalar_dense", "is_nonzero"}
_ONE_KERNEL = {"_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_"}
_CAT_BATCH = 128


def _tensor_lists(args: tuple, kwargs: dict) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    lists, scalars = [], []
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a):
            lists.append(list(a))
        elif isinstance(a, torch.Tensor):
            scalars.append(a)
    return lists, scalars


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense, strided (torch's ``is_non_overlapping_and_dense``)."""
    return t.layout == torch.strided and is_dense(t)


def _same_strides(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(s == 1 or x == y for s, x, y in zip(a.shape, a.stride(), b.stride()))


def foreach_fast_route(lists: list[list[torch.Tensor]], scalars: list[torch.Tensor],
                       cross_dtype: bool = False) -> bool:
    """Whether torch's multi-tensor kernels take their one-launch route for these arguments (the model
    above). ``cross_dtype``: the lists may differ in dtype (``_foreach_copy_``, which casts: torch's
    ``foreach_tensor_copy_list_kernel_cuda_`` asks one dtype within each list only)."""
    first = lists[0][0]
    for ts in lists:
        if any(t.device != first.device or not _dense(t) or t.dtype != ts[0].dtype for t in ts):
            return False
        if ts[0].dtype != first.dtype and ts[0].dtype not in (torch.float32, torch.float64) \
                and not cross_dtype:
            return False  # (state steps and the like ride along as float; other cross-list dtypes do not)
    for ts in lists[1:]:
        if len(ts) == len(lists[0]) and any(
            a.shape != b.shape or not _same_strides(a, b) for a, b in zip(lists[0], ts)
        ):
            return False
    for s in scalars:
        if s.device.type != "cpu" and (s.dim() != 0 or s.dtype != first.dtype):
            return False
    return True


class LaunchCounter(TorchDispatchMode):
    """Counts the kernels a step would launch on CUDA (the module's model), the ops dispatched and the host
    reads; ``by_op`` holds launches per op name."""

    def __init__(self) -> None:
        super().__init__()
        self.launches = 0
        self.ops = 0
        self.syncs = 0
        self.by_op: Counter[str] = Counter()

    def _count(self, name: str, n: int) -> None:
        self.launches += n
        if n:
            self.by_op[name] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops += 1
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in tensors) or (
            not tensors and str(kwargs.get("device", "cpu")) != "cpu"
        )
        if name in _HOST_READS and on_device:  # (reading a CPU tensor waits for no device)
            self.syncs += 1
        if name.startswith("_fused_"):
            self._count(name, 1)
            if all(t.device.type == "meta" for t in tensors):
                return None  # (no meta kernel: the in-place update has nothing to compute on meta)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if not on_device or name in _NO_KERNEL or func.is_view:
            return out
        if name in _ONE_KERNEL:
            self._count(name, 1)
        elif name.startswith("_foreach_"):
            lists, scalars = _tensor_lists(args, kwargs)
            n = len(lists[0]) if lists else 0
            fast = n and foreach_fast_route(lists, scalars, cross_dtype=name == "_foreach_copy_")
            self._count(name, 1 if fast else n)
        elif name in ("cat", "stack"):
            self._count(name, -(-len(args[0]) // _CAT_BATCH))
        else:
            self._count(name, 1)
        return out


@contextlib.contextmanager
def cuda_like() -> Iterator[None]:
    """Within: the fused-kernel gate treats ``meta`` tensors as CUDA tensors (as the rest of optkit does)."""
    import torch.optim.optimizer as torch_opt

    from optkit._core import fused

    saved = {k: dict(v) for k, v in fused.KERNELS.items()}
    for v in fused.KERNELS.values():
        if "cuda" in v:
            v["meta"] = v["cuda"]
    devices = torch_opt._get_fused_kernels_supported_devices
    torch_opt._get_fused_kernels_supported_devices = lambda: [*devices(), "meta"]
    try:
        yield
    finally:
        torch_opt._get_fused_kernels_supported_devices = devices
        for k, v in saved.items():
            fused.KERNELS[k] = v


def count(step: Callable[[], object], warmup: int = 2) -> LaunchCounter:
    """The counter of one ``step()`` after ``warmup`` uncounted ones (the first steps create state)."""
    with cuda_like():
        for _ in range(warmup):
            with LaunchCounter():  # (it also stands in for the fused kernels, which have no meta kernel)
                step()
        with LaunchCounter() as c:
            step()
    return c


# -- the CUDA benchmark's rows ----------------------------------------------------------------------------

SHAPES = {"resnet50": None, "tiny_10k": [(256,)] * 10_000, "tiny_1k": [(256,)] * 1_000}


def make_params(set_name: str, dtype: torch.dtype = torch.float32, flat: bool = False) -> list:
    """The set's parameters on ``meta`` with gradients (meta tensors hold no values: only the ops count)."""
    if set_name == "resnet50":
        threads = torch.get_num_threads()
        from bench._harness import resnet50_shapes

        torch.set_num_threads(threads)  # (importing the harness pins the CPU benchmarks' thread count)
        shapes = resnet50_shapes()
    else:
        shapes = SHAPES[set_name]
    ps = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, device="meta", dtype=dtype))
        p.grad = torch.empty(s, device="meta", dtype=dtype)
        ps.append(p)
    if flat:
        from optkit import flat_parameters

        flat_parameters(ps)
    return ps


def rows() -> dict[str, Callable[[list], Callable[[], object]]]:
    """name -> build(params) -> step: the rows of ``bench/cuda.py`` and their anchors."""
    import optkit

    lr = 0.01

    def sgd(ps):
        return optkit.SGD(ps, learning_rate=lr, momentum=0.9).step

    def sgd_wd_ema(ps):
        return optkit.SGD(ps, learning_rate=lr, momentum=0.9, weight_decay=1e-4, use_ema=True,
                          ema_momentum=0.99).step

    def lars(ps):
        return optkit.LARS(ps, 0.1, momentum=0.9, weight_decay=1e-4, eeta=0.001).step

    def larc(ps):
        return optkit.LARC(optkit.SGD(ps, learning_rate=0.1, momentum=0.9), larc_eta=0.001).step

    def lamb(ps):
        return optkit.LAMB(ps, lr, weight_decay=0.01, always_adapt=True).step

    def lso(ps):
        opt = optkit.LossScaleOptimizer(optkit.SGD(ps, learning_rate=lr, momentum=0.9),
                                        optkit.DynamicLossScale(2.0**15, increment_period=10**9))

        def step():
            opt.grads_scaled = True
            opt.step()

        return step

    def torch_sgd_fused(ps):
        return torch.optim.SGD(ps, lr=lr, momentum=0.9, fused=True).step

    def torch_sgd_fused_ema(ps):
        opt = torch.optim.SGD(ps, lr=lr, momentum=0.9, weight_decay=1e-4, fused=True)
        avgs = [torch.empty_like(p) for p in ps]

        def step():
            opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(avgs, [p.detach() for p in ps], 0.01)

        return step

    def torch_adamw_fused(ps):
        return torch.optim.AdamW(ps, lr=lr, weight_decay=0.01, eps=1e-6, fused=True).step

    def gradscaler_sgd(ps):
        opt = torch.optim.SGD(ps, lr=lr, momentum=0.9, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=10**9)
        scaler._device = "meta"  # (a "cuda" scaler turns itself off without CUDA)
        scaler._lazy_init_scale_growth_tracker(torch.device("meta"))

        def step():
            scaler.step(opt)
            scaler.update()

        return step

    return {
        "SGD momentum": sgd, "torch SGD fused": torch_sgd_fused,
        "SGD + wd + EMA": sgd_wd_ema, "torch SGD fused + lerp EMA": torch_sgd_fused_ema,
        "LARS": lars, "LARC(SGD)": larc,
        "LAMB": lamb, "torch AdamW fused": torch_adamw_fused,
        "LossScaleOptimizer(SGD, dynamic)": lso, "GradScaler + torch SGD fused": gradscaler_sgd,
    }


def launches(row: str, set_name: str, flat: bool = False,
             dtype: torch.dtype = torch.float32) -> LaunchCounter:
    """The counter of one step of ``row`` on ``set_name``."""
    return count(rows()[row](make_params(set_name, dtype, flat)))


def table() -> str:
    lines = ["| step | 161 ResNet-50 tensors | flat | 10,000 × 256 | flat | host reads |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows():
        cells, syncs = [], 0
        for set_name in ("resnet50", "tiny_10k"):
            for flat in (False, True):
                if flat and row.startswith(("torch", "GradScaler")):
                    cells.append("")
                    continue
                try:
                    c = launches(row, set_name, flat)
                except Exception as err:  # noqa: BLE001 - a row that cannot run on meta is reported
                    cells.append(f"({type(err).__name__})")
                    continue
                cells.append(str(c.launches))
                syncs = max(syncs, c.syncs)
        lines.append(f"| {row} | " + " | ".join(cells) + f" | {syncs} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args:  # python -m bench.launches ROW SET [flat]: the ops of one step
        c = launches(args[0], args[1], "flat" in args[2:])
        print(f"{c.launches} launches, {c.ops} ops, {c.syncs} host reads")
        for name, n in c.by_op.most_common():
            print(f"  {n:6d}  {name}")
        return
    print(table())


if __name__ == "__main__":
    main()
