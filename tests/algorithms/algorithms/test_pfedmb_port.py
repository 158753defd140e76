"""The pFedMB benchmark's two sides do the same work: rounds of the engine and of the plain
loop (``benchmarks/plain_pfedmb_loop.py``) give the same global branches, the same trained
client models and the same personal α, under Eq. 5 and under Eq. 6; the loop's server equals
the ``branch_aggregate`` op, a branch nobody weights included."""
from __future__ import annotations

import pytest
import torch

from benchmarks import _common as common
from benchmarks import bench_pfedmb_round as bench
from benchmarks import plain_pfedmb_loop as plain
from pfl_algorithms.algorithms.pfedmb import ALPHA
from pfl_algorithms.engine.rounds import run_round
from pfl_kernels.ops import branch_aggregate

SIZES = (7, 12, 18)  # unequal n_i, so the n_i weighting shows
B = 3
# Full-batch steps (batch = a client's samples), so the order of samples cannot matter; a
# large η_α, so that one round spreads the clients' α well apart from uniform and each other.
RUN = dict(batch=max(SIZES), epochs=2, alpha_lr=20.0, weight_lr=0.05)
TOL = dict(rtol=1e-9, atol=1e-12)  # float64 throughout; only summation order differs


def both_sides(weighting: str):
    """(federation, algorithm, the loop's round, the initial global state) on the same float64 job."""
    inputs, labels, model = common.cifar_job(1, sum(SIZES), seed=3)
    inputs, model = inputs.double(), model.double()
    fed, algorithm = bench.engine(inputs, labels, model, sizes=SIZES, branches=B, weighting=weighting, workers=1,
                                  **RUN)
    eager = plain.eager_copy(fed.cohorts[0].module)
    initial = {k: v.clone() for k, v in eager.state_dict().items() if not k.endswith("." + plain.ALPHA)}
    loop = plain.make_round(eager, inputs, labels, sizes=SIZES, weighting=weighting, shuffle=False, **RUN)
    return fed, algorithm, loop, initial


def engine_global(fed, algorithm) -> dict:
    """The algorithm's global model, by parameter name."""
    cohort = fed.cohorts[0]
    flat = torch.zeros(cohort.params.data.shape[1], dtype=torch.float64)
    for group, value in algorithm.global_model.items():
        flat[cohort.span(group)] = value
    views = cohort.layout.views(flat)
    return {name: views[name] for group in algorithm.global_model for name in cohort.groups.members[group]}


def engine_client(fed, k: int) -> dict:
    """Client k's stored parameters (after its local training), by name."""
    cohort = fed.cohorts[0]
    return cohort.layout.views(cohort.params.row(cohort.row(k)))


def run_and_compare(weighting: str, rounds: int = 2) -> dict:
    """Run ``rounds`` rounds on both sides, comparing after each; returns the last global model."""
    fed, algorithm, loop, initial = both_sides(weighting)
    cohort = fed.cohorts[0]
    names = [n for n, _ in cohort.module.named_parameters()]
    alpha_names = cohort.groups.members[ALPHA]
    assert len(alpha_names) == 5  # every layer of LeNet-5 branches: 2 convolutions, 3 fully connected
    for round_ in range(rounds):
        theirs, client_states = loop()
        run_round(fed, algorithm, round_)
        ours = engine_global(fed, algorithm)
        assert set(ours) == set(theirs) == set(names) - set(alpha_names)
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], **TOL)
        for k in range(len(SIZES)):
            mine = engine_client(fed, k)
            for name in names:  # the trained branches and the personal α (kept, never averaged)
                torch.testing.assert_close(mine[name], client_states[k][name], **TOL)
    # Not a comparison of things that never moved: α left uniform and differ between clients,
    # and the branches moved away from their initial values.
    logits = torch.stack([torch.cat([engine_client(fed, k)[n] for n in alpha_names]) for k in range(len(SIZES))])
    alpha = torch.softmax(logits.reshape(len(SIZES), -1, B), dim=-1)
    assert (alpha - 1 / B).abs().max() > 0.02
    assert (alpha[0] - alpha[1]).abs().max() > 0.02
    assert max(float((ours[n] - initial[n]).abs().max()) for n in ours) > 1e-3
    return ours


def test_one_round_gives_the_same_aggregates_eq5():
    run_and_compare("alpha")


def test_one_round_gives_the_same_aggregates_eq6():
    """weighting='uniform' (Eq. 6), and Eq. 5 gives other branches: the comparison sees the weighting."""
    uniform = run_and_compare("uniform")
    weighted = run_and_compare("alpha")
    gap = max(float((uniform[n] - weighted[n]).abs().max()) for n in uniform if n.endswith("branch_weight"))
    assert gap > 1e-4


@pytest.mark.parametrize("weighting", ["alpha", "uniform"])
def test_loop_server_equals_the_op(weighting):
    """The loop's per-client loops against ``branch_aggregate`` (n_i-weighted mean for a key
    that does not branch), with branch 1 weighted by nobody under Eq. 5: its plain average."""
    gen = torch.Generator().manual_seed(5)
    sizes = [3, 10, 4, 8]
    states = [{"layer.branch_weight": torch.randn(B, 4, 2, generator=gen, dtype=torch.float64),
               "layer.branch_bias": torch.randn(B, 4, generator=gen, dtype=torch.float64),
               "layer.alpha_param": torch.randn(B, generator=gen, dtype=torch.float64),
               "other.weight": torch.randn(5, generator=gen, dtype=torch.float64)} for _ in sizes]
    alpha = torch.rand(len(sizes), B, generator=gen, dtype=torch.float64)
    alpha[:, 1] = 0
    alpha /= alpha.sum(1, keepdim=True)
    out = plain.aggregate(states, [{"layer": a} for a in alpha], sizes, weighting)
    assert set(out) == {"layer.branch_weight", "layer.branch_bias", "other.weight"}
    counts = torch.tensor(sizes, dtype=torch.float64)
    weights = alpha if weighting == "alpha" else torch.ones_like(alpha)
    for key in ("layer.branch_weight", "layer.branch_bias"):
        expected = branch_aggregate(torch.stack([s[key] for s in states]), weights, counts)
        torch.testing.assert_close(out[key], expected, rtol=1e-12, atol=1e-14)
    if weighting == "alpha":
        torch.testing.assert_close(out["layer.branch_weight"][1],
                                   torch.stack([s["layer.branch_weight"][1] for s in states]).mean(0))
    torch.testing.assert_close(out["other.weight"],
                               (counts / counts.sum()) @ torch.stack([s["other.weight"] for s in states]))
