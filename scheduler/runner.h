// Runs a Schedule's action lists for real: one compute thread per stage replica (a rank's
// stage group may be replicated), one communication thread for the whole process, each
// replica's list walked by a C++20 coroutine (Asio) that awaits its receives, runs its
// compute, and posts its sends without waiting for them, so transfers overlap compute.
// Replicas of a rank run the same list on their shares of each microbatch; a receive waits
// for the producing replica of the same index when both sides have as many replicas, for
// every producing replica otherwise (the payload is redistributed); the allreduce of a
// stage runs once every replica has reached it, and releases them all. What F, B, W and a transfer do is supplied by the caller (the
// runtime binds them to stage programs and tensors); the runner orders them, measures every
// action, and turns failures and hangs into errors naming the rank and the action.
// Torch-free.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "scheduler/schedule.h"
#include "scheduler/simulator.h"

namespace conveyor::scheduler {

struct RunnerHooks {
  /// F, B, Bi, W and the optimizer step of one replica of `rank`; runs on its compute thread.
  std::function<Status(int rank, int replica, const Action&)> compute;
  /// The payload of a send (a copy, a device transfer); runs on the communication thread.
  /// Empty: transfers only signal arrival.
  std::function<Status(int rank, int replica, const Action&)> transfer;
  /// The gradient reduction of one stage across its replicas (called once, with replica 0,
  /// when all have arrived); runs on the communication thread. Empty: nothing.
  std::function<Status(int rank, int replica, const Action&)> allreduce;
};

struct RunResult {
  double step_time_s = 0;
  std::vector<Span> spans;  ///< measured, seconds from the start of the step (Span as in the simulator)
};

class Runner {
 public:
  /// `replicas`: per rank, how many replicas run its list (empty: one each).
  Runner(Schedule schedule, RunnerHooks hooks, std::vector<int> replicas = {});
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  /// Runs one step. A hook's error stops every rank and is returned with the rank and action
  /// named; a step that does not finish within `timeout` returns kExecution naming where
  /// each unfinished rank waits. A hook still running then is left on its thread (the call
  /// returns instead of hanging): whatever that hook touches must be owned by the hook.
  Result<RunResult> run_step(std::chrono::milliseconds timeout = std::chrono::minutes(10));

 private:
  struct State;
  Schedule schedule_;
  RunnerHooks hooks_;
  std::vector<int> replicas_;
};

}  // namespace conveyor::scheduler
