#include "partitioner/cost_graph.h"

#include <gtest/gtest.h>

#include "../graph/test_graphs.h"
#include "partitioner/planner.h"
#include "random_graphs.h"

namespace conveyor::partitioner {
namespace {

constexpr const char* kDoc = R"({
  "format": "conveyor.op-graph", "version": 1, "name": "tiny", "microbatch": 2,
  "params": [{"name": "w", "bytes": 4096}],
  "ops": [
    {"name": "embed", "forward_s": 0.001, "backward_s": 0.002, "output_bytes": 1024, "params": [0]},
    {"name": "split", "forward_s": 0.001, "backward_s": 0.001, "output_bytes": [512, 256], "inputs": [0]},
    {"name": "join", "forward_s": 0.002, "backward_s": 0.003, "backward_weight_s": 0.001,
     "inputs": [[1, 0], [1, 1], 0], "saved_bytes": 100, "work_bytes": 50}
  ]})";

TEST(CostGraph, ParsesOpGraphsWithSeveralOutputs) {
  auto g = CostGraph::from_json(kDoc);
  ASSERT_TRUE(g.is_ok()) << g.status().to_string();
  EXPECT_EQ(g->name, "tiny");
  EXPECT_EQ(g->microbatch, 2);
  ASSERT_EQ(g->ops.size(), 3u);
  ASSERT_EQ(g->values.size(), 4u);
  EXPECT_EQ(g->ops[2].inputs, (std::vector<int>{1, 2, 0}));
  EXPECT_DOUBLE_EQ(g->values[2].bytes, 256);
  EXPECT_EQ(g->readers()[0], (std::vector<int>{1, 2}));
  auto again = CostGraph::from_json(g->to_json());
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(again->to_json(), g->to_json());
}

TEST(CostGraph, RandomGraphsRoundTrip) {
  for (int seed = 0; seed < 20; ++seed) {
    CostGraph g = testing::random_dag(25, seed);
    for (std::size_t v = seed % 3; v < g.values.size(); v += 4) g.values[v].redistributable = false;
    ASSERT_TRUE(g.validate().is_ok());
    auto again = CostGraph::from_json(g.to_json());
    ASSERT_TRUE(again.is_ok()) << again.status().to_string();
    EXPECT_EQ(again->to_json(), g.to_json());
  }
}

void expect_error(const std::string& doc, const std::string& needle) {
  auto g = CostGraph::from_json(doc);
  ASSERT_FALSE(g.is_ok()) << doc;
  EXPECT_NE(g.status().message().find(needle), std::string::npos) << g.status().message();
}

TEST(CostGraph, ErrorsNameThePathAndTheFix) {
  std::string doc = kDoc;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string d = doc;
    d.replace(d.find(from), from.size(), to);
    return d;
  };
  expect_error(with("\"inputs\": [0]", "\"inputs\": [2]"), "/ops/1/inputs/0");
  expect_error(with("\"inputs\": [0]", "\"inputs\": [2]"), "topological order");
  expect_error(with("\"forward_s\": 0.002", "\"forward_s\": -1"), "/ops/2/forward_s");
  expect_error(with("\"version\": 1", "\"version\": 7"), "version 7 is not supported");
  expect_error(with("conveyor.op-graph", "conveyor.graph"), "/format");
  expect_error(with("\"params\": [0]", "\"params\": [3]"), "/ops/0/params/0");
  expect_error(with("[1, 1]", "[1, 5]"), "has no output 5");
  expect_error(with("\"inputs\": [0]", "\"inputs\": [0], \"not_redistributable\": [2]"), "/ops/1/not_redistributable/0");
  expect_error(with("\"inputs\": [0]", "\"inputs\": [0], \"not_redistributable\": 1"), "/ops/1/not_redistributable");
  expect_error(with("\"backward_weight_s\": 0.001", "\"backward_weight_s\": 0.5"), "cannot exceed");
  expect_error(with("\"microbatch\": 2", "\"microbatch\": 2, \"min_share\": 0"), "/min_share");
  expect_error(doc.substr(0, 80), "not valid JSON");
  expect_error(with("\"forward_s\": 0.001, \"backward_s\": 0.002,", ""), "missing field 'forward_s'");
}

// x[s0,4] -> linear -> h[s0,8] -> sum over the batch -> [8] -> sum: the [8] depends on the
// batch but has no batch dimension, so no share of it exists to hand between replicas.
graph::Graph summed_over_batch() {
  using graph::Argument;
  using graph::testing::fixed;
  using graph::testing::sym;
  using graph::testing::v;
  graph::testing::GraphBuilder b;
  const graph::ValueId x = b.input("x", {sym("s0"), fixed(4)});
  const graph::ValueId w = b.parameter("w", {fixed(8), fixed(4)});
  const graph::ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(8)});
  const graph::ValueId s =
      b.op("aten::sum", "dim_IntList", {v(h), Argument::of_list({Argument::of_int(0)})}, {fixed(8)});
  const graph::ValueId r = b.op("aten::relu", "", {v(s)}, {fixed(8)});
  b.output(b.op("aten::sum", "", {v(r), Argument::none()}, {}));
  graph::Graph g = b.build();
  g.symbols["s0"] = "batch";
  return g;
}

TEST(CostGraph, AValueWithNoPlainBatchDimensionIsNeverCutWhereReplicasSplitDifferently) {
  const graph::Graph g = summed_over_batch();
  Profile p;
  p.graph_hash = graph_hash(g);
  p.microbatch = 4;
  p.nodes.assign(g.nodes.size(), {1e-3, 2e-3, 1e-3, 10, 20});
  p.value_bytes.assign(g.values.size(), 64);
  auto costs = cost_graph_from_profile(g, p);
  ASSERT_TRUE(costs.is_ok()) << costs.status().to_string();
  const graph::ValueId h = g.nodes[0].returns[0].value, summed = g.nodes[1].returns[0].value;
  auto cost_value_of = [&](graph::ValueId value) {
    for (std::size_t k = 0; k < costs->values.size(); ++k) {
      if (costs->values[k].producer >= 0 && g.nodes[costs->values[k].producer].returns[0].value == value) return k;
    }
    return costs->values.size();
  };
  ASSERT_LT(cost_value_of(h), costs->values.size());
  EXPECT_TRUE(costs->values[cost_value_of(h)].redistributable);
  EXPECT_FALSE(costs->values[cost_value_of(summed)].redistributable);
  auto again = CostGraph::from_json(costs->to_json());
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_FALSE(again->values[cost_value_of(summed)].redistributable);
  // Two ranks of 2 and 1 replicas: the sum over the batch and the relu of it both lack the
  // batch dimension, so the one cut left is after the linear (the cheapest plan would give
  // the ranks of 2 replicas more of the work).
  PlanOptions o;
  o.batch = 8;
  o.microbatches = 2;
  o.ranks = 2;
  o.replicas = {2, 1};
  const Cluster cluster = Cluster::uniform(1, 3, 1e9, 1.0, testing::fast_link(), testing::fast_link());
  auto plan = make_plan(*costs, cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->stages[0].ops, (std::vector<int>{0}));
  o.replicas = {1, 1};  // alike: any cut
  o.max_replicas = 1;
  EXPECT_TRUE(make_plan(*costs, Cluster::uniform(1, 2, 1e9, 1.0, testing::fast_link(), testing::fast_link()), o).is_ok());
}

TEST(Profile, RoundTripsAndChecksItsGraph) {
  Profile p;
  p.graph_hash = "00ff";
  p.device = "cpu";
  p.microbatch = 4;
  p.nodes = {{1e-3, 2e-3, 1e-3, 10, 20}};
  p.value_bytes = {0, 64};
  auto back = Profile::from_json(p.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->to_json(), p.to_json());
  p.value_saved_by = {-1, 0};  // value 1 is in node 0's saved bytes
  back = Profile::from_json(p.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->value_saved_by, p.value_saved_by);
  for (const char* wrong : {"[-1]", "[-1, 1]", "[-1, -2]", "[-1, \"0\"]"}) {
    std::string text = p.to_json();
    const std::string field = "\"value_saved_by\":[-1,0]";
    ASSERT_NE(text.find(field), std::string::npos) << text;
    text.replace(text.find(field), field.size(), std::string("\"value_saved_by\":") + wrong);
    auto refused = Profile::from_json(text);
    ASSERT_FALSE(refused.is_ok()) << wrong;
    EXPECT_NE(refused.status().message().find("/value_saved_by"), std::string::npos) << refused.status().message();
  }
  auto bad = Profile::from_json(R"({"format": "conveyor.profile", "version": 1, "graph_hash": "x", "device": "cpu",
                                    "microbatch": 0, "nodes": [], "value_bytes": []})");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("/microbatch"), std::string::npos);
  // The fixed fraction: kept, and a fraction or refused naming it.
  p.fixed_fraction = 0.4;
  back = Profile::from_json(p.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_DOUBLE_EQ(back->fixed_fraction, 0.4);
  for (const char* wrong : {"1.5", "-0.1", "\"half\""}) {
    std::string text = p.to_json();
    const std::string field = "\"fixed_fraction\":0.4";
    ASSERT_NE(text.find(field), std::string::npos) << text;
    text.replace(text.find(field), field.size(), std::string("\"fixed_fraction\":") + wrong);
    auto refused = Profile::from_json(text);
    ASSERT_FALSE(refused.is_ok()) << wrong;
    EXPECT_NE(refused.status().message().find("/fixed_fraction"), std::string::npos) << refused.status().message();
  }
}

}  // namespace
}  // namespace conveyor::partitioner
