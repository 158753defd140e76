// Helpers shared by the argument checks of the CPU kernels (csrc/cpu/*.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <utility>

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

// Whether two tensors may share a byte: the same storage and intersecting extents (the byte
// range from the lowest to the highest element each can address, any strides).  Conservative
// (interleaved tensors count as overlapping), which is what a kernel writing one of them while
// reading the other needs.
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.storage().is_alias_of(b.storage())) return false;
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

}  // namespace cpu
}  // namespace pfl
