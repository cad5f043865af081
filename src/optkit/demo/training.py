"""The training run behind ``optkit train``: data, model, :func:`optkit.optimize_loss`, evaluation with the
EMA weights, and everything written to the run folder.

Per step the loop calls the train op once and keeps its :class:`~optkit.train.StepResult` as tensors;
every ``log_every`` steps (and before an evaluation or a checkpoint) the pending rows are read back in one
go, so the host reads device values once per interval rather than once per step. Evaluation copies the fp32
master weights (or their EMA averages) into an fp32 copy of the network.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import save_checkpoint
from .components import build_train_op, model_dtype, planned_steps
from .config import TrainConfig, validate
from .data import BatchOrder, DigitsSplit, load_split
from .model import DigitsCNN, make_model
from .parallel import Processes, start
from .report import History, plot_report, write_metrics

__all__ = ["RunResult", "run_training", "default_run_dir"]


@dataclass
class RunResult:
    """The outcome of :func:`run_training`."""

    run_dir: Path
    test_accuracy: float
    test_accuracy_raw: float
    steps: int
    updates_applied: int
    updates_skipped: int
    train_seconds: float


def default_run_dir(root: str | Path = "runs") -> Path:
    """``runs/<date>-<time>`` (with a suffix if that folder exists)."""
    base = Path(root) / datetime.now().strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _weights(train_op: Any, use_ema: bool) -> list[Tensor]:
    """The fp32 values to evaluate: the masters' EMA averages, or the masters themselves."""
    opt = train_op.optimizer
    if use_ema:
        return [opt.get_slot(m, "average") for m in train_op.masters]
    return list(train_op.masters)


@torch.no_grad()
def evaluate(
    train_op: Any, model: nn.Module, net: DigitsCNN, split: DigitsSplit, use_ema: bool
) -> tuple[Tensor, Tensor]:
    """``(accuracy, mean loss)`` on the test split, as 0-d tensors, with the EMA or the raw weights (frozen
    parameters come from the model itself)."""
    for name, p in model.named_parameters():
        net.get_parameter(name).copy_(p)
    for name, value in zip(train_op.names, _weights(train_op, use_ema)):
        net.get_parameter(name).copy_(value)
    logits = net(split.x_test)
    accuracy = (logits.argmax(1) == split.y_test).float().mean()
    return accuracy, nn.functional.cross_entropy(logits, split.y_test)


def _describe(cfg: TrainConfig, model: nn.Module, split: DigitsSplit, procs: Processes) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    precision = f"{cfg.half_dtype} weights + fp32 masters" if cfg.dtype == "mixed" else cfg.dtype
    parts = [
        f"{cfg.optimizer}" + (" + LARC" if cfg.larc_params is not None else ""),
        cfg.lr_policy,
        precision,
        f"loss scaling {cfg.loss_scaling}",
    ]
    if cfg.ema_momentum is not None:
        parts.append(f"EMA {cfg.ema_momentum:g}")
    if cfg.clip_gradients is not None:
        parts.append(f"clip {cfg.clip_gradients:g}")
    threads = torch.get_num_threads()
    where = f"{threads} thread{'s' * (threads > 1)}"
    if procs.distributed:
        where += f" in each of {procs.world_size} processes"
    return (
        f"optkit train: CNN ({n_params / 1000:.1f}k parameters) on {len(split.y_train)} digits "
        f"({len(split.y_test)} held out), {where}\n"
        f"  {', '.join(parts)}"
    )


class _Recorder:
    """Pending per-step results (tensors) and the host-side history they are flushed into."""

    def __init__(self, history: History, procs: Processes, writer: Any) -> None:
        self.history, self.procs, self.writer = history, procs, writer
        self.pending: list[Tensor] = []
        self.first = 0

    def add(self, step: int, r: Any) -> None:
        if not self.pending:
            self.first = step
        nan = torch.full((), float("nan"))
        norm = nan if r.grad_norm is None else r.grad_norm.float()
        row = [r.loss.float(), r.lr.float(), r.loss_scale.float(), norm, r.applied.float()]
        self.pending.append(torch.stack([v.detach().reshape(()).cpu() for v in row]))

    def flush(self) -> list[float] | None:
        """Move the pending rows to the history (one host read); return the last row."""
        if not self.pending:
            return None
        rows = self.procs.mean_(torch.stack(self.pending)).tolist()
        self.pending = []
        self.history.add_train(rows, self.first)
        if self.writer is not None:
            for i, row in enumerate(rows):
                self.writer.add_scalar("train/loss", row[0], self.first + i)
        return rows[-1]


def run_training(
    cfg: TrainConfig, *, resume: dict[str, Any] | None = None, echo: Callable[[str], None] = print
) -> RunResult:
    """Train as ``cfg`` says (continuing ``resume``, a loaded checkpoint, if given) and write the run folder.

    ``cfg`` is validated first; nothing is written if it is invalid.
    """
    validate(cfg)
    procs = start()
    threads = torch.get_num_threads()
    try:
        return _run(cfg, resume, echo, procs)
    finally:
        torch.set_num_threads(threads)  # the run's thread count is not left behind for the caller
        procs.close()


def _run(
    cfg: TrainConfig, resume: dict[str, Any] | None, echo: Callable[[str], None], procs: Processes
) -> RunResult:
    torch.set_num_threads(cfg.threads)
    say = echo if procs.main else (lambda _msg: None)

    split = load_split(cfg.test_fraction, cfg.seed)
    total_steps, total_updates = planned_steps(cfg)
    order = BatchOrder(len(split.y_train), cfg.batch_size, cfg.seed, procs.rank, procs.world_size)
    model = make_model(cfg.channels, cfg.seed, model_dtype(cfg))
    eval_net = make_model(cfg.channels, cfg.seed, torch.float32)
    use_ema = cfg.ema_momentum is not None

    run_dir = Path(cfg.run_dir) if cfg.run_dir else None
    if resume is not None and run_dir is None:
        run_dir = Path(resume["path"]).parent.parent
    run_dir = procs.broadcast(run_dir if run_dir is not None else default_run_dir())
    writer = None
    if procs.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(run_dir / "tensorboard"))

    train_op = build_train_op(cfg, model, total_updates, distributed=procs.distributed, summary_writer=writer)
    history, step0, spent = History(), 0, 0.0
    if resume is not None:
        model.load_state_dict(resume["model"])
        train_op.load_state_dict(resume["train_op"])
        history = History.from_dict(resume["history"])
        step0, spent = int(resume["step"]), float(resume["train_seconds"])
        say(f"resuming from {resume['path']} at step {step0}")
    say(_describe(cfg, model, split, procs))

    recorder = _Recorder(history, procs, writer)
    bar = None
    if procs.main and cfg.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=step0, unit="step", dynamic_ncols=True, desc="train")
    accuracy = accuracy_raw = float("nan")
    t0 = time.perf_counter()
    for step in range(step0, total_steps):
        idx = order.batch(step)
        result = train_op(split.x_train[idx], split.y_train[idx])
        recorder.add(step, result)
        done = step + 1
        last = done == total_steps
        due_eval = done % cfg.eval_every == 0 or last
        due_ckpt = done % cfg.checkpoint_every == 0 or last
        if done % cfg.log_every == 0 or due_eval or due_ckpt:
            row = recorder.flush()
            if bar is not None and row is not None:
                bar.update(done - bar.n)
                bar.set_postfix_str(
                    f"loss {row[0]:.4f}  lr {row[1]:.3g}  scale {row[2]:g}"
                    + (f"  acc {accuracy:.1%}" if accuracy == accuracy else "")
                )
        if due_eval:
            acc, loss = evaluate(train_op, model, eval_net, split, use_ema)
            acc_raw = evaluate(train_op, model, eval_net, split, False)[0] if use_ema else acc
            accuracy, accuracy_raw, test_loss = acc.item(), acc_raw.item(), loss.item()
            history.add_eval(done, accuracy, accuracy_raw, test_loss)
            if writer is not None:
                writer.add_scalar("test/accuracy", accuracy, done)
                writer.add_scalar("test/accuracy_raw_weights", accuracy_raw, done)
                writer.add_scalar("test/loss", test_loss, done)
        if due_ckpt and procs.main:
            payload = {
                "model": model.state_dict(),
                "train_op": train_op.state_dict(),
                "history": history.to_dict(),
                "config": dataclasses.asdict(cfg),
                "train_seconds": spent + time.perf_counter() - t0,
                "world_size": procs.world_size,
            }
            save_checkpoint(run_dir, done, payload, keep=cfg.keep_checkpoints)
    seconds = spent + time.perf_counter() - t0
    if bar is not None:
        bar.close()
    if not history.eval["step"]:  # nothing was evaluated (a resume at or past the end of the run)
        acc, loss = evaluate(train_op, model, eval_net, split, use_ema)
        accuracy, test_loss = acc.item(), loss.item()
        accuracy_raw = evaluate(train_op, model, eval_net, split, False)[0].item() if use_ema else accuracy
        history.add_eval(total_steps, accuracy, accuracy_raw, test_loss)
    accuracy, accuracy_raw = history.eval["test_accuracy"][-1], history.eval["test_accuracy_raw"][-1]
    applied = sum(history.train["applied"])
    attempts = len(history.train["applied"]) // cfg.iter_size  # accumulation micro-steps are no attempts
    result = RunResult(run_dir, accuracy, accuracy_raw, total_steps, applied, attempts - applied, seconds)
    if procs.main:
        _write_outputs(cfg, result, history, procs, writer)
        counts = (
            f"{result.updates_applied} updates applied, {result.updates_skipped} skipped by the loss scaler"
        )
        say(f"{total_steps} steps ({counts}) in {seconds:.1f} s")
        weights = "EMA weights" if use_ema else "final weights"
        raw = f" ({accuracy_raw:.2%} with the raw weights)" if use_ema else ""
        say(f"test accuracy: {accuracy:.2%} with the {weights}{raw}")
        written = ["metrics.json"] + ["report.png"] * cfg.plot + ["tensorboard/"] * cfg.tensorboard
        say(f"run folder: {run_dir}  ({', '.join([*written, 'checkpoints/'])})")
    return result


def _write_outputs(
    cfg: TrainConfig, result: RunResult, history: History, procs: Processes, writer: Any
) -> None:
    run_dir = result.run_dir
    final = {
        "test_accuracy": result.test_accuracy,
        "test_accuracy_raw_weights": result.test_accuracy_raw,
        "steps": result.steps,
        "updates_applied": result.updates_applied,
        "updates_skipped": result.updates_skipped,
        "train_seconds": round(result.train_seconds, 3),
        "world_size": procs.world_size,
        "threads": torch.get_num_threads(),
    }
    write_metrics(
        run_dir / "metrics.json", {"final": final, "config": dataclasses.asdict(cfg), **history.to_dict()}
    )
    if writer is not None:
        writer.flush()
        writer.close()
    if cfg.plot:
        precision = f"{cfg.half_dtype} + fp32 masters" if cfg.dtype == "mixed" else cfg.dtype
        summary = [
            "run summary",
            "",
            f"test accuracy  {result.test_accuracy:8.2%}  (EMA)"
            if cfg.ema_momentum is not None
            else f"test accuracy  {result.test_accuracy:8.2%}",
            f"raw weights    {result.test_accuracy_raw:8.2%}",
            f"steps          {result.steps:8d}",
            f"updates        {result.updates_applied:8d}  applied",
            f"               {result.updates_skipped:8d}  skipped",
            f"train time     {result.train_seconds:8.1f}  s",
            "",
            f"optimizer      {cfg.optimizer} {_kv(cfg.optimizer_params)}",
            f"LARC           {_kv(cfg.larc_params) if cfg.larc_params is not None else 'off'}",
            f"clipping       {cfg.clip_gradients if cfg.clip_gradients is not None else 'off'}",
            f"lr policy      {cfg.lr_policy}",
            f"               {_kv(cfg.lr_policy_params)}",
            f"precision      {precision}",
            f"loss scaling   {cfg.loss_scaling} {_kv(cfg.loss_scaling_params or {})}",
            f"EMA            {cfg.ema_momentum if cfg.ema_momentum is not None else 'off'}",
            f"batch          {cfg.batch_size} over {procs.world_size} process(es), "
            f"{torch.get_num_threads()} thread(s) each",
        ]
        plot_report(
            history,
            run_dir / "report.png",
            "optkit train: CNN on scikit-learn digits",
            summary,
            clip_norm=cfg.clip_gradients,
            iter_size=cfg.iter_size,
        )


def _number(v: Any) -> str:
    if isinstance(v, float):
        exp = math.log2(v) if v > 0 else 0.5
        return f"2**{int(exp)}" if v >= 1024 and exp == int(exp) else f"{v:g}"
    return str(v)


def _kv(d: dict[str, Any]) -> str:
    return " ".join(f"{k}={_number(v)}" for k, v in d.items())
