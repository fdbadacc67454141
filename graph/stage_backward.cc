// A stage's backward, whole or split in two (zero-bubble schedules): autograd from the
// stage's outputs to its inputs' leaves, and the weight half deferred where the parameter
// paths leave the input paths.
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <unordered_map>
#include <unordered_set>

#include "graph/compiled_node.h"
#include "graph/executor.h"

namespace conveyor::graph {

namespace {

using torch::autograd::Edge;
using AutogradNode = torch::autograd::Node;

/// The stage outputs that get a gradient, with their gradients (shapes checked).
Status backward_roots(const StageActivation& act, const std::vector<c10::IValue>& output_grads,
                      const StageBoundary& boundary, std::vector<at::Tensor>& roots, std::vector<at::Tensor>& grads) {
  if (output_grads.size() != act.outputs.size()) {
    return Status(ErrorCode::kInvalidArgument, "the stage has " + std::to_string(act.outputs.size()) +
                                                   " outputs but got " + std::to_string(output_grads.size()) +
                                                   " gradients");
  }
  for (std::size_t i = 0; i < act.outputs.size(); ++i) {
    if (!act.outputs[i].isTensor() || !output_grads[i].isTensor()) continue;
    const at::Tensor& out = act.outputs[i].toTensor();
    const at::Tensor& grad = output_grads[i].toTensor();
    if (!grad.defined() || !out.requires_grad()) continue;
    if (!grad.sizes().equals(out.sizes())) {
      return Status(ErrorCode::kInvalidArgument,
                    "gradient for stage output " + std::to_string(boundary.outputs[i]) + " has shape " +
                        shape_string(grad) + " but the output has shape " + shape_string(out));
    }
    roots.push_back(out);
    grads.push_back(grad);
  }
  return Status::ok();
}

}  // namespace

struct DeferredWeightGradient {
  torch::autograd::edge_list roots;
  torch::autograd::variable_list grads;
  // The graph between the two halves, held as edges hold nodes: std::shared_ptr up to torch
  // 2.11, c10::intrusive_ptr from 2.15 (found by ./run test --latest).
  std::vector<decltype(Edge::function)> keep_alive;
};

Result<std::vector<c10::IValue>> StageProgram::backward(StageActivation& act,
                                                        std::vector<c10::IValue> output_grads) const {
  std::vector<at::Tensor> roots, grads;
  CONVEYOR_RETURN_IF_ERROR(backward_roots(act, output_grads, boundary_, roots, grads));
  if (!roots.empty()) {
    try {
      torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false);
    } catch (const c10::Error& e) {
      return Status(ErrorCode::kExecution, std::string("stage backward failed: ") + e.what_without_backtrace());
    }
  }
  std::vector<c10::IValue> input_grads;
  input_grads.reserve(act.inputs.size());
  for (const auto& in : act.inputs) {
    if (in.isTensor() && in.toTensor().requires_grad() && in.toTensor().grad().defined()) {
      input_grads.emplace_back(in.toTensor().grad());
    } else {
      input_grads.emplace_back();
    }
  }
  act.inputs.clear();
  act.outputs.clear();
  return input_grads;
}

// The split follows the autograd graph. "Input side" nodes are those from which a stage
// input's gradient accumulator can be reached; everything else reachable from the outputs
// leads only to parameters. The input half runs the engine from the outputs to the input
// accumulators (the engine then skips every output a node does not need, e.g. the weight
// product of a matmul) and captures the gradient arriving at each input-side node that also
// has an edge into the parameter side (a "branch" node). Those edges into the input side are
// then cut, so the weight half, run from the branch nodes with the captured gradients (and
// from outputs that never reach an input), re-executes each branch node for its parameter
// outputs only and never walks the input side again: every parameter gets each path's
// contribution exactly once, shared and tied parameters included.
Result<std::vector<c10::IValue>> StageProgram::backward_input(StageActivation& act,
                                                              std::vector<c10::IValue> output_grads) const {
  namespace ag = torch::autograd;
  std::vector<at::Tensor> roots, grads;
  CONVEYOR_RETURN_IF_ERROR(backward_roots(act, output_grads, boundary_, roots, grads));
  auto deferred = std::make_shared<DeferredWeightGradient>();
  std::vector<c10::IValue> input_grads(act.inputs.size());
  try {
    ag::edge_list input_edges;
    std::vector<std::size_t> input_slot;
    std::unordered_map<const AutogradNode*, bool> input_side;  // node -> reaches a stage input
    for (std::size_t i = 0; i < act.inputs.size(); ++i) {
      if (!act.inputs[i].isTensor() || !act.inputs[i].toTensor().requires_grad()) continue;
      Edge e = ag::impl::gradient_edge(act.inputs[i].toTensor());
      input_side[e.function.get()] = true;
      input_edges.push_back(std::move(e));
      input_slot.push_back(i);
    }
    // The edges hold the nodes (a leaf's accumulator is otherwise only weakly referenced).
    ag::edge_list root_edges;
    for (const at::Tensor& r : roots) root_edges.push_back(ag::impl::gradient_edge(r));
    // Post-order walk from the roots: a node is input-side when one of its children is.
    std::vector<AutogradNode*> order;  // post-order: children before parents
    {
      std::vector<std::pair<AutogradNode*, std::size_t>> stack;
      std::unordered_map<const AutogradNode*, bool> seen;
      for (const Edge& root : root_edges) {
        AutogradNode* fn = root.function.get();
        if (fn == nullptr || seen[fn]) continue;
        seen[fn] = true;
        stack.emplace_back(fn, 0);
        while (!stack.empty()) {
          auto& [node, next] = stack.back();
          if (next < node->num_outputs()) {
            const Edge& e = node->next_edge(next++);
            if (e.is_valid() && !seen[e.function.get()]) {
              seen[e.function.get()] = true;
              stack.emplace_back(e.function.get(), 0);
            }
            continue;
          }
          order.push_back(node);
          stack.pop_back();
        }
      }
    }
    for (AutogradNode* n : order) {
      bool& reaches = input_side[n];
      for (const Edge& e : n->next_edges()) {
        if (e.is_valid() && input_side[e.function.get()]) reaches = true;
      }
    }
    // Branch nodes: input-side with an edge into the parameter side.
    std::vector<AutogradNode*> branches;
    for (AutogradNode* n : order) {
      if (!input_side[n]) continue;
      for (const Edge& e : n->next_edges()) {
        if (e.is_valid() && !input_side[e.function.get()]) {
          branches.push_back(n);
          break;
        }
      }
    }
    ag::edge_list capture = input_edges;
    for (AutogradNode* n : branches) {
      for (std::uint32_t k = 0; k < n->num_inputs(); ++k) capture.emplace_back(n->getptr(), k);
    }
    // Roots on the input side start the input half; the others wait for the weight half.
    ag::edge_list input_roots;
    ag::variable_list input_root_grads;
    for (std::size_t i = 0; i < root_edges.size(); ++i) {
      if (input_side[root_edges[i].function.get()]) {
        input_roots.push_back(root_edges[i]);
        input_root_grads.push_back(grads[i]);
      } else {
        deferred->roots.push_back(root_edges[i]);
        deferred->grads.push_back(grads[i]);
      }
    }
    if (!input_roots.empty()) {
      ag::variable_list captured = ag::Engine::get_default_engine().execute(
          input_roots, input_root_grads, /*keep_graph=*/true, /*create_graph=*/false,
          /*accumulate_grad=*/false, capture);
      for (std::size_t j = 0; j < input_edges.size(); ++j) {
        if (captured[j].defined()) input_grads[input_slot[j]] = captured[j];
      }
      std::size_t c = input_edges.size();
      for (AutogradNode* n : branches) {
        for (std::uint32_t k = 0; k < n->num_inputs(); ++k, ++c) {
          if (!captured[c].defined()) continue;
          deferred->roots.emplace_back(n->getptr(), k);
          deferred->grads.push_back(captured[c]);
        }
      }
    }
    // Free what the weight half will not need, before the cut below drops the references
    // that keep these nodes alive.
    const std::unordered_set<const AutogradNode*> branch_set(branches.begin(), branches.end());
    for (AutogradNode* n : order) {
      if (input_side[n] && !branch_set.count(n)) {
        n->release_variables();
      }
    }
    for (AutogradNode* n : branches) {
      // In place (set_next_edge refuses nodes that have parents; cutting an edge only
      // lowers reachability, so the topological numbers stay valid).
      for (Edge& e : n->next_edges()) {
        if (e.is_valid() && input_side[e.function.get()]) e = Edge();
      }
      deferred->keep_alive.push_back(n->getptr());
    }
    for (const Edge& e : deferred->roots) deferred->keep_alive.push_back(e.function);
  } catch (const c10::Error& e) {
    return Status(ErrorCode::kExecution, std::string("stage backward (input half) failed: ") +
                                             e.what_without_backtrace());
  }
  act.inputs.clear();
  act.outputs.clear();
  act.deferred = std::move(deferred);
  return input_grads;
}

Status StageProgram::backward_weight(StageActivation& act) const {
  if (!act.deferred) {
    return Status(ErrorCode::kInternal, "backward_weight needs the activation backward_input returned");
  }
  std::shared_ptr<DeferredWeightGradient> deferred = std::move(act.deferred);
  if (deferred->roots.empty()) return Status::ok();
  try {
    torch::autograd::Engine::get_default_engine().execute(deferred->roots, deferred->grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false, /*accumulate_grad=*/true);
  } catch (const c10::Error& e) {
    return Status(ErrorCode::kExecution, std::string("stage backward (weight half) failed: ") +
                                             e.what_without_backtrace());
  }
  return Status::ok();
}

}  // namespace conveyor::graph

