// Pipeline schedules as per-rank action lists. The simulator and the runtime consume the
// same lists, so a plan's predicted trace and its measured trace line up action by action.
// Torch-free.
//
// A rank is one pipeline position: a stage replica group runs the list of its rank, every
// replica the same list on its share of each microbatch. A rank holds one stage, or with the
// interleaved schedule `chunks` stages (rank r holds stages r, r + ranks, r + 2 ranks, ...),
// or with ZB-V two stages in a V (rank r holds stages r and 2 ranks - 1 - r: the first rank
// holds the first and the last stage, and the middle two stages share the last rank); DualPipeV
// places stages as ZB-V does.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::scheduler {

/// The schedules conveyor generates action lists for.
enum class ScheduleKind : std::uint8_t { kGPipe, kOneFOneB, kInterleaved, kZeroBubbleH1, kZeroBubbleV, kDualPipeV };

/// The largest schedule made (docs/formats.md, "Size limits"): a plan or a command asking for
/// more is refused, naming the value and the limit, before anything is allocated.
inline constexpr int kMostRanks = 4096;
inline constexpr int kMostMicrobatches = 65536;
/// Compute actions (stages x microbatches): 2^22, about 40 million actions in all at most.
inline constexpr long long kMostStageMicrobatches = 1LL << 22;

/// Every schedule, each once, in the order their names are listed to users.
inline constexpr std::array kScheduleKinds{ScheduleKind::kGPipe,        ScheduleKind::kOneFOneB,
                                           ScheduleKind::kInterleaved,  ScheduleKind::kZeroBubbleH1,
                                           ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV};

/// A schedule's name ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"): the one
/// place these names are spelled; the command line, the launcher and Python (`_C`) read them here.
std::string_view schedule_kind_name(ScheduleKind kind);
/// The schedule a name means; an error naming every schedule for an unknown one.
Result<ScheduleKind> schedule_kind_from_name(std::string_view name);
/// Every schedule's name in kScheduleKinds' order, joined for a message: "gpipe, 1f1b, ..., zb-v
/// or dualpipev" (`last` joins the last two).
std::string schedule_names_text(std::string_view last = " or ");
/// Whether a schedule places two stages per rank in a V (ZB-V, DualPipeV).
inline bool is_v_shape(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleV || kind == ScheduleKind::kDualPipeV;
}
/// Whether a schedule holds several stages per rank (interleaved, and the V shapes).
inline bool is_chunked(ScheduleKind kind) { return kind == ScheduleKind::kInterleaved || is_v_shape(kind); }
/// The stages each rank holds when nothing else fixes them (a stage count given, the planner
/// aside): 2 for interleaved (the planner may choose 3 or 4) and the V shapes (always 2), else 1.
inline int default_chunks(ScheduleKind kind) { return is_chunked(kind) ? 2 : 1; }
/// Whether a schedule splits (some) backwards into an input and a weight half.
inline bool splits_backward(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleH1 || is_v_shape(kind);
}

/// What one action of a rank's list does.
enum class ActionKind : std::uint8_t {
  kForward,         ///< F: forward of one microbatch
  kBackward,        ///< B: backward of one microbatch (input and weight gradients)
  kBackwardInput,   ///< B of a split backward: input gradients only (zero-bubble schedules)
  kBackwardWeight,  ///< W of a split backward: weight gradients, deferred to fill idle time
  kSendActivation,  ///< post the forward output to the next stage's rank (non-blocking)
  kRecvActivation,  ///< wait for the forward input from the previous stage's rank
  kSendGradient,    ///< post the input gradient to the previous stage's rank (non-blocking)
  kRecvGradient,    ///< wait for the output gradient from the next stage's rank
  kAllReduce,       ///< reduce the stage's gradients across its replicas (collective stream)
  kOptimizerStep,   ///< apply the optimizer to the rank's parameters once reductions finished
};

/// One step of a rank's list.
struct Action {
  ActionKind kind;
  int microbatch = 0;  ///< -1 for the step's tail (allreduce, optimizer step)
  int peer = -1;       ///< the other rank of a send or receive
  int stage = 0;       ///< the stage this action belongs to (== rank unless interleaved)

  bool is_compute() const {
    return kind == ActionKind::kForward || kind == ActionKind::kBackward ||
           kind == ActionKind::kBackwardInput || kind == ActionKind::kBackwardWeight;
  }
  bool operator==(const Action&) const = default;
};

using ActionList = std::vector<Action>;

/// What to generate: `ranks` pipeline positions, `microbatches` per step, and for the
/// interleaved schedule `chunks` stages per rank (stages = ranks * chunks; ZB-V, DualPipeV: 2).
struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  int ranks = 1;
  int microbatches = 1;
  int chunks = 1;
  /// Forwards only (evaluation): each rank runs its stages in order, every microbatch's
  /// forward of one before the next's, and no backward, reduction or optimizer step.
  bool forward_only = false;

  int stages() const { return ranks * chunks; }
  /// Whether stages run down the ranks and back up (ZB-V, DualPipeV) rather than round-robin.
  bool v_shape() const { return is_v_shape(kind); }
  int rank_of_stage(int stage) const {
    if (v_shape()) return stage < ranks ? stage : 2 * ranks - 1 - stage;
    return stage % ranks;
  }
  /// The stages rank `rank` holds, ascending.
  std::vector<int> stages_of_rank(int rank) const {
    std::vector<int> out;
    for (int s = 0; s < stages(); ++s) {
      if (rank_of_stage(s) == rank) out.push_back(s);
    }
    return out;
  }
};

/// Per-rank action lists of one training step.
struct Schedule {
  ScheduleSpec spec;
  std::vector<ActionList> ranks;

  /// "F3", "B0", "sendA3>1", "recvG2<2", "allreduce0", "step" ... one line per rank;
  /// interleaved lists name the stage: "F3@s5".
  std::string to_text() const;
};

/// Generates the schedule; errors when the spec is out of range.
Result<Schedule> make_schedule(const ScheduleSpec& spec);

/// Checks that every stage runs F and the backward of every microbatch once on its rank (F
/// before B, a split backward as B then W), then one allreduce per stage and one optimizer
/// step per rank (forward_only: F once and nothing else); every send has its matching
/// receive, and the lists cannot deadlock (each receive's send is reached).
Status validate_schedule(const Schedule& schedule);

/// An action in the schedule's notation: `F3`, `recvA0<1`, `sendG2@s1>0` (docs/design.md).
std::string action_text(const Action& a, bool with_stage = false);
/// An action in words, for errors a user reads: "receiving microbatch 0's activations from
/// rank 1 (recvA0<1)", "the forward of microbatch 3 of stage 2 (F3@s2)".
std::string action_words(const Action& a, bool with_stage = false);

/// The replicas of `other_rank` that replica `replica` of `rank` exchanges microbatch data
/// with: the one of the same index when both ranks split a microbatch alike, every one
/// otherwise (the data is then redistributed). `replicas`: the count per rank; `splits`:
/// per rank, an id equal for ranks that split alike (empty: alike when the counts are).
std::vector<int> partner_replicas(const std::vector<int>& replicas, int rank, int replica, int other_rank,
                                  const std::vector<int>& splits = {});

}  // namespace conveyor::scheduler
