"""Optimizer summaries for :func:`optkit.optimize_loss` (OpenSeq2Seq ``OPTIMIZER_SUMMARIES``,
``open_seq2seq/optimizers/optimizers.py``).

Names and tags (``<name>`` is the parameter name, ``:`` replaced by ``_``):

============================ ==========================================================================
``learning_rate``            scalar ``learning_rate``: lr(k) of the update
``global_gradient_norm``     scalar ``global_gradient_norm`` (before clipping, after the all-reduce) and,
                             with clipping, ``global_clipped_gradient_norm``
``gradients``                histogram ``gradients/<name>`` of the processed gradient, NaN/inf → 0
``gradient_norm``            scalar ``gradient_norm/<name>``
``variables``                histogram ``variables/<name>`` (fp32 masters in ``"mixed"``)
``variable_norm``            scalar ``variable_norm/<name>``
``larc_summaries``           scalars ``larc_clip_on/<name>``, ``larc_grad_update/<name>``,
                             ``larc_final_lr/<name>``
``loss_scale``               scalar ``loss_scale``: the scale the update's gradients were computed with
============================ ==========================================================================

The writer is anything with ``add_scalar(tag, value, global_step)`` and ``add_histogram(tag, values,
global_step)``, e.g. ``torch.utils.tensorboard.SummaryWriter``. :class:`SummaryLogger` decides *on the host*
whether an update is due (every ``every`` update attempts, which are the applied updates unless the dynamic
loss scaler skipped some), so the steps in between do no summary work and no host sync; a due step reads its
values once (one sync) and writes them. The step recorded with each value is the applied-update count.

**Distributed runs** (``collective=True``: DTensor parameters, or a pipeline group) usually hold a writer on
rank 0 only. Whole-tensor values of sharded parameters need collectives, so there the decisions (due steps,
which values to compute) follow the requested summaries, not the writer: every rank computes, only ranks with
a writer read values to the host and write. Per-variable norms are batched (one collective per mesh-dim
group for all variables); histograms of sharded tensors gather each element once (replicas skipped) to the
first rank of the tensor's mesh (rank 0 for a mesh over the whole world), in buckets of at most
:data:`HISTOGRAM_BUCKET_NUMEL` elements (two collectives per bucket and splitting mesh dim): only that rank's
writer can write them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _multi_tensor as mt

__all__ = ["OPTIMIZER_SUMMARIES", "DEFAULT_SUMMARIES", "validate_summaries", "SummaryLogger"]

OPTIMIZER_SUMMARIES = [
    "learning_rate",
    "gradients",
    "gradient_norm",
    "global_gradient_norm",
    "variables",
    "variable_norm",
    "larc_summaries",
    "loss_scale",
]

#: what ``summaries=None`` means (OpenSeq2Seq)
DEFAULT_SUMMARIES = ["learning_rate", "global_gradient_norm", "loss_scale"]

#: histograms of sharded tensors are gathered in buckets of at most this many elements (bounded memory)
HISTOGRAM_BUCKET_NUMEL = 1 << 24


def validate_summaries(summaries: Iterable[str] | None) -> list[str]:
    """The list of summary names to write: ``None`` gives :data:`DEFAULT_SUMMARIES`; every given name must be
    in :data:`OPTIMIZER_SUMMARIES` (``ValueError`` naming the first unknown one)."""
    if summaries is None:
        return list(DEFAULT_SUMMARIES)
    if isinstance(summaries, str):
        raise TypeError(f"`summaries` must be a list of names, not a single string ({summaries!r})")
    out = list(summaries)
    for s in out:
        if s not in OPTIMIZER_SUMMARIES:
            raise ValueError(f"Summaries should be one of {OPTIMIZER_SUMMARIES}, you provided {s!r}.")
    return out


def _tag_name(name: str) -> str:
    return name.replace(":", "_")


class SummaryLogger:
    """Writes the requested optimizer summaries to ``writer`` every ``every`` update attempts.

    ``writer=None`` disables everything (no work at all) unless ``collective`` is set: then every rank
    computes the requested values on due steps (they may need collectives) and only ranks with a writer read
    and write them. :meth:`due` is a host-side counter test; the ``write_*`` methods are called by the train
    op only on due steps and read tensors to the host there.
    """

    def __init__(
        self, writer: Any, summaries: Sequence[str], every: int, *, collective: bool = False
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"`summary_every` must be an int >= 1, got {every!r}")
        if writer is not None:
            for attr in ("add_scalar", "add_histogram"):
                if not callable(getattr(writer, attr, None)):
                    raise TypeError(
                        f"`summary_writer` must have an {attr}() method, got {type(writer).__name__}"
                    )
        self.writer = writer
        self.summaries = frozenset(summaries)
        self.every = every
        self.collective = bool(collective)
        self.attempts = 0  # update attempts seen so far (host counter)

    @property
    def active(self) -> bool:
        """Whether summaries are computed here: a writer is set, or the run is collective (same answer on
        every rank, whichever ranks hold a writer)."""
        return bool(self.summaries) and (self.writer is not None or self.collective)

    def wants(self, name: str) -> bool:
        """Whether summary ``name`` is requested and computed on this rank (see :attr:`active`)."""
        return self.active and name in self.summaries

    def due(self) -> bool:
        """True when the current update attempt should write summaries (host-only test, no sync)."""
        return self.active and self.attempts % self.every == 0

    def advance(self) -> None:
        """Count one update attempt."""
        self.attempts += 1

    # ---- writing (due steps only) -------------------------------------------------------------------------

    def scalar(self, tag: str, value: Tensor | float, step: int) -> None:
        if self.writer is None:
            return
        v = float(value.detach().float().cpu()) if isinstance(value, Tensor) else float(value)
        self.writer.add_scalar(tag, v, step)

    def histogram(self, tag: str, values: Tensor | None, step: int) -> None:
        if self.writer is None or values is None:
            return
        self.writer.add_histogram(tag, values.detach().float().cpu().reshape(-1).numpy(), step)

    def write_per_variable(
        self,
        names: Sequence[str],
        params: Sequence[Tensor],
        grads: Sequence[Tensor | None],
        grad_factor: Tensor,
        step: int,
    ) -> None:
        """``gradients``, ``gradient_norm``, ``variables``, ``variable_norm`` for every pair with a gradient.

        The processed gradient is ``grad_factor · grad`` (unscaling, averaging and clipping folded into one
        0-d factor); its non-finite entries are shown as 0 in the histogram (``mask_nans``). Norms of all
        variables come from one batched pass (whole-tensor norms for sharded ones); histograms of sharded
        tensors are gathered (module doc).
        """
        f = grad_factor.detach().float()
        keep = [i for i, g in enumerate(grads) if g is not None]
        names = [names[i] for i in keep]
        params = [params[i] for i in keep]
        dense = [grads[i].coalesce() if grads[i].is_sparse else grads[i] for i in keep]  # type: ignore
        if "gradient_norm" in self.summaries and dense:
            gnorms = mt.norms(dense)
            for name, n in zip(names, gnorms):
                self.scalar(f"gradient_norm/{_tag_name(name)}", n.float() * f.to(n.device), step)
        if "variable_norm" in self.summaries and params:
            vnorms = mt.norms([p.detach() for p in params])
            for name, n in zip(names, vnorms):
                self.scalar(f"variable_norm/{_tag_name(name)}", n.float(), step)
        if "gradients" in self.summaries:
            hist = [g.to_dense() if g.is_sparse else g for g in dense]
            for name, values in zip(names, _elements(hist)):
                if values is not None:
                    pg = values * f.to(values.device)
                    self.histogram(f"gradients/{_tag_name(name)}",
                                   torch.nan_to_num(pg, nan=0.0, posinf=0.0, neginf=0.0), step)
        if "variables" in self.summaries:
            for name, values in zip(names, _elements([p.detach() for p in params])):
                self.histogram(f"variables/{_tag_name(name)}", values, step)

    def write_larc(
        self, names: Sequence[str], clip_on: Tensor | None, ratios: Tensor, lr: Tensor, step: int
    ) -> None:
        """``larc_clip_on`` (clip mode), ``larc_grad_update`` = r, ``larc_final_lr`` = lr·r per variable."""
        ratios_h = ratios.detach().float().cpu()
        lr_h = float(lr.detach().float().cpu())
        clip_h = None if clip_on is None else clip_on.detach().float().cpu()
        for i, name in enumerate(names):
            tag = _tag_name(name)
            if clip_h is not None:
                self.writer.add_scalar(f"larc_clip_on/{tag}", float(clip_h[i]), step)
            self.writer.add_scalar(f"larc_grad_update/{tag}", float(ratios_h[i]), step)
            self.writer.add_scalar(f"larc_final_lr/{tag}", lr_h * float(ratios_h[i]), step)


# ------------------------------------------------------------------------------------------------------------
# every element of (possibly sharded) tensors, for histograms


def _elements(tensors: Sequence[Tensor]) -> list[Tensor | None]:
    """The elements of each tensor as a flat fp32 tensor, or ``None`` on ranks that do not receive them.

    Plain tensors: their own values, in order. DTensors (``Partial`` ones reduced first): every element
    exactly once, in no particular order, on one rank (the first member of each splitting mesh-dim group,
    first along the replicated dims: rank 0 for a mesh over the whole world); ``None`` elsewhere.
    Replicated copies are skipped. The gathers run in buckets of at most :data:`HISTOGRAM_BUCKET_NUMEL`
    elements; each bucket costs, per splitting mesh-dim group, one ``all_gather`` of per-tensor sizes and
    one ``gather`` of the padded values. Every rank must call this with the same tensors (SPMD training).
    """
    out: list[Tensor | None] = [None] * len(tensors)
    dts = [i for i, t in enumerate(tensors) if mt.is_dtensor(t)]
    for i, t in enumerate(tensors):
        if not mt.is_dtensor(t):
            out[i] = t.detach().float().reshape(-1)
    if not dts:
        return out
    resolved = mt._reduce_partials([tensors[i] for i in dts])
    bucket: list[int] = []
    n = 0
    for j in range(len(dts)):
        bucket.append(j)
        n += resolved[j].numel()
        if n >= HISTOGRAM_BUCKET_NUMEL or j == len(dts) - 1:
            got = _gather_bucket([resolved[k] for k in bucket])
            for k, v in zip(bucket, got):
                out[dts[k]] = v
            bucket, n = [], 0
    return out


def _gather_bucket(ts: list[Tensor]) -> list[Tensor | None]:
    import torch.distributed as dist

    pieces: list[Tensor | None] = []
    plans = []
    holder = []
    for t in ts:
        mesh = t.device_mesh
        coord = mesh.get_coordinate()
        keep = coord is not None
        split = []
        for d, p in enumerate(t.placements):
            if mt._split_dim(p) is not None:
                split.append((mesh, d))
            elif coord is not None and coord[d] != 0:
                keep = False  # a replica: the first member along this dim contributes
        lt = mt.local(t).detach().float().reshape(-1)
        pieces.append(lt if keep else lt[:0])
        plans.append(split)
        holder.append(keep)
    for pg, idx in mt._group_order(plans):
        me = dist.get_rank(pg)
        size = dist.get_world_size(pg)
        device = pieces[idx[0]].device  # type: ignore[union-attr]
        mine = torch.tensor([pieces[i].numel() for i in idx], dtype=torch.int64, device=device)  # type: ignore
        sizes = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(sizes, mine, group=pg)
        per_rank = torch.stack(sizes).cpu()
        longest = int(per_rank.sum(1).max())
        flat = torch.zeros(longest, dtype=torch.float32, device=device)
        own = torch.cat([pieces[i] for i in idx])  # type: ignore[misc]
        flat[: own.numel()] = own
        dst = dist.get_global_rank(pg, 0)
        bufs = [torch.empty_like(flat) for _ in range(size)] if me == 0 else None
        dist.gather(flat, bufs, dst=dst, group=pg)
        for i in idx:
            pieces[i] = pieces[i][:0]  # type: ignore[index]
            holder[i] = holder[i] and me == 0
        if me == 0:
            got: dict[int, list[Tensor]] = {i: [] for i in idx}
            for r in range(size):
                parts = torch.split(bufs[r][: int(per_rank[r].sum())], per_rank[r].tolist())  # type: ignore
                for i, part in zip(idx, parts):
                    got[i].append(part)
            for i in idx:
                pieces[i] = torch.cat(got[i])
    return [v if h else None for v, h in zip(pieces, holder)]
