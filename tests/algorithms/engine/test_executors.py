"""Every algorithm gives bitwise the same results on every executor."""
from __future__ import annotations

import threading

import pytest
import torch

from pfl_algorithms.algorithms import ALGORITHMS, make_algorithm
from pfl_algorithms.engine.executor_factory import make_executor
from pfl_algorithms.engine.rounds import run_round

from ..algorithms.federation_cases import make_federation
from ..state_checks import assert_same


def run(name, executor, workers):
    algo = make_algorithm(name)
    fed = make_federation(algo, rounds=2, epochs=1, executor=executor, workers=workers, clients_per_round=2,
                          optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep")
    records = [run_round(fed, algo, r).as_dict() for r in range(2)]
    for r in records:
        r.pop("wall_s")
    return records, fed.state_dict(), algo.state_dict()


@pytest.mark.slow  # every algorithm, whole rounds on two executors
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_threaded_and_sequential_executors_agree_bitwise(name):
    sequential = run(name, "sequential", None)
    for workers in (1, 3):
        assert_same(run(name, "threaded", workers), sequential)


def test_unknown_executor_is_refused():
    with pytest.raises(ValueError, match="executor must be one of"):
        make_executor("ray")


def test_a_threaded_round_leaves_the_callers_thread_count_alone():
    # Workers run each task on one intra-op thread; that must not leak into the process
    # (it once did: a benchmark's plain-PyTorch baseline then ran on 1 thread of 2).
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        algo = make_algorithm("fedavg")
        fed = make_federation(algo, rounds=1, epochs=1, executor="threaded", workers=2)
        run_round(fed, algo, 0)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert (torch.get_num_threads(), seen) == (2, [2])
    finally:
        torch.set_num_threads(threads)


def test_choose_executor_default_auto_and_asked(monkeypatch):
    from pfl_algorithms.engine.executors import (AUTO_CPU_MAX_PARAMETERS, AUTO_CPU_MAX_PARAMETERS_PASSIVE,
                                                 choose_executor)

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)

    assert choose_executor(None, device="cpu", parameters=10) == ("threaded", "the default on a CPU")
    assert choose_executor(None, device="cuda", parameters=10)[0] == "batched"
    assert choose_executor("sequential", device="cuda", parameters=10) == ("sequential", "asked for")
    assert choose_executor("auto", device="cuda:1", parameters=10 ** 9)[0] == "batched"
    small = choose_executor("auto", device="cpu", parameters=AUTO_CPU_MAX_PARAMETERS)
    large = choose_executor("auto", device="cpu", parameters=AUTO_CPU_MAX_PARAMETERS + 1)
    assert small[0] == "batched" and large[0] == "threaded"
    assert "begin hooks or loss terms" in small[1] and "go threaded" in small[1]
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # batched's two-thread small ops pay for waking threads
    assert choose_executor("auto", device="cpu", parameters=AUTO_CPU_MAX_PARAMETERS_PASSIVE)[0] == "batched"
    passive = choose_executor("auto", device="cpu", parameters=AUTO_CPU_MAX_PARAMETERS_PASSIVE + 1)
    assert passive[0] == "threaded" and "OMP_WAIT_POLICY=PASSIVE" in passive[1]
    assert str(AUTO_CPU_MAX_PARAMETERS + 1) in large[1] and "benchmark" in large[1]
    with pytest.raises(ValueError, match="executor must be one of"):
        choose_executor("ray", device="cpu", parameters=1)
