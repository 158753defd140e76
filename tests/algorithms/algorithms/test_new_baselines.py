"""FedRep, Per-FedAvg and pFedMe: each paper's update rule on a tiny case, against autograd."""
from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms.fedrep import FedRep
from pfl_algorithms.algorithms.per_fedavg import PerFedAvg
from pfl_algorithms.algorithms.pfedme import PFedMe
from pfl_algorithms.engine.client import phase_schedule
from pfl_algorithms.engine.local import client_batches
from pfl_algorithms.engine.rounds import evaluate_all, run_round

from .federation_cases import make_federation

TOL = dict(rtol=1e-12, atol=1e-12)


def row(fed, client):
    return fed.cohorts[0].params.row(client)


def loss_fn(fed, client):
    """f(flat params; batch indices): the client's cross-entropy, differentiable in the params."""
    cohort = fed.cohorts[0]
    module = copy.deepcopy(cohort.module)

    def f(flat, batch):
        y = fed.labels[batch]
        if fed.clients[client].label_map is not None:
            y = fed.clients[client].label_map[y]
        return F.cross_entropy(torch.func.functional_call(module, cohort.layout.views(flat), (fed.inputs[batch],)), y)

    return f


def grad(f, w, batch):
    w = w.detach().requires_grad_(True)
    return torch.autograd.grad(f(w, batch), w)[0]


def test_fedrep_trains_the_head_then_the_body_each_with_its_own_momentum():
    algo = FedRep(head_epochs=1)
    fed = make_federation(algo, steps=2, optimizer_settings={"lr": 0.1, "momentum": 0.9})
    cohort = fed.cohorts[0]
    head, body = cohort.span("head"), cohort.span("body")
    f = loss_fn(fed, 1)
    w = row(fed, 1).clone()
    generator = fed.generator("train", 0, 1)
    for phase, span in zip(algo.plan(1), (head, body)):
        buffer = None
        for step, batch in enumerate(client_batches(fed.clients[1].train, phase_schedule(phase, fed.settings.schedule),
                                                    generator)):
            g = grad(f, w, batch)[span]
            buffer = g if buffer is None else 0.9 * buffer + g  # torch.optim.SGD's momentum, fresh per phase
            w[span] -= 0.1 * buffer
    run_round(fed, algo, 0)
    torch.testing.assert_close(row(fed, 1), w, **TOL)
    assert set(algo.global_model) == {"body"}  # the head is never sent
    bodies = torch.stack([row(fed, k)[body] for k in range(3)])
    n = fed.train_sizes()
    torch.testing.assert_close(algo.global_model["body"], (n / n.sum()) @ bodies, **TOL)


@pytest.mark.parametrize("variant,hvp", [("fo", "exact"), ("hf", "exact"), ("hf", "finite-difference")])
def test_per_fedavg_step_is_the_maml_update(variant, hvp):
    alpha, beta = 0.05, 0.1
    algo = PerFedAvg(alpha=alpha, variant=variant, hvp=hvp, delta=1e-5)
    fed = make_federation(algo, steps=1, optimizer_settings={"lr": beta, "momentum": 0.9})  # 1 step: no momentum yet
    f = loss_fn(fed, 0)
    w = row(fed, 0).clone()
    batches = list(client_batches(fed.clients[0].train, phase_schedule(algo.plan(0)[0], fed.settings.schedule),
                                  fed.generator("train", 0, 0)))
    assert len(batches) == (3 if variant == "hf" else 2)
    inner = w - alpha * grad(f, w, batches[0])
    g = grad(f, inner, batches[1])
    if variant == "hf":
        _, hg = torch.autograd.functional.hvp(lambda p: f(p, batches[2]), w, g)
        g = g - alpha * hg
    run_round(fed, algo, 0)
    tol = TOL if hvp == "exact" else dict(rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(row(fed, 0), w - beta * g, **tol)


def test_per_fedavg_evaluates_after_one_step_from_the_global_model():
    alpha = 0.05
    algo = PerFedAvg(alpha=alpha)
    fed = make_federation(algo, steps=1)
    run_round(fed, algo, 0)
    result = evaluate_all(fed, algo)
    cohort = fed.cohorts[0]
    for client in range(3):
        w = row(fed, client).clone()
        for group, value in algo.global_model.items():
            w[cohort.span(group)] = value
        schedule = replace(fed.settings.schedule, steps=1)
        batch = next(client_batches(fed.clients[client].train, schedule, fed.generator("finetune", fed.round, client)))
        f = loss_fn(fed, client)
        adapted = w - alpha * grad(f, w, batch)
        test = fed.clients[client].test
        assert result["loss"][client] == pytest.approx(float(f(adapted, test)), rel=1e-10)


def test_pfedme_step_solves_the_moreau_problem_then_moves_w():
    lam, plr, k, eta, beta = 2.0, 0.05, 3, 0.1, 0.7
    algo = PFedMe(lam=lam, personal_lr=plr, inner_steps=k, beta=beta)
    fed = make_federation(algo, steps=2, optimizer_settings={"lr": eta, "momentum": 0.9})  # the step takes none
    cohort = fed.cohorts[0]
    global_before = {g: v.clone() for g, v in algo.global_model.items()}
    want = []
    for client in range(3):
        f = loss_fn(fed, client)
        w = row(fed, client).clone()
        theta = w.clone()  # the first step starts θ from the received model
        for batch in client_batches(fed.clients[client].train, fed.settings.schedule,
                                    fed.generator("train", 0, client)):
            for _ in range(k):
                theta = theta - plr * (grad(f, theta, batch) + lam * (theta - w))
            w = w - eta * lam * (w - theta)
        want.append((w, theta))
    run_round(fed, algo, 0)
    for client, (w, theta) in enumerate(want):
        torch.testing.assert_close(row(fed, client), w, **TOL)
        torch.testing.assert_close(cohort.extra["personal"].row(client), theta, **TOL)
    n = fed.train_sizes()
    average = (n / n.sum()) @ torch.stack([w for w, _ in want])
    for group in ("body", "head"):
        span = cohort.span(group)
        torch.testing.assert_close(algo.global_model[group], (1 - beta) * global_before[group] + beta * average[span],
                                   **TOL)
    # Clients are evaluated with their personal models.
    result = evaluate_all(fed, algo)
    for client, (_, theta) in enumerate(want):
        test = fed.clients[client].test
        assert result["loss"][client] == pytest.approx(float(loss_fn(fed, client)(theta, test)), rel=1e-10)


def test_pfedme_refuses_an_inner_step_that_cannot_converge():
    """personal_lr * lam >= 2: |1 - personal_lr (L + lam)| >= 1 for every curvature L >= 0, so the
    inner gradient descent cannot converge; the run is refused before it trains on noise."""
    PFedMe(lam=15.0, personal_lr=0.13)  # the released code's lamda 15 with a step just inside
    for lam, plr in ((15.0, 0.2), (10.0, 0.2), (1.0, 2.0)):
        with pytest.raises(ValueError, match="personal_lr \\* lam"):
            PFedMe(lam=lam, personal_lr=plr)


@pytest.mark.parametrize("name", ["fedrep", "per-fedavg", "pfedme"])
def test_a_few_rounds_on_digits(tmp_path, name):
    """The whole path on real data: every round logs every client, training lowers the loss,
    and the communication is the hand count of what travels (the body and its BatchNorm
    statistics, down and up, 32 bits each: the head stays with its client)."""
    from pfl_algorithms.config import RunConfig, check
    from pfl_algorithms.models import build_model
    from pfl_algorithms.runner import run

    pytest.importorskip("sklearn")
    config = check(RunConfig(algorithm=name, dataset="digits", scenario="permuted-iid", clients=6, rounds=4,
                             batch_size=16, local_epochs=2, lr=0.05))
    summary = run(config, tmp_path / name, progress=False)
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2, 3] and all(len(m["train_loss"]) == 6 for m in lines)
    mean_loss = [sum(m["train_loss"].values()) / 6 for m in lines]
    assert mean_loss[-1] < mean_loss[0]
    model = build_model("digits-cnn", input_shape=(1, 8, 8), num_classes=10)
    body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head."))
    buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    per_round = 6 * (body + buffers) * 32
    assert all(m["bits_down"] == m["bits_up"] == per_round for m in lines)
    assert summary["comm_gb"]["up"] + summary["comm_gb"]["down"] == pytest.approx(4 * 2 * per_round / 1e9)
