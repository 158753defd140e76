// Helpers shared by the argument checks of the CPU kernels (csrc/cpu/*.cpp).
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pfl {
namespace cpu {

// "a, b, c" for the sizes of a shape, as the error messages print them.
inline std::string join(c10::IntArrayRef s) {
  std::string r;
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r;
}

// "[a, b, c]".
inline std::string shape_str(c10::IntArrayRef s) { return "[" + join(s) + "]"; }

// Whether two tensors may share a byte: their address ranges (from the lowest to the highest
// element each can address, any strides) intersect.  Compared by address, not by storage, so
// aliases made through another storage (torch.from_numpy of one array twice, DLPack) count
// too.  Conservative (interleaved tensors count as overlapping), which is what a kernel
// writing one of them while reading the other needs.  pfl_kernels.ops._checks.may_overlap is
// the same test.
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  auto extent = [](const at::Tensor& t) {
    int64_t lo = 0, hi = 1;  // in elements from t's first element, [lo, hi)
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t span = (t.size(d) - 1) * t.stride(d);
      (span < 0 ? lo : hi) += span;
    }
    const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
    const auto e = static_cast<int64_t>(t.element_size());
    return std::pair<uintptr_t, uintptr_t>{base + lo * e, base + hi * e};
  };
  const auto [alo, ahi] = extent(a);
  const auto [blo, bhi] = extent(b);
  return alo < bhi && blo < ahi;
}

// Whether two elements of t share memory, exactly, from its sizes and strides (at::has_internal_overlap
// answers "too hard" for many layouts, e.g. strides [3, 6, 1] for sizes [3, 2, 3]).  The same
// test as pfl_kernels.ops._checks.has_internal_overlap: a sufficient one (each stride beyond
// the span of the smaller ones), then, for the rare layouts it cannot settle, distinct offsets.
inline bool has_internal_overlap(const at::Tensor& t) {
  const at::MemOverlap quick = at::has_internal_overlap(t);
  if (quick != at::MemOverlap::TooHard) return quick == at::MemOverlap::Yes;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;
  bool settled = true;
  for (const auto& [stride, size] : dims) {
    if (stride <= span) {
      settled = false;
      break;
    }
    span += (size - 1) * stride;
  }
  if (settled) return false;
  std::vector<int64_t> offsets{0};
  for (const auto& [stride, size] : dims) {
    std::vector<int64_t> next;
    next.reserve(offsets.size() * size);
    for (const int64_t o : offsets) {
      for (int64_t i = 0; i < size; ++i) next.push_back(o + i * stride);
    }
    offsets.swap(next);
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end();
}

}  // namespace cpu
}  // namespace pfl
