#include "transport/endpoint_group.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <set>

namespace conveyor::transport {

namespace {

constexpr std::int64_t kData = 0x436f6c6c;   // a message's first word: data of the call
constexpr std::int64_t kAbort = 0x41626f72;  // or: the sender failed the call (text follows)
constexpr std::int64_t kWholeTensorAllreduceBytes = 64 << 10;

// The part of `length` elements that member i of n owns (tensor_split's rule).
std::pair<std::int64_t, std::int64_t> part_of(std::int64_t length, int n, int i) {
  const std::int64_t base = length / n, extra = length % n;
  return {i * base + std::min<std::int64_t>(i, extra), base + (i < extra ? 1 : 0)};
}

struct GroupState {
  std::shared_ptr<Endpoint> endpoint;
  std::vector<int> members;  // endpoint ranks, in member order
  int me = 0;
  Tag group_bits = 0;
  std::mutex mu;
  std::uint64_t issued = 0;
  Status error = Status::ok();
  std::set<std::shared_ptr<struct Operation>> pending;
};

// One collective call of this member: its messages in flight and what to do when they are in.
struct Operation : std::enable_shared_from_this<Operation> {
  std::shared_ptr<GroupState> group;
  CollectiveCall call;
  // The first tensor of every message of the call: kData, when the sender called (its
  // system clock, nanoseconds since the Unix epoch), then the call encoded.
  at::Tensor header;
  std::uint64_t number = 0;
  TimedDone done;
  std::mutex mu;
  bool finished = false;
  // When each member called: this member's wait for the others is from its own call to the
  // last member's, at most until their parts were all in (-1: not known).
  std::chrono::steady_clock::time_point called = std::chrono::steady_clock::now();
  std::int64_t called_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count();
  std::vector<std::int64_t> called_ns_of;  // per member, as its messages say (under mu)
  double waited = -1;

  int n() const { return static_cast<int>(group->members.size()); }
  Tag tag(int phase) const {
    return kCollectiveTagBit | group->group_bits | (Tag(phase) << 31) | (number & 0x7fffffffULL);
  }

  void finish(Status s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (finished) return;
      finished = true;
    }
    {
      std::lock_guard<std::mutex> lock(group->mu);
      if (!s && group->error.is_ok()) group->error = s;
      group->pending.erase(shared_from_this());
    }
    done(std::move(s), waited);
  }

  // When member j says it called.
  void heard_call(int j, std::int64_t ns) {
    std::lock_guard<std::mutex> lock(mu);
    called_ns_of.resize(static_cast<std::size_t>(n()), -1);
    called_ns_of[j] = ns;
  }

  // Every other member's part is in: this member waited from its call to the last member's,
  // at most until now (a peer's clock that runs ahead cannot make it wait longer than it did).
  void parts_in() {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - called).count();
    std::lock_guard<std::mutex> lock(mu);
    std::int64_t last = called_ns;
    for (int j = 0; j < n(); ++j) {
      if (j == group->me) continue;
      if (j >= static_cast<int>(called_ns_of.size()) || called_ns_of[j] < 0) return;
      last = std::max(last, called_ns_of[j]);
    }
    waited = std::min(elapsed, static_cast<double>(last - called_ns) * 1e-9);
  }

  // Fails the call, telling every other member (in the first phase, where they all check calls).
  void fail(Status s) {
    for (int j = 0; j < n(); ++j) {
      if (j == group->me) continue;
      group->endpoint->send(group->members[j], tag(0),
                            {at::tensor(std::vector<std::int64_t>{kAbort}), text_tensor(s.message())}, [](Status) {});
    }
    finish(std::move(s));
  }

  void send(int member, int phase, const at::Tensor& payload) {
    send_then(member, phase, payload, nullptr);
  }

  // As send, and `sent` runs once the member has taken the payload (not on failure).
  void send_then(int member, int phase, const at::Tensor& payload, std::function<void()> sent) {
    auto self = shared_from_this();
    group->endpoint->send(group->members[member], tag(phase), {header, payload},
                          [self, sent = std::move(sent)](Status s) {
                            if (!s) return self->finish(std::move(s));
                            if (sent) sent();
                          });
  }

  // Receives one message from each of `from` in `phase`; checks each sender's call against
  // this member's, then runs `then` with the payloads (indexed by member).
  void receive(const std::vector<int>& from, int phase, std::function<Status(std::vector<at::Tensor>&)> then) {
    struct Gather {
      std::mutex mu;
      std::vector<at::Tensor> payloads;
      int left = 0;
      bool failed = false;
    };
    auto gather = std::make_shared<Gather>();
    gather->payloads.resize(static_cast<std::size_t>(n()));
    gather->left = static_cast<int>(from.size());
    auto self = shared_from_this();
    auto complete = [self, gather, then](int j, Result<std::vector<at::Tensor>> got) {
      Status bad = self->check(j, got);
      std::unique_lock<std::mutex> lock(gather->mu);
      if (gather->failed) return;
      if (!bad) {
        gather->failed = true;
        lock.unlock();
        return bad.code() == ErrorCode::kInvalidArgument ? self->fail(bad) : self->finish(bad);
      }
      self->heard_call(j, (*got)[0].data_ptr<std::int64_t>()[1]);
      gather->payloads[j] = (*got)[1];
      if (--gather->left > 0) return;
      lock.unlock();
      c10::NoGradGuard no_grad;
      if (Status s = then(gather->payloads); !s) return self->fail(s);
    };
    if (from.empty()) {
      std::vector<at::Tensor> none(static_cast<std::size_t>(n()));
      if (Status s = then(none); !s) fail(s);
      return;
    }
    for (int j : from) {
      group->endpoint->recv(group->members[j], tag(phase),
                            [complete, j](Result<std::vector<at::Tensor>> got) { complete(j, std::move(got)); });
    }
  }

  // A received message: an abort (its text is the error), or data whose call must be ours.
  Status check(int j, const Result<std::vector<at::Tensor>>& got) const {
    if (!got.is_ok()) return got.status();
    const auto& m = *got;
    if (m.size() != 2 || !m[0].defined() || m[0].scalar_type() != at::kLong || m[0].dim() != 1 || m[0].numel() < 1) {
      return Status(ErrorCode::kCorrupt, "a malformed collective message from member " + std::to_string(j));
    }
    const std::int64_t* head = m[0].data_ptr<std::int64_t>();
    if (head[0] == kAbort && m[1].defined() && m[1].scalar_type() == at::kByte) {
      return Status(ErrorCode::kExecution, text_of(m[1]) + " (reported by member " + std::to_string(j) + ")");
    }
    if (head[0] != kData || m[0].numel() < 2) return Status(ErrorCode::kCorrupt, "a malformed collective message from member " + std::to_string(j));
    auto theirs = CollectiveCall::decode(std::vector<std::int64_t>(head + 2, head + m[0].numel()));
    if (!theirs.is_ok()) return theirs.status();
    // Named in member order, as every member names them.
    const int me = group->me;
    return me < j ? check_collective_call(call, me, *theirs, j, n(), number)
                  : check_collective_call(*theirs, j, call, me, n(), number);
  }

  std::vector<int> others() const {
    std::vector<int> out;
    for (int j = 0; j < n(); ++j) {
      if (j != group->me) out.push_back(j);
    }
    return out;
  }
};

// Sums `parts` in member order, `own` standing for this member's part.
at::Tensor sum_in_member_order(const std::vector<at::Tensor>& parts, const at::Tensor& own, int me) {
  at::Tensor acc;
  for (int j = 0; j < static_cast<int>(parts.size()); ++j) {
    const at::Tensor& x = j == me ? own : parts[j];
    if (!acc.defined()) {
      acc = x.to(own.device(), /*non_blocking=*/false, /*copy=*/true);
    } else {
      acc.add_(x.to(own.device()));
    }
  }
  return acc;
}

// Sums `parts` in member order into `own` (this member's part; `parts[me]` unused), equal
// bit for bit to sum_in_member_order: ((p0 + p1) + p2) + ... Member 0 and member 1 sum in
// place (p0 + own is own + p0: one addition commutes exactly), others from a sum of the
// parts before theirs. Received parts are not written: a transport may hand over the
// sender's own tensor.
void sum_into_own_part(const std::vector<at::Tensor>& parts, at::Tensor& own, int me) {
  auto part = [&](int j) { return parts[static_cast<std::size_t>(j)].to(own.device()); };
  if (me >= 2) {
    at::Tensor before = part(0) + part(1);
    for (int j = 2; j < me; ++j) before.add_(part(j));
    own.add_(before);
  } else if (me == 1) {
    own.add_(part(0));
  }
  for (int j = me == 0 ? 1 : me + 1; j < static_cast<int>(parts.size()); ++j) own.add_(part(j));
}

class Member final : public EndpointGroup {
 public:
  explicit Member(std::shared_ptr<GroupState> g) : g_(std::move(g)) {}
  int rank() const override { return g_->me; }
  int size() const override { return static_cast<int>(g_->members.size()); }

  void allreduce(at::Tensor t, Done done) override {
    allreduce_timed(std::move(t), [done = std::move(done)](Status s, double) { done(std::move(s)); });
  }

  void allreduce_timed(at::Tensor t, TimedDone done) override {
    t = without_python(t);
    auto op = start_timed({CollectiveKind::kAllReduce, 0, t, {}}, std::move(done));
    if (!op) return;
    const int n = size(), me = rank();
    at::Tensor flat = t.contiguous().view(-1);
    if (flat.numel() * static_cast<std::int64_t>(flat.element_size()) <= kWholeTensorAllreduceBytes || flat.numel() < n) {
      for (int j : op->others()) op->send(j, 0, flat);
      op->receive(op->others(), 0, [op, t, flat, me](std::vector<at::Tensor>& parts) {
        op->parts_in();
        t.copy_(sum_in_member_order(parts, flat, me).view(t.sizes()));
        op->finish(Status::ok());
        return Status::ok();
      });
      return;
    }
    // reduce_scatter: member j owns part j; then every owner sends its reduced part to all.
    // Sums and results are written into `flat` itself (t's memory when t is contiguous),
    // with no step-sized buffer: a fresh one per step cost page faults and two more copies.
    // `flat` is overwritten only where it is no longer read: this member's part after the
    // others sent theirs (it is never sent in the first phase), part j once member j's
    // reduced part arrived (j had received this member's part j before it summed).
    for (int j : op->others()) {
      const auto [offset, length] = part_of(flat.numel(), n, j);
      op->send(j, 0, flat.narrow(0, offset, length));
    }
    // Done when every reduced part is in and this member's own has been taken by all: a
    // caller may write t again once done.
    auto left = std::make_shared<std::atomic<int>>(static_cast<int>(op->others().size()) + 1);
    const bool into_t = t.is_contiguous() && flat.data_ptr() == t.data_ptr();
    auto one_more = [op, left, t, flat, into_t]() {
      if (left->fetch_sub(1) != 1) return;
      if (!into_t) t.copy_(flat.view(t.sizes()));
      op->finish(Status::ok());
    };
    op->receive(op->others(), 0, [op, flat, me, n, one_more](std::vector<at::Tensor>& parts) {
      op->parts_in();
      const auto [offset, length] = part_of(flat.numel(), n, me);
      at::Tensor mine = flat.narrow(0, offset, length);
      sum_into_own_part(parts, mine, me);
      for (int j : op->others()) op->send_then(j, 1, mine, one_more);
      op->receive(op->others(), 1, [op, flat, n, one_more](std::vector<at::Tensor>& reduced) {
        for (int j : op->others()) {
          const auto [o, l] = part_of(flat.numel(), n, j);
          flat.narrow(0, o, l).copy_(reduced[j]);
        }
        one_more();
        return Status::ok();
      });
      return Status::ok();
    });
  }

  void reduce(at::Tensor t, int root, Done done) override {
    t = without_python(t);
    auto op = start({CollectiveKind::kReduce, root, t, {}}, std::move(done));
    if (!op) return;
    if (rank() != root) {
      op->send(root, 0, t);
      // Done once the root has it: wait for the root's acknowledgement (or its abort).
      op->receive({root}, 1, [op](std::vector<at::Tensor>&) {
        op->finish(Status::ok());
        return Status::ok();
      });
      return;
    }
    op->receive(op->others(), 0, [op, t, root](std::vector<at::Tensor>& parts) {
      t.copy_(sum_in_member_order(parts, t, root));
      for (int j : op->others()) op->send(j, 1, at::Tensor());
      op->finish(Status::ok());
      return Status::ok();
    });
  }

  void broadcast(at::Tensor t, int root, Done done) override {
    t = without_python(t);
    auto op = start({CollectiveKind::kBroadcast, root, t, {}}, std::move(done));
    if (!op) return;
    if (rank() == root) {
      for (int j : op->others()) op->send(j, 0, t);
      // Done once every member has it (or one refused the call).
      op->receive(op->others(), 1, [op](std::vector<at::Tensor>&) {
        op->finish(Status::ok());
        return Status::ok();
      });
      return;
    }
    op->receive({root}, 0, [op, t, root](std::vector<at::Tensor>& parts) {
      t.copy_(parts[root]);
      op->send(root, 1, at::Tensor());
      op->finish(Status::ok());
      return Status::ok();
    });
  }

  void allgather(at::Tensor in, at::Tensor out, Done done) override {
    in = without_python(in);
    out = without_python(out);
    auto op = start({CollectiveKind::kAllGather, 0, in, out}, std::move(done));
    if (!op) return;
    for (int j : op->others()) op->send(j, 0, in);
    const int me = rank();
    op->receive(op->others(), 0, [op, in, out, me](std::vector<at::Tensor>& parts) {
      const std::int64_t k = in.size(0);
      for (int j = 0; j < op->n(); ++j) out.narrow(0, j * k, k).copy_(j == me ? in : parts[j]);
      op->finish(Status::ok());
      return Status::ok();
    });
  }

  void reduce_scatter(at::Tensor in, at::Tensor out, Done done) override {
    in = without_python(in);
    out = without_python(out);
    auto op = start({CollectiveKind::kReduceScatter, 0, in, out}, std::move(done));
    if (!op) return;
    const std::int64_t k = out.size(0);
    for (int j : op->others()) op->send(j, 0, in.narrow(0, j * k, k));
    const int me = rank();
    op->receive(op->others(), 0, [op, in, out, me, k](std::vector<at::Tensor>& parts) {
      out.copy_(sum_in_member_order(parts, in.narrow(0, me * k, k), me));
      op->finish(Status::ok());
      return Status::ok();
    });
  }

  void abort(Status error) override {
    std::set<std::shared_ptr<Operation>> pending;
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      if (g_->error.is_ok()) g_->error = error;
      pending = g_->pending;
    }
    for (const auto& op : pending) op->finish(error);
  }

 private:
  // A new operation, or none (`done` called) when the group failed or the call is invalid here.
  std::shared_ptr<Operation> start(CollectiveCall call, Done done) {
    return start_timed(std::move(call), [done = std::move(done)](Status s, double) { done(std::move(s)); });
  }
  std::shared_ptr<Operation> start_timed(CollectiveCall call, TimedDone done) {
    auto op = std::make_shared<Operation>();
    op->group = g_;
    op->call = std::move(call);
    std::vector<std::int64_t> head{kData, op->called_ns};
    const auto code = op->call.encode();
    head.insert(head.end(), code.begin(), code.end());
    op->header = at::tensor(head);
    op->done = std::move(done);
    Status invalid = Status::ok();
    {
      std::lock_guard<std::mutex> lock(g_->mu);
      if (!g_->error.is_ok()) invalid = g_->error;
      op->number = g_->issued++;
      if (invalid.is_ok()) g_->pending.insert(op);
    }
    if (invalid.is_ok()) invalid = check_collective_call(op->call, rank(), op->call, rank(), size(), op->number);
    if (!invalid.is_ok()) {
      op->finish(invalid);
      return nullptr;
    }
    return op;
  }
  std::shared_ptr<GroupState> g_;
};

}  // namespace

Result<std::shared_ptr<EndpointGroup>> make_endpoint_group(std::shared_ptr<Endpoint> endpoint, std::vector<int> members,
                                                           int group_id) {
  if (!endpoint) return Status(ErrorCode::kInvalidArgument, "a collective group needs an endpoint");
  if (group_id < 0 || group_id >= (1 << 15)) {
    return Status(ErrorCode::kInvalidArgument, "group id " + std::to_string(group_id) + " (0 to 32767)");
  }
  auto state = std::make_shared<GroupState>();
  state->me = -1;
  std::set<int> seen;
  for (int i = 0; i < static_cast<int>(members.size()); ++i) {
    const int r = members[i];
    if (r < 0 || r >= endpoint->world_size() || !seen.insert(r).second) {
      return Status(ErrorCode::kInvalidArgument, "group member " + std::to_string(r) + " of a world of " +
                                                     std::to_string(endpoint->world_size()) + " (out of range or repeated)");
    }
    if (r == endpoint->rank()) state->me = i;
  }
  if (state->me < 0) {
    return Status(ErrorCode::kInvalidArgument, "member " + std::to_string(endpoint->rank()) +
                                                   " made a group it does not belong to");
  }
  state->endpoint = std::move(endpoint);
  state->members = std::move(members);
  state->group_bits = collective_group_bits(group_id);
  return std::shared_ptr<EndpointGroup>(std::make_shared<Member>(std::move(state)));
}

}  // namespace conveyor::transport
