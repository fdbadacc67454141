#include "runtime/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <numeric>

#include "actors/rendezvous.h"
#include "conveyor_config.h"

namespace conveyor::runtime {

Result<std::shared_ptr<ProcessGroup>> ProcessGroup::create(const ProcessGroupOptions& options) {
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->rank_ = options.rank;
  group->world_ = options.world;
  group->timeout_ = options.timeout;
  if (options.world < 1 || options.rank < 0 || options.rank >= options.world) {
    return Status(ErrorCode::kInvalidArgument, "RANK " + std::to_string(options.rank) + " with WORLD_SIZE " +
                                                   std::to_string(options.world) + " (RANK must be 0 to WORLD_SIZE - 1)");
  }
  CONVEYOR_ASSIGN_OR_RETURN(group->endpoint_, transport::make_ucx_endpoint(options.rank, options.world, "process"));
  const auto address = group->endpoint_->address();
  actors::JoinRequest join;
  join.rank = options.rank;
  join.world = options.world;
  join.host = options.host;
  join.port = options.port;
  join.version = options.version.empty() ? std::string(CONVEYOR_VERSION) : options.version;
  join.job = options.job;
  join.address.assign(address.begin(), address.end());
  join.timeout = options.timeout;
  CONVEYOR_ASSIGN_OR_RETURN(auto met, actors::rendezvous(join));
  for (int peer = 0; peer < options.world; ++peer) {
    if (peer == options.rank) continue;
    const std::string& a = met->addresses()[peer];
    CONVEYOR_RETURN_IF_ERROR(group->endpoint_->connect(peer, std::vector<std::uint8_t>(a.begin(), a.end())));
  }
  group->rendezvous_ = std::shared_ptr<actors::Rendezvous>(std::move(met));
  std::vector<int> everyone(static_cast<std::size_t>(options.world));
  std::iota(everyone.begin(), everyone.end(), 0);
  CONVEYOR_ASSIGN_OR_RETURN(group->all_, transport::make_endpoint_group(group->endpoint_, everyone, /*group_id=*/0));
  // A first exchange with every process: connections stand both ways from here on, so a
  // process that dies is noticed on every link (UCX keepalive), not only where data flows.
  at::Tensor hello = at::ones({1}, at::kLong);
  CONVEYOR_RETURN_IF_ERROR(group->wait([&](transport::Done d) { group->all_->allreduce(hello, d); },
                                       "the first exchange between the processes"));
  if (hello.item<std::int64_t>() != options.world) {
    return Status(ErrorCode::kInternal, "the first exchange between the processes counted " +
                                            std::to_string(hello.item<std::int64_t>()) + " of " +
                                            std::to_string(options.world));
  }
  return group;
}

ProcessGroup::~ProcessGroup() { close(); }

void ProcessGroup::close() {
  if (closed_ || !all_) return;
  closed_ = true;
  if (failed_) return;
  at::Tensor here = at::ones({1}, at::kLong);
  if (wait([&](transport::Done d) { all_->allreduce(here, d); }, "leaving the job (every process's last step)")) {
    endpoint_->close_gracefully();
  }
}

Status ProcessGroup::wait(const std::function<void(transport::Done)>& issue, const std::string& what) const {
  std::optional<Status> done = transport::wait_within(issue, timeout_);
  if (!done) {
    return Status(ErrorCode::kExecution, "process " + std::to_string(rank_) + ": " + what + " did not complete within " +
                                             std::to_string(timeout_.count()) +
                                             " ms (a process that hangs, or one that stopped calling in step; "
                                             "raise the timeout if the work is just slow)");
  }
  return done->with_context("process " + std::to_string(rank_) + ", " + what);
}

Result<std::string> ProcessGroup::broadcast_bytes(int root, const std::string& bytes) const {
  at::Tensor length = at::full({1}, static_cast<std::int64_t>(bytes.size()), at::kLong);
  CONVEYOR_RETURN_IF_ERROR(broadcast(length, root));
  at::Tensor data = at::empty({length.item<std::int64_t>()}, at::kByte);
  if (rank_ == root) std::copy(bytes.begin(), bytes.end(), data.data_ptr<std::uint8_t>());
  CONVEYOR_RETURN_IF_ERROR(broadcast(data, root));
  const auto* p = data.data_ptr<std::uint8_t>();
  return std::string(p, p + data.numel());
}

Status ProcessGroup::broadcast(at::Tensor tensor, int root) const {
  return wait([&](transport::Done d) { all_->broadcast(tensor, root, d); },
              "a broadcast from process " + std::to_string(root));
}

Result<std::shared_ptr<transport::NcclGroup>> ProcessGroup::nccl(const c10::Device& device) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = nccl_.find(device.index()); it != nccl_.end()) return it->second;
  const Status can = transport::nccl_usable_on(device);  // what each process says
  at::Tensor mine = at::full({1}, can.is_ok() ? 1 : 0, at::kLong);
  at::Tensor all = at::empty({world_}, at::kLong);
  CONVEYOR_RETURN_IF_ERROR(wait([&](transport::Done d) { all_->allgather(mine, all, d); }, "agreeing on an NCCL group"));
  if (!can.is_ok()) return can.with_context("process " + std::to_string(rank_) + " cannot join an NCCL group");
  for (int p = 0; p < world_; ++p) {
    if (all[p].item<std::int64_t>() == 0) {
      return Status(ErrorCode::kUnsupported, "process " + std::to_string(p) +
                                                 " cannot join an NCCL group (its own error says why); every process "
                                                 "needs NCCL and a GPU");
    }
  }
  std::string id;
  Status made_id = Status::ok();
  if (rank_ == 0) {
    auto made = transport::nccl_unique_id();
    if (made.is_ok()) id.assign(made->begin(), made->end());
    made_id = made.status();
  }
  CONVEYOR_ASSIGN_OR_RETURN(id, broadcast_bytes(0, id));
  CONVEYOR_RETURN_IF_ERROR(made_id);
  if (id.empty()) return Status(ErrorCode::kExecution, "process 0 could not make an NCCL unique id (its error says why)");
  CONVEYOR_ASSIGN_OR_RETURN(auto group, transport::make_nccl_group(rank_, world_, std::vector<std::uint8_t>(id.begin(), id.end()), device));
  nccl_[device.index()] = group;
  return group;
}

Result<std::shared_ptr<transport::EndpointGroup>> ProcessGroup::subgroup(const std::vector<int>& members) {
  for (std::size_t k = 0; k < members.size(); ++k) {
    if (members[k] < 0 || members[k] >= world_ || (k > 0 && members[k] <= members[k - 1])) {
      return Status(ErrorCode::kInvalidArgument, "a process group's members must be distinct processes of the job (0 to " +
                                                     std::to_string(world_ - 1) + "), in ascending order");
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  const int id = ++groups_made_;  // 0 is the group over every process
  if (id >= (1 << 15)) {
    return Status(ErrorCode::kUnsupported, "the job has made " + std::to_string(id) +
                                               " process groups, more than the 32767 the message tags can tell apart");
  }
  if (std::find(members.begin(), members.end(), rank_) == members.end()) return std::shared_ptr<transport::EndpointGroup>();
  CONVEYOR_ASSIGN_OR_RETURN(auto group, transport::make_endpoint_group(endpoint_, members, id));
  if (failed_) group->abort(Status(ErrorCode::kExecution, "the job's processes were aborted"));
  subgroups_.push_back(group);
  return group;
}

void ProcessGroup::abort(Status error) {
  failed_ = true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [index, group] : nccl_) group->abort(error);
    for (auto& group : subgroups_) group->abort(error);
  }
  all_->abort(error);
  endpoint_->abort(std::move(error));
}

}  // namespace conveyor::runtime
