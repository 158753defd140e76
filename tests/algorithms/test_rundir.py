"""--out protection: a run writes only into a new, empty or its own directory, holds a lock
on it for the whole run, reports a file or unwritable path before any data loads, and
creates its files with the user's umask."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pfl_algorithms import runner
from pfl_algorithms.cli import main
from pfl_algorithms.engine.rundir import PLOT_FILES
from pfl_algorithms.runner import run
from tests.algorithms.test_cli import TINY, tiny_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_data_loads(monkeypatch):
    """Fail the test if a dataset is loaded (the --out checks must come first)."""
    loaded = []

    def load_run_data(*args, **kwargs):
        loaded.append(args)
        raise AssertionError("the dataset was loaded before the --out checks")

    monkeypatch.setattr(runner, "load_run_data", load_run_data)
    return loaded


def one_line_error(capsys, *fragments) -> str:
    """The command's stderr, checked to be one ``pfl: error:`` line holding ``fragments``."""
    err = capsys.readouterr().err
    assert err.startswith("pfl: error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.mark.parametrize("files", [{"config.json": '{"mine": 1}\n'}, {"notes.txt": "my notes\n"},
                                   {".hidden": "x"}])
@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume"]])
def test_a_directory_that_is_not_a_run_is_never_written(tmp_path, capsys, no_data_loads, files, flag):
    out = tmp_path / "mine"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    assert main(["run", "fedavg", *TINY, "--out", str(out), *flag]) == 2
    one_line_error(capsys, str(out))
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    assert all((out / name).read_text() == text for name, text in files.items())
    assert not no_data_loads


@pytest.mark.parametrize("where", ["file", "below a file"])
def test_an_out_path_that_is_a_file_is_one_line_before_data_loads(tmp_path, capsys, no_data_loads, where):
    file = tmp_path / "results.txt"
    file.write_text("keep me\n")
    out = file if where == "file" else file / "run"
    assert main(["run", "fedavg", *TINY, "--out", str(out)]) == 2
    one_line_error(capsys, str(out))
    assert file.read_text() == "keep me\n" and not no_data_loads


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("exists", [True, False])
def test_a_read_only_out_is_one_line_before_data_loads(tmp_path, capsys, no_data_loads, exists):
    parent = tmp_path / "ro"
    parent.mkdir()
    out = parent if exists else parent / "run"
    parent.chmod(0o555)
    try:
        assert main(["run", "fedavg", *TINY, "--out", str(out)]) == 2
    finally:
        parent.chmod(0o755)
    one_line_error(capsys, str(out), "cannot be written")
    assert not no_data_loads


@pytest.mark.parametrize("exists", [True, False])
def test_an_unwritable_out_is_one_line_before_data_loads(tmp_path, capsys, monkeypatch, no_data_loads, exists):
    """The read-only case as root (who may write anywhere but on a read-only mount): every
    attempt to create a file or folder under ``out`` fails with EROFS."""
    out = tmp_path / "ro"
    if exists:
        out.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def refuse(real):
        def call(path, *args, **kwargs):
            if str(path).startswith(str(out)):
                raise OSError(30, "Read-only file system", str(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", refuse(real_open))
    monkeypatch.setattr(os, "mkdir", refuse(real_mkdir))
    assert main(["run", "fedavg", *TINY, "--out", str(out)]) == 2
    monkeypatch.undo()
    one_line_error(capsys, str(out), "cannot be written", "Read-only file system")
    assert not no_data_loads


def test_a_second_run_into_a_locked_directory_fails_at_once(tmp_path, capsys):
    """While a run goes on, another run into its directory (fresh or --resume) is refused."""
    out = tmp_path / "r"
    errors = []

    def start_another(record):
        if record["round"] == 0:
            errors.append(main(["run", "fedavg", *TINY, "--out", str(out)]))
            errors.append(main(["run", "fedavg", *TINY, "--out", str(out), "--overwrite"]))
            errors.append(capsys.readouterr().err)

    run(tiny_config(), out, progress=False, on_round=start_another)
    assert errors[:2] == [2, 2]
    assert errors[2].count("is in use by another pfl run") == 2 and str(out) in errors[2]
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_a_second_process_cannot_resume_a_running_run(tmp_path):
    """Another process's ``pfl run --resume`` on a directory a run is writing fails at once
    (it used to resume too, and the two interleaved their metrics)."""
    out = tmp_path / "r"
    seen = []

    def resume_from_another_process(record):
        if record["round"] == 1:  # the checkpoint of round 0 exists
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            seen.append(subprocess.run([sys.executable, "-m", "pfl_algorithms", "run", "fedavg", *TINY, "--out",
                                        str(out), "--resume"], capture_output=True, text=True, env=env, cwd=ROOT))

    run(tiny_config(checkpoint_every=1), out, progress=False, on_round=resume_from_another_process)
    other = seen[0]
    assert other.returncode == 2, other.stderr
    assert "is in use by another pfl run" in other.stderr and str(out) in other.stderr
    assert other.stderr.count("\n") == 1
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_a_failed_start_leaves_nothing_behind(tmp_path, capsys, monkeypatch):
    def load_run_data(*args, **kwargs):  # the data fails to load once the directory is claimed
        raise ValueError("mnist: nothing under the data root")

    monkeypatch.setattr(runner, "load_run_data", load_run_data)
    out = tmp_path / "new" / "r"
    assert main(["run", "fedavg", *TINY, "--out", str(out)]) == 2
    assert "nothing" in capsys.readouterr().err
    assert not out.exists()
    # ... and an existing empty directory stays empty.
    out.mkdir()
    assert main(["run", "fedavg", *TINY, "--out", str(out)]) == 2
    assert list(out.iterdir()) == []


def test_an_empty_directory_is_accepted(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    run(tiny_config(rounds=1), out, progress=False)
    identity = json.loads((out / "run.json").read_text())
    assert identity["format"] == "pfl-run" and len(identity["run_id"]) == 32 and identity["created"]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_run_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        run(tiny_config(rounds=2), tmp_path / "r", progress=False)
    finally:
        os.umask(old)
    paths = [tmp_path / "r", *(tmp_path / "r").rglob("*")]
    assert {p.name for p in paths} >= {"config.json", "partition.json", "metrics.jsonl", "summary.json",
                                       "checkpoint.pt"}
    for path in paths:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))


def test_a_resume_removes_the_temporary_files_a_kill_left_and_nothing_else(tmp_path):
    """A kill during an atomic write leaves its temporary file (a checkpoint's is as large as
    the checkpoint); the next run holding the lock removes it, and only files so named."""
    out = tmp_path / "r"
    run(tiny_config(), out, progress=False, stop_after=1)
    stale = out / ".checkpoint.pt.0123456789ab.tmp"
    stale.write_bytes(b"half a checkpoint")
    kept = [out / ".notes.tmp", out / ".checkpoint.pt.tmp", out / "x.0123456789ab.tmp"]
    for path in kept:
        path.write_text("the user's")
    run(tiny_config(), out, resume=True, progress=False)
    assert not stale.exists() and all(path.read_text() == "the user's" for path in kept)


def test_a_refused_second_run_leaves_the_running_ones_temporary_files(tmp_path, capsys):
    out = tmp_path / "r"
    planted, outcome = out / ".metrics.jsonl.0123456789ab.tmp", []

    def second_run(record):
        if record["round"] == 0:
            planted.write_bytes(b"being written")
            outcome.append(main(["run", "fedavg", *TINY, "--out", str(out), "--resume"]))
            outcome.append(planted.exists())

    run(tiny_config(), out, progress=False, on_round=second_run)
    assert outcome == [2, True]


def test_overwrite_replaces_the_runs_plots_and_keeps_the_users_files(tmp_path, capsys):
    """--overwrite removes the files the old run wrote, plots/'s PNGs included, and nothing
    else: a user's file in plots/ or beside it survives."""
    out = tmp_path / "r"
    run(tiny_config(rounds=1), out, progress=False)
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted(PLOT_FILES)  # what begin() removes
    mine = {out / "NOTES.md": "my notes\n", out / "plots" / "mynote.txt": "about the plots\n"}
    for path, text in mine.items():
        path.write_text(text)
    # A replacing run stopped before its plots: none of the old run's is left beside the new one.
    run(tiny_config(rounds=2), out, overwrite=True, progress=False, stop_after=1)
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["mynote.txt"]
    assert all(path.read_text() == text for path, text in mine.items())
    assert main(["run", "fedavg", *TINY, "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in (out / "plots").iterdir()) == sorted([*PLOT_FILES, "mynote.txt"])
    assert all(path.read_text() == text for path, text in mine.items())


def test_overwrite_removes_a_plots_folder_it_empties(tmp_path):
    out = tmp_path / "r"
    run(tiny_config(rounds=1), out, progress=False)
    run(tiny_config(rounds=2), out, overwrite=True, progress=False, stop_after=1)
    assert not (out / "plots").exists()
