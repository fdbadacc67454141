// Sums a pipeline's gradients over the replicas that computed them, so the user's `.grad`
// (replica 0's) holds the whole batch's gradient after a step.
//
// Each replicated stage's parameters are cut into buckets (consecutive parameters of one
// dtype, at most bucket_bytes, last layers first, as backward produces them). In a replica's
// last backward of the step for the stage (B, or W when the backward is split), a hook after
// each gradient accumulation counts the bucket's parameters; when every replica here has
// accumulated all of a bucket's, the bucket is reduced on the communication thread while
// backward goes on. The stage's allreduce action reduces what is left. A stage whose
// replicas span processes then sums each bucket across them (its group: UCX or NCCL),
// issued from the communication thread in bucket order without waiting; the step waits for
// those sums at its end. Parameters several stages read (tied weights) are summed after the
// step, within the process and across processes.
//
/// @note Thread affinity: the accumulation hooks run on the autograd engine's threads,
/// reductions on the communication thread, begin_step/finish_* on the caller's; the
/// buckets' state is under the reducer's own lock.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "runtime/device_streams.h"
#include "runtime/pipeline_layout.h"
#include "runtime/placement.h"
#include "runtime/process_group.h"
#include "scheduler/simulator.h"
#include "transport/transport.h"

namespace conveyor::runtime {

/// Replica `replica`'s tensor bound to `name` (null: none).
using TensorLookup = std::function<const at::Tensor*(int replica, const std::string& name)>;

/// The gradient sums of one pipeline across its replicas and processes.
class GradientReducer {
 public:
  /// Where the sums beyond this process go.
  struct Groups {
    /// [stage]: the group summing the stage's buckets across its processes (null: the
    /// stage runs in one process, or not here).
    std::vector<std::shared_ptr<transport::Collective>> across;
    /// The job's processes: tied weights read in several processes are summed over all of
    /// them. Null in one process.
    ProcessGroup* processes = nullptr;
    /// How long the step waits for the sums across processes.
    std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  };

  /// Sizes of a tensor by name (null: unknown).
  using SizesLookup = std::function<const std::vector<std::int64_t>*(const std::string&)>;
  /// Buckets the stages' parameters and hooks their accumulation. `released`: the sizes of
  /// a tensor this process released (null: held), whose `.grad` is never written here.
  /// `declared`: every parameter's sizes as the graph declares them, which the buckets are
  /// cut by (a tensor may still be empty here, released under the plan this one replaced);
  /// null: the tensors' own.
  static Result<std::unique_ptr<GradientReducer>> create(const PipelineLayout& layout, const Placement& placement,
                                                         TensorLookup tensors, PipelineStreams* streams,
                                                         std::int64_t bucket_bytes, Groups groups, SizesLookup released,
                                                         SizesLookup declared = nullptr);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// A new step: every bucket waits for its accumulations again.
  void begin_step();
  /// Replica `replica` of `stage` starts (true) or ends (false) its last backward of the
  /// step for the stage: its accumulations now count towards the buckets.
  void final_pass(int stage, int replica, bool on);
  /// The stage's allreduce (communication thread): reduces the buckets not reduced during
  /// backward; with streams, after `final_done` (each local replica's last backward).
  Status finish_stage(int stage, const std::vector<c10::Event*>& final_done);
  /// Whether some bucket still has its sum across processes in flight.
  bool across_pending() const;
  /// The end of a step across processes: waits (the host, on the sums' completion, within
  /// the timeout) for the sums across processes. The device may still be writing them.
  Status wait_across();
  /// After the device is done: the sums across processes become the user's gradients (a
  /// parameter no process had a gradient for keeps none).
  Status write_across();
  /// Tied weights: their gradients summed over every replica (in this process), then
  /// across the processes that read them.
  Status reduce_tied();

  /// The step's reductions as measured spans: buckets reduced during backward (each on its
  /// stage's collective track, per local replica) and sums across processes. `device_time`
  /// turns an event into seconds from the step's start (streams only).
  void add_spans(std::vector<scheduler::Span>& spans, std::chrono::steady_clock::time_point start,
                 const std::function<double(const c10::Event*)>& device_time) const;
  /// The allreduce actions' events on the collective stream, [stage] (streams only).
  std::pair<c10::Event*, c10::Event*> allreduce_events(int stage) const;
  /// (buckets, reduced during backward) of the last step.
  std::pair<int, int> counts() const;

 private:
  struct Bucket;
  struct HookTarget;
  struct Accumulated;
  GradientReducer(const PipelineLayout& layout, const Placement& placement);
  void accumulated(int stage, int bucket, int replica);  // the hook (autograd engine)
  void reduce_early(int stage, int bucket);              // posted to the communication thread
  Status reduce_bucket(int stage, int b);                // communication thread
  void issue_across(int stage);                          // communication thread
  Result<at::Tensor> sum_replicas(const std::vector<std::string>& names, const std::vector<int>& members,
                                  const std::vector<std::shared_ptr<transport::Collective>>& group,
                                  bool with_count = false);
  void write_back(const std::vector<std::string>& names, const at::Tensor& flat, bool as_views = false);
  std::vector<std::vector<std::string>> make_buckets(const std::vector<std::string>& names) const;
  std::int64_t numel_of(const std::string& name) const;

  const PipelineLayout& layout_;
  const Placement& placement_;
  TensorLookup tensors_;
  PipelineStreams* streams_;
  std::int64_t bucket_bytes_ = 4 << 20;
  Groups groups_;
  SizesLookup released_, declared_;
  std::vector<std::vector<std::shared_ptr<transport::Collective>>> local_groups_;  // [stage]: over its local replicas
  std::vector<std::shared_ptr<transport::Collective>> tied_group_;               // over every replica index
  std::unique_ptr<std::atomic<bool>[]> final_pass_;  // [stage * most_replicas + replica]
  std::shared_ptr<HookTarget> hook_target_;
  std::vector<std::pair<at::Tensor, Accumulated*>> installed_;

  mutable std::mutex mu_;  // the buckets, the collective event pools, error_
  std::vector<std::vector<Bucket>> buckets_;  // [stage]
  std::vector<std::pair<c10::Event*, c10::Event*>> allreduce_events_;  // [stage]
  std::vector<int> next_across_;  // [stage]: the next bucket to sum across processes (communication thread)
  Status error_ = Status::ok();
  // The sums across processes in flight (their callbacks run on the transport's threads).
  struct Across;
  std::shared_ptr<Across> across_;
};

}  // namespace conveyor::runtime
