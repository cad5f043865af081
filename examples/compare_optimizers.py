"""Run the ``optkit train`` demo with several optimizer set-ups and print a Markdown table of the results.

Uses the demo's Python API (``optkit.demo``): a :class:`TrainConfig` per set-up, :func:`run_training` to
train it.
Every run uses the demo's data, model, mixed precision with Backoff loss scaling and warm-up + decay policy;
only the optimizer part changes. The LAMB + layer-decay row adds parameter rules by name
(:func:`optkit.param_groups`: layer-wise learning-rate decay over the network's four weight layers, no weight
decay on biases), which ``optimize_loss`` takes as ``layer_decay=``/``layer_regex=``/``rules=`` (the demo's
configuration has no field for them yet, so this script adds them to the demo's ``optimize_loss`` call for
that row).

    python examples/compare_optimizers.py [--epochs 12]

(the MLPerf recipe warms up for 5 epochs, so it needs at least 6)

Needs the ``cli`` extra (scikit-learn, matplotlib, tqdm, tensorboard).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path

import optkit.train
from optkit.demo.config import TrainConfig, merge
from optkit.demo.training import run_training

SETUPS = {
    "LARS (the demo's default)": {},
    "MLPerf LARS recipe (--recipe mlperf-lars)": {"recipe": "mlperf-lars", "clip_gradients": None},
    "SGD + LARC (Keras SGD, EMA)": {
        "optimizer": "SGD",
        "optimizer_params": {"momentum": 0.9},
        "clip_gradients": None,
        "larc_params": {"larc_eta": 0.02},
        "lr_policy_params": {"learning_rate": 0.2, "warmup_steps": 30},
    },
    "SGD, Nesterov + clipping": {
        "optimizer": "SGD",
        "optimizer_params": {"momentum": 0.9, "nesterov": True},
        "lr_policy_params": {"learning_rate": 0.05, "warmup_steps": 30},
    },
    "LAMB (wd 0.01, EMA)": {
        "optimizer": "LAMB",
        "optimizer_params": {"weight_decay": 0.01},
        "lr_policy_params": {"learning_rate": 0.05, "warmup_steps": 30},
    },
    # layer decay: the head at lr 0.1 (where LAMB alone diverges on this data), lower layers at 0.7^k of it
    "LAMB + layer decay 0.7": {
        "optimizer": "LAMB",
        "optimizer_params": {"weight_decay": 0.01},
        "lr_policy_params": {"learning_rate": 0.1, "warmup_steps": 30},
    },
    "Adam, cosine decay (no EMA)": {
        "optimizer": "Adam",
        "optimizer_params": {},
        "ema_momentum": None,
        "lr_policy": "cosine_decay",
        "lr_policy_params": {"learning_rate": 3e-3, "warmup_steps": 30},
    },
}


#: optimize_loss keywords per set-up beyond the demo's configuration. The demo's model is an nn.Sequential,
#: so a weight layer's block index is its position ("0.weight", "3.weight", ...): layer_regex picks it up.
EXTRA = {
    "LAMB + layer decay 0.7": {"layer_decay": 0.7, "layer_regex": r"^(\d+)\."},
}


@contextlib.contextmanager
def optimize_loss_with(extra: dict) -> Iterator[None]:
    """Add ``extra`` keywords to the demo's ``optimize_loss`` call for the ``with`` body."""
    original = optkit.train.optimize_loss
    if extra:
        optkit.train.optimize_loss = functools.partial(original, **extra)
    try:
        yield
    finally:
        optkit.train.optimize_loss = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, changes) in enumerate(SETUPS.items()):
            cfg = merge(
                TrainConfig(),
                {
                    **changes,
                    "epochs": args.epochs,
                    "progress": False,
                    "plot": False,
                    "tensorboard": False,
                    "run_dir": str(Path(tmp) / f"run{i}"),
                },
            )
            print(f"\n== {name}")
            with optimize_loss_with(EXTRA.get(name, {})):
                r = run_training(cfg)
            rows.append((name, r.test_accuracy, r.updates_skipped, r.train_seconds))
    print("\n| set-up | test accuracy | skipped updates | train time (s) |\n|---|---|---|---|")
    for name, acc, skipped, seconds in rows:
        print(f"| {name} | {acc:.2%} | {skipped} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
