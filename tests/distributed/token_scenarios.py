"""Token-weighted accumulation across ranks (spawned by ``test_token_weighted.py``): every rank trains on its
own micro-batches of different lengths; the update must use ``Σ loss_sum / Σ num_items`` over the window's
micro-batches of *all* ranks, whatever reduces the gradients (our bucketed all-reduce with ``on_horovod``,
DDP's averaging hook, DDP with fp32 window sums for ``"mixed"``, FSDP2's averaging reduce-scatter)."""

from __future__ import annotations

import torch
from torch import nn

import optkit

WORLD = 2
ITER = 2
UPDATES = 2
#: tokens of micro-batch m of update u on rank r: LENGTHS[r][u * ITER + m]
LENGTHS = [[3, 9, 1, 6], [12, 2, 7, 5]]


def make_model(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def batch(rank: int, k: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * rank + k)
    n = LENGTHS[rank][k]
    return torch.randn(n, 4, generator=g).to(dtype), torch.randn(n, 2, generator=g).to(dtype)


def reference() -> list[torch.Tensor]:
    """One process, float64, SGD on the pooled loss of each update's micro-batches of every rank."""
    model = make_model()
    for u in range(UPDATES):
        window = [batch(r, u * ITER + m) for r in range(WORLD) for m in range(ITER)]
        model.zero_grad()
        total = sum(((model(x) - y) ** 2).sum() for x, y in window)
        (total / sum(x.shape[0] for x, _ in window)).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return [p.detach().clone() for p in model.parameters()]


def _run(rank: int, case: str) -> list:
    dtype = torch.bfloat16 if case == "ddp_mixed" else torch.float64
    model = make_model(dtype)
    kw: dict = {}
    target: nn.Module = model
    if case == "horovod":
        kw["on_horovod"] = True
    elif case.startswith("ddp"):
        target = nn.parallel.DistributedDataParallel(model)
        if case == "ddp_mixed":
            kw["dtype"] = "mixed"
    elif case == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def loss(x, y):
        per = ((target(x.to(dtype)).double() - y) ** 2).sum(dim=1)
        return per.sum(), x.shape[0]

    op = optkit.optimize_loss(loss, "SGD", None, 0.1, model=target, iter_size=ITER, **kw)
    for k in range(UPDATES * ITER):
        op(*batch(rank, k))
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().double().numpy().copy())  # numpy: tensors do not survive the queue
    return out


def token_cases(rank: int, world: int) -> dict:
    out = {}
    for case in ("horovod", "ddp", "ddp_mixed", "fsdp"):
        try:
            out[case] = ("ok", _run(rank, case))
        except Exception as err:  # noqa: BLE001 - reported per case
            import traceback

            out[case] = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    return out
