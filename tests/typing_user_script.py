"""A typed user script: optkit's common API written as a torch.optim user writes it.

tests/test_typing.py runs pyright and mypy over this file (no error allowed: every annotation and every
``assert_type`` must hold, so an optimizer typed as ``Any`` fails) and runs it. Not a test module itself.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from typing_extensions import assert_type

import optkit
from optkit.optimizer import LearningRate, ParamsT

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
x, y = torch.randn(16, 4), torch.randn(16, 1)


def loss_fn() -> Tensor:
    return nn.functional.mse_loss(model(x), y)


def train(opt: torch.optim.Optimizer, steps: int = 2) -> float:
    """The plain torch loop: zero_grad, backward, step."""
    loss = loss_fn()
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
    return loss.item()


# every optimizer: params, then the learning rate (torch's `lr=` too); everything else keyword-only
sgd = optkit.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
assert_type(sgd, optkit.SGD)
adamw = optkit.AdamW(model.parameters(), 3e-4, weight_decay=0.05)
assert_type(adamw, optkit.AdamW)
adam = optkit.Adam(model.named_parameters(), 1e-3, beta1=0.9, beta2=0.99, epsilon=1e-8, amsgrad=True)
assert_type(adam, optkit.Adam)
momentum = optkit.Momentum(model.parameters(), 0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
assert_type(momentum, optkit.Momentum)
lars = optkit.LARS(model.named_parameters(), lr=0.1, momentum=0.9, eeta=0.001, skip_list=["bias"])
assert_type(lars, optkit.LARS)
lamb = optkit.LAMB(optkit.param_groups(model), 1e-3, weight_decay=0.01, global_grad_norm_clip=1.0)
assert_type(lamb, optkit.LAMB)
rms = optkit.RMSProp([{"params": list(model.parameters()), "lr": 0.01}], decay=0.9, momentum=0.5)
assert_type(rms, optkit.RMSProp)
adagrad = optkit.Adagrad(model.parameters(), 0.1, initial_accumulator_value=0.1, epsilon=1e-10)
assert_type(adagrad, optkit.Adagrad)
ftrl = optkit.Ftrl(model.parameters(), 0.1, l1_regularization_strength=0.01)
assert_type(ftrl, optkit.Ftrl)
lion = optkit.Lion(model.parameters(), 1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1, clipnorm=1.0)
assert_type(lion, optkit.Lion)
for opt in (sgd, adamw, adam, momentum, lars, lamb, rms, adagrad, ftrl, lion):
    train(opt, steps=1)

# a learning rate may be a schedule, a callable (of nothing, or of the step) or a 0-d tensor
schedule = optkit.PolicySchedule("cosine_decay", learning_rate=0.1, decay_steps=100)
optkit.SGD(model.parameters(), schedule)
optkit.SGD(model.parameters(), lambda: 0.1)
optkit.SGD(model.parameters(), lambda step: 0.1 * 0.99**step)
optkit.SGD(model.parameters(), torch.tensor(0.1))


def make_adam(params: ParamsT, lr: LearningRate = 1e-3) -> optkit.Adam:
    return optkit.Adam(params, lr, weight_decay=0.01)


assert_type(make_adam(model.parameters()), optkit.Adam)

# the base options: clipping, EMA, names
ema = optkit.SGD(model.parameters(), 0.05, momentum=0.9, global_clipnorm=1.0, use_ema=True, ema_momentum=0.9,
                 name="sgd_ema")
train(ema)
with ema.ema_weights():
    averaged = loss_fn().item()
ema.finalize_variable_values()

# state dicts and configs round-trip
ema.load_state_dict(ema.state_dict())
clone = optkit.SGD.from_config(sgd.get_config(), model.parameters())
assert_type(clone, optkit.SGD)
iterations: Tensor = sgd.iterations

# wrappers and the front doors
larc = optkit.LARC(optkit.SGD(model.parameters(), 0.1, momentum=0.9), larc_eta=0.002)
train(larc)
scaled = optkit.LossScaleOptimizer(optkit.Adam(model.parameters(), 1e-3), "dynamic")
created = optkit.create_optimizer(model, "LAMB", lr=1e-3, weight_decay=0.01, rules=[("2", {"lr_scale": 2.0})])
train(created)
built = optkit.get_optimizer("adamw")(model.parameters(), learning_rate=1e-3)
train(built)

# the one-call train step; its optimizer is optkit's
train_op = optkit.optimize_loss(lambda a, b: nn.functional.mse_loss(model(a), b), "AdamW",
                                {"weight_decay": 0.01, "use_ema": True}, 1e-3, model=model)
for _ in range(2):
    train_op(x, y)
with train_op.optimizer.ema_weights():
    evaluated = loss_fn().item()
step: int = int(train_op.global_step)
