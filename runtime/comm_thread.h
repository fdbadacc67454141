// The process's communication thread: one Asio event loop that runs every transfer and
// collective of every pipeline in the process, in the order they are posted. Work posted
// here must not block on the device or on a peer: a collective is issued and completes
// through its callback (docs/thread_model.md).
#pragma once

#include <functional>
#include <memory>

namespace conveyor::runtime {

/// The process's communication thread: an Asio event loop that runs every transfer and
/// collective of every pipeline in the process, in the order they are posted.
class CommThread {
 public:
  /// The process's thread, started on first use. If a transfer hook never returned (the step
  /// that posted it timed out and gave the thread up), the next call starts a fresh thread
  /// and leaves the stuck one behind.
  static std::shared_ptr<CommThread> process();
  ~CommThread();
  CommThread(const CommThread&) = delete;

  /// Runs `work` on the thread, after everything posted before it.
  void post(std::function<void()> work);
  CommThread& operator=(const CommThread&) = delete;

  struct Impl;
  Impl& impl() { return *impl_; }

 private:
  CommThread();
  std::unique_ptr<Impl> impl_;
};

}  // namespace conveyor::runtime
