#include "runtime/stage_replica.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace conveyor::runtime {

using graph::AutocastScope;

using graph::ValueId;
using scheduler::Action;
using scheduler::ActionKind;

StageReplica::StageReplica(int rank, int replica, const PipelineLayout& layout, const Placement& placement,
                           std::map<int, std::shared_ptr<const graph::StageProgram>> programs, ValueStore& store,
                           GradientReducer& reducer, RemoteExchange* remote, PipelineStreams* streams,
                           const StepSettings& settings)
    : rank_(rank), replica_(replica), layout_(layout), placement_(placement), programs_(std::move(programs)),
      store_(store), reducer_(reducer), remote_(remote),
      streams_(streams == nullptr ? nullptr : &streams->of_rank(rank, replica)), settings_(settings) {}

void StageReplica::begin_step() {
  activations_.clear();
  backwards_done_.clear();
  final_done_.clear();
  timed_.clear();
  if (!settings_.forward_only) memory_->reset_peak();  // an evaluation leaves the steps' peaks
}

c10::Event* StageReplica::final_done(int stage) const {
  auto it = final_done_.find(stage);
  return it == final_done_.end() ? nullptr : it->second;
}

Status StageReplica::compute(const Action& a) {
  MeterScope metered(memory_);
  if (configured_threads_ != settings_.intra_op_threads) {
    at::set_num_threads(settings_.intra_op_threads);
    configured_threads_ = settings_.intra_op_threads;
  }
  std::optional<c10::StreamGuard> on_compute;
  c10::Event* start = nullptr;
  if (streams_ != nullptr) {
    on_compute.emplace(streams_->compute);
    start = streams_->events.record(streams_->compute);
  }
  Status s = Status::ok();
  switch (a.kind) {
    case ActionKind::kForward: {
      // Forward under the caller's autocast; backward without, as eager's loss.backward()
      // outside the autocast region.
      AutocastScope autocast(settings_.autocast);
      s = forward(a);
      break;
    }
    case ActionKind::kBackward:
    case ActionKind::kBackwardWeight: {
      // The pass that accumulates this replica's last gradients of the step for the stage.
      const bool last = ++backwards_done_[a.stage] == layout_.microbatches();
      reducer_.final_pass(a.stage, replica_, last);
      s = a.kind == ActionKind::kBackward ? backward(a, /*split=*/false) : backward_weight(a);
      reducer_.final_pass(a.stage, replica_, false);
      if (last && streams_ != nullptr) final_done_[a.stage] = streams_->events.record(streams_->compute);
      break;
    }
    case ActionKind::kBackwardInput: s = backward(a, /*split=*/true); break;
    case ActionKind::kOptimizerStep: break;  // the user's optimizer steps after the call
    default: s = Status(ErrorCode::kInternal, "not a compute action: " + scheduler::action_text(a));
  }
  if (streams_ != nullptr) timed_.push_back({a, start, streams_->events.record(streams_->compute)});
  return s;
}

// The seed of a forward's random draws: a hash of the pipeline's seed, the step, the stage,
// the microbatch and the replica (splitmix64 over each in turn).
std::uint64_t StageReplica::forward_seed(int stage, int microbatch) const {
  auto mix = [](std::uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
  };
  std::uint64_t h = mix(settings_.random_seed);
  for (std::uint64_t part : {settings_.step, static_cast<std::uint64_t>(stage), static_cast<std::uint64_t>(microbatch),
                             static_cast<std::uint64_t>(replica_)}) {
    h = mix(h ^ part);
  }
  return h;
}

Status StageReplica::forward(const Action& a) {
  const graph::StageProgram& program = *programs_.at(a.stage);
  CONVEYOR_ASSIGN_OR_RETURN(std::vector<c10::IValue> in, store_.read(program.inputs(), a.microbatch, a.stage, replica_));
  std::optional<std::uint64_t> seed;
  if (program.draws_random()) seed = forward_seed(a.stage, a.microbatch);
  auto run = [&]() -> Result<graph::StageActivation> {
    if (settings_.forward_only) {  // an evaluation: nothing recorded for a backward
      at::NoGradGuard no_grad;
      return program.forward(std::move(in), seed);
    }
    switch (settings_.recompute[a.stage]) {
      case Recomputation::kSelective: return program.forward_selective(std::move(in), seed);
      case Recomputation::kFull: return program.forward_for_recompute(std::move(in), seed);
      case Recomputation::kNone: break;
    }
    return program.forward(std::move(in), seed);
  };
  CONVEYOR_ASSIGN_OR_RETURN(graph::StageActivation act, run());
  c10::Event* done = streams_ != nullptr ? streams_->events.record(streams_->compute) : nullptr;
  store_.put(program.outputs(), act.outputs, a.microbatch, a.stage, replica_, done);
  if (!settings_.forward_only) activations_[{a.stage, a.microbatch}] = std::move(act);  // kept for the backward
  return Status::ok();
}

Status StageReplica::backward(const Action& a, bool split) {
  const graph::StageProgram& program = *programs_.at(a.stage);
  auto it = activations_.find({a.stage, a.microbatch});
  if (it == activations_.end()) return Status(ErrorCode::kInternal, "backward before forward");
  graph::StageActivation act = std::move(it->second);
  activations_.erase(it);
  if (act.needs_recompute) {
    // The forward again, as it first ran: the caller's autocast, the same seeded draws.
    AutocastScope autocast(settings_.autocast);
    std::optional<std::uint64_t> seed;
    if (program.draws_random()) seed = forward_seed(a.stage, a.microbatch);
    CONVEYOR_RETURN_IF_ERROR(program.recompute(act, seed));
  }
  std::vector<c10::IValue> out_grads;
  for (std::size_t k = 0; k < program.outputs().size(); ++k) {
    const ValueId v = program.outputs()[k];
    at::Tensor g;
    if (v == layout_.batch.loss) {  // the loss of this share, weighted by its share of the batch
      const double w = store_.weight(a.microbatch, a.stage, replica_);
      g = at::full_like(act.outputs[k].toTensor(), w * settings_.grad_scale);
    }
    add_into(g, store_.take_gradient(v, a.microbatch, replica_));
    out_grads.push_back(g.defined() ? c10::IValue(g) : c10::IValue());
  }
  CONVEYOR_ASSIGN_OR_RETURN(std::vector<c10::IValue> in_grads, split ? program.backward_input(act, std::move(out_grads))
                                                                     : program.backward(act, std::move(out_grads)));
  if (split) activations_[{a.stage, a.microbatch}] = std::move(act);
  for (std::size_t k = 0; k < program.inputs().size(); ++k) {
    const ValueId v = program.inputs()[k];
    if (!in_grads[k].isTensor()) continue;
    const at::Tensor& g = in_grads[k].toTensor();
    if (!g.defined()) continue;
    if (auto input = layout_.batch.input_index.find(v); input != layout_.batch.input_index.end()) {
      store_.add_input_gradient(input->second, a.microbatch, a.stage, replica_, g);  // a graph input's
      continue;
    }
    // To the producing replicas this one exchanges with: here, and at the stage's send
    // action to those in other processes.
    const int s = layout_.batch.producer[v];
    bool local = false, remote = false;
    for (int j : layout_.partners(a.stage, replica_, s)) (placement_.here(s, j) ? local : remote) = true;
    if (local) store_.add_gradient(v, a.microbatch, a.stage, replica_, g);
    if (remote && remote_ != nullptr) remote_->hand_back(a.stage, a.microbatch, replica_, v, g);
  }
  return Status::ok();
}

Status StageReplica::backward_weight(const Action& a) {
  auto it = activations_.find({a.stage, a.microbatch});
  if (it == activations_.end() || !it->second.deferred) {
    return Status(ErrorCode::kInternal, "weight gradient before the input gradient");
  }
  graph::StageActivation act = std::move(it->second);
  activations_.erase(it);
  return programs_.at(a.stage)->backward_weight(act);
}

}  // namespace conveyor::runtime
