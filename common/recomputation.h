// How a pipeline stage keeps what its backward needs: every activation, all but those of
// cheap operators (recomputed just before the backward), or only its inputs (the whole
// forward again). Shared by the planner, which chooses it per stage, and the runtime.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace conveyor {

/// A stage's activation recomputation (docs/design.md, "Recomputation").
enum class Recomputation : std::uint8_t {
  kNone,       ///< keeps every saved activation
  kSelective,  ///< recomputes the cheap operators that read no parameter (elementwise, softmax, attention)
  kFull,       ///< keeps only the stage's inputs and runs its forward again
};

/// "none", "selective", "full": the name plans and the Python API use.
constexpr std::string_view recomputation_name(Recomputation r) {
  switch (r) {
    case Recomputation::kNone: return "none";
    case Recomputation::kSelective: return "selective";
    case Recomputation::kFull: return "full";
  }
  return "none";
}

/// The recomputation a name means, or nothing for an unknown name.
constexpr std::optional<Recomputation> recomputation_from_name(std::string_view name) {
  for (Recomputation r : {Recomputation::kNone, Recomputation::kSelective, Recomputation::kFull}) {
    if (recomputation_name(r) == name) return r;
  }
  return std::nullopt;
}

}  // namespace conveyor
