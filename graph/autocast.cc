#include "graph/autocast.h"

#include <ATen/autocast_mode.h>

namespace conveyor::graph {

namespace {
constexpr std::array<c10::DeviceType, 2> kAutocastTypes{c10::DeviceType::CPU, c10::DeviceType::CUDA};
}  // namespace

AutocastState AutocastState::of_this_thread() {
  AutocastState s;
  for (std::size_t i = 0; i < kAutocastTypes.size(); ++i) {
    s.enabled[i] = at::autocast::is_autocast_enabled(kAutocastTypes[i]);
    s.dtype[i] = at::autocast::get_autocast_dtype(kAutocastTypes[i]);
  }
  return s;
}

void AutocastState::apply() const {
  for (std::size_t i = 0; i < kAutocastTypes.size(); ++i) {
    at::autocast::set_autocast_enabled(kAutocastTypes[i], enabled[i]);
    at::autocast::set_autocast_dtype(kAutocastTypes[i], dtype[i]);
  }
}

AutocastScope::AutocastScope(const AutocastState& wanted) : active_(wanted.any()) {
  if (!active_) return;
  previous_ = AutocastState::of_this_thread();
  wanted.apply();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  at::autocast::clear_cache();
  previous_.apply();
}

}  // namespace conveyor::graph
