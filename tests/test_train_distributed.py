"""optimize_loss(on_horovod=True) on 2 gloo processes (spawned, 127.0.0.1, free port) gives the same
parameters as one process on the combined batch (spec/openseq2seq.md §3.4–3.5): our bucketed all-reduce,
with and without accumulation, and a DistributedDataParallel model (its own reduction, no_sync while
accumulating); ``"mixed"`` with DDP and accumulation (the fp32 window sums reduced once per update); and a
train-op state taken inside an accumulation window resumes exactly on every rank (issue #12 items 3, 5)."""

from __future__ import annotations

import os

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


def _mixed_model():
    return _model().half()


def _chunks(step, rank, world, iter_size):
    """Rank ``rank``'s micro-batches of update ``step`` (``rank`` None: every rank's, in rank order)."""
    X, y = _data()
    per = BATCH // world
    micro = per // iter_size
    ranks = range(world) if rank is None else [rank]
    return [(X[step, r * per + j * micro:r * per + (j + 1) * micro].half(),
             y[step, r * per + j * micro:r * per + (j + 1) * micro].half())
            for r in ranks for j in range(iter_size)]


def _train_mixed(model, rank, world, iter_size=2, use_ddp=False):
    """``dtype="mixed"`` (fp16 model, fp32 masters), dynamic scaling, clipping; STEPS updates of
    ``iter_size`` micro-batches per rank. ``rank`` None: one process running every rank's micro-batches as
    one window (the same micro-batch gradients, summed in fp32)."""
    net = torch.nn.parallel.DistributedDataParallel(model) if use_ddp else model
    n = iter_size * (world if rank is None else 1)
    op = optimize_loss(lambda a, b: ((net(a).float() - b.float()) ** 2).mean(), SGD, {"momentum": 0.9}, 0.1,
                       model=net, dtype="mixed", iter_size=n, clip_gradients=0.4, loss_scaling="dynamic",
                       loss_scaling_params={"initial_loss_scale": 256.0},
                       on_horovod=rank is not None and not use_ddp, summaries=[])
    for s in range(STEPS):
        for a, b in _chunks(s, rank, world, iter_size):
            r = op(a, b)
        assert bool(r.applied)
    return [m.detach().numpy().copy() for m in op.masters], int(op.global_step)


#: the state is taken after call 4: one micro-batch into the second window
RESUME_ITER, RESUME_CALLS, RESUME_AT = 3, 8, 4


def _resume_op(kind, rank, world, seed=1):
    model = _mixed_model() if kind == "ddp_mixed" else _model()
    if seed != 1:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)
    net = torch.nn.parallel.DistributedDataParallel(model) if kind.startswith("ddp") else model
    dtype = "mixed" if kind == "ddp_mixed" else torch.float32
    op = optimize_loss(lambda a, b: ((net(a).float() - b.float()) ** 2).mean(), SGD, {"momentum": 0.9}, 0.1,
                       model=net, dtype=dtype, iter_size=RESUME_ITER, clip_gradients=0.4,
                       loss_scaling="dynamic", loss_scaling_params={"initial_loss_scale": 256.0},
                       on_horovod=kind == "horovod", summaries=[])
    return model, op


def _resume_batch(call, rank, kind):
    X, y = _data()
    g = torch.Generator().manual_seed(77 + 13 * call + rank)
    idx = torch.randint(0, BATCH, (4,), generator=g)
    a, b = X[call % STEPS, idx], y[call % STEPS, idx]
    return (a.half(), b.half()) if kind == "ddp_mixed" else (a, b)


def _snapshot(model, op):
    return {"params": [p.detach().float().numpy().copy() for p in model.parameters()],
            "masters": [m.detach().float().numpy().copy() for m in op.masters], "step": int(op.global_step)}


def _resume(kind, rank, world, path):
    """Uninterrupted run vs a run checkpointed after RESUME_AT calls (inside a window) and resumed by a fresh
    model and train op on every rank from rank 0's file."""
    import torch.distributed as dist

    model, op = _resume_op(kind, rank, world)
    for call in range(RESUME_CALLS):
        op(*_resume_batch(call, rank, kind))
    uninterrupted = _snapshot(model, op)

    model, op = _resume_op(kind, rank, world)
    for call in range(RESUME_AT):
        op(*_resume_batch(call, rank, kind))
    state = op.state_dict()  # every rank: the open window's per-rank sums are gathered to rank 0
    info = {"micro": state["micro"], "world": state.get("accumulators_world_size"),
            "shapes": [None if a is None else tuple(a.shape) for a in state["accumulators"]]}
    if rank == 0:
        torch.save({"model": model.state_dict(), "train_op": state}, path)
    dist.barrier()
    model2, op2 = _resume_op(kind, rank, world, seed=2)
    saved = torch.load(path, weights_only=True)
    model2.load_state_dict(saved["model"])
    op2.load_state_dict(saved["train_op"])
    for call in range(RESUME_AT, RESUME_CALLS):
        op2(*_resume_batch(call, rank, kind))
    return {"uninterrupted": uninterrupted, "resumed": _snapshot(model2, op2), "info": info}


RESUME_KINDS = ["horovod", "ddp", "ddp_mixed"]


def _worker(rank, world_size, workdir):
    out = {}
    out["allreduce"] = _train(_model(), True, 1, world_size, rank)
    out["allreduce_accum"] = _train(_model(), True, 2, world_size, rank)
    out["ddp_accum"] = _train(_model(), True, 2, world_size, rank, use_ddp=True)
    out["ddp_mixed_accum"] = _train_mixed(_mixed_model(), rank, world_size, use_ddp=True)
    out["horovod_mixed_accum"] = _train_mixed(_mixed_model(), rank, world_size)
    for kind in RESUME_KINDS:
        out[f"resume/{kind}"] = _resume(kind, rank, world_size, os.path.join(workdir, f"{kind}.pt"))
    return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("train_distributed"))


@pytest.fixture(scope="module")
def ranks(workdir):
    from distributed._spawn import run_on_ranks

    return run_on_ranks(_worker, workdir, world_size=2, timeout=240.0)


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


@pytest.mark.parametrize("scenario", ["ddp_mixed_accum", "horovod_mixed_accum"])
def test_mixed_accumulation_matches_one_process_and_ranks_agree(ranks, scenario):
    """DDP + "mixed" + iter_size 2: every micro-batch's gradient reaches the update on every rank (the fp32
    window sums are all-reduced), so the ranks stay identical and match one process summing the same
    micro-batch gradients in fp32."""
    ref, ref_steps = _train_mixed(_mixed_model(), None, 2)
    for rank in range(2):
        masters, steps = ranks[rank][scenario]
        assert steps == ref_steps == STEPS
        for got, want in zip(masters, ref):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(ranks[0][scenario][0], ranks[1][scenario][0]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", RESUME_KINDS)
def test_resume_inside_an_accumulation_window_is_exact(ranks, kind):
    for rank in range(2):
        r = ranks[rank][f"resume/{kind}"]
        assert r["info"]["micro"] == RESUME_AT % RESUME_ITER == 1
        for key in ("params", "masters"):
            for got, want in zip(r["resumed"][key], r["uninterrupted"][key]):
                np.testing.assert_array_equal(got, want)
        assert r["resumed"]["step"] == r["uninterrupted"]["step"] == RESUME_CALLS // RESUME_ITER
    info0 = ranks[0][f"resume/{kind}"]["info"]
    assert info0["world"] == 2 and all(s is None or s[0] == 2 for s in info0["shapes"])
    assert ranks[1][f"resume/{kind}"]["info"]["world"] is None  # only rank 0 holds the gathered sums


def test_per_rank_window_state_needs_the_same_ranks(ranks, workdir):
    """A state holding 2 ranks' window sums cannot be loaded by a single process (ValueError, nothing
    changes)."""
    saved = torch.load(os.path.join(workdir, "horovod.pt"), weights_only=True)
    model = _model()
    op = optimize_loss(lambda a, b: ((model(a) - b) ** 2).mean(), SGD, {"momentum": 0.9}, 0.1, model=model,
                       iter_size=RESUME_ITER, clip_gradients=0.4, loss_scaling="dynamic", summaries=[])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="data-parallel"):
        op.load_state_dict(saved["train_op"])
    assert int(op.global_step) == 0 and op.micro_steps == 0
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
