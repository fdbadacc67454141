// An Endpoint whose tensors travel over lanes that match by order, not by tag: NCCL's point
// to point (ncclSend/ncclRecv pair up the n-th send with the n-th receive between two
// members). The runtime receives by tag and in any order (a stage asks for microbatch 3's
// gradient while microbatch 2's activation is still in flight), so a lane alone cannot
// serve it; this endpoint adds the matching.
//
// A message goes as two parts. Its header (tag, and each tensor's dtype and shape), with
// any tensor not on the endpoint's device (host scalars, say), goes over a control endpoint
// (UCX) under one tag per lane endpoint: messages between two members under one tag keep
// their order, so the receiver reads the headers in the order the sender sent them. The
// tensors on the device go over the lane to that peer, in the same order. The receiver
// posts each message's lane receive as soon as its header arrives (allocating its tensors
// on the device), whether or not anyone asked for the tag yet, so no send waits for a
// receive posted out of order; the finished message goes to the first receive of its
// (peer, tag), or waits for it.
//
// A lane is one direction between two members (transport/nccl.h, make_nccl_lane: a
// two-member NCCL group each). Separate directions never wait on each other inside NCCL,
// which is what keeps a pipeline's activations (forward) and gradients (backward) between
// the same two processes from deadlocking.
#pragma once

#include <c10/core/Device.h>

#include <map>
#include <memory>

#include "transport/transport.h"

namespace conveyor::transport {

/// Tags of lane endpoints' control messages: this bit and the endpoint's channel number.
/// Pipeline messages stay below it, collectives (kCollectiveTagBit) above.
constexpr Tag kLaneControlTagBit = Tag{1} << 46;

/// One direction between this member and one peer that moves tensors in order.
class Lane {
 public:
  virtual ~Lane() = default;
  /// Sends `tensors` (contiguous, on the lane's device) as the next message to the peer,
  /// after the work queued on the caller's current stream; `done` once they are no longer read.
  virtual void send(std::vector<at::Tensor> tensors, Done done) = 0;
  /// Fills `into` (allocated by the caller, contiguous) with the peer's next message, which
  /// must have as many tensors of the same dtypes and sizes; `done` once they hold it.
  virtual void recv(std::vector<at::Tensor> into, Done done) = 0;
  /// Fails every pending and later transfer with `error`.
  virtual void abort(Status error) = 0;
};

/// A lane over any Endpoint, under one tag (it moves the lane's messages in order): lets the
/// lane endpoint run where NCCL cannot (the conformance suite, on the CPU).
std::shared_ptr<Lane> make_endpoint_lane(std::shared_ptr<Endpoint> endpoint, int peer, Tag tag);

/// Tagged messages whose tensors travel over ordered lanes (NCCL point to point).
class LaneEndpoint : public Endpoint {
 public:
  /// Fails every pending and later operation with `error`, and aborts the lanes.
  virtual void abort(Status error) = 0;
};

/// The member `control->rank()` of a lane endpoint: tensors on `device` go to peer p over
/// `sends[p]` and come from peer p over `receives[p]`; headers, and tensors elsewhere, over
/// `control` under kLaneControlTagBit | `channel` (every member of one lane endpoint passes
/// the same channel; channels tell lane endpoints over one control endpoint apart, below
/// 2^16). Sending to a peer without a send lane, or receiving from one without a receive
/// lane, is an error naming the peer.
Result<std::shared_ptr<LaneEndpoint>> make_lane_endpoint(std::shared_ptr<Endpoint> control, c10::Device device,
                                                         std::map<int, std::shared_ptr<Lane>> sends,
                                                         std::map<int, std::shared_ptr<Lane>> receives, int channel);

}  // namespace conveyor::transport
