"""What the public torch API cannot do, and the private API that ``pfl_kernels`` uses in its
place (``ops/_library.py``, ``nn/_read_only.py``).

Each test passes while the limit holds.  When a torch release lifts one, its test fails
with what to change: the private use can then go (where the package's floor torch has the
fix too).
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.autograd import forward_ad

F64 = torch.float64

LIB = torch.library.Library("pfl_public_limits", "FRAGMENT")
LIB.define("scale(Tensor x) -> Tensor")
LIB.impl("scale", lambda x: x * 3, "CompositeExplicitAutograd")


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


torch.library.register_autograd("pfl_public_limits::scale", lambda ctx, grad: grad * 3, setup_context=_save_input)


def _scaled_sum(x):
    return torch.ops.pfl_public_limits.scale(x).sum()


def test_register_autograd_is_refused_inside_torch_func():
    """pytorch/pytorch#168393, #170834: the Function that torch.library.register_autograd
    generates has no setup_context, which torch.func requires.  ops/_library.register_autograd
    runs as a single-level Function there instead."""
    x = torch.randn(3, dtype=F64)
    assert torch.equal(torch.autograd.grad(_scaled_sum(x.requires_grad_()), x)[0], torch.full_like(x, 3))
    try:
        torch.func.grad(_scaled_sum)(x.detach())
    except RuntimeError as e:
        assert "setup_context" in str(e)
    else:
        pytest.fail("torch.library.register_autograd now works under torch.func (pytorch/pytorch#168393 fixed): "
                    "ops/_library.register_autograd may drop its single-level Function if "
                    "tests/nn/test_functorch.py (nested transforms, hessian) passes with the public one")


def test_register_autograd_has_no_forward_mode():
    """torch.library.register_autograd takes no jvp (pytorch/pytorch#131116 proposed one and
    was closed unmerged), and the op's output silently carries no tangent.
    ops/_library.register_autograd takes a jvp."""
    x = torch.randn(3, dtype=F64)
    with forward_ad.dual_level():
        out = torch.ops.pfl_public_limits.scale(forward_ad.make_dual(x, torch.ones_like(x)))
        tangent = forward_ad.unpack_dual(out).tangent
    if tangent is not None:
        pytest.fail("torch.library.register_autograd now gives forward-mode tangents: see whether it takes "
                    "the jvp formulas of ops/_library.register_autograd")


def test_a_setup_context_function_cannot_run_in_an_autograd_kernel_under_torch_func():
    """The public way into torch.func, an autograd.Function with setup_context (and a vmap
    rule), fails when applied by an op's autograd kernel: functorch's custom_function_call
    finds no kernel for the Autograd key there.  Hence the single-level Function."""

    class Triple(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    LIB.define("triple(Tensor x) -> Tensor")
    LIB.impl("triple", lambda x: x * 3, "CompositeExplicitAutograd")
    LIB.impl("triple", lambda x: Triple.apply(x), "Autograd")
    x = torch.randn(3, dtype=F64)
    try:
        torch.func.grad(lambda t: torch.ops.pfl_public_limits.triple(t).sum())(x)
    except NotImplementedError as e:
        assert "custom_function_call" in str(e)
    else:
        pytest.fail("an autograd.Function applied inside an autograd kernel now works under torch.func: "
                    "ops/_library.register_autograd may use one with setup_context in place of the "
                    "single-level Function")


def test_register_autograd_refuses_an_op_that_writes_an_argument():
    """No public autograd registration exists for soft_threshold_, project_simplex_ or the
    out= variants: ops/_library._guard_mutation is their autograd kernel (version bump and
    refusal of inputs that require grad)."""
    LIB.define("shrink_(Tensor(a!) x) -> ()")
    LIB.impl("shrink_", lambda x: None, "CompositeExplicitAutograd")
    with pytest.raises(RuntimeError, match="non-functional"):
        torch.library.register_autograd("pfl_public_limits::shrink_", lambda ctx, grad: grad)


@torch.library.custom_op("pfl_public_limits::halve_", mutates_args=("x",))
def _custom_halve_(x: torch.Tensor) -> None:
    x.mul_(0.5)


def test_custom_op_lets_a_leaf_that_requires_grad_be_written():
    """torch.library.custom_op bumps the version counter of a written argument, but writes a
    leaf that requires grad without a word, where a built-in in-place op (and the pfl ops,
    tests/kernels/test_inplace_versions.py) refuses."""
    leaf = torch.ones(3, dtype=F64, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.mul_(0.5)
    _custom_halve_(leaf)
    assert torch.equal(leaf.detach(), torch.full_like(leaf, 0.5)), "custom_op now refuses: see _guard_mutation"


def test_default_torch_function_makes_every_result_the_subclass():
    """The public default Tensor.__torch_function__ (what super() gives a subclass) returns
    every result as the subclass; a read-only weight's clone() and arithmetic must be plain
    tensors, so nn/_read_only.py runs the call under torch._C.DisableTorchFunctionSubclass,
    for which torch has no public equivalent (pytorch/pytorch#87990)."""

    class Sub(torch.Tensor):
        pass

    x = torch.ones(2).as_subclass(Sub)
    assert type(x.clone()) is Sub and type(x * 2) is Sub
    with torch._C.DisableTorchFunctionSubclass():
        assert type(x.clone()) is torch.Tensor


def test_pytree_is_private():
    """nn/_read_only.py walks a call's arguments and results with torch.utils._pytree: no
    public pytree module exists yet (pytorch/pytorch#65761; #175082 proposes torch.utils.pytree)."""
    if importlib.util.find_spec("torch.utils.pytree") is not None:
        pytest.fail("torch.utils.pytree is public now: nn/_read_only.py may import tree_flatten and tree_map from it")


def test_the_dual_level_gate_of_the_autograd_kernel():
    """ops/_library's autograd kernel skips the Function when no input can carry a tangent.
    It reads the private forward_ad._current_level for that (about 0.1 us a call, against
    about 1 us a tensor through the public unpack_dual), and falls back to unpack_dual on a
    torch without it."""
    from pfl_kernels.ops._library import _may_carry_tangents

    assert hasattr(forward_ad, "_current_level"), \
        "forward_ad._current_level is gone: ops/_library asks every tensor through unpack_dual (slower)"
    x = torch.randn(3, dtype=F64)
    assert not _may_carry_tangents((x, 2.0))
    with forward_ad.dual_level():
        assert not _may_carry_tangents((x, 2.0))
        assert _may_carry_tangents((forward_ad.make_dual(x, torch.ones_like(x)), 2.0))
