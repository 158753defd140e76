"""CPU benchmark of one Factorized-FL β round: the engine against the released code's loop.

The job: 20 clients x 250 CIFAR-shaped samples (3x32x32, 10 classes), LeNet-5 factorized
(rank 1, the released code's ``view`` layout; the classifier dense), batch 64, shuffled,
1 local epoch, SGD lr 0.01, every client every round, τ = 0, ε = 1, at least 10 kept.

* ours: ``factorized-fl-beta`` on a :class:`Federation` (banks, fused factorized layers,
  matching by ``pairwise_cosine`` + ``similarity_weights`` and one ``weighted_average`` per
  group over the round's uploads).
* baseline: ``plain_factorized_fl_loop.py``, a port of the released loop (deepcopy per
  client, eager reconstruction of every weight at every forward, a DataLoader, per-client
  Python matching and per-key averaging of state dicts).

Both do the same arithmetic: the same model, optimizer and aggregates
(``tests/algorithms/algorithms/test_factorized_fl_port.py`` checks the aggregates agree).
The L1 term is off and μ is aggregated densely on both sides (the released L1 is computed
on detached tensors).  The ratio is baseline / ours (speed-up).  Target on CPU: >= 2.

``PFL_BENCH_QUICK=1``: fewer rounds of measurement.
"""
from __future__ import annotations

import pytest

from benchmarks import _common as common
from benchmarks import plain_factorized_fl_loop as plain
from benchmarks._common import Shape
from pfl_algorithms.algorithms.factorized_fl import FactorizedFLBeta

SHAPES = [Shape("lenet5-factorized-20x250-cifar", (plain.CLIENTS, plain.SAMPLES, 3, 32, 32))]
SIDES = (("ours", "engine"), ("baseline", "released-loop-port"))
SETTINGS = dict(tau=plain.TAU, scale=plain.SCALE, min_keep=plain.MIN_KEEP, l1=0.0, threshold=0.0, layout="view")

pytestmark = common.benchmark_mark(max_time=3.0, quick_max_time=1.0)


def job(seed: int = 0):
    """The data (random CIFAR-shaped tensors, random labels) and the initial LeNet-5."""
    return common.cifar_job(plain.CLIENTS, plain.SAMPLES, seed)


def engine(inputs, labels, model, *, batch: int = plain.BATCH):
    """(the federation, the algorithm) of the job."""
    algorithm = FactorizedFLBeta(**SETTINGS)
    return common.shard_federation(algorithm, inputs, labels, model, [plain.SAMPLES] * plain.CLIENTS,
                                   lr=plain.LR, batch=batch), algorithm


def match_key(fed) -> str:
    """The state-dict key of the penultimate layer's v (the ``v_last`` group's one member)."""
    (name,) = fed.cohorts[0].groups.members["v_last"]
    return name


def engine_round():
    fed, algorithm = engine(*job())
    return common.next_round(fed, algorithm)


def loop_round():
    inputs, labels, model = job()
    fed, algorithm = engine(inputs, labels, model)  # the factorized initial model, as ours starts
    eager = plain.eager_copy(fed.cohorts[0].module)
    return plain.make_round(eager, inputs, labels, match_key(fed))


@pytest.mark.parametrize("shape, side, impl, repeat", common.params(SHAPES, SIDES))
def test_factorized_fl_round(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    fn = engine_round() if impl == "engine" else loop_round()
    common.run(benchmark, "factorized_fl_round", fn,
               {"clients": plain.CLIENTS, "samples": plain.SAMPLES, "model": "lenet5-factorized"})
