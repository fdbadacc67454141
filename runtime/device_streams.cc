#include "runtime/device_streams.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>

namespace conveyor::runtime {

bool device_has_streams(const c10::Device& device) { return device.is_cuda(); }

c10::Event* EventPool::record(const c10::Stream& stream) {
  if (next_ == events_.size()) {
    events_.push_back(std::make_unique<c10::Event>(type_, c10::EventFlag::BACKEND_DEFAULT));  // timing on
  }
  c10::Event* e = events_[next_++].get();
  e->record(stream);
  return e;
}

ReplicaStreams::ReplicaStreams(const c10::Device& device)
    : compute(pool_stream(device)), send(pool_stream(device)), recv(pool_stream(device)), events(device.type()) {}

PipelineStreams::PipelineStreams(const c10::Device& device, const std::vector<int>& rank_replicas, int stages)
    : device_(device), step_events_(device.type()) {
  for (int count : rank_replicas) {
    first_.push_back(static_cast<int>(replicas_.size()));
    for (int r = 0; r < count; ++r) replicas_.push_back(std::make_unique<ReplicaStreams>(device));
  }
  for (int s = 0; s < stages; ++s) {
    collective_.push_back(pool_stream(device));
    collective_events_.push_back(std::make_unique<EventPool>(device.type()));
  }
}

c10::Event* PipelineStreams::start_step() {
  step_events_.rewind();
  for (auto& pool : collective_events_) pool->rewind();
  c10::Event* start = step_events_.record(current_stream(device_));
  for (auto& rs : replicas_) {
    rs->events.rewind();
    for (const c10::Stream& stream : {rs->compute, rs->send, rs->recv}) start->block(stream);
  }
  for (const auto& stream : collective_) start->block(stream);
  return start;
}

c10::Stream current_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStream(device);
}

c10::Stream pool_stream(const c10::Device& device) {
  return c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
}

namespace {
std::atomic<std::int64_t> waits{0};
}  // namespace

std::int64_t host_waits() { return waits.load(); }

void synchronize_device(const c10::Device& device) {
  ++waits;
  c10::impl::VirtualGuardImpl(device.type()).synchronizeDevice(device.index());
}

void used_on(const at::Tensor& t, const c10::Stream& stream) {
  if (!t.defined() || !t.has_storage()) return;
  c10::impl::VirtualGuardImpl(stream.device_type()).recordDataPtrOnStream(t.storage().data_ptr(), stream);
}

void wait_all(const std::vector<c10::Event*>& events, const c10::Stream& stream) {
  for (c10::Event* e : events) {
    if (e != nullptr) e->block(stream);
  }
}

double seconds_between(const c10::Event& from, const c10::Event& to) { return from.elapsedTime(to) / 1000.0; }

}  // namespace conveyor::runtime
