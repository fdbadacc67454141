// Pipeline schedules as per-rank action lists. The simulator and the runtime consume the
// same lists, so a plan's predicted trace and its measured trace line up action by action.
// Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::scheduler {

enum class ScheduleKind : std::uint8_t { kGPipe, kOneFOneB, kZeroBubbleH1 };

/// Parses "gpipe", "1f1b" or "zb-h1".
Result<ScheduleKind> schedule_kind_from_name(std::string_view name);
std::string_view schedule_kind_name(ScheduleKind kind);

enum class ActionKind : std::uint8_t {
  kForward,         ///< F: forward of one microbatch
  kBackward,        ///< B: backward of one microbatch (input and weight gradients)
  kBackwardInput,   ///< B of a split backward: input gradients only (zero-bubble schedules)
  kBackwardWeight,  ///< W of a split backward: weight gradients, deferred to fill idle time
  kSendActivation,  ///< post the forward output to the next rank (non-blocking)
  kRecvActivation,  ///< wait for the forward input from the previous rank
  kSendGradient,    ///< post the input gradient to the previous rank (non-blocking)
  kRecvGradient,    ///< wait for the output gradient from the next rank
};

/// One step of a rank's list.
struct Action {
  ActionKind kind;
  int microbatch = 0;
  int peer = -1;  ///< the other rank of a send or receive

  bool is_compute() const {
    return kind == ActionKind::kForward || kind == ActionKind::kBackward ||
           kind == ActionKind::kBackwardInput || kind == ActionKind::kBackwardWeight;
  }
  bool operator==(const Action&) const = default;
};

using ActionList = std::vector<Action>;

/// What to generate: `ranks` pipeline positions (one stage each), `microbatches` per step.
struct ScheduleSpec {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  int ranks = 1;
  int microbatches = 1;
};

/// Per-rank action lists of one training step.
struct Schedule {
  ScheduleSpec spec;
  std::vector<ActionList> ranks;

  /// "F3", "B0", "sendA3>1", "recvG2<2" ... one line per rank.
  std::string to_text() const;
};

/// Generates the schedule; errors when the spec is out of range.
Result<Schedule> make_schedule(const ScheduleSpec& spec);

/// Checks that every rank runs F and the backward of every microbatch once (F before B, a
/// split backward as B then W), every send
/// has its matching receive, and the lists cannot deadlock (each receive's send is reached).
Status validate_schedule(const Schedule& schedule);

std::string action_text(const Action& a);

}  // namespace conveyor::scheduler
