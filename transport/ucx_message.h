// A framed message (message_buffer.h) as UCX tagged sends: the send side of the UCX
// endpoint's wire format.
#pragma once

#include <ucp/api/ucp.h>

#include <memory>

#include "transport/message_buffer.h"
#include "transport/ucx_request.h"

namespace conveyor::transport {

/// Sends `message` to `ep` under `tag`: a gathered message as one UCX message from its
/// segments' memory (an iov), else its header and then each part, under the same tag (UCX
/// keeps their order). `sent` runs once, after the last request completed, with the first
/// failure or UCS_OK. Call on the thread that progresses the worker.
void send_message(ucp_ep_h ep, ucp_tag_t tag, std::shared_ptr<const OutgoingMessage> message, Completed sent);

}  // namespace conveyor::transport
