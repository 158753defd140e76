// Tensor helpers of the autograd kernels in csrc/autograd/*.cpp: undefined tensors as zeros
// or "not given", and forward-mode tangents.
//
// Each kernel records its graph node (op_node.h) and its tangents the way PyTorch's
// generated autograd kernels do, rather than through torch::autograd::Function: that one
// refuses to run inside torch.func transforms, while a kernel registered for the Autograd
// key that records its own node is what every built-in op is, and functorch runs it at each
// transform's level like theirs.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/csrc/autograd/function.h>

#include <array>
#include <cstddef>
#include <optional>
#include <vector>

namespace pfl {
namespace autograd {

using OptTensor = std::optional<at::Tensor>;
using torch::autograd::variable_list;

// a + b, where an undefined tensor stands for zero (undefined when both are).
inline at::Tensor sum_defined(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined()) return b;
  if (!b.defined()) return a;
  return at::add(a, b);
}

// t where it is defined, else fallback.
inline const at::Tensor& defined_or(const at::Tensor& t, const at::Tensor& fallback) {
  return t.defined() ? t : fallback;
}

inline OptTensor optional_of(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

inline at::Tensor tensor_of(const OptTensor& t) { return t.value_or(at::Tensor()); }

// Forward mode.  Kernels see level 0 only: functorch's jvp gives each level its own wrapper,
// so this is what PyTorch's generated kernels do too.
inline at::Tensor tangent_of(const at::Tensor& t) { return t.defined() ? t._fw_grad(/*level=*/0) : at::Tensor(); }

// The value without its tangent, so that a tangent formula does not carry a tangent itself.
inline at::Tensor primal_of(const at::Tensor& t) {
  return t.defined() && t._fw_grad(/*level=*/0).defined() ? t._fw_primal(/*level=*/0) : t;
}

inline void set_tangent(const at::Tensor& output, const at::Tensor& tangent) {
  if (tangent.defined()) output._set_fw_grad(tangent, /*level=*/0, /*is_inplace_op=*/false);
}

// The incoming gradients of the N outputs of a backward op, where the output is computed
// (the others are empty placeholders and carry nothing).
template <size_t N>
std::array<at::Tensor, N> computed_gradients(const variable_list& grads, const std::vector<bool>& computed) {
  std::array<at::Tensor, N> out;
  for (size_t i = 0; i < N; ++i) {
    if (computed[i] && i < grads.size()) out[i] = grads[i];
  }
  return out;
}

}  // namespace autograd
}  // namespace pfl
