"""``out=`` overlapping the inputs on the Triton kernels of weighted_average.out and
branch_aggregate.out (issue 13, item 6): every kind of overlap of ``aliasing_cases``.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_out_aliasing_triton.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import DEVICE, MARKS, RUNNABLE

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels.triton import aggregate as ta
    from pfl_kernels.triton import branch_aggregate as tb
    from tests.kernels.aliasing_cases import average_cases, branch_cases, check

# P past one block of the kernels (512 and more), so that a program's write can reach
# elements another program reads later.
P = 1_500


@pytest.mark.parametrize("case", list(branch_cases("cpu")) if RUNNABLE else [])
def test_branch_aggregate_out_overlapping_inputs(case):
    check(branch_cases(DEVICE, torch.float32, p=P)[case](), tb.branch_aggregate_out_triton, torch.float32)


@pytest.mark.parametrize("case", list(average_cases("cpu")) if RUNNABLE else [])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_weighted_average_out_overlapping_inputs(case, dtype):
    check(average_cases(DEVICE, dtype, p=P)[case](), ta.weighted_average_out_triton, dtype)
