// CPU kernels of pfl::relu_max_pool2d and pfl::relu_max_pool2d_backward (schemas in
// pfl_kernels/ops/pool.py):
//
//   out[n, c, i, j]     = relu(max of x[n, c] over the window rows 2i..2i+1, columns 2j..2j+1)
//   offsets[n, c, i, j] = the window position (0..3, row-major) of that max, or 4 where the
//                         ReLU stops the gradient (the max is <= 0)
//   grad_x              = grad_out at each window's offset, 0 elsewhere
//
// The max is F.max_pool2d's: the first of equal values, the last NaN.  relu(max) equals
// max(relu) exactly (ReLU is monotone), with the same gradient, so the op stands in for
// ReLU then MaxPool2d(2) and for MaxPool2d(2) then ReLU.
//
// Both kernels walk memory as rows of [P, H, W, C]: a channels-last tensor is P = N images of
// C interleaved channels, any other one is made NCHW-contiguous and walked as P = N * C planes
// of C = 1.  The outputs take the input's layout.  Per pair of input rows, output j of the row
// (j = ow * C + c) reads the input row at base(j) = 2 * ow * C + c and base(j) + C.  F.max_pool2d
// keeps channels-last with few channels scalar (LeNet's 6: 0.65 ms for a batch of 64 28x28
// maps on one thread); the AVX2 loop here gathers 8 outputs' windows at a time.
#include "check_helpers.h"
#include "loop_helpers.h"
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define PFL_POOL_AVX2 1
#endif

namespace pfl::cpu_pool {  // one namespace per file: setup.py's unity build compiles files together
namespace {

using cpu::shape_str;

// The offset where no gradient flows (the ReLU is closed).
constexpr uint8_t kClosed = 4;

struct Geometry {
  int64_t P, H, W, C;  // rows of [P, H, W, C]
  int64_t OH() const { return H / 2; }
  int64_t OW() const { return W / 2; }
  int64_t row() const { return OW() * C; }  // outputs per output row
};

// The layout a tensor is walked in, which its outputs take: channels-last for a channels-last
// tensor; NCHW otherwise, also for one both layouts describe (C = 1, or 1x1 maps).
at::MemoryFormat walk_format(const at::Tensor& t) {
  const bool last = t.is_contiguous(at::MemoryFormat::ChannelsLast) && !t.is_contiguous();
  return last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
}

// The rows of t [N, C, ., .] (laid out in `format`) for input maps of H x W.
Geometry geometry_of(const at::Tensor& t, int64_t H, int64_t W, at::MemoryFormat format) {
  return format == at::MemoryFormat::ChannelsLast ? Geometry{t.size(0), H, W, t.size(1)}
                                                  : Geometry{t.size(0) * t.size(1), H, W, 1};
}

// The checks of _check_forward in ops/pool.py (the same wording).
void check_input(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 4, "input must be [N, C, H, W], got ", shape_str(x.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "input must be a floating tensor, got ", x.scalar_type());
}

// take ? a : b on the bits, so the compiler emits no branch (a branch on random signs
// mispredicts half the time) and NaNs pass through untouched.
template <typename scalar_t>
inline scalar_t pick(bool take, scalar_t a, scalar_t b) {
  using bits_t = std::conditional_t<sizeof(scalar_t) == 8, uint64_t,
                                    std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint16_t>>;
  bits_t x, y;
  std::memcpy(&x, &a, sizeof(x));
  std::memcpy(&y, &b, sizeof(y));
  const bits_t mask = static_cast<bits_t>(-static_cast<bits_t>(take));
  x = (x & mask) | (y & static_cast<bits_t>(~mask));
  std::memcpy(&a, &x, sizeof(x));
  return a;
}

// One window, in F.max_pool2d's order: a later value replaces the max when greater, or NaN.
template <typename scalar_t>
inline void window_max(const scalar_t* r0, const scalar_t* r1, int64_t C, scalar_t& out, uint8_t& offset) {
  const scalar_t v[4] = {r0[0], r0[C], r1[0], r1[C]};
  scalar_t m = v[0];
  uint8_t k = 0;
  for (uint8_t i = 1; i < 4; ++i) {
    const bool take = (v[i] > m) | (v[i] != v[i]);
    m = pick(take, v[i], m);
    k = take ? i : k;
  }
  const bool open = (m > scalar_t(0)) | (m != m);
  out = pick(open, m, scalar_t(0));
  offset = open ? k : kClosed;
}

// f(j, base(j)) for the outputs j in [j0, j1) of a row, base(j) = 2 * ow * C + c kept without a
// division per output.
template <typename F>
inline void for_each_output(int64_t C, int64_t j0, int64_t j1, const F& f) {
  int64_t c = j0 % C, base = j0 + (j0 / C) * C;
  for (int64_t j = j0; j < j1; ++j) {
    f(j, base);
    if (++c == C) {  // the next window's first channel
      c = 0;
      base += C + 1;
    } else {
      ++base;
    }
  }
}

// Outputs [j0, j1) of one output row, one at a time (output j = ow * C + c).
template <typename scalar_t>
void forward_row_scalar(const scalar_t* r0, const scalar_t* r1, int64_t C, int64_t j0, int64_t j1, scalar_t* out,
                        uint8_t* offsets) {
  for_each_output(C, j0, j1, [&](int64_t j, int64_t base) { window_max(r0 + base, r1 + base, C, out[j], offsets[j]); });
}

#ifdef PFL_POOL_AVX2
// The same row, 8 outputs at a time: the four window values by gathers at base(j), the
// comparisons as masks (greater-ordered, or unordered with itself), the same selection order.
// Returns the first output left to the scalar loop.
__attribute__((target("avx2"))) int64_t forward_row_avx2(const float* r0, const float* r1, int64_t C, int64_t L,
                                                       const int32_t* base, float* out, uint8_t* offsets) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256i closed = _mm256_set1_epi32(kClosed);
  const float* src[4] = {r0, r0 + C, r1, r1 + C};
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256i idx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + j));
    __m256 m = _mm256_i32gather_ps(src[0], idx, 4);
    __m256i k = _mm256_setzero_si256();
    for (int i = 1; i < 4; ++i) {
      const __m256 v = _mm256_i32gather_ps(src[i], idx, 4);
      const __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, m, _CMP_GT_OQ), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m = _mm256_blendv_ps(m, v, take);
      k = _mm256_blendv_epi8(k, _mm256_set1_epi32(i), _mm256_castps_si256(take));
    }
    const __m256 open = _mm256_or_ps(_mm256_cmp_ps(m, zero, _CMP_GT_OQ), _mm256_cmp_ps(m, m, _CMP_UNORD_Q));
    _mm256_storeu_ps(out + j, _mm256_and_ps(m, open));
    alignas(32) int32_t kk[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(kk), _mm256_blendv_epi8(closed, k, _mm256_castps_si256(open)));
    for (int i = 0; i < 8; ++i) offsets[j + i] = static_cast<uint8_t>(kk[i]);
  }
  return j;
}
#endif

// For the AVX2 loops: base(j) = 2 * ow * C + c for the outputs j = ow * C + c of a row, where
// each window starts; empty where they do not run (other dtypes, rows under 8 outputs, no AVX2).
template <typename scalar_t>
std::vector<int32_t> avx2_window_bases(const Geometry& g) {
  std::vector<int32_t> base;
  const int64_t L = g.row();
  if (std::is_same<scalar_t, float>::value && L >= 8 && cpu::cpu_has_avx2() && 2 * g.W * g.C < (int64_t{1} << 31)) {
    base.resize(L);
    for (int64_t j = 0; j < L; ++j) base[j] = static_cast<int32_t>(j + (j / g.C) * g.C);
  }
  return base;
}

// Output rows per task: about 16k outputs, so small maps run on one thread.
int64_t grain_rows(int64_t outputs_per_row) { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(outputs_per_row, 1)); }

template <typename scalar_t>
void forward_kernel(const scalar_t* x, scalar_t* out, uint8_t* offsets, const Geometry& g) {
  const int64_t OH = g.OH(), L = g.row(), rows = g.P * OH;
  if (rows == 0 || L == 0) return;
#ifdef PFL_POOL_AVX2
  const std::vector<int32_t> base = avx2_window_bases<scalar_t>(g);
#endif
  at::parallel_for(0, rows, grain_rows(L), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = r / OH, oh = r % OH;
      const scalar_t* r0 = x + ((p * g.H + 2 * oh) * g.W) * g.C;
      const scalar_t* r1 = r0 + g.W * g.C;
      int64_t j = 0;
#ifdef PFL_POOL_AVX2
      if (!base.empty()) {
        j = forward_row_avx2(reinterpret_cast<const float*>(r0), reinterpret_cast<const float*>(r1), g.C, L,
                             base.data(), reinterpret_cast<float*>(out + r * L), offsets + r * L);
      }
#endif
      forward_row_scalar(r0, r1, g.C, j, L, out + r * L, offsets + r * L);
    }
  });
}

// Outputs [j0, j1) of one output row, scattered into one input row: the left and right
// columns of each window get the output's gradient where its offset points at them
// (`top`: this row's left window position, 0 or 2), 0 elsewhere.
template <typename scalar_t>
void backward_row_scalar(const scalar_t* grad, const uint8_t* offsets, uint8_t top, int64_t C, int64_t j0,
                         int64_t j1, scalar_t* row) {
  for_each_output(C, j0, j1, [&](int64_t j, int64_t base) {
    row[base] = pick(offsets[j] == top, grad[j], scalar_t(0));
    row[base + C] = pick(offsets[j] == top + 1, grad[j], scalar_t(0));
  });
}

#ifdef PFL_POOL_AVX2
// The same, 8 outputs at a time: masks from the offsets, the two columns' values stored
// through a small buffer (AVX2 has no scatter).  Returns the first output left to the scalar loop.
__attribute__((target("avx2"))) int64_t backward_row_avx2(const float* grad, const uint8_t* offsets, uint8_t top,
                                                        int64_t L, const int32_t* base, int64_t C, float* row) {
  const __m256i left = _mm256_set1_epi32(top), right = _mm256_set1_epi32(top + 1);
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 g = _mm256_loadu_ps(grad + j);
    const __m256i k = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(offsets + j)));
    alignas(32) float l[8], r[8];
    _mm256_store_ps(l, _mm256_and_ps(g, _mm256_castsi256_ps(_mm256_cmpeq_epi32(k, left))));
    _mm256_store_ps(r, _mm256_and_ps(g, _mm256_castsi256_ps(_mm256_cmpeq_epi32(k, right))));
    const int32_t* b = base + j;
    for (int i = 0; i < 8; ++i) {
      row[b[i]] = l[i];
      row[b[i] + C] = r[i];
    }
  }
  return j;
}
#endif

// grad_x row by row: each input row of a window gets its outputs' gradients where the offset
// points at it, 0 elsewhere (and 0 in the rows and columns no window covers).
template <typename scalar_t>
void backward_kernel(const scalar_t* grad, const uint8_t* offsets, scalar_t* grad_x, const Geometry& g) {
  const int64_t OH = g.OH(), OW = g.OW(), C = g.C, L = g.row(), width = g.W * C, rows = g.P * g.H;
  if (rows == 0 || width == 0) return;
#ifdef PFL_POOL_AVX2
  const std::vector<int32_t> base = avx2_window_bases<scalar_t>(g);
#endif
  at::parallel_for(0, rows, grain_rows(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = r / g.H, h = r % g.H;
      scalar_t* row = grad_x + r * width;
      const int64_t oh = h / 2;
      if (oh >= OH) {
        std::fill(row, row + width, scalar_t(0));
        continue;
      }
      const uint8_t top = static_cast<uint8_t>((h % 2) * 2);
      const scalar_t* gr = grad + (p * OH + oh) * L;
      const uint8_t* fr = offsets + (p * OH + oh) * L;
      int64_t j = 0;
#ifdef PFL_POOL_AVX2
      if (!base.empty()) j = backward_row_avx2(reinterpret_cast<const float*>(gr), fr, top, L, base.data(), C,
                                      reinterpret_cast<float*>(row));
#endif
      backward_row_scalar(gr, fr, top, C, j, L, row);
      std::fill(row + 2 * OW * C, row + width, scalar_t(0));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> relu_max_pool2d_cpu(const at::Tensor& input) {
  check_input(input);
  const auto format = walk_format(input);
  const at::Tensor x = input.contiguous(format);
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  at::Tensor out = at::empty({N, C, H / 2, W / 2}, x.options().memory_format(format));
  at::Tensor offsets = at::empty({N, C, H / 2, W / 2}, x.options().dtype(at::kByte).memory_format(format));
  const Geometry g = geometry_of(x, H, W, format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "relu_max_pool2d", [&] {
    forward_kernel(x.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), offsets.data_ptr<uint8_t>(), g);
  });
  return {out, offsets};
}

// The checks of _check_backward in ops/pool.py (the same wording).
void check_backward(const at::Tensor& grad, const at::Tensor& offsets, c10::IntArrayRef size) {
  TORCH_CHECK_VALUE(size.size() == 2, "input_size must be [H, W], got ", shape_str(size));
  TORCH_CHECK_VALUE(offsets.dim() == 4 && size[0] >= 0 && size[1] >= 0 && offsets.size(2) == size[0] / 2 &&
                        offsets.size(3) == size[1] / 2,
                    "offsets must be [N, C, H // 2, W // 2] for input_size ", shape_str(size), ", got ",
                    shape_str(offsets.sizes()));
  TORCH_CHECK_VALUE(grad.sizes() == offsets.sizes(), "grad must have the shape of offsets ",
                    shape_str(offsets.sizes()), ", got ", shape_str(grad.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(grad.scalar_type()), "grad must be a floating tensor, got ", grad.scalar_type());
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kByte, "offsets must be uint8, got ", offsets.scalar_type());
}

at::Tensor relu_max_pool2d_backward_cpu(const at::Tensor& grad, const at::Tensor& offsets, c10::IntArrayRef size) {
  check_backward(grad, offsets, size);
  const auto format = walk_format(offsets);
  const at::Tensor g = grad.contiguous(format), f = offsets.contiguous(format);
  const int64_t N = f.size(0), C = f.size(1), H = size[0], W = size[1];
  at::Tensor grad_x = at::empty({N, C, H, W}, g.options().memory_format(format));
  const Geometry geo = geometry_of(f, H, W, format);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "relu_max_pool2d_backward", [&] {
    backward_kernel(g.const_data_ptr<scalar_t>(), f.const_data_ptr<uint8_t>(), grad_x.data_ptr<scalar_t>(), geo);
  });
  return grad_x;
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("relu_max_pool2d", &relu_max_pool2d_cpu);
  m.impl("relu_max_pool2d_backward", &relu_max_pool2d_backward_cpu);
}

}  // namespace pfl::cpu_pool
