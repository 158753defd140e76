// Autograd of pfl::branch_combine and pfl::branch_combine_backward in C++, for every device
// (the Autograd alias key): gradients of every order and forward mode.
//
// The same formulas are registered from Python (pfl_kernels/ops/branch.py) when this
// extension is not loaded.  Doing it here removes the Python autograd layer from every call:
// combining the branches of a small layer costs a few microseconds, so a Python round trip
// per call would dominate it.
//
// W = Σ_b alpha_b·weights_b is bilinear in (weights, alpha) and its backward is linear in
// grad_w and bilinear in (weights, alpha), so every derivative of either op is again made of
// the two ops: combine_derivative and backward_derivative below, called through the
// dispatcher so that they are differentiable in turn.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "node_helpers.h"
#include "op_node.h"

#include <array>
#include <string>
#include <tuple>

namespace pfl::autograd_branch {  // one namespace per file: setup.py's unity build compiles files together
namespace {

using autograd::defined_or;
using autograd::sum_defined;
using autograd::variable_list;
using Grads = std::array<at::Tensor, 2>;

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&);
using BackwardSig = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       std::array<bool, 2>);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pfl::branch_combine", "").typed<ForwardSig>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pfl::branch_combine_backward", "").typed<BackwardSig>();
  return op;
}

// Σ_b alpha_b·dweights_b + dalpha_b·weights_b: the derivative of branch_combine at (weights,
// alpha) in the direction (dweights, dalpha), where undefined is no change.  Also the
// gradient of the backward op with respect to grad_w.
at::Tensor combine_derivative(const at::Tensor& weights, const at::Tensor& alpha, const at::Tensor& dweights,
                              const at::Tensor& dalpha) {
  return sum_defined(dweights.defined() ? forward_op().call(dweights, alpha) : at::Tensor(),
                     dalpha.defined() ? forward_op().call(weights, dalpha) : at::Tensor());
}

// The outputs of branch_combine_backward(grad_w, ...) that vary along (dweights, dalpha):
// (dalpha_b·grad_w, ⟨grad_w, dweights_b⟩), undefined where not wanted or constant.  The same
// products are the gradients of the backward op's (weights, alpha) for incoming gradients
// (dweights, dalpha).
Grads backward_derivative(const at::Tensor& grad_w, const at::Tensor& weights, const at::Tensor& alpha,
                          const at::Tensor& dweights, const at::Tensor& dalpha, const std::array<bool, 2>& wanted) {
  const std::array<bool, 2> output_mask = {wanted[0] && dalpha.defined(), wanted[1] && dweights.defined()};
  Grads out;
  if (!(output_mask[0] || output_mask[1])) return out;
  auto [gw, ga] = backward_op().call(grad_w, defined_or(dweights, weights), defined_or(dalpha, alpha), output_mask);
  if (output_mask[0]) out[0] = gw;
  if (output_mask[1]) out[1] = ga;
  return out;
}

// ---------------------------------------------------------------- branch_combine

struct BranchCombineBackward : public autograd::OpNode<BranchCombineBackward, 2> {  // weights, alpha
  static variable_list backward(const variable_list& grads, const autograd::Inputs<2>& in,
                                const autograd::Wanted<2>& wanted, const autograd::OpArgs& /*args*/) {
    variable_list out(2);
    if (!grads[0].defined() || !(wanted[0] || wanted[1])) return out;
    auto [gw, ga] = backward_op().call(grads[0], in[0], in[1], wanted);
    if (wanted[0]) out[0] = gw;
    if (wanted[1]) out[1] = ga;
    return out;
  }
  std::string name() const override { return "BranchCombineBackward"; }
};

at::Tensor branch_combine_autograd(c10::DispatchKeySet ks, const at::Tensor& weights, const at::Tensor& alpha) {
  auto node = autograd::make_node<BranchCombineBackward>({}, weights, alpha);
  at::Tensor w;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    w = forward_op().redispatch(ks & c10::after_autograd_keyset, weights, alpha);
  }
  if (node) torch::autograd::set_history(w, node);

  const at::Tensor dweights = autograd::tangent_of(weights), dalpha = autograd::tangent_of(alpha);
  if (dweights.defined() || dalpha.defined()) {
    autograd::set_tangent(w, combine_derivative(autograd::primal_of(weights), autograd::primal_of(alpha), dweights,
                                                dalpha));
  }
  return w;
}

// ---------------------------------------------------------------- branch_combine_backward

// grad_w, weights, alpha
struct BranchCombineBackwardBackward : public autograd::OpNode<BranchCombineBackwardBackward, 3> {
  static variable_list backward(const variable_list& grads, const autograd::Inputs<3>& in,
                                const autograd::Wanted<3>& wanted, const autograd::OpArgs& args) {
    variable_list out(3);
    const Grads d = autograd::computed_gradients<2>(grads, args.computed);
    const auto& [grad_w, weights, alpha] = in;
    if (wanted[0]) out[0] = combine_derivative(weights, alpha, d[0], d[1]);
    const Grads rest = backward_derivative(grad_w, weights, alpha, d[0], d[1], {wanted[1], wanted[2]});
    out[1] = rest[0];
    out[2] = rest[1];
    return out;
  }
  std::string name() const override { return "BranchCombineBackwardBackward"; }
};

std::tuple<at::Tensor, at::Tensor> branch_combine_backward_autograd(c10::DispatchKeySet ks, const at::Tensor& grad_w,
                                                                    const at::Tensor& weights, const at::Tensor& alpha,
                                                                    std::array<bool, 2> output_mask) {
  auto node = autograd::make_node<BranchCombineBackwardBackward>(
      {{}, {}, std::vector<bool>(output_mask.begin(), output_mask.end())}, grad_w, weights, alpha);
  Grads out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [gw, ga] = backward_op().redispatch(ks & c10::after_autograd_keyset, grad_w, weights, alpha, output_mask);
    out = {gw, ga};
  }
  // The empty placeholders of gradients not asked for are constants.
  if (node) autograd::set_history(out, output_mask, node);

  const at::Tensor dgrad_w = autograd::tangent_of(grad_w), dweights = autograd::tangent_of(weights),
                   dalpha = autograd::tangent_of(alpha);
  if (dgrad_w.defined() || dweights.defined() || dalpha.defined()) {
    const at::Tensor gw_p = autograd::primal_of(grad_w), weights_p = autograd::primal_of(weights),
                     alpha_p = autograd::primal_of(alpha);
    Grads linear;  // the part along grad_w: the backward op itself
    if (dgrad_w.defined()) {
      auto [gw, ga] = backward_op().call(dgrad_w, weights_p, alpha_p, output_mask);
      if (output_mask[0]) linear[0] = gw;
      if (output_mask[1]) linear[1] = ga;
    }
    const Grads along = backward_derivative(gw_p, weights_p, alpha_p, dweights, dalpha, output_mask);
    for (size_t i = 0; i < 2; ++i) autograd::set_tangent(out[i], sum_defined(linear[i], along[i]));
  }
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, Autograd, m) {
  m.impl("branch_combine", TORCH_FN(branch_combine_autograd));
  m.impl("branch_combine_backward", TORCH_FN(branch_combine_backward_autograd));
}

}  // namespace pfl::autograd_branch
