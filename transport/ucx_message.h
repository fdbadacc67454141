// The UCX endpoint's wire format on the UCX side: a framed message (message_buffer.h) as
// tagged sends, the memory type of a transfer's buffer, and closing: waiting for the last
// requests and clearing what nobody received.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "transport/message_buffer.h"
#include "transport/ucx_request.h"

namespace conveyor::transport {

/// `given` with the memory type of `t`'s memory said (CUDA), for a transfer from or into it.
ucp_request_param_t with_memory_type(const ucp_request_param_t& given, const at::Tensor& t);

/// Sends `message` to `ep` under `tag`: a gathered message as one UCX message from its
/// segments' memory (an iov), else its header and then each part, under the same tag (UCX
/// keeps their order). `sent` runs once, after the last request completed, with the first
/// failure (a lost peer named `lost_peer`, transfer_error) or ok. Call on the thread that
/// holds the worker.
void send_message(ucp_ep_h ep, ucp_tag_t tag, std::shared_ptr<const OutgoingMessage> message,
                  const std::string& lost_peer, std::function<void(Status)> sent);

/// Progresses `worker` until each of `requests` (in flight, from UCX's send or close calls)
/// completed, or until `deadline`; frees those that completed. Closing only: what did not
/// complete by then is left to UCX's cleanup.
void wait_for_requests(ucp_worker_h worker, const std::vector<ucs_status_ptr_t>& requests,
                       std::chrono::steady_clock::time_point deadline);

/// Closing: closes each of `eps` and sets it null; `flush`: what was sent on it reaches the
/// peer first (within 5 s), else at once (within 1 s).
void close_endpoints(ucp_worker_h worker, std::vector<ucp_ep_h>& eps, bool flush);

/// Closing: small messages that arrived on `worker` and nobody will receive (a peer's
/// goodbye, a late ping) taken off UCX's queue, so that destroying the worker does not warn
/// about each.
void drop_unreceived(ucp_worker_h worker);

}  // namespace conveyor::transport
