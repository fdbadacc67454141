// Event-by-event execution of a Schedule's action lists under a cost model: compute on one
// stream per rank, each send on its link's stream, receives waiting for arrival. The same
// lists drive the runtime, so predicted and measured traces compare action by action.
// Torch-free.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "scheduler/schedule.h"

namespace conveyor::scheduler {

/// Cost of one rank's stage for one microbatch.
struct StageCost {
  double forward_s = 0;
  double backward_s = 0;         ///< whole backward (input and weight gradients)
  double backward_weight_s = 0;  ///< the weight-gradient part of backward_s (split schedules)
  double activation_bytes = 0;  ///< sent forward to the next rank per microbatch
  double gradient_bytes = 0;    ///< sent back to the previous rank per microbatch
};

/// A point-to-point link: time = latency + bytes / bandwidth (bandwidth 0 means free).
struct LinkCost {
  double latency_s = 0;
  double bandwidth_bytes_per_s = 0;
  double transfer_s(double bytes) const {
    return bytes <= 0 ? 0 : latency_s + (bandwidth_bytes_per_s > 0 ? bytes / bandwidth_bytes_per_s : 0);
  }
};

/// One slice of the simulated timeline.
struct Span {
  enum class Stream : std::uint8_t { kCompute, kSend };
  int rank = 0;
  Stream stream = Stream::kCompute;
  Action action{ActionKind::kForward};
  double start_s = 0, end_s = 0;
};

struct SimulationResult {
  double step_time_s = 0;
  double bubble_fraction = 0;        ///< idle share of ranks x step time
  std::vector<double> busy_s;        ///< compute time per rank
  std::vector<Span> spans;           ///< compute and send spans in start order per rank
};

/// Runs `schedule` with `costs[rank]` per rank and one link model between neighbours.
Result<SimulationResult> simulate(const Schedule& schedule, const std::vector<StageCost>& costs,
                                  const LinkCost& link);

}  // namespace conveyor::scheduler
