// The processes of one job: found through the rendezvous (runtime/rendezvous.h, CAF remote
// actors) and connected on the data plane by UCX, every process to every other. Each process
// is a member of the UCX world (its rank is the job's RANK) and of a collective group over
// all processes (transport/endpoint_group.h), which carries the loss to every rank, sums the
// gradients of parameters that stages in several processes share, hands out the plan and
// gathers the model's state. A lost process fails every operation waiting on it, naming its
// rank; every wait has the group's timeout.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/core/Device.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"
#include "transport/endpoint_group.h"
#include "transport/lane_endpoint.h"
#include "transport/nccl.h"
#include "transport/ucx.h"

namespace conveyor::runtime {

/// Who this process is in the job and where the job meets.
struct ProcessGroupOptions {
  int rank = 0, world = 1;
  std::string host = "127.0.0.1";  ///< MASTER_ADDR
  int port = 29500;                ///< MASTER_PORT
  std::string job;                 ///< fingerprint every process must share (model and plan)
  std::string version;             ///< the conveyor version announced (empty: this build's)
  std::string secret;              ///< the job's secret (empty: secret::job_secret())
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};  ///< rendezvous and every later wait
  /// Asked about every 100 ms by the rendezvous and each wait of the group's (wait() and
  /// what waits through it), on the waiting thread: true ends the wait (kInterrupted) and
  /// the job (abort(): the others learn within seconds that this process stopped). The
  /// bindings run Python's signal handlers there, so Ctrl-C stops a process waiting on its
  /// peers instead of waiting out the timeout.
  std::function<bool()> interrupted;
};

/// The processes of one job, connected every one to every other.
class ProcessGroup {
 public:
  /// Joins the job: rendezvous, UCX connections to every other process, and a first
  /// exchange with each (so a process that dies later is noticed on every link).
  static Result<std::shared_ptr<ProcessGroup>> create(const ProcessGroupOptions& options);
  ~ProcessGroup();

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  std::shared_ptr<transport::Endpoint> endpoint() const { return endpoint_; }
  /// The collective group over every process (member i is process i).
  transport::EndpointGroup& all() const { return *all_; }

  /// Waits for `issue`'s operation within the group's timeout; a timeout names `what`, an
  /// interruption (ProcessGroupOptions::interrupted) ends it and the job.
  Status wait(const std::function<void(transport::Done)>& issue, const std::string& what);
  /// Whether the caller waiting for `what` is to stop (ProcessGroupOptions::interrupted):
  /// then the job is aborted, naming this process and `what`. For a wait of the caller's own.
  bool interrupted(const std::string& what);
  /// The next message process `peer` sends under `tag`, within the group's timeout; a timeout
  /// names `what` and the processes that do not answer, as wait() does. `via`: the endpoint
  /// it comes over (one of this group's lane endpoints); null, the group's UCX endpoint.
  Result<std::vector<at::Tensor>> receive(int peer, transport::Tag tag, const std::string& what,
                                          transport::Endpoint* via = nullptr);
  /// Why a wait between processes timed out, naming the processes that do not answer a ping
  /// within 2 s (stopped or hung), to append to the timeout's message. Before abort().
  std::string whom_it_waited_for() const;
  /// `root`'s bytes, on every process.
  Result<std::string> broadcast_bytes(int root, const std::string& bytes);
  /// `tensor` becomes process `root`'s on every process (CPU or device memory).
  Status broadcast(at::Tensor tensor, int root);
  /// The NCCL group over every process on `device` (this process's GPU; member i is process
  /// i), made on first use: every process says whether it can join (so one that cannot
  /// fails them all, named, instead of leaving them waiting in NCCL), process 0 makes the
  /// unique id and the group hands it out. Collective: every process asks, in one order.
  Result<std::shared_ptr<transport::NcclGroup>> nccl(const c10::Device& device);
  /// An endpoint for tensors on `device` (this process's GPU) between processes over NCCL
  /// (transport/lane_endpoint.h): a two-member NCCL group per ordered pair (sender, receiver)
  /// of `links` this process is in, messages' headers and host tensors over UCX. Collective:
  /// every process calls it with the same links, in one order with the job's other
  /// collective calls. Groups are made in the links' sorted order, each with a first
  /// transfer, so NCCL's connection set-up never waits in a cycle between processes.
  Result<std::shared_ptr<transport::LaneEndpoint>> nccl_endpoint(const c10::Device& device,
                                                                 std::vector<std::pair<int, int>> links);
  /// An NCCL group over `members` (process ranks, ascending; member i is members[i]) on
  /// `device` (this process's GPU): a stage's replicas in several processes summing their
  /// gradients on their GPUs. Collective: every process calls it for every such group, in
  /// one order, members or not (process 0 makes the unique id and every process passes it
  /// on); a non-member gets null.
  Result<std::shared_ptr<transport::NcclGroup>> nccl_subgroup(const std::vector<int>& members, const c10::Device& device);
  /// A collective group over `members` (process ranks, ascending; member i is members[i]),
  /// for work that spans some processes only (a stage's replicas in several processes).
  /// Collective by order: every process makes every group of the job in the same order,
  /// members or not (the n-th group gets the same id everywhere, so groups never mix their
  /// messages); a non-member gets null.
  Result<std::shared_ptr<transport::EndpointGroup>> subgroup(const std::vector<int>& members);
  /// Fails everything pending and later with `error` (a process that gives up), NCCL groups included.
  void abort(Status error);
  /// Says to every process that this one's work ended: it sends nothing more but the last
  /// collective exchanges, so a receive from it that finds nothing fails at once there,
  /// naming it, instead of at the timeout (a script that ended early, by SystemExit too).
  void leave();
  /// Leaves the job in step (after leave()): waits (within the timeout) until every process has come here,
  /// so none leaves while another still waits for what it sent, then lets the connections
  /// flush as they close. The destructor does it too; after an error it only closes.
  void close();

 private:
  ProcessGroup() = default;
  int rank_ = 0, world_ = 1;
  std::chrono::milliseconds timeout_{0};
  std::function<bool()> interrupted_;
  std::shared_ptr<transport::UcxEndpoint> endpoint_;
  std::shared_ptr<transport::EndpointGroup> all_;
  std::shared_ptr<void> rendezvous_;  // process 0: the published rendezvous actor
  bool closed_ = false;
  std::atomic<bool> failed_{false};
  // Groups are made one at a time under making_, in the caller's order (every process makes
  // them in the same order), without holding mu_: abort() takes mu_ and must not wait for an
  // NCCL join. making_ guards what only makers touch; mu_ what abort() reads.
  std::mutex making_;
  std::map<int, std::shared_ptr<transport::NcclGroup>> nccl_;  // the whole job's, by device index
  int groups_made_ = 0;          // subgroups made so far (the next one's id is this + 1)
  int lane_endpoints_made_ = 0;  // the next one's channel is this
  std::mutex mu_;
  std::vector<std::shared_ptr<transport::EndpointGroup>> subgroups_;
  std::vector<std::shared_ptr<transport::NcclGroup>> nccl_groups_;  // every NCCL group made: the whole,
                                                                   // subgroups and point to point links
  std::vector<std::shared_ptr<transport::LaneEndpoint>> lane_endpoints_;
  Status abort_error_ = Status::ok();  // what abort() was given first
  // How an NCCL join of this process waits: the group's timeout, given up on abort().
  transport::NcclJoin join() const;
  // Keeps `group` for abort(), aborting it at once if the job already failed.
  template <class Group>
  void keep(std::vector<std::shared_ptr<Group>>& kept, const std::shared_ptr<Group>& group);
  // Every process says whether it can hold an NCCL member on `device`; OK when all can.
  Status agree_on_nccl(const c10::Device& device, const std::string& what);
  // OK when `members` are distinct processes of the job, in ascending order.
  Status check_members(const std::vector<int>& members) const;
  // Process 0's `count` fresh NCCL unique ids, handed to every process.
  Result<std::vector<std::vector<std::uint8_t>>> unique_ids(int count);
};

}  // namespace conveyor::runtime
