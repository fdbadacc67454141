// The step runner on its own (torch-free, no actors): each replica's action list walked as a
// coroutine against fake hooks. Where one replica is enough the test's thread walks it, so
// what runs, and in which order, is fixed. Where ranks must run at once (a rank waits for
// another's send) each walks on a thread of its own, and the tests assert only what every
// interleaving must give: each replica's own order, and, checked inside the hooks, that no
// action ran before what it depends on. Waits are on promises, never on sleeps.
#include "runtime/step_run.h"

#include <gtest/gtest.h>

#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace conveyor::runtime {
namespace {

using scheduler::ActionKind;
using scheduler::ActionList;
using scheduler::action_text;
using scheduler::action_words;
using scheduler::make_schedule;
using scheduler::ScheduleKind;
using scheduler::ScheduleSpec;

constexpr auto kGenerous = std::chrono::seconds(60);  // a bound on a hang, never reached when it passes

Schedule schedule_of(ScheduleKind kind, int ranks, int microbatches) {
  auto s = make_schedule(ScheduleSpec{kind, ranks, microbatches});
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return *s;
}

bool is_compute(const Action& a) { return a.is_compute() || a.kind == ActionKind::kOptimizerStep; }

// The compute actions of `list`, in its order: what the compute hook must see.
ActionList computes_of(const ActionList& list) {
  ActionList out;
  for (const Action& a : list) {
    if (is_compute(a)) out.push_back(a);
  }
  return out;
}

std::size_t measured_of(const Schedule& s, const std::vector<int>& replicas) {
  std::size_t n = 0;
  for (std::size_t r = 0; r < s.ranks.size(); ++r) {
    for (const Action& a : s.ranks[r]) {
      n += static_cast<std::size_t>(replicas[r]) *
           (a.kind != ActionKind::kRecvActivation && a.kind != ActionKind::kRecvGradient);
    }
  }
  return n;
}

// What the hooks saw, per (rank, replica), and the threads they ran on.
struct Log {
  std::mutex mu;
  std::map<std::pair<int, int>, ActionList> computed, transferred, received;
  std::vector<Action> reduced;
  std::set<std::thread::id> compute_threads, transfer_threads;

  void add(std::map<std::pair<int, int>, ActionList>& to, int r, int i, const Action& a, std::set<std::thread::id>* on) {
    std::lock_guard<std::mutex> lock(mu);
    to[{r, i}].push_back(a);
    if (on != nullptr) on->insert(std::this_thread::get_id());
  }
  bool has(std::map<std::pair<int, int>, ActionList>& in, int r, int i, ActionKind kind, int mb) {
    std::lock_guard<std::mutex> lock(mu);
    for (const Action& a : in[{r, i}]) {
      if (a.kind == kind && a.microbatch == mb) return true;
    }
    return false;
  }
};

// Hooks that log every call and refuse, as the step's error, an action whose inputs are not
// there yet: a forward before every producing replica's activation was sent, a backward
// before its forward and the gradient from the next rank, a reduction before every replica's
// backwards, an optimizer step before its stage's reduction. `replicas` per rank; ranks are
// stages here (one chunk each).
RunnerHooks checking_hooks(Log& log, std::vector<int> replicas, int microbatches) {
  RunnerHooks hooks;
  hooks.compute = [&log, replicas](int r, int i, const Action& a) -> Status {
    const auto refuse = [&](const std::string& why) {
      return Status(ErrorCode::kInternal, action_text(a) + " of replica " + std::to_string(i) + " ran " + why);
    };
    const int ranks = static_cast<int>(replicas.size());
    const auto senders = [&](int other) {
      std::vector<int> out;
      for (int j = 0; j < replicas[other]; ++j) {
        if (replicas[other] != replicas[r] || j == i) out.push_back(j);
      }
      return out;
    };
    switch (a.kind) {
      case ActionKind::kForward:
        if (r > 0) {
          for (int j : senders(r - 1)) {
            if (!log.has(log.transferred, r - 1, j, ActionKind::kSendActivation, a.microbatch)) {
              return refuse("before replica " + std::to_string(j) + " of rank " + std::to_string(r - 1) + " sent it");
            }
          }
        }
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (!log.has(log.computed, r, i, ActionKind::kForward, a.microbatch)) return refuse("before its forward");
        if (r + 1 < ranks) {
          for (int j : senders(r + 1)) {
            if (!log.has(log.transferred, r + 1, j, ActionKind::kSendGradient, a.microbatch)) {
              return refuse("before its gradient was sent");
            }
          }
        }
        break;
      case ActionKind::kOptimizerStep: {
        std::lock_guard<std::mutex> lock(log.mu);
        bool reduced = false;
        for (const Action& x : log.reduced) reduced = reduced || x.stage == a.stage;
        if (!reduced) return refuse("before its stage's reduction");
        break;
      }
      default:
        break;
    }
    log.add(log.computed, r, i, a, &log.compute_threads);
    return Status::ok();
  };
  hooks.transfer = [&log](int r, int i, const Action& a) -> Status {
    const ActionKind made_by = a.kind == ActionKind::kSendActivation ? ActionKind::kForward : ActionKind::kBackward;
    if (!log.has(log.computed, r, i, made_by, a.microbatch) &&
        !log.has(log.computed, r, i, ActionKind::kBackwardInput, a.microbatch)) {
      return Status(ErrorCode::kInternal, action_text(a) + " was sent before it was computed");
    }
    log.add(log.transferred, r, i, a, &log.transfer_threads);
    return Status::ok();
  };
  hooks.allreduce = [&log, replicas, microbatches](int r, int i, const Action& a) -> Status {
    if (i != 0) return Status(ErrorCode::kInternal, "the reduction was called for replica " + std::to_string(i));
    for (int j = 0; j < replicas[r]; ++j) {  // every replica's last gradient is in
      for (int mb = 0; mb < microbatches; ++mb) {
        if (!log.has(log.computed, r, j, ActionKind::kBackward, mb) &&
            !log.has(log.computed, r, j, ActionKind::kBackwardWeight, mb)) {
          return Status(ErrorCode::kInternal, "stage " + std::to_string(a.stage) + " was reduced before replica " +
                                                  std::to_string(j) + "'s backward of microbatch " + std::to_string(mb));
        }
      }
    }
    std::lock_guard<std::mutex> lock(log.mu);
    log.reduced.push_back(a);
    return Status::ok();
  };
  return hooks;
}

// Walks every worker of `step` on a thread of its own and waits for the step.
Result<RunResult> run_on_threads(StepRun& step, std::chrono::milliseconds timeout = kGenerous) {
  std::vector<std::thread> threads;
  for (int w = 0; w < step.workers(); ++w) threads.emplace_back([&step, w] { step.run_replica(w); });
  auto result = step.wait(timeout);
  for (auto& t : threads) t.join();
  return result;
}

// One rank: its list runs in order on the thread that walks it (here the test's), the
// reduction runs once before the optimizer step, and every action but a receive is measured.
TEST(StepRun, OneReplicasListRunsInOrderOnTheThreadThatWalksIt) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 1, 4);
  Log log;
  auto step = StepRun::create(schedule, checking_hooks(log, {1}, schedule.spec.microbatches));
  ASSERT_TRUE(step.is_ok()) << step.status().to_string();
  ASSERT_EQ((*step)->workers(), 1);
  EXPECT_EQ((*step)->worker(0), std::make_pair(0, 0));
  (*step)->run_replica(0);
  auto result = (*step)->wait(kGenerous);
  ASSERT_TRUE(result.is_ok()) << result.status().to_string();
  EXPECT_EQ((log.computed[{0, 0}]), computes_of(schedule.ranks[0]));
  EXPECT_EQ(log.compute_threads, std::set<std::thread::id>{std::this_thread::get_id()});
  ASSERT_EQ(log.reduced.size(), 1u);
  EXPECT_EQ(result->spans.size(), measured_of(schedule, {1}));
  EXPECT_TRUE((*step)->stuck().empty());
}

// Ranks walking at once: each keeps its list's order, nothing runs before its inputs
// (checked in the hooks), and every transfer runs on the one communication thread.
TEST(StepRun, RanksKeepTheirOrderAndRunNothingBeforeItsInputs) {
  for (ScheduleKind kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1}) {
    const Schedule schedule = schedule_of(kind, 3, 4);
    Log log;
    auto step = StepRun::create(schedule, checking_hooks(log, {1, 1, 1}, schedule.spec.microbatches));
    ASSERT_TRUE(step.is_ok()) << step.status().to_string();
    auto result = run_on_threads(**step);
    ASSERT_TRUE(result.is_ok()) << scheduler::schedule_kind_name(kind) << ": " << result.status().to_string();
    for (int r = 0; r < 3; ++r) EXPECT_EQ((log.computed[{r, 0}]), computes_of(schedule.ranks[r])) << "rank " << r;
    EXPECT_EQ(log.reduced.size(), 3u);
    EXPECT_EQ(log.compute_threads.size(), 3u);
    ASSERT_EQ(log.transfer_threads.size(), 1u);
    EXPECT_EQ(log.compute_threads.count(*log.transfer_threads.begin()), 0u);
    EXPECT_EQ(result->spans.size(), measured_of(schedule, {1, 1, 1}));
  }
}

// Two replicas feeding one: the reader waits for both producers' sends, the producers for the
// reader's gradient, and the producers' stage is reduced once, after both replicas reach it
// and before either's optimizer step (the hooks refuse anything else).
TEST(StepRun, ReplicasWaitForEveryProducerAndTheirStageIsReducedOnce) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 2, 3);
  const std::vector<int> replicas = {2, 1};
  Log log;
  auto step = StepRun::create(schedule, checking_hooks(log, replicas, schedule.spec.microbatches), replicas);
  ASSERT_TRUE(step.is_ok()) << step.status().to_string();
  ASSERT_EQ((*step)->workers(), 3);
  EXPECT_EQ((*step)->worker(1), std::make_pair(0, 1));
  EXPECT_EQ((*step)->worker(2), std::make_pair(1, 0));
  auto result = run_on_threads(**step);
  ASSERT_TRUE(result.is_ok()) << result.status().to_string();
  for (int i = 0; i < 2; ++i) EXPECT_EQ((log.computed[{0, i}]), computes_of(schedule.ranks[0])) << "replica " << i;
  EXPECT_EQ((log.computed[{1, 0}]), computes_of(schedule.ranks[1]));
  std::multiset<int> reduced_stages;
  for (const Action& a : log.reduced) reduced_stages.insert(a.stage);
  EXPECT_EQ(reduced_stages, (std::multiset<int>{0, 1}));
  EXPECT_EQ(result->spans.size(), measured_of(schedule, replicas));
}

// A hook's failure ends the step with its status, naming the rank and the action; the
// failing replica runs nothing after it.
TEST(StepRun, AFailureMidListEndsTheStepWithItsStatus) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 1, 4);
  Log log;
  RunnerHooks hooks = checking_hooks(log, {1}, schedule.spec.microbatches);
  hooks.compute = [&log, inner = hooks.compute](int r, int i, const Action& a) {
    if (a.kind == ActionKind::kBackward && a.microbatch == 1) {
      return Status(ErrorCode::kExecution, "out of memory in the test");
    }
    return inner(r, i, a);
  };
  auto step = StepRun::create(schedule, hooks);
  ASSERT_TRUE(step.is_ok());
  (*step)->run_replica(0);
  auto result = (*step)->wait(kGenerous);
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kExecution);
  EXPECT_NE(result.status().message().find("out of memory in the test"), std::string::npos);
  EXPECT_NE(result.status().message().find("rank 0 at the backward of microbatch 1 (B1)"), std::string::npos)
      << result.status().message();
  // What ran is the list up to the failing backward, which the log does not hold.
  ActionList before;
  for (const Action& a : computes_of(schedule.ranks[0])) {
    if (a.kind == ActionKind::kBackward && a.microbatch == 1) break;
    before.push_back(a);
  }
  EXPECT_EQ((log.computed[{0, 0}]), before);
  EXPECT_TRUE(log.reduced.empty());
  EXPECT_TRUE((*step)->stuck().empty());
}

bool is_prefix(const ActionList& of, const ActionList& list) {
  return of.size() <= list.size() && std::equal(of.begin(), of.end(), list.begin());
}

// The same across ranks: a rank failing mid-list wakes the ranks waiting for it, every walk
// returns, and the step reports the first failure.
TEST(StepRun, AFailingRankWakesTheOthersAndTheStepReportsIt) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 3, 4);
  Log log;
  RunnerHooks hooks = checking_hooks(log, {1, 1, 1}, schedule.spec.microbatches);
  hooks.compute = [&log, inner = hooks.compute](int r, int i, const Action& a) {
    if (r == 1 && a.kind == ActionKind::kForward && a.microbatch == 2) {
      return Status(ErrorCode::kExecution, "a NaN in the test");
    }
    return inner(r, i, a);
  };
  auto step = StepRun::create(schedule, hooks);
  ASSERT_TRUE(step.is_ok());
  auto result = run_on_threads(**step);  // returns: every thread joined
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kExecution);
  EXPECT_NE(result.status().message().find("rank 1 at the forward of microbatch 2 (F2)"), std::string::npos)
      << result.status().message();
  EXPECT_NE(result.status().message().find("a NaN in the test"), std::string::npos);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(is_prefix(log.computed[{r, 0}], computes_of(schedule.ranks[r]))) << r;
  EXPECT_FALSE(log.has(log.computed, 1, 0, ActionKind::kForward, 2));
  EXPECT_FALSE(log.has(log.computed, 2, 0, ActionKind::kForward, 2));  // it never got its input
  EXPECT_TRUE((*step)->stuck().empty());
}

// A failing transfer (on the communication thread) fails the step naming the send.
TEST(StepRun, AFailingTransferNamesItsSend) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 2, 2);
  Log log;
  RunnerHooks hooks = checking_hooks(log, {1, 1}, schedule.spec.microbatches);
  hooks.transfer = [&log, inner = hooks.transfer](int r, int i, const Action& a) {
    if (a.kind == ActionKind::kSendGradient) return Status(ErrorCode::kExecution, "the link went down");
    return inner(r, i, a);
  };
  auto step = StepRun::create(schedule, hooks);
  ASSERT_TRUE(step.is_ok());
  auto result = run_on_threads(**step);
  ASSERT_FALSE(result.is_ok());
  EXPECT_NE(result.status().message().find("rank 1 at sending microbatch 0's gradients to rank 0 (sendG0>0)"),
            std::string::npos)
      << result.status().message();
  EXPECT_NE(result.status().message().find("the link went down"), std::string::npos);
  EXPECT_FALSE(log.has(log.computed, 0, 0, ActionKind::kBackward, 0));  // its gradient never came
}

// Rank 1 runs in another process: rank 0's walk asks the receive hook for what that process
// sends, before each backward that needs it, and hands its sends to the transfer hook.
TEST(StepRun, ReplicasInAnotherProcessAreReachedThroughTheHooks) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 2, 3);
  Log log;
  RunnerHooks hooks;
  ActionList sequence;  // rank 0's receives and computes, on its walk's thread (the test's)
  hooks.compute = [&sequence](int, int, const Action& a) {
    sequence.push_back(a);
    return Status::ok();
  };
  hooks.transfer = [&log](int r, int i, const Action& a) {
    log.add(log.transferred, r, i, a, nullptr);
    return Status::ok();
  };
  hooks.receive = [&sequence](int r, int i, const Action& a, std::function<void(Status)> arrived) {
    EXPECT_EQ(r, 0);
    EXPECT_EQ(i, 0);
    sequence.push_back(a);
    arrived(Status::ok());
  };
  auto step = StepRun::create(schedule, hooks, {1, 1}, LocalReplicas{{true}, {false}});
  ASSERT_TRUE(step.is_ok()) << step.status().to_string();
  ASSERT_EQ((*step)->workers(), 1);
  (*step)->run_replica(0);
  auto result = (*step)->wait(kGenerous);
  ASSERT_TRUE(result.is_ok()) << result.status().to_string();
  ActionList expected;
  for (const Action& a : schedule.ranks[0]) {
    if (is_compute(a) || a.kind == ActionKind::kRecvGradient) expected.push_back(a);
  }
  EXPECT_EQ(sequence, expected);
  ActionList sends;
  for (const Action& a : schedule.ranks[0]) {
    if (a.kind == ActionKind::kSendActivation) sends.push_back(a);
  }
  EXPECT_EQ((log.transferred[{0, 0}]), sends);
}

// An evaluation's list ends with a send, which reads what the step's caller clears once the
// step returns: the step ends only after every send ran, in the order the list posted them.
TEST(StepRun, AForwardOnlyStepEndsAfterItsLastSend) {
  auto made = make_schedule(ScheduleSpec{ScheduleKind::kOneFOneB, 2, 4, 1, /*forward_only=*/true});
  ASSERT_TRUE(made.is_ok()) << made.status().to_string();
  const Schedule& schedule = *made;
  ASSERT_EQ(schedule.ranks[0].back().kind, ActionKind::kSendActivation);
  Log log;
  RunnerHooks hooks;
  hooks.compute = [&log](int r, int i, const Action& a) {
    log.add(log.computed, r, i, a, nullptr);
    return Status::ok();
  };
  hooks.transfer = [&log](int r, int i, const Action& a) {
    log.add(log.transferred, r, i, a, nullptr);
    return Status::ok();
  };
  auto step = StepRun::create(schedule, hooks, {1, 1}, LocalReplicas{{true}, {false}});
  ASSERT_TRUE(step.is_ok()) << step.status().to_string();
  (*step)->run_replica(0);
  auto result = (*step)->wait(kGenerous);
  ASSERT_TRUE(result.is_ok()) << result.status().to_string();
  ActionList sends;
  for (const Action& a : schedule.ranks[0]) {
    if (a.kind == ActionKind::kSendActivation) sends.push_back(a);
  }
  EXPECT_EQ(sends.size(), 4u);
  EXPECT_EQ((log.transferred[{0, 0}]), sends);
  EXPECT_EQ((log.computed[{0, 0}]), computes_of(schedule.ranks[0]));
}

// Another process's failure, reported through the receive hook, fails the step naming the receive.
TEST(StepRun, AFailedReceiveFromAnotherProcessFailsTheStep) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 2, 2);
  RunnerHooks hooks;
  hooks.compute = [](int, int, const Action&) { return Status::ok(); };
  hooks.receive = [](int, int, const Action&, std::function<void(Status)> arrived) {
    arrived(Status(ErrorCode::kExecution, "process 1 was lost"));
  };
  auto step = StepRun::create(schedule, hooks, {1, 1}, LocalReplicas{{true}, {false}});
  ASSERT_TRUE(step.is_ok());
  (*step)->run_replica(0);
  auto result = (*step)->wait(kGenerous);
  ASSERT_FALSE(result.is_ok());
  EXPECT_NE(result.status().message().find("rank 0 at receiving microbatch 0's gradients from rank 1 (recvG0<1)"),
            std::string::npos)
      << result.status().message();
  EXPECT_NE(result.status().message().find("process 1 was lost"), std::string::npos);
}

// A replica waiting for a message that never comes, walked on its own thread. The receive
// hook keeps `arrived` and says when the replica reached it.
struct WaitingForever {
  std::promise<Action> reached;
  std::function<void(Status)> arrived;  // never called
  RunnerHooks hooks() {
    RunnerHooks h;
    h.compute = [](int, int, const Action&) { return Status::ok(); };
    h.receive = [this](int, int, const Action& a, std::function<void(Status)> done) {
      arrived = std::move(done);
      reached.set_value(a);
    };
    return h;
  }
};

// A step that does not finish in its time says where each replica waits; the waiting replica
// is woken and leaves, so none is stuck.
TEST(StepRun, AStepThatDoesNotFinishInTimeNamesWhereEachReplicaWaits) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 2, 2);
  WaitingForever peer;
  auto step = StepRun::create(schedule, peer.hooks(), {1, 1}, LocalReplicas{{true}, {false}});
  ASSERT_TRUE(step.is_ok());
  auto reached = peer.reached.get_future();
  std::thread walk([&] { (*step)->run_replica(0); });
  const Action at = reached.get();  // the replica is at its receive, and stays there
  auto result = (*step)->wait(std::chrono::milliseconds(50));
  walk.join();
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kExecution);
  EXPECT_NE(result.status().message().find("did not finish within 50 ms"), std::string::npos);
  EXPECT_NE(result.status().message().find("rank 0 at " + action_words(at) + ";"), std::string::npos)
      << result.status().message();
  EXPECT_TRUE((*step)->stuck().empty());
}

// A caller that says stop (the bindings: Ctrl-C) ends the step with kInterrupted.
TEST(StepRun, AStepItsCallerStopsEndsInterrupted) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 2, 2);
  WaitingForever peer;
  auto step = StepRun::create(schedule, peer.hooks(), {1, 1}, LocalReplicas{{true}, {false}});
  ASSERT_TRUE(step.is_ok());
  auto reached = peer.reached.get_future();
  std::thread walk([&] { (*step)->run_replica(0); });
  reached.wait();
  int asked = 0;
  auto result = (*step)->wait(kGenerous, [&] { return ++asked == 1; });
  walk.join();
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kInterrupted);
  EXPECT_EQ(asked, 1);
  EXPECT_TRUE((*step)->stuck().empty());
}

TEST(StepRun, BadArgumentsAreRefusedSayingWhatIsWrong) {
  const Schedule schedule = schedule_of(ScheduleKind::kOneFOneB, 2, 2);
  RunnerHooks none;
  RunnerHooks hooks;
  hooks.compute = [](int, int, const Action&) { return Status::ok(); };
  const auto message = [](const Result<std::shared_ptr<StepRun>>& r) {
    EXPECT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    return r.status().message();
  };
  EXPECT_EQ(message(StepRun::create(schedule, none)), "the runner needs a compute hook");
  EXPECT_EQ(message(StepRun::create(schedule, hooks, {1, 1, 1})),
            "replica counts for 3 ranks, but the schedule has 2");
  EXPECT_EQ(message(StepRun::create(schedule, hooks, {1, 0})), "rank 1 has 0 replicas (at least 1)");
  EXPECT_EQ(message(StepRun::create(schedule, hooks, {2, 1}, LocalReplicas{{true}, {true}})),
            "rank 0 has 2 replicas but 1 are placed");
  EXPECT_EQ(message(StepRun::create(schedule, hooks, {1, 1}, {}, {0})), "splits given for 1 ranks, but the schedule has 2");
  Schedule broken = schedule;
  broken.ranks[1].clear();  // rank 1 never receives what rank 0 sends
  EXPECT_FALSE(StepRun::create(broken, hooks).is_ok());
}

}  // namespace
}  // namespace conveyor::runtime
