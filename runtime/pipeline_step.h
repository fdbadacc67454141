// One pipelined training step in one process: a captured graph cut into stages, its batch
// sliced into microbatches, the schedule's action lists run by scheduler::Runner with each
// F and B bound to the stage's program. Activations and gradients pass between stages in
// memory (zero-copy: producer and consumer share the device). Parameter gradients
// accumulate into the model's own .grad, each microbatch's loss weighted by its share of
// the batch, so a step equals eager training with gradient accumulation over the same
// microbatches.
//
// Zero-bubble schedules split each backward: Bi (StageProgram::backward_input) hands the
// input gradient on at once, W (backward_weight) fills idle time with the weight gradients.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "graph/executor.h"
#include "scheduler/runner.h"

namespace conveyor::runtime {

struct StepResult {
  at::Tensor loss;                  ///< the batch's loss: microbatch losses weighted by size, detached
  scheduler::RunResult measured;    ///< every action's measured span
};

class PipelineStep {
 public:
  /// `stages`: node lists in pipeline order (a valid partition); `spec`: the schedule
  /// (ranks = stages, or stages / chunks when interleaved).
  static Result<std::unique_ptr<PipelineStep>> create(std::shared_ptr<const graph::GraphExecutor> executor,
                                                      std::vector<std::vector<graph::NodeId>> stages,
                                                      scheduler::ScheduleSpec spec);

  /// Runs forward and backward of every microbatch. `inputs` are the whole batch (the
  /// graph's flattened inputs); tensors whose first dimension is the batch are split.
  /// Gradients reach the parameters scaled by `grad_scale` (the incoming loss gradient).
  Result<StepResult> run(const std::vector<c10::IValue>& inputs, double grad_scale = 1.0);

  /// Writes the last step's measured actions as a Perfetto trace: a track per rank with its
  /// compute, send and collective streams, flows from each transfer to its consumer.
  Status write_trace(const std::string& path) const;

 private:
  struct Impl;
  explicit PipelineStep(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;

 public:
  ~PipelineStep();
};

}  // namespace conveyor::runtime
