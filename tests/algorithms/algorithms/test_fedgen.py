"""FedGen, limited sharing (Fed-CMA's Table 2 baseline): each rule on a tiny hand-computable
float64 case (label weights, the server's generator objective, the decay of α and β, Adam,
the client's regularizer), what travels (the head up; the head and the generator down), a
federation of two architectures, then a few rounds on digits (the loss goes down, the state
stays finite, a stopped run resumed with --resume is bitwise)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms.fedgen import (FedGen, FedGenSettings, GenerativeRegularizer, decayed,
                                              diversity_loss, embedding_size, generate, generator_loss,
                                              generator_optimizer, generator_shapes, head_logits, init_generator,
                                              label_weights)
from pfl_algorithms.api import Batch
from pfl_algorithms.config import RunConfig, check
from pfl_algorithms.engine.rounds import evaluate_all, run_round
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from ..engine.test_cohorts import two_architectures
from .federation_cases import make_federation

TOL = dict(rtol=1e-12, atol=1e-12)
SMALL = dict(hidden_dim=5, noise_dim=3, generator_steps=4)  # a generator small enough to count by hand
TINY_HEAD = 6 * 3 + 3  # TinyNet's head: Linear(6, 3)


def generator_size(noise=3, classes=3, hidden=5, d=6):
    return hidden * (noise + classes) + 3 * hidden + d * hidden + d, 2 * hidden  # params, BatchNorm statistics


def capture_uploads(algo):
    """Record every round's Uploads as aggregate sees them."""
    seen, aggregate = [], algo.aggregate

    def recording(round_, uploads):
        seen.append(uploads)
        aggregate(round_, uploads)
    algo.aggregate = recording
    return seen


# ---------------------------------------------------------------- the pieces, by hand

def test_embedding_size_is_read_off_the_head_and_the_generator_emits_it():
    assert embedding_size(TINY_HEAD, 3) == 6
    assert embedding_size(33 * 10, 10) == 32  # FedGen's CNN: Linear(32, 10)
    for bad in (20, 3):
        with pytest.raises(ValueError, match="Linear"):
            embedding_size(bad, 3)
    shapes = generator_shapes(noise_dim=3, classes=3, hidden_dim=5, embedding_dim=6)
    params, stats = init_generator(shapes, torch.Generator().manual_seed(0))
    assert (params.numel(), stats.numel()) == generator_size()
    noise = torch.rand(4, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out = generate(params, stats, shapes, torch.tensor([0, 2, 1, 2]), noise, training=True)
    assert out.shape == (4, 6) and out.dtype == torch.float64
    # torch's initialization: |W1|, |b1| <= 1/sqrt(6), BatchNorm 1 and 0, |W2|, |b2| <= 1/sqrt(5); statistics 0, 1
    assert params[:35].abs().max() <= 1 / math.sqrt(6) and params[45:].abs().max() <= 1 / math.sqrt(5)
    assert params[35:40].tolist() == [1.0] * 5 and params[40:45].tolist() == [0.0] * 5
    params2, _ = init_generator(shapes, torch.Generator().manual_seed(0))
    assert torch.equal(params, params2)  # the same stream draws the same generator


def test_generator_batch_norm_trains_on_the_batch_and_evaluates_on_its_statistics():
    shapes = generator_shapes(3, 3, 5, 6)
    params, stats = init_generator(shapes, torch.Generator().manual_seed(1))
    labels, noise = torch.tensor([0, 1, 2, 1]), torch.rand(4, 3, generator=torch.Generator().manual_seed(2),
                                                             dtype=torch.float64)
    x = torch.cat([noise, F.one_hot(labels, 3).double()], 1)
    h = x @ params[:30].view(5, 6).T + params[30:35]
    before = stats.clone()
    trained = generate(params, stats, shapes, labels, noise, training=True)
    normed = (h - h.mean(0)) / torch.sqrt(h.var(0, unbiased=False) + 1e-5)
    want = F.relu(normed) @ params[45:75].view(6, 5).T + params[75:]
    torch.testing.assert_close(trained, want, **TOL)
    torch.testing.assert_close(stats[:5], 0.9 * before[:5] + 0.1 * h.mean(0), **TOL)
    torch.testing.assert_close(stats[5:], 0.9 * before[5:] + 0.1 * h.var(0, unbiased=True), **TOL)
    evaluated = generate(params, stats, shapes, labels, noise, training=False)
    want = F.relu((h - stats[:5]) / torch.sqrt(stats[5:] + 1e-5)) @ params[45:75].view(6, 5).T + params[75:]
    torch.testing.assert_close(evaluated, want, **TOL)


def test_label_weights_share_each_label_by_the_senders_counts_plus_the_prior():
    counts = torch.tensor([[3.0, 0.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)  # 2 senders, 3 labels
    weights, labels = label_weights(counts, prior=1.0)
    torch.testing.assert_close(weights, torch.tensor([[4 / 6, 2 / 6], [1 / 2, 1 / 2], [2 / 3, 1 / 3]],
                                                     dtype=torch.float64), **TOL)
    assert labels.tolist() == [0, 2]  # label 1 nobody holds: never drawn
    weights, _ = label_weights(counts, prior=0.0)
    torch.testing.assert_close(weights, torch.tensor([[3 / 4, 1 / 4], [0, 0], [1, 0]], dtype=torch.float64), **TOL)


def test_generator_loss_by_hand():
    """α_e·Σ_i mean_b w_{y_b i}·CE_i(b) − β_e·KL(teacher ‖ student) + η_e·diversity, against
    loops over senders and samples."""
    g = torch.Generator().manual_seed(3)
    heads = torch.randn(2, TINY_HEAD, generator=g, dtype=torch.float64)
    average = torch.randn(TINY_HEAD, generator=g, dtype=torch.float64)
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 2, 2, 1])
    noise = torch.rand(4, 3, generator=g, dtype=torch.float64)
    output = torch.randn(4, 6, generator=g, dtype=torch.float64)
    settings = FedGenSettings(ensemble_alpha=2.0, ensemble_beta=0.5, ensemble_eta=3.0)
    loss, parts = generator_loss(heads, average, weights, labels, noise, output, settings)

    def logits(head, z):
        return z @ head[:18].view(3, 6).T + head[18:]
    teacher = sum(sum(weights[labels[b], i] * F.cross_entropy(logits(heads[i], output[b:b + 1]), labels[b:b + 1])
                      for b in range(4)) / 4 for i in range(2))
    mixed = sum(logits(heads[i], output) * weights[labels, i][:, None] for i in range(2))
    p, q = F.softmax(mixed, 1), F.log_softmax(logits(average, output), 1)
    student = (p * (p.log() - q)).mean()
    pairs = [((noise[a] - noise[b]).square().mean() * (output[a] - output[b]).abs().mean()) for a in range(4)
             for b in range(4)]
    diversity = torch.exp(-sum(pairs) / 16)
    torch.testing.assert_close(parts["teacher"], teacher, **TOL)
    torch.testing.assert_close(parts["student"], student, **TOL)
    torch.testing.assert_close(parts["diversity"], diversity, **TOL)
    torch.testing.assert_close(loss, 2.0 * teacher - 0.5 * student + 3.0 * diversity, **TOL)
    torch.testing.assert_close(diversity_loss(noise, output), diversity, **TOL)
    torch.testing.assert_close(head_logits(heads, output, 3)[1], logits(heads[1], output), **TOL)
    # β_e = 0 (the code's MNIST setting): no student term, none reported
    loss, parts = generator_loss(heads, average, weights, labels, noise, output, FedGenSettings())
    assert float(parts["student"]) == 0.0
    torch.testing.assert_close(loss, teacher + diversity, **TOL)


def test_alpha_and_beta_decay_as_the_codes_exp_lr_scheduler():
    assert decayed(10.0, 0, 0.98) == 10.0
    assert decayed(10.0, 3, 0.98) == pytest.approx(10 * 0.98 ** 3, rel=1e-15)
    assert decayed(1e-3, 200, 0.98) == 1e-4  # the floor
    assert decayed(10.0, 5, 1.0) == 10.0


def test_the_generators_optimizer_is_torchs_adam_with_l2_weight_decay_and_decayed_lr():
    g = torch.Generator().manual_seed(4)
    start = torch.randn(7, generator=g, dtype=torch.float64)
    grads = [torch.randn(7, generator=g, dtype=torch.float64) for _ in range(5)]
    mine = start.clone()
    state = {"exp_avg": torch.zeros(7, dtype=torch.float64), "exp_avg_sq": torch.zeros(7, dtype=torch.float64),
             "steps": 0}
    settings = FedGenSettings(generator_lr=3e-2, weight_decay=1e-2)
    rule = generator_optimizer(settings, 2)
    theirs = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([theirs], lr=3e-2 * settings.generator_lr_decay ** 2, weight_decay=1e-2,
                                 foreach=False)
    for grad in grads:
        rule.step(mine, grad.clone(), state)
        theirs.grad = grad.clone()
        optimizer.step()
    assert state["steps"] == 5
    torch.testing.assert_close(mine, theirs.detach(), **TOL)


def test_the_client_regularizer_by_hand():
    """gen_ratio·α(t)·CE(h(G(ŷ)), ŷ) + β(t)·KL(softmax h(G(y)) ‖ softmax f(x)), with ŷ and ε
    drawn from the client's stream in the order the term draws them."""
    settings = FedGenSettings(hidden_dim=5, noise_dim=3, gen_batch_size=6, generative_alpha=4.0,
                              generative_beta=2.0)
    torch.manual_seed(5)
    head = torch.nn.Linear(6, 3).double()
    shapes = generator_shapes(3, 3, 5, 6)
    params, stats = init_generator(shapes, torch.Generator().manual_seed(6))
    mask = torch.tensor([True, False, True])
    download = SimpleNamespace(extras={"generator": {"params": params, "stats": stats}, "labels": mask})
    view = SimpleNamespace(download=download, round=3, generator=lambda: torch.Generator().manual_seed(7),
                           group=lambda name: torch.zeros(TINY_HEAD))
    term = GenerativeRegularizer(settings)
    term.begin(view)
    x = torch.randn(4, 6, dtype=torch.float64)
    labels = torch.tensor([0, 2, 2, 0])
    logits = head(x)
    value = term(Batch(x, labels, logits, x, SimpleNamespace(head=head)))

    g = torch.Generator().manual_seed(7)
    noise = torch.rand(4, 3, generator=g, dtype=torch.float64)
    target = F.softmax(head(generate(params, stats, shapes, labels, noise, training=False)), 1)
    latent = (target * (target.log() - F.log_softmax(logits, 1))).sum() / 4
    drawn = torch.tensor([0, 2])[torch.randint(2, (6,), generator=g)]
    noise = torch.rand(6, 3, generator=g, dtype=torch.float64)
    teacher = F.cross_entropy(head(generate(params, stats, shapes, drawn, noise, training=False)), drawn)
    alpha, beta = 4.0 * 0.98 ** 3, 2.0 * 0.98 ** 3
    torch.testing.assert_close(value, (6 / 4) * alpha * teacher + beta * latent, **TOL)
    assert set(drawn.tolist()) <= {0, 2}  # only available labels
    # the gradient reaches the head (the teacher) and the logits (the latent KL), never G
    value.backward()
    assert head.weight.grad.abs().sum() > 0
    # teacher_labels='own': ŷ only among the client's own training labels (here 2 alone)
    own = GenerativeRegularizer(FedGenSettings(hidden_dim=5, noise_dim=3, teacher_labels="own"))
    own.begin(SimpleNamespace(download=download, round=0, generator=lambda: torch.Generator().manual_seed(7),
                              group=lambda name: torch.zeros(TINY_HEAD), indices=lambda split: torch.arange(3),
                              labels_of=lambda indices: torch.tensor([2, 2, 2])))
    assert own.labels.tolist() == [2] and own.alpha == 10.0
    # no generator downloaded (round 0): nothing added
    idle = GenerativeRegularizer(settings)
    idle.begin(SimpleNamespace(download=SimpleNamespace(extras={})))
    assert float(idle(Batch(x, labels, logits, x, SimpleNamespace(head=head)))) == 0.0


# ---------------------------------------------------------------- the algorithm in a federation

def test_only_the_head_goes_up_and_the_head_and_generator_come_down():
    algo = FedGen(**SMALL)
    fed = make_federation(algo, clients=3, sizes=(30, 40, 50))
    seen = capture_uploads(algo)
    bodies = [fed.cohorts[0].params.row(k)[fed.cohorts[0].span("body")].clone() for k in range(3)]
    records = [run_round(fed, algo, r) for r in range(2)]
    for uploads in seen:
        for message in uploads.messages:
            assert set(message.tensors) == {"head"} and dict(message.extras) == {}
    params, stats = generator_size()
    head_bits = TINY_HEAD * 64
    assert [r.bits_up for r in records] == [3 * head_bits] * 2
    assert records[0].bits_down == 3 * head_bits  # no generator before it has trained
    assert records[1].bits_down == 3 * (head_bits + (params + stats) * 64 + 3 * 8)  # + the label mask
    # the server's head is the n_i-weighted mean of the heads sent; no body ever left (each trained on its own)
    heads = seen[-1].stack("head")
    n = fed.train_sizes()
    torch.testing.assert_close(algo.head, (n / n.sum()) @ heads, **TOL)
    after = [fed.cohorts[0].params.row(k)[fed.cohorts[0].span("body")] for k in range(3)]
    assert all(not torch.equal(a, b) for a, b in zip(after, bodies))
    assert "body" not in fed.shared_groups
    assert set(records[1].algorithm) == {"generator_teacher", "generator_student", "generator_diversity"}


def test_the_server_trains_the_generator_towards_the_senders_heads():
    """Many Adam steps against fixed heads lower the label-weighted teacher loss of G's samples."""
    algo = FedGen(hidden_dim=16, noise_dim=4, generator_steps=150, generator_lr=1e-2)
    fed = make_federation(algo, clients=3)
    run_round(fed, algo, 0)
    heads = torch.stack([fed.cohorts[0].params.row(k)[fed.cohorts[0].span("head")] for k in range(3)])
    counts = fed.class_counts()
    first = dict(algo.losses)
    algo.train_generator(1, heads, counts)
    assert algo.losses["teacher"] < 0.5 * first["teacher"]
    assert algo.adam["steps"] == 300 and torch.isfinite(algo.params).all()


def test_evaluation_with_the_global_head_or_the_clients_own():
    algo = FedGen(**SMALL)
    fed = make_federation(algo, clients=3)
    run_round(fed, algo, 0)
    assert torch.equal(algo.evaluation(1).tensors["head"], algo.head)
    own = FedGen(**SMALL, evaluation="own")
    assert own.evaluation(1) is None
    accuracy = evaluate_all(fed, algo)["accuracy"]
    assert all(0 <= a <= 1 for a in accuracy.values())


def test_two_architectures_share_only_the_head_and_the_generator():
    """Each body keeps its own shapes and trains apart; the head and G serve both (α(0) = β(0) = 1:
    the code's 10 swamps 40 blobs)."""
    algo = FedGen(**SMALL, generative_alpha=1.0, generative_beta=1.0)
    fed = two_architectures(algo, epochs=2)
    assert FedGen.capabilities.mixed_architectures
    records = [run_round(fed, algo, r) for r in range(4)]
    narrow, deep = fed.cohorts
    assert narrow.params.data.shape == (2, 30 + 21) and deep.params.data.shape == (2, 40 + 54 + 21)
    params, stats = generator_size()
    assert all(r.bits_up == 4 * 21 * 64 for r in records)
    assert records[2].bits_down == 4 * (21 * 64 + (params + stats) * 64 + 3 * 8)
    assert all(math.isfinite(v) for r in records for v in r.train_loss.values())
    assert torch.isfinite(algo.params).all() and records[-1].eval["mean_accuracy"] > 0.6


def test_settings_and_config_are_checked():
    for bad, key in (({"hidden_dim": 0}, "hidden_dim"), ({"generator_lr": 0.0}, "generator_lr"),
                     ({"regularizer_decay": 1.5}, "regularizer_decay"), ({"teacher_labels": "all"}, "teacher_labels"),
                     ({"evaluation": "best"}, "evaluation"), ({"generative_alpha": -1.0}, "generative_alpha")):
        with pytest.raises(ValueError, match=key):
            FedGen(**bad)
    # FedGen shares the head (Capabilities.head): a run that keeps it local is refused.
    with pytest.raises(ValueError, match="keep_head_local=True"):
        check(RunConfig(algorithm="fedgen", scenario="dirichlet", keep_head_local=True))
    with pytest.raises(ValueError, match="scenario 'permuted-iid' keeps it local by default"):
        check(RunConfig(algorithm="fedgen"))
    check(RunConfig(algorithm="fedgen", scenario="dirichlet"))


# ---------------------------------------------------------------- digits

ROUNDS = 4


@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_digits_loss_goes_down_and_stop_and_resume_is_bitwise(tmp_path):
    """The code's local optimizer (plain SGD, lr 0.01).  Round 0 trains without the generator, so
    the loss is compared from round 1 on, where the regularized objective is the same."""
    pytest.importorskip("sklearn")
    args = ["fedgen", "--dataset", "digits", "--clients", "4", "--rounds", str(ROUNDS), "--quiet",
            "--scenario", "dirichlet", "--lr", "0.01", "--momentum", "0"]
    reference, state = assert_resume_bitwise(tmp_path, args, ROUNDS, stop_after=2)
    mean = [sum(m["train_loss"].values()) / len(m["train_loss"]) for m in reference]
    assert all(math.isfinite(v) for v in mean) and mean[-1] < mean[1]
    assert reference[-1]["eval"]["mean_accuracy"] > reference[0]["eval"]["mean_accuracy"]
    algorithm = state["algorithm"]
    for tensor in (algorithm["head"], algorithm["generator"], algorithm["generator_stats"],
                   algorithm["adam"]["exp_avg"], algorithm["adam"]["exp_avg_sq"]):
        assert torch.isfinite(tensor).all()
    assert algorithm["adam"]["steps"] == ROUNDS * 50
    assert all(m["bits_up"] == 4 * (64 * 10 + 10) * 32 for m in reference)  # the digits CNN's head only
