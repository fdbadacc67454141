// The torch.autocast state of a thread, captured and re-applied: a pipeline's forwards run
// under its caller's autocast on other threads, and a recomputed forward under the state its
// first run had.
#pragma once

#include <c10/core/ScalarType.h>

#include <array>

namespace conveyor::graph {

/// The torch.autocast state of one thread for the device types a model runs on.
struct AutocastState {
  std::array<bool, 2> enabled{};                            ///< CPU, CUDA
  std::array<at::ScalarType, 2> dtype{at::kBFloat16, at::kHalf};
  static AutocastState of_this_thread();
  bool any() const { return enabled[0] || enabled[1]; }
  void apply() const;
};

/// Runs a scope under `wanted` autocast (nothing when it enables none), then puts the
/// thread's back; the weight casts it cached go with it (eager clears them when the
/// outermost autocast region ends, so an optimizer step is never served stale copies).
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& wanted);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_;
  AutocastState previous_;
};

}  // namespace conveyor::graph
