"""Tensor parallelism (issue #12 items 1-2): FSDP2 x TP on a 2-D mesh (4 ranks, dp=2 x tp=2) and tensor +
sequence parallel without FSDP2 (2 and 4 ranks) train exactly like one process on whole tensors.

FSDP2 gives column-parallel weights ``_StridedShard`` on the dp dim (not a ``Shard``): norms that skipped
that dim were wrong on every rank. Sequence parallelism leaves the LayerNorm gradients ``Partial``: applied
shard-locally they made the replicas diverge. See ``tp_scenarios`` for the model and the plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ._compare import assert_close, assert_equal, ok
from .tp_scenarios import (
    DP,
    OPTIMIZERS,
    TRAIN_OP_CASES,
    TPNet,
    loss_of,
    reference,
    sp_reference,
    train_op_reference,
)

RANKS = range(DP * 2)


def _fsdp_tp(tp_results, rank=0):
    return tp_results[rank]["fsdp_tp"]


def test_the_layout_under_test_has_strided_shards(tp_results):
    pl = _fsdp_tp(tp_results)["placements"]
    assert pl["up.weight"][0].startswith("_S(0"), pl  # FSDP2's _StridedShard on dp
    assert pl["up.weight"][1] == "S(0)" and pl["down.weight"] == ["S(0)", "S(1)"]
    assert pl["norm.weight"] == ["S(0)", "R"] and pl["head.weight"] == ["S(0)"]  # head: the dp sub-mesh


@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_fsdp2_tp_matches_single_process(tp_results, case):
    ref = reference(case)
    for rank in RANKS:
        got = ok(_fsdp_tp(tp_results, rank)[f"opt/{case}"])
        assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-7, path=f"{case}/norms")
        assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6, path=f"{case}/params")
        assert_close(got["state"], ref["state"], rtol=1e-5, atol=1e-6, path=f"{case}/state")
        assert got["loss_scale"] == ref["loss_scale"]


@pytest.mark.parametrize("case", list(OPTIMIZERS) + [f"train_op/{c}" for c in TRAIN_OP_CASES])
def test_fsdp2_tp_ranks_agree_exactly(tp_results, case):
    key = case if case.startswith("train_op/") else f"opt/{case}"
    r0 = ok(_fsdp_tp(tp_results, 0)[key])
    for rank in RANKS:
        got = ok(_fsdp_tp(tp_results, rank)[key])
        assert_equal(got["params"], r0["params"])
        assert_equal(got["norms"], r0["norms"])


@pytest.mark.parametrize("case", list(TRAIN_OP_CASES))
def test_fsdp2_tp_optimize_loss_matches_single_process(tp_results, case):
    ref = train_op_reference(case)
    assert ref["global_step"] >= 2 and all(ref["applied"])
    for rank in RANKS:
        got = ok(_fsdp_tp(tp_results, rank)[f"train_op/{case}"])
        assert got["global_step"] == ref["global_step"] and got["applied"] == ref["applied"]
        assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-7)
        assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)


def _reference_grads() -> list[np.ndarray]:
    model = TPNet()
    loss_of(model, 0, None, None).backward()
    return [p.grad.double().numpy() for p in model.parameters()]


def test_norm_functions_on_fsdp2_tp_gradients(tp_results):
    """global_norm, clip_by_global_norm, per-tensor norms and max-abs against float64 NumPy."""
    g = _reference_grads()
    ref = np.sqrt(sum(np.sum(x ** 2) for x in g))
    for rank in RANKS:
        r = ok(_fsdp_tp(tp_results, rank)["norm_functions"])
        np.testing.assert_allclose(r["global_norm"], ref, rtol=1e-5)
        np.testing.assert_allclose(r["clip_by_global_norm"], ref, rtol=1e-5)
        np.testing.assert_allclose(r["per_tensor"], [np.sqrt(np.sum(x ** 2)) for x in g], rtol=1e-5)
        np.testing.assert_allclose(r["max_abs"], max(np.abs(x).max() for x in g), rtol=1e-6)
        assert_close(r["clipped"], [x * 0.01 / ref for x in g], rtol=1e-5, atol=1e-9)


#: collectives per step on the 2-D mesh: every norm-type reduction costs one all-reduce per mesh-dim group
#: (dp and tp; the 1-D dp sub-mesh shares the dp group), whatever the number of parameters
EXPECTED_COLLECTIVES = {
    "sgd_global_clipnorm": 2, "sgd_clipnorm": 2, "lars": 2, "larc": 2, "variable_clipping": 2,
    "clip_grads_by_global_norm_": 2,
    "loss_scale_dynamic": 1,  # the overflow flag: one all-reduce over the world (the mesh spans it)
    "loss_scale_logmax": 2,  # max|g| per mesh-dim group
    "optimize_loss_clip_dynamic": 2,  # norm and overflow flag travel together
    # max|g| (2), norm (2), LARC look-ahead ratios for LogMax (2), LARC's own ratios (2)
    "optimize_loss_larc_logmax": 8,
}


@pytest.mark.parametrize("name", sorted(EXPECTED_COLLECTIVES))
def test_collectives_per_step_do_not_grow_with_parameters(tp_results, name):
    counts = ok(_fsdp_tp(tp_results)["collectives"])
    assert counts[name] == {50: EXPECTED_COLLECTIVES[name], 500: EXPECTED_COLLECTIVES[name]}, counts[name]


# ----------------------------------------------------------------------------------------------------------
# tensor + sequence parallel, no FSDP2: Partial gradients


def _sp_results(dist_results, tp_results, world):
    res = dist_results if world == 2 else [r["sp"] for r in tp_results]
    if world == 2:
        res = [r["tp_sequence_parallel"] for r in res]
    return [ok(r) for r in res]


@pytest.mark.parametrize("world", [2, 4])
def test_partial_gradients_are_reduced_in_one_collective(dist_results, tp_results, world):
    ref_model = TPNet()
    loss_of(ref_model, 0, 0, None).backward()
    for r in _sp_results(dist_results, tp_results, world):
        pg = ok(r["partial_grads"])
        assert pg["before"]["norm.weight"] == ["P(sum)"] and pg["before"]["norm.bias"] == ["P(sum)"]
        assert pg["after"]["norm.weight"] == ["R"] and pg["after"]["norm.bias"] == ["R"]
        assert pg["after"]["up.weight"] == pg["before"]["up.weight"] == ["S(0)"]
        assert pg["reduced"] == 2 and pg["collectives"] == 1  # both LayerNorm gradients in one all-reduce
        np.testing.assert_allclose(pg["norm_weight_grad"], ref_model.norm.weight.grad.numpy(), rtol=1e-5,
                                   atol=1e-7)
        np.testing.assert_allclose(pg["norm_bias_grad"], ref_model.norm.bias.grad.numpy(), rtol=1e-5,
                                   atol=1e-7)
        # the shard-local value alone is not the gradient
        assert abs(pg["local_norm"] - float(ref_model.norm.weight.grad.norm())) > 1e-3


@pytest.mark.parametrize("case", ["sgd_global_clipnorm", "lars"])
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_optimizers_match_single_process(dist_results, tp_results, world, case):
    ref = sp_reference(case)
    results = _sp_results(dist_results, tp_results, world)
    for r in results:
        got = ok(r[f"opt/{case}"])
        assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-7)
        assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)
    # the replicated LayerNorm weights stay identical on every rank
    for name in ("norm.weight", "norm.bias", "down.bias"):
        for r in results:
            np.testing.assert_array_equal(ok(r[f"opt/{case}"])["local"][name],
                                          ok(results[0][f"opt/{case}"])["local"][name])


@pytest.mark.parametrize("case", list(TRAIN_OP_CASES))
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_optimize_loss_matches_single_process(dist_results, tp_results, world, case):
    ref = sp_reference(case)
    for r in _sp_results(dist_results, tp_results, world):
        got = ok(r[f"train_op/{case}"])
        assert got["global_step"] == ref["global_step"]
        assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=1e-7)
        assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)


def test_reference_is_not_trivial():
    """The cases move the weights and the clip/variable-clip thresholds bind (so the tests can fail)."""
    model = TPNet()
    before = [p.detach().clone() for p in model.parameters()]
    reference("sgd_global_clipnorm")
    r = reference("variable_clipping")
    col = np.linalg.norm(r["params"]["up.weight"], axis=0)
    assert np.isclose(col.max(), 0.45, rtol=1e-5)  # clipped to the max norm
    assert all(isinstance(b, torch.Tensor) for b in before)
    assert max(reference("sgd_global_clipnorm")["norms"]) > 0.05  # global clipnorm 0.05 binds
