"""pFedHN and pFedHN-PC (Fed-CMA's CIFAR-10 Table 3 baselines): the hypernetwork and its server
step on tiny hand-computable float64 cases, pFedHN-PC's local head, resume, then a few rounds
on digits (the loss goes down, the state stays finite, a stopped run resumed with --resume is bitwise)."""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms.pfedhn import (PFedHN, PFedHNPC, clip_term, generate, init_hypernetwork,
                                              server_gradients)
from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.engine.messages import Message
from pfl_algorithms.engine.rounds import evaluate_all, run_round
from pfl_algorithms.engine.uploads import Uploads
from tests.algorithms.state_checks import assert_same
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from .federation_cases import BatchNormNet, make_federation

TOL = dict(rtol=1e-12, atol=1e-12)
D = torch.float64


def tiny_params():
    """A hypernetwork by hand: 3 clients, embed_dim 2, hidden 2, n_hidden 1, groups a (2) and b (1)."""
    t = lambda *rows: torch.tensor(rows, dtype=D)  # noqa: E731
    return {"embeddings": t([1.0, -1.0], [0.5, 2.0], [-1.0, 0.0]),
            "mlp.0.weight": t([1.0, 0.0], [1.0, 1.0]), "mlp.0.bias": t(0.0, -1.0),
            "mlp.1.weight": t([2.0, 0.0], [-1.0, 1.0]), "mlp.1.bias": t(0.5, 0.0),
            "out.a.weight": t([1.0, 0.0], [0.0, 2.0]), "out.a.bias": t(0.0, 1.0),
            "out.b.weight": t([1.0, -1.0]), "out.b.bias": t(3.0)}


def test_generate_by_hand():
    # client 1: v = (0.5, 2); layer 0: (0.5, 1.5); ReLU; layer 1: (1.5, 1.0); out a = (1.5, 3), b = 3.5
    theta = generate(tiny_params(), 1, ["a", "b"])
    torch.testing.assert_close(theta["a"], torch.tensor([1.5, 3.0], dtype=D), **TOL)
    torch.testing.assert_close(theta["b"], torch.tensor([3.5], dtype=D), **TOL)
    # client 0: v = (1, -1); layer 0: (1, -1); ReLU -> (1, 0); layer 1: (2.5, -1); the last has no ReLU
    theta = generate(tiny_params(), 0, ["a", "b"])
    torch.testing.assert_close(theta["a"], torch.tensor([2.5, -1.0], dtype=D), **TOL)
    torch.testing.assert_close(theta["b"], torch.tensor([6.5], dtype=D), **TOL)


def test_server_gradients_are_the_vjp_of_the_update():
    """(∇θ_i)ᵀΔθ_i for φ and v: autograd of ⟨θ_i(φ, v), Δθ_i⟩ with Δθ_i = θ_i − θ̃_i held fixed,
    and by hand for the output layer (bias: Δθ; weight: Δθ·featuresᵀ) and the other clients'
    embeddings (0)."""
    params = tiny_params()
    trained = {"a": torch.tensor([1.0, 2.0], dtype=D), "b": torch.tensor([4.0], dtype=D)}
    grads = server_gradients(params, 1, trained)
    delta = {"a": torch.tensor([0.5, 1.0], dtype=D), "b": torch.tensor([-0.5], dtype=D)}  # θ_1 − θ̃
    leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
    theta = generate(leaves, 1, ["a", "b"])
    inner = sum((theta[g] * delta[g]).sum() for g in delta)
    want = dict(zip(leaves, torch.autograd.grad(inner, list(leaves.values()))))
    assert list(grads) == list(params)
    for name in params:
        torch.testing.assert_close(grads[name], want[name], **TOL)
    features = torch.tensor([1.5, 1.0], dtype=D)
    torch.testing.assert_close(grads["out.a.bias"], delta["a"], **TOL)
    torch.testing.assert_close(grads["out.a.weight"], torch.outer(delta["a"], features), **TOL)
    torch.testing.assert_close(grads["out.b.weight"], torch.outer(delta["b"], features), **TOL)
    assert not grads["embeddings"][[0, 2]].any() and grads["embeddings"][1].abs().sum() > 0
    # dθ/dh = out weights; dh/dv through layer 1, ReLU (both units active) and layer 0
    dh = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, -1.0]], dtype=D).T @ torch.cat([delta["a"], delta["b"]])
    dv = torch.tensor([[1.0, 0.0], [1.0, 1.0]], dtype=D).T @ (torch.tensor([[2.0, 0.0], [-1.0, 1.0]], dtype=D).T @ dh)
    torch.testing.assert_close(grads["embeddings"][1], dv, **TOL)


def test_init_draws_like_nn_linear_and_embedding_from_the_generator():
    sizes = {"body": 30, "head": 21}
    params = init_hypernetwork(sizes, 5, 2, 8, 3, torch.Generator().manual_seed(0), D)
    assert [n for n in params if n.startswith("mlp.")] == [f"mlp.{j}.{k}" for j in range(4) for k in ("weight", "bias")]
    assert params["embeddings"].shape == (5, 2) and params["mlp.0.weight"].shape == (8, 2)
    assert params["out.body.weight"].shape == (30, 8) and params["out.head.bias"].shape == (21,)
    for name, p in params.items():
        if name != "embeddings":  # U(-1/sqrt(fan_in), 1/sqrt(fan_in)), nn.Linear's bound
            assert p.abs().max() <= 1 / math.sqrt(2 if name.startswith("mlp.0.") else 8)
    again = init_hypernetwork(sizes, 5, 2, 8, 3, torch.Generator().manual_seed(0), D)
    assert_same(params, again)


def test_setup_sizes_the_hypernetwork_and_refuses_batchnorm():
    algo = PFedHN()
    make_federation(algo, clients=3)
    assert algo.params["embeddings"].shape == (3, int(1 + 3 / 4)) and algo.params["mlp.0.weight"].shape == (100, 1)
    assert sum(1 for n in algo.params if n.startswith("mlp.") and n.endswith(".weight")) == 4  # 1 + n_hidden
    assert algo.params["out.body.weight"].shape == (30, 100) and algo.params["out.head.weight"].shape == (21, 100)
    pc = PFedHNPC(embed_dim=3, hidden=7, n_hidden=0)
    make_federation(pc, clients=3)
    assert pc.groups == ["body"] and "out.head.weight" not in pc.params and pc.params["embeddings"].shape == (3, 3)
    with pytest.raises(ValueError, match="BatchNorm"):
        make_federation(PFedHN(), models=BatchNormNet().to(D))


def test_server_step_is_the_codes_sgd_one_step_per_upload_with_gradients_at_the_rounds_phi():
    """Two uploads: each gradient is taken at the φ that generated the round's θ_i, then SGD
    (momentum 0.9, weight decay, the embedding lr) steps once per upload in client order;
    with clipping, each gradient is scaled by max_norm / (‖g‖ + 1e-6)."""
    for clip in (0.0, 0.5):
        algo = PFedHN(hidden=5, n_hidden=1, server_lr=0.1, embed_lr=0.3, server_weight_decay=0.01, server_clip=clip,
                      server_update="sequential")
        make_federation(algo, clients=3)
        before = {n: p.detach().clone() for n, p in algo.params.items()}
        trained = {c: {g: t + 0.1 * (c + 1) * torch.linspace(-1, 1, t.numel(), dtype=D)
                       for g, t in algo.generated(c).tensors.items()} for c in (0, 2)}
        algo.aggregate(0, Uploads([0, 2], [Message(trained[0]), Message(trained[2])]))
        params, momentum = {n: p.clone() for n, p in before.items()}, {}
        for c in (0, 2):
            grads = server_gradients(before, c, trained[c])
            if clip:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
                grads = {n: g * min(1.0, clip / (float(norm) + 1e-6)) for n, g in grads.items()}
            for n in params:
                g = grads[n] + 0.01 * params[n]
                momentum[n] = g if n not in momentum else 0.9 * momentum[n] + g
                params[n] = params[n] - (0.3 if n == "embeddings" else 0.1) * momentum[n]
        for n in params:
            torch.testing.assert_close(algo.params[n].detach(), params[n], **TOL)
        state = algo.state_dict()
        torch.testing.assert_close(state["momentum"]["out.body.bias"], momentum["out.body.bias"], **TOL)
        assert all(p.grad is None for p in algo.params.values())


def test_server_update_mean_takes_one_step_on_the_mean_gradient_each_embedding_its_own():
    algo = PFedHN(hidden=5, n_hidden=1, server_lr=0.1, embed_lr=0.3, server_weight_decay=0.01, server_clip=0.0)
    make_federation(algo, clients=3)
    before = {n: p.detach().clone() for n, p in algo.params.items()}
    trained = {c: {g: t + 0.1 * (c + 1) * torch.linspace(-1, 1, t.numel(), dtype=D)
                   for g, t in algo.generated(c).tensors.items()} for c in (0, 2)}
    algo.aggregate(0, Uploads([0, 2], [Message(trained[0]), Message(trained[2])]))
    grads = [server_gradients(before, c, trained[c]) for c in (0, 2)]
    for n, p in before.items():
        g = grads[0][n] + grads[1][n]
        g = (g if n == "embeddings" else g / 2) + 0.01 * p  # one step: momentum buffer = first gradient
        torch.testing.assert_close(algo.params[n].detach(), p - (0.3 if n == "embeddings" else 0.1) * g, **TOL)
    assert not torch.equal(algo.params["embeddings"][1], before["embeddings"][1] * 1)  # weight decay moves it
    torch.testing.assert_close(algo.params["embeddings"][1], before["embeddings"][1] * (1 - 0.3 * 0.01), **TOL)


def test_one_client_per_round_is_the_papers_loop():
    """clients_per_round=1: download θ_i = h(v_i; φ), local training, then one step along
    (∇θ_i)ᵀ(θ_i − θ̃_i), the code's train() step."""
    algo = PFedHN(hidden=4, n_hidden=1)
    fed = make_federation(algo, clients=3, clients_per_round=1)
    before = {n: p.detach().clone() for n, p in algo.params.items()}
    record = run_round(fed, algo, 0)
    (client,) = record.clients
    trained = {g: fed.cohorts[0].params.row(client)[fed.cohorts[0].span(g)].clone() for g in ("body", "head")}
    hnet = torch.nn.ParameterList([torch.nn.Parameter(p.clone()) for p in before.values()])
    optimizer = torch.optim.SGD(
        [{"params": list(hnet)[1:]}, {"params": [hnet[0]], "lr": 1e-2}], lr=1e-2, momentum=0.9, weight_decay=1e-3)
    weights = generate(dict(zip(before, hnet)), client, ["body", "head"])
    grads = torch.autograd.grad(list(weights.values()), list(hnet),
                                grad_outputs=[weights[g].detach() - trained[g] for g in weights])
    for p, g in zip(hnet, grads):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(hnet.parameters(), 50)
    optimizer.step()
    for name, p in zip(before, hnet):
        torch.testing.assert_close(algo.params[name].detach(), p.detach(), **TOL)


def test_downloads_and_evaluation_are_the_generated_model():
    algo = PFedHN(hidden=6)
    fed = make_federation(algo, clients=3)
    downloads = algo.configure(0, torch.tensor([0, 2]))
    assert sorted(downloads) == [0, 2]
    for c in (0, 2):
        want = generate(algo.params, c, ["body", "head"])
        assert list(downloads[c].tensors) == ["body", "head"]
        for g in want:
            torch.testing.assert_close(downloads[c].tensors[g], want[g].detach(), **TOL)
    accuracy = evaluate_all(fed, algo, "test")
    module = fed.cohorts[0].module
    for k in range(3):
        theta = torch.cat(list(generate(algo.params, k, ["body", "head"]).values())).detach()
        test = fed.clients[k].test
        logits = torch.func.functional_call(module, fed.cohorts[0].layout.views(theta), (fed.inputs[test],))
        assert accuracy["accuracy"][k] == pytest.approx(float((logits.argmax(1) == fed.labels[test]).double().mean()))
    record = run_round(fed, algo, 0)
    model_bits = fed.cohorts[0].params.row(0).numel() * 64
    assert record.bits_down == 3 * model_bits and record.bits_up == 3 * model_bits


def test_pfedhn_pc_never_sends_or_overwrites_the_head():
    """The body is generated and sent; each client's head stays on the client: it is trained
    there (changed by a round), never in a download, upload or evaluation message, and a round
    without local steps leaves it as it was."""
    algo = PFedHNPC(hidden=6)
    fed = make_federation(algo, clients=3)
    cohort = fed.cohorts[0]
    head = lambda: torch.stack([cohort.params.row(k)[cohort.span("head")].clone() for k in range(3)])  # noqa: E731
    start = head()
    assert all(list(m.tensors) == ["body"] for m in algo.configure(0, torch.tensor([0, 1, 2])).values())
    assert list(algo.evaluation(1).tensors) == ["body"]
    record = run_round(fed, algo, 0)
    assert record.bits_down == record.bits_up == 3 * cohort.span("body").stop * 64
    trained = head()
    assert not torch.equal(trained, start) and not torch.equal(trained[0], trained[1])
    fed.settings = replace(fed.settings, schedule=replace(fed.settings.schedule, epochs=0, steps=0))
    phi = {n: p.detach().clone() for n, p in algo.params.items()}
    run_round(fed, algo, 1)
    torch.testing.assert_close(head(), trained, rtol=0, atol=0)
    for k in range(3):  # the body is the one generated from the round's φ
        torch.testing.assert_close(cohort.params.row(k)[cohort.span("body")], generate(phi, k, ["body"])["body"],
                                   rtol=0, atol=0)
    with pytest.raises(ValueError, match="keep_head_local=False"):
        check(RunConfig(algorithm="pfedhn-pc", keep_head_local=False))


def test_client_clip_scales_the_generated_groups_gradient():
    grads = {"body": torch.tensor([3.0, 0.0], dtype=D), "head": torch.tensor([4.0], dtype=D)}
    view = SimpleNamespace(grad=grads.__getitem__)
    assert clip_term(["body"], 10.0)(view) is None
    torch.testing.assert_close(grads["body"], torch.tensor([3.0, 0.0], dtype=D), **TOL)  # below the norm
    clip_term(["body", "head"], 4.0)(view)  # norm 5
    torch.testing.assert_close(grads["body"], torch.tensor([3.0 * 4 / (5 + 1e-6), 0.0], dtype=D), **TOL)
    torch.testing.assert_close(grads["head"], torch.tensor([4.0 * 4 / (5 + 1e-6)], dtype=D), **TOL)
    only_body = {"body": torch.tensor([3.0, 4.0], dtype=D), "head": torch.tensor([100.0], dtype=D)}
    clip_term(["body"], 1.0)(SimpleNamespace(grad=only_body.__getitem__))
    assert float(only_body["head"]) == 100.0  # pFedHN-PC's local head is not clipped


def test_state_dict_resumes_bitwise():
    """Two rounds, a state_dict into a fresh algorithm, then the third round on both: the same
    hypernetwork and momentum, bit for bit."""
    def fresh():
        algo = PFedHN(hidden=6)
        return algo, make_federation(algo, clients=3, clients_per_round=2, rounds=3)

    algo, fed = fresh()
    for r in range(2):
        run_round(fed, algo, r)
    saved, fed_state = algo.state_dict(), fed.state_dict()
    assert set(saved["momentum"]) == set(saved["params"])
    other, other_fed = fresh()
    other.load_state_dict(saved)
    other_fed.load_state_dict(fed_state)
    run_round(fed, algo, 2)
    run_round(other_fed, other, 2)
    assert_same(other.state_dict(), algo.state_dict())


def test_settings_are_checked():
    assert PFedHNPC().settings.server_lr == 5e-2 and PFedHN().settings.server_lr == 1e-2
    for bad, key in (({"hidden": 0}, "hidden"), ({"embed_dim": 0}, "embed_dim"), ({"server_lr": 0.0}, "server_lr"),
                     ({"n_hidden": -1}, "n_hidden"), ({"server_clip": -1.0}, "server_clip"),
                     ({"embed_lr": math.nan}, "embed_lr")):
        with pytest.raises(ValueError, match=key):
            PFedHN(**bad)


# ---------------------------------------------------------------- digits

ROUNDS = 4


@pytest.mark.parametrize("algorithm", ["pfedhn", "pfedhn-pc"])
@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_digits_loss_goes_down_and_stop_and_resume_is_bitwise(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    # --lr 0.005: the code's inner lr (the run's default 0.05 is ten times the client step it was tuned with)
    args = [algorithm, "--dataset", "digits", "--clients", "4", "--rounds", str(ROUNDS), "--quiet",
            "--scenario", "pathological", "--lr", "0.005"]
    reference, state = assert_resume_bitwise(tmp_path, args, ROUNDS, stop_after=2)
    mean = [sum(m["train_loss"].values()) / len(m["train_loss"]) for m in reference]
    assert all(math.isfinite(v) for v in mean) and mean[-1] < mean[0]
    for tensor in [*state["algorithm"]["params"].values(), *state["algorithm"]["momentum"].values()]:
        assert torch.isfinite(tensor).all()
    assert set(state["algorithm"]["momentum"]) == set(state["algorithm"]["params"])
    assert all(m["bits_down"] == m["bits_up"] for m in reference)
