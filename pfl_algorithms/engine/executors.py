"""Executors: where client tasks run.  The round loop hands an executor a list of tasks and a
function that runs one task; the executor returns the results in task order.

* ``sequential``: one task after another on the calling thread.
* ``threaded`` (the CPU default): ``workers`` tasks at once, each on a thread of its own with
  its own working model (the cohorts keep one per thread).

Every task runs with one intra-op thread, on every executor: a client's numbers then do not
depend on the executor or on how many tasks run beside it (the two executors agree bit for
bit; small models also use cores better one client per core than one op per core).

* ``batched``: the training tasks of a cohort in chunks, each chunk in one vmapped
  forward/backward (``engine.batched``); what cannot be batched runs threaded.
* ``distributed``: a round's clients sharded over the processes of a torch.distributed job
  (``torchrun``), client c on rank c % N, the results gathered on every rank
  (``engine.distributed``).

The round loop hands its training tasks to ``run_train(fed, algorithm, tasks, run_one)``, which
runs each through ``run`` unless the executor trains clients its own way, and answers the
post-training statistics their uploads ask for (``engine.cohort_stats``).  A task is a pure
description (client, round, download, plan), so it can be shipped or stacked.
``engine.executor_factory.make_executor`` makes the executor a run names (a module of its own:
``batched`` and ``distributed`` import this one).
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Optional, Sequence, TypeVar

import torch

from .cohort_stats import answer_statistics
from .intra_op import one_intra_op_thread

Task = TypeVar("Task")
Result = TypeVar("Result")


def _on_one_intra_op_thread(run_one: Callable[[Task], Result], task: Task) -> Result:
    torch.set_num_threads(1)
    return run_one(task)


class Executor(ABC):
    """Runs client tasks; subclasses decide where."""

    name: str = ""

    @abstractmethod
    def run(self, tasks: Sequence[Task], run_one: Callable[[Task], Result]) -> list[Result]:
        """``[run_one(task) for task in tasks]``, computed wherever this executor runs tasks."""

    def run_train(self, fed, algorithm, tasks: Sequence[Task], run_one: Callable[[Task], Result]) -> list[Result]:
        """The round's training tasks, in task order: each through ``run_one`` here, then the
        statistics their uploads ask for answered (``engine.cohort_stats``); an executor that
        trains clients its own way (batched, distributed) overrides it and answers them too."""
        results = self.run(tasks, run_one)
        answer_statistics(fed, results)
        return results

    def run_eval(self, fed, tasks: Sequence[Task], run_one: Callable[[Task], Result]) -> list[Result]:
        """The evaluation tasks, in task order: each through ``run_one`` here; an executor that
        scores clients its own way (batched) overrides it."""
        return self.run(tasks, run_one)

    def close(self) -> None:
        """Release workers (the executor may be used again afterwards)."""

    def sync_state(self, fed) -> None:
        """Make this process's banks hold every client's current state before a checkpoint is
        written (a no-op where one process holds them all; see ``engine.distributed``)."""


class SequentialExecutor(Executor):
    """Every task on the calling thread, in order."""

    name = "sequential"

    def run(self, tasks, run_one):
        with one_intra_op_thread():
            return [run_one(task) for task in tasks]


class ThreadedExecutor(Executor):
    """``workers`` tasks at once (None: one per core), each thread with one intra-op thread."""

    name = "threaded"

    def __init__(self, workers: Optional[int] = None):
        if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers must be None or an integer >= 1, got {workers!r}")
        self.workers = workers or (os.cpu_count() or 1)
        self._pool: Optional[ThreadPoolExecutor] = None

    def run(self, tasks, run_one):
        if self.workers == 1 or len(tasks) <= 1:
            with one_intra_op_thread():
                return [run_one(task) for task in tasks]
        if self._pool is None:
            # Kept between rounds, so each thread keeps its working models.
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="pfl-client")
        # torch's intra-op thread count is partly process-wide (the count a thread adopts on its
        # first parallel op, MKL's pool): a worker's set_num_threads(1) would otherwise stay in
        # force for the caller after the round.  So each task sets 1 before any work (every
        # task then runs on one thread whatever ran before), and the caller's count comes back.
        previous = torch.get_num_threads()
        try:
            return list(self._pool.map(partial(_on_one_intra_op_thread, run_one), tasks))
        finally:
            torch.set_num_threads(previous)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


EXECUTORS = ("sequential", "threaded", "batched", "distributed")
CHOICES = (*EXECUTORS, "auto")  # what a run may ask for: 'auto' is resolved by ``choose_executor``

# ``auto`` on a CPU runs ``batched`` for models of at most this many parameters per client and
# ``threaded`` above.  Measured on 2 cores (``bash scripts/bench.sh --full --suite executor``,
# benchmarks/results/executor_cpu.json; one FedAvg round of 20 clients): batched trains the MLP
# (9.6k parameters, batch 16) 3.9x and the digits CNN (38k, batch 16) 2.2x faster than threaded,
# LeNet-5 (62k, batch 64; its vmapped convolutions become grouped convolutions, slow to
# differentiate on a CPU) and its factorized form 0.34x and 0.36x (re-measured with the fused
# ReLU + max pool, which both executors run).
AUTO_CPU_MAX_PARAMETERS = 40_000
# Under OMP_WAIT_POLICY=PASSIVE, batched's two-thread ops pay for waking sleeping threads at every
# small op: the MLP still trained 1.4-2.3x faster batched, the digits CNN 0.66-1.13x (20 clients,
# batch 16 and 32, equal and unequal sizes), so the line moves between them.
AUTO_CPU_MAX_PARAMETERS_PASSIVE = 20_000


def choose_executor(name: Optional[str], *, device: str, parameters: int) -> tuple[str, str]:
    """(executor, why) for a run asking for ``name`` (None: the default) on ``device`` with
    models of at most ``parameters`` parameters per client: None is ``batched`` on CUDA and
    ``threaded`` elsewhere; ``auto`` is ``batched`` on CUDA and, on a CPU, whichever the
    benchmark measured faster for that model size (:data:`AUTO_CPU_MAX_PARAMETERS`)."""
    cuda = torch.device(device).type == "cuda"
    if name is None:
        return ("batched", "the default on CUDA") if cuda else ("threaded", "the default on a CPU")
    if name not in CHOICES:
        raise ValueError(f"executor must be one of {sorted(CHOICES)}, got {name!r}")
    if name != "auto":
        return name, "asked for"
    if cuda:
        return "batched", "auto on CUDA: clients in chunks, one vmapped forward/backward each"
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    limit = AUTO_CPU_MAX_PARAMETERS_PASSIVE if passive else AUTO_CPU_MAX_PARAMETERS
    where = " (OMP_WAIT_POLICY=PASSIVE)" if passive else ""
    if parameters <= limit:
        return "batched", (f"auto on a CPU{where}: {parameters} parameters per client <= {limit}, where batched "
                           "trained faster than threaded in the CPU benchmark; plans with begin hooks or loss "
                           "terms, which run client by client, go threaded")
    return "threaded", (f"auto on a CPU{where}: {parameters} parameters per client > {limit}, where threaded "
                        "trained faster than batched in the CPU benchmark")
