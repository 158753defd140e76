// Helpers shared by the CPU kernels (csrc/cpu/*.cpp) to keep their inner loops vectorizable.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pfl {
namespace cpu {

// Runs f(std::true_type) when `unit` (so the compiler sees unit strides and vectorizes), else
// f(std::false_type).
template <typename F>
void with_unit_stride(bool unit, const F& f) {
  if (unit) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// Conversion of results to the output type.  float -> bfloat16 rounds to nearest even like
// c10's, but without its NaN branch in the rounding path, so that loops of it vectorize.
template <typename D, typename S>
inline D cast_to(S x) {
  return static_cast<D>(x);
}

template <>
inline c10::BFloat16 cast_to<c10::BFloat16, float>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(x != x ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}

}  // namespace cpu
}  // namespace pfl
