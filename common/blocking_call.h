// A call that may block for ever (a library's blocking join that cannot be cancelled, such as
// ncclCommInitRank waiting for a member that never comes), made so that its caller does not:
// the call runs on a thread of its own, and the caller waits for its result only until a
// deadline or until it is told to give up. The thread is left behind when the caller gives
// up; a result that comes after that goes to `late`, which releases what it holds.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

namespace conveyor {

/// How often a wait that may be stopped asks whether to stop (a caller's interruption, as
/// Python's Ctrl-C, checked by transport::wait_within and runtime::StepRun::wait).
inline constexpr std::chrono::milliseconds kStopAskedEvery{100};

/// How a waited-for blocking call ended.
enum class BlockingCallEnd { kReturned, kTimedOut, kAbandoned };

template <class T>
/// The end of a blocking call, and its result when it returned in time.
struct BlockingCallResult {
  BlockingCallEnd end = BlockingCallEnd::kReturned;
  std::optional<T> value;  ///< the call's result when it returned in time
};

/// Runs `call` on its own thread and waits at most `timeout` for it, asking `abandoned`
/// (when given) every `poll` whether to give up sooner.
template <class T>
BlockingCallResult<T> wait_for_blocking_call(std::function<T()> call, std::function<void(T)> late,
                                             std::chrono::milliseconds timeout,
                                             const std::function<bool()>& abandoned = {},
                                             std::chrono::milliseconds poll = std::chrono::milliseconds(20)) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    bool given_up = false;
    std::optional<T> value;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, call = std::move(call), late = std::move(late)] {
    T value = call();
    std::unique_lock<std::mutex> lock(shared->mu);
    if (shared->given_up) {
      lock.unlock();
      if (late) late(std::move(value));
      return;
    }
    shared->value.emplace(std::move(value));
    shared->cv.notify_all();
  }).detach();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(shared->mu);
  for (;;) {
    if (shared->value) return {BlockingCallEnd::kReturned, std::move(shared->value)};
    const auto now = std::chrono::steady_clock::now();
    if (abandoned && abandoned()) {
      shared->given_up = true;
      return {BlockingCallEnd::kAbandoned, std::nullopt};
    }
    if (now >= deadline) {
      shared->given_up = true;
      return {BlockingCallEnd::kTimedOut, std::nullopt};
    }
    shared->cv.wait_until(lock, std::min(deadline, now + poll));
  }
}

}  // namespace conveyor
