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
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .checkpoint import Checkpoint, save_checkpoint
from .components import build_train_op, model_dtype, planned_steps
from .config import ConfigError, TrainConfig
from .data import BatchOrder, DigitsSplit, load_split
from .extras import require
from .files import check_writable, os_reason
from .model import DigitsCNN, make_model
from .parallel import Processes, env_world, start
from .report import History, plot_report, write_metrics
from .resume import check_continuation, check_progress, check_state_fits, output_dir
from .run_folder import CHECKPOINTS, check_new_run_dir, create_run_dir, default_run_dir
from .validation import validate

__all__ = ["RunResult", "run_training", "preflight", "plan_output", "default_run_dir"]


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
    #: optimizer state per trained parameter, in bytes (:func:`state_bytes_per_parameter`)
    state_bytes_per_param: float = 0.0


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


def state_bytes_per_parameter(train_op: Any) -> tuple[float, float]:
    """``(all, EMA)``: bytes of optimizer state per trained parameter, ``Σ numel·element_size`` over every
    tensor of the optimizer's per-parameter state (slots, 8-bit block scales, the split master's low halves,
    the Kahan compensation, the EMA average) plus the fp32 master copies (``--dtype mixed``), divided by the
    number of trained parameters; and the EMA average's share of it."""
    n = sum(p.numel() for p in train_op.params)
    total = ema = 0
    for st in train_op.optimizer.state.values():
        for key, v in st.items():
            if isinstance(v, Tensor) and v.dim() > 0:
                size = v.numel() * v.element_size()
                total += size
                ema += size if key == "average" else 0
    pairs = zip(train_op.params, train_op.masters)
    total += sum(m.numel() * m.element_size() for p, m in pairs if m is not p)
    return total / max(n, 1), ema / max(n, 1)


def precision_label(cfg: TrainConfig) -> str:
    """How the run keeps its weights and optimizer state, in words."""
    if cfg.precision is not None and cfg.precision != "fp32-masters":
        text = f"bfloat16 weights, {cfg.precision} (no masters)"
    elif cfg.dtype == "mixed":
        text = f"{cfg.half_dtype} weights + fp32 masters"
    else:
        text = cfg.dtype
    return text + (f", state {cfg.state_dtype}" if cfg.state_dtype is not None else "")


def _describe(cfg: TrainConfig, model: nn.Module, split: DigitsSplit, procs: Processes) -> str:
    n_params = sum(p.numel() for p in model.parameters())
    precision = precision_label(cfg)
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


def _required_modules(cfg: TrainConfig) -> list[str]:
    """The optional modules this run needs (the ``cli`` extra)."""
    return (
        ["numpy", "sklearn"]
        + ["tqdm"] * bool(cfg.progress)
        + ["tensorboard"] * bool(cfg.tensorboard)
        + ["matplotlib"] * bool(cfg.plot)
    )


def _main_process() -> bool:
    try:
        return env_world()[0] == 0
    except ValueError as err:
        raise ConfigError(f"torchrun environment: {err}") from None


def plan_output(cfg: TrainConfig, resume: Checkpoint | None = None) -> tuple[Path | None, bool]:
    """``(folder, new)``: where the run will write, checked against the run-folder rules without writing
    anything. ``folder`` is ``None`` for a fresh ``runs/<date>-<time>``; ``new`` says whether the run creates
    it (a new run, or a continuation in a new folder) or continues in the recognised run folder of
    ``resume``. ``ConfigError`` naming the flag when the rules refuse it."""
    if resume is not None:
        return output_dir(resume, cfg)
    if cfg.run_dir is None:
        return None, True
    target = Path(cfg.run_dir).expanduser()
    check_new_run_dir(target)
    return target, True


def preflight(cfg: TrainConfig, resume: Checkpoint | None = None) -> TrainConfig:
    """Everything checked before a run starts, nothing written: the configuration (returned with canonical
    names), the optional modules it needs, a continuation's options and state, and the output folder.
    ``ConfigError`` naming the flag or file on the first failing check."""
    if resume is not None:
        check_continuation(resume, cfg)
    cfg = validate(cfg)
    require(_required_modules(cfg), "optkit train")
    if resume is not None:
        check_progress(resume, cfg)
        probe = make_model(cfg.channels, cfg.seed, model_dtype(cfg))
        check_state_fits(resume, probe, build_train_op(cfg, probe, planned_steps(cfg)[1]))
    if _main_process():  # the other processes of a torchrun job would race the main one creating it
        plan_output(cfg, resume)
    return cfg


def run_training(
    cfg: TrainConfig, *, resume: Checkpoint | None = None, echo: Callable[[str], None] = print
) -> RunResult:
    """Train as ``cfg`` says (continuing ``resume``, a checkpoint from
    :func:`~optkit.demo.checkpoint.load_checkpoint`, if given) and write the run folder.

    Everything is checked first (:func:`preflight`); nothing is written if a check fails. A new run creates
    its folder (new or empty, see :mod:`optkit.demo.run_folder`); a continuation writes into the run folder
    holding its checkpoint, or into a new folder named by ``cfg.run_dir``. Every file is written atomically;
    a failed write raises :class:`~optkit.demo.config.ConfigError` naming the file.
    """
    cfg = preflight(cfg, resume)
    procs = start()
    threads = torch.get_num_threads()
    try:
        return _run(cfg, resume, echo, procs)
    finally:
        torch.set_num_threads(threads)  # the run's thread count is not left behind for the caller
        procs.close()


def _open_run_dir(cfg: TrainConfig, resume: Checkpoint | None, procs: Processes) -> Path:
    """The run folder, created (with its marker) by the main process when the run is new; every process
    gets its path, or the main process's error."""
    outcome: tuple[str, str] = ("", "")
    if procs.main:
        try:
            target, new = plan_output(cfg, resume)
            folder = create_run_dir(target) if new else target
            if not new:  # continuing in place: a read-only run folder is refused before anything runs
                for where in (folder, folder / CHECKPOINTS):
                    if where.is_dir():
                        check_writable(where)
            outcome = (str(folder), "")
        except ConfigError as err:
            outcome = ("", str(err))
    path, error = procs.broadcast(outcome)
    if error:
        raise ConfigError(error)
    return Path(path)


def _summary_writer(run_dir: Path) -> Any:
    """TensorBoard's writer on ``run_dir/tensorboard``, started only once that folder is known to take new
    files: its first write happens on a background thread, whose failure would print a second traceback
    after the one-line error."""
    from torch.utils.tensorboard import SummaryWriter

    folder = run_dir / "tensorboard"
    try:
        folder.mkdir(exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot write {folder}: {os_reason(err)}") from None
    check_writable(folder)
    try:
        return SummaryWriter(str(folder))
    except OSError as err:
        raise ConfigError(f"cannot write {folder}: {os_reason(err)}") from None


def _load_resume(resume: Checkpoint, model: nn.Module, train_op: Any) -> tuple[History, int, float]:
    """Load ``resume`` (already checked by :func:`preflight`) into the run; ``(history, step, seconds)``."""
    try:
        model.load_state_dict(resume.model)
        train_op.load_state_dict(resume.train_op)
    except Exception as err:  # noqa: BLE001 - a foreign state that slipped past the checks
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"--resume: {resume.path} does not fit this run: {first}") from None
    return History.from_dict(resume.history), resume.step, resume.train_seconds


def _run(
    cfg: TrainConfig, resume: Checkpoint | None, echo: Callable[[str], None], procs: Processes
) -> RunResult:
    torch.set_num_threads(cfg.threads)
    say = echo if procs.main else (lambda _msg: None)

    split = load_split(cfg.test_fraction, cfg.seed)
    total_steps, total_updates = planned_steps(cfg)
    order = BatchOrder(len(split.y_train), cfg.batch_size, cfg.seed, procs.rank, procs.world_size)
    model = make_model(cfg.channels, cfg.seed, model_dtype(cfg))
    eval_net = make_model(cfg.channels, cfg.seed, torch.float32)
    use_ema = cfg.ema_momentum is not None

    run_dir = _open_run_dir(cfg, resume, procs)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))  # recorded in metrics.json and the checkpoints
    writer = _summary_writer(run_dir) if procs.main and cfg.tensorboard else None
    try:
        train_op = build_train_op(
            cfg, model, total_updates, distributed=procs.distributed, summary_writer=writer
        )
        history, step0, spent = History(), 0, 0.0
        if resume is not None:
            history, step0, spent = _load_resume(resume, model, train_op)
            moved = "" if resume.run_dir == run_dir else f", continuing in the new run folder {run_dir}"
            say(f"resuming from {resume.path} at step {step0}{moved}")
        say(_describe(cfg, model, split, procs))
        loop = _Loop(cfg, procs, writer, split, order, model, eval_net, train_op, history, run_dir)
        accuracy, accuracy_raw, seconds = loop.run(step0, total_steps, spent)
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    applied = sum(history.train["applied"])
    attempts = len(history.train["applied"]) // cfg.iter_size  # accumulation micro-steps are no attempts
    state_bytes, ema_bytes = state_bytes_per_parameter(train_op)
    result = RunResult(run_dir, accuracy, accuracy_raw, total_steps, applied, attempts - applied, seconds,
                       state_bytes)
    if procs.main:
        _write_outputs(cfg, result, history, procs, writer)
        counts = (
            f"{result.updates_applied} updates applied, {result.updates_skipped} skipped by the loss scaler"
        )
        say(f"{total_steps} steps ({counts}) in {seconds:.1f} s")
        weights = "EMA weights" if use_ema else "final weights"
        raw = f" ({accuracy_raw:.2%} with the raw weights)" if use_ema else ""
        say(f"test accuracy: {accuracy:.2%} with the {weights}{raw}")
        ema_part = f" (EMA average {ema_bytes:g})" if use_ema else ""
        say(f"precision: {precision_label(cfg)}; optimizer state {state_bytes:.4g} B/param{ema_part}")
        written = ["metrics.json"] + ["report.png"] * cfg.plot + ["tensorboard/"] * cfg.tensorboard
        say(f"run folder: {run_dir}  ({', '.join([*written, 'checkpoints/'])})")
    return result


class _Loop:
    """The training loop of one run: steps, periodic evaluation, metrics and checkpoints."""

    def __init__(
        self,
        cfg: TrainConfig,
        procs: Processes,
        writer: Any,
        split: DigitsSplit,
        order: BatchOrder,
        model: nn.Module,
        eval_net: DigitsCNN,
        train_op: Any,
        history: History,
        run_dir: Path,
    ) -> None:
        self.cfg, self.procs, self.writer, self.split, self.order = cfg, procs, writer, split, order
        self.model, self.eval_net, self.train_op, self.history = model, eval_net, train_op, history
        self.run_dir = run_dir
        self.use_ema = cfg.ema_momentum is not None
        self.accuracy = self.accuracy_raw = float("nan")

    def _evaluate(self, step: int) -> None:
        acc, loss = evaluate(self.train_op, self.model, self.eval_net, self.split, self.use_ema)
        raw = acc
        if self.use_ema:
            raw = evaluate(self.train_op, self.model, self.eval_net, self.split, False)[0]
        self.accuracy, self.accuracy_raw, test_loss = acc.item(), raw.item(), loss.item()
        self.history.add_eval(step, self.accuracy, self.accuracy_raw, test_loss)
        if self.writer is not None:
            self.writer.add_scalar("test/accuracy", self.accuracy, step)
            self.writer.add_scalar("test/accuracy_raw_weights", self.accuracy_raw, step)
            self.writer.add_scalar("test/loss", test_loss, step)

    def _checkpoint(self, step: int, seconds: float) -> None:
        """Every rank takes the train op's state (a collective under torchrun: an open accumulation window
        holds every rank's sums); the main process writes the file."""
        train_op_state = self.train_op.state_dict()
        if not self.procs.main:
            return
        payload = {
            "model": self.model.state_dict(),
            "train_op": train_op_state,
            "history": self.history.to_dict(),
            "config": dataclasses.asdict(self.cfg),
            "train_seconds": seconds,
            "world_size": self.procs.world_size,
        }
        save_checkpoint(self.run_dir, step, payload, keep=self.cfg.keep_checkpoints)

    def run(self, step0: int, total_steps: int, spent: float) -> tuple[float, float, float]:
        """Train from ``step0`` to ``total_steps``; ``(accuracy, raw accuracy, training seconds)``."""
        cfg, procs = self.cfg, self.procs
        recorder = _Recorder(self.history, procs, self.writer)
        bar = None
        if procs.main and cfg.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total_steps, initial=step0, unit="step", dynamic_ncols=True, desc="train")
        t0 = time.perf_counter()
        try:
            for step in range(step0, total_steps):
                idx = self.order.batch(step)
                recorder.add(step, self.train_op(self.split.x_train[idx], self.split.y_train[idx]))
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
                            + (f"  acc {self.accuracy:.1%}" if self.accuracy == self.accuracy else "")
                        )
                if due_eval:
                    self._evaluate(done)
                if due_ckpt:
                    self._checkpoint(done, spent + time.perf_counter() - t0)
        finally:
            if bar is not None:
                bar.close()
        seconds = spent + time.perf_counter() - t0
        if not self.history.eval["step"]:  # nothing was evaluated (a resume at or past the end of the run)
            self._evaluate(total_steps)
        return self.history.eval["test_accuracy"][-1], self.history.eval["test_accuracy_raw"][-1], seconds


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
        "precision": cfg.precision,
        "state_dtype": cfg.state_dtype,
        "state_bytes_per_param": round(result.state_bytes_per_param, 4),
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
        precision = precision_label(cfg)
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
            f"state          {result.state_bytes_per_param:8.4g}  B/param",
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
