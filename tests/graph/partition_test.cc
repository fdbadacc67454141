#include "graph/partition.h"

#include <gtest/gtest.h>

#include <random>

#include "test_graphs.h"

namespace conveyor::graph {
namespace {

using testing::diamond_graph;
using testing::inplace_view_graph;
using testing::mlp_graph;

TEST(AtomicGroups, ViewWriteAndEarlierReadsStayTogether) {
  Graph g = inplace_view_graph();
  auto groups = atomic_groups(g);
  ASSERT_EQ(groups.size(), 1u);
  // mul creates the storage, sum(y) reads it before the write, slice views it, add_ writes.
  EXPECT_EQ(groups[0], (std::vector<NodeId>{1, 2, 3, 4}));
}

TEST(AtomicGroups, GraphsWithoutInPlaceWritesHaveNone) {
  EXPECT_TRUE(atomic_groups(mlp_graph()).empty());
  EXPECT_TRUE(atomic_groups(diamond_graph()).empty());
}

TEST(CheckStage, RejectsNonConvexSetsNamingTheNodeInBetween) {
  Graph g = diamond_graph();
  std::vector<NodeId> stage = {0, 3};  // linear and add, but not relu/sigmoid between them
  Status st = check_stage(g, stage);
  ASSERT_FALSE(st.is_ok());
  EXPECT_EQ(st.code(), ErrorCode::kInvalidStage);
  EXPECT_NE(st.message().find("not convex"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("is outside the stage but lies on a path"), std::string::npos) << st.message();
}

TEST(CheckStage, RejectsSplitAtomicGroups) {
  Graph g = inplace_view_graph();
  std::vector<NodeId> stage = {0, 1, 2, 3};
  Status st = check_stage(g, stage);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("splits an atomic group"), std::string::npos) << st.message();
}

TEST(CheckStage, RejectsBadNodeLists) {
  Graph g = mlp_graph();
  EXPECT_FALSE(check_stage(g, std::vector<NodeId>{}).is_ok());
  EXPECT_NE(check_stage(g, std::vector<NodeId>{0, 9}).message().find("nodes 0..3"), std::string::npos);
  EXPECT_NE(check_stage(g, std::vector<NodeId>{1, 1}).message().find("twice"), std::string::npos);
}

TEST(CheckPartition, RequiresCoverageAndForwardDataFlow) {
  Graph g = mlp_graph();
  EXPECT_TRUE(check_partition(g, {{0, 1}, {2, 3}}).is_ok());
  EXPECT_NE(check_partition(g, {{0, 1}, {2}}).message().find("in no stage"), std::string::npos);
  EXPECT_NE(check_partition(g, {{2, 3}, {0, 1}}).message().find("data flows forward"), std::string::npos);
  EXPECT_NE(check_partition(g, {{0, 1}, {1, 2, 3}}).message().find("and stage"), std::string::npos);
}

TEST(StageBoundary, ListsCrossingValues) {
  Graph g = diamond_graph();
  std::vector<NodeId> middle = {1, 2, 3};
  auto b = stage_boundary(g, middle);
  EXPECT_EQ(b.inputs, (std::vector<ValueId>{2}));   // linear's output
  EXPECT_EQ(b.outputs, (std::vector<ValueId>{5}));  // add's output
  std::vector<NodeId> last = {4, 5};
  auto tail = stage_boundary(g, last);
  EXPECT_EQ(tail.inputs, (std::vector<ValueId>{0, 5}));  // the skip from the graph input
  EXPECT_EQ(tail.outputs, (std::vector<ValueId>{7}));     // the graph output
}

TEST(RandomPartition, AlwaysValidAndNonEmpty) {
  for (const Graph& g : {mlp_graph(), diamond_graph(), inplace_view_graph()}) {
    for (int k = 1; k <= 4; ++k) {
      for (std::uint64_t seed = 0; seed < 20; ++seed) {
        auto p = random_partition(g, k, seed, false);
        if (!p.is_ok()) {
          EXPECT_NE(p.status().message().find("units that can be separated"), std::string::npos);
          continue;
        }
        EXPECT_EQ(p->size(), static_cast<std::size_t>(k));
        EXPECT_TRUE(check_partition(g, *p).is_ok()) << check_partition(g, *p).message();
      }
    }
  }
}

TEST(RandomPartition, KeepNodeOrderGivesContiguousRanges) {
  Graph g = diamond_graph();
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    auto p = random_partition(g, 3, seed, true);
    ASSERT_TRUE(p.is_ok());
    NodeId next = 0;
    for (const auto& stage : *p) {
      for (NodeId n : stage) EXPECT_EQ(n, next++);
    }
  }
}

TEST(RandomPartition, TooManyStagesIsAnError) {
  auto p = random_partition(inplace_view_graph(), 7, 0, false);
  ASSERT_FALSE(p.is_ok());
  EXPECT_NE(p.status().message().find("only 5 units"), std::string::npos) << p.status().message();
}

// Convexity by definition: every node on a path between two members is a member.
bool convex_by_definition(const std::vector<std::vector<char>>& reach, std::uint32_t mask, int n) {
  for (int u = 0; u < n; ++u) {
    if (!(mask >> u & 1)) continue;
    for (int v = 0; v < n; ++v) {
      if (!(mask >> v & 1)) continue;
      for (int w = 0; w < n; ++w) {
        if (!(mask >> w & 1) && reach[u][w] && reach[w][v]) return false;
      }
    }
  }
  return true;
}

TEST(CheckStage, AgreesWithTheDefinitionOfConvexityOnRandomDags) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 30; ++trial) {
    const int n = 9;
    testing::GraphBuilder b;
    std::vector<ValueId> outs = {b.input("x", {testing::fixed(2)})};
    std::vector<std::vector<char>> reach(n, std::vector<char>(n, 0));
    for (int i = 0; i < n; ++i) {
      std::uniform_int_distribution<int> pick(0, static_cast<int>(outs.size()) - 1);
      int a = pick(rng), c = pick(rng);
      outs.push_back(b.op("aten::add", "Tensor", {testing::v(outs[a]), testing::v(outs[c]), Argument::of_int(1)},
                          {testing::fixed(2)}));
      for (int src : {a, c}) {
        if (src == 0) continue;
        reach[src - 1][i] = 1;
        for (int k = 0; k < n; ++k) {
          if (reach[k][src - 1]) reach[k][i] = 1;
        }
      }
    }
    b.output(outs.back());
    Graph g = b.build();
    for (std::uint32_t mask = 1; mask < (1u << n); ++mask) {
      std::vector<NodeId> stage;
      for (int i = 0; i < n; ++i) {
        if (mask >> i & 1) stage.push_back(i);
      }
      ASSERT_EQ(check_stage(g, stage).is_ok(), convex_by_definition(reach, mask, n))
          << "trial " << trial << " mask " << mask;
    }
  }
}

}  // namespace
}  // namespace conveyor::graph
