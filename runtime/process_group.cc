#include "runtime/process_group.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <numeric>

#include "common/secret.h"
#include "runtime/rendezvous.h"
#include "conveyor_config.h"
#include "transport/nccl_library.h"

namespace conveyor::runtime {

Result<std::shared_ptr<ProcessGroup>> ProcessGroup::create(const ProcessGroupOptions& options) {
  std::shared_ptr<ProcessGroup> group(new ProcessGroup());
  group->rank_ = options.rank;
  group->world_ = options.world;
  group->timeout_ = options.timeout;
  group->interrupted_ = options.interrupted;
  if (options.world < 1 || options.rank < 0 || options.rank >= options.world) {
    return Status(ErrorCode::kInvalidArgument, "RANK " + std::to_string(options.rank) + " with WORLD_SIZE " +
                                                   std::to_string(options.world) + " (RANK must be 0 to WORLD_SIZE - 1)");
  }
  // UCX listens on the interface that reaches MASTER_ADDR only (loopback for one machine).
  CONVEYOR_ASSIGN_OR_RETURN(group->endpoint_, transport::make_ucx_endpoint(options.rank, options.world, "process",
                                                                           transport::interface_towards(options.host)));
  const auto address = group->endpoint_->address();
  runtime::JoinRequest join;
  join.rank = options.rank;
  join.world = options.world;
  join.host = options.host;
  join.port = options.port;
  join.version = options.version.empty() ? std::string(CONVEYOR_VERSION) : options.version;
  join.job = options.job;
  if (options.secret.empty()) {
    CONVEYOR_ASSIGN_OR_RETURN(join.secret, secret::job_secret());
  } else {
    join.secret = options.secret;
  }
  join.address.assign(address.begin(), address.end());
  join.timeout = options.timeout;
  join.interrupted = options.interrupted;
  CONVEYOR_ASSIGN_OR_RETURN(auto met, runtime::rendezvous(join));
  for (int peer = 0; peer < options.world; ++peer) {
    if (peer == options.rank) continue;
    const std::string& a = met->addresses()[peer];
    CONVEYOR_RETURN_IF_ERROR(group->endpoint_->connect(peer, std::vector<std::uint8_t>(a.begin(), a.end())));
  }
  group->rendezvous_ = std::shared_ptr<runtime::Rendezvous>(std::move(met));
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

void ProcessGroup::leave() {
  if (endpoint_) endpoint_->leave();
}

void ProcessGroup::close() {
  if (closed_ || !all_) return;
  closed_ = true;
  if (failed_) return;
  leave();
  at::Tensor here = at::ones({1}, at::kLong);
  if (wait([&](transport::Done d) { all_->allreduce(here, d); }, "leaving the job (every process's last step)")) {
    endpoint_->close_gracefully();
  }
}

Status ProcessGroup::wait(const std::function<void(transport::Done)>& issue, const std::string& what) {
  bool stopped = false;
  std::optional<Status> done = transport::wait_within(issue, timeout_, endpoint_.get(), [&] {
    return stopped = interrupted(what);
  });
  if (stopped) {
    return Status(ErrorCode::kInterrupted, "process " + std::to_string(rank_) + ": interrupted while waiting for " + what);
  }
  if (!done) {
    return Status(ErrorCode::kExecution, "process " + std::to_string(rank_) + ": " + what + " did not complete within " +
                                             std::to_string(timeout_.count()) + " ms" + whom_it_waited_for());
  }
  return done->with_context("process " + std::to_string(rank_) + ", " + what);
}

Result<std::vector<at::Tensor>> ProcessGroup::receive(int peer, transport::Tag tag, const std::string& what,
                                                      transport::Endpoint* via) {
  transport::Endpoint& from = via != nullptr ? *via : *endpoint_;
  // Shared with the callback, which may still run after a timeout.
  auto got = std::make_shared<Result<std::vector<at::Tensor>>>(Status(ErrorCode::kInternal, "nothing received"));
  CONVEYOR_RETURN_IF_ERROR(wait(
      [&](transport::Done done) {
        from.recv(peer, tag, [got, done](Result<std::vector<at::Tensor>> r) {
          const Status status = r.status();
          *got = std::move(r);
          done(status);
        });
      },
      what));
  return std::move(*got);
}

bool ProcessGroup::interrupted(const std::string& what) {
  if (!interrupted_ || !interrupted_()) return false;
  abort(Status(ErrorCode::kExecution, "process " + std::to_string(rank_) + " was interrupted while waiting for " + what));
  return true;
}

std::string ProcessGroup::whom_it_waited_for() const {
  const std::vector<int> silent = endpoint_->silent_peers(std::chrono::seconds(2));
  if (silent.empty()) {
    return " (every other process answers, so one is still working or stopped calling in step; raise the timeout if "
           "the work is just slow)";
  }
  std::string who;
  for (int p : silent) who += (who.empty() ? "" : ", ") + std::to_string(p);
  return silent.size() == 1 ? ": process " + who + " does not answer (stopped or hung)"
                            : ": processes " + who + " do not answer (stopped or hung)";
}

Result<std::string> ProcessGroup::broadcast_bytes(int root, const std::string& bytes) {
  at::Tensor length = at::full({1}, static_cast<std::int64_t>(bytes.size()), at::kLong);
  CONVEYOR_RETURN_IF_ERROR(broadcast(length, root));
  at::Tensor data = at::empty({length.item<std::int64_t>()}, at::kByte);
  if (rank_ == root) std::copy(bytes.begin(), bytes.end(), data.data_ptr<std::uint8_t>());
  CONVEYOR_RETURN_IF_ERROR(broadcast(data, root));
  const auto* p = data.data_ptr<std::uint8_t>();
  return std::string(p, p + data.numel());
}

Status ProcessGroup::broadcast(at::Tensor tensor, int root) {
  return wait([&](transport::Done d) { all_->broadcast(tensor, root, d); },
              "a broadcast from process " + std::to_string(root));
}

Status ProcessGroup::agree_on_nccl(const c10::Device& device, const std::string& what) {
  const Status can = transport::nccl_usable_on(device);  // what each process says
  at::Tensor mine = at::full({1}, can.is_ok() ? 1 : 0, at::kLong);
  at::Tensor all = at::empty({world_}, at::kLong);
  CONVEYOR_RETURN_IF_ERROR(wait([&](transport::Done d) { all_->allgather(mine, all, d); }, "agreeing on " + what));
  if (!can.is_ok()) return can.with_context("process " + std::to_string(rank_) + " cannot join " + what);
  for (int p = 0; p < world_; ++p) {
    if (all[p].item<std::int64_t>() == 0) {
      return Status(ErrorCode::kUnsupported, "process " + std::to_string(p) + " cannot join " + what +
                                                 " (its own error says why); every process needs NCCL and a GPU");
    }
  }
  return Status::ok();
}

// Process 0's `count` fresh NCCL unique ids, on every process.
Result<std::vector<std::vector<std::uint8_t>>> ProcessGroup::unique_ids(int count) {
  std::string ids;
  Status made = Status::ok();
  for (int k = 0; rank_ == 0 && k < count && made.is_ok(); ++k) {
    auto id = transport::nccl_unique_id();
    if (id.is_ok()) ids.append(id->begin(), id->end());
    made = id.status();
  }
  if (!made.is_ok()) ids.clear();
  CONVEYOR_ASSIGN_OR_RETURN(ids, broadcast_bytes(0, ids));
  CONVEYOR_RETURN_IF_ERROR(made);
  if (ids.size() != static_cast<std::size_t>(count) * transport::nccl_abi::kUniqueIdBytes) {
    return Status(ErrorCode::kExecution, "process 0 could not make NCCL unique ids (its error says why)");
  }
  std::vector<std::vector<std::uint8_t>> out;
  for (int k = 0; k < count; ++k) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(ids.data()) + k * transport::nccl_abi::kUniqueIdBytes;
    out.emplace_back(p, p + transport::nccl_abi::kUniqueIdBytes);
  }
  return out;
}

transport::NcclJoin ProcessGroup::join() const {
  return transport::NcclJoin{timeout_, [this] { return failed_.load(); }};
}

template <class Group>
void ProcessGroup::keep(std::vector<std::shared_ptr<Group>>& kept, const std::shared_ptr<Group>& group) {
  std::lock_guard<std::mutex> lock(mu_);
  kept.push_back(group);
  if (failed_) group->abort(abort_error_);
}

Result<std::shared_ptr<transport::NcclGroup>> ProcessGroup::nccl(const c10::Device& device) {
  std::lock_guard<std::mutex> making(making_);  // nccl_ changes only under it
  if (auto it = nccl_.find(device.index()); it != nccl_.end()) return it->second;
  CONVEYOR_RETURN_IF_ERROR(agree_on_nccl(device, "an NCCL group"));
  CONVEYOR_ASSIGN_OR_RETURN(auto ids, unique_ids(1));
  CONVEYOR_ASSIGN_OR_RETURN(auto group, transport::make_nccl_group(rank_, world_, ids[0], device, join()));
  keep(nccl_groups_, group);
  nccl_[device.index()] = group;
  return group;
}

Result<std::shared_ptr<transport::LaneEndpoint>> ProcessGroup::nccl_endpoint(const c10::Device& device,
                                                                             std::vector<std::pair<int, int>> links) {
  std::sort(links.begin(), links.end());
  links.erase(std::unique(links.begin(), links.end()), links.end());
  for (const auto& [from, to] : links) {
    if (from < 0 || to < 0 || from >= world_ || to >= world_ || from == to) {
      return Status(ErrorCode::kInvalidArgument, "an NCCL link from process " + std::to_string(from) + " to process " +
                                                     std::to_string(to) + " (links join two distinct processes of 0 to " +
                                                     std::to_string(world_ - 1) + ")");
    }
  }
  std::lock_guard<std::mutex> making(making_);
  const int channel = lane_endpoints_made_++;
  CONVEYOR_RETURN_IF_ERROR(agree_on_nccl(device, "NCCL point to point"));
  CONVEYOR_ASSIGN_OR_RETURN(auto ids, unique_ids(static_cast<int>(links.size())));
  std::map<int, std::shared_ptr<transport::Lane>> sends, receives;
  for (std::size_t k = 0; k < links.size(); ++k) {
    const auto [from, to] = links[k];
    if (rank_ != from && rank_ != to) continue;
    const bool sending = rank_ == from;
    const std::string what = "the NCCL link from process " + std::to_string(from) + " to process " + std::to_string(to);
    auto made = transport::make_nccl_group(sending ? 0 : 1, 2, ids[k], device, join());
    if (!made.is_ok()) {
      return made.status().with_context(what + " (each process needs a GPU of its own: NCCL refuses two members on one)");
    }
    std::shared_ptr<transport::NcclGroup> group = *made;
    keep(nccl_groups_, group);  // abort() ends its first transfer too
    // A first transfer: NCCL connects the pair now, in the links' order on every process.
    at::Tensor first = at::zeros({1}, at::TensorOptions().dtype(at::kByte).device(device));
    CONVEYOR_RETURN_IF_ERROR(wait(
        [&](transport::Done d) {
          if (sending) {
            group->exchange({first}, 1, {}, 1, d);
          } else {
            group->exchange({}, 0, {first}, 0, d);
          }
        },
        "the first transfer over " + what));
    (sending ? sends[to] : receives[from]) = transport::make_nccl_lane(group, sending ? 1 : 0);
  }
  CONVEYOR_ASSIGN_OR_RETURN(auto endpoint,
                            transport::make_lane_endpoint(endpoint_, device, std::move(sends), std::move(receives), channel));
  keep(lane_endpoints_, endpoint);
  return endpoint;
}

Status ProcessGroup::check_members(const std::vector<int>& members) const {
  for (std::size_t k = 0; k < members.size(); ++k) {
    if (members[k] < 0 || members[k] >= world_ || (k > 0 && members[k] <= members[k - 1])) {
      return Status(ErrorCode::kInvalidArgument, "a process group's members must be distinct processes of the job (0 to " +
                                                     std::to_string(world_ - 1) + "), in ascending order");
    }
  }
  return Status::ok();
}

Result<std::shared_ptr<transport::NcclGroup>> ProcessGroup::nccl_subgroup(const std::vector<int>& members,
                                                                          const c10::Device& device) {
  CONVEYOR_RETURN_IF_ERROR(check_members(members));
  std::lock_guard<std::mutex> making(making_);
  std::string names;
  for (int m : members) names += (names.empty() ? "" : ", ") + std::to_string(m);
  const std::string what = "an NCCL group of processes " + names;
  CONVEYOR_RETURN_IF_ERROR(agree_on_nccl(device, what));
  CONVEYOR_ASSIGN_OR_RETURN(auto ids, unique_ids(1));
  auto me = std::find(members.begin(), members.end(), rank_);
  if (me == members.end()) return std::shared_ptr<transport::NcclGroup>();
  auto made = transport::make_nccl_group(static_cast<int>(me - members.begin()), static_cast<int>(members.size()),
                                         ids[0], device, join());
  if (!made.is_ok()) {
    return made.status().with_context(what + " (each process needs a GPU of its own: NCCL refuses two members on one)");
  }
  keep(nccl_groups_, *made);
  return *made;
}

Result<std::shared_ptr<transport::EndpointGroup>> ProcessGroup::subgroup(const std::vector<int>& members) {
  CONVEYOR_RETURN_IF_ERROR(check_members(members));
  std::lock_guard<std::mutex> making(making_);
  const int id = ++groups_made_;  // 0 is the group over every process
  if (id >= (1 << 15)) {
    return Status(ErrorCode::kUnsupported, "the job has made " + std::to_string(id) +
                                               " process groups, more than the 32767 the message tags can tell apart");
  }
  if (std::find(members.begin(), members.end(), rank_) == members.end()) return std::shared_ptr<transport::EndpointGroup>();
  CONVEYOR_ASSIGN_OR_RETURN(auto group, transport::make_endpoint_group(endpoint_, members, id));
  keep(subgroups_, group);
  return group;
}

void ProcessGroup::abort(Status error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) abort_error_ = error;
    failed_ = true;  // an NCCL join under way gives up (join())
    for (auto& group : nccl_groups_) group->abort(error);
    for (auto& endpoint : lane_endpoints_) endpoint->abort(error);
    for (auto& group : subgroups_) group->abort(error);
  }
  all_->abort(error);
  endpoint_->abort(std::move(error));
}

}  // namespace conveyor::runtime
