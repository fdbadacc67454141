#include "runtime/coordinator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "trace/simulation_trace.h"

namespace conveyor::runtime {
using namespace scheduler;  // the schedules the runner walks
// (The tests name the scheduler's types unqualified; the actors run them.)
namespace {

// Records what each stage has done and checks, inside the hooks, that every action's data
// dependencies were met before it ran (on whichever thread it ran).
struct Recorder {
  explicit Recorder(const ScheduleSpec& spec) : spec(spec) {
    const std::size_t n = static_cast<std::size_t>(spec.stages() * spec.microbatches);
    f = std::vector<std::atomic<int>>(n);
    b = std::vector<std::atomic<int>>(n);
    w = std::vector<std::atomic<int>>(n);
    sent = std::vector<std::atomic<int>>(2 * n);
  }
  void reset() {
    for (auto* v : {&f, &b, &w, &sent}) {
      for (auto& x : *v) x = 0;
    }
    reduced.clear();
    steps = 0;
  }
  std::size_t at(int stage, int mb) const { return static_cast<std::size_t>(stage * spec.microbatches + mb); }

  Status compute(int rank, const Action& a) {
    auto bad = [&](const std::string& why) { return Status(ErrorCode::kInternal, action_text(a, true) + ": " + why); };
    const int s = a.stage, mb = a.microbatch;
    // A little real work so threads interleave.
    volatile double x = 0;
    for (int i = 0; i < 2000; ++i) x = x + i * 0.5;
    switch (a.kind) {
      case ActionKind::kForward:
        if (s > 0 && !sent[at(s - 1, mb)]) return bad("ran before its activation arrived");
        ++f[at(s, mb)];
        break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput:
        if (!f[at(s, mb)]) return bad("ran before its forward");
        if (s + 1 < spec.stages() && !sent[f.size() + at(s + 1, mb)]) return bad("ran before its gradient arrived");
        ++b[at(s, mb)];
        break;
      case ActionKind::kBackwardWeight:
        if (!b[at(s, mb)]) return bad("ran before its input-gradient pass");
        ++w[at(s, mb)];
        break;
      case ActionKind::kOptimizerStep:
        for (int st = rank; st < spec.stages(); st += spec.ranks) {
          for (int m = 0; m < spec.microbatches; ++m) {
            if (!b[at(st, m)]) return bad("ran before every backward of its stages");
          }
          std::lock_guard<std::mutex> lock(mu);
          if (!reduced.count(st)) return bad("ran before the allreduce of stage " + std::to_string(st));
        }
        ++steps;
        break;
      default:
        return bad("not a compute action");
    }
    return Status::ok();
  }

  Status transfer(int, const Action& a) {
    const bool grad = a.kind == ActionKind::kSendGradient;
    // The data exists: the forward (or backward) that produced it has run.
    if (!(grad ? b[at(a.stage, a.microbatch)] : f[at(a.stage, a.microbatch)])) {
      return Status(ErrorCode::kInternal, action_text(a, true) + " sent before it was computed");
    }
    ++sent[(grad ? f.size() : 0) + at(a.stage, a.microbatch)];
    return Status::ok();
  }

  Status allreduce(int, const Action& a) {
    std::lock_guard<std::mutex> lock(mu);
    reduced.insert(a.stage);
    return Status::ok();
  }

  RunnerHooks hooks() {
    return {[this](int r, int, const Action& a) { return compute(r, a); },
            [this](int r, int, const Action& a) { return transfer(r, a); },
            [this](int r, int, const Action& a) { return allreduce(r, a); }};
  }

  ScheduleSpec spec;
  std::vector<std::atomic<int>> f, b, w, sent;
  std::mutex mu;
  std::set<int> reduced;
  std::atomic<int> steps{0};
};

Result<RunResult> run_once(const Schedule& schedule, RunnerHooks hooks, std::vector<int> replicas = {},
                           std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  CONVEYOR_ASSIGN_OR_RETURN(auto coordinator, runtime::Coordinator::create(schedule, std::move(hooks), std::move(replicas)));
  return coordinator->run_step(timeout);
}

// Every schedule, five steps on the same actors: each step runs in dependency order, every
// action is measured, and each replica keeps its one thread from step to step.
TEST(Coordinator, EveryScheduleRunsInDependencyOrderOnPersistentReplicaThreads) {
  for (auto spec : {ScheduleSpec{ScheduleKind::kGPipe, 4, 8}, ScheduleSpec{ScheduleKind::kOneFOneB, 4, 8},
                    ScheduleSpec{ScheduleKind::kZeroBubbleH1, 4, 8}, ScheduleSpec{ScheduleKind::kInterleaved, 3, 6, 2},
                    ScheduleSpec{ScheduleKind::kOneFOneB, 1, 3}}) {
    auto schedule = make_schedule(spec);
    ASSERT_TRUE(schedule.is_ok());
    Recorder rec(spec);
    std::mutex mu;
    std::map<int, std::set<std::thread::id>> threads;  // rank -> threads its compute ran on
    RunnerHooks hooks = rec.hooks();
    auto inner = hooks.compute;
    hooks.compute = [&, inner](int r, int i, const Action& a) {
      {
        std::lock_guard<std::mutex> lock(mu);
        threads[r].insert(std::this_thread::get_id());
      }
      return inner(r, i, a);
    };
    auto coordinator = runtime::Coordinator::create(*schedule, hooks);
    ASSERT_TRUE(coordinator.is_ok()) << coordinator.status().to_string();
    for (int repeat = 0; repeat < 5; ++repeat) {
      rec.reset();
      auto result = (*coordinator)->run_step(std::chrono::seconds(60));
      ASSERT_TRUE(result.is_ok()) << schedule_kind_name(spec.kind) << ": " << result.status().to_string();
      for (std::size_t i = 0; i < rec.f.size(); ++i) {
        EXPECT_EQ(rec.f[i], 1);
        EXPECT_EQ(rec.b[i], 1);
      }
      EXPECT_EQ(rec.steps, spec.ranks);
      // Every action was measured: compute, sends, allreduces.
      std::size_t actions = 0;
      for (const auto& list : schedule->ranks) {
        for (const auto& a : list) actions += a.kind != ActionKind::kRecvActivation && a.kind != ActionKind::kRecvGradient;
      }
      EXPECT_EQ(result->spans.size(), actions);
      // The measured step decodes as a valid trace with a flow per transfer.
      trace::PerfettoTrace t;
      SimulationResult as_sim;
      as_sim.spans = result->spans;
      trace::add_simulation(t, *schedule, as_sim, "measured");
      auto summary = trace::check_trace(t.serialize());
      ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
      EXPECT_EQ(summary->flows, static_cast<std::size_t>(2 * (spec.stages() - 1) * spec.microbatches));
    }
    // One thread per rank for all five steps, none shared between ranks.
    std::set<std::thread::id> all;
    for (int r = 0; r < spec.ranks; ++r) {
      EXPECT_EQ(threads[r].size(), 1u) << "rank " << r << " ran on " << threads[r].size() << " threads";
      all.insert(threads[r].begin(), threads[r].end());
    }
    EXPECT_EQ(all.size(), static_cast<std::size_t>(spec.ranks));
    EXPECT_EQ(all.count(std::this_thread::get_id()), 0u);
  }
}

// Replicated ranks: each replica runs the list on its share; a receive waits for the
// matching replica (equal counts) or for every producing replica (different counts); the
// allreduce runs once per stage after every replica's backwards, and before any replica's
// optimizer step.
TEST(Coordinator, ReplicatedRanksWaitForTheirProducersAndReduceOnce) {
  for (auto spec : {ScheduleSpec{ScheduleKind::kOneFOneB, 4, 6}, ScheduleSpec{ScheduleKind::kZeroBubbleH1, 4, 6},
                    ScheduleSpec{ScheduleKind::kGPipe, 4, 3}}) {
    const std::vector<int> replicas = {2, 1, 3, 3};
    auto schedule = make_schedule(spec);
    ASSERT_TRUE(schedule.is_ok());
    const int p = spec.ranks, m = spec.microbatches, most = 3;
    auto idx = [&](int s, int mb, int i) { return static_cast<std::size_t>((s * m + mb) * most + i); };
    std::vector<std::atomic<int>> f(p * m * most), b(p * m * most), sent_a(p * m * most), sent_g(p * m * most);
    std::vector<std::atomic<int>> reduced(p), stepped(p * most);
    auto producers = [&](int s, int i, int other) {
      std::vector<int> out;
      if (replicas[s] == replicas[other]) return std::vector<int>{i};
      for (int j = 0; j < replicas[other]; ++j) out.push_back(j);
      return out;
    };
    RunnerHooks hooks;
    hooks.compute = [&](int r, int i, const Action& a) -> Status {
      auto bad = [&](const std::string& why) {
        return Status(ErrorCode::kInternal, "replica " + std::to_string(i) + " " + action_text(a) + ": " + why);
      };
      const int s = a.stage, mb = a.microbatch;
      switch (a.kind) {
        case ActionKind::kForward:
          if (s > 0) {
            for (int j : producers(s, i, s - 1)) {
              if (!sent_a[idx(s - 1, mb, j)]) return bad("ran before producer replica " + std::to_string(j));
            }
          }
          ++f[idx(s, mb, i)];
          break;
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput:
          if (s + 1 < p) {
            for (int j : producers(s, i, s + 1)) {
              if (!sent_g[idx(s + 1, mb, j)]) return bad("ran before gradient replica " + std::to_string(j));
            }
          }
          ++b[idx(s, mb, i)];
          break;
        case ActionKind::kBackwardWeight:
          break;
        case ActionKind::kOptimizerStep:
          if (!reduced[r]) return bad("stepped before the allreduce");
          ++stepped[static_cast<std::size_t>(r * most + i)];
          break;
        default:
          return bad("not compute");
      }
      return Status::ok();
    };
    hooks.transfer = [&](int, int i, const Action& a) -> Status {
      (a.kind == ActionKind::kSendGradient ? sent_g : sent_a)[idx(a.stage, a.microbatch, i)]++;
      return Status::ok();
    };
    hooks.allreduce = [&](int r, int i, const Action& a) -> Status {
      for (int j = 0; j < replicas[r]; ++j) {
        for (int mb = 0; mb < m; ++mb) {
          if (!b[idx(a.stage, mb, j)]) return Status(ErrorCode::kInternal, "allreduce before every backward");
        }
      }
      if (i != 0 || reduced[r]++) return Status(ErrorCode::kInternal, "allreduce ran twice");
      return Status::ok();
    };
    auto result = run_once(*schedule, hooks, replicas);
    ASSERT_TRUE(result.is_ok()) << schedule_kind_name(spec.kind) << ": " << result.status().to_string();
    for (int s = 0; s < p; ++s) {
      EXPECT_EQ(reduced[s], 1);
      for (int i = 0; i < replicas[s]; ++i) {
        EXPECT_EQ(stepped[static_cast<std::size_t>(s * most + i)], 1);
        for (int mb = 0; mb < m; ++mb) {
          EXPECT_EQ(f[idx(s, mb, i)], 1);
          EXPECT_EQ(b[idx(s, mb, i)], 1);
        }
      }
    }
  }
  auto refused = runtime::Coordinator::create(*make_schedule({ScheduleKind::kOneFOneB, 2, 2}),
                                             RunnerHooks{[](int, int, const Action&) { return Status::ok(); }}, {1, 0});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("rank 1 has 0 replicas"), std::string::npos);
}

// Two processes simulated by two Coordinators with complementary placements: each runs
// only its own replicas; what a replica sends to a replica of the other goes through the
// transfer hook, what it waits for from there through the receive hook; a stage's
// allreduce runs once in each process, when that process's own replicas have arrived.
TEST(Coordinator, ReplicasPlacedInOtherProcessesAreReachedThroughTheHooks) {
  const ScheduleSpec spec{ScheduleKind::kOneFOneB, 2, 4};
  auto schedule = make_schedule(spec);
  ASSERT_TRUE(schedule.is_ok());
  for (const std::vector<int>& replicas : {std::vector<int>{2, 2}, std::vector<int>{2, 1}}) {
    const int m = spec.microbatches, most = 2;
    // Process 0 runs replica 0 of every rank, process 1 the rest.
    auto process_of = [](int, int i) { return i == 0 ? 0 : 1; };
    auto idx = [&](int s, int mb, int i) { return static_cast<std::size_t>((s * m + mb) * most + i); };
    std::mutex mu;
    std::condition_variable cv;
    std::vector<int> sent_a(2 * m * most), sent_g(2 * m * most), f(2 * m * most), b(2 * m * most);
    int reductions[2][2] = {{0, 0}, {0, 0}};  // [process][stage]
    std::vector<std::future<void>> waiters;
    auto partners = [&](int s, int i, int other) {
      return partner_replicas(replicas, s, i, other);
    };
    auto hooks_of = [&](int process) {
      RunnerHooks hooks;
      hooks.compute = [&, process](int r, int i, const Action& a) -> Status {
        std::lock_guard<std::mutex> lock(mu);
        if (process_of(r, i) != process) return Status(ErrorCode::kInternal, "ran a replica of the other process");
        const int s = a.stage, mb = a.microbatch;
        if (a.kind == ActionKind::kForward) {
          for (int j : s > 0 ? partners(s, i, s - 1) : std::vector<int>{}) {
            if (!sent_a[idx(s - 1, mb, j)]) return Status(ErrorCode::kInternal, "forward before its activation");
          }
          ++f[idx(s, mb, i)];
        } else if (a.kind == ActionKind::kBackward) {
          for (int j : s + 1 < 2 ? partners(s, i, s + 1) : std::vector<int>{}) {
            if (!sent_g[idx(s + 1, mb, j)]) return Status(ErrorCode::kInternal, "backward before its gradient");
          }
          ++b[idx(s, mb, i)];
        }
        return Status::ok();
      };
      hooks.transfer = [&](int, int i, const Action& a) -> Status {
        std::lock_guard<std::mutex> lock(mu);
        (a.kind == ActionKind::kSendGradient ? sent_g : sent_a)[idx(a.stage, a.microbatch, i)] = 1;
        cv.notify_all();
        return Status::ok();
      };
      hooks.receive = [&, process](int r, int i, const Action& a, std::function<void(Status)> arrived) {
        const bool grad = a.kind == ActionKind::kRecvGradient;
        const int other = grad ? r + 1 : r - 1;
        std::vector<int> remote;
        for (int j : partners(r, i, other)) {
          if (process_of(other, j) != process) remote.push_back(j);
        }
        std::lock_guard<std::mutex> lock(mu);
        waiters.push_back(std::async(std::launch::async, [&, grad, other, remote, mb = a.microbatch, arrived] {
          std::unique_lock<std::mutex> wait(mu);
          const bool in = cv.wait_for(wait, std::chrono::seconds(30), [&] {
            for (int j : remote) {
              if (!(grad ? sent_g : sent_a)[idx(other, mb, j)]) return false;
            }
            return true;
          });
          wait.unlock();
          arrived(in ? Status::ok() : Status(ErrorCode::kExecution, "never arrived"));
        }));
      };
      hooks.allreduce = [&, process](int r, int, const Action& a) -> Status {
        std::lock_guard<std::mutex> lock(mu);
        for (int i = 0; i < replicas[r]; ++i) {
          for (int mb = 0; mb < m; ++mb) {
            if (process_of(r, i) == process && !b[idx(a.stage, mb, i)]) {
              return Status(ErrorCode::kInternal, "allreduce before this process's backwards");
            }
          }
        }
        ++reductions[process][a.stage];
        return Status::ok();
      };
      return hooks;
    };
    std::vector<std::unique_ptr<runtime::Coordinator>> processes;
    for (int process = 0; process < 2; ++process) {
      LocalReplicas local;
      for (int r = 0; r < 2; ++r) {
        local.emplace_back();
        for (int i = 0; i < replicas[r]; ++i) local.back().push_back(process_of(r, i) == process);
      }
      auto made = runtime::Coordinator::create(*schedule, hooks_of(process), replicas, std::nullopt, local);
      ASSERT_TRUE(made.is_ok()) << made.status().to_string();
      processes.push_back(std::move(*made));
    }
    auto other = std::async(std::launch::async, [&] { return processes[1]->run_step(std::chrono::seconds(60)); });
    auto mine = processes[0]->run_step(std::chrono::seconds(60));
    auto theirs = other.get();
    ASSERT_TRUE(mine.is_ok()) << mine.status().to_string();
    ASSERT_TRUE(theirs.is_ok()) << theirs.status().to_string();
    for (auto& w : waiters) w.get();
    for (int s = 0; s < 2; ++s) {
      for (int i = 0; i < replicas[s]; ++i) {
        for (int mb = 0; mb < m; ++mb) EXPECT_EQ(b[idx(s, mb, i)], 1) << s << " " << i << " " << mb;
      }
      // A process with a replica of the stage reduces it once; one without never.
      EXPECT_EQ(reductions[0][s], 1);
      EXPECT_EQ(reductions[1][s], replicas[s] > 1 ? 1 : 0);
    }
  }
  auto misplaced = runtime::Coordinator::create(*schedule, RunnerHooks{[](int, int, const Action&) { return Status::ok(); }},
                                               {2, 1}, std::nullopt, LocalReplicas{{true}, {true}});
  ASSERT_FALSE(misplaced.is_ok());
  EXPECT_NE(misplaced.status().message().find("rank 0 has 2 replicas but 1 are placed"), std::string::npos);
}

TEST(Coordinator, AFailingHookStopsEveryRankAndNamesItself) {
  auto schedule = make_schedule({ScheduleKind::kOneFOneB, 4, 8});
  ASSERT_TRUE(schedule.is_ok());
  Recorder rec(schedule->spec);
  RunnerHooks hooks = rec.hooks();
  auto inner = hooks.compute;
  hooks.compute = [inner](int r, int, const Action& a) {
    if (r == 2 && a.kind == ActionKind::kBackward && a.microbatch == 3) {
      return Status(ErrorCode::kExecution, "out of memory in the test");
    }
    return inner(r, 0, a);
  };
  auto result = run_once(*schedule, hooks);
  ASSERT_FALSE(result.is_ok());
  EXPECT_NE(result.status().message().find("rank 2 at the backward of microbatch 3 (B3)"), std::string::npos)
      << result.status().message();
  EXPECT_NE(result.status().message().find("out of memory in the test"), std::string::npos);
}

// `rec`'s hooks, whose compute holds rank `rank`'s forward of `microbatch` until `gate` is
// ready (a peer lost or hung, say). What the held hook touches is owned by the hooks: it may
// outlive the step.
RunnerHooks held_at(const std::shared_ptr<Recorder>& rec, int rank, int microbatch, std::shared_future<void> gate) {
  RunnerHooks hooks = rec->hooks();
  hooks.compute = [rec, inner = hooks.compute, gate, rank, microbatch](int r, int, const Action& a) {
    if (r == rank && a.kind == ActionKind::kForward && a.microbatch == microbatch) gate.wait();
    return inner(r, 0, a);
  };
  hooks.transfer = [rec](int r, int, const Action& a) { return rec->transfer(r, a); };
  hooks.allreduce = [rec](int r, int, const Action& a) { return rec->allreduce(r, a); };
  return hooks;
}

TEST(Coordinator, AHookThatNeverReturnsTimesOutNamingWhereRanksWaitAndFailsLaterStepsAtOnce) {
  auto schedule = make_schedule({ScheduleKind::kOneFOneB, 3, 4});
  ASSERT_TRUE(schedule.is_ok());
  auto rec = std::make_shared<Recorder>(schedule->spec);
  auto release = std::make_shared<std::promise<void>>();
  auto coordinator = runtime::Coordinator::create(*schedule, held_at(rec, 1, 1, release->get_future().share()));
  ASSERT_TRUE(coordinator.is_ok());
  auto result = (*coordinator)->run_step(std::chrono::milliseconds(300));
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kExecution);
  EXPECT_NE(result.status().message().find("did not finish within 300 ms"), std::string::npos);
  EXPECT_NE(result.status().message().find("rank 1 at the forward of microbatch 1 (F1)"), std::string::npos)
      << result.status().message();
  // Rank 1's replica is still inside its hook: the next step says so at once, not after a timeout.
  const auto start = std::chrono::steady_clock::now();
  auto again = (*coordinator)->run_step(std::chrono::seconds(30));
  ASSERT_FALSE(again.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(again.status().message().find("rank 1 replica 0 is still inside a hook"), std::string::npos)
      << again.status().message();
  release->set_value();  // let the stuck thread finish
  // Once the hook returns (and its replica has left the failed step), the pipeline runs again.
  Result<RunResult> recovered = Status(ErrorCode::kInternal, "not run");
  for (auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       std::chrono::steady_clock::now() < until;) {
    rec->reset();
    recovered = (*coordinator)->run_step(std::chrono::seconds(30));
    if (recovered.is_ok() || recovered.status().message().find("still inside") == std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(recovered.is_ok()) << recovered.status().to_string();
}

// A step waiting for a replica that waits for a peer asks its caller whether to stop (the
// bindings: Ctrl-C): told so, it fails at once with kInterrupted, well inside its timeout,
// and once the replica is released the pipeline runs again.
TEST(Coordinator, AStepItsCallerStopsFailsAtOnceAndTheNextRuns) {
  auto schedule = make_schedule({ScheduleKind::kOneFOneB, 2, 2});
  ASSERT_TRUE(schedule.is_ok());
  auto rec = std::make_shared<Recorder>(schedule->spec);
  auto release = std::make_shared<std::promise<void>>();
  auto coordinator = runtime::Coordinator::create(*schedule, held_at(rec, 1, 0, release->get_future().share()));
  ASSERT_TRUE(coordinator.is_ok());
  std::atomic<int> asked{0};
  const auto start = std::chrono::steady_clock::now();
  std::thread releaser([&] {  // the hung replica comes back a while after the interruption
    std::this_thread::sleep_for(std::chrono::seconds(1));
    release->set_value();
  });
  auto result = (*coordinator)->run_step(std::chrono::seconds(60), {}, [&] { return ++asked >= 3; });
  const auto took = std::chrono::steady_clock::now() - start;
  releaser.join();
  ASSERT_FALSE(result.is_ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kInterrupted) << result.status().to_string();
  EXPECT_EQ(asked.load(), 3);  // asked about every 100 ms, and not after it said stop
  EXPECT_LT(took, std::chrono::seconds(10));  // the interruption, then the replica's return
  rec->reset();
  auto next = (*coordinator)->run_step(std::chrono::seconds(30));
  EXPECT_TRUE(next.is_ok()) << next.status().to_string();
}

// An evaluation walks the forward-only lists on the same replicas' threads, and ends only
// once its sends are handed to the transport: a rank's list ends with its last send (the
// store it reads is cleared when the step returns).
TEST(Coordinator, AForwardOnlyStepRunsForwardsAloneAndEndsAfterItsLastSend) {
  auto schedule = make_schedule({ScheduleKind::kOneFOneB, 2, 4});
  ASSERT_TRUE(schedule.is_ok());
  std::atomic<int> forwards{0}, others{0}, transferred{0};
  RunnerHooks hooks;
  hooks.compute = [&](int, int, const Action& a) {
    ++(a.kind == ActionKind::kForward ? forwards : others);
    return Status::ok();
  };
  hooks.transfer = [&](int, int, const Action& a) {  // rank 1 runs in another process
    if (a.microbatch == 3) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ++transferred;
    return Status::ok();
  };
  hooks.receive = [](int, int, const Action&, std::function<void(Status)> arrived) { arrived(Status::ok()); };
  auto coordinator = Coordinator::create(*schedule, hooks, {1, 1}, {}, LocalReplicas{{true}, {false}});
  ASSERT_TRUE(coordinator.is_ok()) << coordinator.status().to_string();
  for (int round = 1; round <= 2; ++round) {
    auto run = (*coordinator)->run_step(std::chrono::seconds(30), {}, {}, /*forward_only=*/true);
    ASSERT_TRUE(run.is_ok()) << run.status().to_string();
    EXPECT_EQ(transferred.load(), 4 * round);  // the last one slept: the step waited for it
    EXPECT_EQ(forwards.load(), 4 * round);
    EXPECT_EQ(others.load(), 0);
    for (const Span& s : run->spans) {
      EXPECT_TRUE(s.action.kind == ActionKind::kForward || s.action.kind == ActionKind::kSendActivation)
          << action_text(s.action);
    }
  }
  // A training step on the same actors afterwards: forwards, backwards and the tail.
  auto step = (*coordinator)->run_step(std::chrono::seconds(30));
  ASSERT_TRUE(step.is_ok()) << step.status().to_string();
  EXPECT_EQ(forwards.load(), 12);
  EXPECT_EQ(others.load(), 4 + 1);  // rank 0's backwards and its optimizer step
  auto report = (*coordinator)->profile_report();
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  EXPECT_EQ(report->steps, 1);  // the evaluations are not in the live profile
}

// Live profiles: every measured step reaches the PartitionerActor, whose report compares
// each stage's measured times with the simulator's prediction for the same schedule.
TEST(Coordinator, LiveProfilesCompareEachStageWithThePrediction) {
  const ScheduleSpec spec{ScheduleKind::kOneFOneB, 2, 4};
  auto schedule = make_schedule(spec);
  ASSERT_TRUE(schedule.is_ok());
  // The plan assumes 5 ms forward and 10 ms backward per microbatch on both stages; stage 1
  // really runs twice as slow (long enough that scheduling jitter does not blur the two).
  std::vector<StageCost> costs(2);
  for (auto& c : costs) {
    c.forward_s = 0.005;
    c.backward_s = 0.010;
  }
  auto predicted = simulate(*schedule, costs, LinkCost{});
  ASSERT_TRUE(predicted.is_ok());
  RunnerHooks hooks;
  hooks.compute = [](int r, int, const Action& a) {
    const double scale = r == 1 ? 2.0 : 1.0;
    double s = 0;
    if (a.kind == ActionKind::kForward) s = 0.005 * scale;
    if (a.kind == ActionKind::kBackward) s = 0.010 * scale;
    std::this_thread::sleep_for(std::chrono::duration<double>(s));
    return Status::ok();
  };
  auto coordinator = runtime::Coordinator::create(*schedule, hooks, {}, *predicted);
  ASSERT_TRUE(coordinator.is_ok());
  auto empty = (*coordinator)->profile_report();
  ASSERT_TRUE(empty.is_ok());
  EXPECT_EQ(empty->steps, 0);
  for (int step = 0; step < 4; ++step) ASSERT_TRUE((*coordinator)->run_step(std::chrono::seconds(30)).is_ok());
  auto report = (*coordinator)->profile_report();
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  EXPECT_EQ(report->steps, 3);  // the first step is warm-up
  ASSERT_EQ(report->stages.size(), 2u);
  EXPECT_DOUBLE_EQ(report->predicted_step_s, predicted->step_time_s);
  EXPECT_GE(report->measured_step_s, predicted->step_time_s);
  for (const auto& s : report->stages) {
    EXPECT_DOUBLE_EQ(s.predicted_forward_s, 0.005);
    EXPECT_DOUBLE_EQ(s.predicted_backward_s, 0.010);
    // sleep_for never returns early; a loaded machine may run late.
    const double scale = s.stage == 1 ? 2.0 : 1.0;
    EXPECT_GE(s.forward_s, 0.005 * scale);
    EXPECT_GE(s.backward_s, 0.010 * scale);
    EXPECT_GE(s.compute_ratio(), scale);
  }
  // Stage 1 is the one that runs slower than planned.
  EXPECT_GT(report->stages[1].compute_ratio(), report->stages[0].compute_ratio());
  const std::string table = report->table();
  EXPECT_NE(table.find("live profile over the last 3 steps measured"), std::string::npos) << table;
  EXPECT_NE(table.find("measured / predicted"), std::string::npos) << table;
}

}  // namespace
}  // namespace conveyor::runtime
