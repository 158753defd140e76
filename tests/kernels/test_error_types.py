"""One exception type per argument mistake, whichever layer of the op catches it (issue 14).

Each mistake of ``error_cases`` is made through the documented wrapper and as a direct
``torch.ops.pfl`` call: on the op's CPU kernel (C++ when the extension is built, else the
reference), with the reference kernel run in place of the C++ one, and on meta tensors and
under FakeTensorMode (the fake kernel, what torch.compile traces with).  Every one must
raise the case's type (TypeError for a wrong kind of argument, ValueError for a wrong shape,
value, device or layout) with a message naming the argument.  Before, the op-level checks
raised RuntimeError (``torch._check`` / ``TORCH_CHECK``) where the wrapper raised ValueError or
TypeError.  The Triton launchers: ``test_error_types_triton.py``.

Not covered by the table, because torch's dispatcher refuses them before any of our layers
runs: a non-tensor where the schema wants a tensor, a float where it wants an int (torch's
RuntimeError); the wrappers raise TypeError for both (``WRONG_KINDS`` below).
"""
from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pfl_kernels import ops
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


SPARSE_ARGUMENTS = {  # wrapper -> a call with one sparse tensor (torch's dispatcher has no sparse kernel)
    "weighted_average weights": lambda s: ops.weighted_average(s(torch.rand(2, 3)), torch.randn(3, 4)),
    "weighted_average params": lambda s: ops.weighted_average(torch.rand(2, 3), s(torch.randn(3, 4))),
    "weighted_average out": lambda s: ops.weighted_average(torch.rand(2, 3), torch.randn(3, 4),
                                                           out=s(torch.ones(2, 4))),
    "pairwise_cosine x": lambda s: ops.pairwise_cosine(s(torch.randn(3, 4))),
    "similarity_weights sim": lambda s: ops.similarity_weights(s(torch.rand(3, 3)), tau=0.5, scale=1.0),
    "similarity_weights self_index": lambda s: ops.similarity_weights(
        torch.rand(3, 3), tau=0.5, scale=1.0, self_index=s(torch.tensor([0, 1, 2]))),
    "class_means features": lambda s: ops.class_means(s(torch.randn(4, 2)), torch.tensor([0, 1, 1, 0]), 2),
    "branch_aggregate counts": lambda s: ops.branch_aggregate(torch.randn(3, 2, 5), torch.rand(3, 2),
                                                              s(torch.tensor([3, 1, 2]))),
    "relu_max_pool2d input": lambda s: ops.relu_max_pool2d(s(torch.randn(1, 2, 4, 4))),
    # Before, a metadata cache key read a CSR tensor's strides (RuntimeError) before the
    # wrapper's check, and these wrappers never checked the layout (issue D3).
    "factorized_weight u": lambda s: ops.factorized_weight(s(torch.randn(9, 2)), torch.randn(2, 6), shape=(3, 2, 3, 3)),
    "factorized_weight v": lambda s: ops.factorized_weight(torch.randn(9, 2), s(torch.randn(2, 6)), shape=(3, 2, 3, 3)),
    "factorized_weight mu": lambda s: ops.factorized_weight(torch.randn(9, 2), torch.randn(2, 6), s(torch.randn(9, 6)),
                                                            shape=(3, 2, 3, 3)),
    "factorized_weight mask": lambda s: ops.factorized_weight(torch.randn(9, 2), torch.randn(2, 6), torch.randn(9, 6),
                                                              s(torch.ones(9, 6)), shape=(3, 2, 3, 3)),
    "soft_threshold_ mu": lambda s: ops.soft_threshold_(s(torch.randn(3, 4)), 0.1),
    "project_simplex_ x": lambda s: ops.project_simplex_(s(torch.randn(3, 4))),
    "branch_combine alpha": lambda s: ops.branch_combine(torch.randn(2, 3, 4), s(torch.rand(2, 3))),
    "branch_combine weights": lambda s: ops.branch_combine(s(torch.randn(3, 4)), torch.rand(3)),
    "branch_aggregate branch_params": lambda s: ops.branch_aggregate(s(torch.randn(3, 2, 5)), torch.rand(3, 2),
                                                                     torch.tensor([3, 1, 2])),
    "branch_aggregate alpha": lambda s: ops.branch_aggregate(torch.randn(3, 2, 5), s(torch.rand(3, 2)),
                                                             torch.tensor([3, 1, 2])),
    "branch_aggregate out": lambda s: ops.branch_aggregate(torch.randn(3, 2, 5), torch.rand(3, 2),
                                                           torch.tensor([3, 1, 2]), out=s(torch.ones(2, 5))),
    "class_means labels": lambda s: ops.class_means(torch.randn(4, 2), s(torch.tensor([0, 1, 1, 0])), 2),
    "pairwise_cosine y": lambda s: ops.pairwise_cosine(torch.randn(3, 4), s(torch.randn(2, 4))),
    "pairwise_sqdist x": lambda s: ops.pairwise_sqdist(s(torch.randn(3, 4))),
    "pairwise_sqdist y": lambda s: ops.pairwise_sqdist(torch.randn(3, 4), s(torch.randn(2, 4))),
    "reflection_weights attention": lambda s: ops.reflection_weights(s(torch.rand(3, 3))),
    "reflection_weights self_index": lambda s: ops.reflection_weights(torch.rand(2, 3),
                                                                      self_index=s(torch.tensor([0, 1]))),
}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", [torch.Tensor.to_sparse, torch.Tensor.to_sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("case", SPARSE_ARGUMENTS)
def test_a_sparse_tensor_is_refused_naming_the_argument(case, layout):
    """A sparse tensor failed deep inside (NotImplementedError from aten::linalg_vector_norm
    for weighted_average's weights); every wrapper now refuses it in one line."""
    name = case.split()[-1]

    def sparse(t):
        return layout(t) if t.dim() == 2 or layout is torch.Tensor.to_sparse else t.to_sparse()

    with pytest.raises(ValueError, match=rf"^{name} must be a dense \(strided\) tensor, got layout torch\.sparse"):
        SPARSE_ARGUMENTS[case](sparse)


def test_a_min_keep_beyond_int64_keeps_the_whole_row():
    """The docstring: a min_keep larger than the row keeps the whole row; 2**63 failed in the
    dispatcher's multi-line message ("Expected a value of type 'int'")."""
    sim = torch.rand(3, 3, generator=torch.Generator().manual_seed(0))
    want = ops.similarity_weights(sim, tau=1.0, scale=2.0, min_keep=3)
    for huge in (2**63, 2**70):
        assert torch.equal(ops.similarity_weights(sim, tau=1.0, scale=2.0, min_keep=huge), want)


# A wrong kind of scalar argument, which torch's dispatcher would refuse with a RuntimeError
# (a float where the schema wants an int, a str where it wants a float): the wrappers raise
# TypeError naming the argument (a right kind with a bad value stays a ValueError, see
# error_cases).  factorized_weight(shape=(3.0, ...)) passed the wrapper and failed in the
# dispatcher; class_means(num_classes=3.0) raised ValueError; soft_threshold_ took "0.1",
# True and a 0-d tensor through float().
WRONG_KINDS = {
    "factorized_weight shape of floats": ("shape must hold ints, got float 3.0 at index 0",
                                          lambda t: ops.factorized_weight(t(torch.randn(9, 2)), t(torch.randn(2, 12)),
                                                                          shape=(3.0, 2, 3, 3))),
    "factorized_weight shape of a bool": ("shape must hold ints, got bool", lambda t: ops.factorized_weight(
        t(torch.randn(9, 2)), t(torch.randn(2, 12)), shape=(6, True, 3, 3))),
    "factorized_weight shape not a sequence": ("shape must be a list or tuple of ints, got int",
                                               lambda t: ops.factorized_weight(t(torch.randn(9, 2)),
                                                                               t(torch.randn(2, 12)), shape=6)),
    "class_means num_classes float": ("num_classes must be an int, got float", lambda t: ops.class_means(
        t(torch.randn(5, 3)), t(torch.zeros(5, dtype=torch.int64)), 3.0)),
    "class_means num_classes bool": ("num_classes must be an int, got bool", lambda t: ops.class_means(
        t(torch.randn(5, 3)), t(torch.zeros(5, dtype=torch.int64)), True)),
    "similarity_weights min_keep float": ("min_keep must be an int, got float", lambda t: ops.similarity_weights(
        t(torch.rand(3, 3)), tau=0.0, scale=1.0, min_keep=2.0)),
    "similarity_weights tau str": ("tau must be a real number, got str", lambda t: ops.similarity_weights(
        t(torch.rand(3, 3)), tau="0.5", scale=1.0)),
    "pairwise_cosine eps 0-d tensor": ("eps must be a real number, got Tensor", lambda t: ops.pairwise_cosine(
        t(torch.randn(3, 4)), eps=torch.tensor(1e-8))),
    "soft_threshold_ threshold str": ("threshold must be a real number, got str",
                                      lambda t: ops.soft_threshold_(t(torch.randn(3, 4)), "0.1")),
    "soft_threshold_ threshold bool": ("threshold must be a real number, got bool",
                                       lambda t: ops.soft_threshold_(t(torch.randn(3, 4)), True)),
    "soft_threshold_ threshold 0-d tensor": ("threshold must be a real number, got Tensor",
                                             lambda t: ops.soft_threshold_(t(torch.randn(3, 4)), torch.tensor(0.1))),
    "soft_threshold_ threshold None": ("threshold must be a real number, got NoneType",
                                       lambda t: ops.soft_threshold_(t(torch.randn(3, 4)), None)),
}


@pytest.mark.parametrize("tensors", ["cpu", "meta"])
@pytest.mark.parametrize("case", WRONG_KINDS)
def test_a_wrong_kind_of_scalar_is_a_type_error_naming_it(case, tensors):
    message, call = WRONG_KINDS[case]
    place = (lambda t: t.to("meta")) if tensors == "meta" else (lambda t: t)
    with pytest.raises(TypeError, match="^" + re.escape(message)):
        call(place)


@pytest.mark.parametrize("case, message", [
    ("factorized_weight", r"shape must have sizes >= 1, got \[6, 0, 3, 3\]"),
    ("class_means", "num_classes must be an integer >= 1, got -2"),
])
def test_a_right_kind_with_a_bad_value_stays_a_value_error(case, message):
    calls = {
        "factorized_weight": lambda: ops.factorized_weight(torch.randn(9, 2), torch.randn(2, 12), shape=(6, 0, 3, 3)),
        "class_means": lambda: ops.class_means(torch.randn(5, 3), torch.zeros(5, dtype=torch.int64), -2),
    }
    with pytest.raises(ValueError, match=message):
        calls[case]()
