"""The optimizers' ``mesh=`` argument (seed 004) and the data-parallel gradient averaging helper."""

from __future__ import annotations

import numpy as np

from ._compare import ok


def test_seed_004_example_on_a_2x1_mesh(dist_results):
    for rank in (0, 1):
        r = ok(dist_results[rank]["mesh_argument"])
        assert r["iterations"] == 1
        np.testing.assert_allclose(r["m"], np.full((4, 4), -0.01), rtol=1e-6)
        np.testing.assert_allclose(r["w"], np.full((4, 4), 0.99), rtol=1e-6)
        assert r["m_layout_ok"]
        assert r["iterations_device"] == "cpu"
        assert r["replicated_iterations"] == (1, ("R", "R"))


def test_parameters_off_the_mesh_raise(dist_results):
    errors = ok(dist_results[0]["mesh_argument"])["errors"]
    kind, msg = errors["other_mesh"]
    assert kind == "ValueError" and "'u'" in msg and "mesh" in msg
    kind, msg = errors["plain"]
    assert kind == "ValueError" and "'plain_p'" in msg
    kind, msg = errors["not_a_mesh"]
    assert kind == "TypeError" and "`mesh`" in msg


def test_all_reduce_gradients_averages_in_buckets(dist_results):
    r0, r1 = ok(dist_results[0]["all_reduce_gradients"]), ok(dist_results[1]["all_reduce_gradients"])
    for i, (a, b) in enumerate(zip(r0["before"], r1["before"])):
        if a is None:
            assert r0["after"][i] is None
            continue
        mean = (a.astype(np.float64) + b) / 2
        np.testing.assert_allclose(r0["after"][i], mean, rtol=1e-6)
        np.testing.assert_array_equal(r0["after"][i], r1["after"][i])
    # 15 + 7 + 8 elements in buckets of at most 22: [15, 7] and [8]
    assert r0["calls"] == r0["counted"] == 2
