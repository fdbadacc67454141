// The executor's compiled form of a node, shared by its translation units (internal to
// graph/): how each stack slot of an operator call is filled (ArgPlan), the resolved operator,
// and how the node draws random numbers (Draws). node_compiler.cc compiles nodes against
// their schemas; seeded_draws.cc runs the random ones from seeded generators; executor.cc
// runs steps of them; stage_backward.cc differentiates a stage.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "graph/executor.h"
#include "graph/ir.h"

namespace conveyor::graph {

/// Symbolic-integer arithmetic of conveyor::sym nodes (size arithmetic left in the graph).
enum class SymOp : std::uint8_t {
  kNone, kAdd, kSub, kMul, kFloorDiv, kTrueDiv, kMod, kNeg, kPow, kEq, kNe, kLt, kLe, kGt, kGe,
  kAnd, kOr, kNot, kMax, kMin, kToFloat, kToInt, kCeil, kFloor, kSqrt,
};

/// How one stack slot of an operator call is filled.
struct ArgPlan {
  /// A literal, a value computed at run time, or a list of either.
  enum class Kind : std::uint8_t { kConstant, kValue, kList };
  /// How a run-time value is converted to what the schema slot holds.
  enum class Convert : std::uint8_t { kNone, kWrapNumber, kToDouble };
  Kind kind = Kind::kConstant;
  Convert convert = Convert::kNone;
  c10::IValue constant;
  ValueId value = -1;
  std::vector<ArgPlan> items;
  c10::TypePtr element_type;
};

/// How a node that draws random numbers is given a seeded generator (StageProgram::forward
/// with a seed): through its own `generator` argument, or by conveyor computing it.
enum class Draws : std::uint8_t {
  kNone,               // draws nothing
  kGeneratorArgument,  // rand, randn, bernoulli, normal, randint, randperm, multinomial, ...
  kGeneratorOverload,  // rand_like, randn_like: their `.generator` overload, generator inserted
  kDropout,            // aten::dropout(input, p, train): input * bernoulli(1 - p) / (1 - p)
  kFeatureDropout,     // aten::feature_dropout: one draw per (sample, channel)
  kAlphaDropout,       // aten::alpha_dropout, feature_alpha_dropout: SELU-preserving
  kFeatureAlphaDropout,
  kNativeDropout,      // aten::native_dropout(input, p, train?): (the output, the mask)
  kAttentionDropout,   // aten::scaled_dot_product_attention with dropout: its math form, mask given
  kGlobalOnly,         // takes no generator and none of the above: torch's global one
};

/// One node, resolved once when the executor is created.
struct GraphExecutor::CompiledNode {
  const Node* node = nullptr;
  std::optional<c10::OperatorHandle> op;
  SymOp sym = SymOp::kNone;
  std::vector<ArgPlan> args;
  Draws draws = Draws::kNone;
  int generator_argument = -1;  // kGeneratorArgument, kGeneratorOverload: its stack slot
  std::optional<c10::OperatorHandle> with_generator;  // kGeneratorOverload; kAttentionDropout: the math form
  // A `*_like` factory (zeros_like, randint_like, ...): run without autograd, as eager's
  // torch.* factories are, so its output never requires grad (randint_like's autograd kernel
  // would otherwise attach a backward that fails).
  bool factory = false;
};

/// The storages (as storage_roots gives them) that `nodes` write in place.
std::set<ValueId> written_storages(const Graph& g, const std::vector<ValueId>& root, const std::vector<NodeId>& nodes);
/// "node 3 (aten::add.Tensor, from model.py:12)": how errors name a node.
std::string where(const Node& n);
/// Compiles node `n` of `g` against its operator's schema; `bound` holds the tensors bound to
/// parameters, buffers and constants (None for every other value).
Result<std::unique_ptr<GraphExecutor::CompiledNode>> compile_node(const Graph& g, const Node& n,
                                                                  const std::vector<c10::IValue>& bound);
/// The stack slot `p` describes, filled from the values computed so far.
c10::IValue materialize(const ArgPlan& p, const std::vector<c10::IValue>& values);
/// The result of a symbolic-integer node on its operands.
Result<c10::IValue> evaluate_sym(SymOp op, const std::vector<c10::IValue>& operands);
/// Whether `t` has the shape's rank and every fixed size of it (symbolic sizes: any).
bool fits_shape(const at::Tensor& t, const std::vector<Dim>& shape);
/// "[2, 3]" for a tensor, "[s0, 3]" for a captured shape.
std::string shape_string(const at::Tensor& t);
std::string shape_string(const std::vector<Dim>& shape);

/// A stage forward's seeded generators: one per device it draws on, each made on first use
/// from the same seed, so its draws depend on the seed and the stage's node order only.
class SeededGenerators {
 public:
  explicit SeededGenerators(std::uint64_t seed) : seed_(seed) {}
  /// The generator for `device`, made on first use.
  at::Generator& on(c10::Device device);
  /// Independent generators in the states these are in now: a recomputed part of a forward
  /// draws from a copy taken where it first ran, so it draws what it drew then.
  SeededGenerators copy() const;

 private:
  std::uint64_t seed_;
  std::map<std::string, at::Generator> made_;
};

/// Runs a node that draws random numbers (cn.draws neither kNone nor kGlobalOnly) with a
/// generator from `generators`: through its generator argument or overload, or computed by
/// conveyor (the dropouts, attention dropout).
void call_seeded(const GraphExecutor::CompiledNode& cn, torch::jit::Stack& stack, SeededGenerators& generators);

}  // namespace conveyor::graph
