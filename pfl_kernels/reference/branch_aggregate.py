"""Plain-PyTorch definition of pFedMB's server aggregation (Eq. 5), any device, any float dtype.

``branch_params`` is [K, B, *shape] (client i's copy of branch b), ``alpha`` [K, B] (the
clients' branch weights) and ``counts`` [K] (their sample counts n_i).  The result is

    W_b = Σ_i n_i α_ib W_ib / Σ_i n_i α_ib                                   (pFedMB Eq. 5)

computed as Σ_i c_ib W_ib with the normalized coefficients c_ib = n_i α_ib / Σ_j n_j α_jb
(``coefficients``).  A branch that nobody weights (Σ_j n_j α_jb = 0) gets the plain average
over all K clients (c_ib = 1/K).  Clients with c_ib = 0 are not read for branch b, so a
NaN/Inf row of a client that does not weight b leaves W_b finite.

The coefficients are scale-invariant, and formed so that finite counts and α give finite
coefficients however large or small: each product n_i α_ib is scaled by a power of two,
2^-E_b, that brings the branch's largest into [0.25, 1) (``scaled_products``), so the
products and their sum can neither overflow (counts and α of 1e300 made every W_b NaN) nor
underflow to a branch nobody weights.  Scaling by a power of two is exact, so for products
within float64's normal range the coefficients are bit for bit n_i α_ib / Σ_j n_j α_jb.
Every backend (the C++ and Triton kernels too) forms them this way.
"""
from __future__ import annotations

import torch

# Below the exponent of any nonzero product (each is at least 2 * -1074).
_NO_EXPONENT = -float(1 << 30)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of parameters of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# The exponents here are integer-valued float64 tensors, never integer ones, and the powers of
# two are built by products, never from bits: converting frexp's int32 exponents does not
# compile in inductor's vectorized CPU code (torch 2.11 and 2.13), a bit cast
# (``view(torch.float64)``) has no vmap rule on 2.11, and ``torch.pow``/``exp2`` are not exact
# on every CPU.


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0**k in float64 for k holding integers, exactly: for k in [-1022, 1023]; 0 below
    (products that far below the branch's largest count as 0, on every backend), inf above.
    A product of exact powers of two, one per bit of |k|: each partial product is a normal
    float64 between 1 and the result, so every step is exact."""
    k = k.to(torch.float64)
    e = k.clamp(-1022, 1023)
    magnitude, negative = e.abs(), e < 0
    p = torch.ones_like(k)
    for bit in range(9, -1, -1):  # |e| <= 1023 < 2^10
        step = float(1 << bit)
        has = magnitude >= step
        magnitude = torch.where(has, magnitude - step, magnitude)
        factor = torch.where(negative, torch.full_like(p, 2.0 ** -step), torch.full_like(p, 2.0 ** step))
        p = torch.where(has, p * factor, p)
    p = torch.where(k < -1022, torch.zeros_like(p), p)
    return torch.where(k > 1023, torch.full_like(p, float("inf")), p)


def frexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, e) of float64 x >= 0, finite, as ``torch.frexp``: x = m 2^e, m in [0.5, 1) (0 for
    x = 0), e integer-valued, here float64 (see above).  The exponent is log2's, set right
    where log2 rounds across a power of two, then checked exactly against 2^(e-1) <= x < 2^e."""
    subnormal = x < 2.0 ** -1022
    normal = torch.where(subnormal, x * 2.0 ** 64, x)  # exact: a subnormal made normal
    positive = normal > 0
    safe = torch.where(positive, normal, torch.ones_like(normal))
    e = torch.floor(torch.log2(safe)) + 1
    low = pow2(e - 1)
    e = torch.where(low > safe, e - 1, torch.where(low * 2 <= safe, e + 1, e))
    half = torch.floor(e / 2)  # 2^-e in two factors, each within pow2's range
    m = safe * pow2(-half) * pow2(half - e)
    zero = torch.zeros_like(x)
    return torch.where(positive, m, zero), torch.where(positive, torch.where(subnormal, e - 64, e), zero)


def scaled_products(alpha: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [K, B], E [B]): w_ib = n_i α_ib 2^-E_b in float64, E_b the exponent that brings the
    largest product of branch b into [0.25, 1) (w = 0 on a branch nobody weights).

    With n_i = mn_i 2^en_i and α_ib = ma_ib 2^ea_ib (``frexp``, mantissas in [0.5, 1)), a
    product is mn_i ma_ib 2^(en_i + ea_ib), its mantissa product in [0.25, 1): no product and
    no sum of them overflows or underflows, whatever the counts and α (finite, >= 0)."""
    mn, en = frexp(counts.to(torch.float64))
    ma, ea = frexp(alpha.to(torch.float64))
    m = mn[:, None] * ma  # [K, B], 0 exactly where n_i α_ib = 0
    e = en[:, None] + ea
    nonzero = m != 0
    top = torch.where(nonzero, e, _NO_EXPONENT).amax(0)  # [B]
    zero = torch.zeros((), dtype=torch.float64, device=m.device)
    # A zero product's shift is 0, not e - top (up to 2^30): inf there would make 0 * inf =
    # NaN in the gradient of torch.where's unselected side (double backward).
    return torch.where(nonzero, m * pow2(torch.where(nonzero, e - top, 0)), zero), top


def coefficients(alpha: torch.Tensor, counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """c [K, B] with c_ib = n_i α_ib / Σ_j n_j α_jb (1/K where that sum is 0), in ``dtype``.

    Computed in float64 whatever ``dtype`` is, then rounded once: with float32 counts and
    alpha the products n_i α_ib (n_i up to 2^53) would otherwise lose digits before the sum.
    The products are scaled per branch (``scaled_products``): no overflow, no underflow.
    """
    weight, _ = scaled_products(alpha, counts)  # [K, B]
    total = weight.sum(0)  # [B]
    uniform = torch.full_like(weight, 1.0 / weight.shape[0])
    coef = torch.where(total > 0, weight / torch.where(total > 0, total, 1.0), uniform)
    return coef.to(dtype)


def branch_aggregate(branch_params: torch.Tensor, alpha: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """W [B, *shape] = Σ_i c_ib W_ib (pFedMB Eq. 5), accumulated in float32 (float64 for float64)
    and returned in branch_params' dtype.  Zero-coefficient clients contribute exactly 0."""
    k, b = alpha.shape
    acc = acc_dtype(branch_params.dtype)
    coef = coefficients(alpha, counts, acc)
    w = branch_params.reshape(k, b, -1).to(acc)
    # A client that does not weight b is not read: 0 · NaN would be NaN.
    w = torch.where((coef != 0)[..., None], w, torch.zeros((), dtype=acc, device=w.device))
    out = torch.einsum("kb,kbp->bp", coef, w)
    return out.to(branch_params.dtype).reshape(branch_params.shape[1:])


def branch_aggregate_backward(grad_out, branch_params, alpha, counts, output_mask):
    """(grad_branch_params, grad_alpha) of ``branch_aggregate``; an unrequested one is None.

    grad_W_ib = c_ib g_b.  For a weighted branch (D_b = Σ_j n_j α_jb > 0),
    ∂W_b/∂α_ib = n_i (W_ib − W_b) / D_b, so grad_α_ib = n_i (⟨g_b, W_ib⟩ − ⟨g_b, W_b⟩) / D_b
    with ⟨g_b, W_b⟩ = Σ_j c_jb ⟨g_b, W_jb⟩ (no need to keep W_b).  grad_α_ib is exactly 0
    where n_i = 0 (α_ib does not enter) and on a branch nobody weights (its plain average is
    taken as constant in α there).  Plain PyTorch ops: one pass over branch_params for the
    dot products, one write of grad_branch_params.
    """
    k, b = alpha.shape
    acc = acc_dtype(branch_params.dtype)
    coef = coefficients(alpha, counts, acc)
    g = grad_out.reshape(b, -1)
    grad_params = grad_alpha = None
    if output_mask[0]:
        # In branch_params' dtype: one pass, products rounded once (opmath inside the kernel).
        grad_params = (coef.to(branch_params.dtype)[..., None] * g[None]).reshape(branch_params.shape)
    if output_mask[1]:
        weight, top = scaled_products(alpha, counts)
        total = weight.sum(0)  # D_b 2^-E_b
        dots = torch.einsum("kbp,bp->kb", branch_params.reshape(k, b, -1), g).to(torch.float64)
        c64 = coefficients(alpha, counts, torch.float64)
        zero = torch.zeros((), dtype=torch.float64, device=dots.device)
        mean_dot = torch.where(c64 != 0, c64 * dots, zero).sum(0)  # ⟨g_b, W_b⟩
        # n_i / D_b as (n_i 2^-E_b) / (D_b 2^-E_b): D_b itself may overflow (n and α of 1e200).
        mn, en = frexp(counts.to(torch.float64))
        shift = torch.where(total > 0, en[:, None] - top, 0.0)  # 0 where unused (see above)
        n_scaled = mn[:, None] * pow2(shift)
        scale = torch.where(total > 0, n_scaled / torch.where(total > 0, total, 1.0), zero)  # [K, B]
        grad_alpha = torch.where(scale != 0, scale * (dots - mean_dot), zero).to(alpha.dtype)
    return grad_params, grad_alpha
