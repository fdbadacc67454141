#include "runtime/pipeline_step.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "actors/coordinator.h"
#include "graph/partition.h"
#include "runtime/device_streams.h"
#include "trace/simulation_trace.h"
#include "transport/inproc.h"

namespace conveyor::runtime {

using graph::NodeId;
using graph::ValueId;
using scheduler::Action;
using scheduler::ActionKind;

namespace {

/// The share of `length` samples that replica `i` of `replicas` takes (tensor_split's rule:
/// the first length % replicas replicas take one more).
struct Share {
  std::int64_t offset = 0, length = 0;
};
Share share_of(std::int64_t length, int replicas, int i) {
  const std::int64_t base = length / replicas, extra = length % replicas;
  return {i * base + std::min<std::int64_t>(i, extra), base + (i < extra ? 1 : 0)};
}

/// The autocast (torch.autocast) of one thread for the device types a model runs on.
struct AutocastState {
  static constexpr std::array<c10::DeviceType, 2> kTypes{c10::DeviceType::CPU, c10::DeviceType::CUDA};
  std::array<bool, 2> enabled{};
  std::array<at::ScalarType, 2> dtype{at::kBFloat16, at::kHalf};

  static AutocastState of_this_thread() {
    AutocastState s;
    for (std::size_t i = 0; i < kTypes.size(); ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(kTypes[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(kTypes[i]);
    }
    return s;
  }
  bool any() const { return enabled[0] || enabled[1]; }
  void apply() const {
    for (std::size_t i = 0; i < kTypes.size(); ++i) {
      at::autocast::set_autocast_enabled(kTypes[i], enabled[i]);
      at::autocast::set_autocast_dtype(kTypes[i], dtype[i]);
    }
  }
};

/// Runs a replica's forward under the caller's autocast, as eager's forward runs under the
/// user's `torch.autocast`; the weight casts it cached go with it (eager clears them when
/// the outermost autocast region ends, so an optimizer step is never served stale copies).
class AutocastScope {
 public:
  explicit AutocastScope(const AutocastState& wanted) : active_(wanted.any()) {
    if (!active_) return;
    previous_ = AutocastState::of_this_thread();
    wanted.apply();
  }
  ~AutocastScope() {
    if (!active_) return;
    at::autocast::clear_cache();
    previous_.apply();
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_;
  AutocastState previous_;
};

void add_into(at::Tensor& acc, const at::Tensor& g) {
  if (!g.defined()) return;
  acc = acc.defined() ? acc + g : g;
}

// Values between processes: a header of (kind, requires_grad) per value, then one tensor per
// value (scalars as 0-dim tensors).
enum WireKind : std::int64_t { kNone, kTensor, kUndefined, kInt, kDouble, kBool };

Result<std::vector<at::Tensor>> to_wire(const std::vector<c10::IValue>& values, const std::vector<ValueId>& ids) {
  std::vector<std::int64_t> header;
  std::vector<at::Tensor> out{at::Tensor()};
  for (std::size_t k = 0; k < values.size(); ++k) {
    const c10::IValue& v = values[k];
    if (v.isTensor() && v.toTensor().defined()) {
      header.insert(header.end(), {kTensor, v.toTensor().requires_grad() ? 1 : 0});
      out.push_back(v.toTensor().detach());
    } else if (v.isTensor() || v.isNone()) {
      header.insert(header.end(), {v.isNone() ? kNone : kUndefined, 0});
      out.emplace_back();
    } else if (v.isInt()) {
      header.insert(header.end(), {kInt, 0});
      out.push_back(at::scalar_tensor(v.toInt(), at::kLong));
    } else if (v.isDouble()) {
      header.insert(header.end(), {kDouble, 0});
      out.push_back(at::scalar_tensor(v.toDouble(), at::kDouble));
    } else if (v.isBool()) {
      header.insert(header.end(), {kBool, 0});
      out.push_back(at::scalar_tensor(v.toBool(), at::kBool));
    } else {
      return Status(ErrorCode::kUnsupported, "value " + std::to_string(ids[k]) + " (a " + v.tagKind() +
                                                 ") crosses between processes, which carries tensors and scalars only; "
                                                 "cut the model where it passes tensors");
    }
  }
  out[0] = at::tensor(header, at::kLong);
  return out;
}

// Tensors come back on `device` (a GPU pipeline whose message crossed in host memory is
// copied there, on the calling thread's current stream; over NCCL they are there already).
Result<std::vector<c10::IValue>> from_wire(const std::vector<at::Tensor>& message, std::size_t expected,
                                           const std::optional<c10::Device>& device) {
  if (message.empty() || !message[0].defined() || message[0].numel() != static_cast<std::int64_t>(2 * expected) ||
      message.size() != expected + 1) {
    return Status(ErrorCode::kCorrupt, "a pipeline message between processes carries " +
                                           std::to_string(message.empty() ? 0 : message.size() - 1) + " values, not " +
                                           std::to_string(expected) + " (do the processes run the same plan?)");
  }
  const std::int64_t* h = message[0].data_ptr<std::int64_t>();
  std::vector<c10::IValue> out;
  for (std::size_t k = 0; k < expected; ++k) {
    at::Tensor t = message[k + 1];
    if (device && h[2 * k] == kTensor) t = t.to(*device);
    switch (h[2 * k]) {
      case kTensor: out.emplace_back(h[2 * k + 1] ? t.requires_grad_(true) : t); break;
      case kUndefined: out.emplace_back(at::Tensor()); break;
      case kInt: out.emplace_back(t.item<std::int64_t>()); break;
      case kDouble: out.emplace_back(t.item<double>()); break;
      case kBool: out.emplace_back(t.item<bool>()); break;
      default: out.emplace_back(); break;
    }
  }
  return out;
}

// Tags of pipeline messages between processes: kind (1 activations, 2 gradients), microbatch,
// the sending stage and replica (below transport::kCollectiveTagBit).
transport::Tag message_tag(int kind, int mb, int stage, int replica) {
  return (transport::Tag(kind) << 44) | (transport::Tag(mb) << 24) | (transport::Tag(stage) << 12) |
         transport::Tag(replica);
}

// The replicas of a stage with `theirs` replicas that replica `mine` of a stage with
// `ours` exchanges with (the runner's rule for neighbouring ranks, for any two stages).
std::vector<int> partners(int ours, int theirs, int mine) {
  return scheduler::partner_replicas({ours, theirs}, 0, mine, 1);
}

}  // namespace

struct PipelineStep::Impl {
  std::vector<std::shared_ptr<const graph::GraphExecutor>> executors;   // per replica index
  std::vector<std::vector<std::shared_ptr<const graph::StageProgram>>> programs;  // [stage][replica]
  scheduler::Schedule schedule;
  std::vector<int> rank_replicas;   // per rank
  std::vector<int> stage_replicas;  // per stage
  std::int64_t bucket_bytes = 4 << 20;
  int intra_op_threads = 0;
  std::vector<bool> batched_input;  // per graph input: split along dim 0
  graph::Graph::Range batch_range;   // the share sizes the graph holds for (capture's guards)
  std::map<ValueId, int> input_index;
  std::vector<int> producer;    // per value: the stage defining it, -1 for inputs and bindings
  std::vector<int> batch_dim;   // per value: its batch dimension, -1 when it has none
  std::vector<bool> is_batch_size;  // per value: a symbolic size equal to the batch
  std::vector<std::int64_t> batch_scale;  // per value: elements per sample along batch_dim (flattened batch)
  ValueId loss = -1;
  std::vector<std::vector<std::string>> stage_parameters;  // per stage: parameters only it uses
  std::vector<std::string> shared_parameters;              // used by several stages (tied)
  std::vector<std::string> buffers;
  // Gradient reduction across replicas: a group per stage, one over the most replicas for
  // parameters several stages share.
  std::vector<std::vector<std::shared_ptr<transport::Collective>>> stage_groups;
  std::vector<std::shared_ptr<transport::Collective>> shared_group;
  std::vector<int> shared_members;  // every replica index (those not run here have no gradients)
  // Reduction during backward: each replicated stage's parameters in buckets (last layers
  // first, as backward produces them). In the last backward of a step (B, or W when split)
  // a hook after each gradient accumulation counts the bucket's parameters; once every
  // replica has accumulated all of them the bucket is reduced on the communication thread
  // while the backward goes on. The stage's allreduce reduces whatever is left (parameters
  // that got no gradient in that pass).
  struct Bucket {
    std::vector<std::string> names;
    int fired = 0;  // (parameter, replica) accumulations in the final pass
    int state = 0;  // 0 waiting, 1 posted, 2 reduced (in this process)
    at::Tensor across;  // spanning processes: this process's sum, flat, then everyone's (+ a had-gradients count)
    bool early = false;
    std::chrono::steady_clock::time_point start, end;  // of an early reduction, for the trace
    std::vector<c10::Event*> accumulated;       // streams: after each accumulation in the final pass
    c10::Event *gpu_start = nullptr, *gpu_end = nullptr;  // streams: the early reduction's
  };
  std::vector<std::vector<Bucket>> stage_buckets;               // [stage]
  std::vector<std::vector<int>> backwards_done;                 // [stage][replica], this step
  std::unique_ptr<std::atomic<bool>[]> final_pass;              // [pass_index(stage, replica)]
  std::size_t pass_index(int stage, int replica) const {
    return static_cast<std::size_t>(stage) * executors.size() + static_cast<std::size_t>(replica);
  }
  std::mutex bucket_mu;
  Status bucket_error = Status::ok();
  // The hooks reach this Impl through a target that outlives it: a hook that cannot be
  // unlinked (another hook was chained in front of it) finds it gone and only passes on.
  struct HookTarget {
    std::mutex mu;
    Impl* im = nullptr;
  };
  std::shared_ptr<HookTarget> hook_target = std::make_shared<HookTarget>();
  struct Accumulated final : torch::autograd::PostAccumulateGradHook {
    Accumulated(std::shared_ptr<HookTarget> target, int s, int b, int r,
                std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous)
        : target(std::move(target)), s(s), b(b), r(r), previous(std::move(previous)) {}
    void operator()(const torch::autograd::Variable& t) override {
      if (previous) (*previous)(t);
      std::lock_guard<std::mutex> lock(target->mu);
      if (target->im) target->im->accumulated(s, b, r);
    }
    std::shared_ptr<HookTarget> target;
    int s, b, r;
    std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous;
  };
  std::vector<std::pair<at::Tensor, Accumulated*>> installed_hooks;

  ~Impl() {
    coordinator.reset();  // no replica runs a hook any more
    {
      std::lock_guard<std::mutex> lock(hook_target->mu);
      hook_target->im = nullptr;
    }
    for (auto it = installed_hooks.rbegin(); it != installed_hooks.rend(); ++it) {
      auto& slot = torch::autograd::impl::post_acc_grad_hooks(it->first);
      if (slot.get() == it->second) {
        auto previous = std::move(it->second->previous);
        slot = std::move(previous);
      }
    }
  }

  // Per step:
  std::mutex mu;
  std::int64_t batch = 0;
  std::vector<std::int64_t> micro_length;                 // samples per microbatch
  std::vector<std::vector<c10::IValue>> micro_inputs;     // [mb][graph input], whole microbatch
  std::map<std::pair<ValueId, int>, std::vector<c10::IValue>> values;  // (value, mb) -> per producing replica
  std::map<std::pair<ValueId, int>, c10::IValue> joined;  // (value, mb) -> shares joined (redistribution)
  std::map<std::pair<ValueId, int>, std::vector<at::Tensor>> grads;    // (value, mb) -> per producing replica
  std::map<std::pair<ValueId, int>, at::Tensor> joined_grads;          // (value, mb) -> whole-microbatch gradient
  std::map<std::tuple<int, int, int>, graph::StageActivation> activations;  // (stage, mb, replica)
  std::map<std::pair<int, int>, at::Tensor> losses;       // (mb, replica) -> loss of that share
  double grad_scale = 1;
  int replica_threads = 1;    // intra-op threads of each replica this step
  AutocastState caller_autocast;  // the caller's torch.autocast this step: forwards run under it
  scheduler::RunResult last;  // the last step's measured actions
  std::pair<int, int> last_reduction{0, 0};  // buckets, of which reduced during backward
  std::unique_ptr<actors::Coordinator> coordinator;  // the replicas' actors, for the pipeline's life
  std::chrono::milliseconds step_timeout{std::chrono::minutes(10)};

  // Many processes (docs/thread_model.md, "Many processes"); none: every stage runs here.
  // Values go from their producing stage's process straight to every process that reads
  // them, gradients straight back: each a message per (microbatch, stage, replica), sent at
  // the stage's send action and awaited at the reader's receive action.
  std::shared_ptr<ProcessGroup> processes;
  int process = 0;
  std::vector<std::vector<int>> replica_process;  // [stage][replica]: the process that runs it
  bool here(int stage, int replica) const {
    return replica_process.empty() || replica_process[stage][replica] == process;
  }
  std::vector<std::vector<int>> local_replicas;  // [stage]: the replicas this process runs
  struct Remote {
    int process;
    std::vector<ValueId> values;
  };
  using RemoteLists = std::vector<std::vector<std::vector<Remote>>>;  // [stage][replica]: per other process
  std::shared_ptr<transport::Endpoint> remote;  // pipeline messages between processes: UCX's, or NCCL lanes
  RemoteLists activations_out;  // [s][i]: the outputs of s that another process reads from replica i
  RemoteLists gradients_out;    // [t][j]: the gradients of t's inputs that replica j hands another process
  std::vector<std::vector<int>> reads_from;  // [stage t]: the stages whose outputs t reads
  std::vector<std::vector<int>> read_by;     // [stage s]: the stages that read outputs of s
  std::vector<std::pair<std::string, bool>> cross_shared;  // parameters several stages in several processes read (read here?)
  std::vector<std::pair<std::string, int>> owners;   // parameters and buffers: the process of their first reader's replica 0
  // A stage whose replicas run in several processes: its gradients, summed over this
  // process's replicas bucket by bucket, are then summed over those processes (its group,
  // null where it has no replica here), the buckets in one order everywhere; each step ends
  // by waiting for those sums. Buffers such stages read go from their owner to the other
  // processes that read them after every step (so every replica starts the next step from
  // replica 0's, as in one process); only buffers the model writes.
  std::vector<std::shared_ptr<transport::Collective>> stage_across;  // [stage]: over UCX, or NCCL on GPUs
  struct Across {
    std::mutex mu;
    std::condition_variable cv;
    int pending = 0;
    Status error = Status::ok();
    struct Timed {
      int stage, bucket;
      std::chrono::steady_clock::time_point start, end;
    };
    std::vector<Timed> times;  // this step's sums, as they completed (for the trace and the live profile)
  };
  std::shared_ptr<Across> across = std::make_shared<Across>();
  // Random draws (PipelineOptions::seed): the pipeline's seed, and the step now running
  // (counting every step begun, from 0).
  std::uint64_t random_seed = 0;
  std::uint64_t this_step = 0, steps_begun = 0;
  std::vector<int> next_across;  // [stage]: the next bucket to sum across processes (comm thread)
  struct BufferSync {
    std::string name;
    std::shared_ptr<transport::EndpointGroup> group;  // null: this process does not read it
    int root = 0;                                     // the owner's place in the group
  };
  std::vector<BufferSync> buffer_syncs;
  bool out_of_step = false;  // a failed step left the processes out of step
  // Parameters and buffers no stage of this process reads: released (0 elements) while the
  // pipeline trains, so a process holds only its stages' share of the model; brought back
  // whole (from their owners) by gather_state(), released again at the next step.
  struct NotHere {
    std::string name;
    std::vector<std::int64_t> sizes;
  };
  std::vector<NotHere> not_here;
  bool released = false;
  std::set<std::string> buffers_here;  // buffers some stage of this process reads
  static const std::vector<ValueId>* values_for(const std::vector<Remote>& list, int process) {
    for (const Remote& r : list) {
      if (r.process == process) return &r.values;
    }
    return nullptr;
  }
  // Per step: gradients of inputs produced in other processes, (stage, mb, replica) -> by value.
  std::map<std::tuple<int, int, int>, std::map<ValueId, at::Tensor>> grads_out;
  Status send_error = Status::ok();  // under mu
  struct Arrival {
    bool posted = false, done = false;
    Status error = Status::ok();
    std::vector<std::function<void(Status)>> waiters;
  };
  std::mutex arrivals_mu;
  std::map<std::pair<int, transport::Tag>, Arrival> arrivals;  // (from process, tag), this step

  // Streams, on a device that has them (docs/thread_model.md, "Streams"): each replica's
  // compute, send and recv streams with its event pool, rank-major; a collective stream and
  // event pool per stage (the pool under bucket_mu). None on the CPU.
  std::optional<c10::Device> stream_device;
  std::vector<int> first_worker;  // per rank: the index of its replica 0 in `streams`
  std::vector<std::unique_ptr<ReplicaStreams>> streams;
  std::vector<std::optional<c10::Stream>> collective_streams;
  std::vector<std::unique_ptr<EventPool>> collective_events;
  std::unique_ptr<EventPool> step_events;
  ReplicaStreams* streams_of_rank(int rank, int replica) const {
    return streams.empty() ? nullptr : streams[first_worker[rank] + replica].get();
  }
  ReplicaStreams* streams_of(int stage, int replica) const {
    return streams_of_rank(schedule.spec.rank_of_stage(stage), replica);
  }
  // Per step, with streams: where each value, gradient and join is ready, each action's
  // timing events, and the end of each replica's final backward of each stage.
  std::map<std::pair<ValueId, int>, std::vector<c10::Event*>> value_ready;  // per producing replica
  std::map<std::pair<ValueId, int>, c10::Event*> joined_ready;
  std::map<std::pair<ValueId, int>, std::vector<c10::Event*>> grad_ready;   // per slot
  std::map<std::pair<ValueId, int>, c10::Event*> joined_grad_ready;
  std::vector<std::vector<c10::Event*>> final_done;  // [stage][replica]
  struct Timed {
    int rank, replica;
    Action action;
    c10::Event *start, *end;
  };
  std::vector<std::vector<Timed>> timed;  // per worker: compute actions
  std::vector<std::pair<c10::Event*, c10::Event*>> allreduce_timed;  // per stage
  c10::Event* step_start = nullptr;
  std::chrono::steady_clock::time_point step_start_host;

  double weight(int mb, int replicas, int i) const {
    return static_cast<double>(share_of(micro_length[mb], replicas, i).length) / static_cast<double>(batch);
  }

  // The value `v` of microbatch `mb` as replica `i` of `stage` sees it; with streams, the
  // replica's compute stream (current) waits until it is ready. Holds `mu`.
  Result<c10::IValue> read_value(ValueId v, int mb, int stage, int i) {
    ReplicaStreams* rs = streams_of(stage, i);
    auto ready_on_compute = [&](c10::IValue x, c10::Event* ready) {
      if (rs != nullptr) {
        if (ready != nullptr) ready->block(rs->compute);
        if (x.isTensor()) used_on(x.toTensor(), rs->compute);
      }
      return x;
    };
    auto produced = [&](int r) -> c10::Event* {
      auto rt = value_ready.find({v, mb});
      return rt == value_ready.end() || r >= static_cast<int>(rt->second.size()) ? nullptr : rt->second[r];
    };
    const int rc = stage_replicas[stage];
    auto gi = input_index.find(v);
    if (gi != input_index.end()) {
      const c10::IValue& whole = micro_inputs[mb][gi->second];
      if (!batched_input[gi->second] || !whole.isTensor()) return whole;
      const Share s = share_of(micro_length[mb], rc, i);
      return c10::IValue(whole.toTensor().narrow(0, s.offset, s.length));
    }
    auto it = values.find({v, mb});
    if (it == values.end()) {
      return Status(ErrorCode::kInternal, "value " + std::to_string(v) + " of microbatch " + std::to_string(mb) +
                                              " was not produced yet");
    }
    const auto& shares = it->second;
    const int rp = stage_replicas[producer[v]];
    if (rp == rc) return ready_on_compute(shares[i], produced(i));
    if (is_batch_size[v]) return c10::IValue(share_of(micro_length[mb], rc, i).length);
    if (batch_dim[v] < 0) return ready_on_compute(shares[0], produced(0));  // the same on every replica (checked at creation)
    auto [jt, fresh] = joined.emplace(std::pair{v, mb}, c10::IValue());
    if (fresh) {  // joined on the recv stream of the first replica to read it
      std::optional<c10::StreamGuard> on_recv;
      if (rs != nullptr) {
        for (int r = 0; r < rp; ++r) {
          if (c10::Event* e = produced(r)) e->block(rs->recv);
        }
        on_recv.emplace(rs->recv);
      }
      std::vector<at::Tensor> parts;
      bool needs_grad = false;
      for (const auto& s : shares) {
        parts.push_back(s.toTensor().detach());
        needs_grad = needs_grad || s.toTensor().requires_grad();
        if (rs != nullptr) used_on(parts.back(), rs->recv);
      }
      at::Tensor whole = at::cat(parts, batch_dim[v]);
      if (needs_grad) whole.requires_grad_(true);  // so consumers' inputs ask for gradients
      jt->second = whole;
      if (rs != nullptr) joined_ready[{v, mb}] = rs->events.record(rs->recv);
    }
    const Share s = share_of(micro_length[mb], rc, i);
    const std::int64_t k = batch_scale[v];
    auto jr = joined_ready.find({v, mb});
    return ready_on_compute(c10::IValue(jt->second.toTensor().narrow(batch_dim[v], k * s.offset, k * s.length)),
                            jr == joined_ready.end() ? nullptr : jr->second);
  }

  // Adds the gradient replica `i` of `stage` computed for its input `v` (on its compute
  // stream, current; a joined gradient on its send stream). Holds `mu`.
  void write_grad(ValueId v, int mb, int stage, int i, const at::Tensor& g) {
    const int rp = stage_replicas[producer[v]], rc = stage_replicas[stage];
    ReplicaStreams* rs = streams_of(stage, i);
    auto& slots = grads[{v, mb}];
    slots.resize(static_cast<std::size_t>(rp));
    if (rp == rc || batch_dim[v] < 0) {
      const int slot = rp == rc ? i : 0;
      if (rs != nullptr) {
        auto& ready = grad_ready[{v, mb}];
        ready.resize(static_cast<std::size_t>(rp), nullptr);
        if (slots[slot].defined() && ready[slot] != nullptr) {  // another stage's gradient of it
          ready[slot]->block(rs->compute);
          used_on(slots[slot], rs->compute);
        }
        add_into(slots[slot], g);
        ready[slot] = rs->events.record(rs->compute);
        return;
      }
      return add_into(slots[slot], g);
    }
    std::optional<c10::StreamGuard> on_send;
    if (rs != nullptr) {
      rs->events.record(rs->compute)->block(rs->send);
      auto jr = joined_grad_ready.find({v, mb});
      if (jr != joined_grad_ready.end()) jr->second->block(rs->send);
      on_send.emplace(rs->send);
      used_on(g, rs->send);
    }
    at::Tensor& whole = joined_grads[{v, mb}];
    if (!whole.defined()) whole = zeros_like_joined(v, mb);
    if (!whole.defined()) return;  // no share of the value is here: no replica here reads this gradient
    const Share s = share_of(micro_length[mb], rc, i);
    whole.narrow(batch_dim[v], batch_scale[v] * s.offset, batch_scale[v] * s.length).add_(g);
    if (rs != nullptr) {
      used_on(whole, rs->send);
      joined_grad_ready[{v, mb}] = rs->events.record(rs->send);
    }
  }

  // Zeros shaped like value `v` of microbatch `mb` with its producers' shares joined (the
  // join itself is in the reading process, which may be another one, and this process may
  // hold some of the shares only): a share's shape, the whole microbatch along the batch
  // dimension. Holds `mu`.
  at::Tensor zeros_like_joined(ValueId v, int mb) const {
    auto jt = joined.find({v, mb});
    if (jt != joined.end()) return at::zeros_like(jt->second.toTensor());
    for (const auto& share : values.at({v, mb})) {
      if (!share.isTensor()) continue;
      std::vector<std::int64_t> sizes = share.toTensor().sizes().vec();
      sizes[batch_dim[v]] = batch_scale[v] * micro_length[mb];
      return at::zeros(sizes, share.toTensor().options());
    }
    return at::Tensor();
  }

  // The gradient of output `v` for replica `i` of its producing stage (its compute stream,
  // current, waits until it is ready). Holds `mu`.
  at::Tensor read_grad(ValueId v, int mb, int i) {
    ReplicaStreams* rs = streams_of(producer[v], i);
    at::Tensor g;
    auto it = grads.find({v, mb});
    if (it != grads.end() && i < static_cast<int>(it->second.size())) g = std::move(it->second[i]);
    if (rs != nullptr) {
      auto rt = grad_ready.find({v, mb});
      if (rt != grad_ready.end() && i < static_cast<int>(rt->second.size()) && rt->second[i] != nullptr) {
        rt->second[i]->block(rs->compute);
      }
      auto jr = joined_grad_ready.find({v, mb});
      if (jr != joined_grad_ready.end()) jr->second->block(rs->compute);
      used_on(g, rs->compute);
    }
    auto jt = joined_grads.find({v, mb});
    if (jt != joined_grads.end()) {
      const Share s = share_of(micro_length[mb], stage_replicas[producer[v]], i);
      add_into(g, jt->second.narrow(batch_dim[v], batch_scale[v] * s.offset, batch_scale[v] * s.length));
    }
    return g;
  }

  // The seed of a forward's random draws: a hash of the pipeline's seed, the step, the
  // stage, the microbatch and the replica (splitmix64 over each in turn).
  std::uint64_t forward_seed(int stage, int microbatch, int replica) const {
    auto mix = [](std::uint64_t x) {
      x += 0x9e3779b97f4a7c15ULL;
      x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
      x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
      return x ^ (x >> 31);
    };
    std::uint64_t h = mix(random_seed);
    for (std::uint64_t part : {this_step, static_cast<std::uint64_t>(stage), static_cast<std::uint64_t>(microbatch),
                               static_cast<std::uint64_t>(replica)}) {
      h = mix(h ^ part);
    }
    return h;
  }

  Status forward(int i, const Action& a) {
    const auto& program = *programs[a.stage][i];
    std::vector<c10::IValue> in;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (ValueId v : program.inputs()) {
        CONVEYOR_ASSIGN_OR_RETURN(c10::IValue x, read_value(v, a.microbatch, a.stage, i));
        in.push_back(std::move(x));
      }
    }
    std::optional<std::uint64_t> seed;
    if (program.draws_random()) seed = forward_seed(a.stage, a.microbatch, i);
    CONVEYOR_ASSIGN_OR_RETURN(graph::StageActivation act, program.forward(std::move(in), seed));
    ReplicaStreams* rs = streams_of(a.stage, i);
    c10::Event* done = rs != nullptr ? rs->events.record(rs->compute) : nullptr;
    std::lock_guard<std::mutex> lock(mu);
    for (std::size_t k = 0; k < program.outputs().size(); ++k) {
      const ValueId v = program.outputs()[k];
      auto& shares = values[{v, a.microbatch}];
      shares.resize(static_cast<std::size_t>(stage_replicas[a.stage]));
      shares[i] = act.outputs[k];
      if (done != nullptr) {
        auto& ready = value_ready[{v, a.microbatch}];
        ready.resize(shares.size(), nullptr);
        ready[i] = done;
      }
      if (v == loss) losses[{a.microbatch, i}] = act.outputs[k].toTensor().detach();
    }
    activations[{a.stage, a.microbatch, i}] = std::move(act);
    return Status::ok();
  }

  // B (whole backward) or Bi (input half; the activation stays for W).
  Status backward(int i, const Action& a, bool split) {
    const auto& program = *programs[a.stage][i];
    graph::StageActivation act;
    std::vector<c10::IValue> out_grads;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = activations.find({a.stage, a.microbatch, i});
      if (it == activations.end()) return Status(ErrorCode::kInternal, "backward before forward");
      act = std::move(it->second);
      activations.erase(it);
      for (std::size_t k = 0; k < program.outputs().size(); ++k) {
        const ValueId v = program.outputs()[k];
        at::Tensor g;
        if (v == loss) {
          const double w = weight(a.microbatch, stage_replicas[a.stage], i);
          g = at::full_like(act.outputs[k].toTensor(), w * grad_scale);
        }
        add_into(g, read_grad(v, a.microbatch, i));
        out_grads.push_back(g.defined() ? c10::IValue(g) : c10::IValue());
      }
    }
    CONVEYOR_ASSIGN_OR_RETURN(std::vector<c10::IValue> in_grads,
                              split ? program.backward_input(act, std::move(out_grads))
                                    : program.backward(act, std::move(out_grads)));
    std::lock_guard<std::mutex> lock(mu);
    if (split) activations[{a.stage, a.microbatch, i}] = std::move(act);
    for (std::size_t k = 0; k < program.inputs().size(); ++k) {
      const ValueId v = program.inputs()[k];
      if (input_index.count(v) || !in_grads[k].isTensor()) continue;
      const at::Tensor& g = in_grads[k].toTensor();
      if (!g.defined()) continue;
      // To the producing replicas this one exchanges with: here, and sent at the stage's
      // send to those in other processes.
      const int s = producer[v];
      bool local = false, remote = false;
      for (int j : partners(stage_replicas[a.stage], stage_replicas[s], i)) (here(s, j) ? local : remote) = true;
      if (local) write_grad(v, a.microbatch, a.stage, i, g);
      if (remote) grads_out[{a.stage, a.microbatch, i}][v] = g;
    }
    return Status::ok();
  }

  // One compute action of a replica (on its compute stream, current, when there are streams).
  Status compute(int replica, const Action& a);

  // Seconds from the measured step's start to when `e` was reached on the device.
  double device_time(const c10::Event* e, const scheduler::RunResult& measured) const {
    const double host_offset = std::chrono::duration<double>(step_start_host - measured.start).count();
    return e == nullptr ? host_offset : host_offset + seconds_between(*step_start, *e);
  }

  // With streams, the host only queued the work: once the device has run it all, every
  // compute action and allreduce gets the device's times from its events, and the step
  // lasts until the device is done.
  void device_times(scheduler::RunResult& measured) {
    synchronize_device(*stream_device);
    std::map<std::tuple<int, int, int, int, int>, const Timed*> by_action;  // (rank, replica, kind, mb, stage)
    for (const auto& worker : timed) {
      for (const Timed& t : worker) {
        by_action[{t.rank, t.replica, static_cast<int>(t.action.kind), t.action.microbatch, t.action.stage}] = &t;
      }
    }
    for (auto& span : measured.spans) {
      if (span.stream == scheduler::Span::Stream::kCompute) {
        auto it = by_action.find({span.rank, span.replica, static_cast<int>(span.action.kind), span.action.microbatch,
                                  span.action.stage});
        if (it == by_action.end()) continue;
        span.start_s = device_time(it->second->start, measured);
        span.end_s = device_time(it->second->end, measured);
      } else if (span.stream == scheduler::Span::Stream::kCollective && span.action.kind == ActionKind::kAllReduce) {
        const auto& [start, end] = allreduce_timed[span.action.stage];
        if (start == nullptr || end == nullptr) continue;
        span.start_s = device_time(start, measured);
        span.end_s = device_time(end, measured);
      }
    }
    measured.step_time_s = std::max(measured.step_time_s,
                                    std::chrono::duration<double>(std::chrono::steady_clock::now() - measured.start).count());
  }

  // W: the weight half of the microbatch's split backward.
  Status backward_weight(int i, const Action& a) {
    graph::StageActivation act;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = activations.find({a.stage, a.microbatch, i});
      if (it == activations.end() || !it->second.deferred) {
        return Status(ErrorCode::kInternal, "weight gradient before the input gradient");
      }
      act = std::move(it->second);
      activations.erase(it);
    }
    return programs[a.stage][i]->backward_weight(act);
  }

  // Places the replicas on processes (placement: per pipeline rank, per replica) and works
  // out which values and gradients cross between them, which stages reduce their gradients
  // across processes, and who owns each parameter and buffer; checks that every process
  // builds this same pipeline. Called by create() on every process, in one order.
  Status distribute(const graph::Graph& g, const std::vector<std::vector<NodeId>>& stages,
                    std::shared_ptr<ProcessGroup> group, const std::vector<std::vector<int>>& placement) {
    const int ranks = schedule.spec.ranks, num_stages = static_cast<int>(stages.size());
    if (static_cast<int>(placement.size()) != ranks) {
      return Status(ErrorCode::kInvalidArgument, "processes given for " + std::to_string(placement.size()) +
                                                     " pipeline ranks, but the pipeline has " + std::to_string(ranks));
    }
    for (int rank = 0; rank < ranks; ++rank) {
      if (static_cast<int>(placement[rank].size()) != rank_replicas[rank]) {
        return Status(ErrorCode::kInvalidArgument, "pipeline rank " + std::to_string(rank) + " has " +
                                                       std::to_string(rank_replicas[rank]) + " replicas but " +
                                                       std::to_string(placement[rank].size()) + " are placed on processes");
      }
      for (int p : placement[rank]) {
        if (p < 0 || p >= group->world_size()) {
          return Status(ErrorCode::kInvalidArgument, "pipeline rank " + std::to_string(rank) + " placed on process " +
                                                         std::to_string(p) + " of a world of " +
                                                         std::to_string(group->world_size()));
        }
      }
    }
    processes = std::move(group);
    process = processes->rank();
    replica_process.clear();
    std::vector<std::set<int>> stage_processes;  // per stage: the processes running its replicas
    for (int st = 0; st < num_stages; ++st) {
      replica_process.push_back(placement[schedule.spec.rank_of_stage(st)]);
      stage_processes.emplace_back(replica_process[st].begin(), replica_process[st].end());
    }
    activations_out.assign(static_cast<std::size_t>(num_stages), {});
    gradients_out.assign(static_cast<std::size_t>(num_stages), {});
    reads_from.assign(static_cast<std::size_t>(num_stages), {});
    read_by.assign(static_cast<std::size_t>(num_stages), {});
    for (int st = 0; st < num_stages; ++st) {
      activations_out[st].resize(static_cast<std::size_t>(stage_replicas[st]));
      gradients_out[st].resize(static_cast<std::size_t>(stage_replicas[st]));
    }
    auto add = [](std::vector<Remote>& list, int to, ValueId v) {
      for (Remote& r : list) {
        if (r.process != to) continue;
        if (std::find(r.values.begin(), r.values.end(), v) == r.values.end()) r.values.push_back(v);
        return;
      }
      list.push_back({to, {v}});
    };
    for (int t = 0; t < num_stages; ++t) {
      for (ValueId v : graph::stage_boundary(g, stages[t]).inputs) {
        const int s = producer[v];
        if (s < 0) continue;
        if (std::find(reads_from[t].begin(), reads_from[t].end(), s) == reads_from[t].end()) reads_from[t].push_back(s);
        if (std::find(read_by[s].begin(), read_by[s].end(), t) == read_by[s].end()) read_by[s].push_back(t);
        for (int j = 0; j < stage_replicas[t]; ++j) {
          for (int i : partners(stage_replicas[t], stage_replicas[s], j)) {
            if (replica_process[t][j] == replica_process[s][i]) continue;
            add(activations_out[s][i], replica_process[t][j], v);
            add(gradients_out[t][j], replica_process[s][i], v);
          }
        }
      }
    }
    // Parameters and buffers: owned by the process of their first reader's replica 0;
    // parameters several stages read in several processes (tied weights) get their
    // gradients summed across the processes after each step (a stage's own parameters, by
    // its subgroup during the step).
    std::map<ValueId, std::set<int>> reading;  // value -> processes
    std::map<ValueId, std::set<int>> stages_reading;
    std::map<ValueId, int> first;              // value -> first reading stage
    for (int st = 0; st < num_stages; ++st) {
      for (NodeId n : stages[st]) {
        for (ValueId in : graph::Graph::node_inputs(g.nodes[n])) {
          for (int p : replica_process[st]) reading[in].insert(p);
          stages_reading[in].insert(st);
          first.emplace(in, st);
        }
      }
    }
    // Every process makes every group, in this order (ProcessGroup::subgroup).
    for (int st = 0; st < num_stages; ++st) {
      std::shared_ptr<transport::EndpointGroup> stage_group;
      if (const std::set<int>& ps = stage_processes[st]; ps.size() > 1) {
        CONVEYOR_ASSIGN_OR_RETURN(stage_group, processes->subgroup(std::vector<int>(ps.begin(), ps.end())));
      }
      stage_across[st] = std::move(stage_group);
    }
    // Buffers the model writes (running statistics; through views too): the others never change.
    std::vector<bool> written(g.values.size(), false);
    {
      const std::vector<ValueId> root = graph::storage_roots(g);
      for (const auto& n : g.nodes) {
        for (int a : n.mutated_args) {
          if (n.args[a].kind == graph::Argument::Kind::kValue) written[root[n.args[a].value]] = true;
        }
      }
    }
    std::map<std::set<int>, std::shared_ptr<transport::EndpointGroup>> buffer_groups;
    for (const auto& b : g.bindings) {
      if (!first.count(b.value) || executors[0]->tensor(b.name) == nullptr) continue;
      if (b.kind != graph::Binding::Kind::kParameter && b.kind != graph::Binding::Kind::kBuffer) continue;
      const int owner = replica_process[first[b.value]][0];
      owners.emplace_back(b.name, owner);
      const std::set<int>& readers = reading[b.value];
      if (!readers.count(process)) {
        not_here.push_back({b.name, executors[0]->tensor(b.name)->sizes().vec()});
      } else if (b.kind == graph::Binding::Kind::kBuffer) {
        buffers_here.insert(b.name);
      }
      if (b.kind == graph::Binding::Kind::kParameter && stages_reading[b.value].size() > 1 && readers.size() > 1 &&
          executors[0]->tensor(b.name)->requires_grad()) {
        cross_shared.emplace_back(b.name, readers.count(process) > 0);
      }
      bool replicated_across = false;  // read by a stage whose replicas span processes
      for (int st : stages_reading[b.value]) replicated_across = replicated_across || stage_processes[st].size() > 1;
      if (b.kind == graph::Binding::Kind::kBuffer && written[b.value] && replicated_across && readers.size() > 1) {
        auto it = buffer_groups.find(readers);
        if (it == buffer_groups.end()) {
          CONVEYOR_ASSIGN_OR_RETURN(auto made, processes->subgroup(std::vector<int>(readers.begin(), readers.end())));
          it = buffer_groups.emplace(readers, std::move(made)).first;
        }
        buffer_syncs.push_back({b.name, it->second,
                                static_cast<int>(std::distance(readers.begin(), readers.find(owner)))});
      }
    }
    // Every process must build this pipeline: compare fingerprints.
    std::uint64_t h = 1469598103934665603ULL;
    auto mix = [&h](std::int64_t x) {
      for (int k = 0; k < 8; ++k) h = (h ^ static_cast<std::uint64_t>((x >> (8 * k)) & 0xff)) * 1099511628211ULL;
    };
    mix(static_cast<std::int64_t>(schedule.spec.kind));
    mix(schedule.spec.chunks);
    mix(schedule.spec.microbatches);
    for (int r : rank_replicas) mix(r);
    for (const auto& rank : placement) {
      mix(-2);
      for (int p : rank) mix(p);
    }
    for (const auto& stage : stages) {
      mix(-1);
      for (NodeId n : stage) mix(n);
    }
    mix(static_cast<std::int64_t>(g.nodes.size()));
    at::Tensor mine = at::full({1}, static_cast<std::int64_t>(h), at::kLong);
    at::Tensor all = at::zeros({processes->world_size()}, at::kLong);
    CONVEYOR_RETURN_IF_ERROR(processes->wait([&](transport::Done d) { processes->all().allgather(mine, all, d); },
                                             "comparing the pipeline every process built"));
    std::string differ;
    for (int p = 0; p < processes->world_size(); ++p) {
      if (all[p].item<std::int64_t>() != all[0].item<std::int64_t>()) differ += (differ.empty() ? "" : ", ") + std::to_string(p);
    }
    if (!differ.empty()) {
      return Status(ErrorCode::kInvalidArgument,
                    "processes " + differ + " built a different pipeline (stages, schedule, microbatches, replicas or "
                    "placement) than process 0; every process must run the same plan");
    }
    return Status::ok();
  }

  // The endpoint pipeline messages cross processes by: the process group's (UCX), or NCCL
  // lanes for every pair of processes a message goes between (both directions of a
  // pipeline link: activations one way, gradients back), and then the stages that span
  // processes sum their gradients in NCCL groups instead of UCX ones. Collective, after
  // distribute().
  Status connect_remote(PipelineOptions::Transport transport) {
    remote = processes->endpoint();
    if (transport != PipelineOptions::Transport::kNccl) return Status::ok();
    if (!stream_device || !stream_device->is_cuda()) {
      return Status(ErrorCode::kInvalidArgument,
                    std::string("transport \"nccl\" moves GPU tensors between processes, but this pipeline's model is on ") +
                        (stream_device ? stream_device->str() : std::string("the CPU")) +
                        "; move the model to its process's GPU, or use transport \"ucx\"");
    }
    std::vector<std::pair<int, int>> links;
    for (const RemoteLists* lists : {&activations_out, &gradients_out}) {
      for (std::size_t st = 0; st < lists->size(); ++st) {
        for (std::size_t i = 0; i < (*lists)[st].size(); ++i) {
          for (const Remote& to : (*lists)[st][i]) links.emplace_back(replica_process[st][i], to.process);
        }
      }
    }
    CONVEYOR_ASSIGN_OR_RETURN(auto lanes, processes->nccl_endpoint(*stream_device, links));
    remote = std::move(lanes);
    // Stages whose replicas span processes sum their gradients across them on the GPUs too.
    for (std::size_t st = 0; st < replica_process.size(); ++st) {
      const std::set<int> spanned(replica_process[st].begin(), replica_process[st].end());
      if (spanned.size() < 2) continue;
      CONVEYOR_ASSIGN_OR_RETURN(auto group, processes->nccl_subgroup(std::vector<int>(spanned.begin(), spanned.end()),
                                                                     *stream_device));
      stage_across[st] = std::move(group);
    }
    return Status::ok();
  }

  // A send action of replica `i` (on the communication thread): what other processes read
  // of it goes to them, one message per process.
  Status send_remote(int i, const Action& a) {
    if (!processes) return Status::ok();
    const bool grad = a.kind == ActionKind::kSendGradient;
    const std::vector<Remote>& destinations = (grad ? gradients_out : activations_out)[a.stage][i];
    if (stream_device && !destinations.empty()) {
      // A GPU pipeline's messages leave after the compute that made them: the endpoint's host
      // copy (UCX) or NCCL's stream waits for this thread's current stream, which waits for it.
      c10::Event computed(stream_device->type());
      computed.record(streams_of(a.stage, i)->compute);
      computed.block(current_stream(*stream_device));
    }
    for (const Remote& to : destinations) {
      std::vector<c10::IValue> payload;
      {
        std::lock_guard<std::mutex> lock(mu);
        if (grad) {
          auto& computed = grads_out[{a.stage, a.microbatch, i}];
          for (ValueId v : to.values) payload.emplace_back(computed.count(v) ? computed[v] : at::Tensor());
        } else {
          for (ValueId v : to.values) payload.push_back(values.at({v, a.microbatch})[i]);
        }
      }
      CONVEYOR_ASSIGN_OR_RETURN(auto message, to_wire(payload, to.values));
      remote->send(to.process, message_tag(grad ? 2 : 1, a.microbatch, a.stage, i), std::move(message),
                                  [target = hook_target](Status s) {
                                    if (s) return;
                                    std::lock_guard<std::mutex> alive(target->mu);
                                    if (target->im == nullptr) return;
                                    std::lock_guard<std::mutex> lock(target->im->mu);
                                    if (target->im->send_error.is_ok()) target->im->send_error = s;
                                  });
    }
    if (grad) {
      std::lock_guard<std::mutex> lock(mu);
      grads_out.erase({a.stage, a.microbatch, i});
    }
    return Status::ok();
  }

  // A receive action of replica `i`: `arrived` runs once every message from other processes
  // that its stage reads for the microbatch is in the tables (each message is received once
  // per process, whichever replica or stage asks first).
  void receive_remote(int i, const Action& a, std::function<void(Status)> arrived) {
    struct Need {
      int process;
      bool grad;
      int stage, replica;  // the sender's
    };
    std::vector<Need> needs;
    const bool grad = a.kind == ActionKind::kRecvGradient;
    if (processes) {
      for (int other : grad ? read_by[a.stage] : reads_from[a.stage]) {
        for (int j : partners(stage_replicas[a.stage], stage_replicas[other], i)) {
          if (!here(other, j)) needs.push_back({replica_process[other][j], grad, other, j});
        }
      }
    }
    if (needs.empty()) return arrived(Status::ok());
    struct Countdown {
      std::mutex mu;
      std::size_t left;
      bool reported = false;
      std::function<void(Status)> arrived;
      void one(const Status& s) {
        std::unique_lock<std::mutex> lock(mu);
        if (reported || (s.is_ok() && --left > 0)) return;
        reported = true;
        lock.unlock();
        arrived(s);
      }
    };
    auto count = std::make_shared<Countdown>();
    count->left = needs.size();
    count->arrived = std::move(arrived);
    const int mb = a.microbatch;
    for (const Need& n : needs) {
      const std::pair<int, transport::Tag> key{n.process, message_tag(n.grad ? 2 : 1, mb, n.stage, n.replica)};
      std::unique_lock<std::mutex> lock(arrivals_mu);
      Arrival& arrival = arrivals[key];
      if (arrival.done) {
        Status e = arrival.error;
        lock.unlock();
        count->one(e);
        continue;
      }
      arrival.waiters.push_back([count](Status s) { count->one(s); });
      if (arrival.posted) continue;
      arrival.posted = true;
      lock.unlock();
      remote->recv(key.first, key.second, [target = hook_target, n, mb, key](Result<std::vector<at::Tensor>> got) {
        std::lock_guard<std::mutex> alive(target->mu);
        Impl* im = target->im;
        if (im == nullptr) return;  // the pipeline is gone
        Status s = got.is_ok() ? im->apply_message(n.grad, n.stage, n.replica, mb, *got) : got.status();
        std::vector<std::function<void(Status)>> waiters;
        {
          std::lock_guard<std::mutex> lock(im->arrivals_mu);
          Arrival& arrival = im->arrivals[key];
          arrival.done = true;
          arrival.error = s;
          waiters.swap(arrival.waiters);
        }
        for (auto& w : waiters) w(s);
      });
    }
  }

  // Stores a message from another process: values (activations) of replica `replica` of
  // `stage`, or the gradients replica `replica` of reading stage `stage` computed.
  Status apply_message(bool grad, int stage, int replica, int mb, const std::vector<at::Tensor>& message) {
    const std::vector<ValueId>* ids = values_for((grad ? gradients_out : activations_out)[stage][replica], process);
    if (ids == nullptr) return Status(ErrorCode::kInternal, "a message from a stage that sends this process nothing");
    // With streams, a message lands on the compute stream of the replica that sent it (one
    // of another process: here its streams carry nothing but its arrivals), so the events
    // recorded there tell readers when it is on the device.
    ReplicaStreams* rs = streams_of(stage, replica);
    std::optional<c10::StreamGuard> on_arrival;
    if (rs != nullptr) on_arrival.emplace(rs->compute);
    CONVEYOR_ASSIGN_OR_RETURN(auto got, from_wire(message, ids->size(), stream_device));
    std::lock_guard<std::mutex> lock(mu);
    c10::Event* landed = rs != nullptr && !grad ? rs->events.record(rs->compute) : nullptr;
    for (std::size_t k = 0; k < ids->size(); ++k) {
      const ValueId v = (*ids)[k];
      if (grad) {
        if (got[k].isTensor() && got[k].toTensor().defined()) write_grad(v, mb, stage, replica, got[k].toTensor());
      } else {
        auto& shares = values[{v, mb}];
        shares.resize(static_cast<std::size_t>(stage_replicas[stage]));
        shares[replica] = std::move(got[k]);
        if (landed != nullptr) {
          auto& ready = value_ready[{v, mb}];
          ready.resize(shares.size(), nullptr);
          ready[replica] = landed;
        }
      }
    }
    return Status::ok();
  }

  // Sums the gradients of `names` over replicas 1..replicas-1 into replica 0 (the user's
  // `.grad`), in buckets of at most bucket_bytes: each bucket is flattened once per replica,
  // summed, and added back through views. The replicas' gradients are released.
  // Consecutive parameters of one dtype, at most bucket_bytes each (one at least).
  std::vector<std::vector<std::string>> make_buckets(const std::vector<std::string>& names) const {
    std::vector<std::vector<std::string>> out;
    std::int64_t bytes = 0;
    at::ScalarType dtype = at::ScalarType::Undefined;
    for (const auto& name : names) {
      const at::Tensor* t = executors[0]->tensor(name);
      if (out.empty() || t->scalar_type() != dtype || bytes >= bucket_bytes) {
        out.emplace_back();
        bytes = 0;
        dtype = t->scalar_type();
      }
      out.back().push_back(name);
      bytes += t->numel() * static_cast<std::int64_t>(t->element_size());
    }
    return out;
  }

  // Sums the gradients of `names` over `members` (replicas run in this process) into replica
  // 0's (the user's) `.grad` through `group` (the inproc group over them), bucket by bucket.
  Status reduce(const std::vector<std::string>& names, const std::vector<int>& members,
                const std::vector<std::shared_ptr<transport::Collective>>& group) {
    if (members.size() < 2) return Status::ok();
    for (const auto& bucket : make_buckets(names)) {
      CONVEYOR_ASSIGN_OR_RETURN(at::Tensor sum, sum_replicas(bucket, members, group));
      if (sum.defined()) write_back(bucket, sum);
    }
    return Status::ok();
  }

  // The gradients of `names` summed over `members` as one flat tensor (zeros for a member
  // without one), through `group` (member order: the same sums wherever they run); every
  // member's gradients but replica 0's are released. Undefined when no member has any.
  Result<at::Tensor> sum_replicas(const std::vector<std::string>& names, const std::vector<int>& members,
                                  const std::vector<std::shared_ptr<transport::Collective>>& group) {
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> buckets;
    bool any = false;
    for (int r : members) {
      std::vector<at::Tensor> flat;
      for (const auto& name : names) {
        at::Tensor p = *executors[r]->tensor(name);
        at::Tensor g = p.grad();
        any = any || g.defined();
        flat.push_back(g.defined() ? g.reshape(-1) : at::zeros({p.numel()}, p.options()));
        if (r > 0 && g.defined()) {
          if (stream_device) used_on(g, current_stream(*stream_device));  // the collective stream
          p.mutable_grad().reset();
        }
      }
      buckets.push_back(at::cat(flat));
    }
    if (!any) return at::Tensor();
    if (members.size() < 2) return buckets[0];
    // Every member's part of the reduction (inproc completes it inline on the last call).
    struct Pending {
      std::mutex mu;
      int left = 0;
      Status first = Status::ok();
      std::promise<void> all;
    };
    auto pending = std::make_shared<Pending>();
    pending->left = static_cast<int>(members.size());
    for (std::size_t k = 0; k < members.size(); ++k) {
      group[k]->reduce(buckets[k], /*root=*/0, [pending](Status s) {
        std::lock_guard<std::mutex> lock(pending->mu);
        if (!s && pending->first.is_ok()) pending->first = std::move(s);
        if (--pending->left == 0) pending->all.set_value();
      });
    }
    pending->all.get_future().wait();
    CONVEYOR_RETURN_IF_ERROR(pending->first);
    return buckets[0];
  }

  // A flat sum of `names`' gradients becomes replica 0's (the user's) `.grad` (not for
  // tensors released here).
  void write_back(const std::vector<std::string>& names, const at::Tensor& flat) {
    c10::NoGradGuard no_grad;
    std::int64_t offset = 0;
    for (const auto& name : names) {
      at::Tensor p = *executors[0]->tensor(name);
      at::Tensor part = flat.narrow(0, offset, p.numel()).view(p.sizes());
      offset += p.numel();
      if (released_sizes(name) != nullptr) continue;
      if (p.grad().defined()) {
        p.mutable_grad().copy_(part);
      } else {
        p.mutable_grad() = part.clone();
      }
    }
  }

  // Bucket `b` of `stage`, on the communication thread: summed over this process's
  // replicas and, where the stage spans processes, queued to be summed across them.
  Status reduce_stage_bucket(int stage, int b) {
    Bucket& bucket = stage_buckets[stage][b];
    CONVEYOR_ASSIGN_OR_RETURN(at::Tensor sum, sum_replicas(bucket.names, local_replicas[stage], stage_groups[stage]));
    if (!stage_across[stage]) {
      if (sum.defined()) write_back(bucket.names, sum);
      return Status::ok();
    }
    const at::Tensor& first = *executors[0]->tensor(bucket.names[0]);
    if (!sum.defined()) {
      std::int64_t numel = 0;
      for (const auto& name : bucket.names) numel += executors[0]->tensor(name)->numel();
      bucket.across = at::zeros({numel + 1}, first.options());
    } else {
      bucket.across = at::cat({sum, at::ones({1}, sum.options())});  // the last element counts processes with gradients
    }
    issue_across(stage);
    return Status::ok();
  }

  // On the communication thread: the stage's buckets summed here go to be summed across
  // its processes, in bucket order (the same order on every process, whatever order
  // backward finished them in).
  void issue_across(int stage) {
    auto& buckets = stage_buckets[stage];
    while (next_across[stage] < static_cast<int>(buckets.size()) && buckets[next_across[stage]].across.defined()) {
      const int index = next_across[stage]++;
      Bucket& b = buckets[index];
      if (stream_device) collective_streams[stage]->synchronize();  // the sum is on the device before it leaves
      {
        std::lock_guard<std::mutex> lock(across->mu);
        ++across->pending;
      }
      stage_across[stage]->allreduce(b.across, [state = across, stage, index, start = std::chrono::steady_clock::now()](
                                                   Status s) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->times.push_back({stage, index, start, std::chrono::steady_clock::now()});
        if (!s && state->error.is_ok()) state->error = std::move(s);
        --state->pending;
        state->cv.notify_all();
      });
    }
  }

  // The end of a step: waits for the sums across processes and makes them the user's
  // gradients (a parameter no process had a gradient for keeps none).
  Status finish_across() {
    {
      std::unique_lock<std::mutex> lock(across->mu);
      if (!across->cv.wait_for(lock, processes->timeout(), [&] { return across->pending == 0; })) {
        return Status(ErrorCode::kExecution, "process " + std::to_string(process) +
                                                 ": summing the gradients of replicas in other processes did not "
                                                 "complete within " + std::to_string(processes->timeout().count()) +
                                                 " ms (a process that hangs, or one out of step)");
      }
      CONVEYOR_RETURN_IF_ERROR(across->error.with_context("summing the gradients of replicas in other processes"));
    }
    if (stream_device) synchronize_device(*stream_device);
    for (int st = 0; st < static_cast<int>(stage_buckets.size()); ++st) {
      if (!stage_across[st]) continue;
      for (Bucket& b : stage_buckets[st]) {
        if (!b.across.defined()) {
          return Status(ErrorCode::kInternal, "a gradient bucket of stage " + std::to_string(st) + " was never reduced");
        }
        const std::int64_t n = b.across.numel() - 1;
        if (b.across[n].item<double>() > 0) write_back(b.names, b.across.narrow(0, 0, n));
        b.across = at::Tensor();
      }
    }
    return Status::ok();
  }

  // After a step: buffers of stages replicated across processes become their owner's (the
  // process of replica 0) wherever they are read.
  Status sync_buffers() {
    c10::NoGradGuard no_grad;
    for (const BufferSync& b : buffer_syncs) {
      if (!b.group) continue;
      at::Tensor t = *executors[0]->tensor(b.name);
      CONVEYOR_RETURN_IF_ERROR(processes->wait([&](transport::Done d) { b.group->broadcast(t, b.root, d); },
                                               "handing buffer '" + b.name + "' to the processes that read it"));
    }
    return Status::ok();
  }

  // Frees what no local stage reads (every replica's handle on it); the user's tensors keep
  // their identity (set_data), so optimizers and state_dict() still find them.
  void release_not_here() {
    if (released || not_here.empty()) return;
    c10::NoGradGuard no_grad;
    for (const auto& t : not_here) {
      for (const auto& ex : executors) {
        if (const at::Tensor* x = ex->tensor(t.name)) x->set_data(at::empty({0}, x->options()));
      }
    }
    released = true;
  }

  // Gives the released tensors their shapes back (contents: gather_state's broadcast).
  void materialize_not_here() {
    if (!released) return;
    c10::NoGradGuard no_grad;
    for (const auto& t : not_here) {
      const at::Tensor* mine = executors[0]->tensor(t.name);
      mine->set_data(at::empty(t.sizes, mine->options()));
      for (std::size_t r = 1; r < executors.size(); ++r) {
        if (const at::Tensor* x = executors[r]->tensor(t.name)) x->set_data(*mine);
      }
    }
    released = false;
  }

  const std::vector<std::int64_t>* released_sizes(const std::string& name) const {
    if (!released) return nullptr;
    for (const auto& t : not_here) {
      if (t.name == name) return &t.sizes;
    }
    return nullptr;
  }

  // Parameters read by stages in several processes (tied weights): their gradients summed
  // across the processes (one that does not read a parameter adds zeros), kept where read.
  Status reduce_across_processes() {
    c10::NoGradGuard no_grad;
    for (const auto& [name, read_here] : cross_shared) {
      at::Tensor p = *executors[0]->tensor(name);
      const auto* sizes = released_sizes(name);  // not read here: its shape, for zeros
      at::Tensor g = sizes ? at::zeros(*sizes, p.options()) : p.grad().defined() ? p.grad().clone() : at::zeros_like(p);
      CONVEYOR_RETURN_IF_ERROR(processes->wait([&](transport::Done d) { processes->all().allreduce(g, d); },
                                               "summing the gradient of '" + name + "' across processes"));
      if (read_here) p.mutable_grad() = g;
    }
    return Status::ok();
  }

  // The stage's allreduce (on the communication thread): the buckets not reduced during
  // backward, reduced now.
  Status finish_reduction(int stage) {
    if (stage_buckets[stage].empty()) return Status::ok();
    std::optional<c10::StreamGuard> on_collective;
    if (stream_device) {
      wait_all(final_done[stage], *collective_streams[stage]);
      on_collective.emplace(*collective_streams[stage]);
      std::lock_guard<std::mutex> lock(bucket_mu);
      allreduce_timed[stage].first = collective_events[stage]->record(*collective_streams[stage]);
    }
    Status result = Status::ok();
    for (int k = 0; k < static_cast<int>(stage_buckets[stage].size()); ++k) {
      {
        std::lock_guard<std::mutex> lock(bucket_mu);
        if (stage_buckets[stage][k].state == 2) continue;
        stage_buckets[stage][k].state = 2;  // a posted reduction not run yet finds it done
      }
      result = reduce_stage_bucket(stage, k);
      if (!result) break;
    }
    std::lock_guard<std::mutex> lock(bucket_mu);
    if (stream_device) allreduce_timed[stage].second = collective_events[stage]->record(*collective_streams[stage]);
    return result.is_ok() ? bucket_error : result;
  }

  // A replica's parameter accumulated its gradient (the autograd engine, on the replica's thread).
  void accumulated(int stage, int bucket, int replica) {
    if (!final_pass[pass_index(stage, replica)]) return;  // an earlier microbatch, or eager use
    std::lock_guard<std::mutex> lock(bucket_mu);
    Bucket& b = stage_buckets[stage][bucket];
    // With streams, the accumulation was queued on the stream current here (the engine's
    // for this gradient): the reduction waits for it there.
    if (stream_device) b.accumulated.push_back(collective_events[stage]->record(current_stream(*stream_device)));
    if (++b.fired < static_cast<int>(b.names.size() * local_replicas[stage].size()) || b.state != 0) return;
    b.state = 1;
    scheduler::CommThread::process()->post([this, stage, bucket] {
      std::optional<c10::StreamGuard> on_collective;
      {
        std::lock_guard<std::mutex> lock(bucket_mu);
        Bucket& b = stage_buckets[stage][bucket];
        if (b.state != 1) return;
        b.state = 2;
        b.early = true;
        if (stream_device) {
          wait_all(b.accumulated, *collective_streams[stage]);
          on_collective.emplace(*collective_streams[stage]);
          b.gpu_start = collective_events[stage]->record(*collective_streams[stage]);
        }
      }
      const auto start = std::chrono::steady_clock::now();
      Status s = reduce_stage_bucket(stage, bucket);
      std::lock_guard<std::mutex> lock(bucket_mu);
      stage_buckets[stage][bucket].start = start;
      stage_buckets[stage][bucket].end = std::chrono::steady_clock::now();
      if (stream_device) stage_buckets[stage][bucket].gpu_end = collective_events[stage]->record(*collective_streams[stage]);
      if (!s && bucket_error.is_ok()) bucket_error = s;
    });
  }
};

PipelineStep::PipelineStep(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PipelineStep::~PipelineStep() = default;

Result<std::unique_ptr<PipelineStep>> PipelineStep::create(std::shared_ptr<const graph::GraphExecutor> executor,
                                                           std::vector<std::vector<NodeId>> stages,
                                                           scheduler::ScheduleSpec spec, PipelineOptions options) {
  const graph::Graph& g = executor->graph();
  CONVEYOR_RETURN_IF_ERROR(graph::check_partition(g, stages));
  const int num_stages = static_cast<int>(stages.size());
  if (spec.stages() != num_stages) {
    return Status(ErrorCode::kInvalidArgument, "the schedule has " + std::to_string(spec.stages()) +
                                                   " stages but the partition " + std::to_string(num_stages));
  }
  if (g.outputs.size() != 1 || g.values[g.outputs[0]].kind != graph::ValueKind::kTensor ||
      !g.values[g.outputs[0]].shape.empty()) {
    return Status(ErrorCode::kInvalidArgument,
                  "the model's forward must return one scalar loss to be trained pipelined (it returns " +
                      std::to_string(g.outputs.size()) +
                      " values); compute the loss inside forward, or wrap the model so that it does");
  }
  auto impl = std::make_unique<Impl>();
  impl->loss = g.outputs[0];
  impl->bucket_bytes = std::max<std::int64_t>(options.bucket_bytes, 1);
  impl->intra_op_threads = std::max(options.intra_op_threads, 0);
  impl->rank_replicas = options.replicas.empty() ? std::vector<int>(static_cast<std::size_t>(spec.ranks), 1)
                                                 : options.replicas;
  if (static_cast<int>(impl->rank_replicas.size()) != spec.ranks) {
    return Status(ErrorCode::kInvalidArgument, "replica counts for " + std::to_string(impl->rank_replicas.size()) +
                                                   " ranks, but the schedule has " + std::to_string(spec.ranks));
  }
  int most = 1;
  for (int r : impl->rank_replicas) {
    if (r < 1) return Status(ErrorCode::kInvalidArgument, "every stage needs at least one replica");
    most = std::max(most, r);
  }
  for (int s = 0; s < num_stages; ++s) impl->stage_replicas.push_back(impl->rank_replicas[spec.rank_of_stage(s)]);

  // Which stage defines each value, which values depend on the batch, where their batch is.
  impl->producer.assign(g.values.size(), -1);
  for (int s = 0; s < num_stages; ++s) {
    for (NodeId n : stages[s]) {
      for (ValueId out : graph::Graph::node_outputs(g.nodes[n])) impl->producer[out] = s;
    }
  }
  std::set<std::string> batch_symbols;
  for (const auto& [symbol, role] : g.symbols) {
    if (role != "batch") continue;
    batch_symbols.insert(symbol);
    if (auto r = g.ranges.find(symbol); r != g.ranges.end()) {
      impl->batch_range.min = std::max(impl->batch_range.min, r->second.min);
      impl->batch_range.max = std::min(impl->batch_range.max, r->second.max);
    }
  }
  std::vector<bool> on_batch(g.values.size(), false);  // depends on a batched input
  // Depends on a batched input's data, and holds positions within a share (made from
  // arange(batch) and no data): such positions mean nothing once shares are joined and split.
  std::vector<bool> on_batch_data(g.values.size(), false), share_positions(g.values.size(), false);
  for (std::size_t i = 0; i < g.inputs.size(); ++i) {
    const graph::Value& v = g.values[g.inputs[i].value];
    impl->input_index[g.inputs[i].value] = static_cast<int>(i);
    const bool batched = v.kind == graph::ValueKind::kTensor && !v.shape.empty() &&
                         batch_symbols.count(v.shape[0].symbol) > 0;
    impl->batched_input.push_back(batched);
    on_batch[g.inputs[i].value] = batched;
    on_batch_data[g.inputs[i].value] = batched;
  }
  impl->batch_dim.assign(g.values.size(), -1);
  for (const auto& v : g.values) {
    for (std::size_t d = 0; d < v.shape.size(); ++d) {
      if (batch_symbols.count(v.shape[d].symbol)) {
        impl->batch_dim[v.id] = static_cast<int>(d);
        break;
      }
    }
  }
  // A dimension "k*s" at the front, made by flattening a batch-first tensor (view, reshape,
  // flatten), possibly followed by ops that keep the shape: samples stay contiguous runs of
  // k elements, so a share is a run of k * its samples. Other products are not split.
  impl->batch_scale.assign(g.values.size(), 1);
  {
    const std::vector<NodeId> defined_by = g.producers();
    for (const auto& v : g.values) {
      if (impl->batch_dim[v.id] >= 0 || v.shape.empty()) continue;
      const std::string& d0 = v.shape[0].symbol;
      const auto star = d0.find('*');
      if (star == std::string::npos) continue;
      std::string k = d0.substr(0, star), sym = d0.substr(star + 1);
      if (batch_symbols.count(k)) std::swap(k, sym);
      if (!batch_symbols.count(sym) || k.empty() || k.find_first_not_of("0123456789") != std::string::npos) continue;
      ValueId at = v.id;
      for (int hops = 0; hops < 64 && at >= 0 && defined_by[at] >= 0; ++hops) {
        const graph::Node& n = g.nodes[defined_by[at]];
        const auto ins = graph::Graph::node_inputs(n);
        if (ins.empty()) break;
        const graph::Value& x = g.values[ins[0]];
        if (n.op == "aten::view" || n.op == "aten::reshape" || n.op == "aten::_unsafe_view" ||
            n.op == "aten::flatten") {
          if (impl->batch_dim[x.id] == 0) {
            impl->batch_dim[v.id] = 0;
            impl->batch_scale[v.id] = std::stoll(k);
          }
          break;
        }
        bool same_shape = x.shape.size() == g.values[at].shape.size();
        for (std::size_t d = 0; same_shape && d < x.shape.size(); ++d) {
          same_shape = x.shape[d].symbol == g.values[at].shape[d].symbol && x.shape[d].size == g.values[at].shape[d].size;
        }
        if (!same_shape) break;
        at = x.id;
      }
    }
  }
  impl->is_batch_size.assign(g.values.size(), false);
  for (const auto& node : g.nodes) {
    const auto ins = graph::Graph::node_inputs(node);
    const auto outs = graph::Graph::node_outputs(node);
    if (node.op == "aten::sym_size" && ins.size() == 1 && outs.size() == 1 && node.args.size() == 2 &&
        node.args[1].kind == graph::Argument::Kind::kInt) {
      // The size of one dimension: the batch size (a share's own on each replica) or a
      // size that no replica changes.
      const auto& shape = g.values[ins[0]].shape;
      std::int64_t d = node.args[1].int_value;
      if (d < 0) d += static_cast<std::int64_t>(shape.size());
      impl->is_batch_size[outs[0]] = d >= 0 && d == impl->batch_dim[ins[0]];
      on_batch[outs[0]] = impl->is_batch_size[outs[0]];
      continue;
    }
    bool depends = false, on_data = false, positions = false;
    for (ValueId in : ins) {
      depends = depends || on_batch[in];
      on_data = on_data || on_batch_data[in];
      positions = positions || share_positions[in] || (node.op == "aten::arange" && impl->is_batch_size[in]);
    }
    for (ValueId out : outs) {
      on_batch[out] = depends;
      on_batch_data[out] = on_data;
      share_positions[out] = positions && !on_data;
    }
  }
  // Between stages with different replica counts a value is redistributed along its batch
  // dimension, or, when it does not depend on the batch, taken from any replica.
  for (int s = 0; s < num_stages; ++s) {
    for (ValueId v : graph::stage_boundary(g, stages[s]).inputs) {
      const int p = impl->producer[v];
      if (p < 0 || impl->stage_replicas[p] == impl->stage_replicas[s] || !on_batch[v] || impl->is_batch_size[v]) {
        continue;
      }
      const graph::Value& val = g.values[v];
      int batch_dims = 0;
      bool other_symbolic = false;
      for (std::size_t d = 0; d < val.shape.size(); ++d) {
        if (batch_symbols.count(val.shape[d].symbol) || (d == 0 && impl->batch_scale[v] > 1)) {
          ++batch_dims;
        } else if (val.shape[d].is_symbolic()) {
          other_symbolic = true;
        }
      }
      if (val.kind != graph::ValueKind::kTensor || batch_dims != 1 || other_symbolic || share_positions[v]) {
        return Status(ErrorCode::kUnsupported,
                      "value " + std::to_string(v) + " ('" + val.name + "') passes from stage " + std::to_string(p) +
                          " (" + std::to_string(impl->stage_replicas[p]) + " replicas) to stage " +
                          std::to_string(s) + " (" + std::to_string(impl->stage_replicas[s]) +
                          " replicas) but has no plain batch dimension to redistribute along (or holds "
                          "positions within a share, like arange(batch)); give both "
                          "stages the same number of replicas, or cut the model elsewhere");
      }
    }
  }

  // Replica executors: parameters share storage, buffers are copies.
  impl->executors.push_back(executor);
  for (int r = 1; r < most; ++r) {
    CONVEYOR_ASSIGN_OR_RETURN(auto replica, executor->replica());
    impl->executors.push_back(std::move(replica));
  }
  impl->programs.resize(static_cast<std::size_t>(num_stages));
  for (int s = 0; s < num_stages; ++s) {
    for (int r = 0; r < impl->stage_replicas[s]; ++r) {
      CONVEYOR_ASSIGN_OR_RETURN(auto program, impl->executors[r]->stage(stages[s]));
      impl->programs[s].push_back(std::move(program));
    }
  }
  // Parameters by the stages that read them: reduced by their stage, or after the step
  // when several stages read them.
  std::map<ValueId, std::set<int>> readers;
  for (int s = 0; s < num_stages; ++s) {
    for (NodeId n : stages[s]) {
      for (ValueId in : graph::Graph::node_inputs(g.nodes[n])) readers[in].insert(s);
    }
  }
  impl->stage_parameters.resize(static_cast<std::size_t>(num_stages));
  for (const auto& b : g.bindings) {
    if (b.kind == graph::Binding::Kind::kBuffer) impl->buffers.push_back(b.name);
    if (b.kind != graph::Binding::Kind::kParameter) continue;
    const at::Tensor* t = executor->tensor(b.name);
    if (t == nullptr || !t->requires_grad() || !readers.count(b.value)) continue;
    const auto& who = readers[b.value];
    if (who.size() == 1) {
      impl->stage_parameters[*who.begin()].push_back(b.name);
    } else {
      impl->shared_parameters.push_back(b.name);
    }
  }
  CONVEYOR_ASSIGN_OR_RETURN(impl->schedule, scheduler::make_schedule(spec));
  impl->stage_across.assign(static_cast<std::size_t>(num_stages), nullptr);
  if (options.seed) {
    impl->random_seed = *options.seed;
  } else {
    at::CPUGeneratorImpl* global = at::check_generator<at::CPUGeneratorImpl>(at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(global->mutex_);
    impl->random_seed = global->random64();
  }
  if (options.processes) {
    std::vector<std::vector<int>> placement = options.replica_process;
    if (placement.empty()) {  // a rank's replicas all on its process
      for (std::size_t rank = 0; rank < options.rank_process.size(); ++rank) {
        placement.emplace_back(static_cast<std::size_t>(rank < impl->rank_replicas.size() ? impl->rank_replicas[rank] : 1),
                               options.rank_process[rank]);
      }
    }
    CONVEYOR_RETURN_IF_ERROR(impl->distribute(g, stages, options.processes, placement));
    // One seed for the job, process 0's: a replica draws the same wherever it runs.
    at::Tensor seed = at::tensor({static_cast<std::int64_t>(impl->random_seed)}, at::kLong);
    CONVEYOR_RETURN_IF_ERROR(options.processes->broadcast(seed, 0).with_context("handing out the random seed"));
    impl->random_seed = static_cast<std::uint64_t>(seed.item<std::int64_t>());
  }
  // Which replicas run here: all of them, or across processes those placed on this one.
  scheduler::LocalReplicas local(static_cast<std::size_t>(spec.ranks));  // per rank and replica, for the runner
  impl->local_replicas.resize(static_cast<std::size_t>(num_stages));
  for (int s = 0; s < num_stages; ++s) {
    const int rank = spec.rank_of_stage(s);
    local[rank].assign(static_cast<std::size_t>(impl->stage_replicas[s]), false);
    for (int r = 0; r < impl->stage_replicas[s]; ++r) {
      if (!impl->here(s, r)) continue;
      impl->local_replicas[s].push_back(r);
      local[rank][r] = true;
    }
  }
  for (int s = 0; s < num_stages; ++s) {
    impl->stage_groups.push_back(transport::make_inproc_group(std::max<int>(1, impl->local_replicas[s].size())));
  }
  impl->shared_group = transport::make_inproc_group(most);
  for (int r = 0; r < most; ++r) impl->shared_members.push_back(r);
  impl->next_across.assign(static_cast<std::size_t>(num_stages), 0);
  impl->hook_target->im = impl.get();
  impl->final_pass.reset(new std::atomic<bool>[static_cast<std::size_t>(num_stages * most)]);
  for (int k = 0; k < num_stages * most; ++k) impl->final_pass[k] = false;
  impl->stage_buckets.resize(static_cast<std::size_t>(num_stages));
  for (int s = 0; s < num_stages; ++s) {
    if (impl->stage_replicas[s] < 2 || impl->local_replicas[s].empty()) continue;
    std::vector<std::string> last_first(impl->stage_parameters[s].rbegin(), impl->stage_parameters[s].rend());
    for (auto& names : impl->make_buckets(last_first)) impl->stage_buckets[s].push_back({std::move(names)});
    for (int b = 0; b < static_cast<int>(impl->stage_buckets[s].size()); ++b) {
      for (const auto& name : impl->stage_buckets[s][b].names) {
        for (int r : impl->local_replicas[s]) {
          const at::Tensor& t = *impl->executors[r]->tensor(name);
          // Chained in front of any hook already there (the user's, another pipeline's).
          auto& slot = torch::autograd::impl::post_acc_grad_hooks(t);
          auto hook = std::make_unique<Impl::Accumulated>(impl->hook_target, s, b, r, std::move(slot));
          impl->installed_hooks.emplace_back(t, hook.get());
          slot = std::move(hook);
        }
      }
    }
  }
  // Streams, when the model lives on a device that has them.
  for (const auto& b : g.bindings) {
    const at::Tensor* t = executor->tensor(b.name);
    if (t != nullptr && t->defined() && device_has_streams(t->device())) {
      impl->stream_device = t->device();
      break;
    }
  }
  if (options.processes) CONVEYOR_RETURN_IF_ERROR(impl->connect_remote(options.transport));
  if (impl->stream_device) {
    const c10::Device device = *impl->stream_device;
    for (int rank = 0; rank < spec.ranks; ++rank) {
      impl->first_worker.push_back(static_cast<int>(impl->streams.size()));
      for (int r = 0; r < impl->rank_replicas[rank]; ++r) impl->streams.push_back(std::make_unique<ReplicaStreams>(device));
    }
    for (int s = 0; s < num_stages; ++s) {
      impl->collective_streams.emplace_back(pool_stream(device));
      impl->collective_events.push_back(std::make_unique<EventPool>(device.type()));
    }
    impl->step_events = std::make_unique<EventPool>(device.type());
  }
  impl->step_timeout = options.step_timeout;
  // The replicas' actors live as long as the pipeline; their hooks read the step's state.
  Impl* im = impl.get();
  scheduler::RunnerHooks hooks;
  hooks.compute = [im](int rank, int replica, const Action& a) -> Status {
    thread_local int configured = 0;  // a replica's thread keeps its setting across steps
    if (configured != im->replica_threads) {
      at::set_num_threads(im->replica_threads);
      configured = im->replica_threads;
    }
    // With streams, the action runs on the replica's compute stream between two timing events.
    ReplicaStreams* rs = im->streams_of_rank(rank, replica);
    std::optional<c10::StreamGuard> on_compute;
    c10::Event* start = nullptr;
    if (rs != nullptr) {
      on_compute.emplace(rs->compute);
      start = rs->events.record(rs->compute);
    }
    Status s = Status::ok();
    {
      // Forward under the caller's autocast; backward without, as eager's loss.backward()
      // outside the autocast region.
      const bool forward = a.kind == ActionKind::kForward;
      AutocastScope autocast(forward ? im->caller_autocast : AutocastState{});
      s = im->compute(replica, a);
    }
    if (rs != nullptr) {
      c10::Event* end = rs->events.record(rs->compute);
      im->timed[im->first_worker[rank] + replica].push_back({rank, replica, a, start, end});
    }
    return s;
  };
  hooks.allreduce = [im](int, int, const Action& a) -> Status {
    return im->finish_reduction(a.stage);
  };
  if (impl->processes) {
    hooks.transfer = [im](int, int replica, const Action& a) { return im->send_remote(replica, a); };
    hooks.receive = [im](int, int replica, const Action& a, std::function<void(Status)> arrived) {
      im->receive_remote(replica, a, std::move(arrived));
    };
  }
  CONVEYOR_ASSIGN_OR_RETURN(impl->coordinator,
                            actors::Coordinator::create(impl->schedule, std::move(hooks), impl->rank_replicas,
                                                        std::move(options.predicted), std::move(local)));
  std::unique_ptr<PipelineStep> step(new PipelineStep(std::move(impl)));
  // Every process starts from the same parameters and buffers, their owners', and keeps
  // only what its stages read.
  CONVEYOR_RETURN_IF_ERROR(step->gather_state());
  step->impl_->release_not_here();
  return step;
}

Status PipelineStep::Impl::compute(int replica, const Action& a) {
  if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) {
    // The pass that accumulates this replica's last gradients of the step for the stage.
    const int done = backwards_done[a.stage][replica]++;
    const bool last = done + 1 == schedule.spec.microbatches;
    auto& flag = final_pass[pass_index(a.stage, replica)];
    flag = last;
    Status s = a.kind == ActionKind::kBackward ? backward(replica, a, /*split=*/false)
                                               : backward_weight(replica, a);
    flag = false;
    if (ReplicaStreams* rs = streams_of(a.stage, replica); last && rs != nullptr) {
      final_done[a.stage][replica] = rs->events.record(rs->compute);
    }
    return s;
  }
  switch (a.kind) {
    case ActionKind::kForward: return forward(replica, a);
    case ActionKind::kBackwardInput: return backward(replica, a, /*split=*/true);
    case ActionKind::kOptimizerStep: return Status::ok();  // the user's optimizer steps after the call
    default: return Status(ErrorCode::kInternal, "not a compute action: " + scheduler::action_text(a));
  }
}

Result<StepResult> PipelineStep::run(const std::vector<c10::IValue>& inputs, double grad_scale) {
  Impl& im = *impl_;
  const int m = im.schedule.spec.microbatches;
  if (im.out_of_step) {
    return Status(ErrorCode::kExecution, "an earlier step failed and left the processes out of step; "
                                         "restart the job (every process) after fixing its cause");
  }
  im.release_not_here();  // after gather_state(), this process again holds only its stages' share
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
  const int most = *std::max_element(im.stage_replicas.begin(), im.stage_replicas.end());
  if (batch / m < most) {
    return Status(ErrorCode::kInvalidArgument,
                  "the batch has " + std::to_string(batch) + " samples: " + std::to_string(m) +
                      " microbatches leave " + std::to_string(batch / m) + " per microbatch, fewer than the " +
                      std::to_string(most) +
                      " replicas of a stage; use a larger batch, fewer microbatches or fewer replicas (a data "
                      "loader's smaller last batch can be dropped: drop_last=True)");
  }
  {
    // Each replica runs a share of a microbatch; the graph holds only for the sizes its
    // capture allowed (a kernel chosen by size, a branch on the batch size).
    const int fewest = *std::min_element(im.stage_replicas.begin(), im.stage_replicas.end());
    const std::int64_t largest = ((batch + m - 1) / m + fewest - 1) / fewest, smallest = batch / m / most;
    auto outside = [&](const char* bound, std::int64_t limit, std::int64_t share, const char* change) {
      return Status(ErrorCode::kInvalidArgument,
                    std::string("the model's graph holds for ") + bound + " " + std::to_string(limit) +
                        " samples at once (capture found a guard on the batch size: a kernel chosen by size or a "
                        "branch on it), but a replica would run " + std::to_string(share) + " (a batch of " +
                        std::to_string(batch) + " in " + std::to_string(m) + " microbatches, shared by up to " +
                        std::to_string(most) + " replicas); use " + change);
    };
    if (largest > im.batch_range.max) {
      return outside("at most", im.batch_range.max, largest, "more microbatches or replicas, or a smaller batch");
    }
    if (smallest < im.batch_range.min) {
      return outside("at least", im.batch_range.min, smallest, "fewer microbatches or replicas, or a larger batch");
    }
  }
  im.batch = batch;
  im.micro_inputs.assign(static_cast<std::size_t>(m), {});
  im.micro_length.assign(static_cast<std::size_t>(m), 0);
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
      if (!parts.empty()) im.micro_length[mb] = parts[mb].size(0);
    }
  }
  // Replicas start from the user's buffers; their gradients start empty.
  {
    c10::NoGradGuard no_grad;
    for (std::size_t r = 1; r < im.executors.size(); ++r) {
      for (const auto& name : im.buffers) {
        if (im.processes && !im.buffers_here.count(name)) continue;  // released here
        at::Tensor mine = *im.executors[r]->tensor(name);
        mine.copy_(*im.executors[0]->tensor(name));
      }
      for (const auto& stage : im.stage_parameters) {
        for (const auto& name : stage) {
          at::Tensor p = *im.executors[r]->tensor(name);
          p.mutable_grad().reset();
        }
      }
      for (const auto& name : im.shared_parameters) {
        at::Tensor p = *im.executors[r]->tensor(name);
        p.mutable_grad().reset();
      }
    }
  }
  im.values.clear();
  im.joined.clear();
  im.grads.clear();
  im.joined_grads.clear();
  im.activations.clear();
  im.losses.clear();
  im.grad_scale = grad_scale;
  im.this_step = im.steps_begun++;
  im.backwards_done.assign(im.stage_replicas.size(), std::vector<int>(im.executors.size(), 0));
  for (auto& stage : im.stage_buckets) {
    for (auto& b : stage) b = Impl::Bucket{std::move(b.names)};
  }
  im.bucket_error = Status::ok();
  std::fill(im.next_across.begin(), im.next_across.end(), 0);
  {
    std::lock_guard<std::mutex> lock(im.across->mu);
    im.across->error = Status::ok();
    im.across->times.clear();
  }
  // With streams: every stream of the step starts after the caller's work so far (its
  // inputs, the last optimizer step), the events of the last step are reused.
  im.final_done.assign(im.stage_replicas.size(), std::vector<c10::Event*>(im.executors.size(), nullptr));
  im.timed.assign(im.streams.size(), {});
  im.allreduce_timed.assign(im.stage_replicas.size(), {nullptr, nullptr});
  if (im.stream_device) {
    im.step_events->rewind();
    for (auto& pool : im.collective_events) pool->rewind();
    im.step_start = im.step_events->record(current_stream(*im.stream_device));
    im.step_start_host = std::chrono::steady_clock::now();
    for (auto& rs : im.streams) {
      rs->events.rewind();
      for (const c10::Stream& stream : {rs->compute, rs->send, rs->recv}) im.step_start->block(stream);
    }
    for (const auto& stream : im.collective_streams) im.step_start->block(*stream);
  }
  // Each replica's compute thread gets its share of the caller's intra-op threads (they
  // would otherwise each start a full-size pool and oversubscribe the cores).
  const int caller_threads = at::get_num_threads();
  int workers = 0;
  for (int r : im.rank_replicas) workers += r;
  const int threads = im.intra_op_threads > 0 ? im.intra_op_threads : std::max(1, caller_threads / workers);
  im.replica_threads = threads;
  im.caller_autocast = AutocastState::of_this_thread();
  // The buckets reduced during backward join the measured spans (the trace, the live
  // profile) before the step's profile goes to the partitioner actor.
  std::pair<int, int> reduction{0, 0};
  Status across_status = Status::ok();
  bool across_finished = false;
  auto add_reductions = [&im, &reduction, &across_status, &across_finished](scheduler::RunResult& measured) {
    if (im.stream_device) im.device_times(measured);
    for (int s = 0; s < static_cast<int>(im.stage_buckets.size()); ++s) {
      for (const auto& b : im.stage_buckets[s]) {
        ++reduction.first;
        if (!b.early) continue;
        ++reduction.second;
        auto at = [&](std::chrono::steady_clock::time_point t) {
          return std::chrono::duration<double>(t - measured.start).count();
        };
        const double start = im.stream_device ? im.device_time(b.gpu_start, measured) : at(b.start);
        const double end = im.stream_device ? im.device_time(b.gpu_end, measured) : at(b.end);
        for (int r : im.local_replicas[s]) {
          measured.spans.push_back({im.schedule.spec.rank_of_stage(s), scheduler::Span::Stream::kCollective,
                                    Action{ActionKind::kAllReduce, -1, -1, s}, start, end, r});
        }
      }
    }
    // Across processes, the step ends with the sums across them (they join the measured
    // spans on the track of this process's first replica of the stage).
    if (!im.processes) return;
    {
      std::lock_guard<std::mutex> lock(im.mu);
      if (!im.send_error.is_ok()) return;  // out of step: the caller stops the job
    }
    across_status = im.finish_across();
    across_finished = true;
    std::lock_guard<std::mutex> lock(im.across->mu);
    for (const auto& t : im.across->times) {
      const double start = std::chrono::duration<double>(t.start - measured.start).count();
      const double end = std::chrono::duration<double>(t.end - measured.start).count();
      measured.spans.push_back({im.schedule.spec.rank_of_stage(t.stage), scheduler::Span::Stream::kAcrossProcesses,
                                Action{ActionKind::kAllReduce, -1, -1, t.stage}, start, end,
                                im.local_replicas[t.stage].front()});
      measured.step_time_s = std::max(measured.step_time_s, end);
    }
  };
  {
    std::lock_guard<std::mutex> lock(im.arrivals_mu);
    im.arrivals.clear();
  }
  im.grads_out.clear();
  im.send_error = Status::ok();
  auto measured = im.coordinator->run_step(im.step_timeout, add_reductions);
  at::set_num_threads(caller_threads);  // the setting is process-wide as well as per thread
  if (im.stream_device) synchronize_device(*im.stream_device);  // before the step's tensors go
  im.value_ready.clear();
  im.joined_ready.clear();
  im.grad_ready.clear();
  im.joined_grad_ready.clear();
  im.values.clear();
  im.joined.clear();
  im.activations.clear();
  im.grads.clear();
  im.joined_grads.clear();
  Status send_error = Status::ok();
  {
    std::lock_guard<std::mutex> lock(im.mu);  // a send still in flight may fail meanwhile
    send_error = im.send_error;
  }
  if (im.processes && (!measured || !send_error.is_ok())) {
    // Out of step with the other processes: this process's part of the job is over.
    im.out_of_step = true;
    im.processes->abort(measured ? send_error : measured.status());
  }
  if (!measured) return measured.status();
  CONVEYOR_RETURN_IF_ERROR(send_error);
  if (im.processes) {
    if (Status s = across_finished ? across_status : im.finish_across(); !s) {
      im.out_of_step = true;
      im.processes->abort(s);
      return s;
    }
  }
  CONVEYOR_RETURN_IF_ERROR(im.reduce(im.shared_parameters, im.shared_members, im.shared_group));
  if (im.processes) {
    Status s = im.reduce_across_processes();
    if (s) s = im.sync_buffers();
    if (!s) {
      im.out_of_step = true;
      return s;
    }
  }
  StepResult out;
  std::tie(out.buckets, out.buckets_reduced_during_backward) = reduction;
  im.last = *measured;
  im.last_reduction = {out.buckets, out.buckets_reduced_during_backward};
  out.measured = std::move(*measured);
  const int loss_stage = im.producer[im.loss], loss_replicas = im.stage_replicas[loss_stage];
  // The batch's loss: every share's loss weighted by its size, summed in microbatch and
  // replica order. Across processes every process gets every weighted share (exact: each
  // slot has one process's value, the others add zeros) and sums them in that same order,
  // so every process holds the single-process value, bit for bit.
  at::Tensor total;
  std::map<std::pair<int, int>, at::Tensor> weighted;  // (mb, replica), this process's
  for (int mb = 0; mb < m; ++mb) {
    for (int i : im.local_replicas[loss_stage]) weighted[{mb, i}] = im.losses.at({mb, i}) * im.weight(mb, loss_replicas, i);
  }
  if (im.processes) {
    const std::int64_t slots = static_cast<std::int64_t>(m) * loss_replicas;
    at::Tensor carrier = at::zeros({slots + 2}, at::kDouble);  // the shares, then dtype codes and how many sent them
    auto* c = carrier.data_ptr<double>();
    for (const auto& [key, w] : weighted) c[key.first * loss_replicas + key.second] = w.item<double>();
    if (!weighted.empty()) {
      c[slots] = static_cast<double>(weighted.begin()->second.scalar_type());
      c[slots + 1] = 1;
    }
    Status s = im.processes->wait([&](transport::Done d) { im.processes->all().allreduce(carrier, d); },
                                  "handing every process the step's loss");
    if (!s) {
      im.out_of_step = true;
      return s;
    }
    const auto dtype = static_cast<at::ScalarType>(std::lround(c[slots] / std::max(c[slots + 1], 1.0)));
    const auto options = at::TensorOptions().dtype(dtype).device(im.stream_device.value_or(c10::Device(c10::kCPU)));
    for (int mb = 0; mb < m; ++mb) {
      for (int i = 0; i < loss_replicas; ++i) {
        auto it = weighted.find({mb, i});
        add_into(total, it != weighted.end() ? it->second : at::scalar_tensor(c[mb * loss_replicas + i], options));
      }
    }
  } else {
    for (const auto& [key, w] : weighted) add_into(total, w);
  }
  out.loss = total;
  return out;
}

std::vector<std::pair<std::string, int>> PipelineStep::owners() const { return impl_->owners; }

Status PipelineStep::gather_state() {
  Impl& im = *impl_;
  if (!im.processes) return Status::ok();
  im.materialize_not_here();
  c10::NoGradGuard no_grad;
  for (const auto& [name, owner] : im.owners) {
    CONVEYOR_RETURN_IF_ERROR(im.processes->broadcast(*im.executors[0]->tensor(name), owner));
  }
  return Status::ok();
}

std::pair<int, int> PipelineStep::last_reduction() const { return impl_->last_reduction; }

const scheduler::RunResult& PipelineStep::last_step() const { return impl_->last; }

Result<actors::ProfileReport> PipelineStep::profile_report() const { return impl_->coordinator->profile_report(); }

Status PipelineStep::write_trace(const std::string& path) const {
  if (impl_->last.spans.empty()) return Status(ErrorCode::kInvalidArgument, "no step has run yet: nothing to trace");
  scheduler::SimulationResult spans;
  spans.spans = impl_->last.spans;
  return trace::write_step_trace(path, impl_->schedule, spans, "measured", impl_->rank_replicas);
}

}  // namespace conveyor::runtime
