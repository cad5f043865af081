"""``optkit lr-plot``: draw learning-rate policies with their parameters, several on one chart.

A specification is a policy name followed by its ``KEY=VALUE`` parameters; a new name starts the next curve::

    optkit lr-plot poly_decay learning_rate=0.1 decay_steps=1000 warmup_steps=100 \\
                   cosine_decay learning_rate=0.1 decay_steps=1000 warmup_steps=100 begin_decay_at=100

Values are read as TOML values (``0.1``, ``1e-3``, ``true``, ``[10, 20]``). Each curve is built as an
:class:`optkit.PolicySchedule`, so unknown or missing parameters are reported before anything is drawn.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError, parse_assignment
from .report import use_agg

__all__ = ["CurveSpec", "parse_specs", "plot_policies"]


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


def _default_steps(specs: Sequence[CurveSpec]) -> int:
    """Long enough to show each curve's decay and warmup: 1.1 × the longest horizon, or 1000."""
    horizon = 0
    for s in specs:
        p = s.params
        ends = [p.get("decay_steps", 0) or 0, p.get("warmup_steps", 0) or 0]
        ends.append((p.get("begin_decay_at", 0) or 0) + (p.get("decay_steps", 0) or 0))
        bounds = p.get("boundaries")
        if isinstance(bounds, list) and bounds:
            ends.append(max(bounds) * (p.get("steps_per_epoch") or 1))
        horizon = max([horizon, *[e for e in ends if isinstance(e, (int, float))]])
    return int(horizon * 1.1) if horizon else 1000


def plot_policies(
    specs: Sequence[CurveSpec], out: str | Path, steps: int | None = None, log_y: bool = False
) -> Path:
    """Evaluate every curve at steps ``0 .. steps-1`` and draw them to ``out`` (PNG)."""
    from optkit.schedules import PolicySchedule

    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 2):
        raise ConfigError(f"lr-plot: --steps must be an integer >= 2, got {steps!r}")
    schedules = []
    for spec in specs:
        try:
            schedules.append(PolicySchedule(spec.policy, **spec.params))
        except (TypeError, ValueError) as err:
            raise ConfigError(f"lr-plot: {spec.label}: {err}") from None
    n = steps or _default_steps(specs)
    xs = list(range(n))
    plt = use_agg()
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    for spec, schedule in zip(specs, schedules):
        ax.plot(xs, [float(schedule(k)) for k in xs], lw=2, label=spec.label)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("applied update (global_step)")
    ax.set_ylabel("learning rate")
    ax.set_title("learning-rate policies")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
