"""The ``optkit`` command end to end: short training runs (files written, resume, errors), config handling,
``lr-plot`` and ``bench``. Runs in-process through ``optkit.cli.main`` so imports are paid once."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")
pytest.importorskip("tensorboard")

from optkit import cli  # noqa: E402
from optkit.demo import components, config  # noqa: E402
from optkit.demo.checkpoint import list_checkpoints  # noqa: E402
from optkit.demo.data import BatchOrder, load_split, train_size  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUIET = ["--no-progress", "--no-tensorboard", "--no-plot"]


def run(*argv: str) -> int:
    return cli.main([str(a) for a in argv])


def assert_same_state(a, b, where="train_op"):
    """Nested state dicts hold equal tensors and values (bitwise)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


# ------------------------------------------------------------------------------------------------------------
# end to end


def test_train_writes_every_output(tmp_path, capsys):
    out = tmp_path / "run"
    rc = run(
        "train",
        "--max-steps",
        6,
        "--eval-every",
        3,
        "--checkpoint-every",
        3,
        "--keep-checkpoints",
        0,
        "--log-every",
        2,
        "--run-dir",
        out,
        "--no-progress",
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "test accuracy:" in text and "EMA weights" in text
    assert f"run folder: {out}" in text

    m = metrics(out)
    assert m["train"]["step"] == list(range(6))
    assert m["eval"]["step"] == [3, 6]
    final = m["final"]
    assert final["steps"] == 6 and final["updates_applied"] + final["updates_skipped"] == 6
    assert final["test_accuracy"] == m["eval"]["test_accuracy"][-1]
    # the default run starts at the Backoff ceiling 2**24 and the first fp16 steps overflow
    assert m["train"]["loss_scale"][0] == 2.0**24
    assert final["updates_skipped"] >= 1 and m["train"]["applied"][0] is False
    assert all(v is None or math.isfinite(v) for v in m["train"]["loss"])
    assert m["config"]["optimizer"] == "LARS" and m["config"]["dtype"] == "mixed"

    png = (out / "report.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 20_000
    assert [p.name for p in list_checkpoints(out)] == ["step_000003.pt", "step_000006.pt"]

    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "test/accuracy", "learning_rate", "loss_scale", "global_gradient_norm"} <= tags


def test_resume_continues_bit_identically(tmp_path, capsys):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = [
        "--max-steps",
        8,
        "--eval-every",
        4,
        "--checkpoint-every",
        4,
        "--keep-checkpoints",
        0,
        "--log-every",
        3,
        *QUIET,
    ]
    assert run("train", *common, "--run-dir", full) == 0
    assert (
        run("train", "--resume", full / "checkpoints" / "step_000004.pt", "--run-dir", resumed, *QUIET) == 0
    )
    assert "resuming from" in capsys.readouterr().out
    a, b = metrics(full), metrics(resumed)
    assert a["train"] == b["train"]
    assert a["eval"] == b["eval"]
    sa = torch.load(full / "checkpoints" / "step_000008.pt", weights_only=True)
    sb = torch.load(resumed / "checkpoints" / "step_000008.pt", weights_only=True)
    for key, value in sa["model"].items():
        assert torch.equal(value, sb["model"][key]), key
    assert_same_state(sa["train_op"], sb["train_op"])  # slots, EMA averages, masters, loss scale, step
    assert "average" in repr(sa["train_op"])  # the EMA is part of what was compared



def _files(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file below ``folder`` with its bytes and modification time (ns)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resuming_a_finished_run_has_nothing_to_do(tmp_path, capsys):
    """``--resume`` of a finished run (from its folder: the newest checkpoint is at the last step) trains
    nothing, says so and writes nothing: metrics.json, report.png, TensorBoard events and checkpoints keep
    their bytes and times, and a ``--run-dir`` given with it is not created. A longer ``--max-steps``
    continues the run."""
    out = tmp_path / "run"
    assert run("train", "--max-steps", 4, "--checkpoint-every", 2, "--run-dir", out, "--no-progress") == 0
    capsys.readouterr()
    before = _files(out)
    assert {"metrics.json", "report.png", "checkpoints/step_000004.pt"} <= set(before)
    assert run("train", "--resume", out, "--no-progress") == 0
    text = capsys.readouterr().out
    assert text.startswith("optkit train: nothing to do: ") and text.count("\n") == 1, text
    assert "step_000004.pt is at step 4, the last step of this run" in text and f"are in {out}" in text
    assert _files(out) == before
    elsewhere = tmp_path / "copy"
    assert run("train", "--resume", out / "checkpoints" / "step_000004.pt", "--run-dir", elsewhere) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert not elsewhere.exists() and _files(out) == before
    assert run("train", "--resume", out, "--max-steps", 5, *QUIET) == 0  # more steps: it trains on
    assert "resuming from" in capsys.readouterr().out
    assert metrics(out)["final"]["steps"] == 5


def test_resume_keeps_the_runs_config_and_applies_flags(tmp_path):
    out = tmp_path / "run"
    assert (
        run(
            "train",
            "--max-steps",
            4,
            "--checkpoint-every",
            2,
            "--optimizer-param",
            "eeta=0.02",
            "--run-dir",
            out,
            *QUIET,
        )
        == 0
    )
    assert run("train", "--resume", out / "checkpoints" / "step_000002.pt", "--max-steps", 6, *QUIET) == 0
    m = metrics(out)
    assert m["config"]["optimizer_params"]["eeta"] == 0.02
    assert m["final"]["steps"] == 6 and m["train"]["step"] == list(range(6))


@pytest.mark.parametrize(
    "argv",
    [
        [
            "--dtype",
            "float32",
            "--loss-scaling",
            "1",
            "--loss-scaling-param",
            "none",
            "--ema-momentum",
            "none",
        ],
        [
            "--optimizer",
            "Momentum",
            "--optimizer-param",
            "none",
            "--optimizer-param",
            "momentum=0.9",
            "--ema-momentum",
            "none",
            "--clip-gradients",
            "none",
            "--larc-param",
            "larc_eta=0.02",
            "--half-dtype",
            "bfloat16",
            "--iter-size",
            "2",
            "--loss-scaling",
            "LogMax",
            "--loss-scaling-param",
            "none",
        ],
    ],
)
def test_train_variants(tmp_path, argv):
    out = tmp_path / "run"
    assert run("train", "--max-steps", 4, *argv, "--run-dir", out, *QUIET) == 0
    m = metrics(out)
    assert len(m["train"]["loss"]) == 4 and 0.0 <= m["final"]["test_accuracy"] <= 1.0
    attempts = 4 // m["config"]["iter_size"]  # accumulation micro-steps are not update attempts
    assert m["final"]["updates_applied"] + m["final"]["updates_skipped"] == attempts
    assert m["final"]["updates_applied"] == sum(m["train"]["applied"])


# ------------------------------------------------------------------------------------------------------------
# errors: reported before any work, naming the flag


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optimizer", "Nope"], "--optimizer: unknown optimizer 'Nope'"),
        (["--lr-policy", "nope"], "--lr-policy: unknown learning-rate policy 'nope'"),
        (["--epochs", "0"], "--epochs (epochs) must be >= 1"),
        (["--epochs", "many"], "--epochs (epochs) must be an integer"),
        (["--batch-size", "2.5"], "--batch-size (batch_size) must be an integer"),
        (["--test-fraction", "1.5"], "--test-fraction (test_fraction) must be <= 0.9"),
        (["--clip-gradients", "-1"], "--clip-gradients (clip_gradients) must be > 0.0"),
        (["--ema-momentum", "nan"], "--ema-momentum (ema_momentum) must be finite"),
        (["--dtype", "float64"], "--dtype (dtype) must be one of"),
        (["--summaries", "learning_rate,bogus"], "--summaries"),
        (
            ["--lr-policy-param", "bogus=1"],
            "--lr-policy-param: PolicySchedule: unknown parameter(s) ['bogus']",
        ),
        (["--lr-policy-param", "learning_rate=-1"], "--lr-policy-param"),
        (["--lr-policy-param", "oops"], "--lr-policy-param: expected KEY=VALUE"),
        (["--optimizer-param", "momentum=-1"], "--optimizer-param: LARS rejects"),
        (["--optimizer-param", "lr=0.1"], "--optimizer-param: lr comes from the learning-rate policy"),
        (["--larc-param", "larc_eta=0.01"], "cannot be used together"),
        (
            ["--clip-gradients", "none", "--larc-param", "larc_mode=bogus", "--larc-param", "larc_eta=0.01"],
            "--larc-param",
        ),
        (["--loss-scaling", "Bogus"], "--loss-scaling"),
        (["--loss-scaling-param", "step_window=0"], "--loss-scaling"),
        (["--iter-size", "0"], "--iter-size (iter_size) must be >= 1"),
        (
            ["--freeze-variables-regex", "("],
            "--freeze-variables-regex (freeze_variables_regex) is not a valid",
        ),
        (
            ["--freeze-variables-regex", ".*"],
            "--freeze-variables-regex freezes every parameter (0.weight, 0.bias",
        ),
        (["--bucket-numel", "0"], "--bucket-numel (bucket_numel) must be >= 1"),
        (
            ["--optimizer-param", "none", "--optimizer-param", "eta=0.1"],
            "--optimizer-param: unknown parameter(s) ['eta'] for LARS; accepted: ",
        ),
        (
            ["--optimizer", "Momentum", "--optimizer-param", "none", "--ema-momentum", "none"],
            "--optimizer-param: Momentum rejects {}: ",
        ),
        (
            ["--resume", "/nonexistent/run"],
            "--resume: /nonexistent/run is neither a checkpoint file nor a run folder",
        ),
        (["--precision", "bf16"], "--precision (precision) must be one of fp32-masters, split, kahan"),
        (["--state-dtype", "int4"], "--state-dtype (state_dtype) must be one of fp32, bf16, int8"),
        (["--precision", "split", "--dtype", "float32"], "split trains a bfloat16 model without fp32"),
        (["--precision", "fp32-masters", "--dtype", "bfloat16"], "fp32-masters is --dtype mixed"),
        (["--optimizer-param", "precision=split"], "must not set precision: give --precision"),
        (["--optimizer", "SGD", "--optimizer-param", "none", "--state-dtype", "bf16", "--optimizer-param",
          "state_dtype=int8"], "must not set state_dtype"),
    ],
)
def test_bad_flags_fail_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "never"
    assert run("train", *argv, "--run-dir", out, *QUIET) == 2
    err = capsys.readouterr().err
    assert err.startswith("optkit train: error:")
    assert message in err
    assert not out.exists()


def test_every_problem_is_listed_at_once(capsys):
    assert run("train", "--epochs", "0", "--batch-size", "-1", "--log-every", "x") == 2
    err = capsys.readouterr().err
    assert "--epochs" in err and "--batch-size" in err and "--log-every" in err


def test_resume_from_folder_without_checkpoints(tmp_path, capsys):
    assert run("train", "--resume", tmp_path) == 2
    assert "is not an optkit run folder: it has no optkit-run.json" in capsys.readouterr().err
    (tmp_path / "optkit-run.json").write_text('{"format": "optkit-demo-run/1"}')
    assert run("train", "--resume", tmp_path) == 2
    assert "no checkpoint in" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# configuration: TOML, precedence, help


def test_toml_then_flags_precedence(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(
        'optimizer = "SGD"\nepochs = 3\nlarc_params = "none"\n'
        "[optimizer_params]\nmomentum = 0.5\nnesterov = true\n"
        "[lr_policy_params]\nlearning_rate = 0.3\n"
    )
    assert (
        run("train", "--config", path, "--epochs", "4", "--optimizer-param", "momentum=0.7", "--print-config")
        == 0
    )
    data = tomllib.loads(capsys.readouterr().out)
    assert data["optimizer"] == "SGD" and data["epochs"] == 4
    assert data["optimizer_params"] == {"momentum": 0.7, "nesterov": True}
    assert data["lr_policy_params"] == {"learning_rate": 0.3}
    assert data["larc_params"] == "none"


def test_print_config_round_trips(tmp_path, capsys):
    assert (
        run(
            "train",
            "--print-config",
            "--larc-param",
            "larc_eta=0.01",
            "--clip-gradients",
            "none",
            "--optimizer",
            "SGD",
            "--optimizer-param",
            "momentum=0.9",
            "--summaries",
            "loss_scale",
        )
        == 0
    )
    text = capsys.readouterr().out
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert run("train", "--config", path, "--print-config") == 0
    assert capsys.readouterr().out == text


def test_toml_errors(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("optimiser = 'LARS'\n")
    assert run("train", "--config", bad) == 2
    assert "unknown key(s) ['optimiser']" in capsys.readouterr().err
    bad.write_text("epochs = \n")
    assert run("train", "--config", bad) == 2
    assert "is not valid TOML" in capsys.readouterr().err
    assert run("train", "--config", tmp_path / "missing.toml") == 2
    assert "file not found" in capsys.readouterr().err


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exc:
        run("train", "--help")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in config.FIELDS:
        flag = cli._flag(name)
        assert flag in text, flag
    assert "--resume" in text and "--config" in text and "torchrun" in text


@pytest.mark.parametrize(
    "text, value",
    [
        ("3", 3),
        ("0.5", 0.5),
        ("1e-3", 1e-3),
        ("true", True),
        ("False", False),
        ("none", None),
        ("[10, 20]", [10, 20]),
        ("clip", "clip"),
        ("Backoff", "Backoff"),
        ('"7"', "7"),
    ],
)
def test_parse_value(text, value):
    assert config.parse_value(text) == value


def test_policy_params_inject_decay_steps_like_openseq2seq():
    cfg = config.TrainConfig(
        lr_policy="poly_decay", lr_policy_params={"learning_rate": 1.0, "warmup_steps": 30}
    )
    assert components.policy_params(cfg, 200) == {
        "learning_rate": 1.0,
        "warmup_steps": 30,
        "begin_decay_at": 30,
        "decay_steps": 170,
    }
    given = config.TrainConfig(
        lr_policy="poly_decay", lr_policy_params={"learning_rate": 1.0, "decay_steps": 50}
    )
    assert components.policy_params(given, 200)["decay_steps"] == 50
    exp = config.TrainConfig(
        lr_policy="exp_decay",
        lr_policy_params={
            "learning_rate": 1.0,
            "decay_rate": 0.5,
            "use_staircase_decay": False,
            "begin_decay_at": 20,
        },
    )
    assert components.policy_params(exp, 200)["decay_steps"] == 180
    fixed = config.TrainConfig(lr_policy="fixed_lr", lr_policy_params={"learning_rate": 1.0})
    assert components.policy_params(fixed, 200) == {"learning_rate": 1.0}


# ------------------------------------------------------------------------------------------------------------
# data


def test_split_and_batches():
    split = load_split(0.2, seed=3)
    n_train = train_size(0.2)
    assert len(split.y_train) == n_train and len(split.y_train) + len(split.y_test) == 1797
    assert split.x_train.shape == (n_train, 1, 8, 8) and split.x_train.dtype == torch.float32
    assert abs(float(split.x_train.mean())) < 1e-4 and abs(float(split.x_train.std()) - 1) < 1e-3
    one = BatchOrder(n_train, 64, seed=3)
    again = BatchOrder(n_train, 64, seed=3)
    epoch = torch.cat([one.batch(s) for s in range(one.steps_per_epoch)])
    assert sorted(epoch.tolist()) == list(range(n_train))  # every image once per epoch
    assert torch.equal(one.batch(one.steps_per_epoch + 5), again.batch(one.steps_per_epoch + 5))
    assert not torch.equal(one.batch(0), one.batch(one.steps_per_epoch))  # a new order each epoch
    shards = [BatchOrder(n_train, 64, seed=3, rank=r, world_size=2).batch(7) for r in range(2)]
    assert torch.equal(torch.cat(shards), one.batch(7))


# ------------------------------------------------------------------------------------------------------------
# lr-plot and bench


def test_lr_plot(tmp_path, capsys):
    out = tmp_path / "lr.png"
    assert (
        run(
            "lr-plot",
            "poly_decay",
            "learning_rate=0.1",
            "decay_steps=1000",
            "warmup_steps=100",
            "piecewise_constant",
            "learning_rate=0.1",
            "boundaries=[300, 600]",
            "decay_rates=[0.5, 0.1]",
            "--out",
            out,
            "--log-y",
        )
        == 0
    )
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["learning_rate=0.1"], "comes before any policy name"),
        (["nope", "learning_rate=0.1"], "unknown learning-rate policy 'nope'"),
        (["poly_decay", "learning_rate=0.1"], "missing required parameter(s) ['decay_steps']"),
        (["fixed_lr", "learning_rate=0.1", "--steps", "1"], "--steps must be an integer from 2 to 1000000"),
    ],
)
def test_lr_plot_errors(tmp_path, capsys, argv, message):
    out = tmp_path / "lr.png"
    assert run("lr-plot", *argv, "--out", out) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_bench_runs_run_all(tmp_path, monkeypatch):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run_all.py").write_text(
        "import os, sys, pathlib\n"
        "quick = os.environ.get('OPTKIT_BENCH_QUICK', '-')\n"
        "pathlib.Path('ran.txt').write_text(quick + ' ' + ' '.join(sys.argv[1:]))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPTKIT_BENCH_QUICK", raising=False)
    assert run("bench", "--quick", "optimizers", "--flag") == 0
    assert (tmp_path / "ran.txt").read_text() == "1 optimizers --flag"


def test_bench_without_checkout(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_find_bench", lambda: None)
    assert run("bench") == 2
    assert "bench/run_all.py not found" in capsys.readouterr().err


def test_switching_optimizer_or_policy_starts_their_parameters_afresh(capsys):
    assert run("train", "--optimizer", "Adam", "--lr-policy", "cosine_decay", "--print-config") == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["optimizer_params"] == {}
    assert data["ema_momentum"] == config.TrainConfig().ema_momentum  # every optimizer keeps an EMA now
    assert data["lr_policy_params"] == {
        "learning_rate": config.TrainConfig().lr_policy_params["learning_rate"]
    }
    assert run("train", "--optimizer", "SGD", "--optimizer-param", "momentum=0.5", "--print-config") == 0
    assert tomllib.loads(capsys.readouterr().out)["optimizer_params"] == {"momentum": 0.5}


def test_freeze_variables_regex_keeps_matching_parameters(tmp_path):
    from optkit.demo.model import make_model

    out = tmp_path / "run"
    argv = ["--max-steps", 4, "--dtype", "float32", "--loss-scaling", 1, "--loss-scaling-param", "none"]
    assert run("train", *argv, "--freeze-variables-regex", r"0\.", "--run-dir", out, *QUIET) == 0
    final = torch.load(out / "checkpoints" / "step_000004.pt", weights_only=True)["model"]
    initial = make_model(16, 0, torch.float32).state_dict()
    assert torch.equal(final["0.weight"], initial["0.weight"]) and torch.equal(
        final["0.bias"], initial["0.bias"]
    )
    assert not torch.equal(final["8.weight"], initial["8.weight"])
    assert len(final) == len(initial)


# ------------------------------------------------------------------------------------------------------------
# --recipe and --no-decay-1d

RECIPE_RUN = ["--recipe", "mlperf-lars", "--epochs", 6, "--batch-size", 720, "--dtype", "float32"]
PLAIN_FP32 = ["--loss-scaling", 1, "--loss-scaling-param", "none", "--ema-momentum", "none",
              "--clip-gradients", "none"]


def test_recipe_is_written_out_into_the_config():
    from test_recipes import tf_poly_rate

    cfg, errors = components.canonical(config.TrainConfig(recipe=" MLPerf-LARS", batch_size=720, epochs=6))
    assert errors == [] and cfg.recipe == "mlperf-lars" and cfg.optimizer == "LARS"
    # epsilon: the effective 1e-7 of mlcommons' TF2 reference
    assert cfg.optimizer_params == {"momentum": 0.9, "weight_decay": 1e-4, "eeta": 0.001, "epsilon": 1e-7}
    per_epoch = math.ceil(train_size(0.2) / 720)
    total = 6 * per_epoch
    assert components.planned_steps(cfg)[1] == total
    schedule = components.build_schedule_for(cfg, total)
    for k in range(total + 3):  # base lr 10 below a batch of 16k, 5 warm-up epochs
        assert float(schedule(k)) == pytest.approx(tf_poly_rate(k, 10.0, 5 * per_epoch, total), rel=1e-12)
    assert components.canonical(cfg) == (cfg, [])  # a saved (written-out) configuration expands to itself


def test_recipe_trains_the_demo_like_the_library_recipe(tmp_path):
    from optkit.demo.model import make_model
    from optkit.recipes import mlperf_resnet50_lars

    out = tmp_path / "run"
    assert run("train", *RECIPE_RUN, *PLAIN_FP32, "--run-dir", out, *QUIET) == 0
    m = metrics(out)
    assert m["config"]["recipe"] == "mlperf-lars" and m["config"]["optimizer_params"]["eeta"] == 0.001
    updates = m["final"]["updates_applied"]
    final = torch.load(list_checkpoints(out)[-1], weights_only=True)["model"]
    # the same run by hand: optkit.recipes' optimizer form on the demo's batches
    model = make_model(16, 0, torch.float32)
    per_epoch = math.ceil(train_size(0.2) / 720)
    recipe = mlperf_resnet50_lars(model, 720, 6, per_epoch)
    assert recipe.skipped == ["0.bias", "3.bias", "6.bias", "8.bias"]
    split = load_split(0.2, 0)
    order = BatchOrder(len(split.y_train), 720, 0)
    assert updates == 6 * per_epoch
    for step in range(updates):
        idx = order.batch(step)
        recipe.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(split.x_train[idx]), split.y_train[idx]).backward()
        recipe.optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(final[name], p.detach(), rtol=1e-4, atol=1e-6, msg=name)


def test_recipe_errors_name_the_flag(capsys):
    assert run("train", "--recipe", "mlperf-lamb", *QUIET) == 2
    err = capsys.readouterr().err
    assert "--recipe (recipe) must be one of mlperf-lars or none, got 'mlperf-lamb'" in err
    assert run("train", "--recipe", "mlperf-lars", "--max-steps", 40, *QUIET) == 2
    err = capsys.readouterr().err
    assert "--recipe: mlperf-lars does not fit a run of 2 epoch(s)" in err and "warmup_epochs" in err


def test_no_decay_1d_flags(capsys):
    """``--no-decay-1d`` turns the option on and ``--decay-1d`` off (argparse's own ``--x/--no-x`` pair read
    ``--no-decay-1d`` as "off", so the flag could never turn it on)."""
    for argv, expected in [(["--no-decay-1d"], True), (["--no-decay-1d", "--decay-1d"], False), ([], False)]:
        assert run("train", *argv, "--print-config") == 0
        assert tomllib.loads(capsys.readouterr().out)["no_decay_1d"] is expected


def test_no_decay_1d_takes_weight_decay_off_biases_only():
    from optkit.demo.model import make_model

    base = config.TrainConfig(
        optimizer="SGD", optimizer_params={"weight_decay": 0.05}, dtype="float32", loss_scaling=1.0,
        loss_scaling_params=None, ema_momentum=None, clip_gradients=None, lr_policy="fixed_lr",
        lr_policy_params={"learning_rate": 0.2},
    )
    split = load_split(0.2, 0)
    x, y = split.x_train[:64], split.y_train[:64]
    after = {}
    variants = {"rules": dataclasses.replace(base, no_decay_1d=True), "decay": base,
                "none": dataclasses.replace(base, optimizer_params={})}
    for name, cfg in variants.items():
        model = make_model(16, 0, torch.float32)
        components.build_train_op(cfg, model, 10)(x, y)
        after[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n, p in after["rules"].items():
        ref = after["none"][n] if n.endswith("bias") else after["decay"][n]
        other = after["decay"][n] if n.endswith("bias") else after["none"][n]
        torch.testing.assert_close(p, ref, rtol=0, atol=0, msg=n)
        assert not torch.equal(p, other), n


# ------------------------------------------------------------------------------------------------------------
# --precision and --state-dtype

LEAN_RUN = ["--optimizer", "SGD", "--optimizer-param", "none", "--optimizer-param", "momentum=0.9",
            "--lr-policy", "fixed_lr", "--lr-policy-param", "learning_rate=0.1", "--loss-scaling", "1",
            "--loss-scaling-param", "none", "--ema-momentum", "none", "--max-steps", 8,
            "--eval-every", 8, *QUIET]


@pytest.mark.parametrize("precision, state_dtype, model_dtype, state_bytes", [
    (None, None, "mixed", 4 + 4),  # (today's default: float16 weights, fp32 masters + fp32 momentum)
    ("fp32-masters", "bf16", "mixed", 4 + 2),
    ("split", None, "bfloat16", 2 + 4),  # low halves + fp32 momentum
    ("kahan", "bf16", "bfloat16", 2 + 2),
    ("stochastic", "int8", "bfloat16", None),  # 8-bit codes for the large tensors, fp32 for the others
])
def test_precision_modes_train(tmp_path, capsys, precision, state_dtype, model_dtype, state_bytes):
    out = tmp_path / "run"
    flags = (["--precision", precision] if precision else []) + (["--state-dtype", state_dtype] if state_dtype
                                                                 else [])
    assert run("train", *LEAN_RUN, *flags, "--run-dir", out) == 0
    m = metrics(out)
    assert m["config"]["precision"] == precision and m["config"]["state_dtype"] == state_dtype
    assert m["config"]["dtype"] == model_dtype
    assert m["config"]["half_dtype"] == ("bfloat16" if precision == "fp32-masters" else "float16")
    loss = m["train"]["loss"]
    assert min(loss[-3:]) < loss[0]  # it trains
    final = m["final"]
    assert (final["precision"], final["state_dtype"]) == (precision, state_dtype)
    ckpt = torch.load(out / "checkpoints" / "step_000008.pt", weights_only=True)
    weights = [v for k, v in ckpt["model"].items() if v.is_floating_point()]
    n = sum(w.numel() for w in weights)
    if state_bytes is None:  # computed from the checkpoint's state: 8-bit slots, fp32 small ones, no extra
        st = ckpt["train_op"]["optimizer"]["state"]
        state_bytes = sum(v.numel() * v.element_size() for e in st.values() for v in e.values()
                          if isinstance(v, torch.Tensor) and v.dim() > 0) / n
        assert 1.0 < state_bytes < 1.2
    assert final["state_bytes_per_param"] == pytest.approx(state_bytes, abs=1e-4)
    assert all(w.dtype == (torch.float16 if precision is None else torch.bfloat16) for w in weights)
    printed = capsys.readouterr().out
    assert f"optimizer state {state_bytes:.4g} B/param" in printed


@pytest.mark.parametrize("precision, state_dtype", [("stochastic", "int8"), ("split", "fp32")])
def test_precision_resume_keeps_the_options_and_continues_bit_identically(tmp_path, capsys, precision,
                                                                          state_dtype):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    flags = ["--precision", precision, "--state-dtype", state_dtype, "--checkpoint-every", 4,
             "--keep-checkpoints", 0]
    assert run("train", *LEAN_RUN, *flags, "--run-dir", full) == 0
    ckpt = full / "checkpoints" / "step_000004.pt"
    assert run("train", "--resume", ckpt, "--run-dir", resumed, *QUIET) == 0
    a, b = metrics(full), metrics(resumed)
    assert b["config"]["precision"] == precision and b["config"]["state_dtype"] == state_dtype
    assert a["train"] == b["train"]
    sa = torch.load(full / "checkpoints" / "step_000008.pt", weights_only=True)
    sb = torch.load(resumed / "checkpoints" / "step_000008.pt", weights_only=True)
    for st in (sa, sb):  # (a split master's low halves are raw bits in a bfloat16 tensor: compare the bits)
        for entry in st["train_op"]["optimizer"]["state"].values():
            if "master_low" in entry:
                entry["master_low"] = entry["master_low"].view(torch.int16)
    assert_same_state(sa["train_op"], sb["train_op"])
    assert ("rounding_step" if precision == "stochastic" else "master_low") in repr(sa["train_op"])
    capsys.readouterr()
    assert run("train", "--resume", full, "--precision", "kahan", "--max-steps", 12, *QUIET) == 2
    assert "--precision: the run of" in capsys.readouterr().err
