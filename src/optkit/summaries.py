"""Optimizer summaries for :func:`optkit.optimize_loss` (OpenSeq2Seq ``OPTIMIZER_SUMMARIES``,
``spec/openseq2seq.md`` §3.1–3.3).

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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

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

    ``writer=None`` disables everything (no work at all). :meth:`due` is a host-side counter test; the
    ``write_*`` methods are called by the train op only on due steps and read tensors to the host there.
    """

    def __init__(self, writer: Any, summaries: Sequence[str], every: int) -> None:
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
        self.attempts = 0  # update attempts seen so far (host counter)

    def wants(self, name: str) -> bool:
        """Whether summary ``name`` is requested (and a writer is set)."""
        return self.writer is not None and name in self.summaries

    def due(self) -> bool:
        """True when the current update attempt should write summaries (host-only test, no sync)."""
        return self.writer is not None and self.attempts % self.every == 0

    def advance(self) -> None:
        """Count one update attempt."""
        self.attempts += 1

    # ---- writing (due steps only) -------------------------------------------------------------------------

    def scalar(self, tag: str, value: Tensor | float, step: int) -> None:
        v = float(value.detach().float().cpu()) if isinstance(value, Tensor) else float(value)
        self.writer.add_scalar(tag, v, step)

    def histogram(self, tag: str, values: Tensor, step: int) -> None:
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
        0-d factor); its non-finite entries are shown as 0 in the histogram (``mask_nans``).
        """
        f = grad_factor.detach().float()
        for name, p, g in zip(names, params, grads):
            if g is None:
                continue
            tag = _tag_name(name)
            dense = g.to_dense() if g.is_sparse else g
            if "gradients" in self.summaries or "gradient_norm" in self.summaries:
                pg = dense.float() * f.to(dense.device)
                if "gradients" in self.summaries:
                    masked = torch.nan_to_num(pg, nan=0.0, posinf=0.0, neginf=0.0)
                    self.histogram(f"gradients/{tag}", masked, step)
                if "gradient_norm" in self.summaries:
                    self.scalar(f"gradient_norm/{tag}", torch.linalg.vector_norm(pg), step)
            if "variables" in self.summaries:
                self.histogram(f"variables/{tag}", p, step)
            if "variable_norm" in self.summaries:
                self.scalar(f"variable_norm/{tag}", torch.linalg.vector_norm(p.detach().float()), step)

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
