"""The Triton wrappers route each shape to its path (issue 30, item 2): dense weighted_average
and long float32 pairwise rows to the GEMM forms, the rest to the kernels.  The routing applies
to CUDA tensors; here the interpreter's CPU tensors are let in (``_GEMM_DEVICES``) and the
pairwise threshold is lowered, so tiny shapes take it.

    TRITON_INTERPRET=1 python -m pytest tests/kernels/test_cuda_paths_triton.py -q -m triton_interpret
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.triton_support import DEVICE, F64, MARKS, RUNNABLE, interpreter_only
from tests.tolerances import assert_close

pytestmark = [*MARKS, interpreter_only]

if RUNNABLE:
    from pfl_kernels.ops import similarity as sim_ops
    from pfl_kernels.reference import aggregate as ref_agg
    from pfl_kernels.reference import class_means as ref_cm
    from pfl_kernels.reference import similarity as ref_sim
    from pfl_kernels.triton import aggregate as ta
    from pfl_kernels.triton import class_means as tc
    from pfl_kernels.triton import similarity as ts


@pytest.fixture
def launches(monkeypatch):
    """The Triton kernels launched (each still runs), but for weighted_average's counting and
    compaction of values (``test_counts_*``, ``test_compact_*``), which precede every path's choice."""
    seen = []

    def launch(kernel):
        if kernel is not ta._count_kernel and kernel is not ta._compact_kernel:
            seen.append(kernel)
        return kernel

    monkeypatch.setattr(ta, "_launch", launch)
    monkeypatch.setattr(ts, "_launch", launch)
    monkeypatch.setattr(tc, "_launch", launch)
    return seen


@pytest.fixture
def routed(monkeypatch):
    monkeypatch.setattr(ta, "_GEMM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(ts, "_GEMM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(tc, "_GEMM_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(sim_ops, "GEMM_MIN_DIM", 64)


def weights(k, m, density):
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(k, m, generator=g) + 0.1) * (torch.rand(k, m, generator=g) < density)
    return w.to(DEVICE)


@pytest.fixture(params=[False, True], ids=["tf32-off", "tf32-on"])
def tf32(request):
    """torch's float32 matmul setting (TF32 off is torch's default), restored after the test."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = request.param
    yield request.param
    torch.backends.cuda.matmul.allow_tf32 = before


def test_dense_weighted_average_takes_the_gemm(routed, launches, tf32):
    params = torch.randn(6, 40, dtype=torch.float32, device=DEVICE)
    params[3, 5] = math.nan
    w = weights(5, 6, 1.0)
    w[:, 3] = 0
    w[2, 3] = 0.5
    out = ta.weighted_average_triton(w, params)
    expected = ref_agg.weighted_average(w.double(), params.double())
    assert torch.equal(torch.isnan(out), torch.isnan(expected)) and int(torch.isnan(out).sum()) == 1
    assert_close(out[~torch.isnan(out)], expected[~torch.isnan(expected)], torch.float32)
    assert launches == ([ta._dense_kernel] if tf32 else [])


@pytest.fixture
def counted(monkeypatch):
    """The arguments of every launch of weighted_average's counting kernel (each still runs)."""
    seen = []
    kernel = ta._count_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(x, n, counts, **meta):
                seen.append((x.clone(), grid))
                kernel[grid](x, n, counts, **meta)
            return launch

    launch = ta._launch
    monkeypatch.setattr(ta, "_launch", lambda k: Recorded() if k is kernel else launch(k))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("size, block, programs", [(0, 4096, 1024), (1, 4096, 1024), (1000, 16, 4), (77, 16, 1024)],
                         ids=["empty", "one", "strided-over-blocks", "one-block-each"])
def test_counts_of_nonzeros_and_non_finite_values(size, block, programs, dtype, counted, monkeypatch):
    """Every program adds its totals: zeros, ±0.0, NaN and ±Inf anywhere, a strided view."""
    monkeypatch.setattr(ta, "_COUNT_BLOCK", block)
    monkeypatch.setattr(ta, "_COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(size)
    x = torch.randn(2 * size, generator=g).to(dtype)
    x[torch.rand(2 * size, generator=g) < 0.3] = 0.0
    for i, value in enumerate([-0.0, math.nan, math.inf, -math.inf, math.nan]):
        if 2 * i < 2 * size:
            x[2 * i] = value
    view = x.to(DEVICE)[::2]  # every other value: copied to a contiguous run first
    counts = ta._new_counts(2, view)
    counts += 5  # counts are added to what is there
    ta._count_values(view, counts)
    want = [5 + int((view != 0).sum()), 5 + int((~torch.isfinite(view)).sum())]
    assert counts.tolist() == want
    assert len(counted) == (1 if size else 0)
    if size:
        assert counted[0][1] == (min(-(-size // block), programs),)


def test_counts_replace_the_reductions_before_each_sync(routed, counted, fresh_paths):
    """One launch per read: the weights' stats (from their compaction, or counted before a
    speculative GEMM), and the GEMM's row 0 only where a weight is zero: with every weight
    nonzero the plain product is the contract's result."""
    params = torch.randn(6, 40, device=DEVICE)
    ta.weighted_average_triton(weights(5, 6, 1.0), params)  # stats (compaction), the GEMM
    assert counted == []
    ta.weighted_average_triton(weights(5, 6, 1.0), params)  # the speculative GEMM: the weights counted
    assert [x.shape for x, _ in counted] == [(30,)]
    counted.clear()
    holes = weights(5, 6, 1.0)
    holes[1, 2] = 0.0  # dense, but one weight is zero: the product's row 0 is checked too
    out = ta.weighted_average_triton(holes, params)
    assert [x.shape for x, _ in counted] == [(30,), (40,)]
    assert_close(out, ref_agg.weighted_average(holes.double(), params.double()), torch.float32)
    counted.clear()
    sparse = weights(5, 6, 0.1)
    ta.weighted_average_triton(sparse, params)  # the GEMM was speculated, the counts say sparse
    assert [x.shape for x, _ in counted] == [(30,)]
    counted.clear()
    out = ta.weighted_average_triton(sparse, params)  # the signature now takes sparse: the compaction alone
    assert counted == []
    assert_close(out, ref_agg.weighted_average(sparse.double(), params.double()), torch.float32)


class _KernelOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ATen ops of a call that run a kernel on a GPU (views, allocations and the
    interpreter's own copies between tensors and arrays left out)."""

    FREE = {"view", "_unsafe_view", "t", "slice", "select", "alias", "as_strided", "expand", "empty", "empty_strided",
            "detach", "unsqueeze", "squeeze", "reshape", "permute", "transpose", "_reshape_alias", "copy_",
            "_local_scalar_dense", "item", "new_empty", "new_empty_strided", "empty_like", "set_", "resize_"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.FREE:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_host_launches_per_call(routed, fresh_paths):
    """The PyTorch launches around the kernels (each a host round trip on a GPU): the dense
    GEMM, after a zeroed count buffer where it is speculated (the reductions they replace were
    15 launches); on the sparse path, whose weights are compacted by a Triton launch (its CSR
    was 8), the zeroed flag that guards its speculative launch."""
    from pfl_kernels.triton import branch_aggregate as tba

    params, out = torch.randn(6, 40, device=DEVICE), torch.empty(5, 40, device=DEVICE)
    dense, sparse = weights(5, 6, 1.0), weights(5, 6, 0.1)
    calls = {"dense": lambda: ta.weighted_average_triton(dense, params),
             "dense out": lambda: ta.weighted_average_out_triton(dense, params, out=out),
             "sparse": lambda: ta.weighted_average_triton(sparse, params)}
    want = {"dense": ["zeros", "mm"], "dense out": ["mm"], "sparse": ["zeros"]}
    for name, call in calls.items():
        call()  # the signature's path is known from here on
        with _KernelOps() as log:
            call()
        assert log.ops == want[name], name
    bp, alpha, counts = torch.randn(4, 3, 9, device=DEVICE), torch.rand(4, 3, device=DEVICE), torch.tensor([3, 1, 4, 2])
    with _KernelOps() as log:
        tba.branch_aggregate_triton(bp, alpha, counts.to(DEVICE))
    assert log.ops == []  # two Triton launches, nothing else


def test_segment_class_means_reads_the_device_once(routed):
    """The segment path (C > D here) groups the labels with one sort and counts them, the
    out-of-range ones included, in one scatter: one device read (was two: the labels' own
    check, and ``bincount``'s maximum on CUDA), which also reads the largest class (the
    chunking), and no separate pass over the labels.  13 launches besides the kernel, 17 where
    a class spans several chunks (their sum and the division by the counts)."""
    features, labels = class_data((3, 40, 3), 5)
    tc.class_means_triton(features, labels, 5)
    with _KernelOps() as log:
        tc.class_means_triton(features, labels, 5)
    with _Reads() as reads:
        tc.class_means_triton(features, labels, 5)
    assert reads.count == 1
    assert "bincount" not in log.ops and len(log.ops) <= 13, log.ops


class _Reads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the reads of a device value by the host (each a sync on a GPU): ``item`` and
    the like (``_local_scalar_dense``, which the mode sees) and ``Tensor.tolist`` (which reads
    the data past the dispatcher, so it is counted where it is called)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self._tolist = None

    def __enter__(self):
        self._tolist = tolist = torch.Tensor.tolist

        def counted(t):
            self.count += 1
            return tolist(t)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ == "_local_scalar_dense"
        return func(*args, **(kwargs or {}))


def test_sparse_weighted_average_keeps_its_kernel(routed, launches):
    params = torch.randn(20, 33, dtype=torch.float32, device=DEVICE)
    w = weights(10, 20, 0.1)
    out = ta.weighted_average_triton(w, params)
    assert launches == [ta._sparse_kernel]
    assert_close(out, ref_agg.weighted_average(w.double(), params.double()), torch.float32)


def test_the_out_overload_in_place_through_the_gemm(routed, launches):
    bank = torch.randn(5, 24, dtype=torch.float32, device=DEVICE)
    w = weights(5, 5, 1.0)
    expected = ref_agg.weighted_average(w.double(), bank.double())
    assert ta.weighted_average_out_triton(w, bank, out=bank) is bank
    assert launches == []
    assert_close(bank, expected, torch.float32)


@pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"])
@pytest.mark.parametrize("d,path", [(64, "gemm"), (63, "triton")])
def test_pairwise_routes_by_length(routed, launches, d, path, with_y):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, d, generator=g).to(DEVICE)
    y = torch.randn(3, d, generator=g).to(DEVICE) if with_y else None
    c = ts.pairwise_cosine_triton(x, y, 1e-8)
    s = ts.pairwise_sqdist_triton(x, y)
    # the GEMM form: cuBLAS's product, then its epilogue, one launch per call
    assert (launches == [ts._gemm_epilogue_kernel] * 2) == (path == "gemm")
    y64 = None if y is None else y.to(F64)
    assert_close(c, ref_sim.pairwise_cosine(x.to(F64), y64, 1e-8), torch.float32)
    assert_close(s, ref_sim.pairwise_sqdist(x.to(F64), y64), torch.float32)


def test_bfloat16_rows_keep_the_kernel(routed, launches):
    x = torch.randn(4, 64).to(torch.bfloat16).to(DEVICE)
    ts.pairwise_cosine_triton(x, None, 1e-8)
    assert launches and launches[0] is ts._product_kernel


def class_data(shape, c, dtype=torch.float32, seed=2):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(*shape, generator=g).to(dtype).to(DEVICE)
    labels = torch.randint(0, c, shape[:-1], generator=g).to(DEVICE)
    return features, labels


def expected_means(features, labels, c):
    means, counts = ref_cm.class_means(features.to(F64), labels, c)
    return means, counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(37, 9), (3, 29, 9)], ids=["N,D", "K,N,D"])
def test_few_classes_take_the_one_hot_gemm(routed, launches, shape, dtype):
    features, labels = class_data(shape, 5, dtype)
    labels.view(-1)[0] = 4  # class 4 seen; with 5 classes over ~30 rows, some may be empty
    means, counts = tc.class_means_triton(features, labels, 5)
    want_means, want_counts = expected_means(features, labels, 5)
    assert launches == []
    assert means.dtype == ref_cm.acc_dtype(dtype) and torch.equal(counts, want_counts)
    assert_close(means, want_means, torch.float32 if dtype != torch.float64 else torch.float64)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_non_finite_feature_stays_in_its_class(routed, launches, value):
    """The GEMM spreads 0·NaN to every class: the segment kernel recomputes, and only the
    feature's own class holds it, as in the reference."""
    features, labels = class_data((2, 23, 8), 4)
    features[1, 5, 3] = value
    means, counts = tc.class_means_triton(features, labels, 4)
    want, _ = expected_means(features, labels, 4)
    assert launches == [tc._class_means_kernel]
    bad = ~torch.isfinite(means)
    assert torch.equal(bad, ~torch.isfinite(want)) and int(bad.sum()) == 1
    assert_close(means[~bad], want[~bad], torch.float32)


def test_an_overflowing_sum_is_recomputed(routed, launches):
    features, labels = class_data((30, 4), 3)
    labels[:3] = 2
    features[:3, 0] = 3e38  # finite, but their sum overflows float32 in class 2 only
    means, _ = tc.class_means_triton(features, labels, 3)
    want, _ = expected_means(features.double(), labels, 3)  # float64 sums: finite
    assert launches == [tc._class_means_kernel]
    assert torch.isinf(means[2, 0]) and torch.isfinite(means[:2]).all() and torch.isfinite(means[2, 1:]).all()
    assert_close(means[:2], want[:2], torch.float32)


@pytest.mark.parametrize("bad", [-1, 4])
def test_labels_out_of_range_fail_as_on_the_kernel_path(routed, launches, bad):
    features, labels = class_data((2, 11, 6), 4)
    labels[1, 7] = bad
    with pytest.raises(ValueError, match=rf"labels\[1, 7\] = {bad}"):
        tc.class_means_triton(features, labels, 4)


def test_more_classes_than_dims_and_tf32_keep_the_segment_kernel(routed, launches, tf32):
    features, labels = class_data((40, 3), 5)
    tc.class_means_triton(features, labels, 5)  # C > D
    assert launches == [tc._class_means_kernel]
    launches.clear()
    features, labels = class_data((40, 8), 5)
    means, _ = tc.class_means_triton(features, labels, 5)
    assert launches == ([tc._class_means_kernel] if tf32 else [])
    assert_close(means, expected_means(features, labels, 5)[0], torch.float32)


@pytest.fixture
def fresh_paths(monkeypatch):
    """An empty memory of the paths each signature took, restored after the test."""
    monkeypatch.setattr(ta, "_LAST_PATH", {})


def test_a_repeated_dense_signature_runs_the_gemm_first(routed, launches, fresh_paths, monkeypatch):
    """The second call of a signature that took the GEMM runs it before reading the weights'
    stats (one device sync for both): the same result, the reference's fix-up included."""
    stats = []
    weights_stats = ta._weights_stats
    monkeypatch.setattr(ta, "_weights_stats", lambda w: stats.append(w) or weights_stats(w))
    params = torch.randn(6, 40, device=DEVICE)
    first = ta.weighted_average_triton(weights(5, 6, 1.0), params)
    assert len(stats) == 1 and first.shape == (5, 40)
    w = weights(5, 6, 1.0)
    w[:, 2] = 0
    params[2, 7] = math.inf  # only zero weights meet it: the product's row 0 is NaN, fixed up
    second = ta.weighted_average_triton(w, params)
    assert len(stats) == 1 and launches == []
    expected = ref_agg.weighted_average(w.double(), params.double())
    assert torch.isfinite(second).all()
    assert_close(second, expected, torch.float32)


def test_a_signature_whose_weights_turn_sparse_takes_the_sparse_kernel(routed, launches, fresh_paths):
    params = torch.randn(20, 33, device=DEVICE)
    ta.weighted_average_triton(weights(10, 20, 1.0), params)
    w = weights(10, 20, 0.1)
    out = ta.weighted_average_triton(w, params)
    assert launches == [ta._sparse_kernel]
    assert_close(out, ref_agg.weighted_average(w.double(), params.double()), torch.float32)


def test_non_finite_weights_fail_on_the_speculative_path_too(routed, fresh_paths):
    params = torch.randn(6, 40, device=DEVICE)
    ta.weighted_average_triton(weights(5, 6, 1.0), params)
    w = weights(5, 6, 1.0)
    w[1, 1] = math.nan
    with pytest.raises(ValueError, match="weights must be finite"):
        ta.weighted_average_triton(w, params)


@pytest.mark.parametrize("density", [1.0, 0.1], ids=["dense", "sparse"])
@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
def test_the_out_overload_never_writes_out_before_the_checks(routed, fresh_paths, tf32, density, bad):
    """``out=`` is the caller's: nothing is written into it when the weights are refused.  The
    GEMM waits for the check; the sparse and dense kernels, launched before the check is read
    once their signature took them, are guarded on the device (they write nothing where a
    weight is NaN/Inf)."""
    params = torch.randn(6, 40, device=DEVICE)
    out = torch.full((5, 40), 7.0, device=DEVICE)
    ta.weighted_average_out_triton(weights(5, 6, density), params, out=out)
    want = "sparse" if density < 1 else "dense" if tf32 else "gemm"
    assert ta._LAST_PATH and set(ta._LAST_PATH.values()) == {want}
    out.fill_(7.0)
    w = weights(5, 6, density)
    w[tuple(w.nonzero()[-1])] = bad  # one row's kept weight: every row of out must stay as it was
    with pytest.raises(ValueError, match="weights must be finite"):
        ta.weighted_average_out_triton(w, params, out=out)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("fresh", [True, False], ids=["new", "out="])
@pytest.mark.parametrize("first, then", [(1.0, 0.1), (0.1, 1.0), (0.1, 0.1), (1.0, 1.0)],
                         ids=["gemm-then-sparse", "sparse-then-gemm", "sparse-twice", "gemm-twice"])
def test_a_speculated_path_gives_the_numbers_of_a_first_call(routed, fresh_paths, monkeypatch, tf32, first, then,
                                                            fresh):
    """Whatever a signature took last, a call's numbers are those of the path its own weights
    choose (bitwise the same as a call with no history): a wrong guess is rerun, never kept.
    Dense weights take the GEMM, or the dense kernel where TF32 is allowed."""
    params = torch.randn(20, 33, device=DEVICE)
    w = weights(10, 20, then)

    def call():
        if fresh:
            return ta.weighted_average_triton(w, params)
        return ta.weighted_average_out_triton(w, params, out=torch.full((10, 33), 7.0, device=DEVICE))

    without_history = call()
    monkeypatch.setattr(ta, "_LAST_PATH", {})
    ta.weighted_average_triton(weights(10, 20, first), params)  # the signature takes `first`'s path
    assert torch.equal(call(), without_history)
    assert_close(without_history, ref_agg.weighted_average(w.double(), params.double()), torch.float32)


@pytest.mark.parametrize("k, density, tf32_on", [(8, 0.2, False), (8, 1.0, True), (40, 1.0, True)],
                         ids=["sparse", "dense-one-k-block", "dense-k-blocks"])
def test_a_speculative_call_into_its_own_params(routed, fresh_paths, monkeypatch, k, density, tf32_on):
    """The in-place ``bank <- W @ bank`` after the signature took the sparse or dense kernel:
    params are copied before the speculative launch writes the bank where the kernel could
    read a row it wrote (the sparse kernel, the dense one over several blocks of rows), so
    every row reads the old bank."""
    monkeypatch.setattr(ta, "_MAX_BLOCK_K", 16)  # 40 rows: three blocks
    before, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, tf32_on
    try:
        bank = torch.randn(k, 24, device=DEVICE)
        w = weights(k, k, density)
        ta.weighted_average_out_triton(w, bank.clone(), out=torch.empty_like(bank))
        assert set(ta._LAST_PATH.values()) == {"sparse" if density < 1 else "dense"}
        expected = ref_agg.weighted_average(w.double(), bank.double())
        assert ta.weighted_average_out_triton(w, bank, out=bank) is bank
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert_close(bank, expected, torch.float32)


def test_the_path_override_holds_after_a_speculative_gemm(routed, launches, fresh_paths, monkeypatch):
    """``_PATH_OVERRIDE`` (the benchmarks' and tests' way to time or check one path) serves a
    new result even where the signature took the GEMM last, whose speculative launch then
    gives way to it."""
    params = torch.randn(6, 40, device=DEVICE)
    w = weights(5, 6, 1.0)
    ta.weighted_average_triton(w, params)  # the signature takes the GEMM
    monkeypatch.setattr(ta, "_PATH_OVERRIDE", "dense")
    out = ta.weighted_average_triton(w, params)
    assert launches == [ta._dense_kernel]
    assert_close(out, ref_agg.weighted_average(w.double(), params.double()), torch.float32)
