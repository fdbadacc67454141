// One conformance suite for every transport backend: each test runs against every backend
// that can run on this machine (inproc here; UCX and NCCL register themselves where built).
// What is UCX's alone is in ucx_test.cc.
// Members run on threads of their own, as stage replicas do.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <numeric>
#include <future>
#include <thread>

#include "transport/endpoint_group.h"
#include "transport/inproc.h"
#include "transport/lane_endpoint.h"
#include "transport/ucx.h"

namespace conveyor::transport {
namespace {

// Tests bind UCX to loopback only.
const int kLoopbackOnly = [] { return setenv("UCX_NET_DEVICES", "lo", /*overwrite=*/0); }();

struct Backend {
  std::string name;
  std::function<Result<std::vector<std::shared_ptr<Endpoint>>>(int)> endpoints;
  std::function<void(Endpoint&, Status)> abort_endpoint;
  std::function<std::vector<std::shared_ptr<Collective>>(int)> group;  // empty: point to point only
  std::function<void(const Collective&, Status)> abort_group;
};

// UCX groups: a world of n members in this process, a group over all of them. Aborting one
// member stands for its death, which every peer's endpoint sees: all members are aborted.
struct UcxGroups {
  std::mutex mu;
  std::vector<std::pair<std::vector<std::shared_ptr<Endpoint>>, std::vector<std::shared_ptr<Collective>>>> made;
};
UcxGroups& ucx_groups() {
  static UcxGroups groups;
  return groups;
}
std::vector<std::shared_ptr<Collective>> make_ucx_group(int n) {
  auto world = make_ucx_world_in_process(n);
  if (!world.is_ok()) return {};
  std::vector<std::shared_ptr<Collective>> group;
  for (int i = 0; i < n; ++i) {
    std::vector<int> members(static_cast<std::size_t>(n));
    std::iota(members.begin(), members.end(), 0);
    auto member = make_endpoint_group((*world)[i], members, /*group_id=*/3);
    if (!member.is_ok()) return {};
    group.push_back(*member);
  }
  std::lock_guard<std::mutex> lock(ucx_groups().mu);
  ucx_groups().made.emplace_back(*world, group);
  return group;
}
void abort_ucx_group(const Collective& member, const Status& error) {
  std::lock_guard<std::mutex> lock(ucx_groups().mu);
  for (auto& [world, group] : ucx_groups().made) {
    bool ours = false;
    for (auto& c : group) ours = ours || c.get() == &member;
    if (!ours) continue;
    for (auto& c : group) dynamic_cast<EndpointGroup&>(*c).abort(error);
  }
}

// Lane endpoints (headers over `control`, tensors over endpoint lanes on a second world of
// the same kind): the matching NCCL's point to point needs, run here without NCCL.
Result<std::vector<std::shared_ptr<Endpoint>>> make_lane_world(
    int n, const std::function<Result<std::vector<std::shared_ptr<Endpoint>>>(int)>& world) {
  CONVEYOR_ASSIGN_OR_RETURN(auto control, world(n));
  CONVEYOR_ASSIGN_OR_RETURN(auto lanes, world(n));
  std::vector<std::shared_ptr<Endpoint>> out;
  for (int i = 0; i < n; ++i) {
    std::map<int, std::shared_ptr<Lane>> sends, receives;
    for (int j = 0; j < n; ++j) {
      if (j == i) continue;
      sends[j] = make_endpoint_lane(lanes[i], j, /*tag=*/1);
      receives[j] = make_endpoint_lane(lanes[i], j, /*tag=*/1);
    }
    CONVEYOR_ASSIGN_OR_RETURN(auto member, make_lane_endpoint(control[i], at::kCPU, sends, receives, /*channel=*/5));
    out.push_back(member);
  }
  return out;
}
Result<std::vector<std::shared_ptr<Endpoint>>> make_inproc_world(int n) {
  return make_inproc_endpoints(std::vector<c10::Device>(static_cast<std::size_t>(n), at::kCPU));
}

std::vector<Backend> backends() {
  return {{"inproc",
           [](int n) -> Result<std::vector<std::shared_ptr<Endpoint>>> {
             return make_inproc_endpoints(std::vector<c10::Device>(static_cast<std::size_t>(n), at::kCPU));
           },
           [](Endpoint& e, Status s) { abort_inproc(e, std::move(s)); }, [](int n) { return make_inproc_group(n); },
           [](const Collective& c, Status s) { abort_inproc(c, std::move(s)); }},
          {"ucx", [](int n) { return make_ucx_world_in_process(n); },
           [](Endpoint& e, Status s) { dynamic_cast<UcxEndpoint&>(e).abort(std::move(s)); }, make_ucx_group,
           abort_ucx_group},
          {"lanes_inproc", [](int n) { return make_lane_world(n, make_inproc_world); },
           [](Endpoint& e, Status s) { dynamic_cast<LaneEndpoint&>(e).abort(std::move(s)); }, nullptr, nullptr},
          {"lanes_ucx", [](int n) { return make_lane_world(n, make_ucx_world_in_process); },
           [](Endpoint& e, Status s) { dynamic_cast<LaneEndpoint&>(e).abort(std::move(s)); }, nullptr, nullptr}};
}

// The backends with collectives (lane endpoints are point to point only).
std::vector<Backend> collective_backends() {
  std::vector<Backend> out;
  for (Backend& b : backends()) {
    if (b.group) out.push_back(std::move(b));
  }
  return out;
}

// The backend's world of n members, or the test is skipped saying why it cannot run here.
#define WORLD_OR_SKIP(var, n)                                                                        \
  auto var##_made = GetParam().endpoints(n);                                                         \
  if (!var##_made.is_ok()) GTEST_SKIP() << GetParam().name << " cannot run here: " << var##_made.status().to_string(); \
  auto var = *var##_made
// The backend's group of n members, or the test is skipped saying why it cannot run here.
#define GROUP_OR_SKIP(var, n)                                                          \
  auto var = GetParam().group(n);                                                      \
  if (var.empty()) GTEST_SKIP() << GetParam().name << " cannot make a group here (UCX cannot start)"

void PrintTo(const Backend& b, std::ostream* os) { *os << b.name; }

class Conformance : public ::testing::TestWithParam<Backend> {};
class CollectiveConformance : public ::testing::TestWithParam<Backend> {};

// Runs `body(member)` for every member on a thread of its own.
void on_threads(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back(body, i);
  for (auto& t : threads) t.join();
}

Result<std::vector<at::Tensor>> receive(Endpoint& e, int peer, Tag tag) {
  return receive_within(e, peer, tag, std::chrono::seconds(30));
}

TEST_P(Conformance, MessagesArriveWholeInOrderPerTagWhicheverSideComesFirst) {
  WORLD_OR_SKIP(eps, 3);
  ASSERT_EQ(eps.size(), 3u);
  EXPECT_EQ(eps[1]->rank(), 1);
  EXPECT_EQ(eps[1]->world_size(), 3);
  // Receive posted before the send.
  auto pending = std::async(std::launch::async, [&] { return receive(*eps[1], 0, 7); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  at::Tensor a = at::arange(6, at::kDouble).view({2, 3}), b = at::ones({4}, at::kLong);
  ASSERT_TRUE(wait_for([&](Done d) { eps[0]->send(1, 7, {a, b}, d); }).is_ok());
  auto got = pending.get();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  ASSERT_EQ(got->size(), 2u);
  EXPECT_TRUE(at::equal((*got)[0], a));
  EXPECT_TRUE(at::equal((*got)[1], b));
  // Sends before receives: per (peer, tag) in order; tags and peers do not mix.
  for (int k = 0; k < 5; ++k) {
    ASSERT_TRUE(wait_for([&](Done d) { eps[2]->send(1, 9, {at::full({1}, k, at::kFloat)}, d); }).is_ok());
    ASSERT_TRUE(wait_for([&](Done d) { eps[0]->send(1, 9, {at::full({1}, 100 + k, at::kFloat)}, d); }).is_ok());
  }
  for (int k = 0; k < 5; ++k) {
    auto from2 = receive(*eps[1], 2, 9);
    auto from0 = receive(*eps[1], 0, 9);
    ASSERT_TRUE(from2.is_ok() && from0.is_ok());
    EXPECT_EQ((*from2)[0].item<float>(), k);
    EXPECT_EQ((*from0)[0].item<float>(), 100 + k);
  }
}

// send_copied is for a caller that may write the tensors as soon as it returns (a script's
// conveyor.distributed.send has nothing to wait on). Messages of 4 KB, 4 MB (gathered from
// the caller's memory by a plain send) and 40 MB (in parts) are written again right after
// the call, before the receiver asks for them: what arrives is what was sent.
TEST_P(Conformance, SendCopiedTensorsMayBeWrittenAtOnce) {
  WORLD_OR_SKIP(eps, 2);
  const std::vector<std::int64_t> sizes{1000, 1 << 20, 10 << 20};  // floats
  std::vector<std::future<Status>> sent;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    at::Tensor t = at::full({sizes[i]}, static_cast<double>(i + 1), at::kFloat);
    auto done = std::make_shared<std::promise<Status>>();
    sent.push_back(done->get_future());
    eps[0]->send_copied(1, 11, {t, at::Tensor()}, [done](Status s) { done->set_value(std::move(s)); });
    t.fill_(-1);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    auto got = receive(*eps[1], 0, 11);
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    ASSERT_EQ(got->size(), 2u);
    EXPECT_TRUE(at::equal((*got)[0], at::full({sizes[i]}, static_cast<double>(i + 1), at::kFloat))) << "message " << i;
    EXPECT_FALSE((*got)[1].defined());
  }
  for (auto& s : sent) EXPECT_TRUE(s.get().is_ok());
}

// A UCX message is packed below kPartsFrom bytes, gathered from the caller's tensors up to
// kGatheredBelow, and from there a header and a message per tensor under one tag: several
// of each in flight under one tag still arrive whole and in order, with the receives posted
// before or after the sends.
TEST_P(Conformance, LargeMessagesSharingATagArriveWholeInOrder) {
  WORLD_OR_SKIP(eps, 2);
  auto message = [](int k) {  // 1.7 MB (gathered), and for k = 4 17 MB more (in parts)
    std::vector<at::Tensor> m{at::full({300, 1000}, k, at::kFloat), at::Tensor(), at::arange(k + 1, at::kLong),
                              at::full({70000}, -k, at::kDouble)};
    if (k == 4) m.push_back(at::full({17 << 18}, k, at::kFloat));
    return m;
  };
  auto check = [&](const Result<std::vector<at::Tensor>>& got, int k) {
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    const auto want = k % 3 == 2 ? std::vector<at::Tensor>{at::full({2}, k, at::kInt)} : message(k);
    ASSERT_EQ(got->size(), want.size()) << "message " << k;
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ((*got)[i].defined(), want[i].defined());
      if (want[i].defined()) {
        EXPECT_TRUE(at::equal((*got)[i], want[i])) << "message " << k << " tensor " << i;
      }
    }
  };
  for (bool receives_first : {true, false}) {
    std::vector<std::future<Result<std::vector<at::Tensor>>>> got;
    auto post_receives = [&] {
      for (int k = 0; k < 6; ++k) got.push_back(std::async(std::launch::async, [&eps] { return receive(*eps[1], 0, 3); }));
    };
    if (receives_first) post_receives();
    std::vector<std::future<Status>> sent;
    for (int k = 0; k < 6; ++k) {  // every third small; all in flight at once, sent in order
      auto done = std::make_shared<std::promise<Status>>();
      sent.push_back(done->get_future());
      eps[0]->send(1, 3, k % 3 == 2 ? std::vector<at::Tensor>{at::full({2}, k, at::kInt)} : message(k),
                   [done](Status s) { done->set_value(s); });
    }
    if (!receives_first) {
      // One at a time: each receive is the next message under the tag.
      for (int k = 0; k < 6; ++k) check(receive(*eps[1], 0, 3), k);
    } else {
      // Posted at once from six threads, so which receive gets which message is open: the
      // messages, sorted by their first value, are still each whole and all there.
      std::vector<Result<std::vector<at::Tensor>>> results;
      for (auto& g : got) results.push_back(g.get());
      std::vector<int> seen;
      for (auto& r : results) {
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        const int k = static_cast<int>((*r)[0].flatten()[0].item<double>());
        seen.push_back(k);
        check(r, k);
      }
      std::sort(seen.begin(), seen.end());
      EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4, 5}));
    }
    for (auto& s : sent) EXPECT_TRUE(s.get().is_ok());
  }
}

TEST_P(Conformance, ManyThreadsExchangeConcurrently) {
  const int n = 4, rounds = 50;
  WORLD_OR_SKIP(eps, n);
  std::atomic<int> bad{0};
  on_threads(n, [&](int me) {
    const int next = (me + 1) % n, prev = (me + n - 1) % n;
    for (int k = 0; k < rounds; ++k) {
      eps[me]->send(next, static_cast<Tag>(k), {at::full({8}, me * 1000 + k, at::kDouble)}, [&](Status s) {
        if (!s) ++bad;
      });
      auto got = receive(*eps[me], prev, static_cast<Tag>(k));
      if (!got.is_ok() || (*got)[0][3].item<double>() != prev * 1000 + k) ++bad;
    }
  });
  EXPECT_EQ(bad, 0);
}

TEST_P(Conformance, AddressingYourselfOrNoOneIsAnError) {
  WORLD_OR_SKIP(eps, 2);
  Status self = wait_for([&](Done d) { eps[0]->send(0, 1, {at::ones({1})}, d); });
  EXPECT_EQ(self.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(self.message().find("addressed member 0"), std::string::npos) << self.message();
  auto nobody = receive(*eps[1], 5, 1);
  EXPECT_FALSE(nobody.is_ok());
}

TEST_P(Conformance, AbortWakesEveryPendingReceiveAndFailsLaterOperations) {
  WORLD_OR_SKIP(eps, 2);
  auto pending = std::async(std::launch::async, [&] { return receive(*eps[0], 1, 3); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  GetParam().abort_endpoint(*eps[0], Status(ErrorCode::kExecution, "member 1 died"));
  auto got = pending.get();
  ASSERT_FALSE(got.is_ok());
  EXPECT_NE(got.status().message().find("member 1 died"), std::string::npos);
  Status later = wait_for([&](Done d) { eps[0]->send(1, 3, {at::ones({1})}, d); });
  EXPECT_NE(later.message().find("member 1 died"), std::string::npos);
}

// Member i contributes (i + 1) * base + i: distinct, so a wrong member order or a missing
// member shows.
at::Tensor contribution(int i, std::int64_t n, at::ScalarType dtype = at::kDouble) {
  return (at::arange(n, dtype) * (i + 1) + i).contiguous();
}

TEST_P(CollectiveConformance, CollectivesComputeTheDefinedResultOnEveryGroupSize) {
  for (int n : {1, 2, 3, 4}) {
    GROUP_OR_SKIP(group, n);
    ASSERT_EQ(static_cast<int>(group.size()), n);
    at::Tensor sum = at::zeros({6}, at::kDouble);
    for (int i = 0; i < n; ++i) sum += contribution(i, 6);
    std::atomic<int> failures{0};
    std::mutex mu;
    std::vector<std::string> errors;
    auto expect = [&](bool ok, const std::string& what) {
      if (ok) return;
      std::lock_guard<std::mutex> lock(mu);
      errors.push_back(what + " (group of " + std::to_string(n) + ")");
      ++failures;
    };
    on_threads(n, [&](int me) {
      Collective& c = *group[me];
      expect(c.rank() == me && c.size() == n, "rank/size");
      at::Tensor t = contribution(me, 6);
      expect(wait_for([&](Done d) { c.allreduce(t, d); }).is_ok() && at::equal(t, sum), "allreduce");
      at::Tensor r = contribution(me, 6);
      const int root = n - 1;
      expect(wait_for([&](Done d) { c.reduce(r, root, d); }).is_ok(), "reduce status");
      expect(me == root ? at::equal(r, sum) : at::equal(r, contribution(me, 6)), "reduce result");
      at::Tensor b = me == 0 ? at::full({3}, 42.0, at::kDouble) : at::zeros({3}, at::kDouble);
      expect(wait_for([&](Done d) { c.broadcast(b, 0, d); }).is_ok() && at::equal(b, at::full({3}, 42.0, at::kDouble)),
             "broadcast");
      at::Tensor out = at::zeros({2 * n, 3}, at::kDouble);
      at::Tensor in = at::full({2, 3}, static_cast<double>(me), at::kDouble);
      expect(wait_for([&](Done d) { c.allgather(in, out, d); }).is_ok(), "allgather status");
      for (int j = 0; j < n; ++j) expect(at::equal(out.narrow(0, 2 * j, 2), at::full({2, 3}, double(j), at::kDouble)), "allgather");
      at::Tensor rs_in = contribution(me, 2 * n), rs_out = at::zeros({2}, at::kDouble);
      at::Tensor rs_sum = at::zeros({2 * n}, at::kDouble);
      for (int j = 0; j < n; ++j) rs_sum += contribution(j, 2 * n);
      expect(wait_for([&](Done d) { c.reduce_scatter(rs_in, rs_out, d); }).is_ok() &&
                 at::equal(rs_out, rs_sum.narrow(0, 2 * me, 2)),
             "reduce_scatter");
    });
    EXPECT_EQ(failures, 0) << (errors.empty() ? "" : errors[0]);
  }
}

TEST_P(CollectiveConformance, SumsAreBitwiseDeterministicInMemberOrder) {
  // Float sums depend on order: the result equals ((x0 + x1) + x2) + x3 exactly, every run,
  // for small tensors and for large ones (which backends may reduce in parts).
  const int n = 4;
  for (std::int64_t numel : {1000, 100003}) {
    std::vector<at::Tensor> xs;
    for (int i = 0; i < n; ++i) xs.push_back(at::randn({numel}, at::kFloat) * std::pow(10.0, i));
    at::Tensor expected = xs[0].clone();
    for (int i = 1; i < n; ++i) expected.add_(xs[i]);
    for (int run = 0; run < 5; ++run) {
      GROUP_OR_SKIP(group, n);
      std::vector<at::Tensor> ts;
      for (auto& x : xs) ts.push_back(x.clone());
      on_threads(n, [&](int me) {
        std::this_thread::sleep_for(std::chrono::microseconds((n - me) * 200 * (run % 3)));  // vary arrival order
        ASSERT_TRUE(wait_for([&](Done d) { group[me]->allreduce(ts[me], d); }).is_ok());
      });
      for (int i = 0; i < n; ++i) EXPECT_TRUE(at::equal(ts[i], expected)) << numel << " run " << run << " member " << i;
    }
  }
}

TEST_P(CollectiveConformance, AllreduceWritesANonContiguousTensorInPlace) {
  // A transposed gradient: summed through a contiguous copy, written back element by element.
  const int n = 3;
  GROUP_OR_SKIP(group, n);
  std::vector<at::Tensor> ts;
  at::Tensor expected = at::zeros({300, 200}, at::kDouble);
  for (int i = 0; i < n; ++i) {
    ts.push_back(at::randn({200, 300}, at::kDouble).t());
    expected += ts.back();
  }
  on_threads(n, [&](int me) { ASSERT_TRUE(wait_for([&](Done d) { group[me]->allreduce(ts[me], d); }).is_ok()); });
  for (int i = 0; i < n; ++i) {
    EXPECT_FALSE(ts[i].is_contiguous());
    EXPECT_TRUE(at::allclose(ts[i], expected)) << "member " << i;
  }
}

TEST_P(CollectiveConformance, MismatchedCallsFailEveryMemberNamingBoth) {
  GROUP_OR_SKIP(group, 2);
  std::vector<Status> got(2, Status::ok());
  on_threads(2, [&](int me) {
    at::Tensor t = at::ones({4}, at::kFloat);
    got[me] = me == 0 ? wait_for([&](Done d) { group[0]->allreduce(t, d); })
                      : wait_for([&](Done d) { group[1]->broadcast(t, 0, d); });
  });
  for (const Status& s : got) {
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("member 0 called allreduce"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("member 1 called broadcast"), std::string::npos) << s.message();
  }
  GROUP_OR_SKIP(shapes, 2);
  on_threads(2, [&](int me) {
    at::Tensor t = at::ones({me + 1}, at::kFloat);
    got[me] = wait_for([&](Done d) { shapes[me]->allreduce(t, d); });
  });
  EXPECT_NE(got[1].message().find("different shape"), std::string::npos) << got[1].message();
}

TEST_P(CollectiveConformance, AbortCompletesAWaitingMemberWithTheError) {
  GROUP_OR_SKIP(group, 3);
  auto waiting = std::async(std::launch::async, [&] {
    at::Tensor t = at::ones({2});
    return wait_for([&](Done d) { group[0]->allreduce(t, d); });
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  GetParam().abort_group(*group[1], Status(ErrorCode::kExecution, "member 2 died"));
  Status s = waiting.get();
  EXPECT_NE(s.message().find("member 2 died"), std::string::npos) << s.message();
}

// A call left pending (its peers never came; a peer died) is dropped later on the
// transport's thread, perhaps while Python finalizes: it holds only its own handles on the
// caller's memory, never the caller's tensors, which Python may own (transport.h).
TEST_P(CollectiveConformance, APendingCallHoldsNoHandleTheCallerGaveIt) {
  const std::vector<std::pair<std::string, std::function<void(Collective&, at::Tensor, at::Tensor, Done)>>> calls = {
      {"allreduce", [](Collective& c, at::Tensor in, at::Tensor, Done d) { c.allreduce(in, std::move(d)); }},
      {"reduce", [](Collective& c, at::Tensor in, at::Tensor, Done d) { c.reduce(in, 0, std::move(d)); }},
      {"broadcast", [](Collective& c, at::Tensor in, at::Tensor, Done d) { c.broadcast(in, 1, std::move(d)); }},
      {"allgather", [](Collective& c, at::Tensor in, at::Tensor out, Done d) { c.allgather(in, out, std::move(d)); }},
      {"reduce_scatter",
       [](Collective& c, at::Tensor in, at::Tensor out, Done d) { c.reduce_scatter(in, out, std::move(d)); }},
  };
  for (const auto& [name, call] : calls) {
    GROUP_OR_SKIP(group, 2);
    // Large enough that UCX's allreduce splits it (endpoint_group.cc), small enough for inproc.
    at::Tensor in = at::ones({1 << 15}, at::kFloat);
    at::Tensor out = name == "allgather" ? at::empty({2 << 15}) : at::empty({1 << 14});
    std::promise<Status> done;
    call(*group[0], in, out, [&done](Status s) { done.set_value(std::move(s)); });
    EXPECT_EQ(in.use_count(), 1) << name << " holds the caller's input";
    EXPECT_EQ(out.use_count(), 1) << name << " holds the caller's output";
    GetParam().abort_group(*group[1], Status(ErrorCode::kExecution, "member 1 died"));
    EXPECT_FALSE(done.get_future().get().is_ok()) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Conformance, ::testing::ValuesIn(backends()),
                         [](const ::testing::TestParamInfo<Backend>& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Backends, CollectiveConformance, ::testing::ValuesIn(collective_backends()),
                         [](const ::testing::TestParamInfo<Backend>& info) { return info.param.name; });

// A wait asks `stop` about every 100 ms (the bindings: Ctrl-C): true ends it at once, as a
// timeout would, whatever the timeout left.
TEST(WaitWithin, EndsWhenAskedToStop) {
  auto world = make_inproc_endpoints({at::kCPU, at::kCPU});
  int asked = 0;
  const auto start = std::chrono::steady_clock::now();
  auto got = wait_within([&](Done d) { world[0]->recv(1, 7, [d](Result<std::vector<at::Tensor>> r) { d(r.status()); }); },
                         std::chrono::minutes(1), nullptr, [&] { return ++asked == 3; });
  EXPECT_FALSE(got.has_value());
  EXPECT_EQ(asked, 3);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // Never told to stop, it still ends at its timeout.
  got = wait_within([&](Done d) { world[0]->recv(1, 8, [d](Result<std::vector<at::Tensor>> r) { d(r.status()); }); },
                    std::chrono::milliseconds(250), nullptr, [] { return false; });
  EXPECT_FALSE(got.has_value());
  abort_inproc(*world[0], Status(ErrorCode::kExecution, "the test ends"));
}

// Inproc specifics: zero-copy on the receiver's device.
TEST(Inproc, SameDeviceMessagesShareStorage) {
  auto eps = make_inproc_endpoints({at::kCPU, at::kCPU});
  at::Tensor a = at::ones({16});
  ASSERT_TRUE(wait_for([&](Done d) { eps[0]->send(1, 1, {a}, d); }).is_ok());
  auto got = receive(*eps[1], 0, 1);
  ASSERT_TRUE(got.is_ok());
  EXPECT_EQ((*got)[0].data_ptr(), a.data_ptr());
}

// Lane endpoint specifics. On "meta" the lane carries the meta tensors and the header the
// host ones, inline: both paths, with undefined tensors between them.
TEST(LaneEndpoint, DeviceTensorsGoOverTheLaneOthersInlineWithTheHeader) {
  auto control = make_inproc_world(2);
  auto lanes = make_inproc_endpoints({at::kMeta, at::kMeta});
  ASSERT_TRUE(control.is_ok());
  std::atomic<int> lane_messages{0};
  struct CountingLane : Lane {
    std::shared_ptr<Lane> inner;
    std::atomic<int>* count;
    void send(std::vector<at::Tensor> t, Done d) override { ++*count; inner->send(std::move(t), std::move(d)); }
    void recv(std::vector<at::Tensor> t, Done d) override { inner->recv(std::move(t), std::move(d)); }
    void abort(Status e) override { inner->abort(std::move(e)); }
  };
  auto counting = std::make_shared<CountingLane>();
  counting->inner = make_endpoint_lane(lanes[0], 1, 1);
  counting->count = &lane_messages;
  auto sender = make_lane_endpoint((*control)[0], at::kMeta, {{1, counting}}, {}, 0);
  auto receiver = make_lane_endpoint((*control)[1], at::kMeta, {}, {{0, make_endpoint_lane(lanes[1], 0, 1)}}, 0);
  ASSERT_TRUE(sender.is_ok() && receiver.is_ok());
  at::Tensor host = at::arange(5, at::kLong), device = at::empty({3, 2}, at::TensorOptions().dtype(at::kHalf).device(at::kMeta));
  ASSERT_TRUE(wait_for([&](Done d) { (*sender)->send(1, 42, {host, at::Tensor(), device}, d); }).is_ok());
  ASSERT_TRUE(wait_for([&](Done d) { (*sender)->send(1, 42, {host + 1}, d); }).is_ok());  // host only: no lane transfer
  EXPECT_EQ(lane_messages, 1);
  auto got = receive(**receiver, 0, 42);
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  ASSERT_EQ(got->size(), 3u);
  EXPECT_TRUE(at::equal((*got)[0], host));
  EXPECT_FALSE((*got)[1].defined());
  EXPECT_EQ((*got)[2].device(), at::Device(at::kMeta));
  EXPECT_EQ((*got)[2].scalar_type(), at::kHalf);
  EXPECT_EQ((*got)[2].sizes(), device.sizes());
  auto second = receive(**receiver, 0, 42);
  ASSERT_TRUE(second.is_ok());
  EXPECT_TRUE(at::equal((*second)[0], host + 1));
  // Directions without a lane are refused, naming the peer.
  Status no_lane = wait_for([&](Done d) { (*receiver)->send(0, 1, {host}, d); });
  EXPECT_NE(no_lane.message().find("no lane to member 0"), std::string::npos) << no_lane.message();
}

// Receives are posted on the lane as headers arrive, whatever tag the receiver asks for
// first: a receiver that asks for the last message first still gets everything (a lane
// matched by order alone would hand it the first message's tensors, or wait forever).
TEST(LaneEndpoint, ReceivesInAnyTagOrderGetTheirOwnMessages) {
  auto eps = make_lane_world(2, make_inproc_world);
  ASSERT_TRUE(eps.is_ok());
  for (int k = 0; k < 4; ++k) {
    ASSERT_TRUE(wait_for([&](Done d) { (*eps)[0]->send(1, static_cast<Tag>(10 + k), {at::full({k + 1}, k, at::kFloat)}, d); }).is_ok());
  }
  for (int k = 3; k >= 0; --k) {
    auto got = receive(*(*eps)[1], 0, static_cast<Tag>(10 + k));
    ASSERT_TRUE(got.is_ok());
    EXPECT_TRUE(at::equal((*got)[0], at::full({k + 1}, k, at::kFloat)));
  }
}

// A header that is not one fails every receive from that peer, naming it; receives from
// other peers go on until the endpoint is aborted.
TEST(LaneEndpoint, ACorruptHeaderOrAFailedLaneFailsThatPeersReceives) {
  auto control = make_inproc_world(3), lanes = make_inproc_world(3);
  ASSERT_TRUE(control.is_ok() && lanes.is_ok());
  auto lane = [&](int me, int peer) { return make_endpoint_lane((*lanes)[me], peer, 1); };
  auto receiver = make_lane_endpoint((*control)[2], at::kCPU, {}, {{0, lane(2, 0)}, {1, lane(2, 1)}}, 9);
  auto good = make_lane_endpoint((*control)[1], at::kCPU, {{2, lane(1, 2)}}, {}, 9);
  ASSERT_TRUE(receiver.is_ok() && good.is_ok());
  auto waiting = std::async(std::launch::async, [&] { return receive(**receiver, 0, 3); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  // Member 0 sends something that is not a lane header on the control channel.
  ASSERT_TRUE(wait_for([&](Done d) { (*control)[0]->send(2, kLaneControlTagBit | 9, {at::ones({2})}, d); }).is_ok());
  auto got = waiting.get();
  ASSERT_FALSE(got.is_ok());
  EXPECT_EQ(got.status().code(), ErrorCode::kCorrupt);
  EXPECT_NE(got.status().message().find("from member 0"), std::string::npos) << got.status().message();
  EXPECT_FALSE(receive(**receiver, 0, 4).is_ok());  // later receives from member 0 fail too
  ASSERT_TRUE(wait_for([&](Done d) { (*good)->send(2, 3, {at::ones({2})}, d); }).is_ok());
  EXPECT_TRUE(receive(**receiver, 1, 3).is_ok());
  // Aborted (the process group lost a process): every receive fails with that error.
  dynamic_cast<LaneEndpoint&>(**receiver).abort(Status(ErrorCode::kExecution, "process 1 was lost"));
  auto after = receive(**receiver, 1, 3);
  ASSERT_FALSE(after.is_ok());
  EXPECT_NE(after.status().message().find("process 1 was lost"), std::string::npos);
}

// A send's `done` never runs under the endpoint's per-peer order lock, even when a part fails
// at once inside the send call: a `done` that sends to the same peer again goes through.
TEST(LaneEndpoint, ADoneThatSendsAgainToThePeerDoesNotDeadlock) {
  auto control = make_inproc_world(2);
  ASSERT_TRUE(control.is_ok());
  struct FailingLane : Lane {
    void send(std::vector<at::Tensor>, Done d) override { d(Status(ErrorCode::kExecution, "the lane is down")); }
    void recv(std::vector<at::Tensor>, Done d) override { d(Status(ErrorCode::kExecution, "the lane is down")); }
    void abort(Status) override {}
  };
  auto sender = make_lane_endpoint((*control)[0], at::kMeta, {{1, std::make_shared<FailingLane>()}}, {}, 0);
  ASSERT_TRUE(sender.is_ok());
  auto finished = std::make_shared<std::promise<std::pair<Status, Status>>>();
  std::shared_ptr<Endpoint> endpoint = *sender;
  std::thread([endpoint, finished] {
    at::Tensor device = at::empty({2}, at::TensorOptions().device(at::kMeta));
    endpoint->send(1, 1, {device}, [endpoint, finished, device](Status first) {
      endpoint->send(1, 2, {device}, [finished, first](Status second) { finished->set_value({first, second}); });
    });
  }).detach();
  auto result = finished->get_future();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(10)), std::future_status::ready) << "the second send deadlocked";
  auto [first, second] = result.get();
  EXPECT_NE(first.message().find("the lane is down"), std::string::npos) << first.message();
  EXPECT_NE(second.message().find("the lane is down"), std::string::npos) << second.message();
}

}  // namespace
}  // namespace conveyor::transport
