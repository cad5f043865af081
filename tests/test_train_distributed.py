"""optimize_loss(on_horovod=True) on 2 gloo processes (spawned, 127.0.0.1, free port) gives the same
parameters as one process on the combined batch (spec/openseq2seq.md §3.4–3.5): our bucketed all-reduce,
with and without accumulation, and a DistributedDataParallel model (its own reduction, no_sync while
accumulating)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optkit.sgd import SGD
from optkit.train import optimize_loss

BATCH, STEPS = 16, 3


def _data():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(STEPS, BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS, BATCH, 1, generator=g, dtype=torch.float64)
    return X, y


def _model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _train(model, on_horovod, iter_size, shards, rank, use_ddp=False):
    """STEPS updates; each update sees this rank's shard of the batch, split into iter_size micro-batches."""
    X, y = _data()
    net = model
    if use_ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
    op = optimize_loss(lambda a, b: ((net(a) - b) ** 2).mean(), SGD, {"momentum": 0.9, "nesterov": True},
                       0.1, model=net, on_horovod=on_horovod, iter_size=iter_size, clip_gradients=0.4,
                       loss_scaling="dynamic", summaries=[])
    per = BATCH // shards
    micro = per // iter_size
    for s in range(STEPS):
        xs, ys = X[s, rank * per:(rank + 1) * per], y[s, rank * per:(rank + 1) * per]
        for j in range(iter_size):
            r = op(xs[j * micro:(j + 1) * micro], ys[j * micro:(j + 1) * micro])
        assert bool(r.applied)
    return [p.detach().numpy().copy() for p in model.parameters()], int(op.global_step)


def _worker(rank, world_size):
    out = {}
    out["allreduce"] = _train(_model(), True, 1, world_size, rank)
    out["allreduce_accum"] = _train(_model(), True, 2, world_size, rank)
    out["ddp_accum"] = _train(_model(), True, 2, world_size, rank, use_ddp=True)
    return out


@pytest.fixture(scope="module")
def ranks():
    from distributed._spawn import run_on_ranks

    return run_on_ranks(_worker, world_size=2, timeout=180.0)


@pytest.mark.parametrize("scenario", ["allreduce", "allreduce_accum", "ddp_accum"])
def test_two_ranks_equal_one_process_on_combined_batch(ranks, scenario):
    ref, ref_steps = _train(_model(), False, 1, 1, 0)
    for rank in range(2):
        params, steps = ranks[rank][scenario]
        assert steps == ref_steps == STEPS
        for got, want in zip(params, ref):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    for a, b in zip(ranks[0][scenario][0], ranks[1][scenario][0]):
        np.testing.assert_array_equal(a, b)
