"""A non-finite gradient in one rank's shard skips the step on every rank, and changes nothing there."""

from __future__ import annotations

import pytest

from ._compare import assert_equal, ok


def test_protocol_skip_on_every_rank(dist_results):
    r0 = ok(dist_results[0]["nonfinite_skip"])
    for rank in (0, 1):
        r = ok(dist_results[rank]["nonfinite_skip"])
        s0, s1 = r["step0"], r["step1"]
        assert s0["found_inf"] == 1.0 and not s0["should_apply"] and not s0["applied"]
        assert s0["scale"] == 8.0  # halved once on every rank
        assert_equal(s0["snap"]["params"], r["before"]["params"])
        assert_equal(s0["snap"]["state"], r["before"]["state"])
        assert s0["snap"]["iterations"] == 0
        assert s1["found_inf"] == 0.0 and s1["applied"] and s1["snap"]["iterations"] == 1
        assert_equal(s1["snap"]["params"], r0["step1"]["snap"]["params"])


def test_loss_scale_optimizer_skip_on_every_rank(dist_results):
    r0 = dist_results[0]["nonfinite_skip_wrapper"]
    if r0 is None:
        pytest.skip("LossScaleOptimizer is not available")
    for rank in (0, 1):
        r = ok(dist_results[rank]["nonfinite_skip_wrapper"])
        s0, s1 = r["step0"], r["step1"]
        assert not s0["applied"] and s0["snap"]["iterations"] == 0
        assert s0["scale"] == 8.0
        assert_equal(s0["snap"]["params"], r["before"]["params"])
        assert_equal(s0["snap"]["state"], r["before"]["state"])
        assert s1["applied"] and s1["snap"]["iterations"] == 1
        assert_equal(s1["snap"]["params"], ok(r0)["step1"]["snap"]["params"])


def test_torch_grad_scaler_skips_on_every_rank(dist_results):
    for rank in (0, 1):
        r = ok(dist_results[rank]["grad_scaler_interop"])
        assert_equal(r["after"]["params"], r["before"]["params"])
        assert_equal(r["after"]["state"], r["before"]["state"])
        assert r["after"]["iterations"] == 0
        assert r["scale"] == 8.0
