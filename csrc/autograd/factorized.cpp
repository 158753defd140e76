// Autograd of pfl::factorized_weight in C++, for every device (the Autograd alias key).
//
// The same formula is registered from Python (pfl_kernels/ops/factorized.py) when this
// extension is not loaded.  Doing it here removes the Python autograd layer from every
// call: the reconstruction of a small layer (a few hundred elements) costs a few
// microseconds, so a Python round trip per call would dominate it.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>

namespace pfl {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using OptTensor = std::optional<at::Tensor>;

at::Tensor call_forward(const at::Tensor& u, const at::Tensor& v, const OptTensor& mu, const OptTensor& mask,
                        c10::SymIntArrayRef shape, c10::string_view layout) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pfl::factorized_weight", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                                         c10::SymIntArrayRef, c10::string_view)>();
  return op.call(u, v, mu, mask, shape, layout);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_backward(
    const at::Tensor& grad_w, const at::Tensor& u, const at::Tensor& v, const OptTensor& mu, const OptTensor& mask,
    c10::SymIntArrayRef shape, c10::string_view layout, std::array<bool, 4> output_mask) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pfl::factorized_weight_backward", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                           const OptTensor&, c10::SymIntArrayRef, c10::string_view, std::array<bool, 4>)>();
  return op.call(grad_w, u, v, mu, mask, shape, layout, output_mask);
}

OptTensor defined_or_none(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

class FactorizedWeight : public torch::autograd::Function<FactorizedWeight> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& u, const at::Tensor& v, const OptTensor& mu,
                            const OptTensor& mask, c10::SymIntArrayRef shape, c10::string_view layout) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({u, v, mu.value_or(at::Tensor()), mask.value_or(at::Tensor())});
    ctx->saved_data["shape"] = c10::IValue(shape.vec());
    ctx->saved_data["layout"] = std::string(layout);
    return call_forward(u, v, mu, mask, shape, layout);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const OptTensor mu = defined_or_none(saved[2]);
    const OptTensor mask = defined_or_none(saved[3]);
    // needs_input_grad counts only the tensors that were given (None inputs have no edge).
    const std::array<bool, 4> output_mask = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                             mu.has_value() && ctx->needs_input_grad(2),
                                             mask.has_value() && ctx->needs_input_grad(3)};
    const auto shape = ctx->saved_data["shape"].toSymIntVector();
    auto [grad_u, grad_v, grad_mu, grad_mask] =
        call_backward(grad_outputs[0], saved[0], saved[1], mu, mask, shape,
                      ctx->saved_data["layout"].toStringRef(), output_mask);
    // One entry per forward input; undefined where no gradient (or a non-tensor input).
    variable_list grads = {grad_u, grad_v, grad_mu, grad_mask, at::Tensor(), at::Tensor()};
    for (size_t i = 0; i < 4; ++i) {
      if (!output_mask[i]) grads[i] = at::Tensor();
    }
    return grads;
  }
};

at::Tensor factorized_weight_autograd(const at::Tensor& u, const at::Tensor& v, const OptTensor& mu,
                                      const OptTensor& mask, c10::SymIntArrayRef shape, c10::string_view layout) {
  return FactorizedWeight::apply(u, v, mu, mask, shape, layout);
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, Autograd, m) { m.impl("factorized_weight", &factorized_weight_autograd); }

}  // namespace pfl
