#include "runtime/memory_meter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>

#include <array>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <unordered_map>
#include <utility>

#include "common/env.h"

namespace conveyor::runtime {

void MemoryCounter::add(std::int64_t bytes) {
  const std::int64_t now = live_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  std::int64_t seen = peak_.load(std::memory_order_relaxed);
  while (now > seen && !peak_.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

namespace {

thread_local std::shared_ptr<MemoryCounter> current_counter;

void metered_delete(void* data);

// Counts what is allocated under a MeterScope; passes everything else to `inner`.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* inner) : inner_(inner) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = inner_->allocate(n);
    const std::shared_ptr<MemoryCounter>& counter = current_counter;
    if (!counter || n == 0 || d.get() == nullptr) return d;
    void* data = d.get();
    const c10::Device device = d.device();
    counter->add(static_cast<std::int64_t>(n));
    {
      Shard& s = shard(data);
      std::lock_guard<std::mutex> lock(s.mu);
      s.counted.emplace(data, Counted{std::move(d), static_cast<std::int64_t>(n), counter});
    }
    return {data, data, &metered_delete, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &metered_delete; }

  // A child forked while another thread held a table's lock (a DataLoader's worker) gets
  // free locks: no thread of the parent runs in it.
  void after_fork_in_child() {
    for (Shard& s : shards_) new (&s.mu) std::mutex();
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }

  // Frees `data`: a counted allocation is uncharged and handed back to the inner
  // allocator; anything else came from the inner allocator's raw_allocate (uncounted).
  void release(void* data) {
    Counted c;
    {
      Shard& s = shard(data);
      std::lock_guard<std::mutex> lock(s.mu);
      auto it = s.counted.find(data);
      if (it == s.counted.end()) {
        inner_->raw_deallocate(data);
        return;
      }
      c = std::move(it->second);
      s.counted.erase(it);
    }
    c.counter->remove(c.bytes);
    // c.inner frees the memory as it leaves.
  }

 private:
  struct Counted {
    c10::DataPtr inner;
    std::int64_t bytes = 0;
    std::shared_ptr<MemoryCounter> counter;
  };
  // The table of counted allocations, in shards by address: replicas allocating at once
  // rarely meet on a lock.
  struct Shard {
    std::mutex mu;
    std::unordered_map<void*, Counted> counted;
  };
  Shard& shard(void* data) { return shards_[(reinterpret_cast<std::uintptr_t>(data) >> 6) % shards_.size()]; }
  c10::Allocator* inner_;
  std::array<Shard, 32> shards_;
};

CountingAllocator* the_meter = nullptr;

void metered_delete(void* data) { the_meter->release(data); }

}  // namespace

MeterScope::MeterScope(std::shared_ptr<MemoryCounter> counter) : previous_(std::move(current_counter)) {
  current_counter = std::move(counter);
}

MeterScope::~MeterScope() { current_counter = std::move(previous_); }

bool install_memory_meter() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!env::memory_meter_enabled()) return;  // torch's allocator alone; peaks unknown
    // Never freed: allocations it counted may be freed at any time until the process ends.
    the_meter = new CountingAllocator(c10::GetCPUAllocator());
    pthread_atfork(nullptr, nullptr, [] { the_meter->after_fork_in_child(); });
    c10::SetCPUAllocator(the_meter, /*priority=*/1);
  });
  return memory_meter_active();
}

bool memory_meter_active() { return the_meter != nullptr && c10::GetCPUAllocator() == the_meter; }

}  // namespace conveyor::runtime
