"""Local training on the flat working model against a plain PyTorch loop over the same batches."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pfl_algorithms.algorithms.fedprox import FedProx
from pfl_algorithms.algorithms.local import Local
from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.federation import EngineSettings
from pfl_algorithms.engine.optim import OptimizerSettings
from pfl_algorithms.engine.local import LocalSchedule, client_batches, evaluate
from pfl_algorithms.engine.rounds import federation_for, run_round


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


class ConvNet(nn.Module):
    """body: conv + BatchNorm (running statistics) + ReLU; head: linear."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        return self.head(self.body(x))


def one_client_federation(algorithm, inputs, labels, label_map, schedule, optimizer_settings):
    torch.manual_seed(0)
    client = ClientSplit(train=torch.arange(2, 35), val=torch.arange(0), test=torch.arange(35, 37),
                         label_map=label_map)
    settings = EngineSettings(rounds=1, schedule=schedule, optimizer=OptimizerSettings(**optimizer_settings))
    return federation_for(algorithm, ConvNet().double(), inputs, labels, [client], settings)


def test_a_round_matches_a_plain_loop_with_label_map_batchnorm_and_prox():
    inputs, labels = make_data()
    label_map = torch.tensor([3, 0, 4, 1, 2])
    schedule = LocalSchedule(batch_size=6, epochs=2)
    mu = 0.3
    algo = FedProx(mu=mu)
    fed = one_client_federation(algo, inputs, labels, label_map, schedule, {"lr": 0.05, "momentum": 0.9})
    twin = copy.deepcopy(fed.cohorts[0].module)
    anchor = [p.detach().clone() for p in twin.parameters()]
    optimizer = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    for batch in client_batches(fed.clients[0].train, schedule, fed.generator("train", 0, 0)):
        optimizer.zero_grad()
        loss = F.cross_entropy(twin(inputs[batch]), label_map[labels[batch]])
        loss = loss + mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(twin.parameters(), anchor))
        loss.backward()
        optimizer.step()
    record = run_round(fed, algo, 0)
    assert record.skipped == []
    cohort = fed.cohorts[0]
    cohort.work.load(cohort.params.row(0), cohort.buffers.row(0), cohort.int_buffers.row(0))
    for (name, a), b in zip(cohort.module.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_non_finite_training_is_reported_and_not_stored():
    inputs, labels = make_data()
    inputs[3, 0, 1, 1] = float("nan")
    algo = Local()
    fed = one_client_federation(algo, inputs, labels, None, LocalSchedule(batch_size=5), {"lr": 0.1})
    before = fed.cohorts[0].params.data.clone()
    record = run_round(fed, algo, 0)
    assert record.skipped == [0]
    assert torch.equal(fed.cohorts[0].params.data, before)


def test_evaluate_counts_correct_predictions():
    inputs, labels = make_data(20)
    module = make_module().eval()
    with torch.no_grad():
        want = (module(inputs).argmax(1) == labels).double().mean().item()
    acc, loss, n = evaluate(module, inputs, labels, torch.arange(20), batch_size=7)
    assert n == 20 and acc == pytest.approx(want) and loss > 0


def test_evaluate_reads_the_device_once_and_never_scores_a_diverged_model(monkeypatch):
    """Its two totals come back in one read (a device sync each on a GPU); a model with NaN
    logits gets NaN accuracy and loss, over the samples it was given."""
    inputs, labels = make_data(20)
    module = make_module().eval()
    with torch.no_grad():
        logits = module(inputs)
        want_acc = (logits.argmax(1) == labels).double().mean().item()
        want_loss = F.cross_entropy(logits, labels).item()
    reads = []
    for name in ("tolist", "item", "__float__", "__int__", "__bool__"):
        def counted(self, *args, _original=getattr(torch.Tensor, name), _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    acc, loss, n = evaluate(module, inputs, labels, torch.arange(20), batch_size=7)
    assert reads == ["tolist"]
    monkeypatch.undo()
    assert (acc, n) == (want_acc, 20) and loss == pytest.approx(want_loss, rel=1e-12)
    with torch.no_grad():
        module[-1].bias[2] = float("nan")
    acc, loss, n = evaluate(module, inputs, labels, torch.arange(20), batch_size=7)
    assert math.isnan(acc) and math.isnan(loss) and n == 20


def test_local_results_of_a_chunk_in_one_read():
    """Each task's mean loss (its float64 sum over its samples), and finite exactly when its
    parameters and its loss are; a task without samples has a NaN loss and is finite when its
    parameters are."""
    from pfl_algorithms.engine.client import local_result, local_results

    totals = torch.tensor([6.0, 1.0, float("inf"), 2.5, 0.0, 7.0], dtype=torch.float64)
    params = torch.randn(6, 9)
    params[1, 4] = float("nan")
    params[3, 0] = -float("inf")
    samples, steps = [4, 3, 5, 2, 0, 3], [1, 1, 2, 1, 0, 1]
    results = local_results(totals, samples, steps, params)
    assert [r.finite for r in results] == [True, False, False, False, True, True]
    assert [r.loss for r in results[:4]] == [1.5, 1.0 / 3.0, float("inf"), 1.25]
    assert results[4].loss != results[4].loss and results[5].loss == 7.0 / 3.0  # NaN without samples
    assert [(r.samples, r.steps) for r in results] == list(zip(samples, steps))
    for i, result in enumerate(results):  # one task alone reads the same
        alone = local_result(totals[i], samples[i], steps[i], params[i])
        assert (alone.loss == result.loss or alone.loss != alone.loss) and alone.finite == result.finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_finite_sums_are_finite_exactly_where_every_element_is(dtype):
    """finite_sums: each row's sum finite iff the row is, at the dtype's extremes too (rows of
    its largest values, both signs, which a sum in the dtype itself would overflow), with one
    NaN, +Inf, -Inf or both infinities among finite values; the whole-tensor form agrees."""
    from pfl_algorithms.engine.client import finite_sums

    big = torch.finfo(dtype).max
    rows = torch.randn(8, 37, dtype=torch.float64).to(dtype)
    rows[1] = big
    rows[2] = -big
    rows[3, 5] = float("nan")
    rows[4, 0] = float("inf")
    rows[5, 36] = -float("inf")
    rows[6, 1], rows[6, 2] = float("inf"), -float("inf")
    rows[7] = torch.finfo(dtype).tiny
    sums = finite_sums(rows, 1)
    assert sums.dtype == torch.float64 and sums.shape == (8,)
    assert torch.isfinite(sums).tolist() == [True, True, True, False, False, False, False, True]
    assert bool(torch.isfinite(finite_sums(rows[[0, 1, 2, 7]]))) and not bool(torch.isfinite(finite_sums(rows)))
    assert finite_sums(rows[:0], 1).shape == (0,) and float(finite_sums(rows[:0])) == 0.0
