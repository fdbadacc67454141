// Values and gradients between processes: a pipeline's messages to the replicas that other
// processes run, and their messages to this one, landing in the same ValueStore as local
// values (docs/thread_model.md, "Many processes").
//
// A send action sends what other processes read of the stage's outputs (or the gradients of
// its inputs that their replicas produced) straight to each of them, one message per
// (microbatch, stage, replica), tagged with them; a receive action asks for the messages its
// stage needs from other processes, each received once per process whichever replica or
// stage asks first. On a device with streams a message leaves after the compute that made it
// and lands on the sending replica's compute stream here, whose events readers wait on.
//
/// @note send() runs on the communication thread, receive() on a replica's, arrivals on the
/// transport's; the exchange's state is under its own lock.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "runtime/device_streams.h"
#include "runtime/pipeline_layout.h"
#include "runtime/placement.h"
#include "runtime/value_store.h"
#include "scheduler/schedule.h"
#include "transport/transport.h"

namespace conveyor::runtime {

/// Values as a message of tensors: a header of (kind, requires_grad) per value, then one
/// tensor per value (scalars as 0-dim tensors). Errors name a value that is neither.
Result<std::vector<at::Tensor>> to_wire(const std::vector<c10::IValue>& values, const std::vector<graph::ValueId>& ids);
/// The values of a message of `expected` values; tensors are moved to `device` (none: as they are).
Result<std::vector<c10::IValue>> from_wire(const std::vector<at::Tensor>& message, std::size_t expected,
                                           const std::optional<c10::Device>& device);
/// The tag of a pipeline message: kind (1 activations, 2 gradients), microbatch, and the
/// sending stage and replica (below transport::kCollectiveTagBit).
transport::Tag message_tag(int kind, int mb, int stage, int replica);

/// The messages of one pipeline between this process and the others.
class RemoteExchange {
 public:
  RemoteExchange(const PipelineLayout& layout, const Placement& placement, ValueStore& store, PipelineStreams* streams,
                 std::shared_ptr<transport::Endpoint> endpoint);
  ~RemoteExchange();
  RemoteExchange(const RemoteExchange&) = delete;
  RemoteExchange& operator=(const RemoteExchange&) = delete;

  /// A new step: nothing received, nothing failed.
  void begin_step();
  /// Replica `i` of reading `stage` computed `g`, the gradient of input `v` of microbatch
  /// `mb`, for a producer in another process: it leaves at the stage's send action.
  void hand_back(int stage, int mb, int i, graph::ValueId v, const at::Tensor& g);
  /// A send action of replica `i` (communication thread): what other processes read of it
  /// goes to them, one message per process.
  Status send(int i, const scheduler::Action& a);
  /// A receive action of replica `i`: `arrived` runs once every message from other processes
  /// that its stage reads for the microbatch is in the store (with the first error, if any).
  void receive(int i, const scheduler::Action& a, std::function<void(Status)> arrived);
  /// The first failed send of the step (a lost peer); OK when none failed.
  Status send_error() const;

 private:
  struct Arrival {
    bool posted = false, done = false;
    Status error = Status::ok();
    std::vector<std::function<void(Status)>> waiters;
  };
  // Keeps callbacks that outlive the exchange harmless: they find `self` null.
  struct Alive {
    std::mutex mu;
    RemoteExchange* self = nullptr;
  };
  Status apply(bool grad, int stage, int replica, int mb, const std::vector<at::Tensor>& message);

  const PipelineLayout& layout_;
  const Placement& placement_;
  ValueStore& store_;
  PipelineStreams* streams_;
  std::shared_ptr<transport::Endpoint> endpoint_;
  std::shared_ptr<Alive> alive_;
  mutable std::mutex mu_;
  std::map<std::tuple<int, int, int>, std::map<graph::ValueId, at::Tensor>> handed_back_;  // (stage, mb, replica)
  std::map<std::pair<int, transport::Tag>, Arrival> arrivals_;  // (from process, tag), this step
  Status send_error_ = Status::ok();
};

}  // namespace conveyor::runtime
