// Selective activation recomputation (docs/design.md, "Recomputation"): runs of cheap
// operators become one autograd node each that keeps only the run's inputs and runs the run
// again when its gradient is asked for; the operators that read parameters keep what they
// save, as in forward().
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>

#include <set>
#include <string_view>
#include <unordered_set>

#include "graph/autocast.h"
#include "graph/compiled_node.h"
#include "graph/executor.h"

namespace conveyor::graph {

namespace {

// Operators cheap to run again whose backward saves tensors: what selective recomputation
// frees. Elementwise math and activations, softmax, dropout, losses, and attention between
// activations (its score matrix grows with the square of the sequence).
bool cheap_and_saving(std::string_view op) {
  static const std::unordered_set<std::string_view> ops = {
      "aten::gelu", "aten::silu", "aten::relu", "aten::leaky_relu", "aten::elu", "aten::selu", "aten::celu",
      "aten::hardtanh", "aten::hardswish", "aten::hardsigmoid", "aten::mish", "aten::softplus", "aten::sigmoid",
      "aten::tanh", "aten::exp", "aten::log", "aten::log1p", "aten::sqrt", "aten::rsqrt", "aten::reciprocal",
      "aten::pow", "aten::mul", "aten::div", "aten::square", "aten::abs", "aten::clamp", "aten::erf", "aten::sin",
      "aten::cos", "aten::minimum", "aten::maximum", "aten::where", "aten::masked_fill", "aten::softmax",
      "aten::log_softmax", "aten::_softmax", "aten::_log_softmax", "aten::dropout", "aten::native_dropout",
      "aten::feature_dropout", "aten::alpha_dropout", "aten::feature_alpha_dropout", "aten::matmul", "aten::bmm",
      "aten::baddbmm", "aten::scaled_dot_product_attention", "aten::cross_entropy_loss", "aten::nll_loss",
      "aten::mse_loss", "aten::norm", "aten::linalg_vector_norm"};
  return ops.count(op) > 0;
}

// Of those, the ones whose backward saves their output rather than their input.
bool saves_output(std::string_view op) {
  static const std::unordered_set<std::string_view> ops = {
      "aten::tanh", "aten::sigmoid", "aten::exp", "aten::sqrt", "aten::rsqrt", "aten::reciprocal", "aten::relu",
      "aten::elu", "aten::selu", "aten::celu", "aten::softmax", "aten::_softmax", "aten::log_softmax",
      "aten::_log_softmax"};
  return ops.count(op) > 0;
}

bool floating(const Value& v) {
  return v.kind == ValueKind::kTensor &&
         (v.dtype.starts_with("float") || v.dtype.starts_with("bfloat") || v.dtype.starts_with("complex"));
}

// A dropout that keeps everything (p = 0, or not training) draws nothing and saves nothing.
bool keeps_all(const Node& n) {
  if (n.op.find("dropout") == std::string::npos || n.args.size() < 3) return false;
  return (n.args[1].kind == Argument::Kind::kFloat && n.args[1].float_value == 0) ||
         (n.args[1].kind == Argument::Kind::kInt && n.args[1].int_value == 0) ||
         (n.args[2].kind == Argument::Kind::kBool && !n.args[2].bool_value);
}

// Which values may require a gradient: those computed (under grad mode) from a trained
// parameter. An operator on none of them saves nothing for a backward.
std::vector<bool> may_require_grad(const Graph& g) {
  std::vector<bool> grad(g.values.size(), false);
  for (const Binding& b : g.bindings) {
    grad[b.value] = b.kind == Binding::Kind::kParameter && g.values[b.value].requires_grad;
  }
  for (const Input& in : g.inputs) grad[in.value] = floating(g.values[in.value]);  // a stage's inputs may
  for (const Node& n : g.nodes) {
    if (n.grad_enabled && !*n.grad_enabled) continue;
    bool any = false;
    for (ValueId v : Graph::node_inputs(n)) any = any || grad[v];
    if (!any) continue;
    for (ValueId v : Graph::node_outputs(n)) grad[v] = floating(g.values[v]);
  }
  return grad;
}

}  // namespace

/// One run of a stage's forward under selective recomputation, and the autograd function
/// that keeps its inputs and runs it again for its backward. Friend of StageProgram and
/// GraphExecutor: it runs their steps.
struct SelectiveSegment {
  /// What the run's autograd node keeps. `program` outlives it: a stage's activations never
  /// outlive the program that made them (runtime/stage_replica.h).
  struct Call : torch::CustomClassHolder {
    const StageProgram* program = nullptr;
    std::size_t segment = 0;
    std::vector<std::pair<ValueId, c10::IValue>> constants;  // inputs that are no tensor
    std::vector<ValueId> tensor_inputs;                     // the function's tensor inputs, in order
    std::optional<SeededGenerators> generators;              // as they were where the run began
    AutocastState autocast;
    std::vector<c10::IValue>* values = nullptr;  // the forward's values (forward only)
    SeededGenerators* live = nullptr;            // the forward's generators (forward only)
    Status status;
  };

  /// The autograd function: forward runs the steps without a graph, backward runs them again
  /// with one and differentiates it.
  struct Function : torch::autograd::Function<Function> {
    static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                  const c10::intrusive_ptr<Call>& call) {
      const StageProgram& p = *call->program;
      const StageProgram::Segment& seg = p.segments_[call->segment];
      std::vector<c10::IValue>& values = *call->values;
      // Which outputs may carry a gradient: those reached from an input that requires one
      // (autograd's rule), floating point only.
      std::set<ValueId> grad_values;
      for (std::size_t i = 0; i < inputs.size(); ++i) {
        if (inputs[i].requires_grad()) grad_values.insert(call->tensor_inputs[i]);
      }
      for (std::size_t s = seg.first; s < seg.last; ++s) {
        const Node& n = *p.executor_->compiled_[p.steps_[s].compiled]->node;
        bool reached = false;
        for (ValueId v : Graph::node_inputs(n)) reached = reached || grad_values.count(v) > 0;
        if (reached) {
          for (ValueId v : Graph::node_outputs(n)) grad_values.insert(v);
        }
      }
      call->status = p.executor_->execute_steps(p.steps_.data() + seg.first, p.steps_.data() + seg.last, values,
                                                call->live);
      torch::autograd::variable_list out(seg.outputs.size());
      if (!call->status.is_ok()) return out;
      std::unordered_set<const c10::TensorImpl*> seen;
      for (const at::Tensor& t : inputs) seen.insert(t.unsafeGetTensorImpl());
      std::vector<at::Tensor> no_grad;
      for (std::size_t k = 0; k < seg.outputs.size(); ++k) {
        const c10::IValue& v = values[seg.outputs[k]];
        if (!v.isTensor() || !v.toTensor().defined()) continue;
        out[k] = v.toTensor();
        // A tensor returned twice (an operator that returned its input) is two outputs of
        // the node: the second becomes an alias of its own.
        if (!seen.insert(out[k].unsafeGetTensorImpl()).second) out[k] = at::alias(out[k]);
        if (!grad_values.count(seg.outputs[k]) || !at::isFloatingType(out[k].scalar_type())) {
          no_grad.push_back(out[k]);
        }
      }
      ctx->save_for_backward(inputs.vec());
      ctx->saved_data["call"] = c10::IValue::make_capsule(call);
      ctx->set_materialize_grads(false);
      if (!no_grad.empty()) ctx->mark_non_differentiable(no_grad);
      call->values = nullptr;
      call->live = nullptr;
      return out;
    }

    static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                   torch::autograd::variable_list grads) {
      auto call = c10::static_intrusive_pointer_cast<Call>(ctx->saved_data["call"].toCapsule());
      const StageProgram& p = *call->program;
      const StageProgram::Segment& seg = p.segments_[call->segment];
      const torch::autograd::variable_list saved = ctx->get_saved_variables();
      std::vector<c10::IValue> values(p.executor_->graph().values.size());
      for (const auto& [v, constant] : call->constants) values[v] = constant;
      torch::autograd::variable_list leaves(saved.size());
      for (std::size_t i = 0; i < saved.size(); ++i) {
        leaves[i] = saved[i].detach();
        if (saved[i].requires_grad()) leaves[i].requires_grad_(true);
        values[call->tensor_inputs[i]] = leaves[i];
      }
      {
        c10::AutoGradMode grad(true);
        AutocastScope autocast(call->autocast);
        std::optional<SeededGenerators> generators;
        if (call->generators) generators.emplace(call->generators->copy());
        Status s = p.executor_->execute_steps(p.steps_.data() + seg.first, p.steps_.data() + seg.last, values,
                                              generators ? &*generators : nullptr);
        TORCH_CHECK(s.is_ok(), "recomputing a stage's cheap operators failed: ", s.message());
      }
      torch::autograd::variable_list outs, out_grads, targets;
      for (std::size_t k = 0; k < seg.outputs.size() && k < grads.size(); ++k) {
        const c10::IValue& v = values[seg.outputs[k]];
        if (!grads[k].defined() || !v.isTensor() || !v.toTensor().requires_grad()) continue;
        outs.push_back(v.toTensor());
        out_grads.push_back(grads[k]);
      }
      std::vector<std::size_t> slot;
      for (std::size_t i = 0; i < leaves.size(); ++i) {
        if (leaves[i].requires_grad()) {
          targets.push_back(leaves[i]);
          slot.push_back(i);
        }
      }
      torch::autograd::variable_list result(saved.size() + 1);  // + the call, no tensor
      if (outs.empty() || targets.empty()) return result;
      torch::autograd::variable_list got = torch::autograd::grad(outs, targets, out_grads, /*retain_graph=*/false,
                                                                 /*create_graph=*/false, /*allow_unused=*/true);
      for (std::size_t j = 0; j < got.size(); ++j) result[slot[j]] = got[j];
      return result;
    }
  };

  /// Runs segment `k` of `program` on `values` as one autograd node.
  static Status run(const StageProgram& program, std::size_t k, std::vector<c10::IValue>& values,
                    SeededGenerators* generators) {
    const StageProgram::Segment& seg = program.segments_[k];
    auto call = c10::make_intrusive<Call>();
    call->program = &program;
    call->segment = k;
    std::vector<at::Tensor> tensors;
    for (ValueId v : seg.inputs) {
      const c10::IValue& value = values[v];
      if (value.isTensor() && value.toTensor().defined()) {
        tensors.push_back(value.toTensor());
        call->tensor_inputs.push_back(v);
      } else {
        call->constants.emplace_back(v, value);
      }
    }
    if (generators != nullptr) call->generators.emplace(generators->copy());
    call->autocast = AutocastState::of_this_thread();
    call->values = &values;
    call->live = generators;
    torch::autograd::variable_list out;
    try {
      out = Function::apply(at::TensorList(tensors), call);
    } catch (const c10::Error& e) {
      return Status(ErrorCode::kExecution, std::string("selective recomputation failed: ") + e.what_without_backtrace());
    }
    CONVEYOR_RETURN_IF_ERROR(call->status);
    for (std::size_t j = 0; j < seg.outputs.size(); ++j) {
      if (out[j].defined()) values[seg.outputs[j]] = out[j];
    }
    return Status::ok();
  }
};

std::vector<StageProgram::Segment> GraphExecutor::plan_segments(const std::vector<NodeId>& nodes,
                                                                const std::vector<StageProgram::Step>& steps) const {
  const Graph& g = graph_;
  const std::vector<ValueId> root = storage_roots(g);
  // Storages the stage writes in place: recomputing around them could see other data.
  const std::set<ValueId> written = written_storages(g, root, nodes);
  const std::vector<bool> grad = may_require_grad(g);
  std::vector<bool> parameter(g.values.size(), false), bound(g.values.size(), false);
  for (const Binding& b : g.bindings) {
    bound[b.value] = true;
    parameter[b.value] = b.kind == Binding::Kind::kParameter;
  }
  auto eligible = [&](const CompiledNode& cn) {
    const Node& n = *cn.node;
    if (cn.sym != SymOp::kNone || !n.mutated_args.empty() || n.grad_enabled || cn.draws == Draws::kGlobalOnly) {
      return false;
    }
    for (const Return& r : n.returns) {
      if (r.kind == Return::Kind::kList) return false;
      if (r.kind == Return::Kind::kValue &&
          (g.values[r.value].kind != ValueKind::kTensor || written.count(root[r.value]))) {
        return false;
      }
    }
    for (ValueId v : Graph::node_inputs(n)) {
      if (parameter[v] || written.count(root[v])) return false;
    }
    return true;
  };
  std::vector<StageProgram::Segment> out;
  std::size_t s = 0;
  while (s < steps.size()) {
    if (!eligible(*compiled_[steps[s].compiled])) {
      ++s;
      continue;
    }
    StageProgram::Segment seg;
    seg.first = s;
    while (s < steps.size() && eligible(*compiled_[steps[s].compiled])) ++s;
    seg.last = s;
    std::set<ValueId> made, released, read;
    for (std::size_t i = seg.first; i < seg.last; ++i) {
      const Node& n = *compiled_[steps[i].compiled]->node;
      for (ValueId v : Graph::node_inputs(n)) {
        if (!made.count(v) && !bound[v]) read.insert(v);
      }
      for (ValueId v : Graph::node_outputs(n)) made.insert(v);
      released.insert(steps[i].release.begin(), steps[i].release.end());
    }
    // Worth running again only where it frees something: a cheap operator that saves a
    // floating-point value on storage made and dropped inside the run (the run keeps its
    // inputs, views of them too, and its outputs live on), or attention, which saves its score
    // matrix inside itself. A lone activation between two linear layers, or a dropout and a
    // residual sum after one, saves about what the run would keep anyway.
    auto internal = [&](ValueId v) { return floating(g.values[v]) && made.count(root[v]) && released.count(v); };
    bool frees = false;
    for (std::size_t i = seg.first; i < seg.last && !frees; ++i) {
      const Node& n = *compiled_[steps[i].compiled]->node;
      bool differentiated = false;  // else autograd saves nothing for it
      for (ValueId v : Graph::node_inputs(n)) differentiated = differentiated || grad[v];
      if (!cheap_and_saving(n.op) || keeps_all(n) || !differentiated) continue;
      if (n.op == "aten::scaled_dot_product_attention") frees = true;
      for (ValueId v : saves_output(n.op) ? Graph::node_outputs(n) : Graph::node_inputs(n)) {
        frees = frees || internal(v);
      }
    }
    if (!frees) continue;
    seg.inputs.assign(read.begin(), read.end());
    for (ValueId v : made) {
      if (!released.count(v)) seg.outputs.push_back(v);
    }
    out.push_back(std::move(seg));
  }
  return out;
}

Result<StageActivation> StageProgram::forward_selective(std::vector<c10::IValue> inputs,
                                                        std::optional<std::uint64_t> random_seed) const {
  StageActivation act;
  CONVEYOR_ASSIGN_OR_RETURN(std::vector<c10::IValue> values, bind_inputs(std::move(inputs), act));
  std::optional<SeededGenerators> generators;
  if (random_seed) generators.emplace(*random_seed);
  SeededGenerators* gens = generators ? &*generators : nullptr;
  std::size_t done = 0;
  for (std::size_t k = 0; k < segments_.size(); ++k) {
    const Segment& seg = segments_[k];
    CONVEYOR_RETURN_IF_ERROR(executor_->execute_steps(steps_.data() + done, steps_.data() + seg.first, values, gens));
    // Without a seed a random operator draws from torch's global generators, which a
    // second run cannot replay: such a run keeps its activations.
    bool random = false;
    for (std::size_t s = seg.first; s < seg.last; ++s) {
      random = random || executor_->compiled_[steps_[s].compiled]->draws != Draws::kNone;
    }
    if (random && gens == nullptr) {
      CONVEYOR_RETURN_IF_ERROR(executor_->execute_steps(steps_.data() + seg.first, steps_.data() + seg.last, values, gens));
    } else {
      CONVEYOR_RETURN_IF_ERROR(SelectiveSegment::run(*this, k, values, gens));
    }
    done = seg.last;
  }
  CONVEYOR_RETURN_IF_ERROR(executor_->execute_steps(steps_.data() + done, steps_.data() + steps_.size(), values, gens));
  act.outputs.reserve(boundary_.outputs.size());
  for (ValueId v : boundary_.outputs) act.outputs.push_back(std::move(values[v]));
  return act;
}

std::vector<RecomputedRun> StageProgram::selective_runs() const {
  std::vector<RecomputedRun> out;
  for (const Segment& seg : segments_) {
    RecomputedRun run;
    for (std::size_t s = seg.first; s < seg.last; ++s) run.nodes.push_back(executor_->compiled_[steps_[s].compiled]->node->id);
    run.inputs = seg.inputs;
    out.push_back(std::move(run));
  }
  return out;
}

}  // namespace conveyor::graph
