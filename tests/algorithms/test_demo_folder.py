"""``pfl demo --out``: the demo's own folder (``demo.json``) or refused, so a user's report.md or
plots are never written over; a folder an older demo made is adopted only when every entry in it
is the demo's."""
from __future__ import annotations

import json

import pytest

from pfl_algorithms import runner
from pfl_algorithms.cli import main
from pfl_algorithms.demo import claim_demo_folder
from tests.algorithms.state_checks import file_tree

pytest.importorskip("sklearn")

DEMO = ["demo", "--algorithms", "local", "--rounds", "1", "--dataset", "digits", "--quiet"]


def _no_training(*args, **kwargs):
    raise AssertionError("a run started in the user's folder")


def test_a_users_folder_is_refused_and_left_untouched(tmp_path, capsys, monkeypatch):
    out = tmp_path / "mine"
    (out / "plots").mkdir(parents=True)
    (out / "report.md").write_text("# my own report\n")
    (out / "plots" / "permuted.png").write_bytes(b"my plot")
    before = file_tree(out)
    monkeypatch.setattr(runner, "run", _no_training)
    assert main([*DEMO, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pfl: error: --out {out} is not empty (plots, report.md) and is not a folder of `pfl demo` "
                   f"(it has no demo.json); refusing to write into it: choose a new or empty --out"]
    assert file_tree(out) == before


def test_the_demos_folder_is_reused_and_a_file_it_did_not_write_is_refused(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main([*DEMO, "--out", str(out)]) == 0
    marker = json.loads((out / "demo.json").read_text())
    assert marker["format"] == "pfl-demo" and "report.md" in marker["written"]
    assert {f"plots/{key}.png" for key in ("permuted", "mixed")} <= set(marker["written"])
    first = (out / "report.md").read_text()
    assert main([*DEMO, "--out", str(out)]) == 0  # its finished runs kept, its report rewritten
    assert (out / "report.md").read_text() == first
    capsys.readouterr()
    # A file the user put where the demo writes, which the marker does not list, is refused.
    (out / "plots" / "mixed.png").write_bytes(b"the user's")
    marker["written"].remove("plots/mixed.png")
    (out / "demo.json").write_text(json.dumps(marker))
    assert main([*DEMO, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out / 'plots' / 'mixed.png'} was not written by `pfl demo`" in err[0], err
    assert (out / "plots" / "mixed.png").read_bytes() == b"the user's"


def test_a_plot_of_a_table_the_call_leaves_out_goes_unless_it_is_the_users(tmp_path, capsys):
    """plots/ shows what report.md shows: a rerun with other --algorithms removes the demo's own
    plot of a table it no longer reports (it stayed, describing runs the report left out)."""
    out = tmp_path / "demo"
    assert main([*DEMO, "--out", str(out)]) == 0
    assert (out / "plots" / "mixed.png").is_file()
    only_permuted = ["demo", "--algorithms", "fedprox", "--rounds", "1", "--dataset", "digits", "--quiet"]
    (out / "plots" / "fda.png").write_bytes(b"the user's")  # not listed in demo.json: not the demo's
    assert main([*only_permuted, "--out", str(out)]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["fda.png", "permuted.png"]
    assert (out / "plots" / "fda.png").read_bytes() == b"the user's"
    assert "plots/mixed.png" not in (out / "report.md").read_text()


def test_a_folder_an_older_demo_made_is_adopted_only_if_every_entry_is_the_demos(tmp_path):
    out = tmp_path / "old"
    (out / "plots").mkdir(parents=True)
    (out / "permuted" / "local-seed0").mkdir(parents=True)
    (out / "permuted" / "local-seed0" / "run.json").write_text("{}")
    (out / "permuted" / "local-seed0" / "metrics.jsonl").write_text("")
    (out / "plots" / "permuted.png").write_bytes(b"png")
    (out / "report.md").write_text("Testbed: 10 clients\n")
    for stray in (out / "permuted" / "notes.txt", out / "plots" / "mine.png", out / "data.csv"):
        stray.write_text("mine")
        with pytest.raises(ValueError, match="is not empty"):
            claim_demo_folder(out)
        stray.unlink()
    (out / "report.md").write_text("# my own report\n")
    with pytest.raises(ValueError, match="is not empty"):
        claim_demo_folder(out)
    (out / "report.md").unlink()
    (out / "report.md").mkdir()  # not the demo's report: a folder of that name
    with pytest.raises(ValueError, match="is not empty"):
        claim_demo_folder(out)
    (out / "report.md").rmdir()
    (out / "report.md").write_text("Testbed: 10 clients\n")
    claim_demo_folder(out)
    assert json.loads((out / "demo.json").read_text())["written"] == ["report.md", "plots/permuted.png"]


def test_the_marker_must_be_the_demos(tmp_path):
    out = tmp_path / "d"
    out.mkdir()
    (out / "demo.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="demo.json: not a pfl demo marker"):
        claim_demo_folder(out)
    (out / "demo.json").unlink()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        claim_demo_folder(tmp_path / "file")
