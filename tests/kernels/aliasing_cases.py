"""Every kind of overlap between ``out=`` and the inputs of weighted_average.out and
branch_aggregate.out (issue 13, item 6), shared by the CPU and the Triton interpreter tests.

Each case builds fresh inputs and an ``out`` that aliases them in one way; the answer is the
reference computed in float64 on copies made before the call (so an overlap that corrupts the
inputs mid-way shows), or a ValueError where ``out``'s own elements share memory.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from pfl_kernels.reference import aggregate as ref_aggregate
from pfl_kernels.reference import branch_aggregate as ref_branch

F64 = torch.float64


class Case(NamedTuple):
    args: tuple          # the op's inputs
    out: torch.Tensor    # the out= tensor (aliasing them)
    want: Optional[torch.Tensor]  # float64 answer, or None: a ValueError is due


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- branch_aggregate.out: branch_params [K, B, *shape], alpha [K, B], counts [K] -> [B, *shape]

def _branch_case(bp, alpha, counts, out) -> Case:
    want = ref_branch.branch_aggregate(bp.detach().to(F64).clone(), alpha.detach().to(F64).clone(),
                                       counts.detach().clone())
    return Case((bp, alpha, counts), out, want)


def _alpha_counts(k, b, seed=1):
    g = _gen(seed)
    return torch.rand(k, b, generator=g, dtype=F64) + 0.1, torch.randint(1, 9, (k,), generator=g)


def branch_cases(device: str, dtype: torch.dtype = torch.float32, p: int = 37) -> dict[str, Callable[[], Case]]:
    """name -> a function building one case (K = B = 3, P = ``p``)."""
    k = b = 3

    def bank(*shape, seed=0):
        return torch.randn(*shape, generator=_gen(seed), dtype=F64).to(device, dtype)

    def alpha_counts():  # on the cases' device: the op refuses alpha or counts on another
        alpha, counts = _alpha_counts(k, b)
        return alpha.to(device), counts.to(device)

    def out_is_a_client():  # slice along K: out = branch_params[1]
        bp = bank(k, b, p)
        return _branch_case(bp, *alpha_counts(), bp[1])

    def out_is_a_branch_column():  # slice along B: out[i] = branch_params[i, 2] (K = B)
        bp = bank(k, b, p)
        return _branch_case(bp, *alpha_counts(), bp[:, 2])

    def out_is_shifted_along_p():  # out = the bank one element further along P
        big = bank(k, b, p + 1)
        return _branch_case(big[:, :, :p], *alpha_counts(), big[1, :, 1:])

    def out_is_strided_params():  # every other element: out = branch_params[2] of a strided bank
        big = bank(k, b, 2 * p)
        return _branch_case(big[:, :, ::2], *alpha_counts(), big[2, :, ::2])

    def out_interleaved_with_params():  # shares no element, but the address ranges interleave
        big = bank(k, b, 2 * p)
        return _branch_case(big[:, :, ::2], *alpha_counts(), big[0, :, 1::2])

    def out_is_transposed():  # out[b, h, w] = branch_params[0, b, w, h]
        bp = bank(k, b, 5, 5)
        return _branch_case(bp, *alpha_counts(), bp[0].transpose(1, 2))

    def out_is_alpha():  # parameters of shape [] (P = 1): out [B] is a row of alpha
        alpha, counts = alpha_counts()
        alpha = alpha.to(dtype)
        return _branch_case(bank(k, b), alpha, counts, alpha[1])

    def out_is_counts():  # float counts [K] and out [B] (K = B) one tensor
        alpha, counts = alpha_counts()
        counts = counts.to(dtype)
        return _branch_case(bank(k, b), alpha, counts, counts)

    def out_aliases_through_another_storage():  # torch.from_numpy of one array twice, shifted by one
        if device != "cpu":
            return out_is_shifted_along_p()
        arr = np.random.default_rng(0).standard_normal((k, b, p + 1)).astype(np.float32)
        flat = arr.reshape(-1)
        bp = torch.from_numpy(flat[: k * b * p].reshape(k, b, p)).to(dtype)
        if dtype != torch.float32:  # from_numpy shares memory only for its own dtype
            return out_is_shifted_along_p()
        out = torch.from_numpy(flat[1: 1 + b * p].reshape(b, p))
        return _branch_case(bp, *alpha_counts(), out)

    def out_expanded():  # out's elements share memory: refused
        return Case((bank(k, b, p), *alpha_counts()), bank(p).expand(b, p), None)

    def out_overlaps_itself_too_hard():  # strides [3, 6, 1] for [3, 2, 3]: torch cannot tell
        bp = bank(k, b, 2, 3)
        out = torch.empty(64, dtype=dtype, device=device).as_strided((3, 2, 3), (3, 6, 1))
        return Case((bp, *alpha_counts()), out, None)

    cases = [out_is_a_client, out_is_a_branch_column, out_is_shifted_along_p, out_is_strided_params,
             out_interleaved_with_params, out_is_transposed, out_is_alpha, out_is_counts,
             out_aliases_through_another_storage, out_expanded, out_overlaps_itself_too_hard]
    return {f.__name__: f for f in cases}


# ---- weighted_average.out: weights [K, M], params [M, P] -> out [K, P] ----------------------

def _average_case(weights, params, out) -> Case:
    want = ref_aggregate.weighted_average(weights.detach().to(F64).clone(), params.detach().to(F64).clone())
    return Case((weights, params), out, want)


def average_cases(device: str, dtype: torch.dtype = torch.float32, p: int = 37) -> dict[str, Callable[[], Case]]:
    """name -> a function building one case (K = M = 4, P = ``p``)."""
    k = m = 4

    def rand(*shape, seed=0):
        return torch.randn(*shape, generator=_gen(seed), dtype=F64).to(device, dtype)

    def weights(seed=1):
        return rand(k, m, seed=seed)

    def out_is_params():  # in place: bank <- W @ bank
        params = rand(m, p)
        return _average_case(weights(), params, params)

    def out_is_shifted_rows():  # out = rows 1..K of the bank params are rows 0..M-1 of
        bank = rand(m + 1, p)
        return _average_case(weights(), bank[:m], bank[1:])

    def out_is_shifted_columns():  # out = the bank one column further
        bank = rand(m, p + 1)
        return _average_case(weights(), bank[:, :p], bank[:, 1:])

    def out_is_weights():  # P = M: W <- W @ params
        w = weights()
        return _average_case(w, rand(m, m), w)

    def out_holds_the_weights():  # weights = the first M columns of out [K, P = M + 2]
        store = rand(k, m + 2, seed=1)
        return _average_case(store[:, :m], rand(m, m + 2), store)

    def out_aliases_through_another_storage():  # torch.from_numpy of one array twice
        if device != "cpu" or dtype != torch.float32:
            return out_is_shifted_rows()
        arr = np.random.default_rng(0).standard_normal((m + 1, p)).astype(np.float32)
        return _average_case(weights(), torch.from_numpy(arr[:m]), torch.from_numpy(arr[1:]))

    def out_rows_overlap():  # row stride 1 < P: refused
        return Case((weights(), rand(m, p)), torch.empty(k + p, dtype=dtype, device=device).as_strided((k, p), (1, 1)),
                    None)

    def out_expanded():
        return Case((weights(), rand(m, p)), rand(p).expand(k, p), None)

    cases = [out_is_params, out_is_shifted_rows, out_is_shifted_columns, out_is_weights, out_holds_the_weights,
             out_aliases_through_another_storage, out_rows_overlap, out_expanded]
    return {f.__name__: f for f in cases}


def check(case: Case, call: Callable, dtype: torch.dtype, match: str = "share memory|rows overlap") -> None:
    """``call(*case.args, out=case.out)`` gives the answer in out (and returns out), or raises
    the ValueError due for an out whose elements share memory."""
    import pytest

    from tests.tolerances import assert_close

    if case.want is None:
        with pytest.raises(ValueError, match=match):
            call(*case.args, out=case.out)
        return
    got = call(*case.args, out=case.out)
    assert got is case.out or got.data_ptr() == case.out.data_ptr()
    assert_close(case.out, case.want, dtype, "out")
