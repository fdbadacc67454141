#include "scheduler/schedule.h"

#include "common/printable.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <tuple>

namespace conveyor::scheduler {
namespace {

// Appends F of `mb` on `stage` with the receive before and the send after it.
void forward(ActionList& list, const ScheduleSpec& spec, int stage, int mb) {
  const int last = spec.stages() - 1;
  if (stage > 0) list.push_back({ActionKind::kRecvActivation, mb, spec.rank_of_stage(stage - 1), stage});
  list.push_back({ActionKind::kForward, mb, -1, stage});
  if (stage < last) list.push_back({ActionKind::kSendActivation, mb, spec.rank_of_stage(stage + 1), stage});
}

// Appends the backward of `mb` on `stage` (B, or Bi of a split one) with its receive and send.
void backward(ActionList& list, const ScheduleSpec& spec, int stage, int mb, ActionKind kind = ActionKind::kBackward) {
  const int last = spec.stages() - 1;
  if (stage < last) list.push_back({ActionKind::kRecvGradient, mb, spec.rank_of_stage(stage + 1), stage});
  list.push_back({kind, mb, -1, stage});
  if (stage > 0) list.push_back({ActionKind::kSendGradient, mb, spec.rank_of_stage(stage - 1), stage});
}

// Interleaved 1F1B (Narayanan et al., 2021): rank r holds stages r, r + p, ... Microbatches
// advance in groups of p through one chunk, then the next; warmup runs
// 2 (p - r - 1) + (v - 1) p forwards, then one forward and one backward alternate. Needs
// m to be a multiple of p so that each group fills every rank.
void interleaved(ActionList& list, const ScheduleSpec& spec, int r) {
  const int p = spec.ranks, v = spec.chunks, m = spec.microbatches;
  const int total = m * v;
  auto chunk_of = [&](int k, bool fwd) {
    int c = (k % (p * v)) / p;
    return fwd ? c : v - 1 - c;
  };
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  const int warmup = std::min(2 * (p - r - 1) + (v - 1) * p, total);
  int next_f = 0, next_b = 0;
  for (; next_f < warmup; ++next_f) forward(list, spec, chunk_of(next_f, true) * p + r, mb_of(next_f));
  while (next_f < total) {
    forward(list, spec, chunk_of(next_f, true) * p + r, mb_of(next_f));
    ++next_f;
    backward(list, spec, chunk_of(next_b, false) * p + r, mb_of(next_b));
    ++next_b;
  }
  for (; next_b < total; ++next_b) backward(list, spec, chunk_of(next_b, false) * p + r, mb_of(next_b));
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
      if (r < p - 1) list.push_back({ActionKind::kRecvGradient, mb, r + 1, r});
      list.push_back({ActionKind::kBackwardInput, mb, -1, r});
      if (r > 0) {
        list.push_back({ActionKind::kSendGradient, mb, r - 1, r});
        grad_ready[r - 1][mb] = t + 1;
      }
      free_at[r] = t + 1;
    } else if (f_ready(r)) {
      int mb = next_f[r]++;
      if (r > 0) list.push_back({ActionKind::kRecvActivation, mb, r - 1, r});
      list.push_back({ActionKind::kForward, mb, -1, r});
      if (r < p - 1) {
        list.push_back({ActionKind::kSendActivation, mb, r + 1, r});
        act_ready[r + 1][mb] = t + 1;
      } else {
        grad_ready[r][mb] = t + 1;  // the last rank's backward starts from its own loss
      }
      free_at[r] = t + 1;
    } else if (next_w[r] < next_b[r]) {
      list.push_back({ActionKind::kBackwardWeight, next_w[r]++, -1, r});
      free_at[r] = t + 1;
    }
  }
}


// ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6): rank r holds the down
// stage r and the up stage 2p - 1 - r, and the backward is split into Bi and W. At unit
// cost (F = Bi = W) and m >= 2p - 1 the order below idles only while the first forward
// fills the ranks (p - 1 units per rank in all), while no rank keeps more activations than
// 1F1B's first rank (2p stage-microbatches of half a rank's model):
//   fill     2(p - r) - 1 forwards down, then r times: F up, F down;
//   ramp     p - r times: F up, Bi up, W up;
//   steady   until every forward ran: F down (while any is left), Bi down, W down, F up,
//            Bi up, W up;
//   drain    r times: Bi down, Bi up (their W wait); p - r times: Bi down, W down;
//            then every W left, up stage first.
// With fewer than 2p - 1 microbatches the order is made for 2p - 1 and the absent
// microbatches' actions are left out, which keeps the lists deadlock-free (what is left
// waits on a subset of what waited before).
void zero_bubble_v(ActionList& list, const ScheduleSpec& spec, int r) {
  const int p = spec.ranks, m = spec.microbatches;
  const int padded = std::max(m, 2 * p - 1);
  const int down = r, up = 2 * p - 1 - r;
  struct Leg {
    int stage, forwards = 0, inputs = 0, weights = 0;
  };
  Leg d{down}, u{up};
  auto f = [&](Leg& l) {
    if (l.forwards < m) forward(list, spec, l.stage, l.forwards);
    ++l.forwards;
  };
  auto bi = [&](Leg& l) {
    if (l.inputs < m) backward(list, spec, l.stage, l.inputs, ActionKind::kBackwardInput);
    ++l.inputs;
  };
  auto w = [&](Leg& l) {
    if (l.weights < m) list.push_back({ActionKind::kBackwardWeight, l.weights, -1, l.stage});
    ++l.weights;
  };
  for (int k = 0; k < 2 * (p - r) - 1; ++k) f(d);
  for (int k = 0; k < r; ++k) f(u), f(d);
  for (int k = 0; k < p - r; ++k) f(u), bi(u), w(u);
  while (u.forwards < d.forwards || d.forwards < padded) {
    if (d.forwards < padded) f(d);
    bi(d), w(d), f(u), bi(u), w(u);
  }
  for (int k = 0; k < r; ++k) bi(d), bi(u);
  for (int k = 0; k < p - r; ++k) bi(d), w(d);
  while (u.weights < u.inputs) w(u);
  while (d.weights < d.inputs) w(d);
  CONVEYOR_CHECK(d.forwards == padded && d.inputs == padded && d.weights == padded && u.forwards == padded &&
                     u.inputs == padded && u.weights == padded,
                 "ZB-V left a microbatch unfinished");
}

// DualPipeV (DeepSeek-V3's DualPipe cut in half, as torch.distributed.pipelining's
// ScheduleDualPipeV orders it): ZB-V's placement, with m >= 2p microbatches. Its steady state
// pairs a forward of one leg with a whole backward of the other (F down + B up, then F up +
// B down), which DualPipe overlaps with the other's communication; here the pair runs in
// order on the replica's compute stream while transfers proceed on theirs. Input-gradient
// halves (with their W deferred) fill the warm-up and the drain:
//   1: 2 (p - r - 1) forwards down;  2: r + 1 times F down, F up;
//   3: p - r - 1 times Bi up, a pending W, F up;
//   4: m - 2p + r + 1 times F down + B up (the last rank's first pair unpaired), F up + B down;
//   5: p - r - 1 times B up, F up + B down;
//   6: r + 1 times B up, B down, the second half of them split (Bi) for the drain;
//   7: p - r - 1 times a pending W, B down (split when 6 ended split);  8: every W left.
void dual_pipe_v(ActionList& list, const ScheduleSpec& spec, int r) {
  const int p = spec.ranks, m = spec.microbatches;
  struct Leg {
    int stage, forwards = 0, backwards = 0;
  };
  Leg down{r}, up{2 * p - 1 - r};
  std::deque<std::pair<int, int>> weights;  // (stage, microbatch) whose W is pending
  auto f = [&](Leg& l) { forward(list, spec, l.stage, l.forwards++); };
  auto b = [&](Leg& l, bool split) {
    const int mb = l.backwards++;
    backward(list, spec, l.stage, mb, split ? ActionKind::kBackwardInput : ActionKind::kBackward);
    if (split) weights.emplace_back(l.stage, mb);
  };
  auto w = [&] {
    if (weights.empty()) return;
    list.push_back({ActionKind::kBackwardWeight, weights.front().second, -1, weights.front().first});
    weights.pop_front();
  };
  for (int k = 0; k < 2 * (p - r - 1); ++k) f(down);
  for (int k = 0; k < r + 1; ++k) f(down), f(up);
  for (int k = 0; k < p - r - 1; ++k) b(up, true), w(), f(up);
  for (int k = 0; k < m - 2 * p + r + 1; ++k) {
    f(down), b(up, false);
    f(up), b(down, false);
  }
  for (int k = 0; k < p - r - 1; ++k) b(up, false), f(up), b(down, false);
  bool split = false;
  for (int k = 0; k < r + 1; ++k) {
    if (k == (r + 1) / 2 && r % 2 == 1) split = true;
    b(up, split);
    if (k == (r + 1) / 2 && r % 2 == 0) split = true;
    b(down, split);
  }
  for (int k = 0; k < p - r - 1; ++k) w(), b(down, split);
  while (!weights.empty()) w();
  CONVEYOR_CHECK(down.forwards == m && up.forwards == m && down.backwards == m && up.backwards == m,
                 "DualPipeV left a microbatch unfinished");
}

}  // namespace

Result<ScheduleKind> schedule_kind_from_name(std::string_view name) {
  for (ScheduleKind kind : kScheduleKinds) {
    if (schedule_kind_name(kind) == name) return kind;
  }
  return Status(ErrorCode::kInvalidArgument,
                "unknown schedule '" + printable(name, 40) + "' (expected " + schedule_names_text() + ")");
}

std::string schedule_names_text(std::string_view last) {
  std::string out;
  for (std::size_t k = 0; k < kScheduleKinds.size(); ++k) {
    if (k > 0) out += k + 1 == kScheduleKinds.size() ? std::string(last) : ", ";
    out += schedule_kind_name(kScheduleKinds[k]);
  }
  return out;
}

std::string_view schedule_kind_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGPipe: return "gpipe";
    case ScheduleKind::kOneFOneB: return "1f1b";
    case ScheduleKind::kInterleaved: return "interleaved";
    case ScheduleKind::kZeroBubbleH1: return "zb-h1";
    case ScheduleKind::kZeroBubbleV: return "zb-v";
    case ScheduleKind::kDualPipeV: return "dualpipev";
  }
  return "1f1b";
}

std::string action_text(const Action& a, bool with_stage) {
  std::string mb = std::to_string(a.microbatch);
  std::string peer = std::to_string(a.peer);
  std::string at = with_stage ? "@s" + std::to_string(a.stage) : "";
  switch (a.kind) {
    case ActionKind::kForward: return "F" + mb + at;
    case ActionKind::kBackward: return "B" + mb + at;
    case ActionKind::kBackwardInput: return "Bi" + mb + at;
    case ActionKind::kBackwardWeight: return "W" + mb + at;
    case ActionKind::kSendActivation: return "sendA" + mb + at + ">" + peer;
    case ActionKind::kRecvActivation: return "recvA" + mb + at + "<" + peer;
    case ActionKind::kSendGradient: return "sendG" + mb + at + ">" + peer;
    case ActionKind::kRecvGradient: return "recvG" + mb + at + "<" + peer;
    case ActionKind::kAllReduce: return "allreduce" + std::to_string(a.stage);
    case ActionKind::kOptimizerStep: return "step";
  }
  return "?";
}

std::string action_words(const Action& a, bool with_stage) {
  const std::string mb = "microbatch " + std::to_string(a.microbatch);
  const std::string of = with_stage ? " of stage " + std::to_string(a.stage) : "";
  const std::string peer = "rank " + std::to_string(a.peer);
  std::string words;
  switch (a.kind) {
    case ActionKind::kForward: words = "the forward of " + mb + of; break;
    case ActionKind::kBackward: words = "the backward of " + mb + of; break;
    case ActionKind::kBackwardInput: words = "the input gradient of " + mb + of; break;
    case ActionKind::kBackwardWeight: words = "the weight gradient of " + mb + of; break;
    case ActionKind::kSendActivation: words = "sending " + mb + "'s activations" + of + " to " + peer; break;
    case ActionKind::kRecvActivation: words = "receiving " + mb + "'s activations" + of + " from " + peer; break;
    case ActionKind::kSendGradient: words = "sending " + mb + "'s gradients" + of + " to " + peer; break;
    case ActionKind::kRecvGradient: words = "receiving " + mb + "'s gradients" + of + " from " + peer; break;
    case ActionKind::kAllReduce:
      words = "summing stage " + std::to_string(a.stage) + "'s gradients over its replicas";
      break;
    case ActionKind::kOptimizerStep: words = "the optimizer step"; break;
  }
  return words + " (" + action_text(a, with_stage) + ")";
}

std::string Schedule::to_text() const {
  const bool with_stage = spec.chunks > 1;
  std::string out;
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    out += "rank " + std::to_string(r) + ":";
    for (const auto& a : ranks[r]) out += " " + action_text(a, with_stage);
    out += "\n";
  }
  return out;
}

Result<Schedule> make_schedule(const ScheduleSpec& spec) {
  if (spec.ranks < 1) return Status(ErrorCode::kInvalidArgument, "a schedule needs at least one rank");
  if (spec.microbatches < 1) {
    return Status(ErrorCode::kInvalidArgument, "a schedule needs at least one microbatch");
  }
  if (spec.ranks > kMostRanks || spec.microbatches > kMostMicrobatches || spec.chunks > kMostRanks ||
      static_cast<long long>(spec.ranks) * std::max(spec.chunks, 1) * spec.microbatches > kMostStageMicrobatches) {
    return Status(ErrorCode::kInvalidArgument,
                  "a schedule of " + std::to_string(spec.ranks) + " ranks, " + std::to_string(spec.chunks) +
                      " stages each and " + std::to_string(spec.microbatches) + " microbatches is larger than conveyor " +
                      "makes: at most " + std::to_string(kMostRanks) + " ranks, " + std::to_string(kMostMicrobatches) +
                      " microbatches and " + std::to_string(kMostStageMicrobatches) +
                      " stages x microbatches (docs/formats.md, \"Size limits\")");
  }
  if (spec.v_shape() && spec.chunks != 2) {
    return Status(ErrorCode::kInvalidArgument, std::string(schedule_kind_name(spec.kind)) +
                                                   " holds exactly two stages (chunks) per rank, not " +
                                                   std::to_string(spec.chunks));
  }
  if (spec.kind == ScheduleKind::kDualPipeV && spec.microbatches < 2 * spec.ranks) {
    return Status(ErrorCode::kInvalidArgument,
                  "DualPipeV needs at least as many microbatches as stages (2 per rank): " +
                      std::to_string(spec.microbatches) + " microbatches for " + std::to_string(2 * spec.ranks) +
                      " stages");
  }
  if (spec.chunks < 1 || (spec.chunks > 1 && spec.kind != ScheduleKind::kInterleaved && !spec.v_shape())) {
    return Status(ErrorCode::kInvalidArgument,
                  "only the interleaved and V-shaped (ZB-V, DualPipeV) schedules hold several stages (chunks) per rank");
  }
  if (spec.kind == ScheduleKind::kInterleaved && spec.microbatches % spec.ranks != 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "the interleaved schedule needs the microbatch count (" + std::to_string(spec.microbatches) +
                      ") to be a multiple of the rank count (" + std::to_string(spec.ranks) + ")");
  }
  Schedule s{spec, std::vector<ActionList>(static_cast<std::size_t>(spec.ranks))};
  const int p = spec.ranks, m = spec.microbatches;
  if (spec.forward_only) {
    // Stage by stage in pipeline order: every receive waits on a send of an earlier stage,
    // so the lists cannot deadlock, and the microbatches stream down the ranks.
    for (int r = 0; r < p; ++r) {
      for (int stage : spec.stages_of_rank(r)) {
        for (int mb = 0; mb < m; ++mb) forward(s.ranks[r], spec, stage, mb);
      }
    }
    CONVEYOR_RETURN_IF_ERROR(validate_schedule(s));
    return s;
  }
  for (int r = 0; r < p; ++r) {
    ActionList& list = s.ranks[static_cast<std::size_t>(r)];
    switch (spec.kind) {
      case ScheduleKind::kGPipe:
        for (int mb = 0; mb < m; ++mb) forward(list, spec, r, mb);
        for (int mb = 0; mb < m; ++mb) backward(list, spec, r, mb);
        break;
      case ScheduleKind::kOneFOneB: {
        const int warmup = std::min(p - r - 1, m);
        int next_f = 0, next_b = 0;
        for (; next_f < warmup; ++next_f) forward(list, spec, r, next_f);
        while (next_f < m) {  // steady state: one forward, one backward
          forward(list, spec, r, next_f++);
          backward(list, spec, r, next_b++);
        }
        while (next_b < m) backward(list, spec, r, next_b++);
        break;
      }
      case ScheduleKind::kInterleaved:
        interleaved(list, spec, r);
        break;
      case ScheduleKind::kZeroBubbleV:
        zero_bubble_v(list, spec, r);
        break;
      case ScheduleKind::kDualPipeV:
        dual_pipe_v(list, spec, r);
        break;
      case ScheduleKind::kZeroBubbleH1:
        break;  // all ranks at once, below
    }
  }
  if (spec.kind == ScheduleKind::kZeroBubbleH1) zero_bubble_h1(s.ranks, p, m);
  // The step's tail: each stage reduces its gradients across replicas, the stage whose
  // backward finished first first, then the rank applies its optimizer.
  for (int r = 0; r < p; ++r) {
    ActionList& list = s.ranks[r];
    std::vector<std::pair<std::size_t, int>> finished;  // (position of its last compute, stage)
    for (int stage : spec.stages_of_rank(r)) {
      std::size_t last = 0;
      for (std::size_t k = 0; k < list.size(); ++k) {
        if (list[k].stage == stage && list[k].is_compute()) last = k;
      }
      finished.emplace_back(last, stage);
    }
    std::sort(finished.begin(), finished.end());
    for (const auto& [at, stage] : finished) list.push_back({ActionKind::kAllReduce, -1, -1, stage});
    list.push_back({ActionKind::kOptimizerStep, -1, -1, r});
  }
  CONVEYOR_RETURN_IF_ERROR(validate_schedule(s));
  return s;
}

namespace {
// The key under which a send is posted and its receive looks for it.
using MessageKey = std::tuple<bool, int, int>;  // is_gradient, microbatch, sending stage

MessageKey send_key(const Action& a) { return {a.kind == ActionKind::kSendGradient, a.microbatch, a.stage}; }
MessageKey recv_key(const Action& a) {
  bool grad = a.kind == ActionKind::kRecvGradient;
  return {grad, a.microbatch, grad ? a.stage + 1 : a.stage - 1};
}
}  // namespace

Status validate_schedule(const Schedule& s) {
  auto bad = [](const std::string& msg) { return Status(ErrorCode::kInvalidArgument, "invalid schedule: " + msg); };
  const int p = static_cast<int>(s.ranks.size());
  const int m = s.spec.microbatches;
  const int stages = s.spec.stages();
  if (p != s.spec.ranks) return bad(std::to_string(p) + " lists for " + std::to_string(s.spec.ranks) + " ranks");
  const bool with_stage = s.spec.chunks > 1;
  auto txt = [&](const Action& a) { return action_text(a, with_stage); };
  // Coverage: F and B of every (stage, microbatch) exactly once on the stage's rank, F first.
  for (int r = 0; r < p; ++r) {
    const auto idx = [&](int stage, int mb) { return static_cast<std::size_t>(stage * m + mb); };
    const std::size_t n = static_cast<std::size_t>(stages * m);
    std::vector<int> f(n, 0), b(n, 0), input(n, 0), weight(n, 0), reduced(static_cast<std::size_t>(stages), 0);
    int steps = 0;
    bool reduced_any = false;
    for (const auto& a : s.ranks[r]) {
      if (a.stage < 0 || a.stage >= stages || s.spec.rank_of_stage(a.stage) != r) {
        return bad("rank " + std::to_string(r) + " runs " + txt(a) + " of stage " + std::to_string(a.stage) +
                   ", which is not one of its stages");
      }
      if (a.kind == ActionKind::kAllReduce) {
        ++reduced[a.stage];
        reduced_any = true;
        continue;
      }
      if (a.kind == ActionKind::kOptimizerStep) {
        ++steps;
        continue;
      }
      if (steps > 0 || reduced_any) {
        return bad("rank " + std::to_string(r) + " runs " + txt(a) + " after its allreduce or optimizer step");
      }
      if (a.microbatch < 0 || a.microbatch >= m) {
        return bad("rank " + std::to_string(r) + " has " + txt(a) + " outside microbatches 0.." +
                   std::to_string(m - 1));
      }
      const std::size_t i = idx(a.stage, a.microbatch);
      if (a.kind == ActionKind::kForward) ++f[i];
      if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) {
        if (f[i] == 0) return bad("rank " + std::to_string(r) + " runs " + txt(a) + " before its forward");
        ++(a.kind == ActionKind::kBackward ? b : input)[i];
      }
      if (a.kind == ActionKind::kBackwardWeight) {
        if (input[i] == 0) {
          return bad("rank " + std::to_string(r) + " runs " + txt(a) + " before its input-gradient pass");
        }
        ++weight[i];
      }
    }
    for (int stage : s.spec.stages_of_rank(r)) {
      for (int mb = 0; mb < m; ++mb) {
        const std::size_t i = idx(stage, mb);
        if (input[i] != weight[i] || input[i] > 1) {
          return bad("rank " + std::to_string(r) + " splits the backward of microbatch " + std::to_string(mb) +
                     " unevenly (" + std::to_string(input[i]) + " input and " + std::to_string(weight[i]) +
                     " weight passes)");
        }
        const int backwards = s.spec.forward_only ? 0 : 1;
        if (f[i] != 1 || b[i] + input[i] != backwards) {
          return bad("rank " + std::to_string(r) + " runs microbatch " + std::to_string(mb) +
                     (with_stage ? " of stage " + std::to_string(stage) : "") + " forward " + std::to_string(f[i]) +
                     " and backward " + std::to_string(b[i] + input[i]) + " times (expected " +
                     (backwards ? "once each)" : "once and never)"));
        }
      }
      if (reduced[stage] != (s.spec.forward_only ? 0 : 1)) {
        return bad("rank " + std::to_string(r) + " reduces the gradients of stage " + std::to_string(stage) + " " +
                   std::to_string(reduced[stage]) + " times (expected " + (s.spec.forward_only ? "never" : "once") +
                   ")");
      }
    }
    if (steps != (s.spec.forward_only ? 0 : 1)) {
      return bad("rank " + std::to_string(r) + " runs the optimizer step " + std::to_string(steps) +
                 (s.spec.forward_only ? " times in a forward-only schedule" : " times (expected once, last)"));
    }
  }
  // Matching and progress: replay the lists; a receive proceeds once its send was posted.
  std::set<MessageKey> posted;
  std::vector<std::size_t> pc(static_cast<std::size_t>(p), 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      auto& list = s.ranks[r];
      while (pc[r] < list.size()) {
        const Action& a = list[pc[r]];
        if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGradient) {
          const int to = a.kind == ActionKind::kSendGradient ? a.stage - 1 : a.stage + 1;
          if (to < 0 || to >= stages || a.peer != s.spec.rank_of_stage(to)) {
            return bad("rank " + std::to_string(r) + " sends " + txt(a) + " to rank " + std::to_string(a.peer) +
                       ", which does not hold stage " + std::to_string(to));
          }
          if (!posted.insert(send_key(a)).second) {
            return bad("rank " + std::to_string(r) + " posts " + txt(a) + " twice");
          }
        } else if (a.kind == ActionKind::kRecvActivation || a.kind == ActionKind::kRecvGradient) {
          auto it = posted.find(recv_key(a));
          if (it == posted.end()) break;
          posted.erase(it);
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
        if (pc[q] < s.ranks[q].size()) stuck += " rank " + std::to_string(q) + " at " + txt(s.ranks[q][pc[q]]) + ";";
      }
      return bad("the lists deadlock:" + stuck + " each waits for a send that is never reached");
    }
  }
  if (!posted.empty()) {
    auto [grad, mb, from] = *posted.begin();
    const int to = grad ? from - 1 : from + 1;
    return bad("rank " + std::to_string(s.spec.rank_of_stage(from)) + " sends " + (grad ? "gradient" : "activation") +
               " of microbatch " + std::to_string(mb) + " to rank " + std::to_string(s.spec.rank_of_stage(to)) +
               " which never receives it");
  }
  return Status::ok();
}

std::vector<int> partner_replicas(const std::vector<int>& replicas, int rank, int replica, int other_rank,
                                  const std::vector<int>& splits) {
  const bool alike = splits.empty() ? replicas[rank] == replicas[other_rank] : splits[rank] == splits[other_rank];
  if (alike) return {replica};
  std::vector<int> all(static_cast<std::size_t>(replicas[other_rank]));
  for (int j = 0; j < replicas[other_rank]; ++j) all[j] = j;
  return all;
}

}  // namespace conveyor::scheduler
