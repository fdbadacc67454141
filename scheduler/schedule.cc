#include "scheduler/schedule.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace conveyor::scheduler {
namespace {

// Appends F of `mb` on `rank` with the receive before and the send after it.
void forward(ActionList& list, int rank, int ranks, int mb) {
  if (rank > 0) list.push_back({ActionKind::kRecvActivation, mb, rank - 1});
  list.push_back({ActionKind::kForward, mb, -1});
  if (rank < ranks - 1) list.push_back({ActionKind::kSendActivation, mb, rank + 1});
}

void backward(ActionList& list, int rank, int ranks, int mb) {
  if (rank < ranks - 1) list.push_back({ActionKind::kRecvGradient, mb, rank + 1});
  list.push_back({ActionKind::kBackward, mb, -1});
  if (rank > 0) list.push_back({ActionKind::kSendGradient, mb, rank - 1});
}

// ZB-H1: 1F1B's order of forwards and input-gradient backwards with the same in-flight
// limit (p - rank microbatches between F and B), and weight-gradient passes (W) deferred to
// the moments a rank would otherwise idle. The order is derived by list scheduling at unit cost
// (F = B = W), the setting in which ZB-H1 is defined; bubbles shrink to about a third of 1F1B's.
void zero_bubble_h1(std::vector<ActionList>& lists, int p, int m) {
  constexpr double kUnset = -1;
  std::vector<std::vector<double>> act_ready(p, std::vector<double>(m, kUnset));
  std::vector<std::vector<double>> grad_ready(p, std::vector<double>(m, kUnset));
  for (int mb = 0; mb < m; ++mb) act_ready[0][mb] = 0;
  std::vector<double> free_at(p, 0);
  std::vector<int> next_f(p, 0), next_b(p, 0), next_w(p, 0);
  auto done = [&](int r) { return next_w[r] == m; };
  auto b_ready = [&](int r) {
    return next_b[r] < next_f[r] && grad_ready[r][next_b[r]] != kUnset && grad_ready[r][next_b[r]] <= free_at[r];
  };
  auto f_ready = [&](int r) {
    return next_f[r] < m && next_f[r] - next_b[r] < p - r && act_ready[r][next_f[r]] != kUnset &&
           act_ready[r][next_f[r]] <= free_at[r];
  };
  auto can_act = [&](int r) { return !done(r) && (b_ready(r) || f_ready(r) || next_w[r] < next_b[r]); };
  for (;;) {
    // The earliest rank that can act goes next; ties go to the lower rank.
    int r = -1, earliest = -1;
    for (int q = 0; q < p; ++q) {
      if (done(q)) continue;
      if (earliest < 0 || free_at[q] < free_at[earliest]) earliest = q;
      if (can_act(q) && (r < 0 || free_at[q] < free_at[r])) r = q;
    }
    if (earliest < 0) break;
    if (r < 0 || free_at[r] > free_at[earliest]) {
      // The earliest rank waits: move it to the next moment anything can change.
      const double t = free_at[earliest];
      double next = -1;
      auto consider = [&](double x) { if (x > t && (next < 0 || x < next)) next = x; };
      for (int q = 0; q < p; ++q) {
        if (!done(q)) consider(free_at[q]);
        for (int mb = 0; mb < m; ++mb) {
          consider(act_ready[q][mb]);
          consider(grad_ready[q][mb]);
        }
      }
      CONVEYOR_CHECK(next > t, "zero-bubble list scheduling made no progress");
      free_at[earliest] = next;
      continue;
    }
    const double t = free_at[r];
    ActionList& list = lists[r];
    if (b_ready(r)) {
      int mb = next_b[r]++;
      if (r < p - 1) list.push_back({ActionKind::kRecvGradient, mb, r + 1});
      list.push_back({ActionKind::kBackwardInput, mb, -1});
      if (r > 0) {
        list.push_back({ActionKind::kSendGradient, mb, r - 1});
        grad_ready[r - 1][mb] = t + 1;
      }
      free_at[r] = t + 1;
    } else if (f_ready(r)) {
      int mb = next_f[r]++;
      if (r > 0) list.push_back({ActionKind::kRecvActivation, mb, r - 1});
      list.push_back({ActionKind::kForward, mb, -1});
      if (r < p - 1) {
        list.push_back({ActionKind::kSendActivation, mb, r + 1});
        act_ready[r + 1][mb] = t + 1;
      } else {
        grad_ready[r][mb] = t + 1;  // the last rank's backward starts from its own loss
      }
      free_at[r] = t + 1;
    } else if (next_w[r] < next_b[r]) {
      list.push_back({ActionKind::kBackwardWeight, next_w[r]++, -1});
      free_at[r] = t + 1;
    }
  }
}

}  // namespace

Result<ScheduleKind> schedule_kind_from_name(std::string_view name) {
  if (name == "gpipe") return ScheduleKind::kGPipe;
  if (name == "1f1b") return ScheduleKind::kOneFOneB;
  if (name == "zb-h1") return ScheduleKind::kZeroBubbleH1;
  return Status(ErrorCode::kInvalidArgument,
                "unknown schedule '" + std::string(name) + "' (expected gpipe, 1f1b or zb-h1)");
}

std::string_view schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::kOneFOneB: return "1f1b";
    case ScheduleKind::kZeroBubbleH1: return "zb-h1";
  }
  return "1f1b";
}

std::string action_text(const Action& a) {
  std::string mb = std::to_string(a.microbatch);
  std::string peer = std::to_string(a.peer);
  switch (a.kind) {
    case ActionKind::kForward: return "F" + mb;
    case ActionKind::kBackward: return "B" + mb;
    case ActionKind::kBackwardInput: return "Bi" + mb;
    case ActionKind::kBackwardWeight: return "W" + mb;
    case ActionKind::kSendActivation: return "sendA" + mb + ">" + peer;
    case ActionKind::kRecvActivation: return "recvA" + mb + "<" + peer;
    case ActionKind::kSendGradient: return "sendG" + mb + ">" + peer;
    case ActionKind::kRecvGradient: return "recvG" + mb + "<" + peer;
  }
  return "?";
}

std::string Schedule::to_text() const {
  std::string out;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    out += "rank " + std::to_string(r) + ":";
    for (const auto& a : ranks[r]) out += " " + action_text(a);
    out += "\n";
  }
  return out;
}

Result<Schedule> make_schedule(const ScheduleSpec& spec) {
  if (spec.ranks < 1) return Status(ErrorCode::kInvalidArgument, "a schedule needs at least one rank");
  if (spec.microbatches < 1) {
    return Status(ErrorCode::kInvalidArgument, "a schedule needs at least one microbatch");
  }
  Schedule s{spec, std::vector<ActionList>(static_cast<std::size_t>(spec.ranks))};
  const int p = spec.ranks, m = spec.microbatches;
  for (int r = 0; r < p; ++r) {
    ActionList& list = s.ranks[static_cast<std::size_t>(r)];
    switch (spec.kind) {
      case ScheduleKind::kGPipe:
        for (int mb = 0; mb < m; ++mb) forward(list, r, p, mb);
        for (int mb = 0; mb < m; ++mb) backward(list, r, p, mb);
        break;
      case ScheduleKind::kOneFOneB: {
        const int warmup = std::min(p - r - 1, m);
        int next_f = 0, next_b = 0;
        for (; next_f < warmup; ++next_f) forward(list, r, p, next_f);
        while (next_f < m) {  // steady state: one forward, one backward
          forward(list, r, p, next_f++);
          backward(list, r, p, next_b++);
        }
        while (next_b < m) backward(list, r, p, next_b++);
        break;
      }
      case ScheduleKind::kZeroBubbleH1:
        break;  // all ranks at once, below
    }
  }
  if (spec.kind == ScheduleKind::kZeroBubbleH1) zero_bubble_h1(s.ranks, p, m);
  CONVEYOR_RETURN_IF_ERROR(validate_schedule(s));
  return s;
}

Status validate_schedule(const Schedule& s) {
  auto bad = [](const std::string& msg) { return Status(ErrorCode::kInvalidArgument, "invalid schedule: " + msg); };
  const int p = static_cast<int>(s.ranks.size());
  const int m = s.spec.microbatches;
  // Coverage: F and B of every microbatch exactly once per rank, F first.
  for (int r = 0; r < p; ++r) {
    std::vector<int> f(static_cast<std::size_t>(m), 0), b(static_cast<std::size_t>(m), 0);
    std::vector<int> input(static_cast<std::size_t>(m), 0), weight(static_cast<std::size_t>(m), 0);
    for (const auto& a : s.ranks[r]) {
      if (a.microbatch < 0 || a.microbatch >= m) {
        return bad("rank " + std::to_string(r) + " has " + action_text(a) + " outside microbatches 0.." +
                   std::to_string(m - 1));
      }
      if (a.kind == ActionKind::kForward) ++f[a.microbatch];
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
        if (f[a.microbatch] == 0) return bad("rank " + std::to_string(r) + " runs " + action_text(a) + " before its forward");
        ++(a.kind == ActionKind::kBackward ? b : input)[a.microbatch];
      }
      if (a.kind == ActionKind::kBackwardWeight) {
        if (input[a.microbatch] == 0) {
          return bad("rank " + std::to_string(r) + " runs " + action_text(a) + " before its input-gradient pass");
        }
        ++weight[a.microbatch];
      }
    }
    for (int mb = 0; mb < m; ++mb) {
      if (input[mb] != weight[mb] || input[mb] > 1) {
        return bad("rank " + std::to_string(r) + " splits the backward of microbatch " + std::to_string(mb) +
                   " unevenly (" + std::to_string(input[mb]) + " input and " + std::to_string(weight[mb]) +
                   " weight passes)");
      }
      b[mb] += input[mb];
    }
    for (int mb = 0; mb < m; ++mb) {
      if (f[mb] != 1 || b[mb] != 1) {
        return bad("rank " + std::to_string(r) + " runs microbatch " + std::to_string(mb) + " forward " +
                   std::to_string(f[mb]) + " and backward " + std::to_string(b[mb]) + " times (expected once)");
      }
    }
  }
  // Matching and progress: replay the lists; a receive proceeds once its send was posted.
  using Key = std::tuple<int, int, bool, int>;  // from, to, is_gradient, microbatch
  std::set<Key> posted;
  std::vector<std::size_t> pc(static_cast<std::size_t>(p), 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      auto& list = s.ranks[r];
      while (pc[r] < list.size()) {
        const Action& a = list[pc[r]];
        if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGradient) {
          if (a.peer < 0 || a.peer >= p) return bad("rank " + std::to_string(r) + " sends to missing rank " + std::to_string(a.peer));
          if (!posted.insert({r, a.peer, a.kind == ActionKind::kSendGradient, a.microbatch}).second) {
            return bad("rank " + std::to_string(r) + " posts " + action_text(a) + " twice");
          }
        } else if (a.kind == ActionKind::kRecvActivation || a.kind == ActionKind::kRecvGradient) {
          Key k{a.peer, r, a.kind == ActionKind::kRecvGradient, a.microbatch};
          if (!posted.count(k)) break;
          posted.erase(k);
        }
        ++pc[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    if (pc[r] < s.ranks[r].size()) {
      std::string stuck;
      for (int q = 0; q < p; ++q) {
        if (pc[q] < s.ranks[q].size()) stuck += " rank " + std::to_string(q) + " at " + action_text(s.ranks[q][pc[q]]) + ";";
      }
      return bad("the lists deadlock:" + stuck + " each waits for a send that is never reached");
    }
  }
  if (!posted.empty()) {
    auto [from, to, grad, mb] = *posted.begin();
    return bad("rank " + std::to_string(from) + " sends " + (grad ? "gradient" : "activation") + " of microbatch " +
               std::to_string(mb) + " to rank " + std::to_string(to) + " which never receives it");
  }
  return Status::ok();
}

}  // namespace conveyor::scheduler
