"""`pfl flower`: the run config and federation config it writes, and its launch line."""
import json
import tomllib

import pytest

pytest.importorskip("flwr")

from pfl_algorithms.cli import main  # noqa: E402
from pfl_algorithms.flower.client import config_from_key  # noqa: E402


def test_pfl_flower_writes_the_run_config_and_federation_config(tmp_path, capsys):
    assert main(["flower", "fedrep", "--clients", "6", "--rounds", "3", "--set", "samples_per_client=40",
                 "--out", str(tmp_path)]) == 0
    run_config = tomllib.loads((tmp_path / "run_config.toml").read_text())
    config = config_from_key(run_config["pfl-config"])
    assert (config.algorithm, config.clients, config.rounds, config.samples_per_client) == ("fedrep", 6, 3, 40)
    assert run_config["pfl-out"] == str(tmp_path.resolve())
    federation = tomllib.loads((tmp_path / "federation.toml").read_text())
    assert federation["tool"]["flwr"]["federations"]["local-simulation"]["options"]["num-supernodes"] == 6
    assert "flwr run . local-simulation --run-config" in capsys.readouterr().out


def test_pfl_flower_refuses_bad_settings_in_one_line(tmp_path, capsys):
    assert main(["flower", "fedavg", "--clients", "0", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert json.loads(json.dumps(sorted(p.name for p in tmp_path.iterdir()))) == []
