// CommThread's state, for the runtime's own translation units that post Asio work to it
// (step_run.cc): the event loop and whether a stuck hook made the process give it up.
#pragma once

#include <asio/executor_work_guard.hpp>
#include <asio/io_context.hpp>
#include <atomic>
#include <thread>

#include "runtime/comm_thread.h"

namespace conveyor::runtime {

/// The event loop and its thread; `abandoned` once a stuck hook made the process give it up.
struct CommThread::Impl {
  asio::io_context io{1};
  asio::executor_work_guard<asio::io_context::executor_type> guard = asio::make_work_guard(io);
  std::thread thread;
  std::atomic<bool> exited{false};
  std::atomic<bool> abandoned{false};  // a transfer hook never returned: serve no more steps
};

}  // namespace conveyor::runtime
