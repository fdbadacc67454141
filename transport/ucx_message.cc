#include "transport/ucx_message.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace conveyor::transport {

ucp_request_param_t with_memory_type(const ucp_request_param_t& given, const at::Tensor& t) {
  ucp_request_param_t p = given;
  if (t.is_cuda()) {  // said, not detected: UCX would look the pointer up in its memory-type cache
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  return p;
}

void send_message(ucp_ep_h ep, ucp_tag_t tag, std::shared_ptr<const OutgoingMessage> message,
                  const std::string& lost_peer, std::function<void(Status)> sent) {
  auto as_status = [lost_peer](ucs_status_t s) {
    return s == UCS_OK ? Status::ok() : transfer_error("a UCX send", lost_peer, s);
  };
  if (message->gathered) {
    auto iov = std::make_shared<std::vector<ucp_dt_iov_t>>();  // UCX reads it until the send completes
    for (const auto& [at, bytes] : gathered_segments(*message)) iov->push_back({const_cast<void*>(at), bytes});
    post_request([message, iov, as_status, sent = std::move(sent)](ucs_status_t s) { sent(as_status(s)); },
                 [&](const ucp_request_param_t& given) {
                   ucp_request_param_t p = given;
                   p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
                   p.datatype = ucp_dt_make_iov();
                   return ucp_tag_send_nbx(ep, iov->data(), iov->size(), tag, &p);
                 },
                 /*receive=*/false);
    return;
  }
  auto all = std::make_shared<Countdown>(1 + message->parts.size(), std::move(sent));
  auto send = [&](const at::Tensor& t) {
    post_request([all, message, as_status](ucs_status_t s) { all->completed(as_status(s)); },
                 [&](const ucp_request_param_t& given) {
                   ucp_request_param_t p = with_memory_type(given, t);
                   return ucp_tag_send_nbx(ep, t.data_ptr(), t.nbytes(), tag, &p);
                 },
                 /*receive=*/false);
  };
  send(message->header);
  for (const auto& part : message->parts) send(part);
}

void wait_for_requests(ucp_worker_h worker, const std::vector<ucs_status_ptr_t>& requests,
                       std::chrono::steady_clock::time_point deadline) {
  for (ucs_status_ptr_t r : requests) {
    while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker);
    }
    if (ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);
  }
}

void close_endpoints(ucp_worker_h worker, std::vector<ucp_ep_h>& eps, bool flush) {
  std::vector<ucs_status_ptr_t> closing;
  for (ucp_ep_h& ep : eps) {
    if (!ep) continue;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = flush ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
    ep = nullptr;
  }
  wait_for_requests(worker, closing, std::chrono::steady_clock::now() + std::chrono::seconds(flush ? 5 : 1));
}

void drop_unreceived(ucp_worker_h worker) {
  std::vector<std::uint8_t> sink;
  for (int k = 0; k < 4096; ++k) {
    ucp_tag_recv_info_t info{};
    if (ucp_tag_probe_nb(worker, 0, 0, 0, &info) == nullptr || info.length > (64 << 10)) return;
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker, 0, 0, 1, &info);
    if (msg == nullptr) return;
    sink.resize(info.length);
    ucp_request_param_t p{};
    ucs_status_ptr_t r = ucp_tag_msg_recv_nbx(worker, sink.data(), sink.size(), msg, &p);
    if (!UCS_PTR_IS_PTR(r)) continue;
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(10);
    while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < until) {
      ucp_worker_progress(worker);
    }
    if (ucp_request_check_status(r) == UCS_INPROGRESS) return;  // its data is not here: leave the rest
    ucp_request_free(r);
  }
}

}  // namespace conveyor::transport
