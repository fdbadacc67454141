// Transport interfaces: how tensors move between the members of a pipeline. Endpoint is
// point-to-point (tagged messages of tensors, one message per microbatch hop); Collective is
// a group operation over the replicas of a stage (allreduce, reduce, broadcast, allgather,
// reduce-scatter). Backends: inproc (this process: zero-copy on the same device, a device
// copy otherwise); UCX and NCCL implement the same interfaces for many processes.
//
// Every operation is non-blocking and completes through its callback, which may run on the
// calling thread (inproc completes inline when the operation's last party arrives) or on the
// process's communication thread (backends with a progress engine). A failed or aborted
// transport completes every pending and later operation with the error.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

/// Names a message between two members: the runtime packs (kind, microbatch, stage) into it.
using Tag = std::uint64_t;
using Done = std::function<void(Status)>;
/// `waited_s`: of the time from a member's call of a collective to its completion, the part
/// spent waiting for the last member to call, in seconds (negative: the backend cannot tell).
/// Between hosts it is as exact as their clocks agree (NTP: well under a millisecond), and
/// never more than the member waited for the others' parts.
using TimedDone = std::function<void(Status, double waited_s)>;
using Received = std::function<void(Result<std::vector<at::Tensor>>)>;

/// Tagged point-to-point messages of tensors between members of a world.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  /// Sends `tensors` to `peer` as one message under `tag`. `done` runs once the transport no
  /// longer reads them. Zero-copy backends hand the receiver the same storage: a sender that
  /// will modify a tensor in place after sending it sends a clone.
  virtual void send(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) = 0;
  /// send() for a caller that may write the tensors as soon as this returns (a script's
  /// conveyor.distributed.send, which has no completion to wait for): what the transport
  /// would read later from the caller's memory is copied first. By default every tensor is
  /// cloned; UCX copies only what it would not copy anyway (its packed and region layouts do).
  virtual void send_copied(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done);
  /// Receives the message `peer` sends under `tag` (before or after it was sent), on this
  /// endpoint's device. Messages under one (peer, tag) arrive in the order they were sent.
  virtual void recv(int peer, Tag tag, Received done) = 0;
  /// Advances the transport once on the calling thread, a waiter's, if it can without
  /// blocking: true if it did. Callbacks of operations this thread issued may run in it;
  /// others' stay on the communication thread. Backends without a progress engine: false.
  virtual bool progress_here() { return false; }
};

/// The collective operations.
enum class CollectiveKind : std::uint8_t { kAllReduce, kReduce, kBroadcast, kAllGather, kReduceScatter };
std::string collective_kind_name(CollectiveKind kind);

/// `t` as a transport keeps it: a new TensorImpl over the same memory (detach()), undefined
/// stays undefined. A transport may drop its last reference to what it was given on its own
/// thread after the call returned (a call that failed or timed out leaves its receives
/// pending), possibly while Python finalizes: a tensor Python made (a parameter, a script's
/// tensor) would need the GIL there to release its PyObject, and taking it then ends the
/// thread (pthread_exit through noexcept frames: std::terminate, as an allreduce at exit
/// after a peer died did), or waits on a main thread that joins it. Every backend keeps
/// only such views of its callers' tensors.
inline at::Tensor without_python(const at::Tensor& t) { return t.defined() ? t.detach() : t; }

/// One member's handle on a group. Every member calls the same operations in the same order
/// (a mismatch is an error naming both calls); sums run in member order, so results are
/// bitwise deterministic. A call writes its tensors in place and keeps only without_python
/// views of them.
class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// `tensor` becomes the sum over the members, on every member.
  virtual void allreduce(at::Tensor tensor, Done done) = 0;
  /// allreduce(), and `done` learns how long this member waited for the last member to call,
  /// told apart from the time spent moving and summing (a member whose peer computes slower
  /// waits). By default the backend cannot tell: negative.
  virtual void allreduce_timed(at::Tensor tensor, TimedDone done);
  /// `root`'s tensor becomes the sum; the others' are only read.
  virtual void reduce(at::Tensor tensor, int root, Done done) = 0;
  /// Every member's tensor becomes `root`'s.
  virtual void broadcast(at::Tensor tensor, int root, Done done) = 0;
  /// `out` (size() times `in` along dim 0) becomes every member's `in`, in member order.
  virtual void allgather(at::Tensor in, at::Tensor out, Done done) = 0;
  /// `out` becomes this member's slice (dim 0, size() equal parts) of the sum of every `in`.
  virtual void reduce_scatter(at::Tensor in, at::Tensor out, Done done) = 0;
};

/// What one member asked of a collective, without the data: compared across members (every
/// backend refuses calls that disagree, with an error naming both) and sent between
/// processes by backends that check remotely.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  int root = 0;
  at::Tensor in, out;  ///< `out` only for allgather and reduce_scatter

  /// "member 1 called broadcast of Float[4] on cpu with root 0".
  std::string text(int member) const;
  /// The call as integers (kind, root, dtype and shapes), and back: what a remote member compares.
  std::vector<std::int64_t> encode() const;
  static Result<CollectiveCall> decode(const std::vector<std::int64_t>& code);
};

/// Checks member `member`'s call against member `first_member`'s (`first`) in a group of
/// `n`, for the group's call `number`; the error names both calls.
Status check_collective_call(const CollectiveCall& first, int first_member, const CollectiveCall& call, int member,
                             int n, std::uint64_t number);

/// OK when `peer` is another member of a world of `world` than `rank`; otherwise the error
/// every endpoint gives ("member 0 addressed member 0 of a world of 2 ...").
Status check_peer(int rank, int world, int peer);

/// "Float[2,3] on cpu" (or "an undefined tensor").
std::string describe_tensor(const at::Tensor& t);

/// Text as a message carries it (an error's words): `s`'s bytes as a CPU uint8 tensor; and
/// back, from such a tensor (defined, uint8, on the host, contiguous).
at::Tensor text_tensor(const std::string& s);
std::string text_of(const at::Tensor& t);

/// Waits for an operation issued with `issue(done)` (tests, and callers with nothing to
/// overlap). Inproc operations complete inline; others complete on their progress thread.
Status wait_for(const std::function<void(Done)>& issue);
/// The same, waiting at most `timeout`: nothing when the operation has not completed by then
/// (its callback may still run later). `helping`: the endpoint the operation runs on, which
/// the waiter advances itself for a few microseconds before it sleeps (Endpoint::progress_here).
/// `stop`, when given, is asked about every kStopAskedEvery (common/blocking_call.h) while it
/// waits: true ends the wait at once, as a timeout would.
std::optional<Status> wait_within(const std::function<void(Done)>& issue, std::chrono::milliseconds timeout,
                                  Endpoint* helping = nullptr, const std::function<bool()>& stop = {});

/// Receives the next message `peer` sends under `tag`, waiting at most `timeout`.
Result<std::vector<at::Tensor>> receive_within(Endpoint& endpoint, int peer, Tag tag,
                                               std::chrono::milliseconds timeout = std::chrono::minutes(10));

}  // namespace conveyor::transport
