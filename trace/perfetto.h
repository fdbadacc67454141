// Native Perfetto traces (protobuf, written by hand: no Perfetto SDK needed) and a checker
// that decodes them back. Field numbers follow perfetto/trace/perfetto_trace.proto:
//   Trace{packet=1}
//   TracePacket{timestamp=8, trusted_packet_sequence_id=10, track_event=11, track_descriptor=60}
//   TrackDescriptor{uuid=1, name=2, parent_uuid=5}
//   TrackEvent{type=9 (1 begin, 2 end, 3 instant), track_uuid=11, name=23, flow_ids=47}
// Torch-free.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::trace {

/// A Perfetto trace being built: tracks, slices, instants, counters and flows.
class PerfettoTrace {
 public:
  /// Declares a track (a row in the UI); `parent` nests it under another track.
  std::uint64_t add_track(const std::string& name, std::uint64_t parent = 0);
  /// A slice from `start_ns` to `end_ns` on `track`; `flows` link it to slices carrying the
  /// same ids (a send and the compute that consumes what it sent).
  void slice(std::uint64_t track, std::uint64_t start_ns, std::uint64_t end_ns, const std::string& name,
             const std::vector<std::uint64_t>& flows = {});
  void instant(std::uint64_t track, std::uint64_t t_ns, const std::string& name);

  /// The serialized Trace message (packets sorted by time after the descriptors).
  std::string serialize() const;
  /// The same events in Chrome's trace event format (chrome://tracing, ui.perfetto.dev):
  /// a top-level track is a process, each track a thread of its top-level track's process;
  /// a slice a B/E pair, a flow an "s" event at the first slice carrying it and an "f" at
  /// each later one; times in microseconds from the earliest event.
  std::string chrome_json() const;
  /// Writes chrome_json() where `path` ends in ".json", serialize() otherwise.
  Status write(const std::string& path) const;

 private:
  struct Event {
    std::uint64_t t;
    int type;  // 1 begin, 2 end, 3 instant
    int priority;  // at equal times: ends of earlier slices, then begins, then ends of empty slices
    std::uint64_t track;
    std::string name;
    std::vector<std::uint64_t> flows;
    std::uint64_t order;
  };
  struct Track {
    std::uint64_t uuid, parent;
    std::string name;
  };
  /// The events in time order; at equal times a slice that ends comes before one that
  /// begins (back-to-back slices), an empty slice ends after it begins, otherwise emission
  /// order.
  std::vector<const Event*> in_time_order() const;
  std::vector<Track> tracks_;
  std::vector<Event> events_;
  std::uint64_t next_uuid_ = 1;
};

/// What a checked trace holds.
struct TraceSummary {
  std::size_t tracks = 0;
  std::size_t slices = 0;     ///< matched begin/end pairs
  std::size_t instants = 0;
  std::size_t flows = 0;      ///< flow ids, each joining at least two slices
  std::map<std::string, std::size_t> slices_by_track;  ///< track name -> slices
  std::map<std::string, std::size_t> slices_by_name;   ///< slice name's leading letters ("F", "sendA") -> count
};

/// Decodes a trace and checks it: every packet well formed, every event on a declared track,
/// begin/end balanced and nested per track with time going forward, every flow joining at
/// least two slices. Errors name the packet and what is wrong.
Result<TraceSummary> check_trace(std::string_view bytes);
Result<TraceSummary> check_trace_file(const std::string& path);

}  // namespace conveyor::trace
