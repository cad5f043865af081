"""The ``optkit`` command.

* ``optkit train``: the embedded demo (a CNN on scikit-learn's digits trained with
  :func:`optkit.optimize_loss`) or any variation of it through flags and ``--config FILE.toml``;
  ``--resume RUN`` continues a run.
* ``optkit lr-plot POLICY KEY=VALUE ... [POLICY KEY=VALUE ...]``: learning-rate policies on one chart.
* ``optkit bench [ARGS]``: the benchmark suite of a source checkout (``bench/run_all.py``).

Every ``train`` option is a field of :class:`optkit.demo.config.TrainConfig`; the flags are generated from it,
so the TOML keys, the flags and ``--help`` always agree. Options are validated before any work starts; a bad
value, a refused file or folder, a missing optional package or a failed write ends the command with exit
status 2 and a one-line message naming the flag or the file (several problems: one line each).

Building the parser imports neither torch nor the library's modules (only the option table of
:mod:`optkit.demo.config`), so ``--help`` and ``--version`` cost what importing the ``optkit`` package costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from optkit import __version__
from optkit.demo.config import (
    DICT_FIELDS,
    FIELDS,
    ConfigError,
    TrainConfig,
    load_toml,
    merge,
    parse_assignment,
    parse_value,
)
from optkit.demo.extras import PACKAGES, extra_for, require

__all__ = ["main", "build_parser", "config_from_args", "to_toml"]

_GROUPS = {
    "optimize_loss": "optimize_loss options (what the train op does)",
    "training": "data, model and run length",
    "outputs": "outputs (written to the run folder)",
}
_RAW_STRINGS = ("optimizer", "lr_policy", "dtype", "half_dtype", "run_dir")

_TRAIN_DESCRIPTION = """\
Train a small CNN on scikit-learn's bundled handwritten digits with optkit.optimize_loss (by default:
LARS, warmup + decay, float16 weights with fp32 masters and Backoff loss scaling, EMA weights, gradient
clipping). Writes TensorBoard events, metrics.json, report.png and checkpoints to a run folder.
"""

_TRAIN_EPILOG = """\
TOML config files use the option names as keys, with tables for the KEY=VALUE options:

    optimizer = "LARS"
    epochs = 10
    [optimizer_params]
    momentum = 0.9
    [lr_policy_params]
    learning_rate = 2.0
    warmup_steps = 50

Precedence: defaults < --config file < flags. KEY=VALUE flags update single keys; 'none' clears the table
first (--larc-param none turns LARC off; --optimizer-param none --optimizer-param momentum=0.9 replaces it).
Another --optimizer or --lr-policy without its parameters starts them afresh (the policy keeps learning_rate).
`optkit train --print-config` prints the effective configuration as TOML.
Under torchrun the same command trains data-parallel (gloo):  torchrun --nproc-per-node 2 -m optkit.cli train
"""


def _flag(name: str) -> str:
    return FIELDS[name].metadata.get("flag", f"--{name.replace('_', '-')}")


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items()) or "{}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "none" if value is None else str(value)


def _metavar(f: dataclasses.Field) -> str:
    """``N`` for integers, ``X`` for numbers, ``NAME`` for strings, ``|none`` when the option is optional."""
    if "choices" in f.metadata:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    if f.name in ("run_dir", "loss_scaling"):
        return "PATH" if f.name == "run_dir" else "X|NAME"
    kind = str(f.type)
    base = "N" if kind.startswith("int") else "X" if "float" in kind else "NAME"
    return base + ("|none" if f.metadata.get("nullable") else "")


def _add_train_flags(parser: argparse.ArgumentParser) -> None:
    defaults = TrainConfig()
    groups = {key: parser.add_argument_group(title) for key, title in _GROUPS.items()}
    for name, f in FIELDS.items():
        meta = f.metadata
        group = groups[meta["group"]]
        default = getattr(defaults, name)
        text = meta["help"] if name == "run_dir" else f"{meta['help']} (default: {_show(default)})"
        if isinstance(default, bool) and name.startswith("no_"):
            # argparse's --x/--no-x pair would read --no-decay-1d as "decay_1d off", i.e. this option false
            flag = f"--{name.replace('_', '-')}"
            group.add_argument(flag, dest=name, action="store_const", const=True, default=argparse.SUPPRESS,
                               help=text)
            group.add_argument("--" + flag[len("--no-"):], dest=name, action="store_const", const=False,
                               default=argparse.SUPPRESS, help=f"the opposite of {flag}")
        elif isinstance(default, bool):
            group.add_argument(
                f"--{name.replace('_', '-')}",
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text,
            )
        elif name in DICT_FIELDS:
            group.add_argument(
                _flag(name),
                dest=name,
                action="append",
                default=argparse.SUPPRESS,
                metavar=meta["metavar"],
                help=text + "; repeatable",
            )
        else:
            group.add_argument(
                _flag(name),
                dest=name,
                default=argparse.SUPPRESS,
                metavar=meta.get("metavar") or _metavar(f),
                help=text,
            )


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error message (exit status 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``optkit`` argument parser (subcommands ``train``, ``lr-plot``, ``bench``)."""
    parser = _Parser(
        prog="optkit",
        description="optkit: the TensorFlow-era optimizer suite for PyTorch. "
        "Run `optkit train` for the demo.",
    )
    parser.add_argument("--version", action="version", version=f"optkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    train = sub.add_parser(
        "train",
        help="train the demo CNN on the bundled digits with optimize_loss",
        description=_TRAIN_DESCRIPTION,
        epilog=_TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file")
    train.add_argument(
        "--resume",
        metavar="RUN_OR_CHECKPOINT",
        help="continue a run from its newest checkpoint (a run folder) or from a checkpoint file, in the run "
        "folder that holds it (or in a new folder given with --run-dir); the run's own configuration is "
        "used, flags given here override it except those that would make it another run (--optimizer, "
        "--dtype, ...). Checkpoints are read with torch.load(weights_only=True): see docs/cli.md, "
        "'Checkpoints and safety'",
    )
    train.add_argument(
        "--print-config", action="store_true", help="print the effective configuration as TOML and exit"
    )
    _add_train_flags(train)

    plot = sub.add_parser(
        "lr-plot",
        help="plot learning-rate policies to a PNG",
        description="Plot learning-rate policies with their parameters on one chart. Each policy name "
        "starts a curve; the KEY=VALUE words after it are its parameters.",
        epilog="example: optkit lr-plot poly_decay learning_rate=0.1 decay_steps=1000 warmup_steps=100 "
        "cosine_decay learning_rate=0.1 decay_steps=900 warmup_steps=100 begin_decay_at=100",
    )
    plot.add_argument("spec", nargs="+", metavar="POLICY|KEY=VALUE")
    plot.add_argument(
        "--steps", type=int, default=None, help="steps to draw (default: 1.1 x the longest decay)"
    )
    plot.add_argument(
        "--out",
        default="lr_policies.png",
        help="output file; the extension picks the format (.png, .svg, .pdf, .jpg; none: .png is added) "
        "(default: lr_policies.png)",
    )
    plot.add_argument("--log-y", action="store_true", help="logarithmic learning-rate axis")

    bench = sub.add_parser(
        "bench",
        help="run the benchmark suite (bench/run_all.py of a source checkout)",
        description="Run bench/run_all.py from the repository root; the remaining arguments "
        "(bench names such as 'optimizers') are passed to it.",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run with few repeats (sets OPTKIT_BENCH_QUICK=1); timings are not meaningful",
    )
    bench.add_argument("args", nargs="*", metavar="ARG", help="arguments for bench/run_all.py")
    return parser


# ------------------------------------------------------------------------------------------------------------
# train


def _flag_values(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list]]:
    """(whole-field updates, dict-field operations) from the flags given on the command line."""
    updates: dict[str, Any] = {}
    dict_ops: dict[str, list] = {}
    for name in FIELDS:
        if not hasattr(args, name):
            continue
        raw = getattr(args, name)
        if name in DICT_FIELDS:
            dict_ops[name] = [
                None if item.strip().lower() == "none" else parse_assignment(item, _flag(name))
                for item in raw
            ]
        elif name == "summaries":
            updates[name] = [s.strip() for s in raw.split(",") if s.strip()]
        elif isinstance(raw, bool) or name in _RAW_STRINGS:
            updates[name] = raw
        else:
            updates[name] = parse_value(raw)
    return updates, dict_ops


def _toml_nulls(data: dict[str, Any]) -> dict[str, Any]:
    """TOML has no null: the string "none" stands for it in optional options."""
    out = dict(data)
    for name, value in data.items():
        if isinstance(value, str) and value.lower() == "none" and FIELDS[name].metadata.get("nullable"):
            out[name] = None
    return out


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, Any]:
    """The effective configuration, validated and with canonical names, and the loaded checkpoint when
    resuming (a :class:`~optkit.demo.checkpoint.Checkpoint`, whose continuation rules are checked)."""
    from optkit.demo.validation import validate

    resume = None
    cfg = TrainConfig()
    if args.resume:
        from optkit.demo.checkpoint import load_checkpoint
        from optkit.demo.resume import saved_config

        resume = load_checkpoint(args.resume)
        cfg = saved_config(resume)
    if args.config:
        cfg = merge(cfg, _toml_nulls(load_toml(args.config)))
    updates, dict_ops = _flag_values(args)
    cfg = merge(cfg, updates, dict_ops)
    if resume is not None:
        from optkit.demo.resume import check_continuation

        check_continuation(resume, cfg)  # first: "the optimizer changed" says more than its consequences
    cfg = validate(cfg)
    if resume is not None:
        from optkit.demo.resume import check_progress

        check_progress(resume, cfg)
    return cfg, resume


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float):
        return (
            repr(value)
            if value == value and abs(value) != float("inf")
            else ("nan" if value != value else ("inf" if value > 0 else "-inf"))
        )
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def to_toml(cfg: TrainConfig) -> str:
    """``cfg`` as a TOML document that ``--config`` reads back to the same configuration."""
    data = dataclasses.asdict(cfg)
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if k not in DICT_FIELDS or v is None]
    for name in DICT_FIELDS:
        if data[name] is not None:
            lines += ["", f"[{name}]"] + [f"{k} = {_toml_value(v)}" for k, v in data[name].items()]
    return "\n".join(lines) + "\n"


def _cmd_train(args: argparse.Namespace) -> int:
    cfg, resume = config_from_args(args)
    if args.print_config:
        sys.stdout.write(to_toml(cfg))
        return 0
    if resume is not None:
        from optkit.demo.parallel import env_world
        from optkit.demo.resume import nothing_to_do

        done = nothing_to_do(resume, cfg)
        if done is not None:  # a finished run: its files stay as they are
            try:
                main_process = env_world()[0] == 0
            except ValueError as err:
                raise ConfigError(f"torchrun environment: {err}") from None
            if main_process:
                print(f"optkit train: {done}")
            return 0
    from optkit.demo.training import run_training

    run_training(cfg, resume=resume)
    return 0


# ------------------------------------------------------------------------------------------------------------
# lr-plot and bench


def _cmd_lr_plot(args: argparse.Namespace) -> int:
    require(["matplotlib"], "optkit lr-plot")
    from optkit.demo.lr_plot import parse_specs, plot_policies

    path = plot_policies(parse_specs(args.spec), args.out, steps=args.steps, log_y=args.log_y)
    note = f" (--out {args.out} has no extension: .png added)" if str(path) != str(args.out) else ""
    print(f"wrote {path}{note}")
    return 0


def _find_bench() -> Path | None:
    candidates = [Path.cwd(), Path(__file__).resolve().parents[2]]  # cwd, then the source checkout
    for root in candidates:
        if (root / "bench" / "run_all.py").is_file():
            return root
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    root = _find_bench()
    if root is None:
        raise ConfigError(
            "bench: bench/run_all.py not found; the benchmarks ship with the source checkout "
            "(run this from the repository root)"
        )
    env = dict(os.environ)
    if args.quick:
        env["OPTKIT_BENCH_QUICK"] = "1"
    return subprocess.call([sys.executable, "-m", "bench.run_all", *args.args], cwd=root, env=env)


def _fail(command: str, message: str) -> int:
    print(f"optkit {command}: error: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``optkit`` command; returns the exit status (2 for every refused input)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "bench":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.args = [*args.args, *extra]  # options meant for bench/run_all.py
    handlers = {"train": _cmd_train, "lr-plot": _cmd_lr_plot, "bench": _cmd_bench}
    try:
        return handlers[args.command](args)
    except ConfigError as err:
        return _fail(args.command, str(err))
    except ModuleNotFoundError as err:
        root = (err.name or "").split(".")[0]
        if root not in PACKAGES:
            raise
        return _fail(args.command, str(extra_for([root], f"optkit {args.command}")))
    except OSError as err:  # the environment (a disk, a folder) rather than the input: still one line
        where = f"{err.filename}: " if err.filename else ""
        return _fail(args.command, f"{where}{err.strerror or err}")
    except KeyboardInterrupt:
        print("optkit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
