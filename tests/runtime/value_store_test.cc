// The value store on its own (libtorch on the CPU, no Python, no threads): a step's inputs
// split into microbatches and shares, values handed from their producing replica to their
// readers, gradients handed back and summed, and the refusals a caller can act on.
#include "runtime/value_store.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../graph/test_graphs.h"

namespace conveyor::runtime {
namespace {

using graph::Argument;
using graph::ValueId;
using graph::testing::fixed;
using graph::testing::GraphBuilder;
using graph::testing::sym;
using graph::testing::v;

const std::set<std::string> kMlpParameters = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
// mlp_graph: x[b,4] (value 0) -> linear -> relu (value 6) | linear -> sum (value 8, the loss).
const std::vector<std::vector<graph::NodeId>> kMlpCut = {{0, 1}, {2, 3}};
constexpr ValueId kInput = 0, kRelu = 6, kLoss = 8;

scheduler::ScheduleSpec spec_of(int ranks, int microbatches) {
  scheduler::ScheduleSpec spec;
  spec.kind = scheduler::ScheduleKind::kOneFOneB;
  spec.ranks = ranks;
  spec.microbatches = microbatches;
  return spec;
}

// The MLP cut after its relu, stage replicas `replicas`.
PipelineLayout mlp_layout(std::vector<int> replicas, int microbatches) {
  auto layout = PipelineLayout::create(graph::testing::mlp_graph(), kMlpCut, spec_of(2, microbatches),
                                       std::move(replicas), kMlpParameters, kMlpParameters);
  EXPECT_TRUE(layout.is_ok()) << layout.status().to_string();
  return std::move(*layout);
}

at::Tensor rows(std::int64_t n, std::int64_t width) {
  return torch::arange(n * width, torch::kDouble).reshape({n, width});
}

std::vector<c10::IValue> one(const at::Tensor& t) { return {c10::IValue(t)}; }

at::Tensor read_one(ValueStore& store, ValueId id, int mb, int stage, int i) {
  auto got = store.read({id}, mb, stage, i);
  EXPECT_TRUE(got.is_ok()) << got.status().to_string();
  if (!got.is_ok() || got->size() != 1 || !(*got)[0].isTensor()) return at::Tensor();
  return (*got)[0].toTensor();
}

TEST(ValueStore, BatchedInputsAreSplitIntoMicrobatchesAndEachReplicaReadsItsShare) {
  const PipelineLayout layout = mlp_layout({2, 1}, 2);
  ValueStore store(layout, nullptr);
  const at::Tensor x = rows(7, 4);
  ASSERT_TRUE(store.begin_step({x}, 7).is_ok());
  // As torch.tensor_split gives them: microbatches of 4 and 3 samples, and replica shares of those.
  const auto micro = x.tensor_split(2, 0);
  for (int mb = 0; mb < 2; ++mb) {
    const auto shares = micro[mb].tensor_split(2, 0);
    for (int i = 0; i < 2; ++i) {
      EXPECT_TRUE(torch::equal(read_one(store, kInput, mb, 0, i), shares[i])) << "mb " << mb << " replica " << i;
    }
  }
}

TEST(ValueStore, AValueReachesTheReaderOfTheSameIndexAsItsProducerMadeIt) {
  const PipelineLayout layout = mlp_layout({2, 2}, 2);
  ValueStore store(layout, nullptr);
  ASSERT_TRUE(store.begin_step({rows(8, 4)}, 8).is_ok());
  std::vector<at::Tensor> made;
  for (int mb = 0; mb < 2; ++mb) {
    for (int i = 0; i < 2; ++i) {
      made.push_back(rows(2, 8) + 100 * mb + 10 * i);
      store.put({kRelu}, one(made.back()), mb, 0, i, nullptr);
    }
  }
  for (int mb = 0; mb < 2; ++mb) {
    for (int i = 0; i < 2; ++i) {
      const at::Tensor read = read_one(store, kRelu, mb, 1, i);
      EXPECT_TRUE(torch::equal(read, rows(2, 8) + 100 * mb + 10 * i));
      EXPECT_TRUE(read.is_same(made[2 * mb + i]));  // zero-copy: the producer's own tensor
      // What the producer made, to send to another process.
      EXPECT_TRUE(torch::equal(store.produced(kRelu, mb, i).toTensor(), rows(2, 8) + 100 * mb + 10 * i));
    }
  }
}

// Two producing replicas, three readers: the readers see the producers' shares joined and
// split again their way, and the producers get back their own rows of the readers' gradients.
TEST(ValueStore, SharesOfDifferentReplicaCountsAreJoinedAndTheirGradientsSplitBack) {
  const PipelineLayout layout = mlp_layout({2, 3}, 2);
  ValueStore store(layout, nullptr);
  ASSERT_TRUE(store.begin_step({rows(10, 4)}, 10).is_ok());  // microbatches of 5
  const int mb = 1;
  const at::Tensor whole = rows(5, 8) + 1000;
  const auto produced = whole.tensor_split(2, 0);  // 3 and 2 rows
  for (int i = 0; i < 2; ++i) store.put({kRelu}, one(produced[i].clone()), mb, 0, i, nullptr);
  const auto read = whole.tensor_split(3, 0);  // 2, 2 and 1 rows
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(torch::equal(read_one(store, kRelu, mb, 1, i), read[i])) << "reader " << i;

  const at::Tensor grad = rows(5, 8) * -1;
  const auto grads = grad.tensor_split(3, 0);
  for (int i = 0; i < 3; ++i) store.add_gradient(kRelu, mb, 1, i, grads[i].clone());
  const auto back = grad.tensor_split(2, 0);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(store.take_gradient(kRelu, mb, i), back[i])) << "producer " << i;
}

TEST(ValueStore, GradientsOfOneValueAreSummedAndTakenOnce) {
  const PipelineLayout layout = mlp_layout({1, 1}, 1);
  ValueStore store(layout, nullptr);
  ASSERT_TRUE(store.begin_step({rows(3, 4)}, 3).is_ok());
  store.put({kRelu}, one(rows(3, 8)), 0, 0, 0, nullptr);
  EXPECT_FALSE(store.take_gradient(kRelu, 0, 0).defined());  // no reader handed one back yet
  store.add_gradient(kRelu, 0, 1, 0, torch::ones({3, 8}, torch::kDouble));
  store.add_gradient(kRelu, 0, 1, 0, torch::full({3, 8}, 2.0, torch::kDouble));
  EXPECT_TRUE(torch::equal(store.take_gradient(kRelu, 0, 0), torch::full({3, 8}, 3.0, torch::kDouble)));
  EXPECT_FALSE(store.take_gradient(kRelu, 0, 0).defined());  // taken: nothing arrived since
}

// Values between stages live from their forward to their producer's backward, not to the end
// of the step: once the producer took its gradient the store no longer holds the value.
TEST(ValueStore, TakingTheGradientLetsGoOfTheValue) {
  const PipelineLayout layout = mlp_layout({1, 1}, 2);
  ValueStore store(layout, nullptr);
  ASSERT_TRUE(store.begin_step({rows(4, 4)}, 4).is_ok());
  at::Tensor value = rows(2, 8);
  store.put({kRelu}, one(value), 0, 0, 0, nullptr);
  EXPECT_EQ(value.use_count(), 2);  // the test's and the store's
  read_one(store, kRelu, 0, 1, 0);
  store.add_gradient(kRelu, 0, 1, 0, torch::ones({2, 8}, torch::kDouble));
  store.take_gradient(kRelu, 0, 0);
  EXPECT_EQ(value.use_count(), 1);
  auto again = store.read({kRelu}, 0, 1, 0);
  ASSERT_FALSE(again.is_ok());
  EXPECT_EQ(again.status().code(), ErrorCode::kInternal);
}

TEST(ValueStore, ReadingAValueNotYetProducedIsRefusedNamingIt) {
  const PipelineLayout layout = mlp_layout({1, 1}, 2);
  ValueStore store(layout, nullptr);
  ASSERT_TRUE(store.begin_step({rows(4, 4)}, 4).is_ok());
  store.put({kRelu}, one(rows(2, 8)), 0, 0, 0, nullptr);
  auto got = store.read({kRelu}, 1, 1, 0);
  ASSERT_FALSE(got.is_ok());
  EXPECT_EQ(got.status().code(), ErrorCode::kInternal);
  EXPECT_EQ(got.status().message(), "value 6 of microbatch 1 was not produced yet");
}

TEST(ValueStore, EndingTheStepDropsItsValues) {
  const PipelineLayout layout = mlp_layout({1, 1}, 1);
  ValueStore store(layout, nullptr);
  ASSERT_TRUE(store.begin_step({rows(2, 4)}, 2).is_ok());
  at::Tensor value = rows(2, 8);
  store.put({kRelu}, one(value), 0, 0, 0, nullptr);
  store.add_gradient(kRelu, 0, 1, 0, torch::ones({2, 8}, torch::kDouble));
  store.end_step();
  EXPECT_EQ(value.use_count(), 1);
  ASSERT_TRUE(store.begin_step({rows(2, 4)}, 2).is_ok());
  EXPECT_FALSE(store.read({kRelu}, 0, 1, 0).is_ok());
  EXPECT_FALSE(store.take_gradient(kRelu, 0, 0).defined());  // last step's gradient is gone too
}

TEST(ValueStore, AnInputWithAnotherBatchSizeIsRefused) {
  // Two batched inputs: x[b,4] and y[b,4], added.
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId y = b.input("y", {sym("s0"), fixed(4)});
  ValueId sum = b.op("aten::add", "Tensor", {v(x), v(y), Argument::of_int(1)}, {sym("s0"), fixed(4)});
  b.output(b.op("aten::sum", "", {v(sum), Argument::none()}, {}));
  graph::Graph g = b.build();
  g.symbols["s0"] = "batch";
  auto layout = PipelineLayout::create(g, {{0, 1}}, spec_of(1, 2), {1}, {}, {});
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  ValueStore store(*layout, nullptr);
  Status s = store.begin_step({rows(6, 4), rows(5, 4)}, 6);
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "input 1 has 5 samples, input 0 has 6");
  EXPECT_TRUE(store.begin_step({rows(6, 4), rows(6, 4)}, 6).is_ok());
}

// Microbatches the caller packed keep their own sizes; replicas share each one.
TEST(ValueStore, PackedMicrobatchesKeepTheirSizes) {
  const PipelineLayout layout = mlp_layout({2, 1}, 2);
  ValueStore store(layout, nullptr);
  const at::Tensor a = rows(3, 4), b = rows(5, 4) + 100;
  ASSERT_TRUE(store.begin_packed_step({{a}, {b}}, {3, 5}).is_ok());
  EXPECT_TRUE(torch::equal(read_one(store, kInput, 0, 0, 0), a.tensor_split(2, 0)[0]));
  EXPECT_TRUE(torch::equal(read_one(store, kInput, 1, 0, 0), b.tensor_split(2, 0)[0]));
  EXPECT_TRUE(torch::equal(read_one(store, kInput, 1, 0, 1), b.tensor_split(2, 0)[1]));
  // A sum loss weighs every share 1.
  EXPECT_EQ(store.weight(1, 0, 1), 1.0);

  Status too_few = store.begin_packed_step({{a}}, {3});
  EXPECT_EQ(too_few.code(), ErrorCode::kInternal);
  EXPECT_EQ(too_few.message(), "a packed step needs one list of inputs per microbatch");
  EXPECT_FALSE(store.begin_packed_step({{a}, {b}}, {3}).is_ok());  // rows for one microbatch only
}

// A mean loss: each share's loss weighs its samples over the batch's, and each share's loss
// is kept for the step's total.
TEST(ValueStore, SharesOfAMeanLossWeighTheirSamplesAndEachLossIsKept) {
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(3), fixed(4)});
  ValueId y = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(3)});
  ValueId loss = b.op("aten::mean", "", {v(y), Argument::none()}, {});
  b.output(loss);
  graph::Graph g = b.build();
  g.symbols["s0"] = "batch";
  auto layout = PipelineLayout::create(g, {{0, 1}}, spec_of(1, 2), {2}, {"w"}, {"w"});
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  ValueStore store(*layout, nullptr);
  ASSERT_TRUE(store.begin_step({rows(10, 4)}, 10).is_ok());  // microbatches of 5: shares of 3 and 2
  EXPECT_DOUBLE_EQ(store.weight(0, 0, 0), 0.3);
  EXPECT_DOUBLE_EQ(store.weight(1, 0, 1), 0.2);
  for (int mb = 0; mb < 2; ++mb) {
    for (int i = 0; i < 2; ++i) store.put({loss}, one(torch::scalar_tensor(10.0 * mb + i, torch::kDouble)), mb, 0, i, nullptr);
  }
  const auto losses = store.losses();
  ASSERT_EQ(losses.size(), 4u);
  for (const auto& [key, l] : losses) EXPECT_EQ(l.item<double>(), 10.0 * key.first + key.second);
}

// The gradient of an input the caller passed requiring one: each share's in its rows, zeros
// where no share's was computed; none for an input that needs none.
TEST(ValueStore, InputGradientsArePutInTheirPlacesAlongTheBatch) {
  const PipelineLayout layout = mlp_layout({2, 1}, 2);
  ValueStore store(layout, nullptr);
  const at::Tensor x = rows(6, 4).requires_grad_(true);
  ASSERT_TRUE(store.begin_step({x}, 6).is_ok());  // microbatches of 3: shares of 2 and 1
  store.add_input_gradient(0, 0, 0, 1, torch::full({1, 4}, 1.0, torch::kDouble));  // row 2
  store.add_input_gradient(0, 1, 0, 0, torch::full({2, 4}, 2.0, torch::kDouble));  // rows 3, 4
  store.add_input_gradient(0, 1, 0, 0, torch::full({2, 4}, 3.0, torch::kDouble));  // summed
  const auto grads = store.take_input_gradients();
  ASSERT_EQ(grads.size(), 1u);
  const at::Tensor expected =
      torch::tensor({0.0, 0.0, 1.0, 5.0, 5.0, 0.0}, torch::kDouble).unsqueeze(1).expand({6, 4});
  EXPECT_TRUE(torch::equal(grads[0], expected)) << grads[0];
  // Taken: the next call has nothing but zeros.
  EXPECT_TRUE(torch::equal(store.take_input_gradients()[0], torch::zeros({6, 4}, torch::kDouble)));

  ASSERT_TRUE(store.begin_step({rows(6, 4)}, 6).is_ok());  // no gradient asked for
  store.add_input_gradient(0, 0, 0, 0, torch::ones({2, 4}, torch::kDouble));
  const auto none = store.take_input_gradients();
  ASSERT_EQ(none.size(), 1u);
  EXPECT_FALSE(none[0].defined());
}

}  // namespace
}  // namespace conveyor::runtime
