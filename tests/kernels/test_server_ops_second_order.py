"""gradcheck and gradgradcheck of every server-side op (issue 13, item 3): the backward
formulas (registered in Python, some reading the saved output) differentiated once more,
on the C++ kernels when built, else the reference (the Triton kernels:
``test_server_ops_second_order_triton.py``)."""
from __future__ import annotations

import warnings

import pytest

from tests.kernels.second_order_cases import cases, check_second_order


@pytest.mark.parametrize("case", list(cases()))
def test_gradcheck_and_gradgradcheck(case):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "backward not differentiable" warning is a failure here
        check_second_order(cases()[case])
