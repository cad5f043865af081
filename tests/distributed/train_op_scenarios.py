"""2-rank scenarios for the train op and the global reductions (issue #12 items 4, 5, 6 and pipeline stages):
summaries with a writer on rank 0 only, the overflow decision on any number of ranks, the reductions across
pipeline stages, and the FSDP2 mid-window state guard. Called as ``fn(rank, world, workdir)`` on every rank
(from ``mesh_scenarios.SCENARIOS``); the references run in the parent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from optkit import _multi_tensor as mt
from optkit.sgd import SGD

from .scenarios import batch, full, loss_fn, make_model, mesh_1d, shard

# ----------------------------------------------------------------------------------------------------------
# summaries with the writer on rank 0 only


class RecordingWriter:
    """``add_scalar``/``add_histogram`` into plain dicts (histogram values sorted: their order is free)."""

    def __init__(self) -> None:
        self.scalars: dict[str, list] = {}
        self.hists: dict[str, list] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.setdefault(tag, []).append((int(step), float(value)))

    def add_histogram(self, tag: str, values: Any, step: int) -> None:
        v = np.sort(np.asarray(values, dtype=np.float64).reshape(-1))
        self.hists.setdefault(tag, []).append((int(step), v))

    def records(self) -> dict:
        return {"scalars": self.scalars, "hists": self.hists}


ALL_SUMMARIES = ["learning_rate", "gradients", "gradient_norm", "global_gradient_norm", "variables",
                 "variable_norm", "loss_scale"]
SUMMARY_CASES = {
    "clip_backoff": {"clip_gradients": 0.3, "loss_scaling": "Backoff", "summaries": ALL_SUMMARIES},
    "larc": {"larc_params": {"larc_eta": 0.02}, "summaries": ["larc_summaries", "gradient_norm"]},
}
SUMMARY_CALLS = 3


def summaries_run(model: nn.Module, case: str, rank: int | None, writer: Any, world: int = 2) -> dict:
    from optkit.train import optimize_loss

    if rank is None:
        def loss(step):
            return sum(loss_fn(model, *batch(step, r)) for r in range(world)) / world
    else:
        def loss(step):
            return loss_fn(model, *batch(step, rank))
    op = optimize_loss(loss, "SGD", {"momentum": 0.9}, 0.1, model=model, summary_writer=writer,
                       summary_every=1, **SUMMARY_CASES[case])
    for step in range(SUMMARY_CALLS):
        op(step)
    return {"params": {n: full(p) for n, p in model.named_parameters()},
            "records": None if writer is None else writer.records()}


def summaries_rank0(rank: int, world: int, workdir: str) -> dict:
    out = {}
    for case in SUMMARY_CASES:
        model = shard(make_model(), mesh_1d())
        out[case] = summaries_run(model, case, rank, RecordingWriter() if rank == 0 else None)
    return out


def summaries_reference(case: str) -> dict:
    return summaries_run(make_model(), case, None, RecordingWriter())


# ----------------------------------------------------------------------------------------------------------
# the overflow decision: non-finite elements only, the same on any number of ranks

BIG = 4e18  # finite; summed over 2 ranks one tensor's fp32 norm would overflow (> 1.8e19)


def overflow_train(rank: int | None, world: int, value: float, nan_rank: int | None = None) -> dict:
    """optimize_loss(Backoff) on a plain replicated parameter whose gradient is ``value`` per element
    (``on_horovod`` over ``world`` ranks when ``rank`` is given); ``nan_rank``: that rank adds a NaN."""
    from optkit.train import optimize_loss

    w = nn.Parameter(torch.ones(8))

    def loss():
        out = (w * value).sum()
        if nan_rank is not None and (rank or 0) == nan_rank:
            out = out + w[0] * float("nan")
        return out

    op = optimize_loss(loss, "SGD", None, 1e-20, var_list=[("w", w)], loss_scaling="Backoff",
                       loss_scaling_params={"scale_min": 1.0, "scale_max": 1.0},
                       on_horovod=rank is not None, summaries=[])
    r = op()
    return {"applied": bool(r.applied), "w": w.detach().numpy().copy(), "loss_scale": float(r.loss_scale)}


def overflow_decision(rank: int, world: int, workdir: str) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, Any] = {}
    big = torch.full((6, 4), 3e19)  # every element finite; the norm's square is not
    t = distribute_tensor(big.clone(), mesh_1d(), [Shard(0)], src_data_rank=None)
    n, found = mt.global_norm_and_found_inf([t, torch.full((3,), 2.0)])
    out["found_big"] = float(found)
    out["any_non_finite_big"] = float(mt.any_non_finite([t]))
    out["norm_big"] = float(n)
    nan = big.clone()
    nan[5, 3] = float("nan")  # in rank 1's shard only
    tn = distribute_tensor(nan, mesh_1d(), [Shard(0)], src_data_rank=None)
    out["found_nan"] = float(mt.global_norm_and_found_inf([tn])[1])
    out["any_non_finite_nan"] = float(mt.any_non_finite([tn]))
    out["train_big"] = overflow_train(rank, world, BIG)
    out["train_nan"] = overflow_train(rank, world, 1.0, nan_rank=1)
    return out


# ----------------------------------------------------------------------------------------------------------
# pipeline stages: rank r is stage r (the pipeline group is the world)


def stage_tensors(stage: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(40 + stage)
    shapes = [(5, 3), (3,)] if stage == 0 else [(4, 4), (2, 3), (7,)]
    return [torch.randn(s, generator=g) for s in shapes]


def stage_batch(step: int, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(900 + 7 * step + stage)
    return torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)


def stage_loss(params: list[torch.Tensor], step: int, stage: int) -> torch.Tensor:
    x, y = stage_batch(step, stage)
    scale = sum((p ** 2).sum() for p in params) * 0.1
    return ((x * scale - y) ** 2).mean() * (1.0 + stage)


PIPE_STEPS = 3


def pipeline_train(stages: list[int], pp: Any, nan_at: tuple[int, int] | None = None) -> dict:
    """optimize_loss (clip 0.5, Backoff) over the parameters of ``stages``; ``pp``: the stage group (the run
    holds one stage) or None (one process holds every stage: the reference). ``nan_at`` = (step, stage)."""
    from optkit.train import optimize_loss

    params = {s: [nn.Parameter(t) for t in stage_tensors(s)] for s in stages}
    named = [(f"s{s}_{i}", p) for s in stages for i, p in enumerate(params[s])]

    def loss(step):
        total = sum(stage_loss(params[s], step, s) for s in stages)
        if nan_at is not None and nan_at[0] == step and nan_at[1] in stages:
            total = total + params[nan_at[1]][0].sum() * float("nan")
        return total

    op = optimize_loss(loss, "SGD", {"momentum": 0.9}, 0.05, var_list=named, clip_gradients=0.5,
                       loss_scaling="Backoff", summaries=[], pipeline_group=pp)
    norms, applied = [], []
    for step in range(PIPE_STEPS):
        r = op(step)
        norms.append(float(r.grad_norm))
        applied.append(bool(r.applied))
    return {"params": {s: [p.detach().numpy().copy() for p in params[s]] for s in stages},
            "norms": norms, "applied": applied}


def pipeline_global_clipnorm(stages: list[int], pp: Any) -> dict:
    """SGD(global_clipnorm) stepped per stage inside ``optkit.distributed.pipeline_group(pp)``."""
    from optkit.distributed import pipeline_group

    params = {s: [nn.Parameter(t) for t in stage_tensors(s)] for s in stages}
    opt = SGD([(f"s{s}_{i}", p) for s in stages for i, p in enumerate(params[s])], learning_rate=0.1,
              momentum=0.9, global_clipnorm=0.2)
    for step in range(PIPE_STEPS):
        opt.zero_grad(set_to_none=True)
        sum(stage_loss(params[s], step, s) for s in stages).backward()
        with pipeline_group(pp):
            opt.step()
    return {s: [p.detach().numpy().copy() for p in params[s]] for s in stages}


def pipeline_stages(rank: int, world: int, workdir: str) -> dict:
    import torch.distributed as dist

    pp = dist.group.WORLD
    ts = stage_tensors(rank)
    out: dict[str, Any] = {
        "global_norm": float(mt.global_norm(ts, pipeline_group=pp)),
        "global_norm_stage_only": float(mt.global_norm(ts)),
        "max_abs": float(mt.max_abs(ts, pipeline_group=pp)),
        "sum_of_squares": float(mt.sum_of_squares(ts, pipeline_group=pp)),
        "empty_stage_norm": float(mt.global_norm(ts if rank == 0 else [], pipeline_group=pp)),
    }
    bad = [t.clone() for t in ts]
    if rank == 1:
        bad[0].view(-1)[0] = float("inf")
    out["any_non_finite"] = float(mt.any_non_finite(bad, pipeline_group=pp))
    out["found_inf"] = float(mt.global_norm_and_found_inf(bad, pipeline_group=pp)[1])
    out["train"] = pipeline_train([rank], pp)
    out["train_nan"] = pipeline_train([rank], pp, nan_at=(1, 1))
    out["global_clipnorm"] = pipeline_global_clipnorm([rank], pp)
    out["module_setting_restored"] = mt.get_pipeline_group() is None
    return out


# ----------------------------------------------------------------------------------------------------------
# FSDP2 keeps an open window's gradients inside FSDP2: state_dict refuses mid-window


def fsdp_midwindow_state(rank: int, world: int, workdir: str) -> dict:
    from optkit.train import optimize_loss

    model = shard(make_model(), mesh_1d())
    op = optimize_loss(lambda s: loss_fn(model, *batch(s, rank)), "SGD", None, 0.1, model=model,
                       iter_size=2, summaries=[])
    op(0)
    try:
        op.state_dict()
        raised = None
    except ValueError as e:
        raised = str(e)
    op(1)
    boundary = op.state_dict()
    return {"raised": raised, "boundary_micro": boundary["micro"],
            "boundary_accumulators": [a is None for a in boundary["accumulators"]]}


def reference_norm_over_stages() -> float:
    ts = stage_tensors(0) + stage_tensors(1)
    return float(np.sqrt(sum(float((t.double() ** 2).sum()) for t in ts)))

