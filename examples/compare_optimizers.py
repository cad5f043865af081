"""Run the ``optkit train`` demo with several optimizer set-ups and print a Markdown table of the results.

Uses the demo's Python API (``optkit.demo``): a :class:`TrainConfig` per set-up, :func:`run_training` to
train it.
Every run uses the demo's data, model, mixed precision with Backoff loss scaling and warm-up + decay policy;
only the optimizer part changes.

    python examples/compare_optimizers.py [--epochs 6]

Needs the ``cli`` extra (scikit-learn, matplotlib, tqdm, tensorboard).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from optkit.demo.config import TrainConfig, merge
from optkit.demo.training import run_training

SETUPS = {
    "LARS (the demo's default)": {},
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
    "Adam, cosine decay (no EMA)": {
        "optimizer": "Adam",
        "optimizer_params": {},
        "ema_momentum": None,
        "lr_policy": "cosine_decay",
        "lr_policy_params": {"learning_rate": 3e-3, "warmup_steps": 30},
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
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
            r = run_training(cfg)
            rows.append((name, r.test_accuracy, r.updates_skipped, r.train_seconds))
    print("\n| set-up | test accuracy | skipped updates | train time (s) |\n|---|---|---|---|")
    for name, acc, skipped, seconds in rows:
        print(f"| {name} | {acc:.2%} | {skipped} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
