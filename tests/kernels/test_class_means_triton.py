"""The Triton class_means kernel against the float64 reference.

In the Triton interpreter or on a CUDA device, skipped otherwise (see ``triton_support.py``):

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_class_means_triton.py -q
"""
from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_support import (
    DEVICE, F64, MARKS, RUNNABLE, assert_registered_for_cuda, gpu_only, interpreter_only, launchers_as_cpu_kernels)
from tests.tolerances import assert_close

pytestmark = MARKS

if RUNNABLE:
    from pfl_kernels.reference import class_means as ref
    from pfl_kernels.triton import class_means as tcm


def make_inputs(n, d, c, clients=None, dtype=F64, seed=0, label_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    lead = () if clients is None else (clients,)
    features = torch.randn(*lead, n, d, generator=g, dtype=F64).to(DEVICE, dtype)
    labels = torch.randint(0, c, (*lead, n), generator=g).to(DEVICE, label_dtype)
    return features, labels


def check(features, labels, c, dtype=F64):
    means, counts = tcm.class_means_triton(features, labels, c)
    want_means, want_counts = ref.class_means(features.to(F64), labels, c)
    assert means.dtype == ref.acc_dtype(features.dtype) and counts.dtype == torch.int64
    assert torch.equal(counts.cpu(), want_counts.cpu())
    assert_close(means, want_means, dtype, "means")
    return means, counts


@pytest.mark.parametrize("n,d,c,clients", [(1, 1, 1, None), (17, 5, 3, None), (40, 9, 7, None),
                                           (12, 3, 4, 3), (30, 300, 5, None)], ids=str)
def test_matches_reference(n, d, c, clients):
    check(*make_inputs(n, d, c, clients), c)


def test_float32_int32_labels_and_empty_classes():
    features, labels = make_inputs(25, 6, 5, dtype=torch.float32, seed=1, label_dtype=torch.int32)
    labels[labels == 2] = 4
    labels[0], labels[-1] = 0, 4
    means, counts = check(features, labels, 5, torch.float32)
    assert counts[2] == 0 and not means[2].any()


def test_empty_inputs():
    means, counts = tcm.class_means_triton(torch.randn(0, 4, device=DEVICE), torch.zeros(0, dtype=torch.int64,
                                                                                         device=DEVICE), 3)
    assert means.shape == (3, 4) and not means.any() and not counts.any()


def test_no_clients():
    """K = 0 clients of N > 0 samples: empty results (segment_keys' arange refused K = 0)."""
    means, counts = tcm.class_means_triton(torch.randn(0, 4, 2, device=DEVICE),
                                           torch.zeros(0, 4, dtype=torch.int64, device=DEVICE), 3)
    assert means.shape == (0, 3, 2) and counts.shape == (0, 3)


def test_strided_features():
    features, labels = make_inputs(20, 8, 4, clients=2, seed=2)
    t = features.transpose(1, 2).contiguous().transpose(1, 2)
    check(t, labels, 4)


def test_out_of_range_labels_raise():
    """The launcher itself raises the ValueError of every kernel (first bad label named)."""
    features, labels = make_inputs(10, 3, 4, seed=3)
    labels[3] = 9
    labels[5] = -2
    with pytest.raises(ValueError, match=r"labels must be in \[0, num_classes=4\), got labels\[3\] = 9"):
        tcm.class_means_triton(features, labels, 4)


@pytest.mark.parametrize("bad", [-1, 4, -7, 2**40], ids=str)
def test_out_of_range_labels_of_a_client_raise(bad):
    """Per client, labels below 0 and from C up are counted in two slots of their own (the keys'
    ends, -1 and C included): the error names the first in sample order, client by client."""
    features, labels = make_inputs(11, 3, 4, clients=3, seed=5)
    labels[2, 1] = 5
    labels[1, 7] = bad
    with pytest.raises(ValueError, match=rf"labels\[1, 7\] = {bad}"):
        tcm.class_means_triton(features, labels, 4)


def test_segment_keys_group_each_clients_classes():
    labels = torch.tensor([[2, -3, 0, 2, 9], [1, 1, 3, 0, 2]], device=DEVICE)
    keys, counts = tcm.segment_keys(labels, 3)
    assert keys.tolist() == [3, 0, 1, 3, 4, 7, 7, 9, 6, 8]
    assert counts.tolist() == [1, 1, 0, 2, 1, 0, 1, 2, 1, 1]  # per client: below 0, classes 0, 1, 2, from 3 up
    # -3 and 9 of client 0, 3 of client 1 outside; the largest class: client 0's 2, client 1's 1
    assert tcm.segment_stats(counts, 2, 3) == (3, 2)


@pytest.mark.parametrize("rows", [1, 2, 3, 64], ids=lambda r: f"{r}-rows")
@pytest.mark.parametrize("clients", [None, 3], ids=["one-client", "clients"])
def test_chunks_of_a_class_add_up_to_its_mean(rows, clients, monkeypatch):
    """A class's rows split over several programs (chunks of ``rows``, the last one short,
    classes with fewer rows than a chunk, an empty class): the partial sums added in chunk
    order give the float64 means, and the same bits on every call."""
    monkeypatch.setattr(tcm, "_CHUNK_ROWS", rows)
    monkeypatch.setattr(tcm, "_GEMM_DEVICES", ())  # the segment kernel on a GPU too (C <= D here)
    features, labels = make_inputs(23, 5, 4, clients, dtype=torch.float32, seed=7)
    labels[..., :12] = 0  # class 0: 12 rows or more per client, several chunks of 1, 2 or 3
    labels[labels == 3] = 2  # class 3 empty
    first, _ = check(features, labels, 4, torch.float32)
    again, _ = tcm.class_means_triton(features, labels, 4)
    assert torch.equal(first, again)


def test_chunking_caps_the_chunks_and_their_memory(monkeypatch):
    assert tcm.chunking(0, 1, 1, 1, 4) == (tcm._CHUNK_ROWS, 1)
    assert tcm.chunking(64, 1, 10, 256, 4) == (64, 1)
    assert tcm.chunking(10_000, 1, 10, 256, 4) == (64, 157)  # 100,000 samples in 10 classes
    rows, chunks = tcm.chunking(10**7, 1, 10, 256, 4)
    assert chunks <= tcm._MAX_CHUNKS and rows * chunks >= 10**7
    monkeypatch.setattr(tcm, "_MAX_PARTIAL_BYTES", 10 * 256 * 4 * 20)  # room for 20 chunks a class
    rows, chunks = tcm.chunking(10_000, 1, 10, 256, 4)
    assert chunks <= 20 and rows * chunks >= 10_000


def test_num_classes_beyond_int64_raises():
    """The launcher refuses an output whose element count wraps int64, as every kernel does."""
    features, labels = make_inputs(3, 4, 2, clients=2, seed=4)
    with pytest.raises(ValueError, match=r"num_classes=4611686018427387904 is too large: means of shape "
                                         r"\[2, 4611686018427387904, 4\]"):
        tcm.class_means_triton(features, labels, 2**62)


def test_num_classes_beyond_memory_raises_the_wrappers_error():
    """The launcher refuses an output larger than the device's memory with the wrapper's
    ValueError (the allocator's error before)."""
    from pfl_kernels.ops import class_means

    features, labels = make_inputs(5, 3, 2, seed=4)
    with pytest.raises(ValueError) as wrapper_error:
        class_means(features, labels, 2**40)
    with pytest.raises(ValueError, match=r"^num_classes=1099511627776 is too large: .* GiB of memory of ") as error:
        tcm.class_means_triton(features, labels, 2**40)
    assert str(error.value) == str(wrapper_error.value)


@interpreter_only
def test_through_dispatcher_and_autograd():
    from pfl_kernels.ops import class_means

    features, labels = make_inputs(15, 4, 3, clients=2, seed=4)
    f = features.clone().requires_grad_(True)
    f_ref = features.clone().requires_grad_(True)
    with launchers_as_cpu_kernels({"class_means": tcm.class_means_triton}):
        means, _ = class_means(f, labels, 3)
    g = torch.randn_like(means)
    means.backward(g)
    want, _ = ref.class_means(f_ref, labels, 3)
    want.backward(g)
    assert_close(means, want, F64)
    assert_close(f.grad, f_ref.grad, F64, "grad of features")


def test_registered_for_cuda():
    assert_registered_for_cuda(("class_means",))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_dtypes(dtype):
    features, labels = make_inputs(5000, 257, 10, dtype=dtype, seed=5)
    means, counts = torch.ops.pfl.class_means(features, labels, 10)
    assert means.dtype == torch.float32
    want, want_counts = ref.class_means(features.to(F64), labels, 10)
    assert torch.equal(counts, want_counts)
    assert_close(means, want, torch.float32 if dtype != torch.float16 else dtype)


@gpu_only
def test_gpu_opcheck_gradcheck_and_determinism():
    features, labels = make_inputs(30, 5, 4, clients=2, seed=6)
    torch.library.opcheck(torch.ops.pfl.class_means.default, (features.requires_grad_(), labels, 4))
    assert torch.autograd.gradcheck(lambda x: torch.ops.pfl.class_means(x, labels, 4)[0], (features,))
    big, big_labels = make_inputs(20000, 64, 7, dtype=torch.float32, seed=7)
    a = torch.ops.pfl.class_means(big, big_labels, 7)[0]
    b = torch.ops.pfl.class_means(big, big_labels, 7)[0]
    assert torch.equal(a, b)


@gpu_only
@pytest.mark.parametrize("n, c", [(100_000, 10), (50_000, 100)])
def test_gpu_segment_kernel_at_benchmark_shapes(n, c, monkeypatch):
    """The chunked segment kernel at the benchmark's sizes (about 157 and 8 chunks of 64 rows a
    class) against float64, and the same bits on a second call."""
    monkeypatch.setattr(tcm, "_GEMM_DEVICES", ())
    features, labels = make_inputs(n, 256, c, dtype=torch.float32, seed=9)
    first, _ = check(features, labels, c, torch.float32)
    again, _ = tcm.class_means_triton(features, labels, c)
    assert torch.equal(first, again)
