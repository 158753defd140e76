"""What the CPU benchmark suites (``bench_factorized.py``, ``bench_branch.py``, the round suites) share.

The layer shapes they measure, the run settings, the timing marks, the parametrization
(repeats outer, shapes, then B where a suite varies it, then the sides of a group back to
back), the labels ``benchmarks/report.py`` groups by, the layer training step, and the job
of the round suites (``cifar_job``, ``shard_federation``, ``next_round``).

Not collected by pytest (the suites name their files on the command line).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Optional, Sequence

import pytest
import torch
from torch import nn

QUICK = os.environ.get("PFL_BENCH_QUICK", "") not in ("", "0")

BATCH = 32
IMAGE_SIZE = 32
REPEATS = 1 if QUICK else 3


def benchmark_mark(*, max_time: float, quick_max_time: float):
    """pytest-benchmark's settings for a group of measurements.

    pytest-benchmark picks the iterations per round (each round lasts >= min_time, which
    keeps microsecond-scale ops above the timer's noise) and runs rounds until max_time,
    but at least min_rounds: the slowest layer step (~0.4 s on 2 cores) gets min_rounds.
    Its calibration calls are untimed and warm up each function (first-call allocations,
    oneDNN primitive creation), so no separate warm-up phase: it would only add calls
    of the slow layer steps.
    """
    return pytest.mark.benchmark(
        min_rounds=3,
        max_time=quick_max_time if QUICK else max_time,
        min_time=1e-4 if QUICK else 2e-4,
        warmup=False,
    )


# The settings of the layer steps (and of every case of bench_factorized.py).
LAYER_BENCHMARK = benchmark_mark(max_time=0.5, quick_max_time=0.25)


@dataclass(frozen=True)
class Shape:
    """A layer of the benchmarked networks: its weight shape and how it is applied."""

    name: str
    weight: tuple[int, ...]  # [O, I, kh, kw] for a conv, [out_features, in_features] for a linear
    stride: int = 1
    padding: int = 0

    @property
    def is_linear(self) -> bool:
        return len(self.weight) == 2

    @property
    def layout(self) -> str:
        """The factor layout of the factorized ops for this weight."""
        return "linear" if self.is_linear else "spatial"

    @property
    def numel(self) -> int:
        return math.prod(self.weight)


SHAPES = (
    # ResNet-9: the k5 layer has stride 2 and padding 2, the k3 layers padding 1.
    Shape("resnet9-conv64-128k5", (128, 64, 5, 5), stride=2, padding=2),
    Shape("resnet9-conv128-128k3", (128, 128, 3, 3), padding=1),
    Shape("resnet9-conv128-256k3", (256, 128, 3, 3), padding=1),
    Shape("resnet9-conv256-256k3", (256, 256, 3, 3), padding=1),
    # LeNet-5 (pFedMB's CNN): unpadded k5 convs, then the fully connected layers.
    Shape("lenet5-conv3-6k5", (6, 3, 5, 5)),
    Shape("lenet5-conv6-16k5", (16, 6, 5, 5)),
    Shape("lenet5-fc400-120", (120, 400)),
    Shape("lenet5-fc120-84", (84, 120)),
    Shape("lenet5-fc84-10", (10, 84)),
)


def params(shapes: Sequence[Shape], sides: Sequence[tuple[str, str]],
           branch_counts: Optional[Iterable[int]] = None):
    """The parametrization of one case: ``shape, side, impl, repeat``, or with
    ``branch_counts`` ``shape, branches, side, impl, repeat``.

    Repeats are the outer loop, which spreads a group's repeats over the whole case; the
    sides (``(side, impl)`` pairs, 'ours' first) are the inner one, so the sides of a group
    run back to back.
    """
    if branch_counts is None:
        return [pytest.param(shape, side, impl, repeat, id=f"{shape.name}-r{repeat}-{impl}")
                for repeat in range(REPEATS) for shape in shapes for side, impl in sides]
    return [pytest.param(shape, branches, side, impl, repeat,
                         id=f"{shape.name}-B{branches}-r{repeat}-{impl}")
            for repeat in range(REPEATS) for shape in shapes for branches in branch_counts
            for side, impl in sides]


def run(benchmark, case: str, fn: Callable[[], object], labels: Mapping[str, object],
        extra: Optional[Mapping[str, object]] = None, rounds: Optional[int] = None):
    """Benchmark ``fn`` under the group ``case/shape`` (``case/shape/B<branches>`` where the
    test is parametrized by ``branches``), labelled for the report to group.

    ``extra_info`` holds ``case``, ``shape``, ``weight_shape``, the suite's ``labels``,
    ``side``, ``impl``, ``repeat`` and then ``extra``.  ``rounds``: measure exactly that many
    single calls (``benchmark.pedantic``), for sides that take minutes per call.
    """
    shape: Shape = benchmark.params["shape"]
    benchmark.group = f"{case}/{shape.name}"
    if "branches" in benchmark.params:
        benchmark.group += f"/B{benchmark.params['branches']}"
    benchmark.extra_info.update(case=case, shape=shape.name, weight_shape=list(shape.weight), **labels,
                                side=benchmark.params["side"], impl=benchmark.params["impl"],
                                repeat=benchmark.params["repeat"])
    benchmark.extra_info.update(extra or {})
    if rounds is not None:
        return benchmark.pedantic(fn, rounds=rounds, iterations=1)
    return benchmark(fn)


def make_layer(shape: Shape, impl: str, linear: type, conv: type, **kwargs) -> nn.Module:
    """The layer of ``shape``: ``nn.Linear`` / ``nn.Conv2d`` for impl 'dense', else
    ``linear`` / ``conv`` built with ``kwargs``, all of whose parameters are then drawn
    standard normal (the suites' layers start some of them at zero).

    No bias on either side (ResNet-9's convs have none; for the others it costs the same on
    both sides, so leaving it out only makes the ratio stricter).
    """
    torch.manual_seed(0)
    if shape.is_linear:
        out_f, in_f = shape.weight
        if impl == "dense":
            return nn.Linear(in_f, out_f, bias=False)
        layer = linear(in_f, out_f, bias=False, **kwargs)
    else:
        out_c, in_c, kh, kw = shape.weight
        args = (in_c, out_c, (kh, kw), shape.stride, shape.padding)
        if impl == "dense":
            return nn.Conv2d(*args, bias=False)
        layer = conv(*args, bias=False, **kwargs)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def train_step(layer: nn.Module, shape: Shape) -> Callable[[], tuple[torch.Tensor, ...]]:
    """One training step of ``layer``: forward on a fixed random batch (BATCH inputs,
    IMAGE_SIZE x IMAGE_SIZE for a conv), then backward from a fixed random grad.

    ``torch.autograd.grad`` returns the parameter grads without accumulating them in
    ``.grad`` (like a step after ``zero_grad(set_to_none=True)``).  The input does not
    require grad: the layer's own cost without the input gradient, the stricter ratio.
    """
    params = list(layer.parameters())
    gen = torch.Generator().manual_seed(2)
    if shape.is_linear:
        x = torch.randn(BATCH, shape.weight[1], generator=gen)
        out_shape = (BATCH, shape.weight[0])
    else:
        x = torch.randn(BATCH, shape.weight[1], IMAGE_SIZE, IMAGE_SIZE, generator=gen)
        out_size = [(IMAGE_SIZE + 2 * shape.padding - k) // shape.stride + 1 for k in shape.weight[2:]]
        out_shape = (BATCH, shape.weight[0], *out_size)
    grad_out = torch.randn(out_shape, generator=gen)

    def fn():
        return torch.autograd.grad(layer(x), params, grad_out)

    return fn


def next_round(fed, algorithm):
    """A function running the federation's next round each time it is called (rounds 0, 1, ...)."""
    from pfl_algorithms.engine.rounds import run_round

    state = {"round": 0}

    def fn():
        run_round(fed, algorithm, state["round"])
        state["round"] += 1

    return fn


def cifar_job(clients: int, samples: int, seed: int = 0):
    """The round suites' data and model: ``clients * samples`` random CIFAR-shaped inputs
    (3x32x32, standard normal) with random labels (10 classes) from a generator seeded by
    ``seed``, and the registry's LeNet-5 built right after ``torch.manual_seed(seed)``."""
    from pfl_algorithms.models import build_model

    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(clients * samples, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 10, (clients * samples,), generator=gen)
    torch.manual_seed(seed)
    return inputs, labels, build_model("lenet5", input_shape=(3, 32, 32), num_classes=10)


def shard_federation(algorithm, inputs: torch.Tensor, labels: torch.Tensor, model: nn.Module,
                     sizes: Sequence[int], *, lr: float, batch: int, epochs: int = 1,
                     workers: Optional[int] = None):
    """A federation of ``algorithm`` on the engine whose client k trains on the k-th contiguous
    shard of ``sizes[k]`` samples (no validation or test data), SGD at ``lr`` without momentum,
    ``epochs`` epochs of batches of ``batch``, every client every round, the threaded executor
    with ``workers`` tasks at once (None: one per core), no evaluation."""
    from pfl_algorithms.data.partition import ClientSplit
    from pfl_algorithms.engine.federation import EngineSettings
    from pfl_algorithms.engine.optim import OptimizerSettings
    from pfl_algorithms.engine.local import LocalSchedule
    from pfl_algorithms.engine.rounds import federation_for

    empty = torch.empty(0, dtype=torch.int64)
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    clients = [ClientSplit(train=torch.arange(start, start + size), val=empty, test=empty)
               for start, size in zip(starts, sizes)]
    settings = EngineSettings(rounds=10 ** 6, eval_every=10 ** 6, optimizer=OptimizerSettings(lr=lr),
                              schedule=LocalSchedule(batch_size=batch, epochs=epochs), workers=workers)
    return federation_for(algorithm, model, inputs, labels, clients, settings)
