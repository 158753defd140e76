"""``out=`` overlapping the inputs (issue 13, item 6): weighted_average.out and
branch_aggregate.out give the result without overlap, or a ValueError where out's own
elements share memory, for every kind of overlap (``aliasing_cases``), through the wrapper,
the op (the C++ kernel when built, else the reference) and the reference kernel itself.
The Triton kernels: ``test_out_aliasing_triton.py``."""
from __future__ import annotations

import importlib

import pytest
import torch

from tests.kernels.aliasing_cases import average_cases, branch_cases, check

# The modules (pfl_kernels.ops.branch_aggregate is also the name of the function).
aggregate_ops = importlib.import_module("pfl_kernels.ops.aggregate")
branch_ops = importlib.import_module("pfl_kernels.ops.branch_aggregate")

DTYPES = [torch.float32, torch.float64, torch.bfloat16]

BRANCH_CALLS = {
    "wrapper": branch_ops.branch_aggregate,
    "op": torch.ops.pfl.branch_aggregate.out,
    "reference kernel": branch_ops._reference_out,
}
AVERAGE_CALLS = {
    "wrapper": aggregate_ops.weighted_average,
    "op": torch.ops.pfl.weighted_average.out,
    "reference kernel": aggregate_ops._reference_out,
}


@pytest.mark.parametrize("call", list(BRANCH_CALLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(branch_cases("cpu")))
def test_branch_aggregate_out_overlapping_inputs(case, dtype, call):
    check(branch_cases("cpu", dtype)[case](), BRANCH_CALLS[call], dtype)


@pytest.mark.parametrize("call", list(AVERAGE_CALLS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(average_cases("cpu")))
def test_weighted_average_out_overlapping_inputs(case, dtype, call):
    check(average_cases("cpu", dtype)[case](), AVERAGE_CALLS[call], dtype)


@pytest.mark.parametrize("case", ["out_is_params", "out_is_shifted_rows", "out_aliases_through_another_storage"])
def test_weighted_average_out_overlap_on_large_inputs(case):
    """Wide enough for several column tiles and threads (the C++ kernels' tiled paths)."""
    check(average_cases("cpu", torch.float32, p=20_011)[case](), aggregate_ops.weighted_average, torch.float32)


@pytest.mark.parametrize("case", ["out_is_a_client", "out_is_shifted_along_p", "out_aliases_through_another_storage"])
def test_branch_aggregate_out_overlap_on_large_inputs(case):
    check(branch_cases("cpu", torch.float32, p=20_011)[case](), branch_ops.branch_aggregate, torch.float32)


def test_may_overlap_matches_the_address_ranges_of_random_views():
    """_checks.may_overlap against the byte ranges counted element by element: random views
    (zero strides, transposes, offsets, another dtype's view) of one buffer and of another."""
    from pfl_kernels.ops._checks import may_overlap

    g = torch.Generator().manual_seed(3)
    buf = torch.zeros(4096)

    def view():
        dims = int(torch.randint(1, 4, (1,), generator=g))
        size = [int(n) for n in torch.randint(0, 6, (dims,), generator=g)]
        stride = [int(s) for s in torch.randint(0, 40, (dims,), generator=g)]
        return buf.as_strided(size, stride, int(torch.randint(0, 300, (1,), generator=g)))

    def byte_range(t):  # [first byte, last byte + 1) of its elements, each counted
        index = torch.cartesian_prod(*[torch.arange(n) for n in t.shape]).reshape(-1, t.dim())
        offsets = [t.storage_offset() + sum(i * s for i, s in zip(ix, t.stride())) for ix in index.tolist()]
        size = t.element_size()
        return buf.data_ptr() + min(offsets) * size, buf.data_ptr() + (max(offsets) + 1) * size

    seen = {True: 0, False: 0}
    for _ in range(400):
        a, b = view(), view()
        if a.dim() and a.stride(-1) == 1 and torch.randint(0, 4, (1,), generator=g) == 0:
            a = a.view(torch.int32)  # another dtype's view of the same bytes
        expected = False
        if a.numel() and b.numel():
            (alo, ahi), (blo, bhi) = byte_range(a), byte_range(b)
            expected = alo < bhi and blo < ahi
        assert may_overlap(a, b) == expected == may_overlap(b, a), (a.shape, a.stride(), b.shape, b.stride())
        seen[expected] += 1
    assert min(seen.values()) > 50  # both answers exercised
    assert not may_overlap(buf, torch.zeros(4096))  # another buffer
