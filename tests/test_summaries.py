"""Tests for optkit.summaries and the summaries written by optimize_loss (spec/openseq2seq.md §3.1–3.3):
names, tags, values against float64 NumPy, the every-N schedule, and a real TensorBoard event file read back
with EventAccumulator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from optkit.sgd import SGD
from optkit.summaries import DEFAULT_SUMMARIES, OPTIMIZER_SUMMARIES, SummaryLogger, validate_summaries
from optkit.train import optimize_loss

F64 = torch.float64


class FakeWriter:
    def __init__(self):
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.hists: dict[str, list[tuple[int, np.ndarray]]] = {}

    def add_scalar(self, tag, value, step):
        assert isinstance(value, float) and isinstance(step, int)
        self.scalars.setdefault(tag, []).append((step, value))

    def add_histogram(self, tag, values, step):
        self.hists.setdefault(tag, []).append((step, np.asarray(values)))


def test_names_and_defaults():
    assert OPTIMIZER_SUMMARIES == ["learning_rate", "gradients", "gradient_norm", "global_gradient_norm",
                                   "variables", "variable_norm", "larc_summaries", "loss_scale"]
    assert validate_summaries(None) == DEFAULT_SUMMARIES == ["learning_rate", "global_gradient_norm",
                                                             "loss_scale"]
    assert validate_summaries(["variables"]) == ["variables"]
    with pytest.raises(ValueError, match="'nope'"):
        validate_summaries(["learning_rate", "nope"])
    with pytest.raises(TypeError, match="summaries"):
        validate_summaries("learning_rate")


def test_logger_schedule_and_checks():
    with pytest.raises(ValueError, match="summary_every"):
        SummaryLogger(FakeWriter(), [], 0)
    with pytest.raises(TypeError, match="add_histogram"):
        SummaryLogger(type("W", (), {"add_scalar": lambda *a: None})(), [], 1)
    log = SummaryLogger(FakeWriter(), ["learning_rate"], 3)
    due = []
    for _ in range(7):
        due.append(log.due())
        log.advance()
    assert due == [True, False, False, True, False, False, True]
    off = SummaryLogger(None, ["learning_rate"], 1)
    assert not off.due() and not off.wants("learning_rate")


def _problem(seed=0):
    r = np.random.default_rng(seed)
    X, y = r.standard_normal((8, 3)), r.standard_normal((8, 1))
    w0 = r.standard_normal((3, 1))
    return X, y, w0


def test_all_summaries_values_and_every_n():
    X, y, w0 = _problem()
    Xt, yt = torch.tensor(X), torch.tensor(y)
    w = torch.nn.Parameter(torch.tensor(w0))
    b = torch.nn.Parameter(torch.tensor([0.25], dtype=F64))
    writer = FakeWriter()
    clip = 0.3
    op = optimize_loss(lambda: ((Xt @ w + b - yt) ** 2).mean(), SGD, None, lambda k: 0.1 / (1 + k),
                       var_list=[("dense:kernel", w), ("dense:bias", b)], clip_gradients=clip,
                       summaries=[s for s in OPTIMIZER_SUMMARIES if s != "larc_summaries"],
                       loss_scaling=64.0, summary_writer=writer, summary_every=2)
    expected = []
    for k in range(5):
        wn, bn = w.detach().numpy().copy(), b.detach().numpy().copy()
        r = X @ wn + bn - y
        gw, gb = 2 * X.T @ r / 8, 2 * r.sum(0) / 8
        N = np.sqrt((gw**2).sum() + (gb**2).sum())
        s = min(1.0, clip / N)
        expected.append((k, N, s, gw * s, gb * s, wn, bn))
        op()
    steps = [st for st, _ in writer.scalars["learning_rate"]]
    assert steps == [0, 2, 4]
    for k, N, s, gw, _gb, wn, bn in expected:
        if k % 2:
            continue
        i = k // 2
        assert writer.scalars["learning_rate"][i] == (k, pytest.approx(0.1 / (1 + k), rel=1e-6))
        assert writer.scalars["global_gradient_norm"][i] == (k, pytest.approx(N, rel=1e-6))
        assert writer.scalars["global_clipped_gradient_norm"][i] == (k, pytest.approx(N * s, rel=1e-6))
        assert writer.scalars["loss_scale"][i] == (k, 64.0)
        got = writer.scalars["gradient_norm/dense_kernel"][i][1]
        assert got == pytest.approx(np.linalg.norm(gw), rel=1e-6)
        assert writer.scalars["variable_norm/dense_bias"][i][1] == pytest.approx(abs(bn[0]), rel=1e-6)
        np.testing.assert_allclose(writer.hists["gradients/dense_kernel"][i][1], gw.ravel(), rtol=1e-6)
        np.testing.assert_allclose(writer.hists["variables/dense_kernel"][i][1], wn.ravel(), rtol=1e-6)


def test_larc_summaries():
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=F64))
    g = torch.tensor([0.3, 0.4], dtype=F64)
    writer = FakeWriter()
    op = optimize_loss(lambda: (w * g).sum(), SGD, None, 0.1, var_list=[("v", w)],
                       larc_params={"larc_eta": 0.002}, summaries=["larc_summaries"], summary_writer=writer,
                       summary_every=1)
    op()
    r = 0.01 / (0.1 * 0.5000001)
    assert writer.scalars["larc_clip_on/v"] == [(0, 1.0)]
    assert writer.scalars["larc_grad_update/v"][0][1] == pytest.approx(r, rel=1e-6)
    assert writer.scalars["larc_final_lr/v"][0][1] == pytest.approx(0.1 * r, rel=1e-6)
    assert "learning_rate" not in writer.scalars


def test_gradients_histogram_masks_non_finite():
    log = SummaryLogger(FakeWriter(), ["gradients"], 1)
    p = torch.zeros(3)
    g = torch.tensor([1.0, float("nan"), float("inf")])
    log.write_per_variable(["a"], [p], [g], torch.tensor(2.0), 7)
    np.testing.assert_array_equal(log.writer.hists["gradients/a"][0][1], [2.0, 0.0, 0.0])


def test_no_writer_no_summary_work():
    calls = []

    class Spy(FakeWriter):
        def add_scalar(self, *a):
            calls.append(a)

    w = torch.nn.Parameter(torch.ones(2, dtype=F64))
    op = optimize_loss(lambda: (w * w).sum(), SGD, None, 0.1, var_list=[w], summary_writer=Spy(),
                       summary_every=4)
    for _ in range(3):
        op()
    assert len(calls) == 3  # step 0 only: learning_rate, global_gradient_norm, loss_scale


def test_tensorboard_event_file_readable(tmp_path):
    tb = pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    X, y, w0 = _problem(1)
    Xt, yt = torch.tensor(X), torch.tensor(y)
    w = torch.nn.Parameter(torch.tensor(w0))
    writer = tb.SummaryWriter(log_dir=str(tmp_path))
    op = optimize_loss(lambda: ((Xt @ w - yt) ** 2).mean(), SGD, None, 0.05, var_list=[("w", w)],
                       summaries=["learning_rate", "global_gradient_norm", "variables", "loss_scale"],
                       loss_scaling="dynamic", summary_writer=writer, summary_every=1)
    norms = []
    for _ in range(3):
        norms.append(float(op().grad_norm))
    writer.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"learning_rate", "global_gradient_norm", "loss_scale"} <= set(tags["scalars"])
    assert "variables/w" in tags["histograms"]
    got = [(e.step, e.value) for e in acc.Scalars("global_gradient_norm")]
    assert [s for s, _ in got] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in got], norms, rtol=1e-6)
    assert [e.value for e in acc.Scalars("loss_scale")] == [2.0**15] * 3
