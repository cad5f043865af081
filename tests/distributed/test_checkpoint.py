"""DCP round trips (sharded through dcp.save/dcp.load, and full state dicts) resume bit-identically."""

from __future__ import annotations

import pytest

from ._compare import assert_equal, ok

KEYS = ("params", "state", "norms", "iterations", "loss_scale")


def _cases(dist_results, rank):
    return ok(dist_results[rank]["dcp_roundtrip"])


@pytest.mark.parametrize("case", ["sgd_ema/sharded", "sgd_ema/full", "loss_scale_optimizer/sharded",
                                  "loss_scale_optimizer/full", "mixed_precision/sharded",
                                  "mixed_precision/full"])
def test_resume_is_identical(dist_results, case):
    for rank in (0, 1):
        cases = _cases(dist_results, rank)
        if case not in cases:
            pytest.skip(f"{case}: optimizer not available")
        r = cases[case]
        assert r["resumed_iterations"] == 2
        assert r["steps_shared"], "after loading, every parameter must share one step counter again"
        for key in KEYS:
            if key == "iterations":
                assert r["resumed"][key] == r["cont"][key] == 4
            else:
                assert_equal(r["resumed"][key], r["cont"][key])


def test_sharded_state_dict_keeps_dtensors(dist_results):
    assert _cases(dist_results, 0)["sgd_ema/sharded"]["sharded_state"]
    assert not _cases(dist_results, 0)["sgd_ema/full"]["sharded_state"]


def test_mismatched_wrapper_state_raises_and_changes_nothing(dist_results):
    for rank in (0, 1):
        r = ok(dist_results[rank]["dcp_mismatch"])
        assert r["raised"] is not None and "LossScaleOptimizer" in r["raised"]
        assert_equal(r["after"]["params"], r["before"]["params"])
        assert_equal(r["after"]["state"], r["before"]["state"])
