// CPU kernel of pfl::branch_aggregate (schema in pfl_kernels/ops/branch_aggregate.py):
//
//   W[b, p] = Σ_i c[i, b] w[i, b, p],   c[i, b] = n_i α[i, b] / Σ_j n_j α[j, b]   (pFedMB Eq. 5)
//
// with c[i, b] = 1/K on a branch nobody weights.  The coefficients (K·B numbers) are formed in
// double before the pass.  The pass is memory bound (one multiply-add per element read), so it
// reads every element of branch_params that has a nonzero coefficient exactly once and writes
// W once:
//
//   a task owns a chunk of p for one branch b; it walks the clients with c[i, b] != 0 in order,
//   kGroup at a time, each reading one contiguous run of the chunk (kGroup + 1 streams: the
//   prefetchers follow them), adding into a chunk-sized accumulator that stays in L1/L2, and
//   the last group writes W.  Clients with c[i, b] == 0 are never read, so their NaN/Inf rows
//   do not reach W[b].
//
// branch_aggregate.out writes W into a given tensor: in place where it can be viewed as [B, P]
// with unit stride in P and shares no memory with branch_params, else through a fresh W copied
// into it (so an overlap, e.g. out = branch_params[0], or out aliasing branch_params through
// another storage, gives the result without overlap).  alpha and counts are read into the
// coefficients before anything is written, so out may overlap them too.  An out whose own
// elements share memory is refused (ValueError).
//
// Determinism: every output element is summed over its clients in client order, one rounding
// per addition (s += c_i w_i), whatever the chunking or the thread count.
#include "check_helpers.h"
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorUtils.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "loop_helpers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace pfl::cpu_branch_aggregate {  // one namespace per file: setup.py's unity build compiles files together
namespace {

using cpu::shape_str;

// The checks of _check_op_args in ops/branch_aggregate.py (the same wording).
void check_args(const at::Tensor& params, const at::Tensor& alpha, const at::Tensor& counts) {
  TORCH_CHECK_VALUE(alpha.dim() == 2, "alpha must be [K, B], got ", shape_str(alpha.sizes()));
  TORCH_CHECK_VALUE(alpha.size(0) >= 1, "alpha must have K >= 1 clients, got ", shape_str(alpha.sizes()));
  TORCH_CHECK_VALUE(alpha.size(1) >= 1, "alpha must have B >= 1 branches, got ", shape_str(alpha.sizes()));
  TORCH_CHECK_VALUE(params.dim() >= 2 && params.size(0) == alpha.size(0) && params.size(1) == alpha.size(1),
                    "branch_params must have shape [", alpha.size(0), ", ", alpha.size(1),
                    ", *shape] to match alpha, got ", shape_str(params.sizes()));
  TORCH_CHECK_VALUE(counts.dim() == 1 && counts.size(0) == alpha.size(0), "counts must have shape [", alpha.size(0),
                    "] (one count per client), got ", shape_str(counts.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(params.scalar_type()), "branch_params must be a floating tensor, got ",
                   params.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(alpha.scalar_type()), "alpha must be a floating tensor, got ",
                   alpha.scalar_type());
  TORCH_CHECK_TYPE(counts.scalar_type() != at::kBool && !at::isComplexType(counts.scalar_type()),
                   "counts must be an integer or floating tensor, got ", counts.scalar_type());
  TORCH_CHECK_VALUE(alpha.device() == params.device(), "alpha must be on branch_params' device ", params.device(),
                    ", got ", alpha.device());
  TORCH_CHECK_VALUE(counts.device() == params.device(), "counts must be on branch_params' device ", params.device(),
                    ", got ", counts.device());
}

// Below any exponent of a nonzero product (each is at least 2 * -1074).
constexpr int64_t kNoExponent = -(int64_t{1} << 40);

// x = *mantissa 2^exponent with *mantissa in [0.5, 1) (0 for x = 0), exactly, subnormals too.
int64_t frexp_exponent(double x, double* mantissa) {
  int e = 0;
  *mantissa = std::frexp(x, &e);
  return e;
}

// 2^k for k <= 0, exact; 0 below 2^-1022 (reference.branch_aggregate.pow2: every backend flushes
// the same products).
double exact_pow2(int64_t k) { return k < -1022 ? 0.0 : std::ldexp(1.0, static_cast<int>(k)); }

// c[i, b] in double (row-major [K, B]), formed as reference.branch_aggregate.coefficients does,
// with the op's data checks (cheap: K·B reads): the ValueErrors of check_branch_values in
// ops/branch_aggregate.py (the same wording and order).
std::vector<double> coefficients(const at::Tensor& alpha, const at::Tensor& counts) {
  const int64_t K = alpha.size(0), B = alpha.size(1);
  const at::Tensor a = alpha.to(at::kDouble).contiguous();
  const at::Tensor n = counts.to(at::kDouble).contiguous();
  const double* ap = a.const_data_ptr<double>();
  const double* np = n.const_data_ptr<double>();
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK_VALUE(std::isfinite(np[i]) && np[i] >= 0, "counts must be >= 0 and finite, got counts[", i,
                      "] = ", np[i]);
  }
  for (int64_t i = 0; i < K; ++i) {
    for (int64_t b = 0; b < B; ++b) {
      const double v = ap[i * B + b];
      TORCH_CHECK_VALUE(std::isfinite(v) && v >= 0, "alpha must be >= 0 and finite, got alpha[", i, ", ", b,
                        "] = ", v);
    }
  }
  // n_i = mn_i 2^en_i and alpha_ib = ma_ib 2^ea_ib (frexp: mantissas in [0.5, 1)).
  std::vector<double> mn(K), ma(K * B);
  std::vector<int64_t> en(K), ea(K * B);
  for (int64_t i = 0; i < K; ++i) en[i] = frexp_exponent(np[i], &mn[i]);
  for (int64_t j = 0; j < K * B; ++j) ea[j] = frexp_exponent(ap[j], &ma[j]);
  std::vector<double> c(K * B), w(K);
  for (int64_t b = 0; b < B; ++b) {
    // Each product n_i alpha_ib as mn_i ma_ib 2^(en_i + ea_ib), scaled by 2^-E_b (E_b: the
    // branch's largest exponent), so that it cannot overflow (1e300 * 1e300 made NaN
    // coefficients) nor, for tiny counts and alpha, underflow to a branch nobody weights.
    int64_t top = kNoExponent;
    for (int64_t i = 0; i < K; ++i) {
      if (mn[i] * ma[i * B + b] != 0) top = std::max(top, en[i] + ea[i * B + b]);
    }
    double total = 0;
    for (int64_t i = 0; i < K; ++i) {
      const double m = mn[i] * ma[i * B + b];
      w[i] = m != 0 ? m * exact_pow2(en[i] + ea[i * B + b] - top) : 0.0;
      total += w[i];
    }
    for (int64_t i = 0; i < K; ++i) c[i * B + b] = total > 0 ? w[i] / total : 1.0 / static_cast<double>(K);
  }
  return c;
}

// Elements of p per task: the accumulator (32 KiB of float) stays in L1/L2 while the clients'
// runs of the chunk stream past it, each a contiguous run long enough for the prefetchers.
constexpr int64_t kChunk = 8192;
// Clients added per sweep over the accumulator: kGroup read streams + the accumulator.
constexpr int kGroup = 8;
// A pass that reads fewer elements than this runs on the calling thread (a parallel region
// costs tens of microseconds on a loaded machine).
constexpr int64_t kMinParallelElems = 1 << 20;

using cpu::cast_to;
using cpu::with_unit_stride;

// acc[j] (or out[j] for the last group) = (first ? 0 : acc[j]) + Σ_g c[g] w[g][j sp], in order.
// The kN pointers are named one by one (not indexed from an array), so that the compiler sees
// kN + 2 distinct streams and vectorizes the loop.
template <int kN, bool kUnit, bool kFirst, bool kLast, typename acc_t, typename scalar_t>
C10_ALWAYS_INLINE void add_group(const scalar_t* const* w, const acc_t* c, int64_t sp, acc_t* __restrict acc,
                                 scalar_t* __restrict out, int64_t n) {
  if (kUnit) sp = 1;
#define PFL_STREAM(l)                                        \
  const scalar_t* __restrict w##l = w[kN > l ? l : 0];       \
  const acc_t c##l = c[kN > l ? l : 0];
  PFL_STREAM(0) PFL_STREAM(1) PFL_STREAM(2) PFL_STREAM(3) PFL_STREAM(4) PFL_STREAM(5) PFL_STREAM(6) PFL_STREAM(7)
#undef PFL_STREAM
  for (int64_t j = 0; j < n; ++j) {
    acc_t s = kFirst ? c0 * static_cast<acc_t>(w0[j * sp]) : acc[j] + c0 * static_cast<acc_t>(w0[j * sp]);
    if (kN > 1) s += c1 * static_cast<acc_t>(w1[j * sp]);
    if (kN > 2) s += c2 * static_cast<acc_t>(w2[j * sp]);
    if (kN > 3) s += c3 * static_cast<acc_t>(w3[j * sp]);
    if (kN > 4) s += c4 * static_cast<acc_t>(w4[j * sp]);
    if (kN > 5) s += c5 * static_cast<acc_t>(w5[j * sp]);
    if (kN > 6) s += c6 * static_cast<acc_t>(w6[j * sp]);
    if (kN > 7) s += c7 * static_cast<acc_t>(w7[j * sp]);
    if (kLast) {
      out[j] = cast_to<scalar_t>(s);
    } else {
      acc[j] = s;
    }
  }
}

template <int kN, bool kUnit, typename acc_t, typename scalar_t>
C10_ALWAYS_INLINE void add_group_dispatch(bool first, bool last, const scalar_t* const* w, const acc_t* c, int64_t sp, acc_t* acc,
                        scalar_t* out, int64_t n) {
  if (first && last) return add_group<kN, kUnit, true, true>(w, c, sp, acc, out, n);
  if (first) return add_group<kN, kUnit, true, false>(w, c, sp, acc, out, n);
  if (last) return add_group<kN, kUnit, false, true>(w, c, sp, acc, out, n);
  add_group<kN, kUnit, false, false>(w, c, sp, acc, out, n);
}

// One task: out[j] = Σ_{g} c[g] w[ids[g] sk + j sp] for j < n, over the clients `ids` of one
// branch (w points at that branch and chunk), kGroup clients per sweep over the accumulator.
template <bool kUnit, typename acc_t, typename scalar_t>
C10_ALWAYS_INLINE void aggregate_chunk_impl(const scalar_t* w0, int64_t sk, int64_t sp, const std::vector<int64_t>& ids,
                                            const acc_t* c, acc_t* acc, scalar_t* out, int64_t n) {
  const int64_t m = static_cast<int64_t>(ids.size());  // >= 1: see coefficients()
  for (int64_t g = 0; g < m; g += kGroup) {
    const int ng = static_cast<int>(std::min<int64_t>(kGroup, m - g));
    const scalar_t* w[kGroup];
    for (int l = 0; l < ng; ++l) w[l] = w0 + ids[g + l] * sk;
    const bool first = g == 0, last = g + kGroup >= m;
    switch (ng) {
      case 1: add_group_dispatch<1, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
      case 2: add_group_dispatch<2, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
      case 3: add_group_dispatch<3, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
      case 4: add_group_dispatch<4, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
      case 5: add_group_dispatch<5, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
      case 6: add_group_dispatch<6, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
      case 7: add_group_dispatch<7, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
      default: add_group_dispatch<8, kUnit>(first, last, w, c + g, sp, acc, out, n); break;
    }
  }
}

// The baseline build (SSE2 on x86-64).
template <bool kUnit, typename acc_t, typename scalar_t>
void aggregate_chunk(const scalar_t* w0, int64_t sk, int64_t sp, const std::vector<int64_t>& ids, const acc_t* c,
                     acc_t* acc, scalar_t* out, int64_t n) {
  aggregate_chunk_impl<kUnit>(w0, sk, sp, ids, c, acc, out, n);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define PFL_AGGREGATE_AVX2 1
// The same loop compiled for AVX2 (no FMA: the same rounding), chosen at run time.  With SSE2
// the loop issues about one instruction per element read (load, multiply, add, plus the
// accumulator's load and store per sweep): it measured 1.15-1.3x slower than the BLAS einsum
// single-threaded at K = 50, P = 10^5; 8-wide vectors halve that.
template <bool kUnit, typename acc_t, typename scalar_t>
__attribute__((target("avx2"))) void aggregate_chunk_avx2(const scalar_t* w0, int64_t sk, int64_t sp,
                                                         const std::vector<int64_t>& ids, const acc_t* c,
                                                         acc_t* acc, scalar_t* out, int64_t n) {
  aggregate_chunk_impl<kUnit>(w0, sk, sp, ids, c, acc, out, n);
}

using cpu::cpu_has_avx2;
#endif

// out: W[b, p] at out[b * so + p].
template <typename scalar_t>
void aggregate_kernel(const at::Tensor& params, int64_t sk, int64_t sb, int64_t sp, int64_t K, int64_t B, int64_t P,
                      const std::vector<double>& coef, scalar_t* out, int64_t so) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* wp = params.const_data_ptr<scalar_t>();
  // Per branch, the clients that weight it and their coefficients (in the accumulation type).
  std::vector<std::vector<int64_t>> clients(B);
  std::vector<std::vector<acc_t>> weights(B);
  int64_t read = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < K; ++i) {
      const acc_t c = static_cast<acc_t>(coef[i * B + b]);
      if (c != acc_t(0)) {
        clients[b].push_back(i);
        weights[b].push_back(c);
      }
    }
    read += static_cast<int64_t>(clients[b].size()) * P;
  }
  const int64_t n_chunks = (P + kChunk - 1) / kChunk;
  const int64_t tasks = B * n_chunks;
  const int64_t grain = read < kMinParallelElems ? tasks : 1;
#ifdef PFL_AGGREGATE_AVX2
  const bool avx2 = cpu_has_avx2();
#endif
  with_unit_stride(sp == 1 || P == 1, [&](auto unit) {
    constexpr bool kUnit = decltype(unit)::value;
    at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
      std::unique_ptr<acc_t[]> acc(new acc_t[std::min(P, kChunk)]);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / n_chunks, ch = task - b * n_chunks;
        const int64_t p0 = ch * kChunk, n = std::min(kChunk, P - p0);
        const scalar_t* wb = wp + b * sb + p0 * sp;
        scalar_t* o = out + b * so + p0;
#ifdef PFL_AGGREGATE_AVX2
        if (avx2) {
          aggregate_chunk_avx2<kUnit>(wb, sk, sp, clients[b], weights[b].data(), acc.get(), o, n);
          continue;
        }
#endif
        aggregate_chunk<kUnit>(wb, sk, sp, clients[b], weights[b].data(), acc.get(), o, n);
      }
    });
  });
}

// W into out viewed as [B, P] with row stride `so` (unit stride in P), out not overlapping params.
void aggregate_into(const at::Tensor& params, const at::Tensor& alpha, const at::Tensor& counts, at::Tensor& out,
                    int64_t so) {
  const int64_t K = alpha.size(0), B = alpha.size(1);
  const std::vector<double> coef = coefficients(alpha, counts);
  const int64_t P = c10::multiply_integers(params.sizes().slice(2));
  if (P == 0) return;
  // branch_params as [K, B, P] through its strides where the trailing dims are one strided run.
  at::Tensor w = params;
  auto strides = at::detail::computeStride(params.sizes(), params.strides(), at::IntArrayRef{K, B, P});
  if (!strides) {
    w = params.contiguous();
    strides = std::vector<int64_t>{B * P, P, 1};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, params.scalar_type(), "branch_aggregate_cpu", [&] {
    aggregate_kernel<scalar_t>(w, (*strides)[0], (*strides)[1], (*strides)[2], K, B, P, coef,
                               out.data_ptr<scalar_t>(), so);
  });
}

at::Tensor branch_aggregate_cpu(const at::Tensor& params, const at::Tensor& alpha, const at::Tensor& counts) {
  check_args(params, alpha, counts);
  at::Tensor out = at::empty(params.sizes().slice(1), params.options());
  aggregate_into(params, alpha, counts, out, c10::multiply_integers(params.sizes().slice(2)));
  return out;
}

at::Tensor& branch_aggregate_out_cpu(const at::Tensor& params, const at::Tensor& alpha, const at::Tensor& counts,
                                     at::Tensor& out) {
  check_args(params, alpha, counts);
  TORCH_CHECK_VALUE(out.sizes() == params.sizes().slice(1), "out must have shape ",
                    shape_str(params.sizes().slice(1)), ", got ", shape_str(out.sizes()));
  TORCH_CHECK_TYPE(out.scalar_type() == params.scalar_type(), "out must have branch_params' dtype ",
                   params.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK_VALUE(out.device() == params.device(), "out must be on branch_params' device ", params.device(),
                    ", got ", out.device());
  // An out whose elements share memory would keep whichever value came last (copy_ refuses
  // only the layouts at::has_internal_overlap can decide).
  TORCH_CHECK_VALUE(!cpu::has_internal_overlap(out), "out must not have elements that share memory, got strides ",
                    shape_str(out.strides()));
  const int64_t B = alpha.size(1), P = c10::multiply_integers(params.sizes().slice(2));
  auto so = at::detail::computeStride(out.sizes(), out.strides(), at::IntArrayRef{B, P});
  const bool direct = so && (P <= 1 || (*so)[1] == 1) && (B == 1 || P == 0 || std::abs((*so)[0]) >= P) &&
                      !cpu::may_overlap(out, params);
  if (direct) {
    aggregate_into(params, alpha, counts, out, (*so)[0]);
  } else {
    at::Tensor w = at::empty(params.sizes().slice(1), params.options());
    aggregate_into(params, alpha, counts, w, P);
    out.copy_(w);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("branch_aggregate", &branch_aggregate_cpu);
  m.impl("branch_aggregate.out", &branch_aggregate_out_cpu);
}

}  // namespace pfl::cpu_branch_aggregate
