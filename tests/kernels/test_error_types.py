"""One exception type per argument mistake, whichever layer of the op catches it (issue 14).

Each mistake of ``error_cases`` is made through the documented wrapper and as a direct
``torch.ops.pfl`` call: on the op's CPU kernel (C++ when the extension is built, else the
reference), with the reference kernel run in place of the C++ one, and on meta tensors and
under FakeTensorMode (the fake kernel, what torch.compile traces with).  Every one must
raise the case's type (TypeError for a wrong kind of argument, ValueError for a wrong shape,
value, device or layout) with a message naming the argument.  Before, the op-level checks
raised RuntimeError (``torch._check`` / ``TORCH_CHECK``) where the wrapper raised ValueError or
TypeError.  The Triton launchers: ``test_error_types_triton.py``.

Not covered, because torch's dispatcher refuses them before any of our layers runs: a
non-tensor where the schema wants a tensor, a float where it wants an int (torch's
RuntimeError); the wrappers raise TypeError for both.
"""
from __future__ import annotations

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from pfl_kernels.ops._library import REFERENCE_KERNELS
from pfl_kernels.triton import launchers_on_cpu
from tests.kernels.error_cases import MISTAKES, Mistake, Tensors

THROUGH = ["op", "wrapper"]


def reference_kernels_on_cpu():
    """Within the block, every op runs its reference kernel for CPU tensors (not the C++ one)."""
    return launchers_on_cpu({qualname.split("::", 1)[1]: kernel for qualname, kernel in REFERENCE_KERNELS.items()})


def mistake_through(name: str, through: str) -> Mistake:
    mistake = MISTAKES[name]
    if through == "wrapper" and not mistake.has_wrapper:
        pytest.skip("an op without a wrapper (a backward)")
    return mistake


def expect(mistake: Mistake, call) -> None:
    with pytest.raises(mistake.error, match=mistake.match):
        call()


@pytest.mark.parametrize("through", THROUGH)
@pytest.mark.parametrize("name", list(MISTAKES))
def test_cpu_kernel(name, through):
    """On CPU tensors: the C++ kernel (the reference without the extension), after the
    wrapper's own checks for ``through='wrapper'``."""
    mistake = mistake_through(name, through)
    expect(mistake, lambda: mistake.call(through, Tensors()))


@pytest.mark.parametrize("through", THROUGH)
@pytest.mark.parametrize("name", list(MISTAKES))
def test_reference_kernel(name, through):
    mistake = mistake_through(name, through)
    with reference_kernels_on_cpu():
        expect(mistake, lambda: mistake.call(through, Tensors()))


@pytest.mark.parametrize("tensors", ["meta", "fake"])
@pytest.mark.parametrize("through", THROUGH)
@pytest.mark.parametrize("name", list(MISTAKES))
def test_fake_kernel(name, through, tensors):
    mistake = mistake_through(name, through)
    if mistake.reads_values:
        pytest.skip("a check of values: the kernels make it, not the fake kernel (there are no values)")
    if tensors == "meta":
        if mistake.devices:
            pytest.skip("every tensor is on meta: no device differs")
        expect(mistake, lambda: mistake.call(through, Tensors(lambda t: t.to("meta"))))
        return
    mode = FakeTensorMode()
    args, kwargs = mistake.args(Tensors(mode.from_tensor))
    with mode:
        expect(mistake, lambda: mistake.function(through)(*args, **kwargs))
