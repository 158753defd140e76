// Autograd of pfl::relu_max_pool2d and pfl::relu_max_pool2d_backward in C++, for every device
// (the Autograd alias key): gradients of every order and forward mode.
//
// The same formulas are registered from Python (pfl_kernels/ops/pool.py) when this extension
// is not loaded.  Doing it here keeps the Python autograd layer out of every training step:
// with two clients training on two threads, that layer's Python work is serialized by the
// GIL and cost a LeNet-5 round more than the fused kernel saved.
//
// The backward scatters grad to each window's offset: linear in grad, with the gather of the
// same offsets as its transpose (gather_windows), which is also the forward's tangent map.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/clamp_max.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "node_helpers.h"
#include "op_node.h"

#include <string>
#include <tuple>
#include <vector>

namespace pfl::autograd_pool {  // one namespace per file: setup.py's unity build compiles files together
namespace {

using autograd::variable_list;

using ForwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&);
using BackwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, c10::SymIntArrayRef);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pfl::relu_max_pool2d", "").typed<ForwardSig>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pfl::relu_max_pool2d_backward", "").typed<BackwardSig>();
  return op;
}

// [N, C, OH, OW]: t [N, C, H, W] at each window's offset, 0 where the offset is closed (4).
// The transpose of the backward's scatter (ref.gather_windows in pfl_kernels/reference/pool.py).
at::Tensor gather_windows(const at::Tensor& t, const at::Tensor& offsets) {
  const auto n = offsets.sym_size(0), c = offsets.sym_size(1), oh = offsets.sym_size(2), ow = offsets.sym_size(3);
  if (t.sym_numel() == 0 || offsets.sym_numel() == 0) return at::zeros_symint({n, c, oh, ow}, t.options());
  const at::Tensor k = offsets.to(at::kLong);
  const at::Tensor windows = t.slice_symint(2, 0, oh * 2)
                                 .slice_symint(3, 0, ow * 2)
                                 .reshape_symint({n, c, oh, 2, ow, 2})
                                 .permute({0, 1, 2, 4, 3, 5})
                                 .reshape_symint({n, c, oh, ow, 4});
  const at::Tensor values = windows.gather(-1, at::clamp_max(k, 3).unsqueeze(-1)).squeeze(-1);
  return at::where(at::lt(k, 4), values, at::scalar_tensor(0, t.options()));
}

// ---------------------------------------------------------------- relu_max_pool2d

struct ReluMaxPool2dBackward : public autograd::OpNode<ReluMaxPool2dBackward, 1> {  // saved: offsets
  static variable_list backward(const variable_list& grads, const autograd::Inputs<1>& in,
                                const autograd::Wanted<1>& wanted, const autograd::OpArgs& args) {
    variable_list out(1);
    if (grads[0].defined() && wanted[0]) out[0] = backward_op().call(grads[0], in[0], args.shape);
    return out;
  }
  std::string name() const override { return "ReluMaxPool2dBackward"; }
};

std::tuple<at::Tensor, at::Tensor> relu_max_pool2d_autograd(c10::DispatchKeySet ks, const at::Tensor& input) {
  at::Tensor out, offsets;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(out, offsets) = forward_op().redispatch(ks & c10::after_autograd_keyset, input);
  }
  if (torch::autograd::compute_requires_grad(input)) {
    auto node = autograd::new_node<ReluMaxPool2dBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(input));
    node->saved_[0] = torch::autograd::SavedVariable(offsets, /*is_output=*/false);
    node->args_.shape = {input.sym_size(2), input.sym_size(3)};
    torch::autograd::set_history(out, node);
  }
  const at::Tensor tangent = autograd::tangent_of(input);
  if (tangent.defined()) autograd::set_tangent(out, gather_windows(tangent, offsets));
  return {out, offsets};
}

// ---------------------------------------------------------------- relu_max_pool2d_backward

struct ReluMaxPool2dBackwardBackward : public autograd::OpNode<ReluMaxPool2dBackwardBackward, 1> {  // offsets
  static variable_list backward(const variable_list& grads, const autograd::Inputs<1>& in,
                                const autograd::Wanted<1>& wanted, const autograd::OpArgs&) {
    variable_list out(1);
    if (grads[0].defined() && wanted[0]) out[0] = gather_windows(grads[0], in[0]);
    return out;
  }
  std::string name() const override { return "ReluMaxPool2dBackwardBackward"; }
};

at::Tensor relu_max_pool2d_backward_autograd(c10::DispatchKeySet ks, const at::Tensor& grad,
                                             const at::Tensor& offsets, c10::SymIntArrayRef input_size) {
  at::Tensor grad_input;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    grad_input = backward_op().redispatch(ks & c10::after_autograd_keyset, grad, offsets, input_size);
  }
  if (torch::autograd::compute_requires_grad(grad)) {  // offsets are integers: no gradient
    auto node = autograd::new_node<ReluMaxPool2dBackwardBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(grad));
    node->saved_[0] = torch::autograd::SavedVariable(offsets, /*is_output=*/false);
    node->args_.shape = input_size.vec();
    torch::autograd::set_history(grad_input, node);
  }
  const at::Tensor tangent = autograd::tangent_of(grad);
  if (tangent.defined()) {
    autograd::set_tangent(grad_input, backward_op().call(tangent, autograd::primal_of(offsets), input_size));
  }
  return grad_input;
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, Autograd, m) {
  m.impl("relu_max_pool2d", TORCH_FN(relu_max_pool2d_autograd));
  m.impl("relu_max_pool2d_backward", TORCH_FN(relu_max_pool2d_backward_autograd));
}

}  // namespace pfl::autograd_pool
