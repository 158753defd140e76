// CPU kernel of pfl::class_means (schema in pfl_kernels/ops/class_means.py):
//
//   means[k, c, :] = (1 / n_kc) Σ_{n : labels[k, n] = c} features[k, n, :],  counts[k, c] = n_kc
//
// Two passes.  The first (over the labels only) counts the samples of each class, checks the
// labels and lists each class's samples in sample order (a counting sort).  The second sums
// the rows: a task owns one (client, class, run of D) and adds the class's rows in sample
// order into an accumulator in L1, then scales and writes its run of means once.  Each row is
// a contiguous run of D elements read once (the tasks of one class split D only when there are
// too few classes to keep the threads busy); the next rows are prefetched, since the rows of a
// class are scattered.  No atomics, no partial sums to combine: every mean is summed in sample
// order, so the result does not depend on the thread count.
#include "check_helpers.h"
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace pfl {
namespace {

using cpu::shape_str;

// The checks of _check_op_args in ops/class_means.py (the same wording).
void check_args(const at::Tensor& features, const at::Tensor& labels, int64_t num_classes) {
  TORCH_CHECK(features.dim() == 2 || features.dim() == 3, "features must be [N, D] or [K, N, D], got ",
              shape_str(features.sizes()));
  TORCH_CHECK(labels.dim() == features.dim() - 1 && labels.sizes() == features.sizes().slice(0, features.dim() - 1),
              "labels must have shape ", shape_str(features.sizes().slice(0, features.dim() - 1)),
              " to match features ", shape_str(features.sizes()), ", got ", shape_str(labels.sizes()));
  TORCH_CHECK(at::isFloatingType(features.scalar_type()), "features must be a floating tensor, got ",
              features.scalar_type());
  TORCH_CHECK(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt,
              "labels must be int64 or int32, got ", labels.scalar_type());
  TORCH_CHECK(labels.device() == features.device(), "labels must be on features' device ", features.device(),
              ", got ", labels.device());
  TORCH_CHECK(num_classes >= 1, "num_classes must be >= 1, got ", num_classes);
}

// Per client k: counts[k, c], and order[k, :] = the sample indices grouped by class (each class's
// samples in sample order) with start[k, c] the first position of class c.  Checks the labels.
template <typename label_t>
void sort_by_class(const label_t* labels, int64_t slk, int64_t sln, int64_t K, int64_t N, int64_t C,
                   int64_t* counts, int64_t* start, int64_t* order) {
  at::parallel_for(0, K, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(N, 1)), [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const label_t* l = labels + k * slk;
      int64_t* cnt = counts + k * C;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t c = static_cast<int64_t>(l[n * sln]);
        if (c < 0 || c >= C) {
          if (K == 1 && slk == 0) {
            TORCH_CHECK(false, "labels must be in [0, num_classes=", C, "), got labels[", n, "] = ", c);
          }
          TORCH_CHECK(false, "labels must be in [0, num_classes=", C, "), got labels[", k, ", ", n, "] = ", c);
        }
        ++cnt[c];
      }
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
}

// Rows ahead whose first cache lines are prefetched (the rows of a class are scattered).
constexpr int64_t kPrefetchRows = 4;
// Columns of one task at least (when D is split because there are few classes).
constexpr int64_t kMinColumns = 64;

template <typename scalar_t>
void means_kernel(const scalar_t* f, int64_t sfk, int64_t sfn, int64_t K, int64_t N, int64_t D, int64_t C,
                  const int64_t* counts, const int64_t* start, const int64_t* order,
                  at::opmath_type<scalar_t>* means) {
  using acc_t = at::opmath_type<scalar_t>;
  // Split D into runs only when (client, class) pairs are too few for the threads; the split
  // changes nothing in the sums (each element is still summed in sample order).
  const int64_t pairs = K * C;
  const int64_t want_tasks = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t runs = pairs >= want_tasks ? 1 : (want_tasks + pairs - 1) / pairs;
  runs = std::max<int64_t>(1, std::min(runs, D / kMinColumns));
  const int64_t width = ((D + runs - 1) / runs + 15) / 16 * 16;
  runs = (D + width - 1) / width;
  const int64_t tasks = pairs * runs;
  // Small problems on the calling thread: a parallel region costs tens of microseconds.
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
        for (int64_t d = 0; d < w; ++d) a[d] = static_cast<acc_t>(row[d]);
      }
      for (int64_t j = 1; j < m; ++j) {
        if (j + kPrefetchRows < m) {
          const char* ahead = reinterpret_cast<const char*>(base + ids[j + kPrefetchRows] * sfn);
          for (int64_t off = 0; off < w * static_cast<int64_t>(sizeof(scalar_t)); off += 64) {
            __builtin_prefetch(ahead + off);
          }
        }
        const scalar_t* __restrict row = base + ids[j] * sfn;
        for (int64_t d = 0; d < w; ++d) a[d] += static_cast<acc_t>(row[d]);
      }
      // Divide, not multiply by 1/m: the same rounding as the reference's sum / count.
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
  std::vector<int64_t> start(K * C);
  std::unique_ptr<int64_t[]> order(new int64_t[K * N]);
  int64_t* cnt = counts.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(labels.scalar_type(), "class_means_cpu_labels", [&] {
    sort_by_class<index_t>(labels.const_data_ptr<index_t>(), slk, sln, K, N, C, cnt, start.data(), order.get());
  });
  if (D == 0) return {means, counts};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, features.scalar_type(), "class_means_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    means_kernel<scalar_t>(f.const_data_ptr<scalar_t>(), sfk, sfn, K, N, D, C, cnt, start.data(), order.get(),
                           means.data_ptr<acc_t>());
  });
  return {means, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, CPU, m) {
  m.impl("class_means", &class_means_cpu);
}

}  // namespace pfl
