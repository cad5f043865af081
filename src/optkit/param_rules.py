"""Parameter rules by name: param groups from ``named_parameters()``, layer-wise learning-rate decay, and the
``create_optimizer`` front door that ``optimize_loss`` shares.

:func:`param_groups` walks ``model.named_parameters()`` (trainable ones) and gives each parameter options:

1. ``weight_decay`` (the argument, when given);
2. ``no_decay_1d=True``: ``weight_decay = 0`` for tensors with ``ndim <= 1`` and names ending in ``.bias``
   (biases and normalisation scales; timm's ``param_groups_weight_decay`` rule);
3. ``layer_decay=d`` (BEiT / ELECTRA layer-wise decay): ``lr_scale = d ** (num_layers − layer_id)`` with the
   layer id parsed from the name: ``N + 1`` for a name holding ``layers.N.``, ``layer.N.`` (also
   ``encoder.layer.N.``), ``blocks.N.`` or ``h.N.`` (``layer_regex``), 0 for embeddings (``embed_regex``:
   ``embeddings``, ``patch_embed``, ``pos_embed``, ``cls_token``, ``reg_token`` (ViT register tokens),
   ``norm_pre``, ``wte``, ...: the stem of timm's ViT ``group_matcher``), and ``num_layers`` (the head:
   scale 1) for everything else. ``num_layers`` defaults to the number of blocks + 1 (timm's
   ``param_groups_layer_decay``: ``layer_max``). The final ``norm`` after the last block takes the head's
   scale, as in BEiT's and MAE's layer decay (every name that is neither an embedding nor in a block is
   the head's); timm's ViT ``group_matcher`` puts it in the last block instead (scale ``d``), which
   ``final_norm="last_block"`` gives: names matching ``final_norm_regex`` (by default those of a module
   called ``norm``) that are in no block take the last block's layer id;
4. the first rule ``(regex, options)`` whose regex is found in the name (``re.search``) sets its options
   (overriding the three above).

Parameters with equal options share one group, in order of first appearance. Each group is a dict with
``"params"`` as ``(name, tensor)`` pairs (what optkit optimizers take) and the options as keys:

* ``lr_scale`` — the group's learning rate is ``lr × lr_scale``: optkit optimizers multiply it in (every
  schedule included), :class:`optkit.ScheduleLR` multiplies it for torch optimizers, and
  :func:`create_optimizer` folds it into the ``lr`` of torch optimizer groups;
* ``weight_decay`` — the optimizer's group weight decay (its own meaning: LAMB's, LARS's, Keras's);
* ``exclude_from_adaptation`` — no layer-wise trust ratio (LAMB reads it; :func:`create_optimizer` turns it
  into a match-all ``skip_list`` for LARS, which then also drops that group's decay as TF's LARS does, and
  leaves it out for optimizers without adaptation);
* ``clip`` — clip each gradient of the group to norm ``clip`` (TF ``clip_by_norm``: ``g·c/max(‖g‖, c)``),
  done by a step pre-hook that :func:`create_optimizer` installs (:func:`install_group_clipping`); it reads
  the loss scale of the step protocol (``grad_scale``), so it clips the true gradient under loss scaling.

The result prints as a table (:meth:`ParamGroups.describe`). An unknown rule key raises ``ValueError`` naming
it; a rule that matches no parameter warns.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from . import _multi_tensor as mt
from .schedules import applies_lr_scale

__all__ = ["param_groups", "ParamGroups", "create_optimizer", "build_optimizer", "install_group_clipping",
           "layer_id", "RULE_KEYS", "DEFAULT_LAYER_REGEX", "DEFAULT_EMBED_REGEX", "DEFAULT_FINAL_NORM_REGEX",
           "FINAL_NORM_CHOICES"]

#: the options a rule may set
RULE_KEYS = ("lr_scale", "weight_decay", "exclude_from_adaptation", "clip")
#: a transformer block index: ``layers.N.``, ``layer.N.`` (``encoder.layer.N.``), ``blocks.N.``, ``h.N.``
DEFAULT_LAYER_REGEX = r"(?:^|\.)(?:layers|layer|blocks|h)\.(\d+)(?:\.|$)"
#: embeddings (layer 0); ``reg_token`` / ``register_tokens`` (ViT registers: timm, DINOv2) and ``norm_pre``
#: are in the stem of timm's ViT ``group_matcher``
DEFAULT_EMBED_REGEX = (r"(?:^|\.)(?:embeddings?|embed_tokens|word_embeddings|position_embeddings|"
                       r"token_type_embeddings|embeddings_project|patch_embed|pos_embed|cls_token|dist_token|mask_token|wte|"
                       r"wpe|reg_token|register_tokens|norm_pre)(?:\.|$)")
#: the final norm after the last block (a module called ``norm``), moved by ``final_norm="last_block"``
DEFAULT_FINAL_NORM_REGEX = r"(?:^|\.)norm\."
#: where the final norm's layer is: the head's (BEiT, MAE) or the last block's (timm's ViT)
FINAL_NORM_CHOICES = ("head", "last_block")

RuleList = Sequence[tuple[str | re.Pattern, Mapping[str, Any]]]


def _entry(item: Any) -> str:
    """A short description of a refused entry: a tensor by its type and shape, never its values."""
    if isinstance(item, Tensor):
        return f"{type(item).__name__} of shape {tuple(item.shape)}"
    if isinstance(item, tuple):
        parts = (repr(x) if isinstance(x, str) and len(x) <= 60 else _entry(x) for x in item)
        return "(" + ", ".join(parts) + ")"
    return type(item).__name__


def _named(model: Any, include_frozen: bool) -> list[tuple[str, Tensor]]:
    if isinstance(model, nn.Module):
        items = list(model.named_parameters())
    elif isinstance(model, (Tensor, str, bytes)) or not isinstance(model, Iterable):
        raise TypeError("`model` must be an nn.Module or an iterable of (name, tensor) pairs")
    else:
        items = list(model)
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                    and isinstance(item[1], Tensor)):
                hint = ("; pass the module itself or model.named_parameters() (rules match names, which "
                        "model.parameters() does not give)" if isinstance(item, Tensor) else "")
                raise TypeError("`model` must be an nn.Module or an iterable of (name, tensor) pairs, "
                                f"got an entry {_entry(item)}{hint}")
    out = [(n, p) for n, p in items if include_frozen or p.requires_grad]
    if not out:
        raise ValueError("`model` has no trainable parameters")
    return out


def _check_option(where: str, key: str, value: Any) -> Any:
    if key not in RULE_KEYS:
        raise ValueError(f"{where}: unknown key {key!r}; a rule sets {list(RULE_KEYS)}")
    if key == "exclude_from_adaptation":
        if not isinstance(value, bool):
            raise TypeError(f"{where}: 'exclude_from_adaptation' must be a bool, got {value!r}")
        return value
    if key == "clip" and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{where}: {key!r} must be a finite number, got {value!r}")
    if value < 0 or (key == "clip" and value == 0):
        raise ValueError(f"{where}: {key!r} must be {'> 0' if key == 'clip' else '>= 0'}, got {value!r}")
    return float(value)


def _compile_rules(rules: RuleList | None) -> list[tuple[re.Pattern, dict[str, Any]]]:
    if rules is None:
        return []
    if isinstance(rules, (str, Mapping)):
        raise TypeError("`rules` must be a list of (regex, options) pairs")
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise TypeError(f"`rules`[{i}] must be a (regex, options) pair, got {rule!r}")
        pattern, opts = rule
        where = f"`rules`[{i}] ({getattr(pattern, 'pattern', pattern)!r})"
        if isinstance(pattern, str):
            try:
                pattern = re.compile(pattern)
            except re.error as err:
                raise ValueError(f"{where}: invalid regex: {err}") from None
        elif not isinstance(pattern, re.Pattern):
            raise TypeError(f"{where}: the pattern must be a str or a compiled regex")
        if not isinstance(opts, Mapping):
            raise TypeError(f"{where}: the options must be a dict, got {type(opts).__name__}")
        out.append((pattern, {k: _check_option(where, k, v) for k, v in opts.items()}))
    return out


def layer_id(name: str, num_layers: int, layer_regex: str | re.Pattern = DEFAULT_LAYER_REGEX,
             embed_regex: str | re.Pattern = DEFAULT_EMBED_REGEX) -> int:
    """The layer of a parameter for layer-wise decay: ``N + 1`` for block ``N`` (``layer_regex``'s first
    group), 0 for embeddings (``embed_regex``), ``num_layers`` for the rest (the head)."""
    m = re.search(layer_regex, name)
    if m is not None:
        return int(m.group(1)) + 1
    if re.search(embed_regex, name) is not None:
        return 0
    return num_layers


class ParamGroups(list):
    """The groups :func:`param_groups` built (a list of dicts, accepted wherever param groups are), with the
    per-parameter record behind them: ``records`` = ``[(name, shape, group index, layer id or None)]``."""

    def __init__(self, groups: list[dict], records: list[tuple[str, tuple, int, int | None]],
                 sparse_grad_ids: frozenset[int] = frozenset()) -> None:
        super().__init__(groups)
        self.records = records
        #: ids of the weights of the module's ``nn.Embedding`` / ``nn.EmbeddingBag(sparse=True)`` (sparse
        #: gradients): :func:`optkit.flat_parameters` given these groups keeps them out of the buffer
        self.sparse_grad_ids = sparse_grad_ids

    def describe(self, per_parameter: bool = False, width: int = 60) -> str:
        """A Markdown table: one row per group (index, parameters, elements, lr_scale, weight_decay, other
        options, names), or one row per parameter with ``per_parameter=True``."""
        def opt(g: dict, key: str) -> str:
            return f"{g[key]:g}" if key in g else "-"

        def other(g: dict) -> str:
            return ", ".join(f"{k}={g[k]}" for k in ("exclude_from_adaptation", "clip") if k in g) or "-"

        if per_parameter:
            lines = ["| parameter | shape | group | layer | lr_scale | weight_decay | other |",
                     "|---|---|---:|---:|---:|---:|---|"]
            for name, shape, gi, lid in self.records:
                g = self[gi]
                lines.append(f"| {name} | {tuple(shape)} | {gi} | {'-' if lid is None else lid} | "
                             f"{opt(g, 'lr_scale')} | {opt(g, 'weight_decay')} | {other(g)} |")
            return "\n".join(lines)
        lines = ["| group | params | elements | lr_scale | weight_decay | other | names |",
                 "|---:|---:|---:|---:|---:|---|---|"]
        for gi, g in enumerate(self):
            names = [n for n, _ in g["params"]]
            text = ", ".join(names)
            if len(text) > width:
                shown, used = [], 0
                for n in names:
                    if used + len(n) > width and shown:
                        break
                    shown.append(n)
                    used += len(n) + 2
                if len(shown) < len(names):  # a single long name is shown whole
                    text = ", ".join(shown) + f", … (+{len(names) - len(shown)})"
            numel = sum(p.numel() for _, p in g["params"])
            lines.append(f"| {gi} | {len(names)} | {numel:,} | {opt(g, 'lr_scale')} | "
                         f"{opt(g, 'weight_decay')} | {other(g)} | {text} |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


def param_groups(
    model: nn.Module | Iterable[tuple[str, Tensor]],
    rules: RuleList | None = None,
    *,
    weight_decay: float | None = None,
    no_decay_1d: bool = True,
    layer_decay: float | None = None,
    num_layers: int | None = None,
    layer_regex: str | re.Pattern = DEFAULT_LAYER_REGEX,
    embed_regex: str | re.Pattern = DEFAULT_EMBED_REGEX,
    include_frozen: bool = False,
    final_norm: str = "head",
    final_norm_regex: str | re.Pattern = DEFAULT_FINAL_NORM_REGEX,
) -> ParamGroups:
    """Param groups by name (module doc): ``weight_decay``, then ``no_decay_1d``, then ``layer_decay``, then
    the first matching rule of ``rules`` (``[(regex, {"lr_scale": ..., "weight_decay": ...,
    "exclude_from_adaptation": ..., "clip": ...}), ...]``).

    Args:
        model: an ``nn.Module`` or ``(name, tensor)`` pairs; parameters without ``requires_grad`` are left out
            unless ``include_frozen``.
        rules: ``(regex, options)`` pairs; the first whose regex is found in a name wins.
        weight_decay: the weight decay of the parameters no other option changes (None: the optimizer's).
        no_decay_1d: weight decay 0 for tensors with ``ndim <= 1`` and names ending in ``.bias``.
        layer_decay: ``d`` in ``lr_scale = d ** (num_layers − layer_id)`` (``0 < d <= 1``).
        num_layers: the head's layer id (default: the number of blocks found + 1).
        layer_regex, embed_regex: how block indices (first group) and embeddings are found in names.
        final_norm: the layer of the final norm (names matching ``final_norm_regex`` in no block and not
            embeddings): ``"head"`` (``num_layers``, scale 1: BEiT, MAE) or ``"last_block"`` (the last
            block's id ``max(N) + 1``, scale ``d ** (num_layers − max(N) − 1)``: timm's ViT, whose
            ``group_matcher`` maps ``^norm`` to the last block's group).
        final_norm_regex: how the final norm is found for ``final_norm="last_block"`` (default: the
            parameters of a module called ``norm``).

    Returns a :class:`ParamGroups` (a list of group dicts that prints as a table).

    Raises:
        ValueError / TypeError: an unknown rule key (named), a bad value, an invalid regex, a ``layer_decay``
            outside ``(0, 1]``, no block found for ``layer_decay``, a block beyond ``num_layers``, or a
            ``final_norm`` other than ``"head"`` / ``"last_block"``.
    """
    if not isinstance(final_norm, str):
        raise TypeError(f"`final_norm` must be one of {list(FINAL_NORM_CHOICES)}, got {final_norm!r}")
    if final_norm not in FINAL_NORM_CHOICES:
        raise ValueError(f"`final_norm` must be one of {list(FINAL_NORM_CHOICES)}, got {final_norm!r}")
    if not isinstance(final_norm_regex, (str, re.Pattern)):
        raise TypeError(f"`final_norm_regex` must be a str or a compiled regex, got {final_norm_regex!r}")
    named = _named(model, include_frozen)
    compiled = _compile_rules(rules)
    if weight_decay is not None:
        weight_decay = _check_option("`weight_decay`", "weight_decay", weight_decay)
    if not isinstance(no_decay_1d, bool):
        raise TypeError(f"`no_decay_1d` must be a bool, got {no_decay_1d!r}")
    ids: list[int | None] = [None] * len(named)
    if layer_decay is not None:
        if isinstance(layer_decay, bool) or not isinstance(layer_decay, numbers.Real):
            raise TypeError(f"`layer_decay` must be a number in (0, 1], got {layer_decay!r}")
        if not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"`layer_decay` must be a number in (0, 1], got {layer_decay!r}")
        try:
            lre = re.compile(layer_regex) if isinstance(layer_regex, str) else layer_regex
            ere = re.compile(embed_regex) if isinstance(embed_regex, str) else embed_regex
            fre = re.compile(final_norm_regex) if isinstance(final_norm_regex, str) else final_norm_regex
        except re.error as err:
            raise ValueError(f"`layer_regex`/`embed_regex`/`final_norm_regex`: invalid regex: {err}") \
                from None
        if lre.groups < 1:
            raise ValueError("`layer_regex` must capture the block index in its first group")
        blocks = [int(m.group(1)) for m in (lre.search(n) for n, _ in named) if m is not None]
        if not blocks:
            raise ValueError(f"`layer_decay`: no parameter name matches layer_regex {lre.pattern!r} "
                             "(pass layer_regex= for this model's block names)")
        if num_layers is None:
            num_layers = max(blocks) + 2
        elif isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral):
            raise TypeError(f"`num_layers` must be an int >= 1, got {num_layers!r}")
        elif num_layers < 1:
            raise ValueError(f"`num_layers` must be an int >= 1, got {num_layers!r}")
        elif max(blocks) + 1 > num_layers:
            raise ValueError(f"`num_layers`={num_layers} but a parameter is in block {max(blocks)} "
                             f"(layer id {max(blocks) + 1})")
        ids = [layer_id(n, int(num_layers), lre, ere) for n, _ in named]
        if final_norm == "last_block":  # timm's ViT: the final norm is in the last block's group
            ids = [max(blocks) + 1 if lre.search(n) is None and ere.search(n) is None and fre.search(n)
                   else lid for (n, _), lid in zip(named, ids)]
    elif num_layers is not None:
        raise ValueError("`num_layers` only applies with `layer_decay`")
    elif final_norm != "head":
        raise ValueError("`final_norm` only applies with `layer_decay`")
    groups: list[dict] = []
    index: dict[tuple, int] = {}
    records = []
    used = [False] * len(compiled)  # the rule decided some parameter's options
    seen = [False] * len(compiled)  # the rule's regex is found in some name
    for (name, p), lid in zip(named, ids):
        opts: dict[str, Any] = {}
        if weight_decay is not None:
            opts["weight_decay"] = weight_decay
        if no_decay_1d and (p.ndim <= 1 or name.endswith(".bias")):
            opts["weight_decay"] = 0.0
        if lid is not None:
            opts["lr_scale"] = float(layer_decay) ** (int(num_layers) - lid)  # type: ignore[arg-type]
        won = False
        for k, (pattern, rule_opts) in enumerate(compiled):
            if pattern.search(name):
                seen[k] = True
                if not won:
                    opts.update(rule_opts)
                    used[k] = won = True
        if opts.get("clip", 1) is None:
            del opts["clip"]
        key = tuple(sorted(opts.items()))
        gi = index.get(key)
        if gi is None:
            gi = index[key] = len(groups)
            groups.append({"params": [], **opts})
        groups[gi]["params"].append((name, p))
        records.append((name, tuple(p.shape), gi, lid))
    for (pattern, _), hit, found in zip(compiled, used, seen):
        if not found:
            warnings.warn(f"param_groups: rule {pattern.pattern!r} matches no parameter name", stacklevel=2)
        elif not hit:
            warnings.warn(f"param_groups: rule {pattern.pattern!r} decides nothing: every parameter it "
                          "matches is taken by an earlier rule (the first matching rule wins)", stacklevel=2)
    sparse = frozenset()
    if isinstance(model, nn.Module):
        from .flat import _SPARSE_GRAD_MODULES

        sparse = frozenset(id(m.weight) for m in model.modules() if isinstance(m, _SPARSE_GRAD_MODULES)
                           and m.sparse and isinstance(m.weight, Tensor))
    return ParamGroups(groups, records, sparse)


# ------------------------------------------------------------------------------------------------------------
# building optimizers


def _clip_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook: every gradient of a group with ``clip = c`` becomes ``g·c/max(‖g‖/S, c)`` where ``S``
    is the step's loss scale (1 without one: the ``grad_scale`` of the ``context`` an optkit wrapper steps
    its inner optimizer with, or the attribute ``torch.amp.GradScaler`` sets), so the true gradient's norm
    is clipped. It writes
    ``.grad`` in place, as ``torch.nn.utils.clip_grad_norm_`` in a torch loop does (it serves torch optimizers
    too); the optimizer-wide ``clipnorm``/``global_clipnorm`` leave ``.grad`` alone."""
    context = kwargs.get("context")
    scale = context.grad_scale if context is not None else getattr(opt, "grad_scale", None)
    with torch.no_grad():
        for group in opt.param_groups:
            c = group.get("clip")
            if c is None:
                continue
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if not grads:
                continue
            norms = mt.norms(grads)
            dev = mt.local(grads[0]).device
            n = torch.stack([x.to(device=dev, dtype=torch.float64) for x in norms])
            if scale is not None:
                n = n / scale.detach().to(device=dev, dtype=torch.float64).reshape(())
            coef = mt.clip_factor(n, float(c))
            mt.scale_(grads, list(coef.unbind()))


def install_group_clipping(opt: torch.optim.Optimizer) -> bool:
    """Make ``opt`` honour the ``clip`` key of its param groups (a step pre-hook, see :func:`_clip_hook`);
    returns whether any group has one. :func:`create_optimizer` calls it; call it yourself when you build an
    optimizer from :func:`param_groups` output directly."""
    if not any(g.get("clip") is not None for g in opt.param_groups):
        return False
    if not getattr(opt, "_optkit_group_clipping", False):
        opt.register_step_pre_hook(_clip_hook)
        opt._optkit_group_clipping = True  # type: ignore[attr-defined]
    return True


def _accepts_learning_rate(cls: Any) -> bool:
    import inspect

    try:
        return "learning_rate" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def build_optimizer(cls: Any, groups: Sequence[dict], lr: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """``cls`` over ``groups`` (from :func:`param_groups`) with learning rate ``lr``: optimizers that apply
    ``lr_scale`` themselves (:func:`~optkit.schedules.applies_lr_scale`: optkit's) get the groups as they are;
    torch optimizers get tensors and ``lr = lr × lr_scale`` per group. ``exclude_from_adaptation`` becomes
    LARS's match-all ``skip_list`` and is dropped for optimizers without layer adaptation; ``clip`` installs
    :func:`install_group_clipping`."""
    from .lamb import LAMB
    from .lars import LARS

    scales_itself = applies_lr_scale(cls)
    out = []
    for g in groups:
        g = dict(g)
        if g.pop("exclude_from_adaptation", False):
            if isinstance(cls, type) and issubclass(cls, LAMB):
                g["exclude_from_adaptation"] = True
            elif isinstance(cls, type) and issubclass(cls, LARS):
                g["skip_list"] = [""]  # every name contains ""
        if not scales_itself:
            g["params"] = [p[1] if isinstance(p, tuple) else p for p in g["params"]]
            scale = g.get("lr_scale", 1.0)
            if scale != 1.0:
                if isinstance(lr, numbers.Real):
                    g["lr"] = float(lr) * scale
                    g["lr_scale_in_lr"] = True  # ScheduleLR's multiplier mode: do not multiply it again
                else:
                    name = getattr(cls, "__name__", cls)
                    raise TypeError(f"{name}: lr_scale needs a number `lr` for a torch optimizer")
        out.append(g)
    key = "learning_rate" if _accepts_learning_rate(cls) else "lr"
    opt = cls(out, **{key: lr}, **kwargs)
    install_group_clipping(opt)
    return opt


def create_optimizer(
    model: nn.Module | Iterable[tuple[str, Tensor]],
    optimizer: str | type = "LAMB",
    lr: Any = None,
    weight_decay: float | None = None,
    *,
    layer_decay: float | None = None,
    rules: RuleList | None = None,
    no_decay_1d: bool = True,
    num_layers: int | None = None,
    layer_regex: str | re.Pattern = DEFAULT_LAYER_REGEX,
    embed_regex: str | re.Pattern = DEFAULT_EMBED_REGEX,
    final_norm: str = "head",
    final_norm_regex: str | re.Pattern = DEFAULT_FINAL_NORM_REGEX,
    **optimizer_kwargs: Any,
) -> torch.optim.Optimizer:
    """An optimizer from the registry (or a class) over :func:`param_groups` of ``model``.

    ``create_optimizer(model, "LAMB", lr=1e-3, weight_decay=0.01, layer_decay=0.75,
    rules=[("head", {"lr_scale": 10.0})])`` builds ``LAMB(groups, learning_rate=1e-3, weight_decay=0.01)``
    where biases and norm scales have no weight decay, block ``N`` of ``L − 1`` has
    ``lr_scale = 0.75 ** (L − N − 1)`` and the head 10; the final ``norm`` has the head's scale (BEiT, MAE),
    or the last block's with ``final_norm="last_block"`` (timm's ViT; :func:`param_groups`). ``lr`` (alias
    ``learning_rate``) is a number, a 0-d tensor, a schedule or a callable for optkit optimizers;
    ``weight_decay`` is also passed to the constructor (the default of groups without their own). Other
    keywords go to the optimizer.
    """
    from .registry import get_optimizer

    if "learning_rate" in optimizer_kwargs:
        if lr is not None:
            raise ValueError("create_optimizer: give `lr` or `learning_rate`, not both")
        lr = optimizer_kwargs.pop("learning_rate")
    if lr is None:
        raise ValueError("create_optimizer: `lr` is required")
    cls = get_optimizer(optimizer)
    groups = param_groups(model, rules, weight_decay=weight_decay, no_decay_1d=no_decay_1d,
                          layer_decay=layer_decay, num_layers=num_layers, layer_regex=layer_regex,
                          embed_regex=embed_regex, final_norm=final_norm, final_norm_regex=final_norm_regex)
    if weight_decay is not None:
        optimizer_kwargs["weight_decay"] = weight_decay
    return build_optimizer(cls, groups, lr, **optimizer_kwargs)
