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
