// The UCX transport: each member has its own UCP context and worker, driven by a progress
// thread of its own that makes the UCX calls (receivers and senders queue work for it, but a
// small message is sent by the caller's thread itself when the worker is free), sleeping on
// the worker's event file descriptor when idle. Peers connect by worker address, exchanged
// by the caller (in one process directly; between processes through the rendezvous). A
// message is one UCX tagged message, or a header and parts under one tag
// (transport/message_buffer.h); the UCX tag carries the message tag and the sender's rank,
// so receives match exactly. Peers on this host go through shared memory, watched by pidfd
// (transport/peer_liveness.h), large host messages written into the sender's shared region
// (transport/shared_region.h); others over tcp with UCX's peer failure detection. With a
// GPU, CUDA tensors travel from and into device memory through UCX's CUDA transports.
#pragma once

#include <cstdint>
#include <chrono>
#include <memory>
#include <vector>

#include "transport/transport.h"

namespace conveyor::transport {

class UcxEndpoint;

/// A member of a UCX world of `world_size`; errors name a lost peer as `noun` and its rank
/// ("process 2 was lost"). Errors when UCX cannot start (no transport). `net_device`: the one
/// network interface UCX may listen and connect on (empty: UCX_NET_DEVICES, or UCX's choice of
/// every interface).
Result<std::shared_ptr<UcxEndpoint>> make_ucx_endpoint(int rank, int world_size, std::string noun = "member",
                                                       std::string net_device = "");

/// The network interface this machine reaches `host` through ("lo" for a loopback address),
/// or empty when `host` does not resolve: where a job's processes should listen, and nowhere
/// else.
std::string interface_towards(const std::string& host);

/// An Endpoint over UCX, driven by a progress thread of its own.
class UcxEndpoint : public Endpoint {
 public:
  /// This member's worker address, for its peers' connect().
  virtual std::vector<std::uint8_t> address() const = 0;
  /// Connects to `peer` at its worker address (before any send to it).
  virtual Status connect(int peer, const std::vector<std::uint8_t>& address) = 0;
  /// Fails every pending and later operation with `error`.
  virtual void abort(Status error) = 0;
  /// The peers that do not answer a ping within `within`: stopped or hung processes (a
  /// process busy computing answers, from its progress thread). For naming whom a timed-out
  /// wait was waiting for.
  virtual std::vector<int> silent_peers(std::chrono::milliseconds within) = 0;
  /// When this member goes, what it sent is flushed to its peers first (a few seconds at
  /// most) instead of its connections being dropped at once.
  virtual void close_gracefully() = 0;
  /// This member sends nothing more but the job group's collectives (group id 0: the last
  /// exchange of a job's processes): tells every peer, in order after what it sent before.
  /// There a receive from this member under any other tag that finds no message fails
  /// (after a grace) instead of waiting out its timeout: a process whose script ended,
  /// even by SystemExit, is named at once by the one still waiting for it.
  virtual void leave() = 0;
};

/// `n` members in this process, connected to each other (tests, and single-process runs
/// that want the UCX data path).
Result<std::vector<std::shared_ptr<Endpoint>>> make_ucx_world_in_process(int n);

}  // namespace conveyor::transport
