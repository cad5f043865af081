"""``optimize_loss(on_horovod=...)`` on 2 ranks matches one process trained on the mean of both ranks' losses:
a plain replicated model (bucketed all-reduce average) and an FSDP2 model (FSDP2 already averages, so
``on_horovod`` must add no second reduction)."""

from __future__ import annotations

import pytest

from ._compare import assert_close, assert_equal, ok
from .scenarios import train_op_reference

CASES = ["replicated_horovod", "fsdp", "fsdp_horovod"]


@pytest.fixture(scope="module")
def reference():
    return train_op_reference()


@pytest.mark.parametrize("case", CASES)
def test_matches_single_process(dist_results, reference, case):
    results = ok(dist_results[0]["optimize_loss"])
    got = ok(results[case])
    assert got["global_step"] == reference["global_step"] == 2
    assert_close(got["norms"], reference["norms"], rtol=1e-5, atol=1e-6)
    assert_close(got["params"], reference["params"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_ranks_agree(dist_results, case):
    r0 = ok(ok(dist_results[0]["optimize_loss"])[case])
    r1 = ok(ok(dist_results[1]["optimize_loss"])[case])
    assert_equal(r1["params"], r0["params"])
