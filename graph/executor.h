// Runs a captured graph, or any valid stage of it, through the ATen dispatcher with
// autograd. Every operator is resolved once when the executor is created.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "graph/ir.h"
#include "graph/partition.h"

namespace conveyor::graph {

/// Tensors bound by fully-qualified name to a graph's parameters, buffers and constants.
using TensorMap = std::unordered_map<std::string, at::Tensor>;

/// The weight-gradient half of a split backward: the autograd roots where the parameter
/// paths leave the input paths, with the gradients captured there (opaque; torch inside).
struct DeferredWeightGradient;

/// A run of operators selective recomputation runs again: its nodes, ascending, and the
/// values it keeps in their stead (those it reads from before it).
struct RecomputedRun {
  std::vector<NodeId> nodes;
  std::vector<ValueId> inputs;
};

/// What a stage keeps between its forward and its backward (one per microbatch in flight).
struct StageActivation {
  std::vector<c10::IValue> inputs;   ///< as the stage saw them: tensors are detached leaves
  std::vector<c10::IValue> outputs;  ///< in StageProgram::outputs() order
  std::shared_ptr<DeferredWeightGradient> deferred;  ///< set by backward_input, used by backward_weight
  /// Set by forward_for_recompute: no autograd graph is kept; recompute() makes it.
  bool needs_recompute = false;
};

class GraphExecutor;
class SeededGenerators;
struct SelectiveSegment;

/// A compiled stage: a convex set of nodes with explicit inputs and outputs.
/// Immutable after creation; forward/backward may run on any thread, one call per activation.
class StageProgram {
 public:
  const std::vector<NodeId>& nodes() const { return nodes_; }
  /// Values the stage needs, ascending: graph inputs or other stages' outputs.
  const std::vector<ValueId>& inputs() const { return boundary_.inputs; }
  /// Values the stage produces for others or for the graph's outputs, ascending.
  const std::vector<ValueId>& outputs() const { return boundary_.outputs; }

  /// Runs the stage. Tensor inputs become fresh autograd leaves (requires_grad kept), so
  /// backward() can hand their gradients to the stage that produced them. With
  /// `random_seed`, random operators (dropout, rand, bernoulli, ...) draw from generators
  /// seeded with it (one per device, made for this call), so their draws depend on the seed
  /// alone, not on what else ran before or beside; without, from torch's global generators
  /// in execution order. Operators that take no generator (GraphExecutor::
  /// unseeded_random_nodes) always draw from the global ones.
  Result<StageActivation> forward(std::vector<c10::IValue> inputs,
                                  std::optional<std::uint64_t> random_seed = std::nullopt) const;

  /// Whether any node of the stage draws random numbers.
  bool draws_random() const { return draws_random_; }

  /// Runs the stage for a backward that recomputes it (activation recomputation): the
  /// autograd graph is dropped as soon as the outputs exist (they keep requires_grad, so
  /// the stages reading them still send gradients back), and the activation keeps only
  /// the stage's inputs (those the stage writes in place as they were before it ran) and
  /// its outputs. Buffers (BatchNorm's running statistics) are updated here, once.
  Result<StageActivation> forward_for_recompute(std::vector<c10::IValue> inputs,
                                                std::optional<std::uint64_t> random_seed = std::nullopt) const;
  /// Runs the stage for selective recomputation: every run of cheap operators that read no
  /// parameter and write nothing in place (elementwise math, activations, softmax, dropout,
  /// attention between activations) that saves tensors for its backward is one autograd
  /// node that keeps only the run's inputs and runs the run again when its gradient is
  /// asked for, with the dropout draws and autocast of its first run. The operators that
  /// read parameters (linear, convolution, norms) keep their activations as forward() does.
  /// backward() and backward_input() then work as after forward(), to the same bits.
  Result<StageActivation> forward_selective(std::vector<c10::IValue> inputs,
                                            std::optional<std::uint64_t> random_seed = std::nullopt) const;
  /// The runs forward_selective recomputes, in execution order (none: it keeps what forward()
  /// keeps).
  std::vector<RecomputedRun> selective_runs() const;

  /// Runs the forward again from what forward_for_recompute kept, with autograd and the
  /// same `random_seed` (the same dropout masks), and leaves the buffers it writes as they
  /// were: `activation` is then what forward() would have made, ready for backward(). The
  /// outputs equal the first forward's bit for bit (same inputs, seed and operators).
  Status recompute(StageActivation& activation, std::optional<std::uint64_t> random_seed = std::nullopt) const;

  /// Backpropagates `output_grads` (None or undefined where an output got no gradient),
  /// accumulating parameter gradients into their live `.grad`; returns the gradients of
  /// the inputs (None where an input needs none). Releases the activation's graph.
  Result<std::vector<c10::IValue>> backward(StageActivation& activation,
                                            std::vector<c10::IValue> output_grads) const;

  /// The first half of a split backward (zero-bubble schedules): computes and returns only
  /// the input gradients, and keeps, in `activation`, the gradients arriving where the
  /// parameter paths branch off the input paths. Only the autograd nodes there keep their
  /// saved tensors; the rest of the graph is released. backward_input then
  /// backward_weight accumulate exactly what backward would.
  Result<std::vector<c10::IValue>> backward_input(StageActivation& activation,
                                                  std::vector<c10::IValue> output_grads) const;
  /// The second half: the parameter gradients, accumulated into their live `.grad`, from
  /// what backward_input kept. Releases the activation's graph.
  Status backward_weight(StageActivation& activation) const;

 private:
  friend class GraphExecutor;
  /// One node of a stage in execution order, and the values dead after it.
  struct Step {
    std::size_t compiled;  ///< index into the executor's compiled nodes
    std::vector<ValueId> release;  ///< values dead after this step
  };
  /// A run of steps forward_selective recomputes: steps [first, last), the values it reads
  /// from before it and those read after it.
  struct Segment {
    std::size_t first = 0, last = 0;
    std::vector<ValueId> inputs, outputs;
  };
  friend struct SelectiveSegment;
  /// The stage's input values as autograd leaves (their gradients are the stage's input
  /// gradients), kept in `act.inputs`.
  Result<std::vector<c10::IValue>> bind_inputs(std::vector<c10::IValue> inputs, StageActivation& act) const;

  std::shared_ptr<const GraphExecutor> executor_;
  std::vector<NodeId> nodes_;
  StageBoundary boundary_;
  std::vector<Step> steps_;
  bool draws_random_ = false;
  std::vector<std::size_t> inputs_written_;     ///< input positions the stage writes in place (through views too)
  std::vector<std::string> buffers_written_;    ///< buffer bindings the stage writes in place
  std::vector<Segment> segments_;               ///< what forward_selective recomputes
};

/// Owns a graph, the tensors bound to it, and every node's resolved operator.
class GraphExecutor : public std::enable_shared_from_this<GraphExecutor> {
 public:
  struct CompiledNode;

  /// Resolves all operators and binds `tensors` by name (shapes and dtypes are checked).
  static Result<std::shared_ptr<GraphExecutor>> create(Graph graph, TensorMap tensors);
  ~GraphExecutor();

  const Graph& graph() const { return graph_; }

  /// Runs the whole graph on the user inputs (flattened, in Graph::inputs order) without
  /// detaching anything: outputs stay connected to parameters and inputs through autograd.
  Result<std::vector<c10::IValue>> run(std::vector<c10::IValue> inputs) const;

  /// The user inputs against the capture, each error naming the input and what to pass: the
  /// count, every fixed size and dtype, one size per symbol across inputs, the device of the
  /// model's tensors, and with `whole_batch` the sizes the batch range allows (a pipeline
  /// checks its replicas' shares against the range instead).
  Status check_inputs(const std::vector<c10::IValue>& inputs, bool whole_batch = true) const;

  /// An executor for another replica of the same graph: parameters share storage with this
  /// executor's (an optimizer step on them reaches every replica) but are separate autograd
  /// leaves with their own `.grad`; buffers are copies (each replica updates its own running
  /// statistics); constants are shared. A tensor released here (0 elements where the graph
  /// has more) gets a placeholder of the graph's shape over one element, until the runtime
  /// hands it over or releases it again.
  Result<std::shared_ptr<GraphExecutor>> replica() const;

  /// An executor of the same graph over the same tensors, except that the parameters
  /// `names` are leaves of its own over the same storage, with their own `.grad`: stages run
  /// through it accumulate those gradients apart from stages run through this one (a tied
  /// weight that several threads and streams of one process read).
  Result<std::shared_ptr<GraphExecutor>> with_own_leaves(const std::vector<std::string>& names) const;

  /// The tensor bound to a binding's name, or nullptr.
  const at::Tensor* tensor(const std::string& name) const {
    auto it = tensors_.find(name);
    return it == tensors_.end() ? nullptr : &it->second;
  }

  /// Compiles the stage made of `nodes` (any order; executed in ascending id order).
  Result<std::shared_ptr<const StageProgram>> stage(std::vector<NodeId> nodes) const;

  /// Nodes that draw random numbers but can take no seeded generator (their operator has
  /// no `generator` argument and is not a dropout conveyor computes itself): they draw
  /// from torch's global generators even under StageProgram::forward's seed.
  std::vector<NodeId> unseeded_random_nodes() const;

 private:
  friend class StageProgram;
  GraphExecutor() = default;
  friend struct SelectiveSegment;
  // create(), with the tensors' shapes checked against the graph or not.
  static Result<std::shared_ptr<GraphExecutor>> bind(Graph graph, TensorMap tensors, bool check_shapes);
  Status execute(const std::vector<StageProgram::Step>& steps, std::vector<c10::IValue>& values,
                 std::optional<std::uint64_t> random_seed = std::nullopt) const;
  /// Runs steps [first, last) on `values`; random operators draw from `generators` (null:
  /// torch's global generators).
  Status execute_steps(const StageProgram::Step* first, const StageProgram::Step* last,
                       std::vector<c10::IValue>& values, SeededGenerators* generators) const;
  /// The runs of `steps` (a stage of `nodes`) that forward_selective recomputes.
  std::vector<StageProgram::Segment> plan_segments(const std::vector<NodeId>& nodes,
                                                   const std::vector<StageProgram::Step>& steps) const;
  std::vector<StageProgram::Step> plan_steps(const std::vector<NodeId>& nodes,
                                             const std::vector<ValueId>& keep) const;

  Graph graph_;
  TensorMap tensors_;
  std::vector<std::unique_ptr<CompiledNode>> compiled_;
  std::vector<StageProgram::Step> whole_graph_steps_;
};

/// at::ScalarType for a dtype name ("float32"), or an error naming the unknown dtype.
Result<at::ScalarType> scalar_type_from_name(std::string_view name);
/// The dtype name conveyor's IR uses for a scalar type ("float32").
std::string scalar_type_name(at::ScalarType type);

}  // namespace conveyor::graph
