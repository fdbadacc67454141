// ModelState on its own (libtorch, no Python): a tied parameter that two ranks of one process
// read is a leaf of its own for the later rank, over the same storage, so the two never
// accumulate into one `.grad` from their threads and device streams; the step's fold adds
// the later rank's gradient into the parameter's.
#include "runtime/model_state.h"

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

// x -> linear(w) -> h -> linear(h, w) -> sum: stage 0 is node 0, stage 1 nodes 1 and 2,
// and both read w.
graph::Graph tied_graph() {
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(4), fixed(4)});
  ValueId h = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(4)});
  ValueId o = b.op("aten::linear", "", {v(h), v(w), Argument::none()}, {sym("s0"), fixed(4)});
  b.output(b.op("aten::sum", "", {v(o), Argument::none()}, {}));
  graph::Graph g = b.build();
  g.symbols["s0"] = "batch";
  return g;
}

scheduler::ScheduleSpec ranks(int n, int chunks = 1) {
  scheduler::ScheduleSpec spec;
  spec.kind = chunks == 1 ? scheduler::ScheduleKind::kOneFOneB : scheduler::ScheduleKind::kInterleaved;
  spec.ranks = n;
  spec.chunks = chunks;
  spec.microbatches = 1;
  return spec;
}

TEST(ModelState, ATiedParameterIsALeafOfItsOwnForTheLaterRankAndItsGradientIsFoldedBack) {
  const graph::Graph g = tied_graph();
  torch::manual_seed(0);
  at::Tensor w = torch::randn({4, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto ex = graph::GraphExecutor::create(g, {{"w", w}});
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  auto layout = PipelineLayout::create(g, {{0}, {1, 2}}, ranks(2), {1, 1}, {"w"}, {"w"});
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  EXPECT_EQ(layout->shared_parameters, std::vector<std::string>{"w"});
  EXPECT_EQ(layout->stage_shared, (std::vector<std::vector<std::string>>{{"w"}, {"w"}}));
  const Placement placement = Placement::one_process(*layout);
  auto state = ModelState::create(*layout, placement, {*ex}, nullptr);
  ASSERT_TRUE(state.is_ok()) << state.status().to_string();

  auto first = (*state)->executor_for(0, 0), second = (*state)->executor_for(0, 1);
  EXPECT_EQ(first.get(), ex->get());  // the first rank reads the user's parameter
  ASSERT_NE(second.get(), ex->get());
  const at::Tensor& own = *second->tensor("w");
  EXPECT_FALSE(own.is_same(w));
  EXPECT_EQ(own.data_ptr(), w.data_ptr());  // the same storage: an optimizer step reaches it
  EXPECT_TRUE(own.is_leaf() && own.requires_grad());

  // A step by hand: each stage through its rank's executor, backward from the loss.
  (*state)->begin_step();
  const at::Tensor x = torch::randn({3, 4}, torch::kDouble);
  auto stage0 = first->stage(layout->stages[0]);
  auto stage1 = second->stage(layout->stages[1]);
  ASSERT_TRUE(stage0.is_ok() && stage1.is_ok());
  auto act0 = (*stage0)->forward({x});
  ASSERT_TRUE(act0.is_ok()) << act0.status().to_string();
  auto act1 = (*stage1)->forward({act0->outputs[0]});
  ASSERT_TRUE(act1.is_ok()) << act1.status().to_string();
  auto into_h = (*stage1)->backward(*act1, {c10::IValue(torch::ones({}, torch::kDouble))});
  ASSERT_TRUE(into_h.is_ok()) << into_h.status().to_string();
  auto into_x = (*stage0)->backward(*act0, *into_h);
  ASSERT_TRUE(into_x.is_ok()) << into_x.status().to_string();
  ASSERT_TRUE(w.grad().defined() && own.grad().defined());
  const at::Tensor first_part = w.grad().clone(), second_part = own.grad().clone();

  (*state)->fold_tied_gradients();
  EXPECT_FALSE(own.grad().defined());
  EXPECT_TRUE(torch::equal(w.grad(), first_part + second_part));
  // Against the whole graph in one autograd pass.
  at::Tensor reference = w.detach().clone().requires_grad_(true);
  torch::linear(torch::linear(x, reference), reference).sum().backward();
  EXPECT_TRUE(torch::allclose(w.grad(), reference.grad(), 1e-12, 1e-12));

  // The parameter gets new data (a re-plan's hand-over, the user's assignment): the next
  // step's leaf reads it, with no gradient left over.
  {
    c10::NoGradGuard no_grad;
    w.set_data(torch::randn({4, 4}, torch::kDouble));
  }
  own.mutable_grad() = torch::ones({4, 4}, torch::kDouble);  // as a failed step would leave it
  (*state)->begin_step();
  EXPECT_EQ(own.data_ptr(), w.data_ptr());
  EXPECT_FALSE(own.grad().defined());
}

TEST(ModelState, StagesOfOneRankReadTheReplicasParameter) {
  // An interleaved rank holding both stages reads w through one leaf (one thread, one stream).
  const graph::Graph g = tied_graph();
  at::Tensor w = torch::randn({4, 4}, torch::dtype(torch::kDouble).requires_grad(true));
  auto ex = graph::GraphExecutor::create(g, {{"w", w}});
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  auto layout = PipelineLayout::create(g, {{0}, {1, 2}}, ranks(1, 2), {1}, {"w"}, {"w"});
  ASSERT_TRUE(layout.is_ok()) << layout.status().to_string();
  auto state = ModelState::create(*layout, Placement::one_process(*layout), {*ex}, nullptr);
  ASSERT_TRUE(state.is_ok()) << state.status().to_string();
  EXPECT_EQ((*state)->executor_for(0, 0).get(), ex->get());
}

}  // namespace
}  // namespace conveyor::runtime
