"""``--finetune-epochs``: local fine-tuning before evaluation, for every algorithm, run by the
executor as part of each client's evaluation task; it changes evaluation and nothing else."""
from __future__ import annotations

import json

import pytest

from pfl_algorithms.algorithms import ALGORITHMS, make_algorithm
from pfl_algorithms.cli import main
from pfl_algorithms.engine.plan import finetune_phase
from pfl_algorithms.engine.rounds import run_round
from pfl_algorithms.runner import run

from ..algorithms.federation_cases import make_federation
from ..state_checks import assert_same
from ..test_cli import TINY, tiny_config


def rounds(name, finetune_epochs, executor="threaded", workers=2):
    algo = make_algorithm(name)
    fed = make_federation(algo, rounds=2, finetune_epochs=finetune_epochs, executor=executor, workers=workers,
                          optimizer_settings={"lr": 0.1, "momentum": 0.9})
    records = [run_round(fed, algo, r).as_dict() for r in range(2)]
    for r in records:
        r.pop("wall_s")
    return records, fed.state_dict(), algo.state_dict()


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_finetuning_changes_evaluation_only_and_is_executor_independent(name):
    plain, tuned = rounds(name, 0), rounds(name, 2)
    assert_same(tuned[1:], plain[1:])  # the same training: banks, optimizer state, server state
    strip = lambda records: [{k: v for k, v in r.items() if k != "eval"} for r in records]  # noqa: E731
    assert_same(strip(tuned[0]), strip(plain[0]))  # losses (NaN for a client that trained no batch), bits, clients
    assert [r["eval"] for r in tuned[0]] != [r["eval"] for r in plain[0]]  # evaluation did change
    assert_same(rounds(name, 2, executor="sequential", workers=None), tuned)


def test_the_phase_trains_what_the_local_plan_trains():
    assert finetune_phase(make_algorithm("fedavg"), 0, 3).groups is None
    assert finetune_phase(make_algorithm("fedrep"), 0, 3).groups == ("body", "head")
    pfedmb = make_algorithm("pfedmb")
    make_federation(pfedmb)  # converts the model: its groups exist from then on
    phase = finetune_phase(pfedmb, 0, 2)
    assert (phase.epochs, phase.groups) == (2, ("alpha", "branches", "head"))


def test_the_cli_records_it_and_resume_keeps_it(tmp_path):
    out = tmp_path / "r"
    assert main(["run", "fedavg", *TINY, "--finetune-epochs", "2", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["finetune_epochs"] == 2
    config = tiny_config(finetune_epochs=2, rounds=4)
    whole = run(config, tmp_path / "whole", progress=False)
    run(config, tmp_path / "killed", progress=False, stop_after=2)
    resumed = run(config, tmp_path / "killed", resume=True, progress=False)
    assert resumed["final_mean_accuracy"] == whole["final_mean_accuracy"]
    metrics = lambda d: [{k: v for k, v in json.loads(line).items() if k != "wall_s"}  # noqa: E731
                         for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
    assert metrics("killed") == metrics("whole") and len(metrics("whole")) == 4
    assert json.loads((tmp_path / "killed" / "config.json").read_text())["finetune_epochs"] == 2


def test_bad_values_name_the_flag(capsys):
    assert main(["run", "fedavg", "--finetune-epochs", "1.5", "--quiet"]) == 2
    assert "--finetune-epochs" in capsys.readouterr().err
