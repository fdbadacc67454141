#include "test_graphs.h"

namespace conveyor::graph::testing {

Argument v(ValueId id) { return Argument::of_value(id); }
Dim sym(const std::string& s) { Dim d; d.symbol = s; return d; }
Dim fixed(std::int64_t n) { Dim d; d.size = n; return d; }

ValueId GraphBuilder::value(const std::string& name, std::vector<Dim> shape, std::string dtype) {
  Value val;
  val.id = static_cast<ValueId>(graph_.values.size());
  val.kind = ValueKind::kTensor;
  val.name = name;
  val.shape = std::move(shape);
  val.dtype = std::move(dtype);
  graph_.values.push_back(val);
  return val.id;
}

ValueId GraphBuilder::input(const std::string& name, std::vector<Dim> shape, std::string dtype) {
  ValueId id = value(name, std::move(shape), std::move(dtype));
  graph_.inputs.push_back({id, name});
  return id;
}

ValueId GraphBuilder::parameter(const std::string& name, std::vector<Dim> shape, std::string dtype) {
  ValueId id = value(name, std::move(shape), std::move(dtype));
  graph_.bindings.push_back({id, name, Binding::Kind::kParameter});
  return id;
}

ValueId GraphBuilder::op(const std::string& op, const std::string& overload, std::vector<Argument> args,
                         std::vector<Dim> shape, std::vector<int> mutates, std::vector<int> aliases) {
  ValueId out = value(op + "_" + std::to_string(graph_.nodes.size()), std::move(shape), "float64");
  Node n;
  n.id = static_cast<NodeId>(graph_.nodes.size());
  n.op = op;
  n.overload = overload;
  n.args = std::move(args);
  Return r;
  r.kind = Return::Kind::kValue;
  r.value = out;
  n.returns.push_back(r);
  n.mutated_args = std::move(mutates);
  n.aliased_args = std::move(aliases);
  n.source = "test_graphs.cc:" + std::to_string(n.id);
  graph_.nodes.push_back(std::move(n));
  return out;
}

Graph mlp_graph() {
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w1 = b.parameter("fc1.weight", {fixed(8), fixed(4)});
  ValueId b1 = b.parameter("fc1.bias", {fixed(8)});
  ValueId w2 = b.parameter("fc2.weight", {fixed(3), fixed(8)});
  ValueId b2 = b.parameter("fc2.bias", {fixed(3)});
  ValueId h = b.op("aten::linear", "", {v(x), v(w1), v(b1)}, {sym("s0"), fixed(8)});
  ValueId r = b.op("aten::relu", "", {v(h)}, {sym("s0"), fixed(8)});
  ValueId o = b.op("aten::linear", "", {v(r), v(w2), v(b2)}, {sym("s0"), fixed(3)});
  ValueId s = b.op("aten::sum", "", {v(o), Argument::none()}, {});
  b.output(s);
  Graph g = b.build();
  g.symbols["s0"] = "batch";
  return g;
}

Graph diamond_graph() {
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(4), fixed(4)});
  ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(4)});
  ValueId a = b.op("aten::relu", "", {v(h)}, {sym("s0"), fixed(4)});
  ValueId c = b.op("aten::sigmoid", "", {v(h)}, {sym("s0"), fixed(4)});
  ValueId d = b.op("aten::add", "Tensor", {v(a), v(c), Argument::of_int(1)}, {sym("s0"), fixed(4)});
  ValueId e = b.op("aten::mul", "Tensor", {v(d), v(x)}, {sym("s0"), fixed(4)});
  ValueId s = b.op("aten::sum", "", {v(e), Argument::none()}, {});
  b.output(s);
  return b.build();
}

Graph inplace_view_graph() {
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(4), fixed(4)});
  ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(4)});    // node 0
  ValueId y = b.op("aten::mul", "Tensor", {v(h), Argument::of_int(2)}, {sym("s0"), fixed(4)});   // node 1
  ValueId early = b.op("aten::sum", "", {v(y), Argument::none()}, {});                          // node 2: reads y before the write
  ValueId view = b.op("aten::slice", "Tensor",
                      {v(y), Argument::of_int(1), Argument::of_int(1), Argument::none(), Argument::of_int(1)},
                      {sym("s0"), fixed(3)}, {}, {0});                                          // node 3
  b.op("aten::add_", "Tensor", {v(view), Argument::of_int(1), Argument::of_int(1)}, {sym("s0"), fixed(3)},
       {0}, {0});                                                                               // node 4
  ValueId late = b.op("aten::sum", "", {v(y), Argument::none()}, {});                           // node 5
  ValueId tot = b.op("aten::add", "Tensor", {v(early), v(late), Argument::of_int(1)}, {});      // node 6
  ValueId sq = b.op("aten::mul", "Tensor", {v(tot), v(tot)}, {});                               // node 7
  b.output(sq);
  return b.build();
}

}  // namespace conveyor::graph::testing
