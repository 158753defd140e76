"""torch.func (grad, vmap of grad) through the server-side ops on their Triton kernels, in the
interpreter or on a CUDA device (float64: the similarity ops fall back to the reference there;
the aggregation kernels run); see ``test_server_ops_functorch.py``.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_server_ops_functorch_triton.py -q
"""
from __future__ import annotations

import contextlib

import pytest

from tests.kernels.triton_support import DEVICE, MARKS, RUNNABLE, launchers_as_cpu_kernels

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels import triton as pfl_triton
    from tests.kernels.second_order_cases import cases
    from tests.kernels.test_server_ops_functorch import check_functorch

    pfl_triton.register_all()


@pytest.mark.parametrize("case", list(cases(DEVICE)) if RUNNABLE else [])
def test_grad_and_vmap_grad_match_eager_autograd(case):
    with launchers_as_cpu_kernels(pfl_triton.LAUNCHERS) if DEVICE == "cpu" else contextlib.nullcontext():
        check_functorch(cases(DEVICE)[case])
