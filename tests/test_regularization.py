"""Tests for optkit.regularization (spec/openseq2seq.md §2): registration on parameters and modules, the fp32
sum, TF-style scope filtering, the empty branch, the l1/l2 forms against float64 NumPy, and the errors."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from optkit.regularization import (
    add_regularizer,
    clear_regularizers,
    get_regularization_loss,
    l1_regularizer,
    l2_regularizer,
    regularized_parameters,
)


@pytest.fixture(autouse=True)
def _clean():
    clear_regularizers()
    yield
    clear_regularizers()


def test_empty_gives_fp32_zero():
    r = get_regularization_loss()
    assert r.dtype == torch.float32 and r.shape == () and float(r) == 0.0


def test_l2_and_l1_values(rng):
    a = rng.standard_normal((3, 4))
    b = rng.standard_normal(5)
    pa = torch.nn.Parameter(torch.tensor(a))
    pb = torch.nn.Parameter(torch.tensor(b))
    add_regularizer(pa, l2_regularizer(0.01), name="enc/kernel")
    add_regularizer(pb, l1_regularizer(0.5), name="dec/kernel")
    total = get_regularization_loss()
    want = 0.01 * (a**2).sum() / 2 + 0.5 * np.abs(b).sum()
    assert total.dtype == torch.float32
    np.testing.assert_allclose(float(total.detach()), want, rtol=1e-6)
    (g,) = torch.autograd.grad(total, [pa])
    np.testing.assert_allclose(g.numpy(), 0.01 * a, rtol=1e-6)


def test_scope_filter_is_a_prefix_regex_match(rng):
    ps = {n: torch.nn.Parameter(torch.tensor(rng.standard_normal(3))) for n in
          ("encoder/conv1", "encoder/conv2", "decoder/rnn", "my_encoder/x")}
    for n, p in ps.items():
        add_regularizer(p, l2_regularizer(1.0), name=n)

    def want(names):
        return sum((ps[n].detach().numpy() ** 2).sum() / 2 for n in names)

    np.testing.assert_allclose(float(get_regularization_loss("encoder").detach()),
                               want(["encoder/conv1", "encoder/conv2"]), rtol=1e-6)
    np.testing.assert_allclose(float(get_regularization_loss("enc.*conv2").detach()),
                               want(["encoder/conv2"]), rtol=1e-6)
    assert float(get_regularization_loss("nothing")) == 0.0
    assert len(regularized_parameters(scope="decoder")) == 1


def test_module_registration_names_and_regex():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    names = add_regularizer(model, l2_regularizer(0.1), name="net", param_regex=r"weight$")
    assert names == ["net.0.weight", "net.1.weight"]
    want = sum(0.1 * (m.weight.detach().double() ** 2).sum().item() / 2 for m in model)
    np.testing.assert_allclose(float(get_regularization_loss().detach()), want, rtol=1e-6)
    np.testing.assert_allclose(float(get_regularization_loss(r"net\.1").detach()),
                               0.1 * (model[1].weight.detach().double() ** 2).sum().item() / 2, rtol=1e-6)
    clear_regularizers(model[0])
    assert [n for _, _, n in regularized_parameters()] == ["net.1.weight"]


def test_half_losses_are_summed_in_fp32():
    p16 = torch.nn.Parameter(torch.full((4,), 100.0, dtype=torch.float16))
    p32 = torch.nn.Parameter(torch.full((2,), 0.5))
    add_regularizer(p16, l2_regularizer(1.0))
    add_regularizer(p32, l2_regularizer(1.0))
    total = get_regularization_loss()
    assert total.dtype == torch.float32
    # 4·100²/2 = 20000 (exact in fp16) plus 2·0.5²/2 = 0.25: 20000.25 in fp32; an fp16 sum would give 20000
    assert float(total.detach()) == 20000.25


def test_entries_die_with_the_parameter():
    p = torch.nn.Parameter(torch.ones(2))
    add_regularizer(p, l2_regularizer(1.0))
    assert len(regularized_parameters()) == 1
    del p
    gc.collect()
    assert regularized_parameters() == []


def test_errors_leave_registry_untouched():
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match="fn"):
        add_regularizer(p, "l2")
    with pytest.raises(TypeError, match="target"):
        add_regularizer([p], l2_regularizer(1.0))
    with pytest.raises(ValueError, match="leaf"):
        add_regularizer(p * 2, l2_regularizer(1.0))
    with pytest.raises(ValueError, match="param_regex"):
        add_regularizer(p, l2_regularizer(1.0), param_regex="w")
    with pytest.raises(ValueError, match="param_regex"):
        add_regularizer(torch.nn.Linear(2, 2), l2_regularizer(1.0), param_regex="nothing")
    with pytest.raises(TypeError, match="name"):
        add_regularizer(p, l2_regularizer(1.0), name=3)
    with pytest.raises(TypeError, match="scale"):
        l2_regularizer("0.1")
    with pytest.raises(ValueError, match="scale"):
        l1_regularizer(-1.0)
    with pytest.raises(TypeError, match="scope"):
        get_regularization_loss(scope=3)
    with pytest.raises(TypeError, match="name"):
        get_regularization_loss(name=None)
    with pytest.raises(TypeError, match="target"):
        clear_regularizers("all")
    assert regularized_parameters() == []


def test_a_mixed_train_op_adds_each_regularizer_once():
    """``optimize_loss(dtype="mixed")`` adds the gradient of the half weights' regularizers (those registered
    when it is built, while they stay registered) on the fp32 masters, and leaves exactly those out of
    ``get_regularization_loss`` while it runs its loss function. Every regularizer then counts once per
    update, whatever else happens: a regularizer added later (counted in the loss), another train op built
    over the same weight or deleted, ``clear_regularizers`` and a re-added regularizer, a deleted train op
    kept alive by a reference cycle (it used to keep the term out of every later loss)."""
    import optkit

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2, bias=False).half()
    add_regularizer(m.weight, l2_regularizer(1.0), name="a")
    seen = []

    def loss(x):
        seen.append(float(get_regularization_loss()))
        return m(x.to(m.weight.dtype)).float().sum() * 0.0 + get_regularization_loss()

    def check_once(op, lam):
        """One update of ``op``: master ← master − 0.1·lam·master (lam: the total regularizer scale)."""
        w = op.masters[0].detach().double().clone()
        op(torch.randn(3, 4))
        torch.testing.assert_close(op.masters[0].detach().double(), w * (1 - 0.1 * lam), rtol=2e-3, atol=1e-4)

    op = optkit.optimize_loss(loss, "SGD", None, learning_rate_decay_fn=0.1, model=m, dtype="mixed")
    add_regularizer(m.weight, l2_regularizer(0.5), name="b")  # after the op: through the loss
    b_term = 0.25 * float((m.weight.detach().double() ** 2).sum())
    both = 0.75 * float((m.weight.detach().double() ** 2).sum())
    assert float(get_regularization_loss()) == pytest.approx(both, rel=1e-3)  # outside the call: all
    check_once(op, 1.5)
    assert seen == [pytest.approx(b_term, rel=1e-3)]  # inside: a is added on the master instead
    other = optkit.optimize_loss(loss, "SGD", None, learning_rate_decay_fn=0.1, model=m, dtype=torch.float16)
    check_once(op, 1.5)  # another train op over the weight changes nothing for this one
    del other
    clear_regularizers(m.weight)
    add_regularizer(m.weight, l2_regularizer(1.0), name="a")  # a new entry: through the loss
    check_once(op, 1.0)
    gc.collect()
    del op  # optimizer and train op refer to each other: freed only by a collection
    assert float(get_regularization_loss()) == pytest.approx(
        0.5 * float((m.weight.detach().double() ** 2).sum()), rel=1e-3)



def test_a_train_op_called_inside_a_mixed_one_counts_its_own_regularizers():
    """Only the train op running its loss function now leaves out what it adds on masters: a float16 train
    op over the same half weight, called inside a mixed one's loss function, counts the regularizer."""
    import optkit

    w = torch.nn.Parameter(torch.tensor([0.5, -0.5, 0.2, 0.9], dtype=torch.float16))
    add_regularizer(w, l2_regularizer(0.5))
    inner = optkit.optimize_loss(lambda: get_regularization_loss(), "SGD", None, var_list=[w],
                                 learning_rate_decay_fn=0.1, dtype=torch.float16)
    seen = []

    def outer_loss():
        before = w.detach().double().clone()
        inner()
        seen.append((before, w.detach().double().clone()))
        return (w.float() * 0.0).sum() + get_regularization_loss()

    outer = optkit.optimize_loss(outer_loss, "SGD", None, var_list=[w], learning_rate_decay_fn=0.0,
                                 dtype="mixed")
    outer()
    before, after = seen[0]  # the inner update: w − 0.1·0.5·w (it used to see no regularizer: no change)
    torch.testing.assert_close(after, before * (1 - 0.1 * 0.5), rtol=2e-3, atol=1e-3)
