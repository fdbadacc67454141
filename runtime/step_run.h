// Runs a Schedule's action lists for real, one step at a time: each replica's list walked by
// a C++20 coroutine (Asio) that awaits its receives, runs its compute, and posts its sends
// without waiting for them, so transfers overlap compute; every transfer and collective runs
// on the process's one communication thread.
//
// Replicas of a rank run the same list on their shares of each microbatch; a receive waits
// for the producing replica of the same index when both sides have as many replicas, for
// every producing replica otherwise (the payload is redistributed); the allreduce of a stage
// runs once every replica has reached it, and releases them all. What F, B, W and a transfer
// do is supplied by the caller (the runtime binds them to stage programs and tensors); the
// step orders them, measures every action, and turns failures and hangs into errors naming
// the rank and the action.
//
// Where each replica's walk runs is also the caller's: StepRun::run_replica runs on the
// thread that owns the replica (runtime::Coordinator gives every replica a StageReplica actor
// with a thread of its own that lives as long as the pipeline). Torch-free.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "scheduler/schedule.h"
#include "runtime/comm_thread.h"
#include "scheduler/simulator.h"

namespace conveyor::runtime {

using scheduler::Action;
using scheduler::Schedule;
using scheduler::Span;

/// What the runner calls for each kind of action (the runtime binds them to tensors).
struct RunnerHooks {
  /// F, B, Bi, W and the optimizer step of one replica of `rank`; runs on its compute thread.
  std::function<Status(int rank, int replica, const Action&)> compute;
  /// The payload of a send (a copy, a device transfer); runs on the communication thread.
  /// Empty: transfers only signal arrival.
  std::function<Status(int rank, int replica, const Action&)> transfer;
  /// The gradient reduction of one stage across its replicas (called once, with replica 0,
  /// when all of this process's have arrived); runs on the communication thread. Empty: nothing.
  std::function<Status(int rank, int replica, const Action&)> allreduce;
  /// What a receive waits for besides this process's senders: messages from other
  /// processes (a remote neighbour's payload, skip values or gradients from further away).
  /// Called for every receive of a local replica after its local senders have signalled;
  /// `arrived` is called once, on any thread, when everything is in (or with the error).
  /// Empty: one process, nothing else to wait for.
  std::function<void(int rank, int replica, const Action&, std::function<void(Status)> arrived)> receive;
};

/// A step's measured actions, as the simulator reports predicted ones.
struct RunResult {
  double step_time_s = 0;
  std::vector<Span> spans;  ///< measured, seconds from the start of the step (Span as in the simulator)
  std::chrono::steady_clock::time_point start;  ///< when the step started (spans count from here)
};

/// Per rank, per replica: whether this process runs it.
using LocalReplicas = std::vector<std::vector<bool>>;

/// One step of a schedule: the shared state of its replicas' walks.
class StepRun {
 public:
  /// `replicas`: per rank, how many replicas run its list (empty: one each). `local`: per
  /// rank and replica, whether this process runs it (empty: all); sends to and receives
  /// from the others are the hooks' business (transfer, receive), and so is the part of a
  /// stage's allreduce that spans processes. `splits`: per rank, an id equal for ranks that
  /// split a microbatch alike (replica i talks to replica i only; empty: alike when the
  /// counts are). Errors for an invalid schedule, a missing compute hook, or bad replica counts.
  static Result<std::shared_ptr<StepRun>> create(const Schedule& schedule, const RunnerHooks& hooks,
                                                 std::vector<int> replicas = {}, LocalReplicas local = {},
                                                 std::vector<int> splits = {});
  ~StepRun();

  /// Replicas of the step, rank-major: worker w is replica worker(w).second of rank worker(w).first.
  int workers() const;
  std::pair<int, int> worker(int w) const;

  /// Walks worker w's action list on the calling thread; returns when the list is done or
  /// the step has failed (a hook that never returns keeps the calling thread).
  void run_replica(int w);

  /// Stops the step with `error` (the first error wins); every waiting replica wakes.
  void fail(Status error);

  /// Waits until every replica has finished. A hook's error is returned with the rank and
  /// action named; a step that does not finish within `timeout` returns kExecution naming
  /// where each unfinished replica waits. After a failure, waits (within the same timeout)
  /// for the other replicas to leave their current action, so their hooks no longer run
  /// when this returns; `stuck()` then names any that did not. `stop`, when given, is asked
  /// about every 100 ms while it waits (the bindings run Python's signal handlers there):
  /// true fails the step (kInterrupted), whose replicas then get 5 s to leave.
  Result<RunResult> wait(std::chrono::milliseconds timeout, const std::function<bool()>& stop = {});

  /// Workers still inside run_replica (a hook that never returned), after wait().
  std::vector<int> stuck() const;

 private:
  struct State;
  explicit StepRun(std::shared_ptr<State> state);
  std::shared_ptr<State> st_;
};

}  // namespace conveyor::runtime
