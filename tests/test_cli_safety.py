"""``optkit train`` with files it did not write or folders it must not touch: crafted and misfit checkpoints,
reused and foreign run folders, resumes from elsewhere, failed writes (mocked ``OSError``). Every refusal is
one line on stderr naming the flag or file, exit status 2, and leaves every file as it was."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from optkit import cli  # noqa: E402
from optkit.demo import files, run_folder  # noqa: E402
from optkit.demo.checkpoint import load_checkpoint  # noqa: E402

QUIET = ["--no-progress", "--no-tensorboard", "--no-plot"]
SHORT = ["--max-steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "0", *QUIET]


def run(*argv: object) -> int:
    return cli.main([str(a) for a in argv])


def one_line_error(capsys, *fragments: str) -> str:
    """stderr is a single ``optkit ...: error:`` line holding every fragment (no traceback)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("optkit train: error:"), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, err)
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def trained(tmp_path) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    assert run("train", *SHORT, "--run-dir", out) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002.pt", "step_000004.pt"]
    return out


class _RunsCode:
    """Unpickling this runs ``exec`` (as a crafted checkpoint would): it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


# ------------------------------------------------------------------------------------------------------------
# what --resume reads


def test_real_checkpoints_are_plain_data(trained):
    data = torch.load(trained / "checkpoints" / "step_000004.pt", weights_only=True)
    assert isinstance(data["config"], dict) and data["config"]["optimizer"] == "LARS"
    assert load_checkpoint(trained).step == 4


def test_crafted_pickle_never_runs(tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "step_000010.pt"
    torch.save({"format": "optkit-demo-checkpoint/1", "step": 10, "payload": _RunsCode(marker)}, evil)
    assert run("train", "--resume", evil, "--run-dir", tmp_path / "new", *QUIET) == 2
    one_line_error(
        capsys,
        f"--resume: {evil.resolve()} is not a plain-data checkpoint",
        "(it asks to build exec)",
        "weights_only=True",
    )
    assert not marker.exists()
    assert not (tmp_path / "new").exists()


def test_crafted_pickle_inside_a_run_folder_never_runs(trained, tmp_path, capsys):
    marker = tmp_path / "pwned"
    before = snapshot(trained)
    torch.save({"evil": _RunsCode(marker)}, trained / "checkpoints" / "step_000099.pt")
    assert run("train", "--resume", trained, *QUIET) == 2  # the newest checkpoint is the crafted one
    one_line_error(capsys, "step_000099.pt is not a plain-data checkpoint")
    assert not marker.exists()
    after = snapshot(trained)
    del after["checkpoints/step_000099.pt"]
    assert after == before


def test_truncated_file(trained, capsys):
    ckpt = trained / "checkpoints" / "step_000004.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:4000])
    assert run("train", "--resume", ckpt, *QUIET) == 2
    one_line_error(capsys, f"--resume: cannot read {ckpt}", "truncated")


@pytest.mark.parametrize("content", ["print-config", "# my run\nepochs = 2\n", ""])
def test_a_toml_or_other_file_given_to_resume(tmp_path, capsys, content):
    """A configuration file given to ``--resume`` (meant for ``--config``), or any other file that is not a
    torch checkpoint, is one line naming ``--resume``, what it takes and where a TOML goes (it leaked the
    unpickler's "list index out of range" or claimed the file asked to build code)."""
    if content == "print-config":
        assert run("train", "--print-config") == 0
        content = capsys.readouterr().out
    toml = tmp_path / "my_run.toml"
    toml.write_text(content)
    assert run("train", "--resume", toml, "--run-dir", tmp_path / "new", *QUIET) == 2
    line = one_line_error(
        capsys,
        f"--resume: {toml} is not a checkpoint: --resume takes a run folder made by optkit train or one of "
        "its checkpoint files",
        "a TOML configuration goes to --config",
    )
    assert "list index" not in line and "plain-data" not in line
    assert toml.read_text() == content and not (tmp_path / "new").exists()


def _rewrite(ckpt: Path, change) -> None:
    data = torch.load(ckpt, weights_only=True)
    change(data)
    torch.save(data, ckpt)


def test_truncated_slot_is_refused_before_any_kernel(trained, capsys):
    ckpt = trained / "checkpoints" / "step_000004.pt"
    before = snapshot(trained)

    def truncate(data):
        state = data["train_op"]["optimizer"]["optimizer"]["state"]
        state[4]["momentum"] = state[4]["momentum"][:3].clone()

    _rewrite(ckpt, truncate)
    assert run("train", "--resume", trained, "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "does not fit this run", "state[4].momentum has shape (3, 512)", "(64, 512)")
    after = snapshot(trained)
    assert {k: v for k, v in after.items() if k != "checkpoints/step_000004.pt"} == {
        k: v for k, v in before.items() if k != "checkpoints/step_000004.pt"
    }


def test_another_optimizers_state_is_refused(trained, tmp_path, capsys):
    other = tmp_path / "sgd"
    argv = ["--optimizer", "SGD", "--optimizer-param", "momentum=0.9", "--run-dir", other]
    assert run("train", *SHORT, *argv) == 0
    sgd_state = torch.load(other / "checkpoints" / "step_000004.pt", weights_only=True)["train_op"]
    _rewrite(trained / "checkpoints" / "step_000004.pt", lambda d: d.update(train_op=sgd_state))
    assert run("train", "--resume", trained, "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "--resume:", "does not fit this run")


def test_a_wrong_model_tensor_is_refused(trained, capsys):
    def shrink(data):
        data["model"]["6.weight"] = data["model"]["6.weight"][:, :100].clone()

    _rewrite(trained / "checkpoints" / "step_000004.pt", shrink)
    assert run("train", "--resume", trained, "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "model.6.weight has shape (64, 100)")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(format="something else"), "is not an optkit demo checkpoint"),
        (lambda d: d.update(step=-1), "'step' is not a whole number"),
        (lambda d: d.update(history="nope"), "'history' is not a table"),
        (lambda d: d["history"]["train"].update(loss="x"), "columns must be lists of numbers"),
        (lambda d: d.update(config=[1, 2]), "'config' is not a table"),
        (lambda d: d.update(model={"0.weight": 3}), "is not a named tensor"),
    ],
)
def test_checkpoint_layout_is_checked(trained, capsys, change, message):
    _rewrite(trained / "checkpoints" / "step_000004.pt", change)
    assert run("train", "--resume", trained, *QUIET) == 2
    one_line_error(capsys, message)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.update(global_step=torch.tensor(float("nan"))), "train_op.global_step is nan"),
        (lambda t: t.update(global_step=torch.tensor(2.5)), "'global_step' must be a whole number in"),
        (lambda t: t.update(global_step=torch.tensor(-3)), "'global_step' must be a whole number in"),
        (lambda t: t["scaler"].update(scale=torch.tensor(float("inf"))), "train_op.scaler.scale is inf"),
        (lambda t: t.update(micro=7), "'micro' must be < iter_size"),
        (lambda t: t["scaler"].update(scale=torch.empty((), device="meta")),
         "train_op.scaler.scale is 'a tensor without data'"),
    ],
    ids=["nan-step", "fractional-step", "negative-step", "inf-scale", "micro", "meta-scale"],
)
def test_non_finite_or_impossible_counters_are_refused(trained, capsys, change, message):
    ckpt = trained / "checkpoints" / "step_000004.pt"
    _rewrite(ckpt, lambda d: change(d["train_op"]))
    before = snapshot(trained)
    assert run("train", "--resume", trained, "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, f"--resume: {ckpt} does not fit this run", message)
    assert snapshot(trained) == before


# ------------------------------------------------------------------------------------------------------------
# where a run writes


def test_a_run_folder_is_never_reused(trained, capsys):
    before = snapshot(trained)
    assert run("train", *SHORT, "--run-dir", trained, "--seed", 1) == 2
    one_line_error(capsys, f"--run-dir: {trained} is an optkit run", f"--resume {trained}")
    assert snapshot(trained) == before


def test_a_non_empty_folder_is_refused_and_an_empty_one_is_used(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert run("train", *SHORT, "--run-dir", tmp_path) == 2
    one_line_error(capsys, f"--run-dir: {tmp_path} is not empty (notes.txt)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("train", *SHORT, "--run-dir", empty) == 0
    assert run_folder.is_run_folder(empty)


def test_a_file_is_not_a_run_folder(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert run("train", *SHORT, "--run-dir", f) == 2
    one_line_error(capsys, f"--run-dir: {f} exists and is not a folder")
    assert run("train", *SHORT, "--run-dir", f / "sub") == 2
    one_line_error(capsys, f"--run-dir: cannot create {f / 'sub'}: {f} is not a folder")
    assert f.read_text() == "x"


def test_default_folders_never_collide(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class Frozen:
        @staticmethod
        def now():
            from datetime import datetime

            return datetime(2026, 11, 23, 10, 15, 0)

    monkeypatch.setattr(run_folder, "datetime", Frozen)
    first = run_folder.create_run_dir(None)
    second = run_folder.create_run_dir(None)
    assert first == Path("runs/20261123-101500") and second == Path("runs/20261123-101500-2")
    assert run_folder.is_run_folder(first) and run_folder.is_run_folder(second)


def test_resume_from_outside_a_run_folder_is_refused(trained, tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    (home / "Downloads").mkdir(parents=True)
    (home / "precious.txt").write_text("keep")
    (trained / "checkpoints" / "step_000004.pt").replace(home / "Downloads" / "step_000004.pt")
    monkeypatch.setenv("HOME", str(home))
    before = snapshot(home)
    assert run("train", "--resume", "~/Downloads/step_000004.pt", "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "is not inside an optkit run folder", "--run-dir NEW_FOLDER")
    assert snapshot(home) == before
    # with a new folder it continues there (the file is only read)
    new = tmp_path / "continued"
    assert (
        run("train", "--resume", "~/Downloads/step_000004.pt", "--max-steps", 6, "--run-dir", new, *QUIET)
        == 0
    )
    assert snapshot(home) == before
    assert [p.name for p in run_folder.list_checkpoints(new)] == ["step_000006.pt"]


def test_a_folder_without_the_marker_is_not_resumed(trained, capsys):
    (trained / run_folder.MARKER).unlink()
    before = snapshot(trained)
    assert run("train", "--resume", trained, "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "is not an optkit run folder: it has no optkit-run.json")
    assert run("train", "--resume", trained / "checkpoints" / "step_000004.pt", "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "is not inside an optkit run folder")
    assert snapshot(trained) == before


def test_the_checkpoint_does_not_decide_where_output_goes_or_what_is_pruned(trained, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "step_000001.pt").write_text("not ours")

    def redirect(data):
        data["config"].update(run_dir=str(elsewhere), keep_checkpoints=1)

    _rewrite(trained / "checkpoints" / "step_000002.pt", redirect)
    assert (
        run(
            "train",
            "--resume",
            trained / "checkpoints" / "step_000002.pt",
            "--max-steps",
            6,
            "--checkpoint-every",
            2,
            *QUIET,
        )
        == 0
    )
    assert sorted(p.name for p in elsewhere.iterdir()) == ["step_000001.pt"]
    names = [p.name for p in run_folder.list_checkpoints(trained)]
    assert names == ["step_000002.pt", "step_000004.pt", "step_000006.pt"]  # nothing pruned
    assert json.loads((trained / "metrics.json").read_text())["config"]["run_dir"] == str(trained.resolve())


def test_pruning_deletes_only_this_runs_checkpoints(trained, tmp_path):
    ckpts = trained / "checkpoints"
    outside = tmp_path / "outside.pt"
    outside.write_text("target of a link")
    (ckpts / "notes.txt").write_text("mine")
    (ckpts / "best.pt").write_text("mine")
    (ckpts / "step_1.pt").write_text("mine")
    os.symlink(outside, ckpts / "step_000001.pt")
    assert (
        run(
            "train",
            "--resume",
            trained,
            "--max-steps",
            8,
            "--checkpoint-every",
            2,
            "--keep-checkpoints",
            1,
            *QUIET,
        )
        == 0
    )
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "best.pt",
        "notes.txt",
        "step_000001.pt",
        "step_000008.pt",
        "step_1.pt",
    ]
    assert outside.read_text() == "target of a link"


def test_resume_keeps_the_optimizer_and_precision(trained, capsys):
    before = snapshot(trained)
    assert run("train", "--resume", trained, "--optimizer", "Adam", "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "--optimizer: the run of", "'LARS', not 'Adam'")
    assert run("train", "--resume", trained, "--dtype", "float32", "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, "--dtype:", "'mixed', not 'float32'")
    assert snapshot(trained) == before
    assert json.loads((trained / "metrics.json").read_text())["config"]["optimizer"] == "LARS"
    # the same names in another letter case are the same optimizer and dtype
    assert (
        run("train", "--resume", trained, "--optimizer", "lars", "--dtype", "MIXED", "--max-steps", 6, *QUIET)
        == 0
    )
    assert json.loads((trained / "metrics.json").read_text())["config"]["optimizer"] == "LARS"


def test_resume_keeps_the_loss_scaler_settings(trained, capsys):
    """The loaded scaler keeps the settings saved with its state: a changed --loss-scaling-param would be
    ignored while metrics.json recorded it, so it is refused."""
    before = snapshot(trained)
    assert run("train", "--resume", trained, "--loss-scaling-param", "scale_min=2", "--max-steps", 6,
               *QUIET) == 2
    one_line_error(capsys, "--loss-scaling-param: the run of", "a resumed run keeps it")
    assert snapshot(trained) == before


def test_resume_past_the_planned_end_is_refused(trained, capsys):
    assert run("train", "--resume", trained, "--max-steps", 3, *QUIET) == 2
    one_line_error(capsys, "is at step 4, past the end of this run (3 steps)")


def test_a_new_folder_for_a_continuation_follows_the_new_run_rules(trained, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert run("train", "--resume", trained, "--max-steps", 6, "--run-dir", busy, *QUIET) == 2
    one_line_error(capsys, f"--run-dir: {busy} is not empty")


# ------------------------------------------------------------------------------------------------------------
# failed writes: one line, nothing half-written


def _no_temporaries(folder: Path) -> None:
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


def test_full_disk_while_saving_a_checkpoint(tmp_path, monkeypatch, capsys):
    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "run"
    assert run("train", *SHORT, "--run-dir", out) == 2
    one_line_error(capsys, f"cannot write {out / 'checkpoints' / 'step_000002.pt'}: No space left on device")
    _no_temporaries(out)
    assert run_folder.list_checkpoints(out) == []


def test_failed_rename_of_metrics(tmp_path, monkeypatch, capsys):
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith("metrics.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(files.os, "replace", replace)
    out = tmp_path / "run"
    assert run("train", *SHORT, "--run-dir", out) == 2
    one_line_error(capsys, f"cannot write {out / 'metrics.json'}")
    _no_temporaries(out)
    assert not (out / "metrics.json").exists()
    assert [p.name for p in run_folder.list_checkpoints(out)] == ["step_000002.pt", "step_000004.pt"]


def test_read_only_parent(tmp_path, monkeypatch, capsys):
    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", denied)
    out = tmp_path / "run"
    assert run("train", *SHORT, "--run-dir", out) == 2
    one_line_error(capsys, f"--run-dir: cannot create {out}: Permission denied")
    assert not out.exists()


def test_marker_write_failure_removes_the_new_folder(tmp_path, monkeypatch, capsys):
    def denied(*_args, **_kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files.os, "open", denied)
    out = tmp_path / "a" / "run"
    assert run("train", *SHORT, "--run-dir", out) == 2
    one_line_error(capsys, "--run-dir:", f"cannot write {out / run_folder.MARKER}: Permission denied")
    assert not (tmp_path / "a").exists()


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("old")

    def boom(fh):
        fh.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(files.ConfigError, match="No space left"):
        files.atomic_write(target, boom)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


# ------------------------------------------------------------------------------------------------------------
# values no run makes (the file's own configuration says how far its run can have come)


def _set(*path: object, value: object):
    def change(data):
        for key in path[:-1]:
            data = data[key]
        data[path[-1]] = value

    return change


def _fill(*path: object, value: float):
    def change(data):
        for key in path:
            data = data[key]
        data.fill_(value)

    return change


def _every_slot(slot: str, value: object):
    def change(data):
        for slots in data["train_op"]["optimizer"]["optimizer"]["state"].values():
            slots[slot] = value.clone()

    return change


_OPT = ("train_op", "optimizer", "optimizer")
_WRAPPER = ("train_op", "optimizer", "wrapper")


@pytest.mark.parametrize(
    "change, message",
    [
        (_set("train_op", "global_step", value=torch.tensor(10**6)),
         "train_op.global_step is 1000000, but at step 4 with --iter-size 1 the run has made at most 4 "
         "updates"),
        (_set("train_op", "global_step", value=torch.tensor(5)), "train_op.global_step is 5"),
        (_set("train_op", "summary_attempts", value=9), "train_op.summary_attempts is 9"),
        (_set("train_op", "scaler", "iteration", value=torch.tensor(50)), "train_op.scaler.iteration is 50"),
        (_every_slot("step", torch.tensor(10**6)), "train_op.optimizer.optimizer.state[0].step is 1e+06"),
        (_set("step", value=5), "it is at step 5, past the end of the run that wrote it (4 steps)"),
        (_set("train_op", "scaler", "scale", value=torch.tensor(1e30)),
         "train_op.scaler.scale is 1e+30, outside the scaler's range [1, 1.67772e+07]"),
        (_set("train_op", "scaler", "scale", value=torch.tensor(0.25)),
         "train_op.scaler.scale is 0.25, outside"),
        (_fill(*_WRAPPER, "masters", 0, value=float("nan")),
         "train_op.optimizer.wrapper.masters[0] holds NaN"),
        (_fill("model", "3.weight", value=float("nan")), "model.3.weight holds NaN or inf values"),
        (_fill("model", "8.bias", value=float("inf")), "model.8.bias holds NaN or inf values"),
        (_fill(*_OPT, "state", 2, "momentum", value=float("nan")),
         "train_op.optimizer.optimizer.state[2].momentum holds NaN values"),
        (_fill(*_OPT, "state", 7, "average", value=float("-inf")), "state[7].average holds NaN or inf"),
        (_set("train_op", "accumulators", 0, value=torch.full((16, 1, 3, 3), 1e3)),
         "train_op.accumulators[0] holds gradients, but at step 4 with --iter-size 1 no accumulation window"),
        (_set(*_WRAPPER, "loss_scale", value={
            "scale": torch.tensor(1e30), "config": {"loss_scale_value": 1e30, "skip_non_finite": False}}),
         "train_op.optimizer.wrapper.loss_scale.scale is"),
    ],
    ids=["step-1e6", "step-5", "summary-attempts", "scaler-iteration", "slot-step", "past-its-end",
         "scale-above-max", "scale-below-min", "nan-master", "nan-weight", "inf-weight", "nan-momentum",
         "inf-ema", "closed-window-sums", "wrapper-scale"],
)
def test_values_no_run_makes_are_refused(trained, capsys, change, message):
    """A 4-step run at step 4 (iter_size 1: 4 update attempts, at most 4 updates) with the default Backoff
    scaler (scale in [1, 2^24]) and fp16 weights with fp32 masters: each tampered value is refused, nothing
    is written, even where a longer continuation (--max-steps 6) is asked for."""
    ckpt = trained / "checkpoints" / "step_000004.pt"
    _rewrite(ckpt, change)
    before = snapshot(trained)
    assert run("train", "--resume", trained, "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, f"--resume: {ckpt}", message)
    assert snapshot(trained) == before


def test_window_and_skip_free_counts_follow_the_step(tmp_path, capsys):
    """--iter-size 2: a checkpoint at step 3 holds one micro-batch of the open window and 1 update attempt;
    with a fixed loss scale no update is skipped, so the applied updates equal the attempts."""
    out = tmp_path / "window"
    assert run("train", "--iter-size", 2, "--max-steps", 3, "--checkpoint-every", 3, "--run-dir", out,
               "--loss-scaling", 8, *QUIET) == 0
    ckpt = out / "checkpoints" / "step_000003.pt"
    good = ckpt.read_bytes()
    state = torch.load(ckpt, weights_only=True)["train_op"]
    assert (state["micro"], state["summary_attempts"], int(state["global_step"])) == (1, 1, 1)

    _rewrite(ckpt, _set("train_op", "micro", value=0))
    assert run("train", "--resume", out, "--max-steps", 5, *QUIET) == 2
    one_line_error(capsys, "train_op.micro is 0, but at step 3 with --iter-size 2 the open window holds 1")

    ckpt.write_bytes(good)
    _rewrite(ckpt, _set("train_op", "global_step", value=torch.tensor(0)))
    _rewrite(ckpt, _set("train_op", "host_step", value=0))
    assert run("train", "--resume", out, "--max-steps", 5, *QUIET) == 2
    one_line_error(capsys, "train_op.global_step is 0", "a run that skips no update has made 1")

    ckpt.write_bytes(good)
    assert run("train", "--resume", out, "--max-steps", 5, "--checkpoint-every", 5, *QUIET) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--loss-scaling", "dynamic", "--dtype", "float32"],
        ["--loss-scaling", "LogMax", "--iter-size", "3"],
        ["--optimizer", "Adam", "--loss-scaling", "1", "--loss-scaling-param", "none",
         "--clip-gradients", "none", "--ema-momentum", "none"],
    ],
    ids=["default", "dynamic-fp32", "logmax-window", "adam-fixed"],
)
def test_continuations_of_continuations_are_accepted(tmp_path, capsys, argv):
    """What the demo writes always resumes, also after a resume that made the run longer: the checkpoint
    then records the longer run (step 6 of --max-steps 6 written by a continuation of a 4-step run)."""
    out = tmp_path / "run"
    assert run("train", *SHORT, *argv, "--run-dir", out) == 0
    assert run("train", "--resume", out, "--max-steps", 7, "--checkpoint-every", 5, *QUIET) == 0
    assert run("train", "--resume", out, "--max-steps", 8, *QUIET) == 0
    assert run_folder.list_checkpoints(out)[-1].name == "step_000008.pt"
    capsys.readouterr()


# ------------------------------------------------------------------------------------------------------------
# a full disk inside torch.save, a read-only run folder


def test_full_disk_inside_torch_save(tmp_path, monkeypatch, capsys):
    """torch.save reports a stream that cannot be written as a RuntimeError ("[enforce fail at
    inline_container.cc:672] . unexpected pos ..."), not as an OSError."""

    def cut_short(data, fh, *args, **kwargs):
        fh.write(b"PK\x03\x04" + bytes(4096))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(torch, "save", cut_short)
    out = tmp_path / "run"
    assert run("train", *SHORT, "--run-dir", out) == 2
    one_line_error(capsys, f"cannot write {out / 'checkpoints' / 'step_000002.pt'}: ", "unexpected pos")
    _no_temporaries(out)
    assert run_folder.list_checkpoints(out) == []


class _FillingDisk:
    """A file object whose disk is full after ``room`` bytes (ENOSPC from ``write``/``flush``)."""

    def __init__(self, fh, room: int) -> None:
        self.fh, self.room = fh, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.fh.write(data)

    def __getattr__(self, name):
        return getattr(self.fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.fh.close()


def test_disk_filling_up_during_a_real_torch_save(tmp_path, monkeypatch, capsys):
    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        fh = real_fdopen(fd, mode, *args, **kwargs)
        return _FillingDisk(fh, 20_000) if "w" in mode else fh

    monkeypatch.setattr(files.os, "fdopen", fdopen)
    out = tmp_path / "run"
    assert run("train", *SHORT, "--run-dir", out) == 2
    one_line_error(capsys, f"cannot write {out / 'checkpoints' / 'step_000002.pt'}: No space left on device")
    _no_temporaries(out)
    assert run_folder.list_checkpoints(out) == []


def _read_only(monkeypatch, folder: Path, folders: bool = True) -> None:
    """Creating or writing any file (and with ``folders`` any folder) below ``folder`` fails as on a
    read-only mount (os.open, open, os.mkdir)."""
    real_os_open, real_open, real_mkdir = os.open, io.open, os.mkdir
    inside = str(folder.resolve())

    def refuse(path) -> None:
        name = os.path.abspath(os.fsdecode(path))
        if name == inside or name.startswith(inside + os.sep):
            raise OSError(errno.EROFS, "Read-only file system", name)

    def os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def open_(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if not os.path.lexists(path):  # an existing name gives EEXIST, as on a read-only mount
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", os_open)
    if folders:
        monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(io, "open", open_)
    monkeypatch.setattr(builtins, "open", open_)


@pytest.fixture
def writer_threads(monkeypatch) -> list:
    """The TensorBoard event writers' background threads started during the test."""
    from tensorboard.summary.writer import event_file_writer

    started: list = []
    real_start = event_file_writer._AsyncWriterThread.start

    def start(self):
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(event_file_writer._AsyncWriterThread, "start", start)
    return started


def test_resume_in_a_read_only_run_folder_starts_no_writer(tmp_path, monkeypatch, capsys, writer_threads):
    """One line, and no TensorBoard writer thread: its failing first write would print a second traceback
    ("Exception in thread Thread-1") after the error."""
    out = tmp_path / "run"
    assert run("train", "--max-steps", 2, "--tensorboard", "--no-progress", "--no-plot", "--run-dir", out) \
        == 0
    assert (out / "tensorboard").is_dir()
    before = snapshot(out)
    writer_threads.clear()
    _read_only(monkeypatch, out)
    assert run("train", "--resume", out, "--max-steps", 4, "--no-progress", "--no-plot") == 2
    assert writer_threads == []
    one_line_error(capsys, f"cannot write {out}: Read-only file system")
    monkeypatch.undo()
    assert snapshot(out) == before


def test_tensorboard_folder_without_room_for_files_starts_no_writer(
    tmp_path, monkeypatch, capsys, writer_threads
):
    """The folder can be made but takes no file: the writer is not started either."""
    out = tmp_path / "run"
    _read_only(monkeypatch, out / "tensorboard", folders=False)
    assert run("train", *SHORT, "--tensorboard", "--run-dir", out) == 2
    assert writer_threads == []
    one_line_error(capsys, f"cannot write {out / 'tensorboard'}: Read-only file system")


def test_an_overflowed_second_moment_resumes(tmp_path, capsys):
    """A float16 second moment (Adam's ``exp_avg_sq``) overflows to inf from finite gradients (|g| > 256)
    and training goes on (the update of those elements is 0): a checkpoint holding one resumes (set here in
    a float32 run's slot: the check is the same). NaN in it does not."""
    out = tmp_path / "adam"
    assert run("train", *SHORT, "--optimizer", "Adam", "--dtype", "float32", "--loss-scaling", "1",
               "--loss-scaling-param", "none", "--run-dir", out) == 0
    ckpt = run_folder.list_checkpoints(out)[-1]
    good = ckpt.read_bytes()
    _rewrite(ckpt, _fill("train_op", "optimizer", "state", 0, "exp_avg_sq", value=float("nan")))
    assert run("train", "--resume", out, "--max-steps", 6, *QUIET) == 2
    one_line_error(capsys, f"--resume: {ckpt}", "exp_avg_sq holds NaN values")
    ckpt.write_bytes(good)
    _rewrite(ckpt, _fill("train_op", "optimizer", "state", 0, "exp_avg_sq", value=float("inf")))
    assert run("train", "--resume", out, "--max-steps", 6, "--checkpoint-every", 6, *QUIET) == 0
    capsys.readouterr()
