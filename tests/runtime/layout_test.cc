// The torch-free layouts of a pipeline: where the batch is in every value (BatchLayout), the
// pipeline's shape (PipelineLayout), and what follows from placing replicas on processes
// (Placement). No Python, no torch.
#include <gtest/gtest.h>

#include <functional>

#include "../graph/test_graphs.h"
#include "runtime/batch_layout.h"
#include "runtime/pipeline_layout.h"
#include "runtime/placement.h"

namespace conveyor::runtime {
namespace {

using graph::Argument;
using graph::Graph;
using graph::NodeId;
using graph::ValueId;
using graph::testing::fixed;
using graph::testing::GraphBuilder;
using graph::testing::sym;
using graph::testing::v;

scheduler::ScheduleSpec one_f_one_b(int ranks, int microbatches) {
  scheduler::ScheduleSpec spec;
  spec.kind = scheduler::ScheduleKind::kOneFOneB;
  spec.ranks = ranks;
  spec.microbatches = microbatches;
  return spec;
}

const std::set<std::string> kMlpParameters = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};

// mlp_graph's nodes: 0 linear, 1 relu, 2 linear, 3 sum; cut after the relu.
const std::vector<std::vector<NodeId>> kMlpCut = {{0, 1}, {2, 3}};

PipelineLayout mlp_layout(std::vector<int> replicas, int microbatches = 2) {
  auto layout = PipelineLayout::create(graph::testing::mlp_graph(), kMlpCut, one_f_one_b(2, microbatches),
                                       std::move(replicas), kMlpParameters, kMlpParameters);
  EXPECT_TRUE(layout.is_ok()) << layout.status().to_string();
  return std::move(*layout);
}

TEST(BatchLayout, SharesFollowTensorSplit) {
  // 10 samples over 3 replicas: 4, 3, 3, as torch.tensor_split gives them.
  EXPECT_EQ(share_of(10, 3, 0).offset, 0);
  EXPECT_EQ(share_of(10, 3, 0).length, 4);
  EXPECT_EQ(share_of(10, 3, 1).offset, 4);
  EXPECT_EQ(share_of(10, 3, 1).length, 3);
  EXPECT_EQ(share_of(10, 3, 2).offset, 7);
  EXPECT_EQ(share_of(10, 3, 2).length, 3);
  EXPECT_EQ(share_of(2, 3, 2).length, 0);
}

TEST(BatchLayout, WeightedSharesEndTheSlowestShareFirstInWholeSamples) {
  // Equal weights split as tensor_split does, whatever their scale.
  for (std::int64_t n : {1, 2, 7, 10, 64}) {
    const auto lengths = share_lengths(n, {0.3, 0.3, 0.3}, 3);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(lengths[i], share_of(n, 3, i).length) << n;
  }
  // Against every split by brute force: the slowest share (length over weight) is the least
  // possible, every replica has a sample when there are enough, and the lengths sum up.
  const std::vector<std::vector<double>> cases = {{1.0, 0.5}, {0.65, 1.0}, {1.0, 0.3, 0.7}, {2.0, 1.0, 1.0, 0.25}};
  for (const auto& w : cases) {
    const int r = static_cast<int>(w.size());
    for (std::int64_t n = 1; n <= 24; ++n) {
      const auto lengths = share_lengths(n, w, r);
      std::int64_t sum = 0;
      double slowest = 0;
      for (int i = 0; i < r; ++i) {
        sum += lengths[i];
        if (n >= r) EXPECT_GE(lengths[i], 1);
        slowest = std::max(slowest, static_cast<double>(lengths[i]) / w[i]);
      }
      EXPECT_EQ(sum, n);
      double best = 1e300;  // every split of n into r parts (each >= 1 when n >= r)
      std::vector<std::int64_t> part(static_cast<std::size_t>(r), 0);
      std::function<void(int, std::int64_t)> walk = [&](int i, std::int64_t left) {
        if (i == r - 1) {
          part[i] = left;
          if (n >= r && left < 1) return;
          double t = 0;
          for (int k = 0; k < r; ++k) t = std::max(t, static_cast<double>(part[k]) / w[k]);
          best = std::min(best, t);
          return;
        }
        for (std::int64_t x = n >= r ? 1 : 0; x <= left; ++x) {
          part[i] = x;
          walk(i + 1, left - x);
        }
      };
      walk(0, n);
      EXPECT_NEAR(slowest, best, 1e-12) << "n " << n << " replicas " << r;
    }
  }
  // A plan's shares (lengths over the microbatch) give those lengths back; offsets follow.
  EXPECT_EQ(share_lengths(8, {0.75, 0.25}, 2), (std::vector<std::int64_t>{6, 2}));
  EXPECT_EQ(share_of(8, {0.75, 0.25}, 2, 1).offset, 6);
  EXPECT_EQ(share_of(8, {0.75, 0.25}, 2, 1).length, 2);
  EXPECT_EQ(share_of(9, {}, 2, 1).length, share_of(9, 2, 1).length);
}

TEST(BatchLayout, FindsTheBatchDimensionOfEveryValueAndItsProducer) {
  const Graph g = graph::testing::mlp_graph();
  auto layout = BatchLayout::analyze(g, kMlpCut, {2, 1});
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  const ValueId x = g.inputs[0].value, relu = g.nodes[1].returns[0].value, loss = g.outputs[0];
  EXPECT_EQ(layout->batched_input, std::vector<bool>{true});
  EXPECT_EQ(layout->batch_dim[x], 0);
  EXPECT_EQ(layout->batch_dim[relu], 0);
  EXPECT_EQ(layout->batch_dim[loss], -1);
  EXPECT_EQ(layout->producer[relu], 0);
  EXPECT_EQ(layout->producer[loss], 1);
  EXPECT_EQ(layout->producer[x], -1);
  EXPECT_EQ(layout->loss, loss);
}

// x[s0,4] -> linear -> h[s0,8] -> (stage 1) view as [8*s0] -> sum, or sum over the batch.
Graph flattened_graph(bool reduce_over_batch) {
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(8), fixed(4)});
  ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(8)});
  ValueId cut = reduce_over_batch
                    ? b.op("aten::sum", "dim_IntList", {v(h), Argument::of_list({Argument::of_int(0)})}, {fixed(8)})
                    : b.op("aten::view", "", {v(h), Argument::of_list({Argument::of_int(-1)})}, {sym("8*s0")});
  ValueId s = b.op("aten::sum", "", {v(cut), Argument::none()}, {});
  b.output(s);
  Graph g = b.build();
  g.symbols["s0"] = "batch";
  return g;
}

TEST(BatchLayout, AFlattenedBatchIsSplitInRunsOfItsSamples) {
  const Graph g = flattened_graph(/*reduce_over_batch=*/false);
  auto layout = BatchLayout::analyze(g, {{0, 1}, {2}}, {2, 1});
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  const ValueId flat = g.nodes[1].returns[0].value;
  EXPECT_EQ(layout->batch_dim[flat], 0);
  EXPECT_EQ(layout->batch_scale[flat], 8);
}

TEST(BatchLayout, ABatchFlattenedWithASequenceLengthIsSplitInRunsKnownPerCall) {
  // x[s0,s1,4] (s1 a sequence length) -> linear -> [s0,s1,8] -> view [s0*s1, 8]: a share of
  // the flattened value is s1 rows per sample, s1 known only when a call runs (scale 0);
  // sizes in other symbols only are not the batch.
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), sym("s1"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(8), fixed(4)});
  ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), sym("s1"), fixed(8)});
  ValueId flat = b.op("aten::view", "", {v(h), Argument::of_list({Argument::of_int(-1), Argument::of_int(8)})},
                      {sym("s0*s1"), fixed(8)});
  b.output(b.op("aten::sum", "", {v(flat), Argument::none()}, {}));
  Graph g = b.build();
  g.symbols = {{"s0", "batch"}, {"s1", "x dim 1"}};
  auto layout = BatchLayout::analyze(g, {{0}, {1, 2}}, {2, 1});  // h crosses: [s0, s1, 8]
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  EXPECT_EQ(layout->batch_dim[h], 0);
  EXPECT_EQ(layout->batch_scale[h], 1);
  auto cut_flat = BatchLayout::analyze(g, {{0, 1}, {2}}, {2, 1});  // the flattened value crosses
  ASSERT_TRUE(cut_flat.is_ok()) << cut_flat.status().to_string();
  EXPECT_EQ(cut_flat->batch_dim[flat], 0);
  EXPECT_EQ(cut_flat->batch_scale[flat], 0);
}

TEST(BatchLayout, AValueWithoutABatchDimensionCannotCrossBetweenDifferentReplicaCounts) {
  const Graph g = flattened_graph(/*reduce_over_batch=*/true);
  auto refused = BatchLayout::analyze(g, {{0, 1}, {2}}, {2, 1});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(refused.status().message().find("from stage 0 (2 replicas) to stage 1 (1 replicas, split otherwise)"),
            std::string::npos)
      << refused.status().message();
  EXPECT_TRUE(BatchLayout::analyze(g, {{0, 1}, {2}}, {2, 2}).is_ok());  // replica i to replica i
  // As many replicas split by other weights: shares differ, so the value is redistributed too.
  auto weighted = BatchLayout::analyze(g, {{0, 1}, {2}}, {2, 2}, {0, 1});
  ASSERT_FALSE(weighted.is_ok());
  EXPECT_NE(weighted.status().message().find("split by other weights"), std::string::npos)
      << weighted.status().message();
}

TEST(BatchLayout, PositionsWithinAShareCannotCrossButTheRowsTheyPickFromTheirOwnSamplesCan) {
  // pos = arange(x.size(0)); rows = linear(x)[pos]: positions within a share mean nothing
  // once shares are joined and split again, but the rows they pick are each sample's own
  // (transformers' causal masks are built so).
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(8), fixed(4)});
  ValueId size = b.op("aten::sym_size", "int", {v(x), Argument::of_int(0)}, {});
  ValueId pos = b.op("aten::arange", "", {v(size)}, {sym("s0")});
  ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(8)});
  ValueId rows = b.op("aten::index", "Tensor", {v(h), Argument::of_list({v(pos)})}, {sym("s0"), fixed(8)});
  b.output(b.op("aten::sum", "", {v(rows), Argument::none()}, {}));
  Graph g = b.build();
  g.symbols["s0"] = "batch";
  auto positions = BatchLayout::analyze(g, {{0, 1, 2}, {3, 4}}, {2, 1});
  ASSERT_FALSE(positions.is_ok());
  EXPECT_NE(positions.status().message().find("value " + std::to_string(pos)), std::string::npos)
      << positions.status().message();
  auto picked = BatchLayout::analyze(g, {{0, 1, 2, 3}, {4}}, {2, 1});
  ASSERT_TRUE(picked.is_ok()) << picked.status().to_string();
  EXPECT_TRUE(picked->share_positions[pos]);
  EXPECT_FALSE(picked->share_positions[rows]);
  EXPECT_TRUE(picked->redistributable(g, rows));
}

TEST(BatchLayout, AModelThatReturnsNoScalarLossIsRefused) {
  Graph g = graph::testing::mlp_graph();
  g.outputs = {g.nodes[2].returns[0].value};  // the logits, not the loss
  auto refused = BatchLayout::analyze(g, {{0, 1, 2, 3}}, {1});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("one scalar loss"), std::string::npos);
}

TEST(BatchLayout, AStepIsCheckedAgainstMicrobatchesReplicasAndTheRange) {
  const Graph g = graph::testing::mlp_graph();
  auto layout = BatchLayout::analyze(g, kMlpCut, {3, 1});
  ASSERT_TRUE(layout.is_ok());
  EXPECT_TRUE(layout->check_step(12, 4, {3, 1}).is_ok());
  const std::string small = layout->check_step(3, 4, {3, 1}).message();
  EXPECT_NE(small.find("fewer than the 4 microbatches the plan runs"), std::string::npos) << small;
  EXPECT_NE(small.find("drop_last=True"), std::string::npos) << small;
  EXPECT_NE(layout->check_step(8, 4, {3, 1}).message().find("drop_last=True"), std::string::npos);
  layout->range = {3, 9};  // the graph holds for shares of 3 to 9 samples
  EXPECT_TRUE(layout->check_step(36, 4, {3, 1}).is_ok());  // shares of 3 (stage 0) and 9 (stage 1)
  EXPECT_NE(layout->check_step(40, 4, {3, 1}).message().find("at most 9"), std::string::npos);
  EXPECT_NE(layout->check_step(12, 4, {3, 1}).message().find("at least 3"), std::string::npos);
  // Weighted shares: 36 in 4 microbatches of 9, split 5 / 2 / 2 by stage 0's weights.
  EXPECT_NE(layout->check_step(36, 4, {3, 1}, {{0.5, 0.25, 0.25}, {}}).message().find("at least 3"), std::string::npos);
  layout->range = {2, 9};
  EXPECT_TRUE(layout->check_step(36, 4, {3, 1}, {{0.5, 0.25, 0.25}, {}}).is_ok());
}

TEST(PipelineLayout, ParametersGoToTheStagesThatReadThem) {
  const PipelineLayout layout = mlp_layout({2, 1});
  EXPECT_EQ(layout.stage_replicas, (std::vector<int>{2, 1}));
  EXPECT_EQ(layout.most_replicas, 2);
  EXPECT_EQ(layout.stage_parameters[0], (std::vector<std::string>{"fc1.weight", "fc1.bias"}));
  EXPECT_EQ(layout.stage_parameters[1], (std::vector<std::string>{"fc2.weight", "fc2.bias"}));
  EXPECT_TRUE(layout.shared_parameters.empty());
  EXPECT_EQ(layout.reads_from[1], std::vector<int>{0});
  EXPECT_EQ(layout.read_by[0], std::vector<int>{1});
  EXPECT_EQ(layout.partners(1, 0, 0), (std::vector<int>{0, 1}));  // different counts: every producing replica
  // Parameters that need no gradient are nobody's to reduce.
  auto frozen = PipelineLayout::create(graph::testing::mlp_graph(), kMlpCut, one_f_one_b(2, 2), {2, 1},
                                       kMlpParameters, {"fc2.weight"});
  ASSERT_TRUE(frozen.is_ok());
  EXPECT_TRUE(frozen->stage_parameters[0].empty());
  EXPECT_EQ(frozen->stage_parameters[1], std::vector<std::string>{"fc2.weight"});
}

TEST(PipelineLayout, BadShapesAreRefusedNamingWhatIsWrong) {
  const Graph g = graph::testing::mlp_graph();
  auto wrong_ranks = PipelineLayout::create(g, kMlpCut, one_f_one_b(1, 2), {}, {}, {});
  EXPECT_NE(wrong_ranks.status().message().find("the schedule has 1 stages but the partition 2"), std::string::npos);
  auto wrong_counts = PipelineLayout::create(g, kMlpCut, one_f_one_b(2, 2), {1, 1, 1}, {}, {});
  EXPECT_NE(wrong_counts.status().message().find("replica counts for 3 ranks"), std::string::npos);
  auto no_replica = PipelineLayout::create(g, kMlpCut, one_f_one_b(2, 2), {1, 0}, {}, {});
  EXPECT_NE(no_replica.status().message().find("at least one replica"), std::string::npos);
  auto not_a_partition = PipelineLayout::create(g, {{0}, {2, 3}}, one_f_one_b(2, 2), {}, {}, {});
  EXPECT_FALSE(not_a_partition.is_ok());
}

TEST(Placement, OneProcessRunsEveryReplicaAndSendsNothing) {
  const PipelineLayout layout = mlp_layout({2, 1});
  const Placement p = Placement::one_process(layout);
  EXPECT_FALSE(p.across_processes());
  EXPECT_EQ(p.local_replicas, (std::vector<std::vector<int>>{{0, 1}, {0}}));
  EXPECT_TRUE(p.here(0, 1));
  EXPECT_FALSE(p.spans_processes(0));
  EXPECT_TRUE(p.links().empty());
  EXPECT_EQ(p.local_workers(layout), (LocalReplicas{{true, true}, {true}}));
}

TEST(Placement, ValuesGradientsAndOwnersFollowTheProcesses) {
  const Graph g = graph::testing::mlp_graph();
  const PipelineLayout layout = mlp_layout({2, 1});
  // Stage 0's replicas on processes 0 and 1, stage 1 on process 1; seen from process 0.
  auto p = Placement::across(g, layout, /*process=*/0, /*world=*/2, {{0, 1}, {1}});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->local_replicas, (std::vector<std::vector<int>>{{0}, {}}));
  EXPECT_EQ(p->stage_processes, (std::vector<std::vector<int>>{{0, 1}, {1}}));
  EXPECT_TRUE(p->spans_processes(0));
  EXPECT_EQ(p->local_workers(layout), (LocalReplicas{{true, false}, {false}}));
  const ValueId relu = g.nodes[1].returns[0].value;
  // Replica 0 of stage 0 sends its activation to process 1, which hands the gradient back.
  ASSERT_EQ(p->activations_out[0][0].size(), 1u);
  EXPECT_EQ(p->activations_out[0][0][0].process, 1);
  EXPECT_EQ(p->activations_out[0][0][0].values, std::vector<ValueId>{relu});
  EXPECT_TRUE(p->activations_out[0][1].empty());  // replica 1 is on process 1 already
  ASSERT_EQ(p->gradients_out[1][0].size(), 1u);
  EXPECT_EQ(p->gradients_out[1][0][0].process, 0);
  EXPECT_EQ(p->links(), (std::vector<std::pair<int, int>>{{0, 1}, {1, 0}}));
  // Owners are the first reader's replica 0: fc1 on process 0, fc2 on process 1; process 0
  // releases what only stage 1 reads.
  EXPECT_EQ(p->owners, (std::vector<std::pair<std::string, int>>{
                           {"fc1.weight", 0}, {"fc1.bias", 0}, {"fc2.weight", 1}, {"fc2.bias", 1}}));
  EXPECT_EQ(p->not_here, (std::vector<std::string>{"fc2.weight", "fc2.bias"}));
  EXPECT_TRUE(p->cross_shared.empty());
  // Every process must agree on the fingerprint; another placement gives another one.
  auto same = Placement::across(g, layout, 1, 2, {{0, 1}, {1}});
  auto other = Placement::across(g, layout, 0, 2, {{0, 1}, {0}});
  ASSERT_TRUE(same.is_ok() && other.is_ok());
  EXPECT_EQ(p->fingerprint, same->fingerprint);
  EXPECT_NE(p->fingerprint, other->fingerprint);
}

TEST(Placement, TiedWeightsAndWrittenBuffersAcrossProcessesAreFound) {
  // x -> linear(w) -> h; stage 1: linear(h, w) again (w tied) and a running statistic
  // written in place, read by a stage replicated over both processes.
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(4), fixed(4)});
  ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(4)});
  ValueId o = b.op("aten::linear", "", {v(h), v(w), Argument::none()}, {sym("s0"), fixed(4)});
  Graph g = b.build();
  graph::Value stat;
  stat.id = static_cast<ValueId>(g.values.size());
  stat.name = "running";
  stat.dtype = "float64";
  stat.shape = {fixed(4)};
  g.values.push_back(stat);
  g.bindings.push_back({stat.id, "running", graph::Binding::Kind::kBuffer});
  // The write and the loss, by hand (the builder makes plain ops only).
  graph::Node write;
  write.id = static_cast<NodeId>(g.nodes.size());
  write.op = "aten::add_";
  write.overload = "Tensor";
  write.args = {v(stat.id), v(stat.id), Argument::of_int(1)};
  graph::Value written = stat;
  written.id = static_cast<ValueId>(g.values.size());
  written.name = "running_out";
  g.values.push_back(written);
  write.returns.push_back({graph::Return::Kind::kValue, written.id, {}});
  write.mutated_args = {0};
  write.aliased_args = {0};
  g.nodes.push_back(write);
  graph::Node sum;
  sum.id = static_cast<NodeId>(g.nodes.size());
  sum.op = "aten::sum";
  sum.args = {v(o), Argument::none()};
  graph::Value loss;
  loss.id = static_cast<ValueId>(g.values.size());
  loss.name = "loss";
  loss.dtype = "float64";
  g.values.push_back(loss);
  sum.returns.push_back({graph::Return::Kind::kValue, loss.id, {}});
  g.nodes.push_back(sum);
  g.outputs = {loss.id};
  g.symbols["s0"] = "batch";
  ASSERT_TRUE(g.validate().is_ok()) << g.validate().to_string();
  auto layout = PipelineLayout::create(g, {{0}, {1, 2, 3}}, one_f_one_b(2, 2), {1, 2}, {"w", "running"}, {"w"});
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  EXPECT_EQ(layout->shared_parameters, std::vector<std::string>{"w"});
  auto p = Placement::across(g, *layout, 1, 2, {{0}, {0, 1}});
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(p->cross_shared, (std::vector<std::pair<std::string, bool>>{{"w", true}}));
  ASSERT_EQ(p->buffer_syncs.size(), 1u);
  EXPECT_EQ(p->buffer_syncs[0].name, "running");
  EXPECT_EQ(p->buffer_syncs[0].readers, (std::vector<int>{0, 1}));
  EXPECT_EQ(p->buffer_syncs[0].root, 0);  // stage 1's replica 0 is on process 0
  EXPECT_TRUE(p->buffers_here.count("running"));
}

TEST(Placement, BadPlacementsAreRefusedNamingTheRank) {
  const Graph g = graph::testing::mlp_graph();
  const PipelineLayout layout = mlp_layout({2, 1});
  EXPECT_NE(Placement::across(g, layout, 0, 2, {{0, 1}}).status().message().find("for 1 pipeline ranks"), std::string::npos);
  EXPECT_NE(Placement::across(g, layout, 0, 2, {{0}, {1}}).status().message().find("rank 0 has 2 replicas but 1"),
            std::string::npos);
  EXPECT_NE(Placement::across(g, layout, 0, 2, {{0, 2}, {1}}).status().message().find("process 2 of a world of 2"),
            std::string::npos);
}

}  // namespace
}  // namespace conveyor::runtime
