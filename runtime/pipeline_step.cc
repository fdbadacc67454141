#include "runtime/pipeline_step.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "runtime/gradient_reducer.h"
#include "runtime/model_state.h"
#include "runtime/pipeline_layout.h"
#include "runtime/placement.h"
#include "runtime/remote_exchange.h"
#include "runtime/stage_replica.h"
#include "runtime/value_store.h"
#include "trace/simulation_trace.h"
#include "trace/span_record.h"

namespace conveyor::runtime {

using graph::NodeId;
using scheduler::Action;
using scheduler::ActionKind;
using scheduler::Span;

struct PipelineStep::Impl {
  std::vector<std::shared_ptr<const graph::GraphExecutor>> executors;  // per replica index
  PipelineLayout layout;
  Placement placement;
  std::shared_ptr<ProcessGroup> processes;  // null in one process
  std::unique_ptr<PipelineStreams> streams;  // null on the CPU
  std::unique_ptr<ValueStore> store;
  std::unique_ptr<ModelState> state;
  std::unique_ptr<RemoteExchange> remote;   // null in one process
  std::unique_ptr<GradientReducer> reducer;
  std::vector<std::unique_ptr<StageReplica>> replicas;  // this process's, rank-major
  std::map<std::pair<int, int>, StageReplica*> by_worker;  // (rank, replica) -> this process's replica
  StepSettings settings;
  int intra_op_threads = 0;  // fixed by the caller; 0: the caller's shared out
  std::chrono::milliseconds step_timeout{std::chrono::minutes(10)};
  std::function<bool()> interrupted;  // PipelineOptions::interrupted
  std::uint64_t steps_begun = 0;
  std::uint64_t evaluations_begun = 0;
  bool out_of_step = false;  // a failed step left the processes out of step
  c10::Event* step_start = nullptr;  // streams: the device's start of the step
  std::chrono::steady_clock::time_point step_start_host;
  RunResult last;
  std::pair<int, int> last_reduction{0, 0};
  std::int64_t handed_over_bytes = 0;  // received when made from holders (a re-plan)
  double handed_over_s = 0;
  std::shared_ptr<HeldGradients> held;  // the last run's, with hold_gradients
  std::vector<at::Tensor> input_grads;   // the last run's, per graph input that required one
  std::unique_ptr<Coordinator> coordinator;  // the replicas' actors; destroyed first

  ~Impl() { coordinator.reset(); }  // no replica runs a hook any more

  double device_time(const c10::Event* e, const RunResult& measured) const;
  void device_times(RunResult& measured) const;
  Result<at::Tensor> total_loss();
  Status sum_across_processes(std::vector<at::Tensor>& input_grads);
  Status connect_nccl(std::vector<std::shared_ptr<transport::Collective>>& across);
};

// Seconds from the measured step's start to when `e` was reached on the device.
double PipelineStep::Impl::device_time(const c10::Event* e, const RunResult& measured) const {
  const double host_offset = std::chrono::duration<double>(step_start_host - measured.start).count();
  return e == nullptr ? host_offset : host_offset + seconds_between(*step_start, *e);
}

// With streams, the host only queued the work: once the device has run it all, every compute
// action and allreduce gets the device's times from its events.
void PipelineStep::Impl::device_times(RunResult& measured) const {
  std::map<std::tuple<int, int, int, int, int>, const StageReplica::Timed*> by_action;  // (rank, replica, kind, mb, stage)
  for (const auto& r : replicas) {
    for (const auto& t : r->timed()) {
      by_action[{r->rank(), r->replica(), static_cast<int>(t.action.kind), t.action.microbatch, t.action.stage}] = &t;
    }
  }
  for (auto& span : measured.spans) {
    if (span.stream == Span::Stream::kCompute) {
      auto it = by_action.find({span.rank, span.replica, static_cast<int>(span.action.kind), span.action.microbatch,
                                span.action.stage});
      if (it == by_action.end()) continue;
      span.start_s = device_time(it->second->start, measured);
      span.end_s = device_time(it->second->end, measured);
    } else if (span.stream == Span::Stream::kCollective && span.action.kind == ActionKind::kAllReduce) {
      const auto [start, end] = reducer->allreduce_events(span.action.stage);
      if (start == nullptr || end == nullptr) continue;
      span.start_s = device_time(start, measured);
      span.end_s = device_time(end, measured);
    }
  }
}

// GPU pipelines over NCCL: lanes for every pair of processes a message goes between, and the
// stages that span processes sum their gradients in NCCL groups instead of UCX ones.
Status PipelineStep::Impl::connect_nccl(std::vector<std::shared_ptr<transport::Collective>>& across) {
  if (!streams || !streams->device().is_cuda()) {
    return Status(ErrorCode::kInvalidArgument,
                  std::string("transport \"nccl\" moves GPU tensors between processes, but this pipeline's model is on ") +
                      (streams ? streams->device().str() : std::string("the CPU")) +
                      "; move the model to its process's GPU, or use transport \"ucx\"");
  }
  CONVEYOR_ASSIGN_OR_RETURN(auto lanes, processes->nccl_endpoint(streams->device(), placement.links()));
  remote = std::make_unique<RemoteExchange>(layout, placement, *store, streams.get(), std::move(lanes));
  for (int st = 0; st < layout.num_stages(); ++st) {
    if (!placement.spans_processes(st)) continue;
    CONVEYOR_ASSIGN_OR_RETURN(auto group, processes->nccl_subgroup(placement.stage_processes[st], streams->device()));
    across[st] = std::move(group);
  }
  return Status::ok();
}

PipelineStep::PipelineStep(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PipelineStep::~PipelineStep() = default;

Result<std::unique_ptr<PipelineStep>> PipelineStep::create(std::shared_ptr<const graph::GraphExecutor> executor,
                                                           std::vector<std::vector<NodeId>> stages,
                                                           scheduler::ScheduleSpec spec, PipelineOptions options) {
  install_memory_meter();  // each replica's host memory, measured from its first step on
  const graph::Graph& g = executor->graph();
  auto impl = std::make_unique<Impl>();
  Impl& im = *impl;
  std::set<std::string> held, trainable;
  std::optional<c10::Device> stream_device;  // where the model lives, when that device has streams
  for (const auto& b : g.bindings) {
    const at::Tensor* t = executor->tensor(b.name);
    if (t == nullptr) continue;
    held.insert(b.name);
    if (t->requires_grad()) trainable.insert(b.name);
    if (!stream_device && t->defined() && device_has_streams(t->device())) stream_device = t->device();
  }
  CONVEYOR_ASSIGN_OR_RETURN(im.layout, PipelineLayout::create(g, std::move(stages), spec, options.replicas,
                                                              std::move(held), std::move(trainable), options.shares));
  const PipelineLayout& layout = im.layout;
  const int num_stages = layout.num_stages();
  // Replica executors: parameters share storage, buffers are copies.
  im.executors.push_back(executor);
  for (int r = 1; r < layout.most_replicas; ++r) {
    CONVEYOR_ASSIGN_OR_RETURN(auto replica, executor->replica());
    im.executors.push_back(std::move(replica));
  }
  im.settings.recompute = options.recompute;
  im.settings.recompute.resize(static_cast<std::size_t>(num_stages), Recomputation::kNone);
  if (options.seed) {
    im.settings.random_seed = *options.seed;
  } else {
    at::CPUGeneratorImpl* global = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(global->mutex_);
    im.settings.random_seed = global->random64();
  }
  im.processes = options.processes;
  std::vector<std::shared_ptr<transport::Collective>> across(static_cast<std::size_t>(num_stages));
  if (im.processes) {
    std::vector<std::vector<int>> per_rank = options.replica_process;
    if (per_rank.empty()) {  // a rank's replicas all on its process
      for (std::size_t rank = 0; rank < options.rank_process.size(); ++rank) {
        const int count = rank < layout.rank_replicas.size() ? layout.rank_replicas[rank] : 1;
        per_rank.emplace_back(static_cast<std::size_t>(count), options.rank_process[rank]);
      }
    }
    CONVEYOR_ASSIGN_OR_RETURN(im.placement, Placement::across(g, layout, im.processes->rank(),
                                                              im.processes->world_size(), per_rank));
    // Every process makes every group, in this order (ProcessGroup::subgroup): the stages'
    // groups, then the buffers'.
    for (int st = 0; st < num_stages; ++st) {
      if (!im.placement.spans_processes(st)) continue;
      CONVEYOR_ASSIGN_OR_RETURN(auto group, im.processes->subgroup(im.placement.stage_processes[st]));
      across[st] = std::move(group);
    }
  } else {
    im.placement = Placement::one_process(layout);
  }
  CONVEYOR_ASSIGN_OR_RETURN(im.state, ModelState::create(layout, im.placement, im.executors, im.processes));
  if (im.processes) {
    // Every process must build this pipeline: compare fingerprints.
    at::Tensor mine = at::full({1}, static_cast<std::int64_t>(im.placement.fingerprint), at::kLong);
    at::Tensor all = at::zeros({im.processes->world_size()}, at::kLong);
    CONVEYOR_RETURN_IF_ERROR(im.processes->wait([&](transport::Done d) { im.processes->all().allgather(mine, all, d); },
                                                "comparing the pipeline every process built"));
    std::string differ;
    for (int p = 0; p < im.processes->world_size(); ++p) {
      if (all[p].item<std::int64_t>() != all[0].item<std::int64_t>()) differ += (differ.empty() ? "" : ", ") + std::to_string(p);
    }
    if (!differ.empty()) {
      return Status(ErrorCode::kInvalidArgument,
                    "processes " + differ + " built a different pipeline (stages, schedule, microbatches, replicas or "
                    "placement) than process 0; every process must run the same plan");
    }
    // One seed for the job, process 0's: a replica draws the same wherever it runs.
    at::Tensor seed = at::tensor({static_cast<std::int64_t>(im.settings.random_seed)}, at::kLong);
    CONVEYOR_RETURN_IF_ERROR(im.processes->broadcast(seed, 0).with_context("handing out the random seed"));
    im.settings.random_seed = static_cast<std::uint64_t>(seed.item<std::int64_t>());
  }
  if (stream_device) im.streams = std::make_unique<PipelineStreams>(*stream_device, layout.rank_replicas, num_stages);
  im.store = std::make_unique<ValueStore>(layout, im.streams.get());
  if (im.processes) {
    if (options.transport == PipelineOptions::Transport::kNccl) {
      CONVEYOR_RETURN_IF_ERROR(im.connect_nccl(across));
    } else {
      im.remote = std::make_unique<RemoteExchange>(layout, im.placement, *im.store, im.streams.get(),
                                                   im.processes->endpoint());
    }
  }
  GradientReducer::Groups groups;
  groups.across = std::move(across);
  groups.processes = im.processes.get();
  if (im.processes) groups.timeout = im.processes->timeout();
  ModelState* state = im.state.get();
  const auto& executors = im.executors;
  CONVEYOR_ASSIGN_OR_RETURN(
      im.reducer, GradientReducer::create(
                      layout, im.placement,
                      [&executors](int r, const std::string& name) { return executors[r]->tensor(name); },
                      im.streams.get(), options.bucket_bytes, std::move(groups),
                      [state](const std::string& name) { return state->released_sizes(name); },
                      [state](const std::string& name) { return state->declared_sizes(name); }));
  // This process's replicas, each with its programs.
  const LocalReplicas local = im.placement.local_workers(layout);
  for (int rank = 0; rank < spec.ranks; ++rank) {
    for (int i = 0; i < layout.rank_replicas[rank]; ++i) {
      if (!local[rank][i]) continue;
      std::map<int, std::shared_ptr<const graph::StageProgram>> programs;
      for (int s : spec.stages_of_rank(rank)) {
        CONVEYOR_ASSIGN_OR_RETURN(programs[s], im.state->executor_for(i, rank)->stage(layout.stages[s]));
      }
      im.replicas.push_back(std::make_unique<StageReplica>(rank, i, layout, im.placement, std::move(programs), *im.store,
                                                           *im.reducer, im.remote.get(), im.streams.get(), im.settings));
      im.by_worker[{rank, i}] = im.replicas.back().get();
    }
  }
  im.intra_op_threads = std::max(options.intra_op_threads, 0);
  im.step_timeout = options.step_timeout;
  im.interrupted = options.interrupted;
  // The replicas' actors live as long as the pipeline; their hooks reach the owners above.
  Impl* self = impl.get();
  RunnerHooks hooks;
  hooks.compute = [self](int rank, int replica, const Action& a) { return self->by_worker.at({rank, replica})->compute(a); };
  hooks.allreduce = [self](int rank, int, const Action& a) {
    std::vector<c10::Event*> final_done;
    for (int i : self->placement.local_replicas[a.stage]) final_done.push_back(self->by_worker.at({rank, i})->final_done(a.stage));
    return self->reducer->finish_stage(a.stage, final_done);
  };
  if (im.remote) {
    hooks.transfer = [self](int, int replica, const Action& a) { return self->remote->send(replica, a); };
    hooks.receive = [self](int, int replica, const Action& a, std::function<void(Status)> arrived) {
      self->remote->receive(replica, a, std::move(arrived));
    };
  }
  CONVEYOR_ASSIGN_OR_RETURN(im.coordinator, Coordinator::create(layout.schedule, std::move(hooks), layout.rank_replicas,
                                                                std::move(options.predicted), local, layout.rank_split));
  std::unique_ptr<PipelineStep> step(new PipelineStep(std::move(impl)));
  if (!options.holders.empty() && step->impl_->processes) {
    // A re-plan: what this process's stages read and it lacks comes from a holder.
    const auto start = std::chrono::steady_clock::now();
    CONVEYOR_ASSIGN_OR_RETURN(step->impl_->handed_over_bytes, step->impl_->state->hand_over(options.holders));
    step->impl_->handed_over_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return step;
  }
  // Every process starts from the same parameters and buffers, their owners', and keeps
  // only what its stages read.
  CONVEYOR_RETURN_IF_ERROR(step->gather_state());
  step->impl_->state->release();
  return step;
}

namespace {

const Status kOutOfStep(ErrorCode::kExecution, "an earlier step failed and left the processes out of step; "
                                               "restart the job (every process) after fixing its cause");

// The samples of a batch (its batched inputs' first size), checked against the capture
// before anything runs (the shares against the batch range follow in check_step). A graph
// whose capture fixed the batch size has no batched input: its call is one indivisible
// sample, which runs where the pipeline splits nothing (one microbatch, one replica each).
Result<std::int64_t> samples_of(const graph::GraphExecutor& executor, const PipelineLayout& layout,
                                const std::vector<c10::IValue>& inputs, int microbatches) {
  CONVEYOR_RETURN_IF_ERROR(executor.check_inputs(inputs, /*whole_batch=*/false));
  std::int64_t batch = -1;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (layout.batch.batched_input[i] && inputs[i].isTensor()) batch = inputs[i].toTensor().size(0);
  }
  if (batch >= 0) return batch;
  const int most = *std::max_element(layout.stage_replicas.begin(), layout.stage_replicas.end());
  if (microbatches == 1 && most == 1) return std::int64_t{1};
  return Status(ErrorCode::kInvalidArgument,
                "no input has a batch dimension (the capture fixed the batch size), so a call cannot be split into " +
                    std::to_string(microbatches) + " microbatches" + (most > 1 ? " and replicas" : "") +
                    "; run it with microbatches=1 and one replica per stage");
}

}  // namespace

Status PipelineStep::begin_batch(const std::vector<c10::IValue>& inputs) {
  Impl& im = *impl_;
  const PipelineLayout& layout = im.layout;
  if (im.out_of_step) return kOutOfStep;
  CONVEYOR_ASSIGN_OR_RETURN(const std::int64_t batch, samples_of(*im.executors[0], layout, inputs, layout.microbatches()));
  CONVEYOR_RETURN_IF_ERROR(layout.batch.check_step(batch, layout.microbatches(), layout.stage_replicas, layout.stage_weights()));
  return im.store->begin_step(inputs, batch);
}

Result<StepResult> PipelineStep::run(const std::vector<c10::IValue>& inputs, double grad_scale, bool hold_gradients) {
  CONVEYOR_RETURN_IF_ERROR(begin_batch(inputs));
  return run_begun(grad_scale, hold_gradients);
}

void PipelineStep::set_draws(std::uint64_t seed, std::uint64_t next_step) {
  Impl& im = *impl_;
  im.settings.random_seed = seed;
  im.steps_begun = next_step;
}

Result<StepResult> PipelineStep::evaluate(const std::vector<c10::IValue>& inputs) {
  CONVEYOR_RETURN_IF_ERROR(begin_batch(inputs));
  return run_begun(1.0, /*hold_gradients=*/false, /*forward_only=*/true);
}

Result<StepResult> PipelineStep::run_packed(const std::vector<std::vector<c10::IValue>>& microbatches,
                                            double grad_scale, bool hold_gradients) {
  Impl& im = *impl_;
  const PipelineLayout& layout = im.layout;
  if (im.out_of_step) return kOutOfStep;
  if (static_cast<int>(microbatches.size()) != layout.microbatches()) {
    return Status(ErrorCode::kInvalidArgument, "packed " + std::to_string(microbatches.size()) +
                                                   " microbatches but the pipeline runs " +
                                                   std::to_string(layout.microbatches()) + " a step; pack that many");
  }
  std::vector<std::int64_t> rows;
  for (std::size_t k = 0; k < microbatches.size(); ++k) {
    auto samples = samples_of(*im.executors[0], layout, microbatches[k], 1);
    if (!samples) return samples.status().with_context("microbatch " + std::to_string(k));
    Status fits = layout.batch.check_step(*samples, 1, layout.stage_replicas, layout.stage_weights());
    if (!fits.is_ok()) return fits.with_context("microbatch " + std::to_string(k));
    rows.push_back(*samples);
  }
  CONVEYOR_RETURN_IF_ERROR(im.store->begin_packed_step(microbatches, rows));
  return run_begun(grad_scale, hold_gradients);
}

Result<StepResult> PipelineStep::run_begun(double grad_scale, bool hold_gradients, bool forward_only) {
  Impl& im = *impl_;
  im.state->begin_step();
  if (hold_gradients) im.state->set_gradients_aside();
  im.settings.forward_only = forward_only;
  // Each replica's compute thread gets its share of the caller's intra-op threads: the
  // caller's count over the replicas this process runs (they would otherwise each start a
  // full-size pool and oversubscribe the cores).
  const int caller_threads = at::get_num_threads();
  const int workers = std::max<int>(1, static_cast<int>(im.replicas.size()));  // a process may run none
  im.settings.intra_op_threads = im.intra_op_threads > 0 ? im.intra_op_threads : std::max(1, caller_threads / workers);
  im.settings.grad_scale = grad_scale;
  // An evaluation draws (train-mode dropout) from its own count: evaluating between two
  // steps leaves the steps' draws as they were.
  im.settings.step = forward_only ? (std::uint64_t{1} << 63) | im.evaluations_begun++ : im.steps_begun++;
  im.settings.autocast = AutocastState::of_this_thread();
  im.reducer->begin_step();
  if (im.remote) im.remote->begin_step();
  for (auto& r : im.replicas) r->begin_step();  // after settings.forward_only is set
  if (im.streams) {
    im.step_start = im.streams->start_step();
    im.step_start_host = std::chrono::steady_clock::now();
  }
  // The one host wait on the device per step: after the runner's walks and the host's part
  // of the sums across processes, so the measured spans (trace, live profile) carry the
  // device's times before the step's profile goes to the partitioner actor.
  Status across_status = Status::ok();
  bool synchronized = false;
  auto complete = [&im, &across_status, &synchronized, forward_only](RunResult& measured) {
    if (im.remote && !forward_only && im.remote->send_error().is_ok()) across_status = im.reducer->wait_across();
    if (im.streams) {
      synchronize_device(im.streams->device());
      synchronized = true;
      im.device_times(measured);
    }
    im.reducer->add_spans(measured.spans, measured.start, [&im, &measured](const c10::Event* e) {
      return im.device_time(e, measured);
    });
    for (const auto& s : measured.spans) measured.step_time_s = std::max(measured.step_time_s, s.end_s);
    if (im.streams) {
      measured.step_time_s = std::max(measured.step_time_s,
                                      std::chrono::duration<double>(std::chrono::steady_clock::now() - measured.start).count());
    }
  };
  auto measured = im.coordinator->run_step(im.step_timeout, complete, im.interrupted, forward_only);
  at::set_num_threads(caller_threads);  // the setting is process-wide as well as per thread
  if (im.streams && !synchronized) synchronize_device(im.streams->device());  // a failed step: before its tensors go
  Status send_error = im.remote ? im.remote->send_error() : Status::ok();
  const auto timed_out = [](const Status& st) { return st.message().find(" within ") != std::string::npos; };
  if (im.processes && !measured && timed_out(measured.status())) {
    measured = Status(measured.status().code(), measured.status().message() + im.processes->whom_it_waited_for());
  }
  if (im.processes && !across_status.is_ok() && timed_out(across_status)) {
    across_status = Status(across_status.code(), across_status.message() + im.processes->whom_it_waited_for());
  }
  if (im.processes && (!measured || !send_error.is_ok())) {
    // Out of step with the other processes: this process's part of the job is over.
    im.out_of_step = true;
    im.processes->abort(measured ? send_error : measured.status());
  }
  auto finish = [&]() -> Status {
    if (!measured) return measured.status();
    CONVEYOR_RETURN_IF_ERROR(send_error);
    if (im.processes && !forward_only) {
      if (!across_status.is_ok()) {
        im.out_of_step = true;
        im.processes->abort(across_status);
        return across_status;
      }
      CONVEYOR_RETURN_IF_ERROR(im.reducer->write_across());
    }
    if (!forward_only) im.state->fold_tied_gradients();
    Status s = forward_only ? Status::ok() : im.reducer->reduce_tied();
    if (s.is_ok() && im.processes) s = im.state->sync_buffers();
    if (!s.is_ok() && im.processes) im.out_of_step = true;
    return s;
  };
  Status finished = finish();
  im.input_grads.clear();
  if (finished.is_ok() && !forward_only) {
    im.input_grads = im.store->take_input_gradients();
    finished = im.sum_across_processes(im.input_grads);
  }
  im.store->end_step();
  if (hold_gradients) im.held = im.state->hold_step_gradients();
  CONVEYOR_RETURN_IF_ERROR(finished);
  StepResult out;
  if (!forward_only) {
    std::tie(out.buckets, out.buckets_reduced_during_backward) = im.reducer->counts();
    im.last = *measured;
    im.last_reduction = {out.buckets, out.buckets_reduced_during_backward};
  }
  out.measured = std::move(*measured);
  CONVEYOR_ASSIGN_OR_RETURN(out.loss, im.total_loss());
  return out;
}

// The batch's loss: every share's loss weighted by its size, summed in microbatch and replica
// order. Across processes every process gets every weighted share (exact: each slot has one
// process's value, the others add zeros) and sums them in that same order, so every process
// holds the single-process value, bit for bit.
Result<at::Tensor> PipelineStep::Impl::total_loss() {
  const int m = layout.microbatches();
  const int loss_stage = layout.batch.producer[layout.batch.loss], loss_replicas = layout.stage_replicas[loss_stage];
  const auto losses = store->losses();
  at::Tensor total;
  std::map<std::pair<int, int>, at::Tensor> weighted;  // (mb, replica), this process's
  for (int mb = 0; mb < m; ++mb) {
    for (int i : placement.local_replicas[loss_stage]) {
      weighted[{mb, i}] = losses.at({mb, i}) * store->weight(mb, loss_stage, i);
    }
  }
  if (!processes) {
    for (const auto& [key, w] : weighted) add_into(total, w);
    return total;
  }
  const std::int64_t slots = static_cast<std::int64_t>(m) * loss_replicas;
  at::Tensor carrier = at::zeros({slots + 2}, at::kDouble);  // the shares, then dtype codes and how many sent them
  auto* c = carrier.data_ptr<double>();
  for (const auto& [key, w] : weighted) c[key.first * loss_replicas + key.second] = w.item<double>();
  if (!weighted.empty()) {
    c[slots] = static_cast<double>(weighted.begin()->second.scalar_type());
    c[slots + 1] = 1;
  }
  Status s = processes->wait([&](transport::Done d) { processes->all().allreduce(carrier, d); },
                             "handing every process the step's loss");
  if (!s.is_ok()) {
    out_of_step = true;
    return s;
  }
  const auto dtype = static_cast<at::ScalarType>(std::lround(c[slots] / std::max(c[slots + 1], 1.0)));
  const auto options = at::TensorOptions().dtype(dtype).device(streams ? streams->device() : c10::Device(c10::kCPU));
  for (int mb = 0; mb < m; ++mb) {
    for (int i = 0; i < loss_replicas; ++i) {
      auto it = weighted.find({mb, i});
      add_into(total, it != weighted.end() ? it->second : at::scalar_tensor(c[mb * loss_replicas + i], options));
    }
  }
  return total;
}

// Each process computed the inputs' gradients of its own shares (zeros elsewhere): summed
// over the processes in process order, every process holds the whole batch's.
Status PipelineStep::Impl::sum_across_processes(std::vector<at::Tensor>& input_grads) {
  if (!processes) return Status::ok();
  for (at::Tensor& g : input_grads) {
    if (!g.defined()) continue;
    Status s = processes->wait([&](transport::Done d) { processes->all().allreduce(g, d); },
                               "summing the inputs' gradients across the processes");
    if (!s.is_ok()) {
      out_of_step = true;
      return s;
    }
  }
  return Status::ok();
}

std::shared_ptr<HeldGradients> PipelineStep::take_held_gradients() { return std::move(impl_->held); }

std::vector<at::Tensor> PipelineStep::take_input_gradients() { return std::move(impl_->input_grads); }

std::vector<std::pair<std::string, int>> PipelineStep::owners() const { return impl_->placement.owners; }

Status PipelineStep::gather_state() { return impl_->state->gather(); }

std::map<std::string, std::vector<int>> PipelineStep::readers() const {
  std::map<std::string, std::vector<int>> out;
  const Placement& p = impl_->placement;
  if (!p.across_processes()) return out;
  for (std::size_t k = 0; k < p.owners.size(); ++k) out[p.owners[k].first] = p.readers[k];
  return out;
}

std::int64_t PipelineStep::handed_over_bytes() const { return impl_->handed_over_bytes; }
double PipelineStep::handed_over_s() const { return impl_->handed_over_s; }

const LossReductionFound& PipelineStep::loss_reduction() const { return impl_->layout.batch.loss_reduction; }

std::vector<std::int64_t> PipelineStep::share_lengths(int stage, std::int64_t length) const {
  const PipelineLayout& layout = impl_->layout;
  std::vector<std::int64_t> out;
  if (stage < 0 || stage >= layout.num_stages()) return out;
  for (int i = 0; i < layout.stage_replicas[stage]; ++i) out.push_back(layout.share(length, stage, i).length);
  return out;
}

std::pair<int, int> PipelineStep::last_reduction() const { return impl_->last_reduction; }

std::map<std::pair<int, int>, std::int64_t> PipelineStep::memory_peaks() const {
  std::map<std::pair<int, int>, std::int64_t> out;
  if (!memory_meter_active()) return out;
  for (const auto& [worker, replica] : impl_->by_worker) out[worker] = replica->memory().peak();
  return out;
}

const RunResult& PipelineStep::last_step() const { return impl_->last; }

Result<ProfileReport> PipelineStep::profile_report() const { return impl_->coordinator->profile_report(); }

void PipelineStep::set_prediction(scheduler::SimulationResult predicted) {
  impl_->coordinator->set_prediction(std::move(predicted));
}

const scheduler::ScheduleSpec& PipelineStep::spec() const { return impl_->layout.schedule.spec; }

Status PipelineStep::write_trace(const std::string& path, const std::vector<trace::Marker>& markers) const {
  return write_job_trace(path, {trace_record()}, markers);
}

std::string PipelineStep::trace_record() const {
  using namespace std::chrono;
  const auto since_start = steady_clock::now() - impl_->last.start;
  const auto wall_start = system_clock::now() - duration_cast<system_clock::duration>(since_start);
  return trace::span_record(impl_->last.spans, duration_cast<nanoseconds>(wall_start.time_since_epoch()).count());
}

Status PipelineStep::write_job_trace(const std::string& path, const std::vector<std::string>& records,
                                     const std::vector<trace::Marker>& markers) const {
  if (impl_->last.spans.empty()) return Status(ErrorCode::kInvalidArgument, "no step has run yet: nothing to trace");
  scheduler::SimulationResult spans;
  CONVEYOR_ASSIGN_OR_RETURN(spans.spans, trace::merge_span_records(records, static_cast<int>(impl_->layout.schedule.ranks.size())));
  return trace::write_step_trace(path, impl_->layout.schedule, spans, "measured", impl_->layout.rank_replicas, markers);
}

}  // namespace conveyor::runtime
