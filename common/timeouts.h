// The range every timeout and grace period conveyor reads is held to (seconds): positive and
// finite, at most a week (longer ones overflow clocks' durations, shorter ones cannot be
// waited). conveyor/arguments.py holds Python's copy of the same range.
#pragma once

namespace conveyor {

inline constexpr double kLeastSeconds = 0.001, kMostSeconds = 604800;

/// Within [kLeastSeconds, kMostSeconds]; NaN is not.
inline bool valid_seconds(double s) { return s >= kLeastSeconds && s <= kMostSeconds; }

}  // namespace conveyor
