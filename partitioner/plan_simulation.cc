// A plan as the simulator sees it: its schedule, its stages' costs per replica and its
// links, and the simulated step (partitioner/planner.h, Plan).
#include <algorithm>
#include <string>

#include "partitioner/planner.h"

namespace conveyor::partitioner {

scheduler::ScheduleSpec Plan::schedule_spec() const {
  return {schedule, ranks(), microbatches, chunks};
}

std::vector<scheduler::StageCost> Plan::stage_costs() const {
  std::vector<scheduler::StageCost> out;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const StagePlan& st = stages[s];
    scheduler::StageCost c;
    c.forward_s = st.forward_s;
    c.backward_s = st.backward_s;
    c.backward_weight_s = st.backward_weight_s;
    // Replicas send their shares over their own links in parallel; between stages with
    // different replica counts the shares are redistributed, and the side with fewer
    // replicas carries the most per link.
    const int next = s + 1 < stages.size() ? stages[s + 1].replicas : st.replicas;
    const int prev = s > 0 ? stages[s - 1].replicas : st.replicas;
    c.activation_bytes = st.send_bytes / std::min(st.replicas, next);
    c.gradient_bytes = st.recv_bytes / std::min(st.replicas, prev);
    c.allreduce_s = st.allreduce_s;
    c.optimizer_s = st.optimizer_s;
    c.static_bytes = st.static_bytes;
    c.weight_grad_bytes = st.weight_grad_bytes;
    c.saved_bytes = st.saved_bytes;
    c.input_freed_bytes = st.input_freed_bytes;
    c.captured_bytes = st.captured_bytes;
    c.backward_extra_bytes = st.backward_extra_bytes;
    c.split_backward_extra_bytes = st.split_backward_extra_bytes;
    out.push_back(c);
  }
  return out;
}

std::vector<scheduler::LinkCost> Plan::link_costs() const {
  std::vector<scheduler::LinkCost> out;
  for (const auto& l : links) out.push_back({l.latency_s, l.bandwidth_bytes_per_s});
  if (out.empty()) out.push_back({});
  return out;
}

Result<scheduler::SimulationResult> Plan::simulate() const {
  CONVEYOR_ASSIGN_OR_RETURN(auto sched, scheduler::make_schedule(schedule_spec()));
  auto links = link_costs();
  if (stages.size() <= 1) links = {scheduler::LinkCost{}};
  return scheduler::simulate(sched, stage_costs(), links);
}

Result<scheduler::SimulationResult> Plan::simulate_as_built(const scheduler::ScheduleSpec& built) const {
  const auto planned = schedule_spec();
  if (planned.kind != built.kind || planned.ranks != built.ranks || planned.chunks != built.chunks ||
      planned.microbatches != built.microbatches) {
    return Status(ErrorCode::kInvalidArgument,
                  "the plan describes a different pipeline (" + std::to_string(planned.stages()) + " stages, " +
                      std::string(scheduler::schedule_kind_name(planned.kind)) + ", " +
                      std::to_string(planned.microbatches) + " microbatches) than the one built (" +
                      std::to_string(built.stages()) + " stages, " + std::string(scheduler::schedule_kind_name(built.kind)) +
                      ", " + std::to_string(built.microbatches) + " microbatches); pass the plan the stages came from");
  }
  return simulate();
}

}  // namespace conveyor::partitioner
