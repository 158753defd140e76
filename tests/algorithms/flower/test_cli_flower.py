"""`pfl flower`: the run config and federation config it writes, and its launch line."""
import json

import pytest

pytest.importorskip("flwr")  # first: on Python 3.10 neither flwr nor tomllib is there

import tomllib  # noqa: E402

from pfl_algorithms.cli import main  # noqa: E402
from pfl_algorithms.flower.client import config_from_key  # noqa: E402


def test_pfl_flower_writes_the_run_config_and_federation_config(tmp_path, capsys):
    assert main(["flower", "fedrep", "--clients", "6", "--rounds", "3", "--set", "samples_per_client=40",
                 "--out", str(tmp_path)]) == 0
    run_config = tomllib.loads((tmp_path / "run_config.toml").read_text())
    config = config_from_key(run_config["pfl-config"])
    assert (config.algorithm, config.clients, config.rounds, config.samples_per_client) == ("fedrep", 6, 3, 40)
    assert run_config["pfl-out"] == str(tmp_path.resolve() / "run")
    federation = tomllib.loads((tmp_path / "federation.toml").read_text())
    assert federation["num-supernodes"] == 6  # flwr run's --federation-config
    assert f"flwr run . local --run-config {tmp_path / 'run_config.toml'} " \
           f"--federation-config {tmp_path / 'federation.toml'}" in capsys.readouterr().out


def test_pfl_flower_refuses_bad_settings_in_one_line(tmp_path, capsys):
    assert main(["flower", "fedavg", "--clients", "0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert json.loads(json.dumps(sorted(p.name for p in tmp_path.iterdir()))) == []


def test_pfl_flower_never_writes_into_a_users_folder(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["flower", "fedavg", "--clients", "3", "--out", str(tmp_path)]) == 2
    assert "is not empty and not an app folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    app = tmp_path / "app"
    for clients in (3, 4):  # its own folder again: the configs are rewritten
        assert main(["flower", "fedavg", "--clients", str(clients), "--out", str(app)]) == 0
    assert sorted(p.name for p in app.iterdir()) == ["federation.toml", "flower.json", "run_config.toml"]
    assert "num-supernodes = 4" in (app / "federation.toml").read_text()


@pytest.mark.parametrize("name", ["run_config.toml", "federation.toml"])
def test_pfl_flower_keeps_a_config_it_did_not_write_or_that_was_edited(tmp_path, capsys, name):
    """A user's run_config.toml (or one the README's recipe edited: a timeout added) was replaced."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / name).write_text('my = "precious"\n')
    app = tmp_path / "app"
    assert main(["flower", "fedavg", "--out", str(app)]) == 0
    with (app / name).open("a") as f:
        f.write("pfl-timeout-s = 60.0\n")
    edited = (app / name).read_text()
    for folder, kept in ((mine, 'my = "precious"\n'), (app, edited)):
        assert main(["flower", "fedavg", "--rounds", "3", "--out", str(folder)]) == 2
        assert f"{name} was not written by `pfl flower` or was edited since, so it is kept" in capsys.readouterr().err
        assert (folder / name).read_text() == kept


@pytest.mark.parametrize("contents", ['{"my": "important settings"}', "not json", '{"format": "pfl-flower"}'])
def test_pfl_flower_keeps_a_flower_json_it_did_not_write(tmp_path, capsys, contents):
    """A folder holding only the user's own flower.json was taken as an app folder and the file
    replaced by the marker."""
    (tmp_path / "flower.json").write_text(contents)
    assert main(["flower", "fedavg", "--out", str(tmp_path)]) == 2
    assert "flower.json was not written by `pfl flower`, so it is kept" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flower.json"]
    assert (tmp_path / "flower.json").read_text() == contents


def test_pfl_flower_writes_the_data_root_absolute(tmp_path, monkeypatch):
    """A relative --data-root was written as given, so the app, started from the project root,
    read another folder or refused it."""
    (tmp_path / "datadir").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["flower", "fedavg", "--data-root", "datadir", "--out", str(tmp_path / "app")]) == 0
    config = config_from_key(tomllib.loads((tmp_path / "app" / "run_config.toml").read_text())["pfl-config"])
    assert config.data_root == str(tmp_path.resolve() / "datadir")


@pytest.mark.parametrize("flags, named", [(["--executor", "batched"], "executor=batched"),
                                          (["--workers", "2"], "workers=2"),
                                          (["--chunk-clients", "4"], "chunk_clients=4"),
                                          (["--set", "batched_conv=gemm"], "batched_conv=gemm")])
def test_pfl_flower_refuses_executor_settings_its_nodes_never_use(tmp_path, capsys, flags, named):
    """They were recorded in the run's config.json, though every node runs sequentially."""
    assert main(["flower", "fedavg", *flags, "--out", str(tmp_path / "app")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pfl: error: {named}: `pfl flower` runs each client's tasks")
    assert not (tmp_path / "app").exists()
    assert main(["flower", "fedavg", "--executor", "sequential", "--out", str(tmp_path / "app")]) == 0


def test_the_server_app_refuses_a_folder_that_is_not_ours_or_already_holds_a_run(tmp_path):
    from pfl_algorithms.flower.app import run_server
    from pfl_algorithms.flower.loopback import LoopbackGrid
    from pfl_algorithms.flower.app import make_client_app

    from .common import small_config

    config = small_config("fedavg", rounds=1, clients=2)
    grid = lambda: LoopbackGrid(make_client_app(config), config.clients)  # noqa: E731
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "metrics.jsonl").write_text("keep me\n")
    with pytest.raises(ValueError, match="is not a pfl run"):
        run_server(config, grid(), out=theirs)
    assert (theirs / "metrics.jsonl").read_text() == "keep me\n"
    out = tmp_path / "run"
    run_server(config, grid(), out=out)
    first = (out / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run"):
        run_server(config, grid(), out=out)
    assert (out / "metrics.jsonl").read_text() == first and (out / "summary.json").exists()
