"""Every optimizer and wrapper on an FSDP2-sharded model (2 gloo ranks) matches the same run in one process.

The reference trains the unsharded model on the mean of both ranks' losses (FSDP2 averages gradients), so
parameters, optimizer state (momentum, EMA averages, the shared step), gradient norms and loss scales must
agree to fp32 rounding after ``STEPS`` steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from ._compare import assert_close, assert_equal, ok
from .scenarios import HSDP_CASES, OPTIMIZERS, available, reference

CASES = list(OPTIMIZERS)

#: VariableClippingOptimizer clips along dims [0] of a Shard(0) weight: the norm crosses the shard dim and
#: must be reduced across the mesh (``_multi_tensor.norms_along``).
MATCH_CASES = CASES


def _result(dist_results, case, rank=0):
    if not available(case):
        pytest.skip(f"optkit.{OPTIMIZERS[case][1]}.{OPTIMIZERS[case][2]} is not available")
    return ok(dist_results[rank][f"fsdp/{case}"])


@pytest.mark.parametrize("case", MATCH_CASES)
def test_sharded_run_matches_single_process(dist_results, case):
    got = _result(dist_results, case)
    ref = reference(case)
    assert got["iterations"] == ref["iterations"]
    assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-6)
    assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)
    assert_close(got["state"], ref["state"], rtol=1e-5, atol=1e-6)
    assert_close(got["loss_scale"], ref["loss_scale"])


@pytest.mark.parametrize("case", CASES)
def test_ranks_agree_exactly(dist_results, case):
    r0, r1 = _result(dist_results, case, 0), _result(dist_results, case, 1)
    for key in ("params", "state", "norms", "loss_scale"):
        assert_equal(r1[key], r0[key])
    assert r0["iterations"] == r1["iterations"]


@pytest.mark.parametrize("case", CASES)
def test_state_keeps_the_parameter_placement(dist_results, case):
    got = _result(dist_results, case)
    if not got["placements"]:
        assert all(set(st) == {"step"} for st in got["state"].values())
        pytest.skip(f"{case} keeps no per-parameter tensor state")
    assert all(got["placements"].values()), got["placements"]


def test_ema_finalize_is_local(dist_results):
    got = _result(dist_results, "sgd_ema")
    assert got["finalize_collectives"] == 0
    assert got["finalized_is_dtensor"]
    averages = {n: st["average"] for n, st in got["state"].items()}
    assert_equal(got["finalized"], averages)
    # the averages really differ from the weights (a meaningful swap)
    assert any(not np.array_equal(got["params"][n], averages[n]) for n in averages)


@pytest.mark.parametrize("shape", ["1x2", "2x1"])
@pytest.mark.parametrize("case", HSDP_CASES)
def test_hsdp_on_a_2d_mesh_matches_single_process(dist_results, case, shape):
    if not available(case):
        pytest.skip(f"{case} not available")
    ref = reference(case)
    for rank in (0, 1):
        got = ok(dist_results[rank][f"hsdp{shape}/{case}"])
        assert got["iterations"] == ref["iterations"]
        for key in ("norms", "params", "state", "loss_scale"):
            assert_close(got[key], ref[key], rtol=1e-5, atol=1e-6)
        assert all(got["placements"].values()), got["placements"]
