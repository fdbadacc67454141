#include "scheduler/runner.h"

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/concurrent_channel.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/use_awaitable.hpp>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

namespace conveyor::scheduler {

namespace {
using Clock = std::chrono::steady_clock;
// (Asio 1.22 cannot instantiate a channel of void(error_code) alone: the int is unused.)
using Channel = asio::experimental::concurrent_channel<void(asio::error_code, int)>;
// A message: kind (0 activation, 1 gradient, 2 allreduce done), microbatch, sending stage.
using Key = std::tuple<int, int, int>;
}  // namespace

// Shared by the threads of one step.
struct Runner::State {
  State(Schedule s, RunnerHooks h)
      : schedule(std::move(s)), hooks(std::move(h)), compute(schedule.ranks.size()), exited(schedule.ranks.size()) {
    for (auto& c : compute) c = std::make_unique<asio::io_context>(1);
    for (auto& e : exited) e = false;
  }
  // Copies: a thread left behind by a hook that never returns still finds them alive.
  const Schedule schedule;
  const RunnerHooks hooks;
  asio::io_context comm{1};
  std::vector<std::unique_ptr<asio::io_context>> compute;
  std::vector<std::atomic<bool>> exited;  // per compute thread
  std::atomic<bool> comm_exited{false};
  std::mutex mu;
  std::map<Key, std::shared_ptr<Channel>> channels;  // created by whichever side comes first
  std::vector<Span> spans;
  std::vector<std::string> waiting;  // per rank: the action it is at
  Status error = Status::ok();
  std::atomic<bool> failed{false};
  int finished = 0;
  std::condition_variable done;
  Clock::time_point t0 = Clock::now();

  double now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }

  std::shared_ptr<Channel> channel(const Key& k) {
    std::lock_guard<std::mutex> lock(mu);
    auto& ch = channels[k];
    if (!ch) ch = std::make_shared<Channel>(comm.get_executor(), 1);
    return ch;
  }

  void fail(Status st) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (error.is_ok()) error = std::move(st);
      for (auto& [k, ch] : channels) ch->close();
    }
    failed = true;
    done.notify_all();
  }

  void record(const Span& s) {
    std::lock_guard<std::mutex> lock(mu);
    spans.push_back(s);
  }

  // Runs a transfer or reduction of rank r on the communication thread (posted, not awaited:
  // the rank goes on computing), timed on `stream`; completing it signals `ch`.
  static void post(const std::shared_ptr<State>& st, int r, const Action& a, Span::Stream stream,
                   std::shared_ptr<Channel> ch, std::string where) {
    asio::post(st->comm, [st, r, a, stream, ch = std::move(ch), where = std::move(where)] {
      if (st->failed) return;
      const auto& hook = stream == Span::Stream::kCollective ? st->hooks.allreduce : st->hooks.transfer;
      const double start = st->now();
      if (hook) {
        Status s = hook(r, a);
        if (!s) return st->fail(s.with_context(where));
      }
      st->record({r, stream, a, start, st->now()});
      ch->try_send(asio::error_code{}, 0);
    });
  }
};

Runner::Runner(Schedule schedule, RunnerHooks hooks) : schedule_(std::move(schedule)), hooks_(std::move(hooks)) {}
Runner::~Runner() = default;

Result<RunResult> Runner::run_step(std::chrono::milliseconds timeout) {
  CONVEYOR_RETURN_IF_ERROR(validate_schedule(schedule_));
  if (!hooks_.compute) return Status(ErrorCode::kInvalidArgument, "the runner needs a compute hook");
  const int ranks = static_cast<int>(schedule_.ranks.size());
  const bool with_stage = schedule_.spec.chunks > 1;
  auto st = std::make_shared<State>(schedule_, hooks_);
  st->waiting.assign(static_cast<std::size_t>(ranks), "start");

  // No captures: a coroutine lambda's captures live in the closure, not in the frame, and a
  // frame may outlive this function (a hook that never returns). State comes in by value.
  auto walk = [](std::shared_ptr<State> st, int r, bool with_stage) -> asio::awaitable<void> {
    const ActionList& list = st->schedule.ranks[r];
    std::vector<std::shared_ptr<Channel>> reductions;  // this rank's allreduces in flight
    for (const Action& a : list) {
      if (st->failed) co_return;
      {
        std::lock_guard<std::mutex> lock(st->mu);
        st->waiting[r] = action_text(a, with_stage);
      }
      const auto where = [&] { return "rank " + std::to_string(r) + " at " + action_text(a, with_stage); };
      switch (a.kind) {
        case ActionKind::kForward:
        case ActionKind::kBackward:
        case ActionKind::kBackwardInput:
        case ActionKind::kBackwardWeight:
        case ActionKind::kOptimizerStep: {
          if (a.kind == ActionKind::kOptimizerStep) {
            for (auto& ch : reductions) {  // the optimizer needs every reduced gradient
              auto [ec, unused] = co_await ch->async_receive(asio::experimental::as_tuple(asio::use_awaitable));
              if (ec) co_return;
            }
          }
          const double start = st->now();
          Status s = st->hooks.compute(r, a);
          if (!s) {
            st->fail(s.with_context(where()));
            co_return;
          }
          st->record({r, Span::Stream::kCompute, a, start, st->now()});
          break;
        }
        case ActionKind::kSendActivation:
        case ActionKind::kSendGradient: {
          const bool grad = a.kind == ActionKind::kSendGradient;
          State::post(st, r, a, Span::Stream::kSend, st->channel({grad ? 1 : 0, a.microbatch, a.stage}), where());
          break;
        }
        case ActionKind::kRecvActivation:
        case ActionKind::kRecvGradient: {
          const bool grad = a.kind == ActionKind::kRecvGradient;
          auto ch = st->channel({grad ? 1 : 0, a.microbatch, grad ? a.stage + 1 : a.stage - 1});
          auto [ec, unused] = co_await ch->async_receive(asio::experimental::as_tuple(asio::use_awaitable));
          if (ec) co_return;  // closed: another rank failed
          break;
        }
        case ActionKind::kAllReduce: {
          auto ch = std::make_shared<Channel>(st->comm.get_executor(), 1);
          reductions.push_back(ch);
          {
            std::lock_guard<std::mutex> lock(st->mu);
            st->channels[{2, r, a.stage}] = ch;  // closed with the others on failure
          }
          State::post(st, r, a, Span::Stream::kCollective, ch, where());
          break;
        }
      }
    }
    std::lock_guard<std::mutex> lock(st->mu);
    st->waiting[r] = "";
    ++st->finished;
    st->done.notify_all();
  };

  st->t0 = Clock::now();
  for (int r = 0; r < ranks; ++r) {
    asio::co_spawn(*st->compute[r], walk(st, r, with_stage), asio::detached);
  }
  // Threads: one per rank for compute (and its coroutine), one for all communication.
  auto comm_guard = asio::make_work_guard(st->comm);
  std::thread comm_thread([st] {
    st->comm.run();
    st->comm_exited = true;
  });
  std::vector<std::thread> compute_threads;
  for (int r = 0; r < ranks; ++r) {
    compute_threads.emplace_back([st, r] {
      st->compute[r]->run();
      st->exited[r] = true;
    });
  }

  bool in_time;
  {
    std::unique_lock<std::mutex> lock(st->mu);
    in_time = st->done.wait_for(lock, timeout, [&] { return st->finished == ranks || st->failed.load(); });
  }
  Status outcome = Status::ok();
  if (!in_time) {
    std::string stuck;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      for (int r = 0; r < ranks; ++r) {
        if (!st->waiting[r].empty()) stuck += " rank " + std::to_string(r) + " at " + st->waiting[r] + ";";
      }
    }
    outcome = Status(ErrorCode::kExecution, "the step did not finish within " + std::to_string(timeout.count()) +
                                                " ms:" + stuck + " (a hook that never returns, or a lost peer)");
    st->fail(outcome);
  }
  // Drain: closed channels wake every waiting coroutine; then the contexts run out of work.
  for (auto& c : st->compute) c->stop();
  comm_guard.reset();
  st->comm.stop();
  // A hook that never returns keeps its thread: give each a moment, then leave it behind
  // (it holds the shared state alive) rather than hang the caller.
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  for (int r = 0; r < ranks; ++r) {
    while (!st->exited[r] && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (st->exited[r]) compute_threads[r].join(); else compute_threads[r].detach();
  }
  while (!st->comm_exited && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool comm_joined = st->comm_exited;
  if (comm_joined) comm_thread.join(); else comm_thread.detach();
  // Coroutines still suspended hold the state (and it holds them): let them see their closed
  // channels and finish, here, on contexts no thread runs any more.
  for (int r = 0; r < ranks; ++r) {
    if (!st->exited[r]) continue;
    st->compute[r]->restart();
    st->compute[r]->poll();
  }
  if (comm_joined) {
    st->comm.restart();
    st->comm.poll();
  }
  if (!outcome) return outcome;
  if (!st->error.is_ok()) return st->error;
  RunResult result;
  result.spans = std::move(st->spans);
  for (const auto& s : result.spans) result.step_time_s = std::max(result.step_time_s, s.end_s);
  return result;
}

}  // namespace conveyor::scheduler
