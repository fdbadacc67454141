#include "common/blocking_call.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>

namespace conveyor {
namespace {

using namespace std::chrono_literals;

TEST(BlockingCall, AReturningCallGivesItsValue) {
  auto r = wait_for_blocking_call<int>([] { return 42; }, {}, 10s);
  EXPECT_EQ(r.end, BlockingCallEnd::kReturned);
  ASSERT_TRUE(r.value.has_value());
  EXPECT_EQ(*r.value, 42);
}

TEST(BlockingCall, ABlockedCallTimesOutAndItsLateValueGoesToLate) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<int> late_value;
  const auto start = std::chrono::steady_clock::now();
  auto r = wait_for_blocking_call<int>(
      [released] {
        released.wait();
        return 7;
      },
      [&late_value](int v) { late_value.set_value(v); }, 100ms);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(r.end, BlockingCallEnd::kTimedOut);
  EXPECT_FALSE(r.value.has_value());
  EXPECT_GE(waited, 100ms);
  EXPECT_LT(waited, 5s);
  release.set_value();  // the call returns after its caller gave up: its value is released
  auto got = late_value.get_future();
  ASSERT_EQ(got.wait_for(10s), std::future_status::ready);
  EXPECT_EQ(got.get(), 7);
}

TEST(BlockingCall, AbandoningEndsTheWaitBeforeTheTimeout) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> aborted{false};
  std::promise<void> late_seen;
  std::thread aborter([&] {
    std::this_thread::sleep_for(50ms);
    aborted = true;
  });
  const auto start = std::chrono::steady_clock::now();
  auto r = wait_for_blocking_call<int>(
      [released] {
        released.wait();
        return 1;
      },
      [&late_seen](int) { late_seen.set_value(); }, 60s, [&] { return aborted.load(); });
  aborter.join();
  EXPECT_EQ(r.end, BlockingCallEnd::kAbandoned);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  release.set_value();
  EXPECT_EQ(late_seen.get_future().wait_for(10s), std::future_status::ready);
}

}  // namespace
}  // namespace conveyor
