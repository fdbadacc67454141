// conveyor._C: UCX and NCCL as this machine has them, NCCL groups, and the processes of a job.
#include "bindings/bindings.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "common/blocking_call.h"
#include "common/timeouts.h"
#include "runtime/process_group.h"
#include "transport/lane_endpoint.h"
#include "transport/nccl.h"
#include "transport/ucx.h"

namespace conveyor::bindings {

using namespace conveyor::graph;

namespace {

// A Python handle on an NCCL group member: each call waits for its operation (without the
// GIL) and aborts the group when it does not finish in time.
struct NcclHandle {
  std::shared_ptr<transport::NcclGroup> group;
  std::chrono::milliseconds timeout;
  void run(const std::string& what, const std::function<void(transport::Done)>& issue) const {
    py::gil_scoped_release nogil;
    bool stopped = false;
    std::optional<Status> done = transport::wait_within(issue, timeout, nullptr, [&] { return stopped = python_signal_raised(); });
    if (stopped) {
      group->abort(Status(ErrorCode::kExecution, "NCCL " + what + " was interrupted"));
      raise(Status(ErrorCode::kInterrupted, "NCCL " + what + " was interrupted; the group is aborted"));
    }
    if (!done) {
      Status late(ErrorCode::kExecution, "NCCL " + what + " did not complete within " + std::to_string(timeout.count()) +
                                             " ms (a member that hangs or is gone); the group is aborted");
      group->abort(late);  // ends NCCL's kernels; the operation then completes with `late`
      check(late);
    }
    check(*done);
  }
};

// The endpoint messages of `group` go over: `via` (one of its lane endpoints), or its UCX one.
std::shared_ptr<transport::Endpoint> endpoint_of(const runtime::ProcessGroup& group,
                                                 std::shared_ptr<transport::LaneEndpoint> via) {
  return via ? std::shared_ptr<transport::Endpoint>(std::move(via)) : group.endpoint();
}

// Sends in flight on a ProcessGroup (conveyor.distributed's, re-planning's), counted: no
// object per send, however many a script makes before it next waits (a loop that only
// sends, as inference, never waits).
// wait() returns once the peers have them all; the first that failed is raised, by name, at
// the next send or wait.
class SendsInFlight {
 public:
  /// Sends over `via` (a lane endpoint of `group`), or with null over the group's UCX endpoint.
  SendsInFlight(std::shared_ptr<runtime::ProcessGroup> group, std::shared_ptr<transport::LaneEndpoint> via)
      : group_(std::move(group)),
        endpoint_(endpoint_of(*group_, std::move(via))) {}

  void send(int peer, std::uint64_t tag, std::vector<at::Tensor> tensors, std::string what) {
    raise_failure();
    std::uint64_t serial = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      serial = state_->next++;
      state_->pending.emplace(serial, std::move(what));
    }
    // The caller (a script) may write the tensors once this returns: nothing is read later
    // (so the transport holds none of them).
    endpoint_->send_copied(peer, tag, std::move(tensors), [state = state_, serial](Status s) {
      std::lock_guard<std::mutex> lock(state->mu);
      auto it = state->pending.find(serial);
      if (!s && state->failed.is_ok()) state->failed = s.with_context(it->second);
      state->pending.erase(it);
      if (state->pending.empty()) state->all_done.notify_all();
    });
  }

  void wait() {
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(state_->mu);
      const auto deadline = std::chrono::steady_clock::now() + group_->timeout();
      while (!state_->all_done.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() + kStopAskedEvery),
                                          [&] { return state_->pending.empty(); })) {
        if (std::chrono::steady_clock::now() >= deadline) break;
        const std::string oldest = state_->pending.begin()->second;
        lock.unlock();
        if (group_->interrupted(oldest)) raise(Status(ErrorCode::kInterrupted, "interrupted while waiting for " + oldest));
        lock.lock();
      }
      if (!state_->pending.empty()) {
        const std::string& oldest = state_->pending.begin()->second;
        const std::size_t n = state_->pending.size();
        Status late(ErrorCode::kExecution, "process " + std::to_string(group_->rank()) + ": " + oldest +
                                               " did not complete within " + std::to_string(group_->timeout().count()) +
                                               " ms" + (n > 1 ? " (nor " + std::to_string(n - 1) + " later sends)" : ""));
        lock.unlock();
        check(late);
      }
    }
    raise_failure();
  }

 private:
  void raise_failure() {
    Status failed = Status::ok();
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      failed = state_->failed;
    }
    if (!failed.is_ok()) check(failed.with_context("process " + std::to_string(group_->rank())));
  }

  struct State {
    std::mutex mu;
    std::condition_variable all_done;
    std::map<std::uint64_t, std::string> pending;  // serial -> what the send is, for errors
    std::uint64_t next = 0;
    Status failed = Status::ok();  // the first send that failed
  };
  std::shared_ptr<runtime::ProcessGroup> group_;
  std::shared_ptr<transport::Endpoint> endpoint_;
  std::shared_ptr<State> state_ = std::make_shared<State>();  // shared with the sends' callbacks
};

// Receives posted before anyone waits for them (conveyor.distributed's gradients, one per
// send that needs one), so a sender can see without waiting whether an answer is in (its
// receiver may say at once that no gradient will come); take() waits for one within the
// group's timeout, failing as ProcessGroup::receive does.
class PostedReceives {
 public:
  /// Receives over `via` (a lane endpoint of `group`), or with null over the group's UCX endpoint.
  PostedReceives(std::shared_ptr<runtime::ProcessGroup> group, std::shared_ptr<transport::LaneEndpoint> via)
      : group_(std::move(group)),
        endpoint_(endpoint_of(*group_, std::move(via))) {}

  void post(int peer, std::uint64_t tag) {
    auto slot = std::make_shared<Slot>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!slots_.emplace(std::pair{peer, tag}, slot).second) {
        check(Status(ErrorCode::kInvalidArgument, "a receive from process " + std::to_string(peer) + " under tag " +
                                                      std::to_string(tag) + " is posted already"));
      }
    }
    endpoint_->recv(peer, tag, [slot](Result<std::vector<at::Tensor>> got) {
      transport::Done waiter;
      Status status = got.status();
      {
        std::lock_guard<std::mutex> lock(slot->mu);
        slot->got = std::move(got);
        waiter = std::move(slot->waiter);
      }
      if (waiter) waiter(status);
    });
  }

  /// Whether the message of the receive posted for (peer, tag) is in (a receive that failed
  /// is not: take() raises its error where the message is needed).
  bool arrived(int peer, std::uint64_t tag) {
    const std::shared_ptr<Slot> slot = find(peer, tag);
    std::lock_guard<std::mutex> lock(slot->mu);
    return slot->got.has_value() && slot->got->is_ok();
  }

  /// The message of the receive posted for (peer, tag), waiting for it within the group's
  /// timeout (a timeout names `what`); forgets the receive.
  std::vector<at::Tensor> take(int peer, std::uint64_t tag, const std::string& what) {
    const std::shared_ptr<Slot> slot = find(peer, tag);
    Status status = Status::ok();
    {
      py::gil_scoped_release nogil;
      status = group_->wait(
          [&](transport::Done done) {
            std::unique_lock<std::mutex> lock(slot->mu);
            if (!slot->got) {
              slot->waiter = std::move(done);
              return;
            }
            const Status in = slot->got->status();
            lock.unlock();
            done(in);
          },
          what);
    }
    check(status);
    {
      std::lock_guard<std::mutex> lock(mu_);
      slots_.erase(std::pair{peer, tag});
    }
    std::lock_guard<std::mutex> lock(slot->mu);
    return std::move(**slot->got);
  }

 private:
  struct Slot {
    std::mutex mu;
    std::optional<Result<std::vector<at::Tensor>>> got;  // what the receive completed with
    transport::Done waiter;                              // take()'s, while it waits
  };

  std::shared_ptr<Slot> find(int peer, std::uint64_t tag) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(std::pair{peer, tag});
    if (it == slots_.end()) {
      check(Status(ErrorCode::kInvalidArgument, "no receive from process " + std::to_string(peer) + " under tag " +
                                                    std::to_string(tag) + " was posted"));
    }
    return it->second;
  }

  std::shared_ptr<runtime::ProcessGroup> group_;
  std::shared_ptr<transport::Endpoint> endpoint_;
  std::mutex mu_;
  std::map<std::pair<int, std::uint64_t>, std::shared_ptr<Slot>> slots_;
};

}  // namespace

void bind_processes(py::module_& m) {
  py::class_<SendsInFlight>(m, "SendsInFlight",
                            "Sends in flight on a ProcessGroup, counted; wait() until the peers "
                            "have them all, or raise the first that failed.")
      .def(py::init<std::shared_ptr<runtime::ProcessGroup>, std::shared_ptr<transport::LaneEndpoint>>(),
           py::arg("group"), py::arg("via") = nullptr,
           "Sends over `via` (a LaneEndpoint of the group), or over the group's UCX endpoint when None.")
      .def("send", &SendsInFlight::send, py::arg("peer"), py::arg("tag"), py::arg("tensors"), py::arg("what"),
           "Sends tensors to process peer under tag without waiting (raises if an earlier send failed); `what` "
           "names the send in errors.")
      .def("wait", &SendsInFlight::wait, "Returns once every send so far reached its peer; raises the first that failed.");

  py::class_<PostedReceives>(m, "PostedReceives",
                             "Receives posted on a ProcessGroup before anyone waits for them: arrived() without "
                             "waiting, take() within the group's timeout.")
      .def(py::init<std::shared_ptr<runtime::ProcessGroup>, std::shared_ptr<transport::LaneEndpoint>>(),
           py::arg("group"), py::arg("via") = nullptr,
           "Receives over `via` (a LaneEndpoint of the group), or over the group's UCX endpoint when None.")
      .def("post", &PostedReceives::post, py::arg("peer"), py::arg("tag"),
           "Asks for process peer's next message under tag, now.")
      .def("arrived", &PostedReceives::arrived, py::arg("peer"), py::arg("tag"),
           "Whether the message of the receive posted for (peer, tag) is in; never waits.")
      .def("take", &PostedReceives::take, py::arg("peer"), py::arg("tag"), py::arg("what"),
           "The tensors of the receive posted for (peer, tag), waiting at most the group's timeout; `what` names it "
           "in errors.");

  py::class_<transport::LaneEndpoint, std::shared_ptr<transport::LaneEndpoint>>(
      m, "LaneEndpoint",
      "Tagged messages between the processes of a job whose tensors on one GPU travel over NCCL "
      "(transport/lane_endpoint.h): headers and other tensors over the group's UCX endpoint. Made by "
      "ProcessGroup.nccl_endpoint; pass it to SendsInFlight and ProcessGroup.recv.");

  m.def("ucx_status", [] {
    auto probe = transport::make_ucx_endpoint(0, 1);
    return probe.is_ok() ? std::string() : probe.status().message();
  }, "Empty when UCX can start here (processes can be connected); otherwise why not.");

  m.def("nccl_status", [] {
    auto described = transport::nccl_description();
    return py::make_tuple(described.is_ok(), described.is_ok() ? *described : described.status().message());
  }, "(True, 'NCCL 2.28.9 (path)') when NCCL can be loaded here (no GPU needed for that); (False, why not).");
  m.def("nccl_unique_id", [] {
    auto id = unwrap(transport::nccl_unique_id());
    return py::bytes(reinterpret_cast<const char*>(id.data()), id.size());
  }, "A fresh unique id for a new NCCL group (128 bytes): one member makes it, every member passes it to NcclGroup.");

  py::class_<NcclHandle>(m, "NcclGroup",
                         "A member of an NCCL group on one CUDA device (transport/nccl.h): collectives on the member's "
                         "own stream, after the work queued on the current stream; each call returns once its result "
                         "is in the tensor. Joining fails when the other members have not joined within timeout_s; a call that "
                         "does not finish within timeout_s aborts the group.")
      .def(py::init([](int rank, int size, const py::bytes& unique_id, const std::string& device, double timeout_s) {
             std::string id = unique_id;
             auto dev = c10::Device(device);
             const std::chrono::milliseconds timeout(static_cast<std::int64_t>(timeout_s * 1000));
             py::gil_scoped_release nogil;
             return NcclHandle{unwrap(transport::make_nccl_group(rank, size, std::vector<std::uint8_t>(id.begin(), id.end()),
                                                                 dev, transport::NcclJoin{timeout, {}})),
                               timeout};
           }),
           py::arg("rank"), py::arg("size"), py::arg("unique_id"), py::arg("device"), py::arg("timeout_s") = 300.0)
      .def_property_readonly("rank", [](const NcclHandle& h) { return h.group->rank(); })
      .def_property_readonly("size", [](const NcclHandle& h) { return h.group->size(); })
      .def_property_readonly("device", [](const NcclHandle& h) { return h.group->device().str(); })
      .def("allreduce", [](const NcclHandle& h, at::Tensor t) {
        h.run("allreduce", [&](transport::Done d) { h.group->allreduce(t, d); });
      }, py::arg("tensor"), "tensor becomes the sum over the members, in place.")
      .def("reduce", [](const NcclHandle& h, at::Tensor t, int root) {
        h.run("reduce", [&](transport::Done d) { h.group->reduce(t, root, d); });
      }, py::arg("tensor"), py::arg("root"), "root's tensor becomes the sum, in place.")
      .def("broadcast", [](const NcclHandle& h, at::Tensor t, int root) {
        h.run("broadcast", [&](transport::Done d) { h.group->broadcast(t, root, d); });
      }, py::arg("tensor"), py::arg("root"), "tensor becomes root's, in place.")
      .def("allgather", [](const NcclHandle& h, at::Tensor in, at::Tensor out) {
        h.run("allgather", [&](transport::Done d) { h.group->allgather(in, out, d); });
      }, py::arg("input"), py::arg("output"), "output (size times input, dim 0) becomes every member's input, in member order.")
      .def("reduce_scatter", [](const NcclHandle& h, at::Tensor in, at::Tensor out) {
        h.run("reduce_scatter", [&](transport::Done d) { h.group->reduce_scatter(in, out, d); });
      }, py::arg("input"), py::arg("output"), "output becomes this member's slice of the sum of every input.")
      .def("exchange", [](const NcclHandle& h, std::vector<at::Tensor> send, int to, std::vector<at::Tensor> recv, int from) {
        h.run("exchange", [&](transport::Done d) { h.group->exchange(send, to, recv, from, d); });
      }, py::arg("send"), py::arg("to"), py::arg("recv"), py::arg("from_"),
         "Point to point, matched by order: sends each of `send` to member `to` and fills each of `recv` "
         "(allocated by the caller) from member `from_`, as one NCCL group (a member may exchange with itself).")
      .def("abort", [](const NcclHandle& h, const std::string& why) {
        h.group->abort(Status(ErrorCode::kExecution, why));
      }, py::arg("why"), "Fails everything pending and later with `why` (ends kernels waiting for a lost member).");

  py::class_<runtime::ProcessGroup, std::shared_ptr<runtime::ProcessGroup>>(
      m, "ProcessGroup", "The processes of one job: rendezvous (CAF remote actors), UCX between every two.")
      .def(py::init([](int rank, int world, const std::string& host, int port, const std::string& job, double timeout_s,
                       const std::string& version, const std::string& secret) {
             if (!valid_seconds(timeout_s)) {
               char range[64];
               std::snprintf(range, sizeof range, "%g to %g", kLeastSeconds, kMostSeconds);
               raise(Status(ErrorCode::kInvalidArgument, "timeout_s=" + std::to_string(timeout_s) +
                                                             ": expected a number of seconds from " + range));
             }
             runtime::ProcessGroupOptions o;
             o.rank = rank;
             o.world = world;
             o.host = host;
             o.port = port;
             o.job = job;
             o.version = version;
             o.secret = secret;
             o.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_s * 1000));
             o.interrupted = python_signal_raised;  // Ctrl-C ends a wait on the peers, and the job
             py::gil_scoped_release nogil;
             return unwrap(runtime::ProcessGroup::create(o));
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("host") = "127.0.0.1", py::arg("port") = 29500,
           py::arg("job") = "", py::arg("timeout_s") = 120.0, py::arg("version") = "",
           py::arg("secret") = "",
           "Joins the job: process 0 listens at host:port, the others connect; every process connects to every "
           "other over UCX. job: a fingerprint every process must share. timeout_s: the rendezvous and every "
           "later wait. version: the conveyor version to announce (empty: this build's; tests of mismatches). secret: the "
           "job's secret (empty: CONVEYOR_JOB_SECRET, or this user's secret file).")
      .def("close", [](runtime::ProcessGroup& g) {
        py::gil_scoped_release nogil;
        g.close();
      }, "Leaves the job in step with the others (a last exchange, then connections flushed as they close).")
      .def("leave", &runtime::ProcessGroup::leave,
           "Says this process's work ended: it sends nothing more but the last collective exchanges (a receive "
           "from it that finds nothing then fails at once, naming it).")
      .def("abort", [](runtime::ProcessGroup& g, const std::string& why) {
        g.abort(Status(ErrorCode::kExecution, why));
      }, py::arg("why"), "Gives up: everything pending and later fails with `why`; close() then only closes.")
      .def_property_readonly("rank", &runtime::ProcessGroup::rank)
      .def_property_readonly("world_size", &runtime::ProcessGroup::world_size)
      .def("broadcast_bytes", [](runtime::ProcessGroup& g, int root, const py::bytes& data) {
        std::string in = data;
        std::string out;
        {
          py::gil_scoped_release nogil;
          out = unwrap(g.broadcast_bytes(root, in));
        }
        return py::bytes(out);
      }, py::arg("root"), py::arg("data"), "root's bytes, on every process.")
      .def("broadcast", [](runtime::ProcessGroup& g, at::Tensor t, int root) {
        py::gil_scoped_release nogil;  // the group keeps no tensor Python made (transport::without_python)
        check(g.broadcast(std::move(t), root));
      }, py::arg("tensor"), py::arg("root"), "tensor becomes process root's, in place, on every process.")
      .def("recv", [](runtime::ProcessGroup& g, int peer, std::uint64_t tag, const std::string& what,
                      const std::shared_ptr<transport::LaneEndpoint>& via) {
        py::gil_scoped_release nogil;
        return unwrap(g.receive(peer, tag, what, via.get()));
      }, py::arg("peer"), py::arg("tag"), py::arg("what"), py::arg("via") = nullptr,
         "The tensors process peer sends under tag (waiting at most the group's timeout); `what` names it in errors. "
         "`via`: the LaneEndpoint it comes over (None: the group's UCX endpoint).")
      .def("allreduce", [](runtime::ProcessGroup& g, at::Tensor t) {
        py::gil_scoped_release nogil;  // the group keeps no tensor Python made (transport::without_python)
        check(g.wait([&](transport::Done d) { g.all().allreduce(t, d); }, "an allreduce"));
      }, py::arg("tensor"), "tensor becomes the sum over the processes (in process order), in place.")
      .def("nccl", [](runtime::ProcessGroup& g, const std::string& device) {
        auto dev = c10::Device(device);
        py::gil_scoped_release nogil;
        return NcclHandle{unwrap(g.nccl(dev)), g.timeout()};
      }, py::arg("device"), "The NCCL group over every process on this process's CUDA device (member i is process i); "
         "made on first use. Every process calls it, in the same order.")
      .def("nccl_endpoint", [](runtime::ProcessGroup& g, const std::string& device, std::vector<std::pair<int, int>> links) {
        auto dev = c10::Device(device);
        py::gil_scoped_release nogil;
        return unwrap(g.nccl_endpoint(dev, std::move(links)));
      }, py::arg("device"), py::arg("links"),
         "A LaneEndpoint whose tensors on this process's CUDA device go over NCCL, a two-member group per "
         "(sender, receiver) of `links` this process is in. Every process calls it with the same links, in one "
         "order with the job's other collective calls.")
      .def("nccl_subgroup", [](runtime::ProcessGroup& g, std::vector<int> members, const std::string& device) -> py::object {
        auto dev = c10::Device(device);
        std::shared_ptr<transport::NcclGroup> group;
        {
          py::gil_scoped_release nogil;
          group = unwrap(g.nccl_subgroup(members, dev));
        }
        if (!group) return py::none();
        return py::cast(NcclHandle{group, g.timeout()});
      }, py::arg("members"), py::arg("device"),
         "An NCCL group over some processes (ascending ranks; member i is members[i]) on this process's CUDA "
         "device; None where this process is not a member. Every process calls it for every such group, in one order.");
}

}  // namespace conveyor::bindings
