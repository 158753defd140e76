"""The server-side ops (similarity, weights, aggregation, branch aggregation, class means) on
meta tensors, under FakeTensorMode and under torch.compile(fullgraph=True) through their
wrappers (issue 13, item 6): no wrapper or fake kernel reads data (Tensor.item()), the
checks of values are the kernels', and they still raise at run time."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pfl_kernels.ops import (
    branch_aggregate, class_means, pairwise_cosine, pairwise_sqdist, reflection_weights, similarity_weights,
    weighted_average)

F32, F64, BF16, I64 = torch.float32, torch.float64, torch.bfloat16, torch.int64


def calls(device: str):
    """name -> (a call of the wrapper on empty tensors of ``device``, [(shape, dtype)] expected)."""
    def e(*shape, dtype=F32):
        return torch.empty(*shape, dtype=dtype, device=device)

    return {
        "pairwise_cosine": (lambda: pairwise_cosine(e(5, 7)), [((5, 5), F32)]),
        "pairwise_cosine y bf16": (lambda: pairwise_cosine(e(5, 7, dtype=BF16), e(3, 7, dtype=BF16)),
                                   [((5, 3), F32)]),
        "pairwise_sqdist": (lambda: pairwise_sqdist(e(5, 7, dtype=F64), e(2, 7, dtype=F64)), [((5, 2), F64)]),
        "similarity_weights": (lambda: similarity_weights(e(4, 4), tau=0.1, scale=2.0, min_keep=2), [((4, 4), F32)]),
        "similarity_weights self_index": (
            lambda: similarity_weights(e(4, 6, dtype=BF16), tau=0.1, scale=2.0, self_index=e(4, dtype=I64)),
            [((4, 6), F32)]),
        "weighted_average": (lambda: weighted_average(e(3, 4), e(4, 9, dtype=BF16)), [((3, 9), BF16)]),
        "weighted_average out": (lambda: weighted_average(e(3, 4), e(4, 9), out=e(3, 9)), [((3, 9), F32)]),
        "reflection_weights": (lambda: reflection_weights(e(3, 3)), [((3, 3), F32)]),
        "branch_aggregate": (lambda: branch_aggregate(e(4, 2, 3, 5), e(4, 2), e(4, dtype=I64)), [((2, 3, 5), F32)]),
        "branch_aggregate out": (
            lambda: branch_aggregate(e(4, 2, 6, dtype=BF16), e(4, 2), e(4), out=e(2, 6, dtype=BF16)),
            [((2, 6), BF16)]),
        "class_means": (lambda: class_means(e(6, 5), e(6, dtype=I64), 3), [((3, 5), F32), ((3,), I64)]),
        "class_means clients": (lambda: class_means(e(2, 6, 5, dtype=BF16), e(2, 6, dtype=I64), 3),
                                [((2, 3, 5), F32), ((2, 3), I64)]),
    }


def _check(result, expected, device):
    result = result if isinstance(result, tuple) else (result,)
    assert [(tuple(r.shape), r.dtype) for r in result] == expected
    assert all(r.device.type == device for r in result)


@pytest.mark.parametrize("name", list(calls("meta")))
def test_meta_tensors(name):
    call, expected = calls("meta")[name]
    _check(call(), expected, "meta")


@pytest.mark.parametrize("name", list(calls("cpu")))
def test_fake_tensors(name):
    with FakeTensorMode():
        call, expected = calls("cpu")[name]
        _check(call(), expected, "cpu")


def test_meta_ops_without_the_wrappers():
    m = "meta"
    assert torch.ops.pfl.branch_aggregate(torch.empty(3, 2, 4, device=m), torch.empty(3, 2, device=m),
                                          torch.empty(3, device=m)).shape == (2, 4)
    out = torch.empty(2, 4, device=m)
    assert torch.ops.pfl.branch_aggregate.out(torch.empty(3, 2, 4, device=m), torch.empty(3, 2, device=m),
                                              torch.empty(3, device=m), out=out) is out
    assert torch.ops.pfl.similarity_weights(torch.empty(3, 3, device=m), 0.0, 1.0, 0, None).shape == (3, 3)
    means, counts = torch.ops.pfl.class_means(torch.empty(4, 2, device=m), torch.empty(4, dtype=I64, device=m), 5)
    assert means.shape == (5, 2) and counts.shape == (5,)


def test_meta_out_checks_hold():
    """The layout checks of out= need no data: they hold on meta tensors too."""
    m = "meta"
    bad = torch.empty(64, device=m).as_strided((3, 2, 3), (3, 6, 1))
    with pytest.raises(ValueError, match="out must not have elements that share memory"):
        branch_aggregate(torch.empty(4, 3, 2, 3, device=m), torch.empty(4, 3, device=m), torch.empty(4, device=m),
                         out=bad)
    with pytest.raises(ValueError, match="rows overlap"):
        torch.ops.pfl.weighted_average.out(torch.empty(3, 4, device=m), torch.empty(4, 5, device=m),
                                           out=torch.empty(8, device=m).as_strided((3, 5), (1, 1)))


def _server_round(x, branch_params, alpha, counts, features, labels, bank, global_branches):
    """One round of every server-side op, through the wrappers (out= included)."""
    sim = pairwise_cosine(x)
    w = similarity_weights(sim, tau=0.0, scale=4.0, min_keep=2)
    d = pairwise_sqdist(x)
    new = weighted_average(reflection_weights(w), x)
    weighted_average(w, x, out=bank)
    branches = branch_aggregate(branch_params, alpha, counts)
    branch_aggregate(branch_params, alpha, counts, out=global_branches)
    means, n = class_means(features, labels, 3)
    return sim, w, d, new, bank, branches, global_branches, means, n


def _round_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(5, 7, generator=g), torch.randn(4, 2, 6, generator=g), torch.rand(4, 2, generator=g),
            torch.tensor([3, 1, 4, 2]), torch.randn(9, 5, generator=g), torch.randint(0, 3, (9,), generator=g),
            torch.empty(5, 7), torch.empty(2, 6))


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compile_fullgraph_through_the_wrappers(dynamic):
    torch._dynamo.reset()
    args = _round_inputs()
    eager = _server_round(*args)
    compiled = torch.compile(_server_round, fullgraph=True, dynamic=dynamic)(*args[:-2], torch.empty(5, 7),
                                                                             torch.empty(2, 6))
    for a, b in zip(compiled, eager):
        assert torch.allclose(a.double(), b.double(), atol=1e-5)


def test_compiled_out_with_elements_sharing_memory_is_refused():
    torch._dynamo.reset()
    x, branch_params, alpha, counts, *_ = _round_inputs()
    fn = torch.compile(lambda p, a, c, o: branch_aggregate(p, a, c, out=o) * 1)
    with pytest.raises(ValueError, match="out must not have elements that share memory"):
        fn(branch_params, alpha, counts, torch.empty(6).expand(2, 6))


@pytest.mark.parametrize("bad", ["nan row", "negative count", "label"])
def test_compiled_ops_still_check_values(bad):
    """The checks that left the wrappers run in the kernels, inside the compiled code too."""
    torch._dynamo.reset()
    x, branch_params, alpha, counts, features, labels, bank, global_branches = _round_inputs()
    if bad == "nan row":
        x[2, 3] = float("nan")
        match = "sim must be finite"
    elif bad == "negative count":
        counts[1] = -1
        match = r"counts must be >= 0 and finite, got counts\[1\] = -1"
    else:
        labels[4] = 7
        match = r"labels must be in \[0, num_classes=3\), got labels\[4\] = 7"
    with pytest.raises(ValueError, match=match):
        torch.compile(_server_round, fullgraph=True, dynamic=False)(x, branch_params, alpha, counts, features,
                                                                    labels, bank, global_branches)
