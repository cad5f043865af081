"""The train op and the global reductions on 2 gloo ranks (issue #12 items 4, 5, 6 and pipeline stages):
summaries with the writer on rank 0 only, the overflow decision, reductions across pipeline stages and the
FSDP2 mid-window state guard. Each against one process."""

from __future__ import annotations

import numpy as np
import pytest

from ._compare import assert_close, ok
from .train_op_scenarios import (
    BIG,
    SUMMARY_CASES,
    overflow_train,
    pipeline_global_clipnorm,
    pipeline_train,
    reference_norm_over_stages,
    stage_tensors,
    summaries_reference,
)

# ----------------------------------------------------------------------------------------------------------
# summaries (item 4)


@pytest.mark.parametrize("case", list(SUMMARY_CASES))
def test_rank0_writer_summaries_match_single_process(dist_results, case):
    """FSDP2 parameters, writer on rank 0 only: no deadlock, and every value (per-variable norms and
    histograms of sharded tensors included) equals the single-process run's."""
    ref = summaries_reference(case)
    got = ok(ok(dist_results[0]["summaries_rank0"])[case])
    assert ok(dist_results[1]["summaries_rank0"])[case]["records"] is None  # rank 1 has no writer
    assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)
    rec, want = got["records"], ref["records"]
    assert set(rec["scalars"]) == set(want["scalars"]) and rec["scalars"]
    for tag, series in want["scalars"].items():
        assert [s for s, _ in rec["scalars"][tag]] == [s for s, _ in series], tag
        np.testing.assert_allclose([v for _, v in rec["scalars"][tag]], [v for _, v in series], rtol=1e-5,
                                   atol=1e-7, err_msg=tag)
    assert set(rec["hists"]) == set(want["hists"])
    for tag, series in want["hists"].items():
        for (s1, v1), (s2, v2) in zip(rec["hists"][tag], series):
            assert s1 == s2 and v1.shape == v2.shape, tag
            np.testing.assert_allclose(v1, v2, rtol=1e-5, atol=1e-7, err_msg=tag)


def test_summary_tags_cover_every_variable(dist_results):
    rec = ok(ok(dist_results[0]["summaries_rank0"])["clip_backoff"])["records"]
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        for kind in ("gradient_norm", "variable_norm"):
            assert f"{kind}/{name}" in rec["scalars"]
        for kind in ("gradients", "variables"):
            assert f"{kind}/{name}" in rec["hists"]
    assert len(rec["hists"]["variables/0.weight"][0][1]) == 35  # every element of the 7x5 weight, once


# ----------------------------------------------------------------------------------------------------------
# the overflow decision (item 6)


def test_huge_finite_gradients_are_not_overflow_on_any_world_size(dist_results):
    single = overflow_train(None, 1, BIG)
    assert single["applied"]
    for rank in (0, 1):
        r = ok(dist_results[rank]["overflow_decision"])
        assert r["found_big"] == 0.0 and r["any_non_finite_big"] == 0.0
        assert r["train_big"]["applied"], "finite gradients were taken for an overflow"
        np.testing.assert_allclose(r["train_big"]["w"], single["w"], rtol=1e-6)


def test_non_finite_elements_are_overflow_on_every_rank(dist_results):
    single = overflow_train(None, 1, 1.0, nan_rank=0)
    assert not single["applied"]
    for rank in (0, 1):
        r = ok(dist_results[rank]["overflow_decision"])
        assert r["found_nan"] == 1.0 and r["any_non_finite_nan"] == 1.0
        assert not r["train_nan"]["applied"]  # the NaN was on rank 1 only
        np.testing.assert_array_equal(r["train_nan"]["w"], np.ones(8, dtype=np.float32))


def test_huge_finite_gradients_single_process():
    """One process, no distribution: a gradient whose norm's square overflows fp32 is applied."""
    import torch

    from optkit import _multi_tensor as mt

    t = torch.full((6, 4), 3e19)
    n, found = mt.global_norm_and_found_inf([t])
    assert float(found) == 0.0 and float(mt.any_non_finite([t])) == 0.0
    t[0, 0] = float("inf")
    assert float(mt.global_norm_and_found_inf([t])[1]) == 1.0
    assert overflow_train(None, 1, 1e19)["applied"]


# ----------------------------------------------------------------------------------------------------------
# pipeline stages (scale section)


def test_global_reductions_across_pipeline_stages(dist_results):
    ref = reference_norm_over_stages()
    ts = stage_tensors(0) + stage_tensors(1)
    for rank in (0, 1):
        r = ok(dist_results[rank]["pipeline_stages"])
        np.testing.assert_allclose(r["global_norm"], ref, rtol=1e-6)
        np.testing.assert_allclose(r["sum_of_squares"], ref ** 2, rtol=1e-5)
        np.testing.assert_allclose(r["max_abs"], max(float(t.abs().max()) for t in ts), rtol=0)
        stage_only = np.sqrt(sum(float((t.double() ** 2).sum()) for t in stage_tensors(rank)))
        np.testing.assert_allclose(r["global_norm_stage_only"], stage_only, rtol=1e-6)
        np.testing.assert_allclose(r["empty_stage_norm"], np.sqrt(sum(float((t.double() ** 2).sum())
                                                                      for t in stage_tensors(0))), rtol=1e-6)
        assert r["any_non_finite"] == 1.0 and r["found_inf"] == 1.0  # the inf is on stage 1 only
        assert r["module_setting_restored"]


def test_optimize_loss_with_a_pipeline_group_matches_one_process(dist_results):
    ref = pipeline_train([0, 1], None)
    assert max(ref["norms"]) > 0.5  # the clip binds: the factor must come from both stages' norms
    for rank in (0, 1):
        got = ok(dist_results[rank]["pipeline_stages"])["train"]
        np.testing.assert_allclose(got["norms"], ref["norms"], rtol=1e-5)
        assert got["applied"] == ref["applied"]
        assert_close(got["params"][rank], ref["params"][rank], rtol=1e-5, atol=1e-7)


def test_a_non_finite_gradient_on_one_stage_skips_every_stage(dist_results):
    ref = pipeline_train([0, 1], None, nan_at=(1, 1))
    assert ref["applied"] == [True, False, True]
    for rank in (0, 1):
        got = ok(dist_results[rank]["pipeline_stages"])["train_nan"]
        assert got["applied"] == ref["applied"]
        assert_close(got["params"][rank], ref["params"][rank], rtol=1e-5, atol=1e-7)


def test_global_clipnorm_inside_pipeline_group_context(dist_results):
    ref = pipeline_global_clipnorm([0, 1], None)
    for rank in (0, 1):
        got = ok(dist_results[rank]["pipeline_stages"])["global_clipnorm"]
        assert_close(got[rank], ref[rank], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------
# state: FSDP2 mid-window guard (item 5)


def test_fsdp2_state_inside_a_window_is_refused(dist_results):
    for rank in (0, 1):
        r = ok(dist_results[rank]["fsdp_midwindow_state"])
        assert r["raised"] is not None and "window boundary" in r["raised"]
        assert r["boundary_micro"] == 0 and all(r["boundary_accumulators"])
