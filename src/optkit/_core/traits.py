"""How the engine runs a rule: one declaration per optimizer class.

An optimizer is its math (the pointwise rule, optionally a fast ``_update`` and a per-tensor ``_prepare``);
everything the engine must know about that math to run it correctly and fast is declared once, as the class
attribute ``traits``::

    class LARS(Optimizer):
        traits = Traits(decoupled_weight_decay=False, blocks="always", sparse=True, prepare_reads_grads=True)

A subclass inherits its parent's declaration; ``dataclasses.replace(Parent.traits, ...)`` changes a field.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["Traits"]


@dataclasses.dataclass(frozen=True)
class Traits:
    """What the engine needs to know about an optimizer's rule.

    Attributes:
        decoupled_weight_decay: the group's ``weight_decay`` is the engine's decoupled decay
            ``w ← w − lr·wd·w`` before the rule (Keras, AdamW); False when the rule uses ``weight_decay``
            itself (coupled L2 as in ``torch.optim.Adam``, LARS's and LAMB's decay inside the ratio).
        blocks: ``"auto"``: the chain decay → rule → EMA runs block by block over cache-sized chunks when it
            has more than one link (a decay, an EMA, multipliers, in-cache copies of the caller's gradients);
            ``"always"``: always, for rules written as a chain of multi-tensor kernels, each one pass over
            memory unless the chunk is in cache.
        sparse: the rule has a form for coalesced sparse gradients (``_sparse_update``, as TF's
            ``SparseApply*`` ops); otherwise sparse gradients are densified.
        prepare_reads_grads: ``_prepare`` computes whole-tensor quantities of the gradients (LARS's and
            LAMB's norms), so per-tensor multipliers must be in the gradients before it runs.
        multipliers_in_kernel: ``_update`` takes per-tensor multipliers (LARC's ratios) as its ``aux`` and
            applies them in its kernel, for groups of large tensors (``FOLD_MIN_NUMEL``).
        writes_grads: ``_prepare``/``_update`` may leave in the gradients anything but ``g`` or ``k·g`` (the
            fused kernels' unscaled write-back); the engine then hands them in-cache copies, so that each
            caller's ``.grad`` is left as ``torch.optim`` leaves it. False for rules that only read them.
        keeps_values_in_grads: the rule keeps values in its gradients from ``_prepare`` to ``_update``
            (LAMB's direction ``u``): the engine gives it one buffer kept with the plan instead of per-chunk
            copies (its ``_prepare`` fills it while copying).
        unsigned_slots: slots that are never negative (second moments, accumulators): under
            ``state_dtype="int8"`` they take the unsigned dynamic map, whose 8 bits all go to magnitudes
            (:mod:`optkit._core.lowp`); every other slot takes the signed one.
        exact_slots: slots never stored below float32 under ``state_dtype`` (FTRL's ``linear``, a sum
            whose rounding error would not decay).
    """

    decoupled_weight_decay: bool = True
    blocks: Literal["auto", "always"] = "auto"
    sparse: bool = False
    prepare_reads_grads: bool = False
    multipliers_in_kernel: bool = False
    writes_grads: bool = True
    keeps_values_in_grads: bool = False
    unsigned_slots: tuple[str, ...] = ()
    exact_slots: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("unsigned_slots", "exact_slots"):
                if not isinstance(value, tuple) or not all(isinstance(s, str) for s in value):
                    raise TypeError(f"Traits: `{field.name}` must be a tuple of slot names, got {value!r}")
            elif field.name == "blocks":
                if value not in ("auto", "always"):
                    raise ValueError(f"Traits: `blocks` must be 'auto' or 'always', got {value!r}")
            elif not isinstance(value, bool):
                raise TypeError(f"Traits: `{field.name}` must be a bool, got {value!r}")
