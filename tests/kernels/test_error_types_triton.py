"""One exception type per argument mistake on the Triton launchers (issue 14): every case of
``error_cases``, through the documented wrapper and as a direct ``torch.ops.pfl`` call, with
the launchers run as the CPU kernels in the interpreter (on a GPU: the CUDA kernels), raises
the type the wrapper, the C++ kernel, the reference and the fake kernel raise
(``test_error_types.py``).  In the interpreter a device mistake (a meta tensor among CPU
ones) reaches the fake kernel (meta decides the dispatch); on a GPU (a CPU tensor among CUDA
ones) it reaches the launcher's own check.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_error_types_triton.py -q
"""
from __future__ import annotations

import contextlib

import pytest

from tests.kernels.triton_support import DEVICE, MARKS, RUNNABLE, launchers_as_cpu_kernels

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels import triton as pfl_triton
    from tests.kernels.error_cases import MISTAKES, Tensors

    pfl_triton.register_all()


def tensors() -> "Tensors":
    """CPU tensors in the interpreter; on a GPU, CUDA ones with a CPU one for device mistakes."""
    return Tensors() if DEVICE == "cpu" else Tensors(lambda t: t.to(DEVICE), elsewhere=lambda t: t)


@pytest.mark.parametrize("through", ["op", "wrapper"])
@pytest.mark.parametrize("name", list(MISTAKES) if RUNNABLE else [])
def test_launcher(name, through):
    mistake = MISTAKES[name]
    if through == "wrapper" and not mistake.has_wrapper:
        pytest.skip("an op without a wrapper (a backward)")
    assert mistake.op in pfl_triton.LAUNCHERS, f"pfl::{mistake.op} has no Triton launcher"
    with launchers_as_cpu_kernels(pfl_triton.LAUNCHERS) if DEVICE == "cpu" else contextlib.nullcontext():
        with pytest.raises(mistake.error, match=mistake.match):
            mistake.call(through, tensors())
