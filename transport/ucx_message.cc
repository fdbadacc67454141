#include "transport/ucx_message.h"

#include <chrono>
#include <cstddef>
#include <cstdint>
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

ucp_request_param_t with_memory_type(const ucp_request_param_t& given, const at::Tensor& t) {
  ucp_request_param_t p = given;
  if (t.is_cuda()) {  // said, not detected: UCX would look the pointer up in its memory-type cache
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p.memory_type = UCS_MEMORY_TYPE_CUDA;
  }
  return p;
}

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
                 [&](const ucp_request_param_t& given) {
                   ucp_request_param_t p = with_memory_type(given, t);
                   return ucp_tag_send_nbx(ep, t.data_ptr(), t.nbytes(), tag, &p);
                 },
                 /*receive=*/false);
  };
  send(message->header);
  for (const auto& part : message->parts) send(part);
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
