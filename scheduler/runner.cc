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
// A message: kind (0 activation, 1 gradient, 2 allreduce done), microbatch (or stage for
// an allreduce), sending stage, sending replica, receiving replica.
using Key = std::tuple<int, int, int, int, int>;
}  // namespace

// Shared by the threads of one step.
struct Runner::State {
  State(Schedule s, RunnerHooks h, std::vector<int> r)
      : schedule(std::move(s)), hooks(std::move(h)), replicas(std::move(r)) {
    for (int rank = 0; rank < static_cast<int>(replicas.size()); ++rank) {
      first_worker.push_back(static_cast<int>(workers.size()));
      for (int i = 0; i < replicas[rank]; ++i) workers.emplace_back(rank, i);
    }
    compute.resize(workers.size());
    for (auto& c : compute) c = std::make_unique<asio::io_context>(1);
    exited = std::vector<std::atomic<bool>>(workers.size());
    for (auto& e : exited) e = false;
  }
  // Copies: a thread left behind by a hook that never returns still finds them alive.
  const Schedule schedule;
  const RunnerHooks hooks;
  const std::vector<int> replicas;               // per rank
  std::vector<std::pair<int, int>> workers;      // (rank, replica), rank-major
  std::vector<int> first_worker;                 // per rank
  asio::io_context comm{1};
  std::vector<std::unique_ptr<asio::io_context>> compute;  // per worker
  std::vector<std::atomic<bool>> exited;                   // per compute thread
  std::map<int, int> allreduce_arrivals;                   // stage -> replicas arrived (comm thread only)
  std::atomic<bool> comm_exited{false};
  std::mutex mu;
  std::map<Key, std::shared_ptr<Channel>> channels;  // created by whichever side comes first
  std::vector<Span> spans;
  std::vector<std::string> waiting;  // per worker: the action it is at
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

  // Runs a send of replica i of rank r on the communication thread (posted, not awaited: the
  // replica goes on computing); completing it signals every receiving replica.
  static void post_send(const std::shared_ptr<State>& st, int r, int i, const Action& a, std::string where) {
    const int kind = a.kind == ActionKind::kSendGradient ? 1 : 0;
    std::vector<std::shared_ptr<Channel>> out;
    for (int j : partner_replicas(st->replicas, r, i, a.peer)) out.push_back(st->channel({kind, a.microbatch, a.stage, i, j}));
    asio::post(st->comm, [st, r, i, a, out = std::move(out), where = std::move(where)] {
      if (st->failed) return;
      const double start = st->now();
      if (st->hooks.transfer) {
        Status s = st->hooks.transfer(r, i, a);
        if (!s) return st->fail(s.with_context(where));
      }
      st->record({r, Span::Stream::kSend, a, start, st->now(), i});
      for (auto& ch : out) ch->try_send(asio::error_code{}, 0);
    });
  }

  // A replica of rank r arrives at its stage's allreduce; the last to arrive runs it (on the
  // communication thread) and releases all of them through their channels.
  static void post_allreduce(const std::shared_ptr<State>& st, int r, const Action& a, std::string where) {
    asio::post(st->comm, [st, r, a, where = std::move(where)] {
      if (st->failed) return;
      if (++st->allreduce_arrivals[a.stage] < st->replicas[r]) return;
      const double start = st->now();
      if (st->hooks.allreduce) {
        Status s = st->hooks.allreduce(r, 0, a);
        if (!s) return st->fail(s.with_context(where));
      }
      const double end = st->now();
      for (int j = 0; j < st->replicas[r]; ++j) {
        st->record({r, Span::Stream::kCollective, a, start, end, j});
        st->channel({2, a.stage, a.stage, 0, j})->try_send(asio::error_code{}, 0);
      }
    });
  }
};

Runner::Runner(Schedule schedule, RunnerHooks hooks, std::vector<int> replicas)
    : schedule_(std::move(schedule)), hooks_(std::move(hooks)), replicas_(std::move(replicas)) {}
Runner::~Runner() = default;

Result<RunResult> Runner::run_step(std::chrono::milliseconds timeout) {
  CONVEYOR_RETURN_IF_ERROR(validate_schedule(schedule_));
  if (!hooks_.compute) return Status(ErrorCode::kInvalidArgument, "the runner needs a compute hook");
  const int ranks = static_cast<int>(schedule_.ranks.size());
  std::vector<int> replicas = replicas_.empty() ? std::vector<int>(static_cast<std::size_t>(ranks), 1) : replicas_;
  if (static_cast<int>(replicas.size()) != ranks) {
    return Status(ErrorCode::kInvalidArgument, "replica counts for " + std::to_string(replicas.size()) +
                                                   " ranks, but the schedule has " + std::to_string(ranks));
  }
  for (int r = 0; r < ranks; ++r) {
    if (replicas[r] < 1) {
      return Status(ErrorCode::kInvalidArgument, "rank " + std::to_string(r) + " has " +
                                                     std::to_string(replicas[r]) + " replicas (at least 1)");
    }
  }
  const bool with_stage = schedule_.spec.chunks > 1;
  auto st = std::make_shared<State>(schedule_, hooks_, std::move(replicas));
  const int workers = static_cast<int>(st->workers.size());
  st->waiting.assign(static_cast<std::size_t>(workers), "start");

  // No captures: a coroutine lambda's captures live in the closure, not in the frame, and a
  // frame may outlive this function (a hook that never returns). State comes in by value.
  auto walk = [](std::shared_ptr<State> st, int w, bool with_stage) -> asio::awaitable<void> {
    const auto [r, i] = st->workers[w];
    const ActionList& list = st->schedule.ranks[r];
    std::vector<std::shared_ptr<Channel>> reductions;  // this replica's allreduces in flight
    const std::string who = st->replicas[r] > 1 ? "rank " + std::to_string(r) + " replica " + std::to_string(i)
                                                : "rank " + std::to_string(r);
    for (const Action& a : list) {
      if (st->failed) co_return;
      {
        std::lock_guard<std::mutex> lock(st->mu);
        st->waiting[w] = action_text(a, with_stage);
      }
      const auto where = [&] { return who + " at " + action_text(a, with_stage); };
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
          Status s = st->hooks.compute(r, i, a);
          if (!s) {
            st->fail(s.with_context(where()));
            co_return;
          }
          st->record({r, Span::Stream::kCompute, a, start, st->now(), i});
          break;
        }
        case ActionKind::kSendActivation:
        case ActionKind::kSendGradient:
          State::post_send(st, r, i, a, where());
          break;
        case ActionKind::kRecvActivation:
        case ActionKind::kRecvGradient: {
          const bool grad = a.kind == ActionKind::kRecvGradient;
          const int from_stage = grad ? a.stage + 1 : a.stage - 1;
          for (int j : partner_replicas(st->replicas, r, i, a.peer)) {
            auto ch = st->channel({grad ? 1 : 0, a.microbatch, from_stage, j, i});
            auto [ec, unused] = co_await ch->async_receive(asio::experimental::as_tuple(asio::use_awaitable));
            if (ec) co_return;  // closed: another worker failed
          }
          break;
        }
        case ActionKind::kAllReduce:
          reductions.push_back(st->channel({2, a.stage, a.stage, 0, i}));
          State::post_allreduce(st, r, a, where());
          break;
      }
    }
    std::lock_guard<std::mutex> lock(st->mu);
    st->waiting[w] = "";
    ++st->finished;
    st->done.notify_all();
  };

  st->t0 = Clock::now();
  for (int w = 0; w < workers; ++w) {
    asio::co_spawn(*st->compute[w], walk(st, w, with_stage), asio::detached);
  }
  // Threads: one per replica for compute (and its coroutine), one for all communication.
  auto comm_guard = asio::make_work_guard(st->comm);
  std::thread comm_thread([st] {
    st->comm.run();
    st->comm_exited = true;
  });
  std::vector<std::thread> compute_threads;
  for (int w = 0; w < workers; ++w) {
    compute_threads.emplace_back([st, w] {
      st->compute[w]->run();
      st->exited[w] = true;
    });
  }

  bool in_time;
  {
    std::unique_lock<std::mutex> lock(st->mu);
    in_time = st->done.wait_for(lock, timeout, [&] { return st->finished == workers || st->failed.load(); });
  }
  Status outcome = Status::ok();
  if (!in_time) {
    std::string stuck;
    {
      std::lock_guard<std::mutex> lock(st->mu);
      for (int w = 0; w < workers; ++w) {
        if (st->waiting[w].empty()) continue;
        const auto [r, i] = st->workers[w];
        stuck += " rank " + std::to_string(r) + (st->replicas[r] > 1 ? " replica " + std::to_string(i) : "") +
                 " at " + st->waiting[w] + ";";
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
  for (int w = 0; w < workers; ++w) {
    while (!st->exited[w] && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (st->exited[w]) compute_threads[w].join(); else compute_threads[w].detach();
  }
  while (!st->comm_exited && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool comm_joined = st->comm_exited;
  if (comm_joined) comm_thread.join(); else comm_thread.detach();
  // Coroutines still suspended hold the state (and it holds them): let them see their closed
  // channels and finish, here, on contexts no thread runs any more.
  for (int w = 0; w < workers; ++w) {
    if (!st->exited[w]) continue;
    st->compute[w]->restart();
    st->compute[w]->poll();
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
