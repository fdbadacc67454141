// Small hand-built graphs shared by the graph tests.
#pragma once

#include <string>
#include <vector>

#include "graph/ir.h"

namespace conveyor::graph::testing {

/// Builds graphs node by node; value and node ids follow creation order.
class GraphBuilder {
 public:
  ValueId input(const std::string& name, std::vector<Dim> shape, std::string dtype = "float64");
  ValueId parameter(const std::string& name, std::vector<Dim> shape, std::string dtype = "float64");
  /// Adds `op.overload(args...)` returning one tensor of the given shape.
  ValueId op(const std::string& op, const std::string& overload, std::vector<Argument> args,
             std::vector<Dim> shape, std::vector<int> mutates = {}, std::vector<int> aliases = {});
  void output(ValueId v) { graph_.outputs.push_back(v); }
  Graph build() const { return graph_; }

 private:
  ValueId value(const std::string& name, std::vector<Dim> shape, std::string dtype);
  Graph graph_;
};

Argument v(ValueId id);
Dim sym(const std::string& s);
Dim fixed(std::int64_t n);

/// x[b,4] -> linear(w1[8,4], b1[8]) -> relu -> linear(w2[3,8], b2[3]) -> sum.
Graph mlp_graph();
/// x -> relu, sigmoid -> add -> mul by x (a skip) -> sum: branches and a long edge.
Graph diamond_graph();
/// y = x * 2; y[:, 1:] += 1 through a view; then sum(y) and sum(x): an atomic group.
Graph inplace_view_graph();

}  // namespace conveyor::graph::testing
