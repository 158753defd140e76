"""Local training on the flat working model against a plain PyTorch loop over the same batches."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pfl_algorithms.engine.local import LocalSchedule, client_batches, evaluate, train_locally
from pfl_algorithms.engine.optim import SGD
from pfl_algorithms.engine.working import WorkingModel


def make_module():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(64, 5)).double()


def make_data(n=37):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.parametrize("schedule", [LocalSchedule(batch_size=8, epochs=2), LocalSchedule(batch_size=10, steps=7),
                                      LocalSchedule(batch_size=8, epochs=1, drop_last=True, shuffle=False)])
def test_batches_cover_the_split(schedule):
    indices = torch.arange(3, 40)
    batches = list(client_batches(indices, schedule, torch.Generator().manual_seed(0)))
    if schedule.steps is not None:
        assert len(batches) == schedule.steps
    else:
        seen = torch.cat(batches)
        per_epoch = (37 // 8) * 8 if schedule.drop_last else 37
        assert seen.numel() == per_epoch * schedule.epochs
        for e in range(schedule.epochs):
            chunk = seen[e * per_epoch:(e + 1) * per_epoch]
            assert chunk.unique().numel() == per_epoch
    assert all(b.numel() <= schedule.batch_size for b in batches)


def test_no_samples_no_batches():
    assert list(client_batches(torch.empty(0, dtype=torch.int64), LocalSchedule())) == []


def test_train_locally_matches_a_plain_loop_with_label_map_and_prox():
    torch.manual_seed(0)
    inputs, labels = make_data()
    indices = torch.arange(2, 35)
    label_map = torch.tensor([3, 0, 4, 1, 2])
    schedule = LocalSchedule(batch_size=6, epochs=2)
    mu = 0.3
    module = make_module()
    twin = copy.deepcopy(module)
    anchor = [p.detach().clone() for p in twin.parameters()]

    optimizer = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    for batch in client_batches(indices, schedule, torch.Generator().manual_seed(5)):
        optimizer.zero_grad()
        loss = F.cross_entropy(twin(inputs[batch]), label_map[labels[batch]])
        loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(twin.parameters(), anchor))
        loss.backward()
        optimizer.step()

    work = WorkingModel(module)
    flat_anchor = work.params.clone()

    def prox(params, grads):
        diff = params - flat_anchor
        grads.add_(diff, alpha=mu)
        return mu / 2 * diff.square().sum()

    rule = SGD(lr=0.05, momentum=0.9)
    state = {"momentum_buffer": torch.zeros_like(work.params), "steps": torch.zeros((), dtype=torch.int64)}
    result = train_locally(work, rule, state, inputs, labels, indices, schedule,
                           generator=torch.Generator().manual_seed(5), label_map=label_map, grad_terms=[prox])
    assert result.finite and result.samples == 2 * indices.numel() and result.steps == 12
    for (name, a), b in zip(work.module.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_non_finite_training_is_reported():
    inputs, labels = make_data()
    work = WorkingModel(make_module())
    state = {"steps": torch.zeros((), dtype=torch.int64)}
    inputs[3, 0, 1, 1] = float("nan")
    result = train_locally(work, SGD(lr=0.1), state, inputs, labels, torch.arange(10), LocalSchedule(batch_size=5))
    assert not result.finite


def test_evaluate_counts_correct_predictions():
    inputs, labels = make_data(20)
    module = make_module().eval()
    with torch.no_grad():
        want = (module(inputs).argmax(1) == labels).double().mean().item()
    acc, loss, n = evaluate(module, inputs, labels, torch.arange(20), batch_size=7)
    assert n == 20 and acc == pytest.approx(want) and loss > 0
