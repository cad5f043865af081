"""Train a CNN on scikit-learn's bundled digits with ``optkit.optimize_loss``, in one short file.

This is what ``optkit train`` does, without the command-line machinery: LARS from the registry, a warm-up +
decay policy, a float16 model with fp32 master weights and Backoff loss scaling, EMA weights, gradient
clipping; then the EMA weights are swapped into an fp32 copy of the model for evaluation.

    python examples/optimize_loss_digits.py [--epochs 12]

Needs the ``cli`` extra (scikit-learn) for the data.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import optkit


def make_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 16, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y))
    test, train = order[:360], order[360:]
    x = (x - x[train].mean()) / x[train].std()

    model = make_cnn().half()  # float16 weights: "mixed" keeps fp32 masters next to them
    steps_per_epoch = -(-len(train) // args.batch_size)
    total = args.epochs * steps_per_epoch

    def loss_fn(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(inputs.half()).float(), labels)

    train_op = optkit.optimize_loss(
        loss_fn,
        "LARS",
        {"momentum": 0.9, "eeta": 0.01, "weight_decay": 1e-4, "use_ema": True, "ema_momentum": 0.98},
        learning_rate_decay_fn=optkit.PolicySchedule(
            "poly_decay",
            learning_rate=2.0,
            warmup_steps=30,
            begin_decay_at=30,
            decay_steps=total - 30,
            power=2.0,
            min_lr=1e-4,
        ),
        dtype="mixed",
        clip_gradients=2.0,
        loss_scaling="Backoff",
        loss_scaling_params={"scale_max": 2.0**24, "step_window": 100},
        model=model,
    )

    start = time.perf_counter()
    for epoch in range(args.epochs):
        perm = train[torch.randperm(len(train))]
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch_size : (i + 1) * args.batch_size]
            result = train_op(x[idx], y[idx])
        print(
            f"epoch {epoch + 1:2d}: loss {result.loss.item():.4f}  lr {result.lr.item():.3g}  "
            f"loss scale {result.loss_scale.item():g}  updates {int(train_op.global_step)}"
        )
    seconds = time.perf_counter() - start

    # evaluate with the EMA of the fp32 master weights, in an fp32 copy of the network
    evaluator = make_cnn()
    with torch.no_grad():
        for name, master in zip(train_op.names, train_op.masters):
            evaluator.get_parameter(name).copy_(train_op.optimizer.get_slot(master, "average"))
        accuracy = (evaluator(x[test]).argmax(1) == y[test]).float().mean().item()
    print(f"test accuracy with EMA weights: {accuracy:.2%} after {total} steps in {seconds:.1f} s")


if __name__ == "__main__":
    main()
