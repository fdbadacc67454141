// Event-by-event execution of a Schedule's action lists under a cost model: compute on one
// stream per rank, each send on its link's stream, receives waiting for arrival, gradient
// reductions on a collective stream per rank. The same lists drive the runtime, so predicted
// and measured traces compare action by action. Torch-free.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "scheduler/schedule.h"

namespace conveyor::scheduler {

/// Cost of one stage on one of its replicas, per microbatch unless said otherwise.
struct StageCost {
  double forward_s = 0;
  double backward_s = 0;         ///< whole backward (input and weight gradients)
  double backward_weight_s = 0;  ///< the weight-gradient part of backward_s (split schedules)
  double activation_bytes = 0;   ///< sent forward to the next stage per microbatch
  double gradient_bytes = 0;     ///< sent back to the previous stage per microbatch
  double allreduce_s = 0;        ///< per step: gradient reduction across the stage's replicas
  double optimizer_s = 0;        ///< per step: the optimizer update of the stage's parameters
  double static_bytes = 0;       ///< per device: parameters, gradients, optimizer state, buffers
  double saved_bytes = 0;        ///< per device and microbatch: activations kept from F to B/W
  /// Of saved_bytes, what a split backward frees at its Bi: only the weight gradients'
  /// inputs stay until its W (negative: W keeps more, as a stage recomputing fully does).
  double input_freed_bytes = 0;
  /// The gradients a split backward's Bi makes for its W, on top of everything held until
  /// Bi ends (its peak); they are part of what stays to W.
  double captured_bytes = 0;
  /// What its whole backward (B) holds while it runs beyond what was kept when it began:
  /// working memory, and a recomputing stage's forward run again; it peaks there, not between.
  double backward_extra_bytes = 0;
  /// The same for a split backward's Bi and W, which keep the stage's graph whole until W.
  double split_backward_extra_bytes = 0;
  /// Of its rank's static bytes, the parameters' gradients this stage makes first: they are
  /// freed before a step (zero_grad) and held from the stage's first backward that makes
  /// weight gradients (B, or W where split) to the step's end (0: held throughout).
  double weight_grad_bytes = 0;
};

/// A point-to-point link: time = latency + bytes / bandwidth (bandwidth 0 means free).
struct LinkCost {
  double latency_s = 0;
  double bandwidth_bytes_per_s = 0;
  double transfer_s(double bytes) const {
    return bytes <= 0 ? 0 : latency_s + (bandwidth_bytes_per_s > 0 ? bytes / bandwidth_bytes_per_s : 0);
  }
};

/// One slice of a step's timeline, simulated or measured: one type for both, so the trace
/// writer and the live profile compare a plan's prediction with its run action by action
/// (the replica and the across-processes stream only occur in measured steps).
struct Span {
  /// kAcrossProcesses: the part of a stage's gradient sum that crosses processes (a
  /// bucket's sum with the stage's replicas in other processes), one span per bucket;
  /// kWaitingForProcesses: before it, the time that sum waited for the stage's last process
  /// to contribute (where the group tells waiting from moving: transport::allreduce_timed).
  enum class Stream : std::uint8_t { kCompute, kSend, kCollective, kAcrossProcesses, kWaitingForProcesses };
  int rank = 0;
  Stream stream = Stream::kCompute;
  Action action{ActionKind::kForward};
  double start_s = 0, end_s = 0;
  int replica = 0;  ///< which replica of the rank's stage group (measured runs; 0 in simulations)
};

/// A simulated step: its time, every action's span and each rank's peak memory.
struct SimulationResult {
  double step_time_s = 0;
  double bubble_fraction = 0;        ///< idle share of ranks x time until the last backward ends
  std::vector<double> busy_s;        ///< F/B/W compute time per rank
  std::vector<double> peak_bytes;    ///< per rank: static bytes + the most activations alive at once
  std::vector<Span> spans;           ///< compute, send and collective spans in start order per rank
};

/// Runs `schedule` with `costs[stage]` per stage and `links[k]` between stages k and k + 1
/// (one link for all boundaries when `links` has one entry, free transfers when empty).
Result<SimulationResult> simulate(const Schedule& schedule, const std::vector<StageCost>& costs,
                                  const std::vector<LinkCost>& links);

/// Same, one link model for every boundary.
inline Result<SimulationResult> simulate(const Schedule& schedule, const std::vector<StageCost>& costs,
                                         const LinkCost& link) {
  return simulate(schedule, costs, std::vector<LinkCost>{link});
}

}  // namespace conveyor::scheduler
