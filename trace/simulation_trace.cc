#include "trace/simulation_trace.h"

#include <cmath>
#include <map>

namespace conveyor::trace {

using scheduler::ActionKind;
using scheduler::Span;

std::uint64_t transfer_flow_id(bool gradient, int microbatch, int sending_stage) {
  return (static_cast<std::uint64_t>(gradient) << 62) | (static_cast<std::uint64_t>(microbatch) << 24) |
         static_cast<std::uint64_t>(sending_stage) | (std::uint64_t{1} << 61);
}

void add_simulation(PerfettoTrace& trace, const scheduler::Schedule& schedule,
                    const scheduler::SimulationResult& result, const std::string& name) {
  const int ranks = static_cast<int>(schedule.ranks.size());
  const int stages = schedule.spec.stages();
  std::vector<std::uint64_t> rank_track(ranks), compute(ranks), collective(ranks);
  std::map<std::pair<int, int>, std::uint64_t> send;  // (rank, peer): one stream per link
  for (int r = 0; r < ranks; ++r) {
    rank_track[r] = trace.add_track(name + " rank " + std::to_string(r));
    compute[r] = trace.add_track("compute", rank_track[r]);
    collective[r] = trace.add_track("collective", rank_track[r]);
  }
  auto send_track = [&](int r, int peer) {
    auto [it, fresh] = send.emplace(std::pair{r, peer}, 0);
    if (fresh) it->second = trace.add_track("send to rank " + std::to_string(peer), rank_track[r]);
    return it->second;
  };
  auto ns = [](double s) { return static_cast<std::uint64_t>(std::llround(s * 1e9)); };
  const bool with_stage = schedule.spec.chunks > 1;
  for (const Span& span : result.spans) {
    const auto& a = span.action;
    std::vector<std::uint64_t> flows;
    std::uint64_t track = compute[span.rank];
    if (span.stream == Span::Stream::kSend) {
      track = send_track(span.rank, a.peer);
      flows.push_back(transfer_flow_id(a.kind == ActionKind::kSendGradient, a.microbatch, a.stage));
    } else if (span.stream == Span::Stream::kCollective) {
      track = collective[span.rank];
    } else if (a.kind == ActionKind::kForward && a.stage > 0) {
      flows.push_back(transfer_flow_id(false, a.microbatch, a.stage - 1));
    } else if ((a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && a.stage + 1 < stages) {
      flows.push_back(transfer_flow_id(true, a.microbatch, a.stage + 1));
    }
    trace.slice(track, ns(span.start_s), ns(span.end_s), scheduler::action_text(a, with_stage), flows);
  }
}

}  // namespace conveyor::trace
