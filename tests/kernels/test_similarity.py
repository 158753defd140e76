"""The similarity ops on CPU (the C++ kernels when built) against the float64 reference."""
from __future__ import annotations

import math

import pytest
import torch

from pfl_kernels.ops import pairwise_cosine, pairwise_sqdist, similarity_weights
from pfl_kernels.reference import similarity as ref
from tests.threads import on_one_and_many_threads
from tests.tolerances import assert_close

F64 = torch.float64
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# (K, M, D): tiny, odd, the split-D path (K·M <= 4096) with several chunks and groups, and
# the large path (K·M > 4096), bfloat16 there with several converted blocks.
PAIR_SHAPES = [(1, 1, 1), (1, 5, 7), (7, 1, 33), (13, 17, 65), (64, 64, 129), (3, 2, 100_003),
               (65, 70, 301), (200, 150, 31), (80, 60, 70_001)]


def make_rows(k, d, dtype, seed=0, generator=None):
    g = generator or torch.Generator().manual_seed(seed)
    return torch.randn(k, d, generator=g, dtype=F64).to(dtype)


def acc_of(dtype):
    return F64 if dtype == F64 else torch.float32


def check_sqdist(got, want, x, y, dtype, what=""):
    """|d − d_exact| <= tol·(‖x_i‖² + ‖y_j‖²): the expanded form's error is relative to the norms
    (and, summed over D terms, grows about like √D)."""
    sx = x.to(F64).pow(2).sum(1)
    sy = sx if y is None else y.to(F64).pow(2).sum(1)
    scale = sx[:, None] + sy[None, :] + 1e-300
    tol = (1e-14 if dtype == F64 else 4e-6) * max(1.0, math.sqrt(x.shape[1] / 1000))
    err = (got.to(F64) - want).abs() / scale
    assert err.max() <= tol, f"{what}: relative-to-norms error {float(err.max()):.3e} > {tol}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"])
@pytest.mark.parametrize("shape", PAIR_SHAPES, ids=str)
def test_pairwise_match_reference(shape, with_y, dtype):
    k, m, d = shape
    g = torch.Generator().manual_seed(1)
    x = make_rows(k, d, dtype, generator=g)
    y = make_rows(m, d, dtype, generator=g) if with_y else None
    xe, ye = x.to(F64), None if y is None else y.to(F64)
    acc = acc_of(dtype)
    # bfloat16 inputs accumulate in float32: float32 accuracy relative to the (rounded) inputs.
    tol_dtype = F64 if dtype == F64 else torch.float32
    c = pairwise_cosine(x, y)
    assert c.dtype == acc and c.shape == (k, m if with_y else k)
    assert_close(c, ref.pairwise_cosine(xe, ye, 1e-8), tol_dtype, "cosine")
    assert c.abs().max() <= 1
    s = pairwise_sqdist(x, y)
    assert s.dtype == acc and s.shape == c.shape
    check_sqdist(s, ref.pairwise_sqdist(xe, ye), x, y, dtype, "sqdist")
    assert (s >= 0).all()
    if not with_y:
        assert torch.equal(c, c.t()) and torch.equal(s, s.t()), "y=None: exactly symmetric"
        assert torch.equal(s.diagonal(), torch.zeros(k, dtype=acc)), "y=None: sqdist diagonal exactly 0"
        assert_close(c.diagonal(), torch.ones(k, dtype=F64), tol_dtype, "cosine diagonal")


def test_float16_inputs():
    x, y = make_rows(9, 301, torch.float16), make_rows(4, 301, torch.float16, seed=2)
    c = pairwise_cosine(x, y)
    assert c.dtype == torch.float32
    assert_close(c, ref.pairwise_cosine(x.double(), y.double(), 1e-8), torch.float32, "cosine fp16")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"])
def test_zero_rows_have_similarity_zero_with_everything(with_y, dtype):
    x = make_rows(6, 37, dtype)
    x[2] = 0
    y = make_rows(5, 37, dtype, seed=3) if with_y else None
    if with_y:
        y[4] = 0
    c = pairwise_cosine(x, y)
    assert (c[2] == 0).all(), "a zero row has cosine 0 with everything, itself included"
    if with_y:
        assert (c[:, 4] == 0).all()
    else:
        assert (c[:, 2] == 0).all() and c[2, 2] == 0
    s = pairwise_sqdist(x, y)
    yy = x if y is None else y
    assert_close(s[2], yy.to(F64).pow(2).sum(1), F64 if dtype == F64 else torch.float32, "‖0 − y‖² = ‖y‖²")


def test_norms_below_eps_use_eps():
    x = torch.tensor([[3e-9, 4e-9], [1.0, 0.0]], dtype=F64)
    c = pairwise_cosine(x, eps=1e-8)
    # 0 < ‖x_0‖ = 5e-9 < eps: scaled by 1/eps, so |c| < 1 (a vanishing vector is not similar).
    assert_close(c, torch.tensor([[25e-18 / 1e-16, 3e-9 / 1e-8], [3e-9 / 1e-8, 1.0]], dtype=F64), F64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_duplicated_rows(dtype):
    x = make_rows(5, 1001, dtype)
    x[3] = x[1]
    x[4] = 2.5 * x[1].to(F64).to(dtype) if dtype == F64 else (2 * x[1])  # exact scaling in low precision
    c = pairwise_cosine(x)
    tol_dtype = F64 if dtype == F64 else torch.float32
    for i, j in ((1, 3), (1, 4), (3, 4)):
        assert_close(c[i, j], torch.tensor(1.0, dtype=F64), tol_dtype, f"duplicate {i},{j}")
    s = pairwise_sqdist(x)
    assert s[1, 3] >= 0 and s[1, 3] <= (4e-6 if dtype != F64 else 1e-12) * 2 * x[1].double().pow(2).sum()


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_near_duplicate_cancellation_is_bounded(dtype):
    """Rows 1e-4 apart relative to their norm: ‖x‖² + ‖y‖² − 2x·y cancels; the error stays
    within tol·(‖x‖² + ‖y‖²) (documented) and the result is never negative."""
    g = torch.Generator().manual_seed(4)
    base = torch.randn(1, 4097, generator=g, dtype=F64)
    x = (base + 1e-4 * torch.randn(6, 4097, generator=g, dtype=F64)).to(dtype)
    s = pairwise_sqdist(x)
    exact = torch.cdist(x.to(F64), x.to(F64)).pow(2)
    check_sqdist(s, exact, x, None, dtype, "near duplicates")
    assert (s >= 0).all()
    if dtype == F64:  # float64 resolves them: small relative error on d itself
        off = ~torch.eye(6, dtype=torch.bool)
        assert ((s - exact).abs()[off] / exact[off]).max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_strided_inputs(dtype):
    g = torch.Generator().manual_seed(5)
    big = torch.randn(40, 2 * 53, generator=g, dtype=F64).to(dtype)
    x = big[::3, ::2]  # row and column strides
    y = torch.randn(53, 7, generator=g, dtype=F64).to(dtype).t()  # transposed
    for xx, yy in ((x, y), (x, None), (y, x)):
        want_c = ref.pairwise_cosine(xx.to(F64), None if yy is None else yy.to(F64), 1e-8)
        assert_close(pairwise_cosine(xx, yy), want_c, dtype, "cosine strided")
        want_s = ref.pairwise_sqdist(xx.to(F64), None if yy is None else yy.to(F64))
        check_sqdist(pairwise_sqdist(xx, yy), want_s, xx, yy, dtype, "sqdist strided")


def test_empty_shapes():
    for k, m, d in ((0, 3, 4), (3, 0, 4), (2, 3, 0)):
        x, y = torch.randn(k, d), torch.randn(m, d)
        c, s = pairwise_cosine(x, y), pairwise_sqdist(x, y)
        assert c.shape == (k, m) and s.shape == (k, m)
        if d == 0:
            assert (c == 0).all() and (s == 0).all()


def needs_cpp_kernels():
    """The thread-count promise is the C++ kernels' (the plain-PyTorch reference's BLAS calls
    make none): skip where they are switched off."""
    import pfl_kernels
    if pfl_kernels.backend_info()["pfl::pairwise_sqdist"]["cpu"]["implementation"] != "cpp":
        pytest.skip("the C++ similarity kernels are not in use")


def test_independent_of_thread_count():
    needs_cpp_kernels()
    x, y = make_rows(20, 200_001, torch.float32), make_rows(20, 200_001, torch.float32, seed=7)
    xb = x.to(torch.bfloat16)
    results = on_one_and_many_threads(lambda: (pairwise_cosine(x, y), pairwise_sqdist(x), pairwise_cosine(xb)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("k, m, d", [(4, 4, 38_282), (2, 4, 38_282), (3, 5, 70_001)])
def test_few_rows_are_independent_of_thread_count(k, m, d):
    """Few rows, several blocks of D (FedAMP's distances of 4 digits CNNs): MKL called from
    at::parallel_for's master thread ran each block on every thread unless told not to."""
    needs_cpp_kernels()
    x, y = make_rows(k, d, torch.float32), make_rows(m, d, torch.float32, seed=7)
    results = on_one_and_many_threads(lambda: (pairwise_sqdist(x, y), pairwise_sqdist(x), pairwise_cosine(x, y),
                                               pairwise_cosine(y)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ---- gradients -----------------------------------------------------------------------------

@pytest.mark.parametrize("with_y", [False, True], ids=["y=None", "y"])
@pytest.mark.parametrize("k, m, d", [(1, 1, 3), (4, 3, 7), (6, 5, 2)])
def test_gradcheck_pairwise(k, m, d, with_y):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(k, d, generator=g, dtype=F64, requires_grad=True)
    y = torch.randn(m, d, generator=g, dtype=F64, requires_grad=True)
    args = (x, y) if with_y else (x,)
    assert torch.autograd.gradcheck(lambda *a: pairwise_cosine(*a), args)
    assert torch.autograd.gradcheck(lambda *a: pairwise_sqdist(*a), args)


def test_gradcheck_zero_row_and_only_y():
    """A zero row (in the flat region of max(‖x‖, eps)) and a gradient for y alone."""
    x = torch.randn(4, 5, dtype=F64)
    x[1] = 0
    x.requires_grad_()
    y = torch.randn(3, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: pairwise_cosine(a, b, eps=0.1), (x, y))
    assert torch.autograd.gradcheck(lambda a: pairwise_cosine(a, eps=0.1), (x,))
    assert torch.autograd.gradcheck(lambda b: pairwise_cosine(x.detach(), b), (y,))
    assert torch.autograd.gradcheck(lambda b: pairwise_sqdist(x.detach(), b), (y,))


@pytest.mark.parametrize("op", [pairwise_cosine, pairwise_sqdist])
def test_bfloat16_gradients(op):
    x = make_rows(5, 33, torch.bfloat16).requires_grad_()
    y = make_rows(4, 33, torch.bfloat16, seed=8).requires_grad_()
    grad = torch.randn(5, 4)
    op(x, y).backward(grad)
    xe, ye = x.detach().to(F64).requires_grad_(), y.detach().to(F64).requires_grad_()
    op(xe, ye).backward(grad.to(F64))
    assert x.grad.dtype == torch.bfloat16 and y.grad.dtype == torch.bfloat16
    for a, e in ((x.grad, xe.grad), (y.grad, ye.grad)):
        scale = e.abs().max()
        assert_close(a / scale, e / scale, torch.bfloat16, "bf16 grad")


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_opcheck_pairwise(dtype):
    x, y = make_rows(5, 9, dtype), make_rows(3, 9, dtype, seed=1)
    for args in ((x.requires_grad_(), y.requires_grad_(), 1e-8), (x.detach(), None, 1e-8)):
        torch.library.opcheck(torch.ops.pfl.pairwise_cosine, args)
        torch.library.opcheck(torch.ops.pfl.pairwise_sqdist, args[:2])


def test_compile_matches_eager():
    x = make_rows(6, 17, torch.float32).requires_grad_()

    def fn(x):
        w = similarity_weights(pairwise_cosine(x), tau=0.0, scale=5.0, min_keep=2)
        return (w * pairwise_sqdist(x)).sum()

    eager = fn(x)
    (eager_grad,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(fn, fullgraph=True)(x)
    (compiled_grad,) = torch.autograd.grad(compiled, x)
    assert_close(compiled, eager.double(), torch.float32, "loss")
    assert_close(compiled_grad, eager_grad.double(), torch.float32, "grad")


# ---- similarity_weights --------------------------------------------------------------------

def naive_weights(sim, tau, scale, min_keep, self_index=None):
    """Float64, row by row in Python: an independent statement of the rule."""
    k, m = sim.shape
    out = torch.zeros(k, m, dtype=F64)
    for i in range(k):
        own = i if self_index is None else int(self_index[i])
        v = [1.0 if j == own else float(sim[i, j]) for j in range(m)]
        kept = {j for j in range(m) if v[j] >= tau or j == own}
        order = ([own] if own >= 0 else []) + sorted((j for j in range(m) if j != own), key=lambda j: (-v[j], j))
        kept |= set(order[:min_keep])
        if not kept:
            continue
        top = max(scale * v[j] for j in kept)
        e = {j: math.exp(scale * v[j] - top) for j in kept}
        z = sum(e.values())
        for j in kept:
            out[i, j] = e[j] / z
    return out


def random_sim(k, m, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(k, m, generator=g, dtype=F64) * 2 - 1).to(dtype)


WEIGHT_CASES = [  # (K, M, tau, scale, min_keep)
    (1, 1, 0.5, 1.0, 0), (2, 2, 0.0, 1.0, 0), (7, 7, 0.3, 20.0, 4), (50, 50, 0.95, 20.0, 4),
    (50, 50, 0.0, 1.0, 10), (300, 300, 0.9, 30.0, 0), (300, 300, 0.5, -3.0, 7), (13, 13, -1.0, 2.0, 0),
    (9, 9, 1.0, 5.0, 0),  # nothing but self reaches tau = 1
    (9, 9, 1.0, 5.0, 50),  # min_keep larger than the row: the whole row
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", WEIGHT_CASES, ids=str)
def test_weights_match_naive_and_reference(case, dtype):
    k, m, tau, scale, min_keep = case
    sim = random_sim(k, m, seed=k + m, dtype=dtype)
    w = similarity_weights(sim, tau=tau, scale=scale, min_keep=min_keep)
    assert w.dtype == acc_of(dtype) and w.shape == (k, m)
    want = naive_weights(sim.to(F64), tau, scale, min_keep)
    tol_dtype = F64 if dtype == F64 else torch.float32
    assert_close(w, want, tol_dtype, "weights vs naive")
    assert_close(w, ref.similarity_weights(sim, tau, scale, min_keep, None), tol_dtype, "weights vs reference")
    assert torch.equal(w > 0, want > 0) or scale * 2 > 80, "kept sets differ"
    assert_close(w.sum(1), torch.ones(k, dtype=F64), tol_dtype, "row sums")
    kept = (want > 0).sum(1)
    assert (kept >= min(min_keep, m)).all()
    if min_keep >= m:
        assert (kept == m).all()


def test_weights_nothing_reaches_tau_keeps_self_only():
    sim = random_sim(6, 6, seed=3) * 0.5
    w = similarity_weights(sim, tau=0.9, scale=10.0)
    assert torch.equal(w, torch.eye(6, dtype=F64))


def test_weights_ties_prefer_lower_column():
    # row 0: self (col 0), then ties at 0.5 in cols 1, 3, 4 and 0.7 in col 2
    sim = torch.tensor([[0.0, 0.5, 0.7, 0.5, 0.5], [0.2, 0.0, 0.2, 0.2, 0.1], [0.3, 0.3, 0.0, 0.3, 0.3],
                        [0.1, 0.1, 0.1, 0.0, 0.1], [0.6, 0.6, 0.6, 0.6, 0.0]], dtype=torch.float32)
    w = similarity_weights(sim, tau=0.9, scale=1.0, min_keep=3)
    assert (w > 0).tolist() == [
        [True, True, True, False, False],   # self, 0.7 (col 2), the first 0.5 (col 1)
        [True, True, True, False, False],   # self, the first two 0.2 (cols 0, 2)
        [True, True, True, False, False],   # self, cols 0 and 1 of four ties
        [True, True, False, True, False],   # self (col 3), cols 0 and 1
        [True, True, False, False, True],   # self (col 4), cols 0 and 1
    ]
    assert_close(w, ref.similarity_weights(sim.double(), 0.9, 1.0, 3, None), torch.float32)
    assert torch.equal(w > 0, ref.similarity_weights(sim, 0.9, 1.0, 3, None) > 0)
    sim[0, 3] = -0.0  # -0.0 ties with 0.0 (the lower column first)
    sim[0, 4] = 0.0
    sim[0, 1] = 0.0
    assert (similarity_weights(sim, tau=0.9, scale=1.0, min_keep=3)[0] > 0).tolist() == [True, True, True, False, False]


def test_weights_self_index_rectangular_and_missing():
    sim = random_sim(4, 7, seed=5)
    own = torch.tensor([2, -1, 6, -1])
    for tau, min_keep in ((0.5, 0), (0.95, 3), (0.99, 0), (0.0, 9)):
        w = similarity_weights(sim, tau=tau, scale=4.0, min_keep=min_keep, self_index=own)
        assert_close(w, naive_weights(sim, tau, 4.0, min_keep, own), F64, f"tau={tau}, min_keep={min_keep}")
        assert_close(w, ref.similarity_weights(sim, tau, 4.0, min_keep, own), F64)
        assert (w[0, 2] > 0) and (w[2, 6] > 0), "the own column is always kept"
    # No own column, nothing reaches tau, min_keep 0: a zero row (documented).
    w = similarity_weights(-sim.abs(), tau=0.5, scale=1.0, self_index=own)
    assert (w[1] == 0).all() and (w[3] == 0).all() and w[0].sum() == 1
    w32 = similarity_weights(sim, tau=0.5, scale=1.0, self_index=own.to(torch.int32))
    assert_close(w32, naive_weights(sim, 0.5, 1.0, 0, own), F64)


def test_weights_own_entry_is_one_whatever_sim_holds():
    sim = random_sim(5, 5, seed=6)
    a = similarity_weights(sim, tau=0.2, scale=3.0, min_keep=2)
    sim2 = sim.clone()
    sim2.diagonal().copy_(torch.tensor([-1.0, 0.3, 0.0, 0.9, -0.5]))
    assert torch.equal(a, similarity_weights(sim2, tau=0.2, scale=3.0, min_keep=2))


@pytest.mark.parametrize("self_index", [None, torch.tensor([1, -1, 0, 3, 2])], ids=["diag", "index"])
def test_gradcheck_weights(self_index):
    sim = random_sim(5, 5, seed=8).requires_grad_()
    fn = lambda s: similarity_weights(s, tau=0.1, scale=3.0, min_keep=3, self_index=self_index)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (sim,))
    fn(sim).backward(torch.randn(5, 5, dtype=F64))
    own = torch.arange(5) if self_index is None else self_index
    for i, j in enumerate(own.tolist()):
        if j >= 0:
            assert sim.grad[i, j] == 0, "the own entry gets no gradient"


def test_weights_bfloat16_gradient_dtype():
    sim = random_sim(6, 6, seed=9, dtype=torch.bfloat16).requires_grad_()
    similarity_weights(sim, tau=0.0, scale=2.0).sum().backward()
    assert sim.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_opcheck_weights(dtype):
    sim = random_sim(6, 6, seed=10, dtype=dtype)
    torch.library.opcheck(torch.ops.pfl.similarity_weights, (sim.requires_grad_(), 0.2, 4.0, 3, None))
    torch.library.opcheck(torch.ops.pfl.similarity_weights,
                          (random_sim(4, 6, dtype=dtype), 0.2, 4.0, 2, torch.tensor([0, -1, 5, 2])))


def test_weights_large_rows_top_up():
    """Rows of 2000 where min_keep forces a selection among many (nth_element path)."""
    sim = random_sim(40, 2000, seed=11, dtype=torch.float32)
    own = torch.randint(-1, 2000, (40,), generator=torch.Generator().manual_seed(1))
    w = similarity_weights(sim, tau=0.999, scale=8.0, min_keep=57, self_index=own)
    assert_close(w, ref.similarity_weights(sim, 0.999, 8.0, 57, own), torch.float32)
    assert ((w > 0).sum(1) == 57).all()


# ---- bad input -----------------------------------------------------------------------------

def test_errors_pairwise():
    x = torch.randn(4, 5)
    with pytest.raises(ValueError, match="x must have 2 dimensions"):
        pairwise_cosine(torch.randn(5))
    with pytest.raises(ValueError, match=r"y must be \[M, D\] with D = 5"):
        pairwise_cosine(x, torch.randn(3, 6))
    with pytest.raises(ValueError, match="y must have 2 dimensions"):
        pairwise_sqdist(x, torch.randn(5))
    with pytest.raises(TypeError, match="y must have the dtype of x"):
        pairwise_sqdist(x, torch.randn(3, 5, dtype=F64))
    with pytest.raises(TypeError, match="x must be a floating"):
        pairwise_cosine(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        pairwise_cosine([[1.0, 2.0]])
    with pytest.raises(ValueError, match="y must be on the device of x"):
        pairwise_cosine(x, torch.randn(3, 5, device="meta"))
    for eps in (0.0, -1e-8, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be"):
            pairwise_cosine(x, eps=eps)
    with pytest.raises(TypeError, match="eps must be a real number"):
        pairwise_cosine(x, eps="1e-8")


def test_errors_op_level_without_the_wrapper():
    with pytest.raises(ValueError, match=r"y must be \[M, D\]"):
        torch.ops.pfl.pairwise_cosine(torch.randn(4, 5), torch.randn(3, 6), 1e-8)
    with pytest.raises(ValueError, match="x must be"):
        torch.ops.pfl.pairwise_sqdist(torch.randn(5), None)
    with pytest.raises(ValueError, match="not square"):
        torch.ops.pfl.similarity_weights(torch.randn(4, 5), 0.0, 1.0, 0, None)
    with pytest.raises(ValueError, match="self_index must be"):
        torch.ops.pfl.similarity_weights(torch.randn(4, 5), 0.0, 1.0, 0, torch.tensor([0, 1]))


def test_errors_weights():
    sim = random_sim(4, 4, dtype=torch.float32)
    for tau in (1.5, -1.01, float("nan")):
        with pytest.raises(ValueError, match="tau must be"):
            similarity_weights(sim, tau=tau, scale=1.0)
    for scale in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="scale must be finite"):
            similarity_weights(sim, tau=0.5, scale=scale)
    with pytest.raises(TypeError, match="scale must be a real number"):
        similarity_weights(sim, tau=0.5, scale=None)
    with pytest.raises(ValueError, match="min_keep must be >= 0"):
        similarity_weights(sim, tau=0.5, scale=1.0, min_keep=-1)
    with pytest.raises(TypeError, match="min_keep must be an int"):
        similarity_weights(sim, tau=0.5, scale=1.0, min_keep=2.0)
    for bad in (float("nan"), float("inf"), -float("inf")):
        s = sim.clone()
        s[1, 2] = bad
        with pytest.raises(ValueError, match="sim must be finite"):
            similarity_weights(s, tau=0.5, scale=1.0)
    with pytest.raises(ValueError, match="not square: pass self_index"):
        similarity_weights(random_sim(3, 4), tau=0.5, scale=1.0)
    with pytest.raises(ValueError, match=r"self_index must be \[K\] with K = 3"):
        similarity_weights(random_sim(3, 4), tau=0.5, scale=1.0, self_index=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="self_index must be an int64 or int32"):
        similarity_weights(random_sim(3, 4), tau=0.5, scale=1.0, self_index=torch.tensor([0.0, 1.0, 2.0]))
    for bad in ([0, 4, 1], [0, -2, 1]):
        with pytest.raises(ValueError, match=r"self_index values must be in \[-1, 4\)"):
            similarity_weights(random_sim(3, 4), tau=0.5, scale=1.0, self_index=torch.tensor(bad))
    with pytest.raises(ValueError, match="sim must have 2 dimensions"):
        similarity_weights(torch.rand(4), tau=0.5, scale=1.0)
    with pytest.raises(TypeError, match="sim must be a floating"):
        similarity_weights(torch.ones(3, 3, dtype=torch.int64), tau=0.5, scale=1.0)
