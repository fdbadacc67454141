// The UCX endpoint's own behaviour, beyond the conformance suite every backend passes
// (conformance_test.cc): large messages, a lost peer failing what waits on it, a peer that
// left, liveness pings and goodbyes in a large world and behind a backlog, and who runs
// a callback when callers' threads send, ask and wait for themselves (transport/ucx_progress.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <thread>

#include "transport/endpoint_group.h"
#include "transport/ucx.h"

namespace conveyor::transport {
namespace {

// Tests bind UCX to loopback only.
const int kLoopbackOnly = [] { return setenv("UCX_NET_DEVICES", "lo", /*overwrite=*/0); }();

Result<std::vector<at::Tensor>> receive(Endpoint& e, int peer, Tag tag) {
  return receive_within(e, peer, tag, std::chrono::seconds(30));
}

TEST(Ucx, LargeMessagesArriveIntact) {
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  at::Tensor big = at::randn({8 << 20}, at::kFloat);  // 32 MiB
  at::Tensor ints = at::arange(1000, at::kLong);
  auto pending = std::async(std::launch::async, [&] { return receive(*(*world)[1], 0, 5); });
  ASSERT_TRUE(wait_for([&](Done d) { (*world)[0]->send(1, 5, {big, at::Tensor(), ints}, d); }).is_ok());
  auto got = pending.get();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  ASSERT_EQ(got->size(), 3u);
  EXPECT_TRUE(at::equal((*got)[0], big));
  EXPECT_FALSE((*got)[1].defined());
  EXPECT_TRUE(at::equal((*got)[2], ints));
}

TEST(Ucx, ALostPeerFailsTheReceiveWaitingOnIt) {
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  auto members = std::move(*world);  // the only references: member 1 can go away
  // Connected both ways (as pipeline neighbours are after their first step).
  ASSERT_TRUE(wait_for([&](Done d) { members[0]->send(1, 1, {at::ones({1})}, d); }).is_ok());
  ASSERT_TRUE(receive(*members[1], 0, 1).is_ok());
  ASSERT_TRUE(wait_for([&](Done d) { members[1]->send(0, 1, {at::ones({1})}, d); }).is_ok());
  ASSERT_TRUE(receive(*members[0], 1, 1).is_ok());
  auto pending = std::async(std::launch::async, [&] { return receive(*members[0], 1, 9); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  members[1].reset();  // member 1 goes away: its endpoints close
  auto got = pending.get();
  ASSERT_FALSE(got.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(got.status().message().find("member 1 was lost"), std::string::npos) << got.status().message();
}

// In a child process: `scenario` on a world of two members, then std::exit(0), which must
// exit cleanly having said `said` on stderr (the world outlives the scenario).
void expect_exit_saying(const std::function<void(std::vector<std::shared_ptr<Endpoint>>&)>& scenario,
                        const std::string& said) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        auto world = make_ucx_world_in_process(2);
        scenario(*world);
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), said);
}

// A member whose last reference goes in a callback on its own progress thread is closed by
// a thread of its own, and the process's exit waits for that close to end. It once exited
// under it: a close that reached torch's operators after their teardown aborted the
// conformance test after every test had passed (2 runs in 12 under load). Here the close
// fails a pending receive whose callback takes 300 ms, and exit comes at once.
TEST(Ucx, ExitWaitsForAMemberClosingOnAThreadOfItsOwn) {
  if (auto probe = make_ucx_world_in_process(2); !probe.is_ok()) {
    GTEST_SKIP() << "UCX cannot run here: " << probe.status().to_string();
  }
  expect_exit_saying(
      [](std::vector<std::shared_ptr<Endpoint>>& world) {
        std::shared_ptr<Endpoint> zero = std::move(world[0]);
        auto closing = std::make_shared<std::promise<void>>();
        zero->recv(1, 2, [closing](Result<std::vector<at::Tensor>>) {  // failed by the close
          closing->set_value();
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          std::fprintf(stderr, "the close ran to its end\n");
        });
        Endpoint* member = zero.get();
        member->recv(1, 1, [last = std::move(zero)](Result<std::vector<at::Tensor>>) {});
        world[1]->send(0, 1, {at::ones({1})}, [](Status) {});
        closing->get_future().wait();
      },
      "the close ran to its end");
}

// A member that only its own pending receive holds (a cycle, as a group's pending operation
// makes) is closed at exit all the same, before torch's operators are torn down: its receive
// fails then. It once ran on through exit, its progress thread among torch's teardown.
TEST(Ucx, ExitClosesAMemberThatOnlyItsOwnPendingReceiveHolds) {
  if (auto probe = make_ucx_world_in_process(2); !probe.is_ok()) {
    GTEST_SKIP() << "UCX cannot run here: " << probe.status().to_string();
  }
  expect_exit_saying(
      [](std::vector<std::shared_ptr<Endpoint>>& world) {
        std::shared_ptr<Endpoint> zero = std::move(world[0]);
        Endpoint* member = zero.get();
        member->recv(1, 5, [self = std::move(zero)](Result<std::vector<at::Tensor>> r) {
          std::fprintf(stderr, "failed at exit: %s\n", r.status().message().c_str());
        });
      },
      "failed at exit: the UCX endpoint was closed");
}

// A member that leaves (its script ended) sends nothing more but the job group's
// collectives: what it sent before stays receivable, a receive of anything else fails at
// once naming it, a collective's message of the job group still arrives.
TEST(Ucx, AMemberThatLeftDeliversWhatItSentAndCollectivesAndFailsOtherReceives) {
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  auto leaver = std::dynamic_pointer_cast<UcxEndpoint>((*world)[1]);
  ASSERT_NE(leaver, nullptr);
  Endpoint& stays = *(*world)[0];
  ASSERT_TRUE(wait_for([&](Done d) { leaver->send(0, 3, {at::full({2}, 3.0)}, d); }).is_ok());
  auto waiting = std::async(std::launch::async, [&] { return receive(stays, 1, 9); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  leaver->leave();
  const Tag collective = kCollectiveTagBit | 4;
  ASSERT_TRUE(wait_for([&](Done d) { leaver->send(0, collective, {at::full({1}, 4.0)}, d); }).is_ok());
  auto never = waiting.get();
  ASSERT_FALSE(never.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(never.status().message().find("member 1 sent nothing for this before it left the job"), std::string::npos)
      << never.status().message();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // past the grace after its word
  auto before = receive(stays, 1, 3);
  ASSERT_TRUE(before.is_ok()) << before.status().to_string();
  EXPECT_TRUE(at::equal((*before)[0], at::full({2}, 3.0)));
  auto last = receive(stays, 1, collective);
  ASSERT_TRUE(last.is_ok()) << last.status().to_string();
  EXPECT_TRUE(at::equal((*last)[0], at::full({1}, 4.0)));
  auto after = receive(stays, 1, 10);
  EXPECT_FALSE(after.is_ok());
  // A subgroup's collective (a stage's gradient sum) is not the job's last exchange: a member
  // that left calls none, and the one waiting for it hears so at once.
  auto subgroup = receive(stays, 1, kCollectiveTagBit | collective_group_bits(5) | 7);
  ASSERT_FALSE(subgroup.is_ok());
  EXPECT_NE(subgroup.status().message().find("member 1 sent nothing for this before it left the job"), std::string::npos)
      << subgroup.status().message();
}

// Pings and goodbyes are probed under each peer's exact tag (ucx_receive.cc, answer_pings):
// in a world larger than probed every round, every member still answers, though its rounds
// skip them, since it probes before it sleeps; and one whose peer closed fails what waits
// on that peer at once, not at a timeout.
TEST(Ucx, EveryMemberOfALargeWorldAnswersPingsAndHearsGoodbyes) {
  constexpr int kMembers = 18;  // above kPeersProbedEveryRound
  auto world = make_ucx_world_in_process(kMembers);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  auto members = std::move(*world);
  auto& first = dynamic_cast<UcxEndpoint&>(*members[0]);
  // Member 0 pings every other: each answers from its progress thread.
  EXPECT_TRUE(first.silent_peers(std::chrono::seconds(5)).empty());
  // Connected both ways, then the last member closes: member 0's receive from it fails
  // promptly (its goodbye heard), naming it.
  const int last = kMembers - 1;
  ASSERT_TRUE(wait_for([&](Done d) { members[last]->send(0, 1, {at::ones({1})}, d); }).is_ok());
  ASSERT_TRUE(receive(*members[0], last, 1).is_ok());
  auto pending = std::async(std::launch::async, [&] { return receive(*members[0], last, 2); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto start = std::chrono::steady_clock::now();
  members[last].reset();
  auto got = pending.get();
  ASSERT_FALSE(got.is_ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_NE(got.status().message().find("member 17 was lost"), std::string::npos) << got.status().message();
}

// Many large messages wait unreceived (a stream sent ahead of its receives) while pings
// come in: each is still answered.
TEST(Ucx, PingsAreAnsweredBehindABacklogOfUnreceivedMessages) {
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  at::Tensor part = at::ones({256 << 10}, at::kFloat);  // 1 MiB
  for (Tag tag = 100; tag < 300; ++tag) (*world)[0]->send(1, tag, {part}, [](Status) {});
  auto& second = dynamic_cast<UcxEndpoint&>(*(*world)[1]);
  EXPECT_TRUE(second.silent_peers(std::chrono::seconds(5)).empty());
  for (Tag tag = 100; tag < 300; ++tag) ASSERT_TRUE(receive(*(*world)[1], 0, tag).is_ok());
}

// A caller's thread sends small messages itself and a waiter runs the transport's rounds
// itself (ucx_progress.h): a done that sends again runs once the caller let go of the worker,
// and a waiter never runs another thread's callback, though it meets its message.
TEST(Ucx, CallbacksRunOnTheirIssuerOrTheProgressThreadNeverOnAnotherWaiter) {
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  Endpoint& sender = *(*world)[0];
  Endpoint& receiver = *(*world)[1];
  const at::Tensor small = at::arange(4, at::kLong);
  for (int k = 0; k < 200; ++k) {
    const Tag theirs = 2 * k + 10, mine = 2 * k + 11;
    // Another thread's receive, pending while this thread waits for its own.
    std::promise<std::thread::id> ran_on;
    std::thread([&] {
      receiver.recv(0, theirs, [&](Result<std::vector<at::Tensor>> r) {
        EXPECT_TRUE(r.is_ok());
        ran_on.set_value(std::this_thread::get_id());
      });
    }).join();
    // Both messages come while this thread waits: a done that sends again, once the first went.
    std::thread sending([&] {
      std::this_thread::sleep_for(std::chrono::microseconds(k % 20));
      EXPECT_TRUE(wait_for([&](Done d) {
                    sender.send(1, theirs, {small}, [&, d](Status s) {
                      EXPECT_TRUE(s.is_ok());
                      sender.send(1, mine, {small}, d);
                    });
                  }).is_ok());
    });
    auto got = receive_within(receiver, 0, mine, std::chrono::seconds(10));
    sending.join();
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    EXPECT_TRUE(at::equal((*got)[0], small));
    auto other = ran_on.get_future();
    ASSERT_EQ(other.wait_for(std::chrono::seconds(10)), std::future_status::ready);
    EXPECT_NE(other.get(), std::this_thread::get_id()) << "round " << k << ": a waiter ran another thread's callback";
  }
}

// A receive asked for after its message came in, while the receiver's progress thread
// sleeps (idle, its worker armed): the message raises no event any more, so asking wakes it.
TEST(Ucx, AReceiveAskedForAfterItsMessageCameInCompletesPromptly) {
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  Endpoint& receiver = *(*world)[1];
  for (int k = 0; k < 3; ++k) {
    ASSERT_TRUE(wait_for([&](Done d) { (*world)[0]->send(1, 40 + k, {at::ones({3})}, d); }).is_ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both progress threads asleep by now
    std::promise<void> arrived;
    const auto start = std::chrono::steady_clock::now();
    receiver.recv(0, 40 + k, [&](Result<std::vector<at::Tensor>> r) {
      EXPECT_TRUE(r.is_ok());
      arrived.set_value();
    });
    ASSERT_EQ(arrived.get_future().wait_for(std::chrono::seconds(5)), std::future_status::ready);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(300))
        << "the receive waited for the sleeping progress thread's timeout";
  }
}

// A member that calls an allreduce early waits there for the last one: the group tells that
// wait apart from the time the sum took (allreduce_timed), so a late member's compute is not
// booked as the link's; in two phases (large) and in one exchange (small) alike.
TEST(Ucx, AnAllreduceTellsTheEarlyMembersWaitForTheLastFromMovingAndSumming) {
  auto world = make_ucx_world_in_process(2);
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  std::vector<std::shared_ptr<EndpointGroup>> group;
  for (int i = 0; i < 2; ++i) {
    auto member = make_endpoint_group((*world)[i], {0, 1}, /*group_id=*/5);
    ASSERT_TRUE(member.is_ok()) << member.status().to_string();
    group.push_back(*member);
  }
  constexpr auto kLate = std::chrono::milliseconds(400);
  for (const std::int64_t elements : {std::int64_t{1} << 20, std::int64_t{16}}) {  // two phases; one exchange
    std::vector<at::Tensor> t{at::full({elements}, 1.0), at::full({elements}, 2.0)};
    std::vector<std::promise<std::pair<Status, double>>> done(2);
    auto call = [&](int i) {
      group[i]->allreduce_timed(t[i], [&done, i](Status s, double waited_s) { done[i].set_value({s, waited_s}); });
    };
    call(0);
    std::this_thread::sleep_for(kLate);
    call(1);
    std::vector<std::pair<Status, double>> got;
    for (auto& d : done) {
      auto f = d.get_future();
      ASSERT_EQ(f.wait_for(std::chrono::seconds(30)), std::future_status::ready);
      got.push_back(f.get());
    }
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(got[i].first.is_ok()) << got[i].first.to_string();
      EXPECT_TRUE(at::equal(t[i], at::full({elements}, 3.0)));
    }
    // Member 0 waited for member 1 most of the time member 1 came later; member 1, for nobody.
    EXPECT_EQ(got[1].second, 0.0);
    EXPECT_GT(got[0].second, std::chrono::duration<double>(kLate).count() / 2) << got[0].second;
  }
}

}  // namespace
}  // namespace conveyor::transport
