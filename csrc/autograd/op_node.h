// OpNode: the graph node that the autograd kernels of csrc/autograd/*.cpp record for one
// call of an op, in the way PyTorch's generated kernels do (a Node with SavedVariables).
//
// The backward is one static function of (incoming gradients, the op's inputs, which
// inputs want a gradient, the op's non-tensor arguments), used both by apply() and, under
// compiled autograd (torch._dynamo.compiled_autograd), as the functional form that is
// proxied into the compiled graph (the protocol of the generated nodes: see "Compiled
// Autograd and backward functions" in torch/csrc/dynamo/compiled_autograd.h).  It only
// calls ops through the dispatcher, all of which have fake kernels, so it traces.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <array>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace pfl {
namespace autograd {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// The non-tensor arguments a backward needs (each op uses what it has).
struct OpArgs {
  std::vector<c10::SymInt> shape;
  std::string layout;
  std::vector<bool> computed;  // which outputs of a backward op are computed (not placeholders)
};

template <size_t N>
using Inputs = std::array<at::Tensor, N>;
template <size_t N>
using Wanted = std::array<bool, N>;

// Derived must define
//   static variable_list backward(const variable_list& grads, const Inputs<N>& inputs,
//                                 const Wanted<N>& wanted, const OpArgs& args);
// returning one gradient per input (undefined where not wanted), and name().
template <typename Derived, size_t N>
struct OpNode : public torch::autograd::Node {
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    Inputs<N> inputs;
    for (size_t i = 0; i < N; ++i) inputs[i] = saved_[i].unpack();
    return Derived::backward(grads, inputs, wanted(), args_);
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& s : saved_) s.reset_data();
  }

  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    for (const auto& s : saved_) args.collect(s, /*is_output=*/false);
    for (bool w : wanted()) args.collect(w);  // baked into the compiled graph as constants
    args.collect(args_.shape);
    args.collect(args_.layout);
    for (bool c : args_.computed) args.collect(c);
  }

  variable_list apply_with_saved(const variable_list& grads,
                                 torch::dynamo::autograd::SwapSavedVariables& saved) override {
    using torch::dynamo::autograd::IValuePacker;
    for (auto& s : saved_) saved.before(s);
    saved.before(args_.shape);

    std::vector<at::IValue> packed;
    std::vector<at::TypePtr> schema;
    for (const auto& s : saved_) {
      const at::Tensor t = s.unpack();
      packed.push_back(IValuePacker<std::optional<at::Tensor>>::pack(t.defined() ? std::optional(t) : std::nullopt));
      schema.push_back(IValuePacker<std::optional<at::Tensor>>::packed_type());
    }
    const Wanted<N> w = wanted();
    packed.push_back(IValuePacker<std::vector<bool>>::pack(std::vector<bool>(w.begin(), w.end())));
    packed.push_back(IValuePacker<std::vector<c10::SymInt>>::pack(args_.shape));
    packed.push_back(IValuePacker<std::string>::pack(args_.layout));
    packed.push_back(IValuePacker<std::vector<bool>>::pack(args_.computed));
    schema.push_back(IValuePacker<std::vector<bool>>::packed_type());
    schema.push_back(IValuePacker<std::vector<c10::SymInt>>::packed_type());
    schema.push_back(IValuePacker<std::string>::packed_type());
    schema.push_back(IValuePacker<std::vector<bool>>::packed_type());

    const auto output_metadata = IValuePacker<std::vector<std::optional<torch::autograd::InputMetadata>>>::pack(
        torch::dynamo::autograd::get_input_metadata(next_edges()));
    const auto& py = torch::dynamo::autograd::getPyCompilerInterface();
    // Bound once per process (compiled autograd's namespace of functional backwards is), as
    // the generated nodes are.
    static std::mutex bind_mutex;
    static std::string fn_name;
    {
      std::lock_guard<std::mutex> lock(bind_mutex);
      if (fn_name.empty()) {
        fn_name = py->bind_function(saved.get_py_compiler(), "pfl_" + name(), &OpNode::apply_functional, schema);
      }
    }
    variable_list result =
        py->call_function(saved.get_py_compiler(), "apply_functional", fn_name, grads, packed, output_metadata);

    for (auto& s : saved_) saved.after(s);
    saved.after(args_.shape);
    return result;
  }

  std::array<SavedVariable, N> saved_;
  OpArgs args_;

 private:
  Wanted<N> wanted() const {
    Wanted<N> out{};
    for (size_t i = 0; i < N; ++i) out[i] = task_should_compute_output(i);
    return out;
  }

  // The backward from the packed form of apply_with_saved.
  static variable_list apply_functional(const variable_list& grads, const std::vector<at::IValue>& packed) {
    using torch::dynamo::autograd::IValuePacker;
    Inputs<N> inputs;
    for (size_t i = 0; i < N; ++i) inputs[i] = IValuePacker<std::optional<at::Tensor>>::unpack(packed[i]).value_or(at::Tensor());
    const auto w = IValuePacker<std::vector<bool>>::unpack(packed[N]);
    Wanted<N> wanted{};
    for (size_t i = 0; i < N; ++i) wanted[i] = w[i];
    OpArgs args{IValuePacker<std::vector<c10::SymInt>>::unpack(packed[N + 1]),
                IValuePacker<std::string>::unpack(packed[N + 2]),
                IValuePacker<std::vector<bool>>::unpack(packed[N + 3])};
    return Derived::backward(grads, inputs, wanted, args);
  }
};

// How torch owns its graph nodes: by c10::intrusive_ptr in torch 2.13, by std::shared_ptr in
// 2.11 (the declared floor), and set_history takes only that pointer.  Read off
// torch::autograd::Node itself rather than a version number, so any torch between builds too.
constexpr bool kIntrusiveNodes = std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>;

template <typename NodeT>
using NodePtr = std::conditional_t<kIntrusiveNodes, c10::intrusive_ptr<NodeT>, std::shared_ptr<NodeT>>;

// A new, empty node of type NodeT, owned the way this torch's set_history expects.
template <typename NodeT>
NodePtr<NodeT> new_node() {
  if constexpr (kIntrusiveNodes) {
    return c10::make_intrusive<NodeT>();
  } else {
    return std::make_shared<NodeT>();
  }
}

// The node of one call, with edges to and saved copies of `inputs` (tensors or optional
// tensors, in the op's order); null when no input needs a gradient (or grad mode is off).
template <typename NodeT, typename... In>
NodePtr<NodeT> make_node(OpArgs args, const In&... inputs) {
  if (!torch::autograd::compute_requires_grad(inputs...)) return {};
  auto node = new_node<NodeT>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  size_t i = 0;
  ((node->saved_[i++] = SavedVariable(inputs, /*is_output=*/false)), ...);
  node->args_ = std::move(args);
  return node;
}

// Output i of a kernel is input i of `node`; outputs that are not computed (empty
// placeholders) are constants.
template <size_t M>
void set_history(const std::array<at::Tensor, M>& outputs, const std::array<bool, M>& computed,
                 const NodePtr<torch::autograd::Node>& node) {
  for (size_t i = 0; i < M; ++i) {
    if (computed[i]) {
      torch::autograd::set_history(outputs[i], node);
    } else {
      node->add_input_metadata(torch::autograd::Node::undefined_input());
    }
  }
}

}  // namespace autograd
}  // namespace pfl
