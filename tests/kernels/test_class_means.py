"""pfl::class_means (Fed-CMA's class-conditional means) on CPU (the C++ kernel when built)
against a float64 definition."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

import pfl_kernels
from pfl_kernels.ops import class_means
from pfl_kernels.reference import class_means as ref
from tests.threads import on_one_and_many_threads
from tests.tolerances import assert_close

F64 = torch.float64
DTYPES = [torch.float32, F64, torch.bfloat16]


def make_inputs(n, d, c, dtype=torch.float32, clients=None, seed=0, label_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    lead = () if clients is None else (clients,)
    features = torch.randn(*lead, n, d, generator=g, dtype=F64).to(dtype)
    labels = torch.randint(0, c, (*lead, n), generator=g).to(label_dtype)
    return features, labels


def expected(features, labels, c):
    """Loop over classes in float64: (means, counts)."""
    if features.dim() == 3:
        outs = [expected(f, l, c) for f, l in zip(features, labels)]
        return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
    f = features.to(F64)
    means = torch.zeros(c, f.shape[1], dtype=F64)
    counts = torch.zeros(c, dtype=torch.int64)
    for cls in range(c):
        rows = f[labels == cls]
        counts[cls] = rows.shape[0]
        if rows.shape[0]:
            means[cls] = rows.mean(0)
    return means, counts


def acc(dtype):
    return F64 if dtype == F64 else torch.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,d,c,clients", [(1, 1, 1, None), (17, 5, 3, None), (1000, 129, 10, None),
                                           (333, 33, 100, None), (50, 7, 4, 3), (200, 65, 10, 5),
                                           (3, 300, 7, 2)], ids=str)
def test_matches_reference(n, d, c, clients, dtype):
    features, labels = make_inputs(n, d, c, dtype, clients)
    means, counts = class_means(features, labels, c)
    lead = () if clients is None else (clients,)
    assert means.shape == (*lead, c, d) and means.dtype == acc(dtype) and means.is_contiguous()
    assert counts.shape == (*lead, c) and counts.dtype == torch.int64
    want_means, want_counts = expected(features, labels, c)
    assert torch.equal(counts, want_counts)
    assert_close(means, want_means, torch.float32 if dtype == torch.bfloat16 else dtype, "means")
    ref_means, ref_counts = ref.class_means(features.to(F64), labels, c)
    assert torch.equal(ref_counts, want_counts)
    assert_close(ref_means, want_means, F64, "reference")


def test_int32_labels_and_edge_classes():
    features, labels = make_inputs(64, 9, 6, seed=1, label_dtype=torch.int32)
    labels[0], labels[-1] = 0, 5  # labels at 0 and C - 1
    labels[labels == 3] = 4  # class 3 has no sample
    means, counts = class_means(features, labels, 6)
    assert counts[3] == 0 and torch.equal(means[3], torch.zeros(9))
    want_means, want_counts = expected(features, labels.to(torch.int64), 6)
    assert torch.equal(counts, want_counts)
    assert_close(means, want_means, torch.float32)


def test_classes_without_samples_and_empty_inputs():
    features = torch.randn(5, 4)
    means, counts = class_means(features, torch.full((5,), 2), 4)
    assert torch.equal(counts, torch.tensor([0, 0, 5, 0]))
    assert torch.equal(means[[0, 1, 3]], torch.zeros(3, 4))
    m0, c0 = class_means(torch.randn(0, 4), torch.zeros(0, dtype=torch.int64), 3)
    assert torch.equal(m0, torch.zeros(3, 4)) and torch.equal(c0, torch.zeros(3, dtype=torch.int64))
    m1, c1 = class_means(torch.randn(2, 0, 4), torch.zeros(2, 0, dtype=torch.int64), 3)
    assert m1.shape == (2, 3, 4) and not m1.any() and not c1.any()


def test_duplicated_zero_and_non_finite_rows():
    features, labels = make_inputs(40, 6, 4, seed=2)
    features[3] = features[7]
    features[9] = 0.0
    labels[:] = torch.arange(40) % 4
    features[10, 2] = float("nan")  # class 2 only
    features[13, 0] = float("inf")  # class 1 only
    means, counts = class_means(features, labels, 4)
    assert torch.isnan(means[2, 2]) and torch.isinf(means[1, 0])
    assert torch.isfinite(means[[0, 3]]).all(), "a non-finite row reaches only its own class"
    clean = features.clone()
    clean[10, 2] = 0.0
    clean[13, 0] = 0.0
    assert_close(means[[0, 3]], expected(clean, labels, 4)[0][[0, 3]], torch.float32)


def test_non_contiguous_inputs():
    features, labels = make_inputs(30, 8, 5, F64, clients=3, seed=3)
    t = features.transpose(1, 2).contiguous().transpose(1, 2)  # column-major rows
    s = torch.randn(3, 60, 16, dtype=F64)[:, ::2, ::2]
    s.copy_(features)
    lab = torch.stack([labels, labels], -1)[..., 0]
    want = expected(features, labels, 5)
    for name, f in (("transposed", t), ("strided", s)):
        assert not f.is_contiguous()
        means, counts = class_means(f, lab, 5)
        assert torch.equal(counts, want[1])
        assert_close(means, want[0], F64, name)


# Shapes that take each path of the C++ kernel (csrc/cpu/class_means.cpp): streaming over
# one block of rows, over several blocks (N > 1024: partial sums added in block order), in
# runs of D (C x D accumulators over L2), and the gather path (thousands of classes).
PATHS = {"stream-1-block": (1000, 129, 10, None), "stream-blocks": (5000, 33, 5, 2),
         "stream-runs-of-D": (1500, 257, 300, None), "gather": (3000, 70, 2000, None)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_each_summation_path(path, dtype):
    n, d, c, clients = PATHS[path]
    features, labels = make_inputs(n, d, c, dtype, clients, seed=5)
    one, many = on_one_and_many_threads(lambda: class_means(features, labels, c))
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1]), "depends on the thread count"
    want_means, want_counts = expected(features, labels, c)
    assert torch.equal(many[1], want_counts)
    assert_close(many[0], want_means, torch.float32, path)


def test_deterministic_across_thread_counts():
    features, labels = make_inputs(20000, 96, 7, seed=4)
    one, many = on_one_and_many_threads(lambda: class_means(features, labels, 7))
    assert torch.equal(one[0], many[0]) and torch.equal(one[1], many[1])


@pytest.mark.parametrize("clients", [None, 2])
def test_gradcheck(clients):
    features, labels = make_inputs(12, 3, 4, F64, clients, seed=5)
    labels[..., :2] = 3  # at least one class with several samples; class 0 may be empty
    f = features.requires_grad_()
    assert torch.autograd.gradcheck(lambda x: class_means(x, labels, 5)[0], (f,))


def test_gradient_formula_bf16():
    features, labels = make_inputs(50, 6, 4, torch.bfloat16, seed=6)
    f = features.clone().requires_grad_()
    means, counts = class_means(f, labels, 4)
    g = torch.randn_like(means)
    means.backward(g)
    assert f.grad.dtype == torch.bfloat16
    want = g[labels] / counts[labels][:, None].to(torch.float32)
    assert_close(f.grad, want.to(F64), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
@pytest.mark.parametrize("clients", [None, 3])
def test_opcheck(dtype, clients):
    features, labels = make_inputs(20, 5, 4, dtype, clients, seed=7)
    torch.library.opcheck(torch.ops.pfl.class_means, (features.requires_grad_(), labels, 4))
    torch.library.opcheck(torch.ops.pfl.class_means, (features.detach(), labels.to(torch.int32), 6))


def test_compile_matches_eager():
    features, labels = make_inputs(30, 5, 4, seed=8)
    f = features.requires_grad_()

    def fn(x):
        return (class_means(x, labels, 4)[0] ** 2).sum()

    eager = fn(f)
    (eager_grad,) = torch.autograd.grad(eager, [f])
    compiled = torch.compile(fn)(f)
    (compiled_grad,) = torch.autograd.grad(compiled, [f])
    assert_close(compiled, eager.double(), torch.float32)
    assert_close(compiled_grad, eager_grad.double(), torch.float32)


# ---- bad input ---------------------------------------------------------------------------

LABEL_CALLS = {"wrapper": class_means, "op": torch.ops.pfl.class_means}


@pytest.mark.parametrize("call", list(LABEL_CALLS))
def test_errors_labels_out_of_range(call):
    """The op checks the labels itself (every kernel, the same ValueError), not only the wrapper."""
    means = LABEL_CALLS[call]
    features, labels = make_inputs(10, 3, 4)
    bad = labels.clone()
    bad[6] = 4
    with pytest.raises(ValueError, match=r"labels must be in \[0, num_classes=4\), got labels\[6\] = 4"):
        means(features, bad, 4)
    bad[6] = -1
    bad[8] = 9  # the first bad label is named
    with pytest.raises(ValueError, match=r"got labels\[6\] = -1"):
        means(features, bad, 4)
    f3, l3 = make_inputs(5, 3, 4, clients=2)
    l3[1, 2] = 9
    l3[1, 4] = 5
    with pytest.raises(ValueError, match=r"got labels\[1, 2\] = 9"):
        means(f3, l3, 4)


def test_errors_shapes_types_devices():
    features, labels = make_inputs(10, 3, 4)
    with pytest.raises(ValueError, match="num_classes must be an integer >= 1"):
        class_means(features, labels, 0)
    with pytest.raises(ValueError, match=r"labels must have shape \[N\]"):
        class_means(features, labels[:9], 4)
    with pytest.raises(ValueError, match=r"labels must have shape \[K, N\]"):
        class_means(features[None], labels, 4)
    with pytest.raises(ValueError, match="features must be \\[N, D\\] or \\[K, N, D\\]"):
        class_means(features[0], labels[0], 4)
    with pytest.raises(TypeError, match="labels must be an int64 or int32"):
        class_means(features, labels.to(torch.float32), 4)
    with pytest.raises(TypeError, match="features must be a floating"):
        class_means(features.to(torch.int64), labels, 4)
    with pytest.raises(ValueError, match="labels must be on the device of features"):
        class_means(features, labels.to("meta"), 4)


def test_cpu_runs_the_cpp_kernel():
    if any(os.environ.get(v, "0") not in ("", "0") for v in ("PFL_KERNELS_SKIP_EXTENSION",
                                                              "PFL_KERNELS_DISABLE_EXTENSION")):
        pytest.skip("the C++ extension is switched off by the environment")
    assert pfl_kernels.backend_info()["pfl::class_means"]["cpu"] == {"implementation": "cpp", "reason": ""}


@pytest.mark.parametrize("num_classes, clients, message", [
    (2**40, None, r"means of shape \[1099511627776, 4\] and their counts need [\d.]+ GiB, more than the [\d.]+ GiB "
                  r"of memory of cpu"),
    (2**62, 2, r"means of shape \[2, 4611686018427387904, 4\] would have more than 2\*\*63 - 1 elements"),
])
def test_errors_num_classes_too_large_for_the_output(num_classes, clients, message):
    """One line naming num_classes, not a failure in the allocator (or a storage size that wraps)."""
    features, labels = make_inputs(3, 4, 2, clients=clients)
    with pytest.raises(ValueError, match=f"num_classes={num_classes} is too large: {message}") as error:
        class_means(features, labels, num_classes)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kernel", ["op", "reference", "fake"])
def test_errors_num_classes_beyond_memory_at_the_op(kernel):
    """A direct torch.ops.pfl.class_means call failed in the allocator ("can't allocate memory:
    you tried to allocate 13194139533312 bytes"); every layer now gives the wrapper's message."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pfl_kernels.ops.class_means import _reference_forward

    features, labels = make_inputs(5, 3, 2)
    with pytest.raises(ValueError) as wrapper_error:
        class_means(features, labels, 2**40)
    mode = FakeTensorMode() if kernel == "fake" else None
    if mode is not None:
        features, labels = mode.from_tensor(features), mode.from_tensor(labels)
    call = _reference_forward if kernel == "reference" else torch.ops.pfl.class_means
    with mode or contextlib.nullcontext(), pytest.raises(ValueError) as error:
        call(features, labels, 2**40)
    assert str(error.value) == str(wrapper_error.value)
    assert str(error.value).startswith("num_classes=1099511627776 is too large: means of shape [1099511627776, 3] "
                                       "and their counts need 20480.0 GiB, more than the ")


def test_meta_tensors_need_no_memory_but_an_int64_count():
    """On meta tensors (no memory) a large output is fine; one beyond int64 is not."""
    features, labels = (t.to("meta") for t in make_inputs(5, 3, 2))
    means, counts = torch.ops.pfl.class_means(features, labels, 2**40)
    assert means.shape == (2**40, 3) and counts.shape == (2**40,)
    with pytest.raises(ValueError, match=r"num_classes=4611686018427387904 is too large: .* more than 2\*\*63 - 1"):
        torch.ops.pfl.class_means(features, labels, 2**62)


@pytest.mark.parametrize("kernel", ["op", "reference"])
def test_errors_num_classes_beyond_int64_at_the_op(kernel):
    """The kernels themselves refuse an output whose element count wraps int64 (C++ on CPU)."""
    from pfl_kernels.ops.class_means import _reference_forward

    call = torch.ops.pfl.class_means if kernel == "op" else _reference_forward
    features, labels = make_inputs(3, 4, 2, clients=2)
    with pytest.raises(ValueError, match=r"num_classes=4611686018427387904 is too large: means of shape "
                                         r"\[2, 4611686018427387904, 4\]"):
        call(features, labels, 2**62)
