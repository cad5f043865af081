"""Lean-memory precision: bfloat16 weights without fp32 masters, and slots kept in bfloat16 or 8 bits, for
every optkit optimizer (``precision=`` and ``state_dtype=``; the formats are :mod:`optkit._core.lowp`'s).

A param group that uses either runs the *lean pass* instead of the planned passes, bunch by bunch: tensors
taken in order up to :data:`LEAN_BUNCH_CPU` elements on the CPU (the scratch stays in cache through the
chain; a larger tensor goes in pieces along its 8-bit block rows when the rule reads no whole-tensor quantity
of its gradients) or ``max(block_numel, 2**24)`` elsewhere. Each bunch's weights, slots and gradients are
decoded into flat float32 (float64 for float64 parameters) scratch buffers with multi-tensor copies, and the
optimizer's own rule runs on views of them exactly as on fp32 tensors (``_prepare``, the decoupled decay,
``_update`` with its fused kernel); then each is encoded back. A weight or slot already in the working dtype
and contiguous is updated in place, without a copy. Only the rule's math is needed: the engine brings the
rest (unscale and clip, decay, skip, EMA, sparse rows, checkpoints). A fixed number of kernel launches per
bunch, whatever its number of tensors, except for 8-bit slots (quantised tensor by tensor).

A skipped step (``found_inf``) changes nothing: the rule leaves the scratch values as they were, the split,
stochastic and bfloat16 encodings give back the same bits, and the Kahan and 8-bit encodings (whose
re-encoding of unchanged values is not the identity) are selected against the old ones under the flag.

Stochastic rounding draws its bits from a generator seeded by ``(rounding_seed, step call, group)``; the
count of step calls is in the state dict (``"rounding_step"``), so a resumed run rounds as the uninterrupted
one did.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .. import _multi_tensor as mt
from . import lowp
from .plan import Block, PlanView

__all__ = ["LeanMixin", "PRECISIONS", "STATE_DTYPES", "normalize_precision", "normalize_state_dtype",
           "scales_key", "LEAN_EXTRAS"]

#: master-free weight formats for bfloat16 parameters
PRECISIONS = ("split", "kahan", "stochastic")
#: slot storage options (None: the parameter's dtype)
STATE_DTYPES = ("float32", "bfloat16", "int8")
#: per-parameter entries the weight formats keep besides the slots
LEAN_EXTRAS = {"split": "master_low", "kahan": "kahan_comp"}

_STATE_ALIASES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                  "int8": "int8", "8bit": "int8"}
_DTYPE_OF = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def scales_key(slot: str) -> str:
    """The state key of an 8-bit slot's block scales."""
    return f"{slot}_absmax"


def normalize_precision(value: Any, where: str = "precision") -> str | None:
    """``None`` or one of :data:`PRECISIONS` (``"fp32-masters"`` is the mixed-precision wrapper's and is
    not a per-optimizer choice); ``ValueError`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in PRECISIONS:
        raise ValueError(f"`{where}` must be None or one of {list(PRECISIONS)}, got {value!r}")
    return value


def normalize_state_dtype(value: Any, where: str = "state_dtype") -> str | None:
    """``None`` (the parameter's dtype), ``"float32"``, ``"bfloat16"`` or ``"int8"``, from those names,
    their short forms (``"fp32"``, ``"bf16"``) or ``torch.float32`` / ``torch.bfloat16`` /
    ``torch.int8`` / ``torch.uint8``."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        named = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8",
                 torch.uint8: "int8"}.get(value)
        if named is not None:
            return named
    elif isinstance(value, str) and value in _STATE_ALIASES:
        return _STATE_ALIASES[value]
    raise ValueError(f"`{where}` must be None, 'float32', 'bfloat16' or 'int8' (or torch.float32, "
                     f"torch.bfloat16, torch.int8), got {value!r}")


def _quantizable(p: Tensor) -> bool:
    """Whether a parameter's slots may be 8-bit: enough elements (:data:`~optkit._core.lowp.MIN_QUANT_NUMEL`,
    counted over the whole tensor, so that every shard and the unsharded run decide alike), and, for a
    DTensor, sharded only along dim 0 of a 2-d or larger tensor (the block scales then shard along with the
    rows: FSDP2) or replicated."""
    if p.numel() < lowp.MIN_QUANT_NUMEL:
        return False
    if not mt.is_dtensor(p):
        return True
    from torch.distributed.tensor import Replicate, Shard
    if any(not isinstance(pl, Replicate) for pl in p.placements) and p.dim() < 2:
        return False
    return all(isinstance(pl, Replicate) or (type(pl) is Shard and pl.dim == 0) for pl in p.placements)


def _like_placement(p: Tensor, local: Tensor, global_shape: tuple[int, ...]) -> Tensor:
    """``local`` as a DTensor placed as ``p`` (rows along dim 0), or itself for a plain ``p``."""
    if not mt.is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor
    stride = tuple(int(s) for s in torch.empty(global_shape, device="meta").stride())
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(
        global_shape), stride=stride)


#: elements per bunch of the lean pass on the CPU (:meth:`LeanMixin._lean_budget`)
LEAN_BUNCH_CPU = 1 << 18
#: 8-bit slots of a bunch quantised all at once (:func:`optkit._core.lowp.quantize_flat_`: a fixed number of
#: kernel launches) off the CPU; on the CPU tensor by tensor, whose block reductions are faster there (the
#: same codes either way; tests route the CPU through the flat form with this switch)
FLAT_INT8_ON_CPU = False


def _decode(v: Tensor, scales: Tensor | None, signed: bool, dtype: torch.dtype) -> Tensor:
    """A slot's stored values ``v`` (8-bit codes with ``scales``, or a floating tensor) as a new contiguous
    tensor of ``dtype``."""
    if scales is not None:
        x = lowp.dequantize(v, scales, signed)
        return x if dtype == torch.float32 else x.to(dtype)
    return v.to(dtype, memory_format=torch.contiguous_format, copy=True)


def _encode(x: Tensor, v: Tensor, scales: Tensor | None, signed: bool) -> None:
    """Store the values ``x`` into a slot's storage ``v`` (8-bit with ``scales``, or a floating tensor)."""
    if scales is not None:
        lowp.quantize_(x.float(), v, scales, signed)
    else:
        v.copy_(x.view(v.shape) if x.is_contiguous() else x)


def _pieces(t: Tensor, budget: int) -> list:
    """Ranges that cut ``t`` into pieces of about ``budget`` elements along its 8-bit blocks' rows: row
    ranges along dim 0 (2-d and more), element ranges of whole 256-element blocks (1-d); ``[None]`` (the
    whole tensor) when it fits."""
    n = t.numel()
    if n <= budget or t.dim() == 0:
        return [None]
    if t.dim() == 1:
        step = max(lowp.BLOCK, budget // lowp.BLOCK * lowp.BLOCK)
    else:
        step = max(1, budget // max(1, n // t.shape[0]))
        n = t.shape[0]
    if step >= n:
        return [None]
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def _piece_numel(t: Tensor, rng: tuple[int, int]) -> int:
    return (rng[1] - rng[0]) * (t.numel() // t.shape[0] if t.dim() > 1 else 1)


def _piece(t: Tensor, rng: tuple[int, int] | None) -> Tensor:
    """The piece ``rng`` of ``t`` (a view; :func:`_pieces`)."""
    return t if rng is None else t[rng[0]:rng[1]]


def _scales_piece(scales: Tensor, t: Tensor, rng: tuple[int, int] | None) -> Tensor:
    """The block scales of the piece ``rng`` of ``t`` (rows of them; for 1-d, the blocks of its range)."""
    if rng is None:
        return scales
    if t.dim() == 1:
        return scales[rng[0] // lowp.BLOCK:-(-rng[1] // lowp.BLOCK)]
    return scales[rng[0]:rng[1]]


def _untouched_blocks(t: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Masks of the 8-bit blocks of ``t`` that the coalesced sparse gradient ``g`` touches no element of:
    ``(codes' shape, scales' shape)``. Blocks lie within rows along dim 0 (2-d and more: the rows of ``g``'s
    indices); a 1-d tensor's blocks are 256 consecutive elements."""
    index = g._indices()[0]
    touched = torch.zeros(lowp.scales_shape(tuple(t.shape)), dtype=torch.bool, device=t.device)
    if t.dim() >= 2:
        touched[index] = True
        rows = (t.shape[0],) + (1,) * (t.dim() - 1)
        return (~touched.any(1)).view(rows).expand(t.shape), ~touched
    touched[torch.div(index, lowp.BLOCK, rounding_mode="floor")] = True
    return (~touched).repeat_interleave(lowp.BLOCK)[:t.numel()], ~touched


class _Unit:
    """A tensor, or a piece of one, in a bunch of the lean pass."""

    __slots__ = ("param", "local", "grad", "rng", "name", "use_wd", "mult")

    def __init__(self, param, local, grad, rng, name, use_wd, mult) -> None:
        self.param, self.local, self.grad, self.rng = param, local, grad, rng
        self.name, self.use_wd, self.mult = name, use_wd, mult


class _LeanRun:
    """What every bunch of one group's lean pass shares."""

    __slots__ = ("group", "active", "lr", "k", "found_inf", "keep", "decay", "gens", "gi", "applied", "ema")

    def __init__(self, group, active, lr, k, found_inf, keep, decay, gens, gi, applied=None,
                 ema=True) -> None:
        self.group, self.active, self.lr, self.k = group, active, lr, k
        self.found_inf, self.keep, self.decay, self.gens, self.gi = found_inf, keep, decay, gens, gi
        self.applied, self.ema = applied, ema  # (ema: the step's EMA update, not Keras update_step's)


class _Flat:
    """One flat scratch buffer and a contiguous view of it per shape."""

    __slots__ = ("buf", "views")

    def __init__(self, shapes: list, dtype: torch.dtype, device: torch.device) -> None:
        self.buf = torch.empty(sum(math.prod(sh) for sh in shapes), dtype=dtype, device=device)
        self.views = _views(self.buf, shapes)


def _views(buf: Tensor, like: list) -> list[Tensor]:
    """Consecutive views of the flat ``buf`` shaped as ``like`` (tensors or shapes)."""
    out, o = [], 0
    for t in like:
        sh = t.shape if isinstance(t, Tensor) else t
        m = math.prod(sh)
        out.append(buf[o:o + m].view(sh))
        o += m
    return out


def _cat(ts: list[Tensor]) -> Tensor:
    """The tensors' values in order, flat (one copy)."""
    return torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1).clone()


class LeanMixin:
    """Master-free bfloat16 weights and low-precision slots (module doc). A part of
    :class:`optkit.optimizer.Optimizer`."""

    # (class defaults: an optimizer pickled by an earlier optkit has none of the options)
    precision: str | None = None
    state_dtype: str | None = None
    rounding_seed: int = 0
    _rounding_step: int = 0

    def _lean_setup(self, precision: Any, state_dtype: Any, rounding_seed: Any) -> None:
        """Validate and keep the options (nothing built yet)."""
        self.precision = normalize_precision(precision)
        self.state_dtype = normalize_state_dtype(state_dtype)
        if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int) or rounding_seed < 0:
            raise ValueError(f"`rounding_seed` must be a non-negative int, got {rounding_seed!r}")
        self.rounding_seed = int(rounding_seed)
        self._rounding_step = 0
        self._lean_cache: dict[int, tuple] = {}
        #: (device, the 8-bit pieces' shapes) -> their blocks' lengths on the device (lowp.block_lengths)
        self._lean_lengths: dict[tuple, Tensor] = {}

    @staticmethod
    def _check_lean_params(precision: str | None, groups: list[dict]) -> None:
        """``ValueError`` for a master-free precision over float16 parameters (its formats are bfloat16's:
        float16 trains with fp32 masters and a loss scale, :class:`optkit.MixedPrecisionOptimizerWrapper`)."""
        if precision is None:
            return
        if any(p.dtype == torch.float16 for g in groups for p in g["params"]):
            raise ValueError(f"precision={precision!r} is for bfloat16 parameters; float16 parameters train "
                             "with fp32 master weights (MixedPrecisionOptimizerWrapper)")

    @torch.no_grad()
    def _set_lean(self, precision: Any, state_dtype: Any) -> None:
        """Switch to ``precision`` and ``state_dtype`` (as the constructor takes them), converting the state
        already built: each bfloat16 weight's fp32 master under the old precision (split: the recombined
        halves; Kahan: ``p + comp``; else ``p``) is written in the new format (split: its high half and low
        bits; Kahan: ``rn(master)`` and the residual; stochastic or none: ``rn(master)``), the old format's
        entry dropped and the new one's made; each slot decoded to fp32 (float64 for float64 parameters) and
        stored in its new form (:meth:`_slot_form`). Both options are validated (``ValueError``) before
        anything changes; a float16 parameter with a master-free precision is refused as at construction."""
        new_precision = normalize_precision(precision)
        new_state = normalize_state_dtype(state_dtype)
        self._check_lean_params(new_precision, self.param_groups)
        if (new_precision, new_state) == (self.precision, self.state_dtype):
            return  # (re-encoding 8-bit slots need not give the same codes)
        # everything read under the old forms first
        saved: list[tuple[Tensor, dict, Tensor | None, dict[str, Tensor]]] = []
        for g in self.param_groups:
            active = self._active_slots(g)
            for p in g["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                lp = mt.local(p)
                work = torch.float64 if lp.dtype == torch.float64 else torch.float32
                form = self._weight_form(p)
                master = None
                if form == "split" and "master_low" in st:
                    master = lowp.split_decode(lp, mt.local(st["master_low"]))
                elif form == "kahan" and "kahan_comp" in st:
                    master = lp.float().add_(mt.local(st["kahan_comp"]).float())
                values = {s: self._read_slot(p, s, st, work) for s in active if s in st}
                saved.append((p, st, master, values))
        self.precision, self.state_dtype = new_precision, new_state
        for p, st, master, values in saved:
            lp = mt.local(p)
            for key in LEAN_EXTRAS.values():
                st.pop(key, None)
            for s in values:
                st.pop(s, None)
                st.pop(scales_key(s), None)
            self._lean_init_extras(st, p)  # (zero: the master is the weight itself)
            form = self._weight_form(p)
            if master is not None:
                if form == "split":
                    lowp.split_encode_(master, lp, mt.local(st["master_low"]))
                elif form == "kahan":  # rn(master) and its residual, from the compensation 0
                    lowp.kahan_encode_(lp.float(), master, lp, mt.local(st["kahan_comp"]))
                else:
                    lp.copy_(master.view(lp.shape))
            avg = st.get("average")
            if isinstance(avg, Tensor):  # (float32 for a master-free weight, else like the weight)
                want = torch.float32 if form is not None else p.dtype
                if avg.dtype != want:
                    st["average"] = (self._lean_new_average(p) if form is not None else
                                     torch.empty_like(p, memory_format=torch.preserve_format)).copy_(avg)
            for s, x in values.items():
                sform = self._slot_form(p, s)
                if sform is None:
                    st[s] = self._new_slot(p, s, 0.0)
                    mt.local(st[s]).copy_(x.view(lp.shape))
                else:
                    self._lean_new_slot(st, p, s, sform, 0.0)
                    self._write_slot(p, s, st, x)
        self._lean_cache.clear()
        self._invalidate_plans()

    # ---------------------------------------------------------------------------------------- the forms

    def _weight_form(self, p: Tensor) -> str | None:
        """How parameter ``p`` is updated: one of :data:`PRECISIONS` for a bfloat16 parameter under a
        master-free precision, else None (in its own dtype)."""
        return self.precision if self.precision is not None and p.dtype == torch.bfloat16 else None

    def _slot_form(self, p: Tensor, slot: str) -> str | None:
        """How slot ``slot`` of ``p`` is stored: None (like ``p``, as without ``state_dtype``),
        ``"float32"``, ``"bfloat16"`` or ``"int8"``. 8-bit only for slots the rule does not declare exact
        (``Traits.exact_slots``) of parameters large enough (:func:`_quantizable`); the others keep
        float32 (or their parameter's dtype when that is float32 or float64). A slot the rule declares exact
        is never stored below float32. Without ``state_dtype``: float32 for a parameter the master-free
        ``precision`` updates (the state of the fp32 run it stands for), else like ``p`` (a float32 or float64
        parameter under a ``precision`` steps as without it)."""
        sd = self.state_dtype
        if sd is None:
            if self._weight_form(p) is None:
                return None
            sd = "float32"
        exact = slot in self.traits.exact_slots
        if sd == "int8" and not exact and _quantizable(p):
            return "int8"
        if sd == "int8" or exact:
            return None if p.dtype in (torch.float32, torch.float64) else "float32"
        return None if p.dtype == _DTYPE_OF[sd] else sd

    def _lean_group(self, group: dict) -> bool:
        """Whether ``group`` runs the lean pass (a weight or a slot kept in a lean form); cached while its
        parameter list stays."""
        if self.precision is None and self.state_dtype is None:
            return False
        ps = group["params"]
        hit = self._lean_cache.get(id(group))
        if hit is not None and hit[0] is ps and hit[1] == len(ps):
            return hit[2]
        slots = self._active_slots(group)
        lean = any(self._weight_form(p) is not None or any(self._slot_form(p, s) is not None for s in slots)
                   for p in ps)
        self._lean_cache[id(group)] = (ps, len(ps), lean)
        return lean

    # ---------------------------------------------------------------------------------------- the state

    def _lean_new_slot(self, st: dict, p: Tensor, slot: str, form: str, fill: float) -> None:
        """Make slot ``slot`` of ``p`` in ``form`` holding ``fill`` everywhere, into ``st``."""
        if form != "int8":
            st[slot] = torch.full_like(p, fill, dtype=_DTYPE_OF[form], memory_format=torch.contiguous_format)
            return
        codes = torch.empty_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
        lc = mt.local(codes)
        scales = torch.empty(lowp.scales_shape(lc.shape), dtype=torch.float32, device=lc.device)
        lowp.quantize_(torch.full(lc.shape, fill, dtype=torch.float32, device=lc.device), lc, scales,
                       slot not in self.traits.unsigned_slots)
        st[slot] = codes
        st[scales_key(slot)] = _like_placement(p, scales, lowp.scales_shape(tuple(p.shape)))

    def _lean_init_extras(self, st: dict, p: Tensor) -> None:
        """The weight format's own per-parameter entry, zero (the master starts as the bfloat16 weight): the
        split master's low halves, 16 raw bits per element kept in a bfloat16 tensor (int16 has no
        collective on NCCL or gloo, so an int16 DTensor could not be gathered into a full state dict), or the
        Kahan compensation."""
        form = self._weight_form(p)
        key = LEAN_EXTRAS.get(form or "")
        if key is not None and key not in st:
            st[key] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)

    def _signed(self, slot: str) -> bool:
        return slot not in self.traits.unsigned_slots

    def _read_slot(self, p: Tensor, slot: str, st: dict, dtype: torch.dtype = torch.float32) -> Tensor:
        """Slot ``slot`` of ``p`` as a new contiguous local tensor of ``dtype`` (8-bit slots decoded)."""
        v = mt.local(st[slot])
        scales = mt.local(st[scales_key(slot)]) if v.dtype == torch.uint8 else None
        return _decode(v, scales, self._signed(slot), dtype)

    def _write_slot(self, p: Tensor, slot: str, st: dict, x: Tensor) -> None:
        """Store the values ``x`` (local, ``p``'s local shape) into slot ``slot`` of ``p`` in its form."""
        v = mt.local(st[slot])
        scales = mt.local(st[scales_key(slot)]) if v.dtype == torch.uint8 else None
        _encode(x, v, scales, self._signed(slot))

    def lean_slot_values(self, p: Tensor, slot: str) -> Tensor:
        """Slot ``slot`` of parameter ``p`` as float32 values (8-bit slots decoded; local shard)."""
        return self._read_slot(p, slot, self.state[p])

    # ---------------------------------------------------------------------------------------- the pass

    def _rounding_generator(self, device: torch.device, gi: int) -> torch.Generator | None:
        """This step's generator for group ``gi`` on ``device`` (stochastic rounding; module doc)."""
        if device.type not in ("cpu", "cuda"):
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(hash((self.rounding_seed, self._rounding_step, gi)) & ((1 << 63) - 1))
        return gen

    def _lean_budget(self, device: torch.device) -> int:
        """Elements per bunch of the lean pass: :data:`LEAN_BUNCH_CPU` on the CPU (the scratch copies of a
        bunch stay in cache through the chain), else ``max(block_numel, 2**24)`` (few launches)."""
        return LEAN_BUNCH_CPU if device.type == "cpu" else max(self.block_numel, 1 << 24)

    def _run_lean(self, group: dict, idx: list[int], params: list[Tensor], grads: list[Tensor], lr: Tensor,
                  k: Tensor | None, found_inf: Tensor | None, applied: Tensor | None, mult: Any,
                  unscale: Tensor | None) -> None:
        """Decay → rule → encode, bunch by bunch, over fp32 scratch copies (module doc); then the caller's
        gradients get their 1/S and the EMA its update. A rule that reads no whole-tensor quantity of its
        gradients (no LARS/LAMB norms) also takes large tensors in pieces (rows along dim 0, or ranges of
        256-element blocks for 1-d tensors), so that every bunch stays near the budget."""
        if isinstance(mult, Tensor):  # (RowMultipliers: one factor per parameter)
            mult = list(mult.unbind())
        if isinstance(mult, list) and all(m is None for m in mult):
            mult = None
        names = [group["param_names"][i] for i in idx]
        use_wd = [self._use_weight_decay(p, n) for p, n in zip(params, names)]
        wd = group.get("weight_decay", 0.0) if self.traits.decoupled_weight_decay else 0.0
        decay = None
        if wd and any(use_wd):
            decay = 1.0 - lr * wd if applied is None else 1.0 - lr * wd * applied
        keep = None if found_inf is None else found_inf > 0.5
        active = self._active_slots(group)
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        gens: dict[torch.device, torch.Generator | None] = {}
        splits = not (self.traits.prepare_reads_grads or self.traits.keeps_values_in_grads)
        run = _LeanRun(group, active, lr, k, found_inf, keep, decay, gens, gi, applied)
        sparse = [_Unit(p, mt.local(p), g, None, n, u, None if mult is None else mult[j])
                  for j, (p, g, n, u) in enumerate(zip(params, grads, names, use_wd)) if g.is_sparse]
        if sparse:  # coalesced gradients of a rule with a sparse form (TF's touched rows): one bunch of them
            self._lean_bunch(run, sparse, sparse=True)
        bunch: list[_Unit] = []
        total, dev = 0, None
        for j, p in enumerate(params):
            if grads[j].is_sparse:
                continue
            lp = mt.local(p)
            budget = self._lean_budget(lp.device)
            # (a sharded parameter is never cut, and counts with its whole size: every rank then cuts the
            # same bunches, and the rules' mesh reductions of each bunch match across ranks)
            dt = mt.is_dtensor(p)
            for rng in (_pieces(lp, budget) if splits and not dt else (None,)):
                n = p.numel() if rng is None else _piece_numel(lp, rng)
                kind = (lp.device, lp.dtype == torch.float64)  # (one device and working dtype a bunch)
                if bunch and (total + n > budget or kind != dev):
                    self._lean_bunch(run, bunch)
                    bunch, total = [], 0
                bunch.append(_Unit(p, lp, grads[j], rng, names[j], use_wd[j],
                                   None if mult is None else mult[j]))
                total, dev = total + n, kind
        if bunch:
            self._lean_bunch(run, bunch)
        if unscale is not None:
            dense = [g for g in grads if not g.is_sparse]
            if dense:
                mt.scale_(dense, unscale)
        if self.use_ema:  # (a master-free weight's average was updated in its bunch, from the fp32 value)
            plain = [i for i, p in zip(idx, params) if self._weight_form(p) is None]
            if plain:
                self._ema_group(group, plain, applied)
            self._ema_rest(group, idx, applied)

    def _lean_update_one(self, group: dict, index: int, p: Tensor, g: Tensor, lr: Tensor) -> None:
        """The rule on one parameter of a lean group with gradient ``g`` (Keras ``update_step``: no clip,
        decay, skip or EMA): decoded, the rule, encoded, as one bunch."""
        gi = next(i for i, other in enumerate(self.param_groups) if other is group)
        name = group["param_names"][index]
        run = _LeanRun(group, self._active_slots(group), lr, None, None, None, None, {}, gi, ema=False)
        unit = _Unit(p, mt.local(p), g, None, name, self._use_weight_decay(p, name), None)
        self._lean_bunch(run, [unit], sparse=g.is_sparse and self.traits.sparse)

    def _lean_bunch(self, run: _LeanRun, units: list[_Unit], sparse: bool = False) -> None:
        """One bunch of the lean pass (:meth:`_run_lean`): decode, the rule, encode. Every decoded list is
        views of one flat scratch buffer, so that each format's decoding and encoding is a few multi-tensor
        or whole-buffer kernels for the bunch, whatever its number of tensors (8-bit slots: a few per
        tensor). ``sparse``: whole tensors with coalesced sparse gradients, which the rule's sparse form
        (``_sparse_update``: the touched rows only) applies to the decoded values, as the planned pass
        applies it to the tensors (no decoupled decay there either); 8-bit blocks no row of the gradient
        touches keep their codes and scales (re-encoding unchanged values need not give them back)."""
        dev = units[0].local.device
        work = torch.float64 if units[0].local.dtype == torch.float64 else torch.float32
        n = len(units)
        pvs = [_piece(u.local, u.rng) for u in units]
        states = [self.state[u.param] for u in units]
        # gradients: float copies (the rule may write its gradients), multiplied by a wrapper's factors
        if sparse:
            g32 = [mt.local(u.grad).to(work) for u in units]
            g32 = [g if u.mult is None else g * u.mult.to(device=g.device, dtype=work)
                   for g, u in zip(g32, units)]
        else:
            gsrc = []
            for u in units:
                g = mt.local(u.grad)
                gsrc.append(_piece(g.to_dense() if g.is_sparse else g, u.rng))
            g32 = _Flat([g.shape for g in gsrc], work, dev).views
            torch._foreach_copy_(g32, gsrc)
            sel = [(g32[i], u.mult) for i, u in enumerate(units) if u.mult is not None]
            if sel:
                mt.scale_([t for t, _ in sel], [m.to(device=dev, dtype=work) for _, m in sel])
        # weights: in place (already contiguous in the working dtype), or decoded per format
        ws: list[Tensor | None] = [None] * n
        kinds: dict[str, list[int]] = {}
        for i, (u, pv) in enumerate(zip(units, pvs)):
            form = self._weight_form(u.param)
            if form is None and pv.dtype == work and pv.is_contiguous():
                ws[i] = pv
            else:
                kinds.setdefault(form or "plain", []).append(i)
        flats: dict[str, _Flat] = {}
        for kind, ix in kinds.items():
            f = flats[kind] = _Flat([pvs[i].shape for i in ix], work, dev)
            if kind == "split":
                lows = [self._extra(states[i], "master_low", units[i]) for i in ix]
                lowp.split_decode(_cat([pvs[i] for i in ix]), _cat(lows), out=f.buf)
            else:
                torch._foreach_copy_(f.views, [pvs[i] for i in ix])
            for i, v in zip(ix, f.views):
                ws[i] = v
        # slots: in place (contiguous in the working dtype), copied (another float dtype) or 8-bit decoded
        slots32: dict[str, list[Tensor]] = {}
        slot_writes: list[tuple] = []
        flat8 = not sparse and (FLAT_INT8_ON_CPU or dev.type != "cpu") and work == torch.float32
        for s in run.active:
            stored = [_piece(mt.local(st[s]), u.rng) for st, u in zip(states, units)]
            out: list[Tensor | None] = [v if v.dtype == work and v.is_contiguous() else None for v in stored]
            if flat8:  # the 8-bit slots of the bunch at once (off the CPU: a fixed number of launches)
                q8 = [i for i, v in enumerate(stored) if v.dtype == torch.uint8 and v.numel()]
                if q8:
                    slot_writes.append(self._lean_decode_int8(s, q8, stored, states, units, out, dev))
            ix = [i for i, v in enumerate(out) if v is None]
            if ix:
                f = _Flat([stored[i].shape for i in ix], work, dev)
                floats = [(i, v) for i, v in zip(ix, f.views) if stored[i].dtype != torch.uint8]
                if floats:
                    torch._foreach_copy_([v for _, v in floats], [stored[i] for i, _ in floats])
                    slot_writes.append(("float", [stored[i] for i, _ in floats], [v for _, v in floats]))
                for i, v in zip(ix, f.views):
                    out[i] = v
                    if stored[i].dtype == torch.uint8:
                        u = units[i]
                        scales = _scales_piece(mt.local(states[i][scales_key(s)]), u.local, u.rng)
                        lowp.dequantize(stored[i], scales, self._signed(s), out=v)
                        kept = _untouched_blocks(u.local, g32[i]) if sparse else None
                        slot_writes.append(("int8", (stored[i], scales, self._signed(s), kept), v))
            slots32[s] = out  # type: ignore[assignment]
        names = [u.name for u in units]
        use_wd = [u.use_wd for u in units]
        group, lr, k = run.group, run.lr, run.k
        wlist: list[Tensor] = ws  # type: ignore[assignment]
        if sparse:
            self._sparse_update(group, wlist, g32, slots32, lr, k, run.found_inf)
            self._lean_encode(run, units, pvs, states, kinds, flats, slot_writes)
            self._lean_average(run, units, states, wlist, pvs)
            return
        # the rule's _prepare sees the scratch laid out as the parameters (DTensors over the same local
        # storage), as the planned pass shows it the parameters: its whole-tensor norms (LARS, LAMB) are then
        # reduced across the mesh
        pw, pg = wlist, g32
        dtensors = any(mt.is_dtensor(u.param) for u in units)
        if dtensors:
            pw = [_like_placement(u.param, w, tuple(u.param.shape)) for u, w in zip(units, wlist)]
            pg = [_like_placement(u.param, g, tuple(u.param.shape)) for u, g in zip(units, g32)]
        aux = self._prepare(group, PlanView(names, slots32, use_wd, dtensors), pw, pg, lr, k)
        if run.decay is not None:
            dp = [w for w, d in zip(wlist, use_wd) if d]
            if dp:
                mt.scale_(dp, run.decay)
        # the rule runs as in the planned pass over one block of whole tensors (its kernel forms read the
        # block's hints: one (device, dtype), contiguous chunks, the owners' per-tensor values)
        blk = Block()
        blk.owners, blk.params, blk.slots = list(range(n)), wlist, slots32
        blk.averages = blk.split = None
        blk.key = (dev, work)
        blk.identity, blk.all_wd, blk.static_contiguous = True, all(use_wd), True
        self._block = blk
        try:
            if torch.compiler.is_compiling():  # (torch.compile(opt.step): fused kernels have no fake impl)
                self._pointwise_fallback(group, wlist, g32, [slots32[s] for s in run.active], lr, k,
                                         run.found_inf, aux)
            else:
                self._update(group, wlist, g32, slots32, lr, k, run.found_inf, aux)
        finally:
            self._block = None
        self._lean_encode(run, units, pvs, states, kinds, flats, slot_writes)
        self._lean_average(run, units, states, wlist, pvs)

    def _lean_average(self, run: _LeanRun, units: list[_Unit], states: list[dict], ws: list[Tensor],
                      pvs: list[Tensor]) -> None:
        """The EMA of the bunch's master-free weights into float32 averages, from the fp32 weight each
        format holds: the split master (the scratch), Kahan's compensated sum ``p + c`` (after encoding), the
        stochastic result before rounding (the scratch; the weight is an unbiased rounding of it). A
        bfloat16 average of a bfloat16 weight would stop moving once ``(1 − μ)·(w − avg)`` is below half its
        ulp."""
        if not (self.use_ema and run.ema):
            return
        sel = [i for i, u in enumerate(units) if self._weight_form(u.param) is not None]
        if sel:
            avgs = [_piece(mt.local(states[i]["average"]), units[i].rng) for i in sel]
            vals = [pvs[i].float().add_(self._extra(states[i], "kahan_comp", units[i]).float().view(
                pvs[i].shape)) if self._weight_form(units[i].param) == "kahan" else ws[i] for i in sel]
            mt.lerp_(avgs, vals, self._ema_lerp_weight(run.applied))

    def _lean_new_average(self, p: Tensor) -> Tensor:
        """A master-free weight's EMA average: float32, contiguous, from the weight (its master then)."""
        return torch.empty_like(p, dtype=torch.float32, memory_format=torch.contiguous_format).copy_(
            p.detach())

    @torch.no_grad()
    def _lean_overwrite(self, ps: list[Tensor], weight: Tensor | None) -> None:
        """``ema_overwrite_frequency`` for master-free weights: each master becomes its float32 average,
        written in the weight's format (split: both halves; Kahan: the rounded weight and its residual),
        where ``weight`` (a 0-d 0/1 flag off the host, or None for always) says so."""
        for p in ps:
            st, lp = self.state[p], mt.local(p)
            avg = mt.local(st["average"]).view(lp.shape)
            form = self._weight_form(p)
            keep = None if weight is None else weight.to(lp.device) < 0.5
            targets = [lp] + [mt.local(st[k]) for k in LEAN_EXTRAS.values() if k in st]
            old = None if keep is None else [t.clone() for t in targets]
            if form == "split":
                lowp.split_encode_(avg.contiguous(), lp, mt.local(st["master_low"]))
            else:
                lp.copy_(avg)
                if form == "kahan":
                    comp = mt.local(st["kahan_comp"])
                    comp.copy_((avg - lp.float()).view(comp.shape))
            if old is not None:
                for t, o in zip(targets, old):
                    torch.where(keep, o, t, out=t)

    def _extra(self, st: dict, key: str, u: _Unit) -> Tensor:
        """The weight format's entry ``key`` of a unit's parameter, cut to the unit's piece."""
        return _piece(mt.local(st[key]), u.rng)

    def _lean_encode(self, run, units, pvs, states, kinds, flats, slot_writes) -> None:
        """The encoding half of :meth:`_lean_bunch`: each format's results back into the weights and their
        entries, then the slots. A skipped step leaves every bit: the rule left the scratch as decoded, which
        the split, stochastic, plain and bfloat16 encodings give back exactly; the Kahan and 8-bit ones are
        selected against the old values."""
        keep = run.keep
        for kind, ix in kinds.items():
            f = flats[kind]
            targets = [pvs[i] for i in ix]
            if kind == "split":
                hi, lo = (_Flat([t.shape for t in targets], torch.bfloat16, f.buf.device) for _ in range(2))
                lowp.split_encode_(f.buf, hi.buf, lo.buf)
                torch._foreach_copy_(targets, hi.views)
                torch._foreach_copy_([self._extra(states[i], "master_low", units[i]) for i in ix], lo.views)
            elif kind == "stochastic":
                out = _Flat([t.shape for t in targets], torch.bfloat16, f.buf.device)
                dev = f.buf.device
                if dev not in run.gens:
                    run.gens[dev] = self._rounding_generator(dev, run.gi)
                lowp.stochastic_round_(f.buf, out.buf, run.gens[dev])
                torch._foreach_copy_(targets, out.views)
            elif kind == "kahan":
                comps = [self._extra(states[i], "kahan_comp", units[i]) for i in ix]
                p_flat, c_flat = _cat(targets), _cat(comps)
                old = p_flat.float()
                if keep is None:
                    lowp.kahan_encode_(old, f.buf, p_flat, c_flat)
                else:
                    p_old, c_old = p_flat.clone(), c_flat.clone()
                    lowp.kahan_encode_(old, f.buf, p_flat, c_flat)
                    torch.where(keep, p_old, p_flat, out=p_flat)
                    torch.where(keep, c_old, c_flat, out=c_flat)
                torch._foreach_copy_(targets, _views(p_flat, targets))
                torch._foreach_copy_(comps, _views(c_flat, comps))
            else:  # a plain low-precision (or non-contiguous) weight: rounded to nearest
                torch._foreach_copy_(targets, f.views)
        for kind, target, x in slot_writes:
            if kind == "float":
                torch._foreach_copy_(target, x)
                continue
            if kind == "int8-flat":
                self._lean_encode_int8(target, x, keep)
                continue
            v, scales, signed, kept = target
            if kept is not None:  # (8-bit blocks a sparse gradient left alone, and the skip)
                c_keep, s_keep = kept if keep is None else (kept[0] | keep, kept[1] | keep)
            else:
                c_keep = s_keep = keep
            if c_keep is not None:
                old_c, old_s = v.clone(), scales.clone()
                _encode(x, v, scales, signed)
                torch.where(c_keep, old_c, v, out=v)
                torch.where(s_keep, old_s, scales, out=scales)
            else:
                _encode(x, v, scales, signed)

    def _lean_decode_int8(self, slot, q8, stored, states, units, out, dev) -> tuple:
        """Decode the 8-bit pieces ``q8`` of ``slot`` in one flat pass (:func:`optkit._core.lowp.
        dequantize_flat_`) into views written into ``out``; returns the write-back record for
        :meth:`_lean_encode_int8`."""
        codes = [stored[i] for i in q8]
        scales = [_scales_piece(mt.local(states[i][scales_key(slot)]), units[i].local, units[i].rng)
                  for i in q8]
        shapes = tuple(tuple(c.shape) for c in codes)
        key = (dev, shapes)
        lengths = self._lean_lengths.get(key)
        if lengths is None:
            if len(self._lean_lengths) > 64:  # (bounded: a layout per bunch)
                self._lean_lengths.clear()
            lengths = self._lean_lengths[key] = torch.tensor(lowp.block_lengths(shapes), device=dev)
        f = _Flat(list(shapes), torch.float32, dev)
        c_flat, s_flat = _cat(codes), _cat(scales)
        signed = self._signed(slot)
        lowp.dequantize_flat_(c_flat, s_flat, lengths, signed, f.buf)
        for i, v in zip(q8, f.views):
            out[i] = v
        return "int8-flat", (codes, scales, c_flat, s_flat, lengths, signed), f.buf

    @staticmethod
    def _lean_encode_int8(target: tuple, x: Tensor, keep: Tensor | None) -> None:
        """Quantise a bunch's 8-bit slot pieces at once and copy the codes and scales back (the old ones
        kept under a skip flag: re-encoding unchanged values need not give them back)."""
        codes, scales, c_old, s_old, lengths, signed = target
        c_new, s_new = torch.empty_like(c_old), torch.empty_like(s_old)
        lowp.quantize_flat_(x, c_new, s_new, lengths, signed)
        if keep is not None:
            torch.where(keep, c_old, c_new, out=c_new)
            torch.where(keep, s_old, s_new, out=s_new)
        torch._foreach_copy_(codes, _views(c_new, codes))
        torch._foreach_copy_(scales, _views(s_new, scales))

    # ---------------------------------------------------------------------------------------- checkpoints

    def _lean_keys(self, p: Tensor, group: dict) -> set[str]:
        """The state keys of ``p`` kept in a lean form (slots, their scales, the weight format's entry)."""
        keys = {s for s in self._active_slots(group) if self._slot_form(p, s) is not None}
        keys |= {scales_key(s) for s in self.slot_names}
        keys |= set(LEAN_EXTRAS.values())
        if self._weight_form(p) is not None:
            keys.add("average")
        return keys

    def _hold_lean_entries(self, sd: dict, own: dict) -> list[tuple[Tensor, dict]]:
        """Take out of ``own`` (the state a load hands to torch, which would cast every tensor to its
        parameter's dtype) the entries of lean forms, saved or live: 8-bit codes and scales, the weight
        formats' entries, and any slot this optimizer keeps in a lean form. Returned with their parameters
        for :meth:`_load_lean_entries`."""
        held: list[tuple[Tensor, dict]] = []
        extras = set(LEAN_EXTRAS.values()) | {scales_key(s) for s in self.slot_names}
        for sg, g in zip(sd["param_groups"], self.param_groups):
            for i, p in zip(sg["params"], g["params"]):
                entry = own.get(i)
                if not isinstance(entry, dict):
                    continue
                take = {}
                for key in list(entry):
                    v = entry[key]
                    if key in extras or (key in self.slot_names and isinstance(v, Tensor) and (
                            v.dtype == torch.uint8 or self._slot_form(p, key) is not None)) or (
                            key == "average" and self._weight_form(p) is not None):
                        take[key] = entry.pop(key)
                if take:
                    held.append((p, take))
        return held

    @torch.no_grad()
    def _load_lean_entries(self, held: list[tuple[Tensor, dict]]) -> None:
        """Write held entries (:meth:`_hold_lean_entries`, validated) into the live forms: each slot decoded
        from its saved form (any float dtype, or 8 bits) and stored in this optimizer's form; a weight
        format's entry kept when this optimizer uses that format (else dropped: the master is then the
        bfloat16 weight)."""
        for p, values in held:
            st = self.state[p]
            work = torch.float64 if p.dtype == torch.float64 else torch.float32
            for key, v in values.items():
                if key in self.slot_names:
                    if key not in st:  # (a slot this group does not use)
                        continue
                    if v.dtype == torch.uint8 and mt.local(st[key]).dtype == torch.uint8:  # (as it was)
                        mt.local(st[key]).copy_(mt.local(v))
                        mt.local(st[scales_key(key)]).copy_(mt.local(values[scales_key(key)]))
                        continue
                    if v.dtype == torch.uint8:
                        x = lowp.dequantize(mt.local(v), mt.local(values[scales_key(key)]),
                                            key not in self.traits.unsigned_slots).to(work)
                    else:
                        x = mt.local(v).to(work)
                    self._write_slot(p, key, st, x)
                elif key == "average" and key in st:  # (float32 for a master-free weight)
                    mt.local(st[key]).copy_(mt.local(v))
                elif key == LEAN_EXTRAS["split"] and key in st:  # (raw bits: copied, never converted)
                    mt.local(st[key]).view(torch.int16).copy_(mt.local(v).view(torch.int16))
                elif key in LEAN_EXTRAS.values() and key in st:
                    mt.local(st[key]).copy_(mt.local(v))
