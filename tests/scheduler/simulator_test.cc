#include "scheduler/simulator.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>

#include <cmath>

namespace conveyor::scheduler {
namespace {

TEST(Simulator, BalancedChainsReproduceTheAnalyticalBubble) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB}) {
    for (int p : {1, 2, 4, 8}) {
      for (int m : {1, 4, 8, 32}) {
        auto s = make_schedule({kind, p, m});
        ASSERT_TRUE(s.is_ok());
        std::vector<StageCost> costs(static_cast<std::size_t>(p), StageCost{1.0, 2.0, 0, 0, 0});
        auto r = simulate(*s, costs, LinkCost{});
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        double expected = static_cast<double>(p - 1) / (m + p - 1);
        EXPECT_NEAR(r->bubble_fraction, expected, 0.01) << schedule_kind_name(kind) << " p=" << p << " m=" << m;
        EXPECT_NEAR(r->step_time_s, (m + p - 1) * 3.0, 1e-9);
      }
    }
  }
}

TEST(Simulator, ZeroBubbleH1CutsTheBubbleToAThirdOfOneFOneB) {
  // Unit costs: F = B(input) = W = 1, so a whole backward is 2.
  for (int p : {2, 4, 8}) {
    for (int m : {8, 16, 32}) {
      std::vector<StageCost> costs(static_cast<std::size_t>(p), StageCost{1.0, 2.0, 1.0, 0, 0});
      auto ofob = simulate(*make_schedule({ScheduleKind::kOneFOneB, p, m}), costs, LinkCost{});
      auto zb = simulate(*make_schedule({ScheduleKind::kZeroBubbleH1, p, m}), costs, LinkCost{});
      ASSERT_TRUE(ofob.is_ok() && zb.is_ok());
      // The bubble in time units: 1F1B idles (p-1)(F+B+W) per rank, ZB-H1 (p-1)(F+B-W).
      double ofob_idle = ofob->bubble_fraction * ofob->step_time_s;
      double zb_idle = zb->bubble_fraction * zb->step_time_s;
      EXPECT_NEAR(ofob_idle, 3.0 * (p - 1), 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(zb_idle, (p - 1) * 1.0, 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(zb_idle / ofob_idle, 1.0 / 3.0, 0.01) << "p=" << p << " m=" << m;
      EXPECT_LT(zb->step_time_s, ofob->step_time_s);
    }
  }
}

TEST(Simulator, ZeroBubbleVIdlesOnlyWhileTheFirstForwardReachesTheLastRank) {
  // Unit costs per stage (F = Bi = W = 1; each rank holds two stages, so a rank's model costs
  // 2 + 2 + 2 per microbatch). Rank r cannot start before the first forward has crossed r
  // ranks, and the last rank holds the turn; ZB-V fills everything else, so each rank idles
  // exactly p - 1 units: step = 6m + p - 1, with 1F1B's peak activation memory. For the same
  // rank costs ZB-H1 idles (p-1)(F+B-W) = 2(p-1) and 1F1B (p-1)(F+B+W) = 6(p-1).
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {2 * p, 2 * p + 3, 4 * p, 32}) {
      auto zbv = simulate(*make_schedule({ScheduleKind::kZeroBubbleV, p, m, 2}),
                          std::vector<StageCost>(2 * p, StageCost{1.0, 2.0, 1.0, 0, 0, 0, 0, 0, 1.0}), LinkCost{});
      const std::vector<StageCost> rank_costs(p, StageCost{2.0, 4.0, 2.0, 0, 0, 0, 0, 0, 2.0});
      auto zbh1 = simulate(*make_schedule({ScheduleKind::kZeroBubbleH1, p, m}), rank_costs, LinkCost{});
      auto ofob = simulate(*make_schedule({ScheduleKind::kOneFOneB, p, m}), rank_costs, LinkCost{});
      ASSERT_TRUE(zbv.is_ok() && zbh1.is_ok() && ofob.is_ok());
      EXPECT_NEAR(zbv->step_time_s, 6.0 * m + (p - 1), 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(zbv->bubble_fraction, (p - 1.0) / (6.0 * m + p - 1), 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(zbh1->bubble_fraction * zbh1->step_time_s, 2.0 * (p - 1), 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(ofob->bubble_fraction * ofob->step_time_s, 6.0 * (p - 1), 1e-9) << "p=" << p << " m=" << m;
      for (int r = 0; r < p; ++r) EXPECT_LE(zbv->peak_bytes[r], ofob->peak_bytes[0] + 1e-9) << "rank " << r;
    }
  }
}

TEST(Simulator, ZeroBubbleVsTurnStaysOnItsRank) {
  // Costly links: every boundary crosses ranks but the turn (stage p-1 to p), which costs nothing.
  const int p = 3;
  auto s = make_schedule({ScheduleKind::kZeroBubbleV, p, 6, 2});
  ASSERT_TRUE(s.is_ok());
  auto r = simulate(*s, std::vector<StageCost>(2 * p, StageCost{1.0, 2.0, 1.0, 1e6, 1e6}), LinkCost{0.0, 1e6});
  ASSERT_TRUE(r.is_ok());
  int turns = 0, crossings = 0;
  for (const auto& span : r->spans) {
    if (span.stream != Span::Stream::kSend) continue;
    const bool turn = span.action.stage == (span.action.kind == ActionKind::kSendActivation ? p - 1 : p);
    (turn ? turns : crossings) += 1;
    EXPECT_NEAR(span.end_s - span.start_s, turn ? 0.0 : 1.0, 1e-9) << action_text(span.action, true);
  }
  EXPECT_EQ(turns, 2 * 6);
  EXPECT_EQ(crossings, 2 * 6 * (2 * p - 2));
}

TEST(Simulator, TransfersRunOnTheirOwnStreamAndOverlapCompute) {
  auto s = make_schedule({ScheduleKind::kOneFOneB, 4, 8});
  ASSERT_TRUE(s.is_ok());
  std::vector<StageCost> costs(4, StageCost{1.0, 2.0, 0, 1e6, 1e6});
  LinkCost link{0.01, 2e6};  // 0.51 s per message
  auto r = simulate(*s, costs, link);
  ASSERT_TRUE(r.is_ok());
  auto no_comm = simulate(*s, costs, LinkCost{});
  EXPECT_GT(r->step_time_s, no_comm->step_time_s);
  // Compute spans of a rank never overlap one another; some send overlaps compute.
  bool overlap = false;
  for (const auto& a : r->spans) {
    for (const auto& b : r->spans) {
      if (&a == &b || a.rank != b.rank) continue;
      bool intersect = a.start_s < b.end_s && b.start_s < a.end_s;
      if (a.stream == Span::Stream::kCompute && b.stream == Span::Stream::kCompute) {
        EXPECT_FALSE(intersect);
      }
      if (a.stream == Span::Stream::kSend && b.stream == Span::Stream::kCompute && intersect) overlap = true;
    }
  }
  EXPECT_TRUE(overlap);
  // Fill and drain each cross the 3 links at least once; no period waits for more than two
  // transfers (one activation, one gradient).
  const double tc = 0.51;
  EXPECT_GE(r->step_time_s, no_comm->step_time_s + 2 * 3 * tc - 1e-9);
  EXPECT_LE(r->step_time_s, no_comm->step_time_s + (8 + 4 - 1) * 2 * tc + 1e-9);
}

TEST(Simulator, SlowestStageSetsTheSteadyState) {
  auto s = make_schedule({ScheduleKind::kOneFOneB, 3, 16});
  ASSERT_TRUE(s.is_ok());
  std::vector<StageCost> costs = {{1, 2, 0, 0, 0}, {2, 4, 0, 0, 0}, {1, 2, 0, 0, 0}};
  auto r = simulate(*s, costs, LinkCost{});
  ASSERT_TRUE(r.is_ok());
  EXPECT_GE(r->step_time_s, 16 * 6.0);  // the middle stage alone is busy 96 s
  EXPECT_LT(r->step_time_s, 16 * 6.0 + 2 * 6.0 + 1e-9);
}

TEST(Simulator, RejectsMismatchedCosts) {
  auto s = make_schedule({ScheduleKind::kGPipe, 2, 2});
  auto r = simulate(*s, {StageCost{}}, LinkCost{});
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("1 stage costs for a schedule of 2 stages"), std::string::npos);
}

TEST(Simulator, InterleavedBubbleIsDividedByTheChunkCount) {
  // A rank's stage work F = 1, B = 2 is split into v chunks; the bubble relative to the
  // ideal (busy) time is (p - 1) / (v m).
  double worst = 0;
  for (int p : {2, 4, 8}) {
    for (int v : {2, 3, 4}) {
      for (int m : {p, 2 * p, 4 * p}) {
        auto s = make_schedule({ScheduleKind::kInterleaved, p, m, v});
        ASSERT_TRUE(s.is_ok()) << s.status().to_string();
        std::vector<StageCost> costs(static_cast<std::size_t>(p * v), StageCost{1.0 / v, 2.0 / v});
        auto r = simulate(*s, costs, LinkCost{});
        ASSERT_TRUE(r.is_ok()) << r.status().to_string();
        const double ideal = m * 3.0;
        EXPECT_NEAR(r->busy_s[0], ideal, 1e-9);
        const double bubble_of_ideal = (r->step_time_s - ideal) / ideal;
        worst = std::max(worst, std::abs(bubble_of_ideal - static_cast<double>(p - 1) / (v * m)));
        EXPECT_NEAR(bubble_of_ideal, static_cast<double>(p - 1) / (v * m), 0.01)
            << "p=" << p << " v=" << v << " m=" << m;
        // And it beats plain 1F1B on the same work.
        auto plain = simulate(*make_schedule({ScheduleKind::kOneFOneB, p, m}),
                              std::vector<StageCost>(static_cast<std::size_t>(p), StageCost{1.0, 2.0}), LinkCost{});
        EXPECT_LT(r->step_time_s, plain->step_time_s);
      }
    }
  }
  std::printf("interleaved bubble: worst deviation from (p-1)/(v m) is %.4f\n", worst);
}

TEST(Simulator, AllreduceAndOptimizerFormTheTail) {
  auto s = make_schedule({ScheduleKind::kOneFOneB, 2, 4});
  ASSERT_TRUE(s.is_ok());
  std::vector<StageCost> costs(2, StageCost{1.0, 2.0});
  auto base = simulate(*s, costs, LinkCost{});
  costs[0].allreduce_s = 5;
  costs[0].optimizer_s = 1;
  costs[1].allreduce_s = 5;  // rank 1 finishes its backwards 3 s earlier: hidden partly
  auto tail = simulate(*s, costs, LinkCost{});
  ASSERT_TRUE(base.is_ok() && tail.is_ok());
  EXPECT_DOUBLE_EQ(tail->step_time_s, base->step_time_s + 5 + 1);
  bool collective = false;
  for (const auto& span : tail->spans) collective |= span.stream == Span::Stream::kCollective;
  EXPECT_TRUE(collective);
  EXPECT_DOUBLE_EQ(tail->bubble_fraction, base->bubble_fraction);  // the tail is not pipeline bubble
}

TEST(Simulator, PeakMemoryFollowsActivationsInFlight) {
  const int p = 4, m = 8;
  std::vector<StageCost> costs(p, StageCost{1.0, 2.0, 1.0});
  for (auto& c : costs) {
    c.static_bytes = 100;
    c.saved_bytes = 10;
  }
  auto gpipe = simulate(*make_schedule({ScheduleKind::kGPipe, p, m}), costs, LinkCost{});
  auto ofob = simulate(*make_schedule({ScheduleKind::kOneFOneB, p, m}), costs, LinkCost{});
  ASSERT_TRUE(gpipe.is_ok() && ofob.is_ok());
  for (int r = 0; r < p; ++r) {
    EXPECT_DOUBLE_EQ(gpipe->peak_bytes[r], 100 + 10 * m);
    EXPECT_DOUBLE_EQ(ofob->peak_bytes[r], 100 + 10 * (p - r));
  }
}

// A split backward frees most of a microbatch's activations at its Bi and keeps the weight
// gradients' inputs until its W: with nothing kept past Bi, ZB-H1 holds what 1F1B holds
// (its Bi come in 1F1B's order); kept whole to W, more on the first ranks; between, between.
TEST(Simulator, ASplitBackwardFreesAtItsInputHalfWhatItsWeightHalfDoesNotNeed) {
  const int p = 4, m = 8;
  auto peaks = [&](ScheduleKind kind, double freed_at_input) {
    std::vector<StageCost> costs(p, StageCost{1.0, 2.0, 1.0});
    for (auto& c : costs) {
      c.static_bytes = 100;
      c.saved_bytes = 10;
      c.input_freed_bytes = freed_at_input;
    }
    auto sim = simulate(*make_schedule({kind, p, m}), costs, LinkCost{});
    EXPECT_TRUE(sim.is_ok());
    return sim->peak_bytes;
  };
  const auto ofob = peaks(ScheduleKind::kOneFOneB, 0);
  const auto all_to_w = peaks(ScheduleKind::kZeroBubbleH1, 0);
  const auto none_to_w = peaks(ScheduleKind::kZeroBubbleH1, 10);
  const auto some_to_w = peaks(ScheduleKind::kZeroBubbleH1, 6);
  for (int r = 0; r < p; ++r) {
    EXPECT_DOUBLE_EQ(none_to_w[r], ofob[r]) << "rank " << r;
    EXPECT_LE(none_to_w[r], some_to_w[r]);
    EXPECT_LE(some_to_w[r], all_to_w[r]);
  }
  EXPECT_GT(all_to_w[0], ofob[0]);
  EXPECT_LT(some_to_w[0], all_to_w[0]);
}

TEST(Simulator, ASplitBackwardPeaksWithTheGradientsItsInputHalfCaptures) {
  // Bi makes the gradients W needs before it frees anything: one stage, one microbatch
  // (F, Bi, W in a row), 100 static, 10 saved of which Bi frees 6, 3 captured: the peak is
  // held + saved + captured = 113, where 1F1B's whole backward peaks at 110.
  auto peak = [](ScheduleKind kind, double captured) {
    std::vector<StageCost> costs(1, StageCost{1.0, 2.0, 1.0});
    costs[0].static_bytes = 100;
    costs[0].saved_bytes = 10;
    costs[0].input_freed_bytes = 6;
    costs[0].captured_bytes = captured;
    auto sim = simulate(*make_schedule({kind, 1, 1}), costs, LinkCost{});
    EXPECT_TRUE(sim.is_ok());
    return sim->peak_bytes[0];
  };
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kOneFOneB, 3), 110);  // a whole backward captures nothing apart
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kZeroBubbleH1, 0), 110);
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kZeroBubbleH1, 3), 113);
}


TEST(Simulator, ABackwardsWorkingMemoryCountsWhileItRunsNotBetween) {
  // One stage, two microbatches, 10 saved each and 5 more while a backward runs. GPipe
  // (F F B B) peaks in its first B over both microbatches' activations: 25. 1F1B (F B F B)
  // holds one microbatch when each B runs: 15 (adding the 5 to the most ever held, as the
  // model did before, says the same here, but not where the most is held between backwards).
  auto peak = [](ScheduleKind kind, double extra) {
    std::vector<StageCost> costs(1, StageCost{1.0, 2.0, 1.0});
    costs[0].saved_bytes = 10;
    costs[0].input_freed_bytes = 6;
    costs[0].backward_extra_bytes = extra;
    costs[0].split_backward_extra_bytes = 2 * extra;  // Bi and W keep the graph whole
    auto sim = simulate(*make_schedule({kind, 1, 2}), costs, LinkCost{});
    EXPECT_TRUE(sim.is_ok());
    return sim->peak_bytes[0];
  };
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kGPipe, 0), 20);
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kGPipe, 5), 25);
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kOneFOneB, 5), 15);
  // ZB-H1 defers the Ws (F Bi F Bi W W): the second Bi runs holding the first microbatch's 4
  // bytes kept for its W and its own 10, plus its split extra of 10.
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kZeroBubbleH1, 5), 24);
}

TEST(Simulator, WeightGradientsAreHeldFromTheirStagesFirstBackward) {
  // Two stages on two ranks, 1F1B over two microbatches; each stage holds 100 static bytes
  // of which 40 are its parameters' gradients, and saves 10 per microbatch. The gradients are
  // freed before the step (zero_grad) and made by the stage's first B: stage 0 holds both
  // microbatches (20) before its first B, so it peaks there at 60 + 20 + its B's extra of 5,
  // not at 100 + 20; after its B the gradients stay (100 + 10 + 5 at the second B).
  auto peak = [](ScheduleKind kind, double grads) {
    std::vector<StageCost> costs(2, StageCost{1.0, 2.0, 1.0});
    for (auto& c : costs) {
      c.static_bytes = 100;
      c.weight_grad_bytes = grads;
      c.saved_bytes = 10;
      c.input_freed_bytes = 6;
      c.backward_extra_bytes = 5;
      c.split_backward_extra_bytes = 5;
    }
    auto sim = simulate(*make_schedule({kind, 2, 2}), costs, LinkCost{});
    EXPECT_TRUE(sim.is_ok());
    return sim->peak_bytes[0];
  };
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kOneFOneB, 0), 125);
  EXPECT_DOUBLE_EQ(peak(ScheduleKind::kOneFOneB, 40), 115);
  // A split backward makes them at W, not at Bi: one microbatch through one stage (F Bi W)
  // peaks at 60 + 10 + 5 in its Bi, 60 + 4 + 5 in its W, then holds 100. Made at Bi, the
  // gradients would have peaked there at 100 + 10 + 5.
  std::vector<StageCost> one(1, StageCost{1.0, 2.0, 1.0});
  one[0].static_bytes = 100;
  one[0].weight_grad_bytes = 40;
  one[0].saved_bytes = 10;
  one[0].input_freed_bytes = 6;
  one[0].split_backward_extra_bytes = 5;
  auto split = simulate(*make_schedule({ScheduleKind::kZeroBubbleH1, 1, 1}), one, LinkCost{});
  ASSERT_TRUE(split.is_ok()) << split.status().to_string();
  EXPECT_DOUBLE_EQ(split->peak_bytes[0], 100);
}

TEST(Simulator, DualPipeVIdlesOnlyTheFillAndHoldsOneStageMicrobatchMoreThanZeroBubbleV) {
  // DualPipeV's gain over ZB-V is overlapping the forward and the backward it pairs (F&B in
  // DeepSeek-V3's table 2), which one compute stream per replica does not do. Run in order,
  // at unit costs (F = Bi = W = 1 per stage) it idles only the fill, p - 1 units per rank,
  // as ZB-V does; its activations peak at 2p + 1 stage-microbatches against ZB-V's 2p
  // (DualPipe's PP + 1 against PP).
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {2 * p, 2 * p + 3, 4 * p, 32}) {
      const std::vector<StageCost> costs(2 * p, StageCost{1.0, 2.0, 1.0, 0, 0, 0, 0, 0, 1.0});
      auto dpv = simulate(*make_schedule({ScheduleKind::kDualPipeV, p, m, 2}), costs, LinkCost{});
      auto zbv = simulate(*make_schedule({ScheduleKind::kZeroBubbleV, p, m, 2}), costs, LinkCost{});
      ASSERT_TRUE(dpv.is_ok() && zbv.is_ok()) << dpv.status().to_string();
      EXPECT_NEAR(dpv->step_time_s, 6.0 * m + (p - 1), 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(dpv->bubble_fraction * dpv->step_time_s, p - 1.0, 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(dpv->peak_bytes[0], 2.0 * p + 1, 1e-9) << "p=" << p << " m=" << m;
      EXPECT_NEAR(zbv->peak_bytes[0], 2.0 * p, 1e-9) << "p=" << p << " m=" << m;
    }
  }
}

// A many-stage step is simulated in time linear in its actions (1,024 stages hung; 256 took
// 4 s): the times of 256, 512 and 1,024 stages are printed for docs/formats.md's limits, and
// the schedules' sizes checked, never the times.
TEST(Simulator, ManyStagesSimulate) {
  for (int p : {256, 512, 1024}) {
    const int m = 2 * p;
    auto s = make_schedule({ScheduleKind::kOneFOneB, p, m});
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    std::vector<StageCost> costs(p, StageCost{1e-3, 2e-3, 1e-3, 1e6, 1e6, 5e-4});
    const auto t0 = std::chrono::steady_clock::now();
    auto r = simulate(*s, costs, LinkCost{1e-5, 1e9});
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    std::printf("simulated %d stages x %d microbatches in %.2f s\n", p, m, took);
    EXPECT_GE(r->spans.size(), static_cast<std::size_t>(2 * p * m));
  }
}

}  // namespace
}  // namespace conveyor::scheduler
