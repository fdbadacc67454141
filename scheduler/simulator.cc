#include "scheduler/simulator.h"

#include <algorithm>
#include <map>
#include <tuple>

namespace conveyor::scheduler {

Result<SimulationResult> simulate(const Schedule& s, const std::vector<StageCost>& costs,
                                  const std::vector<LinkCost>& links) {
  const int p = static_cast<int>(s.ranks.size());
  const int stages = s.spec.stages();
  if (static_cast<int>(costs.size()) != stages) {
    return Status(ErrorCode::kInvalidArgument, "simulate: " + std::to_string(costs.size()) +
                                                   " stage costs for a schedule of " + std::to_string(stages) +
                                                   " stages");
  }
  if (links.size() > 1 && static_cast<int>(links.size()) != stages - 1) {
    return Status(ErrorCode::kInvalidArgument, "simulate: " + std::to_string(links.size()) + " links for " +
                                                   std::to_string(stages - 1) + " stage boundaries");
  }
  auto link_of = [&](int boundary) {
    return links.empty() ? LinkCost{} : links.size() == 1 ? links[0] : links[static_cast<std::size_t>(boundary)];
  };
  CONVEYOR_RETURN_IF_ERROR(validate_schedule(s));
  SimulationResult result;
  result.busy_s.assign(static_cast<std::size_t>(p), 0);
  result.peak_bytes.assign(static_cast<std::size_t>(p), 0);
  std::vector<double> compute_free(static_cast<std::size_t>(p), 0);     // compute stream per rank
  std::vector<double> collective_free(static_cast<std::size_t>(p), 0);  // collective stream per rank
  std::vector<double> static_bytes(static_cast<std::size_t>(p), 0), live(static_cast<std::size_t>(p), 0);
  for (int stage = 0; stage < stages; ++stage) {
    static_bytes[s.spec.rank_of_stage(stage)] += costs[stage].static_bytes - costs[stage].weight_grad_bytes;
  }
  std::vector<bool> grads_made(static_cast<std::size_t>(stages), false);
  for (int r = 0; r < p; ++r) result.peak_bytes[r] = static_bytes[r];
  double pipeline_end = 0;
  std::map<std::pair<int, int>, double> link_free;                    // send stream per directed rank pair
  using Key = std::tuple<bool, int, int>;                             // gradient, microbatch, sending stage
  std::map<Key, double> arrival;
  std::vector<std::size_t> pc(static_cast<std::size_t>(p), 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      const ActionList& list = s.ranks[r];
      while (pc[r] < list.size()) {
        const Action& a = list[pc[r]];
        const StageCost& c = costs[a.stage];
        switch (a.kind) {
          case ActionKind::kForward:
          case ActionKind::kBackward:
          case ActionKind::kBackwardInput:
          case ActionKind::kBackwardWeight: {
            double d = a.kind == ActionKind::kForward          ? c.forward_s
                       : a.kind == ActionKind::kBackward       ? c.backward_s
                       : a.kind == ActionKind::kBackwardInput  ? c.backward_s - c.backward_weight_s
                                                               : c.backward_weight_s;
            Span span{r, Span::Stream::kCompute, a, compute_free[r], compute_free[r] + d};
            compute_free[r] = span.end_s;
            pipeline_end = std::max(pipeline_end, span.end_s);
            result.busy_s[r] += d;
            result.spans.push_back(span);
            // Activations live from a forward until the backward that consumes them; a split
            // one frees most at its Bi and the weight gradients' inputs at its W.
            // A backward peaks while it runs, at what was held plus its extra (and a Bi
            // plus the gradients it captures for W).
            if (a.kind != ActionKind::kForward) {
              const double extra = a.kind == ActionKind::kBackward         ? c.backward_extra_bytes
                                   : a.kind == ActionKind::kBackwardInput ? c.captured_bytes + c.split_backward_extra_bytes
                                                                          : c.split_backward_extra_bytes;
              result.peak_bytes[r] = std::max(result.peak_bytes[r], static_bytes[r] + live[r] + extra);
            }
            // Its weight gradients stay from here on (the working memory above made them).
            if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) && !grads_made[a.stage]) {
              grads_made[a.stage] = true;
              static_bytes[r] += c.weight_grad_bytes;
            }
            if (a.kind == ActionKind::kForward) {
              live[r] += c.saved_bytes;
            } else if (a.kind == ActionKind::kBackwardInput) {
              live[r] -= c.input_freed_bytes;
            } else if (a.kind == ActionKind::kBackwardWeight) {
              live[r] -= c.saved_bytes - c.input_freed_bytes;
            } else {
              live[r] -= c.saved_bytes;
            }
            result.peak_bytes[r] = std::max(result.peak_bytes[r], static_bytes[r] + live[r]);
            break;
          }
          case ActionKind::kSendActivation:
          case ActionKind::kSendGradient: {
            const bool grad = a.kind == ActionKind::kSendGradient;
            const double bytes = grad ? c.gradient_bytes : c.activation_bytes;
            const LinkCost link = link_of(grad ? a.stage - 1 : a.stage);
            double& free = link_free[{r, a.peer}];
            double start = std::max(compute_free[r], free);  // the data exists once computed
            // Between two stages of one rank (ZB-V's turn) the value stays where it is.
            double end = a.peer == r ? start : start + link.transfer_s(bytes);
            free = end;
            arrival[{grad, a.microbatch, a.stage}] = end;
            result.spans.push_back({r, Span::Stream::kSend, a, start, end});
            break;
          }
          case ActionKind::kRecvActivation:
          case ActionKind::kRecvGradient: {
            const bool grad = a.kind == ActionKind::kRecvGradient;
            auto it = arrival.find({grad, a.microbatch, grad ? a.stage + 1 : a.stage - 1});
            if (it == arrival.end()) goto blocked;
            compute_free[r] = std::max(compute_free[r], it->second);
            arrival.erase(it);
            break;
          }
          case ActionKind::kAllReduce: {
            double start = std::max(compute_free[r], collective_free[r]);
            collective_free[r] = start + c.allreduce_s;
            if (c.allreduce_s > 0) result.spans.push_back({r, Span::Stream::kCollective, a, start, collective_free[r]});
            break;
          }
          case ActionKind::kOptimizerStep: {
            double start = std::max(compute_free[r], collective_free[r]);
            double d = 0;
            for (int stage : s.spec.stages_of_rank(r)) d += costs[stage].optimizer_s;
            compute_free[r] = start + d;
            if (d > 0) result.spans.push_back({r, Span::Stream::kCompute, a, start, compute_free[r]});
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
  for (int r = 0; r < p; ++r) end = std::max({end, compute_free[r], collective_free[r]});
  for (const auto& span : result.spans) end = std::max(end, span.end_s);
  result.step_time_s = end;
  double busy = 0;
  for (double b : result.busy_s) busy += b;
  result.bubble_fraction = pipeline_end > 0 ? 1.0 - busy / (static_cast<double>(p) * pipeline_end) : 0.0;
  return result;
}

}  // namespace conveyor::scheduler
