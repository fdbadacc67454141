// Host memory per device, measured: what a stage replica's thread allocates through torch's
// CPU allocator, live and at its peak, the CPU's counterpart of CUDA's allocator statistics
// (torch.cuda.max_memory_allocated), and per virtual device where one process runs several.
//
// install_memory_meter() puts a counting allocator in front of torch's CPU allocator once
// per process. An allocation made while a MemoryCounter is current on the thread (a
// MeterScope) is charged to that counter until it is freed, on whatever thread that happens;
// every other allocation passes through untouched (and frees as before), so the meter costs
// nothing where nothing measures. A counted allocation keeps its data pointer as its
// context, as torch's own allocator does, so raw_allocate/raw_deallocate (oneDNN's scratch
// memory) work through it.
//
/// @note Thread-safe: counters are atomics, the table of counted allocations has locks.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace conveyor::runtime {

/// Bytes one device's threads hold: live now, and the most live since the last reset.
class MemoryCounter {
 public:
  std::int64_t live() const { return live_.load(std::memory_order_relaxed); }
  std::int64_t peak() const { return peak_.load(std::memory_order_relaxed); }
  /// The peak from now on starts at what is live.
  void reset_peak() { peak_.store(live(), std::memory_order_relaxed); }

  void add(std::int64_t bytes);
  void remove(std::int64_t bytes) { live_.fetch_sub(bytes, std::memory_order_relaxed); }

 private:
  std::atomic<std::int64_t> live_{0}, peak_{0};
};

/// Charges what this thread allocates to `counter` while the scope lives (null: to nothing).
class MeterScope {
 public:
  explicit MeterScope(std::shared_ptr<MemoryCounter> counter);
  ~MeterScope();
  MeterScope(const MeterScope&) = delete;
  MeterScope& operator=(const MeterScope&) = delete;

 private:
  std::shared_ptr<MemoryCounter> previous_;
};

/// Puts the counting allocator in front of torch's CPU allocator (once; later calls do
/// nothing). False when another allocator of higher priority is in place, or
/// CONVEYOR_MEMORY_METER=0 asks for torch's allocator alone, so nothing can be counted:
/// counters then stay at 0 and memory_meter_active() says so.
bool install_memory_meter();
/// Whether torch's CPU allocations go through the meter.
bool memory_meter_active();

}  // namespace conveyor::runtime
