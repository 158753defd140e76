"""How the Triton kernels are launched (issue 30, item 1): an eager call launches the kernel
directly, a traced call goes through ``torch.library.wrap_triton``.

In the Triton interpreter or on a CUDA device, skipped otherwise (see ``triton_support.py``):

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_launch_path_triton.py -q -m triton_interpret
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import DEVICE, F64, MARKS, RUNNABLE, launchers_as_cpu_kernels
from tests.tolerances import assert_close

pytestmark = MARKS

if RUNNABLE:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pfl_kernels.reference import factorized as ref
    from pfl_kernels.triton import factorized as tf

SHAPE = (6, 3, 5, 5)  # a conv weight: R = 25 (kh*kw), C = 18 (out*in channels)


def factors(k=2, rank=2):
    """u, v, mu, mask of K = k clients for a SHAPE weight."""
    g = torch.Generator().manual_seed(0)
    u, v, mu, mask = (torch.randn(k, *size, generator=g, dtype=F64).to(DEVICE)
                      for size in ((25, rank), (rank, 18), (25, 18), (25, 18)))
    return u, v, mu, mask


class _Recorder:
    """Stands in for ``wrap_triton(kernel)``: records each ``[grid](...)`` launch, runs nothing."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, grid))


@pytest.fixture
def wrapped(monkeypatch):
    """The launches that went through ``wrap_triton`` (recorded in place of running)."""
    launches = []
    monkeypatch.setattr(tf, "_wrap_triton", lambda kernel: _Recorder(kernel, launches))
    return launches


def test_an_eager_call_launches_directly(wrapped):
    """Through the public op and the dispatcher, as on a GPU: no launch is wrapped."""
    from pfl_kernels.ops import factorized_weight

    u, v, mu, mask = factors()
    with launchers_as_cpu_kernels({"factorized_weight": tf.factorized_weight_triton}):
        w = factorized_weight(u, v, mu, mask, shape=SHAPE)
    assert wrapped == []
    assert_close(w, ref.factorized_weight(u, v, mu, mask, shape=SHAPE), F64)


def test_a_traced_call_goes_through_wrap_triton(wrapped):
    """Fake tensors under a FakeTensorMode (what torch.compile and make_fx trace with): the
    launch goes through wrap_triton, which records it rather than run it on no memory."""
    with FakeTensorMode() as mode:
        u, v, mu, mask = (mode.from_tensor(t) for t in factors())
        w = tf.factorized_weight_triton(u, v, mu, mask, shape=SHAPE)
    assert tuple(w.shape) == (2, *SHAPE)
    assert [kernel for kernel, _ in wrapped] == [tf._factorized_weight_kernel]


def test_the_launcher_under_torch_compile(wrapped):
    """dynamo tracing a launcher's Python: the launch goes through wrap_triton."""
    u, v, mu, mask = factors()
    torch._dynamo.reset()
    compiled = torch.compile(lambda *t: tf.factorized_weight_triton(*t, shape=SHAPE), backend="eager")
    compiled(u, v, mu, mask)
    assert [kernel for kernel, _ in wrapped] == [tf._factorized_weight_kernel]
