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

}  // namespace conveyor::transport
