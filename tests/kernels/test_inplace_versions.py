"""Every op that writes one of its arguments tells autograd, whichever kernel runs.

A kernel that writes through a raw pointer (C++, Triton) does not bump the tensor's version
counter by itself, so a tensor that autograd saved could change under it and the backward
would silently use the new values.  The normal run covers the C++ kernels, the run with
PFL_KERNELS_DISABLE_EXTENSION=1 the reference, and ``-m triton_interpret`` under
TRITON_INTERPRET=1 the Triton launchers.
"""
from __future__ import annotations

import pytest
import torch

from pfl_kernels.ops._library import FAST_PATHS
from tests.kernels.triton_support import interpreter_only, launchers_as_cpu_kernels

F64 = torch.float64


def _constant(*size: int) -> torch.Tensor:
    return torch.rand(*size, generator=torch.Generator().manual_seed(sum(size)), dtype=F64) + 0.5


# qualified op -> a call that writes into x [3, 4] (float64); every other input is a constant.
WRITES = {
    "pfl::soft_threshold_": lambda x: torch.ops.pfl.soft_threshold_(x, 0.1),
    "pfl::project_simplex_": lambda x: torch.ops.pfl.project_simplex_(x),
    "pfl::weighted_average.out": lambda x: torch.ops.pfl.weighted_average.out(_constant(3, 5), _constant(5, 4), out=x),
    "pfl::branch_aggregate.out": lambda x: torch.ops.pfl.branch_aggregate.out(
        _constant(2, 3, 4), _constant(2, 3), torch.tensor([3.0, 5.0], dtype=F64), out=x),
}


def check_backward_sees_the_write(op: str) -> None:
    """Write into a tensor that autograd saved: the version counter moves and backward raises."""
    a = torch.randn(3, 4, dtype=F64, requires_grad=True)
    x = torch.rand(3, 4, dtype=F64) + 0.5
    loss = (a * x).sum()  # saves x for a's gradient
    before, version = x.clone(), x._version
    with torch.no_grad():
        WRITES[op](x)
    assert not torch.equal(x, before), f"{op} did not write: the test would prove nothing"
    assert x._version > version, f"{op} wrote x without bumping its version counter"
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def check_refuses_a_write_autograd_would_miss(op: str) -> None:
    """Under grad mode, writing into a tensor that requires grad (the op has no derivative) is
    an error, not a gradient that ignores the write; under no_grad it is allowed."""
    leaf = (torch.rand(3, 4, dtype=F64) + 0.5).requires_grad_()
    with pytest.raises(RuntimeError, match="has no derivative.*torch.no_grad"):
        WRITES[op](leaf * 1)  # a non-leaf that requires grad
    with pytest.raises(RuntimeError, match="has no derivative.*torch.no_grad"):
        WRITES[op](leaf)
    with torch.no_grad():
        WRITES[op](leaf)


def test_every_op_that_writes_an_argument_is_covered():
    """A new op whose schema mutates an argument must be added to WRITES (and gets the
    version bump for free from ops/_library.define_op)."""
    def schema(op: str):
        name, _, overload = op.split("::", 1)[1].partition(".")
        return getattr(getattr(torch.ops.pfl, name), overload or "default")._schema

    mutating = {op for op in FAST_PATHS if schema(op).is_mutable}
    assert mutating == set(WRITES)


CHECKS = [check_backward_sees_the_write, check_refuses_a_write_autograd_would_miss]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("op", sorted(WRITES))
def test_kernels(op, check):
    """The C++ kernels, or the reference without the extension."""
    check(op)


@pytest.mark.triton_interpret
@interpreter_only
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("op", sorted(WRITES))
def test_triton_launchers(op, check):
    pytest.importorskip("triton")
    from pfl_kernels.triton import LAUNCHERS, register_all

    register_all()
    name = op.split("::", 1)[1]
    with launchers_as_cpu_kernels({name: LAUNCHERS[name]}):
        check(op)
