"""optkit inside other people's training loops: PyTorch Lightning and the Hugging Face ``Trainer`` (tiny
models built from configs, no downloads). Skipped when the frameworks are not installed (``pip install
-e ".[test]"`` installs them; ``make test`` does).

References: the same optimizer driven by a plain PyTorch loop on the same batches (same numbers), and
``torch.nn.utils.clip_grad_norm_`` for the framework's clipping.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import optkit

pytestmark = pytest.mark.filterwarnings("ignore")


def _data(n=32, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _plain_loop(make_opt, batches, epochs, clip=None, autocast=None):
    net = _net()
    opt = make_opt(net)
    for _ in range(epochs):
        for x, y in batches:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            opt.step()
    return net


# ------------------------------------------------------------------------------------------------ Lightning


def _lightning_fit(make_opt, epochs=2, **trainer_kw):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _net()

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self):
            return make_opt(self.net)

    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False)
    module = Module()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return module.net, [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]


def _sgd(net):
    return optkit.SGD(net.named_parameters(), learning_rate=0.05, momentum=0.9, use_ema=True)


def _assert_same(a: nn.Module, b: nn.Module, tol=1e-6):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=tol, atol=tol)


def test_lightning_trains_like_a_plain_loop():
    net, batches = _lightning_fit(_sgd)
    _assert_same(net, _plain_loop(_sgd, batches, 2))


def test_lightning_keeps_flat_buffers_on_the_flat_path():
    """Lightning clears gradients with the optimizer's ``zero_grad()``: over flat buffers the views stay, the
    steps run over the flat gradient, and the weights are the plain loop's."""
    made = []

    def sgd_flat(net):
        made.append(optkit.flat_parameters(net))
        made.append(_sgd(net))
        return made[-1]

    net, batches = _lightning_fit(sgd_flat)
    flat, opt = made
    assert flat.views_intact() and opt.whole_grads() is not None
    _assert_same(net, _plain_loop(_sgd, batches, 2))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_gradient_clip_val_under_mixed_precision(precision):
    """Lightning refuses ``gradient_clip_val`` for optimizers that unscale inside ``step()`` (torch's fused
    ones, and optkit's by default); ``amp_protocol = False`` lets ``GradScaler`` unscale first, and the result
    is the plain loop with ``clip_grad_norm_``. ``global_clipnorm=`` clips inside the optimizer instead."""

    def unscaling_outside(net):
        opt = _sgd(net)
        opt.amp_protocol = False
        return opt

    with pytest.raises(RuntimeError, match="unscaling of gradients internally"):
        _lightning_fit(_sgd, epochs=1, precision=precision, gradient_clip_val=0.5)
    net, batches = _lightning_fit(unscaling_outside, epochs=1, precision=precision, gradient_clip_val=0.5)
    if precision == "bf16-mixed":
        ref = _plain_loop(_sgd, batches, 1, clip=0.5, autocast=torch.bfloat16)
        _assert_same(net, ref, tol=1e-5)
    for p in net.parameters():
        assert torch.isfinite(p).all()

    def clipping_inside(net):
        return optkit.SGD(net.named_parameters(), learning_rate=0.05, momentum=0.9, global_clipnorm=0.5)

    net, batches = _lightning_fit(clipping_inside, epochs=1, precision=precision)
    if precision == "bf16-mixed":
        _assert_same(net, _plain_loop(clipping_inside, batches, 1, autocast=torch.bfloat16), tol=1e-5)


def test_lightning_rejects_a_loss_scale_wrapper_with_a_clear_error():
    """Lightning back-propagates the unscaled loss itself; a LossScaleOptimizer would divide those gradients
    by 32768 and stall silently. It refuses instead and points at Lightning's own mixed precision."""

    def wrapped(net):
        return optkit.LossScaleOptimizer(optkit.SGD(net.parameters(), learning_rate=0.05), "dynamic")

    with pytest.raises(RuntimeError, match="16-mixed"):
        _lightning_fit(wrapped, epochs=1)


# ------------------------------------------------------------------------------------------------ HF Trainer


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers, transformers.BertForSequenceClassification(cfg)


def _hf_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 40, (8, 12), generator=g)
    labels = torch.randint(0, 2, (8,), generator=g)
    return ids, labels


def _hf_train(tmp_path, make_opt, steps=4):
    transformers, model = _tiny_bert()
    ids, labels = _hf_batch()
    dataset = [{"input_ids": ids[i], "labels": labels[i]} for i in range(8)]
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=steps, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", max_grad_norm=1.0, seed=0,
        dataloader_drop_last=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, optimizers=(opt, sched))
    trainer.train()
    return model, opt


def test_hf_trainer_trains_like_a_plain_loop(tmp_path):
    """The HF Trainer with an optkit optimizer and a torch LR scheduler, its own clipping at 1.0, on one
    batch repeated: the same weights as a plain loop with ``clip_grad_norm_``; one applied update per
    step."""

    def make(model):
        return optkit.Adam(model.named_parameters(), learning_rate=1e-2)

    model, opt = _hf_train(tmp_path, make)
    assert int(opt.iterations) == 4
    _, ref = _tiny_bert()
    ref_opt = make(ref)
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    ids, labels = _hf_batch()
    for _ in range(4):
        ref_opt.zero_grad()
        ref(input_ids=ids, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        sched.step()
    _assert_same(model, ref, tol=1e-5)


def test_hf_trainer_over_flat_buffers_steps_per_tensor(tmp_path):
    """The HF Trainer clears gradients with ``model.zero_grad()`` (None): over flat buffers each backward
    makes separate gradients, so the steps run per tensor (the README says so); the weights are those of the
    same Trainer run without flat buffers."""
    made = []

    def adam_flat(model):
        made.append(optkit.flat_parameters(model))
        return optkit.Adam(model.named_parameters(), learning_rate=1e-2)

    model, opt = _hf_train(tmp_path / "flat", adam_flat)
    flat = made[0]
    assert not flat.views_intact() and opt.whole_grads() is None
    ref, _ = _hf_train(tmp_path / "plain", lambda m: optkit.Adam(m.named_parameters(), learning_rate=1e-2))
    _assert_same(model, ref, tol=1e-6)


def test_hf_trainer_rejects_a_loss_scale_wrapper_with_a_clear_error(tmp_path):
    def make(model):
        return optkit.LossScaleOptimizer(optkit.Adam(model.parameters(), learning_rate=1e-2), "dynamic")

    with pytest.raises(RuntimeError, match="fp16=True"):
        _hf_train(tmp_path, make, steps=1)
