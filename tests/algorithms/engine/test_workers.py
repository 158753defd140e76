"""A run does not depend on the number of workers: every client task (training, evaluation,
fine-tuning) runs on one intra-op thread whatever the worker count (``engine.executors``)."""
from __future__ import annotations

import pytest
import torch

from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.engine.rounds import run_round
from pfl_algorithms.runner import build

from ..state_checks import assert_same

pytest.importorskip("sklearn")  # the digits ship inside scikit-learn


def _rounds(workers: int, **fields):
    config = check(RunConfig(clients=5, rounds=2, samples_per_client=60, batch_size=16, workers=workers, **fields))
    fed, algorithm, _ = build(config)
    records = [run_round(fed, algorithm, r).as_dict() for r in range(config.rounds)]
    for record in records:
        record.pop("wall_s")
    return fed.state_dict(), records


@pytest.mark.parametrize("fields", [
    {"algorithm": "fedavg-ft"},  # fine-tunes in its evaluation: evaluation trains too
    {"algorithm": "fedprox", "clients_per_round": 1},  # one client a round
])
def test_workers_1_2_3_give_bitwise_the_same_run(fields):
    threads = torch.get_num_threads()
    # The calling thread gets several intra-op threads (as on any multi-core machine), so a
    # client computed on it would round differently from one computed on one thread.
    torch.set_num_threads(max(2, threads))
    try:
        runs = {workers: _rounds(workers, **fields) for workers in (1, 2, 3)}
    finally:
        torch.set_num_threads(threads)
    state, records = runs[1]
    for workers in (2, 3):
        other_state, other_records = runs[workers]
        assert other_records == records, workers
        assert_same(other_state, state, f"workers={workers}")
