#include "runtime/pipeline_step.h"

#include <ATen/ATen.h>

#include <map>
#include <mutex>
#include <set>

#include "graph/partition.h"
#include "trace/simulation_trace.h"

namespace conveyor::runtime {

using graph::NodeId;
using graph::ValueId;
using scheduler::Action;
using scheduler::ActionKind;

struct PipelineStep::Impl {
  std::shared_ptr<const graph::GraphExecutor> executor;
  std::vector<std::shared_ptr<const graph::StageProgram>> programs;
  scheduler::Schedule schedule;
  std::vector<bool> batched_input;  // per graph input: split along dim 0
  std::map<ValueId, int> input_index;
  ValueId loss = -1;

  // Per step:
  std::mutex mu;
  std::vector<std::vector<c10::IValue>> micro_inputs;  // [mb][graph input]
  std::vector<double> weight;                           // each microbatch's share of the batch
  std::map<std::pair<ValueId, int>, c10::IValue> values;  // (value, microbatch) -> tensor
  std::map<std::pair<ValueId, int>, at::Tensor> grads;
  std::map<std::pair<int, int>, graph::StageActivation> activations;  // (stage, microbatch)
  std::vector<at::Tensor> losses;
  double grad_scale = 1;
  scheduler::RunResult last;  // the last step's measured actions

  Status forward(const Action& a) {
    const auto& program = *programs[a.stage];
    std::vector<c10::IValue> in;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (ValueId v : program.inputs()) {
        auto gi = input_index.find(v);
        if (gi != input_index.end()) {
          in.push_back(micro_inputs[a.microbatch][gi->second]);
        } else {
          auto it = values.find({v, a.microbatch});
          if (it == values.end()) {
            return Status(ErrorCode::kInternal, "value " + std::to_string(v) + " of microbatch " +
                                                    std::to_string(a.microbatch) + " was not produced yet");
          }
          in.push_back(it->second);
        }
      }
    }
    CONVEYOR_ASSIGN_OR_RETURN(graph::StageActivation act, program.forward(std::move(in)));
    std::lock_guard<std::mutex> lock(mu);
    for (std::size_t i = 0; i < program.outputs().size(); ++i) {
      const ValueId v = program.outputs()[i];
      values[{v, a.microbatch}] = act.outputs[i];
      if (v == loss) losses[a.microbatch] = act.outputs[i].toTensor().detach();
    }
    activations[{a.stage, a.microbatch}] = std::move(act);
    return Status::ok();
  }

  // B (whole backward) or Bi (input half; the activation stays for W).
  Status backward(const Action& a, bool split) {
    const auto& program = *programs[a.stage];
    graph::StageActivation act;
    std::vector<c10::IValue> out_grads;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = activations.find({a.stage, a.microbatch});
      if (it == activations.end()) return Status(ErrorCode::kInternal, "backward before forward");
      act = std::move(it->second);
      activations.erase(it);
      for (std::size_t i = 0; i < program.outputs().size(); ++i) {
        const ValueId v = program.outputs()[i];
        at::Tensor g;
        if (v == loss) {
          const at::Tensor& l = act.outputs[i].toTensor();
          g = at::full_like(l, weight[a.microbatch] * grad_scale);
        }
        auto git = grads.find({v, a.microbatch});
        if (git != grads.end()) {
          g = g.defined() ? g + git->second : git->second;
          grads.erase(git);
        }
        out_grads.push_back(g.defined() ? c10::IValue(g) : c10::IValue());
      }
    }
    CONVEYOR_ASSIGN_OR_RETURN(std::vector<c10::IValue> in_grads,
                              split ? program.backward_input(act, std::move(out_grads))
                                    : program.backward(act, std::move(out_grads)));
    std::lock_guard<std::mutex> lock(mu);
    if (split) activations[{a.stage, a.microbatch}] = std::move(act);
    for (std::size_t i = 0; i < program.inputs().size(); ++i) {
      const ValueId v = program.inputs()[i];
      if (input_index.count(v) || !in_grads[i].isTensor()) continue;
      const at::Tensor& g = in_grads[i].toTensor();
      if (!g.defined()) continue;
      auto [it, fresh] = grads.emplace(std::pair{v, a.microbatch}, g);
      if (!fresh) it->second = it->second + g;
    }
    return Status::ok();
  }

  // W: the weight half of the microbatch's split backward.
  Status backward_weight(const Action& a) {
    graph::StageActivation act;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = activations.find({a.stage, a.microbatch});
      if (it == activations.end() || !it->second.deferred) {
        return Status(ErrorCode::kInternal, "weight gradient before the input gradient");
      }
      act = std::move(it->second);
      activations.erase(it);
    }
    return programs[a.stage]->backward_weight(act);
  }
};

PipelineStep::PipelineStep(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PipelineStep::~PipelineStep() = default;

Result<std::unique_ptr<PipelineStep>> PipelineStep::create(std::shared_ptr<const graph::GraphExecutor> executor,
                                                           std::vector<std::vector<NodeId>> stages,
                                                           scheduler::ScheduleSpec spec) {
  const graph::Graph& g = executor->graph();
  CONVEYOR_RETURN_IF_ERROR(graph::check_partition(g, stages));
  if (spec.stages() != static_cast<int>(stages.size())) {
    return Status(ErrorCode::kInvalidArgument, "the schedule has " + std::to_string(spec.stages()) +
                                                   " stages but the partition " + std::to_string(stages.size()));
  }
  if (g.outputs.size() != 1 || g.values[g.outputs[0]].kind != graph::ValueKind::kTensor ||
      !g.values[g.outputs[0]].shape.empty()) {
    return Status(ErrorCode::kInvalidArgument,
                  "the model's forward must return one scalar loss to be trained pipelined (it returns " +
                      std::to_string(g.outputs.size()) +
                      " values); compute the loss inside forward, or wrap the model so that it does");
  }
  auto impl = std::make_unique<Impl>();
  impl->executor = executor;
  impl->loss = g.outputs[0];
  for (auto& nodes : stages) {
    CONVEYOR_ASSIGN_OR_RETURN(auto program, executor->stage(nodes));
    impl->programs.push_back(std::move(program));
  }
  for (std::size_t i = 0; i < g.inputs.size(); ++i) {
    const graph::Value& v = g.values[g.inputs[i].value];
    impl->input_index[g.inputs[i].value] = static_cast<int>(i);
    bool batched = false;
    if (v.kind == graph::ValueKind::kTensor && !v.shape.empty() && v.shape[0].is_symbolic()) {
      auto role = g.symbols.find(v.shape[0].symbol);
      batched = role != g.symbols.end() && role->second == "batch";
    }
    impl->batched_input.push_back(batched);
  }
  CONVEYOR_ASSIGN_OR_RETURN(impl->schedule, scheduler::make_schedule(spec));
  return std::unique_ptr<PipelineStep>(new PipelineStep(std::move(impl)));
}

Result<StepResult> PipelineStep::run(const std::vector<c10::IValue>& inputs, double grad_scale) {
  Impl& im = *impl_;
  const int m = im.schedule.spec.microbatches;
  if (inputs.size() != im.batched_input.size()) {
    return Status(ErrorCode::kInvalidArgument, "the model takes " + std::to_string(im.batched_input.size()) +
                                                   " inputs but got " + std::to_string(inputs.size()));
  }
  std::int64_t batch = -1;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (im.batched_input[i] && inputs[i].isTensor()) batch = inputs[i].toTensor().size(0);
  }
  if (batch < 0) return Status(ErrorCode::kInvalidArgument, "no input has a batch dimension to split into microbatches");
  if (batch < m) {
    return Status(ErrorCode::kInvalidArgument, "the batch has " + std::to_string(batch) + " samples, fewer than the " +
                                                   std::to_string(m) + " microbatches; use a larger batch or fewer microbatches");
  }
  im.micro_inputs.assign(static_cast<std::size_t>(m), {});
  im.weight.assign(static_cast<std::size_t>(m), 0);
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::vector<at::Tensor> parts;
    if (im.batched_input[i] && inputs[i].isTensor()) {
      const at::Tensor& t = inputs[i].toTensor();
      if (t.size(0) != batch) {
        return Status(ErrorCode::kInvalidArgument, "input " + std::to_string(i) + " has " + std::to_string(t.size(0)) +
                                                       " samples, input 0 has " + std::to_string(batch));
      }
      parts = t.tensor_split(m, 0);
    }
    for (int mb = 0; mb < m; ++mb) {
      im.micro_inputs[mb].push_back(parts.empty() ? inputs[i] : c10::IValue(parts[mb]));
      if (!parts.empty()) im.weight[mb] = static_cast<double>(parts[mb].size(0)) / static_cast<double>(batch);
    }
  }
  im.values.clear();
  im.grads.clear();
  im.activations.clear();
  im.losses.assign(static_cast<std::size_t>(m), at::Tensor());
  im.grad_scale = grad_scale;
  scheduler::RunnerHooks hooks;
  hooks.compute = [&im](int, const Action& a) -> Status {
    switch (a.kind) {
      case ActionKind::kForward: return im.forward(a);
      case ActionKind::kBackward: return im.backward(a, /*split=*/false);
      case ActionKind::kBackwardInput: return im.backward(a, /*split=*/true);
      case ActionKind::kBackwardWeight: return im.backward_weight(a);
      case ActionKind::kOptimizerStep: return Status::ok();  // the user's optimizer steps after the call
      default: return Status(ErrorCode::kInternal, "not a compute action: " + scheduler::action_text(a));
    }
  };
  scheduler::Runner runner(im.schedule, hooks);
  auto measured = runner.run_step();
  im.values.clear();
  im.activations.clear();
  im.grads.clear();
  if (!measured) return measured.status();
  StepResult out;
  im.last = *measured;
  out.measured = std::move(*measured);
  at::Tensor total;
  for (int mb = 0; mb < m; ++mb) {
    at::Tensor part = im.losses[mb] * im.weight[mb];
    total = total.defined() ? total + part : part;
  }
  out.loss = total;
  return out;
}

Status PipelineStep::write_trace(const std::string& path) const {
  if (impl_->last.spans.empty()) return Status(ErrorCode::kInvalidArgument, "no step has run yet: nothing to trace");
  trace::PerfettoTrace t;
  scheduler::SimulationResult spans;
  spans.spans = impl_->last.spans;
  trace::add_simulation(t, impl_->schedule, spans, "measured");
  return t.write(path);
}

}  // namespace conveyor::runtime
