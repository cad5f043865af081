"""Global-norm clipping of FSDP2-sharded gradients: optkit vs ``torch.nn.utils.clip_grad_norm_`` (2 ranks).

Two gloo ranks on this machine (1 thread each) hold a parameter set sharded by FSDP2 ``fully_shard`` (every
parameter a ``DTensor`` with ``Shard(0)`` on a 1-D mesh) and the same sharded gradients. Each variant clips
them in place to ``max_norm`` (below the norm, so the scale pass runs):

* ``torch clip_grad_norm_`` — ``torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)``: DTensor
  dispatch, per-tensor norms as ``_NormPartial`` DTensors, a stacked total norm, then the foreach scale;
* ``optkit clip_grads_by_global_norm_`` — one grouped ``_foreach_norm`` over the local shards, one batched
  ``all_reduce`` per (mesh, sharded dims) group, one grouped scale.

Per-step time is the slower rank's median (the ranks run in lock step: a barrier, untimed, precedes every
step; gradients are restored, untimed, before it). Collectives are counted for one step with the profiler
(backend ``c10d::`` collective ops, which also sees DTensor's functional collectives). ``max |Δ|`` compares
the clipped gradients of the two variants. Traffic: 12 bytes/param (the norm reads the gradient, the scale
reads and writes it), summed over both ranks, against the machine's floor.

A further table checks parameters on two meshes at once (a 1-D mesh and a 1x2 mesh), where torch's
``clip_grad_norm_`` is known to fail (pytorch/pytorch#180346) and optkit combines both meshes.

The last table (4 gloo ranks, a dp=2 x tp=2 mesh) counts the collectives one step issues for 50 and 500
gradients laid out as FSDP2 x tensor parallel lays them out (``_StridedShard`` + ``Shard`` column-parallel
weights, ``Shard`` x ``Shard`` row-parallel weights, ``Shard`` x ``Replicate`` norms, and plain layers on the
1-D ``dp`` sub-mesh), with the global norm checked against the exact one. Counts only: four ranks on this
machine's cores give no meaningful timing.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import statistics
import time
import traceback
from typing import Any

import torch
import torch.multiprocessing as mp

from bench import _harness as H

WORLD = 2
MAX_NORM = 1.0
STEPS_PER_ROUND = 3 if H.QUICK else 12
VARIANTS = ("torch clip_grad_norm_", "optkit clip_grads_by_global_norm_")


# ------------------------------------------------------------------------------------------------------------
# rank side


def _count_collectives(fn) -> int:
    """Backend collectives (``c10d::`` ops) issued by one call of ``fn``; the profiler's native start/stop
    lines on fd 2 are silenced."""
    import sys

    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    keys = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "reduce_")
    return sum(1 for e in prof.events() if e.name.startswith("c10d::") and any(k in e.name for k in keys))


def _sharded(set_name: str, mesh) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    shapes = H.param_set(set_name)
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList(
        torch.nn.Parameter(t) for t in H.make_tensors(shapes, seed=0, scale=0.1))
    fully_shard(holder, mesh=mesh)
    params = list(holder.parameters())
    grads = H.make_tensors(shapes, seed=1, scale=0.01)
    saved = []
    for p, g in zip(params, grads):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        saved.append(p.grad._local_tensor.clone())
    return params, saved


def _run_set(set_name: str, rank: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import optkit

    mesh = init_device_mesh("cpu", (WORLD,))
    params, saved = _sharded(set_name, mesh)
    local_grads = [p.grad._local_tensor for p in params]

    def restore() -> None:
        torch._foreach_copy_(local_grads, saved)

    steps = {
        VARIANTS[0]: lambda: torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True),
        VARIANTS[1]: lambda: optkit.clip_grads_by_global_norm_(params, MAX_NORM),
    }
    out: dict[str, Any] = {"n_params": sum(p.numel() for p in params), "n_tensors": len(params)}
    clipped = {}
    for name, step in steps.items():
        restore()
        out[f"collectives/{name}"] = _count_collectives(step)
        clipped[name] = [g.clone() for g in local_grads]
    diff = max(float((a - b).abs().max()) for a, b in zip(*clipped.values()) if a.numel())
    out["max_abs_diff"] = diff
    samples: dict[str, list[int]] = {name: [] for name in steps}
    for _ in range(H.WARMUP):
        for step in steps.values():
            restore()
            dist.barrier()
            step()
    for r in range(H.ROUNDS):
        order = list(steps)[r % 2:] + list(steps)[:r % 2]
        for name in order:
            for _ in range(STEPS_PER_ROUND):
                restore()
                dist.barrier()
                t0 = time.perf_counter_ns()
                steps[name]()
                samples[name].append(time.perf_counter_ns() - t0)
    for name, s in samples.items():
        out[f"median_ns/{name}"] = statistics.median(s)
        out[f"steps/{name}"] = len(s)
    return out


def _multi_mesh(rank: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import optkit

    m1 = init_device_mesh("cpu", (WORLD,))
    m2 = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(6, 4, generator=g), torch.randn(4, 6, generator=g)]
    exact = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1).double() for t in full])))
    out = {}

    def params():
        ps = [torch.nn.Parameter(distribute_tensor(full[0].clone(), m1, [Shard(0)])),
              torch.nn.Parameter(distribute_tensor(full[1].clone(), m2, [Replicate(), Shard(1)]))]
        for p in ps:
            p.grad = p.detach().clone()
        return ps

    for name, fn in ((VARIANTS[0], lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM)),
                     (VARIANTS[1], lambda ps: optkit.clip_grads_by_global_norm_(ps, MAX_NORM))):
        try:
            n = fn(params())
            n = n.full_tensor() if hasattr(n, "full_tensor") else n
            out[name] = f"norm {float(n):.6f} (exact {exact:.6f})"
        except Exception as e:  # noqa: BLE001 - the outcome is the result
            out[name] = f"raises {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    return out


def _two_d(rank: int) -> dict[str, Any]:
    """Collectives per step on a 2x2 mesh for 50 and 500 FSDP2 x TP-laid-out gradients (4 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    import optkit
    from optkit.lars import LARS

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layouts = [(mesh, [_StridedShard(0, split_factor=2), Shard(0)]), (mesh, [Shard(0), Shard(1)]),
               (mesh, [Shard(0), Replicate()]), (mesh["dp"], [Shard(0)])]
    out: dict[str, Any] = {}
    for n in (50, 500):
        g = torch.Generator().manual_seed(n)
        fulls = [torch.randn(8, 8, generator=g) * 0.1 for _ in range(n)]
        exact = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1).double() for t in fulls])))
        exact_2d = float(torch.linalg.vector_norm(torch.cat([t.reshape(-1).double()
                                                             for i, t in enumerate(fulls) if i % 4 != 3])))

        def params(fulls=fulls):
            ps = [torch.nn.Parameter(distribute_tensor(f.clone(), *layouts[i % 4], src_data_rank=None))
                  for i, f in enumerate(fulls)]
            for i, (p, f) in enumerate(zip(ps, fulls)):
                p.grad = distribute_tensor(f.clone(), *layouts[i % 4], src_data_rank=None)
            return ps

        def on_2d(ps):
            return [p for i, p in enumerate(ps) if i % 4 != 3]

        cases = {
            "torch clip_grad_norm_": lambda ps: torch.nn.utils.clip_grad_norm_(ps, MAX_NORM, foreach=True),
            "torch clip_grad_norm_ (2-D-mesh tensors only)": lambda ps: torch.nn.utils.clip_grad_norm_(
                on_2d(ps), MAX_NORM, foreach=True),
            "optkit clip_grads_by_global_norm_ (2-D-mesh tensors only)":
                lambda ps: optkit.clip_grads_by_global_norm_(on_2d(ps), MAX_NORM),
            "optkit clip_grads_by_global_norm_": lambda ps: optkit.clip_grads_by_global_norm_(ps, MAX_NORM),
            "optkit SGD(global_clipnorm).step": lambda ps: optkit.SGD(
                [(f"p{i}", p) for i, p in enumerate(ps)], 0.1, momentum=0.9, global_clipnorm=MAX_NORM).step(),
            "optkit LARS.step": lambda ps: LARS([(f"p{i}", p) for i, p in enumerate(ps)], 0.1).step(),
        }
        for name, fn in cases.items():
            try:
                ps = params()
                holder: list[Any] = []
                count = _count_collectives(lambda ps=ps, fn=fn, holder=holder: holder.append(fn(ps)))
                res = holder[0]
                if isinstance(res, torch.Tensor):
                    res = res.full_tensor() if hasattr(res, "full_tensor") else res
                    want = exact_2d if "2-D-mesh" in name else exact
                    out[f"{name}/{n}"] = f"{count} (norm {float(res):.6f}, exact {want:.6f})"
                else:
                    out[f"{name}/{n}"] = str(count)
            except Exception as e:  # noqa: BLE001 - the outcome is the result
                out[f"{name}/{n}"] = f"raises {type(e).__name__}"
    return out


def _rank_main_4(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=120))
        try:
            out = _two_d(rank)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, False, traceback.format_exc()))


def _rank_main(rank: int, port: int, set_names: list[str], results: Any) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=120))
        try:
            out = {s: _run_set(s, rank) for s in set_names}
            out["multi_mesh"] = _multi_mesh(rank)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, False, traceback.format_exc()))


# ------------------------------------------------------------------------------------------------------------
# parent side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(set_names: list[str] | None, timeout: float = 1200.0, world: int = WORLD) -> list[dict]:
    """``world`` spawned gloo ranks running ``_rank_main`` (``set_names``) or ``_rank_main_4`` (None)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, set_names, results), daemon=True)
             if set_names is not None else
             ctx.Process(target=_rank_main_4, args=(r, port, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world:
            try:
                rank, ok, payload = results.get(timeout=max(1.0, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("bench_distributed: a rank died or the run timed out") from None
                continue
            if not ok:
                raise RuntimeError(f"bench_distributed: rank {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return [got[r] for r in range(world)]


def main() -> str:
    set_names = ["resnet50", "many_small"]
    floor = H.floor_gbps()
    H.log(f"[bench_distributed] floor {floor:.1f} GB/s; launching {WORLD} gloo ranks ...")
    ranks = _launch(set_names)
    md = [H.header("Global-norm clip of FSDP2-sharded gradients, 2 gloo ranks (CPU)", floor)]
    for s in set_names:
        per = [r[s] for r in ranks]
        n = H.n_params(H.param_set(s))
        ms = {v: max(r[f"median_ns/{v}"] for r in per) / 1e6 for v in VARIANTS}
        rows = []
        for v in VARIANTS:
            gbps = n * 12 / (ms[v] * 1e6)
            rows.append(H.Row(v, ms[v], ms[v] / ms[VARIANTS[0]], 12, gbps, 100 * gbps / floor, 0.0,
                              per[0][f"steps/{v}"]))
        counts = ", ".join(f"{v}: {per[0][f'collectives/{v}']}" for v in VARIANTS)
        note = (f"{per[0]['n_tensors']} sharded tensors, {n:,} parameters over {WORLD} ranks. "
                f"Collectives per step: {counts}. max |Δ| between the clipped gradients: "
                f"{per[0]['max_abs_diff']:.2e}. faults/step not measured here (0).")
        md.append(H.markdown_table(rows, title=f"{s}: per-step time (slower rank)", note=note))
    mm = ranks[0]["multi_mesh"]
    md.append("### Two meshes in one global norm (1-D mesh + 1x2 mesh)\n")
    md.append("| variant | outcome |\n|---|---|")
    md += [f"| {v} | {mm[v]} |" for v in VARIANTS]
    md.append("")
    H.log("[bench_distributed] launching 4 gloo ranks (2x2 mesh) for collective counts ...")
    two_d = _launch(None, world=4)[0]
    md.append("### Collectives per step on a dp=2 x tp=2 mesh (4 gloo ranks, FSDP2 x TP layouts)\n")
    md.append("| step | 50 tensors | 500 tensors |\n|---|---|---|")
    names = sorted({k.rsplit("/", 1)[0] for k in two_d})
    md += [f"| {name} | {two_d[f'{name}/50']} | {two_d[f'{name}/500']} |" for name in names]
    md.append("")
    return "\n".join(md)


if __name__ == "__main__":
    print(main())
