"""Local plans: phases train their own groups with optimizer states of their own."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.api import Phase
from pfl_algorithms.algorithms.local import Local
from pfl_algorithms.engine.client import phase_schedule
from pfl_algorithms.engine.federation import EngineSettings
from pfl_algorithms.engine.local import client_batches
from pfl_algorithms.engine.optim import OptimizerSettings
from pfl_algorithms.engine.rounds import run_round

from ..algorithms.federation_cases import make_federation


class TwoAdamPhases(Local):
    """Head with Adam at lr 0.01 for 3 steps, then body with Adam at lr 0.02 for 4 steps."""

    PLAN = (Phase(groups=("head",), steps=3, optimizer="adam", lr=0.01, state="head"),
            Phase(groups=("body",), steps=4, optimizer="adam", lr=0.02, state="body"))

    def plan(self, client):
        return self.PLAN


@pytest.mark.parametrize("optimizer_state", ["keep", "reset"])
def test_two_phase_adam_equals_two_torch_adams(optimizer_state):
    """Three rounds of the plan on client 0 against two torch.optim.Adam objects over the same
    batches (kept across rounds, or made anew each round)."""
    algo = TwoAdamPhases()
    fed = make_federation(algo, batch_size=8, optimizer_state=optimizer_state)
    cohort = fed.cohorts[0]
    twin = copy.deepcopy(cohort.module)
    heads = [p for n, p in twin.named_parameters() if n.startswith("head.")]
    bodies = [p for n, p in twin.named_parameters() if n.startswith("body.")]
    adams = None
    for round_ in range(3):
        if adams is None or optimizer_state == "reset":
            adams = (torch.optim.Adam(heads, lr=0.01), torch.optim.Adam(bodies, lr=0.02))
        generator = fed.generator("train", round_, 0)  # the phases draw from it in turn
        for phase, adam in zip(algo.PLAN, adams):
            for batch in client_batches(fed.clients[0].train, phase_schedule(phase, fed.settings.schedule), generator):
                adam.zero_grad()
                F.cross_entropy(twin(fed.inputs[batch]), fed.labels[batch]).backward()
                adam.step()
        run_round(fed, algo, round_)
    want = torch.cat([p.detach().reshape(-1) for p in twin.parameters()])
    torch.testing.assert_close(cohort.params.row(0), want, rtol=1e-12, atol=1e-12)
    if optimizer_state == "keep":
        assert cohort.optimizer_steps["head"][0] == 9 and cohort.optimizer_steps["body"][0] == 12


def test_a_phase_trains_only_its_groups():
    class HeadOnly(Local):
        def plan(self, client):
            return (Phase(groups=("head",), steps=2),)

    algo = HeadOnly()
    fed = make_federation(algo)
    before = fed.cohorts[0].params.data.clone()
    run_round(fed, algo, 0)
    after = fed.cohorts[0].params.data
    body, head = fed.cohorts[0].span("body"), fed.cohorts[0].span("head")
    assert torch.equal(after[:, body], before[:, body])
    assert not torch.equal(after[:, head], before[:, head])


def test_phase_arguments_are_checked():
    with pytest.raises(ValueError, match="epochs or steps"):
        Phase(epochs=1, steps=2)
    with pytest.raises(ValueError, match="batches_per_step"):
        Phase(batches_per_step=2)
    with pytest.raises(ValueError, match="lr"):
        Phase(lr=-1.0)

    class Unknown(Local):
        def plan(self, client):
            return (Phase(groups=("tail",)),)

    algo = Unknown()
    fed = make_federation(algo)
    with pytest.raises(ValueError, match="tail"):
        run_round(fed, algo, 0)


OPTIMIZERS = [("sgd", {}, torch.optim.SGD), ("sgd", {"momentum": 0.9}, torch.optim.SGD),
              ("adam", {}, torch.optim.Adam)]


@pytest.mark.parametrize("executor", ["threaded", "batched"])
@pytest.mark.parametrize("given", ["mapping", "function"])
@pytest.mark.parametrize("optimizer,settings,reference", OPTIMIZERS)
def test_lr_scales_are_per_group_and_per_parameter_rates(optimizer, settings, reference, given, executor):
    """A phase's lr_scales by group (body × 2) and by parameter (head.weight × 0.25, over its
    group's default 1): client 0's 3 steps equal torch.optim with those parameter groups."""
    scales = {"body": 2.0, "head.weight": 0.25}
    seen = []

    def scales_of(view):
        seen.append([entry.name for entry in view.segments("head")])
        return scales

    class Scaled(Local):
        PLAN = (Phase(steps=3, optimizer=optimizer, lr=0.05, optimizer_settings=settings,
                      lr_scales=scales if given == "mapping" else scales_of),)

        def plan(self, client):
            return self.PLAN

    algo = Scaled()
    fed = make_federation(algo, batch_size=8, executor=executor)
    cohort = fed.cohorts[0]
    twin = copy.deepcopy(cohort.module)
    rate = {n: 0.05 * (2.0 if n.startswith("body.") else 0.25 if n == "head.weight" else 1.0)
            for n, _ in twin.named_parameters()}
    torch_optimizer = reference([{"params": [p], "lr": rate[n]} for n, p in twin.named_parameters()], **settings)
    generator = fed.generator("train", 0, 0)
    for batch in client_batches(fed.clients[0].train, phase_schedule(algo.PLAN[0], fed.settings.schedule), generator):
        torch_optimizer.zero_grad()
        F.cross_entropy(twin(fed.inputs[batch]), fed.labels[batch]).backward()
        torch_optimizer.step()
    run_round(fed, algo, 0)
    want = torch.cat([p.detach().reshape(-1) for p in twin.parameters()])
    torch.testing.assert_close(cohort.params.row(0), want, rtol=1e-12, atol=1e-12)
    if given == "function":  # once per client and phase, with the group's tensors named
        assert seen == [["head.weight", "head.bias"]] * 3


def test_segments_name_each_tensor_of_a_group_where_the_layout_put_it():
    algo = Local()
    fed = make_federation(algo)
    cohort = fed.cohorts[0]
    for group in cohort.groups.order:
        start = cohort.span(group).start
        entries = cohort.segments(group)
        assert [e.name for e in entries] == list(cohort.groups.members[group])
        for e in entries:
            entry = cohort.layout.by_name[e.name]
            assert e.offset == entry.offset - start and e.shape == entry.shape
        assert algo.server.segments(group) == entries


def test_lr_scales_are_checked():
    for bad in ({"body": 0.0}, {"body": -1.0}, {"body": "2"}, {"body": True}, 3.0):
        with pytest.raises(ValueError, match="lr_scales"):
            Phase(lr_scales=bad)

    class Unknown(Local):
        def plan(self, client):
            return (Phase(lr_scales={"tail": 2.0}),)

    algo = Unknown()
    fed = make_federation(algo)
    with pytest.raises(ValueError, match="tail"):
        run_round(fed, algo, 0)


RUN = OptimizerSettings("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("phase, merged", [
    (Phase(), RUN),
    (Phase(lr=0.5), replace(RUN, lr=0.5)),
    (Phase(lr_scale=0.25), replace(RUN, lr=0.1 * 0.25)),
    (Phase(lr=0.2, lr_scale=0.5, optimizer_settings={"momentum": 0.0}), replace(RUN, lr=0.1, momentum=0.0)),
    (Phase(optimizer="sgd", optimizer_settings={"nesterov": True}), replace(RUN, nesterov=True)),
    (Phase(optimizer="adam"), OptimizerSettings("adam", lr=0.1)),  # another optimizer: only the run's lr
    (Phase(optimizer="adamw", lr=0.01, optimizer_settings={"eps": 1e-6}), OptimizerSettings("adamw", lr=0.01, eps=1e-6)),
])
def test_a_phase_overrides_the_runs_optimizer_settings_as_documented(phase, merged):
    """Phase.settings_for: the phase's optimizer (another keeps only the run's lr), its lr, its
    optimizer_settings, then the lr times lr_scale."""
    assert phase.settings_for(RUN) == merged


def test_phase_optimizer_overrides_are_checked():
    with pytest.raises(ValueError, match="'mom'"):
        Phase(optimizer_settings={"mom": 0.1})
    with pytest.raises(ValueError, match="'lr'"):
        Phase(optimizer_settings={"lr": 0.1})
    with pytest.raises(ValueError, match="rmsprop"):
        Phase(optimizer="rmsprop")
    with pytest.raises(ValueError, match="betas=.* does not apply to sgd"):
        Phase(optimizer_settings={"betas": (0.8, 0.9)}).settings_for(RUN)
    with pytest.raises(ValueError, match="optimizer must be an OptimizerSettings"):
        EngineSettings(optimizer="adam")
