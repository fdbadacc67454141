#include "runtime/coordinator.h"

#include <caf/all.hpp>
#include <thread>

#include "runtime/actor_messages.h"

namespace conveyor::runtime {

caf::actor_system& actor_system() {
  static caf::actor_system* system = [] {
    static caf::actor_system_config config;
    // The pooled threads run only the Coordinator and PartitionerActor (short handlers); the
    // replicas are detached, each on a thread of its own.
    config.set("scheduler.max-threads", 2);
    auto* s = new caf::actor_system(config);
    s->await_actors_before_shutdown(false);
    return s;
  }();
  return *system;
}

caf::behavior stage_replica(caf::event_based_actor* self, int rank, int replica) {
  return {
      [](run_atom, const StepPtr& step, int worker) { step->run_replica(worker); },
  };
}

namespace {

// Hands each step to every replica, in the same order on every replica's mailbox.
caf::behavior coordinator(caf::event_based_actor* self, std::vector<caf::actor> replicas) {
  return {
      [self, replicas](step_atom, const StepPtr& step) {
        for (std::size_t w = 0; w < replicas.size(); ++w) {
          self->send(replicas[w], run_atom::value, step, static_cast<int>(w));
        }
      },
  };
}

}  // namespace

struct Coordinator::Impl {
  scheduler::Schedule schedule;
  scheduler::Schedule forwards;  // the same pipeline's forwards alone (evaluation)
  runtime::RunnerHooks hooks;
  std::vector<int> replicas;
  runtime::LocalReplicas local;
  std::vector<int> splits;
  std::vector<caf::actor> replica_actors;
  caf::actor coordinator, partitioner;
  std::shared_ptr<runtime::StepRun> failed;  // the last step, if it failed

  ~Impl() {
    for (auto& a : replica_actors) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(coordinator, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(partitioner, caf::exit_reason::user_shutdown);
  }
};

Coordinator::Coordinator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Coordinator::~Coordinator() = default;

Result<std::unique_ptr<Coordinator>> Coordinator::create(scheduler::Schedule schedule, runtime::RunnerHooks hooks,
                                                         std::vector<int> replicas,
                                                         std::optional<scheduler::SimulationResult> predicted,
                                                         runtime::LocalReplicas local, std::vector<int> splits) {
  // A step validates the schedule, hooks and counts: check them now, before any actor exists.
  auto probe = runtime::StepRun::create(schedule, hooks, replicas, local, splits);
  if (!probe) return probe.status();
  scheduler::ScheduleSpec forward_spec = schedule.spec;
  forward_spec.forward_only = true;
  auto forwards = scheduler::make_schedule(forward_spec);
  if (!forwards) return forwards.status().with_context("the pipeline's forward-only schedule");
  auto impl = std::make_unique<Impl>();
  impl->schedule = std::move(schedule);
  impl->forwards = std::move(forwards).value();
  impl->hooks = std::move(hooks);
  const int ranks = static_cast<int>(impl->schedule.ranks.size());
  impl->replicas = replicas.empty() ? std::vector<int>(static_cast<std::size_t>(ranks), 1) : std::move(replicas);
  impl->local = std::move(local);
  impl->splits = std::move(splits);
  auto& system = actor_system();
  for (int w = 0; w < (*probe)->workers(); ++w) {
    const auto [r, i] = (*probe)->worker(w);
    impl->replica_actors.push_back(system.spawn<caf::detached>(stage_replica, r, i));
  }
  impl->coordinator = system.spawn(coordinator, impl->replica_actors);
  std::shared_ptr<const scheduler::SimulationResult> prediction;
  if (predicted) prediction = std::make_shared<const scheduler::SimulationResult>(std::move(*predicted));
  impl->partitioner = system.spawn(partitioner_actor, impl->schedule.spec, impl->replicas, prediction);
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(impl)));
}

Result<runtime::RunResult> Coordinator::run_step(std::chrono::milliseconds timeout,
                                                   const std::function<void(runtime::RunResult&)>& complete,
                                                   const std::function<bool()>& stop, bool forward_only) {
  if (impl_->failed) {
    // A replica still inside a hook of the failed step would leave this step waiting for it.
    for (int w : impl_->failed->stuck()) {
      const auto [r, i] = impl_->failed->worker(w);
      return Status(ErrorCode::kExecution, "rank " + std::to_string(r) + " replica " + std::to_string(i) +
                                               " is still inside a hook of an earlier step that did not finish; "
                                               "build the pipeline again after fixing what hung");
    }
    impl_->failed.reset();
  }
  auto step = runtime::StepRun::create(forward_only ? impl_->forwards : impl_->schedule, impl_->hooks, impl_->replicas,
                                       impl_->local, impl_->splits);
  if (!step) return step.status();
  caf::anon_send(impl_->coordinator, step_atom::value, *step);
  auto measured = (*step)->wait(timeout, stop);
  if (!measured) impl_->failed = *step;
  if (measured && complete) complete(*measured);
  if (measured && !forward_only) caf::anon_send(impl_->partitioner, profile_atom::value, std::make_shared<const runtime::RunResult>(*measured));
  return measured;
}

void Coordinator::set_prediction(scheduler::SimulationResult predicted) {
  caf::anon_send(impl_->partitioner, predict_atom::value,
                 std::make_shared<const scheduler::SimulationResult>(std::move(predicted)));
}

Result<ProfileReport> Coordinator::profile_report(std::chrono::milliseconds timeout) const {
  caf::scoped_actor self{actor_system()};
  Result<ProfileReport> out = Status(ErrorCode::kInternal, "the partitioner actor did not answer");
  self->request(impl_->partitioner, timeout, report_atom::value)
      .receive([&](ProfileReport& report) { out = std::move(report); },
               [&](caf::error& e) {
                 out = Status(ErrorCode::kExecution, "the partitioner actor did not answer: " + caf::to_string(e));
               });
  return out;
}

}  // namespace conveyor::runtime
