"""FedFomo and Clustered-FL: each rule on a tiny hand-computable case, then a few rounds on
digits (the loss goes down, the state stays finite, a stopped run resumed with --resume is bitwise)."""
from __future__ import annotations

import copy
import itertools
import json
from dataclasses import replace

import pytest
import torch
from torch.nn import functional as F

from pfl_algorithms.algorithms.clustered_fl import ClusteredFL, bipartition, split_decisions
from pfl_algorithms.algorithms.fedfomo import FedFomo, first_order_weights
from pfl_algorithms.data.partition import ClientSplit
from pfl_algorithms.engine.checkpoint import read_checkpoint
from pfl_algorithms.engine.rounds import run_round
from tests.algorithms.state_checks import assert_same
from tests.algorithms.test_kill_resume import assert_resume_bitwise

from . import federation_cases
from .federation_cases import make_federation

TOL = dict(rtol=1e-12, atol=1e-12)


def with_validation(monkeypatch):
    """Tiny federations whose clients hold 60% train, 20% validation, 20% test."""
    def splits(sizes, label_maps=None):
        data, start = [], 0
        for k, size in enumerate(sizes):
            idx = torch.arange(start, start + size)
            start += size
            a, b = int(0.6 * size), int(0.8 * size)
            data.append(ClientSplit(train=idx[:a], val=idx[a:b], test=idx[b:],
                                    label_map=None if label_maps is None else label_maps[k]))
        return data

    monkeypatch.setattr(federation_cases, "client_splits", splits)


def val_loss(fed, client, flat):
    cohort = fed.cohorts[0]
    module = copy.deepcopy(cohort.module)
    batch = fed.clients[client].val
    logits = torch.func.functional_call(module, cohort.layout.views(flat), (fed.inputs[batch],))
    return float(F.cross_entropy(logits, fed.labels[batch]))


# ---------------------------------------------------------------- FedFomo


def test_first_order_weights_by_hand():
    # L(θ_k) = 1; models with losses 0.5, 1.2, 0.8 at distances 0.5, 2, 0 (the last equals θ_k)
    w = first_order_weights(1.0, torch.tensor([0.5, 1.2, 0.8], dtype=torch.float64),
                            torch.tensor([0.5, 2.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([1.0, -0.1, 0.0], dtype=torch.float64), **TOL)


def test_fedfomo_step_is_the_first_order_combination(monkeypatch):
    """Round 1 without local training: each client's model is θ_k + Σ w_n (θ_n − θ_k) with the
    positive (L(θ_k) − L(θ_n)) / ‖θ_n − θ_k‖ normalized, from a float64 reference; the server
    adds the raw weights / |Σ| to its affinity row."""
    with_validation(monkeypatch)
    algo = FedFomo(n_download=2, epsilon=0.0)
    fed = make_federation(algo, clients=4, sizes=(30, 40, 50, 40))
    run_round(fed, algo, 0)  # trains; nothing to download yet
    assert algo.uploaded.all() and not algo.affinity.any()
    rows = torch.stack([fed.cohorts[0].params.row(k).clone() for k in range(4)])
    torch.testing.assert_close(algo.models["body"], rows[:, fed.cohorts[0].span("body")], **TOL)
    # no local training in round 1: the row after it is the step's
    fed.settings = replace(fed.settings, schedule=replace(fed.settings.schedule, epochs=0, steps=0))
    record = run_round(fed, algo, 1)
    assert all(len(ids) == 2 and k not in ids.tolist() for k, ids in algo._sent.items())
    affinity = torch.zeros(4, 4, dtype=torch.float64)
    for k, ids in algo._sent.items():
        base = val_loss(fed, k, rows[k])
        raw = []
        for n in ids.tolist():
            raw.append((base - val_loss(fed, k, rows[n])) / float((rows[n] - rows[k]).norm()))
        raw = torch.tensor(raw, dtype=torch.float64)
        positive = raw.clamp_min(0)
        want = rows[k].clone()
        if positive.sum() > 0:
            want += ((positive / positive.sum())[:, None] * (rows[ids] - rows[k])).sum(0)
        torch.testing.assert_close(fed.cohorts[0].params.row(k), want, **TOL)
        affinity[k, ids] = (raw / raw.sum().abs()).float().double()
    torch.testing.assert_close(algo.affinity, affinity, **TOL)
    model_bits = rows.shape[1] * 64  # float64 TinyNet, no buffers, the head shared
    assert record.bits_down == 4 * 2 * model_bits
    assert record.bits_up == 4 * (model_bits + 2 * 32)  # its model and its 2 weights


def test_fedfomo_picks_greedily_by_affinity_or_at_random(monkeypatch):
    with_validation(monkeypatch)
    algo = FedFomo(n_download=2, epsilon=1.0, epsilon_decay=0.25)
    make_federation(algo, clients=5, sizes=(20, 20, 20, 20, 20))
    algo.uploaded[:] = torch.tensor([True, True, True, True, False])  # client 4 never uploaded
    algo.affinity[0] = torch.tensor([9.0, 0.1, -1.0, 0.5, 5.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    assert algo.choose(4, 0, g).tolist() == [3, 1]  # ε_4 = 0: the two highest others that uploaded
    drawn = {tuple(algo.choose(0, 0, torch.Generator().manual_seed(s)).tolist()) for s in range(40)}
    assert all(len(set(d)) == 2 and set(d) <= {1, 2, 3} for d in drawn)
    assert len(drawn) > 3  # ε_0 = 1: random picks
    algo.uploaded[:] = False
    assert algo.choose(4, 0, g).numel() == 0  # round 0: nothing to download


def test_fedfomo_refuses_a_split_without_validation():
    from pfl_algorithms.config import RunConfig, check

    with pytest.raises(ValueError, match="scenario.split.*validation"):
        check(RunConfig(algorithm="fedfomo", dataset="digits", scenario_options={"split": (0.8, 0.0, 0.2)}))


# ---------------------------------------------------------------- Clustered-FL


def test_split_rule_by_hand():
    """Two clusters: 0 = clients {0, 1, 2, 3} with opposing updates (mean small, max large),
    1 = clients {4, 5} with agreeing ones."""
    updates = torch.tensor([[2.0, 0.0], [2.0, 0.2], [-2.0, 0.0], [-2.0, -0.2], [1.0, 1.0], [1.0, 1.0]])
    cluster = torch.tensor([0, 0, 0, 0, 1, 1])
    sizes = torch.tensor([1.0, 1.0, 1.0, 3.0, 1.0, 1.0], dtype=torch.float64)
    weights = ClusteredFL.cluster_weights(None, cluster, sizes, 2)
    # cluster 0: mean = (2 + 2 − 2 − 6)/6, (0.2 − 0.6)/6 = (−0.6667, −0.0667), norm 0.6700; max norm 2.0100
    # cluster 1: mean (1, 1), norm 1.4142; max norm 1.4142
    both = torch.tensor([True, True])

    class S:
        eps1, eps2 = 0.7, 1.6

    assert split_decisions(updates, weights, cluster, S, both).tolist() == [True, False]
    S.eps1 = 0.66
    assert split_decisions(updates, weights, cluster, S, both).tolist() == [False, False]  # mean not small
    S.eps1, S.eps2 = 2.0, 2.02
    assert split_decisions(updates, weights, cluster, S, both).tolist() == [False, False]  # no update large
    S.eps2 = 1.4
    assert split_decisions(updates, weights, cluster, S, both).tolist() == [True, True]
    assert split_decisions(updates, weights, cluster, S, torch.tensor([False, True])).tolist() == [False, True]


def test_bipartition_by_hand():
    s = torch.tensor([[1.0, 0.9, 0.0, -0.5],
                      [0.9, 1.0, 0.85, 0.05],
                      [0.0, 0.85, 1.0, 0.1],
                      [-0.5, 0.05, 0.1, 1.0]])
    # single: merge 0-1 (0.9), then 2 by 1-2 (0.85): {0, 1, 2} | {3}
    assert bipartition(s, "single").tolist() == [False, False, False, True]
    # complete: merge 0-1 (0.9); then {0,1}-2 min 0.0, {0,1}-3 min −0.5, 2-3 0.1: {0, 1} | {2, 3}
    assert bipartition(s, "complete").tolist() == [False, False, True, True]


def test_single_linkage_is_the_papers_optimal_bipartition():
    """argmin over all bipartitions of the largest cross similarity, by brute force."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(7, 3, generator=g, dtype=torch.float64)
        s = F.normalize(x, dim=1) @ F.normalize(x, dim=1).T
        best = min(float(s[list(a)][:, [i for i in range(7) if i not in a]].max())
                   for r in range(1, 7) for a in itertools.combinations(range(7), r))
        mask = bipartition(s, "single")
        assert float(s[~mask][:, mask].max()) == pytest.approx(best, abs=1e-12)


def test_clustered_fl_splits_then_averages_within_clusters():
    """Clients 2, 3 see permuted labels: the rule splits them off; each cluster's model is then
    θ_c + Σ (n_i/n_c) Δθ_i of its own members (float64 reference)."""
    perm = torch.tensor([2, 0, 1])
    algo = ClusteredFL(eps1=100.0, eps2=0.0, warmup_rounds=1, min_split_size=3)
    fed = make_federation(algo, clients=4, sizes=(30, 40, 50, 40), label_maps=[None, None, perm, perm])
    run_round(fed, algo, 0)  # warm-up: FedAvg of everyone
    assert algo.cluster_of.tolist() == [0, 0, 0, 0]
    theta = algo.models["body"][0].clone(), algo.models["head"][0].clone()
    run_round(fed, algo, 1)
    assert algo.cluster_of.tolist() == [0, 0, 1, 1]
    n = fed.train_sizes()
    cohort = fed.cohorts[0]
    for c, members in ((0, [0, 1]), (1, [2, 3])):
        w = n[members] / n[members].sum()
        for name, start in zip(("body", "head"), theta):
            deltas = torch.stack([cohort.params.row(k)[cohort.span(name)] for k in members]) - start
            torch.testing.assert_close(algo.models[name][c], start + (w[:, None] * deltas).sum(0), **TOL)
    run_round(fed, algo, 2)  # clusters of two never split again
    assert algo.cluster_of.tolist() == [0, 0, 1, 1] and algo.models["body"].shape[0] == 2
    restored = ClusteredFL()
    restored.load_state_dict(copy.deepcopy(algo.state_dict()))
    assert_same(restored.state_dict(), algo.state_dict())


def test_clustered_fl_waits_for_warmup_and_size():
    algo = ClusteredFL(eps1=100.0, eps2=0.0, warmup_rounds=2)
    fed = make_federation(algo, clients=3)
    run_round(fed, algo, 0)
    run_round(fed, algo, 1)
    assert algo.cluster_of.tolist() == [0, 0, 0]
    run_round(fed, algo, 2)
    assert len(set(algo.cluster_of.tolist())) == 2
    algo = ClusteredFL(eps1=100.0, eps2=0.0, warmup_rounds=0, min_split_size=4)
    fed = make_federation(algo, clients=3)
    run_round(fed, algo, 0)
    assert algo.cluster_of.tolist() == [0, 0, 0]


# ---------------------------------------------------------------- digits

DIGITS = {"fedfomo": {"n_download": 3}, "clustered-fl": {"warmup_rounds": 2, "eps1": 100.0, "eps2": 0.0}}


@pytest.mark.parametrize("name", sorted(DIGITS))
def test_a_few_rounds_on_digits(tmp_path, name):
    from pfl_algorithms.config import RunConfig, check
    from pfl_algorithms.models import build_model
    from pfl_algorithms.runner import run

    pytest.importorskip("sklearn")
    config = check(RunConfig(algorithm=name, dataset="digits", scenario="permuted-iid", clients=6, rounds=4,
                             batch_size=16, local_epochs=1, lr=0.05, algorithm_settings=DIGITS[name]))
    run(config, tmp_path / name, progress=False)
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in lines] == [0, 1, 2, 3] and all(len(m["train_loss"]) == 6 for m in lines)
    mean_loss = [sum(m["train_loss"].values()) / 6 for m in lines]
    assert mean_loss[-1] < mean_loss[0]
    state = read_checkpoint(tmp_path / name / "checkpoint.pt")
    for tensor in [*state["algorithm"]["models"].values()]:
        assert torch.isfinite(tensor).all()
    model = build_model("digits-cnn", input_shape=(1, 8, 8), num_classes=10)
    body = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("head."))
    model_bits = 6 * (body + sum(b.numel() for b in model.buffers() if b.is_floating_point())) * 32
    if name == "fedfomo":  # M = 3 models down, one up with its 3 weights (none in round 0)
        assert (lines[0]["bits_down"], lines[0]["bits_up"]) == (0, model_bits)
        assert all((m["bits_down"], m["bits_up"]) == (3 * model_bits, model_bits + 6 * 3 * 32) for m in lines[1:])
    else:
        assert all(m["bits_down"] == m["bits_up"] == model_bits for m in lines)
        assert len(set(state["algorithm"]["cluster_of"].tolist())) >= 2  # it split after the warm-up


KILL = {"fedfomo": ["--set", "n_download=3"],
        "clustered-fl": ["--set", "warmup_rounds=2", "--set", "eps1=100.0", "--set", "eps2=0.0"]}
ROUNDS = 6


@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
@pytest.mark.parametrize("algorithm", sorted(KILL))
@pytest.mark.slow  # end to end: a run stopped, then resumed by a fresh process
def test_stop_then_resume_in_a_fresh_process_is_bitwise(tmp_path, algorithm):
    args = [algorithm, "--dataset", "digits", "--clients", "6", "--rounds", str(ROUNDS), "--quiet", *KILL[algorithm]]
    assert_resume_bitwise(tmp_path, args, ROUNDS)
