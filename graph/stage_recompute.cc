// Activation recomputation for a stage: a forward that keeps only what a second forward
// needs, and that second forward just before the backward (docs/design.md, "Recomputation").
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "graph/executor.h"

namespace conveyor::graph {

Result<StageActivation> StageProgram::forward_for_recompute(std::vector<c10::IValue> inputs,
                                                            std::optional<std::uint64_t> random_seed) const {
  // The inputs the stage writes in place, as they are before it runs: the second forward
  // must see what the first saw.
  std::vector<c10::IValue> kept = inputs;
  for (std::size_t i : inputs_written_) {
    if (i < kept.size() && kept[i].isTensor()) kept[i] = kept[i].toTensor().clone();
  }
  CONVEYOR_ASSIGN_OR_RETURN(StageActivation act, forward(std::move(inputs), random_seed));
  // The outputs without their autograd graph: dropping it frees every saved tensor. They
  // keep requires_grad, so the stages that read them still compute and send gradients.
  for (auto& out : act.outputs) {
    if (!out.isTensor() || !out.toTensor().defined()) continue;
    const at::Tensor& t = out.toTensor();
    at::Tensor detached = t.detach();
    if (t.requires_grad()) detached.requires_grad_(true);
    out = detached;
  }
  act.inputs = std::move(kept);
  act.needs_recompute = true;
  return act;
}

Status StageProgram::recompute(StageActivation& activation, std::optional<std::uint64_t> random_seed) const {
  if (!activation.needs_recompute) return Status::ok();
  // The buffers the forward writes (running statistics): updated by the first forward,
  // put back after this one so they are updated once.
  std::vector<std::pair<at::Tensor, at::Tensor>> buffers;
  for (const auto& name : buffers_written_) {
    if (const at::Tensor* live = executor_->tensor(name)) buffers.emplace_back(*live, live->clone());
  }
  auto again = forward(activation.inputs, random_seed);
  {
    // Through a view with a version counter of its own: the new autograd graph saved the
    // buffers (BatchNorm keeps its running statistics for an evaluation-mode backward, which
    // a training step never runs), and bumping theirs would fail its backward.
    at::NoGradGuard no_grad;
    for (auto& [live, before] : buffers) live.variable_data().copy_(before);
  }
  if (!again.is_ok()) return again.status();
  activation = std::move(*again);
  return Status::ok();
}

}  // namespace conveyor::graph
