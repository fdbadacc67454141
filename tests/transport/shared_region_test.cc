// The shared region large host messages cross a host in (transport/shared_region.h): its
// allocator's window per peer and reuse of released space, a receiver's view and its
// release, notices, bounds; and through the UCX endpoint, messages over the region, past
// its window, strided, kept after the endpoints are gone, and with the region turned off.
#include "transport/shared_region.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <future>
#include <string>

#include "transport/message_buffer.h"
#include "transport/ucx.h"

namespace conveyor::transport {
namespace {

const int kLoopbackOnly = [] { return setenv("UCX_NET_DEVICES", "lo", /*overwrite=*/0); }();
constexpr std::size_t kMB = std::size_t{1} << 20;
// Messages of 1 MB a sender's window holds (each slot takes a header's 4 KB more).
constexpr std::size_t kHeld = OutboundRegion::kWindowBytes / (kMB + 4096);

// Whether `p` lies in a mapping of a UCX member's message region in this process.
bool in_message_region(const void* p) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto at = reinterpret_cast<std::uintptr_t>(p);
  while (std::getline(maps, line)) {
    if (line.find("conveyor-ucx-messages") == std::string::npos) continue;
    const std::size_t dash = line.find('-'), space = line.find(' ');
    const auto lo = std::stoull(line.substr(0, dash), nullptr, 16), hi = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
    if (lo <= at && at < hi) return true;
  }
  return false;
}

TEST(SharedRegion, APeersShareIsItsWindowAndReleasedSpaceIsReusedFromTheLowestOffset) {
  constexpr std::size_t kWindow = OutboundRegion::kWindowBytes;
  auto region = OutboundRegion::create(4 * kWindow);  // pages are taken only as written
  ASSERT_TRUE(region.is_ok()) << region.status().to_string();
  auto reader = InboundRegion::open(getpid(), (*region)->name());
  ASSERT_TRUE(reader.is_ok()) << reader.status().to_string();

  // Peer 1 gets 1 MB slots until its window is full; peer 2 still gets space.
  std::vector<RegionSlot> slots;
  while (auto slot = (*region)->allocate(1, kMB)) slots.push_back(*slot);
  EXPECT_EQ(slots.size(), kWindow / (kMB + 4096));
  for (std::size_t k = 1; k < slots.size(); ++k) EXPECT_GE(slots[k].offset, slots[k - 1].offset + kMB);
  auto other = (*region)->allocate(2, kMB);
  ASSERT_TRUE(other.has_value());

  // Released space (the last tensor over a message dies) goes back: the lowest first.
  std::memset(slots[0].data, 7, kMB);
  {
    auto message = (*reader)->message(slots[0].offset, kMB, *reader);
    ASSERT_TRUE(message.is_ok()) << message.status().to_string();
    EXPECT_EQ(message->data_ptr<std::uint8_t>()[kMB - 1], 7);  // the sender's bytes, not a copy
    at::Tensor view = message->slice(0, 10, 20);
    *message = at::Tensor();
    EXPECT_FALSE((*region)->allocate(1, kMB).has_value());  // a view still holds it
  }
  auto again = (*region)->allocate(1, kMB);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->offset, slots[0].offset);

  // One message may take more than the window when nothing else of the peer's is held, and
  // none larger than the region fits.
  EXPECT_TRUE((*region)->allocate(3, kWindow + kWindow / 2).has_value());
  EXPECT_FALSE((*region)->allocate(4, 4 * kWindow + kMB).has_value());
}

TEST(SharedRegion, NoticesAreReadBackAndNothingElseReadsAsOne) {
  const at::Tensor notice = region_notice(4096 + 64, 12345);
  auto read = read_region_notice(notice);
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(read->offset, 4096u + 64);
  EXPECT_EQ(read->length, 12345u);
  EXPECT_FALSE(read_message(notice).is_ok());  // an older reader refuses it, never misreads it
  const OutgoingMessage packed = frame_message({at::arange(3, at::kLong)});
  EXPECT_FALSE(read_region_notice(packed.header).has_value());
}

TEST(SharedRegion, ANoticeOutsideTheRegionIsRefused) {
  auto region = OutboundRegion::create(8 * kMB);
  ASSERT_TRUE(region.is_ok());
  auto reader = InboundRegion::open(getpid(), (*region)->name());
  ASSERT_TRUE(reader.is_ok());
  for (auto [offset, length] : {std::pair<std::uint64_t, std::uint64_t>{64, 8 * kMB}, {8 * kMB + 64, 1}, {100, 1}, {0, 1}}) {
    auto message = (*reader)->message(offset, length, *reader);
    ASSERT_FALSE(message.is_ok()) << offset << " " << length;
    EXPECT_EQ(message.status().code(), ErrorCode::kCorrupt);
  }
}

TEST(SharedRegion, ARegionThatCannotBeOpenedSaysWhich) {
  auto reader = InboundRegion::open(getpid(), RegionName{987654, kMB});
  ASSERT_FALSE(reader.is_ok());
  EXPECT_NE(reader.status().to_string().find("/proc/"), std::string::npos) << reader.status().to_string();
}

Result<std::vector<at::Tensor>> receive(Endpoint& e, int peer, Tag tag) {
  return receive_within(e, peer, tag, std::chrono::seconds(30));
}

TEST(SharedRegion, LargeMessagesCrossOverItPastItsWindowThroughUcxAndOutliveTheEndpoints) {
  std::vector<std::vector<at::Tensor>> kept;
  std::vector<at::Tensor> sent;
  {
    auto world = make_ucx_world_in_process(2);
    if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
    // More messages of 1 MB than the sender's window holds, which the receiver keeps, then a
    // strided one and a mixed one: each arrives equal.
    for (std::size_t k = 0; k < kHeld + 8; ++k) {
      sent.push_back(at::full({1 << 18}, static_cast<float>(k), at::kFloat));
    }
    sent.push_back(at::arange(1 << 18, at::kDouble).reshape({512, 512}).t());
    // Sent before any is received (those through UCX complete only then).
    std::vector<std::future<Status>> sends;
    auto send = [&](std::vector<at::Tensor> tensors) {
      auto done = std::make_shared<std::promise<Status>>();
      sends.push_back(done->get_future());
      (*world)[0]->send(1, 7, std::move(tensors), [done](Status s) { done->set_value(s); });
    };
    for (const at::Tensor& t : sent) send({t});
    send({at::ones({3}, at::kInt), at::Tensor(), at::zeros({1 << 16}, at::kHalf)});
    for (std::size_t k = 0; k <= sent.size(); ++k) {
      auto got = receive(*(*world)[1], 0, 7);
      ASSERT_TRUE(got.is_ok()) << got.status().to_string();
      kept.push_back(std::move(*got));
    }
    for (auto& s : sends) {
      ASSERT_EQ(s.wait_for(std::chrono::seconds(30)), std::future_status::ready);
      EXPECT_TRUE(s.get().is_ok());
    }
  }  // the endpoints are gone: what was received over the region stays readable
  int over_region = 0;
  for (std::size_t k = 0; k < sent.size(); ++k) {
    ASSERT_EQ(kept[k].size(), 1u);
    EXPECT_TRUE(at::equal(kept[k][0], sent[k])) << k;
    over_region += in_message_region(kept[k][0].data_ptr()) ? 1 : 0;
  }
  EXPECT_EQ(over_region, static_cast<int>(kHeld));
  ASSERT_EQ(kept.back().size(), 3u);
  EXPECT_TRUE(at::equal(kept.back()[0], at::ones({3}, at::kInt)));
  EXPECT_FALSE(kept.back()[1].defined());
  EXPECT_TRUE(at::equal(kept.back()[2], at::zeros({1 << 16}, at::kHalf)));
  EXPECT_TRUE(in_message_region(kept.back()[2].data_ptr()));
}

TEST(SharedRegion, TurnedOffEveryMessageGoesThroughUcx) {
  setenv("CONVEYOR_UCX_REGION_MB", "0", 1);
  auto world = make_ucx_world_in_process(2);
  unsetenv("CONVEYOR_UCX_REGION_MB");
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  at::Tensor big = at::randn({1 << 20}, at::kFloat);
  auto pending = std::async(std::launch::async, [&] { return receive(*(*world)[1], 0, 3); });
  ASSERT_TRUE(wait_for([&](Done d) { (*world)[0]->send(1, 3, {big}, d); }).is_ok());
  auto got = pending.get();
  ASSERT_TRUE(got.is_ok()) << got.status().to_string();
  EXPECT_TRUE(at::equal((*got)[0], big));
  EXPECT_FALSE(in_message_region((*got)[0].data_ptr()));
}

// With the region off, a plain send of 4 and 40 MB is read from the caller's memory when the
// receiver asks (the caller must not write it until done); send_copied copies it first, so
// a caller that writes it at once still delivers what it sent.
TEST(SharedRegion, TurnedOffSendCopiedStillDeliversWhatWasSent) {
  setenv("CONVEYOR_UCX_REGION_MB", "0", 1);
  auto world = make_ucx_world_in_process(2);
  unsetenv("CONVEYOR_UCX_REGION_MB");
  if (!world.is_ok()) GTEST_SKIP() << "UCX cannot run here: " << world.status().to_string();
  for (std::int64_t n : {std::int64_t{1} << 20, std::int64_t{10} << 20}) {
    at::Tensor t = at::full({n}, 7.0, at::kFloat);
    auto done = std::make_shared<std::promise<Status>>();
    auto sent = done->get_future();
    (*world)[0]->send_copied(1, 4, {t}, [done](Status s) { done->set_value(std::move(s)); });
    t.fill_(-1);
    auto got = receive(*(*world)[1], 0, 4);
    ASSERT_TRUE(got.is_ok()) << got.status().to_string();
    EXPECT_TRUE(at::equal((*got)[0], at::full({n}, 7.0, at::kFloat))) << n << " floats";
    EXPECT_TRUE(sent.get().is_ok());
  }
}

}  // namespace
}  // namespace conveyor::transport
