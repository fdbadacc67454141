// A step's values and gradients between stages: the one place a value goes from the replica
// that produced it (a forward here, or a message from another process) to every replica
// that reads it, and a gradient from the replica that computed it back to the producer's.
// The runner's channels only say when to read; what is read, and where on the device it
// is ready, lives here.
//
// Between stages with as many replicas, replica i's value goes to replica i, zero-copy;
// between different counts the producers' shares are joined along the value's batch
// dimension (on the first reader's recv stream) and each reader takes its own share of
// that, and the readers' gradients are added into one whole-microbatch gradient (on their
// send streams) that each producer takes its share of. On a device with streams every
// entry carries the event after which it is ready, and a reader's compute stream waits on
// it (never the host).
//
/// @note Thread-safe: every method takes the store's lock. Reads and writes name the
/// reading or writing replica, whose compute stream must be current on the calling thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "common/status.h"
#include "runtime/device_streams.h"
#include "runtime/pipeline_layout.h"

namespace conveyor::runtime {

/// `acc` += `g`, where an undefined tensor is nothing yet (a gradient no one computed).
void add_into(at::Tensor& acc, const at::Tensor& g);

/// The values and gradients of one step, by (value, microbatch).
class ValueStore {
 public:
  /// `streams`: the pipeline's streams on a device that has them; null on the CPU.
  ValueStore(const PipelineLayout& layout, PipelineStreams* streams) : layout_(layout), streams_(streams) {}

  /// A new step over `inputs` (the graph's flattened inputs, the whole batch of `batch`
  /// samples): the batched ones are split into the schedule's microbatches. Drops what
  /// the last step left.
  Status begin_step(const std::vector<c10::IValue>& inputs, std::int64_t batch);
  /// A new step over microbatches the caller packed (each the graph's flattened inputs, of
  /// `rows[k]` samples), as many as the schedule's. Drops what the last step left.
  Status begin_packed_step(const std::vector<std::vector<c10::IValue>>& microbatches,
                           const std::vector<std::int64_t>& rows);
  /// Drops every value and gradient of the step (once the device is done with them).
  void end_step();

  /// The values `ids` of microbatch `mb` as replica `i` of `stage` sees them: its share of
  /// graph inputs and of joined values.
  Result<std::vector<c10::IValue>> read(const std::vector<graph::ValueId>& ids, int mb, int stage, int i);
  /// Replica `i` of `stage` produced `values` (for `ids`) of microbatch `mb`, ready after
  /// `ready` on the device (null: at once). The loss is kept for the step's total.
  void put(const std::vector<graph::ValueId>& ids, std::vector<c10::IValue> values, int mb, int stage, int i,
           c10::Event* ready);
  /// The same for values that arrived from replica `i` of `stage` in another process: they
  /// are ready after what is queued now on that replica's compute stream here (current).
  void put_arrived(const std::vector<graph::ValueId>& ids, std::vector<c10::IValue> values, int mb, int stage, int i);
  /// What replica `i` of the producing stage made of value `v` (to send it elsewhere).
  c10::IValue produced(graph::ValueId v, int mb, int i);

  /// Adds the gradient `g` that replica `i` of reading `stage` computed for its input `v`
  /// (on that replica's compute stream, current).
  void add_gradient(graph::ValueId v, int mb, int stage, int i, const at::Tensor& g);
  /// The gradient of output `v` for replica `i` of its producing stage: what every reader
  /// handed back (undefined: none). Taken: a second call returns what arrived since. Every
  /// reader of `v` has run its backward by then (the producer's waits for their gradients),
  /// so the store lets go of replica `i`'s `v` (the producer's activation keeps what its own
  /// backward needs): values between stages live from their forward to their producer's
  /// backward, as the schedule's memory model has them, not to the end of the step.
  at::Tensor take_gradient(graph::ValueId v, int mb, int i);

  /// Keeps the gradient `g` that replica `i` of `stage` computed for graph input `input`, its
  /// share of microbatch `mb` (an input the caller passed requiring a gradient).
  void add_input_gradient(int input, int mb, int stage, int i, const at::Tensor& g);
  /// Per graph input, its gradient this step, taken: the kept shares' gradients put in their
  /// places along the batch (summed where an input has no batch dimension or several stages
  /// read it), in (input, microbatch, stage, replica) order; zeros where none was computed
  /// here, undefined for an input that needs none. After the device finished the step.
  std::vector<at::Tensor> take_input_gradients();

  /// The weight of replica `i` of `stage`'s share of microbatch `mb` in the step's loss: its
  /// fraction of the batch where the loss is a mean over the samples, 1 where it is a sum.
  double weight(int mb, int stage, int i) const;
  /// Each share's loss this step, by (microbatch, replica): only the shares run here.
  std::map<std::pair<int, int>, at::Tensor> losses() const;

 private:
  using Key = std::pair<graph::ValueId, int>;  // (value, microbatch)
  ReplicaStreams* streams_of(int stage, int i) const;
  at::Tensor zeros_like_joined(graph::ValueId v, int mb) const;  // holds mu_
  // Elements per sample along `v`'s batch dimension: fixed at capture, or for a batch
  // flattened with sizes known per call (batch_scale 0), `t`'s size there over its `samples`.
  std::int64_t per_sample(graph::ValueId v, const at::Tensor& t, std::int64_t samples) const;
  void put_locked(const std::vector<graph::ValueId>& ids, std::vector<c10::IValue>& values, int mb, int stage, int i,
                  c10::Event* ready);
  void release_read_locked(graph::ValueId v, int mb, int i);  // replica i's v of mb: read by all

  const PipelineLayout& layout_;
  PipelineStreams* streams_;
  mutable std::mutex mu_;
  std::int64_t batch_ = 0;
  std::vector<std::int64_t> micro_length_;               // samples per microbatch
  std::vector<std::vector<c10::IValue>> micro_inputs_;    // [mb][graph input], whole microbatch
  std::map<Key, std::vector<c10::IValue>> values_;        // per producing replica
  std::map<Key, std::vector<c10::Event*>> value_ready_;   // per producing replica
  std::map<Key, c10::IValue> joined_;                     // the producers' shares joined
  std::map<Key, c10::Event*> joined_ready_;
  std::map<Key, std::vector<at::Tensor>> grads_;          // per producing replica
  std::map<Key, std::vector<c10::Event*>> grad_ready_;
  std::map<Key, at::Tensor> joined_grads_;                // whole-microbatch gradients
  std::map<Key, c10::Event*> joined_grad_ready_;
  std::map<std::pair<int, int>, at::Tensor> losses_;      // (mb, replica)
  std::vector<c10::IValue> inputs_wanting_grad_;          // per graph input: the caller's, or none
  std::map<std::tuple<int, int, int, int>, at::Tensor> input_grads_;  // (input, mb, stage, replica)
};

}  // namespace conveyor::runtime
