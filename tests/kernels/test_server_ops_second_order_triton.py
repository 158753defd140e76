"""gradcheck and gradgradcheck of the server-side ops on their Triton kernels (float64: the
similarity ops fall back to the reference there; the aggregation kernels run).

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_server_ops_second_order_triton.py -q
"""
from __future__ import annotations

import contextlib

import pytest

from tests.kernels.triton_support import DEVICE, MARKS, RUNNABLE, launchers_as_cpu_kernels

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels import triton as pfl_triton
    from tests.kernels.second_order_cases import cases, check_second_order

    pfl_triton.register_all()


@pytest.mark.parametrize("case", list(cases(DEVICE)) if RUNNABLE else [])
def test_gradcheck_and_gradgradcheck(case):
    with launchers_as_cpu_kernels(pfl_triton.LAUNCHERS) if DEVICE == "cpu" else contextlib.nullcontext():
        # Fast mode in the interpreter (the branch case's full Jacobians took 41 s of CI); the
        # same formulas are checked in full on the C++ kernels (test_server_ops_second_order.py)
        # and, on a GPU, here.
        check_second_order(cases(DEVICE)[case], fast=DEVICE == "cpu")
