"""Train a small FSDP2-sharded model with optkit on CPU, checkpoint with DCP, resume, export the EMA weights.

Run on one machine with two CPU processes::

    torchrun --nproc-per-node 2 examples/distributed_fsdp.py [--steps 20] [--checkpoint-dir DIR]

What it shows:

* FSDP2 ``fully_shard`` on a ``gloo`` process group: every parameter is a ``DTensor`` sharded on dim 0;
* ``optkit.SGD`` (Keras form: momentum, Nesterov, decoupled weight decay, global-norm clipping, EMA) wrapped
  in a ``LossScaleOptimizer`` with dynamic loss scaling, unchanged from single-process code. Optimizer state
  and EMA averages are DTensors sharded like the parameters; the global norm and the non-finite check are
  reduced across the ranks (one all-reduce each);
* a sharded checkpoint with ``torch.distributed.checkpoint`` through ``optkit.distributed``'s
  ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (which also carry the loss-scale state), loaded
  into a fresh model and optimizer that continue exactly where the first left off;
* ``finalize_variable_values()`` swapping the EMA averages in, shard by shard, without gathering the model,
  and a full (gathered) state dict saved by rank 0 for export.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import optkit
from optkit.distributed import get_optimizer_state_dict, set_optimizer_state_dict


def build(mesh, seed: int) -> tuple[nn.Module, optkit.LossScaleOptimizer]:
    """A 3-layer MLP sharded layer by layer with FSDP2, and its optimizer stack."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sgd = optkit.SGD(model.named_parameters(), learning_rate=0.05, momentum=0.9, nesterov=True,
                     weight_decay=1e-4, global_clipnorm=1.0, use_ema=True, ema_momentum=0.9, mesh=mesh)
    sgd.exclude_from_weight_decay(var_names=["bias"])
    opt = optkit.LossScaleOptimizer(sgd, loss_scale=optkit.DynamicLossScale(initial_loss_scale=2.0**10))
    return model, opt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of a fixed synthetic regression task (a different slice per rank)."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(32, 16, generator=g)
    target = torch.stack([x[:, :4].sum(1), x[:, 4:8].prod(1), x[:, 8:].abs().mean(1), x[:, 0] * x[:, 1]], 1)
    return x, target


def train(model: nn.Module, opt, steps: range, rank: int) -> float:
    loss = torch.zeros(())
    for step in steps:
        opt.zero_grad(set_to_none=True)
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.scale_loss(loss).backward()
        opt.step()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps before and after the checkpoint")
    parser.add_argument("--checkpoint-dir", default=None, help="DCP directory (default: a temp dir)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    mesh = init_device_mesh("cpu", (world,))
    ckpt = args.checkpoint_dir
    if ckpt is None:
        holder = [tempfile.mkdtemp(prefix="optkit_dcp_") if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        ckpt = holder[0]

    model, opt = build(mesh, seed=0)
    loss = train(model, opt, range(args.steps), rank)
    w = next(model.parameters())
    if rank == 0:
        print(f"[{world} ranks] after {args.steps} steps: loss {loss:.4f}, iterations {int(opt.iterations)}, "
              f"loss scale {float(opt.loss_scale):g}; {type(w).__name__} {tuple(w.shape)} placements "
              f"{w.placements}, local shard {tuple(w.to_local().shape)}")

    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=ckpt)
    loss_a = train(model, opt, range(args.steps, 2 * args.steps), rank)

    # a fresh model and optimizer (different init) resume from the checkpoint
    model_b, opt_b = build(mesh, seed=1)
    state_b = {"model": get_model_state_dict(model_b), "optim": get_optimizer_state_dict(model_b, opt_b)}
    dcp.load(state_b, checkpoint_id=ckpt)
    set_model_state_dict(model_b, state_b["model"])
    set_optimizer_state_dict(model_b, opt_b, state_b["optim"])
    loss_b = train(model_b, opt_b, range(args.steps, 2 * args.steps), rank)
    same = all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(model.parameters(), model_b.parameters()))
    if rank == 0:
        print(f"continued: loss {loss_a:.6f}; resumed from DCP: loss {loss_b:.6f}; "
              f"identical parameters: {same}")

    # EMA weights for export: swap the averages in (local, no gathering), then gather once for rank 0
    opt_b.optimizer.finalize_variable_values()  # the SGD inside the loss-scale wrapper holds the EMA
    full = get_model_state_dict(model_b, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        path = os.path.join(ckpt, "ema_weights.pt")
        torch.save(full, path)
        print(f"EMA weights ({sum(t.numel() for t in full.values())} values) saved to {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
