#include "graph/ir.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_graphs.h"

namespace conveyor::graph {
namespace {

using testing::diamond_graph;
using testing::mlp_graph;

TEST(GraphJson, RoundTripsEveryField) {
  Graph g = mlp_graph();
  g.nodes[1].grad_enabled = false;
  g.nodes[2].nondeterministic_seeded = true;
  g.producer["torch"] = "2.11.0";
  auto parsed = Graph::from_json(g.to_json());
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->to_json(), g.to_json());
  EXPECT_EQ(parsed->nodes.size(), 4u);
  EXPECT_EQ(parsed->nodes[0].qualified_name(), "aten::linear");
  EXPECT_EQ(parsed->nodes[1].grad_enabled, std::optional<bool>(false));
  EXPECT_TRUE(parsed->nodes[2].nondeterministic_seeded);
  EXPECT_EQ(parsed->values[0].shape[0].symbol, "s0");
  EXPECT_EQ(parsed->symbols.at("s0"), "batch");
}

TEST(GraphJson, BatchRangesRoundTripAndMalformedOnesNameThePath) {
  Graph g = mlp_graph();
  g.ranges["s0"] = Graph::Range{3, 880801};
  auto parsed = Graph::from_json(g.to_json());
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->ranges.at("s0").min, 3);
  EXPECT_EQ(parsed->ranges.at("s0").max, 880801);
  EXPECT_EQ(parsed->to_json(), g.to_json());

  g.ranges["s0"] = Graph::Range{0, 64};  // only a maximum
  parsed = Graph::from_json(g.to_json());
  ASSERT_TRUE(parsed.is_ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->ranges.at("s0").min, 0);
  EXPECT_EQ(parsed->ranges.at("s0").max, 64);

  std::string text = g.to_json();
  const auto pos = text.find("{\"max\":64}");
  ASSERT_NE(pos, std::string::npos) << text;
  text.replace(pos, 10, "{\"max\":-1}");
  auto bad = Graph::from_json(text);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kFormat);
  EXPECT_NE(bad.status().message().find("/ranges/s0"), std::string::npos) << bad.status().message();
  EXPECT_NE(bad.status().message().find("0 <= min <= max"), std::string::npos) << bad.status().message();
}

TEST(GraphJson, SpecialFloatsSurvive) {
  Graph g = mlp_graph();
  g.nodes[3].args[1] = Argument::of_list({Argument::of_float(-std::numeric_limits<double>::infinity()),
                                          Argument::of_float(1.5)});
  auto parsed = Graph::from_json(g.to_json());
  ASSERT_TRUE(parsed.is_ok());
  EXPECT_TRUE(std::isinf(parsed->nodes[3].args[1].items[0].float_value));
  EXPECT_EQ(parsed->nodes[3].args[1].items[1].float_value, 1.5);
}

TEST(GraphJson, NewerVersionIsRejectedWithAdvice) {
  std::string text = mlp_graph().to_json();
  auto pos = text.find("\"version\":1");
  ASSERT_NE(pos, std::string::npos);
  text.replace(pos, 11, "\"version\":7");
  auto parsed = Graph::from_json(text);
  ASSERT_FALSE(parsed.is_ok());
  EXPECT_EQ(parsed.status().code(), ErrorCode::kVersion);
  EXPECT_NE(parsed.status().message().find("version 7"), std::string::npos);
  EXPECT_NE(parsed.status().message().find("upgrade conveyor"), std::string::npos);
}

TEST(GraphJson, MalformedDocumentsNameThePath) {
  auto not_json = Graph::from_json("{\"format\": ");
  EXPECT_EQ(not_json.status().code(), ErrorCode::kFormat);

  std::string text = mlp_graph().to_json();
  auto pos = text.find("{\"value\":0}");
  ASSERT_NE(pos, std::string::npos);
  text.replace(pos, 11, "{\"blob\":0} ");
  auto parsed = Graph::from_json(text);
  ASSERT_FALSE(parsed.is_ok());
  EXPECT_EQ(parsed.status().code(), ErrorCode::kFormat);
  EXPECT_NE(parsed.status().message().find("/nodes/0/args/0"), std::string::npos)
      << parsed.status().message();
  EXPECT_NE(parsed.status().message().find("unknown argument kind 'blob'"), std::string::npos);

  auto wrong_format = Graph::from_json(R"({"format": "onnx", "version": 1})");
  EXPECT_NE(wrong_format.status().message().find("expected \"conveyor.graph\""), std::string::npos);
}

TEST(GraphValidate, UseBeforeDefinitionIsReported) {
  Graph g = mlp_graph();
  std::swap(g.nodes[0], g.nodes[1]);
  g.nodes[0].id = 0;
  g.nodes[1].id = 1;
  Status st = g.validate();
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), ErrorCode::kInvalidGraph);
  EXPECT_NE(st.message().find("before it is defined"), std::string::npos) << st.message();
}

TEST(GraphValidate, DanglingReferencesAreReported) {
  Graph g = mlp_graph();
  g.outputs.push_back(99);
  EXPECT_NE(g.validate().message().find("graph output 1 refers to value 99"), std::string::npos);

  Graph h = mlp_graph();
  h.nodes[2].args[0] = Argument::of_value(42);
  EXPECT_NE(h.validate().message().find("reads value 42 which does not exist"), std::string::npos);

  Graph k = mlp_graph();
  k.nodes[1].returns[0].value = 0;  // redefines the input
  EXPECT_NE(k.validate().message().find("a second time"), std::string::npos);

  Graph m = mlp_graph();
  m.nodes[0].mutated_args = {5};
  EXPECT_NE(m.validate().message().find("argument 5 as mutated"), std::string::npos);
}

TEST(GraphStructure, ProducersAndConsumers) {
  Graph g = diamond_graph();
  auto prod = g.producers();
  EXPECT_EQ(prod[0], -1);  // the input
  EXPECT_EQ(prod[2], 0);   // linear
  auto cons = g.consumers();
  EXPECT_EQ(cons[0], (std::vector<NodeId>{1, 2}));  // linear feeds relu and sigmoid
  EXPECT_EQ(cons[3], (std::vector<NodeId>{4}));
  EXPECT_EQ(Graph::node_inputs(g.nodes[4]), (std::vector<ValueId>{5, 0}));
}

}  // namespace
}  // namespace conveyor::graph
