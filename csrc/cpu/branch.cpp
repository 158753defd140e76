// CPU kernels of the multi-branch ops (schemas in pfl_kernels/ops/branch.py).
//
// weights is read as [K, B, N] (K = 1 without a client dimension, N = the flattened layer
// shape) with its own strides, so branches shared by all clients (a view with stride 0 over
// K) cost no copy.  Both passes are memory bound and touch each operand once:
//
//   forward   W[k, n] = Σ_b α[k, b] w[k, b, n]: a task owns a chunk of n for one client; each
//             block of outputs (16 floats; 64 with AVX2 where B >= 6) is summed over the B
//             branches in registers (unit stride in n, so the loops vectorize) and stored once.
//   backward  one pass over grad_W: per chunk of n, for each branch in turn,
//             grad_weights[k, b, chunk] = α[k, b] g[chunk] and the partial dot product
//             ⟨g[chunk], w[k, b, chunk]⟩ come from one loop over the same loads (the chunk of
//             grad_W stays in L2 between branches; grad_weights is written with streaming
//             stores when the pass is too large for the cache).  The partial sums (per chunk
//             and branch, in opmath precision) are added after the parallel loop in chunk
//             order: chunks have a fixed size, so grad_alpha does not depend on the thread
//             count.
//
// Tasks run client-major: each client's output is written front to back.  Chunk-major order,
// which reads shared branches once for all clients, was slower in most K = 10 cases measured
// (by up to 45%): the branches stay in L3 between clients, and ten interleaved output streams
// cost more than that saves.
#include "check_helpers.h"
#include <ATen/core/Tensor.h>
#include <ATen/AccumulateType.h>
#include <ATen/Dispatch.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/TensorUtils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "loop_helpers.h"

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace pfl::cpu_branch {  // one namespace per file: setup.py's unity build compiles files together
namespace {

// ---------------------------------------------------------------- checks

using cpu::join;
using cpu::shape_str;

// Python's name of a dtype, so that the messages read as those of the Python checks.
std::string dtype_str(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// The checks of _check_op_args in ops/branch.py (the same wording); returns W's shape [K?, *shape].
std::vector<int64_t> check_args(const at::Tensor& weights, const at::Tensor& alpha, const at::Tensor* grad_w) {
  TORCH_CHECK_VALUE(alpha.dim() == 1 || alpha.dim() == 2, "alpha must be [B] or [K, B], got ",
                    shape_str(alpha.sizes()));
  TORCH_CHECK_VALUE(alpha.size(-1) >= 1, "alpha must have B >= 1 branches, got ", shape_str(alpha.sizes()));
  TORCH_CHECK_VALUE(weights.dim() >= alpha.dim() && weights.sizes().slice(0, alpha.dim()) == alpha.sizes(),
                    "weights must have shape [", join(alpha.sizes()), ", *shape] to match alpha, got ",
                    shape_str(weights.sizes()));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"weights", &weights}, {"grad_w", grad_w}}) {
    if (t == nullptr) continue;
    TORCH_CHECK_TYPE(t->scalar_type() == alpha.scalar_type(), name, " must have alpha's dtype ",
                     dtype_str(alpha.scalar_type()), ", got ", dtype_str(t->scalar_type()));
    TORCH_CHECK_VALUE(t->device() == alpha.device(), name, " must be on alpha's device ", alpha.device(), ", got ",
                      t->device());
  }
  TORCH_CHECK_TYPE(at::isFloatingType(alpha.scalar_type()), "alpha must be a floating tensor, got ",
                   dtype_str(alpha.scalar_type()));
  std::vector<int64_t> out_shape(weights.sizes().begin(), weights.sizes().begin() + (alpha.dim() - 1));
  out_shape.insert(out_shape.end(), weights.sizes().begin() + alpha.dim(), weights.sizes().end());
  if (grad_w != nullptr) {
    TORCH_CHECK_VALUE(grad_w->sizes() == at::IntArrayRef(out_shape), "grad_w must have shape ", shape_str(out_shape),
                      ", got ", shape_str(grad_w->sizes()));
  }
  return out_shape;
}

// ---------------------------------------------------------------- geometry

// Elements of n per task (the unit of parallel work).  Backward: the chunk of grad_W (128 KiB
// in float) stays in L2 while each branch streams past it, in runs long enough for the
// prefetchers (runs of 16 KiB measured 1.3-1.6x slower at the 256->256 k3 shape).
constexpr int64_t kForwardChunk = 8192;
constexpr int64_t kBackwardChunk = 32768;
// A pass that moves fewer elements (read + written) than this runs on the calling thread; a
// larger one is shared among the threads in parts of at least about half as many.  That keeps every
// LeNet-sized layer (a few microseconds in all) free of a parallel region.  On the shared
// 2-core machine this was tuned on (OMP_WAIT_POLICY=PASSIVE, other work running) a parallel
// region cost 10-50 us: threading paid off from about 2.3M elements moved (backward, 128->64
// k5, B = 5) and lost up to 1.8M (forward, 256->128 k3, B = 5).
constexpr int64_t kMinParallelElems = 1 << 21;
// The backward writes grad_weights with non-temporal stores when the pass moves at least this
// many bytes (about half the 32 MiB L3 of the machine this was measured on): its operands then
// come from memory, and ordinary stores first read every line they write (write-allocate),
// a third more traffic.  At the 256->256 k3 shape, B = 5 (25 MiB moved): 1.7-1.9x the copy
// floor with ordinary stores, 1.0-1.1x with streaming ones.  Smaller passes run from L3, where
// ordinary stores are faster (streaming ones measured up to 1.6x slower there) and leave the
// result in cache for its consumer.
constexpr int64_t kStreamBytes = 16 << 20;

struct Geometry {
  int64_t K, B, N, chunk, n_chunks;
  int64_t tasks() const { return K * n_chunks; }
};

// Chunks of at most max_chunk elements, of equal size, as many as a multiple of 4 once there are
// 4 or more: equal shares for 2 or 4 threads (at 128->128 k3, B = 10, the backward's 5 chunks
// of 32768 split 3:2 took 1.4x as long as 8 of 18432).  The chunking depends on N alone, never
// on the thread count, so that the sums over chunks give the same bits for any thread count.
Geometry geometry(const at::Tensor& weights, const at::Tensor& alpha, int64_t max_chunk) {
  const int64_t K = alpha.dim() == 2 ? alpha.size(0) : 1, B = alpha.size(-1);
  const int64_t N = c10::multiply_integers(weights.sizes().slice(alpha.dim()));
  int64_t chunk = max_chunk, n_chunks = (N + chunk - 1) / chunk;
  if (n_chunks >= 4) {
    n_chunks = (n_chunks + 3) / 4 * 4;
    chunk = ((N + n_chunks - 1) / n_chunks + 63) / 64 * 64;
    n_chunks = (N + chunk - 1) / chunk;
  }
  return {K, B, N, chunk, n_chunks};
}

// at::parallel_for's grain (in tasks) for tasks that each move `elems_per_task` elements.
int64_t task_grain(int64_t elems_per_task) {
  return std::max<int64_t>(1, kMinParallelElems / std::max<int64_t>(1, elems_per_task));
}

// weights as [K, B, N]: its strides (sk = 0 without a client dimension), and the tensor they
// belong to (a contiguous copy where no view of that shape exists: rare, e.g. a transposed
// layer shape; a shared [B, *shape] expanded over K stays shared).
struct Operand3 {
  at::Tensor t;
  int64_t sk, sb, sn;
};

Operand3 weights_kbn(const at::Tensor& weights, const at::Tensor& alpha, const Geometry& g) {
  const bool has_k = alpha.dim() == 2;
  std::vector<int64_t> shape = {g.B, g.N};
  if (has_k) shape.insert(shape.begin(), g.K);
  auto strides = at::detail::computeStride(weights.sizes(), weights.strides(), at::IntArrayRef(shape));
  if (strides) {
    if (!has_k) strides->insert(strides->begin(), 0);
    return {weights, (*strides)[0], (*strides)[1], (*strides)[2]};
  }
  if (has_k && weights.stride(0) == 0) {
    return {weights.select(0, 0).contiguous(), 0, g.N, 1};
  }
  return {weights.contiguous(), has_k ? g.B * g.N : 0, g.N, 1};
}

// grad_W as [K, N]: strides (sk = 0 without a client dimension).
struct Operand2 {
  at::Tensor t;
  int64_t sk, sn;
};

Operand2 grad_kn(const at::Tensor& grad_w, const at::Tensor& alpha, const Geometry& g) {
  const bool has_k = alpha.dim() == 2;
  std::vector<int64_t> shape = {g.N};
  if (has_k) shape.insert(shape.begin(), g.K);
  auto strides = at::detail::computeStride(grad_w.sizes(), grad_w.strides(), at::IntArrayRef(shape));
  if (strides) {
    if (!has_k) strides->insert(strides->begin(), 0);
    return {grad_w, (*strides)[0], (*strides)[1]};
  }
  return {grad_w.contiguous(), has_k ? g.N : 0, 1};
}

using cpu::cast_to;
using cpu::with_unit_stride;

// ---------------------------------------------------------------- forward

// out[i] = Σ_b a[b] w[b * sb + i * sn] for i < n.  A block of kBlock outputs is summed in
// registers over all branches (B streams at once, as a matrix-vector product reads them) and
// stored once: W is written exactly once and nothing else touches memory.  The sum runs over
// b in order, so every instruction set below gives the same bits.
template <int kBlock, bool kUnit, typename acc_t, typename scalar_t>
C10_ALWAYS_INLINE void combine_chunk_impl(const scalar_t* w, int64_t sb, int64_t sn, const acc_t* a, int64_t B,
                                          scalar_t* __restrict out, int64_t n) {
  if (kUnit) sn = 1;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    acc_t s[kBlock];
    const scalar_t* __restrict w0 = w + i * sn;
    for (int l = 0; l < kBlock; ++l) s[l] = a[0] * static_cast<acc_t>(w0[l * sn]);
    for (int64_t b = 1; b < B; ++b) {
      const scalar_t* __restrict wb = w + b * sb + i * sn;
      const acc_t ab = a[b];
      for (int l = 0; l < kBlock; ++l) s[l] += ab * static_cast<acc_t>(wb[l * sn]);
    }
    for (int l = 0; l < kBlock; ++l) out[i + l] = cast_to<scalar_t>(s[l]);
  }
  for (; i < n; ++i) {
    acc_t s = a[0] * static_cast<acc_t>(w[i * sn]);
    for (int64_t b = 1; b < B; ++b) s += a[b] * static_cast<acc_t>(w[b * sb + i * sn]);
    out[i] = cast_to<scalar_t>(s);
  }
}

// The baseline build (SSE2 on x86-64): blocks of four SSE vectors of float.
template <bool kUnit, typename acc_t, typename scalar_t>
void combine_chunk(const scalar_t* w, int64_t sb, int64_t sn, const acc_t* a, int64_t B, scalar_t* __restrict out,
                   int64_t n) {
  combine_chunk_impl<16, kUnit>(w, sb, sn, a, B, out, n);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define PFL_BRANCH_AVX2 1
// The same loop compiled for AVX2 (no FMA, so the same rounding), in blocks of eight AVX
// vectors, chosen at run time.  With many branches, the SSE loop is bound by its instruction
// count once the operands are in L3: at B = 10 and 128->128 k3 it took 1.7x as long as this
// one (which is at the speed of memcpy there); at B <= 5 the SSE loop is as fast or faster.
template <bool kUnit, typename acc_t, typename scalar_t>
__attribute__((target("avx2"))) void combine_chunk_avx2(const scalar_t* w, int64_t sb, int64_t sn, const acc_t* a,
                                                       int64_t B, scalar_t* __restrict out, int64_t n) {
  combine_chunk_impl<static_cast<int>(256 / sizeof(acc_t)), kUnit>(w, sb, sn, a, B, out, n);
}

using cpu::cpu_has_avx2;
#endif

// Branches from which the AVX2 loop is used (where the CPU has it).
constexpr int64_t kAvx2MinBranches = 6;

template <typename scalar_t>
void forward_kernel(scalar_t* out, const Operand3& w, const at::Tensor& alpha, const Geometry& g) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* wp = w.t.const_data_ptr<scalar_t>();
  const scalar_t* ap = alpha.const_data_ptr<scalar_t>();
  const int64_t ask = alpha.dim() == 2 ? alpha.stride(0) : 0, asb = alpha.stride(-1);
  const int64_t B = g.B, N = g.N;
  const int64_t grain = task_grain((B + 1) * std::min(N, g.chunk));
#ifdef PFL_BRANCH_AVX2
  const bool avx2 = B >= kAvx2MinBranches && cpu_has_avx2();
#endif
  with_unit_stride(w.sn == 1 || N == 1, [&](auto unit) {
    constexpr bool kUnit = decltype(unit)::value;
    at::parallel_for(0, g.tasks(), grain, [&](int64_t begin, int64_t end) {
      c10::SmallVector<acc_t, 16> a(B);
      int64_t a_of = -1;  // the client whose α is in `a`
      for (int64_t task = begin; task < end; ++task) {
        const int64_t k = task / g.n_chunks, c = task - k * g.n_chunks;
        const int64_t n0 = c * g.chunk, nc = std::min(g.chunk, N - n0);
        if (k != a_of) {
          for (int64_t b = 0; b < B; ++b) a[b] = static_cast<acc_t>(ap[k * ask + b * asb]);
          a_of = k;
        }
        const scalar_t* wk = wp + k * w.sk + n0 * w.sn;
#ifdef PFL_BRANCH_AVX2
        if (avx2) {
          combine_chunk_avx2<kUnit>(wk, w.sb, w.sn, a.data(), B, out + k * N + n0, nc);
          continue;
        }
#endif
        combine_chunk<kUnit>(wk, w.sb, w.sn, a.data(), B, out + k * N + n0, nc);
      }
    });
  });
}

at::Tensor branch_combine_cpu(const at::Tensor& weights, const at::Tensor& alpha) {
  const std::vector<int64_t> out_shape = check_args(weights, alpha, nullptr);
  at::Tensor out = at::empty(out_shape, alpha.options());
  if (out.numel() == 0) return out;
  const Geometry g = geometry(weights, alpha, kForwardChunk);
  const Operand3 w = weights_kbn(weights, alpha, g);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, alpha.scalar_type(), "branch_combine_cpu",
                                  [&] { forward_kernel<scalar_t>(out.data_ptr<scalar_t>(), w, alpha, g); });
  return out;
}

// ---------------------------------------------------------------- backward

// Lanes of the dot product: sixteen independent sums (four SSE accumulators of float) let it
// vectorize without -ffast-math and keep it from waiting on the latency of one chain of adds.
constexpr int kLanes = 16;

// Writes the kLanes values of v (16-byte aligned) to dst (16-byte aligned) with non-temporal
// stores, which write whole cache lines without first reading them.
template <typename scalar_t>
inline void stream_lanes(scalar_t* dst, const scalar_t* v) {
  constexpr size_t kBytes = kLanes * sizeof(scalar_t);
  static_assert(kBytes % 16 == 0, "whole 16-byte stores");
#if defined(__SSE2__)
  for (size_t o = 0; o < kBytes; o += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(reinterpret_cast<char*>(dst) + o),
                     _mm_load_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const char*>(v) + o)));
  }
#else
  std::memcpy(dst, v, kBytes);
#endif
}

// dst[i] = a g[i] (if kScale; with non-temporal stores if kStream) and returns Σ g[i] w[i] (if
// kDot), from one pass.  Not inlined: compiled on its own, GCC keeps the lanes in registers.
template <bool kScale, bool kDot, bool kUnit, bool kStream, typename acc_t, typename scalar_t>
C10_NOINLINE acc_t scale_and_dot(const acc_t* __restrict g, const scalar_t* __restrict w, int64_t sn, acc_t a,
                                 scalar_t* __restrict dst, int64_t n) {
  if (kUnit) sn = 1;
  // The lanes are only ever indexed by constants, so that they live in registers; the
  // elements outside whole blocks add to `rest`.
  acc_t lane[kLanes] = {};
  acc_t rest = 0;
  int64_t i = 0;
  if (kStream) {  // up to the first 16-byte boundary of dst
    for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) {
      dst[i] = cast_to<scalar_t>(a * g[i]);
      if (kDot) rest += g[i] * static_cast<acc_t>(w[i * sn]);
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    if (kStream) {
      alignas(16) scalar_t v[kLanes];
      for (int l = 0; l < kLanes; ++l) v[l] = cast_to<scalar_t>(a * g[i + l]);
      stream_lanes(dst + i, v);
    } else if (kScale) {
      for (int l = 0; l < kLanes; ++l) dst[i + l] = cast_to<scalar_t>(a * g[i + l]);
    }
    if (kDot) {
      for (int l = 0; l < kLanes; ++l) lane[l] += g[i + l] * static_cast<acc_t>(w[(i + l) * sn]);
    }
  }
  for (; i < n; ++i) {
    if (kScale) dst[i] = cast_to<scalar_t>(a * g[i]);
    if (kDot) rest += g[i] * static_cast<acc_t>(w[i * sn]);
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {  // a fixed tree: deterministic
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  }
  return lane[0] + rest;
}

template <typename scalar_t>
void backward_kernel(const Operand2& gw, const Operand3& w, const at::Tensor& alpha, const Geometry& g,
                     scalar_t* grad_weights, scalar_t* grad_alpha) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kWide = !std::is_same_v<acc_t, scalar_t>;
  const bool need_gw = grad_weights != nullptr, need_ga = grad_alpha != nullptr;
  const scalar_t* gp = gw.t.const_data_ptr<scalar_t>();
  const scalar_t* wp = w.t.const_data_ptr<scalar_t>();
  const scalar_t* ap = alpha.const_data_ptr<scalar_t>();
  const int64_t ask = alpha.dim() == 2 ? alpha.stride(0) : 0, asb = alpha.stride(-1);
  const int64_t K = g.K, B = g.B, N = g.N;
  // grad_alpha: with one chunk, the sums go straight to the output; else per-chunk partial sums.
  const bool direct = g.n_chunks == 1;
  std::unique_ptr<acc_t[]> part(need_ga && !direct ? new acc_t[g.tasks() * B] : nullptr);
  const bool grad_in_place = !kWide && gw.sn == 1;  // else the chunk of grad_W is gathered / widened
  const int64_t chunk = std::min(N, g.chunk);
  const int64_t moved = (1 + (need_ga ? B : 0) + (need_gw ? B : 0)) * chunk;
  const int64_t weights_read = need_ga ? (w.sk == 0 ? 1 : K) * B * N : 0;  // shared branches are read once
  const int64_t moved_bytes = (K * N + weights_read + K * B * N) * static_cast<int64_t>(sizeof(scalar_t));
  const bool stream = need_gw && moved_bytes >= kStreamBytes;
  with_unit_stride(w.sn == 1 || N == 1 || !need_ga, [&](auto unit) {
    constexpr bool kUnit = decltype(unit)::value;
    auto pass = [&](const acc_t* gr, const scalar_t* wb, acc_t a, scalar_t* dst, int64_t n) {
      if (stream) {
        if (need_ga) return scale_and_dot<true, true, kUnit, true>(gr, wb, w.sn, a, dst, n);
        return scale_and_dot<true, false, kUnit, true>(gr, wb, w.sn, a, dst, n);
      }
      if (need_gw && need_ga) return scale_and_dot<true, true, kUnit, false>(gr, wb, w.sn, a, dst, n);
      if (need_gw) return scale_and_dot<true, false, kUnit, false>(gr, wb, w.sn, a, dst, n);
      return scale_and_dot<false, true, kUnit, false>(gr, wb, w.sn, a, dst, n);
    };
    at::parallel_for(0, g.tasks(), task_grain(moved), [&](int64_t begin, int64_t end) {
      std::unique_ptr<acc_t[]> buf(grad_in_place ? nullptr : new acc_t[chunk]);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t k = task / g.n_chunks, c = task - k * g.n_chunks;
        const int64_t n0 = c * g.chunk, nc = std::min(g.chunk, N - n0);
        const scalar_t* gk = gp + k * gw.sk + n0 * gw.sn;
        const acc_t* gr;
        if (grad_in_place) {
          gr = reinterpret_cast<const acc_t*>(gk);
        } else {
          for (int64_t i = 0; i < nc; ++i) buf[i] = static_cast<acc_t>(gk[i * gw.sn]);
          gr = buf.get();
        }
        // One branch at a time: a long run of w[k, b] and of grad_weights[k, b] per pass.
        for (int64_t b = 0; b < B; ++b) {
          const acc_t s = pass(gr, wp + k * w.sk + b * w.sb + n0 * w.sn, static_cast<acc_t>(ap[k * ask + b * asb]),
                               need_gw ? grad_weights + (k * B + b) * N + n0 : nullptr, nc);
          if (!need_ga) continue;
          if (direct) {
            grad_alpha[k * B + b] = static_cast<scalar_t>(s);
          } else {
            part[(k * g.n_chunks + c) * B + b] = s;
          }
        }
      }
#if defined(__SSE2__)
      if (stream) _mm_sfence();  // order the non-temporal stores before the results are used
#endif
    });
  });
  // Add the partial sums in chunk order (deterministic for any thread count).
  if (need_ga && !direct) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t b = 0; b < B; ++b) {
        acc_t s = 0;
        for (int64_t c = 0; c < g.n_chunks; ++c) s += part[(k * g.n_chunks + c) * B + b];
        grad_alpha[k * B + b] = static_cast<scalar_t>(s);
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> branch_combine_backward_cpu(const at::Tensor& grad_w, const at::Tensor& weights,
                                                               const at::Tensor& alpha,
                                                               std::array<bool, 2> output_mask) {
  check_args(weights, alpha, &grad_w);
  const Geometry g = geometry(weights, alpha, kBackwardChunk);
  // A fresh empty tensor each where not requested: outputs sharing storage would break the
  // schema's no-alias promise.
  at::Tensor grad_weights = at::empty(output_mask[0] ? weights.sizes() : at::IntArrayRef{0}, alpha.options());
  at::Tensor grad_alpha = output_mask[1] && g.N == 0 ? at::zeros(alpha.sizes(), alpha.options())
                                                     : at::empty(output_mask[1] ? alpha.sizes() : at::IntArrayRef{0},
                                                                 alpha.options());
  if ((!output_mask[0] && !output_mask[1]) || g.K == 0 || g.N == 0) return {grad_weights, grad_alpha};
  const Operand2 gw = grad_kn(grad_w, alpha, g);
  // The dot products read weights; grad_weights alone needs only alpha and grad_W.
  const Operand3 w = output_mask[1] ? weights_kbn(weights, alpha, g) : Operand3{weights, 0, 0, 1};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, alpha.scalar_type(), "branch_combine_backward_cpu", [&] {
    backward_kernel<scalar_t>(gw, w, alpha, g, output_mask[0] ? grad_weights.data_ptr<scalar_t>() : nullptr,
                              output_mask[1] ? grad_alpha.data_ptr<scalar_t>() : nullptr);
  });
  return {grad_weights, grad_alpha};
}

// ---------------------------------------------------------------- simplex projection

// Each row, as the reference computes it in x's dtype (pfl_kernels/reference/branch.py), so
// that the results are bit for bit the same: v = x - max(x) (the projection commutes with a
// shift, and u_1 = 0 keeps ρ >= 1 even for |x| beyond 1/eps); u = v sorted descending;
// c = cumsum(u) - 1 with the running sum in at::acc_type<scalar_t, /*is_cuda=*/false>
// (torch.cumsum's accumulator on CPU: double for float); every other operation rounded to
// scalar_t after it is computed in opmath precision, as torch's elementwise kernels do.
template <typename scalar_t>
void project_row(scalar_t* x, int64_t s, int64_t B, at::opmath_type<scalar_t>* u, scalar_t* c) {
  using acc_t = at::opmath_type<scalar_t>;
  using cum_t = at::acc_type<scalar_t, false>;
  auto rounded = [](acc_t v) { return static_cast<acc_t>(static_cast<scalar_t>(v)); };
  acc_t x_max = static_cast<acc_t>(x[0]);
  bool finite = true;
  for (int64_t j = 0; j < B; ++j) {
    const acc_t v = static_cast<acc_t>(x[j * s]);
    finite &= std::isfinite(v);
    x_max = std::max(x_max, v);
  }
  if (!finite) {
    // The op's rule for a row holding NaN or +-Inf (the reference's and the Triton kernel's
    // too; the Python wrapper refuses such rows): the whole row becomes NaN.
    for (int64_t j = 0; j < B; ++j) x[j * s] = std::numeric_limits<scalar_t>::quiet_NaN();
    return;
  }
  // Entries more than 1 below the maximum are never in the support (theta >= -1): raised to
  // -2 (as the reference does), they leave rho and theta as they are and keep the prefix sums
  // finite for rows spanning more than half the float range.
  for (int64_t j = 0; j < B; ++j) u[j] = std::max(rounded(static_cast<acc_t>(x[j * s]) - x_max), acc_t(-2));
  std::sort(u, u + B, std::greater<acc_t>());
  cum_t cum = 0;
  int64_t rho = 0;  // the number of j with u_j - c_j / j > 0 (a prefix)
  for (int64_t j = 0; j < B; ++j) {
    cum += static_cast<cum_t>(u[j]);
    c[j] = static_cast<scalar_t>(static_cast<acc_t>(static_cast<scalar_t>(cum)) - acc_t(1));
    const acc_t jj = static_cast<acc_t>(static_cast<scalar_t>(j + 1));
    const acc_t q = rounded(static_cast<acc_t>(c[j]) / jj);
    rho += rounded(u[j] - q) > 0;
  }
  rho = std::max<int64_t>(rho, 1);  // u_1 = 0 is always in the support; this only guards c[rho - 1]
  const acc_t theta = rounded(static_cast<acc_t>(c[rho - 1]) / static_cast<acc_t>(static_cast<scalar_t>(rho)));
  for (int64_t j = 0; j < B; ++j) {
    const acc_t v = rounded(rounded(static_cast<acc_t>(x[j * s]) - x_max) - theta);
    x[j * s] = static_cast<scalar_t>(v < 0 ? acc_t(0) : v);
  }
}

void project_simplex_cpu(at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) >= 1, "x must be [..., B] with B >= 1, got ", shape_str(x.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "x must be a floating tensor, got ",
                   dtype_str(x.scalar_type()));
  // Rows that share memory would be projected twice, the second time from the first's result.
  TORCH_CHECK_VALUE(!cpu::has_internal_overlap(x), "x must not have elements that share memory, got strides ",
                    shape_str(x.strides()));
  const int64_t B = x.size(-1), s = x.stride(-1);
  const int64_t rows = x.numel() / B;
  if (rows == 0) return;
  // Offset of row r: one stride where the leading dims collapse (the usual case), else digit
  // by digit over the leading dims.
  const at::IntArrayRef lead_sizes = x.sizes().slice(0, x.dim() - 1), lead_strides = x.strides().slice(0, x.dim() - 1);
  auto flat = at::detail::computeStride(lead_sizes, lead_strides, at::IntArrayRef{rows});
  const int64_t row_stride = flat ? (*flat)[0] : 0;
  auto row_offset = [&](int64_t r) {
    if (flat) return r * row_stride;
    int64_t off = 0;
    for (int64_t d = static_cast<int64_t>(lead_sizes.size()) - 1; d >= 0; --d) {
      off += (r % lead_sizes[d]) * lead_strides[d];
      r /= lead_sizes[d];
    }
    return off;
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "project_simplex_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* data = x.data_ptr<scalar_t>();
    // A row costs about B log B comparisons: thread only many rows.
    const int64_t grain = std::max<int64_t>(1, 32768 / B);
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> u(B);
      std::vector<scalar_t> c(B);
      for (int64_t r = begin; r < end; ++r) project_row<scalar_t>(data + row_offset(r), s, B, u.data(), c.data());
    });
  });
}

}  // namespace

// The schemas are defined in Python (pfl_kernels/ops/branch.py); the dispatcher accepts
// kernels registered before their schema and checks them against it once it is defined.
TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("branch_combine", &branch_combine_cpu);
  m.impl("branch_combine_backward", &branch_combine_backward_cpu);
  m.impl("project_simplex_", &project_simplex_cpu);
}

}  // namespace pfl::cpu_branch
