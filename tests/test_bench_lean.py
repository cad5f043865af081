"""bench.lean's bytes count (the figures of docs/benchmarks.md's lean-memory table): exact on known
configurations, each expected figure written out by hand from the formats (no timings)."""

from __future__ import annotations

import torch

import optkit


def _lean():
    """bench.lean, imported without its side effect on this process: importing the bench harness pins
    torch's thread count for the benchmarks, which changes the rounding of other tests' CPU reductions."""
    threads = torch.get_num_threads()
    try:
        import bench.lean as lean
    finally:
        torch.set_num_threads(threads)
    return lean


def held_bytes(*args):
    return _lean().held_bytes(*args)


def formula(*args):
    return _lean().formula(*args)

SHAPES = [(16, 512), (4096,), (10,)]  # two tensors of >= 4096 elements (8-bit slots) and one below (fp32)
N = 16 * 512 + 4096 + 10


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=g) * 0.01).to(dtype)
    return ps


def test_split_int8_sgd_counts_every_held_tensor():
    ps = _params(torch.bfloat16)
    opt = optkit.SGD(ps, 0.1, momentum=0.9, precision="split", state_dtype="int8")
    opt.step()
    got = held_bytes(opt, ps)
    weights = 2 * N
    master_low = 2 * N  # int16
    codes = 16 * 512 + 4096  # uint8, the two large tensors
    scales = 4 * (16 * 2 + 4096 // 256)  # fp32 per block of 256 within each row: 16 rows x 2, then 16
    small = 4 * 10  # the 10-element tensor keeps an fp32 momentum
    steps = 8  # the int64 step counter (one tensor, shared by the parameters' entries: counted once)
    assert got == {"weights": weights, "masters": 0, "state": master_low + codes + scales + small + steps,
                   "total": weights + master_low + codes + scales + small + steps}


def test_fp32_masters_adam_counts_masters_and_excludes_gradients():
    ps = _params(torch.bfloat16)
    opt = optkit.MixedPrecisionOptimizerWrapper(optkit.Adam(ps, 1e-3))
    opt.step()
    got = held_bytes(opt, ps, opt.master_params)
    assert got == {"weights": 2 * N, "masters": 4 * N, "state": 2 * 4 * N + 8,
                   "total": 2 * N + 4 * N + 8 * N + 8}


def test_shared_storage_counted_once():
    class Holder:
        pass

    t = torch.zeros(100)
    h = Holder()
    h.state = {"a": {"x": t, "y": t, "z": torch.zeros(3, dtype=torch.int16)}}
    assert held_bytes(h, [])["state"] == 400 + 6


def test_formula():
    assert formula("split", "int8", 1) == ("2 + 2 + 1.016", 2 + 2 + 1 + 4 / 256)
    assert formula("fp32-masters", None, 2) == ("2 + 4 + 2×4", 14)
    assert formula("bf16", None, 2) == ("2 + 2×2", 6)
