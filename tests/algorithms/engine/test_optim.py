"""The flat optimizers against torch.optim on the same module, step by step."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from pfl_algorithms.engine.optim import SGD, Adam, OptimizerSettings, make_optimizer
from pfl_algorithms.engine.working import WorkingModel


def make_module():
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 4)).double()


def run_torch(module, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()
        optimizer.step()


def run_flat(module, rule, batches, *, scales=None):
    """``scales``: parameter name -> multiplier of the rate (the optimizer's ``lr_scale``)."""
    work = WorkingModel(module)
    state = {name: torch.zeros_like(work.params) for name in rule.state_names()}
    state["steps"] = torch.zeros((), dtype=torch.int64)
    lr_scale = None
    if scales is not None:
        lr_scale = torch.ones_like(work.params)
        for entry in work.layout.entries:
            lr_scale[entry.offset:entry.stop] = scales[entry.name]
    for x, y in batches:
        work.zero_grad()
        nn.functional.cross_entropy(work.module(x), y).backward()
        rule.step(work.params, work.grads, state, lr_scale=lr_scale)
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


@pytest.mark.parametrize("name,settings,reference", CASES)
def test_lr_scale_is_torch_optims_per_parameter_lr(name, settings, reference):
    """lr_scale: each tensor steps as a torch.optim parameter group of its own at lr × its scale
    (momentum, weight decay and Adam's moments included).  No BatchNorm: the gradient of a bias
    before one is rounding noise, whose sign Adam turns into whole steps."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(27, 4)).double()
    twin = copy.deepcopy(module)
    batches = [(torch.randn(5, 2, 5, 5, dtype=torch.float64), torch.randint(0, 4, (5,))) for _ in range(6)]
    scales = {n: 0.25 + 0.75 * i for i, (n, _) in enumerate(module.named_parameters())}
    groups = [{"params": [p], "lr": settings["lr"] * scales[n]} for n, p in twin.named_parameters()]
    run_torch(twin, reference(groups, **settings), batches)
    work = run_flat(module, make_optimizer(name, **settings), batches, scales=scales)
    for (name_a, a), (name_b, b) in zip(work.module.state_dict().items(), twin.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name_a)


@pytest.mark.parametrize("name,settings", [("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
                                           ("adamw", dict(lr=1e-2, weight_decay=1e-1))])
def test_stacked_rows_with_rates_and_scales_of_their_own_step_as_each_row_alone(name, settings):
    gen = torch.Generator().manual_seed(0)
    params = torch.randn(3, 10, generator=gen, dtype=torch.float64)
    grads = [torch.randn(3, 10, generator=gen, dtype=torch.float64) for _ in range(3)]
    scale = torch.rand(3, 10, generator=gen, dtype=torch.float64) + 0.5
    lr = torch.tensor([[0.1], [0.2], [0.3]], dtype=torch.float64)
    rule, ranges = make_optimizer(name, **settings), [(1, 4), (6, 9)]
    stacked = params.clone()
    state = {v: torch.zeros_like(stacked) for v in rule.state_names()}
    state["steps"] = torch.zeros((), dtype=torch.int64)
    for g in grads:
        rule.step(stacked, g.clone(), state, ranges=ranges, lr=lr, lr_scale=scale)
    for i in range(3):
        row = params[i].clone()
        row_state = {v: torch.zeros_like(row) for v in rule.state_names()}
        row_state["steps"] = torch.zeros((), dtype=torch.int64)
        for g in grads:
            rule.step(row, g[i].clone(), row_state, ranges=ranges, lr=lr[i], lr_scale=scale[i])
        torch.testing.assert_close(stacked[i], row, rtol=0, atol=0)
    untouched = [0, 4, 5, 9]
    torch.testing.assert_close(stacked[:, untouched], params[:, untouched], rtol=0, atol=0)
    with pytest.raises(ValueError, match="lr_scale"):
        rule.step(stacked, grads[0].clone(), state, lr_scale=scale[:, :4])


@pytest.mark.parametrize("name,settings,reference", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_capturable_step_is_the_host_step_with_rows_at_steps_of_their_own(name, settings, reference, dtype):
    """capturable=True (a step count per row on the device, nothing read back) against the host
    step of each row alone: rows that start at different step counts (kept state), with rates,
    scales and ranges of their own.  SGD's is bitwise; Adam's corrections reach the update as
    tensors, so it agrees to a few float rounding errors."""
    gen = torch.Generator().manual_seed(1)
    rule, ranges = make_optimizer(name, **settings), [(0, 7), (9, 13)]
    params = torch.randn(3, 13, generator=gen, dtype=dtype)
    grads = [torch.randn(3, 13, generator=gen, dtype=dtype) for _ in range(4)]
    scale = torch.rand(3, 13, generator=gen, dtype=dtype) + 0.5
    lr = torch.tensor([[0.1], [0.02], [0.3]], dtype=dtype)
    start = torch.tensor([0, 3, 1])
    state = {v: torch.randn(3, 13, generator=gen, dtype=dtype).abs() for v in rule.state_names()}
    stacked, stacked_state = params.clone(), {**{v: t.clone() for v, t in state.items()}, "steps": start.clone()}
    for g in grads:
        rule.step(stacked, g.clone(), stacked_state, ranges=ranges, lr=lr, lr_scale=scale, capturable=True)
    assert stacked_state["steps"].tolist() == (start + len(grads)).tolist()
    exact = name == "sgd"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-12 if dtype == torch.float64 else 2e-6, atol=1e-6)
    for i in range(3):
        row = params[i].clone()
        row_state = {**{v: t[i].clone() for v, t in state.items()}, "steps": start[i].clone()}
        for g in grads:
            rule.step(row, g[i].clone(), row_state, ranges=ranges, lr=lr[i], lr_scale=scale[i])
        torch.testing.assert_close(stacked[i], row, **tol)
        for v in rule.state_names():
            torch.testing.assert_close(stacked_state[v][i], row_state[v], **tol)
    # One client's flat vector with its step count [] (the sequential executor's captured step).
    flat, flat_state = params[1].clone(), {**{v: t[1].clone() for v, t in state.items()}, "steps": start[1].clone()}
    host, host_state = params[1].clone(), {**{v: t[1].clone() for v, t in state.items()}, "steps": start[1].clone()}
    for g in grads:
        rule.step(flat, g[1].clone(), flat_state, capturable=True)
        rule.step(host, g[1].clone(), host_state)
    torch.testing.assert_close(flat, host, **tol)
    assert int(flat_state["steps"]) == int(host_state["steps"])


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


@pytest.mark.parametrize("bad, setting", [
    (dict(name="rmsprop"), "rmsprop"), (dict(lr="0.1"), "lr"), (dict(lr=-1.0), "lr"), (dict(lr=True), "lr"),
    (dict(momentum=-0.5), "momentum"), (dict(nesterov=1), "nesterov"), (dict(nesterov=True), "nesterov"),
    (dict(weight_decay=None), "weight_decay"), (dict(betas=(0.8, 0.9)), "betas"), (dict(eps=1e-6), "eps"),
    (dict(name="adam", momentum=0.9), "momentum"), (dict(name="adamw", nesterov=True), "nesterov"),
    (dict(name="adam", betas=(1.0, 0.9)), "betas"), (dict(name="adam", betas=0.9), "betas")])
def test_optimizer_settings_refuse_a_bad_setting_in_one_line_naming_it(bad, setting):
    """Types, ranges and settings the named optimizer does not take (momentum is SGD's, betas
    and eps Adam's): one line naming the setting."""
    with pytest.raises(ValueError, match=setting) as info:
        OptimizerSettings(**bad)
    assert "\n" not in str(info.value)


def test_optimizer_settings_build_the_optimizer_with_what_it_takes():
    assert OptimizerSettings().build() == SGD(lr=0.01)
    sgd = OptimizerSettings("sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    assert sgd.settings() == {"lr": 0.1, "momentum": 0.9, "dampening": 0.0, "weight_decay": 0.01, "nesterov": True}
    assert sgd.build() == SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    adamw = OptimizerSettings("adamw", lr=0.01, betas=[0.8, 0.99], eps=1e-6)  # a list, as from JSON
    assert adamw.betas == (0.8, 0.99)
    assert adamw.build() == Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, decoupled=True)
    assert set(OptimizerSettings("adam").settings()) == {"lr", "betas", "eps", "weight_decay"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        adamw.lr = 0.1
