#include "runtime/comm_thread.h"

#include <asio/post.hpp>
#include <chrono>
#include <mutex>
#include <thread>

#include "runtime/comm_thread_impl.h"

namespace conveyor::runtime {

using Clock = std::chrono::steady_clock;

CommThread::CommThread() : impl_(std::make_unique<Impl>()) {
  Impl* impl = impl_.get();
  impl->thread = std::thread([impl] {
    impl->io.run();
    impl->exited = true;
  });
}

CommThread::~CommThread() {
  impl_->guard.reset();
  impl_->io.stop();
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  while (!impl_->exited && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (impl_->exited) {
    impl_->thread.join();
  } else {
    impl_->thread.detach();
    (void)impl_.release();  // the stuck hook's thread still runs on it: leave it be
  }
}

void CommThread::post(std::function<void()> work) { asio::post(impl_->io, std::move(work)); }

std::shared_ptr<CommThread> CommThread::process() {
  static std::mutex mu;
  static std::shared_ptr<CommThread> current;
  std::lock_guard<std::mutex> lock(mu);
  if (!current || current->impl_->abandoned) current.reset(new CommThread());
  return current;
}

}  // namespace conveyor::runtime
