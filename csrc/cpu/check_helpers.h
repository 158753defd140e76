// Helpers shared by the argument checks of the CPU kernels (csrc/cpu/*.cpp).
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>

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

}  // namespace cpu
}  // namespace pfl
