"""``optkit.recipes``: the MLPerf ResNet-50 LARS recipe. Its schedule against the TF formulas of the MLPerf
reference (``lars_util.py``'s ``poly_rate_schedule``: linear warm-up, then ``tf.train.polynomial_decay`` of
power 2 to 1e-4 over ``T − W + 1`` steps), and its first updates on a small conv/BN/fc network against a
float64 NumPy transcription of ``tf.contrib.opt.LARSOptimizer`` (TF 1.15) with batch-norm parameters and
biases skipped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import optkit
from optkit.recipes import mlperf_lars_defaults, mlperf_resnet50_lars, mlperf_resnet50_lars_kwargs

F64 = torch.float64


def tf_poly_rate(k, plr, w_steps, train_steps, end_lr=1e-4):
    """MLPerf's poly_rate_schedule at global step ``k`` (float64, from the TF source's formula)."""
    if k <= w_steps and w_steps > 0:
        return plr * k / w_steps
    decay_steps = train_steps - w_steps + 1
    step = min(max(1, k - w_steps), decay_steps)
    return (plr - end_lr) * (1 - step / decay_steps) ** 2 + end_lr


def tf_lars_step(w, g, a, lr, *, momentum=0.9, wd=1e-4, eeta=0.001, eps=1e-7, skipped=False):
    """tf.contrib.opt.LARSOptimizer (TF 1.15) on one variable, float64; ``eps`` defaults to the effective
    epsilon of mlcommons' TF2 reference (``epsilon or backend_config.epsilon()`` with ``lars_epsilon=0``)."""
    if skipped:
        scaled = lr
        g2 = g
    else:
        wn, gn = np.linalg.norm(w), np.linalg.norm(g)
        trust = eeta * wn / (gn + wd * wn + eps) if (wn > 0 and gn > 0) else 1.0
        scaled = lr * trust
        g2 = g + wd * w
    a = momentum * a + scaled * g2
    return w - a, a


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4))
        self.fc = nn.Linear(4, 5)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.layer1(h) + h)
        return self.fc(h.mean((2, 3)))


def test_defaults_by_batch_size():
    assert mlperf_lars_defaults(4096) == (10.0, 5)
    assert mlperf_lars_defaults(16384) == (25.0, 5)
    assert mlperf_lars_defaults(65536) == (31.2, 25)


@pytest.mark.parametrize("batch_size", [1024, 20000, 32768])
def test_schedule_matches_the_reference_formula(batch_size):
    torch.manual_seed(0)
    recipe = mlperf_resnet50_lars(Net(), batch_size, epochs=30, steps_per_epoch=7)
    plr, w_epochs = mlperf_lars_defaults(batch_size)
    for k in range(recipe.total_steps + 3):
        expected = tf_poly_rate(k, plr, w_epochs * 7, 30 * 7)
        assert recipe.schedule(k) == pytest.approx(expected, rel=1e-12, abs=1e-15), k
    assert recipe.schedule(0) == 0.0 and recipe.schedule(w_epochs * 7) == pytest.approx(plr)


def test_first_updates_match_float64_reference():
    """Six updates over the warm-up (steps_per_epoch 1, warm-up 5): batch norm and biases skipped, every
    other tensor trust-scaled, momentum 0.9, weight decay 1e-4."""
    torch.manual_seed(0)
    model = Net().double()
    recipe = mlperf_resnet50_lars(model, batch_size=256, epochs=20, steps_per_epoch=1, base_lr=2.0)
    assert sorted(recipe.skipped) == sorted(["bn1.weight", "bn1.bias", "layer1.1.weight", "layer1.1.bias",
                                             "fc.bias"])
    names = [n for n, _ in model.named_parameters()]
    ws = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    accs = {n: np.zeros_like(w) for n, w in ws.items()}
    g = torch.Generator().manual_seed(1)
    for k in range(6):
        x = torch.randn(8, 3, 6, 6, generator=g, dtype=F64)
        y = torch.randint(0, 5, (8,), generator=g)
        recipe.optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
        recipe.optimizer.step()
        lr = tf_poly_rate(k, 2.0, 5, 20)
        for n in names:
            ws[n], accs[n] = tf_lars_step(ws[n], grads[n], accs[n], lr, skipped=n in recipe.skipped)
    for n, p in model.named_parameters():  # (float64 parameters: the schedule is evaluated in float64)
        np.testing.assert_allclose(p.detach().numpy(), ws[n], rtol=1e-12, atol=1e-13, err_msg=n)
    assert int(recipe.optimizer.iterations) == 6


@pytest.mark.parametrize("epsilon", [None, 0.0])
def test_epsilon_is_the_tf2_references_effective_one(epsilon):
    """mlcommons' TF2 reference (``image_classification/tensorflow2``) passes ``lars_epsilon`` (default 0) to
    an optimizer that keeps ``epsilon or backend_config.epsilon()``: every run has ε = 1e-7 in
    ``eeta·‖w‖/(‖g‖ + wd·‖w‖ + ε)``. The recipe's default is that ε; ``epsilon=0.0`` gives the TF 1
    references'. With gradients of norm ~1e-4 (as ``wd·‖w‖``) ε is a ~1e-3 effect on the updates, which
    are compared (float64 NumPy reference) to 1e-5."""
    torch.manual_seed(0)
    model = Net().double()
    opts = {} if epsilon is None else {"epsilon": epsilon}
    eps = 1e-7 if epsilon is None else epsilon
    recipe = mlperf_resnet50_lars(model, batch_size=256, epochs=20, steps_per_epoch=1, base_lr=2.0, **opts)
    assert all(g["epsilon"] == eps for g in recipe.optimizer.param_groups)
    assert mlperf_resnet50_lars_kwargs(model, 256, 20, 1, **opts)["optimizer_params"]["epsilon"] == eps
    w0 = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    ws = {n: w.copy() for n, w in w0.items()}
    accs = {n: np.zeros_like(w) for n, w in ws.items()}
    rng = np.random.default_rng(5)
    for k in range(3):
        grads = {n: 1e-5 * rng.standard_normal(w.shape) for n, w in ws.items()}
        for n, p in model.named_parameters():
            p.grad = torch.from_numpy(grads[n].copy())
        recipe.optimizer.step()
        lr = tf_poly_rate(k, 2.0, 5, 20)
        for n in ws:
            ws[n], accs[n] = tf_lars_step(ws[n], grads[n], accs[n], lr, eps=eps, skipped=n in recipe.skipped)
    for n, p in model.named_parameters():  # the updates; the schedule is evaluated in fp32 (~1e-7)
        np.testing.assert_allclose(p.detach().numpy() - w0[n], ws[n] - w0[n], rtol=1e-5, atol=0, err_msg=n)


def test_optimize_loss_form_gives_the_same_updates():
    """The two documented forms agree in float64 to rounding: the optimizer's schedule (called with the
    update count as a float64 tensor for float64 parameters) and the train op's (a Python count)."""
    torch.manual_seed(0)
    m1 = Net().double()
    m2 = Net().double()
    m2.load_state_dict(m1.state_dict())
    recipe = mlperf_resnet50_lars(m1, 512, epochs=10, steps_per_epoch=2, base_lr=1.0)
    kw = mlperf_resnet50_lars_kwargs(m2, 512, epochs=10, steps_per_epoch=2, base_lr=1.0)
    op = optkit.optimize_loss(lambda x, y: nn.functional.cross_entropy(m2(x), y), model=m2, **kw)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        x = torch.randn(8, 3, 6, 6, generator=g, dtype=F64)
        y = torch.randint(0, 5, (8,), generator=g)
        recipe.optimizer.zero_grad()
        nn.functional.cross_entropy(m1(x), y).backward()
        recipe.optimizer.step()
        op(x, y)
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15, msg=n)


def test_tf_skip_list_and_bad_arguments():
    torch.manual_seed(0)
    recipe = mlperf_resnet50_lars(Net(), 256, 10, 3, skip_list=["fc"])
    assert recipe.skipped == ["fc.weight", "fc.bias"]
    for kwargs, err, match in [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(epochs=2.5), TypeError, "epochs"),
        (dict(steps_per_epoch=0), ValueError, "steps_per_epoch"),
        (dict(warmup_epochs=10), ValueError, "warmup_epochs"),
        (dict(base_lr=0.0), ValueError, "base_lr"),
        (dict(end_lr=100.0), ValueError, "end_lr"),
        (dict(skip_list="bias"), TypeError, "skip_list"),
        (dict(momentum=-1.0), ValueError, "momentum"),
    ]:
        args = dict(batch_size=256, epochs=10, steps_per_epoch=3)
        args.update(kwargs)
        with pytest.raises(err, match=match):
            mlperf_resnet50_lars(Net(), **args)
