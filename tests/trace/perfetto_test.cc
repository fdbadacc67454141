#include "trace/perfetto.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "trace/simulation_trace.h"

namespace conveyor::trace {
namespace {

using scheduler::ScheduleKind;

TEST(Perfetto, SimulatedStepsDecodeWithEverySliceAndFlow) {
  for (auto kind : {ScheduleKind::kGPipe, ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1}) {
    const int p = 4, m = 8;
    auto schedule = scheduler::make_schedule({kind, p, m});
    ASSERT_TRUE(schedule.is_ok());
    std::vector<scheduler::StageCost> costs(p, scheduler::StageCost{1e-3, 2e-3, 1e-3, 1e6, 1e6, 5e-4});
    auto sim = scheduler::simulate(*schedule, costs, scheduler::LinkCost{1e-5, 1e9});
    ASSERT_TRUE(sim.is_ok());
    PerfettoTrace t;
    add_simulation(t, *schedule, *sim);
    auto summary = check_trace(t.serialize());
    ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
    EXPECT_EQ(summary->slices, sim->spans.size());
    // Every send is joined to its consumer: one flow per transfer, 2 (p - 1) m transfers.
    EXPECT_EQ(summary->flows, static_cast<std::size_t>(2 * (p - 1) * m));
    const std::size_t backward = kind == ScheduleKind::kZeroBubbleH1 ? summary->slices_by_name["Bi"] : summary->slices_by_name["B"];
    EXPECT_EQ(summary->slices_by_name["F"], static_cast<std::size_t>(p * m));
    EXPECT_EQ(backward, static_cast<std::size_t>(p * m));
    EXPECT_EQ(summary->slices_by_name["allreduce"], static_cast<std::size_t>(p));
    // rank tracks, each with compute, collective and one send stream per neighbour
    EXPECT_EQ(summary->tracks, static_cast<std::size_t>(p * 3 + 2 * (p - 1)));
  }
}

TEST(Perfetto, CheckerRejectsBrokenTraces) {
  PerfettoTrace t;
  auto a = t.add_track("a");
  t.slice(a, 10, 20, "F0", {7});
  t.slice(a, 20, 30, "B0", {7});
  t.slice(a, 30, 30, "empty");
  std::string good = t.serialize();
  ASSERT_TRUE(check_trace(good).is_ok()) << check_trace(good).status().to_string();
  EXPECT_FALSE(check_trace(good.substr(0, good.size() - 3)).is_ok());
  EXPECT_FALSE(check_trace("").is_ok());
  EXPECT_FALSE(check_trace("not a trace at all").is_ok());

  PerfettoTrace lonely;
  auto b = lonely.add_track("b");
  lonely.slice(b, 0, 5, "send", {42});
  auto r = check_trace(lonely.serialize());
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("flow 42 starts but never arrives"), std::string::npos);
}

TEST(Perfetto, ChromeJsonHasAProcessPerTopLevelTrackAndEachFlowOnce) {
  PerfettoTrace t;
  const auto p0 = t.add_track("process 0"), p1 = t.add_track("process 1");
  const auto waits = t.add_track("waits", p1);
  t.slice(p0, 1'000'000, 3'000'000, "microbatch 0");
  t.slice(p0, 2'000'000, 2'500'000, "send #0 to 1", {9});
  t.slice(waits, 1'500'000, 4'000'000, "recv #0 from 0", {9});
  t.instant(p1, 5'000'000, "done");
  auto doc = nlohmann::json::parse(t.chrome_json());
  std::map<std::string, int> phases;
  for (const auto& e : doc["traceEvents"]) ++phases[e["ph"].get<std::string>()];
  EXPECT_EQ(phases["B"], 3);
  EXPECT_EQ(phases["E"], 3);
  EXPECT_EQ(phases["i"], 1);
  EXPECT_EQ(phases["s"], 1);  // at the first slice carrying flow 9 (the receive began first)
  EXPECT_EQ(phases["f"], 1);
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") EXPECT_TRUE(e["pid"] == p0 || e["pid"] == p1);
    if (e["ph"] == "B" && e["name"] == "recv #0 from 0") {
      EXPECT_EQ(e["pid"], p1);  // a child track is a thread of its parent's process
      EXPECT_EQ(e["tid"], waits);
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 500.0);  // microseconds from the earliest event
    }
  }
}

}  // namespace
}  // namespace conveyor::trace
