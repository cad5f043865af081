"""``optimize_loss`` with ``(loss_sum, num_items)`` on 2 gloo ranks equals one process on the pooled loss of
every rank's micro-batches (``token_scenarios``): on_horovod, DDP, DDP + "mixed" (fp32 window sums reduced by
the train op) and FSDP2. One spawned launch for all cases, bounded at 180 s."""

from __future__ import annotations

import pytest
import torch

from ._spawn import run_on_ranks
from .token_scenarios import reference, token_cases

CASES = ["horovod", "ddp", "ddp_mixed", "fsdp"]


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(token_cases, world_size=2, timeout=180.0)


@pytest.mark.parametrize("case", CASES)
def test_pooled_over_window_and_ranks(results, case):
    ref = reference()
    for rank in range(2):
        status, got = results[rank][case]
        assert status == "ok", got
        # float64 models: the count (Σ over the window and the ranks, 26 here) divides in float64, to 1e-12
        tol = dict(rtol=2e-2, atol=2e-2) if case == "ddp_mixed" else dict(rtol=1e-12, atol=1e-14)
        for g, r in zip(got, ref):
            torch.testing.assert_close(torch.from_numpy(g), r, **tol)
    for a, b in zip(results[0][case][1], results[1][case][1]):
        assert (a == b).all()
