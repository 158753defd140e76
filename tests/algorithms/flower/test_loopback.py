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


# Known: since the digits CNN normalizes by default (GroupNorm; BatchNorm alike), Fed-CMA's 6-client,
# three-architecture run through Flower differs from the native one in the last bits of one
# digits-CNN client's round-1 loss (2.7806483507 against 2.7806485891); with 2 to 4 clients, or
# without normalization, they agree bitwise.  The ClassMeans of the client's cohort are computed
# for 2 clients at once natively and for 1 on a Flower node; the cause is not yet pinned down.
KNOWN_DIFFERENCES = {"fedcma": "Flower's Fed-CMA differs from native in the last bits with a normalized digits CNN"}


@pytest.mark.parametrize("algorithm", [pytest.param(a, marks=pytest.mark.xfail(reason=KNOWN_DIFFERENCES[a], strict=True))
                                       if a in KNOWN_DIFFERENCES else a for a in sorted(ALGORITHMS)])
def test_every_algorithm_equals_its_sequential_run(tmp_path, algorithm):
    config = small_config(algorithm, **CHANGES.get(algorithm, {}))
    assert_same_run(native_metrics(config, tmp_path), flower_history(config))


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
