// CPU kernels of weighted_average (schemas in pfl_kernels/ops/aggregate.py).
//
// out[k] = Σ_{j: w_kj != 0} w_kj θ_j, weights [K, M], params [M, P], out [K, P] (any row stride,
// unit column stride).  The work splits into column tiles of params: a tile's outputs depend on
// the same columns of params only, so tasks never share an output, and each output element is
// summed over j in increasing order by one task (results do not depend on the thread count).
// Three paths, chosen from the shapes and the density of the weights (never from the thread
// count):
//
//   sparse  (few nonzero weights, e.g. after similarity_weights): the weights as CSR (built in
//           one parallel pass that also checks they are finite); per tile and row, the sum over
//           the row's nonzeros only, reading the tile of each kept θ_j in place (the tile of
//           params stays in L2 while the rows run).  Cost ∝ nnz · P.
//   dense   (own kernel): the tile of params is packed once into a float panel [M][tile] (bf16
//           converted once, not once per row); register-blocked micro-tiles of 6 rows x two
//           vectors sum over j with broadcast weights, the standard GEMM inner kernel.
//   mm      (dense weights, every dtype: BLAS's packing and blocking win): at::mm_out per
//           column block of out (~512 KB, so it is still in L2 when read again), each block
//           checked for NaN/Inf right after BLAS wrote it and, when it has any, recomputed
//           exactly (BLAS computes 0·NaN = NaN for a zero weight).  Blocks run in parallel
//           with BLAS single-threaded inside; no second pass over out.  bfloat16/float16
//           blocks of params are converted to float32 first and the float32 block of out is
//           rounded into out (float32 accumulation, as the other paths).
//
// Zero weights: the dense kernel multiplies by them only when the panel is finite (0·x = 0
// there); a panel holding NaN/Inf is summed by the zero-skipping loop instead.  So every path
// gives a NaN/Inf row of params only to the clients that weight it.
//
// Overlap: out may overlap params when each element of out shares memory only with the same
// column of params (out a slice of the bank params lives in, the in-place `bank <- W @ bank`):
// then every task packs (mm path: copies) its whole tile of params before it writes that tile
// of out.  Any other overlap is resolved by reading a copy of params.
#include "check_helpers.h"
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include "loop_helpers.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>

namespace pfl::cpu_aggregate {  // one namespace per file: setup.py's unity build compiles files together

using cpu::cast_to;

namespace base {
constexpr int kVecBytes = 16;
#include "aggregate_kernels.h"
}  // namespace base

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define PFL_AGGREGATE_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
constexpr int kVecBytes = 32;
#include "aggregate_kernels.h"
}  // namespace avx2
#pragma GCC pop_options
#endif

namespace {

bool use_avx2() {
#if defined(PFL_AGGREGATE_AVX2)
  return cpu::cpu_has_avx2();
#else
  return false;
#endif
}

// ---------------------------------------------------------------- tuning (measured, see below)

// Bytes of a packed panel [M][tile]: it stays in L2 (1 MiB per core on the machine measured)
// while every row block of the tile streams past it.
constexpr int64_t kPanelBytes = 384 << 10;
constexpr int64_t kMinTile = 64, kMaxTile = 4096;
// Bytes of the [M][tile] block of params the sparse path reads in place.  At K = M = 1000, 5%
// nonzero, P = 10^5 (2 cores): 256 KB (tile 64) 449 ms, 512 KB (128) 337-360 ms, 1 MB (256)
// 369-394 ms, 2 MB (512) 442-487 ms; with M = 20 or 100 wider tiles (up to kMaxTile) win.
constexpr int64_t kSparseTileBytes = 512 << 10;
// Density (nonzero weights / K·M) below which the sparse path runs.
constexpr double kSparseDensity = 0.3;
// Dense weights always use at::mm (+ the NaN/Inf fix-up): under the load this was tuned in,
// the micro-kernel did not reach BLAS at any K measured (20 to 1000), in float32 nor in
// bfloat16 (blocks converted to float32: K = 20, P = 10^6: 11.6 ms against the micro-kernel's
// 27.7; K = 100, P = 10^5: 14.8 against 27.2).  The dense micro-kernel runs only where
// PFL_KERNELS_AGGREGATE_PATH=dense forces it (for comparisons).
// mm path: bytes of one [K, cb] block of out (it stays in L2, 1 MiB per core here, between
// BLAS writing it and the NaN/Inf check reading it), its least width (BLAS re-packs the
// weights for every block; at K = M = 1000, P = 10^5 and 65536, 2 cores, time / torch.mm
// for 128/256/512/1024 columns: 0.98/0.95/0.94/0.94 and 0.94/0.93/0.89/0.92) and the number
// of blocks wanted when P is small.
constexpr int64_t kMmBlockBytes = 512 << 10;
constexpr int64_t kMmMinCols = 512;
constexpr int64_t kMmMinBlocks = 16;
// Weights larger than kMmCachedWeightBytes (beyond L3's share) come from memory each time BLAS
// packs them, once per block: blocks are then at least kMmMinColsUncached wide (or all of P).
// K = M = 10^4, P = 10^3 on 2 cores, time / torch.mm by block width: 64: 1.63, 256: 1.12,
// 1000: 1.0; K = M = 3000: 1.30, 1.07, 1.0; K = M = 10^4, P = 4096: 1024: 1.09, 4096: 1.0.
// Where a block needs temporaries (bfloat16/float16 blocks in float32, or in place), their
// M + K rows of cb floats stay within half the bytes of the float32 weights.
constexpr int64_t kMmCachedWeightBytes = 8 << 20;
constexpr int64_t kMmMinColsUncached = 4096;
// Multiply-adds below which everything runs on the calling thread.
constexpr int64_t kMinParallelWork = 1 << 18;

// ---------------------------------------------------------------- checks

using cpu::shape_str;

void check_args(const at::Tensor& weights, const at::Tensor& params, const at::Tensor* out) {
  TORCH_CHECK_VALUE(weights.dim() == 2, "weights must be [K, M], got ", shape_str(weights.sizes()));
  TORCH_CHECK_VALUE(params.dim() == 2, "params must be [M, P], got ", shape_str(params.sizes()));
  TORCH_CHECK_VALUE(weights.size(1) == params.size(0), "params must have M=", weights.size(1),
                    " rows (weights' last dim), got ", shape_str(params.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(weights.scalar_type()), "weights must be floating, got ",
                   weights.scalar_type());
  TORCH_CHECK_TYPE(at::isFloatingType(params.scalar_type()), "params must be floating, got ",
                   params.scalar_type());
  TORCH_CHECK_VALUE(weights.device() == params.device(), "weights must be on params' device ", params.device(),
                    ", got ", weights.device());
  TORCH_CHECK_VALUE(params.size(0) < std::numeric_limits<int32_t>::max(), "params has too many rows");
  if (out == nullptr) return;
  const int64_t K = weights.size(0), P = params.size(1);
  TORCH_CHECK_VALUE(out->dim() == 2 && out->size(0) == K && out->size(1) == P, "out must have shape [", K, ", ", P,
                    "], got ", shape_str(out->sizes()));
  TORCH_CHECK_TYPE(out->scalar_type() == params.scalar_type(), "out must have params' dtype ",
                   params.scalar_type(), ", got ", out->scalar_type());
  TORCH_CHECK_VALUE(out->device() == params.device(), "out must be on params' device ", params.device(), ", got ",
                    out->device());
  TORCH_CHECK_VALUE(P <= 1 || out->stride(1) == 1, "out must have unit stride in its last dim, got strides ",
                    shape_str(out->strides()));
  TORCH_CHECK_VALUE(K <= 1 || P == 0 || std::abs(out->stride(0)) >= P, "out's rows overlap (row stride ",
                    out->stride(0), " < P=", P, ")");
}

// ---------------------------------------------------------------- overlap

// Whether every element of out that shares memory with params shares it with the same column
// (then packing each column tile before writing it is enough).  O(K).
bool same_columns(const at::Tensor& out, const at::Tensor& params) {
  const int64_t e = out.element_size(), P = params.size(1), M = params.size(0), sp = params.stride(0);
  const auto diff = static_cast<int64_t>(reinterpret_cast<intptr_t>(out.data_ptr()) -
                                         reinterpret_cast<intptr_t>(params.data_ptr()));
  if (diff % e != 0) return false;
  if (M > 1 && sp < P) return false;  // params' own rows overlap (e.g. an expanded row)
  for (int64_t k = 0; k < out.size(0); ++k) {
    const int64_t ok = diff / e + k * out.stride(0);  // out row k, in elements from params[0, 0]
    int64_t j0 = 0;
    if (M > 1) j0 = ok >= 0 ? ok / sp : -((-ok + sp - 1) / sp);
    for (int64_t j = std::max<int64_t>(0, j0 - 1); j <= std::min(M - 1, j0 + 1); ++j) {
      const int64_t shift = ok - j * sp;
      if (shift != 0 && shift > -P && shift < P) return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------- driver

struct Plan {
  int64_t K, M, P, tile, tiles, row_parts;
};

int64_t tile_width(int64_t M, int64_t acc_bytes, int64_t P, int64_t budget = kPanelBytes) {
  int64_t t = budget / std::max<int64_t>(1, M * acc_bytes) / kMinTile * kMinTile;
  t = std::clamp(t, kMinTile, kMaxTile);
  return std::min(t, (P + kMinTile - 1) / kMinTile * kMinTile);
}

template <typename acc_t>
struct Csr {
  std::vector<int64_t> ptr;
  std::vector<int32_t> col;
  std::vector<acc_t> val;
};

// CSR of w [K][M] (contiguous, finite): count per row, prefix sum, fill (rows in parallel).
template <typename acc_t>
Csr<acc_t> build_csr(const acc_t* w, int64_t K, int64_t M) {
  Csr<acc_t> csr;
  csr.ptr.assign(K + 1, 0);
  const int64_t grain = std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, M));
  at::parallel_for(0, K, grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      int64_t n = 0;
      for (int64_t j = 0; j < M; ++j) n += w[k * M + j] != acc_t(0);
      csr.ptr[k + 1] = n;
    }
  });
  for (int64_t k = 0; k < K; ++k) csr.ptr[k + 1] += csr.ptr[k];
  csr.col.resize(csr.ptr[K]);
  csr.val.resize(csr.ptr[K]);
  at::parallel_for(0, K, grain, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      int64_t n = csr.ptr[k];
      for (int64_t j = 0; j < M; ++j) {
        const acc_t v = w[k * M + j];
        if (v != acc_t(0)) {
          csr.col[n] = static_cast<int32_t>(j);
          csr.val[n++] = v;
        }
      }
    }
  });
  return csr;
}

// Runs f(tile index, first row, end row) over tiles x row parts in parallel.
// Row parts hold a multiple of `align` rows.
template <typename F>
void for_tiles(const Plan& plan, int64_t work_per_task, int64_t align, const F& f) {
  const int64_t tasks = plan.tiles * plan.row_parts;
  const int64_t grain = std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, work_per_task));
  const int64_t rows_per_part = ((plan.K + plan.row_parts - 1) / plan.row_parts + align - 1) / align * align;
  at::parallel_for(0, tasks, grain, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t t = task / plan.row_parts, part = task - t * plan.row_parts;
      const int64_t k0 = part * rows_per_part, k1 = std::min(plan.K, k0 + rows_per_part);
      if (k0 < k1) f(t, k0, k1);
    }
  });
}

template <typename scalar_t, typename acc_t, typename Kern>
void run_kernels(const at::Tensor& w_acc, const at::Tensor& params, at::Tensor& out, bool alias, bool sparse,
                 int64_t nnz) {
  const int64_t K = out.size(0), P = out.size(1), M = params.size(0);
  const acc_t* w = w_acc.const_data_ptr<acc_t>();
  const scalar_t* pp = params.const_data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t sp = params.stride(0), so = out.stride(0);
  Plan plan{K, M, P, tile_width(M, sizeof(acc_t), P), 0, 1};
  // The sparse path reads params in place, and the rows kept by a tile's outputs (at 5%
  // density and M = 1000, nearly all M) are re-read from L2 row after row: its own budget.
  if (sparse && !alias) plan.tile = tile_width(M, sizeof(scalar_t), P, kSparseTileBytes);
  plan.tiles = (P + plan.tile - 1) / plan.tile;

  // Few tiles (small P) leave threads idle: split the rows too, unless out overlaps params
  // (then one task must read its whole tile before writing any of it).
  const int64_t threads = at::get_num_threads();
  if (!alias && plan.tiles < 2 * threads) {
    plan.row_parts = std::min<int64_t>((2 * threads + plan.tiles - 1) / plan.tiles,
                                       std::max<int64_t>(1, K / (4 * Kern::kR)));
  }
  const int64_t rows_per_task = (K + plan.row_parts - 1) / plan.row_parts;

  if (sparse) {
    const Csr<acc_t> csr = build_csr(w, K, M);
    const int64_t work = std::max<int64_t>(1, nnz / std::max<int64_t>(1, plan.row_parts)) * plan.tile;
    for_tiles(plan, work, 1, [&](int64_t t, int64_t k0, int64_t k1) {
      const int64_t c0 = t * plan.tile, tw = std::min(plan.tile, P - c0);
      if (alias) {
        std::unique_ptr<acc_t[]> buf(new acc_t[M * plan.tile]);
        Kern::template pack_panel<acc_t>(pp + c0, sp, M, tw, plan.tile, buf.get());
        Kern::template sparse_rows<acc_t>(csr.ptr.data(), csr.col.data(), csr.val.data(), k0, k1, buf.get(),
                                          plan.tile, tw, op + c0, so);
      } else {
        Kern::template sparse_rows<acc_t>(csr.ptr.data(), csr.col.data(), csr.val.data(), k0, k1, pp + c0, sp,
                                          tw, op + c0, so);
      }
    });
    return;
  }

  // Dense: the weights of each block of kR rows as [M][kR] (rows past K zero).
  constexpr int R = Kern::kR;
  const int64_t blocks = (K + R - 1) / R;
  std::unique_ptr<acc_t[]> wpack(new acc_t[blocks * M * R]);
  at::parallel_for(0, blocks, std::max<int64_t>(1, kMinParallelWork / std::max<int64_t>(1, M * R)),
                   [&](int64_t b, int64_t e) {
                     for (int64_t blk = b; blk < e; ++blk) {
                       for (int64_t j = 0; j < M; ++j) {
                         for (int r = 0; r < R; ++r) {
                           const int64_t k = blk * R + r;
                           wpack[(blk * M + j) * R + r] = k < K ? w[k * M + j] : acc_t(0);
                         }
                       }
                     }
                   });
  for_tiles(plan, rows_per_task * M * plan.tile, R, [&](int64_t t, int64_t k0, int64_t k1) {
    const int64_t c0 = t * plan.tile, tw = std::min(plan.tile, P - c0);
    std::unique_ptr<acc_t[]> buf(new acc_t[M * plan.tile]);
    const bool finite = Kern::template pack_panel<acc_t>(pp + c0, sp, M, tw, plan.tile, buf.get());
    if (!finite) {
      Kern::template skip_zero_rows<acc_t>(w, M, k0, k1, buf.get(), plan.tile, tw, op + c0, so);
      return;
    }
    for (int64_t k = k0; k < k1; k += R) {
      Kern::template dense_rows<acc_t>(wpack.get() + k * M, static_cast<int>(std::min<int64_t>(R, K - k)),
                                       buf.get(), plan.tile, M, tw, op + k * so + c0, so);
    }
  });
}

// mm path: BLAS per column block of out, each block checked for NaN/Inf right after BLAS
// wrote it (while it is still in cache) and recomputed exactly when it has any.  No pass over
// all of out after the product, and no temporary the size of out.  bfloat16/float16 params:
// each block of params is converted to float32 (in L2), multiplied in float32 into a float32
// block, and rounded into out: the same float32 accumulation as the micro-kernel, at BLAS's
// speed where the product is bound by arithmetic.
template <typename scalar_t, typename Kern>
void run_mm(const at::Tensor& w, const at::Tensor& params, at::Tensor& out, bool alias) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool kLowp = !std::is_same_v<scalar_t, acc_t>;
  const int64_t K = out.size(0), P = out.size(1), M = params.size(0);
  const int64_t es = static_cast<int64_t>(sizeof(acc_t));
  // Block width from the shapes only (never the thread count): a [K, cb] block of out of
  // about kMmBlockBytes, at least kMmMinCols wide (BLAS packs the weights once per call), and
  // narrow enough to give kMmMinBlocks blocks when P allows.
  int64_t cb = std::max<int64_t>(kMmMinCols, kMmBlockBytes / std::max<int64_t>(1, K * es)) / 64 * 64;
  cb = std::min(cb, ((P + kMmMinBlocks - 1) / kMmMinBlocks + 63) / 64 * 64);
  if (K * M * es > kMmCachedWeightBytes) {
    const int64_t most = alias || kLowp ? K * M / (2 * (M + K)) / 64 * 64 : kMmMinColsUncached;
    cb = std::max(cb, std::min(kMmMinColsUncached, most));
  }
  cb = std::max<int64_t>(64, std::min(cb, P));
  const int64_t blocks = (P + cb - 1) / cb;
  const acc_t* wp = w.const_data_ptr<acc_t>();
  const scalar_t* pp = params.const_data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t sp = params.stride(0), so = out.stride(0);
  const at::Tensor wd = w.detach(), pd = params.detach(), od = out.detach();
  const at::TensorOptions acc_options = params.options().dtype(w.scalar_type());

  // tmp: [M, cb] (params' block, in acc_t); tmp_out: [K, cb] acc_t (reduced precision only).
  auto run_block = [&](int64_t b, at::Tensor& tmp, at::Tensor& tmp_out) {
    const int64_t c0 = b * cb, tw = std::min(cb, P - c0);
    at::Tensor src = pd.narrow(1, c0, tw);
    const acc_t* sptr = nullptr;
    int64_t ss = sp;
    if (alias || kLowp) {  // alias: this block of out is this block of params, read it first
      if (!tmp.defined()) tmp = at::empty({M, cb}, acc_options);
      at::Tensor t = tmp.narrow(1, 0, tw);
      t.copy_(src);
      src = t;
      sptr = tmp.const_data_ptr<acc_t>();
      ss = cb;
    } else {
      sptr = reinterpret_cast<const acc_t*>(pp + c0);  // scalar_t is acc_t here
    }
    at::Tensor dst = od.narrow(1, c0, tw);
    if constexpr (kLowp) {
      if (!tmp_out.defined()) tmp_out = at::empty({K, cb}, acc_options);
      at::Tensor o = tmp_out.narrow(1, 0, tw);
      at::mm_out(o, wd, src);
      if (Kern::all_finite(tmp_out.const_data_ptr<acc_t>(), cb, K, tw)) {
        dst.copy_(o);  // round to scalar_t
        return;
      }
    } else {
      at::mm_out(dst, wd, src);
      if (Kern::all_finite(op + c0, so, K, tw)) return;
    }
    // BLAS computed 0·NaN = NaN for zero weights: redo the block skipping them.
    Kern::template skip_zero_rows<acc_t>(wp, M, 0, K, sptr, ss, tw, op + c0, so);
  };
  const int64_t threads = at::get_num_threads();
  if (threads > 1 && blocks >= 4 * threads && !at::in_parallel_region()) {
    // Blocks in parallel, BLAS single-threaded inside each (MKL and OpenBLAS run one thread
    // when called from a parallel region).  Measured on 2 cores against BLAS threading each
    // block in turn: 0.6-0.97x torch.mm against 1.0-1.5x (K = 20, 100; P = 65536 to 10^7).
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      // Below autograd on this thread too (guards are thread-local); the kernel runs below it.
      at::AutoDispatchBelowADInplaceOrView guard;
      at::Tensor tmp, tmp_out;
      for (int64_t b = b0; b < b1; ++b) run_block(b, tmp, tmp_out);
    });
  } else {
    at::AutoDispatchBelowADInplaceOrView guard;
    at::Tensor tmp, tmp_out;
    for (int64_t b = 0; b < blocks; ++b) run_block(b, tmp, tmp_out);
  }
}

// The kernels of one build, as a type (so run_kernels can be written once).
#define PFL_AGGREGATE_KERNELS(ns)                                                          \
  struct Kernels_##ns {                                                                    \
    static constexpr int kR = ns::kR;                                                      \
    template <typename acc_t, typename scalar_t>                                           \
    static bool pack_panel(const scalar_t* s, int64_t sp, int64_t M, int64_t tw, int64_t ld, acc_t* b) { \
      return ns::pack_panel<acc_t>(s, sp, M, tw, ld, b);                                   \
    }                                                                                      \
    template <typename scalar_t>                                                           \
    static bool all_finite(const scalar_t* o, int64_t so, int64_t K, int64_t tw) {         \
      return ns::all_finite(o, so, K, tw);                                                 \
    }                                                                                      \
    template <typename acc_t, typename scalar_t>                                           \
    static void dense_rows(const acc_t* wb, int rows, const acc_t* buf, int64_t ld, int64_t M, int64_t tw, \
                           scalar_t* out, int64_t so) {                                    \
      ns::dense_rows(wb, rows, buf, ld, M, tw, out, so);                                   \
    }                                                                                      \
    template <typename acc_t, typename S, typename scalar_t>                               \
    static void sparse_rows(const int64_t* ptr, const int32_t* col, const acc_t* val, int64_t k0, int64_t k1, \
                            const S* src, int64_t ss, int64_t tw, scalar_t* out, int64_t so) { \
      ns::sparse_rows<acc_t>(ptr, col, val, k0, k1, src, ss, tw, out, so);                 \
    }                                                                                      \
    template <typename acc_t, typename scalar_t>                                           \
    static void skip_zero_rows(const acc_t* w, int64_t M, int64_t k0, int64_t k1, const acc_t* buf, int64_t ld, \
                               int64_t tw, scalar_t* out, int64_t so) {                    \
      ns::skip_zero_rows(w, M, k0, k1, buf, ld, tw, out, so);                              \
    }                                                                                      \
  };

PFL_AGGREGATE_KERNELS(base)
#if defined(PFL_AGGREGATE_AVX2)
PFL_AGGREGATE_KERNELS(avx2)
#endif
#undef PFL_AGGREGATE_KERNELS

template <typename F>
void with_kernels(const F& f) {
#if defined(PFL_AGGREGATE_AVX2)
  if (use_avx2()) return f(Kernels_avx2{});
#endif
  f(Kernels_base{});
}

// Which path to take: PFL_KERNELS_AGGREGATE_PATH=sparse|dense|mm forces one (tests and
// benchmarks compare them on the same inputs; mm only applies to float32/float64 params without
// overlap); unset or 'auto' chooses from the inputs.
enum class Path { kAuto, kSparse, kDense, kMm };

Path forced_path() {
  const char* v = std::getenv("PFL_KERNELS_AGGREGATE_PATH");
  if (v == nullptr) return Path::kAuto;
  const std::string s(v);
  if (s == "sparse") return Path::kSparse;
  if (s == "dense") return Path::kDense;
  if (s == "mm") return Path::kMm;
  return Path::kAuto;
}

// Nonzeros of w [K*M] (contiguous), checking finiteness on the way (one parallel pass).
template <typename acc_t>
int64_t count_nonzeros(const acc_t* w, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  std::vector<int64_t> count(chunks, 0);
  std::vector<char> bad(chunks, 0);
  at::parallel_for(0, chunks, 4, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
      int64_t nz = 0;
      acc_t probe = 0;
      for (int64_t i = i0; i < i1; ++i) {
        nz += w[i] != acc_t(0);
        probe += w[i] * acc_t(0);
      }
      count[c] = nz;
      bad[c] = probe != acc_t(0);
    }
  });
  TORCH_CHECK_VALUE(std::none_of(bad.begin(), bad.end(), [](char b) { return b != 0; }),
                    "weights must be finite (they hold NaN or Inf, or values beyond the accumulation "
                    "dtype's range: float32's, float64's for float64 params)");
  int64_t total = 0;
  for (int64_t c : count) total += c;
  return total;
}

void weighted_average_into(const at::Tensor& weights, const at::Tensor& params_in, at::Tensor& out) {
  const int64_t K = out.size(0), P = out.size(1), M = params_in.size(0);
  const at::ScalarType st = params_in.scalar_type();
  const at::ScalarType acc = st == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor w = weights.to(acc).contiguous();
  if (cpu::may_overlap(out, w)) w = w.clone();
  const int64_t nnz = AT_DISPATCH_FLOATING_TYPES(acc, "weighted_average_cpu_count", [&] {
    return count_nonzeros(w.const_data_ptr<scalar_t>(), K * M);
  });
  if (K == 0 || P == 0) return;
  if (M == 0) {
    out.zero_();
    return;
  }
  at::Tensor params = params_in;
  if (P > 1 && params.stride(1) != 1) params = params.contiguous();
  bool alias = cpu::may_overlap(out, params);
  if (alias && !same_columns(out, params)) {
    params = params.clone(at::MemoryFormat::Contiguous);
    alias = false;
  }
  const Path forced = forced_path();
  const bool sparse = forced == Path::kAuto
                          ? static_cast<double>(nnz) < kSparseDensity * static_cast<double>(K) * static_cast<double>(M)
                          : forced == Path::kSparse;
  const bool use_mm = forced == Path::kMm || (forced == Path::kAuto && !sparse);
  with_kernels([&](auto kern) {
    using Kern = decltype(kern);
    if (use_mm) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "weighted_average_cpu_mm",
                                      [&] { run_mm<scalar_t, Kern>(w, params, out, alias); });
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, st, "weighted_average_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      run_kernels<scalar_t, acc_t, Kern>(w, params, out, alias, sparse, nnz);
    });
  });
}

at::Tensor weighted_average_cpu(const at::Tensor& weights, const at::Tensor& params) {
  check_args(weights, params, nullptr);
  at::Tensor out = at::empty({weights.size(0), params.size(1)}, params.options());
  weighted_average_into(weights, params, out);
  return out;
}

at::Tensor& weighted_average_out_cpu(const at::Tensor& weights, const at::Tensor& params, at::Tensor& out) {
  check_args(weights, params, &out);
  weighted_average_into(weights, params, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("weighted_average", &weighted_average_cpu);
  m.impl("weighted_average.out", &weighted_average_out_cpu);
}

}  // namespace pfl::cpu_aggregate
