"""Run under torchrun by ``test_distributed.py``: every registered algorithm for 2 rounds on the
distributed executor (2 of 3 clients a round, kept optimizer state), then ``sync_state``; rank 0
runs it sequentially too and prints, as JSON, the algorithms whose records, banks or server state
differ (with the first difference)."""
import json

import torch
import torch.distributed as dist

from pfl_algorithms.algorithms import ALGORITHMS, make_algorithm
from pfl_algorithms.engine.rounds import run_round
from tests.algorithms.algorithms.federation_cases import make_federation
from tests.algorithms.state_checks import assert_same


def run(name: str, executor: str):
    algorithm = make_algorithm(name)
    fed = make_federation(algorithm, rounds=2, epochs=1, executor=executor, clients_per_round=2,
                          optimizer_settings={"lr": 0.1, "momentum": 0.9}, optimizer_state="keep")
    records = [run_round(fed, algorithm, r).as_dict() for r in range(2)]
    for record in records:
        record.pop("wall_s")
    fed.executor.sync_state(fed)  # what a checkpoint would hold
    return records, fed.state_dict(), algorithm.state_dict()


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    differences = {}
    for name in sorted(ALGORITHMS):
        distributed = run(name, "distributed")
        if dist.get_rank() == 0:
            try:
                assert_same(distributed, run(name, "sequential"))
            except AssertionError as error:
                differences[name] = str(error)
        dist.barrier()
    if dist.get_rank() == 0:
        print(json.dumps(differences))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
