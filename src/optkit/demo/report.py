"""What a demo run records and draws: the metric history, ``metrics.json`` and ``report.png``.

``report.png`` has five panels over the training steps: training loss, test accuracy (EMA and raw weights),
learning rate, loss scale (skipped updates marked), and the global gradient norm; a sixth panel sums the run
up. Plotting uses matplotlib's non-interactive Agg backend, so it works without a display. Both files are
written atomically (whole or not at all).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import write_bytes

__all__ = ["TRAIN_KEYS", "EVAL_KEYS", "History", "write_metrics", "plot_report", "use_agg", "figure_bytes"]

TRAIN_KEYS = ("step", "loss", "learning_rate", "loss_scale", "grad_norm", "applied")
EVAL_KEYS = ("step", "test_accuracy", "test_accuracy_raw", "test_loss")


@dataclass
class History:
    """Column-wise metric lists: ``train[key][i]`` per training step, ``eval[key][j]`` per evaluation."""

    train: dict[str, list] = field(default_factory=lambda: {k: [] for k in TRAIN_KEYS})
    eval: dict[str, list] = field(default_factory=lambda: {k: [] for k in EVAL_KEYS})

    def add_train(self, rows: list[list[float]], first_step: int) -> None:
        """Append rows ``[loss, lr, loss_scale, grad_norm, applied]`` for steps ``first_step, +1, ...``."""
        for i, (loss, lr, scale, norm, applied) in enumerate(rows):
            for key, value in zip(TRAIN_KEYS, (first_step + i, loss, lr, scale, norm, bool(applied))):
                self.train[key].append(value)

    def add_eval(self, step: int, accuracy: float, accuracy_raw: float, loss: float) -> None:
        for key, value in zip(EVAL_KEYS, (step, accuracy, accuracy_raw, loss)):
            self.eval[key].append(value)

    def to_dict(self) -> dict[str, Any]:
        return {
            "train": {k: list(v) for k, v in self.train.items()},
            "eval": {k: list(v) for k, v in self.eval.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        h = cls()
        for part in ("train", "eval"):
            for key, values in data[part].items():
                getattr(h, part)[key] = list(values)
        return h


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null (a skipped step's non-finite gradient norm, for instance)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_metrics(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON (non-finite numbers become null), atomically."""
    write_bytes(path, (json.dumps(_clean(payload), indent=1) + "\n").encode())


def use_agg() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (imported lazily: matplotlib is a CLI extra)."""
    from .extras import require

    require(["matplotlib"], "drawing a chart")
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def figure_bytes(fig: Any, fmt: str = "png", dpi: int = 100) -> bytes:
    """``fig`` rendered to ``fmt`` in memory (the file is then written in one atomic step)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi)
    return buf.getvalue()


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average over finite values (NaN-safe)."""
    out, acc, count, buf = [], 0.0, 0, []
    for v in values:
        ok = v is not None and math.isfinite(v)
        buf.append(v if ok else None)
        if ok:
            acc, count = acc + v, count + 1
        if len(buf) > window:
            old = buf.pop(0)
            if old is not None:
                acc, count = acc - old, count - 1
        out.append(acc / count if count else float("nan"))
    return out


def _finite(xs: list, ys: list) -> tuple[list, list]:
    pairs = [(x, y) for x, y in zip(xs, ys) if y is not None and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_report(
    history: History,
    path: str | Path,
    title: str,
    summary: list[str],
    clip_norm: float | None = None,
    iter_size: int = 1,
) -> None:
    """Draw the six-panel report of ``history`` to ``path`` (PNG). ``clip_norm`` marks the clipping threshold;
    with ``iter_size`` micro-batches per update only each window's last step is an update attempt."""
    plt = use_agg()
    t, e = history.train, history.eval
    steps = t["step"]
    fig, axes = plt.subplots(3, 2, figsize=(12, 10.5), constrained_layout=True)
    fig.suptitle(title, fontsize=14, fontweight="bold")
    (ax_loss, ax_acc), (ax_lr, ax_scale), (ax_norm, ax_text) = axes

    xs, ys = _finite(steps, t["loss"])
    ax_loss.plot(xs, ys, color="tab:blue", alpha=0.25, lw=0.8, label="per step")
    window = max(1, len(steps) // 40)
    ax_loss.plot(steps, _smooth(t["loss"], window), color="tab:blue", lw=1.8, label=f"mean of {window} steps")
    ax_loss.set_yscale("log")
    ax_loss.set_title("training loss (cross-entropy)")
    ax_loss.legend(loc="upper right", fontsize=9)

    if e["step"]:
        ax_acc.plot(
            e["step"],
            [100 * a for a in e["test_accuracy"]],
            "o-",
            color="tab:green",
            ms=3.5,
            lw=1.8,
            label="EMA weights",
        )
        ax_acc.plot(
            e["step"],
            [100 * a for a in e["test_accuracy_raw"]],
            "s--",
            color="tab:gray",
            ms=3,
            lw=1.1,
            label="raw weights",
        )
        final = 100 * e["test_accuracy"][-1]
        ax_acc.axhline(95, color="tab:red", lw=0.8, ls=":", label="95%")
        ax_acc.annotate(
            f"{final:.2f}%",
            (e["step"][-1], final),
            textcoords="offset points",
            xytext=(-8, -16),
            ha="right",
            fontsize=10,
            fontweight="bold",
            color="tab:green",
        )
        low = min(100 * a for a in e["test_accuracy"] + e["test_accuracy_raw"])
        ax_acc.set_ylim(max(0.0, min(low, 90.0) - 2), 100.5)
        ax_acc.legend(loc="lower right", fontsize=9)
    ax_acc.set_title("test accuracy (%)")

    ax_lr.plot(steps, t["learning_rate"], color="tab:purple", lw=1.8)
    ax_lr.set_title("learning rate (policy, per applied update)")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))

    ax_scale.step(steps, t["loss_scale"], where="post", color="tab:orange", lw=1.8, label="loss scale")
    skipped = [  # update attempts (the last micro-batch of each window) that the scaler skipped
        (s, v) for s, v, a in zip(steps, t["loss_scale"], t["applied"]) if not a and (s + 1) % iter_size == 0
    ]
    if skipped:
        ax_scale.plot(
            [s for s, _ in skipped],
            [v for _, v in skipped],
            "x",
            color="tab:red",
            ms=7,
            mew=2,
            label=f"skipped update ({len(skipped)})",
        )
    if any(v > 0 for v in t["loss_scale"]):
        ax_scale.set_yscale("log", base=2)
    ax_scale.set_title("loss scale")
    ax_scale.legend(loc="upper right", fontsize=9)

    xs, ys = _finite(steps, t["grad_norm"])
    if ys:
        ax_norm.plot(xs, ys, color="tab:cyan", alpha=0.35, lw=0.8, label="per step")
        ax_norm.plot(xs, _smooth(ys, window), color="tab:blue", lw=1.8, label=f"mean of {window} steps")
        if clip_norm is not None:
            clipped = sum(y > clip_norm for y in ys)
            ax_norm.axhline(
                clip_norm,
                color="tab:red",
                lw=1,
                ls="--",
                label=f"clip_gradients={clip_norm:g} ({clipped} steps clipped)",
            )
        if min(ys) > 0:
            ax_norm.set_yscale("log")
        ax_norm.legend(loc="lower left", fontsize=9)
    ax_norm.set_title("global gradient norm (unscaled, before clipping/LARC)")

    for ax in (ax_loss, ax_acc, ax_lr, ax_scale, ax_norm):
        ax.set_xlabel("training step")
        ax.grid(True, alpha=0.3)
    ax_text.axis("off")
    ax_text.text(
        0.02,
        0.98,
        "\n".join(summary),
        va="top",
        ha="left",
        family="monospace",
        fontsize=9.5,
        transform=ax_text.transAxes,
    )
    try:
        data = figure_bytes(fig)
    finally:
        plt.close(fig)
    write_bytes(path, data)
