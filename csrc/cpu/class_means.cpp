// CPU kernel of pfl::class_means (schema in pfl_kernels/ops/class_means.py):
//
//   means[k, c, :] = (1 / n_kc) Σ_{n : labels[k, n] = c} features[k, n, :],  counts[k, c] = n_kc
//
// A first pass over the labels counts the samples of each class and checks the labels.  The
// sums then take one of two paths, with no atomics, and a result that does not depend on the
// thread count:
//
// * streaming (the usual case): the samples of a client are cut into blocks of consecutive
//   rows (their size depends on K and N only); a task owns one (client, block, run of D, whole rows
//   where the classes' accumulators fit in L2) and reads its rows front to back, adding each
//   row into its class's accumulator.  The features are read once, in long sequential
//   streams that the hardware prefetchers follow.  Each block's sums (in sample order) are
//   then added in block order and divided by the counts.
// * gather (more than a thousand classes, whose accumulators would not fit in L2): the first
//   pass also lists each class's samples (a counting sort); a task owns one (client, class,
//   run of D) and adds the class's rows in sample order, prefetched a few rows ahead since
//   they are scattered.
#include "check_helpers.h"
#include "loop_helpers.h"
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace pfl::cpu_class_means {  // one namespace per file: setup.py's unity build compiles files together
namespace {

using cpu::shape_str;

// The machine's physical memory in bytes (what ops/class_means.py's device_memory reads), 0
// where unknown.
int64_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<int64_t>(pages) * page_size : 0;
}

// ValueError naming num_classes when means [K?, C, D] and their int64 counts need more bytes
// than the machine has (check_output_size in ops/class_means.py, the same wording): at::zeros
// would fail in the allocator ("can't allocate memory: you tried to allocate ... bytes").
void check_fits_in_memory(const at::Tensor& features, int64_t num_classes, const std::string& means_shape) {
  static const int64_t memory = physical_memory();
  if (memory == 0) return;
  const int64_t lead = features.dim() == 3 ? features.size(0) : 1, dim = features.size(-1);
  const int64_t row_bytes = dim * (features.scalar_type() == at::kDouble ? 8 : 4) + 8;  // a mean and its count
  int64_t need = 0;
  const bool huge = c10::mul_overflows(lead, num_classes, &need) || c10::mul_overflows(need, row_bytes, &need);
  if (!huge && need <= memory) return;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  char text[128];  // Python's f"{x:.1f}": both round the exact binary value to one decimal
  std::snprintf(text, sizeof(text), "%.1f GiB, more than the %.1f GiB",
                static_cast<double>(lead) * static_cast<double>(num_classes) * static_cast<double>(row_bytes) / gib,
                static_cast<double>(memory) / gib);
  TORCH_CHECK_VALUE(false, "num_classes=", num_classes, " is too large: means of shape ", means_shape,
                    " and their counts need ", text, " of memory of ", features.device());
}

// The checks of _check_op_args in ops/class_means.py (the same wording), then the output's
// size (check_output_size there).
void check_args(const at::Tensor& features, const at::Tensor& labels, int64_t num_classes) {
  TORCH_CHECK_VALUE(features.dim() == 2 || features.dim() == 3, "features must be [N, D] or [K, N, D], got ",
                    shape_str(features.sizes()));
  TORCH_CHECK_VALUE(labels.dim() == features.dim() - 1 &&
                        labels.sizes() == features.sizes().slice(0, features.dim() - 1),
                    "labels must have shape ", shape_str(features.sizes().slice(0, features.dim() - 1)),
                    " to match features ", shape_str(features.sizes()), ", got ", shape_str(labels.sizes()));
  TORCH_CHECK_TYPE(at::isFloatingType(features.scalar_type()), "features must be a floating tensor, got ",
                   features.scalar_type());
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt,
                   "labels must be int64 or int32, got ", labels.scalar_type());
  TORCH_CHECK_VALUE(labels.device() == features.device(), "labels must be on features' device ", features.device(),
                    ", got ", labels.device());
  TORCH_CHECK_VALUE(num_classes >= 1, "num_classes must be >= 1, got ", num_classes);
  // means [K?, C, D]: its element count must be an int64 (at::zeros would fail in the allocator).
  int64_t elements = 0;
  const bool overflows =
      c10::mul_overflows(features.dim() == 3 ? features.size(0) : int64_t{1}, num_classes, &elements) ||
      c10::mul_overflows(elements, std::max<int64_t>(features.size(-1), 1), &elements);
  const std::string means_shape = features.dim() == 3
                                      ? shape_str({features.size(0), num_classes, features.size(-1)})
                                      : shape_str({num_classes, features.size(-1)});
  TORCH_CHECK_VALUE(!overflows, "num_classes=", num_classes, " is too large: means of shape ", means_shape,
                    " would have more than 2**63 - 1 elements");
  check_fits_in_memory(features, num_classes, means_shape);
}

// Per client k: counts[k, c], and (where order is not null) order[k, :] = the sample indices
// grouped by class (each class's samples in sample order) with start[k, c] the first position
// of class c.  Checks the labels: ValueError naming the first one (in sample order, client by
// client, whatever the threads) outside [0, C), as the reference (ops/class_means.py).
template <typename label_t>
void sort_by_class(const label_t* labels, int64_t slk, int64_t sln, int64_t K, int64_t N, int64_t C,
                   int64_t* counts, int64_t* start, int64_t* order, bool batched) {
  std::vector<int64_t> bad(K, -1);  // per client, the first sample with a bad label
  at::parallel_for(0, K, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(N, 1)), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const label_t* l = labels + k * slk;
      int64_t* cnt = counts + k * C;
      for (int64_t n = 0; n < N && bad[k] < 0; ++n) {
        const int64_t c = static_cast<int64_t>(l[n * sln]);
        if (c < 0 || c >= C) {
          bad[k] = n;
        } else {
          ++cnt[c];
        }
      }
      if (order == nullptr || bad[k] >= 0) continue;
      int64_t* st = start + k * C;
      int64_t pos = 0;
      for (int64_t c = 0; c < C; ++c) {
        st[c] = pos;
        pos += cnt[c];
      }
      std::vector<int64_t> next(st, st + C);
      int64_t* ord = order + k * N;
      for (int64_t n = 0; n < N; ++n) ord[next[static_cast<int64_t>(l[n * sln])]++] = n;
    }
  });
  for (int64_t k = 0; k < K; ++k) {
    if (bad[k] < 0) continue;
    const int64_t n = bad[k], c = static_cast<int64_t>(labels[k * slk + n * sln]);
    if (!batched) TORCH_CHECK_VALUE(false, "labels must be in [0, num_classes=", C, "), got labels[", n, "] = ", c);
    TORCH_CHECK_VALUE(false, "labels must be in [0, num_classes=", C, "), got labels[", k, ", ", n, "] = ", c);
  }
}

// Accumulator floats of one streaming task: C x run stays in L2 (256 KiB).
constexpr int64_t kStreamAcc = 1 << 16;
// The shortest run of D a streaming task reads per row (shorter runs waste prefetched lines);
// where even that run's accumulators do not fit (huge C), the gather path runs.
constexpr int64_t kMinRun = 64;
// Blocks of a streaming pass: kTotalBlocks over all clients (enough tasks for the threads
// when K is small; one block per client from K = kTotalBlocks on), of kMinBlockRows rows at
// least.  They depend on K and N only, never on the thread count, and their partial sums
// (K x blocks x C x D floats, at most about kTotalBlocks x C x D) are little next to the
// K x N x D features.
constexpr int64_t kMinBlockRows = 1024;
constexpr int64_t kTotalBlocks = 16;
// Rows ahead whose first cache lines are prefetched (gather: the rows of a class are scattered).
constexpr int64_t kPrefetchRows = 4;
// Columns of one gather task at least (when D is split because there are few classes).
constexpr int64_t kMinColumns = 64;

using cpu::load_as;

// Tasks of `units` (independent units of work) split into runs of D (no shorter than
// min_width) so that the threads have about 4 tasks each; returns the run width (a multiple of
// 16 unless it is D).
int64_t run_width(int64_t units, int64_t D, int64_t min_width) {
  const int64_t want_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t runs = units >= want_tasks ? 1 : (want_tasks + units - 1) / units;
  runs = std::max<int64_t>(1, std::min(runs, D / min_width));
  if (runs == 1) return D;
  return std::min(D, ((D + runs - 1) / runs + 15) / 16 * 16);
}

// The run of D of a streaming task: whole rows where C x D accumulators fit in L2, else the
// widest multiple of 16 that fits; 0 where not even kMinRun fits (the gather path runs).
int64_t stream_width(int64_t D, int64_t C) {
  if (C * D <= kStreamAcc) return D;
  const int64_t fits = kStreamAcc / C / 16 * 16;
  return fits >= kMinRun ? fits : 0;
}

// sums[c, 0:w] (row stride D) = the sum of rows[n, 0:w] (row stride sr) over the n < rows_n
// with l[n sl] = c, in sample order.  -0.0 is the identity of + for every value (-0.0
// included): the sums start there, so each is exactly that of its rows.
template <typename scalar_t, typename label_t, typename acc_t>
C10_ALWAYS_INLINE void add_rows_impl(const scalar_t* rows, int64_t sr, const label_t* l, int64_t sl, int64_t rows_n,
                                     int64_t w, int64_t C, int64_t D, acc_t* sums) {
  for (int64_t c = 0; c < C; ++c) std::fill(sums + c * D, sums + c * D + w, -acc_t(0));
  for (int64_t n = 0; n < rows_n; ++n) {
    acc_t* __restrict ac = sums + static_cast<int64_t>(l[n * sl]) * D;
    const scalar_t* __restrict row = rows + n * sr;
    for (int64_t d = 0; d < w; ++d) ac[d] += load_as<acc_t>(row + d);
  }
}

template <typename scalar_t, typename label_t, typename acc_t>
void add_rows(const scalar_t* rows, int64_t sr, const label_t* l, int64_t sl, int64_t rows_n, int64_t w, int64_t C,
              int64_t D, acc_t* sums) {
  add_rows_impl(rows, sr, l, sl, rows_n, w, C, D, sums);
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define PFL_CLASS_MEANS_AVX2 1
// The same loop in 8-wide vectors (no FMA: the same rounding), chosen where the CPU has AVX2.
template <typename scalar_t, typename label_t, typename acc_t>
__attribute__((target("avx2"))) void add_rows_avx2(const scalar_t* rows, int64_t sr, const label_t* l, int64_t sl,
                                                   int64_t rows_n, int64_t w, int64_t C, int64_t D, acc_t* sums) {
  add_rows_impl(rows, sr, l, sl, rows_n, w, C, D, sums);
}
#endif

// The streaming path: see the top of the file.  `width` is the run of D of one task;
// partial[k, block, c, d] receives each block's sums (means itself when there is one block).
template <typename scalar_t, typename label_t>
void stream_kernel(const scalar_t* f, int64_t sfk, int64_t sfn, const label_t* labels, int64_t slk, int64_t sln,
                   int64_t K, int64_t N, int64_t D, int64_t C, int64_t width, const int64_t* counts,
                   at::opmath_type<scalar_t>* means) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t want_blocks = std::min((N + kMinBlockRows - 1) / kMinBlockRows, (kTotalBlocks + K - 1) / K);
  const int64_t block_rows = (N + want_blocks - 1) / want_blocks;
  const int64_t blocks = (N + block_rows - 1) / block_rows;
  const int64_t runs = (D + width - 1) / width;
  const int64_t tasks = K * blocks * runs;
  std::unique_ptr<acc_t[]> partial_buf(blocks > 1 ? new acc_t[K * blocks * C * D] : nullptr);
  acc_t* partial = blocks > 1 ? partial_buf.get() : means;
  // Small problems on the calling thread: a parallel region costs tens of microseconds.
  const int64_t grain = K * N * D < (1 << 18) ? tasks : 1;
  const bool avx2 = cpu::cpu_has_avx2();
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task % runs, kb = task / runs, k = kb / blocks, blk = kb - k * blocks;
      const int64_t d0 = r * width, w = std::min(width, D - d0);
      const int64_t n0 = blk * block_rows, n1 = std::min(N, n0 + block_rows);
      acc_t* sums = partial + kb * C * D + d0;  // [C, D] of this (client, block), from column d0
      const scalar_t* rows = f + k * sfk + n0 * sfn + d0;
      const label_t* l = labels + k * slk + n0 * sln;
#ifdef PFL_CLASS_MEANS_AVX2
      if (avx2) {
        add_rows_avx2(rows, sfn, l, sln, n1 - n0, w, C, D, sums);
        continue;
      }
#endif
      add_rows(rows, sfn, l, sln, n1 - n0, w, C, D, sums);
    }
  });
  // means = (the blocks' sums added in block order) / counts; classes without samples keep 0.
  // Divide, not multiply by 1/m: the same rounding as the reference's sum / count.
  at::parallel_for(0, K * C, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(blocks * D, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t kc = begin; kc < end; ++kc) {
      const int64_t k = kc / C, c = kc - k * C;
      const int64_t m = counts[kc];
      acc_t* __restrict out = means + kc * D;
      if (m == 0) {
        std::fill(out, out + D, acc_t(0));
        continue;
      }
      const acc_t cm = static_cast<acc_t>(m);
      if (blocks == 1) {
        for (int64_t d = 0; d < D; ++d) out[d] = out[d] / cm;
        continue;
      }
      const acc_t* p = partial + (k * blocks * C + c) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = p[d];
      for (int64_t blk = 1; blk < blocks; ++blk) {
        const acc_t* __restrict q = p + blk * C * D;
        for (int64_t d = 0; d < D; ++d) out[d] += q[d];
      }
      for (int64_t d = 0; d < D; ++d) out[d] = out[d] / cm;
    }
  });
}

// The gather path: see the top of the file.
template <typename scalar_t>
void gather_kernel(const scalar_t* f, int64_t sfk, int64_t sfn, int64_t K, int64_t N, int64_t D, int64_t C,
                   const int64_t* counts, const int64_t* start, const int64_t* order,
                   at::opmath_type<scalar_t>* means) {
  using acc_t = at::opmath_type<scalar_t>;
  // Split D into runs only when (client, class) pairs are too few for the threads; the split
  // changes nothing in the sums (each element is still summed in sample order).
  const int64_t pairs = K * C;
  const int64_t width = run_width(pairs, D, kMinColumns);
  const int64_t runs = (D + width - 1) / width;
  const int64_t tasks = pairs * runs;
  const int64_t grain = K * N * D < (1 << 18) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
    std::unique_ptr<acc_t[]> acc(new acc_t[width]);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t pair = task / runs, r = task - pair * runs;
      const int64_t k = pair / C;
      const int64_t d0 = r * width, w = std::min(width, D - d0);
      const int64_t m = counts[pair];
      acc_t* __restrict out = means + pair * D + d0;
      if (m == 0) continue;  // means start at 0
      const int64_t* ids = order + k * N + start[pair];
      const scalar_t* base = f + k * sfk + d0;
      acc_t* __restrict a = acc.get();
      {
        const scalar_t* __restrict row = base + ids[0] * sfn;
        for (int64_t d = 0; d < w; ++d) a[d] = load_as<acc_t>(row + d);
      }
      for (int64_t j = 1; j < m; ++j) {
        if (j + kPrefetchRows < m) {
          const char* ahead = reinterpret_cast<const char*>(base + ids[j + kPrefetchRows] * sfn);
          for (int64_t off = 0; off < w * static_cast<int64_t>(sizeof(scalar_t)); off += 64) {
            __builtin_prefetch(ahead + off);
          }
        }
        const scalar_t* __restrict row = base + ids[j] * sfn;
        for (int64_t d = 0; d < w; ++d) a[d] += load_as<acc_t>(row + d);
      }
      const acc_t cm = static_cast<acc_t>(m);
      for (int64_t d = 0; d < w; ++d) out[d] = a[d] / cm;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> class_means_cpu(const at::Tensor& features, const at::Tensor& labels,
                                                   int64_t num_classes) {
  check_args(features, labels, num_classes);
  const bool batched = features.dim() == 3;
  const int64_t K = batched ? features.size(0) : 1, N = features.size(-2), D = features.size(-1);
  const int64_t C = num_classes;
  const at::ScalarType acc_type = features.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  std::vector<int64_t> means_shape = {C, D}, counts_shape = {C};
  if (batched) {
    means_shape.insert(means_shape.begin(), K);
    counts_shape.insert(counts_shape.begin(), K);
  }
  at::Tensor means = at::zeros(means_shape, features.options().dtype(acc_type));
  at::Tensor counts = at::zeros(counts_shape, features.options().dtype(at::kLong));
  if (K == 0 || N == 0) return {means, counts};
  // Rows must be contiguous runs of D; the leading strides are kept (a view costs no copy).
  const at::Tensor f = features.stride(-1) == 1 || D == 1 ? features : features.contiguous();
  const int64_t sfn = f.stride(-2), sfk = batched ? f.stride(0) : 0;
  const int64_t slk = batched ? labels.stride(0) : 0, sln = labels.stride(-1);
  const int64_t width = stream_width(D, C);
  std::vector<int64_t> start(K * C);
  std::unique_ptr<int64_t[]> order(width == 0 ? new int64_t[K * N] : nullptr);
  int64_t* cnt = counts.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "class_means_cpu_labels", [&] {
    sort_by_class<index_t>(labels.const_data_ptr<index_t>(), slk, sln, K, N, C, cnt, start.data(), order.get(),
                           batched);
  });
  if (D == 0) return {means, counts};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, features.scalar_type(), "class_means_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    if (width > 0) {
      AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "class_means_cpu_stream", [&] {
        stream_kernel<scalar_t, index_t>(f.const_data_ptr<scalar_t>(), sfk, sfn, labels.const_data_ptr<index_t>(),
                                         slk, sln, K, N, D, C, width, cnt, means.data_ptr<acc_t>());
      });
    } else {
      gather_kernel<scalar_t>(f.const_data_ptr<scalar_t>(), sfk, sfn, K, N, D, C, cnt, start.data(), order.get(),
                              means.data_ptr<acc_t>());
    }
  });
  return {means, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("class_means", &class_means_cpu);
}

}  // namespace pfl::cpu_class_means
