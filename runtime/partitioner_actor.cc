// The PartitionerActor's live-profile side: measured steps in, a comparison with the plan out.
#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>

#include "runtime/actor_messages.h"

namespace conveyor::runtime {

namespace {

using scheduler::ActionKind;
using scheduler::Span;

// Per stage: the mean time per microbatch of F, B (or Bi) and W, a microbatch's time being
// its slowest replica's; the mean transfer; the allreduce. Fills the measured fields. Where
// a list splits only some backwards (DualPipeV), a whole B counts as B: the sum of the three
// stays the stage's compute, which is what the comparison with the plan reads.
std::vector<StageProfile> summarize(const std::vector<Span>& spans, const scheduler::ScheduleSpec& spec,
                                    const std::vector<int>& replicas) {
  const int stages = spec.stages();
  std::vector<StageProfile> out(static_cast<std::size_t>(stages));
  // (stage, kind, microbatch) -> slowest replica; kind 0 F, 1 B/Bi, 2 W.
  std::map<std::tuple<int, int, int>, double> slowest;
  std::map<std::pair<int, int>, double> replica_compute;  // (stage, replica) -> its F + B + W
  std::vector<std::vector<std::pair<double, double>>> waits(out.size());  // per stage: its sums' waits
  // Per stage, the first replica this process runs: its sums within the process count (each
  // local replica's track holds the same ones).
  std::vector<int> first_replica(out.size(), std::numeric_limits<int>::max());
  std::vector<double> computed_until(out.size(), 0);  // per stage: when its last compute here ended
  for (const Span& s : spans) {
    if (s.action.stage < 0 || s.action.stage >= stages) continue;
    if (s.stream == Span::Stream::kCollective) first_replica[s.action.stage] = std::min(first_replica[s.action.stage], s.replica);
    if (s.action.is_compute()) computed_until[s.action.stage] = std::max(computed_until[s.action.stage], s.end_s);
  }
  std::vector<double> send_sum(out.size(), 0);
  std::vector<int> sends(out.size(), 0);
  for (const Span& s : spans) {
    const int stage = s.action.stage;
    if (stage < 0 || stage >= stages) continue;
    const double d = s.end_s - s.start_s;
    int kind = -1;
    switch (s.action.kind) {
      case ActionKind::kForward: kind = 0; break;
      case ActionKind::kBackward:
      case ActionKind::kBackwardInput: kind = 1; break;
      case ActionKind::kBackwardWeight: kind = 2; break;
      case ActionKind::kSendActivation:
      case ActionKind::kSendGradient:
        send_sum[stage] += d;
        ++sends[stage];
        break;
      case ActionKind::kAllReduce:  // buckets reduced during backward, then the rest, then across processes: their sum
        if (s.stream == Span::Stream::kWaitingForProcesses) {  // not the sum's: the slowest process's compute
          waits[stage].emplace_back(s.start_s, s.end_s);
          break;
        }
        if (s.replica == first_replica[stage] || s.stream == Span::Stream::kAcrossProcesses) out[stage].allreduce_s += d;
        if (s.stream == Span::Stream::kAcrossProcesses) out[stage].across_s += d;
        break;
      default: break;
    }
    if (kind >= 0) {
      double& m = slowest[{stage, kind, s.action.microbatch}];
      m = std::max(m, d);
      replica_compute[{stage, s.replica}] += d;
    }
  }
  for (const auto& [key, d] : slowest) {
    const auto [stage, kind, mb] = key;
    double& field = kind == 0 ? out[stage].forward_s : kind == 1 ? out[stage].backward_s : out[stage].backward_weight_s;
    field += d / spec.microbatches;
  }
  for (int s = 0; s < stages; ++s) {
    // Buckets wait for the same late process at once: the time some sum waited, not their
    // sum; and only once the stage's compute here is over (a bucket waiting beside the
    // backward that is still making the next costs the step nothing).
    std::sort(waits[s].begin(), waits[s].end());
    double covered_to = computed_until[s];
    for (const auto& [from, to] : waits[s]) {
      out[s].waiting_s += std::max(0.0, to - std::max(from, covered_to));
      covered_to = std::max(covered_to, to);
    }
    out[s].stage = s;
    out[s].rank = spec.rank_of_stage(s);
    out[s].replicas = out[s].rank < static_cast<int>(replicas.size()) ? replicas[out[s].rank] : 1;
    out[s].send_s = sends[s] ? send_sum[s] / sends[s] : 0;
    out[s].replica_compute_s.assign(static_cast<std::size_t>(out[s].replicas), 0.0);
  }
  for (const auto& [key, d] : replica_compute) {
    const auto [stage, replica] = key;
    if (replica >= 0 && replica < static_cast<int>(out[stage].replica_compute_s.size())) {
      out[stage].replica_compute_s[replica] = d / spec.microbatches;
    }
  }
  return out;
}

struct Measured {
  double step_s = 0;
  std::vector<StageProfile> stages;
};

struct PartitionerState {
  std::vector<Measured> steps;
  std::shared_ptr<const scheduler::SimulationResult> predicted;
  bool warmed_up = false;  // a new prediction on a running pipeline: no warm-up step to leave out
};

}  // namespace

caf::behavior partitioner_actor(caf::event_based_actor* self, scheduler::ScheduleSpec spec, std::vector<int> replicas,
                                std::shared_ptr<const scheduler::SimulationResult> predicted) {
  auto state = std::make_shared<PartitionerState>();
  state->predicted = std::move(predicted);
  return {
      [state, spec, replicas](profile_atom, const MeasuredPtr& run) {
        state->steps.push_back({run->step_time_s, summarize(run->spans, spec, replicas)});
      },
      [state](predict_atom, const PredictionPtr& next) {
        state->predicted = next;
        state->steps.clear();
        state->warmed_up = true;
      },
      [state, spec, replicas](report_atom) {
        ProfileReport report;
        const auto& predicted = state->predicted;
        // The first step pays for warm-up (allocator, thread pools): leave it out once there are more.
        const std::size_t first = !state->warmed_up && state->steps.size() > 1 ? 1 : 0;
        report.steps = static_cast<int>(state->steps.size() - first);
        report.stages = summarize({}, spec, replicas);
        for (std::size_t k = first; k < state->steps.size(); ++k) {
          const Measured& m = state->steps[k];
          const double w = 1.0 / report.steps;
          report.measured_step_s += m.step_s * w;
          for (std::size_t s = 0; s < report.stages.size(); ++s) {
            StageProfile& t = report.stages[s];
            t.forward_s += m.stages[s].forward_s * w;
            t.backward_s += m.stages[s].backward_s * w;
            t.backward_weight_s += m.stages[s].backward_weight_s * w;
            t.send_s += m.stages[s].send_s * w;
            t.allreduce_s += m.stages[s].allreduce_s * w;
            t.across_s += m.stages[s].across_s * w;
            t.waiting_s += m.stages[s].waiting_s * w;
            for (std::size_t i = 0; i < t.replica_compute_s.size() && i < m.stages[s].replica_compute_s.size(); ++i) {
              t.replica_compute_s[i] += m.stages[s].replica_compute_s[i] * w;
            }
          }
        }
        if (predicted) {
          report.predicted_step_s = predicted->step_time_s;
          auto p = summarize(predicted->spans, spec, replicas);
          for (std::size_t s = 0; s < report.stages.size(); ++s) {
            StageProfile& t = report.stages[s];
            t.predicted_forward_s = p[s].forward_s;
            t.predicted_backward_s = p[s].backward_s;
            t.predicted_backward_weight_s = p[s].backward_weight_s;
            t.predicted_send_s = p[s].send_s;
            t.predicted_allreduce_s = p[s].allreduce_s;
          }
        }
        return report;
      },
  };
}

double StageProfile::compute_ratio() const {
  const double predicted = predicted_forward_s + predicted_backward_s + predicted_backward_weight_s;
  return predicted > 0 ? (forward_s + backward_s + backward_weight_s) / predicted : 0;
}

std::string ProfileReport::table() const {
  auto ms = [](double s) {
    char b[32];
    std::snprintf(b, sizeof b, "%.2f", s * 1e3);
    return std::string(b);
  };
  auto pair = [&](double measured, double predicted) {
    return predicted > 0 ? ms(measured) + " / " + ms(predicted) : ms(measured);
  };
  const bool with_prediction = predicted_step_s > 0;
  // Re-planning starts the count again after each window: the steps are the last ones measured.
  std::string out = "live profile over the last " + std::to_string(steps) + " step" + (steps == 1 ? "" : "s") +
                    " measured" +
                    (with_prediction ? " (measured / predicted, ms per microbatch)\n" : " (measured, ms per microbatch)\n");
  char line[256];
  std::snprintf(line, sizeof line, "%-6s %-5s %-9s %-17s %-17s %-17s %-17s %-17s %s\n", "stage", "rank", "replicas",
                "forward", "backward", "weight grad", "send", "allreduce/step", with_prediction ? "compute ratio" : "");
  out += line;
  for (const auto& s : stages) {
    if (s.forward_s == 0 && s.backward_s == 0 && s.backward_weight_s == 0) {
      // Its replicas run in another process: that process's own report measures them.
      std::snprintf(line, sizeof line, "%-6d %-5d %-9d %s\n", s.stage, s.rank, s.replicas,
                    "runs in another process (its profile_report measures it)");
      out += line;
      continue;
    }
    char ratio[32] = "";
    if (with_prediction) std::snprintf(ratio, sizeof ratio, "%.2f", s.compute_ratio());
    std::snprintf(line, sizeof line, "%-6d %-5d %-9d %-17s %-17s %-17s %-17s %-17s %s\n", s.stage, s.rank, s.replicas,
                  pair(s.forward_s, s.predicted_forward_s).c_str(), pair(s.backward_s, s.predicted_backward_s).c_str(),
                  pair(s.backward_weight_s, s.predicted_backward_weight_s).c_str(),
                  pair(s.send_s, s.predicted_send_s).c_str(), pair(s.allreduce_s, s.predicted_allreduce_s).c_str(),
                  ratio);
    out += line;
  }
  for (const auto& s : stages) {
    if (s.across_s <= 0 && s.waiting_s <= 0) continue;
    out += "stage " + std::to_string(s.stage) + "'s gradient sum across processes: " + ms(s.across_s) +
           " ms per step moving bytes (of allreduce/step), and " + ms(s.waiting_s) +
           " ms waiting for the last process to contribute (its compute, not the link's time)\n";
  }
  // A process that runs no stage of the plan (a device the plan leaves idle) times no step.
  if (measured_step_s <= 0 && steps > 0) return out + "step: not measured here (this process runs no stage of the plan)\n";
  out += "step: " + ms(measured_step_s) + " ms measured";
  if (with_prediction) {
    char r[64];
    std::snprintf(r, sizeof r, ", %s ms predicted (ratio %.2f)", ms(predicted_step_s).c_str(),
                  measured_step_s / predicted_step_s);
    out += r;
  }
  return out + "\n";
}

}  // namespace conveyor::runtime
