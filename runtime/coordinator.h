// The actor graph of one pipeline in this process (CAF): a Coordinator actor, one
// StageReplica actor per (rank, replica) and a PartitionerActor.
//
// Each StageReplica is a detached actor: a thread of its own that lives as long as the
// pipeline, so torch's intra-op thread pools (and, on CUDA, the device binding and streams)
// are set up once, not per step. A step is a message: the Coordinator sends every replica
// its part of the step (runtime::StepRun), each replica walks its action list on its
// thread, transfers and collectives run on the process's communication thread. The
// Coordinator tracks which replicas are still inside a step, so a replica left behind by a
// hook that never returned fails the next step at once instead of hanging it.
//
// Every measured step goes to the PartitionerActor (live profiles), which compares the
// running plan with its prediction: per stage, measured against predicted forward, backward,
// weight-gradient, transfer and allreduce times, and the step time. Re-planning from these
// figures builds on this data path.
//
// This header is CAF-free (the actors live in runtime/coordinator.cc), so the torch translation units
// that hold a Coordinator do not compile CAF.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "runtime/step_run.h"
#include "scheduler/simulator.h"

namespace conveyor::runtime {

/// One stage's measured times against the plan's prediction. Per microbatch, a stage's
/// replicas work on their shares at once: a microbatch's time is its slowest replica's.
struct StageProfile {
  int stage = 0, rank = 0, replicas = 1;
  double forward_s = 0, backward_s = 0, backward_weight_s = 0;  ///< measured, mean per microbatch
  double send_s = 0;                                            ///< measured, mean per transfer
  double allreduce_s = 0;                                       ///< measured, per step
  /// The part of allreduce_s summed across processes, as this process measured it. Where
  /// the group tells them apart (transport::allreduce_timed) the time it waited for the
  /// stage's slowest process to contribute is not in it but in waiting_s; otherwise it is
  /// (re-planning tells the two apart from every process's figure:
  /// bindings/conveyor/planning/replanning.py).
  double across_s = 0;
  /// Per step, the time after the stage's compute here ended during which some of this
  /// process's sums across processes still waited for the stage's last process to
  /// contribute (buckets wait at once: not their sum): that process's compute, not the
  /// link's time, and what it costs this process's step.
  double waiting_s = 0;
  double predicted_forward_s = 0, predicted_backward_s = 0, predicted_backward_weight_s = 0;
  double predicted_send_s = 0, predicted_allreduce_s = 0;
  /// Per replica, its own compute (F + B + W) per microbatch (0: it runs in another process).
  std::vector<double> replica_compute_s;
  /// Measured over predicted compute (F + B + W): how much slower (> 1) or faster the stage
  /// runs than the cost model assumed; 0 without a prediction.
  double compute_ratio() const;
};

/// The PartitionerActor's comparison of the measured steps with the plan's prediction.
struct ProfileReport {
  int steps = 0;                ///< steps measured (the first is left out once there are more: warm-up)
  double measured_step_s = 0;   ///< mean over those steps
  double predicted_step_s = 0;  ///< the simulator's step time for the plan; 0: no prediction
  std::vector<StageProfile> stages;
  /// A readable table: a row per stage, measured against predicted, and the step time.
  std::string table() const;
};

/// The actor graph of one pipeline in this process: runs its steps on the replicas' threads.
class Coordinator {
 public:
  /// Spawns the actor graph for `schedule` with `replicas` per rank (empty: one each): the
  /// replicas `local` marks (per rank and replica; empty: all; the others run in other processes).
  /// `predicted`: the simulator's result for the same plan, for the partitioner's report.
  /// `splits`: per rank, an id equal for ranks that split a microbatch alike (StepRun::create).
  static Result<std::unique_ptr<Coordinator>> create(scheduler::Schedule schedule, runtime::RunnerHooks hooks,
                                                     std::vector<int> replicas = {},
                                                     std::optional<scheduler::SimulationResult> predicted = {},
                                                     runtime::LocalReplicas local = {}, std::vector<int> splits = {});
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  /// Runs one step on the replicas' threads. A hook's error stops every replica and is
  /// returned with the rank and action named; a step that does not finish within `timeout`
  /// returns kExecution naming where each unfinished replica waits. A hook still running
  /// then keeps its replica's thread (this returns instead of hanging); later steps fail at
  /// once naming that replica. `complete` may add to a successful step's measurement
  /// (work the hooks did off the schedule) before it goes to the PartitionerActor. `stop`:
  /// asked while it waits, true fails the step (StepRun::wait).
  /// `forward_only`: the schedule's forwards alone (an evaluation: each rank its stages in
  /// order, scheduler::ScheduleSpec::forward_only), on the same replicas' threads; its
  /// measurement does not reach the PartitionerActor (the live profile is of training steps).
  Result<runtime::RunResult> run_step(std::chrono::milliseconds timeout = std::chrono::minutes(10),
                                        const std::function<void(runtime::RunResult&)>& complete = {},
                                        const std::function<bool()>& stop = {}, bool forward_only = false);

  /// The PartitionerActor's comparison of the measured steps with the prediction.
  Result<ProfileReport> profile_report(std::chrono::milliseconds timeout = std::chrono::seconds(10)) const;
  /// From now on the PartitionerActor compares against `predicted` (the running plan priced
  /// again on corrected inputs), over the steps that follow only: a re-planning window.
  void set_prediction(scheduler::SimulationResult predicted);

 private:
  struct Impl;
  explicit Coordinator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor::runtime
