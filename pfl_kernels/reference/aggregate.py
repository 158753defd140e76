"""Plain-PyTorch definition of the weighted aggregation ops (any device, any float dtype).

``weighted_average(weights, params)``: weights [K, M], params [M, P] -> out [K, P] with

    out[k] = Σ_{j : weights[k, j] != 0} weights[k, j] · params[j]

A zero weight never reads its row of params: a NaN or Inf row of params reaches exactly the
clients that give it a nonzero weight.  (A plain ``weights @ params`` would compute 0·NaN = NaN
and poison every client.)  The sum runs in the accumulation dtype (float32 for bfloat16 and
float16 params, else the params' dtype); weights are read in that dtype; the result has the
params' dtype.
"""
from __future__ import annotations

import torch


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for the half-precision dtypes, else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def weighted_average(weights: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """out[k] = Σ_{j: w_kj != 0} w_kj θ_j (Factorized-FL aggregation, FedAvg), in params' dtype."""
    acc = accumulation_dtype(params.dtype)
    w = weights.to(acc)
    theta = params.to(acc)
    # Rows holding NaN/Inf are taken out of the product (so that 0·NaN never happens) and
    # added back, one at a time, only where their weight is nonzero.
    bad = (~torch.isfinite(theta)).any(dim=1)
    if not bool(bad.any()):
        return (w @ theta).to(params.dtype)
    out = w @ theta.masked_fill(bad[:, None], 0)
    for j in torch.nonzero(bad).flatten().tolist():
        col = w[:, j]
        nz = col != 0
        out[nz] += col[nz, None] * theta[j]
    return out.to(params.dtype)


def reflection_weights(attention: torch.Tensor, self_index: torch.Tensor) -> torch.Tensor:
    """Weights of SimFed's reflection θ_k + Σ_j a_kj (θ_j − θ_k) (Eq. 8) as one weighted average.

    θ_k + Σ_j a_kj (θ_j − θ_k) = Σ_j a_kj θ_j + (1 − Σ_j a_kj) θ_k: the attention with
    (1 − Σ_j a_kj) added at column ``self_index[k]`` of row k.
    """
    rest = 1 - attention.sum(dim=1, keepdim=True)
    return attention.scatter_add(1, self_index.to(torch.int64)[:, None], rest)
