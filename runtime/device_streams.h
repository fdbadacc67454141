// Streams and events of the replicas on a device that has them (CUDA), through c10's
// device-generic interface (c10::Stream, c10::Event, the device's guard implementation): no
// CUDA header or library is needed to build this, and it serves any backend with streams.
//
// Each replica owns three streams taken from the device's pool: compute (its F, B, W), recv
// (joining the shares of other replicas' activations when stage replica counts differ) and
// send (accumulating the gradients it hands back into a joined gradient), and a pool of
// timing events that is rewound, not reallocated, every step. Every stage with replicas also
// owns a collective stream for its gradient reductions. Work on one stream that reads what
// another stream made waits on an event recorded after the producer (never on the host),
// and tells the caching allocator that the memory is in use on the reading stream.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>
#include <vector>

namespace conveyor::runtime {

/// True when `device` has streams and events (CUDA); false for the CPU.
bool device_has_streams(const c10::Device& device);

/// Timing events recorded on demand and reused from step to step: an event handed out
/// stays valid until rewind().
class EventPool {
 public:
  explicit EventPool(c10::DeviceType type) : type_(type) {}
  /// The next event of the pool, recorded on `stream` now.
  c10::Event* record(const c10::Stream& stream);
  /// Every event may be recorded again (the previous step's are all complete).
  void rewind() { next_ = 0; }
  std::size_t size() const { return events_.size(); }

 private:
  c10::DeviceType type_;
  std::vector<std::unique_ptr<c10::Event>> events_;
  std::size_t next_ = 0;
};

/// One replica's compute, send and recv streams and its event pool.
struct ReplicaStreams {
  /// Streams from `device`'s pool; `device` must have streams.
  explicit ReplicaStreams(const c10::Device& device);
  c10::Stream compute, send, recv;
  EventPool events;
};

/// Every stream of one pipeline on a device with streams: each replica's (rank-major,
/// every replica of every rank, also those other processes run: arrivals from them land on
/// their compute stream here), a collective stream and event pool per stage, and the step's
/// own events.
class PipelineStreams {
 public:
  PipelineStreams(const c10::Device& device, const std::vector<int>& rank_replicas, int stages);
  const c10::Device& device() const { return device_; }
  ReplicaStreams& of_rank(int rank, int replica) { return *replicas_[first_[rank] + replica]; }
  const c10::Stream& collective(int stage) const { return collective_[stage]; }
  /// The collective stream's events (reductions' timing, accumulation marks); callers
  /// serialize their use of one stage's pool.
  EventPool& collective_events(int stage) { return *collective_events_[stage]; }
  /// Rewinds every pool and makes every stream start after the work queued so far on the
  /// calling thread's current stream (the step's inputs, the last optimizer step); returns
  /// the event the step's device times count from.
  c10::Event* start_step();

 private:
  c10::Device device_;
  std::vector<int> first_;  // per rank: its replica 0's index in replicas_
  std::vector<std::unique_ptr<ReplicaStreams>> replicas_;
  std::vector<c10::Stream> collective_;
  std::vector<std::unique_ptr<EventPool>> collective_events_;
  EventPool step_events_;
};

/// How many times this process made the host wait for a device (synchronize_device), for
/// the tests that count a step's host waits.
std::int64_t host_waits();

/// The stream current on the calling thread for `device`.
c10::Stream current_stream(const c10::Device& device);
/// A stream from `device`'s pool (for a collective).
c10::Stream pool_stream(const c10::Device& device);
/// Blocks the host until all work queued on `device` has finished.
void synchronize_device(const c10::Device& device);
/// Tells the caching allocator that `t`'s memory is used on `stream` (so it is not reused
/// before the work queued there has run). Undefined tensors are ignored.
void used_on(const at::Tensor& t, const c10::Stream& stream);
/// `stream` waits for every event in `events` (null ones are skipped).
void wait_all(const std::vector<c10::Event*>& events, const c10::Stream& stream);
/// Seconds from `from` to `to` (both recorded and complete).
double seconds_between(const c10::Event& from, const c10::Event& to);

}  // namespace conveyor::runtime
