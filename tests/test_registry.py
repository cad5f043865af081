"""``OPTIMIZER_CLS_NAMES`` / ``get_optimizer`` and the TF-named classes behind them
(``shared/spec/openseq2seq.md`` §3.9): float64 NumPy references of the TF1 rules, and ``torch.optim`` where
the two coincide."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import optkit
from optkit import OPTIMIZER_CLS_NAMES, Adagrad, Adam, AdamW, Momentum, RMSProp, get_optimizer

NAMES = ["SGD", "Momentum", "Adam", "AdamW", "Adagrad", "RMSProp", "Ftrl", "LARS", "LAMB", "Lion"]
EXTRA = {"Momentum": {"momentum": 0.9}, "AdamW": {"weight_decay": 0.01}}


def test_names_and_case_insensitive_lookup():
    assert list(OPTIMIZER_CLS_NAMES) == NAMES
    for name in NAMES:
        for spelling in (name, name.lower(), name.upper()):
            assert get_optimizer(spelling) is OPTIMIZER_CLS_NAMES[name]
    assert get_optimizer("lars") is optkit.LARS and get_optimizer("sgd") is optkit.SGD


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="Unknown optimizer name 'Adadelta'") as err:
        get_optimizer("Adadelta")
    for name in NAMES:
        assert name in str(err.value)


def test_classes_pass_through_and_bad_types():
    assert get_optimizer(torch.optim.Adamax) is torch.optim.Adamax
    assert get_optimizer(optkit.SGD) is optkit.SGD
    for bad in (3, None, dict, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)):
        with pytest.raises(TypeError, match="optimizer"):
            get_optimizer(bad)


def rand_problem(seed, shapes=((4, 3), (5,))):
    rng = np.random.default_rng(seed)
    ws = [rng.standard_normal(s) for s in shapes]
    grads_seq = [[rng.standard_normal(s) for s in shapes] for _ in range(4)]
    return ws, grads_seq


def run(opt_cls, ws, grads_seq, dtype=torch.float64, **kw):
    ts = [torch.tensor(w, dtype=dtype, requires_grad=True) for w in ws]
    opt = opt_cls(ts, **kw)
    for grads in grads_seq:
        for t, g in zip(ts, grads):
            t.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return [t.detach().numpy() for t in ts], opt


@pytest.mark.parametrize("name", NAMES)
def test_every_class_accepts_learning_rate_keyword_and_steps(name):
    ws, grads_seq = rand_problem(1)
    out, _ = run(
        get_optimizer(name), ws, grads_seq[:2], dtype=torch.float32, learning_rate=0.05, **EXTRA.get(name, {})
    )
    for o, w in zip(out, ws):
        assert np.all(np.isfinite(o)) and not np.allclose(o, w)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_matches_tf_rule(nesterov):
    ws, grads_seq = rand_problem(2)
    out, opt = run(Momentum, ws, grads_seq, learning_rate=0.1, momentum=0.9, use_nesterov=nesterov)
    for j, w in enumerate(ws):
        a = np.zeros_like(w)
        for gs in grads_seq:
            a = 0.9 * a + gs[j]
            w = w - 0.1 * (gs[j] + 0.9 * a if nesterov else a)
        np.testing.assert_allclose(out[j], w, rtol=1e-12, atol=1e-12)


def test_momentum_is_required():
    with pytest.raises(TypeError):
        Momentum([torch.zeros(2, requires_grad=True)], learning_rate=0.1)
    with pytest.raises(ValueError, match="momentum"):
        Momentum([torch.zeros(2, requires_grad=True)], learning_rate=0.1, momentum=-1.0)


def test_adagrad_matches_tf_rule_without_epsilon():
    ws, grads_seq = rand_problem(3)
    out, _ = run(Adagrad, ws, grads_seq, learning_rate=0.1)
    for j, w in enumerate(ws):
        s = np.full_like(w, 0.1)
        for gs in grads_seq:
            s = s + gs[j] ** 2
            w = w - 0.1 * gs[j] / np.sqrt(s)
        np.testing.assert_allclose(out[j], w, rtol=1e-12, atol=1e-12)


def test_adam_and_adamw_equal_torch_with_tf_argument_names():
    ws, grads_seq = rand_problem(4)
    ours, opt = run(Adam, ws, grads_seq, learning_rate=0.01, beta1=0.8, beta2=0.99, epsilon=1e-7)
    ref, _ = run(torch.optim.Adam, ws, grads_seq, lr=0.01, betas=(0.8, 0.99), eps=1e-7)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    ours, _ = run(AdamW, ws, grads_seq, learning_rate=0.01, weight_decay=0.1)
    ref, _ = run(torch.optim.AdamW, ws, grads_seq, lr=0.01, weight_decay=0.1)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    # weight_decay defaults to torch.optim.AdamW's (TF required it; docs/compatibility.md)
    w = torch.zeros(2, requires_grad=True)
    assert AdamW([w], 0.1).defaults["weight_decay"] == torch.optim.AdamW([w], 0.1).defaults["weight_decay"]


def test_adam_differs_from_tf_only_by_epsilon_placement():
    """torch: ε added to √v̂; TF: lr_t·m/(√v + ε). With ε_TF = ε_torch·√(1−β2^t) they agree (spec §3.9)."""
    ws, grads_seq = rand_problem(5, shapes=((6,),))
    g1 = [gs[0] for gs in grads_seq][:1]
    out, _ = run(Adam, ws, [[g1[0]]], learning_rate=0.01, epsilon=1e-3)
    b1, b2, t = 0.9, 0.999, 1
    m, v = (1 - b1) * g1[0], (1 - b2) * g1[0] ** 2
    lr_t = 0.01 * np.sqrt(1 - b2**t) / (1 - b1**t)
    eps_tf = 1e-3 * np.sqrt(1 - b2**t)
    np.testing.assert_allclose(out[0], ws[0] - lr_t * m / (np.sqrt(v) + eps_tf), rtol=1e-10)


@pytest.mark.parametrize("centered,momentum", [(False, 0.0), (False, 0.9), (True, 0.0), (True, 0.5)])
def test_rmsprop_matches_tf_rule(centered, momentum):
    ws, grads_seq = rand_problem(6)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-5)):
        out, opt = run(
            RMSProp,
            ws,
            grads_seq,
            dtype=dtype,
            learning_rate=0.01,
            decay=0.9,
            momentum=momentum,
            epsilon=1e-10,
            centered=centered,
        )
        for j, w in enumerate(ws):
            ms, mom, mg = np.ones_like(w), np.zeros_like(w), np.zeros_like(w)
            for gs in grads_seq:
                g = gs[j]
                ms = ms + (g * g - ms) * 0.1
                denom = ms + 1e-10
                if centered:
                    mg = mg + (g - mg) * 0.1
                    denom = denom - mg * mg
                mom = momentum * mom + 0.01 * g / np.sqrt(denom)
                w = w - mom
            np.testing.assert_allclose(out[j], w, rtol=tol, atol=tol)
    assert opt.get_slot_names()[:2] == ["rms", "momentum"]


def test_rmsprop_skip_and_validation():
    w = torch.ones(3, requires_grad=True)
    opt = RMSProp([w], learning_rate=0.1, momentum=0.9)
    w.grad = torch.tensor([float("inf"), 1.0, 2.0])
    opt.found_inf = torch.ones(())
    opt.step()
    del opt.found_inf
    assert torch.equal(w.detach(), torch.ones(3)) and torch.equal(opt.get_slot(w, "rms"), torch.ones(3))
    for kw, exc in (
        ({"decay": 1.5}, ValueError),
        ({"momentum": -1.0}, ValueError),
        ({"epsilon": -1.0}, ValueError),
        ({"centered": 1}, TypeError),
    ):
        with pytest.raises(exc, match=next(iter(kw))):
            RMSProp([w], learning_rate=0.1, **kw)


@pytest.mark.parametrize(
    "cls,kw,bad,exc",
    [
        (Adam, {}, {"beta1": 1.5}, ValueError),
        (Adam, {}, {"epsilon": -1.0}, ValueError),
        (Adagrad, {}, {"initial_accumulator_value": 0.0}, ValueError),
        (Momentum, {"momentum": 0.9}, {"use_nesterov": "yes"}, TypeError),
        (AdamW, {"weight_decay": 0.1}, {"learning_rate": -1.0}, ValueError),
    ],
)
def test_tf_class_validation_names_argument(cls, kw, bad, exc):
    with pytest.raises(exc, match=next(iter(bad))):
        cls([torch.zeros(2, requires_grad=True)], **{"learning_rate": 0.1, **kw, **bad})


def _embedding_grads(rng, rows, dim, ids, steps):
    """Per step the ids looked up (every row once plus repeats, or ``ids``) and the loss weights ``c``
    (``loss = Σ emb(ids)·c``), with the dense gradient they give (repeated rows summed)."""
    out = []
    for _ in range(steps):
        look = rng.permutation(np.concatenate([np.arange(rows), rng.integers(0, rows, 3)])) if ids is None \
            else np.asarray(ids)
        c = rng.standard_normal((len(look), dim))
        g = np.zeros((rows, dim))
        np.add.at(g, look, c)
        out.append((look, c, g))
    return out


def _embedding_step(emb, look, c):
    (emb(torch.tensor(look)) * torch.tensor(c)).sum().backward()


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_zero_then_raised_is_one_rule_on_dense_and_sparse_gradients(nesterov):
    """``Momentum(momentum=0)`` keeps torch's rule on both paths (``w ← w − lr·g``, the accumulator left as it
    is): with the momentum raised to 0.9 after two steps, an ``nn.Embedding(sparse=True)`` whose every row is
    touched ends where the same embedding with dense gradients does, and both match the float64 reference
    and ``torch.optim.SGD`` with the same momentum change."""
    rows, dim, lr = 6, 3, 0.1
    rng = np.random.default_rng(29)
    w0 = rng.standard_normal((rows, dim))
    steps = _embedding_grads(rng, rows, dim, None, 4)
    mus = [0.0, 0.0, 0.9, 0.9]
    out = {}
    for kind in ("sparse", "dense", "torch"):
        emb = torch.nn.Embedding(rows, dim, sparse=kind == "sparse", dtype=torch.float64)
        with torch.no_grad():
            emb.weight.copy_(torch.tensor(w0))
        if kind == "torch":
            opt = torch.optim.SGD(emb.parameters(), lr=lr, momentum=0.9, nesterov=nesterov)
        else:
            opt = Momentum(emb.parameters(), lr, momentum=0.0, nesterov=nesterov)
        for (look, c, _), mu in zip(steps, mus):
            opt.param_groups[0]["momentum"] = mu
            opt.zero_grad()
            _embedding_step(emb, look, c)
            assert emb.weight.grad.is_sparse == (kind == "sparse")
            opt.step()
        out[kind] = (emb.weight.detach().numpy(), None if kind == "torch" else opt.get_slot(emb.weight,
                                                                                            "momentum_buffer"))
    w, a = w0.copy(), np.zeros_like(w0)
    for (_, _, g), mu in zip(steps, mus):
        if mu:
            a = mu * a + g
            w = w - lr * (g + mu * a if nesterov else a)
        else:  # torch's SGD(momentum=0): no buffer (optkit's stays as it was: zero)
            w = w - lr * g
    for kind in ("sparse", "dense", "torch"):
        np.testing.assert_allclose(out[kind][0], w, rtol=1e-12, atol=1e-12, err_msg=kind)
    for kind in ("sparse", "dense"):
        np.testing.assert_allclose(out[kind][1].numpy(), a, rtol=1e-12, atol=1e-12, err_msg=kind)


@pytest.mark.parametrize("centered,momentum", [(False, 0.0), (True, 0.5)])
def test_rmsprop_decoupled_weight_decay_applies_to_sparse_touched_rows(centered, momentum):
    """The base's decoupled ``weight_decay`` (``w ← w − lr·wd·w``, then the TF rule) is applied to the
    touched rows of sparse gradients (it was silently dropped): untouched rows keep weights and slots, an
    embedding excluded by :meth:`exclude_from_weight_decay` is not decayed, and with every row touched the
    sparse path equals the dense one; all against the float64 reference."""
    rows, dim, lr, wd, rho, eps = 7, 3, 0.05, 0.2, 0.9, 1e-10
    rng = np.random.default_rng(10)
    w0 = [rng.standard_normal((rows, dim)), rng.standard_normal((rows, dim))]
    some = _embedding_grads(rng, rows, dim, [1, 4, 4, 6], 3)  # rows 0, 2, 3, 5 never touched
    every = _embedding_grads(rng, rows, dim, None, 3)
    for steps in (some, every):
        results = {}
        for kind in ("sparse", "dense"):
            embs = [torch.nn.Embedding(rows, dim, sparse=kind == "sparse", dtype=torch.float64)
                    for _ in range(2)]
            for e, w in zip(embs, w0):
                with torch.no_grad():
                    e.weight.copy_(torch.tensor(w))
            opt = RMSProp([("emb.weight", embs[0].weight), ("kept.weight", embs[1].weight)], lr, decay=rho,
                          momentum=momentum, epsilon=eps, centered=centered, weight_decay=wd)
            opt.exclude_from_weight_decay(var_names=["kept"])
            for look, c, _ in steps:
                opt.zero_grad()
                for e in embs:
                    _embedding_step(e, look, c)
                opt.step()
            results[kind] = [e.weight.detach().numpy() for e in embs]
        touched = sorted(set(np.concatenate([s[0] for s in steps]).tolist()))
        refs = []
        for w, decayed in zip(w0, (True, False)):
            w = w.copy()
            ms, mom, mg = np.ones_like(w), np.zeros_like(w), np.zeros_like(w)
            for _, _, g in steps:
                r = touched
                if decayed:
                    w[r] = w[r] - w[r] * wd * lr
                ms[r] = ms[r] + (g[r] * g[r] - ms[r]) * (1 - rho)
                denom = ms[r] + eps
                if centered:
                    mg[r] = mg[r] + (g[r] - mg[r]) * (1 - rho)
                    denom = denom - mg[r] * mg[r]
                mom[r] = momentum * mom[r] + lr * g[r] / np.sqrt(denom)
                w[r] = w[r] - mom[r]
            refs.append(w)
        for got, ref in zip(results["sparse"], refs):
            np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
        if steps is every:
            for got, ref in zip(results["dense"], refs):
                np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
        else:
            untouched = [i for i in range(rows) if i not in touched]
            assert np.array_equal(results["sparse"][0][untouched], w0[0][untouched])
