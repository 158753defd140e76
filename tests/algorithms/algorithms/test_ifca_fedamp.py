"""IFCA and FedAMP (pFedMB's Table 2 baselines): each rule on a tiny hand-computable case
against a float64 reference, then a few rounds on digits (the loss goes down, the state stays
finite, a stopped run resumed with --resume is bitwise)."""
from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms.fedamp import FedAMP, attention_weights, cloud_model
from pfl_algorithms.algorithms.fedprox import proximal_term
from pfl_algorithms.algorithms.ifca import IFCA, cluster_weights, lowest_loss
from pfl_algorithms.engine.rounds import evaluate_all, run_round
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from .federation_cases import make_federation

TOL = dict(rtol=1e-12, atol=1e-12)
PERM = torch.tensor([2, 0, 1])


def train_loss(fed, client, flat):
    cohort = fed.cohorts[0]
    module = copy.deepcopy(cohort.module)
    batch = fed.clients[client].train
    labels = fed.labels[batch]
    if fed.clients[client].label_map is not None:
        labels = fed.clients[client].label_map[labels]
    logits = torch.func.functional_call(module, cohort.layout.views(flat), (fed.inputs[batch],))
    return float(F.cross_entropy(logits, labels))


def fit(fed, client, flat, steps=200, lr=0.3):
    """A model fitted to ``client``'s training data by full-batch gradient descent (float64)."""
    flat = flat.clone().requires_grad_(True)
    cohort = fed.cohorts[0]
    module = copy.deepcopy(cohort.module)
    batch = fed.clients[client].train
    labels = fed.clients[client].label_map[fed.labels[batch]]
    for _ in range(steps):
        logits = torch.func.functional_call(module, cohort.layout.views(flat), (fed.inputs[batch],))
        (grad,) = torch.autograd.grad(F.cross_entropy(logits, labels), flat)
        flat = (flat - lr * grad).detach().requires_grad_(True)
    return flat.detach()


# ---------------------------------------------------------------- IFCA

def test_lowest_loss_takes_the_first_minimum_and_never_a_nan():
    assert lowest_loss(torch.tensor([0.7, 0.3, 0.3], dtype=torch.float64)) == 1
    assert lowest_loss(torch.tensor([math.nan, 2.0, 1.5], dtype=torch.float64)) == 2
    assert lowest_loss(torch.tensor([math.nan, math.nan], dtype=torch.float64)) == 0


def test_cluster_weights_by_hand():
    chosen = torch.tensor([1, 0, 1, 1])
    sizes = torch.tensor([10.0, 20.0, 30.0, 60.0], dtype=torch.float64)
    uniform = cluster_weights(chosen, sizes, 3, "uniform")
    torch.testing.assert_close(uniform, torch.tensor([[0, 1, 0, 0], [1 / 3, 0, 1 / 3, 1 / 3], [0, 0, 0, 0]],
                                                     dtype=torch.float64), **TOL)
    examples = cluster_weights(chosen, sizes, 3, "examples")
    torch.testing.assert_close(examples[1], torch.tensor([0.1, 0, 0.3, 0.6], dtype=torch.float64), **TOL)


def test_ifca_clients_pick_their_lowest_loss_cluster_and_clusters_average_their_members():
    """Cluster 1 is fitted to client 2's permuted labels, cluster 0 is the initial model: client 2
    picks 1, the others 0 (checked against each model's float64 training loss); after the round
    each cluster model is the plain mean of its members' trained models, and a cluster nobody
    picks keeps its model.  k models go down to every client."""
    algo = IFCA(clusters=3)
    fed = make_federation(algo, clients=4, sizes=(30, 40, 50, 40), label_maps=[None, None, PERM, None])
    cohort = fed.cohorts[0]
    flat = torch.cat([algo.models["body"], algo.models["head"]], dim=1)  # [3, P] in layout order
    assert not torch.equal(flat[0], flat[1]) and not torch.equal(flat[1], flat[2])  # distinct draws
    flat[1] = fit(fed, 2, flat[0])
    flat[2] = flat[0] + 10.0  # a model nobody picks
    split = cohort.span("body").stop
    algo.models = {"body": flat[:, :split].clone(), "head": flat[:, split:].clone()}
    expected = [int(torch.tensor([train_loss(fed, k, flat[j]) for j in range(3)]).argmin()) for k in range(4)]
    assert expected == [0, 0, 1, 0]
    record = run_round(fed, algo, 0)
    assert [int(cohort.extra["cluster"].row(k)) for k in range(4)] == expected
    rows = torch.stack([cohort.params.row(k).clone() for k in range(4)])
    want = torch.stack([rows[[0, 1, 3]].mean(0), rows[2], flat[2]])
    torch.testing.assert_close(torch.cat([algo.models["body"], algo.models["head"]], dim=1), want, **TOL)
    model_bits = flat.shape[1] * 64  # float64 TinyNet, no buffers
    assert record.bits_down == 4 * 3 * model_bits
    assert record.bits_up == 4 * (model_bits + 64)  # its model and its cluster index


def test_ifca_evaluates_each_client_with_its_lowest_loss_cluster():
    algo = IFCA(clusters=2)
    fed = make_federation(algo, clients=3, label_maps=[None, PERM, None])
    flat = torch.cat([algo.models["body"], algo.models["head"]], dim=1)
    flat[1] = fit(fed, 1, flat[0])
    split = fed.cohorts[0].span("body").stop
    algo.models = {"body": flat[:, :split].clone(), "head": flat[:, split:].clone()}
    accuracy = evaluate_all(fed, algo, "test")
    for k, j in ((0, 0), (1, 1), (2, 0)):
        module = copy.deepcopy(fed.cohorts[0].module)
        test = fed.clients[k].test
        labels = fed.labels[test] if fed.clients[k].label_map is None else fed.clients[k].label_map[fed.labels[test]]
        logits = torch.func.functional_call(module, fed.cohorts[0].layout.views(flat[j]), (fed.inputs[test],))
        assert accuracy["accuracy"][k] == pytest.approx(float((logits.argmax(1) == labels).double().mean()))


def test_ifca_settings_are_checked():
    for bad, key in (({"clusters": 0}, "clusters"), ({"weighting": "mean"}, "weighting")):
        with pytest.raises(ValueError, match=key):
            IFCA(**bad)


# ---------------------------------------------------------------- FedAMP

def test_attention_weights_by_hand():
    # client 0 against clients 0..3: distances 0, 1, 2, 1; client 3 never uploaded
    d = torch.tensor([[0.0, 1.0, 2.0, 1.0]], dtype=torch.float64)
    available = torch.tensor([True, True, True, False])
    xi = attention_weights(d, torch.tensor([0]), available, alpha_k=0.5, sigma=2.0)
    x1, x2 = 0.5 * math.exp(-0.5) / 2, 0.5 * math.exp(-1.0) / 2
    torch.testing.assert_close(xi, torch.tensor([[1 - x1 - x2, x1, x2, 0.0]], dtype=torch.float64), **TOL)
    # α_k too large: the others' weights are scaled to sum to 1 and the client's own is 0
    xi = attention_weights(d, torch.tensor([0]), available, alpha_k=10.0, sigma=1.0)
    e1, e2 = math.exp(-1.0), math.exp(-2.0)
    torch.testing.assert_close(xi, torch.tensor([[0.0, e1 / (e1 + e2), e2 / (e1 + e2), 0.0]], dtype=torch.float64),
                               **TOL)


def test_fedamp_cloud_models_are_the_attention_weighted_mixes_of_the_stored_models():
    """After a round everyone has uploaded; each client's download is u_i = Σ_j ξ_ij w_j with
    ξ_ij = α_k·exp(−‖w_i − w_j‖²/σ)/σ (float64 reference, one model down each)."""
    algo = FedAMP(alpha_k=0.05, sigma=20.0, lamda=0.5)
    fed = make_federation(algo, clients=4, sizes=(30, 40, 50, 40), label_maps=[None, PERM, None, PERM])
    record = run_round(fed, algo, 0)
    rows = torch.stack([fed.cohorts[0].params.row(k).clone() for k in range(4)])
    torch.testing.assert_close(algo.models, rows, **TOL)
    downloads = algo.configure(1, torch.tensor([0, 2, 3]))
    for i in (0, 2, 3):
        xi = torch.tensor([0.05 * math.exp(-float((rows[i] - rows[j]).square().sum()) / 20.0) / 20.0
                           for j in range(4)], dtype=torch.float64)
        xi[i] = 1 - (xi.sum() - xi[i])
        want = (xi[:, None] * rows).sum(0)
        got = torch.cat([downloads[i].extras["cloud"][g] for g in ("body", "head")])
        torch.testing.assert_close(got, want, **TOL)
    model_bits = rows.shape[1] * 64
    assert record.bits_down == 4 * model_bits and record.bits_up == 4 * model_bits


def test_fedamp_first_round_cloud_is_the_clients_own_model():
    algo = FedAMP()
    fed = make_federation(algo, clients=3)
    downloads = algo.configure(0, torch.tensor([0, 1, 2]))
    for i in range(3):
        torch.testing.assert_close(torch.cat([downloads[i].extras["cloud"][g] for g in ("body", "head")]),
                                   fed.cohorts[0].params.row(i), **TOL)


def test_fedamp_proximal_gradient_is_lambda_over_alpha_times_w_minus_u():
    w = {"body": torch.tensor([1.0, 2.0], dtype=torch.float64), "head": torch.tensor([3.0], dtype=torch.float64)}
    u = {"body": torch.tensor([0.5, 2.5], dtype=torch.float64), "head": torch.tensor([1.0], dtype=torch.float64)}
    grads = {g: torch.full_like(t, 0.25) for g, t in w.items()}
    view = SimpleNamespace(download=SimpleNamespace(extras={"cloud": u}), group=w.__getitem__, grad=grads.__getitem__)
    loss = proximal_term(4.0, cloud_model)(view)
    torch.testing.assert_close(grads["body"], torch.tensor([0.25 + 2.0, 0.25 - 2.0], dtype=torch.float64), **TOL)
    torch.testing.assert_close(grads["head"], torch.tensor([0.25 + 8.0], dtype=torch.float64), **TOL)
    assert float(loss) == pytest.approx(0.5 * 4.0 * (0.25 + 0.25 + 4.0))


def test_fedamp_keeps_each_clients_own_model_and_only_uploads_it():
    """Nothing a client receives overwrites its model: with no local steps its row is unchanged."""
    algo = FedAMP(alpha_k=0.05, sigma=20.0)
    fed = make_federation(algo, clients=3, label_maps=[None, PERM, None])
    run_round(fed, algo, 0)
    before = torch.stack([fed.cohorts[0].params.row(k).clone() for k in range(3)])
    fed.settings = replace(fed.settings, schedule=replace(fed.settings.schedule, epochs=0, steps=0))
    run_round(fed, algo, 1)
    torch.testing.assert_close(torch.stack([fed.cohorts[0].params.row(k) for k in range(3)]), before, **TOL)
    for bad, key in (({"sigma": 0.0}, "sigma"), ({"alpha_k": -1.0}, "alpha_k"), ({"lamda": -1.0}, "lamda")):
        with pytest.raises(ValueError, match=key):
            FedAMP(**bad)


# ---------------------------------------------------------------- digits

ROUNDS = 4


@pytest.mark.parametrize("algorithm", ["ifca", "fedamp"])
@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_digits_loss_goes_down_and_stop_and_resume_is_bitwise(tmp_path, algorithm):
    pytest.importorskip("sklearn")
    args = [algorithm, "--dataset", "digits", "--clients", "4", "--rounds", str(ROUNDS), "--quiet",
            "--scenario", "pathological"]
    reference, state = assert_resume_bitwise(tmp_path, args, ROUNDS, stop_after=2)
    mean = [sum(m["train_loss"].values()) / len(m["train_loss"]) for m in reference]
    assert all(math.isfinite(v) for v in mean) and mean[-1] < mean[0]
    for tensor in state["algorithm"]["models"].values() if algorithm == "ifca" else [state["algorithm"]["models"]]:
        assert torch.isfinite(tensor).all()
    if algorithm == "ifca":  # k = 2 models down, one up with its cluster index
        assert all(m["bits_down"] == 2 * (m["bits_up"] - 4 * 64) for m in reference)
    else:
        assert all(m["bits_down"] == m["bits_up"] for m in reference[1:])
