#include "trace/span_record.h"

#include <gtest/gtest.h>

#include "trace/perfetto.h"
#include "trace/simulation_trace.h"

namespace conveyor::trace {
namespace {

using scheduler::Span;

// A simulated step split as two processes would measure it: ranks 0-1 in one, 2-3 in the
// other, the second starting 5 ms later on the wall clock (its spans 5 ms earlier on its own).
TEST(SpanRecord, TwoProcessesMergeIntoOneTraceWithEveryFlow) {
  const int p = 4, m = 4;
  auto schedule = scheduler::make_schedule({scheduler::ScheduleKind::kOneFOneB, p, m});
  ASSERT_TRUE(schedule.is_ok());
  std::vector<scheduler::StageCost> costs(p, scheduler::StageCost{1e-3, 2e-3, 1e-3, 1e6, 1e6, 5e-4});
  auto sim = scheduler::simulate(*schedule, costs, scheduler::LinkCost{1e-5, 1e9});
  ASSERT_TRUE(sim.is_ok());
  std::vector<Span> first, second;
  for (Span s : sim->spans) {
    if (s.rank < 2) {
      first.push_back(s);
    } else {
      s.start_s -= 5e-3;
      s.end_s -= 5e-3;
      second.push_back(s);
    }
  }
  const std::int64_t t0 = 1'700'000'000'000'000'000;
  auto merged = merge_span_records({span_record(second, t0 + 5'000'000), span_record(first, t0)}, p);
  ASSERT_TRUE(merged.is_ok()) << merged.status().to_string();
  ASSERT_EQ(merged->size(), sim->spans.size());
  double latest_end = 0, simulated_end = 0;
  for (const Span& s : *merged) latest_end = std::max(latest_end, s.end_s);
  for (const Span& s : sim->spans) simulated_end = std::max(simulated_end, s.end_s);
  EXPECT_NEAR(latest_end, simulated_end, 1e-9);

  scheduler::SimulationResult job;
  job.spans = *merged;
  PerfettoTrace both;
  add_simulation(both, *schedule, job, "measured");
  auto summary = check_trace(both.serialize());
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  EXPECT_EQ(summary->flows, static_cast<std::size_t>(2 * (p - 1) * m));  // the 2 m crossing processes too

  scheduler::SimulationResult alone;
  alone.spans = first;
  PerfettoTrace one;
  add_simulation(one, *schedule, alone, "measured");
  auto one_summary = check_trace(one.serialize());
  ASSERT_TRUE(one_summary.is_ok());
  EXPECT_EQ(one_summary->flows, static_cast<std::size_t>(2 * m));  // between ranks 0 and 1 only
}

TEST(SpanRecord, ARecordThatDoesNotReadNamesItsProcess) {
  const std::string good = span_record({}, 0);
  for (const std::string bad : {"", "[]", "{\"wall_start_ns\": 0}", "{\"wall_start_ns\": 0, \"spans\": [[1,2]]}",
                                "{\"wall_start_ns\": 0, \"spans\": [[7,0,0,0,0,0,-1,0.0,1.0]]}",
                                "{\"wall_start_ns\": 0, \"spans\": [[0,0,9,0,0,0,-1,0.0,1.0]]}",
                                "{\"wall_start_ns\": 0, \"spans\": [[0,0,0,0,0,0,-1,2.0,1.0]]}"}) {
    auto merged = merge_span_records({good, bad}, 4);
    ASSERT_FALSE(merged.is_ok()) << bad;
    EXPECT_NE(merged.status().message().find("process 1"), std::string::npos) << merged.status().message();
  }
}

}  // namespace
}  // namespace conveyor::trace
