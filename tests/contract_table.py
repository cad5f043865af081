"""The contract matrix: one row per optimizer, wrapper stack and option set, with what each supports.

``tests/test_contract_matrix.py`` crosses every row with dtypes, layouts, sparse gradients, skips,
checkpoints, deepcopy, names, tensor learning rates, hooks, closures and ``apply_gradients``; the train-op
rows (``optimize_loss`` configurations) are crossed in ``tests/test_contract_train_op.py``. A new optimizer,
wrapper or option joins by adding a row here.

Each row builds its optimizer over ``named`` parameters (``(name, tensor)`` pairs, or plain tensors when the
row does not use names) and states its float64 NumPy reference (``tests/reference_rules.py``): the rule, its
hyperparameters and base options, plus what the wrapper does around it (gradient scale fed to ``.grad``,
per-tensor gradient transform, post-step weight transform).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import optkit
from reference_rules import Reference, _norm

LR = 0.05

#: the parameter set of every row: names and shapes (a 4-D tensor for channels_last, a bias for exclusions)
SHAPES = {"enc.weight": (6, 4), "enc.bias": (4,), "conv.weight": (4, 3, 3, 3)}
#: the sparse case: an embedding whose gradient touches rows 1, 4 (twice) and 7
SPARSE_SHAPE = (10, 3)
SPARSE_ROWS = [1, 4, 4, 7]
#: the lean rows' parameter set: SHAPES and a weight large enough for 8-bit slots (4,608 elements, at least
#: ``optkit._core.lowp.MIN_QUANT_NUMEL``; rows of 576 along dim 0: two full blocks of 256 and a partial one)
LEAN_SHAPES = {**SHAPES, "big.weight": (8, 16, 6, 6)}


@dataclass(frozen=True)
class Row:
    """One configuration of the matrix.

    ``build(params, lr)``: the optimizer over ``params`` (named pairs) with learning rate ``lr`` (a float or a
    0-d tensor). ``rule``/``hp``/``base``: the float64 reference. ``feed_scale``: ``.grad`` is set to
    ``scale·g`` (loss-scale wrappers unscale it). ``grad_transform(ws, gs, lr)`` and ``post(ws)``: what a
    wrapper does around the rule. ``sparse``: ``"rows"`` (TF's touched-rows rule, reference ``sparse_rule``
    on the touched rows), ``"dense"`` (densified: same as the dense gradient), or an exception type (a clear
    refusal). ``dtypes``: parameter dtypes it takes; ``half_masters``: half parameters with fp32 masters.
    ``shapes``: the parameter set. ``lean_tol``: a lean row (``precision``/``state_dtype``) whose slots are
    stored below float32 states its bound against the float64 reference, relative to the largest weight
    (None: the dtype's usual tolerance).
    """

    id: str
    build: Callable[[list, Any], torch.optim.Optimizer]
    rule: str
    hp: dict = field(default_factory=dict)
    base: dict = field(default_factory=dict)
    per_tensor: Callable[[list[str]], list[dict]] | None = None
    decay_mask: Callable[[list[str]], list[bool]] | None = None
    feed_scale: float = 1.0
    grad_transform: Callable | None = None
    post: Callable | None = None
    sparse: Any = "dense"
    sparse_rule: str | None = None
    sparse_hp: dict | None = None
    dtypes: tuple = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
    half_masters: bool = False
    uses_names: bool = False
    torch_twin: Callable | None = None  # torch.optim equivalent (params, lr) -> optimizer, if any
    shapes: dict = field(default_factory=lambda: SHAPES)  # the parameter set ({name: shape})
    lean_tol: float | None = None  # lean rows' bound, relative to the largest weight (module doc)

    def reference(self, names: list[str], ws: list[np.ndarray], lr: float = LR) -> Reference:
        base = {"lr": lr, **self.base}
        if self.decay_mask is not None:
            base["decay_mask"] = self.decay_mask(names)
        per = self.per_tensor(names) if self.per_tensor else None
        return _WrappedReference(self, Reference(self.rule, ws, self.hp, base, per), lr)


class _WrappedReference:
    """The row's wrapper math around the rule's :class:`Reference`."""

    def __init__(self, row: Row, ref: Reference, lr: float) -> None:
        self.row, self.ref, self.lr = row, ref, lr

    @property
    def ws(self) -> list[np.ndarray]:
        return self.ref.ws

    def step(self, grads: list[np.ndarray], rows: list[int] | None = None) -> list[np.ndarray]:
        if self.row.grad_transform is not None:
            grads = self.row.grad_transform(self.ref.ws, grads, self.ref.lr())
        ws = self.ref.step(grads)
        if self.row.post is not None:
            self.ref.ws = self.row.post(ws) if rows is None else self.row.post(ws, rows)
        return self.ref.ws


# ------------------------------------------------------------------------------------------------ wrappers


def larc_transform(eta: float, mode: str = "clip", min_update: float = 1e-7, eps: float = 1e-7):
    """OpenSeq2Seq LARC (spec/openseq2seq.md §4): g ← r·g per tensor."""

    def fn(ws, gs, lr):
        out = []
        for w, g in zip(ws, gs):
            wn, gn = _norm(w), _norm(g)
            if mode == "clip":
                r = 1.0 if lr == 0 else min(max(eta * wn / (lr * (gn + eps)), min_update), 1.0)
            else:
                r = max(eta * wn / (gn + eps), min_update)
            out.append(r * g)
        return out

    return fn


def variable_clip_post(index: int, dims: tuple[int, ...], max_norm: float):
    """``VariableClippingOptimizer``: after the step, w ← w·c/max(‖w‖_dims, c) for one variable; with a sparse
    gradient only its touched rows (``rows``) are clipped (TF's ``IndexedSlices`` path)."""

    def fn(ws, rows=None):
        w = ws[index]
        n = np.sqrt(np.sum(w * w, axis=dims, keepdims=True))
        clipped = w * max_norm / np.maximum(n, max_norm)
        ws = list(ws)
        if rows is None:
            ws[index] = clipped
        else:
            out = w.copy()
            out[rows] = clipped[rows]
            ws[index] = out
        return ws

    return fn


def _named(params):
    return [(n, p) for n, p in params]


def _plain(params):
    return [p for _, p in params]


def _sgd_ema_buffers(params, lr):
    """Keras SGD with an EMA (warm-up) of the weights and of a BatchNorm-like running-statistics buffer
    (``ema_buffers``; seeded, in the parameters' dtype), which moves after the optimizer took its copy, so
    every step moves the buffer's average (kept in the state dict as ``"ema_buffers"``)."""
    p = params[0][1]
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(5, generator=g).to(device=p.device, dtype=p.dtype)
    opt = optkit.SGD(_plain(params), learning_rate=lr, momentum=0.5, use_ema=True, ema_momentum=0.8,
                     ema_warmup=True, ema_buffers=[("bn.running_mean", buf)])
    buf.add_(1.0)
    return opt


def _bias_apart(params, bias_options):
    """Two param groups: the non-bias tensors, and the bias with ``bias_options`` (a per-group option)."""
    return [{"params": [p for n, p in params if "bias" not in n]},
            {"params": [p for n, p in params if "bias" in n], **bias_options}]


def _bias_mask(names):
    return ["bias" not in n for n in names]


def _lars_skip_bias(names):
    return [{"_lars_skipped": "bias" in n} for n in names]


def _lamb_skip_bias(names):
    return [{"_skipped": "bias" in n} for n in names]


def _no_decay_bias(names):
    return [{"_decayed": "bias" not in n} for n in names]


def _bias_lr_half(names):
    return [{"_lr_scale": 0.5 if "bias" in n else 1.0} for n in names]


def _excluding_bias(opt):
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


def _excluding_bias_tensors(opt, params):
    """Exclusion by identity (``var_list``): it must follow the parameters into copies and pickles."""
    opt.exclude_from_weight_decay(var_list=[p for n, p in params if "bias" in n])
    return opt


# ------------------------------------------------------------------------------------------------ the rows

ROWS: list[Row] = [
    Row("SGD", lambda ps, lr: optkit.SGD(_plain(ps), learning_rate=lr), "keras_sgd",
        torch_twin=lambda ps, lr: torch.optim.SGD(ps, lr=lr, foreach=False)),
    Row("SGD-nesterov-wd", lambda ps, lr: _excluding_bias(optkit.SGD(
        _named(ps), learning_rate=lr, momentum=0.9, nesterov=True, weight_decay=0.1)),
        "keras_sgd", {"momentum": 0.9, "nesterov": True}, {"weight_decay": 0.1}, decay_mask=_bias_mask,
        uses_names=True),
    Row("SGD-scratch-nesterov-clipnorm", lambda ps, lr: optkit.SGD(
        _plain(ps), learning_rate=lr, momentum=0.9, nesterov=True, clipnorm=0.7, scratch_grads=True),
        "keras_sgd", {"momentum": 0.9, "nesterov": True}, {"clipnorm": 0.7}),
    Row("SGD-wd-exclude-list", lambda ps, lr: _excluding_bias_tensors(optkit.SGD(
        _plain(ps), learning_rate=lr, momentum=0.9, weight_decay=0.1), ps),
        "keras_sgd", {"momentum": 0.9}, {"weight_decay": 0.1}, decay_mask=_bias_mask),
    Row("SGD-rules(lr_scale,no-decay)", lambda ps, lr: optkit.create_optimizer(
        _named(ps), "SGD", lr=lr, weight_decay=0.1, rules=[("bias", {"lr_scale": 0.5, "weight_decay": 0.0})],
        no_decay_1d=False, momentum=0.9),
        "keras_sgd", {"momentum": 0.9}, {"weight_decay": 0.1}, decay_mask=_bias_mask,
        per_tensor=_bias_lr_half, uses_names=True),
    Row("SGD-ema-globalclip", lambda ps, lr: optkit.SGD(
        _plain(ps), learning_rate=lr, momentum=0.5, use_ema=True, ema_momentum=0.8,
        ema_overwrite_frequency=3, global_clipnorm=1.5),
        "keras_sgd", {"momentum": 0.5},
        {"use_ema": True, "ema_momentum": 0.8, "ema_overwrite_frequency": 3, "global_clipnorm": 1.5}),
    # jit_compile with a decay on every tensor: over flat buffers the compiled chain steps the whole buffer as
    # one tensor (per tensor elsewhere)
    Row("SGD-jit-nesterov-wd-ema", lambda ps, lr: optkit.SGD(
        _plain(ps), learning_rate=lr, momentum=0.9, nesterov=True, weight_decay=0.1, use_ema=True,
        ema_momentum=0.8, jit_compile=True),
        "keras_sgd", {"momentum": 0.9, "nesterov": True},
        {"weight_decay": 0.1, "use_ema": True, "ema_momentum": 0.8}),
    Row("SGD-ema-warmup-buffers", lambda ps, lr: _sgd_ema_buffers(ps, lr), "keras_sgd", {"momentum": 0.5},
        {"use_ema": True, "ema_momentum": 0.8, "ema_warmup": True}),
    Row("SGD-clipnorm", lambda ps, lr: optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9, clipnorm=0.7),
        "keras_sgd", {"momentum": 0.9}, {"clipnorm": 0.7}),
    Row("SGD-clipvalue", lambda ps, lr: optkit.SGD(_plain(ps), learning_rate=lr, clipvalue=0.3),
        "keras_sgd", {}, {"clipvalue": 0.3}),
    Row("Momentum", lambda ps, lr: optkit.Momentum(_plain(ps), lr, momentum=0.9), "momentum",
        {"momentum": 0.9}, sparse="rows", sparse_rule="momentum",
        torch_twin=lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, foreach=False)),
    Row("Momentum-nesterov-wd", lambda ps, lr: _excluding_bias(optkit.Momentum(
        _named(ps), lr, momentum=0.9, nesterov=True, weight_decay=0.05)),
        "momentum", {"momentum": 0.9, "use_nesterov": True, "weight_decay": 0.05},
        per_tensor=_no_decay_bias, sparse=ValueError, uses_names=True),
    Row("Adam", lambda ps, lr: optkit.Adam(_plain(ps), lr), "adam",
        torch_twin=lambda ps, lr: torch.optim.Adam(ps, lr=lr, foreach=False)),
    Row("Adam-amsgrad-l2", lambda ps, lr: optkit.Adam(_plain(ps), lr, beta1=0.8, amsgrad=True,
                                                       weight_decay=0.01),
        "adam", {"beta1": 0.8, "amsgrad": True, "weight_decay": 0.01},
        torch_twin=lambda ps, lr: torch.optim.Adam(ps, lr=lr, betas=(0.8, 0.999), amsgrad=True,
                                                   weight_decay=0.01, foreach=False)),
    Row("Adam-group-amsgrad", lambda ps, lr: optkit.Adam(_bias_apart(ps, {"amsgrad": False}), lr,
                                                         amsgrad=True),
        "adam", {"amsgrad": True}, per_tensor=lambda names: [{"amsgrad": "bias" not in n} for n in names]),
    Row("AdamW", lambda ps, lr: optkit.AdamW(_plain(ps), lr, weight_decay=0.1), "adam",
        {"weight_decay": 0.1, "_decoupled": True},
        torch_twin=lambda ps, lr: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1, foreach=False)),
    Row("Adagrad", lambda ps, lr: optkit.Adagrad(_plain(ps), lr), "adagrad", sparse="rows",
        sparse_rule="adagrad",
        torch_twin=lambda ps, lr: torch.optim.Adagrad(ps, lr=lr, initial_accumulator_value=0.1, eps=0.0,
                                                      foreach=False)),
    Row("RMSProp", lambda ps, lr: optkit.RMSProp(_plain(ps), lr), "rmsprop", sparse="rows",
        sparse_rule="rmsprop"),
    Row("RMSProp-centered-momentum", lambda ps, lr: optkit.RMSProp(_plain(ps), lr, momentum=0.5,
                                                                   centered=True),
        "rmsprop", {"momentum": 0.5, "centered": True}, sparse="rows", sparse_rule="rmsprop"),
    Row("RMSProp-group-centered", lambda ps, lr: optkit.RMSProp(_bias_apart(ps, {"centered": True}), lr,
                                                                momentum=0.5),
        "rmsprop", {"momentum": 0.5}, per_tensor=lambda names: [{"centered": "bias" in n} for n in names],
        sparse="rows", sparse_rule="rmsprop"),
    Row("Ftrl", lambda ps, lr: optkit.Ftrl(_plain(ps), lr, l1_regularization_strength=0.01,
                                           l2_regularization_strength=0.02),
        "ftrl", {"l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02},
        sparse="rows", sparse_rule="ftrl"),
    Row("LARS", lambda ps, lr: optkit.LARS(_named(ps), lr, eeta=0.01, skip_list=["bias"]), "lars",
        {"eeta": 0.01}, per_tensor=_lars_skip_bias, sparse="rows", sparse_rule="momentum",
        sparse_hp={"momentum": 0.9}, uses_names=True),
    Row("LARS-tf1.14-nesterov", lambda ps, lr: optkit.LARS(_plain(ps), lr, eeta=0.01, use_nesterov=True,
                                                           variant="tf1.14"),
        "lars", {"eeta": 0.01, "use_nesterov": True, "variant": "tf1.14"}, sparse="rows",
        sparse_rule="momentum", sparse_hp={"momentum": 0.9, "use_nesterov": True}),
    # a binding global clip (the gradients' global norm is ~12) and momentum 0 with a large decay: the
    # kernel's grad_scale carries s·k, the decay enters as (wd/k)·w
    Row("LARS-wd-globalclip-m0", lambda ps, lr: optkit.LARS(
        _named(ps), lr, momentum=0.0, weight_decay=0.05, eeta=0.01, skip_list=["bias"], global_clipnorm=4.0),
        "lars", {"eeta": 0.01, "momentum": 0.0, "weight_decay": 0.05}, {"global_clipnorm": 4.0},
        per_tensor=_lars_skip_bias, sparse="rows", sparse_rule="momentum", sparse_hp={"momentum": 0.0},
        uses_names=True),
    # jit_compile: the compiled norm pass (row sums of squares) and the compiled rule; over flat buffers the
    # rule over the row runs
    Row("LARS-jit-tf1.14-nesterov-skiplist-ema", lambda ps, lr: optkit.LARS(
        _named(ps), lr, eeta=0.01, skip_list=["bias"], use_nesterov=True, variant="tf1.14", use_ema=True,
        ema_momentum=0.9, jit_compile=True),
        "lars", {"eeta": 0.01, "use_nesterov": True, "variant": "tf1.14"},
        {"use_ema": True, "ema_momentum": 0.9}, per_tensor=_lars_skip_bias, sparse="rows",
        sparse_rule="momentum", sparse_hp={"momentum": 0.9, "use_nesterov": True}, uses_names=True),
    Row("LAMB", lambda ps, lr: optkit.LAMB(_plain(ps), lr, weight_decay=0.01), "lamb",
        {"weight_decay": 0.01}),
    Row("LAMB-skiplist-clamp-nvlamb", lambda ps, lr: optkit.LAMB(
        _named(ps), lr, weight_decay=0.05, skip_list=["bias"], min_coeff=0.6, max_coeff=2.0,
        global_grad_norm_clip=4.0),  # binds (the gradients' global norm is ~12), keeps fp16 v normal
        "lamb", {"weight_decay": 0.05, "min_coeff": 0.6, "max_coeff": 2.0}, {"global_clipnorm": 4.0},
        per_tensor=_lamb_skip_bias, uses_names=True),
    # jit_compile: the compiled pass 1 (sums of squares, writes nothing) and the compiled pass 2 (moments
    # from k·g, where k carries the binding global clip)
    Row("LAMB-jit-skiplist-clamp-nvlamb-ema", lambda ps, lr: optkit.LAMB(
        _named(ps), lr, weight_decay=0.05, skip_list=["bias"], min_coeff=0.6, max_coeff=2.0,
        global_grad_norm_clip=4.0, use_ema=True, ema_momentum=0.9, jit_compile=True),
        "lamb", {"weight_decay": 0.05, "min_coeff": 0.6, "max_coeff": 2.0},
        {"global_clipnorm": 4.0, "use_ema": True, "ema_momentum": 0.9},
        per_tensor=_lamb_skip_bias, uses_names=True),
    # scratch_grads=True (what optimize_loss sets): the update may use .grad as scratch; every other
    # guarantee (dtypes, layouts, flat buffers, skips, checkpoints, hooks) holds as in the default mode
    Row("LAMB-scratch-clamp", lambda ps, lr: optkit.LAMB(
        _plain(ps), lr, weight_decay=0.01, min_coeff=0.6, max_coeff=2.0, scratch_grads=True),
        "lamb", {"weight_decay": 0.01, "min_coeff": 0.6, "max_coeff": 2.0}),
    Row("LARS-scratch-nesterov-wd", lambda ps, lr: optkit.LARS(
        _named(ps), lr, eeta=0.01, skip_list=["bias"], nesterov=True, weight_decay=0.05, scratch_grads=True),
        "lars", {"eeta": 0.01, "use_nesterov": True, "weight_decay": 0.05}, per_tensor=_lars_skip_bias,
        sparse="rows", sparse_rule="momentum", sparse_hp={"momentum": 0.9, "use_nesterov": True},
        uses_names=True),
    Row("LAMBC-exclude1d-nobc", lambda ps, lr: optkit.LAMB(
        _plain(ps), lr, beta1=0.8, weight_decay=0.02, exclude_1d=True, lambc=True, bias_correction=False,
        always_adapt=True, use_ema=True, ema_momentum=0.9, ema_warmup=True),
        "lamb", {"beta1": 0.8, "weight_decay": 0.02, "lambc": True, "bias_correction": False,
                 "always_adapt": True}, {"use_ema": True, "ema_momentum": 0.9, "ema_warmup": True},
        per_tensor=_lamb_skip_bias),
    Row("Lion-wd-exclude", lambda ps, lr: _excluding_bias(optkit.Lion(
        _named(ps), lr, beta1=0.8, weight_decay=0.5)),
        "lion", {"beta1": 0.8}, {"weight_decay": 0.5}, decay_mask=_bias_mask, uses_names=True),
    # ---- wrappers and stacks
    Row("LossScale(SGD,dynamic)", lambda ps, lr: optkit.LossScaleOptimizer(
        optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9), optkit.DynamicLossScale(256.0)),
        "keras_sgd", {"momentum": 0.9}, feed_scale=256.0),
    Row("LossScale(LARS-wd,dynamic)", lambda ps, lr: optkit.LossScaleOptimizer(
        optkit.LARS(_plain(ps), lr, eeta=0.01, weight_decay=0.05), optkit.DynamicLossScale(256.0)),
        "lars", {"eeta": 0.01, "weight_decay": 0.05}, feed_scale=256.0, sparse="rows", sparse_rule="momentum",
        sparse_hp={"momentum": 0.9}),
    Row("LossScale(Adam,fixed)", lambda ps, lr: optkit.LossScaleOptimizer(optkit.Adam(_plain(ps), lr), 64.0),
        "adam", feed_scale=64.0),
    Row("LARC(Momentum)", lambda ps, lr: optkit.LARC(optkit.Momentum(_plain(ps), lr, momentum=0.9), 0.02),
        "momentum", {"momentum": 0.9}, grad_transform=larc_transform(0.02)),
    Row("LARC-scale(SGD)", lambda ps, lr: optkit.LARC(optkit.SGD(_plain(ps), learning_rate=lr), 0.02,
                                                      larc_mode="scale"),
        "keras_sgd", grad_transform=larc_transform(0.02, "scale")),
    Row("VariableClipping(SGD)", lambda ps, lr: optkit.VariableClippingOptimizer(
        optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9), {ps[0][1]: [1]}, 0.9),
        "keras_sgd", {"momentum": 0.9}, post=variable_clip_post(0, (1,), 0.9)),
    Row("LossScale(LARC(SGD))", lambda ps, lr: optkit.LossScaleOptimizer(
        optkit.LARC(optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9), 0.02), 128.0),
        "keras_sgd", {"momentum": 0.9}, feed_scale=128.0, grad_transform=larc_transform(0.02)),
    # LARC over an optkit optimizer built with jit_compile: the compiled norm pass (row sums of squares), the
    # unscaled gradient norms from the outer scale, the ratios folded into the compiled rule
    Row("LossScale(LARC(SGD-jit-nesterov))", lambda ps, lr: optkit.LossScaleOptimizer(optkit.LARC(
        optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9, nesterov=True, jit_compile=True), 0.02),
        128.0),
        "keras_sgd", {"momentum": 0.9, "nesterov": True}, feed_scale=128.0,
        grad_transform=larc_transform(0.02)),
    Row("MixedPrecision(Momentum)", lambda ps, lr: optkit.MixedPrecisionOptimizerWrapper(
        optkit.Momentum(_plain(ps), lr, momentum=0.9), loss_scale=None),
        "momentum", {"momentum": 0.9}, dtypes=(torch.float16, torch.bfloat16), half_masters=True),
    # ---- wrappers over torch.optim optimizers (the wrappers take any torch.optim.Optimizer)
    Row("LARC(torch.SGD)", lambda ps, lr: optkit.LARC(
        torch.optim.SGD(_plain(ps), lr=lr, momentum=0.9, foreach=False), 0.02),
        "momentum", {"momentum": 0.9}, grad_transform=larc_transform(0.02)),
    Row("LossScale(torch.Adam,dynamic)", lambda ps, lr: optkit.LossScaleOptimizer(
        torch.optim.Adam(_plain(ps), lr=lr, foreach=False), optkit.DynamicLossScale(256.0)),
        # torch's Adam refuses sparse gradients; in float16 it computes in float16 and overflows (torch's own
        # arithmetic, with or without the wrapper)
        "adam", feed_scale=256.0, sparse=RuntimeError, dtypes=(torch.float32, torch.float64, torch.bfloat16)),
    Row("MixedPrecision(torch.SGD)", lambda ps, lr: optkit.MixedPrecisionOptimizerWrapper(
        torch.optim.SGD(_plain(ps), lr=lr, momentum=0.9, foreach=False), loss_scale=None),
        "momentum", {"momentum": 0.9}, dtypes=(torch.float16, torch.bfloat16), half_masters=True),
    Row("MixedPrecision(LARC(SGD),dynamic)", lambda ps, lr: optkit.MixedPrecisionOptimizerWrapper(
        optkit.LARC(optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9), 0.02),
        loss_scale=optkit.DynamicLossScale(256.0)),
        "keras_sgd", {"momentum": 0.9}, feed_scale=256.0, grad_transform=larc_transform(0.02),
        dtypes=(torch.float16, torch.bfloat16), half_masters=True),
    Row("LossScale(LAMB,dynamic)", lambda ps, lr: optkit.LossScaleOptimizer(
        optkit.LAMB(_plain(ps), lr, weight_decay=0.01), optkit.DynamicLossScale(256.0)),
        "lamb", {"weight_decay": 0.01}, feed_scale=256.0),
    # a static loss scale of 3, no power of two: float64 gradients are unscaled by 1/3 in float64 (a float32
    # 1/3 is 3e-8 off, far outside the float64 rows' 1e-12)
    Row("LossScale(SGD,fixed 3)-fp64", lambda ps, lr: optkit.LossScaleOptimizer(
        optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9), 3.0),
        "keras_sgd", {"momentum": 0.9}, feed_scale=3.0, dtypes=(torch.float64, torch.float32)),
]

# ---- lean rows (optkit._core.lean): bfloat16 weights without fp32 masters (precision=, which only bfloat16
# parameters take: bfloat16 comes first, so every crossing that takes the row's default dtype runs the lean
# pass; float16 parameters are refused, test_lean_rows_refuse_float16) and slots stored in bfloat16 or 8 bits
# (state_dtype=; 8-bit only for big.weight, the others keep float32). LAMB's bfloat16 moments and the 8-bit
# slots are lossy by design: their rows state the bound they keep against the float64 reference over the
# matrix's 3 steps at lr 0.05 (measured, float32 and float64 parameters: Adam 8-bit 1.5e-3 to 2.1e-3 of the
# largest weight, LAMB bfloat16 moments 1.48e-4, LARS 8-bit momentum 9.9e-6; bfloat16 parameters stay within
# bfloat16's own tolerance). Adam's bound, 5e-3: an element near a tenth of its block's scale is stored with
# up to 7% relative error (the map's gap there, 0.9/64 of 0.1), which moves its update lr·m̂/√v̂ by up to
# 7% of lr = 0.0035 a step; three steps against a largest weight of about 2.4 give 4.4e-3.
_PRECISION_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
ROWS += [
    Row("SGD-momentum-split", lambda ps, lr: optkit.SGD(_plain(ps), learning_rate=lr, momentum=0.9,
                                                        precision="split"),
        "keras_sgd", {"momentum": 0.9}, dtypes=_PRECISION_DTYPES),
    Row("Adam-kahan-int8", lambda ps, lr: optkit.Adam(_plain(ps), lr, precision="kahan", state_dtype="int8"),
        "adam", dtypes=_PRECISION_DTYPES, shapes=LEAN_SHAPES, lean_tol=5e-3),
    Row("LAMB-stochastic-bf16", lambda ps, lr: optkit.LAMB(_plain(ps), lr, weight_decay=0.01,
                                                           precision="stochastic", state_dtype="bfloat16"),
        "lamb", {"weight_decay": 0.01}, dtypes=_PRECISION_DTYPES, lean_tol=3e-4),
    Row("LARS-int8", lambda ps, lr: optkit.LARS(_named(ps), lr, eeta=0.01, skip_list=["bias"],
                                                state_dtype="int8"),
        "lars", {"eeta": 0.01}, per_tensor=_lars_skip_bias, sparse="rows", sparse_rule="momentum",
        sparse_hp={"momentum": 0.9}, uses_names=True, shapes=LEAN_SHAPES, lean_tol=2e-5),
    Row("LossScale(Adam-kahan-int8,dynamic)", lambda ps, lr: optkit.LossScaleOptimizer(
        optkit.Adam(_plain(ps), lr, precision="kahan", state_dtype="int8"), optkit.DynamicLossScale(256.0)),
        "adam", feed_scale=256.0, dtypes=_PRECISION_DTYPES, shapes=LEAN_SHAPES, lean_tol=5e-3),
]

ROW_IDS = [r.id for r in ROWS]
BY_ID = {r.id: r for r in ROWS}


def state_tensors(x: Any) -> list[torch.Tensor]:
    """Copies of every tensor in a (nested) state dict, in a fixed order (dict keys sorted)."""
    out: list[torch.Tensor] = []

    def walk(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v.detach().clone())
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(v[k])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    walk(x)
    return out


def innermost(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer):
        opt = opt.optimizer
    return opt
