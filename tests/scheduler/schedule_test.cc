#include "scheduler/schedule.h"

#include <gtest/gtest.h>

#include <set>

namespace conveyor::scheduler {
namespace {

Schedule make(ScheduleKind kind, int p, int m) {
  auto s = make_schedule({kind, p, m});
  EXPECT_TRUE(s.is_ok()) << s.status().to_string();
  return std::move(s).value();
}

TEST(Schedule, OneFOneBOrderIsWarmupSteadyCooldown) {
  Schedule s = make(ScheduleKind::kOneFOneB, 2, 3);
  EXPECT_EQ(s.to_text(),
            "rank 0: F0 sendA0>1 F1 sendA1>1 recvG0<1 B0 F2 sendA2>1 recvG1<1 B1 recvG2<1 B2 allreduce0 step\n"
            "rank 1: recvA0<0 F0 B0 sendG0>0 recvA1<0 F1 B1 sendG1>0 recvA2<0 F2 B2 sendG2>0 allreduce1 step\n");
}

TEST(Schedule, GPipeRunsAllForwardsThenAllBackwards) {
  Schedule s = make(ScheduleKind::kGPipe, 2, 2);
  EXPECT_EQ(s.to_text(),
            "rank 0: F0 sendA0>1 F1 sendA1>1 recvG0<1 B0 recvG1<1 B1 allreduce0 step\n"
            "rank 1: recvA0<0 F0 recvA1<0 F1 B0 sendG0>0 B1 sendG1>0 allreduce1 step\n");
}

TEST(Schedule, EverySizeIsValid) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1}) {
    for (int p = 1; p <= 8; ++p) {
      for (int m = 1; m <= 12; ++m) {
        auto s = make_schedule({kind, p, m});
        ASSERT_TRUE(s.is_ok()) << schedule_kind_name(kind) << " p=" << p << " m=" << m << ": "
                               << s.status().message();
      }
    }
  }
}

// Activations alive on a rank: forwards done whose (input-gradient) backward has not run
// yet. A deferred W keeps only what the weight gradient needs (layer inputs, output grads).
int peak_in_flight(const ActionList& list) {
  int live = 0, peak = 0;
  for (const auto& a : list) {
    if (a.kind == ActionKind::kForward) peak = std::max(peak, ++live);
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput) --live;
  }
  return peak;
}

TEST(Schedule, OneFOneBBoundsActivationMemoryGPipeDoesNot) {
  const int p = 4, m = 8;
  Schedule ofob = make(ScheduleKind::kOneFOneB, p, m);
  Schedule gpipe = make(ScheduleKind::kGPipe, p, m);
  Schedule zb = make(ScheduleKind::kZeroBubbleH1, p, m);
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(peak_in_flight(ofob.ranks[r]), std::min(p - r, m)) << "rank " << r;
    EXPECT_LE(peak_in_flight(zb.ranks[r]), std::min(p - r, m)) << "rank " << r;  // ZB-H1 keeps 1F1B's memory
    EXPECT_EQ(peak_in_flight(gpipe.ranks[r]), m) << "rank " << r;
  }
}

TEST(Schedule, ForwardOnlyStreamsEveryStageInOrderAndNothingElse) {
  ScheduleSpec spec{ScheduleKind::kOneFOneB, 2, 2};
  spec.forward_only = true;
  auto s = make_schedule(spec);
  ASSERT_TRUE(s.is_ok()) << s.status().to_string();
  EXPECT_EQ(s->to_text(),
            "rank 0: F0 sendA0>1 F1 sendA1>1\n"
            "rank 1: recvA0<0 F0 recvA1<0 F1\n");
  // Chunked: a rank's earlier stage for every microbatch first, so no receive waits on a
  // send its own rank has yet to reach; every shape and size validates.
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::kZeroBubbleH1, ScheduleKind::kInterleaved,
                    ScheduleKind::kZeroBubbleV, ScheduleKind::kDualPipeV}) {
    for (int p = 1; p <= 4; ++p) {
      for (int m : {2 * p, 4 * p}) {
        ScheduleSpec f{kind, p, m, is_chunked(kind) ? 2 : 1};
        f.forward_only = true;
        auto made = make_schedule(f);
        ASSERT_TRUE(made.is_ok()) << schedule_kind_name(kind) << " p=" << p << " m=" << m << ": "
                                  << made.status().message();
        for (const ActionList& list : made->ranks) {
          for (const Action& a : list) {
            EXPECT_TRUE(a.kind == ActionKind::kForward || a.kind == ActionKind::kSendActivation ||
                        a.kind == ActionKind::kRecvActivation)
                << action_text(a);
          }
        }
      }
    }
  }
  // A backward in a forward-only schedule is refused.
  Schedule t = std::move(s).value();
  t.ranks[1].push_back({ActionKind::kBackward, 0, -1, 1});
  EXPECT_NE(validate_schedule(t).message().find("backward 1 times (expected once and never)"), std::string::npos)
      << validate_schedule(t).message();
}

TEST(ValidateSchedule, FindsDeadlocks) {
  Schedule s = make(ScheduleKind::kOneFOneB, 2, 2);
  // Rank 0 waits for a gradient before sending the activation rank 1 needs first.
  std::swap(s.ranks[0][1], s.ranks[0][4]);  // sendA0>1 <-> recvG0<1
  Status st = validate_schedule(s);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("deadlock"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("rank 0 at recvG0<1"), std::string::npos) << st.message();
}

TEST(ValidateSchedule, FindsUnmatchedSendsAndMissingWork) {
  Schedule s = make(ScheduleKind::kGPipe, 2, 1);
  s.ranks[1].erase(s.ranks[1].begin());  // drop recvA0<0
  EXPECT_NE(validate_schedule(s).message().find("never receives"), std::string::npos);

  Schedule t = make(ScheduleKind::kGPipe, 1, 2);
  t.ranks[0].erase(t.ranks[0].end() - 3);  // drop B1 (before allreduce0 step)
  EXPECT_NE(validate_schedule(t).message().find("backward 0 times"), std::string::npos);
}

TEST(Schedule, InterleavedHoldsSeveralStagesPerRank) {
  for (int p = 1; p <= 6; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = p; m <= 4 * p; m += p) {
        auto s = make_schedule({ScheduleKind::kInterleaved, p, m, v});
        ASSERT_TRUE(s.is_ok()) << "p=" << p << " v=" << v << " m=" << m << ": " << s.status().message();
      }
    }
  }
  Schedule s = make(ScheduleKind::kInterleaved, 2, 2);
  auto t = make_schedule({ScheduleKind::kInterleaved, 2, 2, 2});
  ASSERT_TRUE(t.is_ok());
  // Rank 0 holds stages 0 and 2; the activation of stage 1 (rank 1) comes back to rank 0.
  EXPECT_NE(t->to_text().find("recvA0@s2<1"), std::string::npos) << t->to_text();
  EXPECT_NE(t->to_text().find("allreduce2 allreduce0 step"), std::string::npos) << t->to_text();
  auto odd = make_schedule({ScheduleKind::kInterleaved, 4, 6, 2});
  ASSERT_FALSE(odd.is_ok());
  EXPECT_NE(odd.status().message().find("multiple of the rank count"), std::string::npos);
  EXPECT_FALSE(make_schedule({ScheduleKind::kOneFOneB, 2, 2, 2}).is_ok());
}

TEST(Schedule, ZeroBubbleVRunsDownTheRanksAndBackUp) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      auto s = make_schedule({ScheduleKind::kZeroBubbleV, p, m, 2});
      ASSERT_TRUE(s.is_ok()) << "p=" << p << " m=" << m << ": " << s.status().message();
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(s->spec.stages_of_rank(r), (std::vector<int>{r, 2 * p - 1 - r}));
        // Activations alive (from F until the input-gradient pass) never exceed 1F1B's first
        // rank: 2p stage-microbatches of half a rank's model each, p whole ones.
        EXPECT_LE(peak_in_flight(s->ranks[r]), std::min(2 * p, 2 * m)) << "p=" << p << " m=" << m << " rank " << r;
      }
    }
  }
  // Rank 0 holds the first and the last stage; the turn (stage 1 to 2) stays on rank 1.
  Schedule s = make_schedule({ScheduleKind::kZeroBubbleV, 2, 4, 2}).value();
  const std::string text = s.to_text();
  EXPECT_NE(text.find("rank 0: F0@s0 sendA0@s0>1"), std::string::npos) << text;
  EXPECT_NE(text.find("recvA0@s3<1 F0@s3 Bi0@s3"), std::string::npos) << text;
  EXPECT_NE(text.find("F0@s1 sendA0@s1>1 recvA0@s2<1 F0@s2"), std::string::npos) << text;
  EXPECT_NE(text.find("allreduce3 allreduce0 step"), std::string::npos) << text;  // stage 3's W ends first
  auto three = make_schedule({ScheduleKind::kZeroBubbleV, 2, 4, 3});
  ASSERT_FALSE(three.is_ok());
  EXPECT_NE(three.status().message().find("exactly two stages"), std::string::npos);
  EXPECT_EQ(schedule_kind_from_name("zb-v").value(), ScheduleKind::kZeroBubbleV);
}

// The compute actions of a list, in order ("F0@s0 Bi0@s3 W0@s3 ...").
std::string compute_order(const ActionList& list) {
  std::string out;
  for (const auto& a : list) {
    if (a.is_compute()) out += (out.empty() ? "" : " ") + action_text(a, /*with_stage=*/true);
  }
  return out;
}

TEST(Schedule, DualPipeVOrdersComputeAsTorchPipeliningDoes) {
  // torch.distributed.pipelining's ScheduleDualPipeV (2.11) for 3 ranks and 7 microbatches,
  // its overlapped F+B pairs written as the forward then the backward.
  const std::vector<std::string> torch_order = {
      "F0@s0 F1@s0 F2@s0 F3@s0 F4@s0 F0@s5 Bi0@s5 W0@s5 F1@s5 Bi1@s5 W1@s5 F2@s5 F5@s0 B2@s5 F3@s5 B0@s0 F6@s0 "
      "B3@s5 F4@s5 B1@s0 B4@s5 F5@s5 B2@s0 B5@s5 F6@s5 B3@s0 B6@s5 Bi4@s0 W4@s0 Bi5@s0 W5@s0 Bi6@s0 W6@s0",
      "F0@s1 F1@s1 F2@s1 F0@s4 F3@s1 F1@s4 Bi0@s4 W0@s4 F2@s4 F4@s1 B1@s4 F3@s4 B0@s1 F5@s1 B2@s4 F4@s4 B1@s1 "
      "F6@s1 B3@s4 F5@s4 B2@s1 B4@s4 F6@s4 B3@s1 B5@s4 B4@s1 Bi6@s4 Bi5@s1 W6@s4 Bi6@s1 W5@s1 W6@s1",
      "F0@s2 F0@s3 F1@s2 F1@s3 F2@s2 F2@s3 F3@s2 B0@s3 F3@s3 B0@s2 F4@s2 B1@s3 F4@s3 B1@s2 F5@s2 B2@s3 F5@s3 "
      "B2@s2 F6@s2 B3@s3 F6@s3 B3@s2 B4@s3 B4@s2 B5@s3 Bi5@s2 Bi6@s3 Bi6@s2 W5@s2 W6@s3 W6@s2"};
  Schedule s = make_schedule({ScheduleKind::kDualPipeV, 3, 7, 2}).value();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(compute_order(s.ranks[r]), torch_order[r]) << "rank " << r;
}

TEST(Schedule, DualPipeVIsValidFromTwoMicrobatchesPerStage) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 3 * p + 5; ++m) {
      auto s = make_schedule({ScheduleKind::kDualPipeV, p, m, 2});
      if (m < 2 * p) {
        ASSERT_FALSE(s.is_ok()) << "p=" << p << " m=" << m;
        EXPECT_NE(s.status().message().find("at least as many microbatches as stages"), std::string::npos);
        continue;
      }
      ASSERT_TRUE(s.is_ok()) << "p=" << p << " m=" << m << ": " << s.status().message();
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(s->spec.stages_of_rank(r), (std::vector<int>{r, 2 * p - 1 - r}));
        // DualPipe's activation memory: 2p + 2 stage-microbatches in flight (p + 1 whole
        // microbatches of a rank's model) at most, one more than ZB-V's bound.
        EXPECT_LE(peak_in_flight(s->ranks[r]), 2 * p + 2) << "p=" << p << " m=" << m << " rank " << r;
      }
    }
  }
  EXPECT_EQ(schedule_kind_from_name("dualpipev").value(), ScheduleKind::kDualPipeV);
  EXPECT_FALSE(make_schedule({ScheduleKind::kDualPipeV, 2, 4, 1}).is_ok());
}

TEST(Schedule, BadSpecsAndNames) {
  EXPECT_FALSE(make_schedule({ScheduleKind::kGPipe, 0, 4}).is_ok());
  EXPECT_FALSE(make_schedule({ScheduleKind::kGPipe, 2, 0}).is_ok());
  EXPECT_EQ(schedule_kind_from_name("1f1b").value(), ScheduleKind::kOneFOneB);
  auto bad = schedule_kind_from_name("pipedream");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("expected gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev"), std::string::npos);
  EXPECT_EQ(schedule_kind_from_name("zb-h1").value(), ScheduleKind::kZeroBubbleH1);
}

// Every schedule has one name, which means it again; the chunks a fixed stage count is cut
// into per rank are what make_schedule accepts for it.
TEST(Schedule, EveryScheduleIsNamedOnceAndTakesItsDefaultChunks) {
  std::set<std::string_view> names;
  for (ScheduleKind kind : kScheduleKinds) {
    EXPECT_TRUE(names.insert(schedule_kind_name(kind)).second) << schedule_kind_name(kind);
    EXPECT_EQ(schedule_kind_from_name(schedule_kind_name(kind)).value(), kind);
    const int chunks = default_chunks(kind);
    EXPECT_EQ(chunks, is_chunked(kind) ? 2 : 1);
    EXPECT_TRUE(make_schedule({kind, 2, 4, chunks}).is_ok()) << schedule_kind_name(kind);
  }
  EXPECT_EQ(schedule_names_text(), "gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev");
}

}  // namespace
}  // namespace conveyor::scheduler
