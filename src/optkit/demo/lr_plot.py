"""``optkit lr-plot``: draw learning-rate policies with their parameters, several on one chart.

A specification is a policy name followed by its ``KEY=VALUE`` parameters; a new name starts the next curve::

    optkit lr-plot poly_decay learning_rate=0.1 decay_steps=1000 warmup_steps=100 \\
                   cosine_decay learning_rate=0.1 decay_steps=1000 warmup_steps=100 begin_decay_at=100

Values are read as TOML values (``0.1``, ``1e-3``, ``true``, ``[10, 20]``). Each curve is built as an
:class:`optkit.PolicySchedule` and evaluated at every step before anything is drawn, so unknown or missing
parameters and values that overflow are reported with the curve they belong to. The chart's format follows
the extension of ``--out`` (:data:`FORMATS`); a name without one gets ``.png``. The file is written
atomically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, parse_assignment
from .files import write_bytes
from .report import figure_bytes, use_agg

__all__ = ["CurveSpec", "FORMATS", "MAX_STEPS", "output_path", "parse_specs", "plot_policies"]

FORMATS = {"png": "png", "svg": "svg", "pdf": "pdf", "jpg": "jpg", "jpeg": "jpg"}
"""Extensions of ``--out`` -> the format drawn (formats matplotlib writes without extra packages)."""
MAX_STEPS = 1_000_000


@dataclass
class CurveSpec:
    """One curve: a policy name and its parameters."""

    policy: str
    params: dict[str, Any]

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.policy}({args})"


def parse_specs(tokens: Sequence[str]) -> list[CurveSpec]:
    """Split ``name k=v k=v name k=v ...`` into curves; ``ConfigError`` on a parameter before any name."""
    specs: list[CurveSpec] = []
    for token in tokens:
        if "=" in token:
            if not specs:
                raise ConfigError(f"lr-plot: parameter {token!r} comes before any policy name")
            key, value = parse_assignment(token, "lr-plot")
            specs[-1].params[key] = value
        else:
            specs.append(CurveSpec(token, {}))
    if not specs:
        raise ConfigError(
            "lr-plot: give at least one policy, e.g. poly_decay learning_rate=0.1 decay_steps=1000"
        )
    return specs


def _finite_number(value: Any) -> bool:
    import math

    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _default_steps(specs: Sequence[CurveSpec]) -> int:
    """Long enough to show each curve's decay and warmup: 1.1 × the longest horizon (at most
    :data:`MAX_STEPS`), or 1000."""
    horizon = 0.0
    for s in specs:
        p = s.params
        get = {
            k: p.get(k) if _finite_number(p.get(k)) else 0
            for k in ("decay_steps", "warmup_steps", "begin_decay_at", "steps_per_epoch")
        }
        ends = [get["decay_steps"], get["warmup_steps"], get["begin_decay_at"] + get["decay_steps"]]
        bounds = p.get("boundaries")
        if isinstance(bounds, list) and bounds and all(_finite_number(b) for b in bounds):
            ends.append(max(bounds) * (get["steps_per_epoch"] or 1))
        horizon = max(horizon, *ends)
    if not horizon:
        return 1000
    return int(min(max(horizon * 1.1, 2), MAX_STEPS))


def output_path(out: str | Path) -> tuple[Path, str]:
    """``(path, format)`` for ``--out``: the extension picks the format (``.png`` is added to a name without
    one); ``ConfigError`` for another extension or a folder."""
    path = Path(out)
    if str(out).endswith(("/", "\\")) or path.is_dir():
        raise ConfigError(f"--out: {out} is a folder; give a file name such as {path / 'lr_policies.png'}")
    ext = path.suffix.lower().lstrip(".")
    if not ext:
        return path.with_name(path.name + ".png"), "png"
    if ext not in FORMATS:
        raise ConfigError(
            f"--out: unsupported extension .{ext} in {out}; supported: {', '.join('.' + e for e in FORMATS)}"
        )
    return path, FORMATS[ext]


def _curve(spec: CurveSpec, schedule: Any, n: int) -> list[float]:
    """The schedule at steps ``0 .. n-1`` as floats; ``ConfigError`` on a failure or a non-finite value."""
    import math

    ys = []
    for k in range(n):
        try:
            y = float(schedule(k))
        except (ArithmeticError, ValueError, TypeError) as err:
            raise ConfigError(f"lr-plot: {spec.label} fails at step {k}: {err}") from None
        if not math.isfinite(y):
            raise ConfigError(
                f"lr-plot: {spec.label} gives the learning rate {y!r} at step {k} (is a parameter too large?)"
            )
        ys.append(y)
    return ys


def plot_policies(
    specs: Sequence[CurveSpec], out: str | Path, steps: int | None = None, log_y: bool = False
) -> Path:
    """Evaluate every curve at steps ``0 .. steps-1`` and draw them to ``out`` (see :func:`output_path`);
    return the path written."""
    from optkit.schedules import PolicySchedule

    if steps is not None and (
        isinstance(steps, bool) or not isinstance(steps, int) or not 2 <= steps <= MAX_STEPS
    ):
        raise ConfigError(f"lr-plot: --steps must be an integer from 2 to {MAX_STEPS}, got {steps!r}")
    path, fmt = output_path(out)
    schedules = []
    for spec in specs:
        try:
            schedules.append(PolicySchedule(spec.policy, **spec.params))
        except Exception as err:  # noqa: BLE001 - the parameters come from the command line
            raise ConfigError(f"lr-plot: {spec.label}: {err}") from None
    n = min(steps or _default_steps(specs), MAX_STEPS)
    curves = [_curve(spec, schedule, n) for spec, schedule in zip(specs, schedules)]
    plt = use_agg()
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    try:
        for spec, ys in zip(specs, curves):
            ax.plot(range(n), ys, lw=2, label=spec.label)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("applied update (global_step)")
        ax.set_ylabel("learning rate")
        ax.set_title("learning-rate policies")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        data = figure_bytes(fig, fmt)
    finally:
        plt.close(fig)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out: cannot create the folder {path.parent}: {err.strerror or err}") from None
    try:
        write_bytes(path, data)
    except ConfigError as err:
        raise ConfigError(f"--out: {err}") from None
    return path
