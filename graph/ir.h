// conveyor's graph IR: a DAG of ATen operator calls over typed values.
// Torch-free: the planner and the command-line tool read graphs without libtorch.
// The JSON form is documented in docs/formats.md.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::graph {

using ValueId = std::int32_t;
using NodeId = std::int32_t;

/// Current version of the graph JSON document; readers reject newer versions.
inline constexpr int kGraphFormatVersion = 1;

/// What a value is: a tensor or a symbolic scalar.
enum class ValueKind : std::uint8_t { kTensor, kInt, kFloat, kBool };

/// One dimension of a tensor shape: a constant or a symbolic expression ("s0", "2*s0").
struct Dim {
  std::int64_t size = -1;  ///< valid when `symbol` is empty
  std::string symbol;
  bool is_symbolic() const { return !symbol.empty(); }
};

/// A value flowing along graph edges: a tensor or a symbolic scalar (a size, a flag).
struct Value {
  ValueId id = -1;
  ValueKind kind = ValueKind::kTensor;
  std::string dtype;        ///< tensors only: "float32", "int64", ...
  std::vector<Dim> shape;   ///< tensors only
  std::string name;         ///< the capture's name, for messages
  bool requires_grad = false;
};

/// One argument of an operator call, normalized against the operator's schema.
struct Argument {
  /// What the argument holds.
  enum class Kind : std::uint8_t {
    kValue, kInt, kFloat, kBool, kString, kNone, kDtype, kDevice, kLayout, kMemoryFormat, kList
  };
  Kind kind = Kind::kNone;
  ValueId value = -1;       ///< kValue
  std::int64_t int_value = 0;
  double float_value = 0;
  bool bool_value = false;
  std::string text;         ///< kString, kDtype, kDevice, kLayout, kMemoryFormat
  std::vector<Argument> items;  ///< kList

  static Argument of_value(ValueId id) { Argument a; a.kind = Kind::kValue; a.value = id; return a; }
  static Argument of_int(std::int64_t v) { Argument a; a.kind = Kind::kInt; a.int_value = v; return a; }
  static Argument of_float(double v) { Argument a; a.kind = Kind::kFloat; a.float_value = v; return a; }
  static Argument of_bool(bool v) { Argument a; a.kind = Kind::kBool; a.bool_value = v; return a; }
  static Argument none() { return {}; }
  static Argument of_text(Kind k, std::string t) { Argument a; a.kind = k; a.text = std::move(t); return a; }
  static Argument of_list(std::vector<Argument> items) {
    Argument a; a.kind = Kind::kList; a.items = std::move(items); return a;
  }
};

/// Where one schema return goes: a value, a list of values (Tensor[] returns), or nowhere.
struct Return {
  /// Where the return goes.
  enum class Kind : std::uint8_t { kValue, kList, kUnused };
  Kind kind = Kind::kUnused;
  ValueId value = -1;
  std::vector<ValueId> items;  ///< kList; -1 for unused elements
};

/// The namespace used for symbolic-integer arithmetic nodes ("conveyor::sym", overload "mul").
inline constexpr std::string_view kSymOpName = "conveyor::sym";

/// One operator call.
struct Node {
  NodeId id = -1;
  std::string op;        ///< "aten::conv2d", or kSymOpName for size arithmetic
  std::string overload;  ///< "" for the default overload
  std::vector<Argument> args;
  std::vector<Return> returns;
  std::vector<int> mutated_args;  ///< schema `(a!)`: the op writes into these arguments
  std::vector<int> aliased_args;  ///< the first return is a view of these arguments
  std::string source;             ///< the user's source line, "file.py:123"
  std::optional<bool> grad_enabled;  ///< set when captured under torch.set_grad_enabled
  bool nondeterministic_seeded = false;  ///< draws from the RNG (dropout, rand)

  /// "aten::add.Tensor" style name.
  std::string qualified_name() const { return overload.empty() ? op : op + "." + overload; }
};

/// A graph input bound by name to a tensor the model owns.
struct Binding {
  /// What the bound tensor is to the model.
  enum class Kind : std::uint8_t { kParameter, kBuffer, kConstant };
  ValueId value = -1;
  std::string name;  ///< fully-qualified name in the model ("encoder.layer.0.weight")
  Kind kind = Kind::kParameter;
  std::vector<std::string> tied_names;  ///< other names of the same tensor (tied weights)
};

/// A user input of the graph, in flattened call order.
struct Input {
  ValueId value = -1;
  std::string name;
};

/// A whole captured model.
struct Graph {
  int version = kGraphFormatVersion;
  std::map<std::string, std::string> producer;  ///< "conveyor", "torch" versions
  std::vector<Value> values;     ///< indexed by ValueId
  std::vector<Input> inputs;
  std::vector<Binding> bindings;
  std::vector<Node> nodes;       ///< indexed by NodeId, in a topological order
  std::vector<ValueId> outputs;
  std::map<std::string, std::string> symbols;  ///< symbol -> role ("batch")
  /// The sizes a symbol may take where the model's guards bound it (a kernel chosen by size,
  /// a Python branch on it): the graph holds for min <= size <= max only. Absent: unbounded.
  struct Range {
    std::int64_t min = 0, max = std::numeric_limits<std::int64_t>::max();
  };
  std::map<std::string, Range> ranges;  ///< symbol -> range
  std::string extra_json = "{}";  ///< front-end data conveyor carries unchanged (pytree specs)

  /// Parses and validates a graph JSON document.
  static Result<Graph> from_json(std::string_view text);
  /// Serializes to the JSON document described in docs/formats.md.
  std::string to_json() const;
  /// Checks structure: ids, definitions before uses, argument kinds, outputs.
  Status validate() const;

  /// For each value, the node producing it (-1 for inputs and bindings).
  std::vector<NodeId> producers() const;
  /// For each node, the nodes consuming one of its values, ascending, without duplicates.
  std::vector<std::vector<NodeId>> consumers() const;
  /// Value ids a node reads (arguments, flattened through lists), in argument order.
  static std::vector<ValueId> node_inputs(const Node& node);
  /// Value ids a node defines, in return order.
  static std::vector<ValueId> node_outputs(const Node& node);
};

std::string_view value_kind_name(ValueKind kind);

}  // namespace conveyor::graph
