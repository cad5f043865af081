"""Reductions are batched: the collectives per optimizer step do not grow with the number of parameters."""

from __future__ import annotations

import pytest

from ._compare import ok

#: upper bound per step (LARS/LARC: one for the weight norms, one for the gradient norms)
LIMIT = {"lars": 2, "larc": 2}


def _counts(dist_results, rank=0):
    return ok(dist_results[rank]["collectives_per_step"])


def test_counts_do_not_depend_on_parameter_count(dist_results):
    counts = _counts(dist_results)
    assert counts, "no cases ran"
    for name, by_depth in counts.items():
        # 4 vs 12 sharded parameters
        assert by_depth[2] == by_depth[6], (name, by_depth)


@pytest.mark.parametrize("name", ["sgd_global_clipnorm_ema", "sgd_clipnorm", "clip_grads_by_global_norm_",
                                  "loss_scale_unscale_update", "lars", "larc", "loss_scale_optimizer"])
def test_few_collectives_per_step(dist_results, name):
    counts = _counts(dist_results)
    if name not in counts:
        pytest.skip(f"{name} not available")
    assert 1 <= counts[name][6] <= LIMIT.get(name, 1), counts[name]
    profiled = counts.get(name + "/profiled")
    if profiled is not None:  # the backend sees exactly the collectives optkit issued
        assert profiled[6] == counts[name][6]
