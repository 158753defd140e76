"""CPU benchmark of the executors: local-training throughput of ``batched`` against
``threaded``, 20 clients, one FedAvg round (no evaluation) per call.

Jobs (random inputs of the model's shape, 10 classes, a fixed seed; SGD lr 0.01):

* ``digits-cnn``: the digits CNN (38k parameters), 20 x 90 samples of 1x8x8, batch 16;
* ``mlp``: the registry MLP (hidden 128, 9.6k parameters), the same data, batch 16;
* ``lenet5``: LeNet-5 (62k), 20 x 250 samples of 3x32x32, batch 64;
* ``lenet5-factorized``: LeNet-5 with every layer factorized (``pfl_kernels.nn.factorize``),
  the same data: its reconstructions run as one op launch over the chunk's client dimension.

Both sides start from the same state and train the same batches (``tests/algorithms/engine/
test_batched.py`` checks they give the same numbers); ``threaded`` runs one task per core on
one intra-op thread each, ``batched`` one chunk of all 20 clients on the cores' intra-op
threads.  The ratio is threaded / batched time (speed-up of batched; < 1: threaded is faster),
which ``--executor auto`` follows on a CPU (``engine.executors.AUTO_CPU_MAX_PARAMETERS``).

``PFL_BENCH_QUICK=1``: fewer rounds of measurement.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from benchmarks import _common as common
from benchmarks._common import Shape
from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.engine.executor_factory import make_executor
from pfl_algorithms.models import build_model
from pfl_kernels.nn import factorize

CLIENTS = 20
THREADS = os.cpu_count() or 1
# name -> (model, input shape, samples per client, batch, factorized)
JOBS = {
    "digits-cnn-20x90-b16": ("digits-cnn", (1, 8, 8), 90, 16, False),
    "mlp-20x90-b16": ("mlp", (1, 8, 8), 90, 16, False),
    "lenet5-20x250-b64": ("lenet5", (3, 32, 32), 250, 64, False),
    "lenet5-factorized-20x250-b64": ("lenet5", (3, 32, 32), 250, 64, True),
}
SHAPES = [Shape(name, (CLIENTS, samples, *shape)) for name, (_, shape, samples, _, _) in JOBS.items()]
SIDES = (("ours", "batched"), ("baseline", "threaded"))

pytestmark = common.benchmark_mark(max_time=3.0, quick_max_time=1.0)


def federation(name: str, executor: str):
    """(federation, FedAvg) of job ``name`` on ``executor``: the same data and initial model
    for both executors."""
    model_name, shape, samples, batch, factorized = JOBS[name]
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(CLIENTS * samples, *shape, generator=gen)
    labels = torch.randint(0, 10, (CLIENTS * samples,), generator=gen)
    torch.manual_seed(0)
    model = build_model(model_name, input_shape=shape, num_classes=10)
    if factorized:
        model = factorize(model)
    algorithm = FedAvg()
    fed = common.shard_federation(algorithm, inputs, labels, copy.deepcopy(model), [samples] * CLIENTS, lr=0.01,
                                  batch=batch, workers=THREADS)
    fed.executor.close()
    fed.executor = make_executor(executor, workers=THREADS)
    return fed, algorithm


@pytest.mark.parametrize("shape, side, impl, repeat", common.params(SHAPES, SIDES))
def test_executor_round(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    model_name, _, samples, batch, factorized = JOBS[shape.name]
    fed, algorithm = federation(shape.name, impl)
    fn = common.next_round(fed, algorithm)
    fn()  # the first round pays one-time costs (working-model copies per thread)
    try:
        common.run(benchmark, "executor_round", fn,
                   {"clients": CLIENTS, "samples": samples, "batch": batch, "model": model_name,
                    "factorized": factorized, "threads": THREADS,
                    "parameters": fed.cohorts[0].layout.numel})
    finally:
        fed.close()
