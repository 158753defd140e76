"""``eval_role``: an evaluation scores only the clients with that role (fda's target, the one
client whose accuracy FedDAF's tables report).  The clients it scores get the same numbers as
when every client is evaluated, training is untouched, and a role the scenario lacks is refused
in one line naming ``eval_role``."""
from __future__ import annotations

import json

import pytest
import torch

from pfl_algorithms.cli import main
from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.federation import EngineSettings, Federation
from pfl_algorithms.runner import run


def fda_config(**overrides) -> RunConfig:
    """Four digits sources and a target, FedAvg-FT (its evaluation fine-tunes every client it scores)."""
    return check(RunConfig(**{**dict(algorithm="fedavg-ft", dataset="digits", scenario="fda", clients=5, rounds=2,
                                    batch_size=16, local_steps=3, workers=1,
                                    scenario_options={"target_fraction": 0.5}), **overrides}))


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_target_only_evaluation_scores_the_target_alike_and_trains_alike(tmp_path):
    every = run(fda_config(), tmp_path / "every", progress=False)
    target = run(fda_config(eval_role="target"), tmp_path / "target", progress=False)
    client = every["target_client"]
    assert target["target_client"] == client == 4
    # Only the target was scored, with the number it gets when every client is scored.
    assert list(target["final_client_accuracy"]) == [client]
    assert len(every["final_client_accuracy"]) == 5
    assert target["target_final_accuracy"] == every["target_final_accuracy"]
    assert target["target_best_accuracy"] == every["target_best_accuracy"]
    assert target["final_mean_accuracy"] == every["target_final_accuracy"]
    # Training is untouched: the same train losses, round by round, and the same communication.
    assert [m["train_loss"] for m in metrics(tmp_path / "target")] == [m["train_loss"] for m in
                                                                         metrics(tmp_path / "every")]
    assert target["comm_gb"] == every["comm_gb"]


@pytest.mark.parametrize("overrides, expected", [
    (dict(scenario="iid", scenario_options={}, eval_role="target"), "scenario 'iid' gives no client roles"),
    (dict(eval_role="sources"), "scenario 'fda' gives the roles source, target"),
])
def test_a_role_the_scenario_lacks_is_refused_naming_eval_role(overrides, expected):
    with pytest.raises(ValueError, match="eval_role='(target|sources)'") as error:
        fda_config(**overrides)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_the_engine_refuses_a_role_its_federation_lacks():
    inputs, labels = torch.randn(12, 3), torch.randint(0, 2, (12,))
    clients = [ClientSplit(torch.arange(0, 4), torch.arange(4, 6), torch.arange(6, 6))] * 2
    with pytest.raises(ValueError, match="eval_role='target' names no role .*roles: source"):
        Federation(torch.nn.Linear(3, 2), inputs, labels, clients, EngineSettings(eval_role="target"),
                   roles={"source": [0]})


def test_the_command_line_flag(tmp_path, capsys):
    assert main(["run", "fedavg", "--dataset", "digits", "--scenario", "fda", "--clients", "3", "--rounds", "1",
                 "--local-steps", "2", "--eval-role", "target", "--out", str(tmp_path / "run"), "--quiet"]) == 0
    evaluated = metrics(tmp_path / "run")[-1]["eval"]["accuracy"]
    assert list(evaluated) == ["2"]
    assert main(["run", "fedavg", "--scenario", "iid", "--eval-role", "target", "--out", str(tmp_path / "x")]) == 2
    assert "eval_role='target'" in capsys.readouterr().err


@pytest.mark.parametrize("algorithm", ["pfedmb", "ifca"])
def test_how_often_a_run_evaluates_changes_no_number_of_its_training(tmp_path, algorithm):
    """Evaluation (here with a fine-tuning epoch first, as pFedMB's tables do) reads the clients'
    state and draws from its own random stream: every 3 rounds or every 5, the train losses, the
    final evaluation and the final checkpoint are the same bit for bit (reproduce's pFedMB table
    evaluates every 5 rounds for cost, so its final accuracies are those of every 3)."""
    from pfl_algorithms.engine.checkpoint import read_checkpoint
    from tests.algorithms.state_checks import assert_same

    def config(every):
        return check(RunConfig(algorithm=algorithm, dataset="digits", scenario="dirichlet", clients=4, rounds=5,
                               local_steps=3, batch_size=16, finetune_epochs=1, eval_every=every, workers=1))

    a = run(config(3), tmp_path / "three", progress=False)
    b = run(config(5), tmp_path / "five", progress=False)
    assert [m["train_loss"] for m in metrics(tmp_path / "three")] == [m["train_loss"] for m in
                                                                       metrics(tmp_path / "five")]
    assert a["final_client_accuracy"] == b["final_client_accuracy"] and a["comm_gb"] == b["comm_gb"]
    assert [m["round"] for m in metrics(tmp_path / "three") if "eval" in m] == [2, 4]
    assert [m["round"] for m in metrics(tmp_path / "five") if "eval" in m] == [4]
    assert_same(read_checkpoint(tmp_path / "three" / "checkpoint.pt")["federation"],
                read_checkpoint(tmp_path / "five" / "checkpoint.pt")["federation"])
