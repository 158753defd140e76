// Autograd of pfl::factorized_weight and pfl::factorized_weight_backward in C++, for every
// device (the Autograd alias key): gradients of every order and forward mode.
//
// The same formulas are registered from Python (pfl_kernels/ops/factorized.py) when this
// extension is not loaded.  Doing it here removes the Python autograd layer from every
// call: the reconstruction of a small layer (a few hundred elements) costs a few
// microseconds, so a Python round trip per call would dominate it.
//
// W = place(u·v + mu∘mask) is bilinear in the factors and its backward is linear in grad_w
// and bilinear in the factors, so every derivative of either op is again made of the two
// ops: weight_derivative and backward_derivative below, called through the dispatcher so
// that they are differentiable in turn.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "node_helpers.h"
#include "op_node.h"

#include <array>
#include <string>
#include <tuple>
#include <vector>

namespace pfl::autograd_factorized {  // one namespace per file: setup.py's unity build compiles files together
namespace {

using autograd::defined_or;
using autograd::OptTensor;
using autograd::optional_of;
using autograd::sum_defined;
using autograd::tensor_of;
using autograd::variable_list;
using Grads = std::array<at::Tensor, 4>;

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                              c10::SymIntArrayRef, c10::string_view);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    c10::SymIntArrayRef, c10::string_view, std::array<bool, 4>);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pfl::factorized_weight", "").typed<ForwardSig>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("pfl::factorized_weight_backward", "").typed<BackwardSig>();
  return op;
}

Grads as_array(std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>&& t) {
  return {std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t)};
}

// place(du·v + u·dv + dmu∘mask + mu∘dmask): the derivative of factorized_weight at (u, v, mu,
// mask) in the direction (du, dv, dmu, dmask), where undefined is no change; undefined when
// nothing changes.  Also the gradient of the backward op with respect to grad_w.
at::Tensor weight_derivative(const at::Tensor& u, const at::Tensor& v, const at::Tensor& mu, const at::Tensor& mask,
                             const at::Tensor& du, const at::Tensor& dv, const at::Tensor& dmu,
                             const at::Tensor& dmask, c10::SymIntArrayRef shape, c10::string_view layout) {
  at::Tensor sparse;
  if (dmu.defined()) sparse = mask.defined() ? at::mul(dmu, mask) : dmu;
  if (dmask.defined() && mask.defined()) sparse = sum_defined(sparse, at::mul(mu, dmask));
  at::Tensor fu, fv;
  if (du.defined() && dv.defined()) {  // du·v + u·dv as one rank-2r product
    fu = at::cat({du, u}, -1);
    fv = at::cat({v, dv}, -2);
  } else if (du.defined() || dv.defined()) {
    fu = defined_or(du, u);
    fv = defined_or(dv, v);
  } else if (sparse.defined()) {  // place(sparse) alone: a zero rank-r product adds nothing
    fu = u;
    fv = at::zeros_like(v);
  } else {
    return {};
  }
  return forward_op().call(fu, fv, optional_of(sparse), std::nullopt, shape, layout);
}

// The outputs of factorized_weight_backward(grad_w, ...) that vary along (du, dv, dmu, dmask):
// (G·dvᵀ, duᵀ·G, G∘dmask, G∘dmu), undefined where not wanted or constant.  The same products
// are the gradients of the backward op's (u, v, mu, mask) for incoming gradients (du, dv,
// dmu, dmask).
Grads backward_derivative(const at::Tensor& grad_w, const at::Tensor& u, const at::Tensor& v, const at::Tensor& mu,
                          const at::Tensor& mask, const at::Tensor& du, const at::Tensor& dv, const at::Tensor& dmu,
                          const at::Tensor& dmask, const std::array<bool, 4>& wanted, c10::SymIntArrayRef shape,
                          c10::string_view layout) {
  const bool has_mask = mask.defined();
  const std::array<bool, 4> output_mask = {wanted[0] && dv.defined(), wanted[1] && du.defined(),
                                           wanted[2] && has_mask && dmask.defined(),
                                           wanted[3] && has_mask && dmu.defined()};
  Grads out;
  if (!(output_mask[0] || output_mask[1] || output_mask[2] || output_mask[3])) return out;
  Grads grads = as_array(backward_op().call(grad_w, defined_or(du, u), defined_or(dv, v),
                                            optional_of(defined_or(dmu, mu)), optional_of(defined_or(dmask, mask)),
                                            shape, layout, output_mask));
  for (size_t i = 0; i < 4; ++i) {
    if (output_mask[i]) out[i] = grads[i];
  }
  return out;
}

// ---------------------------------------------------------------- factorized_weight

struct FactorizedWeightBackward : public autograd::OpNode<FactorizedWeightBackward, 4> {  // u, v, mu, mask
  static variable_list backward(const variable_list& grads, const autograd::Inputs<4>& in,
                                const autograd::Wanted<4>& wanted, const autograd::OpArgs& args) {
    variable_list out(4);
    if (!grads[0].defined() || !(wanted[0] || wanted[1] || wanted[2] || wanted[3])) return out;
    // An absent mu / mask has no edge, so it is never wanted.
    const Grads g = as_array(backward_op().call(grads[0], in[0], in[1], optional_of(in[2]), optional_of(in[3]),
                                                args.shape, args.layout, wanted));
    for (size_t i = 0; i < 4; ++i) {
      if (wanted[i]) out[i] = g[i];
    }
    return out;
  }
  std::string name() const override { return "FactorizedWeightBackward"; }
};

at::Tensor factorized_weight_autograd(c10::DispatchKeySet ks, const at::Tensor& u, const at::Tensor& v,
                                      const OptTensor& mu, const OptTensor& mask, c10::SymIntArrayRef shape,
                                      c10::string_view layout) {
  auto node = autograd::make_node<FactorizedWeightBackward>({shape.vec(), std::string(layout), {}}, u, v, mu, mask);
  at::Tensor w;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    w = forward_op().redispatch(ks & c10::after_autograd_keyset, u, v, mu, mask, shape, layout);
  }
  if (node) torch::autograd::set_history(w, node);

  const at::Tensor mu_t = tensor_of(mu), mask_t = tensor_of(mask);
  const at::Tensor du = autograd::tangent_of(u), dv = autograd::tangent_of(v), dmu = autograd::tangent_of(mu_t),
                   dmask = autograd::tangent_of(mask_t);
  if (du.defined() || dv.defined() || dmu.defined() || dmask.defined()) {
    autograd::set_tangent(w, weight_derivative(autograd::primal_of(u), autograd::primal_of(v),
                                               autograd::primal_of(mu_t), autograd::primal_of(mask_t), du, dv, dmu,
                                               dmask, shape, layout));
  }
  return w;
}

// ---------------------------------------------------------------- factorized_weight_backward

// grad_w, u, v, mu, mask
struct FactorizedWeightBackwardBackward : public autograd::OpNode<FactorizedWeightBackwardBackward, 5> {
  static variable_list backward(const variable_list& grads, const autograd::Inputs<5>& in,
                                const autograd::Wanted<5>& wanted, const autograd::OpArgs& args) {
    variable_list out(5);
    const Grads d = autograd::computed_gradients<4>(grads, args.computed);
    const auto& [grad_w, u, v, mu, mask] = in;
    if (wanted[0]) out[0] = weight_derivative(u, v, mu, mask, d[0], d[1], d[2], d[3], args.shape, args.layout);
    const Grads rest = backward_derivative(grad_w, u, v, mu, mask, d[0], d[1], d[2], d[3],
                                           {wanted[1], wanted[2], wanted[3], wanted[4]}, args.shape, args.layout);
    for (size_t i = 0; i < 4; ++i) out[i + 1] = rest[i];
    return out;
  }
  std::string name() const override { return "FactorizedWeightBackwardBackward"; }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> factorized_weight_backward_autograd(
    c10::DispatchKeySet ks, const at::Tensor& grad_w, const at::Tensor& u, const at::Tensor& v, const OptTensor& mu,
    const OptTensor& mask, c10::SymIntArrayRef shape, c10::string_view layout, std::array<bool, 4> output_mask) {
  // A gradient is computed where it is asked for and its input is given; the others are
  // empty placeholders (constants).
  const std::array<bool, 4> computed = {output_mask[0], output_mask[1], output_mask[2] && mu.has_value(),
                                        output_mask[3] && mask.has_value()};
  auto node = autograd::make_node<FactorizedWeightBackwardBackward>(
      {shape.vec(), std::string(layout), std::vector<bool>(computed.begin(), computed.end())}, grad_w, u, v, mu, mask);
  Grads out;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    out = as_array(backward_op().redispatch(ks & c10::after_autograd_keyset, grad_w, u, v, mu, mask, shape, layout,
                                            output_mask));
  }
  if (node) autograd::set_history(out, computed, node);

  const at::Tensor mu_t = tensor_of(mu), mask_t = tensor_of(mask);
  const at::Tensor dgrad_w = autograd::tangent_of(grad_w), du = autograd::tangent_of(u),
                   dv = autograd::tangent_of(v), dmu = autograd::tangent_of(mu_t),
                   dmask = autograd::tangent_of(mask_t);
  if (dgrad_w.defined() || du.defined() || dv.defined() || dmu.defined() || dmask.defined()) {
    const at::Tensor gw_p = autograd::primal_of(grad_w), u_p = autograd::primal_of(u), v_p = autograd::primal_of(v),
                     mu_p = autograd::primal_of(mu_t), mask_p = autograd::primal_of(mask_t);
    Grads linear;  // the part along grad_w: the backward op itself
    if (dgrad_w.defined()) {
      linear = as_array(backward_op().call(dgrad_w, u_p, v_p, optional_of(mu_p), optional_of(mask_p), shape, layout,
                                           computed));
      for (size_t i = 0; i < 4; ++i) {
        if (!computed[i]) linear[i] = at::Tensor();
      }
    }
    const Grads along = backward_derivative(gw_p, u_p, v_p, mu_p, mask_p, du, dv, dmu, dmask, computed, shape,
                                            layout);
    for (size_t i = 0; i < 4; ++i) autograd::set_tangent(out[i], sum_defined(linear[i], along[i]));
  }
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_IMPL(pfl, Autograd, m) {
  m.impl("factorized_weight", TORCH_FN(factorized_weight_autograd));
  m.impl("factorized_weight_backward", TORCH_FN(factorized_weight_backward_autograd));
}

}  // namespace pfl::autograd_factorized
