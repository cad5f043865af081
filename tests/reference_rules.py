"""Float64 NumPy references of every optkit update rule and of the Keras base pipeline, written from the
formulas (``shared/spec/tf_keras.md`` §1, §4.1, §5.1; ``spec/openseq2seq.md`` §3.9, §4; the module docs of
``optkit.momentum``/``adam``/``adagrad``/``rmsprop``/``ftrl``), not from optkit's code.

:class:`Reference` replays a sequence of steps on NumPy arrays: the base pipeline (clipvalue / clipnorm /
global_clipnorm, decoupled Keras weight decay with exclusions, the rule, EMA with Keras's first-step copy and
overwrite frequency, the applied-update counter) around one rule function per optimizer. The contract matrix
compares optkit in every dtype and layout against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Arr = np.ndarray


def _norm(x: Arr) -> float:
    return float(np.sqrt(np.sum(np.square(x, dtype=np.float64))))


# ------------------------------------------------------------------------------------------------ rules
# Each rule: rule(w, g, state: dict, lr, t, hp) -> new w; ``state`` holds the slots (mutated), ``t`` is the
# number of this applied update (1-based).


def keras_sgd(w, g, st, lr, t, hp):
    mu, nesterov = hp.get("momentum", 0.0), hp.get("nesterov", False)
    if mu == 0.0:
        return w - lr * g
    m = mu * st.get("m", np.zeros_like(w)) - lr * g
    st["m"] = m
    return w + (mu * m - lr * g if nesterov else m)


def tf_momentum(w, g, st, lr, t, hp):
    mu, nesterov, wd = hp["momentum"], hp.get("use_nesterov", False), hp.get("weight_decay", 0.0)
    if wd and hp.get("_decayed", True):
        g = g + wd * w
    a = mu * st.get("a", np.zeros_like(w)) + g
    st["a"] = a
    return w - lr * (g + mu * a if nesterov else a)


def adam(w, g, st, lr, t, hp):
    b1, b2, eps = hp.get("beta1", 0.9), hp.get("beta2", 0.999), hp.get("epsilon", 1e-8)
    wd, decoupled = hp.get("weight_decay", 0.0), hp.get("_decoupled", False)
    if wd and hp.get("_decayed", True):
        if decoupled:
            w = w * (1.0 - lr * wd)
        else:
            g = g + wd * w
    m = b1 * st.get("m", np.zeros_like(w)) + (1 - b1) * g
    v = b2 * st.get("v", np.zeros_like(w)) + (1 - b2) * g * g
    st["m"], st["v"] = m, v
    if hp.get("amsgrad", False):
        v = np.maximum(st.get("vmax", np.zeros_like(w)), v)
        st["vmax"] = v
    denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
    return w - lr / (1 - b1**t) * m / denom


def adagrad(w, g, st, lr, t, hp):
    wd, eps, lr_decay = hp.get("weight_decay", 0.0), hp.get("epsilon", 0.0), hp.get("lr_decay", 0.0)
    if wd and hp.get("_decayed", True):
        g = g + wd * w
    s = st.get("s", np.full_like(w, hp.get("initial_accumulator_value", 0.1))) + g * g
    st["s"] = s
    return w - lr / (1 + (t - 1) * lr_decay) * g / (np.sqrt(s) + eps)


def tf_rmsprop(w, g, st, lr, t, hp):
    rho, mu, eps, centered = hp.get("decay", 0.9), hp.get("momentum", 0.0), hp.get("epsilon", 1e-10), \
        hp.get("centered", False)
    ms = st.get("ms", np.ones_like(w))
    ms = ms + (1 - rho) * (g * g - ms)
    st["ms"] = ms
    if centered:
        mg = st.get("mg", np.zeros_like(w))
        mg = mg + (1 - rho) * (g - mg)
        st["mg"] = mg
        denom = np.maximum(ms - mg * mg, 0.0) + eps
    else:
        denom = ms + eps
    mom = mu * st.get("mom", np.zeros_like(w)) + lr * g / np.sqrt(denom)
    st["mom"] = mom
    return w - mom


def ftrl(w, g, st, lr, t, hp):
    p = -hp.get("learning_rate_power", -0.5)
    l1, l2 = hp.get("l1_regularization_strength", 0.0), hp.get("l2_regularization_strength", 0.0)
    l2s, beta = hp.get("l2_shrinkage_regularization_strength", 0.0), hp.get("beta", 0.0)
    n = st.get("n", np.full_like(w, hp.get("initial_accumulator_value", 0.1)))
    z = st.get("z", np.zeros_like(w))
    g_s = g + 2 * l2s * w
    n_new = n + g * g
    sigma = (n_new**p - n**p) / lr
    z = z + g_s - sigma * w
    quad = n_new**p / lr + 2 * l2 + beta / lr
    w_new = np.where(np.abs(z) > l1, (np.sign(z) * l1 - z) / quad, 0.0)
    st["n"], st["z"] = n_new, z
    return w_new


def lars(w, g, st, lr, t, hp):
    mu, wd = hp.get("momentum", 0.9), hp.get("weight_decay", 1e-4)
    eeta, eps = hp.get("eeta", 0.001), hp.get("epsilon", 0.0)
    nesterov, variant = hp.get("use_nesterov", False), hp.get("variant", "tf1.15")
    skipped = hp.get("_lars_skipped", False)
    wn, gn = _norm(w), _norm(g)
    if skipped:
        trust, wd = 1.0, 0.0
    else:
        trust = eeta * wn / (gn + wd * wn + eps) if (wn > 0 and gn > 0) else 1.0
    s = lr * trust
    a = st.get("a", np.zeros_like(w))
    if variant == "tf1.15":
        u = s * (g + wd * w)
        a = mu * a + u
        st["a"] = a
        return w - (u + mu * a if nesterov else a)
    a = mu * a + g
    st["a"] = a
    return w - (s * g + s * mu * a if nesterov else s * a)


def lamb(w, g, st, lr, t, hp):
    """LAMB, You et al. 2019 (arXiv:1904.00962) Algorithm 2, with the peers' options: ``weight_decay`` in
    the direction, ``bias_correction``, the adaptation rule (``always_adapt``; a tensor without weight decay
    is not adapted unless it is set, as timm's ``Lamb``), the trust-ratio clamp ``min_coeff``/``max_coeff``
    (DeepSpeed) and ``lambc`` (timm's LAMBC: ratio <= 1). Per-tensor flags: ``_skipped`` (skip_list /
    exclude_1d: no decay, no adaptation), ``_decayed`` (exclude_from_weight_decay)."""
    b1, b2, eps = hp.get("beta1", 0.9), hp.get("beta2", 0.999), hp.get("epsilon", 1e-6)
    skipped = hp.get("_skipped", False)
    wd = 0.0 if skipped or not hp.get("_decayed", True) else hp.get("weight_decay", 0.0)
    m = b1 * st.get("m", np.zeros_like(w)) + (1 - b1) * g
    v = b2 * st.get("v", np.zeros_like(w)) + (1 - b2) * g * g
    st["m"], st["v"] = m, v
    if hp.get("bias_correction", True):
        m, v = m / (1 - b1**t), v / (1 - b2**t)
    u = m / (np.sqrt(v) + eps) + wd * w
    r = 1.0
    if not skipped and not hp.get("exclude_from_adaptation", False) and (wd != 0 or hp.get("always_adapt")):
        wn, un = _norm(w), _norm(u)
        if wn > 0 and un > 0:  # DeepSpeed's clamp binds the quotient only: a zero norm's 1 stays 1
            r = wn / un
            if hp.get("min_coeff") is not None:
                r = max(r, hp["min_coeff"])
            if hp.get("max_coeff") is not None:
                r = min(r, hp["max_coeff"])
        if hp.get("lambc"):
            r = min(r, 1.0)
    return w - lr * r * u


def lion(w, g, st, lr, t, hp):
    """Lion, Chen et al. 2023 (arXiv:2302.06675) Algorithm 2: ``c = β1·m + (1 − β1)·g``,
    ``w ← w − lr·sign(c)``, ``m ← β2·m + (1 − β2)·g`` (its decoupled decay ``w ← w − lr·λ·w`` is the
    pipeline's ``weight_decay``)."""
    b1, b2 = hp.get("beta1", 0.9), hp.get("beta2", 0.99)
    m = st.get("m", np.zeros_like(w))
    c = b1 * m + (1 - b1) * g
    st["m"] = b2 * m + (1 - b2) * g
    return w - lr * np.sign(c)


RULES: dict[str, Callable] = {
    "keras_sgd": keras_sgd, "momentum": tf_momentum, "adam": adam, "adagrad": adagrad,
    "rmsprop": tf_rmsprop, "ftrl": ftrl, "lars": lars, "lamb": lamb, "lion": lion,
}


# ------------------------------------------------------------------------------------------------ pipeline


class Reference:
    """The Keras base pipeline around one rule, in float64 (``spec/tf_keras.md`` §4.1).

    ``hp`` holds the rule's hyperparameters; ``base`` the base options: ``lr`` (number or ``step -> lr``),
    ``weight_decay`` (decoupled, Keras), ``decay_mask`` (per tensor), ``clipnorm`` / ``clipvalue`` /
    ``global_clipnorm``, ``use_ema``, ``ema_momentum``, ``ema_overwrite_frequency``, ``ema_warmup``;
    ``per_tensor`` optional per-tensor hyperparameter overrides (e.g. LARS skip flags; ``_lr_scale``
    multiplies the tensor's learning rate, decay included).
    """

    def __init__(self, rule: str, ws: Sequence[Arr], hp: dict | None = None, base: dict | None = None,
                 per_tensor: Sequence[dict] | None = None) -> None:
        self.rule = RULES[rule]
        self.ws = [np.array(w, dtype=np.float64) for w in ws]
        self.hp = dict(hp or {})
        self.base = dict(base or {})
        self.per_tensor = list(per_tensor) if per_tensor else [{} for _ in ws]
        self.states: list[dict] = [{} for _ in ws]
        self.avgs = [np.zeros_like(w) for w in self.ws]
        self.iterations = 0

    def lr(self) -> float:
        lr = self.base.get("lr", 0.01)
        return float(lr(self.iterations)) if callable(lr) else float(lr)

    def step(self, grads: Sequence[Arr | None]) -> list[Arr]:
        b = self.base
        gs = [None if g is None else np.array(g, dtype=np.float64) for g in grads]
        present = [i for i, g in enumerate(gs) if g is not None]
        if b.get("clipvalue") is not None:
            c = b["clipvalue"]
            for i in present:
                gs[i] = np.clip(gs[i], -c, c)
        elif b.get("clipnorm") is not None:
            c = b["clipnorm"]
            for i in present:
                gs[i] = gs[i] * c / max(_norm(gs[i]), c)
        elif b.get("global_clipnorm") is not None:
            c = b["global_clipnorm"]
            n = float(np.sqrt(sum(np.sum(gs[i] ** 2) for i in present)))
            for i in present:
                gs[i] = gs[i] * c / max(n, c)
        lr = self.lr()
        t = self.iterations + 1
        wd = b.get("weight_decay")
        mask = b.get("decay_mask") or [True] * len(self.ws)
        for i in present:
            w = self.ws[i]
            hp = {**self.hp, **self.per_tensor[i]}
            lr_i = lr * hp.pop("_lr_scale", 1.0)  # a param group's lr_scale (optkit.param_groups)
            if wd and mask[i]:
                w = w - w * wd * lr_i
            self.ws[i] = self.rule(w, gs[i], self.states[i], lr_i, t, hp)
        if b.get("use_ema"):
            mu = 0.0 if self.iterations == 0 else b.get("ema_momentum", 0.99)
            if b.get("ema_warmup") and self.iterations:  # TF ExponentialMovingAverage(num_updates=k)
                mu = min(mu, (1 + self.iterations) / (10 + self.iterations))
            self.avgs = [mu * a + (1 - mu) * w for a, w in zip(self.avgs, self.ws)]
            f = b.get("ema_overwrite_frequency")
            if f and (self.iterations + 1) % f == 0:
                self.ws = [a.copy() for a in self.avgs]
        self.iterations += 1
        return self.ws
