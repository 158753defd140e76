"""Shared helpers of the Flower tests: small digits runs, native and through Flower."""
import json
from pathlib import Path

from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.runner import run

# A Flower run must give a sequential run's metrics up to float reassociation; every piece runs
# the same ops in the same order (one intra-op thread, uploads aggregated in client order, the
# records carry the bytes), so the tests ask for bitwise equality: tolerance 0.
TOLERANCE = 0.0

# Ray in the tests: 2 CPUs, one per ClientApp actor, no dashboard.
RAY_BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": 2, "include_dashboard": False}}


def small_config(algorithm: str, **changes) -> RunConfig:
    """A few-second digits run of ``algorithm`` (4 clients, 2 rounds, 40 samples each)."""
    values = dict(algorithm=algorithm, clients=4, rounds=2, samples_per_client=40, executor="sequential")
    values.update(changes)
    return check(RunConfig(**values))


def native_metrics(config: RunConfig, tmp_path: Path) -> list[dict]:
    """The metrics lines of ``pfl run`` (sequential) for ``config``."""
    out = tmp_path / f"native-{config.algorithm}"
    run(config, out, progress=False)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def as_json(history: list[dict]) -> list[dict]:
    """A Flower run's history as its metrics.jsonl lines read back (int keys become strings,
    NaN and infinities null, as every run file writes them)."""
    from pfl_algorithms.atomic_io import json_text

    return json.loads(json_text(history))


def assert_same_run(native: list[dict], flower: list[dict]) -> None:
    """Metrics and communication of the two runs equal, round by round (within TOLERANCE)."""
    assert len(native) == len(flower)
    for a, b in zip(native, flower):
        assert b["failed"] == {}
        assert a["clients"] == b["clients"]
        assert a["train_loss"] == b["train_loss"]
        assert a["skipped_non_finite"] == b["skipped_non_finite"]
        assert (a["bits_up"], a["bits_down"]) == (b["bits_up"], b["bits_down"])
        assert a["comm_gb"] == b["comm_gb"]
        assert a["eval"] == b["eval"]


def simulate(config: RunConfig, *, faults: str = "", timeout: float = 120.0, hang_s: float = 30.0) -> list[dict]:
    """The metrics lines of ``config`` run by Flower's simulation engine (Ray backend, one
    SuperNode per client): PflStrategy in the ServerApp, pfl's ClientApp on the nodes."""
    from flwr.simulation import run_simulation

    from pfl_algorithms.flower.app import make_server_app
    from pfl_algorithms.flower.client import make_client_app

    done = []
    run_simulation(make_server_app(config, timeout=timeout, on_done=done.append),
                   make_client_app(config, faults=faults, hang_s=hang_s), num_supernodes=config.clients,
                   backend_config=RAY_BACKEND)
    assert done, "the ServerApp did not finish"
    return as_json(done[0].history)
