#include "transport/ucx_message.h"

#include <cstddef>
#include <utility>
#include <vector>

namespace conveyor::transport {

namespace {

// Requests that finish together: `finish` runs once, after the last, with the first failure.
struct AllSent {
  AllSent(std::size_t count, Completed finish) : left(count), finish(std::move(finish)) {}
  void completed(ucs_status_t s) {
    if (s != UCS_OK && first_failure == UCS_OK) first_failure = s;
    if (--left == 0) finish(first_failure);
  }
  std::size_t left;
  ucs_status_t first_failure = UCS_OK;
  Completed finish;
};

}  // namespace

void send_message(ucp_ep_h ep, ucp_tag_t tag, std::shared_ptr<const OutgoingMessage> message, Completed sent) {
  if (message->gathered) {
    auto iov = std::make_shared<std::vector<ucp_dt_iov_t>>();  // UCX reads it until the send completes
    for (const auto& [at, bytes] : gathered_segments(*message)) iov->push_back({const_cast<void*>(at), bytes});
    post_request([message, iov, sent = std::move(sent)](ucs_status_t s) { sent(s); },
                 [&](const ucp_request_param_t& given) {
                   ucp_request_param_t p = given;
                   p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
                   p.datatype = ucp_dt_make_iov();
                   return ucp_tag_send_nbx(ep, iov->data(), iov->size(), tag, &p);
                 },
                 /*receive=*/false);
    return;
  }
  auto all = std::make_shared<AllSent>(1 + message->parts.size(), std::move(sent));
  auto send = [&](const at::Tensor& t) {
    post_request([all, message](ucs_status_t s) { all->completed(s); },
                 [&](const ucp_request_param_t& p) { return ucp_tag_send_nbx(ep, t.data_ptr(), t.nbytes(), tag, &p); },
                 /*receive=*/false);
  };
  send(message->header);
  for (const auto& part : message->parts) send(part);
}

}  // namespace conveyor::transport
