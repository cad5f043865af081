"""``optkit.distributed`` argument checks that need no process group (single process, no spawn)."""

from __future__ import annotations

import pytest
import torch

import optkit
from optkit import distributed as od
from optkit.sgd import SGD


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return model, SGD(model.named_parameters(), learning_rate=0.1, momentum=0.9)


def test_optimizer_must_be_a_torch_optimizer():
    model, _ = _model_and_opt()
    with pytest.raises(TypeError, match="optimizer"):
        od.get_optimizer_state_dict(model, object())
    with pytest.raises(TypeError, match="optimizer"):
        od.set_optimizer_state_dict(model, object(), {})


def test_state_dict_must_be_a_dict():
    model, opt = _model_and_opt()
    with pytest.raises(TypeError, match="optim_state_dict"):
        od.set_optimizer_state_dict(model, opt, [1, 2])


def test_parameters_outside_the_model_raise():
    model, _ = _model_and_opt()
    other = SGD([torch.nn.Parameter(torch.ones(2))], learning_rate=0.1)
    with pytest.raises(ValueError, match="not one of `model`'s parameters"):
        od.get_optimizer_state_dict(model, other)


def test_wrapper_mismatch_raises_before_loading():
    model, opt = _model_and_opt()
    wrapped = optkit.LossScaleOptimizer(opt, loss_scale="dynamic")
    before = {k: v.clone() for k, v in opt.state[model.weight].items()}
    scale = wrapped.loss_scale.clone()
    bad = {"state": {}, "param_groups": [], od.WRAPPERS_KEY: [{"type": "LARC"}]}
    with pytest.raises(ValueError, match="wrapper state"):
        od.set_optimizer_state_dict(model, wrapped, bad)
    bad[od.WRAPPERS_KEY] = [{"type": "LossScaleOptimizer", "bogus": 1}]
    with pytest.raises(ValueError):
        od.set_optimizer_state_dict(model, wrapped, bad)
    for k, v in opt.state[model.weight].items():
        assert torch.equal(v, before[k])
    assert torch.equal(wrapped.loss_scale, scale)


def test_check_mesh_and_replicated_need_a_device_mesh():
    with pytest.raises(TypeError, match="`mesh`"):
        od.check_mesh([("w", torch.ones(2))], "cpu")
    with pytest.raises(TypeError, match="`mesh`"):
        od.replicated(torch.zeros(()), None)


def test_optimizer_mesh_argument_is_checked_before_any_state():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match="`mesh`"):
        SGD([p], learning_rate=0.1, momentum=0.9, mesh="cpu")


def test_all_reduce_gradients_checks_arguments():
    g = torch.ones(3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="bucket_numel"):
            od.all_reduce_gradients_([g], bucket_numel=bad)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (3,), check_invariants=True)
    with pytest.raises(TypeError, match="sparse"):
        od.all_reduce_gradients_([sparse])
    assert torch.equal(g, torch.ones(3))
    # nothing to reduce: no process group needed
    assert od.all_reduce_gradients_([None, None]) == 0
