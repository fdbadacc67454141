// One pipelined training step: a captured graph cut into stages, each stage run by one or
// more replicas, its batch sliced into microbatches and each microbatch into one share per
// replica, the schedule's action lists walked by the replicas' actors (runtime/coordinator.h).
//
// PipelineStep only wires and runs. The owners of a step's state, each with its own lock:
// - PipelineLayout / BatchLayout: the immutable shape (stages, replicas, where the batch is);
// - Placement: which process runs each replica, what crosses between processes;
// - ValueStore: the step's values and gradients between stages;
// - StageReplica: one replica's compute (programs, streams, autocast, seeded draws);
// - GradientReducer: the replicas' gradient sums, in buckets during backward;
// - RemoteExchange: messages between processes, in the wire format;
// - ModelState: the replicas' buffers, and what this process holds of the model.
// docs/design.md ("A pipelined step") says how a step flows between them, and
// docs/thread_model.md on which threads.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/coordinator.h"
#include "runtime/device_streams.h"
#include "runtime/loss_reduction.h"
#include "runtime/model_state.h"
#include "common/recomputation.h"
#include "common/status.h"
#include "graph/executor.h"
#include "runtime/process_group.h"
#include "runtime/step_run.h"
#include "trace/simulation_trace.h"

namespace conveyor::runtime {

/// What one step returns: the batch's loss and the measured actions.
struct StepResult {
  at::Tensor loss;                  ///< the batch's loss: microbatch losses weighted by size, detached
  runtime::RunResult measured;    ///< every action's measured span
  /// Gradient buckets of replicated stages, and how many of them were reduced while the
  /// stage's last backward was still running (the rest at the stage's allreduce).
  int buckets = 0, buckets_reduced_during_backward = 0;
};

/// How a pipeline is built: replicas, buckets, threads, processes, transport, timeout, seed.
struct PipelineOptions {
  /// Replicas per rank (a rank's stages all have its count); empty: one each.
  std::vector<int> replicas;
  /// Per rank, each replica's weight in splitting a microbatch (a plan's shares: faster
  /// devices take more samples); empty, or empty for a rank: even shares.
  std::vector<std::vector<double>> shares;
  /// Gradients are summed across replicas in buckets of at most this many bytes.
  std::int64_t bucket_bytes = 4 << 20;
  /// Torch intra-op threads of each replica's compute thread; 0: the caller's count shared
  /// out between the replicas (at least one each).
  int intra_op_threads = 0;
  /// The simulator's result for the plan this pipeline runs (partitioner::Plan::simulate),
  /// for the live profile's comparison; none: measured figures only.
  std::optional<scheduler::SimulationResult> predicted;
  /// Many processes (docs/thread_model.md, "Many processes"): the job's processes and, per
  /// pipeline rank and replica, the process that runs it (this process runs the replicas it
  /// is given). A stage whose replicas run in several processes sums its gradients across
  /// them. `rank_process` is the short form: every replica of rank r on process
  /// rank_process[r]. None: this process runs every replica.
  std::shared_ptr<ProcessGroup> processes;
  std::vector<std::vector<int>> replica_process;
  std::vector<int> rank_process;
  /// How activations and gradients cross between processes: over UCX (host memory, any
  /// device; GPU tensors are copied to the host and back) or over NCCL (GPU memory: a
  /// two-member NCCL group per direction between two processes, headers over UCX; needs
  /// the model on a CUDA GPU, one GPU per process).
  enum class Transport { kUcx, kNccl } transport = Transport::kUcx;
  /// A step that does not finish within this fails, naming where each replica waits.
  std::chrono::milliseconds step_timeout{std::chrono::minutes(10)};
  /// Asked about every 100 ms while a step waits for its replicas: true fails the step
  /// (kInterrupted), and the job when it spans processes. The bindings run Python's signal
  /// handlers there, so Ctrl-C stops a step.
  std::function<bool()> interrupted;
  /// Random operators (dropout) of the forward of microbatch m of stage s, replica i, in
  /// step k draw from a generator seeded with a hash of (seed, k, s, m, i): the same draws
  /// whatever the threads' timing and whichever process runs the replica. None: drawn from
  /// torch's global CPU generator when the pipeline is made (so torch.manual_seed decides);
  /// across processes, process 0's.
  std::optional<std::uint64_t> seed;
  /// Per stage: how it recomputes its activations (kFull: keeps only the stage's inputs
  /// between its forward and its backward and runs the forward again just before the
  /// backward; kSelective: runs its cheap operators again); empty or shorter: the stages
  /// beyond keep theirs.
  std::vector<Recomputation> recompute;
  /// Many processes, a pipeline replacing one placed otherwise (a re-plan): per parameter
  /// and buffer, the processes that hold it whole and current (the old pipeline's readers:
  /// PipelineStep::readers). Each process then receives from a holder only what its stages
  /// read and it lacks, and keeps everything until the first step releases what it does not
  /// read (ModelState::hand_over). Empty: every tensor goes from its owner to every process.
  std::map<std::string, std::vector<int>> holders;
};

/// One pipelined training step over stages of a graph, run again for every batch.
class PipelineStep {
 public:
  /// `stages`: node lists in pipeline order (a valid partition); `spec`: the schedule
  /// (ranks = stages, or stages / chunks when interleaved).
  static Result<std::unique_ptr<PipelineStep>> create(std::shared_ptr<const graph::GraphExecutor> executor,
                                                      std::vector<std::vector<graph::NodeId>> stages,
                                                      scheduler::ScheduleSpec spec, PipelineOptions options = {});

  /// Runs forward and backward of every microbatch. `inputs` are the whole batch (the
  /// graph's flattened inputs); tensors whose first dimension is the batch are split.
  /// Gradients reach the parameters' `.grad` scaled by `grad_scale` (the incoming loss
  /// gradient, when the caller knows it). With `hold_gradients` they are held instead, and
  /// `.grad` keeps what it had, until apply_held_gradients (a loss whose backward comes
  /// later, with a gradient of its own: torch.autograd's, a GradScaler's).
  Result<StepResult> run(const std::vector<c10::IValue>& inputs, double grad_scale = 1.0, bool hold_gradients = false);
  /// The same over microbatches the caller packed, one list of the graph's flattened inputs
  /// each, as many as the pipeline runs: each may have its own number of samples and its
  /// own symbolic sizes (a sequence length), and its loss weighs by its samples over the
  /// step's. Each is checked against the capture before anything runs.
  Result<StepResult> run_packed(const std::vector<std::vector<c10::IValue>>& microbatches, double grad_scale = 1.0,
                                bool hold_gradients = false);
  /// The forwards alone of the same pipeline (an evaluation): every microbatch through the
  /// same stages, replicas and processes under no_grad, each rank its stages in order, nothing
  /// kept for a backward and no gradient touched; returns the batch's loss as run() does
  /// (buffers written in place, a train-mode BatchNorm's statistics, are handed on as after a
  /// step). Its measurement is returned, not added to the live profile or the trace.
  Result<StepResult> evaluate(const std::vector<c10::IValue>& inputs);
  /// What the next step's random operators draw from: the job's seed, and the step's number
  /// in the job (the draws of step k are the same whichever pipeline runs it, so a job
  /// resumed from a checkpoint, or switched to another capture of the same plan, draws as
  /// one that never stopped). Without it, the seed given when the pipeline was made and the
  /// pipeline's own count of steps.
  void set_draws(std::uint64_t seed, std::uint64_t next_step);
  /// The gradients the last run held (hold_gradients), taken: each call to run holds its own.
  std::shared_ptr<HeldGradients> take_held_gradients();
  /// The last run's gradients of the graph's inputs, taken: per input that required a
  /// gradient, the whole batch's (weighted as the loss's shares, times grad_scale, on every
  /// process); undefined for the others, and for every input of a packed step.
  std::vector<at::Tensor> take_input_gradients();

  /// Many processes: every parameter and buffer becomes its owner's (the process of the
  /// first stage that reads it), on every process, and whole: while it trains, a process
  /// holds only what its stages read (the rest has 0 elements until this brings it back,
  /// and the next step releases it again). Collective: every process calls it (the pipeline
  /// does at creation; conveyor.Module's state_dict() and load_state_dict() do).
  Status gather_state();
  /// Many processes: each parameter and buffer the pipeline reads, with the process that
  /// owns it (its first reader's); empty in one process.
  std::vector<std::pair<std::string, int>> owners() const;
  /// Many processes: per parameter and buffer, the processes whose stages read it (what a
  /// pipeline that replaces this one passes as PipelineOptions::holders); empty in one process.
  std::map<std::string, std::vector<int>> readers() const;
  /// The bytes of parameters and buffers this process received when the pipeline was made
  /// from holders (PipelineOptions::holders): what a re-plan moved here.
  std::int64_t handed_over_bytes() const;
  /// How long receiving and sending them took (seconds).
  double handed_over_s() const;
  /// The samples each replica of `stage` runs of a microbatch of `length` (its rank's shares).
  std::vector<std::int64_t> share_lengths(int stage, std::int64_t length) const;
  /// How the loss combines the samples, which decides each share's weight.
  const LossReductionFound& loss_reduction() const;

  /// The last step's gradient buckets of replicated stages, and how many were reduced while
  /// their stage's last backward still ran.
  std::pair<int, int> last_reduction() const;
  /// Per (rank, replica) run in this process: the most host memory its compute held at once
  /// during the last step (torch's CPU allocator, runtime/memory_meter.h: activations,
  /// gradients, working memory; not the parameters and optimizer state it found). Empty
  /// when the meter cannot count (another CPU allocator is in place).
  std::map<std::pair<int, int>, std::int64_t> memory_peaks() const;

  /// The last step's measured actions. On a device with streams, compute actions and
  /// reductions carry the device's times (from events on their streams), not the host's.
  const runtime::RunResult& last_step() const;

  /// Every step's measured actions reach the pipeline's PartitionerActor: its comparison
  /// of the measured steps with the prediction, per stage.
  Result<runtime::ProfileReport> profile_report() const;
  /// From now on the live profile compares the steps that follow with `predicted` (the
  /// running plan priced again on corrected inputs: a re-planning window).
  void set_prediction(scheduler::SimulationResult predicted);
  /// The schedule this pipeline runs (ranks, chunks, microbatches).
  const scheduler::ScheduleSpec& spec() const;

  /// Writes the last step's measured actions as a Perfetto trace: a track per rank and
  /// replica with its compute, send and collective streams, flows from each transfer to its
  /// consumer; `markers` (a switch of plan before the step) as instant events.
  Status write_trace(const std::string& path, const std::vector<trace::Marker>& markers = {}) const;
  /// The last step's measured spans of this process's replicas, with the step's start on the
  /// wall clock (trace/span_record.h): what process 0 merges into the job's trace.
  std::string trace_record() const;
  /// Writes one trace of the job's last step from every process's `trace_record()` (in any
  /// order; this process's own among them): every replica's tracks, and a flow from each
  /// send to its consumer in whichever process it runs.
  Status write_job_trace(const std::string& path, const std::vector<std::string>& records,
                         const std::vector<trace::Marker>& markers = {}) const;

 private:
  /// Checks a whole batch against the capture and the pipeline and splits it into the store.
  Status begin_batch(const std::vector<c10::IValue>& inputs);
  /// A step whose store holds its microbatches: runs it and gathers what it measured.
  Result<StepResult> run_begun(double grad_scale, bool hold_gradients, bool forward_only = false);
  struct Impl;
  explicit PipelineStep(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;

 public:
  ~PipelineStep();
};

}  // namespace conveyor::runtime
