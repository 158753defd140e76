// CPU kernels of the factorized-weight ops (schemas in pfl_kernels/ops/factorized.py).
//
// M = u @ v + mu * mask is an (R, C) matrix per client k; W, viewed as [K?, A, R, B], holds
// W[k, a, r, b] = M[k, r, a*B + b] (see pfl_kernels/_layout.py).
//
// Forward, in one pass: the work splits into tasks (client k, column tile, row tile) that
// own disjoint tiles of M.  A task builds its tile row by row from u, v, mu and mask (unit
// stride in c, so the loops vectorize) and stores it to W: as a blocked 4 x 4 transpose for
// B == 1 (spatial, linear: W is Mᵀ in memory), as runs of B for simfed, or directly into W's
// rows for view (W is M).  So every input and output moves through whole cache lines.
//
// Backward, the same walk in reverse: load a tile of grad_W in (R, C) order, write grad_mu /
// grad_mask rows, and accumulate grad_u (a sum over columns) and grad_v (over rows).  Tasks
// write per-tile partial sums of those, which a second, small pass adds up in a fixed order:
// no two tasks write one element, and results do not depend on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/TensorUtils.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "check_helpers.h"
#include "loop_helpers.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#include <immintrin.h>  // AVX2 intrinsics, used only inside the target("avx2") region below
#endif

namespace pfl::cpu_factorized {  // one namespace per file: setup.py's unity build compiles files together
namespace {

// ---------------------------------------------------------------- geometry and checks

// (R, C, A, B) of a layout: mirrors pfl_kernels._layout.layout_geometry.
struct Geometry {
  int64_t R, C, A, B;
};

Geometry layout_geometry(at::IntArrayRef shape, c10::string_view layout) {
  const bool linear = layout == "linear";
  TORCH_CHECK_VALUE(linear || layout == "spatial" || layout == "view" || layout == "simfed",
                    "layout must be one of ('spatial', 'simfed', 'view', 'linear'), got '", layout, "'");
  const size_t want = linear ? 2 : 4;
  TORCH_CHECK_VALUE(shape.size() == want, "shape must be ",
                    linear ? "[out_features, in_features]" : "[O, I, kh, kw]", " (", want,
                    " sizes) for layout '", layout, "', got ", shape);
  for (int64_t s : shape) {
    TORCH_CHECK_VALUE(s >= 1, "shape must have sizes >= 1, got ", shape);
  }
  if (linear) {
    return {shape[1], shape[0], shape[0], 1};
  }
  const int64_t o = shape[0], i = shape[1], kh = shape[2], kw = shape[3];
  if (layout == "spatial") {
    return {kh * kw, o * i, o * i, 1};
  }
  if (layout == "view") {
    return {kh * kw, o * i, 1, o * i};
  }
  return {i * kh, o * kw, o, kw};  // simfed
}

// Checks of the op contract (the same as the fake kernels'); returns the geometry.
Geometry check_args(const at::Tensor& u, const at::Tensor& v, const std::optional<at::Tensor>& mu,
                    const std::optional<at::Tensor>& mask, at::IntArrayRef shape, c10::string_view layout) {
  const Geometry g = layout_geometry(shape, layout);
  TORCH_CHECK_VALUE(u.dim() == 2 || u.dim() == 3, "u must be [R, r] or [K, R, r], got ", u.sizes());
  TORCH_CHECK_VALUE(v.dim() == u.dim(), "v must have u's ", u.dim(), " dims, got ", v.sizes());
  TORCH_CHECK_VALUE(u.size(-2) == g.R, "u must have R=", g.R, " rows for shape ", shape, " and layout '", layout,
                    "', got ", u.sizes());
  TORCH_CHECK_VALUE(v.size(-1) == g.C, "v must have C=", g.C, " columns for shape ", shape, " and layout '", layout,
                    "', got ", v.sizes());
  TORCH_CHECK_VALUE(v.size(-2) == u.size(-1), "v must have rank ", u.size(-1), " rows (u's last dim), got ", v.sizes());
  TORCH_CHECK_TYPE(v.scalar_type() == u.scalar_type(), "v must have u's dtype ", u.scalar_type(), ", got ",
                   v.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(u.scalar_type()), "u must be a floating tensor, got ", u.scalar_type());
  if (u.dim() == 3) {
    TORCH_CHECK_VALUE(v.size(0) == u.size(0), "v must have u's ", u.size(0), " clients");
  }
  std::vector<int64_t> want(u.sizes().begin(), u.sizes().end() - 2);
  want.push_back(g.R);
  want.push_back(g.C);
  using Named = std::pair<const char*, const std::optional<at::Tensor>&>;
  for (const auto& [name, t] : {Named{"mu", mu}, Named{"mask", mask}}) {
    if (t.has_value()) {
      TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(want), name, " must have shape ", want, ", got ", t->sizes());
      TORCH_CHECK_TYPE(t->scalar_type() == u.scalar_type(), name, " must have u's dtype ", u.scalar_type(), ", got ",
                       t->scalar_type());
      TORCH_CHECK_VALUE(t->device() == u.device(), name, " must be on u's device ", u.device(), ", got ", t->device());
    }
  }
  TORCH_CHECK_VALUE(!mask.has_value() || mu.has_value(), "mask given without mu");
  TORCH_CHECK_VALUE(v.device() == u.device(), "v must be on u's device ", u.device(), ", got ", v.device());
  return g;
}

// A [K?, X, Y] operand read (or written) with its real strides; a 2-D one has K stride 0.
template <typename T>
struct Strided {
  T* data = nullptr;
  int64_t sk = 0, sx = 0, sy = 0;
  T* row(int64_t k, int64_t x, int64_t y0) const { return data + k * sk + x * sx + y0 * sy; }
};

template <typename T>
Strided<T> strided(const at::Tensor& t) {
  const int64_t d = t.dim();
  return {static_cast<T*>(t.data_ptr()), d == 3 ? t.stride(0) : 0, t.stride(d - 2), t.stride(d - 1)};
}

template <typename T>
Strided<T> strided(const std::optional<at::Tensor>& t) {
  return t.has_value() ? strided<T>(*t) : Strided<T>{};
}

// Tile of M: up to 32 rows, and as many columns as fit 32 KiB of the accumulation type.  Few
// rows and many columns give long unit-stride streams through mu, mask and v (the prefetcher
// follows them), while W still gets runs of rows or whole blocks a.  Where W's runs are short
// (B <= cols), tiles hold whole runs.
struct Tiling {
  int64_t rows, cols, n_row_tiles, n_col_tiles;
};

template <typename acc_t>
Tiling make_tiling(const Geometry& g) {
  constexpr int64_t kTileElems = 32768 / sizeof(acc_t);
  const int64_t rows = std::min<int64_t>(g.R, 32);
  int64_t cols = std::min<int64_t>(g.C, std::max<int64_t>(16, kTileElems / rows / 16 * 16));
  if (g.B <= cols) cols = cols / g.B * g.B;
  return {rows, cols, (g.R + rows - 1) / rows, (g.C + cols - 1) / cols};
}

// Below this many elements of M per thread, threading costs more than it saves.
constexpr int64_t kMinElemsPerThread = 65536;

int64_t task_grain(const Tiling& t) {
  return std::max<int64_t>(1, kMinElemsPerThread / (t.rows * t.cols));
}

// Whether every column stride in `strides` is 1 (or there is at most one column).
inline bool unit_columns(std::initializer_list<int64_t> strides, int64_t cols) {
  return cols <= 1 || std::all_of(strides.begin(), strides.end(), [](int64_t s) { return s == 1; });
}

// ---------------------------------------------------------------- moving tiles

using cpu::cast_to;
using cpu::with_unit_stride;

// The kernels are compiled twice from factorized_kernels.h:
// once for the baseline ISA (namespace base) and once for AVX2 (namespace avx2, chosen at
// run time where the CPU has it).  The build is portable (no -march), so without this the hot
// loops would be 4-wide SSE2.  No FMA: both builds do the same operations in the same order
// (explicit lanes in rank_term), so results are bitwise equal whichever one runs.
namespace base {
#include "factorized_kernels.h"
}  // namespace base

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define PFL_FACTORIZED_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
#define PFL_FACTORIZED_IN_AVX2 1  // the AVX2-only parts of factorized_kernels.h
namespace avx2 {
#include "factorized_kernels.h"
}  // namespace avx2
#undef PFL_FACTORIZED_IN_AVX2
#pragma GCC pop_options
#endif

bool use_avx2() {
#if defined(PFL_FACTORIZED_AVX2)
  return cpu::cpu_has_avx2();
#else
  return false;
#endif
}

template <typename scalar_t, typename... Args>
void forward_kernel(const Args&... args) {
#if defined(PFL_FACTORIZED_AVX2)
  if (use_avx2()) return avx2::forward_kernel<scalar_t>(args...);
#endif
  base::forward_kernel<scalar_t>(args...);
}

template <typename scalar_t, typename... Args>
void backward_kernel(const Args&... args) {
#if defined(PFL_FACTORIZED_AVX2)
  if (use_avx2()) return avx2::backward_kernel<scalar_t>(args...);
#endif
  base::backward_kernel<scalar_t>(args...);
}

// float16 runs the float kernel on float copies: c10::Half conversions are scalar bit tricks
// in a portable build (no F16C), far slower than ATen's vectorized casts and a float pass.
std::optional<at::Tensor> to_float(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->to(at::kFloat)) : std::nullopt;
}

at::Tensor factorized_weight_cpu(const at::Tensor& u, const at::Tensor& v, const std::optional<at::Tensor>& mu,
                                 const std::optional<at::Tensor>& mask, at::IntArrayRef shape,
                                 c10::string_view layout) {
  const Geometry g = check_args(u, v, mu, mask, shape, layout);
  if (u.scalar_type() == at::kHalf) {
    return factorized_weight_cpu(u.to(at::kFloat), v.to(at::kFloat), to_float(mu), to_float(mask), shape, layout)
        .to(at::kHalf);
  }
  std::vector<int64_t> out_shape(u.sizes().begin(), u.sizes().end() - 2);
  out_shape.insert(out_shape.end(), shape.begin(), shape.end());
  at::Tensor w = at::empty(out_shape, u.options());
  const int64_t K = u.dim() == 3 ? u.size(0) : 1;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, u.scalar_type(), "factorized_weight_cpu",
                                 [&] { forward_kernel<scalar_t>(w, u, v, mu, mask, g, K); });
  return w;
}


std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> factorized_weight_backward_cpu(
    const at::Tensor& grad_w, const at::Tensor& u, const at::Tensor& v, const std::optional<at::Tensor>& mu,
    const std::optional<at::Tensor>& mask, at::IntArrayRef shape, c10::string_view layout,
    std::array<bool, 4> output_mask) {
  const Geometry g = check_args(u, v, mu, mask, shape, layout);
  std::vector<int64_t> w_shape(u.sizes().begin(), u.sizes().end() - 2);
  w_shape.insert(w_shape.end(), shape.begin(), shape.end());
  TORCH_CHECK_VALUE(grad_w.sizes() == at::IntArrayRef(w_shape), "grad_w must have shape ", w_shape, ", got ",
                    grad_w.sizes());
  TORCH_CHECK_TYPE(grad_w.scalar_type() == u.scalar_type(), "grad_w must have u's dtype ", u.scalar_type(), ", got ",
                   grad_w.scalar_type());
  if (u.scalar_type() == at::kHalf) {
    auto [gu, gv, gmu, gmask] = factorized_weight_backward_cpu(
        grad_w.to(at::kFloat), u.to(at::kFloat), v.to(at::kFloat), to_float(mu), to_float(mask), shape, layout,
        output_mask);
    return {gu.to(at::kHalf), gv.to(at::kHalf), gmu.to(at::kHalf), gmask.to(at::kHalf)};
  }
  // Undefined = not requested; replaced by an empty tensor on return.
  at::Tensor gu, gv, gmu, gmask;
  if (output_mask[0]) gu = at::empty(u.sizes(), u.options());
  if (output_mask[1]) gv = at::empty(v.sizes(), v.options());
  if (output_mask[2] && mu.has_value()) gmu = at::empty(mu->sizes(), u.options());
  if (output_mask[3] && mask.has_value()) gmask = at::empty(mask->sizes(), u.options());
  const int64_t K = u.dim() == 3 ? u.size(0) : 1;
  if ((gu.defined() || gv.defined() || gmu.defined() || gmask.defined()) && K > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, u.scalar_type(), "factorized_weight_backward_cpu", [&] {
      backward_kernel<scalar_t>(grad_w, u, v, mu, mask, g, K, gu, gv, gmu, gmask);
    });
  }
  // A fresh empty tensor each: outputs that share storage would break the schema's no-alias promise.
  auto or_empty = [&](const at::Tensor& t) { return t.defined() ? t : at::empty({0}, u.options()); };
  return {or_empty(gu), or_empty(gv), or_empty(gmu), or_empty(gmask)};
}

// ---------------------------------------------------------------- soft threshold

// mu <- sign(mu) * max(|mu| - t, 0), written as copysign(mu - clamp(mu, -t, t), mu + 0)
// (shrink in factorized_kernels.h): one branch-free expression that vectorizes and, like the
// reference, keeps NaN (std::max/min return their NaN first argument).  The copysign gives a
// zero the formula's sign, bit for bit: -0.0 where mu < 0 (mu - mu alone is +0.0), +0.0 for
// mu = -0.0 (sign(-0.0) is 0, and -0.0 + 0 is +0.0; the compiler keeps that add, as it must
// without -ffast-math).  Contiguous runs take the AVX2 build where the CPU has it (the same
// operations: the same bits).
void soft_threshold_cpu(at::Tensor& mu, double threshold) {
  TORCH_CHECK_TYPE(at::isFloatingType(mu.scalar_type()), "mu must be a floating tensor, got ", mu.scalar_type());
  TORCH_CHECK_VALUE(std::isfinite(threshold) && threshold >= 0, "threshold must be a finite number >= 0, got ",
                    threshold);
  // Elements that share memory would be shrunk twice.
  TORCH_CHECK_VALUE(!cpu::has_internal_overlap(mu), "mu must not have elements that share memory, got strides ",
                    cpu::shape_str(mu.strides()));
  if (mu.numel() == 0) return;
  // TensorIterator handles any strides.
  at::TensorIterator iter = at::TensorIteratorConfig()
                                   .add_output(mu)
                                   .resize_outputs(false)
                                   .check_all_same_dtype(false)
                                   .build();
  const bool wide = use_avx2();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mu.scalar_type(), "soft_threshold_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    // Rounded to mu's dtype first, as torch does with a Python scalar (mu.abs() - threshold).
    // A threshold beyond the dtype acts as its largest finite value: +-inf stays +-inf (an
    // inf threshold would make it inf - inf = NaN), and the cast stays in range (a double
    // beyond the float range cast to float is undefined behaviour).
    const double largest = static_cast<double>(std::numeric_limits<scalar_t>::max());
    const acc_t t = static_cast<acc_t>(static_cast<scalar_t>(std::min(threshold, largest)));
    iter.for_each([&](char** data, const int64_t* strides, int64_t n, int64_t outer) {
      // A copy local to the call: stores through p cannot alias it, so it stays in a register
      // (through the captured reference it was reloaded for every element).
      const acc_t thr = t;
      for (int64_t o = 0; o < outer; ++o) {
        char* row = data[0] + o * strides[1];
        if (strides[0] == sizeof(scalar_t)) {
          scalar_t* p = reinterpret_cast<scalar_t*>(row);
#if defined(PFL_FACTORIZED_AVX2)
          if (wide) {
            avx2::shrink_run(p, n, thr);
            continue;
          }
#endif
          base::shrink_run(p, n, thr);
        } else {
          for (int64_t i = 0; i < n; ++i) {
            scalar_t* p = reinterpret_cast<scalar_t*>(row + i * strides[0]);
            *p = base::shrink(*p, thr);
          }
        }
      }
    });
  });
}

}  // namespace

// The schemas are defined in Python (pfl_kernels/ops/factorized.py); the dispatcher accepts
// kernels registered before their schema and checks them against it once it is defined.
TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("factorized_weight", &factorized_weight_cpu);
  m.impl("factorized_weight_backward", &factorized_weight_backward_cpu);
  m.impl("soft_threshold_", &soft_threshold_cpu);
}

}  // namespace pfl::cpu_factorized
