"""Flower's simulation engine (Ray backend) runs Factorized-FL β bitwise as `pfl run` does
sequentially (tolerance ``common.TOLERANCE`` = 0), and survives a ClientApp that raises, one that
does not reply in time and one whose update is not finite.

Factorized-FL β is the one algorithm run for equality here: its client state lives in the node's
Context between rounds and must survive two Ray actors serving the nodes in turn, and its records
are sparse; every algorithm's messages are checked bitwise in process (test_loopback.py), FedAvg's
through real SuperNode processes (test_deployment.py).  Each test starts Ray once
(``run_simulation`` owns its Ray session), about 30-50 s each on 2 cores under the suite's load.
"""
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from pfl_algorithms.flower.strategy import NO_REPLY  # noqa: E402

from .common import assert_same_run, native_metrics, simulate, small_config  # noqa: E402

pytestmark = pytest.mark.heavy(seconds=70)  # scheduled first under xdist (tests/conftest.py)


def test_simulation_equals_sequential(tmp_path):
    config = small_config("factorized-fl-beta")
    assert_same_run(native_metrics(config, tmp_path), simulate(config))


def test_simulation_survives_raise_timeout_and_non_finite():
    config = small_config("fedavg")
    # round 1: client 1 raises and client 2 sleeps past the 6 s timeout; round 2: client 3 is NaN
    first, second = simulate(config, faults="raise:1@1,hang:2@1,nan:3@2", timeout=6.0, hang_s=10.0)
    assert set(first["failed"]) == {"1", "2"} and first["failed"]["2"] == NO_REPLY
    assert "failure drill: client 1 raises" in first["failed"]["1"]
    assert set(first["train_loss"]) == {"0", "3"} and first["bits_up"] > 0
    assert second["skipped_non_finite"] == [3]
    assert second["eval"]["mean_accuracy"] == second["eval"]["mean_accuracy"]  # the run went on
