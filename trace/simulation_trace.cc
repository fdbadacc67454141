#include "trace/simulation_trace.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "common/file.h"
#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace conveyor::trace {

using scheduler::ActionKind;
using scheduler::Span;

std::uint64_t transfer_flow_id(bool gradient, int microbatch, int sending_stage, int sending_replica) {
  return (static_cast<std::uint64_t>(gradient) << 62) | (std::uint64_t{1} << 61) |
         (static_cast<std::uint64_t>(sending_replica) << 40) | (static_cast<std::uint64_t>(microbatch) << 20) |
         static_cast<std::uint64_t>(sending_stage);
}

namespace {

constexpr const char* kAcrossProcessesTrack = "across processes";

bool across_processes(const Span& span) {
  return span.stream == Span::Stream::kAcrossProcesses || span.stream == Span::Stream::kWaitingForProcesses;
}

// A slice's name: its action's, and a gradient sum across processes says so, and what of it
// waited for the last process.
std::string slice_name(const Span& span, bool with_stage) {
  std::string name = scheduler::action_text(span.action, with_stage);
  if (span.stream == Span::Stream::kWaitingForProcesses) return name + " waiting for the last process";
  return span.stream == Span::Stream::kAcrossProcesses ? name + " across processes" : name;
}

// Replica counts per rank: as given, or one each when none (or the wrong number) are given.
std::vector<int> replicas_per_rank(const scheduler::Schedule& schedule, const std::vector<int>& given) {
  const std::size_t ranks = schedule.ranks.size();
  return given.size() == ranks ? given : std::vector<int>(ranks, 1);
}

}  // namespace

void add_simulation(PerfettoTrace& trace, const scheduler::Schedule& schedule,
                    const scheduler::SimulationResult& result, const std::string& name,
                    const std::vector<int>& replica_counts) {
  const int ranks = static_cast<int>(schedule.ranks.size());
  const int stages = schedule.spec.stages();
  const std::vector<int> replicas = replicas_per_rank(schedule, replica_counts);
  struct Tracks {
    std::uint64_t group = 0, compute = 0, collective = 0, across = 0;
  };
  std::map<std::pair<int, int>, Tracks> tracks;        // (rank, replica)
  std::map<std::tuple<int, int, int>, std::uint64_t> send;  // (rank, replica, peer): one stream per link
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < replicas[r]; ++i) {
      Tracks& t = tracks[{r, i}];
      t.group = trace.add_track(name + " rank " + std::to_string(r) +
                                (replicas[r] > 1 ? " replica " + std::to_string(i) : ""));
      t.compute = trace.add_track("compute", t.group);
      t.collective = trace.add_track("collective", t.group);
    }
  }
  auto send_track = [&](int r, int i, int peer) {
    auto [it, fresh] = send.emplace(std::tuple{r, i, peer}, 0);
    if (fresh) it->second = trace.add_track("send to rank " + std::to_string(peer), tracks[{r, i}].group);
    return it->second;
  };
  auto partners = [&](int rank, int i, int stage) {
    return scheduler::partner_replicas(replicas, rank, i, schedule.spec.rank_of_stage(stage));
  };
  auto ns = [](double s) { return static_cast<std::uint64_t>(std::llround(s * 1e9)); };
  const bool with_stage = schedule.spec.chunks > 1;
  // Each span's flows: a send starts one, its consumers end it.
  std::vector<std::vector<std::uint64_t>> flows(result.spans.size());
  std::map<std::uint64_t, int> ends;  // flow id -> spans carrying it
  for (std::size_t k = 0; k < result.spans.size(); ++k) {
    const Span& span = result.spans[k];
    const auto& a = span.action;
    const int r = span.rank, i = std::min(span.replica, replicas[r] - 1);
    if (span.stream == Span::Stream::kSend) {
      flows[k].push_back(transfer_flow_id(a.kind == ActionKind::kSendGradient, a.microbatch, a.stage, i));
    } else if (span.stream == Span::Stream::kCompute && a.kind == ActionKind::kForward && a.stage > 0) {
      for (int j : partners(r, i, a.stage - 1)) flows[k].push_back(transfer_flow_id(false, a.microbatch, a.stage - 1, j));
    } else if (span.stream == Span::Stream::kCompute &&
               (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && a.stage + 1 < stages) {
      for (int j : partners(r, i, a.stage + 1)) flows[k].push_back(transfer_flow_id(true, a.microbatch, a.stage + 1, j));
    }
    for (std::uint64_t f : flows[k]) ++ends[f];
  }
  for (std::size_t k = 0; k < result.spans.size(); ++k) {
    const Span& span = result.spans[k];
    const auto& a = span.action;
    const int r = span.rank, i = std::min(span.replica, replicas[r] - 1);
    std::uint64_t track = tracks[{r, i}].compute;
    if (span.stream == Span::Stream::kSend) track = send_track(r, i, a.peer);
    if (span.stream == Span::Stream::kCollective) track = tracks[{r, i}].collective;
    if (across_processes(span)) {
      std::uint64_t& across = tracks[{r, i}].across;
      if (across == 0) across = trace.add_track(kAcrossProcessesTrack, tracks[{r, i}].group);
      track = across;
    }
    // A process's own trace of a pipeline across processes holds one end of the transfers
    // to and from the others: only flows with both ends here are drawn.
    std::vector<std::uint64_t> joined;
    for (std::uint64_t f : flows[k]) {
      if (ends[f] > 1) joined.push_back(f);
    }
    trace.slice(track, ns(span.start_s), ns(span.end_s), slice_name(span, with_stage), joined);
  }
}

namespace {

// Chrome's trace event format: a process per rank replica, a thread per stream, "X" slices,
// and "s"/"f" flow events from the end of each send to the start of each consumer.
std::string chrome_trace_json(const scheduler::Schedule& schedule, const scheduler::SimulationResult& result,
                              const std::string& name, const std::vector<int>& replica_counts,
                              const std::vector<Marker>& markers) {
  const int ranks = static_cast<int>(schedule.ranks.size());
  const int stages = schedule.spec.stages();
  const std::vector<int> replicas = replicas_per_rank(schedule, replica_counts);
  std::vector<int> first(static_cast<std::size_t>(ranks), 0);
  for (int r = 1; r < ranks; ++r) first[r] = first[r - 1] + replicas[r - 1];
  auto events = nlohmann::json::array();
  auto pid = [&](int r, int i) { return first[r] + i; };
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < replicas[r]; ++i) {
      events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid(r, i)},
                        {"args", {{"name", name + " rank " + std::to_string(r) +
                                               (replicas[r] > 1 ? " replica " + std::to_string(i) : "")}}}});
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid(r, i)}, {"tid", 0},
                        {"args", {{"name", "compute"}}}});
      events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid(r, i)}, {"tid", 1},
                        {"args", {{"name", "collective"}}}});
    }
  }
  auto partners = [&](int rank, int i, int stage) {
    return scheduler::partner_replicas(replicas, rank, i, schedule.spec.rank_of_stage(stage));
  };
  const bool with_stage = schedule.spec.chunks > 1;
  auto us = [](double s) { return s * 1e6; };
  std::set<int> across_named;  // pids whose "across processes" thread is named
  for (const Span& span : result.spans) {
    const auto& a = span.action;
    const int r = span.rank, i = std::min(span.replica, replicas[r] - 1);
    int tid = 0;
    if (span.stream == Span::Stream::kSend) tid = 2 + a.peer;
    if (span.stream == Span::Stream::kCollective) tid = 1;
    if (across_processes(span)) {
      tid = 2 + ranks;
      if (across_named.insert(pid(r, i)).second) {
        events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid(r, i)}, {"tid", tid},
                          {"args", {{"name", kAcrossProcessesTrack}}}});
      }
    }
    events.push_back({{"name", slice_name(span, with_stage)}, {"ph", "X"}, {"pid", pid(r, i)},
                      {"tid", tid}, {"ts", us(span.start_s)}, {"dur", us(span.end_s - span.start_s)}});
    // A flow per (send, consuming replica): its id names the sending replica and the consumer.
    auto flow = [&](bool grad, int mb, int from_stage, int from_replica, int to_replica) {
      return std::to_string(transfer_flow_id(grad, mb, from_stage, from_replica)) + "." + std::to_string(to_replica);
    };
    if (span.stream == Span::Stream::kSend) {
      const bool grad = a.kind == ActionKind::kSendGradient;
      const int to_stage = grad ? a.stage - 1 : a.stage + 1;
      for (int j : partners(r, i, to_stage)) {
        events.push_back({{"name", "transfer"}, {"cat", "transfer"}, {"ph", "s"}, {"pid", pid(r, i)}, {"tid", tid},
                          {"ts", us(span.end_s)}, {"id", flow(grad, a.microbatch, a.stage, i, j)}});
      }
    } else if (span.stream == Span::Stream::kCompute) {
      const bool fwd = a.kind == ActionKind::kForward && a.stage > 0;
      const bool bwd = (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) && a.stage + 1 < stages;
      if (!fwd && !bwd) continue;
      const int from_stage = fwd ? a.stage - 1 : a.stage + 1;
      for (int j : partners(r, i, from_stage)) {
        events.push_back({{"name", "transfer"}, {"cat", "transfer"}, {"ph", "f"}, {"bp", "e"}, {"pid", pid(r, i)},
                          {"tid", tid}, {"ts", us(span.start_s)}, {"id", flow(bwd, a.microbatch, from_stage, j, i)}});
      }
    }
  }
  for (int r = 0; r < ranks; ++r) {
    for (int i = 0; i < replicas[r]; ++i) {
      for (int peer = 0; peer < ranks; ++peer) {
        if (peer == r) continue;
        events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid(r, i)}, {"tid", 2 + peer},
                          {"args", {{"name", "send to rank " + std::to_string(peer)}}}});
      }
    }
  }
  for (const Marker& m : markers) {
    events.push_back({{"name", m.name}, {"ph", "i"}, {"s", "g"}, {"pid", 0}, {"tid", 0}, {"ts", us(m.t_s)}});
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

}  // namespace

Status write_step_trace(const std::string& path, const scheduler::Schedule& schedule,
                        const scheduler::SimulationResult& result, const std::string& name,
                        const std::vector<int>& replicas, const std::vector<Marker>& markers) {
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    return write_file(path, chrome_trace_json(schedule, result, name, replicas, markers), "trace");
  }
  PerfettoTrace t;
  add_simulation(t, schedule, result, name, replicas);
  if (!markers.empty()) {
    const std::uint64_t track = t.add_track("conveyor");
    for (const Marker& m : markers) t.instant(track, static_cast<std::uint64_t>(std::max(0.0, m.t_s) * 1e9), m.name);
  }
  return t.write(path);
}

}  // namespace conveyor::trace
