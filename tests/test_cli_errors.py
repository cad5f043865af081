"""Inputs that used to end in a traceback (or worse): each is now one line on stderr naming the flag or file,
exit status 2, nothing written. Also the name rules (any letter case) and each loss-scaling algorithm's own
default parameters."""

from __future__ import annotations

import errno
import sys

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from optkit import cli  # noqa: E402
from optkit.demo import files  # noqa: E402
from optkit.demo.config import LOSS_SCALING_DEFAULTS  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

QUIET = ["--no-progress", "--no-tensorboard", "--no-plot"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*argv: object) -> int:
    return cli.main([str(a) for a in argv])


def single_line(capsys, command: str = "train") -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"optkit {command}: error: "), err
    return lines[0]


def printed_config(capsys, *argv: object) -> dict:
    assert run("train", *argv, "--print-config") == 0
    return tomllib.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------------------------------------
# flags


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", str(2**70)], "--seed (seed) must be <= 4294967295, got 1180591620717411303424"),
        (["--seed", "-1"], "--seed (seed) must be >= 0"),
        (["--threads", "100000000"], "--threads (threads) must be <= "),
        (["--threads", "0"], "--threads (threads) must be >= 1"),
        (["--channels", "100000"], "--channels (channels) must be <= 256"),
        (["--max-steps", str(10**12)], "--max-steps (max_steps) must be <= 1000000000"),
        (
            ["--dtype", "float16", "--loss-scaling", "1", "--clip-gradients", "1e5"],
            "--clip-gradients (clip_gradients) must be <= 65504 (the largest float16 number",
        ),
        (["--clip-gradients", "1e39"], "--clip-gradients (clip_gradients) must be <= 3.40282e+38"),
        (["--loss-scaling", "1e39"], "--loss-scaling (loss_scaling) must be <= 3.40282e+38"),
        (["--lr-policy-param", "learning_rate=1e308"], "--lr-policy-param: poly_decay("),
        (
            [
                "--lr-policy",
                "exp_decay",
                "--lr-policy-param",
                "decay_rate=1e300",
                "--lr-policy-param",
                "use_staircase_decay=false",
            ],
            "it must be a finite float32 number >= 0",
        ),
        (["--optimizer", "Lars2"], "--optimizer: unknown optimizer 'Lars2'; choose from Adagrad, Adam"),
        (["--loss-scaling", "backof"], "--loss-scaling: unknown loss scaling 'backof'"),
        (["--dtype", "float64"], "--dtype (dtype) must be one of float32, float16, bfloat16, mixed"),
        (["--run-dir", ""], "--run-dir (run_dir) must be a path"),
        # the EMA is --ema-momentum's (evaluation and the report follow it): not an optimizer parameter
        (["--optimizer-param", "ema_momentum=0.5"], "must not set ema_momentum: the EMA of the weights is "
                                                     "--ema-momentum"),
        (["--ema-momentum", "none", "--optimizer-param", "use_ema=true"], "must not set use_ema"),
    ],
)
def test_bad_values_are_one_line(tmp_path, capsys, argv, message):
    out = tmp_path / "never"
    assert run("train", "--run-dir", out, *argv, *QUIET) == 2  # a later --run-dir wins
    line = single_line(capsys)
    assert message in line
    assert not out.exists()


def test_argparse_errors_are_one_line(capsys):
    assert run_exit("train", "--bogus") == 2
    line = capsys.readouterr().err.strip()
    assert line.count("\n") == 0 and "unrecognized arguments: --bogus" in line


def run_exit(*argv: str) -> int:
    try:
        return run(*argv)
    except SystemExit as exc:  # argparse exits itself
        return int(exc.code)


def test_an_unexpected_os_error_is_one_line(monkeypatch, capsys):
    def broken(_args):
        raise OSError(errno.EIO, "Input/output error", "/some/file")

    monkeypatch.setattr(cli, "_cmd_train", broken)
    assert run("train") == 2
    assert single_line(capsys) == "optkit train: error: /some/file: Input/output error"


# ------------------------------------------------------------------------------------------------------------
# TOML values of the wrong type


@pytest.mark.parametrize(
    "toml, flag",
    [
        ("optimizer = {a = 1}", "--optimizer (optimizer) must be a name"),
        ('optimizer = ["LARS"]', "--optimizer (optimizer) must be a name"),
        ("lr_policy = [1, 2]", "--lr-policy (lr_policy) must be a name"),
        ("dtype = {x = 1}", "--dtype (dtype) must be a name"),
        ('half_dtype = ["float16"]', "--half-dtype (half_dtype) must be a name"),
        ("run_dir = {x = 1}", "--run-dir (run_dir) must be a path"),
        ("loss_scaling = [1]", "--loss-scaling (loss_scaling) must be a number or Backoff"),
        ("loss_scaling = true", "--loss-scaling (loss_scaling) must be a number or Backoff"),
        ("freeze_variables_regex = 5", "--freeze-variables-regex (freeze_variables_regex) must be a regular"),
        ('summaries = "learning_rate"', "--summaries (summaries) must be a list of names"),
        ('optimizer_params = "momentum=0.9"', "--optimizer-param (optimizer_params) must be a table"),
        ("epochs = {a = 1}", "--epochs (epochs) must be an integer"),
        ("epochs = 1979-05-27", "--epochs (epochs) must be an integer"),
        ('progress = "yes"', "--progress (progress) must be true or false"),
        ("[optimizer_params]\nmomentum = {a = 1}", "--optimizer-param: LARS rejects"),
        ('[lr_policy_params]\nlearning_rate = "fast"', "--lr-policy-param:"),
    ],
)
def test_toml_values_of_the_wrong_type(tmp_path, capsys, monkeypatch, toml, flag):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "run.toml"
    path.write_text(toml + "\n")
    assert run("train", "--config", path, "--max-steps", 2) == 2
    assert flag in single_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]


def test_config_that_is_a_folder(tmp_path, capsys):
    assert run("train", "--config", tmp_path) == 2
    assert f"--config: cannot read {tmp_path}" in single_line(capsys)


# ------------------------------------------------------------------------------------------------------------
# names and per-algorithm defaults


def test_names_in_any_letter_case_are_written_canonically(capsys):
    data = printed_config(capsys, "--optimizer", "lars", "--lr-policy", "COSINE_DECAY", "--dtype", "Mixed")
    assert data["optimizer"] == "LARS" and data["lr_policy"] == "cosine_decay" and data["dtype"] == "mixed"
    # the same optimizer in another case keeps its parameters (it is not "another optimizer")
    assert data["optimizer_params"] == {"momentum": 0.9, "eeta": 0.01, "weight_decay": 1e-4}
    assert printed_config(capsys, "--optimizer", "adam")["optimizer"] == "Adam"
    assert printed_config(capsys, "--loss-scaling", "logmax")["loss_scaling"] == "LogMax"


@pytest.mark.parametrize("name", ["dynamic", "LogMax", "logmax", "BACKOFF"])
def test_each_loss_scaling_gets_its_own_defaults(tmp_path, capsys, name):
    data = printed_config(capsys, "--loss-scaling", name)
    assert data["loss_scaling_params"] == LOSS_SCALING_DEFAULTS[name.lower()]
    assert run("train", "--loss-scaling", name, "--max-steps", 3, "--run-dir", tmp_path / "run", *QUIET) == 0


def test_loss_scaling_params_on_top_of_the_defaults_and_static_scales(capsys):
    data = printed_config(capsys, "--loss-scaling", "dynamic", "--loss-scaling-param", "increment_period=7")
    assert data["loss_scaling_params"] == {**LOSS_SCALING_DEFAULTS["dynamic"], "increment_period": 7}
    assert printed_config(capsys, "--loss-scaling", "128")["loss_scaling_params"] == "none"


# ------------------------------------------------------------------------------------------------------------
# lr-plot

CURVE = ["fixed_lr", "learning_rate=0.1", "--steps", "10"]


def test_lr_plot_unsupported_extension(tmp_path, capsys):
    out = tmp_path / "x.xyz"
    assert run("lr-plot", *CURVE, "--out", out) == 2
    line = single_line(capsys, "lr-plot")
    assert "--out: unsupported extension .xyz" in line and ".png, .svg, .pdf, .jpg" in line
    assert not out.exists()


def test_lr_plot_without_extension_writes_png_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run("lr-plot", *CURVE, "--out", "myplot") == 0
    assert capsys.readouterr().out.strip() == "wrote myplot.png (--out myplot has no extension: .png added)"
    assert (tmp_path / "myplot.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "myplot").exists()


def test_lr_plot_svg(tmp_path, capsys):
    out = tmp_path / "curves.svg"
    assert run("lr-plot", *CURVE, "--out", out) == 0
    assert out.read_text().lstrip().startswith("<?xml") and f"wrote {out}" in capsys.readouterr().out


def test_lr_plot_folder_as_out(tmp_path, capsys):
    assert run("lr-plot", *CURVE, "--out", tmp_path) == 2
    assert f"--out: {tmp_path} is a folder" in single_line(capsys, "lr-plot")


def test_lr_plot_overflow(tmp_path, capsys):
    out = tmp_path / "lr.png"
    argv = [
        "exp_decay",
        "learning_rate=1e300",
        "decay_steps=1",
        "decay_rate=1e300",
        "use_staircase_decay=false",
    ]
    assert run("lr-plot", *argv, "--out", out) == 2
    assert "gives the learning rate inf at step" in single_line(capsys, "lr-plot")
    assert not out.exists()


def test_lr_plot_full_disk(tmp_path, capsys, monkeypatch):
    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full)
    out = tmp_path / "lr.png"
    assert run("lr-plot", *CURVE, "--out", out) == 2
    assert f"--out: cannot write {out}: No space left on device" in single_line(capsys, "lr-plot")
    assert list(tmp_path.iterdir()) == []
