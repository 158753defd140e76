"""CPU benchmark of one pFedMB round: the engine against a plain PyTorch loop.

The job: 15 clients x 250 CIFAR-shaped samples (3x32x32, 10 classes, random data from a
fixed seed), the paper's LeNet-5 with every layer (both convolutions, the three fully
connected layers) multi-branch, B = 5, α by softmax, batch 64, shuffled, 1 epoch on α
(η_α = 0.01) then 1 epoch on the branches (η_W = 0.05), plain SGD, every client every round,
Eq. 5 on the server.

* ours: ``pfedmb`` on a :class:`Federation` (banks, the fused ``branch_combine`` in every
  layer, the two phases as a plan with separate optimizer states, one ``branch_aggregate``
  per α over the round's uploads).
* baseline: ``plain_pfedmb_loop.py`` (deepcopy per client, a Python loop over the branches in
  every layer at every forward, DataLoader, two torch.optim.SGD, per-key, per-branch and
  per-client Python loops on the server).

Both start from the same state and do the same arithmetic: the same model, steps and
aggregates (``tests/algorithms/algorithms/test_pfedmb_port.py`` checks the aggregates and α
agree).  Both run on the same cores: the loop with ``torch.set_num_threads(THREADS)``, ours
with ``THREADS`` client tasks at once, each on one intra-op thread (the engine's threaded
executor), THREADS = the machine's cores.  The ratio is baseline / ours (speed-up).
Target on CPU: >= 1.5.  A second case, for information, times the loop on one thread.

``PFL_BENCH_QUICK=1``: fewer rounds of measurement.
"""
from __future__ import annotations

import os

import pytest
import torch

from benchmarks import _common as common
from benchmarks import plain_pfedmb_loop as plain
from benchmarks._common import Shape
from pfl_algorithms.algorithms.pfedmb import PFedMB

SHAPES = [Shape("lenet5-multibranch-B5-15x250-cifar", (plain.CLIENTS, plain.SAMPLES, 3, 32, 32))]
SIDES = (("ours", "engine"), ("baseline", "plain-pfedmb-loop"))
THREADS = os.cpu_count() or 1

pytestmark = common.benchmark_mark(max_time=3.0, quick_max_time=1.0)


def job(seed: int = 0):
    """The data (random CIFAR-shaped tensors, random labels) and the initial dense LeNet-5."""
    return common.cifar_job(plain.CLIENTS, plain.SAMPLES, seed)


def engine(inputs, labels, model, *, sizes=None, batch: int = plain.BATCH, epochs: int = plain.EPOCHS,
           alpha_lr: float = plain.ALPHA_LR, weight_lr: float = plain.WEIGHT_LR, branches: int = plain.BRANCHES,
           weighting: str = "alpha", workers=THREADS):
    """(the federation, the algorithm) of the job; ``prepare_model`` makes the model multi-branch
    (its branches drawn from torch's global generator)."""
    algorithm = PFedMB(branches=branches, alpha_lr=alpha_lr, weight_lr=weight_lr, weighting=weighting)
    sizes = [plain.SAMPLES] * plain.CLIENTS if sizes is None else sizes
    # The run's lr is used by neither phase (both are given theirs).
    fed = common.shard_federation(algorithm, inputs, labels, model, sizes, lr=alpha_lr, batch=batch, epochs=epochs,
                                  workers=workers)
    return fed, algorithm


def engine_round():
    fed, algorithm = engine(*job())
    return common.next_round(fed, algorithm)


def loop_round():
    inputs, labels, model = job()
    fed, _ = engine(inputs, labels, model)  # the multi-branch initial model, as ours starts
    return plain.make_round(plain.eager_copy(fed.cohorts[0].module), inputs, labels)


def measure(benchmark, case: str, impl: str, loop_threads: int):
    # The loop's intra-op threads; the engine's tasks set theirs to 1 and restore the caller's.
    torch.set_num_threads(THREADS if impl == "engine" else loop_threads)
    try:
        fn = engine_round() if impl == "engine" else loop_round()
        common.run(benchmark, case, fn,
                   {"clients": plain.CLIENTS, "samples": plain.SAMPLES, "model": "lenet5-multibranch",
                    "branches": plain.BRANCHES, "threads": THREADS if impl == "engine" else loop_threads})
    finally:
        torch.set_num_threads(THREADS)


@pytest.mark.parametrize("shape, side, impl, repeat", common.params(SHAPES, SIDES))
def test_pfedmb_round(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    """The comparison of record: both sides on THREADS cores."""
    measure(benchmark, "pfedmb_round", impl, THREADS)


@pytest.mark.parametrize("shape, side, impl, repeat",
                         common.params(SHAPES, (SIDES[0], ("baseline", "plain-pfedmb-loop-1-thread"))))
def test_pfedmb_round_loop_one_thread(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    """For information (no target): the loop on one intra-op thread, ours still on THREADS
    cores.  Under OMP_WAIT_POLICY=PASSIVE (as ``report.py`` runs every suite) the loop is
    faster on one thread than on two on a 2-core machine (1.1 s against 1.5 s a round); with
    the default policy it is faster on two (0.77 s): its thousands of small ops per step pay
    for waking the sleeping OpenMP threads.  Ours runs one intra-op thread per task, so the
    policy does not change it.  See the README for what this means for the ratio."""
    measure(benchmark, "pfedmb_round_loop_1thread", impl, 1)
