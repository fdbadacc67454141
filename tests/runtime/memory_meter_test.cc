#include "runtime/memory_meter.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <thread>

namespace conveyor::runtime {
namespace {

TEST(MemoryMeter, ChargesWhatAScopeAllocatesUntilItIsFreedAnywhere) {
  ASSERT_TRUE(install_memory_meter());
  ASSERT_TRUE(install_memory_meter());  // once: a second call changes nothing
  auto counter = std::make_shared<MemoryCounter>();
  at::Tensor outside = at::empty({1000}, at::kFloat);  // not in a scope: not charged
  at::Tensor a, b;
  {
    MeterScope scope(counter);
    a = at::empty({1000}, at::kFloat);
    b = at::empty({500}, at::kDouble);
    {
      MeterScope none(nullptr);  // nested: charged to nothing
      at::Tensor c = at::empty({1 << 20}, at::kByte);
    }
  }
  EXPECT_EQ(counter->live(), 4000 + 4000);
  EXPECT_EQ(counter->peak(), 8000);
  // Freed on another thread: still uncharged from the counter that paid for it.
  std::thread([&] { a.reset(); }).join();
  EXPECT_EQ(counter->live(), 4000);
  EXPECT_EQ(counter->peak(), 8000);
  counter->reset_peak();
  EXPECT_EQ(counter->peak(), 4000);
  b.reset();
  outside.reset();
  EXPECT_EQ(counter->live(), 0);
}

TEST(MemoryMeter, RawAllocationsWorkThroughItCountedOrNot) {
  ASSERT_TRUE(install_memory_meter());
  c10::Allocator* cpu = c10::GetCPUAllocator();
  void* plain = cpu->raw_allocate(256);  // oneDNN's scratch memory takes this path
  auto counter = std::make_shared<MemoryCounter>();
  void* counted = nullptr;
  {
    MeterScope scope(counter);
    counted = cpu->raw_allocate(4096);
  }
  EXPECT_EQ(counter->live(), 4096);
  static_cast<char*>(counted)[4095] = 1;
  static_cast<char*>(plain)[255] = 1;
  cpu->raw_deallocate(counted);
  cpu->raw_deallocate(plain);
  EXPECT_EQ(counter->live(), 0);
  EXPECT_EQ(counter->peak(), 4096);
}

TEST(MemoryMeter, AForwardAndBackwardAreCountedOnTheirThread) {
  ASSERT_TRUE(install_memory_meter());
  at::Tensor w = at::randn({64, 64}).requires_grad_(true);
  auto counter = std::make_shared<MemoryCounter>();
  {
    MeterScope scope(counter);
    at::Tensor x = at::randn({32, 64});
    at::Tensor y = at::tanh(at::mm(x, w)).sum();
    EXPECT_GE(counter->live(), 2 * 32 * 64 * 4);  // x and the saved tanh output at least
    y.backward();
  }
  // What is left: the weight's gradient, allocated by the backward.
  EXPECT_EQ(counter->live(), 64 * 64 * 4);
  EXPECT_GE(counter->peak(), counter->live() + 2 * 32 * 64 * 4);
}

}  // namespace
}  // namespace conveyor::runtime
