// What the autograd kernels of csrc/autograd/*.cpp share.
//
// Each kernel records its graph node the way PyTorch's generated autograd kernels do (a
// Node subclass, SavedVariable, set_history, forward-mode tangents at level 0) rather than
// through torch::autograd::Function: that one refuses to run inside torch.func transforms,
// while a kernel registered for the Autograd key and recording its own node is what every
// built-in op is, and functorch runs it at each transform's level like theirs.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <array>
#include <cstddef>
#include <optional>
#include <vector>

namespace pfl {
namespace autograd {

using OptTensor = std::optional<at::Tensor>;
using torch::autograd::SavedVariable;
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

// The first n incoming gradients that belong to outputs that were asked for (the others are
// empty placeholders and carry nothing).
template <size_t N>
std::array<at::Tensor, N> asked_gradients(const variable_list& grads, const std::array<bool, N>& output_mask) {
  std::array<at::Tensor, N> out;
  for (size_t i = 0; i < N; ++i) {
    if (output_mask[i] && i < grads.size()) out[i] = grads[i];
  }
  return out;
}

// Which inputs of `node` the current backward pass wants.
template <size_t N>
std::array<bool, N> wanted_inputs(const torch::autograd::Node& node) {
  std::array<bool, N> out{};
  for (size_t i = 0; i < N; ++i) out[i] = node.task_should_compute_output(i);
  return out;
}

inline const at::Tensor& tensor_or_undefined(const at::Tensor& t) { return t; }
inline at::Tensor tensor_or_undefined(const OptTensor& t) { return tensor_of(t); }

// A graph node that keeps the N inputs of its op (SavedVariable: unpacking checks that they
// were not modified in place since) and frees them once the backward pass is done with them.
template <size_t N>
struct SavedInputsNode : public torch::autograd::Node {
  std::array<at::Tensor, N> unpack_inputs() const {
    std::array<at::Tensor, N> out;
    for (size_t i = 0; i < N; ++i) out[i] = saved_[i].unpack();
    return out;
  }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : saved_) s.reset_data();
  }

  std::array<SavedVariable, N> saved_;
};

// The node of one call, with edges to and saved copies of `inputs` (tensors or optional
// tensors, in the op's order); null when no input needs a gradient (or grad mode is off).
template <typename NodeT, typename... Inputs>
c10::intrusive_ptr<NodeT> make_node(const Inputs&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return {};
  auto node = c10::make_intrusive<NodeT>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  size_t i = 0;
  ((node->saved_[i++] = SavedVariable(tensor_or_undefined(inputs), /*is_output=*/false)), ...);
  return node;
}

// Output i of a kernel is input i of `node`; outputs that are not computed (empty
// placeholders) are constants.
template <size_t N>
void set_history(const std::array<at::Tensor, N>& outputs, const std::array<bool, N>& computed,
                 const c10::intrusive_ptr<torch::autograd::Node>& node) {
  for (size_t i = 0; i < N; ++i) {
    if (computed[i]) {
      torch::autograd::set_history(outputs[i], node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
}

}  // namespace autograd
}  // namespace pfl
