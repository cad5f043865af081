"""optkit.param_groups / create_optimizer / lr_scale: groups by name, BEiT/ELECTRA layer-wise decay, the
learning-rate scale through constant rates, schedules, ``ScheduleLR`` and ``optimize_loss``, per-group
clipping, and the refusals. Numbers against float64 NumPy references written from the formulas."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

import optkit
from reference_rules import Reference

F64 = torch.float64


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)


class Tiny(nn.Module):
    """Embeddings, ``encoder.layer.N`` blocks (the Hugging Face BERT names) and a head."""

    def __init__(self, d: int = 4, n: int = 3) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(10, d)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 2)

    def forward(self, idx):
        h = self.embeddings(idx).mean(1)
        for blk in self.encoder.layer:
            h = blk.norm(torch.tanh(blk.attn(h)))
        return self.head(h)


def _model(dtype=F64, seed=0):
    torch.manual_seed(seed)
    return Tiny().to(dtype)


def _by_name(groups):
    return {n: g for g in groups for n, _ in g["params"]}


# ------------------------------------------------------------------------------------------------ grouping


def test_layer_decay_ids_and_scales_beit_form():
    """BEiT: ``lr_scale = d ** (num_layers − layer_id)``, embeddings layer 0, block N layer N + 1, head (and
    everything else) ``num_layers`` = blocks + 1; biases and norm scales without weight decay."""
    groups = optkit.param_groups(_model(), weight_decay=0.05, layer_decay=0.5)
    by = _by_name(groups)
    L = 4
    assert by["embeddings.weight"]["lr_scale"] == 0.5**L
    for n in range(3):
        assert by[f"encoder.layer.{n}.attn.weight"]["lr_scale"] == 0.5 ** (L - n - 1)
        assert by[f"encoder.layer.{n}.attn.weight"]["weight_decay"] == 0.05
        assert by[f"encoder.layer.{n}.norm.weight"]["weight_decay"] == 0.0
        assert by[f"encoder.layer.{n}.attn.bias"]["weight_decay"] == 0.0
    assert by["head.weight"]["lr_scale"] == 1.0 and by["head.bias"]["weight_decay"] == 0.0
    # equal options share a group, in order of first appearance
    assert [len(g["params"]) for g in groups] == [1, 1, 3, 1, 3, 1, 3, 1, 1]
    assert [lid for *_, lid in groups.records][:2] == [0, 1]


def test_rules_first_match_wins_and_override_defaults():
    rules = [(r"^head\.", {"lr_scale": 10.0, "weight_decay": 0.0}),
             (r"head|norm", {"exclude_from_adaptation": True, "clip": 1.0}),
             (r"attn\.weight$", {"weight_decay": 0.2})]
    by = _by_name(optkit.param_groups(_model(), rules, weight_decay=0.05, layer_decay=0.5))
    assert by["head.weight"]["lr_scale"] == 10.0 and by["head.weight"]["weight_decay"] == 0.0
    assert "exclude_from_adaptation" not in by["head.weight"]  # the first rule won
    assert by["encoder.layer.1.norm.weight"]["exclude_from_adaptation"] is True
    assert by["encoder.layer.1.norm.weight"]["clip"] == 1.0
    assert by["encoder.layer.1.norm.weight"]["lr_scale"] == 0.5**2  # layer decay kept
    assert by["encoder.layer.2.attn.weight"]["weight_decay"] == 0.2
    assert "weight_decay" not in optkit.param_groups(_model(), no_decay_1d=False)[0]


def test_num_layers_regexes_and_frozen():
    m = _model()
    m.embeddings.weight.requires_grad_(False)
    by = _by_name(optkit.param_groups(m, layer_decay=0.9, num_layers=6))
    assert "embeddings.weight" not in by
    assert by["head.weight"]["lr_scale"] == 1.0
    assert by["encoder.layer.0.attn.weight"]["lr_scale"] == pytest.approx(0.9**5)
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    by = _by_name(optkit.param_groups(seq, layer_decay=0.5, layer_regex=r"^(\d+)\."))
    assert by["0.weight"]["lr_scale"] == 0.5**3 and by["2.weight"]["lr_scale"] == 0.5
    pairs = [("blocks.0.w", torch.zeros(2, 2, requires_grad=True)), ("x", torch.zeros(2, requires_grad=True))]
    assert len(optkit.param_groups(pairs, layer_decay=0.5)) == 2


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(rules=[("head", {"lr_mult": 2.0})]), ValueError, "'lr_mult'"),
    (dict(rules=[("head", {"lr_scale": -1.0})]), ValueError, "lr_scale"),
    (dict(rules=[("head", {"lr_scale": "x"})]), TypeError, "lr_scale"),
    (dict(rules=[("head", {"exclude_from_adaptation": 1})]), TypeError, "exclude_from_adaptation"),
    (dict(rules=[("head", {"clip": 0.0})]), ValueError, "clip"),
    (dict(rules=[("(", {})]), ValueError, "invalid regex"),
    (dict(rules=[("head",)]), TypeError, "pair"),
    (dict(rules="head"), TypeError, "rules"),
    (dict(layer_decay=0.0), ValueError, "layer_decay"),
    (dict(layer_decay=1.5), ValueError, "layer_decay"),
    (dict(layer_decay="0.5"), TypeError, "layer_decay"),
    (dict(layer_decay=0.5, num_layers="3"), TypeError, "num_layers"),
    (dict(layer_decay=0.5, num_layers=3.0), TypeError, "num_layers"),
    (dict(layer_decay=0.5, layer_regex=r"nothing\.(\d+)"), ValueError, "layer_regex"),
    (dict(layer_decay=0.5, layer_regex=r"layer"), ValueError, "first group"),
    (dict(layer_decay=0.5, num_layers=2), ValueError, "num_layers"),
    (dict(num_layers=3), ValueError, "num_layers"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(no_decay_1d=1), TypeError, "no_decay_1d"),
    (dict(layer_decay=0.5, final_norm="block"), ValueError, "final_norm"),
    (dict(layer_decay=0.5, final_norm=None), TypeError, "final_norm"),
    (dict(layer_decay=0.5, final_norm="last_block", final_norm_regex=3), TypeError, "final_norm_regex"),
    (dict(layer_decay=0.5, final_norm="last_block", final_norm_regex="("), ValueError, "invalid regex"),
    (dict(final_norm="last_block"), ValueError, "final_norm"),
])
def test_bad_input_raises_naming_it(kwargs, err, match):
    with pytest.raises(err, match=match):
        optkit.param_groups(_model(), **kwargs)


def test_shadowed_rule_warning_says_an_earlier_rule_took_its_names():
    with pytest.warns(UserWarning, match="decides nothing.*earlier rule") as caught:
        optkit.param_groups(_model(), [("head", {"lr_scale": 2.0}), (r"head\.bias", {"lr_scale": 3.0})])
    assert not any("matches no parameter" in str(w.message) for w in caught)


def test_electra_and_beit_embedding_names_are_layer_zero():
    """ELECTRA's ``embeddings_project`` and BEiT's ``mask_token`` sit with the embeddings (layer 0), as in
    the originals' layer-wise decay."""
    pairs = [(n, torch.zeros(2, 2, requires_grad=True)) for n in (
        "electra.embeddings.word_embeddings.weight", "electra.embeddings_project.weight", "mask_token",
        "encoder.layer.0.w", "encoder.layer.1.w", "classifier.weight")]
    by = {n: g for g in optkit.param_groups(pairs, layer_decay=0.8) for n, _ in g["params"]}
    for name in ("electra.embeddings.word_embeddings.weight", "electra.embeddings_project.weight",
                 "mask_token"):
        assert by[name]["lr_scale"] == pytest.approx(0.8**3)
    assert by["classifier.weight"]["lr_scale"] == 1.0


class TimmViTNames(nn.Module):
    """The parameter names of timm's ``VisionTransformer`` (``reg_tokens=2``, ``norm_pre`` and a ``fc_norm``
    beside ``norm`` to cover every name its ``group_matcher`` sorts), ``depth`` blocks, seeded values."""

    def __init__(self, depth: int = 3, d: int = 4) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)

        def p(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g, dtype=F64))

        self.cls_token, self.reg_token, self.pos_embed = p(1, 1, d), p(1, 2, d), p(1, 5, d)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight, self.patch_embed.proj.bias = p(d, 3, 2, 2), p(d)
        self.norm_pre = nn.Module()
        self.norm_pre.weight = p(d)
        self.blocks = nn.ModuleList()
        for _ in range(depth):
            blk = nn.Module()
            blk.norm1 = nn.Module()
            blk.norm1.weight = p(d)
            blk.attn = nn.Module()
            blk.attn.qkv = nn.Module()
            blk.attn.qkv.weight = p(3 * d, d)
            self.blocks.append(blk)
        self.norm = nn.Module()
        self.norm.weight, self.norm.bias = p(d), p(d)
        self.fc_norm = nn.Module()
        self.fc_norm.weight = p(d)
        self.head = nn.Module()
        self.head.weight, self.head.bias = p(5, d), p(5)


@pytest.mark.parametrize("final_norm", ["head", "last_block"])
def test_timm_vit_names_layer_ids_match_timm(final_norm):
    """timm's ViT: ``cls_token``, ``reg_token``, ``pos_embed``, ``patch_embed`` and ``norm_pre`` are its
    stem (layer 0), block ``i`` is layer ``i + 1``, and ``fc_norm`` / ``head`` are unmatched (the head,
    ``layer_max``); its final ``norm`` joins the last block's group (``group_matcher``: ``(r'^norm',
    (99999,))``), which ``final_norm="last_block"`` reproduces; the default gives it the head's scale (BEiT's
    and MAE's layer decay: every other name is the head). Checked against the scales
    ``d ** (layer_max − layer_id)`` written out below from timm's formula, and against timm's own
    ``param_groups_layer_decay`` over its ``VisionTransformer.group_matcher()`` when timm is installed."""
    from timm_optim import load_timm_vit_layer_decay

    d, depth = 0.75, 3
    model = TimmViTNames(depth)
    groups = optkit.param_groups(model, layer_decay=d, final_norm=final_norm)
    scale = {n: g["lr_scale"] for g in groups for n, _ in g["params"]}
    L = depth + 1  # timm's layer_max: stem 0, blocks 1..depth, the unmatched head depth + 1
    stem = ["cls_token", "reg_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias",
            "norm_pre.weight"]
    expected = {n: d**L for n in stem}
    for i in range(depth):
        expected.update({f"blocks.{i}.norm1.weight": d ** (L - i - 1), f"blocks.{i}.attn.qkv.weight":
                         d ** (L - i - 1)})
    norm_scale = d ** (L - depth) if final_norm == "last_block" else 1.0  # timm: the last block's layer
    expected.update({"norm.weight": norm_scale, "norm.bias": norm_scale, "fc_norm.weight": 1.0,
                     "head.weight": 1.0, "head.bias": 1.0})
    assert scale.keys() == expected.keys()
    for n, v in expected.items():
        assert scale[n] == pytest.approx(v, rel=1e-15), n
    timm = load_timm_vit_layer_decay()
    if timm is None:
        return
    timm_groups, matcher = timm
    model.group_matcher = lambda coarse=False: matcher
    by_id = {id(p): g["lr_scale"] for g in timm_groups(model, layer_decay=d) for p in g["params"]}
    for n, p in model.named_parameters():
        if final_norm == "head" and n.startswith("norm."):
            assert by_id[id(p)] == pytest.approx(d), n  # timm's form, the difference the option covers
            continue
        assert scale[n] == pytest.approx(by_id[id(p)], rel=1e-15), n


def test_create_optimizer_passes_final_norm():
    opt = optkit.create_optimizer(TimmViTNames(2), "SGD", lr=0.1, layer_decay=0.5, final_norm="last_block")
    names = {n: g["lr_scale"] for g in opt.param_groups for n in g["param_names"]}
    assert names["norm.weight"] == 0.5 and names["head.weight"] == 1.0 and names["reg_token"] == 0.5**3


def test_optimize_loss_passes_final_norm():
    """``optimize_loss(layer_decay=..., final_norm=...)`` builds the groups ``param_groups`` builds (timm's
    final-norm assignment here), and ``final_norm`` alone is refused, naming it."""
    model = TimmViTNames(2)

    def loss():
        return sum((p * p).sum() for p in model.parameters())

    op = optkit.optimize_loss(loss, "SGD", {}, 0.1, model=model, layer_decay=0.5, final_norm="last_block")
    got = {n: g["lr_scale"] for g in op.optimizer.param_groups for n in g["param_names"]}
    want = {n: g["lr_scale"] for g in optkit.param_groups(model, layer_decay=0.5, final_norm="last_block")
            for n, _ in g["params"]}
    assert got == want and got["norm.weight"] == 0.5 and got["head.weight"] == 1.0
    with pytest.raises(ValueError, match="final_norm"):
        optkit.optimize_loss(loss, "SGD", {}, 0.1, model=model, final_norm="last_block")


def test_unmatched_rule_warns_and_describe_prints_a_table():
    with pytest.warns(UserWarning, match="matches no parameter"):
        groups = optkit.param_groups(_model(), [("decoder", {"lr_scale": 2.0})])
    text = str(groups)
    assert text.splitlines()[0].startswith("| group | params | elements | lr_scale | weight_decay")
    assert "embeddings.weight" in text
    rows = groups.describe(per_parameter=True).splitlines()
    assert len(rows) == 2 + len(list(_model().parameters()))
    narrow = groups.describe(width=8)  # names cut to the width, with the count left out; never "(+0)"
    assert "(+0)" not in narrow and "… (+" in narrow
    solo = optkit.param_groups([("a_rather_long_parameter_name", torch.zeros(2, requires_grad=True))])
    assert solo.describe(width=8).splitlines()[2].endswith("| a_rather_long_parameter_name |")


# ------------------------------------------------------------------------------------------------ lr_scale


def _check_halving_schedule(opt, scheduler, ts, ws, grads) -> None:
    """Step ``opt`` and ``scheduler`` over ``grads`` and compare with the float64 SGD reference at lr
    0.2·0.5^k, scaled 0.5 in the first group (layer decay) and 1 in the second."""
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g)
        opt.step()
        scheduler.step()
    ref = _sgd_reference(ws, grads, lambda k: 0.2 * 0.5**k, [0.5, 1.0])
    for t, r in zip(ts, ref):
        np.testing.assert_allclose(t.detach().numpy(), r, rtol=1e-13, atol=1e-14)


def _sgd_reference(ws, grads, lrs, scales):
    """Keras SGD without momentum: w ← w − lr(k)·scale·g."""
    out = [w.copy() for w in ws]
    for k, gs in enumerate(grads):
        for i, g in enumerate(gs):
            out[i] = out[i] - lrs(k) * scales[i] * g
    return out


@pytest.mark.parametrize("lr_kind", ["number", "tensor", "schedule", "callable"])
def test_optkit_optimizers_apply_lr_scale(lr_kind):
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal(4)] for _ in range(4)]
    ts = [torch.tensor(w, requires_grad=True) for w in ws]
    sched = optkit.PolicySchedule("poly_decay", learning_rate=0.1, decay_steps=4, power=1.0)
    lr = {"number": 0.1, "tensor": torch.tensor(0.1, dtype=F64), "schedule": sched,
          "callable": lambda step: 0.1 * (1 - step / 4)}[lr_kind]
    opt = optkit.SGD([{"params": [("a", ts[0])], "lr_scale": 0.25}, {"params": [("b", ts[1])]}],
                     learning_rate=lr)
    for gs in grads:
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g)
        opt.step()
    lrs = (lambda k: 0.1) if lr_kind in ("number", "tensor") else (lambda k: 0.1 * (1 - k / 4))
    tol = 1e-13 if lr_kind in ("number", "tensor") else 1e-7  # a schedule of the step tensor is fp32
    for t, r in zip(ts, _sgd_reference(ws, grads, lrs, [0.25, 1.0])):
        np.testing.assert_allclose(t.detach().numpy(), r, rtol=tol, atol=tol)
    assert opt.param_groups[0]["lr_scale"] == 0.25  # the group keeps its own lr unscaled


@pytest.mark.parametrize("torch_opt", [False, True, "by hand", "tensor lr"])
@pytest.mark.parametrize("mode", ["absolute", "multiplier"])
def test_schedulelr_honours_lr_scale(torch_opt, mode):
    """``ScheduleLR`` with optkit optimizers (they scale) and torch optimizers (it scales); the multiplier
    mode multiplies each group's initial lr, which for torch optimizers built by create_optimizer already
    holds the scale."""
    rng = np.random.default_rng(1)
    ws = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal(4)] for _ in range(3)]
    ts = [torch.tensor(w, requires_grad=True) for w in ws]
    pairs = [("blocks.0.w", ts[0]), ("head.w", ts[1])]
    base = 1.0 if mode == "multiplier" else 0.2
    sched = optkit.PolicySchedule("exp_decay", learning_rate=base, decay_steps=1, decay_rate=0.5,
                                   use_staircase_decay=False)
    if torch_opt in ("by hand", "tensor lr"):
        # param_groups() handed to a torch optimizer: the lr does not hold lr_scale, ScheduleLR multiplies it
        # in; a tensor lr is one tensor shared by both groups (torch's add_param_group), which ScheduleLR
        # must split before writing each group's value
        groups = [{**g, "params": [p for _, p in g["params"]]}
                  for g in optkit.param_groups(pairs, layer_decay=0.5, no_decay_1d=False)]
        lr = torch.tensor(0.2, dtype=torch.float64) if torch_opt == "tensor lr" else 0.2
        opt = torch.optim.SGD(groups, lr=lr)
        if torch_opt == "tensor lr":
            assert opt.param_groups[0]["lr"] is opt.param_groups[1]["lr"]
    elif torch_opt:
        opt = optkit.create_optimizer(pairs, torch.optim.SGD, lr=0.2, layer_decay=0.5, no_decay_1d=False)
    else:
        opt = optkit.create_optimizer(pairs, "SGD", lr=0.2, layer_decay=0.5, no_decay_1d=False)
    scheduler = optkit.ScheduleLR(opt, sched, mode=mode)
    _check_halving_schedule(opt, scheduler, ts, ws, grads)


@pytest.mark.parametrize("wrapper", ["LossScaleOptimizer", "LARC"])
@pytest.mark.parametrize("inner", ["optkit", "torch"])
def test_schedulelr_through_wrappers(wrapper, inner):
    """A wrapper applies ``lr_scale`` when the optimizer it wraps does (``applies_lr_scale`` forwards to it):
    around an optkit optimizer ``ScheduleLR`` writes ``schedule(t)`` into every group, around a torch one
    ``schedule(t)·lr_scale``; through the loss-scale wrapper the weights follow the float64 reference, with
    the scale applied once."""
    rng = np.random.default_rng(4)
    ws = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal(4)] for _ in range(3)]
    ts = [torch.tensor(w, requires_grad=True) for w in ws]
    groups = optkit.param_groups([("blocks.0.w", ts[0]), ("head.w", ts[1])], layer_decay=0.5,
                                 no_decay_1d=False)
    assert [g["lr_scale"] for g in groups] == [0.5, 1.0]
    if inner == "optkit":
        opt = optkit.SGD(groups, learning_rate=0.2)
    else:
        opt = torch.optim.SGD([{**g, "params": [p for _, p in g["params"]]} for g in groups], lr=0.2)
    if wrapper == "LossScaleOptimizer":
        opt = optkit.LossScaleOptimizer(opt, 4.0)
    else:
        opt = optkit.LARC(opt, 0.02)
    assert optkit.schedules.applies_lr_scale(opt) is (inner == "optkit")
    sched = optkit.PolicySchedule("exp_decay", learning_rate=0.2, decay_steps=1, decay_rate=0.5,
                                   use_staircase_decay=False)
    scheduler = optkit.ScheduleLR(opt, sched)
    for k, gs in enumerate(grads):
        expected = [0.2 * 0.5**k * (scale if inner == "torch" else 1.0) for scale in (0.5, 1.0)]
        np.testing.assert_allclose([g["lr"] for g in opt.param_groups], expected, rtol=1e-15)
        for t, g in zip(ts, gs):
            t.grad = torch.tensor(g) * (4.0 if wrapper == "LossScaleOptimizer" else 1.0)
        if wrapper == "LossScaleOptimizer":
            opt.grads_scaled = True
        opt.step()
        scheduler.step()
    if wrapper == "LossScaleOptimizer":
        ref = _sgd_reference(ws, grads, lambda k: 0.2 * 0.5**k, [0.5, 1.0])
        for t, r in zip(ts, ref):
            np.testing.assert_allclose(t.detach().numpy(), r, rtol=1e-13, atol=1e-14)


def test_applies_lr_scale_is_declared():
    """``applies_lr_scale`` reads the declared attribute, on optimizers and on classes: optkit optimizers
    declare it, torch's do not, a wrapper forwards its inner optimizer's answer (its class, whose attribute
    is a property, answers False), and any torch optimizer that declares it is left to scale by itself, by
    ``ScheduleLR`` and ``create_optimizer``."""
    from optkit.schedules import applies_lr_scale

    assert applies_lr_scale(optkit.SGD) and applies_lr_scale(optkit.LAMB)
    assert not applies_lr_scale(torch.optim.SGD)
    for cls in (optkit.LossScaleOptimizer, optkit.LARC, optkit.MixedPrecisionOptimizerWrapper,
                optkit.VariableClippingOptimizer):
        assert not applies_lr_scale(cls), cls
    p = torch.zeros(2, dtype=F64, requires_grad=True)
    assert applies_lr_scale(optkit.LARC(optkit.LossScaleOptimizer(optkit.SGD([p], 0.1), 2.0), 0.02))
    assert not applies_lr_scale(optkit.LARC(torch.optim.SGD([p], lr=0.1), 0.02))

    class ScalingSGD(torch.optim.SGD):  # a torch optimizer that multiplies lr_scale in itself
        applies_lr_scale = True

        def step(self, closure=None):
            saved = [g["lr"] for g in self.param_groups]
            for g in self.param_groups:
                g["lr"] = g["lr"] * g.get("lr_scale", 1.0)
            try:
                return super().step(closure)
            finally:
                for g, lr in zip(self.param_groups, saved):
                    g["lr"] = lr

    rng = np.random.default_rng(5)
    ws = [rng.standard_normal((3, 2)), rng.standard_normal(4)]
    grads = [[rng.standard_normal((3, 2)), rng.standard_normal(4)] for _ in range(3)]
    ts = [torch.tensor(w, requires_grad=True) for w in ws]
    opt = optkit.create_optimizer([("blocks.0.w", ts[0]), ("head.w", ts[1])], ScalingSGD, lr=0.2,
                                  layer_decay=0.5, no_decay_1d=False)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.2]  # left unscaled: the optimizer scales
    sched = optkit.PolicySchedule("exp_decay", learning_rate=0.2, decay_steps=1, decay_rate=0.5,
                                   use_staircase_decay=False)
    scheduler = optkit.ScheduleLR(opt, sched)
    _check_halving_schedule(opt, scheduler, ts, ws, grads)


def test_lr_scale_survives_a_checkpoint():
    m = _model()
    opt = optkit.create_optimizer(m, "Adam", lr=0.01, layer_decay=0.7)
    sd = opt.state_dict()
    opt2 = optkit.create_optimizer(_model(), "Adam", lr=0.01, layer_decay=0.7)
    opt2.load_state_dict(sd)
    assert [g["lr_scale"] for g in opt2.param_groups] == [g["lr_scale"] for g in opt.param_groups]


# ---------------------------------------------------------------------------------------- create_optimizer


def _train(opt, model, steps=3, seed=5):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 10, (8, 3), generator=g)
        y = torch.randn(8, 2, generator=g, dtype=F64)
        opt.zero_grad()
        nn.functional.mse_loss(model(idx), y).backward()
        opt.step()


def test_create_optimizer_lamb_layer_decay_matches_reference():
    """LAMB with layer decay, a head rule and no decay on 1-D tensors against the float64 LAMB reference
    run per group with ``lr·lr_scale`` and the group's weight decay."""
    rules = [("head", {"lr_scale": 3.0}), (r"layer\.0\.norm", {"exclude_from_adaptation": True})]
    m = _model()
    names = [n for n, _ in m.named_parameters()]
    w0 = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    groups = optkit.param_groups(m, rules, weight_decay=0.05, layer_decay=0.6)
    opt = optkit.create_optimizer(m, "LAMB", lr=0.02, weight_decay=0.05, layer_decay=0.6, rules=rules)
    assert isinstance(opt, optkit.LAMB)
    grads_seen = []
    orig = opt.step

    def step(*a, **k):
        grads_seen.append({n: p.grad.detach().numpy().copy() for n, p in m.named_parameters()})
        return orig(*a, **k)

    opt.step = step
    _train(opt, m)
    by = _by_name(groups)
    for name in names:
        g = by[name]
        hp = {"weight_decay": g.get("weight_decay", 0.05),
              "exclude_from_adaptation": g.get("exclude_from_adaptation", False)}
        ref = Reference("lamb", [w0[name]], hp, {"lr": 0.02 * g.get("lr_scale", 1.0)})
        for gs in grads_seen:
            ref.step([gs[name]])
        np.testing.assert_allclose(dict(m.named_parameters())[name].detach().numpy(), ref.ws[0],
                                   rtol=1e-11, atol=1e-13, err_msg=name)


def test_create_optimizer_torch_class_lars_and_adam_translation():
    m = _model()
    opt = optkit.create_optimizer(m, torch.optim.AdamW, lr=0.01, weight_decay=0.1, layer_decay=0.5)
    assert all(not isinstance(p, tuple) for g in opt.param_groups for p in g["params"])
    assert [g["lr"] for g in opt.param_groups][:2] == [0.01 * 0.5**4, 0.01 * 0.5**3]
    rules = [("norm", {"exclude_from_adaptation": True})]
    lars = optkit.create_optimizer(_model(), "LARS", lr=0.1, rules=rules)
    assert [g["skip_list"] for g in lars.param_groups if "norm" in g["param_names"][0]] == [[""]]
    adam = optkit.create_optimizer(_model(), "Adam", lr=0.1, rules=rules)
    assert not any("exclude_from_adaptation" in g for g in adam.param_groups)
    with pytest.raises(ValueError, match="lr"):
        optkit.create_optimizer(_model(), "LAMB")
    with pytest.raises(ValueError, match="not both"):
        optkit.create_optimizer(_model(), "LAMB", lr=0.1, learning_rate=0.1)
    with pytest.raises(ValueError, match="Unknown optimizer"):
        optkit.create_optimizer(_model(), "Lamb2", lr=0.1)


@pytest.mark.parametrize("scaled", [False, True])
def test_group_clip_clips_true_gradients(scaled):
    """``clip`` rule: ``g·c/max(‖g‖, c)`` per tensor of the group, on the true gradient under loss scaling
    (the hook divides the norm by the protocol's ``grad_scale``); other groups untouched."""
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal((3, 4)), rng.standard_normal(5)]
    gs = [rng.standard_normal((3, 4)) * 3, rng.standard_normal(5) * 3]
    ts = [torch.tensor(w, requires_grad=True) for w in ws]
    opt = optkit.create_optimizer([("enc.w", ts[0]), ("enc.b", ts[1])], "SGD", lr=0.1, no_decay_1d=False,
                                  rules=[(r"\.w$", {"clip": 0.5})])
    if scaled:
        opt = optkit.LossScaleOptimizer(opt, 128.0)
    for t, g in zip(ts, gs):
        t.grad = torch.tensor(g) * (128.0 if scaled else 1.0)
    if scaled:
        opt.grads_scaled = True
    opt.step()
    clipped = gs[0] * 0.5 / max(np.linalg.norm(gs[0]), 0.5)
    np.testing.assert_allclose(ts[0].detach().numpy(), ws[0] - 0.1 * clipped, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ts[1].detach().numpy(), ws[1] - 0.1 * gs[1], rtol=1e-12, atol=1e-13)


def test_optimize_loss_accepts_rules_and_layer_decay():
    """The train op builds the same optimizer as create_optimizer: one update equals a manual step."""
    m1, m2 = _model(), _model()
    rules = [("head", {"lr_scale": 2.0})]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 10, (8, 3), generator=g)
    y = torch.randn(8, 2, generator=g, dtype=F64)
    op = optkit.optimize_loss(lambda i, t: nn.functional.mse_loss(m1(i), t), "LAMB",
                              {"weight_decay": 0.01}, 0.05, model=m1, rules=rules, layer_decay=0.7)
    assert [g.get("lr_scale") for g in op.base_optimizer.param_groups] == \
        [g.get("lr_scale") for g in optkit.param_groups(m2, rules, layer_decay=0.7)]
    opt = optkit.create_optimizer(m2, "LAMB", lr=0.05, weight_decay=0.01, layer_decay=0.7, rules=rules)
    for _ in range(2):
        op(idx, y)
        opt.zero_grad()
        nn.functional.mse_loss(m2(idx), y).backward()
        opt.step()
    for (n, a), (_, b) in zip(m1.named_parameters(), m2.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=n)
    with pytest.raises(ValueError, match="'lr_mult'"):
        optkit.optimize_loss(lambda i, t: m1(i).sum(), "SGD", None, 0.1, model=m1,
                             rules=[("head", {"lr_mult": 2.0})])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optkit.optimize_loss(lambda i, t: m1(i).sum(), torch.optim.SGD, None, 0.1, model=m1, rules=[])


@pytest.mark.parametrize("bad", [None, 3, torch.zeros(2)])
def test_a_model_that_is_not_a_module_or_named_pairs_is_named(bad):
    with pytest.raises(TypeError, match="`model`"):
        optkit.create_optimizer(bad, "SGD", lr=0.1)


def test_unnamed_parameters_are_refused_in_one_short_line():
    """``create_optimizer(model.parameters())`` names the entry by its type and shape (it printed the whole
    tensor) and says what to pass instead; other entries are named by their types."""
    model = torch.nn.Linear(300, 200)
    with pytest.raises(TypeError) as err:
        optkit.create_optimizer(model.parameters(), "SGD", lr=0.1)
    text = str(err.value)
    assert text == ("`model` must be an nn.Module or an iterable of (name, tensor) pairs, got an entry "
                    "Parameter of shape (200, 300); pass the module itself or model.named_parameters() "
                    "(rules match names, which model.parameters() does not give)")
    with pytest.raises(TypeError, match=r"got an entry \('w', int\)$"):
        optkit.create_optimizer([("w", 3)], "SGD", lr=0.1)
    with pytest.raises(TypeError, match=r"got an entry \(int, Tensor of shape \(2,\)\)$"):
        optkit.create_optimizer([(1, torch.zeros(2))], "SGD", lr=0.1)
