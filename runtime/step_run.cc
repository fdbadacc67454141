#include "runtime/step_run.h"

#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/executor_work_guard.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/concurrent_channel.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/use_awaitable.hpp>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "common/blocking_call.h"
#include "runtime/comm_thread_impl.h"

namespace conveyor::runtime {

using scheduler::ActionKind;
using scheduler::ActionList;
using scheduler::action_words;
using scheduler::partner_replicas;
using scheduler::validate_schedule;

namespace {
using Clock = std::chrono::steady_clock;
// (Asio 1.22 cannot instantiate a channel of void(error_code) alone: the int is unused.)
using Channel = asio::experimental::concurrent_channel<void(asio::error_code, int)>;
// A message: kind (0 activation, 1 gradient, 2 allreduce done), microbatch (or stage for
// an allreduce), sending stage, sending replica, receiving replica.
using Key = std::tuple<int, int, int, int, int>;
}  // namespace

// ---- one step --------------------------------------------------------------------------

// Shared by the threads of one step.
struct StepRun::State {
  State(const Schedule& s, const RunnerHooks& h, std::vector<int> r, LocalReplicas l, std::vector<int> sp)
      : schedule(s), hooks(h), replicas(std::move(r)), local(std::move(l)), splits(std::move(sp)),
        comm_thread(CommThread::process()),
        comm(comm_thread->impl().io) {
    for (int rank = 0; rank < static_cast<int>(replicas.size()); ++rank) {
      for (int i = 0; i < replicas[rank]; ++i) {
        if (local[rank][i]) workers.emplace_back(rank, i);
      }
      local_replicas.push_back(static_cast<int>(std::count(local[rank].begin(), local[rank].end(), true)));
    }
    waiting.assign(workers.size(), "start");
    inside.assign(workers.size(), false);
  }
  // Copies: a thread left behind by a hook that never returns still finds them alive.
  const Schedule schedule;
  const RunnerHooks hooks;
  const std::vector<int> replicas;               // per rank
  const LocalReplicas local;                     // per rank and replica: run by this process
  const std::vector<int> splits;                 // per rank: equal for ranks that split alike
  std::vector<int> local_replicas;               // per rank: how many of its replicas run here
  std::vector<std::pair<int, int>> workers;      // (rank, replica), rank-major
  const std::shared_ptr<CommThread> comm_thread;
  asio::io_context& comm;
  std::map<int, int> allreduce_arrivals;         // stage -> replicas arrived (comm thread only)
  std::mutex mu;
  std::map<Key, std::shared_ptr<Channel>> channels;  // created by whichever side comes first
  std::vector<std::shared_ptr<Channel>> remote;      // receives waiting on other processes
  std::vector<Span> spans;
  std::vector<std::string> waiting;  // per worker: the action it is at ("" when done)
  std::vector<bool> inside;          // per worker: in run_replica
  Status error = Status::ok();
  std::atomic<bool> failed{false};
  int finished = 0;
  // Sends posted to the communication thread and not yet handed to the transport: a step
  // whose walks are over still reads what it sends (a forward-only list ends with its last
  // send), so it ends when these are done too.
  int sends_pending = 0;
  std::condition_variable done;
  Clock::time_point t0 = Clock::now();

  double now() const { return std::chrono::duration<double>(Clock::now() - t0).count(); }

  std::shared_ptr<Channel> channel(const Key& k) {
    std::lock_guard<std::mutex> lock(mu);
    auto& ch = channels[k];
    if (!ch) {
      ch = std::make_shared<Channel>(comm.get_executor(), 1);
      if (failed) ch->close();  // a failed step's late arrivals must not wait
    }
    return ch;
  }

  void fail(Status st) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (error.is_ok()) error = std::move(st);
      failed = true;
      for (auto& [k, ch] : channels) ch->close();
      for (auto& ch : remote) ch->close();
    }
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
    std::vector<std::shared_ptr<Channel>> out;  // none for another process's replica: the transfer hook sends
    for (int j : partner_replicas(st->replicas, r, i, a.peer, st->splits)) {
      if (st->local[a.peer][j]) out.push_back(st->channel({kind, a.microbatch, a.stage, i, j}));
    }
    {
      std::lock_guard<std::mutex> lock(st->mu);
      ++st->sends_pending;
    }
    asio::post(st->comm, [st, r, i, a, out = std::move(out), where = std::move(where)] {
      run_send(*st, r, i, a, out, where);
      {
        std::lock_guard<std::mutex> lock(st->mu);
        --st->sends_pending;
      }
      st->done.notify_all();
    });
  }

  static void run_send(State& st, int r, int i, const Action& a, const std::vector<std::shared_ptr<Channel>>& out,
                       const std::string& where) {
    if (st.failed) return;
    const double start = st.now();
    if (st.hooks.transfer) {
      Status s = st.hooks.transfer(r, i, a);
      if (!s) return st.fail(s.with_context(where));
    }
    st.record({r, Span::Stream::kSend, a, start, st.now(), i});
    for (auto& ch : out) ch->try_send(asio::error_code{}, 0);
  }

  // A replica of rank r arrives at its stage's allreduce; the last of this process's to
  // arrive runs it (on the communication thread) and releases all of them through their
  // channels (replicas in other processes are the hook's business).
  static void post_allreduce(const std::shared_ptr<State>& st, int r, const Action& a, std::string where) {
    asio::post(st->comm, [st, r, a, where = std::move(where)] {
      if (st->failed) return;
      if (++st->allreduce_arrivals[a.stage] < st->local_replicas[r]) return;
      const double start = st->now();
      if (st->hooks.allreduce) {
        Status s = st->hooks.allreduce(r, 0, a);
        if (!s) return st->fail(s.with_context(where));
      }
      const double end = st->now();
      for (int j = 0; j < st->replicas[r]; ++j) {
        if (!st->local[r][j]) continue;
        st->record({r, Span::Stream::kCollective, a, start, end, j});
        st->channel({2, a.stage, a.stage, 0, j})->try_send(asio::error_code{}, 0);
      }
    });
  }

  // One replica's walk of its rank's list. No captures: State comes in by value, so the frame
  // keeps it alive however long a hook takes.
  static asio::awaitable<void> walk(std::shared_ptr<State> st, int w) {
    const auto [r, i] = st->workers[w];
    const bool with_stage = st->schedule.spec.chunks > 1;
    const ActionList& list = st->schedule.ranks[r];
    std::vector<std::shared_ptr<Channel>> reductions;  // this replica's allreduces in flight
    const std::string who = st->replicas[r] > 1 ? "rank " + std::to_string(r) + " replica " + std::to_string(i)
                                                : "rank " + std::to_string(r);
    for (const Action& a : list) {
      if (st->failed) co_return;
      {
        std::lock_guard<std::mutex> lock(st->mu);
        st->waiting[w] = action_words(a, with_stage);
      }
      const auto where = [&] { return who + " at " + action_words(a, with_stage); };
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
          post_send(st, r, i, a, where());
          break;
        case ActionKind::kRecvActivation:
        case ActionKind::kRecvGradient: {
          const bool grad = a.kind == ActionKind::kRecvGradient;
          const int from_stage = grad ? a.stage + 1 : a.stage - 1;
          for (int j : partner_replicas(st->replicas, r, i, a.peer, st->splits)) {
            if (st->local[a.peer][j]) {
              auto ch = st->channel({grad ? 1 : 0, a.microbatch, from_stage, j, i});
              auto [ec, unused] = co_await ch->async_receive(asio::experimental::as_tuple(asio::use_awaitable));
              if (ec) co_return;  // closed: another replica failed
            }
          }
          if (st->hooks.receive) {  // and whatever other processes send it
            auto ch = std::make_shared<Channel>(st->comm.get_executor(), 1);
            {
              std::lock_guard<std::mutex> lock(st->mu);
              if (st->failed) co_return;
              st->remote.push_back(ch);
            }
            st->hooks.receive(r, i, a, [st, ch, where = where()](Status s) {
              if (!s) return st->fail(s.with_context(where));
              ch->try_send(asio::error_code{}, 0);
            });
            auto [ec, unused] = co_await ch->async_receive(asio::experimental::as_tuple(asio::use_awaitable));
            if (ec) co_return;
          }
          break;
        }
        case ActionKind::kAllReduce:
          reductions.push_back(st->channel({2, a.stage, a.stage, 0, i}));
          post_allreduce(st, r, a, where());
          break;
      }
    }
    std::lock_guard<std::mutex> lock(st->mu);
    st->waiting[w] = "";
    ++st->finished;
    st->done.notify_all();
  }
};

StepRun::StepRun(std::shared_ptr<State> state) : st_(std::move(state)) {}
StepRun::~StepRun() = default;

Result<std::shared_ptr<StepRun>> StepRun::create(const Schedule& schedule, const RunnerHooks& hooks,
                                                 std::vector<int> replicas, LocalReplicas local,
                                                 std::vector<int> splits) {
  CONVEYOR_RETURN_IF_ERROR(validate_schedule(schedule));
  if (!hooks.compute) return Status(ErrorCode::kInvalidArgument, "the runner needs a compute hook");
  const int ranks = static_cast<int>(schedule.ranks.size());
  if (replicas.empty()) replicas.assign(static_cast<std::size_t>(ranks), 1);
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
  if (!splits.empty() && static_cast<int>(splits.size()) != ranks) {
    return Status(ErrorCode::kInvalidArgument, "splits given for " + std::to_string(splits.size()) +
                                                   " ranks, but the schedule has " + std::to_string(ranks));
  }
  if (local.empty()) {
    for (int r = 0; r < ranks; ++r) local.emplace_back(static_cast<std::size_t>(replicas[r]), true);
  }
  if (static_cast<int>(local.size()) != ranks) {
    return Status(ErrorCode::kInvalidArgument, "local replicas given for " + std::to_string(local.size()) +
                                                   " ranks, but the schedule has " + std::to_string(ranks));
  }
  for (int r = 0; r < ranks; ++r) {
    if (static_cast<int>(local[r].size()) != replicas[r]) {
      return Status(ErrorCode::kInvalidArgument, "rank " + std::to_string(r) + " has " + std::to_string(replicas[r]) +
                                                     " replicas but " + std::to_string(local[r].size()) +
                                                     " are placed");
    }
  }
  return std::shared_ptr<StepRun>(
      new StepRun(std::make_shared<State>(schedule, hooks, std::move(replicas), std::move(local), std::move(splits))));
}

int StepRun::workers() const { return static_cast<int>(st_->workers.size()); }
std::pair<int, int> StepRun::worker(int w) const { return st_->workers.at(static_cast<std::size_t>(w)); }

void StepRun::fail(Status error) { st_->fail(std::move(error)); }

void StepRun::run_replica(int w) {
  {
    std::lock_guard<std::mutex> lock(st_->mu);
    if (st_->failed) return;  // too late: the step is over
    st_->inside[w] = true;
  }
  asio::io_context replica_context(1);
  asio::co_spawn(replica_context, State::walk(st_, w), asio::detached);
  replica_context.run();  // until the walk ends: its list is done, or a closed channel woke it
  {
    std::lock_guard<std::mutex> lock(st_->mu);
    st_->inside[w] = false;
  }
  st_->done.notify_all();
}

Result<RunResult> StepRun::wait(std::chrono::milliseconds timeout, const std::function<bool()>& stop) {
  State& st = *st_;
  const int workers = static_cast<int>(st.workers.size());
  const auto deadline = Clock::now() + timeout;
  auto grace = deadline;  // for the replicas to leave their actions after a failure
  std::unique_lock<std::mutex> lock(st.mu);
  const auto ended = [&] { return (st.finished == workers && st.sends_pending == 0) || st.failed; };
  bool in_time = false, interrupted = false;
  while (!in_time && !interrupted && Clock::now() < deadline) {
    const auto slice = stop ? std::min(deadline, Clock::now() + kStopAskedEvery) : deadline;
    in_time = st.done.wait_until(lock, slice, ended);
    if (!in_time && stop) {
      lock.unlock();
      interrupted = stop();
      lock.lock();
    }
  }
  in_time = in_time || ended();
  if (!in_time && interrupted) {
    lock.unlock();
    st.fail(Status(ErrorCode::kInterrupted, "the step was interrupted"));
    lock.lock();
    grace = Clock::now() + std::chrono::seconds(5);
  } else if (!in_time) {
    std::string where;
    for (int w = 0; w < workers; ++w) {
      if (st.waiting[w].empty()) continue;
      const auto [r, i] = st.workers[w];
      where += " rank " + std::to_string(r) + (st.replicas[r] > 1 ? " replica " + std::to_string(i) : "") + " at " +
               st.waiting[w] + ";";
    }
    if (st.sends_pending > 0) where += " " + std::to_string(st.sends_pending) + " sends not yet handed to the transport;";
    lock.unlock();
    st.fail(Status(ErrorCode::kExecution, "the step did not finish within " + std::to_string(timeout.count()) +
                                              " ms:" + where + " (a hook that never returns, or a lost peer)"));
    lock.lock();
  }
  if (!st.failed) {
    RunResult result;
    result.start = st.t0;
    result.spans = std::move(st.spans);
    for (const auto& s : result.spans) result.step_time_s = std::max(result.step_time_s, s.end_s);
    return result;
  }
  // Failed: let every replica leave the action it is in (closed channels wake the waiting
  // ones), and the communication thread finish what it runs, before the caller reuses or
  // frees what the hooks touch. What does not return in time is left behind, named by stuck().
  grace = std::max(grace, Clock::now() + std::chrono::seconds(1));
  st.done.wait_until(lock, grace, [&] {
    for (bool in : st.inside) {
      if (in) return false;
    }
    return true;
  });
  Status error = st.error;
  lock.unlock();
  auto drained = std::make_shared<std::promise<void>>();
  auto drained_future = drained->get_future();
  asio::post(st.comm, [drained] { drained->set_value(); });
  if (drained_future.wait_until(grace) != std::future_status::ready) st.comm_thread->impl().abandoned = true;
  return error;
}

std::vector<int> StepRun::stuck() const {
  std::lock_guard<std::mutex> lock(st_->mu);
  std::vector<int> out;
  for (int w = 0; w < static_cast<int>(st_->inside.size()); ++w) {
    if (st_->inside[w]) out.push_back(w);
  }
  return out;
}

}  // namespace conveyor::runtime
