"""The lean modes (``precision="split"|"kahan"``, ``state_dtype="int8"|"bfloat16"``) on FSDP2 (Shard(0), 2
gloo ranks) and tensor-parallel Shard(1) parameters match the same optimizer on the whole tensors in one
process, fed the same gradients: bit for bit for the elementwise rules (SGD, AdamW), to fp32 rounding of the
mesh-reduced norms for the trust-ratio rules (LARS, LAMB). The compact state is sharded like the parameter
(block scales along its rows); a 1-d sharded or a Shard(1) parameter keeps float32 slots. DCP round trips of
the compact state resume bit-identically, and a full (gathered) state dict loads into a 1-rank optimizer.
See ``lean_scenarios`` for the parameters and their edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from optkit._core.lowp import scales_shape

from ._compare import assert_close, assert_equal, ok
from .lean_scenarios import ELEMENTWISE, MODES, NORMED, SHAPES, _optimizer, _train, reference


def _lean(dist_results, rank=0):
    return ok(dist_results[rank]["lean_modes"])


def _case(dist_results, key, rank=0):
    return ok(_lean(dist_results, rank)[key])


def _master(params: np.ndarray, state: dict) -> np.ndarray:
    """The weight the optimizer holds: the split master (bf16 high half + low half, raw 16 bits) or p + Kahan
    sum."""
    if "master_low" in state:
        low = state["master_low"].astype(np.uint16).astype(np.uint32)
        bits = params.astype(np.float32).view(np.uint32) | low
        return bits.view(np.float32)
    if "kahan_comp" in state:
        return params.astype(np.float64) + state["kahan_comp"]
    return params


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_fsdp2_elementwise_rules_are_bit_identical(dist_results, name, mode):
    got, ref = _case(dist_results, f"fsdp/{name}/{mode}"), reference(name, mode)
    assert_equal(got["params"], ref["params"])
    assert_equal(got["state"], ref["state"])  # codes, scales, low halves, compensations


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", NORMED)
def test_fsdp2_trust_ratio_rules_match_to_mesh_norm_rounding(dist_results, name, mode):
    got, ref = _case(dist_results, f"fsdp/{name}/{mode}"), reference(name, mode)
    for n in SHAPES:
        gs, rs = got["state"][n], ref["state"][n]
        assert set(gs) == set(rs)
        # a norm summed over two shards rounds differently: fp32 rounding in the master, at most one bf16
        # ulp in the visible weight
        # (the Kahan sum carries a bfloat16 compensation whose own rounding may differ: < 2^-13 here)
        atol = 1e-6 if "master_low" in gs else 2 ** -13
        assert_close(_master(got["params"][n], gs), _master(ref["params"][n], rs), rtol=1e-5, atol=atol,
                     path=f"{n}/master")
        assert_close(got["params"][n], ref["params"][n], rtol=2 ** -7, atol=0.0, path=f"{n}/param")
        slot_rtol = 2 ** -7 if MODES[mode][1] == "bfloat16" else 1e-5  # (one bfloat16 ulp)
        assert_close(got["decoded"][n], ref["decoded"][n], rtol=slot_rtol, atol=1e-6, path=f"{n}/slots")
    # the row held by rank 0 alone reduces nothing: bit for bit
    assert_equal(got["params"]["row"], ref["params"]["row"])


@pytest.mark.parametrize("key", [f"fsdp/{n}/{m}" for m in MODES for n in ELEMENTWISE + NORMED]
                         + ["tp/adam/split_int8", "tp/lars/split_int8"])
def test_ranks_agree_exactly(dist_results, key):
    r0, r1 = _case(dist_results, key, 0), _case(dist_results, key, 1)
    for part in ("params", "state", "decoded"):
        assert_equal(r1[part], r0[part])


@pytest.mark.parametrize("mode", ["split_int8", "kahan_int8"])
def test_compact_state_is_sharded_like_the_parameter(dist_results, mode):
    extra = "master_low" if mode.startswith("split") else "kahan_comp"
    for rank in (0, 1):
        lay = _case(dist_results, f"fsdp/adam/{mode}", rank)["layout"]
        for n in SHAPES:
            param = lay[n]["param"]
            assert param[1:3] == (True, ("S(0)",)), param
            local = param[4]
            assert lay[n][extra] == ("torch.bfloat16",
                                     *param[1:])
            for slot in ("exp_avg", "exp_avg_sq"):
                if n in ("w", "row"):  # 2-d, >= 4096 elements in all: 8 bits, scales along the rows
                    assert lay[n][slot] == ("torch.uint8", *param[1:])
                    glob = scales_shape(SHAPES[n])
                    assert lay[n][f"{slot}_absmax"] == ("torch.float32", True, ("S(0)",), glob,
                                                        (local[0], glob[1]))
                else:  # vec: 1-d sharded (its scales would not shard with it); bias: too small
                    assert lay[n][slot] == ("torch.float32", *param[1:])
                    assert f"{slot}_absmax" not in lay[n]
    # the edge cases really occur: w's shards straddle the 4096-element threshold, rank 1 holds no row
    w0 = _case(dist_results, "fsdp/adam/split_int8", 0)["layout"]["w"]["param"][4]
    w1 = _case(dist_results, "fsdp/adam/split_int8", 1)["layout"]["w"]["param"][4]
    assert np.prod(w0) >= 4096 > np.prod(w1)
    assert _case(dist_results, "fsdp/adam/split_int8", 1)["layout"]["row"]["param"][4] == (0, 4096)


@pytest.mark.parametrize("name", ["adam", "lars"])
def test_tensor_parallel_shard1_keeps_float32_slots_and_matches(dist_results, name):
    got = _case(dist_results, f"tp/{name}/split_int8")
    ref = reference(name, "split_int8", fallback=("w", "row", "vec"))
    for n in ("w", "row"):
        assert got["layout"][n]["param"][1:3] == (True, ("S(1)",))
        for slot in got["decoded"][n]:
            assert got["layout"][n][slot][0] == "torch.float32"
            assert f"{slot}_absmax" not in got["layout"][n]
    if name == "adam":
        assert_equal(got["params"], ref["params"])
        assert_equal(got["state"], ref["state"])
    else:
        for n in SHAPES:
            assert_close(_master(got["params"][n], got["state"][n]),
                         _master(ref["params"][n], ref["state"][n]), rtol=1e-5, atol=1e-6, path=n)
            assert_close(got["decoded"][n], ref["decoded"][n], rtol=1e-5, atol=1e-6, path=n)


@pytest.mark.parametrize("key", ["dcp/adam/split_int8", "dcp/adam/kahan_int8", "dcp/sgd/kahan_bf16"])
def test_dcp_round_trip_of_compact_state_resumes_bit_identically(dist_results, key):
    for rank in (0, 1):
        r = _case(dist_results, key, rank)
        assert_equal(r["resumed"]["params"], r["cont"]["params"])
        assert_equal(r["resumed"]["state"], r["cont"]["state"])
    saved = _case(dist_results, key, 0)["saved_layout"]["w"]
    if "int8" in key:  # the checkpoint holds the compact forms, sharded
        assert saved["exp_avg"][:3] == ("torch.uint8", True, ("S(0)",))
        assert saved["exp_avg_absmax"][:4] == ("torch.float32", True, ("S(0)",), (63, 1))
    else:
        assert saved["momentum"][:3] == ("torch.bfloat16", True, ("S(0)",))


def _tensor(value, key: str, dtype: str) -> torch.Tensor:
    """A gathered state entry back as a tensor (``master_low``'s raw bits as they were)."""
    t = torch.from_numpy(np.asarray(value))
    return t.view(torch.bfloat16) if key == "master_low" else t.to(getattr(torch, dtype[6:]))


@pytest.mark.parametrize("key", ["dcp/adam/split_int8", "dcp/adam/kahan_int8", "dcp/sgd/kahan_bf16"])
def test_full_state_dict_loads_into_one_process(dist_results, key):
    """Gathered through NCCL/gloo collectives, which have no int16: split masters' low halves travel as the
    raw bits of a bfloat16 tensor."""
    r = _case(dist_results, key, 0)
    _, name, mode = key.split("/")
    precision, state_dtype = MODES[mode]
    full = r["full_sd"]
    extra = "master_low" if precision == "split" else "kahan_comp"
    assert full["dtypes"]["w"][extra] == "torch.bfloat16"
    sd = {"state": {k: {s: _tensor(v, s, full["dtypes"][k][s])
                        if s in full["dtypes"][k] else v for s, v in st.items()}
                    for k, st in full["state"].items()},
          "param_groups": full["param_groups"]}
    named = {n: nn.Parameter(torch.from_numpy(r["params_at_save"][n]).to(torch.bfloat16)) for n in SHAPES}
    opt = _optimizer(name)(list(named.items()), precision=precision, state_dtype=state_dtype)
    opt.load_state_dict(sd)
    got = _train(named, opt, 2, start=2)
    cont = r["cont"]
    # one process keeps vec's slots in 8 bits (the 2-rank run: float32, 1-d sharded): loaded exactly, then
    # rounded to 8 bits each step
    same = [n for n in SHAPES if n != "vec" or state_dtype != "int8"]
    for n in same:
        assert_equal(got["params"][n], cont["params"][n])
        assert_equal(got["state"][n], cont["state"][n])
    if "vec" not in same:
        assert_close(got["params"]["vec"], cont["params"]["vec"], rtol=2 ** -7, atol=1e-3)
