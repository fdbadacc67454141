// The model's parameters and buffers as the pipeline holds them: the replicas' copies of the
// buffers (refreshed from the user's before each step, their gradients emptied), and across
// processes what this process holds of the model. While it trains, a process keeps only the
// tensors its stages read: the others are released (0 elements; the same Python objects, so
// optimizers and state_dict() still find them) and gather() brings every tensor back whole
// from its owner. Written buffers of stages replicated across processes go from their owner
// to the other processes that read them after every step. A tied parameter that several
// ranks of this process read (on their own threads and device streams) is a leaf of its
// own for every such rank but the first, over the same storage: no two ranks accumulate
// into one `.grad` (which would make the device's accumulation cross streams, and the
// sum's order depend on timing); the step adds the others into the first's.
//
/// @note Runs on the caller's thread, between steps.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <string>
#include <vector>

#include "common/status.h"
#include "graph/executor.h"
#include "runtime/pipeline_layout.h"
#include "runtime/placement.h"
#include "runtime/process_group.h"
#include "transport/endpoint_group.h"

namespace conveyor::runtime {

/// The gradients one step held back from `.grad` until its loss's backward.
class HeldGradients {
 public:
  /// Adds them, times `scale` (a scalar tensor: the loss's incoming gradient), into the
  /// parameters' `.grad`; a second call adds nothing.
  void apply(const at::Tensor& scale);

 private:
  friend class ModelState;
  std::mutex mu_;
  std::vector<std::pair<at::Tensor, at::Tensor>> grads_;  // (parameter, the step's gradient)
};

/// The model's tensors as this process holds them for the pipeline.
class ModelState {
 public:
  /// `executors`: one per replica index (0 is the user's model). `processes`: the job's
  /// processes (null in one process); the buffer groups are made here, collectively.
  static Result<std::unique_ptr<ModelState>> create(const PipelineLayout& layout, const Placement& placement,
                                                    std::vector<std::shared_ptr<const graph::GraphExecutor>> executors,
                                                    std::shared_ptr<ProcessGroup> processes);

  /// The executor replica `replica` of pipeline rank `rank` runs its stages through: the
  /// replica's, or one with leaves of its own for the tied parameters an earlier rank of
  /// this process also reads.
  std::shared_ptr<const graph::GraphExecutor> executor_for(int replica, int rank) const;

  /// Before a step: replicas start from the user's buffers with empty gradients, and this
  /// process holds only what its stages read.
  void begin_step();
  /// After a step's backwards, before the tied parameters' sums over replicas and
  /// processes: each rank's own leaf's gradient is added into its replica's parameter.
  void fold_tied_gradients();
  /// Every parameter and buffer becomes its owner's, whole, on every process (collective).
  Status gather();
  /// Across processes, for a pipeline that replaces one placed otherwise (a re-plan):
  /// `holders` names, per parameter and buffer, the processes that hold it whole and current
  /// (the old pipeline's readers). Each one a process reads here and does not hold arrives
  /// from its lowest holder, point to point; nothing is released (the first step does that,
  /// once every process has what it needs). Collective; returns the bytes received here.
  /// Errors: a tensor no process holds, a lost or silent process (named).
  Result<std::int64_t> hand_over(const std::map<std::string, std::vector<int>>& holders);
  /// Frees what no local stage reads (every replica's handle on it).
  void release();
  /// After a step: written buffers of stages replicated across processes become their
  /// owner's wherever they are read (collective).
  Status sync_buffers();
  /// Sets the user's gradients aside so that a step accumulates into empty `.grad`s.
  void set_gradients_aside();
  /// After such a step: its gradients are held, and `.grad` is what it was before it.
  std::shared_ptr<HeldGradients> hold_step_gradients();
  /// The sizes of a tensor released here (null: held, or nothing is released).
  const std::vector<std::int64_t>* released_sizes(const std::string& name) const;
  /// The sizes the graph declares for a parameter or buffer (null: not one of the graph's).
  const std::vector<std::int64_t>* declared_sizes(const std::string& name) const;

 private:
  ModelState(const PipelineLayout& layout, const Placement& placement) : layout_(layout), placement_(placement) {}
  // Gives the released tensors (or ones still empty from a replaced pipeline) their shapes
  // back (contents: gather's broadcast).
  void materialize();
  std::map<std::string, std::vector<std::int64_t>> declared_;  // every binding's sizes, from the graph
  // `name` becomes `whole` here, on every replica's handle (parameters share it, buffers copy it).
  void take(const std::string& name, const at::Tensor& whole);

  struct NotHere {
    std::string name;
    std::vector<std::int64_t> sizes;
  };
  struct OwnLeaf {  // a rank's leaf of a tied parameter, over the replica's tensor's storage
    int replica;
    std::string name;
    at::Tensor leaf;
  };
  struct BufferGroup {
    std::string name;
    std::shared_ptr<transport::EndpointGroup> group;  // null: this process does not read it
    int root = 0;
  };
  const PipelineLayout& layout_;
  const Placement& placement_;
  std::vector<std::shared_ptr<const graph::GraphExecutor>> executors_;
  std::map<std::pair<int, int>, std::shared_ptr<const graph::GraphExecutor>> rank_executors_;  // (replica, rank)
  std::vector<OwnLeaf> own_leaves_;
  std::shared_ptr<ProcessGroup> processes_;
  std::vector<NotHere> not_here_;
  std::vector<BufferGroup> buffer_groups_;
  bool released_ = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> aside_;  // (parameter, its .grad before the step)
};

}  // namespace conveyor::runtime
