// Helpers shared by the CPU kernels (csrc/cpu/*.cpp) to keep their inner loops vectorizable.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pfl {
namespace cpu {

// Whether the running CPU has AVX2.  The build is portable (no -march): the kernels that gain
// from 8-wide vectors compile their loops a second time for AVX2 and choose at run time.
inline bool cpu_has_avx2() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
#else
  return false;
#endif
}

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

// Conversion of inputs to the accumulation type.  bfloat16 -> float is a 16-bit shift, written
// on the raw bits so that loops of it vectorize (c10's conversion operator kept them scalar).
template <typename A, typename S>
inline A load_as(const S* p) {
  return static_cast<A>(*p);
}

template <>
inline float load_as<float, c10::BFloat16>(const c10::BFloat16* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
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
