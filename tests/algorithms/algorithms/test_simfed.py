"""SimFed: the factorized model, the criteria embeddings (Eq. 1–3), the reflection (Eq. 8) on
hand-computable cases against a float64 plain-PyTorch reference, the L1 term on μ, and a
digits run (loss down, finite, kill -9 / --resume bitwise)."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms.simfed import SimFed
from pfl_algorithms.api import Message, Sparse, Uploads
from pfl_algorithms.engine.checkpoint import read_checkpoint
from pfl_algorithms.engine.local import client_batches
from pfl_algorithms.engine.rounds import run_round
from pfl_algorithms.engine.seeds import stream_generator
from pfl_kernels.nn import FactorizedConv2d, FactorizedLinear

from .. import test_kill_resume as kill_resume
from ..state_checks import assert_same
from .federation_cases import make_federation


class HandServer:
    """A server of 3 clients whose shared groups are u [2], v [3] and mu [4] (initially zeros)."""

    num_clients = 3
    input_shape = (2,)

    def generator(self, round_=-1):
        return torch.Generator().manual_seed(0)

    def initial_model(self):
        return {"u": torch.zeros(2, dtype=torch.float64), "v": torch.zeros(3, dtype=torch.float64),
                "mu": torch.zeros(4, dtype=torch.float64)}


# Embeddings with cos(z0, z1) = 0.95, cos(z0, z2) = 0, cos(z1, z2) = sqrt(1 - 0.95²) ≈ 0.312.
EMBEDDINGS = torch.tensor([[1.0, 0.0], [0.95, math.sqrt(1 - 0.95 ** 2)], [0.0, 1.0]], dtype=torch.float64)
# α with exp(α·1) / exp(α·0.95) = 2: client 0's weights on {0, 1} are 2/3 and 1/3.
ALPHA = math.log(2) / 0.05


def hand_models():
    g = torch.Generator().manual_seed(1)
    return [{name: torch.randn(n, generator=g, dtype=torch.float64) for name, n in (("u", 2), ("v", 3), ("mu", 4))}
            for _ in range(3)]


def reference_reflection(models, embeddings, k, *, alpha, tau):
    """Eq. 8 literally, in float64: θ_k + Σ_j softmax(α σ_j)(θ_j − θ_k) over j with σ_j ≥ τ
    (self included, σ_k = 1), for each of u, v and mu separately."""
    z = embeddings / embeddings.norm(dim=1, keepdim=True)
    sigma = z @ z[k]
    sigma[k] = 1.0
    matched = [j for j in range(len(models)) if sigma[j] >= tau]
    attention = torch.softmax(alpha * sigma[matched], dim=0)
    return {g: models[k][g] + sum(a * (models[j][g] - models[k][g]) for a, j in zip(attention, matched))
            for g in models[k]}


def reflected(tau, alpha=ALPHA, clients=(0, 1, 2)):
    """SimFed's downloads after one round of the hand uploads."""
    algo = SimFed(alpha=alpha, tau=tau)
    algo.server = HandServer()
    algo.setup(algo.server)
    models = hand_models()
    messages = [Message({"u": m["u"], "v": m["v"], "mu": Sparse(m["mu"])}, {"embedding": z}, 10)
                for m, z in zip(models, EMBEDDINGS)]
    algo.aggregate(0, Uploads([0, 1, 2], messages))
    return models, algo.configure(1, torch.tensor(clients))


def test_reflection_is_the_hand_computed_similarity_weighted_average():
    models, sent = reflected(tau=0.9)
    for g in ("u", "v", "mu"):
        torch.testing.assert_close(sent[0].tensors[g], 2 / 3 * models[0][g] + 1 / 3 * models[1][g], rtol=0, atol=1e-6)
        torch.testing.assert_close(sent[1].tensors[g], 1 / 3 * models[0][g] + 2 / 3 * models[1][g], rtol=0, atol=1e-6)
        assert torch.equal(sent[2].tensors[g], models[2][g])  # nobody else reaches τ: its own model


@pytest.mark.parametrize("tau", [0.96, 0.9, 0.3, 0.0, -1.0])
@pytest.mark.parametrize("alpha", [ALPHA, 30.0, 1.0])
def test_reflection_matches_a_float64_reference_of_eq_8(tau, alpha):
    """τ decides who is matched: 0.96 nobody (each keeps its own), 0.9 clients 0 and 1, 0.3
    also 1 and 2, 0 and -1 everyone (σ = 0 reaches τ = 0)."""
    models, sent = reflected(tau=tau, alpha=alpha)
    for k in range(3):
        want = reference_reflection(models, EMBEDDINGS, k, alpha=alpha, tau=tau)
        for g in ("u", "v", "mu"):
            torch.testing.assert_close(sent[k].tensors[g], want[g], rtol=1e-6, atol=1e-6)
    if tau > 0.95:
        assert all(torch.equal(sent[k].tensors[g], models[k][g]) for k in range(3) for g in ("u", "v", "mu"))


@pytest.mark.parametrize("tau, matched", [(0.96, 0.0), (0.9, 2 / 3), (0.3, 4 / 3), (0.0, 2.0)])
def test_round_metrics_count_the_matches_eq_8_keeps(tau, matched):
    """``matched``: the mean number of other clients each seen client keeps (σ ≥ τ), which says
    whether reflection has anything to work with; ``zero_embeddings``: encoders silent on x_N."""
    algo = SimFed(tau=tau)
    algo.server = HandServer()
    algo.setup(algo.server)
    assert algo.round_metrics(0) == {"matched": None, "zero_embeddings": None}
    messages = [Message({"u": m["u"], "v": m["v"], "mu": Sparse(m["mu"])}, {"embedding": z}, 10)
                for m, z in zip(hand_models(), EMBEDDINGS)]
    algo.aggregate(0, Uploads([0, 1, 2], messages))
    metrics = algo.round_metrics(0)
    assert metrics["matched"] == pytest.approx(matched) and metrics["zero_embeddings"] == 0
    algo.embeddings[2] = 0.0  # a silent encoder: σ = 0 with everyone
    assert algo.round_metrics(0)["zero_embeddings"] == 1


def test_only_the_sampled_clients_are_sent_and_unseen_ones_keep_their_model():
    models, sent = reflected(tau=0.3, clients=(1,))
    assert sorted(sent) == [1]
    want = reference_reflection(models, EMBEDDINGS, 1, alpha=ALPHA, tau=0.3)
    for g in ("u", "v", "mu"):
        torch.testing.assert_close(sent[1].tensors[g], want[g], rtol=1e-6, atol=1e-6)
    algo = SimFed(tau=-1.0)  # even with every similarity kept, a client never seen is not mixed
    algo.server = HandServer()
    algo.setup(algo.server)
    first = hand_models()[0]
    algo.aggregate(0, Uploads([0], [Message(dict(first), {"embedding": EMBEDDINGS[0]}, 10)]))
    sent = algo.configure(1, torch.tensor([0, 2]))
    for g in ("u", "v", "mu"):
        assert torch.equal(sent[0].tensors[g], first[g])  # only itself is known
        assert torch.equal(sent[2].tensors[g], torch.zeros_like(first[g]))  # its stored (initial) model


def test_the_model_is_factorized_with_simfeds_layout_into_u_v_mu_groups():
    algo = SimFed()
    fed = make_federation(algo)
    cohort = fed.cohorts[0]
    module = cohort.module
    assert isinstance(module.body[0], FactorizedLinear) and isinstance(module.head, FactorizedLinear)
    assert cohort.groups.members["u"] == ("body.0.u",) and cohort.groups.members["mu"] == ("body.0.mu",)
    assert cohort.groups.members["head"] == ("head.u", "head.v", "head.mu", "head.bias")
    assert float(module.body[0].mu.detach().abs().sum()) == 0.0  # init='xavier': μ starts at zero
    from pfl_algorithms.models import build_model

    cnn = SimFed(init="svd").prepare_model(build_model("digits-cnn", input_shape=(1, 8, 8), num_classes=10))
    conv = cnn.body[0]
    assert isinstance(conv, FactorizedConv2d) and conv.layout == "simfed"
    assert conv.u.shape == (1 * 3, 1) and conv.v.shape == (1, 16 * 3) and conv.mu.shape == (3, 48)  # Eq. 6


def test_bad_settings_name_the_setting():
    with pytest.raises(ValueError, match="tau"):
        SimFed(tau=1.5)
    with pytest.raises(ValueError, match="lambda1"):
        SimFed(lambda1=-1.0)
    with pytest.raises(ValueError, match="init"):
        SimFed(init="kaiming")


def test_criteria_embeddings_are_the_encoders_output_on_one_seeded_gaussian_input():
    """With lr 0 every client keeps the initial model: the same encoder gives every client the
    same embedding, the body's output (eval mode) on x_N ~ N(0, 1) drawn from the run's seed."""
    algo = SimFed()
    fed = make_federation(algo, seed=5, lr=0.0)
    criteria = torch.randn((1, 4), generator=stream_generator(5, "server", -1))
    assert torch.equal(algo.criteria, criteria)
    run_round(fed, algo, 0)
    module = copy.deepcopy(fed.cohorts[0].module).eval()
    with torch.no_grad():
        want = module.body(criteria.double())[0].float()
    assert algo.embeddings.shape == (3, 6) and bool(algo.seen.all())
    for k in range(3):
        assert torch.equal(algo.embeddings[k], want)
    other = SimFed()
    make_federation(other, seed=6)
    assert not torch.equal(other.criteria, criteria)


def test_criteria_and_state_are_identical_after_resume():
    algo = SimFed()
    fed = make_federation(algo, seed=2)
    run_round(fed, algo, 0)
    fed_state, algo_state = copy.deepcopy(fed.state_dict()), copy.deepcopy(algo.state_dict())
    run_round(fed, algo, 1)
    resumed = SimFed()
    again = make_federation(resumed, seed=2)
    again.load_state_dict(fed_state)
    resumed.load_state_dict(algo_state)
    assert torch.equal(resumed.criteria, algo.criteria)
    run_round(again, resumed, 1)
    assert_same(again.state_dict(), fed.state_dict())
    assert_same(resumed.state_dict(), algo.state_dict())


def test_local_step_adds_the_l1_subgradient_of_every_mu():
    """One SGD step is w − lr·∇(CE + λ1 Σ‖μ‖₁), the gradient by autograd (|x|' = sign x), with
    μ nonzero (init='svd') in the body and in the head."""
    lam, lr = 0.05, 0.1
    algo = SimFed(lambda1=lam, init="svd")
    fed = make_federation(algo, steps=1, lr=lr)
    cohort = fed.cohorts[0]
    module = copy.deepcopy(cohort.module)
    w = cohort.params.row(1).clone().requires_grad_(True)
    (batch,) = list(client_batches(fed.clients[1].train, fed.settings.schedule, fed.generator("train", 0, 1)))
    views = cohort.layout.views(w)
    logits = torch.func.functional_call(module, views, (fed.inputs[batch],))
    loss = F.cross_entropy(logits, fed.labels[batch]) + lam * (views["body.0.mu"].abs().sum()
                                                               + views["head.mu"].abs().sum())
    (g,) = torch.autograd.grad(loss, w)
    assert float(views["head.mu"].detach().abs().sum()) > 0 and float(views["body.0.mu"].detach().abs().sum()) > 0
    run_round(fed, algo, 0)
    torch.testing.assert_close(cohort.params.row(1), (w - lr * g).detach(), rtol=1e-12, atol=1e-12)


def test_mu_travels_sparsely():
    """Per client, up: u, v, the body's bias and the head densely (64-bit), μ only its entries
    ≥ mu_threshold, and the 6-long embedding; down: the reflected groups and the criteria input."""
    for threshold, mu_sent in ((0.0, 4 * 6), (1e30, 0)):
        algo = SimFed(init="svd", mu_threshold=threshold)
        fed = make_federation(algo, lr=0.0)
        record = run_round(fed, algo, 0)
        cohort = fed.cohorts[0]
        sizes = {g: cohort.span(g).stop - cohort.span(g).start for g in cohort.groups.order}
        dense = sizes["u"] + sizes["v"] + sizes["body"] + sizes["head"]
        assert record.bits_up == 3 * (dense + mu_sent + 6) * 64
        assert record.bits_down == 3 * ((dense + sizes["mu"]) * 64 + 4 * 32)


def test_a_few_rounds_on_digits(tmp_path):
    """The whole path on real data (permuted labels: the head stays local): every round logs
    every client, training lowers the loss, and every state stays finite."""
    from pfl_algorithms.config import RunConfig, check
    from pfl_algorithms.runner import run

    pytest.importorskip("sklearn")
    config = check(RunConfig(algorithm="simfed", dataset="digits", scenario="permuted-iid", clients=6, rounds=4,
                             batch_size=16, local_epochs=2, lr=0.05, weight_decay=1e-4))
    run(config, tmp_path / "run", progress=False)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2, 3] and all(len(m["train_loss"]) == 6 for m in lines)
    mean_loss = [sum(m["train_loss"].values()) / 6 for m in lines]
    assert all(math.isfinite(x) for x in mean_loss) and mean_loss[-1] < mean_loss[0]
    state = read_checkpoint(tmp_path / "run" / "checkpoint.pt")
    for tensor in [*state["algorithm"]["bank"].values(), state["algorithm"]["embeddings"],
                   state["federation"]["cohorts"]["model"]["params"]]:
        assert torch.isfinite(tensor).all()
    assert "head" not in state["algorithm"]["bank"]  # the classifier never leaves its client


@pytest.mark.slow  # end to end: a killed process, then a resumed one
def test_kill_9_then_resume_is_bitwise(tmp_path, monkeypatch):
    """test_kill_resume's kill -9 mid-run then --resume, for SimFed (its server keeps every
    client's latest upload and embedding; the criteria input is drawn again from the seed)."""
    monkeypatch.setitem(kill_resume.CASES, "simfed", [])
    kill_resume.test_kill_9_then_resume_is_bitwise(tmp_path, "simfed")
