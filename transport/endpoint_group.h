// Collectives over point-to-point messages: a Collective for a group of members of any
// Endpoint world (UCX between processes; CPU tensors, or device tensors staged through the
// host). Each operation is a fixed exchange of tagged messages, so there is no coordinator:
//
//   reduce, broadcast           direct to / from the root (n - 1 messages)
//   allgather, reduce_scatter   every member sends each other member its part
//   allreduce                   small tensors (at most 64 KiB): every member sends the whole
//                               tensor to every other and sums all of them itself; larger:
//                               reduce_scatter, then allgather of the reduced parts, so each
//                               member sends and receives 2 (n - 1) / n of the tensor, the
//                               bandwidth bound of a ring, in one round instead of n - 1.
//
// Every sum adds the members' contributions in member order, so the results are bitwise
// those of the inproc group and the same on every member. Every message carries when the
// sender called (its system clock) and its call (CollectiveCall::encode). From the calls'
// times an allreduce tells each member how long it waited for the last member to call
// (allreduce_timed), apart from the time spent moving and summing. A member that receives
// a call unlike its own fails the operation with an error naming both calls and tells
// every other member, so nobody waits for a partner that is doing something else.
#pragma once

#include <memory>
#include <vector>

#include "transport/transport.h"

namespace conveyor::transport {

/// Tags at and above this bit belong to collectives; point-to-point users stay below it.
constexpr Tag kCollectiveTagBit = Tag{1} << 47;
/// The bits of a collective's tag that carry its group's id (make_endpoint_group), and back:
/// 0 is the job's group of every process, which alone still calls collectives after a
/// process left (its last exchange).
constexpr Tag collective_group_bits(int group_id) { return Tag(group_id) << 32; }
constexpr int collective_group_of(Tag tag) { return static_cast<int>((tag >> 32) & 0x7fff); }

/// A Collective over any Endpoint: each operation a fixed exchange of tagged messages.
class EndpointGroup : public Collective {
 public:
  /// Fails every pending and later operation of this member with `error`.
  virtual void abort(Status error) = 0;
};

/// This endpoint's member of the group of `members` (endpoint ranks, in member order; this
/// endpoint's rank among them). `group_id` (below 2^15) tells groups over one world apart:
/// every member of a group passes the same id. The endpoint must copy what it sends before
/// send() returns (UCX does; inproc hands over storage and has its own group).
Result<std::shared_ptr<EndpointGroup>> make_endpoint_group(std::shared_ptr<Endpoint> endpoint, std::vector<int> members,
                                                           int group_id);

}  // namespace conveyor::transport
