// Who holds a UCX member's worker (transport/ucx_member.h), and the progress thread that
// holds it most of the time: its queue of work, its sleep and wake, and the caller's
// threads that take the worker for a moment themselves.
//
// Calls into the worker are serialized by this owner's worker lock. The progress thread
// holds it for each of its rounds. A caller's thread takes it only when it is free
// (try_lock) and briefly (with_worker_on_caller): to send a small message itself, to ask
// for a receive itself, and while it waits, to run rounds itself. While a caller's thread
// holds it, completions go through complete(): those of operations that thread issued run
// on it once it lets go of the worker; the others are queued for the progress thread. So no
// callback runs under the worker lock on a caller's thread, and no callback runs on a
// caller's thread that did not issue its operation.
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

/// Steady clock, in nanoseconds.
inline std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// What the progress thread does with the worker, given by the member that owns it. Each
/// says which thread calls it; every call but wait() holds the worker.
class WorkerRounds {
 public:
  virtual ~WorkerRounds() = default;
  /// Any thread holding the worker, after the work queued for it: the worker's own work
  /// (UCX progress, pings, matching receives). True if anything moved.
  virtual bool work() = 0;
  /// The progress thread, after each of its rounds.
  virtual void after_round() = 0;
  /// The progress thread, idle: how long it may sleep (ms), or nothing when it must not
  /// (the worker has events, or something came since the last round).
  virtual std::optional<int> may_sleep() = 0;
  /// The progress thread, not holding the worker: polls `fds` (the worker's and the
  /// wakeup's; revents set on return) with the member's own for at most `timeout_ms`.
  virtual void wait(std::vector<pollfd>& fds, int timeout_ms) = 0;
  /// The progress thread, last, holding the worker, once the completions met by the last
  /// waiter ran: closes the member.
  virtual void close() = 0;
};

/// The progress thread of one UCX member and the lock on its worker.
class UcxProgress {
 public:
  /// `rounds` outlives this.
  explicit UcxProgress(WorkerRounds& rounds) : rounds_(rounds) {}
  UcxProgress(const UcxProgress&) = delete;
  UcxProgress& operator=(const UcxProgress&) = delete;
  /// Stops the thread if stop() was not called.
  ~UcxProgress();

  /// Owner's thread, once: starts the progress thread, which sleeps on `worker_fd` (the
  /// worker's event descriptor) when idle.
  Status start(int worker_fd);
  /// Owner's thread (never the progress thread): the progress thread runs a last round,
  /// closes the member (WorkerRounds::close) and ends; returns once it has.
  void stop();
  /// Any thread: whether it is the progress thread.
  bool on_progress_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

  /// Any thread: `work` runs on whoever holds the worker next, in posting order.
  void post(std::function<void()> work);
  /// Any thread: no work is queued for the worker (what a caller's own call would overtake).
  bool nothing_queued();
  /// Any thread: wakes the progress thread if it sleeps.
  void wake_if_sleeping();
  /// A caller's thread holding the worker (with_worker_on_caller): the progress thread polls
  /// a while after its next round instead of sleeping (a reply often follows).
  void poke() { poked_ = true; }

  /// Runs `completion`, of an operation thread `owner` issued: at once, unless this is a
  /// caller's thread holding a worker; then once it lets go, on it if it is `owner`, else on
  /// the progress thread.
  static void complete(std::thread::id owner, std::function<void()> completion);

  /// A caller's thread: runs `body` holding the worker, if the worker is free and this
  /// thread holds no worker already; then the completions met, as complete() says. False
  /// when it did not run, or `body` said false. `then_wake`, read once `body` ran (it may
  /// set it): the progress thread is woken if it sleeps (what `body` issued needs it).
  /// Nothing may touch the member after this returns: the last completion may have dropped
  /// it. A template: it runs on every small send and receive.
  template <class Body>
  bool with_worker_on_caller(Body&& body, const bool& then_wake) {
    if (held_ != nullptr || on_progress_thread()) return false;
    std::unique_lock<std::mutex> worker(worker_mu_, std::try_to_lock);
    if (!worker.owns_lock()) return false;
    HeldCompletions held;
    held_ = &held;
    const bool did = body();
    held_ = nullptr;
    worker.unlock();
    let_go_on_caller(held, did && then_wake);
    return did;
  }
  /// A waiting caller's thread holding the worker: it just ran a round itself, and the
  /// progress thread leaves the worker to it a while.
  void helped() { helped_at_ = now_ns(); }

  /// Any thread holding the worker: one round, the queued work first (on the progress
  /// thread also the completions waiters met for it), then WorkerRounds::work. True if
  /// anything moved.
  bool round();
  /// The progress thread holding the worker, closing (WorkerRounds::close): runs the work
  /// queued since the last round.
  void run_queued();

 private:
  /// Completions met by a caller's thread while it held the worker (complete).
  struct HeldCompletions {
    std::vector<std::function<void()>> mine, others;
  };
  // After a caller's thread let go of the worker: wakes the progress thread if asked and it
  // sleeps, hands it the others' completions and runs this thread's.
  void let_go_on_caller(HeldCompletions& held, bool wake_a_sleeper);
  void wake();
  void loop();
  void close();

  static constexpr auto kSpin = std::chrono::microseconds(50);

  WorkerRounds& rounds_;
  std::thread thread_;
  int worker_fd_ = -1, wake_fd_ = -1;
  // Held while calling into the worker. Taken before mu_.
  std::mutex worker_mu_;
  std::mutex mu_;
  std::deque<std::function<void()>> commands_;     // under mu_: for whoever holds the worker next
  std::deque<std::function<void()>> completions_;  // under mu_: met by a waiter, for the progress thread
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};  // the progress thread is (about to be) in poll: post wakes it
  std::atomic<bool> poked_{false};     // a caller sent: the progress thread polls a while
  // When a waiting caller last ran a round itself (now_ns): the progress thread leaves the
  // worker to it meanwhile.
  std::atomic<std::int64_t> helped_at_{0};
  std::chrono::steady_clock::time_point last_busy_{};  // progress thread only
  static thread_local HeldCompletions* held_;          // set while a caller's thread holds a worker
};

}  // namespace conveyor::transport
