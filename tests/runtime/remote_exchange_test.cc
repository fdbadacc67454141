// The remote exchange on its own (libtorch on the CPU, no Python): two processes of one
// pipeline played in this one, each with its placement, value store and exchange, joined by
// the in-process transport. That transport delivers a message on the thread that sends or
// receives it, whichever comes second, so every test here runs on the test's thread alone
// and each step of a message is one call: no thread, no wait, nothing to time.
#include "runtime/remote_exchange.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <optional>

#include "../graph/test_graphs.h"
#include "transport/inproc.h"

namespace conveyor::runtime {
namespace {

using graph::ValueId;
using scheduler::Action;
using scheduler::ActionKind;

const std::set<std::string> kMlpParameters = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"};
// mlp_graph: x[b,4] (value 0) -> linear -> relu (value 6) | linear -> sum (the loss).
const std::vector<std::vector<graph::NodeId>> kMlpCut = {{0, 1}, {2, 3}};
constexpr ValueId kRelu = 6;

at::Tensor rows(std::int64_t n, std::int64_t width) {
  return torch::arange(n * width, torch::kDouble).reshape({n, width});
}

// What a receive reported: nothing yet, or its status.
struct Arrived {
  std::optional<Status> status;
  int calls = 0;
  std::function<void(Status)> callback() {
    return [this](Status s) {
      ++calls;
      status = std::move(s);
    };
  }
};

// The process's endpoint as the exchange sees it, counting the receives it asks for.
class CountingEndpoint final : public transport::Endpoint {
 public:
  explicit CountingEndpoint(std::shared_ptr<transport::Endpoint> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void send(int peer, transport::Tag tag, std::vector<at::Tensor> tensors, transport::Done done) override {
    inner_->send(peer, tag, std::move(tensors), std::move(done));
  }
  void recv(int peer, transport::Tag tag, transport::Received done) override {
    ++receives_[{peer, tag}];
    inner_->recv(peer, tag, std::move(done));
  }
  int receives(int peer, transport::Tag tag) const {
    auto it = receives_.find({peer, tag});
    return it == receives_.end() ? 0 : it->second;
  }

 private:
  std::shared_ptr<transport::Endpoint> inner_;
  std::map<std::pair<int, transport::Tag>, int> receives_;  // the test's thread only
};

// One process of the pipeline: what it places, stores and exchanges.
struct Process {
  Placement placement;
  std::unique_ptr<ValueStore> store;
  std::unique_ptr<RemoteExchange> exchange;
};

// The MLP cut after its relu, `replicas` per stage, stage 0 on process 0 and stage 1 on
// process 1, over the in-process transport; both processes begin a step on the same batch.
struct TwoProcesses {
  TwoProcesses(std::vector<int> replicas, int microbatches, std::int64_t batch) {
    scheduler::ScheduleSpec spec;
    spec.kind = scheduler::ScheduleKind::kOneFOneB;
    spec.ranks = 2;
    spec.microbatches = microbatches;
    auto made = PipelineLayout::create(graph, kMlpCut, spec, replicas, kMlpParameters, kMlpParameters);
    EXPECT_TRUE(made.is_ok()) << made.status().to_string();
    layout = std::move(*made);
    endpoints = transport::make_inproc_endpoints({at::kCPU, at::kCPU});
    const std::vector<std::vector<int>> per_rank = {std::vector<int>(replicas[0], 0), std::vector<int>(replicas[1], 1)};
    for (int p = 0; p < 2; ++p) {
      auto placement = Placement::across(graph, layout, p, 2, per_rank);
      EXPECT_TRUE(placement.is_ok()) << placement.status().to_string();
      Process& process = processes[p];
      process.placement = std::move(*placement);
      process.store = std::make_unique<ValueStore>(layout, nullptr);
      counting.push_back(std::make_shared<CountingEndpoint>(endpoints[p]));
      process.exchange = std::make_unique<RemoteExchange>(layout, process.placement, *process.store, nullptr, counting[p]);
      EXPECT_TRUE(process.store->begin_step({rows(batch, 4)}, batch).is_ok());
      process.exchange->begin_step();
    }
  }
  Process& operator[](int p) { return processes[p]; }

  const graph::Graph graph = graph::testing::mlp_graph();
  PipelineLayout layout;
  std::vector<std::shared_ptr<transport::Endpoint>> endpoints;  // the in-process transport's
  std::vector<std::shared_ptr<CountingEndpoint>> counting;       // the same, as the exchanges see them
  Process processes[2];
};

Action send_activation(int mb) { return {ActionKind::kSendActivation, mb, /*peer=*/1, /*stage=*/0}; }
Action recv_activation(int mb) { return {ActionKind::kRecvActivation, mb, /*peer=*/0, /*stage=*/1}; }
Action send_gradient(int mb) { return {ActionKind::kSendGradient, mb, /*peer=*/0, /*stage=*/1}; }
Action recv_gradient(int mb) { return {ActionKind::kRecvGradient, mb, /*peer=*/1, /*stage=*/0}; }

at::Tensor read_one(ValueStore& store, ValueId id, int mb, int stage, int i) {
  auto got = store.read({id}, mb, stage, i);
  EXPECT_TRUE(got.is_ok()) << got.status().to_string();
  return got.is_ok() && (*got)[0].isTensor() ? (*got)[0].toTensor() : at::Tensor();
}

// Stage 0's activation crosses to the process that reads it, whether the receive asks before
// or after the send, and still asks for a gradient there; the gradient comes back the same way.
TEST(RemoteExchange, ActivationsCrossToTheReaderAndGradientsComeBack) {
  TwoProcesses job({1, 1}, 2, 4);
  Process &first = job[0], &second = job[1];
  const at::Tensor h0 = (rows(2, 8) + 1).requires_grad_(true), h1 = (rows(2, 8) + 2).requires_grad_(true);

  // Microbatch 0: sent, then received (it waits in the transport).
  first.store->put({kRelu}, {h0}, 0, 0, 0, nullptr);
  ASSERT_TRUE(first.exchange->send(0, send_activation(0)).is_ok());
  Arrived a0;
  second.exchange->receive(0, recv_activation(0), a0.callback());
  ASSERT_TRUE(a0.status.has_value());
  EXPECT_TRUE(a0.status->is_ok()) << a0.status->to_string();
  const at::Tensor got0 = read_one(*second.store, kRelu, 0, 1, 0);
  EXPECT_TRUE(torch::equal(got0, h0.detach()));
  EXPECT_TRUE(got0.requires_grad());  // the reader's backward will compute its gradient

  // Microbatch 1: the receive asks first and is released by the send.
  Arrived a1;
  second.exchange->receive(0, recv_activation(1), a1.callback());
  EXPECT_FALSE(a1.status.has_value());
  first.store->put({kRelu}, {h1}, 1, 0, 0, nullptr);
  ASSERT_TRUE(first.exchange->send(0, send_activation(1)).is_ok());
  ASSERT_TRUE(a1.status.has_value());
  EXPECT_TRUE(a1.status->is_ok()) << a1.status->to_string();
  EXPECT_TRUE(torch::equal(read_one(*second.store, kRelu, 1, 1, 0), h1.detach()));

  // The reader's gradient of microbatch 1 goes back at its stage's send and lands where the
  // producer's backward takes it.
  const at::Tensor g = torch::full({2, 8}, 0.5, torch::kDouble);
  second.exchange->hand_back(1, 1, 0, kRelu, g);
  ASSERT_TRUE(second.exchange->send(0, send_gradient(1)).is_ok());
  Arrived back;
  first.exchange->receive(0, recv_gradient(1), back.callback());
  ASSERT_TRUE(back.status.has_value());
  EXPECT_TRUE(back.status->is_ok()) << back.status->to_string();
  EXPECT_TRUE(torch::equal(first.store->take_gradient(kRelu, 1, 0), g));
  EXPECT_TRUE(first.exchange->send_error().is_ok());
  EXPECT_TRUE(second.exchange->send_error().is_ok());
}

// Two replicas of the reading stage in one process: the message is received once there, both
// receives are released by it, and each replica reads its share.
TEST(RemoteExchange, AMessageIsReceivedOncePerProcessAndReleasesEveryReplicaReadingIt) {
  TwoProcesses job({1, 2}, 1, 6);
  Arrived r0, r1;
  job[1].exchange->receive(0, recv_activation(0), r0.callback());
  job[1].exchange->receive(1, recv_activation(0), r1.callback());
  EXPECT_FALSE(r0.status.has_value());
  EXPECT_FALSE(r1.status.has_value());
  const at::Tensor h = rows(6, 8);
  job[0].store->put({kRelu}, {h}, 0, 0, 0, nullptr);
  ASSERT_TRUE(job[0].exchange->send(0, send_activation(0)).is_ok());
  ASSERT_EQ(r0.calls, 1);
  ASSERT_EQ(r1.calls, 1);
  EXPECT_TRUE(r0.status->is_ok() && r1.status->is_ok());
  const auto shares = h.tensor_split(2, 0);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(read_one(*job[1].store, kRelu, 0, 1, i), shares[i]));

  // A replica asking after the message came is released at once, without another message.
  Arrived late;
  job[1].exchange->receive(1, recv_activation(0), late.callback());
  ASSERT_TRUE(late.status.has_value());
  EXPECT_TRUE(late.status->is_ok());
  // One receive asked of the transport for all three: none is left pending to take a later
  // step's message under the same tag.
  EXPECT_EQ(job.counting[1]->receives(0, message_tag(1, 0, 0, 0)), 1);
}

// A lost peer fails the receives waiting on it with the transport's words, and later ones;
// a send to it is the step's send error until the next step begins.
TEST(RemoteExchange, APeerThatFailsFailsTheReceivesWaitingOnItAndTheSends) {
  TwoProcesses job({1, 1}, 2, 4);
  Arrived waiting;
  job[1].exchange->receive(0, recv_activation(0), waiting.callback());
  EXPECT_FALSE(waiting.status.has_value());
  transport::abort_inproc(*job.endpoints[0], Status(ErrorCode::kExecution, "process 0 was lost"));
  ASSERT_TRUE(waiting.status.has_value());
  EXPECT_EQ(waiting.status->code(), ErrorCode::kExecution);
  EXPECT_EQ(waiting.status->message(), "process 0 was lost");
  // The same message asked for again (another replica): the same error, no second receive.
  Arrived again;
  job[1].exchange->receive(0, recv_activation(0), again.callback());
  ASSERT_TRUE(again.status.has_value());
  EXPECT_EQ(again.status->message(), "process 0 was lost");
  EXPECT_EQ(job.counting[1]->receives(0, message_tag(1, 0, 0, 0)), 1);
  Arrived next;
  job[1].exchange->receive(0, recv_activation(1), next.callback());
  ASSERT_TRUE(next.status.has_value());
  EXPECT_FALSE(next.status->is_ok());

  job[0].store->put({kRelu}, {rows(2, 8)}, 1, 0, 0, nullptr);
  EXPECT_TRUE(job[0].exchange->send(0, send_activation(1)).is_ok());  // handed to the transport
  EXPECT_EQ(job[0].exchange->send_error().message(), "process 0 was lost");
  job[0].exchange->begin_step();
  EXPECT_TRUE(job[0].exchange->send_error().is_ok());
}

// Processes that run different plans: a message that does not carry what this process
// expects fails the receive, saying so.
TEST(RemoteExchange, AMessageOfAnotherPlanFailsTheReceiveSayingSo) {
  TwoProcesses job({1, 1}, 1, 2);
  auto message = to_wire({c10::IValue(rows(2, 8)), c10::IValue(rows(2, 8))}, {kRelu, kRelu + 1});
  ASSERT_TRUE(message.is_ok()) << message.status().to_string();
  job.endpoints[0]->send(1, message_tag(1, 0, 0, 0), std::move(*message), [](Status) {});
  Arrived got;
  job[1].exchange->receive(0, recv_activation(0), got.callback());
  ASSERT_TRUE(got.status.has_value());
  EXPECT_EQ(got.status->code(), ErrorCode::kCorrupt);
  EXPECT_NE(got.status->message().find("carries 2 values, not 1 (do the processes run the same plan?)"),
            std::string::npos)
      << got.status->message();
}

// A message that arrives after its pipeline is gone (a re-plan, a failed step) is dropped.
TEST(RemoteExchange, AMessageArrivingAfterThePipelineIsGoneIsDropped) {
  TwoProcesses job({1, 1}, 1, 2);
  Arrived orphan;
  job[1].exchange->receive(0, recv_activation(0), orphan.callback());
  job[1].exchange.reset();
  job[0].store->put({kRelu}, {rows(2, 8)}, 0, 0, 0, nullptr);
  ASSERT_TRUE(job[0].exchange->send(0, send_activation(0)).is_ok());
  EXPECT_EQ(orphan.calls, 0);
  EXPECT_TRUE(job[0].exchange->send_error().is_ok());
}

// The wire format: tensors (with whether they require a gradient), missing tensors and
// scalars come back as they left; anything else is refused naming the value.
TEST(RemoteExchange, ValuesCrossAsTensorsAndScalarsOnly) {
  const at::Tensor t = rows(2, 3).requires_grad_(true);
  const std::vector<c10::IValue> values = {t, at::Tensor(), c10::IValue(), std::int64_t{7}, 2.5, true};
  auto wire = to_wire(values, {10, 11, 12, 13, 14, 15});
  ASSERT_TRUE(wire.is_ok()) << wire.status().to_string();
  auto back = from_wire(*wire, values.size(), std::nullopt);
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  ASSERT_EQ(back->size(), values.size());
  EXPECT_TRUE(torch::equal((*back)[0].toTensor(), t.detach()));
  EXPECT_TRUE((*back)[0].toTensor().requires_grad());
  EXPECT_FALSE((*back)[1].toTensor().defined());
  EXPECT_TRUE((*back)[2].isNone());
  EXPECT_EQ((*back)[3].toInt(), 7);
  EXPECT_EQ((*back)[4].toDouble(), 2.5);
  EXPECT_EQ((*back)[5].toBool(), true);

  auto refused = to_wire({c10::IValue(std::string("text"))}, {42});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kUnsupported);
  EXPECT_NE(refused.status().message().find("value 42"), std::string::npos) << refused.status().message();
  EXPECT_NE(refused.status().message().find("cut the model where it passes tensors"), std::string::npos);
}

}  // namespace
}  // namespace conveyor::runtime
