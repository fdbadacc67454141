// The UCX member's owners that need no UCX (transport/ucx_sends.h, transport/ucx_liveness.h):
// every send finishes exactly once, whether UCX completes it or its peer's loss fails it
// first; and the errors that name a peer say what the peer said.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "transport/ucx_liveness.h"
#include "transport/ucx_sends.h"

namespace conveyor::transport {
namespace {

// Runs what finishes each send, as the member does, with `s`.
void finish(std::vector<UcxSendsInFlight::Finish> sends, const Status& s) {
  for (auto& send : sends) send.done(s);
}

TEST(UcxSendsInFlight, ASendFailedByItsPeersLossFinishesOnceThoughUcxCompletesItLater) {
  UcxSendsInFlight sends;
  int finished = 0;
  std::string error;
  const std::uint64_t to_lost = sends.posted(1, std::this_thread::get_id(), [&](Status s) {
    ++finished;
    error = s.message();
  });
  const std::uint64_t to_alive = sends.posted(2, std::this_thread::get_id(), [&](Status) { ++finished; });
  EXPECT_EQ(sends.count_posted(), 2);
  finish(sends.fail(1), Status(ErrorCode::kExecution, "process 1 was lost"));
  EXPECT_EQ(finished, 1);
  EXPECT_EQ(error, "process 1 was lost");
  EXPECT_EQ(sends.count_posted(), 1);  // the failed send no longer counts as in flight
  EXPECT_FALSE(sends.completed(to_lost).has_value());  // UCX's late completion finishes nothing
  finish(sends.fail(1), Status(ErrorCode::kExecution, "again"));
  EXPECT_EQ(finished, 1);
  auto alive = sends.completed(to_alive);
  ASSERT_TRUE(alive.has_value());
  alive->done(Status::ok());
  EXPECT_EQ(finished, 2);
  EXPECT_EQ(sends.count_posted(), 0);
  EXPECT_FALSE(sends.completed(to_alive).has_value());
}

TEST(UcxSendsInFlight, ClosingFailsEverySendStillPosted) {
  UcxSendsInFlight sends;
  int failed = 0;
  for (int peer = 0; peer < 3; ++peer) {
    sends.posted(peer, std::this_thread::get_id(), [&](Status s) { failed += s.is_ok() ? 0 : 1; });
  }
  finish(sends.fail(-1), Status(ErrorCode::kExecution, "the UCX endpoint was closed"));
  EXPECT_EQ(failed, 3);
  EXPECT_EQ(sends.count_posted(), 0);
}

TEST(UcxPeerLiveness, ALostPeerIsNamedWithWhyItGaveUpWhenItsGoodbyeSaid) {
  UcxPeerLiveness peers(3, "process");
  EXPECT_EQ(peers.lost(1, "(its process exited)"), "process 1 was lost (its process exited)");
  peers.heard(2, UcxPeerLiveness::Word::kGoodbye, "process 2 failed: ValueError: bad");
  EXPECT_EQ(peers.lost(2), "process 2 gave up the job: process 2 failed: ValueError: bad");
  EXPECT_EQ(peers.lost(1), "process 1 was lost");
}

TEST(UcxPeerLiveness, NothingComesFromAPeerThatLeftOnceItsGraceHasPassedButItsCollectives) {
  UcxPeerLiveness peers(2, "process");
  EXPECT_EQ(peers.why_nothing_comes(1, /*collective=*/false), "");
  peers.heard(1, UcxPeerLiveness::Word::kLeaving);
  EXPECT_EQ(peers.why_nothing_comes(1, /*collective=*/false), "");  // what it sent just before may still come
  std::this_thread::sleep_for(UcxPeerLiveness::kGrace + std::chrono::milliseconds(50));
  EXPECT_NE(peers.why_nothing_comes(1, /*collective=*/false).find("process 1 sent nothing for this before it left"),
            std::string::npos);
  EXPECT_EQ(peers.why_nothing_comes(1, /*collective=*/true), "");
  EXPECT_EQ(peers.why_nothing_comes(0, /*collective=*/false), "");
  peers.heard(0, UcxPeerLiveness::Word::kGoodbye);
  std::this_thread::sleep_for(UcxPeerLiveness::kGrace + std::chrono::milliseconds(50));
  EXPECT_EQ(peers.why_nothing_comes(0, /*collective=*/true), "process 0 was lost (it closed its endpoint)");
}

TEST(UcxPeerLiveness, AMemberLeavesAndSaysGoodbyeOnce) {
  UcxPeerLiveness peers(2, "member");
  EXPECT_TRUE(peers.leaving());
  EXPECT_FALSE(peers.leaving());
  EXPECT_TRUE(peers.saying_goodbye());
  EXPECT_FALSE(peers.saying_goodbye());
}

}  // namespace
}  // namespace conveyor::transport
