#include "graph/executor.h"

#include <ATen/ops/empty_strided.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cctype>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>

#include "graph/compiled_node.h"

namespace conveyor::graph {

GraphExecutor::~GraphExecutor() = default;

std::set<ValueId> written_storages(const Graph& g, const std::vector<ValueId>& root, const std::vector<NodeId>& nodes) {
  std::set<ValueId> written;
  for (NodeId id : nodes) {
    const Node& n = g.nodes[id];
    for (int a : n.mutated_args) {
      if (a < 0 || a >= static_cast<int>(n.args.size())) continue;
      const Argument& arg = n.args[a];
      if (arg.kind == Argument::Kind::kValue) written.insert(root[arg.value]);
      for (const auto& item : arg.items) {
        if (item.kind == Argument::Kind::kValue) written.insert(root[item.value]);
      }
    }
  }
  return written;
}

namespace {

// torch.export drops a `.contiguous()` whose input was contiguous when it traced, and the
// strides an operator returns can differ at run time (an attention kernel chosen by size or
// threads returns another layout), so a captured `view` may meet a tensor it cannot view. A
// `view` whose storage nothing writes in place runs as `reshape`: the same values, a view
// whenever one is possible, a copy otherwise; only writes through it could tell them apart.
void reshape_unwritten_views(const Graph& g, std::vector<std::unique_ptr<GraphExecutor::CompiledNode>>& compiled) {
  auto reshape = c10::Dispatcher::singleton().findSchema({"aten::reshape", ""});
  if (!reshape) return;
  const std::vector<ValueId> root = storage_roots(g);
  std::vector<NodeId> all(g.nodes.size());
  std::iota(all.begin(), all.end(), 0);
  const std::set<ValueId> written = written_storages(g, root, all);
  for (auto& cn : compiled) {
    const Node& n = *cn->node;
    if (n.op != "aten::view" || !n.overload.empty() || n.returns.size() != 1 ||
        n.returns[0].kind != Return::Kind::kValue || written.count(root[n.returns[0].value])) {
      continue;
    }
    cn->op = *reshape;
  }
}

// A leaf of its own over `t`'s storage, requiring a gradient as `t` does.
at::Tensor own_leaf(const at::Tensor& t) {
  at::Tensor leaf = t.detach();
  if (t.requires_grad()) leaf.requires_grad_(true);
  return leaf;
}

}  // namespace

Result<std::shared_ptr<GraphExecutor>> GraphExecutor::create(Graph graph, TensorMap tensors) {
  return bind(std::move(graph), std::move(tensors), /*check_shapes=*/true);
}

Result<std::shared_ptr<GraphExecutor>> GraphExecutor::bind(Graph graph, TensorMap tensors, bool check_shapes) {
  CONVEYOR_RETURN_IF_ERROR(graph.validate());
  std::shared_ptr<GraphExecutor> ex(new GraphExecutor());
  ex->graph_ = std::move(graph);
  ex->tensors_ = std::move(tensors);
  const Graph& g = ex->graph_;

  std::vector<c10::IValue> bound(g.values.size());
  for (const auto& b : g.bindings) {
    auto it = ex->tensors_.find(b.name);
    if (it == ex->tensors_.end()) {
      return Status(ErrorCode::kInvalidArgument,
                    "the graph needs a tensor named '" + b.name +
                        "' but none was given; pass the model the graph was captured from");
    }
    const at::Tensor& t = it->second;
    const Value& v = g.values[b.value];
    if (check_shapes && !fits_shape(t, v.shape)) {
      return Status(ErrorCode::kInvalidArgument, "tensor '" + b.name + "' has shape " + shape_string(t) +
                                                     " but the graph expects " + shape_string(v.shape));
    }
    if (scalar_type_name(t.scalar_type()) != v.dtype) {
      return Status(ErrorCode::kInvalidArgument, "tensor '" + b.name + "' has dtype " +
                                                     scalar_type_name(t.scalar_type()) +
                                                     " but the graph expects " + v.dtype);
    }
    bound[b.value] = t;
  }

  for (const Node& n : g.nodes) {
    CONVEYOR_ASSIGN_OR_RETURN(auto compiled, compile_node(g, n, bound));
    ex->compiled_.push_back(std::move(compiled));
  }
  reshape_unwritten_views(g, ex->compiled_);
  std::vector<NodeId> all(g.nodes.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<NodeId>(i);
  ex->whole_graph_steps_ = ex->plan_steps(all, g.outputs);
  return ex;
}

std::vector<StageProgram::Step> GraphExecutor::plan_steps(const std::vector<NodeId>& nodes,
                                                          const std::vector<ValueId>& keep) const {
  std::vector<StageProgram::Step> steps;
  std::vector<int> last_use(graph_.values.size(), -1);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = graph_.nodes[nodes[i]];
    for (ValueId v : Graph::node_inputs(n)) last_use[v] = static_cast<int>(i);
    for (ValueId v : Graph::node_outputs(n)) {
      if (last_use[v] < static_cast<int>(i)) last_use[v] = static_cast<int>(i);
    }
  }
  for (ValueId v : keep) last_use[v] = -2;  // never released
  for (const auto& b : graph_.bindings) last_use[b.value] = -2;
  std::vector<std::vector<ValueId>> release(nodes.size());
  for (std::size_t v = 0; v < last_use.size(); ++v) {
    if (last_use[v] >= 0) release[last_use[v]].push_back(static_cast<ValueId>(v));
  }
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    steps.push_back({static_cast<std::size_t>(nodes[i]), std::move(release[i])});
  }
  return steps;
}

Status GraphExecutor::execute(const std::vector<StageProgram::Step>& steps, std::vector<c10::IValue>& values,
                              std::optional<std::uint64_t> random_seed) const {
  std::optional<SeededGenerators> generators;
  if (random_seed) generators.emplace(*random_seed);
  return execute_steps(steps.data(), steps.data() + steps.size(), values, generators ? &*generators : nullptr);
}

Status GraphExecutor::execute_steps(const StageProgram::Step* first, const StageProgram::Step* last,
                                    std::vector<c10::IValue>& values, SeededGenerators* generators) const {
  torch::jit::Stack stack;
  for (const StageProgram::Step* it = first; it != last; ++it) {
    const StageProgram::Step& step = *it;
    const CompiledNode& cn = *compiled_[step.compiled];
    const Node& n = *cn.node;
    stack.clear();
    stack.reserve(cn.args.size());
    for (const auto& a : cn.args) stack.push_back(materialize(a, values));
    const bool seeded = generators != nullptr && cn.draws != Draws::kNone && cn.draws != Draws::kGlobalOnly;
    if (cn.sym != SymOp::kNone) {
      auto r = evaluate_sym(cn.sym, stack);
      if (!r) return r.status().with_context(where(n));
      values[n.returns[0].value] = std::move(r).value();
    } else {
      try {
        std::optional<c10::AutoGradMode> grad_mode;
        if (cn.factory) {
          grad_mode.emplace(false);
        } else if (n.grad_enabled) {
          grad_mode.emplace(*n.grad_enabled);
        }
        if (seeded) {
          call_seeded(cn, stack, *generators);
        } else {
          cn.op->callBoxed(stack);
        }
      } catch (const c10::Error& e) {
        return Status(ErrorCode::kExecution, where(n) + " failed: " + e.what_without_backtrace());
      } catch (const std::exception& e) {
        return Status(ErrorCode::kExecution, where(n) + " failed: " + e.what());
      }
      if (stack.size() != n.returns.size()) {
        return Status(ErrorCode::kExecution, where(n) + " returned " + std::to_string(stack.size()) +
                                                 " values, expected " + std::to_string(n.returns.size()));
      }
      for (std::size_t r = 0; r < n.returns.size(); ++r) {
        const Return& ret = n.returns[r];
        if (ret.kind == Return::Kind::kValue) {
          values[ret.value] = std::move(stack[r]);
        } else if (ret.kind == Return::Kind::kList) {
          auto list = stack[r].toList();
          if (list.size() != ret.items.size()) {
            return Status(ErrorCode::kExecution,
                          where(n) + " returned a list of " + std::to_string(list.size()) +
                              " tensors but the graph was captured with " +
                              std::to_string(ret.items.size()) +
                              "; its length depends on an input size that changed since capture");
          }
          for (std::size_t j = 0; j < ret.items.size(); ++j) {
            if (ret.items[j] >= 0) values[ret.items[j]] = list.get(j);
          }
        }
      }
    }
    for (ValueId v : step.release) values[v] = c10::IValue();
  }
  return Status::ok();
}

namespace {


bool is_plain_symbol(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

// A symbol as the user knows it: its role ("batch", "input_ids dim 1"), else its name.
std::string symbol_name(const Graph& g, const std::string& sym) {
  auto it = g.symbols.find(sym);
  return it != g.symbols.end() ? it->second + " (" + sym + ")" : sym;
}

// The sizes a call may change: every symbol's role, for an error message.
std::string changeable_sizes(const Graph& g) {
  std::string out;
  for (const auto& [sym, role] : g.symbols) out += (out.empty() ? "" : ", ") + role;
  return out.empty() ? "no size may change: the model fixed them all at capture" : "only " + out + " may change";
}

// The user's tensors against what the graph was captured for: every fixed size and dtype,
// one size per symbol across inputs, and the sizes the symbol's range allows (the batch's
// only for the whole batch: a microbatch share is smaller).
Status check_graph_inputs(const Graph& g, const std::vector<c10::IValue>& inputs, bool whole_batch,
                          const std::optional<c10::Device>& device) {
  std::map<std::string, std::pair<std::int64_t, std::size_t>> seen;  // symbol -> (size, input)
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = g.values[g.inputs[i].value];
    const std::string which = "input " + std::to_string(i) + " ('" + g.inputs[i].name + "')";
    if (v.kind == ValueKind::kTensor && !inputs[i].isTensor() && !inputs[i].isNone()) {
      return Status(ErrorCode::kInvalidArgument, which + " is a " + inputs[i].tagKind() +
                                                     " but the graph was captured with a tensor there; pass a tensor");
    }
    if (v.kind != ValueKind::kTensor || !inputs[i].isTensor()) continue;
    const at::Tensor& t = inputs[i].toTensor();
    if (device && t.dim() > 0 && t.device() != *device) {
      return Status(ErrorCode::kInvalidArgument, which + " is on " + t.device().str() + " but the model is on " +
                                                     device->str() + "; move it there (.to(\"" + device->str() +
                                                     "\"))");
    }
    if (!fits_shape(t, v.shape)) {
      return Status(ErrorCode::kInvalidArgument,
                    which + " has shape " + shape_string(t) + " but the graph was captured for " +
                        shape_string(v.shape) +
                        " (" + changeable_sizes(g) + "); pass that shape or capture the model again with this one");
    }
    if (scalar_type_name(t.scalar_type()) != v.dtype) {
      return Status(ErrorCode::kInvalidArgument, which + " has dtype " + scalar_type_name(t.scalar_type()) +
                                                     " but the graph was captured with " + v.dtype +
                                                     "; convert it, or capture the model again with this dtype");
    }
    for (std::size_t d = 0; d < v.shape.size(); ++d) {
      const std::string& sym = v.shape[d].symbol;
      if (!is_plain_symbol(sym)) continue;
      const std::int64_t size = t.size(static_cast<std::int64_t>(d));
      auto [it, fresh] = seen.try_emplace(sym, size, i);
      if (!fresh && it->second.first != size) {
        return Status(ErrorCode::kInvalidArgument,
                      "inputs " + std::to_string(it->second.second) + " and " + std::to_string(i) + " disagree on " +
                          symbol_name(g, sym) + ": " + std::to_string(it->second.first) + " and " +
                          std::to_string(size) + "; the model was captured with these sizes equal, pass them equal");
      }
      const auto role = g.symbols.find(sym);
      if (!fresh || (!whole_batch && role != g.symbols.end() && role->second == "batch")) continue;
      if (auto r = g.ranges.find(sym); r != g.ranges.end() && (size < r->second.min || size > r->second.max)) {
        const bool bounded = r->second.max != std::numeric_limits<std::int64_t>::max();
        return Status(ErrorCode::kInvalidArgument,
                      which + " has " + symbol_name(g, sym) + " = " + std::to_string(size) + " but the graph holds for " +
                          std::to_string(r->second.min) + (bounded ? " to " + std::to_string(r->second.max) : " and more") +
                          " only (the model's guards bound it at capture); pass a size within that range");
      }
    }
  }
  return Status::ok();
}


// What a stage writes in place, through views too: its inputs (by position) and buffer
// bindings (by name). Recomputation must see the inputs as they were and must not update
// the buffers twice.
void find_written(const Graph& g, const std::vector<NodeId>& nodes, const StageBoundary& boundary,
                  std::vector<std::size_t>& inputs, std::vector<std::string>& buffers) {
  const std::vector<ValueId> root = storage_roots(g);
  const std::set<ValueId> written = written_storages(g, root, nodes);
  for (std::size_t i = 0; i < boundary.inputs.size(); ++i) {
    if (written.count(root[boundary.inputs[i]])) inputs.push_back(i);
  }
  for (const auto& b : g.bindings) {
    if (b.kind == Binding::Kind::kBuffer && written.count(root[b.value])) buffers.push_back(b.name);
  }
}

}  // namespace

Status GraphExecutor::check_inputs(const std::vector<c10::IValue>& inputs, bool whole_batch) const {
  if (inputs.size() != graph_.inputs.size()) {
    std::string names;
    for (const auto& in : graph_.inputs) names += (names.empty() ? "" : ", ") + in.name;
    return Status(ErrorCode::kInvalidArgument, "the model takes " + std::to_string(graph_.inputs.size()) +
                                                   " inputs (" + names + ") but got " + std::to_string(inputs.size()));
  }
  // Where the model's tensors are, when they are all on one device (0-dimensional inputs
  // may stay on the host, as torch allows).
  std::optional<c10::Device> device;
  for (const auto& [name, t] : tensors_) {
    if (!t.defined() || t.numel() == 0) continue;  // released across processes
    if (device && *device != t.device()) {
      device.reset();
      break;
    }
    device = t.device();
  }
  return check_graph_inputs(graph_, inputs, whole_batch, device);
}

Result<std::vector<c10::IValue>> GraphExecutor::run(std::vector<c10::IValue> inputs) const {
  CONVEYOR_RETURN_IF_ERROR(check_inputs(inputs));
  std::vector<c10::IValue> values(graph_.values.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) values[graph_.inputs[i].value] = std::move(inputs[i]);
  CONVEYOR_RETURN_IF_ERROR(execute(whole_graph_steps_, values));
  std::vector<c10::IValue> out;
  out.reserve(graph_.outputs.size());
  for (ValueId v : graph_.outputs) out.push_back(values[v]);
  return out;
}

Result<std::shared_ptr<GraphExecutor>> GraphExecutor::replica() const {
  TensorMap copies = tensors_;
  for (const Binding& b : graph_.bindings) {
    auto it = copies.find(b.name);
    if (it == copies.end()) continue;
    at::Tensor& t = it->second;
    const Value& v = graph_.values[b.value];
    if (t.numel() == 0 && !fits_shape(t, v.shape)) {
      // Released in this process (another process holds it, runtime/model_state.h): a
      // placeholder of the graph's shape over one element until it is handed over or
      // released again.
      std::vector<std::int64_t> sizes;
      for (const Dim& d : v.shape) sizes.push_back(d.size);
      const bool grad = t.requires_grad();
      t = at::empty_strided(sizes, std::vector<std::int64_t>(sizes.size(), 0), t.options());
      if (grad) t.requires_grad_(true);
      continue;
    }
    if (b.kind == Binding::Kind::kParameter) {
      t = own_leaf(t);
    } else if (b.kind == Binding::Kind::kBuffer) {
      t = t.detach().clone();
    }
  }
  return create(graph_, std::move(copies));
}

Result<std::shared_ptr<GraphExecutor>> GraphExecutor::with_own_leaves(const std::vector<std::string>& names) const {
  TensorMap tensors = tensors_;  // the same tensors: a change of one's data reaches both
  for (const auto& name : names) {
    auto it = tensors.find(name);
    if (it == tensors.end()) return Status(ErrorCode::kInvalidArgument, "no tensor is bound to '" + name + "'");
    it->second = own_leaf(it->second);
  }
  // Shapes unchecked: they are this executor's tensors, some perhaps released here until
  // the runtime hands them over (runtime/model_state.h).
  return bind(graph_, std::move(tensors), /*check_shapes=*/false);
}

Result<std::shared_ptr<const StageProgram>> GraphExecutor::stage(std::vector<NodeId> nodes) const {
  CONVEYOR_RETURN_IF_ERROR(check_stage(graph_, nodes));
  std::sort(nodes.begin(), nodes.end());
  auto program = std::shared_ptr<StageProgram>(new StageProgram());
  program->executor_ = shared_from_this();
  program->boundary_ = stage_boundary(graph_, nodes);
  program->steps_ = plan_steps(nodes, program->boundary_.outputs);
  program->draws_random_ = std::any_of(nodes.begin(), nodes.end(),
                                       [&](NodeId n) { return graph_.nodes[n].nondeterministic_seeded; });
  find_written(graph_, nodes, program->boundary_, program->inputs_written_, program->buffers_written_);
  program->segments_ = plan_segments(nodes, program->steps_);
  program->nodes_ = std::move(nodes);
  return std::shared_ptr<const StageProgram>(std::move(program));
}

std::vector<NodeId> GraphExecutor::unseeded_random_nodes() const {
  std::vector<NodeId> out;
  for (const auto& cn : compiled_) {
    if (cn->draws == Draws::kGlobalOnly) out.push_back(cn->node->id);
  }
  return out;
}

Result<StageActivation> StageProgram::forward(std::vector<c10::IValue> inputs,
                                              std::optional<std::uint64_t> random_seed) const {
  StageActivation act;
  CONVEYOR_ASSIGN_OR_RETURN(std::vector<c10::IValue> values, bind_inputs(std::move(inputs), act));
  CONVEYOR_RETURN_IF_ERROR(executor_->execute(steps_, values, random_seed));
  act.outputs.reserve(boundary_.outputs.size());
  for (ValueId v : boundary_.outputs) act.outputs.push_back(std::move(values[v]));
  return act;
}

Result<std::vector<c10::IValue>> StageProgram::bind_inputs(std::vector<c10::IValue> inputs,
                                                           StageActivation& act) const {
  if (inputs.size() != boundary_.inputs.size()) {
    return Status(ErrorCode::kInvalidArgument, "the stage takes " + std::to_string(boundary_.inputs.size()) +
                                                   " inputs but got " + std::to_string(inputs.size()));
  }
  std::vector<c10::IValue> values(executor_->graph().values.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    c10::IValue& in = inputs[i];
    if (in.isTensor()) {
      const at::Tensor& t = in.toTensor();
      at::Tensor leaf = t.detach();
      if (t.requires_grad()) leaf.requires_grad_(true);
      in = leaf;
    }
    values[boundary_.inputs[i]] = in;
  }
  act.inputs = std::move(inputs);
  return values;
}

}  // namespace conveyor::graph
