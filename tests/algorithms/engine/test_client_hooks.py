"""Contract pieces FedFomo added: a phase's ``begin`` hook, ``ClientView.evaluate`` and
``shared_buffers``, and the server's seeded stream ``Server.generator``."""
from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms.local import Local
from pfl_algorithms.api import Phase
from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.client import phase_schedule
from pfl_algorithms.engine.local import client_batches, evaluate
from pfl_algorithms.engine.rounds import run_round

from ..algorithms.federation_cases import make_federation


def test_begin_runs_once_before_the_first_step_and_sees_the_validation_split():
    seen = []

    class Halve(Local):
        def plan(self, client):
            def begin(view):
                seen.append((view.client, view.step, view.evaluate("val"), view.evaluate("test"),
                             view.params.clone(), view.shared_buffers().numel()))
                with torch.no_grad():
                    view.params.mul_(0.5)

            return (Phase(steps=1, begin=begin),)

    algo = Halve()
    fed = make_federation(algo, clients=2, sizes=(30, 40))
    fed.clients[0] = ClientSplit(train=torch.arange(0, 20), val=torch.arange(20, 25), test=torch.arange(25, 30))
    start = fed.cohorts[0].params.row(0).clone()
    module = copy.deepcopy(fed.cohorts[0].module)
    run_round(fed, algo, 0)
    assert [s[0] for s in seen] == [0, 1] and all(s[1] == 0 for s in seen)
    client, _, val, test, params, buffers = seen[0]
    torch.testing.assert_close(params, start, rtol=0, atol=0)
    torch.nn.utils.vector_to_parameters(start, module.parameters())
    assert val == evaluate(module, fed.inputs, fed.labels, torch.arange(20, 25))
    assert val[2] == 5 and test[2] == 5 and buffers == 0
    assert seen[1][2][2] == 0  # client 1 has no validation split: (nan, nan, 0)
    # the one SGD step (lr 0.1) started from the halved parameters
    phase = algo.plan(0)[0]
    batch = next(client_batches(fed.clients[0].train, phase_schedule(phase, fed.settings.schedule),
                                fed.generator("train", 0, 0)))
    w = (0.5 * start).requires_grad_(True)
    loss = F.cross_entropy(torch.func.functional_call(module, fed.cohorts[0].layout.views(w), (fed.inputs[batch],)),
                           fed.labels[batch])
    want = 0.5 * start - 0.1 * torch.autograd.grad(loss, w)[0]
    torch.testing.assert_close(fed.cohorts[0].params.row(0), want, rtol=1e-12, atol=1e-12)


def test_server_generator_is_seeded_by_the_run_and_the_round():
    draws = []
    for seed in (0, 0, 1):
        algo = Local()
        make_federation(algo, seed=seed)
        draws.append([torch.rand(3, generator=algo.server.generator(r)) for r in (0, 1)])
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])
    assert not torch.equal(draws[0][0], draws[0][1]) and not torch.equal(draws[0][0], draws[2][0])
