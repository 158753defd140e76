"""Every algorithm gives bitwise the same results on every executor."""
from __future__ import annotations

import pytest
import torch

from pfl_algorithms.algorithms import ALGORITHMS, make_algorithm
from pfl_algorithms.engine.executors import make_executor
from pfl_algorithms.engine.rounds import run_round

from ..algorithms.federation_cases import make_federation


def run(name, executor, workers):
    algo = make_algorithm(name)
    fed = make_federation(algo, rounds=2, epochs=1, executor=executor, workers=workers, clients_per_round=2,
                          optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep")
    records = [run_round(fed, algo, r).as_dict() for r in range(2)]
    for r in records:
        r.pop("wall_s")
    return records, fed.state_dict(), algo.state_dict()


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b or (a != a and b != b), path


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_threaded_and_sequential_executors_agree_bitwise(name):
    sequential = run(name, "sequential", None)
    for workers in (1, 3):
        assert_same(run(name, "threaded", workers), sequential)


def test_unknown_executor_is_refused():
    with pytest.raises(ValueError, match="executor must be one of"):
        make_executor("ray")
