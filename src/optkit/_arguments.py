"""Other libraries' argument names: the aliases optkit's constructors accept and a hint for the rest.

optkit keeps the TF/Keras names of the originals (``learning_rate``, ``beta1``, ``epsilon``, ``eeta``,
``larc_eta``). A torch.optim, timm, apex or Keras 3 user writes other names; every constructor (the
optimizers' :meth:`optkit.Optimizer.__new__` and the wrappers') checks its keyword arguments against the one
table below before Python binds them, so that such a name gets a "did you mean" (or why there is none)
instead of a bare "unexpected keyword argument" or "missing required argument":

* :data:`ALIASES`: names accepted as they are. ``lr`` (torch, timm) for ``learning_rate``, in every optimizer;
  ``use_nesterov`` (TF1 ``MomentumOptimizer`` / ``LARSOptimizer``) for ``nesterov`` (torch and Keras), in
  every optimizer with Nesterov momentum. Giving both spellings is a ``TypeError``.
* :data:`HINTS`: names that are refused with the optkit spelling this optimizer has (``betas=`` → ``beta1=``,
  ``beta2=``), or, where it has none, what to do instead (``maximize=``: minimise the negated objective).

Other unknown names are refused with the closest accepted names (``difflib``).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

__all__ = [
    "ALIASES", "GROUP_ALIASES", "HINTS", "UnknownArgumentError", "accepted_keywords", "check_call",
    "check_nesterov", "unknown_arguments_error",
]


class UnknownArgumentError(TypeError, ValueError):
    """A keyword argument the constructor does not take: a ``TypeError`` as Python raises for an unexpected
    keyword, and a ``ValueError`` as Keras (and optkit before) raised; catching either works."""


#: alias -> optkit's name; accepted by every constructor that takes the latter
ALIASES: dict[str, str] = {"lr": "learning_rate", "use_nesterov": "nesterov"}

#: param-group key -> optkit's key, for the optimizers that have the latter: in the groups given to a
#: constructor or ``add_param_group`` and in loaded state dicts (Momentum and LARS kept ``use_nesterov``
#: up to optkit 0.3). ``"learning_rate"`` -> ``"lr"`` is the base class's own (it checks the value).
GROUP_ALIASES: dict[str, str] = {"use_nesterov": "nesterov"}


class Hint(NamedTuple):
    """Where a foreign name comes from, the optkit arguments that mean the same (the first alternative whose
    names the constructor takes is suggested; each with a note on how to write it), and the advice when
    it takes none of them (``{cls}`` is the constructor's name)."""

    origin: str
    alternatives: tuple[tuple[tuple[str, ...], str], ...]
    otherwise: str


_IMPLEMENTATION = Hint("a torch.optim implementation switch", (),
                       "optkit picks its fused multi-tensor kernels itself; drop it")
_NESTEROV_OTHERWISE = ("{cls} has no Nesterov momentum (optkit.SGD(momentum=..., nesterov=True), Momentum "
                       "and LARS have)")
_GRAD_SCALER = Hint("torch.amp.GradScaler's option", (),
                    "pass loss_scale=optkit.DynamicLossScale(initial_loss_scale=init_scale, "
                    "multiplier=growth_factor, increment_period=growth_interval) (backoff is 1/multiplier)")
_TRUST = ((("eeta",), "LARS's trust coefficient η"), (("larc_eta",), "LARC's trust coefficient η"))
_TRUST_OTHERWISE = "{cls} has no trust ratio (LARS, LAMB and optkit.LARC(opt, larc_eta) have)"

#: foreign keyword -> hint; one table for every optimizer and wrapper constructor
HINTS: dict[str, Hint] = {
    "lr": Hint("torch's name", ((("learning_rate",), ""),), "{cls} has no learning rate"),
    "betas": Hint("torch's and timm's name", ((("beta1", "beta2"), "betas=(b1, b2) is beta1=b1, beta2=b2"),),
                  "{cls} has no beta1/beta2 (Adam, AdamW, LAMB and Lion have)"),
    "beta_1": Hint("Keras 3's name", ((("beta1",), ""),), "{cls} has no beta1"),
    "beta_2": Hint("Keras 3's name", ((("beta2",), ""),), "{cls} has no beta2"),
    "eps": Hint("torch's name", ((("epsilon",), ""),), "{cls} has no epsilon"),
    "alpha": Hint("torch RMSprop's name", ((("decay",), "the decay of the mean square"),),
                  "{cls} has no such option"),
    "rho": Hint("Keras RMSprop's name", ((("decay",), "the decay of the mean square"),),
                "{cls} has no such option"),
    "maximize": Hint("a torch.optim switch", (),
                     "not supported: optkit optimizers minimise; minimise the negated objective "
                     "(loss = -objective) instead"),
    "dampening": Hint("torch SGD's option", (),
                      "not supported: optkit computes with dampening 0 (torch's default)"),
    "nesterov": Hint("torch's and Keras's name", ((("nesterov",), ""),), _NESTEROV_OTHERWISE),
    "use_nesterov": Hint("TF1's name", ((("nesterov",), ""),), _NESTEROV_OTHERWISE),
    "momentum": Hint("an SGD option", ((("beta1",), "the first-moment decay of Adam-type optimizers"),),
                     "{cls} has no momentum (SGD, Momentum, RMSProp and LARS have)"),
    "trust_coefficient": Hint("apex LARC's name", _TRUST, _TRUST_OTHERWISE),
    "trust_coeff": Hint("timm Lars's name", _TRUST, _TRUST_OTHERWISE),
    "trust_clip": Hint("timm's option",
                       ((("lambc",), "trust_clip=True is lambc=True"),
                        (("larc_mode",), "trust_clip=True is larc_mode='clip'")),
                       "{cls} does not clip its trust ratio: wrap it as optkit.LARC(opt, larc_eta, "
                       "larc_mode='clip')"),
    "clip": Hint("apex LARC's option",
                 ((("larc_mode",), "clip=True is larc_mode='clip', clip=False is larc_mode='scale'"),),
                 "{cls} has no such option"),
    "max_grad_norm": Hint("timm Lamb's and apex's name",
                          ((("global_grad_norm_clip",), "NVLAMB's global gradient-norm clip"),
                           (("global_clipnorm",), "the global gradient-norm clip")),
                          "{cls} has no such option: clip the gradients with "
                          "optkit.clip_grads_by_global_norm_ before step()"),
    "grad_averaging": Hint("timm Lamb's option", (),
                           "not supported: the first moment always averages (1 − beta1)·g (timm's default "
                           "grad_averaging=True)"),
    "decoupled_weight_decay": Hint("torch Adam's switch", (), "use optkit.AdamW for decoupled decay, "
                                   "optkit.Adam for torch's coupled L2"),
    "foreach": _IMPLEMENTATION,
    "fused": _IMPLEMENTATION,
    "capturable": _IMPLEMENTATION,
    "differentiable": _IMPLEMENTATION,
    "use_locking": Hint("TF1's option", (), "it has no meaning in PyTorch; drop it"),
    "init_scale": _GRAD_SCALER,
    "growth_factor": _GRAD_SCALER,
    "backoff_factor": _GRAD_SCALER,
    "growth_interval": _GRAD_SCALER,
    "gradient_accumulation_steps": Hint("Keras 3's option", (),
                                        "accumulate with optkit.optimize_loss(..., iter_size=n)"),
    "loss_scale_factor": Hint("Keras 3's option", (),
                              "wrap the optimizer: optkit.LossScaleOptimizer(opt, loss_scale)"),
}


@functools.cache
def accepted_keywords(cls: type, base: type) -> frozenset[str]:
    """The keyword arguments ``cls(...)`` takes: the named parameters of each ``__init__`` along its MRO while
    they pass ``**kwargs`` on, down to ``base``'s (optkit's ``Optimizer``, whose ``**hyper`` carries a
    subclass's own options)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        ps = inspect.signature(init).parameters.values()
        names |= {p.name for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if klass is base or not any(p.kind is p.VAR_KEYWORD for p in ps):
            break
    return frozenset(names - {"self"})


def _phrase(cls: str, name: str, accepted: Collection[str]) -> str:
    hint = HINTS.get(name)
    if hint is None:
        close = difflib.get_close_matches(name, sorted(accepted), n=2, cutoff=0.75)
        return f"`{name}`" + (f" (did you mean {' or '.join(f'`{c}=`' for c in close)}?)" if close else "")
    for targets, note in hint.alternatives:
        if all(t in accepted for t in targets):
            spelled = ", ".join(f"`{t}=`" for t in targets)
            return f"`{name}` ({hint.origin}): did you mean {spelled}?" + (f" ({note})" if note else "")
    return f"`{name}` ({hint.origin}): {hint.otherwise.format(cls=cls)}"


def unknown_arguments_error(cls: str, names: Sequence[str],
                            accepted: Collection[str]) -> UnknownArgumentError:
    """The error for keyword arguments ``names`` that constructor ``cls`` (which takes ``accepted``) does not
    take: each named, with its hint (:data:`HINTS`) or the closest accepted names."""
    return UnknownArgumentError(
        f"{cls}: argument(s) not recognized: " + "; ".join(_phrase(cls, n, accepted) for n in names))


def check_call(cls: str, positional: int, kwargs: Mapping[str, Any], accepted: Collection[str]) -> None:
    """Check a constructor call before Python binds it: ``positional`` arguments (``params`` and, when 2 or
    more, ``learning_rate``) and ``kwargs``, for a constructor that takes the keywords ``accepted``.

    Raises ``TypeError`` when an alias and its name are both given (``lr`` with ``learning_rate``, also
    positional), and :class:`UnknownArgumentError` for every keyword of :data:`HINTS` it does not take. Other
    unknown keywords are left to the constructor (a subclass may consume its own)."""
    for alias, name in ALIASES.items():
        if alias in kwargs and alias in accepted and (
                name in kwargs or (name == "learning_rate" and positional >= 2)):
            raise TypeError(f"{cls}: got both `{alias}` and `{name}` (`{alias}` is an alias of `{name}`); "
                            "give one")
    hinted = [k for k in kwargs if k in HINTS and k not in accepted]
    if hinted:
        raise unknown_arguments_error(cls, hinted, accepted)


def check_nesterov(nesterov: bool, use_nesterov: bool | None) -> bool:
    """The Nesterov switch of a constructor that takes ``nesterov`` and its TF1 alias ``use_nesterov`` (None:
    not given; both given is refused by :func:`check_call`); ``TypeError`` naming the one given unless a
    bool."""
    name, value = ("nesterov", nesterov) if use_nesterov is None else ("use_nesterov", use_nesterov)
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}")
    return value
