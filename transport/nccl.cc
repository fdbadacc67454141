#include "transport/nccl.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "common/blocking_call.h"
#include "transport/nccl_library.h"

namespace conveyor::transport {
namespace {

// Every NCCL launch of the process, in one order (nccl.h, "Order").
std::mutex& launch_mutex() {
  static std::mutex mu;
  return mu;
}

// NCCL's type for `t`, for an operation that sums (`sums`) or only moves data.
Result<nccl_abi::DataType> nccl_type(at::ScalarType t, bool sums) {
  switch (t) {
    case at::kChar: return nccl_abi::kInt8;
    case at::kByte: return nccl_abi::kUint8;
    case at::kInt: return nccl_abi::kInt32;
    case at::kLong: return nccl_abi::kInt64;
    case at::kHalf: return nccl_abi::kFloat16;
    case at::kFloat: return nccl_abi::kFloat32;
    case at::kDouble: return nccl_abi::kFloat64;
    case at::kBFloat16: return nccl_abi::kBfloat16;
    case at::kFloat8_e4m3fn: return nccl_abi::kFloat8e4m3;
    case at::kFloat8_e5m2: return nccl_abi::kFloat8e5m2;
    case at::kBool:
      if (!sums) return nccl_abi::kUint8;
      break;
    default: break;
  }
  return Status(ErrorCode::kUnsupported, std::string("NCCL cannot ") + (sums ? "sum" : "move") + " " +
                                             c10::toString(t) + " tensors; convert them (to float, say) first");
}

// Why `device` is not a CUDA device of this process, or OK.
Status check_cuda_device(const c10::Device& device) {
  if (!device.is_cuda()) {
    return Status(ErrorCode::kInvalidArgument, "NCCL groups live on CUDA devices, not " + device.str() +
                                                   "; use the UCX group (ProcessGroup) for CPU tensors");
  }
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) || !at::detail::getCUDAHooks().hasCUDA()) {
    return Status(ErrorCode::kUnsupported, "this process has no CUDA (torch without CUDA, its CUDA library not "
                                           "loaded, or no GPU); NCCL needs a GPU");
  }
  // The CUDA runtime's count, through torch's hooks: the registered guard's count is not to
  // be trusted (after torch.export has run, it let a machine without a GPU through).
  const int count = at::detail::getCUDAHooks().getNumGPUs();
  if (count == 0) return Status(ErrorCode::kUnsupported, "no CUDA device is visible to this process; NCCL needs a GPU");
  if (!device.has_index() || device.index() >= count) {
    return Status(ErrorCode::kInvalidArgument, "NCCL needs a CUDA device with an index below " + std::to_string(count) +
                                                   " (the devices this process sees), not " + device.str());
  }
  return Status::ok();
}

class NcclMember final : public NcclGroup {
 public:
  NcclMember(const NcclLibrary& nccl, nccl_abi::Comm comm, int rank, int size, c10::Device device)
      : nccl_(nccl), comm_(comm), rank_(rank), size_(size), device_(device),
        stream_(c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device)),
        completion_([this] { complete(); }) {}

  ~NcclMember() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    completion_.join();  // every launched operation has finished and called back
    std::lock_guard<std::mutex> launch(launch_mutex());
    if (!aborted_) nccl_.CommDestroy(comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  c10::Device device() const override { return device_; }

  void allreduce(at::Tensor tensor, Done done) override {
    run({CollectiveKind::kAllReduce, 0, tensor, {}}, std::move(done));
  }
  void reduce(at::Tensor tensor, int root, Done done) override {
    run({CollectiveKind::kReduce, root, tensor, {}}, std::move(done));
  }
  void broadcast(at::Tensor tensor, int root, Done done) override {
    run({CollectiveKind::kBroadcast, root, tensor, {}}, std::move(done));
  }
  void allgather(at::Tensor in, at::Tensor out, Done done) override {
    run({CollectiveKind::kAllGather, 0, in, out}, std::move(done));
  }
  void reduce_scatter(at::Tensor in, at::Tensor out, Done done) override {
    run({CollectiveKind::kReduceScatter, 0, in, out}, std::move(done));
  }

  void exchange(std::vector<at::Tensor> send, int to, std::vector<at::Tensor> recv, int from, Done done) override {
    const std::string what = "point to point (" + std::to_string(send.size()) + " sends to member " +
                             std::to_string(to) + ", " + std::to_string(recv.size()) + " receives from member " +
                             std::to_string(from) + ")";
    auto bad = [&](const std::string& why) {
      return done(Status(ErrorCode::kInvalidArgument, "NCCL " + what + " on member " + std::to_string(rank_) + ": " + why));
    };
    if (!send.empty() && (to < 0 || to >= size_)) return bad("the peer must be a member, 0 to " + std::to_string(size_ - 1));
    if (!recv.empty() && (from < 0 || from >= size_)) return bad("the peer must be a member, 0 to " + std::to_string(size_ - 1));
    std::vector<nccl_abi::DataType> types;
    for (const auto* list : {&send, &recv}) {
      for (const at::Tensor& t : *list) {
        if (std::string why = unusable(t); !why.empty()) return bad(why);
        auto type = nccl_type(t.scalar_type(), /*sums=*/false);
        if (!type.is_ok()) return done(type.status());
        types.push_back(*type);
      }
    }
    std::vector<at::Tensor> hold = send;
    hold.insert(hold.end(), recv.begin(), recv.end());
    launch(std::move(hold), what, std::move(done), [&](nccl_abi::Stream s) {
      nccl_abi::Result r = nccl_.GroupStart();
      std::size_t k = 0;
      for (const at::Tensor& t : send) {
        if (r == nccl_abi::kSuccess) r = nccl_.Send(t.data_ptr(), static_cast<std::size_t>(t.numel()), types[k], to, comm_, s);
        ++k;
      }
      for (const at::Tensor& t : recv) {
        if (r == nccl_abi::kSuccess) r = nccl_.Recv(t.data_ptr(), static_cast<std::size_t>(t.numel()), types[k], from, comm_, s);
        ++k;
      }
      const nccl_abi::Result ended = nccl_.GroupEnd();  // always: a group once started must end
      return r != nccl_abi::kSuccess ? r : ended;
    });
  }

  void abort(Status error) override {
    std::lock_guard<std::mutex> launch(launch_mutex());
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (aborted_) return;
      aborted_ = true;
      error_ = std::move(error);
    }
    nccl_.CommAbort(comm_);  // NCCL's kernels waiting for a lost member end; their events complete
    cv_.notify_all();
  }

 private:
  struct Pending {
    std::unique_ptr<c10::Event> finished;
    std::vector<at::Tensor> hold;  // alive until the kernel is done
    Done done;
    std::string what;
  };

  // Why `t` cannot be one of this member's NCCL buffers; empty when it can.
  std::string unusable(const at::Tensor& t) const {
    if (!t.defined()) return "an undefined tensor";
    if (t.device() != device_) return "the group's tensors live on " + device_.str();
    if (!t.is_contiguous()) return "NCCL needs contiguous tensors (call .contiguous())";
    return "";
  }

  // The member's own arguments, before anything launches.
  Status check(const CollectiveCall& call) const {
    auto bad = [&](const std::string& why) {
      return Status(ErrorCode::kInvalidArgument, "NCCL " + call.text(rank_) + ": " + why);
    };
    for (const at::Tensor* t : {&call.in, &call.out}) {
      const bool needed = t == &call.in || call.kind == CollectiveKind::kAllGather ||
                          call.kind == CollectiveKind::kReduceScatter;
      if (!needed) continue;
      if (std::string why = unusable(*t); !why.empty()) return bad(why);
      if (t->scalar_type() != call.in.scalar_type()) return bad("in and out differ in dtype");
    }
    if ((call.kind == CollectiveKind::kReduce || call.kind == CollectiveKind::kBroadcast) &&
        (call.root < 0 || call.root >= size_)) {
      return bad("the root must be a member, 0 to " + std::to_string(size_ - 1));
    }
    if (call.kind == CollectiveKind::kAllGather && call.out.numel() != call.in.numel() * size_) {
      return bad("out must hold " + std::to_string(size_) + " times in's elements");
    }
    if (call.kind == CollectiveKind::kReduceScatter && call.in.numel() != call.out.numel() * size_) {
      return bad("in must hold " + std::to_string(size_) + " times out's elements");
    }
    return Status::ok();
  }

  void run(const CollectiveCall& call, Done done) {
    if (Status s = check(call); !s.is_ok()) return done(s);
    const bool sums = call.kind == CollectiveKind::kAllReduce || call.kind == CollectiveKind::kReduce ||
                      call.kind == CollectiveKind::kReduceScatter;
    auto type = nccl_type(call.in.scalar_type(), sums);
    if (!type.is_ok()) return done(type.status());
    const std::string what = collective_kind_name(call.kind);
    void* in = call.in.data_ptr();
    void* out = call.out.defined() ? call.out.data_ptr() : in;
    const std::size_t n = static_cast<std::size_t>(call.in.numel());
    launch({call.in, call.out}, what, std::move(done), [&, t = *type](nccl_abi::Stream s) {
      switch (call.kind) {
        case CollectiveKind::kAllReduce: return nccl_.AllReduce(in, in, n, t, nccl_abi::kSum, comm_, s);
        case CollectiveKind::kReduce: return nccl_.Reduce(in, in, n, t, nccl_abi::kSum, call.root, comm_, s);
        case CollectiveKind::kBroadcast: return nccl_.Broadcast(in, in, n, t, call.root, comm_, s);
        case CollectiveKind::kAllGather: return nccl_.AllGather(in, out, n, t, comm_, s);
        case CollectiveKind::kReduceScatter:
          return nccl_.ReduceScatter(in, out, static_cast<std::size_t>(call.out.numel()), t, nccl_abi::kSum, comm_, s);
      }
      return nccl_abi::Result{nccl_abi::kSuccess};
    });
  }

  // Launches `issue` (NCCL calls on the given stream) under the process-wide launch lock, on
  // the member's stream once the caller's current stream's work is done; `done` runs on the
  // completion thread once the kernels have finished (or at once with a launch error).
  void launch(std::vector<at::Tensor> hold, const std::string& what, Done done,
              const std::function<nccl_abi::Result(nccl_abi::Stream)>& issue) {
    for (at::Tensor& t : hold) t = without_python(t);
    Pending pending{std::make_unique<c10::Event>(device_.type()), std::move(hold), std::move(done), what};
    {
      std::lock_guard<std::mutex> launch(launch_mutex());
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (aborted_) {
          Status error = error_;
          return pending.done(error);
        }
      }
      c10::DeviceGuard on_device(device_);
      c10::impl::VirtualGuardImpl impl(device_.type());
      c10::Event inputs_ready(device_.type());
      inputs_ready.record(impl.getStream(device_));  // after what the caller queued
      inputs_ready.block(stream_);
      const nccl_abi::Result r = issue(static_cast<nccl_abi::Stream>(stream_.native_handle()));
      if (Status st = nccl_.check(r, what, comm_); !st.is_ok()) return pending.done(st);
      for (const at::Tensor& t : pending.hold) {
        if (t.defined()) impl.recordDataPtrOnStream(t.storage().data_ptr(), stream_);
      }
      pending.finished->record(stream_);
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(pending));
    }
    cv_.notify_all();
  }

  // The completion thread: waits for each launched operation's kernel in launch order, then
  // calls its `done` with NCCL's verdict.
  void complete() {
    for (;;) {
      Pending p;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        p = std::move(queue_.front());
        queue_.pop_front();
      }
      p.finished->synchronize();
      Status result = Status::ok();
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (aborted_) result = error_;
      }
      if (result.is_ok()) {
        nccl_abi::Result async = nccl_abi::kSuccess;
        nccl_.CommGetAsyncError(comm_, &async);
        if (async != nccl_abi::kSuccess && async != nccl_abi::kInProgress) result = nccl_.check(async, p.what, comm_);
      }
      p.hold.clear();
      p.done(result);
    }
  }

  const NcclLibrary& nccl_;
  nccl_abi::Comm comm_;
  int rank_, size_;
  c10::Device device_;
  c10::Stream stream_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stopping_ = false, aborted_ = false;
  Status error_ = Status::ok();
  std::thread completion_;  // last: starts once everything above exists
};

class NcclLane final : public Lane {
 public:
  NcclLane(std::shared_ptr<NcclGroup> group, int peer) : group_(std::move(group)), peer_(peer) {}
  void send(std::vector<at::Tensor> tensors, Done done) override {
    group_->exchange(std::move(tensors), peer_, {}, peer_, std::move(done));
  }
  void recv(std::vector<at::Tensor> into, Done done) override {
    group_->exchange({}, peer_, std::move(into), peer_, std::move(done));
  }
  void abort(Status error) override { group_->abort(std::move(error)); }

 private:
  std::shared_ptr<NcclGroup> group_;
  int peer_;
};

}  // namespace

std::shared_ptr<Lane> make_nccl_lane(std::shared_ptr<NcclGroup> group, int peer) {
  return std::make_shared<NcclLane>(std::move(group), peer);
}

Result<std::vector<std::uint8_t>> nccl_unique_id() {
  CONVEYOR_ASSIGN_OR_RETURN(const NcclLibrary* nccl, nccl_library());
  nccl_abi::UniqueId id{};
  CONVEYOR_RETURN_IF_ERROR(nccl->check(nccl->GetUniqueId(&id), "ncclGetUniqueId"));
  std::vector<std::uint8_t> bytes(nccl_abi::kUniqueIdBytes);
  std::memcpy(bytes.data(), id.internal, bytes.size());
  return bytes;
}

Status nccl_usable_on(const c10::Device& device) {
  CONVEYOR_RETURN_IF_ERROR(check_cuda_device(device));
  return nccl_library().status();
}

Result<std::string> nccl_description() {
  CONVEYOR_ASSIGN_OR_RETURN(const NcclLibrary* nccl, nccl_library());
  return "NCCL " + nccl->version_text() + " (" + nccl->path + ")";
}

Result<std::shared_ptr<NcclGroup>> make_nccl_group(int rank, int size, const std::vector<std::uint8_t>& unique_id,
                                                   c10::Device device, NcclJoin join) {
  if (size < 1 || rank < 0 || rank >= size) {
    return Status(ErrorCode::kInvalidArgument, "an NCCL group member needs 0 <= rank < size, not rank " +
                                                   std::to_string(rank) + " of " + std::to_string(size));
  }
  if (unique_id.size() != nccl_abi::kUniqueIdBytes) {
    return Status(ErrorCode::kInvalidArgument, "an NCCL unique id has " + std::to_string(nccl_abi::kUniqueIdBytes) +
                                                   " bytes, not " + std::to_string(unique_id.size()) +
                                                   " (make it with nccl_unique_id())");
  }
  CONVEYOR_RETURN_IF_ERROR(nccl_usable_on(device));
  CONVEYOR_ASSIGN_OR_RETURN(const NcclLibrary* nccl, nccl_library());
  nccl_abi::UniqueId id{};
  std::memcpy(id.internal, unique_id.data(), unique_id.size());
  const std::string what = "joining a group of " + std::to_string(size) + " as member " + std::to_string(rank) +
                           " on " + device.str();
  // NCCL's blocking join, on a thread of its own so that the wait can end (see the header).
  using Joined = std::pair<nccl_abi::Result, nccl_abi::Comm>;
  auto joined = wait_for_blocking_call<Joined>(
      [nccl, size, id, rank, device] {
        nccl_abi::Comm comm = nullptr;
        c10::DeviceGuard on_device(device);  // NCCL joins on the current device
        const nccl_abi::Result r = nccl->CommInitRank(&comm, size, id, rank);
        return Joined{r, comm};
      },
      [nccl](Joined late) {  // joined after the caller gave up: nobody holds it
        if (late.first == nccl_abi::kSuccess) nccl->CommAbort(late.second);
      },
      join.timeout, join.abandoned);
  if (joined.end == BlockingCallEnd::kAbandoned) {
    return Status(ErrorCode::kExecution, "NCCL " + what + ": given up, the job was aborted");
  }
  if (joined.end == BlockingCallEnd::kTimedOut) {
    return Status(ErrorCode::kExecution,
                  "NCCL " + what + ": the other members did not all join within " + std::to_string(join.timeout.count()) +
                      " ms (a process died, never started, or waits elsewhere; every member must join with the "
                      "same id, in the same order of groups); raise the job's timeout if they are only slow");
  }
  const auto [result, comm] = *joined.value;
  CONVEYOR_RETURN_IF_ERROR(nccl->check(result, what));
  return std::shared_ptr<NcclGroup>(std::make_shared<NcclMember>(*nccl, comm, rank, size, device));
}

}  // namespace conveyor::transport
