"""Resume never runs code, never loads a corrupted or foreign checkpoint, never trusts an
edited config.json, never drops an intact metrics line, and always has a way out."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import struct
import zipfile

import pytest
import torch

from pfl_algorithms.cli import main
from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.engine.rundir import RunDirectory
from pfl_algorithms.runner import run
from tests.algorithms.test_cli import TINY, tiny_config
from tests.algorithms.test_rundir import one_line_error


class RunsCode:
    """Unpickling this creates ``marker``: what a crafted checkpoint could do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def malicious_state(marker) -> dict:
    return {"run_id": "x", "config": {}, "federation": {"round": RunsCode(marker)}, "algorithm": {}}


def bare_pickle(state) -> bytes:
    """``state`` as plain ``torch.save`` writes it (a checkpoint of older versions)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def with_valid_header(state) -> bytes:
    """``state`` with a correct checksum header: the payload itself must be refused."""
    payload = bare_pickle(state)
    header = {"sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload), "version": 1}
    return b"pfl-checkpoint " + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def metric_rounds(out) -> list[int]:
    return [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ item 1: no code from a checkpoint

@pytest.mark.parametrize("encode", [bare_pickle, with_valid_header])
def test_a_crafted_checkpoint_runs_nothing_on_resume(tmp_path, capsys, encode):
    out, marker = tmp_path / "r", tmp_path / "pwned"
    run(tiny_config(), out, progress=False, stop_after=1)
    (out / "checkpoint.pt").write_bytes(encode(malicious_state(marker)))
    assert main(["run", "fedavg", *TINY, "--out", str(out), "--resume"]) == 2
    err = one_line_error(capsys, str(out / "checkpoint.pt"), "refusing")
    assert not marker.exists()
    if encode is with_valid_header:  # past the header: the line names what torch refused, not its advice
        assert "Unsupported global" in err and ".open" in err and "weights_only" not in err, err


@pytest.mark.parametrize("encode", [bare_pickle, with_valid_header])
def test_a_crafted_checkpoint_runs_nothing_in_the_demo(tmp_path, capsys, encode):
    """``pfl demo`` resumes the runs it finds: a planted checkpoint must not run either."""
    from pfl_algorithms.demo import TESTBEDS, demo_config

    out, marker = tmp_path / "demo", tmp_path / "pwned"
    run_dir = out / "permuted" / "local-seed0"
    run_dir.mkdir(parents=True)
    config = demo_config(TESTBEDS["digits"], "local", "permuted", rounds=1, seed=0, data_root=None)
    (run_dir / "run.json").write_text(json.dumps({"format": "pfl-run", "version": 1, "run_id": "0" * 32,
                                                  "created": "2024-01-01T00:00:00+00:00"}))
    (run_dir / "config.json").write_text(json.dumps(config.as_dict()))
    (run_dir / "checkpoint.pt").write_bytes(encode(malicious_state(marker)))
    assert main(["demo", "--algorithms", "local", "--out", str(out), "--rounds", "1", "--quiet",
                 "--dataset", "digits"]) == 2
    one_line_error(capsys, str(run_dir / "checkpoint.pt"), "refusing")
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["params shape", "no comm", "no round"])
def test_a_checkpoint_that_does_not_fit_the_run_is_a_clear_error(tmp_path, capsys, damage):
    from pfl_algorithms.engine.checkpoint import read_checkpoint

    out = tmp_path / "r"
    run(tiny_config(), out, progress=False, stop_after=1)
    state = read_checkpoint(out / "checkpoint.pt")
    if damage == "params shape":
        cohort = state["federation"]["cohorts"]["model"]
        cohort["params"] = cohort["params"][:, :-1]
    elif damage == "no comm":
        del state["federation"]["comm"]
    else:
        del state["federation"]["round"]
    (out / "checkpoint.pt").write_bytes(with_valid_header(state))
    assert main(["run", "fedavg", *TINY, "--out", str(out), "--resume"]) == 2
    one_line_error(capsys, str(out / "checkpoint.pt"), "does not fit")


# ------------------------------------------------------------------ item 2: integrity

def largest_tensor_offset(data: bytes) -> tuple[int, int]:
    """(offset, size) in the file of the largest tensor's bytes in the torch.save zip (found
    wherever the zip starts, as zipfile allows data before it)."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


@pytest.mark.parametrize("damage", ["flip tensor bytes", "flip header digit", "truncate", "append"])
def test_a_corrupted_checkpoint_is_refused(tmp_path, capsys, damage):
    out = tmp_path / "r"
    run(tiny_config(rounds=4), out, progress=False, stop_after=2)
    path = out / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    if damage == "flip tensor bytes":
        offset, size = largest_tensor_offset(bytes(data))
        data[offset + size // 2] ^= 0x40
        data[offset + size // 2 + 1] ^= 0x01
    elif damage == "flip header digit":
        at = data.index(b'"sha256": "') + 12
        data[at] = ord("0") if data[at] != ord("0") else ord("1")
    elif damage == "truncate":
        del data[-100:]
    else:
        data += b"\0" * 8
    path.write_bytes(bytes(data))
    assert main(["run", "fedavg", *TINY, "--out", str(out), "--resume"]) == 2
    one_line_error(capsys, str(path), "corrupt")
    assert metric_rounds(out) == [0, 1]  # nothing was run or rewritten


# ------------------------------------------------------------------ item 8: resume never destroys or mixes

def test_one_corrupt_metrics_line_loses_only_itself(tmp_path, capsys):
    config = tiny_config(rounds=5, checkpoint_every=1)
    whole = run(config, tmp_path / "whole", progress=False)
    out = tmp_path / "r"
    run(config, out, progress=False, stop_after=3)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = '{"round": 1, "train_lo\x00ss": [1, 2\n'  # round 1's line damaged; 0 and 2 intact
    lines.append('{"round": 3, "partial": tr\n')  # cut by the kill, a round the checkpoint lacks
    (out / "metrics.jsonl").write_text("".join(lines))
    capsys.readouterr()
    resumed = run(config, out, resume=True, progress=False)
    assert metric_rounds(out) == [0, 2, 3, 4]
    err = capsys.readouterr().err
    assert "warning" in err and "moved to" in err and "round(s) [1]" in err
    aside = list(out.glob("metrics.jsonl.unused-*"))
    assert len(aside) == 1 and aside[0].read_text() == lines[1] + lines[3]
    whole_lines = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    kept = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["train_loss"] for line in kept] == \
           [json.loads(whole_lines[r])["train_loss"] for r in (0, 2, 3, 4)]
    assert resumed["final_mean_accuracy"] == whole["final_mean_accuracy"]


def test_an_edited_config_json_is_refused(tmp_path, capsys):
    out = tmp_path / "r"
    run(tiny_config(rounds=4), out, progress=False, stop_after=2)
    config = json.loads((out / "config.json").read_text())
    config["lr"] = 0.5
    (out / "config.json").write_text(json.dumps(config))
    assert main(["run", "fedavg", "--out", str(out), "--resume", "--quiet"]) == 2
    one_line_error(capsys, "config.json", "checkpoint.pt", "lr (config.json 0.5, checkpoint 0.1)")
    assert metric_rounds(out) == [0, 1]


def test_other_settings_than_the_checkpoint_are_refused(tmp_path):
    out = tmp_path / "r"
    run(tiny_config(rounds=4), out, progress=False, stop_after=2)
    with pytest.raises(ValueError, match=r"settings differ from the saved run in lr \(given 0.2, saved 0.1\)"):
        run(tiny_config(rounds=4, lr=0.2), out, resume=True, progress=False)


def test_another_runs_checkpoint_is_refused(tmp_path):
    config = tiny_config(rounds=4)
    for name in ("a", "b"):
        run(config, tmp_path / name, progress=False, stop_after=2)
    shutil.copy(tmp_path / "a" / "checkpoint.pt", tmp_path / "b" / "checkpoint.pt")
    with pytest.raises(ValueError, match="belongs to another run"):
        run(config, tmp_path / "b", resume=True, progress=False)


def killed_before_first_checkpoint(config, out):
    """A run killed in round 0 after its metrics line, before its checkpoint."""
    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    original = RunDirectory.save_checkpoint
    RunDirectory.save_checkpoint = killed
    try:
        with pytest.raises(KeyboardInterrupt):
            run(config, out, progress=False)
    finally:
        RunDirectory.save_checkpoint = original
    assert not (out / "checkpoint.pt").exists() and metric_rounds(out) == [0]


def test_a_run_killed_before_its_first_checkpoint_can_be_overwritten(tmp_path, capsys):
    out = tmp_path / "r"
    killed_before_first_checkpoint(tiny_config(), out)
    assert main(["run", "fedavg", *TINY, "--out", str(out)]) == 2
    one_line_error(capsys, "--resume", "--overwrite")
    old_id = json.loads((out / "run.json").read_text())["run_id"]
    assert main(["run", "fedavg", *TINY, "--out", str(out), "--overwrite"]) == 0
    assert metric_rounds(out) == [0, 1, 2, 3] and (out / "summary.json").exists()
    assert json.loads((out / "run.json").read_text())["run_id"] != old_id


def test_resuming_a_run_without_a_checkpoint_restarts_it(tmp_path, capsys):
    config = tiny_config()
    whole = run(config, tmp_path / "whole", progress=False)
    out = tmp_path / "r"
    killed_before_first_checkpoint(config, out)
    stopped_line = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["run", "fedavg", "--out", str(out), "--resume", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "has no checkpoint" in err and "restarting it from round 0" in err
    assert metric_rounds(out) == [0, 1, 2, 3]
    assert [p.read_text() for p in out.glob("metrics.jsonl.unused-*")] == [stopped_line]
    assert json.loads((out / "summary.json").read_text())["final_mean_accuracy"] == whole["final_mean_accuracy"]


@pytest.mark.parametrize("checkpoint", [True, False])
def test_other_settings_are_refused_with_or_without_a_checkpoint(tmp_path, capsys, checkpoint):
    """A run stopped before its first checkpoint holds to its config.json as one with a
    checkpoint does: other settings are refused (the same line), nothing is rewritten."""
    out = tmp_path / "r"
    if checkpoint:
        run(tiny_config(), out, progress=False, stop_after=2)
    else:
        killed_before_first_checkpoint(tiny_config(), out)
    before = {name: (out / name).read_bytes() for name in ("run.json", "config.json", "metrics.jsonl")}
    capsys.readouterr()
    assert main(["run", "fedavg", "--out", str(out), "--resume", "--quiet", "--rounds", "3", "--lr", "0.2",
                 "--seed", "7"]) == 2
    one_line_error(capsys, "--resume: the settings differ from the saved run in", "lr (given 0.2, saved 0.1)",
                   "seed (given 7, saved 0)")
    assert {name: (out / name).read_bytes() for name in before} == before


@pytest.mark.parametrize("checkpoint", [True, False])
def test_where_a_run_runs_may_change_on_resume_and_config_json_records_it(tmp_path, checkpoint):
    """The data root, executor and workers are not settings of the experiment (a campaign keeps
    a finished run whatever they were), but --resume refused them: a stopped campaign could not
    go on after its data moved.  The run continues bitwise, config.json names the new values,
    and a second resume holds to them."""
    data_a, data_b = tmp_path / "a", tmp_path / "b"
    data_a.mkdir(), data_b.mkdir()
    whole = run(tiny_config(data_root=str(data_a)), tmp_path / "whole", progress=False)
    out = tmp_path / "r"
    if checkpoint:
        run(tiny_config(data_root=str(data_a), executor="sequential"), out, progress=False, stop_after=2)
    else:
        killed_before_first_checkpoint(tiny_config(data_root=str(data_a), executor="sequential"), out)
    moved = tiny_config(data_root=str(data_b), executor="threaded", workers=2)
    resumed = run(moved, out, resume=True, progress=False)
    assert resumed["final_mean_accuracy"] == whole["final_mean_accuracy"]
    saved = json.loads((out / "config.json").read_text())
    assert (saved["data_root"], saved["executor"], saved["workers"]) == (str(data_b), "threaded", 2)
    assert run(moved, out, resume=True, progress=False)["final_mean_accuracy"] == whole["final_mean_accuracy"]


def test_a_run_without_a_checkpoint_resumes_with_more_rounds(tmp_path, capsys):
    """--rounds alone may change on a restart from round 0, as on a resume from a checkpoint."""
    out = tmp_path / "r"
    killed_before_first_checkpoint(tiny_config(), out)
    assert main(["run", "fedavg", "--out", str(out), "--resume", "--quiet", "--rounds", "5"]) == 0
    assert "restarting it from round 0" in capsys.readouterr().err
    assert metric_rounds(out) == [0, 1, 2, 3, 4]
    assert json.loads((out / "config.json").read_text())["rounds"] == 5


def test_the_demo_restarts_a_run_killed_before_its_first_checkpoint(tmp_path, capsys):
    from pfl_algorithms.demo import TESTBEDS, demo_config

    out = tmp_path / "demo"
    killed_before_first_checkpoint(demo_config(TESTBEDS["digits"], "local", "permuted", rounds=1, seed=0,
                                               data_root=None), out / "permuted" / "local-seed0")
    demo = ["demo", "--algorithms", "local", "--out", str(out), "--quiet", "--dataset", "digits"]
    assert main([*demo, "--rounds", "1"]) == 0
    assert "restarting it from round 0" in capsys.readouterr().err
    assert json.loads((out / "permuted" / "local-seed0" / "summary.json").read_text())["rounds"] == 1
    assert main([*demo, "--rounds", "1"]) == 0
    assert "finished earlier, kept" in capsys.readouterr().out
    assert main([*demo, "--rounds", "2"]) == 0  # more rounds: the finished run goes on
    assert "1 rounds done, continuing to 2" in capsys.readouterr().err
    assert json.loads((out / "permuted" / "local-seed0" / "summary.json").read_text())["rounds"] == 2
    assert main([*demo, "--rounds", "1"]) == 2
    one_line_error(capsys, "other settings", "rounds (now 1, then 2)")


def test_resume_and_overwrite_exclude_each_other(tmp_path, capsys):
    out = tmp_path / "r"
    run(tiny_config(rounds=1), out, progress=False)
    assert main(["run", "fedavg", *TINY, "--out", str(out), "--resume", "--overwrite"]) == 2
    one_line_error(capsys, "--resume", "--overwrite")


def test_resume_of_nothing_is_an_error(tmp_path, capsys):
    assert main(["run", "fedavg", *TINY, "--out", str(tmp_path / "none"), "--resume"]) == 2
    one_line_error(capsys, "holds no run to resume")
    assert not (tmp_path / "none").exists()


def test_the_demo_keeps_a_run_made_before_fields_were_added_and_on_another_executor(tmp_path, capsys):
    """A finished run whose config.json predates ``autocast``/``chunk_clients`` (absent: they
    count at their defaults) and names another executor (not a setting of the experiment) is
    kept; a real difference is still refused."""
    out = tmp_path / "demo"
    demo = ["demo", "--algorithms", "local", "--out", str(out), "--quiet", "--rounds", "1", "--dataset", "digits"]
    assert main(demo) == 0
    path = out / "permuted" / "local-seed0" / "config.json"
    saved = json.loads(path.read_text())
    for field in ("autocast", "chunk_clients"):
        saved.pop(field)
    saved["executor"] = "sequential"
    path.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(demo) == 0
    assert "finished earlier, kept" in capsys.readouterr().out
    saved["lr"] = 0.5
    path.write_text(json.dumps(saved))
    assert main(demo) == 2
    one_line_error(capsys, "other settings", "lr (now 0.05, then 0.5)")


def test_a_run_saved_with_defaults_where_they_did_not_apply_resumes_and_is_kept(tmp_path):
    """Runs made before local_epochs, sample and momentum were None where they do not apply
    recorded 1, 1.0 and 0.9 there (with local_steps, clients_per_round, Adam), which nothing
    read: their config.json and checkpoint read as the same settings, so such a run resumes
    bitwise and a campaign keeps it."""
    from pfl_algorithms.runner import run_or_keep

    def config():
        return tiny_config(optimizer="adam", lr=0.01, local_steps=2, clients_per_round=3)

    assert (config().local_epochs, config().sample, config().momentum) == (None, None, None)
    whole = run(config(), tmp_path / "whole", progress=False)
    old = {"local_epochs": 1, "sample": 1.0, "momentum": 0.9}

    def stopped_as_before(out):
        run(config(), out, progress=False, stop_after=2)
        rundir = RunDirectory(out)
        state = rundir.load_checkpoint()
        state["config"].update(old)
        rundir.save_checkpoint(state)
        rundir.wait_for_checkpoint()
        rundir.config.write_text(json.dumps({**json.loads(rundir.config.read_text()), **old}))
        return rundir

    assert main(["run", "fedavg", "--out", str(stopped_as_before(tmp_path / "cli").root), "--resume", "--quiet"]) == 0
    assert json.loads((tmp_path / "cli" / "summary.json").read_text())["final_mean_accuracy"] == \
        whole["final_mean_accuracy"]
    out = tmp_path / "r"
    rundir = stopped_as_before(out)
    assert run(config(), out, resume=True, progress=False)["final_mean_accuracy"] == whole["final_mean_accuracy"]
    rundir.config.write_text(json.dumps({**json.loads(rundir.config.read_text()), **old}))
    assert run_or_keep(config(), out, progress=False) is True
    with pytest.raises(ValueError, match=r"momentum \(now 0.9, then None\), optimizer"):  # SGD's 0.9 is a setting
        run_or_keep(tiny_config(lr=0.01, local_steps=2, clients_per_round=3), out, progress=False)
