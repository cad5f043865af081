"""Whole-tensor reductions over DTensors on several meshes at once (1-D, 1x2 and 2x1) plus a plain tensor."""

from __future__ import annotations

import numpy as np

from ._compare import assert_close, ok
from .mesh_scenarios import multi_mesh_fulls, multi_mesh_optimizers, multi_mesh_train


def _fulls():
    return [t.double().numpy() for t in multi_mesh_fulls()]


def _r(dist_results, rank=0):
    return ok(dist_results[rank]["multi_mesh_norms"])


def test_global_norm_over_several_meshes(dist_results):
    ref = np.sqrt(sum(np.sum(t ** 2) for t in _fulls()))
    for rank in (0, 1):
        r = _r(dist_results, rank)
        np.testing.assert_allclose(r["norm"], ref, rtol=1e-6)
        np.testing.assert_allclose(r["norm_clip"], ref, rtol=1e-6)


def test_per_tensor_norms_and_max_abs(dist_results):
    f = _fulls()
    r = _r(dist_results)
    np.testing.assert_allclose(r["per"], [np.sqrt(np.sum(t ** 2)) for t in f], rtol=1e-6)
    np.testing.assert_allclose(r["amax"], max(np.abs(t).max() for t in f), rtol=0)


def test_clip_by_global_norm_keeps_layout(dist_results):
    f = _fulls()
    n = np.sqrt(sum(np.sum(t ** 2) for t in f))
    r = _r(dist_results)
    assert all(r["placements_kept"])
    assert_close(r["clipped"], [t * 1.5 / max(n, 1.5) for t in f], rtol=1e-6, atol=1e-7)


def test_norms_along_dims_crossing_the_shard(dist_results):
    f = _fulls()
    for rank in (0, 1):
        r = _r(dist_results, rank)
        ref = [np.sqrt(np.sum(t ** 2, axis=tuple(d), keepdims=True)) for t, d in zip(f, r["along_dims"])]
        assert_close(r["along"], ref, rtol=1e-6, atol=1e-7)
        # two (mesh, mesh-dim) pairs cross a shard (1-D mesh dim 0, the 1x2 mesh's dim 1); both join ranks
        # {0, 1}: one process group, so one collective
        assert r["along_collectives"] == 1


def test_one_collective_per_mesh_group(dist_results):
    r = _r(dist_results)
    # three (mesh, sharded dim) pairs: 1-D (2 tensors), 1x2 dim 1, 2x1 dim 0; replicated ones need none.
    # All three are the group of ranks {0, 1}: collectives are per process group, so one in all.
    assert r["collectives"] == 1
    assert r["profiled"] == 1


def test_non_finite_flag_agrees_on_every_rank(dist_results):
    for rank in (0, 1):
        r = _r(dist_results, rank)
        assert r["flag_finite"] == 0.0
        assert r["flag_nan"] == 1.0  # the NaN sits in rank 1's shard only


def test_optimizers_over_several_meshes_match_single_process(dist_results):
    """SGD (global and per-tensor clipping, EMA, decay) and LARS over parameters on a 1-D mesh, a 1x2 mesh, a
    2x1 mesh and a plain tensor, against the same run on whole tensors in this process."""
    ref = multi_mesh_train(lambda ts: ts)
    assert set(ref) == set(multi_mesh_optimizers())
    for rank in (0, 1):
        got = ok(dist_results[rank]["multi_mesh_step"])
        assert set(got) == set(ref)
        for name in ref:
            assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, path=name)
