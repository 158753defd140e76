"""CPU benchmark of a whole Factorized-FL round end: similarity → weights → aggregation.

One case, ``round_end``: given every client's matching vector (v of the last conv, D =
65,536 for ResNet-9) and its parameters (P per client, stored as a state dict of tensors),
produce every client's personalized aggregate.

* ours: the vectors and parameters are banks ([K, D] and [K, P]);
  ``pairwise_cosine`` → ``similarity_weights(tau, scale, min_keep)`` → ``weighted_average``,
  three ops, the last exploiting the sparsity of the kept pairs.
* baseline: the released Factorized-FL server (``models/factorized_fl/server.py``) written
  in torch: for each client, stack the others' vectors, ``F.cosine_similarity`` against
  them, sort, keep those with σ ≥ τ (at least ``minimum_aggr``), softmax(ε·σ) over the kept,
  then for each state-dict key a Python sum over the kept clients.  Aggregates go to a new
  dict (the released server writes them in place, so later clients average already-updated
  models: see ../shared/papers/README.md; the snapshot is the correct rule and costs the
  same).

The clients form clusters of ``CLUSTER`` = K/20 clients whose vectors are a shared direction
plus noise, so with τ = 0.5 each client keeps its own cluster: 5% of the pairs at every K
(the issue's setting: K = 1000, P = 10^5, 5% kept; target ≥ 10x on CPU).  Both sides return
the same aggregates (checked on the smallest shape).

``PFL_BENCH_QUICK=1``: K = 100 only (the baseline's cost grows as K^2 D; at K = 1000 it takes
about two minutes a call, so that side is timed once per repeat).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pfl_kernels  # noqa: F401  (registers torch.ops.pfl.* and loads the C++ kernels if built)
from benchmarks import _common as common
from benchmarks._common import Shape
from pfl_kernels.ops import pairwise_cosine, similarity_weights, weighted_average

MATCH_DIM = 65536
TAU, SCALE, MIN_KEEP = 0.5, 20.0, 4
# A state dict with the proportions of ResNet-9's tensors (conv weights, BN affine pairs),
# scaled to P values in total.
KEY_FRACTIONS = (0.001, 0.03, 0.06, 0.06, 0.12, 0.24, 0.24, 0.2485, 0.0005)


def shapes() -> list[Shape]:
    grid = [(100, 10 ** 5)] if common.QUICK else [(100, 10 ** 5), (1000, 10 ** 5)]
    return [Shape(f"K{k}-P1e5", (k, p)) for k, p in grid]


SIDES = (("ours", "fused"), ("baseline", "released-server-loop"))

pytestmark = common.benchmark_mark(max_time=1.0, quick_max_time=0.2)


def federation(k: int, p: int):
    """Matching vectors [K, D] in clusters of K/20, parameters [K, P], the state dicts."""
    gen = torch.Generator().manual_seed(0)
    cluster = max(k // 20, 1)
    centers = torch.randn(-(-k // cluster), MATCH_DIM, generator=gen)
    vectors = centers.repeat_interleave(cluster, 0)[:k] + 0.5 * torch.randn(k, MATCH_DIM, generator=gen)
    params = torch.randn(k, p, generator=gen)
    sizes = [int(f * p) for f in KEY_FRACTIONS]
    sizes[-1] += p - sum(sizes)
    state_dicts = [dict(zip((f"layer{i}" for i in range(len(sizes))), row.split(sizes))) for row in params]
    return vectors, params, state_dicts


def ours(vectors, params):
    sim = pairwise_cosine(vectors)
    weights = similarity_weights(sim, tau=TAU, scale=SCALE, min_keep=MIN_KEEP)
    return weighted_average(weights, params)


def released_server(vectors_by_client: dict, state_dicts: list[dict]) -> list[dict]:
    """The released server's loop (see the module docstring), in torch."""
    out = []
    for cid in range(len(state_dicts)):
        zs = torch.stack([v for v in vectors_by_client.values()])  # np.array(...) in the release
        cids = list(vectors_by_client.keys())
        similarity = F.cosine_similarity(vectors_by_client[cid].view(1, -1), zs)
        similarity[cid] = 1.0  # the paper's self similarity (float rounding can put it below others)
        scores, order = torch.sort(similarity, dim=0, descending=True, stable=True)
        n_aggr = int((scores >= TAU).sum())
        n_aggr = max(n_aggr, MIN_KEEP)
        kept = [cids[i] for i in order[:n_aggr].tolist()]
        omega = torch.softmax(scores[:n_aggr] * SCALE, 0)
        out.append({name: sum(state_dicts[c][name] * omega[i] for i, c in enumerate(kept))
                    for name in state_dicts[cid]})
    return out


def test_both_sides_agree():
    vectors, params, state_dicts = federation(40, 1000)
    want = released_server(dict(enumerate(vectors)), state_dicts)
    got = ours(vectors, params)
    torch.testing.assert_close(got, torch.stack([torch.cat(list(d.values())) for d in want]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape, side, impl, repeat", common.params(shapes(), SIDES))
def test_round_end(benchmark, shape: Shape, side: str, impl: str, repeat: int):
    k, p = shape.weight
    vectors, params, state_dicts = federation(k, p)
    if impl == "fused":
        def fn():
            return ours(vectors, params)
    else:
        by_client = dict(enumerate(vectors))

        def fn():
            return released_server(by_client, state_dicts)
    # The loop takes about two minutes per call at K = 1000: one timed call is its median.
    rounds = 1 if impl != "fused" and k >= 1000 else None
    common.run(benchmark, "round_end", fn, {"clients": k, "params": p},
               {"match_dim": MATCH_DIM, "kept_fraction": 1 / 20}, rounds=rounds)
