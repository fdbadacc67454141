// The NCCL backend: collectives over GPUs, one member per device and process (NCCL allows no
// two members of a group on one GPU). NCCL itself is loaded at run time (nccl_library.h).
//
// Streams. Each member owns a stream from its device's pool. An operation makes that stream
// wait for the caller's current stream (so it reads what the caller's work has written),
// runs NCCL's kernel there, and tells the caching allocator the tensors are in use on it;
// the caller's stream is free to go on computing meanwhile, which is how reductions overlap
// backward. `done` runs on the member's completion thread once the kernel has finished (the
// same promise as every other backend: the result is in the tensor), or with the error.
//
// Order. NCCL requires that communicators sharing a device launch their kernels in the same
// order on every member, or they may deadlock. Every operation of every NCCL group in the
// process is launched under one process-wide lock, in the order its callers made them; the
// runtime makes its calls from the communication thread in schedule order, which is the
// same on every member.
//
// Sums are NCCL's (its ring or tree order), deterministic for one topology and NCCL version
// but not the member-order sums of the inproc and UCX groups: results agree with them to
// rounding, not bitwise. Calls are not compared across members (NCCL does not say what
// another member called); a member's own arguments are checked before anything launches.
//
// Failure. A member that dies leaves its peers' kernels waiting; abort() (called by the
// runtime when a wait times out or a peer is lost) aborts the communicator, which ends
// them, and fails every pending and later operation.
#pragma once

#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport/lane_endpoint.h"
#include "transport/transport.h"

namespace conveyor::transport {

/// A fresh unique id for a new group: one member makes it and hands it to the others (the
/// runtime broadcasts it through the process group). Needs NCCL, not a GPU.
Result<std::vector<std::uint8_t>> nccl_unique_id();

/// OK when this process can hold an NCCL member on `device`: NCCL loads, and `device` is a
/// CUDA device the process sees. Otherwise why not, and what to do.
Status nccl_usable_on(const c10::Device& device);

/// "NCCL 2.28.9 (path)" when NCCL can be loaded, or why not.
Result<std::string> nccl_description();

/// One member of an NCCL group on one CUDA device.
class NcclGroup : public Collective {
 public:
  /// Fails every pending and later operation with `error`, ending NCCL's kernels that wait
  /// for a member that is gone.
  virtual void abort(Status error) = 0;
  virtual c10::Device device() const = 0;
  /// Point to point, matched by order as NCCL matches it: sends `send` to member `to` and
  /// fills `recv` (allocated by the caller) with what member `from` sends, as one NCCL group
  /// (so a member may exchange with itself). Each tensor is one ncclSend or ncclRecv, in list
  /// order; `from`'s sends must match these receives in order, dtype and size. Either list
  /// may be empty (its member is then not used). Runs on the member's stream after the
  /// caller's current stream's work, like the collectives.
  virtual void exchange(std::vector<at::Tensor> send, int to, std::vector<at::Tensor> recv, int from, Done done) = 0;
};

/// A lane (transport/lane_endpoint.h) to and from member `peer` of `group`: every transfer
/// one exchange() with `peer`. A lane should have its group to itself (usually a group of
/// two: one member sends, the other receives), since NCCL orders everything on a group.
std::shared_ptr<Lane> make_nccl_lane(std::shared_ptr<NcclGroup> group, int peer);

/// How long joining a group may wait for the other members, and when to give up early.
struct NcclJoin {
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  /// Asked every few milliseconds while waiting: true gives up (the job was aborted).
  std::function<bool()> abandoned;
};

/// Member `rank` of a group of `size` on `device` (a CUDA device of this process), joined
/// through `unique_id` (every member passes the same one). Returns once every member has
/// joined (NCCL's initialization waits for them all), or with an error naming the group when
/// they have not within `join.timeout` or `join.abandoned` says so. NCCL's blocking join runs
/// on a thread of its own, which is left behind when the caller gives up (NCCL cannot stop a
/// blocking join; a member that joins late is then aborted); the caller's process is
/// expected to end on that error. Errors, naming what to do, where NCCL cannot be loaded,
/// the device is not a CUDA device this process has, or the arguments are out of range.
Result<std::shared_ptr<NcclGroup>> make_nccl_group(int rank, int size, const std::vector<std::uint8_t>& unique_id,
                                                   c10::Device device, NcclJoin join = {});

}  // namespace conveyor::transport
