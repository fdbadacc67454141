#include "transport/ucx_progress.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

namespace conveyor::transport {

namespace {

// How long after a waiting caller's last round the progress thread leaves the worker to it.
constexpr std::int64_t kLeftToHelperNs = 20'000;

}  // namespace

thread_local UcxProgress::HeldCompletions* UcxProgress::held_ = nullptr;

UcxProgress::~UcxProgress() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

Status UcxProgress::start(int worker_fd) {
  worker_fd_ = worker_fd;
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return Status(ErrorCode::kExecution, "eventfd failed for the UCX progress thread");
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "ucx progress");  // as top -H and debuggers list it
    loop();
  });
  return Status::ok();
}

void UcxProgress::stop() {
  if (!thread_.joinable()) return;
  stop_ = true;
  wake();
  thread_.join();
}

void UcxProgress::post(std::function<void()> work) {
  // Wakes the progress thread only when it sleeps (a write to the eventfd is a system call;
  // the spinning thread takes the work on its next round).
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands_.push_back(std::move(work));
  }
  if (sleeping_.load()) wake();
}

bool UcxProgress::nothing_queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return commands_.empty();
}

void UcxProgress::wake_if_sleeping() {
  if (sleeping_.load()) wake();
}

void UcxProgress::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = write(wake_fd_, &one, sizeof one);
}

void UcxProgress::complete(std::thread::id owner, std::function<void()> completion) {
  if (held_ == nullptr) return completion();
  (owner == std::this_thread::get_id() ? held_->mine : held_->others).push_back(std::move(completion));
}

void UcxProgress::let_go_on_caller(HeldCompletions& held, bool wake_a_sleeper) {
  if (wake_a_sleeper && sleeping_.load()) wake();
  if (!held.others.empty()) {  // for the progress thread alone (a waiter's rounds run commands_)
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& c : held.others) completions_.push_back(std::move(c));
    }
    if (sleeping_.load()) wake();
  }
  for (auto& c : held.mine) c();  // the last may drop the member: nothing touches it after
}

bool UcxProgress::round() {
  std::deque<std::function<void()>> work, completions;
  {
    std::lock_guard<std::mutex> lock(mu_);
    work.swap(commands_);
    if (on_progress_thread()) completions.swap(completions_);
  }
  for (auto& c : completions) c();
  for (auto& w : work) w();
  bool busy = !work.empty() || !completions.empty();
  busy |= rounds_.work();
  return busy;
}

void UcxProgress::run_queued() {
  std::deque<std::function<void()>> work;
  {
    std::lock_guard<std::mutex> lock(mu_);
    work.swap(commands_);
  }
  for (auto& w : work) w();
}

void UcxProgress::loop() {
  while (true) {
    if (!stop_ && now_ns() - helped_at_.load() < kLeftToHelperNs) {
      std::this_thread::yield();  // a waiting caller runs rounds itself (UcxEndpoint::progress_here)
      continue;
    }
    std::unique_lock<std::mutex> worker(worker_mu_);
    const bool busy = round() || poked_.exchange(false);
    rounds_.after_round();
    if (stop_) break;
    const auto now = std::chrono::steady_clock::now();
    if (busy) {
      last_busy_ = now;
      continue;
    }
    // Just after traffic a reply often follows within microseconds (shared memory raises
    // its wakeup late): keep polling a short while before sleeping.
    if (now - last_busy_ < kSpin) {
      worker.unlock();
      std::this_thread::yield();  // to a thread woken on this core (a waiter polls too: transport.cc)
      continue;
    }
    // Idle, or a transfer in flight that moved nothing for kSpin (a send waiting for its
    // receiver to ask for it): sleep until the worker has events, someone queues work or a
    // watched peer ends, for as long as the member says (WorkerRounds::may_sleep). (Polling
    // instead, yielding, took a core's share from the compute threads of a pipeline whose
    // sends waited long for their receives.)
    const std::optional<int> timeout_ms = rounds_.may_sleep();
    if (!timeout_ms) continue;
    sleeping_ = true;  // before looking at the queue: work posted after this wakes the thread
    bool queued = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      queued = !commands_.empty() || !completions_.empty();
    }
    worker.unlock();
    if (!queued) {
      std::vector<pollfd> fds{{worker_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      rounds_.wait(fds, *timeout_ms);
      if (fds[1].revents & POLLIN) {
        std::uint64_t drained;
        [[maybe_unused]] auto n = read(wake_fd_, &drained, sizeof drained);
      }
    }
    sleeping_ = false;
  }
  close();
}

void UcxProgress::close() {
  std::lock_guard<std::mutex> worker(worker_mu_);
  std::deque<std::function<void()>> completions;  // what a waiter met last still runs
  {
    std::lock_guard<std::mutex> lock(mu_);
    completions.swap(completions_);
  }
  for (auto& c : completions) c();
  rounds_.close();
}

}  // namespace conveyor::transport
