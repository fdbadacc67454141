#include "scheduler/simulator.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace conveyor::scheduler {

Result<SimulationResult> simulate(const Schedule& s, const std::vector<StageCost>& costs,
                                  const LinkCost& link) {
  const int p = static_cast<int>(s.ranks.size());
  if (static_cast<int>(costs.size()) != p) {
    return Status(ErrorCode::kInvalidArgument, "simulate: " + std::to_string(costs.size()) +
                                                   " stage costs for a schedule of " + std::to_string(p) + " ranks");
  }
  CONVEYOR_RETURN_IF_ERROR(validate_schedule(s));
  SimulationResult result;
  result.busy_s.assign(static_cast<std::size_t>(p), 0);
  std::vector<double> compute_free(static_cast<std::size_t>(p), 0);  // compute stream per rank
  std::map<std::pair<int, int>, double> link_free;                    // send stream per directed link
  using Key = std::tuple<int, int, bool, int>;                        // from, to, gradient, microbatch
  std::map<Key, double> arrival;
  std::vector<std::size_t> pc(static_cast<std::size_t>(p), 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const ActionList& list = s.ranks[r];
      while (pc[r] < list.size()) {
        const Action& a = list[pc[r]];
        switch (a.kind) {
          case ActionKind::kForward:
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
          case ActionKind::kBackwardWeight: {
            const StageCost& c = costs[r];
            double d = a.kind == ActionKind::kForward          ? c.forward_s
                       : a.kind == ActionKind::kBackward       ? c.backward_s
                       : a.kind == ActionKind::kBackwardInput  ? c.backward_s - c.backward_weight_s
                                                               : c.backward_weight_s;
            Span span{r, Span::Stream::kCompute, a, compute_free[r], compute_free[r] + d};
            compute_free[r] = span.end_s;
            result.busy_s[r] += d;
            result.spans.push_back(span);
            break;
          }
          case ActionKind::kSendActivation:
          case ActionKind::kSendGradient: {
            bool grad = a.kind == ActionKind::kSendGradient;
            double bytes = grad ? costs[r].gradient_bytes : costs[r].activation_bytes;
            double& free = link_free[{r, a.peer}];
            double start = std::max(compute_free[r], free);  // the data exists once computed
            double end = start + link.transfer_s(bytes);
            free = end;
            arrival[{r, a.peer, grad, a.microbatch}] = end;
            result.spans.push_back({r, Span::Stream::kSend, a, start, end});
            break;
          }
          case ActionKind::kRecvActivation:
          case ActionKind::kRecvGradient: {
            auto it = arrival.find({a.peer, r, a.kind == ActionKind::kRecvGradient, a.microbatch});
            if (it == arrival.end()) goto blocked;
            compute_free[r] = std::max(compute_free[r], it->second);
            arrival.erase(it);
            break;
          }
        }
        ++pc[r];
        progress = true;
      }
    blocked:;
    }
  }
  double end = 0;
  for (int r = 0; r < p; ++r) end = std::max(end, compute_free[r]);
  for (const auto& span : result.spans) end = std::max(end, span.end_s);
  result.step_time_s = end;
  double busy = 0;
  for (double b : result.busy_s) busy += b;
  result.bubble_fraction = end > 0 ? 1.0 - busy / (static_cast<double>(p) * end) : 0.0;
  return result;
}

}  // namespace conveyor::scheduler
