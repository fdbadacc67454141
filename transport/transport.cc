#include "transport/transport.h"

#include <future>

namespace conveyor::transport {

std::string collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "allreduce";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGather: return "allgather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
  }
  return "collective";
}

Status wait_for(const std::function<void(Done)>& issue) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  issue([promise](Status s) { promise->set_value(std::move(s)); });
  return future.get();
}

Result<std::vector<at::Tensor>> receive_within(Endpoint& endpoint, int peer, Tag tag,
                                               std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<Result<std::vector<at::Tensor>>>>();
  auto future = promise->get_future();
  endpoint.recv(peer, tag, [promise](Result<std::vector<at::Tensor>> r) { promise->set_value(std::move(r)); });
  if (future.wait_for(timeout) != std::future_status::ready) {
    return Status(ErrorCode::kExecution, "no message from member " + std::to_string(peer) + " under tag " +
                                             std::to_string(tag) + " within " + std::to_string(timeout.count()) + " ms");
  }
  return future.get();
}

}  // namespace conveyor::transport
