"""benchmarks/step_roofline.py: a step's FLOPs and the bytes its ATen ops move."""
from __future__ import annotations

import torch

from benchmarks import step_roofline
from benchmarks.step_roofline import TrafficCounter, step_cost


def test_traffic_counts_reads_and_new_outputs_not_views():
    x, y = torch.randn(10), torch.randn(10)
    with TrafficCounter() as traffic:
        z = x + y  # reads 2 x 40 bytes, writes 40
    assert traffic.total == 120
    with TrafficCounter() as traffic:
        z.view(2, 5).t()  # views move nothing
        z.add_(x)  # in place: reads both, its output is z itself
    assert traffic.total == 80 and dict(traffic.by_op) == {"add_": 80}


def test_a_linear_models_step():
    """Linear(4, 3) on a batch of 8: forward 2·8·4·3 FLOPs, backward twice that (the input
    needs no gradient here: only the weight's matmul, and the bias)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    flops, moved = step_cost(model, 8, input_shape=(4,), classes=3)
    assert flops == 2 * 8 * 4 * 3 * 2
    assert moved > 8 * 4 * 4  # at least the input, once


def test_the_script_prints_the_floor(capsys):
    assert step_roofline.main(["--model", "lenet5", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("lenet5, batch 4: ") and "a step takes at least" in out
