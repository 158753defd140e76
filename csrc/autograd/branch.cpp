// Autograd of pfl::branch_combine in C++, for every device (the Autograd alias key).
//
// The same formula is registered from Python (pfl_kernels/ops/branch.py) when this extension
// is not loaded.  Doing it here removes the Python autograd layer from every call: combining
// the branches of a small layer costs a few microseconds, so a Python round trip per call
// would dominate it.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <tuple>

namespace pfl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_forward(const at::Tensor& weights, const at::Tensor& alpha) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pfl::branch_combine", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return op.call(weights, alpha);
}

std::tuple<at::Tensor, at::Tensor> call_backward(const at::Tensor& grad_w, const at::Tensor& weights,
                                                 const at::Tensor& alpha, std::array<bool, 2> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pfl::branch_combine_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, std::array<bool, 2>)>();
  return op.call(grad_w, weights, alpha, output_mask);
}

class BranchCombine : public torch::autograd::Function<BranchCombine> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& weights, const at::Tensor& alpha) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({weights, alpha});
    return call_forward(weights, alpha);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const std::array<bool, 2> output_mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1)};
    auto [grad_weights, grad_alpha] = call_backward(grad_outputs[0], saved[0], saved[1], output_mask);
    // One entry per forward input; undefined where no gradient was asked for.
    return {output_mask[0] ? grad_weights : at::Tensor(), output_mask[1] ? grad_alpha : at::Tensor()};
  }
};

at::Tensor branch_combine_autograd(const at::Tensor& weights, const at::Tensor& alpha) {
  return BranchCombine::apply(weights, alpha);
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, Autograd, m) { m.impl("branch_combine", &branch_combine_autograd); }

}  // namespace pfl
