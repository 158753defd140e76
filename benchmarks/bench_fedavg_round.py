"""CPU benchmark of one FedAvg round: the engine against a plain PyTorch loop.

The common small job: 20 clients x 250 CIFAR-shaped samples (3x32x32, 10 classes), LeNet-5,
batch 64, shuffled, 1 local epoch, SGD lr 0.01, every client every round.

* ours: ``pfl_algorithms``' FedAvg on a :class:`Federation` (banks, the flat working model,
  batches gathered from tensors, the flat SGD step, aggregation by ``weighted_average``).
* baseline: the loop research code writes (``plain_fedavg_loop.py``): for each client
  ``copy.deepcopy`` the global model, a ``DataLoader`` over a ``TensorDataset`` (shuffled),
  ``torch.optim.SGD``, then the global ``state_dict`` is the size-weighted average of the
  clients' state dicts.

Both sides do the same arithmetic (same model, batches, optimizer); the ratio is baseline /
ours (speed-up).  Target on CPU: >= 1.5.

``PFL_BENCH_QUICK=1``: fewer rounds of measurement.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks import _common as common
from benchmarks import plain_fedavg_loop
from benchmarks._common import Shape
from pfl_algorithms.algorithms.fedavg import FedAvg
from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.federation import EngineSettings
from pfl_algorithms.engine.optim import OptimizerSettings
from pfl_algorithms.engine.local import LocalSchedule
from pfl_algorithms.engine.rounds import federation_for
from pfl_algorithms.models import build_model

CLIENTS, SAMPLES, BATCH, LR = (plain_fedavg_loop.CLIENTS, plain_fedavg_loop.SAMPLES, plain_fedavg_loop.BATCH,
                               plain_fedavg_loop.LR)
SHAPES = [Shape("lenet5-20x250-cifar", (CLIENTS, SAMPLES, 3, 32, 32))]
SIDES = (("ours", "engine"), ("baseline", "deepcopy-dataloader-loop"))

pytestmark = common.benchmark_mark(max_time=3.0, quick_max_time=1.0)


def job():
    inputs, labels = plain_fedavg_loop.job()
    torch.manual_seed(0)
    model = build_model("lenet5", input_shape=(3, 32, 32), num_classes=10)
    return inputs, labels, model


def engine_round():
    inputs, labels, model = job()
    clients = [ClientSplit(train=torch.arange(k * SAMPLES, (k + 1) * SAMPLES), val=torch.empty(0, dtype=torch.int64),
                           test=torch.empty(0, dtype=torch.int64)) for k in range(CLIENTS)]
    settings = EngineSettings(rounds=10 ** 6, eval_every=10 ** 6, optimizer=OptimizerSettings(lr=LR),
                              schedule=LocalSchedule(batch_size=BATCH, epochs=1))
    algorithm = FedAvg()
    fed = federation_for(algorithm, model, inputs, labels, clients, settings)
    return common.next_round(fed, algorithm)


def loop_round():
    inputs, labels, model = job()
    return plain_fedavg_loop.make_round(model, inputs, labels)


@pytest.mark.parametrize("shape, side, impl, repeat", common.params(SHAPES, SIDES))
def test_fedavg_round(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    fn = engine_round() if impl == "engine" else loop_round()
    common.run(benchmark, "fedavg_round", fn, {"clients": CLIENTS, "samples": SAMPLES, "model": "lenet5"})
