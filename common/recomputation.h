// How a pipeline stage keeps what its backward needs: every activation, all but those of
// cheap operators (recomputed just before the backward), or only its inputs (the whole
// forward again). Shared by the planner, which chooses it per stage, and the runtime.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace conveyor {

/// A stage's activation recomputation (docs/design.md, "Recomputation").
enum class Recomputation : std::uint8_t {
  kNone,       ///< keeps every saved activation
  kSelective,  ///< recomputes the cheap operators that read no parameter (elementwise, softmax, attention)
  kFull,       ///< keeps only the stage's inputs and runs its forward again
};

/// Every recomputation, from keeping the most to keeping the least.
inline constexpr std::array kRecomputations{Recomputation::kNone, Recomputation::kSelective, Recomputation::kFull};

/// "none", "selective", "full": the name plans, the planner's options and the Python API
/// (`_C.recomputation_names()`) use; the one place these names are spelled.
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
  for (Recomputation r : kRecomputations) {
    if (recomputation_name(r) == name) return r;
  }
  return std::nullopt;
}

/// Every recomputation's name, quoted and joined for a message: "none", "selective" or "full".
inline std::string recomputation_names_text() {
  std::string out;
  for (std::size_t k = 0; k < kRecomputations.size(); ++k) {
    if (k > 0) out += k + 1 == kRecomputations.size() ? " or " : ", ";
    out += "\"" + std::string(recomputation_name(kRecomputations[k])) + "\"";
  }
  return out;
}

}  // namespace conveyor
