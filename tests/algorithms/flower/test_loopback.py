"""Every algorithm through PflStrategy and the ClientApp (the Message API, in process: a
LoopbackGrid) gives bitwise a sequential run's metrics and communication; failures are
survived."""
import logging

import pytest

pytest.importorskip("flwr")

from pfl_algorithms.algorithms import ALGORITHMS  # noqa: E402
from pfl_algorithms.flower.app import run_server  # noqa: E402
from pfl_algorithms.flower.client import make_client_app  # noqa: E402
from pfl_algorithms.flower.loopback import LoopbackGrid  # noqa: E402
from pfl_algorithms.flower.strategy import NO_REPLY  # noqa: E402

from .common import as_json, assert_same_run, native_metrics, small_config  # noqa: E402

pytestmark = pytest.mark.heavy(seconds=40)  # scheduled first under xdist (tests/conftest.py)

logging.getLogger("flwr").setLevel(logging.WARNING)

ARCHITECTURES = ["digits-cnn(embedding_dim=32)", "mlp(hidden=(64, 32))", "fedgen-cnn"]
CHANGES = {"feddaf": dict(scenario="fda"), "fedgp": dict(scenario="fda"), "target-only": dict(scenario="fda"),
           "fedavg-classifier": dict(keep_head_local=False), "fedgen": dict(keep_head_local=False),
           # three architectures; its upload's ClassMeans request is answered on the client
           "fedcma": dict(scenario="dirichlet", clients=6, scenario_options={"architectures": ARCHITECTURES})}


def flower_history(config):
    return as_json(run_server(config, LoopbackGrid(make_client_app(config), config.clients)).history)


# Fed-CMA's ClassMeans are answered per sender (engine.cohort_stats), so a Flower node, which
# answers its own client's alone, gives the native run's bits (they once differed in the last bits
# of a digits-CNN client's round-1 loss, where native answered a cohort's 2 senders in one call).
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_every_algorithm_equals_its_sequential_run(tmp_path, algorithm):
    config = small_config(algorithm, **CHANGES.get(algorithm, {}))
    native, flower = native_metrics(config, tmp_path), flower_history(config)
    assert_same_run(native, flower)
    assert [line.get("algorithm") for line in native] == [line.get("algorithm") for line in flower]


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_no_algorithm_starts_from_a_non_finite_server_state(algorithm):
    # The server refuses an aggregate that leaves its state non-finite (validate.finish_round_checked),
    # and does not check one that was so before: a NaN meaning "not measured yet" would both switch
    # that protection off and, once measured and unmeasured again, fail a whole round (FedGP's share
    # of positive cosines was NaN before the first round and in every round without the target).
    from pfl_algorithms.runner import build
    from pfl_algorithms.flower.validate import _non_finite

    _, server_side, _ = build(small_config(algorithm, **CHANGES.get(algorithm, {})))
    assert _non_finite(server_side.state_dict()) is None


def test_fedgp_rounds_without_its_target_equal_its_sequential_run(tmp_path):
    # 3 of 5 clients a round: the target (client 4) is not drawn in round 2, which leaves w as it
    # was and measures no share of positive cosines (null in metrics.jsonl); Flower once failed
    # every sender of that round as a non-finite aggregate.
    config = small_config("fedgp", scenario="fda", clients=5, clients_per_round=3, rounds=3)
    native, flower = native_metrics(config, tmp_path), flower_history(config)
    assert 4 not in native[2]["clients"] and native[2]["algorithm"] == {"positive_cosines": None}
    assert 4 in native[1]["clients"] and native[1]["algorithm"]["positive_cosines"] is not None
    assert_same_run(native, flower)
    assert [line["algorithm"] for line in native] == [line["algorithm"] for line in flower]


def test_fedgp_without_its_failed_target_aggregates_nothing_and_fails_no_one_else():
    config = small_config("fedgp", scenario="fda", rounds=3)  # client 3 is the target
    grid = LoopbackGrid(make_client_app(config, faults="raise:1@1,raise:2@2,raise:3@2"), config.clients)
    first, second, third = as_json(run_server(config, grid).history)
    assert list(first["failed"]) == ["1"] and set(first["train_loss"]) == {"0", "2", "3"}
    assert sorted(second["failed"]) == ["2", "3"] and all("failure drill" in r for r in second["failed"].values())
    assert set(second["train_loss"]) == {"0", "1"} and second["bits_up"] == 2 * first["bits_up"] / 3
    assert second["algorithm"] == {"positive_cosines": None}
    assert second["eval"] == first["eval"]  # without the target's update the global model stays as it was
    assert third["failed"] == {} and set(third["train_loss"]) == {"0", "1", "2", "3"}


def test_kept_optimizer_state_lives_in_the_node_context(tmp_path):
    config = small_config("fedavg", optimizer="adam", lr=0.01, optimizer_state="keep", rounds=3)
    assert_same_run(native_metrics(config, tmp_path), flower_history(config))


def test_a_raising_silent_or_non_finite_client_is_listed_and_the_others_aggregated():
    config = small_config("fedavg", rounds=3)
    grid = LoopbackGrid(make_client_app(config, faults="raise:1@1,nan:2@2"), config.clients)
    kill = lambda line: grid.down.add(4) if line["round"] == 0 else None  # node 4 serves client 3
    first, second, third = as_json(run_server(config, grid, on_round=kill).history)
    assert list(first["failed"]) == ["1"] and "failure drill: client 1 raises" in first["failed"]["1"]
    assert first["skipped_non_finite"] == [] and set(first["train_loss"]) == {"0", "2", "3"}
    assert second["failed"] == {"3": NO_REPLY} and second["eval_failed"] == {"3": NO_REPLY}
    assert second["skipped_non_finite"] == [2] and set(second["train_loss"]) == {"0", "1", "2"}
    assert third["failed"] == {"3": NO_REPLY} and third["skipped_non_finite"] == []
    # the run went on: the live clients are evaluated every round, the silent one is null (NaN)
    assert all(h["eval"]["accuracy"]["3"] is None for h in (second, third))
    assert all(isinstance(h["eval"]["accuracy"][str(c)], float) for h in (first, second, third) for c in range(3))
    assert second["bits_up"] == 2 * first["bits_up"] / 3  # two of three live senders: 0 and 1 (2 was not finite)
