// The gradient reducer on its own (libtorch, no Python): replicas' buckets summed while the
// last backward runs, never before every replica has accumulated them, and a sum across
// processes that the communication thread issues without waiting for.
#include "runtime/gradient_reducer.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <future>

#include "../graph/test_graphs.h"
#include "graph/executor.h"
#include "runtime/comm_thread.h"
#include "transport/inproc.h"

namespace conveyor::runtime {
namespace {

using Clock = std::chrono::steady_clock;

const std::set<std::string> kMlpParameters = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
const std::vector<graph::NodeId> kWholeMlp = {0, 1, 2, 3};

graph::TensorMap mlp_tensors() {
  torch::manual_seed(0);
  auto opts = torch::TensorOptions().dtype(torch::kDouble).requires_grad(true);
  return {{"fc1.weight", torch::randn({8, 4}, opts)}, {"fc1.bias", torch::randn({8}, opts)},
          {"fc2.weight", torch::randn({3, 8}, opts)}, {"fc2.bias", torch::randn({3}, opts)}};
}

PipelineLayout one_stage(int replicas) {
  scheduler::ScheduleSpec spec;
  spec.ranks = 1;
  spec.microbatches = 1;
  auto layout = PipelineLayout::create(graph::testing::mlp_graph(), {kWholeMlp}, spec, {replicas}, kMlpParameters,
                                       kMlpParameters);
  EXPECT_TRUE(layout.is_ok()) << layout.status().to_string();
  return std::move(*layout);
}

// Replica `r`'s forward and backward of `x` (a sum loss), in its final pass of the step.
void backward_share(GradientReducer& reducer, const graph::GraphExecutor& ex, int r, const at::Tensor& x) {
  auto program = ex.stage(kWholeMlp);
  ASSERT_TRUE(program.is_ok()) << program.status().to_string();
  auto act = (*program)->forward({x});
  ASSERT_TRUE(act.is_ok()) << act.status().to_string();
  reducer.final_pass(0, r, true);
  auto grads = (*program)->backward(*act, {c10::IValue(torch::ones({}, torch::kDouble))});
  reducer.final_pass(0, r, false);
  ASSERT_TRUE(grads.is_ok()) << grads.status().to_string();
}

// Runs `work` on the communication thread and waits for it.
template <class F>
auto on_comm_thread(F work) {
  auto done = std::make_shared<std::promise<decltype(work())>>();
  auto result = done->get_future();
  CommThread::process()->post([done, work] { done->set_value(work()); });
  EXPECT_EQ(result.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  return result.get();
}

TEST(GradientReducer, BucketsAreSummedDuringTheLastBackwardIntoTheUsersGradients) {
  graph::TensorMap user = mlp_tensors();
  auto ex0 = graph::GraphExecutor::create(graph::testing::mlp_graph(), user);
  ASSERT_TRUE(ex0.is_ok());
  auto ex1 = (*ex0)->replica();
  ASSERT_TRUE(ex1.is_ok());
  std::vector<std::shared_ptr<graph::GraphExecutor>> executors = {*ex0, *ex1};
  const PipelineLayout layout = one_stage(2);
  const Placement placement = Placement::one_process(layout);
  auto reducer = GradientReducer::create(
      layout, placement, [&](int r, const std::string& name) { return executors[r]->tensor(name); }, nullptr,
      /*bucket_bytes=*/1, {}, nullptr);
  ASSERT_TRUE(reducer.is_ok()) << reducer.status().to_string();
  (*reducer)->begin_step();
  const at::Tensor x = torch::randn({6, 4}, torch::kDouble);

  backward_share(**reducer, *executors[0], 0, x.narrow(0, 0, 3));
  // Replica 1 has not accumulated anything: nothing may be summed yet.
  on_comm_thread([] { return 0; });  // anything posted so far has run
  EXPECT_EQ((*reducer)->counts().second, 0);
  const at::Tensor only_replica_0 = user["fc1.weight"].grad().clone();

  backward_share(**reducer, *executors[1], 1, x.narrow(0, 3, 3));
  Status finished = on_comm_thread([&] { return (*reducer)->finish_stage(0, {}); });
  ASSERT_TRUE(finished.is_ok()) << finished.to_string();
  EXPECT_EQ((*reducer)->counts(), (std::pair<int, int>{4, 4}));  // one parameter a bucket, all during backward

  // The whole batch's gradient, as eager computes it.
  graph::TensorMap eager = mlp_tensors();
  torch::linear(torch::relu(torch::linear(x, eager["fc1.weight"], eager["fc1.bias"])), eager["fc2.weight"],
                eager["fc2.bias"]).sum().backward();
  for (const auto& name : kMlpParameters) {
    EXPECT_TRUE(torch::allclose(user[name].grad(), eager[name].grad(), 1e-12, 1e-12)) << name;
    EXPECT_FALSE(executors[1]->tensor(name)->grad().defined()) << name << ": replica 1's gradient is released";
  }
  EXPECT_FALSE(torch::allclose(only_replica_0, eager["fc1.weight"].grad()));
}

// One stage of two replicas: replica 0 here (process 0), replica 1 in process 1 (played by
// member 1 of an in-process group), so the stage sums its gradients across processes.
struct AcrossTwoProcesses {
  graph::TensorMap user = mlp_tensors();
  std::shared_ptr<graph::GraphExecutor> ex0;
  PipelineLayout layout = one_stage(2);
  Placement placement;
  std::vector<std::shared_ptr<transport::Collective>> pair = transport::make_inproc_group(2);
  std::unique_ptr<GradientReducer> reducer;

  explicit AcrossTwoProcesses(std::chrono::milliseconds timeout) {
    ex0 = *graph::GraphExecutor::create(graph::testing::mlp_graph(), user);
    placement = *Placement::across(graph::testing::mlp_graph(), layout, 0, 2, {{0, 1}});
    GradientReducer::Groups groups;
    groups.across = {pair[0]};
    groups.timeout = timeout;
    reducer = *GradientReducer::create(
        layout, placement, [this](int, const std::string& name) { return ex0->tensor(name); }, nullptr,
        std::int64_t{4} << 20, groups, nullptr);
    reducer->begin_step();
    backward_share(*reducer, *ex0, 0, torch::randn({3, 4}, torch::kDouble));  // posts the bucket's sum
  }
};

TEST(GradientReducer, ASlowSumAcrossProcessesDoesNotHoldUpTheCommunicationThread) {
  AcrossTwoProcesses job(std::chrono::seconds(10));
  std::map<std::string, at::Tensor> own;
  for (const auto& name : kMlpParameters) own[name] = job.user[name].grad().clone();

  // A transfer posted after the sum runs at once, though the sum waits for process 1.
  const auto posted = Clock::now();
  const auto ran = on_comm_thread([] { return Clock::now(); });
  EXPECT_LT(ran - posted, std::chrono::milliseconds(500));
  EXPECT_TRUE(job.reducer->across_pending());

  // Process 1 arrives with gradients of its own (all twos) and a count of one.
  std::int64_t numel = 0;
  for (const auto& name : kMlpParameters) numel += job.user[name].numel();
  at::Tensor theirs = torch::full({numel + 1}, 2.0, torch::kDouble);
  theirs[numel] = 1;
  std::promise<Status> late;
  job.pair[1]->allreduce(theirs, [&late](Status s) { late.set_value(s); });
  ASSERT_TRUE(late.get_future().get().is_ok());
  ASSERT_TRUE(job.reducer->wait_across().is_ok());
  ASSERT_TRUE(job.reducer->write_across().is_ok());
  for (const auto& name : kMlpParameters) {
    EXPECT_TRUE(torch::allclose(job.user[name].grad(), own[name] + 2.0, 1e-12, 1e-12)) << name;
  }
}

TEST(GradientReducer, AProcessThatNeverSumsFailsTheWaitNamingIt) {
  AcrossTwoProcesses job(std::chrono::milliseconds(200));
  on_comm_thread([] { return 0; });
  const Status waited = job.reducer->wait_across();
  ASSERT_FALSE(waited.is_ok());
  EXPECT_NE(waited.message().find("process 0: summing the gradients of replicas in other processes did not complete"),
            std::string::npos)
      << waited.message();
}

}  // namespace
}  // namespace conveyor::runtime
