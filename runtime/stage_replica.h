// One replica of one pipeline rank: its compiled stage programs, its streams and their
// event pool, the activations it keeps between a forward and its backward, the autocast it
// runs forwards under and the seeded generators its random operators draw from. Its
// StageReplica actor (runtime/coordinator.h) walks the rank's action list on a thread of
// its own and calls compute() for every F, B, Bi and W.
//
/// @note Only the replica's actor thread calls compute(); begin_step() and the accessors
/// run on the caller's thread between steps.
#pragma once

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/recomputation.h"
#include "graph/autocast.h"
#include "graph/executor.h"
#include "runtime/device_streams.h"
#include "runtime/gradient_reducer.h"
#include "runtime/memory_meter.h"
#include "runtime/pipeline_layout.h"
#include "runtime/placement.h"
#include "runtime/remote_exchange.h"
#include "runtime/value_store.h"

namespace conveyor::runtime {

using graph::AutocastState;

/// What every replica reads of the step it runs: set by the caller before the step starts,
/// read-only while it runs.
struct StepSettings {
  double grad_scale = 1;       ///< the loss's incoming gradient
  int intra_op_threads = 1;    ///< each replica's torch intra-op threads
  AutocastState autocast;      ///< the caller's: forwards run under it
  std::uint64_t random_seed = 0;  ///< the pipeline's
  std::uint64_t step = 0;         ///< the step running, counting every step begun
  std::vector<Recomputation> recompute;  ///< per stage: what it recomputes before the backward
  /// An evaluation: forwards under no_grad, keeping nothing for a backward.
  bool forward_only = false;
};

/// One replica's compute.
class StageReplica {
 public:
  /// `programs`: the replica's program of every stage of `rank`. `remote`: the exchange
  /// with other processes (null in one process).
  StageReplica(int rank, int replica, const PipelineLayout& layout, const Placement& placement,
               std::map<int, std::shared_ptr<const graph::StageProgram>> programs, ValueStore& store,
               GradientReducer& reducer, RemoteExchange* remote, PipelineStreams* streams, const StepSettings& settings);

  int rank() const { return rank_; }
  int replica() const { return replica_; }

  /// A new step: no activation kept, no backward done, no timing recorded; the memory peak
  /// measured afresh, except for an evaluation (StepSettings::forward_only): the live
  /// profile's peaks stay the training steps'.
  void begin_step();
  /// F, B, Bi, W or the optimizer step of this replica (its actor's thread): on its compute
  /// stream between two timing events, with streams.
  Status compute(const scheduler::Action& a);

  /// A compute action with its events on the replica's compute stream.
  struct Timed {
    scheduler::Action action;
    c10::Event *start, *end;
  };
  /// This step's compute actions with their events (streams only).
  const std::vector<Timed>& timed() const { return timed_; }
  /// The event after this replica's last backward of `stage` this step (streams only; null
  /// before it ran).
  c10::Event* final_done(int stage) const;
  /// The host memory its compute allocated (torch's CPU allocator, runtime/memory_meter.h):
  /// live now, and the peak since this step began.
  const MemoryCounter& memory() const { return *memory_; }

 private:
  Status forward(const scheduler::Action& a);
  Status backward(const scheduler::Action& a, bool split);  // B, or Bi (the activation stays for W)
  Status backward_weight(const scheduler::Action& a);
  std::uint64_t forward_seed(int stage, int microbatch) const;

  const int rank_, replica_;
  const PipelineLayout& layout_;
  const Placement& placement_;
  std::map<int, std::shared_ptr<const graph::StageProgram>> programs_;  // by stage
  ValueStore& store_;
  GradientReducer& reducer_;
  RemoteExchange* remote_;
  ReplicaStreams* streams_;  // null on the CPU
  const StepSettings& settings_;
  int configured_threads_ = 0;  // this replica's thread keeps its intra-op setting across steps
  std::map<std::pair<int, int>, graph::StageActivation> activations_;  // (stage, microbatch)
  std::map<int, int> backwards_done_;                                  // by stage, this step
  std::map<int, c10::Event*> final_done_;                              // by stage, this step
  std::vector<Timed> timed_;
  std::shared_ptr<MemoryCounter> memory_ = std::make_shared<MemoryCounter>();
};

}  // namespace conveyor::runtime
