"""The flat optimizers against torch.optim on the same module, step by step."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pfl_algorithms.engine.optim import SGD, Adam, make_optimizer
from pfl_algorithms.engine.working import WorkingModel


def make_module():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 4)).double()


def run_torch(module, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()


def run_flat(module, rule, batches):
    work = WorkingModel(module)
    state = {name: torch.zeros_like(work.params) for name in rule.state_names()}
    state["steps"] = torch.zeros((), dtype=torch.int64)
    for x, y in batches:
        work.zero_grad()
        nn.functional.cross_entropy(work.module(x), y).backward()
        rule.step(work.params, work.grads, state)
    return work


CASES = [
    ("sgd", dict(lr=0.1), torch.optim.SGD),
    ("sgd", dict(lr=0.1, momentum=0.9), torch.optim.SGD),
    ("sgd", dict(lr=0.05, momentum=0.9, weight_decay=1e-2, nesterov=True), torch.optim.SGD),
    ("sgd", dict(lr=0.05, momentum=0.5, dampening=0.3, weight_decay=1e-3), torch.optim.SGD),
    ("adam", dict(lr=1e-2), torch.optim.Adam),
    ("adam", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-2), torch.optim.Adam),
    ("adamw", dict(lr=1e-2, weight_decay=1e-1), torch.optim.AdamW),
]


@pytest.mark.parametrize("name,settings,reference", CASES)
def test_flat_optimizer_matches_torch_optim(name, settings, reference):
    torch.manual_seed(0)
    module = make_module()
    twin = copy.deepcopy(module)
    batches = [(torch.randn(5, 2, 5, 5, dtype=torch.float64), torch.randint(0, 4, (5,))) for _ in range(6)]
    run_torch(twin, reference(twin.parameters(), **settings), batches)
    work = run_flat(module, make_optimizer(name, **settings), batches)
    assert work.bound()
    for (name_a, a), (name_b, b) in zip(work.module.state_dict().items(), twin.state_dict().items()):
        assert name_a == name_b
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name_a)


def test_ranges_leave_the_rest_untouched():
    params = torch.randn(10, dtype=torch.float64)
    before = params.clone()
    grads = torch.randn(10, dtype=torch.float64)
    state = {"momentum_buffer": torch.zeros(10, dtype=torch.float64), "steps": torch.zeros((), dtype=torch.int64)}
    SGD(lr=0.1, momentum=0.9).step(params, grads.clone(), state, ranges=[(2, 5)])
    torch.testing.assert_close(params[:2], before[:2], rtol=0, atol=0)
    torch.testing.assert_close(params[5:], before[5:], rtol=0, atol=0)
    torch.testing.assert_close(params[2:5], before[2:5] - 0.1 * grads[2:5])


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(lr=0.1, momentum=-0.1), dict(lr=0.1, nesterov=True)])
def test_bad_sgd_settings_raise(bad):
    with pytest.raises(ValueError):
        SGD(**bad)


def test_unknown_optimizer_lists_valid_names():
    with pytest.raises(ValueError, match="adam"):
        make_optimizer("rmsprop", lr=0.1)


def test_adam_rejects_bad_betas():
    with pytest.raises(ValueError, match="betas"):
        Adam(lr=0.1, betas=(1.0, 0.9))
