// The in-process transport: members are threads (stage replicas) of this process.
// Endpoint messages hand the sender's tensors to the receiver (zero-copy) when the receiver's
// device is the tensor's, and copy them to the receiver's device otherwise. A collective
// completes when its last member arrives, computed by that member's thread in member order.
#pragma once

#include <c10/core/Device.h>

#include "transport/transport.h"

namespace conveyor::transport {

/// `devices[r]`: where member r receives (its tensors are moved there when they are not).
std::vector<std::shared_ptr<Endpoint>> make_inproc_endpoints(const std::vector<c10::Device>& devices);

/// A group of `size` members.
std::vector<std::shared_ptr<Collective>> make_inproc_group(int size);

/// Fails every pending and later operation of the world `endpoint` (or the group `member`)
/// belongs to with `error`: a member that died, a step that was abandoned.
void abort_inproc(const Endpoint& endpoint, Status error);
void abort_inproc(const Collective& member, Status error);

}  // namespace conveyor::transport
