// CPU kernels of the similarity ops (schemas in pfl_kernels/ops/similarity.py).
//
// pairwise_cosine / pairwise_sqdist are one matrix product s = x·yᵀ (BLAS: at::mm / addmm, i.e.
// MKL or OpenBLAS sgemm/dgemm) plus an O(K·M) epilogue that turns s and the squared norms into
// the result in place.  The norms never cost a pass of their own over memory:
//
//   y None           the squared norms are the diagonal of the Gram matrix s = x·xᵀ; the
//                    epilogue reads the upper triangle and writes both halves (the result is
//                    exactly symmetric whatever order BLAS summed in).
//   split-D path     (few output entries, K·M <= kSplitMaxOut, or bfloat16/float16 inputs):
//                    D is cut into chunks small enough for L2 ((K + M) rows of a chunk fit in
//                    kChunkBytes), processed by kGroups fixed groups of consecutive chunks.
//                    Per chunk the norms are summed while the block is in cache (bfloat16:
//                    during its conversion to a float32 buffer, so no float32 copy of x is
//                    ever made) and the block's product is added to the group's partial
//                    [K, M] with BLAS (sequential: SequentialBlas).  The
//                    partials are then added in group order: the groups depend on D, K and M
//                    only, so the result does not depend on the thread count.  Small K·M is
//                    where the product is bound by reading x and y, so one read matters; it
//                    also gives BLAS the parallelism over D that a 20 x 20 output lacks.
//   large K·M        the product is bound by arithmetic (2·K·M·D flops for (K + M)·D reads):
//                    float32/float64 call at::mm once (multi-threaded BLAS) and, with y given,
//                    sum the norms in a separate pass (its K·D + M·D reads are a fraction of a
//                    percent of the product's time); bfloat16/float16 convert blocks of D to
//                    float32 (threads over rows, norms summed on the way) and accumulate them
//                    with addmm_, one block at a time.
//
// Extreme and non-finite rows (rescale_extreme_rows): a row whose squared norm leaves a safe
// band (a NaN/Inf entry, entries of 1e19 or 1e-30 in float32) is classified after the product;
// non-finite rows give NaN rows/columns, extreme ones are scaled by a power of two and their
// products recomputed, as reference/similarity.py defines.  Ordinary rows cost nothing more.
//
// similarity_weights: one task per row (threads over rows).  A row is read once to find the
// entries >= tau; only when they (with the own entry) are fewer than min_keep does it select
// the most similar of the rest with std::nth_element on (value desc, column asc) pairs, O(M) on
// average; then one softmax over the kept entries.
#include "check_helpers.h"
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace pfl::cpu_similarity {  // one namespace per file: setup.py's unity build compiles files together
namespace {

// ---------------------------------------------------------------- checks

using cpu::shape_str;

std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// The checks of _check_pair in ops/similarity.py (the same wording).
void check_pair(const at::Tensor& x, const std::optional<at::Tensor>& y) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [K, D], got ", shape_str(x.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "x must be a floating tensor, got ",
                   dtype_str(x.scalar_type()));
  if (!y) return;
  TORCH_CHECK_VALUE(y->dim() == 2 && y->size(1) == x.size(1), "y must be [M, D] with D = ", x.size(1), " (x's), got ",
                    shape_str(y->sizes()));
  TORCH_CHECK_TYPE(y->scalar_type() == x.scalar_type(), "y must have x's dtype ", dtype_str(x.scalar_type()), ", got ",
                   dtype_str(y->scalar_type()));
  TORCH_CHECK_VALUE(y->device() == x.device(), "y must be on x's device ", x.device(), ", got ", y->device());
}

at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// ---------------------------------------------------------------- geometry

// Output entries up to which the split-D path is used: up to here the product reads more bytes
// per flop than the machine moves (float32 at 64 x 64 outputs: 32 flops per byte of x and y,
// about the ratio of a core's FMA throughput to its share of memory bandwidth).
constexpr int64_t kSplitMaxOut = 64 * 64;
// Bytes of one chunk of x and y ((K + M) rows of it, in the accumulation type): within L2.
constexpr int64_t kChunkBytes = 512 << 10;
constexpr int64_t kMinChunk = 256;
// Fixed groups of chunks (and partial products): enough for any thread count here and few
// enough that the partials ([kGroups, K, M] at K·M <= kSplitMaxOut) stay small.
constexpr int64_t kGroups = 64;
// Large path, bfloat16: elements of the float32 buffers (K + M) x chunk converted per addmm_.
constexpr int64_t kConvertElems = 4 << 20;

int64_t chunk_size(int64_t rows, int64_t D, int64_t elem, int64_t budget, int64_t min_chunk) {
  int64_t c = budget / std::max<int64_t>(1, rows * elem);
  c = std::max(min_chunk, c / 64 * 64);
  return std::min(c, std::max<int64_t>(D, 1));
}

// ---------------------------------------------------------------- row helpers

constexpr int kLanes = 16;

// Σ_d p[d]² in acc_t (16 lanes, a fixed tree: vectorizes without -ffast-math, deterministic).
template <typename scalar_t, typename acc_t>
acc_t sum_squares(const scalar_t* __restrict p, int64_t n) {
  acc_t lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const acc_t v = static_cast<acc_t>(p[d + l]);
      lane[l] += v * v;
    }
  }
  acc_t rest = 0;
  for (; d < n; ++d) {
    const acc_t v = static_cast<acc_t>(p[d]);
    rest += v * v;
  }
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  }
  return lane[0] + rest;
}

// dst[d] = float(p[d]) and returns Σ dst[d]² (one pass over the block).
template <typename scalar_t, typename acc_t>
acc_t convert_and_sum_squares(const scalar_t* __restrict p, acc_t* __restrict dst, int64_t n) {
  acc_t lane[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const acc_t v = static_cast<acc_t>(p[d + l]);
      dst[d + l] = v;
      lane[l] += v * v;
    }
  }
  acc_t rest = 0;
  for (; d < n; ++d) {
    const acc_t v = static_cast<acc_t>(p[d]);
    dst[d] = v;
    rest += v * v;
  }
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
  }
  return lane[0] + rest;
}

// x with unit stride along D (BLAS takes any row stride; the row loops here want unit stride).
at::Tensor unit_inner(const at::Tensor& t) { return t.stride(1) == 1 || t.size(1) <= 1 ? t : t.contiguous(); }

// ---------------------------------------------------------------- the product

// MKL's thread count for the calling thread only (libtorch_cpu exports it when torch is built
// with MKL; weak, so null with another BLAS).  MKL does not treat at::parallel_for's master
// thread as inside a parallel region: there a split-D block's addmm_ ran on every thread, its
// sum split over D in an order that depends on the thread count (pairwise_sqdist of [4, 38282]
// float32 rows differed in the last bits between 1 and 2 threads, so FedAMP's resumed run was
// not bitwise).  The guard makes each block's product sequential, as the path requires.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

struct SequentialBlas {
  int previous = 0;
  SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) previous = MKL_Set_Num_Threads_Local(1);
  }
  ~SequentialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);  // 0: the global setting again
  }
  SequentialBlas(const SequentialBlas&) = delete;
  SequentialBlas& operator=(const SequentialBlas&) = delete;
};

struct Product {
  at::Tensor s;   // [K, M] x·yᵀ in the accumulation type (the output, finished in place)
  at::Tensor sx;  // [K] squared norms of x's rows
  at::Tensor sy;  // [M] squared norms of y's rows (sx when y is None)
};

// Split-D path: see the file comment.
template <typename scalar_t>
Product product_split(const at::Tensor& x, const std::optional<at::Tensor>& y) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kConvert = !std::is_same_v<acc_t, scalar_t>;
  const at::ScalarType acc = acc_type_of(x.scalar_type());
  const int64_t K = x.size(0), M = y ? y->size(0) : K, D = x.size(1);
  const bool has_y = y.has_value();
  const int64_t rows = K + (has_y ? M : 0);
  const int64_t chunk = chunk_size(rows, D, sizeof(acc_t), kChunkBytes, kMinChunk);
  const int64_t n_chunks = (D + chunk - 1) / chunk;
  const int64_t groups = std::min(kGroups, n_chunks);
  auto opts = x.options().dtype(acc);
  at::Tensor part = at::zeros({groups, K, M}, opts);
  at::Tensor part_norm = at::zeros({groups, rows}, opts);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* yp = has_y ? y->const_data_ptr<scalar_t>() : nullptr;
  const int64_t sxr = x.stride(0), syr = has_y ? y->stride(0) : 0;
  acc_t* pn = part_norm.data_ptr<acc_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const SequentialBlas sequential;
    at::Tensor buf = kConvert ? at::empty({rows, chunk}, opts) : at::Tensor();
    for (int64_t g = g0; g < g1; ++g) {
      // Group g owns chunks [c0, c1): an equal share, fixed by D, K and M alone.
      const int64_t c0 = g * n_chunks / groups, c1 = (g + 1) * n_chunks / groups;
      at::Tensor acc_g = part.select(0, g);
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t d0 = c * chunk, dc = std::min(chunk, D - d0);
        at::Tensor xb, yb;
        if (kConvert) {
          acc_t* bp = buf.data_ptr<acc_t>();
          for (int64_t r = 0; r < rows; ++r) {
            const scalar_t* src = r < K ? xp + r * sxr + d0 : yp + (r - K) * syr + d0;
            pn[g * rows + r] += convert_and_sum_squares<scalar_t, acc_t>(src, bp + r * chunk, dc);
          }
          xb = buf.narrow(0, 0, K).narrow(1, 0, dc);
          yb = has_y ? buf.narrow(0, K, M).narrow(1, 0, dc) : xb;
        } else {
          xb = x.narrow(1, d0, dc);
          yb = has_y ? y->narrow(1, d0, dc) : xb;
          if (has_y) {  // y None: the norms are the Gram diagonal
            for (int64_t r = 0; r < rows; ++r) {
              const scalar_t* src = r < K ? xp + r * sxr + d0 : yp + (r - K) * syr + d0;
              pn[g * rows + r] += sum_squares<scalar_t, acc_t>(src, dc);
            }
          }
        }
        acc_g.addmm_(xb, yb.t());  // BLAS, sequential (SequentialBlas)
      }
    }
  });
  // The partials in group order (a fixed-order sum: deterministic).
  at::Tensor s = part.select(0, 0).clone();
  for (int64_t g = 1; g < groups; ++g) s.add_(part.select(0, g));
  at::Tensor norms = part_norm.select(0, 0).clone();
  for (int64_t g = 1; g < groups; ++g) norms.add_(part_norm.select(0, g));
  if (!has_y) {  // the Gram diagonal, as on every path (so that c[i, i] = s / (√s)² ≈ 1)
    at::Tensor d = s.diagonal().clone();
    return {s, d, d};
  }
  return {s, norms.narrow(0, 0, K), norms.narrow(0, K, M)};
}

// Squared norms of t's rows, threads over rows.
template <typename scalar_t>
at::Tensor row_sqnorms(const at::Tensor& t, at::ScalarType acc) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t R = t.size(0), D = t.size(1), sr = t.stride(0);
  at::Tensor out = at::empty({R}, t.options().dtype(acc));
  const scalar_t* p = t.const_data_ptr<scalar_t>();
  acc_t* o = out.data_ptr<acc_t>();
  at::parallel_for(0, R, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = sum_squares<scalar_t, acc_t>(p + r * sr, D);
  });
  return out;
}

// Large K·M: see the file comment.
template <typename scalar_t>
Product product_large(const at::Tensor& x, const std::optional<at::Tensor>& y) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kConvert = !std::is_same_v<acc_t, scalar_t>;
  const at::ScalarType acc = acc_type_of(x.scalar_type());
  const bool has_y = y.has_value();
  if (!kConvert) {
    at::Tensor s = at::mm(x, (has_y ? *y : x).t());
    if (!has_y) {
      at::Tensor d = s.diagonal().clone();
      return {s, d, d};
    }
    return {s, row_sqnorms<scalar_t>(x, acc), row_sqnorms<scalar_t>(*y, acc)};
  }
  const int64_t K = x.size(0), M = has_y ? y->size(0) : K, D = x.size(1);
  const int64_t rows = K + (has_y ? M : 0);
  const int64_t chunk = chunk_size(rows, D, 1, kConvertElems, kMinChunk);
  auto opts = x.options().dtype(acc);
  at::Tensor buf = at::empty({rows, chunk}, opts);
  at::Tensor s = at::zeros({K, M}, opts);
  at::Tensor norms = at::zeros({rows}, opts);
  const scalar_t* xp = x.const_data_ptr<scalar_t>();
  const scalar_t* yp = has_y ? y->const_data_ptr<scalar_t>() : nullptr;
  const int64_t sxr = x.stride(0), syr = has_y ? y->stride(0) : 0;
  acc_t* bp = buf.data_ptr<acc_t>();
  acc_t* np = norms.data_ptr<acc_t>();
  for (int64_t d0 = 0; d0 < D; d0 += chunk) {
    const int64_t dc = std::min(chunk, D - d0);
    // Each row's norm is summed block after block by whichever thread converts it: the same
    // order for any thread count.
    at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / dc), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* src = r < K ? xp + r * sxr + d0 : yp + (r - K) * syr + d0;
        np[r] += convert_and_sum_squares<scalar_t, acc_t>(src, bp + r * chunk, dc);
      }
    });
    at::Tensor xb = buf.narrow(0, 0, K).narrow(1, 0, dc);
    at::Tensor yb = has_y ? buf.narrow(0, K, M).narrow(1, 0, dc) : xb;
    s.addmm_(xb, yb.t());
  }
  if (!has_y) {
    at::Tensor d = s.diagonal().clone();
    return {s, d, d};
  }
  return {s, norms.narrow(0, 0, K), norms.narrow(0, K, M)};
}

template <typename scalar_t>
Product product(const at::Tensor& x_in, const std::optional<at::Tensor>& y_in) {
  const at::Tensor x = unit_inner(x_in);
  std::optional<at::Tensor> y;
  if (y_in) y = unit_inner(*y_in);
  const int64_t K = x.size(0), M = y ? y->size(0) : K;
  if (K * M <= kSplitMaxOut && x.size(1) > 0) return product_split<scalar_t>(x, y);
  return product_large<scalar_t>(x, y);
}

// ---------------------------------------------------------------- extreme and non-finite rows
//
// The product above squares and multiplies the rows as they are.  That is exact enough for a
// row whose squared norm q lies in the safe band [low, high] (see safe_band): no partial sum
// can overflow (|x·y| <= ‖x‖‖y‖ <= high, and ‖x‖² + ‖y‖² − 2 x·y <= 4 high < max), and what
// underflow loses (at most the smallest normal per term, D terms) is below 2^-24 of the
// norms for D < 2^38.  A row outside the band is one of:
//
//   non-finite (a NaN or ±Inf entry): its row (and column when y is None) of the result is NaN;
//   zero: nothing to fix, its products are exactly 0;
//   extreme (finite and nonzero, entries whose squares overflow or underflow, e.g. 1e19 or
//     1e-30 in float32): scaled by a power of two σ = 2^-e, e the binary exponent of its max
//     |entry| (reference.similarity.row_scales), its products with every row and its norm are
//     recomputed from the scaled row with BLAS ([U, D] x [D, M] for U such rows), and the
//     epilogue undoes σ where it can no longer overflow.
//
// So rows of ordinary size keep the bits of the fast path, and without extreme rows the fix
// costs one comparison per row.

template <typename acc_t>
struct RowInfo {
  std::vector<acc_t> sigma;      // the row's scale: 1 unless extreme
  std::vector<uint8_t> finite;   // 0 where the row holds a NaN or ±Inf
  std::vector<int64_t> extreme;  // the scaled rows, ascending
  bool any_non_finite = false;
};

// [low, high]: squared norms that need no scaling.  low: 2^62 times the smallest normal
// (float32: 2^-64); high: an eighth of the largest finite value.
template <typename acc_t>
std::pair<acc_t, acc_t> safe_band() {
  using lim = std::numeric_limits<acc_t>;
  return {std::ldexp(lim::min(), 62), lim::max() / 8};
}

// Largest |e| of a scale 2^-e: 2^±e stays a normal number (reference.similarity.scale_exponent_limit).
template <typename acc_t>
constexpr int kScaleExponentLimit = std::numeric_limits<acc_t>::max_exponent - 3;

// Classifies the rows of t (unit inner stride) whose squared norm q[r] lies outside the safe
// band, reading each such row once (threads over them: all rows are zero at initialization).
template <typename scalar_t, typename acc_t>
RowInfo<acc_t> classify_rows(const at::Tensor& t, const acc_t* q) {
  const int64_t R = t.size(0), D = t.size(1), sr = t.stride(0);
  const scalar_t* p = t.const_data_ptr<scalar_t>();
  const auto [low, high] = safe_band<acc_t>();
  RowInfo<acc_t> info;
  info.sigma.assign(R, acc_t(1));
  info.finite.assign(R, 1);
  std::vector<int64_t> outside;
  for (int64_t r = 0; r < R; ++r) {
    if (!(q[r] >= low && q[r] <= high)) outside.push_back(r);  // NaN fails both
  }
  // Per row outside the band: max |entry|, or Inf where one is NaN or ±Inf.
  std::vector<acc_t> m(outside.size(), acc_t(0));
  const int64_t n = static_cast<int64_t>(outside.size());
  at::parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(D, 1)), [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const scalar_t* row = p + outside[u] * sr;
      acc_t mu = 0;
      for (int64_t d = 0; d < D; ++d) {
        const acc_t v = std::abs(static_cast<acc_t>(row[d]));
        if (!std::isfinite(v)) {
          mu = std::numeric_limits<acc_t>::infinity();
          break;
        }
        mu = std::max(mu, v);
      }
      m[u] = mu;
    }
  });
  for (int64_t u = 0; u < n; ++u) {
    const int64_t r = outside[u];
    if (!std::isfinite(m[u])) {
      info.finite[r] = 0;
      info.any_non_finite = true;
    } else if (m[u] > 0) {
      int e = 0;
      std::frexp(m[u], &e);
      e = std::clamp(e, -kScaleExponentLimit<acc_t>, kScaleExponentLimit<acc_t>);
      info.sigma[r] = std::ldexp(acc_t(1), -e);
      info.extreme.push_back(r);
    }
  }
  return info;
}

// The extreme rows of t scaled by their σ, [U, D] in the accumulation type.
template <typename scalar_t, typename acc_t>
at::Tensor scaled_rows(const at::Tensor& t, const RowInfo<acc_t>& info, at::ScalarType acc) {
  const int64_t U = static_cast<int64_t>(info.extreme.size()), D = t.size(1), sr = t.stride(0);
  at::Tensor out = at::empty({U, D}, t.options().dtype(acc));
  const scalar_t* p = t.const_data_ptr<scalar_t>();
  acc_t* o = out.data_ptr<acc_t>();
  for (int64_t u = 0; u < U; ++u) {
    const int64_t r = info.extreme[u];
    for (int64_t d = 0; d < D; ++d) o[u * D + d] = static_cast<acc_t>(p[r * sr + d]) * info.sigma[r];
  }
  return out;
}

at::Tensor index_tensor(const std::vector<int64_t>& rows, const at::Tensor& like) {
  at::Tensor idx = at::empty({static_cast<int64_t>(rows.size())}, like.options().dtype(at::kLong));
  std::copy(rows.begin(), rows.end(), idx.data_ptr<int64_t>());
  return idx;
}

// Classifies the rows of x and y and recomputes the products and squared norms of the extreme
// ones from their scaled rows (ŝ = σ_i σ_j x_i·y_j, q̂ = σ² ‖x‖², in place in pr).
template <typename scalar_t>
std::pair<RowInfo<at::opmath_type<scalar_t>>, RowInfo<at::opmath_type<scalar_t>>> rescale_extreme_rows(
    const at::Tensor& x_in, const std::optional<at::Tensor>& y_in, Product& pr) {
  using acc_t = at::opmath_type<scalar_t>;
  const at::ScalarType acc = acc_type_of(x_in.scalar_type());
  const at::Tensor x = unit_inner(x_in);
  const at::Tensor y = y_in ? unit_inner(*y_in) : x;
  const bool has_y = y_in.has_value();
  pr.sx = pr.sx.contiguous();
  pr.sy = has_y ? pr.sy.contiguous() : pr.sx;
  RowInfo<acc_t> rx = classify_rows<scalar_t, acc_t>(x, pr.sx.const_data_ptr<acc_t>());
  RowInfo<acc_t> ry = has_y ? classify_rows<scalar_t, acc_t>(y, pr.sy.const_data_ptr<acc_t>()) : rx;
  if (rx.extreme.empty() && ry.extreme.empty()) return {rx, ry};
  // The other operand of each product, in the accumulation type (its own extreme rows are
  // overwritten below, so they may overflow here).
  const at::Tensor xa = x.scalar_type() == acc ? x : x.to(acc);
  const at::Tensor ya = !has_y ? xa : (y.scalar_type() == acc ? y : y.to(acc));
  const at::Tensor xu = scaled_rows<scalar_t, acc_t>(x, rx, acc);
  const at::Tensor yu = has_y ? scaled_rows<scalar_t, acc_t>(y, ry, acc) : xu;
  const at::Tensor ix = index_tensor(rx.extreme, pr.s), iy = index_tensor(ry.extreme, pr.s);
  const bool both = !rx.extreme.empty() && !ry.extreme.empty();
  const at::Tensor corner = both ? at::mm(xu, yu.t()) : at::Tensor();  // [Ux, Uy], both scaled
  if (!rx.extreme.empty()) {
    at::Tensor rows = at::mm(xu, ya.t());  // [Ux, M]
    if (both) rows.index_copy_(1, iy, corner);
    pr.s.index_copy_(0, ix, rows);
    if (!has_y) pr.s.index_copy_(1, ix, rows.t());  // the Gram matrix: the same numbers, mirrored
  }
  if (has_y && !ry.extreme.empty()) {
    at::Tensor cols = at::mm(xa, yu.t());  // [K, Uy]
    if (both) cols.index_copy_(0, ix, corner);
    pr.s.index_copy_(1, iy, cols);
  }
  // The squared norms of the scaled rows: the Gram diagonal (so that c[i, i] ≈ 1) or sums.
  acc_t* qx = pr.sx.data_ptr<acc_t>();
  const acc_t* sp = pr.s.const_data_ptr<acc_t>();
  const int64_t D = x.size(1), M = pr.s.size(1);
  for (size_t u = 0; u < rx.extreme.size(); ++u) {
    const int64_t r = rx.extreme[u];
    qx[r] = has_y ? sum_squares<acc_t, acc_t>(xu.const_data_ptr<acc_t>() + u * D, D) : sp[r * M + r];
  }
  if (has_y) {
    acc_t* qy = pr.sy.data_ptr<acc_t>();
    for (size_t u = 0; u < ry.extreme.size(); ++u) {
      qy[ry.extreme[u]] = sum_squares<acc_t, acc_t>(yu.const_data_ptr<acc_t>() + u * D, D);
    }
  }
  return {rx, ry};
}

// ---------------------------------------------------------------- epilogues

// out[i, j] = f(s[i, j], i, j) in place.  y None: f of the upper triangle, mirrored (exactly
// symmetric); the norms were read out of the diagonal before this runs.
template <typename acc_t, typename F>
void epilogue(at::Tensor& s, bool symmetric, const F& f) {
  const int64_t K = s.size(0), M = s.size(1);
  acc_t* p = s.data_ptr<acc_t>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(M, 1));
  at::parallel_for(0, K, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      acc_t* row = p + i * M;
      if (!symmetric) {
        for (int64_t j = 0; j < M; ++j) row[j] = f(row[j], i, j);
        continue;
      }
      // Row i owns s[i, j >= i] (read) and out[j > i, i] (written); nobody reads the lower
      // triangle, so the writes race with nothing.
      for (int64_t j = i; j < M; ++j) {
        const acc_t v = f(row[j], i, j);
        row[j] = v;
        p[j * M + i] = v;
      }
    }
  });
}

// Clamp to [-1, 1] that lets NaN through (std::min/std::max would turn it into -1 or 1).
template <typename acc_t>
acc_t clamp_unit(acc_t v) {
  return v < acc_t(-1) ? acc_t(-1) : (v > acc_t(1) ? acc_t(1) : v);
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

at::Tensor pairwise_cosine_cpu(const at::Tensor& x, const std::optional<at::Tensor>& y, double eps) {
  check_pair(x, y);
  TORCH_CHECK_VALUE(std::isfinite(eps), "eps must be finite, got ", eps);
  TORCH_CHECK_VALUE(eps > 0, "eps must be > 0, got ", eps);
  const at::ScalarType acc = acc_type_of(x.scalar_type());
  const int64_t K = x.size(0), M = y ? y->size(0) : K;
  if (K == 0 || M == 0) return at::empty({K, M}, x.options().dtype(acc));
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pairwise_cosine_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Product pr = product<scalar_t>(x, y);
    const auto rows = rescale_extreme_rows<scalar_t>(x, y, pr);
    const RowInfo<acc_t>& rx = rows.first;
    const RowInfo<acc_t>& ry = rows.second;
    const acc_t e = static_cast<acc_t>(eps);
    // f_i = 1 / max(‖x̂_i‖, eps·σ_i) = σ_i / max(‖x_i‖, eps), so that ŝ_ij f_i f_j is the cosine.
    auto factors = [&](const at::Tensor& sq, const RowInfo<acc_t>& info) {
      std::vector<acc_t> f(sq.numel());
      const acc_t* q = sq.const_data_ptr<acc_t>();
      for (int64_t i = 0; i < sq.numel(); ++i) f[i] = acc_t(1) / std::max(std::sqrt(q[i]), e * info.sigma[i]);
      return f;
    };
    const std::vector<acc_t> fx = factors(pr.sx, rx);
    const std::vector<acc_t> fy = y ? factors(pr.sy, ry) : fx;
    const bool any_non_finite = rx.any_non_finite || ry.any_non_finite;
    const acc_t nan = static_cast<acc_t>(kNaN);
    epilogue<acc_t>(pr.s, !y, [&](acc_t v, int64_t i, int64_t j) {
      if (any_non_finite && !(rx.finite[i] && ry.finite[j])) return nan;
      // A zero product stays 0 even where f_i f_j overflows (two zero rows, a tiny eps).
      return v == acc_t(0) ? v : clamp_unit(v * fx[i] * fy[j]);
    });
    out = pr.s;
  });
  return out;
}

at::Tensor pairwise_sqdist_cpu(const at::Tensor& x, const std::optional<at::Tensor>& y) {
  check_pair(x, y);
  const at::ScalarType acc = acc_type_of(x.scalar_type());
  const int64_t K = x.size(0), M = y ? y->size(0) : K;
  if (K == 0 || M == 0) return at::empty({K, M}, x.options().dtype(acc));
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "pairwise_sqdist_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Product pr = product<scalar_t>(x, y);
    const auto rows = rescale_extreme_rows<scalar_t>(x, y, pr);
    const RowInfo<acc_t>& rx = rows.first;
    const RowInfo<acc_t>& ry = rows.second;
    const acc_t* qx = pr.sx.const_data_ptr<acc_t>();
    const acc_t* qy = pr.sy.const_data_ptr<acc_t>();
    const bool sym = !y;
    const bool any_non_finite = rx.any_non_finite || ry.any_non_finite;
    const bool any_scaled = !rx.extreme.empty() || !ry.extreme.empty();
    const acc_t nan = static_cast<acc_t>(kNaN);
    // max(v, 0) that lets NaN through.
    auto at_least_zero = [](acc_t v) { return v < acc_t(0) ? acc_t(0) : v; };
    epilogue<acc_t>(pr.s, sym, [&](acc_t v, int64_t i, int64_t j) {
      if (any_non_finite && !(rx.finite[i] && ry.finite[j])) return nan;
      if (sym && i == j) return acc_t(0);
      if (!any_scaled) return at_least_zero(qx[i] + qy[j] - acc_t(2) * v);
      // With a_i = 1/σ_i, a = max(a_i, a_j), r = a_•/a <= 1 (powers of two: exact):
      // d = (r_i² q̂_i + r_j² q̂_j − 2 r_i r_j ŝ)·a·a, the bracket at most 4·D (reference.pairwise_sqdist).
      const acc_t ai = acc_t(1) / rx.sigma[i], aj = acc_t(1) / ry.sigma[j];
      const acc_t a = std::max(ai, aj), ri = ai / a, rj = aj / a;
      return at_least_zero(ri * ri * qx[i] + rj * rj * qy[j] - acc_t(2) * (ri * rj) * v) * a * a;
    });
    out = pr.s;
  });
  return out;
}

// ---------------------------------------------------------------- similarity_weights

template <typename scalar_t>
void weights_kernel(const at::Tensor& sim, const int64_t* own, double tau, double scale, int64_t min_keep,
                    at::Tensor& out, std::atomic<bool>& not_finite) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = sim.size(0), M = sim.size(1), sr = sim.stride(0), sc = sim.stride(1);
  const scalar_t* sp = sim.const_data_ptr<scalar_t>();
  acc_t* op = out.data_ptr<acc_t>();
  // The reference compares and scales in the accumulation type (tau and scale rounded to it).
  const acc_t t = static_cast<acc_t>(tau), a = static_cast<acc_t>(scale);
  const int64_t keep_at_least = std::min(min_keep, M);
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(M, 1));
  at::parallel_for(0, K, grain, [&](int64_t i0, int64_t i1) {
    std::vector<uint8_t> kept;
    std::vector<int64_t> idx;  // the kept columns (ascending, then the top-up)
    std::vector<std::pair<acc_t, int64_t>> rest;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t self = own ? own[i] : i;
      const scalar_t* srow = sp + i * sr;
      auto value = [&](int64_t j) { return j == self ? acc_t(1) : static_cast<acc_t>(srow[j * sc]); };
      // One pass over the row: the columns >= tau, and whether all are finite (x - x is 0
      // exactly for finite x, NaN otherwise; branch-free, unlike a test per element).
      idx.clear();
      bool finite = true;
      for (int64_t j = 0; j < M; ++j) {
        const acc_t x = static_cast<acc_t>(srow[j * sc]);
        finite &= (x - x) == acc_t(0);
        if (x >= t) idx.push_back(j);
      }
      if (!finite) not_finite.store(true, std::memory_order_relaxed);
      if (self >= 0) {  // the own column is kept whatever sim holds there
        auto at_self = std::lower_bound(idx.begin(), idx.end(), self);
        if (at_self == idx.end() || *at_self != self) idx.insert(at_self, self);
      }
      const int64_t n_kept = static_cast<int64_t>(idx.size());
      if (n_kept < keep_at_least) {
        // The most similar of the others: value descending, then column ascending (a strict
        // total order, so the set chosen is unique and does not depend on the algorithm).
        kept.assign(M, 0);
        for (const int64_t j : idx) kept[j] = 1;
        rest.clear();
        for (int64_t j = 0; j < M; ++j) {
          if (!kept[j]) rest.emplace_back(value(j), j);
        }
        const int64_t need = keep_at_least - n_kept;
        auto before = [](const std::pair<acc_t, int64_t>& p, const std::pair<acc_t, int64_t>& q) {
          return p.first > q.first || (p.first == q.first && p.second < q.second);
        };
        if (need < static_cast<int64_t>(rest.size())) {
          std::nth_element(rest.begin(), rest.begin() + need, rest.end(), before);
        }
        for (int64_t r = 0; r < need; ++r) idx.push_back(rest[r].second);
      }
      // Softmax over the kept entries only (exp is the costly part: a handful per row).
      acc_t* row = op + i * M;
      std::fill(row, row + M, acc_t(0));
      if (idx.empty()) continue;  // no own column and nothing kept: a zero row
      acc_t mx = -std::numeric_limits<acc_t>::infinity();
      for (const int64_t j : idx) mx = std::max(mx, a * value(j));
      acc_t sum = 0;
      for (const int64_t j : idx) {
        row[j] = std::exp(a * value(j) - mx);
        sum += row[j];
      }
      const acc_t inv = acc_t(1) / sum;
      for (const int64_t j : idx) row[j] *= inv;
    }
  });
}

at::Tensor similarity_weights_cpu(const at::Tensor& sim, double tau, double scale, int64_t min_keep,
                                  const std::optional<at::Tensor>& self_index) {
  TORCH_CHECK_VALUE(sim.dim() == 2, "sim must be [K, M], got ", shape_str(sim.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(sim.scalar_type()), "sim must be a floating tensor, got ",
                   dtype_str(sim.scalar_type()));
  const int64_t K = sim.size(0), M = sim.size(1);
  TORCH_CHECK_VALUE(tau >= -1.0 && tau <= 1.0, "tau must be in [-1, 1], got ", tau);
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite, got ", scale);
  // The kernel scales in the accumulation type, where a larger |scale| rounds to Inf (NaN weights).
  const bool in_double = sim.scalar_type() == at::kDouble;
  const double largest = in_double ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  TORCH_CHECK_VALUE(std::abs(scale) <= largest, "scale must be within ", in_double ? "float64" : "float32",
                    "'s range (|scale| <= ", largest, "), the accumulation dtype of ",
                    dtype_str(sim.scalar_type()), " sim, got ", scale);
  TORCH_CHECK_VALUE(min_keep >= 0, "min_keep must be >= 0, got ", min_keep);
  at::Tensor own;
  if (!self_index) {
    TORCH_CHECK_VALUE(K == M, "sim is ", shape_str(sim.sizes()),
                      ", not square: pass self_index (each row's own column, -1 for none)");
  } else {
    TORCH_CHECK_VALUE(self_index->dim() == 1 && self_index->size(0) == K, "self_index must be [K] with K = ", K,
                      ", got ", shape_str(self_index->sizes()));
    TORCH_CHECK_TYPE(self_index->scalar_type() == at::kLong || self_index->scalar_type() == at::kInt,
                     "self_index must be an int64 or int32 tensor, got ", dtype_str(self_index->scalar_type()));
    TORCH_CHECK_VALUE(self_index->device() == sim.device(), "self_index must be on sim's device ", sim.device(),
                      ", got ", self_index->device());
    own = self_index->to(at::kLong).contiguous();
    const int64_t* o = own.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < K; ++i) {
      TORCH_CHECK_VALUE(o[i] >= -1 && o[i] < M, "self_index values must be in [-1, ", M,
                        ") (a column of sim, or -1 for none), got ", o[i], " in row ", i);
    }
  }
  at::Tensor out = at::empty({K, M}, sim.options().dtype(acc_type_of(sim.scalar_type())));
  if (out.numel() == 0) return out;
  std::atomic<bool> not_finite{false};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sim.scalar_type(), "similarity_weights_cpu", [&] {
    weights_kernel<scalar_t>(sim, own.defined() ? own.const_data_ptr<int64_t>() : nullptr, tau, scale, min_keep,
                             out, not_finite);
  });
  // ValueError in Python, as the wrapper's own check (which it leaves to this kernel).
  TORCH_CHECK_VALUE(!not_finite.load(), "sim must be finite (it holds NaN or Inf)");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("pairwise_cosine", &pairwise_cosine_cpu);
  m.impl("pairwise_sqdist", &pairwise_sqdist_cpu);
  m.impl("similarity_weights", &similarity_weights_cpu);
}

}  // namespace pfl::cpu_similarity
