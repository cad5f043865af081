"""DCP round trips (sharded through dcp.save/dcp.load, and full state dicts) resume bit-identically; full
state dicts follow torch's ``StateDictOptions`` (``cpu_offload``: rank 0 only; ``broadcast_from_rank0``:
tensor by tensor)."""

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


def test_full_cpu_offload_state_dict_lives_on_rank0_only(dist_results):
    r0 = ok(dist_results[0]["dcp_full_offload"])
    r1 = ok(dist_results[1]["dcp_full_offload"])
    assert "optkit_wrappers" in r0["info"]["keys"]
    masters = r0["info"]["masters"]
    assert masters and all(dev == "cpu" and not is_dt for _, dev, is_dt in masters)
    assert r0["info"]["masters"][0][0] == (7, 5)  # the full (gathered) master weight
    assert r1["info"]["keys"] == [] and r1["info"]["tensors_held"] == 0  # torch gives rank 1 an empty dict


def test_broadcast_from_rank0_resumes_exactly_without_pickling_tensors(dist_results):
    for rank in (0, 1):
        r = ok(dist_results[rank]["dcp_full_offload"])
        assert r["info"]["object_broadcast_tensors"] == 0
        for key in ("params", "state", "norms", "iterations", "loss_scale"):
            assert_equal(r["resumed"][key], r["cont"][key])
