"""The Factorized-FL benchmark's two sides do the same work: one β round of the engine and
of the port of the released loop (``benchmarks/plain_factorized_fl_loop.py``) give every
client the same personalized aggregate, and the port's matching weights equal the op's."""
from __future__ import annotations

import torch

from benchmarks import bench_factorized_fl_round as bench
from benchmarks import plain_factorized_fl_loop as plain
from pfl_algorithms.algorithms.factorized_fl import matching_weights
from pfl_algorithms.engine.rounds import run_round


def test_port_matching_weights_equal_the_ops():
    gen = torch.Generator().manual_seed(3)
    vs = [torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(plain.CLIENTS)]
    ours = matching_weights(torch.stack(vs), tau=plain.TAU, scale=plain.SCALE, min_keep=plain.MIN_KEEP)
    for k in range(plain.CLIENTS):
        row = torch.zeros(plain.CLIENTS, dtype=torch.float64)
        for j, w in plain.matching_weights(vs, k).items():
            row[j] = w
        torch.testing.assert_close(ours[k], row, rtol=1e-12, atol=1e-15)


def test_one_round_gives_the_same_aggregates():
    """Full-batch steps (batch = a client's samples), so the order of samples cannot matter:
    both sides then compute the same gradients, up to float32 summation order."""
    inputs, labels, model = bench.job()
    fed, algorithm = bench.engine(inputs, labels, model, batch=plain.SAMPLES)
    cohort = fed.cohorts[0]
    eager = plain.eager_copy(cohort.module)
    loop = plain.make_round(eager, inputs, labels, bench.match_key(fed), batch=plain.SAMPLES, shuffle=False)
    theirs = loop()
    run_round(fed, algorithm, 0)
    compared = set()
    for k in range(plain.CLIENTS):
        flat = torch.zeros(cohort.params.data.shape[1])
        for group, rows in algorithm.personal.items():
            flat[cohort.span(group)] = rows[k]
        ours = cohort.layout.views(flat)
        for group in algorithm.personal:
            for name in cohort.groups.members[group]:
                torch.testing.assert_close(ours[name], theirs[k][name], rtol=1e-4, atol=1e-5)
                compared.add(name)
    # Every parameter of the model was aggregated and compared (β aggregates them all here).
    assert compared == set(theirs[0]) and len(compared) > 10
