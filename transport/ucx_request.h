// One UCX tag request with a completion function instead of UCX's callback and user data:
// the function owns what the transfer reads or writes, and runs once with the status; and
// how a failed request reads as an error.
#pragma once

#include <ucp/api/ucp.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "common/status.h"

namespace conveyor::transport {

/// A UCX failure as conveyor's error: `what` failed, and UCX's reason.
inline Status ucx_error(const std::string& what, ucs_status_t s) {
  return Status(ErrorCode::kExecution, what + ": " + ucs_status_string(s));
}

/// A transfer with a peer that failed: when the status says the peer is gone, named as
/// `lost_peer` ("process 2 was lost"), as the endpoint's error handler names it (a request
/// can fail before that handler runs); over shared memory a peer that died fails the copy
/// from its memory with an I/O error.
inline Status transfer_error(const char* what, const std::string& lost_peer, ucs_status_t s) {
  const bool gone = s == UCS_ERR_ENDPOINT_TIMEOUT || s == UCS_ERR_CONNECTION_RESET || s == UCS_ERR_UNREACHABLE ||
                    s == UCS_ERR_IO_ERROR;
  return ucx_error(gone ? lost_peer : what, s);
}

/// A UCX request's completion: runs once with the request's status, on the thread that
/// progresses the worker (at once when the request completes as it is posted).
using Completed = std::function<void(ucs_status_t)>;

/// Requests that finish together (a message's header and parts): `finish` runs once, after
/// the last completes, with the first failure or ok.
class Countdown {
 public:
  Countdown(std::size_t count, std::function<void(Status)> finish) : left_(count), finish_(std::move(finish)) {}
  void completed(Status status) {
    if (!status.is_ok() && first_failure_.is_ok()) first_failure_ = std::move(status);
    if (--left_ == 0) finish_(first_failure_);
  }

 private:
  std::size_t left_;
  Status first_failure_ = Status::ok();
  std::function<void(Status)> finish_;
};

/// Posts the transfer `start` makes from the request parameters it is given (a send when
/// `receive` is false), whose completion runs `completed`; returns the request while it is
/// in flight (for ucp_request_cancel), else nullptr.
template <class Start>
void* post_request(Completed completed, Start start, bool receive) {
  auto* held = new Completed(std::move(completed));  // owned by the callback, or freed here
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (receive) {
    p.cb.recv = [](void* request, ucs_status_t status, const ucp_tag_recv_info_t*, void* user) {
      std::unique_ptr<Completed> c(static_cast<Completed*>(user));
      ucp_request_free(request);
      (*c)(status);
    };
  } else {
    p.cb.send = [](void* request, ucs_status_t status, void* user) {
      std::unique_ptr<Completed> c(static_cast<Completed*>(user));
      ucp_request_free(request);
      (*c)(status);
    };
  }
  p.user_data = held;
  ucs_status_ptr_t r = start(p);
  if (UCS_PTR_IS_PTR(r)) return r;
  std::unique_ptr<Completed> c(held);  // done inline, or failed: no callback comes
  (*c)(r == nullptr ? UCS_OK : UCS_PTR_STATUS(r));
  return nullptr;
}

}  // namespace conveyor::transport
