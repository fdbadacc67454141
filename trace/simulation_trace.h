// A simulated step as a Perfetto trace: a track per rank with its compute, send and
// collective streams, a slice per action, flows from each send to the compute consuming it.
#pragma once

#include "scheduler/simulator.h"
#include "trace/perfetto.h"

namespace conveyor::trace {

/// Adds the spans of `result` (simulated from `schedule`, or measured) to `trace`; `name`
/// titles the tracks. `replicas` (per rank; empty: one each) gives replicated ranks a track
/// per replica; a transfer then flows to the replica of the same index when both stages
/// have as many replicas, to every consuming replica otherwise.
void add_simulation(PerfettoTrace& trace, const scheduler::Schedule& schedule,
                    const scheduler::SimulationResult& result, const std::string& name = "simulated",
                    const std::vector<int>& replicas = {});

/// A moment of the step worth marking (a switch of plan), in seconds from its start.
struct Marker {
  double t_s = 0;
  std::string name;
};

/// Writes a step's spans to `path`: Chrome JSON trace events when the path ends in ".json"
/// (chrome://tracing, ui.perfetto.dev), a Perfetto protobuf trace otherwise. Tracks, slices
/// and flows as add_simulation describes; `markers` as instant events on a "conveyor" track.
Status write_step_trace(const std::string& path, const scheduler::Schedule& schedule,
                        const scheduler::SimulationResult& result, const std::string& name = "simulated",
                        const std::vector<int>& replicas = {}, const std::vector<Marker>& markers = {});

/// The flow id joining a transfer to the computation that consumes it.
std::uint64_t transfer_flow_id(bool gradient, int microbatch, int sending_stage, int sending_replica = 0);

}  // namespace conveyor::trace
