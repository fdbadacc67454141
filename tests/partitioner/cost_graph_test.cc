#include "partitioner/cost_graph.h"

#include <gtest/gtest.h>

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
  expect_error(with("\"backward_weight_s\": 0.001", "\"backward_weight_s\": 0.5"), "cannot exceed");
  expect_error(with("\"microbatch\": 2", "\"microbatch\": 2, \"min_share\": 0"), "/min_share");
  expect_error(doc.substr(0, 80), "not valid JSON");
  expect_error(with("\"forward_s\": 0.001, \"backward_s\": 0.002,", ""), "missing field 'forward_s'");
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
