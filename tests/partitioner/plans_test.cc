// The plans the planner makes, beyond the searches' optimality (planner_test.cc): memory
// (what does not fit, recomputation, a split backward's activations), the chunked
// schedules (interleaved, ZB-V), plan documents and bad options.
#include "partitioner/planner.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <set>
#include <string>
#include <vector>

#include "random_graphs.h"

namespace conveyor::partitioner {
namespace {

using scheduler::ScheduleKind;
using testing::fast_link;
using testing::random_dag;
using testing::uniform_chain;

TEST(Planner, ModelThatCannotFitGetsTheMemoryItWouldNeed) {
  CostGraph g = uniform_chain(16, 1e-3, 2e-3, 1e9, 1e6);  // 16 GB of weights, x4 with Adam
  Cluster small = Cluster::uniform(1, 4, 8e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 8;
  auto plan = make_plan(g, small, o);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kDoesNotFit);
  const std::string& msg = plan.status().message();
  EXPECT_NE(msg.find("needs at least"), std::string::npos) << msg;
  EXPECT_NE(msg.find("per device"), std::string::npos) << msg;
  // The stated figure is right: with that much memory per device a plan exists, with a bit
  // less none does.
  const auto pos = msg.find("needs at least ") + 15;
  const double gib = std::stod(msg.substr(pos));
  ASSERT_NE(msg.find("GiB", pos), std::string::npos);
  Cluster enough = Cluster::uniform(1, 4, (gib + 0.1) * 1024 * 1024 * 1024, 1.0, fast_link(), fast_link());
  EXPECT_TRUE(make_plan(g, enough, o).is_ok()) << msg;
  Cluster short_of = Cluster::uniform(1, 4, (gib - 0.2) * 1024 * 1024 * 1024, 1.0, fast_link(), fast_link());
  EXPECT_FALSE(make_plan(g, short_of, o).is_ok()) << msg;
}

// A batch of 8 in 4 microbatches over 2 ranks of 1F1B: the recomputation tests' plans.
PlanOptions two_ranks_of_four_microbatches() {
  PlanOptions o;
  o.batch = 8;
  o.microbatches = 4;
  o.ranks = 2;
  o.schedules = {ScheduleKind::kOneFOneB};
  return o;
}

TEST(Planner, StagesRecomputeWhereTheyWouldNotFitOtherwise) {
  // Activations dominate: 8 layers of 100 MB saved each per microbatch, small weights.
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e6, 1e8);
  PlanOptions o = two_ranks_of_four_microbatches();
  o.recompute = Recomputation::kNone;
  auto roomy = make_plan(g, Cluster::uniform(1, 2, 1e12, 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(roomy.is_ok()) << roomy.status().to_string();
  double need = 0;
  for (const auto& s : roomy->stages) need = std::max(need, s.memory_bytes);
  const Cluster tight = Cluster::uniform(1, 2, 0.6 * need, 1.0, fast_link(), fast_link());
  EXPECT_EQ(make_plan(g, tight, o).status().code(), ErrorCode::kDoesNotFit);  // without recomputation: none
  o.recompute = std::nullopt;
  auto plan = make_plan(g, tight, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  int recomputing = 0;
  for (const auto& s : plan->stages) {
    EXPECT_LE(s.memory_bytes, 0.6 * need);
    if (s.recompute == Recomputation::kNone) continue;
    EXPECT_EQ(s.recompute, Recomputation::kFull);  // the chain's operators say nothing of selective recomputation
    ++recomputing;
    EXPECT_NEAR(s.backward_s, s.forward_s + 2 * s.forward_s, 1e-12);  // the forward again, then B = 2F
  }
  EXPECT_GE(recomputing, 1);
  EXPECT_GT(plan->predicted_step_s, roomy->predicted_step_s);  // memory for time
  EXPECT_NE(plan->table().find("full"), std::string::npos) << plan->table();
  auto back = Plan::from_json(plan->to_json());
  ASSERT_TRUE(back.is_ok());
  for (std::size_t s = 0; s < plan->stages.size(); ++s) EXPECT_EQ(back->stages[s].recompute, plan->stages[s].recompute);
  // Full for every stage: every stage recomputes, even with room to spare.
  o.recompute = Recomputation::kFull;
  auto every_stage_full = make_plan(g, Cluster::uniform(1, 2, 1e12, 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(every_stage_full.is_ok());
  for (const auto& s : every_stage_full->stages) EXPECT_EQ(s.recompute, Recomputation::kFull);
}

// Selective recomputation frees part of what a stage keeps for a part of its forward: where
// that is enough the planner takes it before full recomputation (a smaller price), where it
// is not, full; memory and time as the model says.
TEST(Plans, SelectiveRecomputationWhereItFitsFullWhereOnlyThatFits) {
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e6, 1e8);
  for (CostOp& op : g.ops) {
    op.selective_forward_s = 0.25 * op.forward_s;
    // A fifth freed (each operator its own run, made again in its backward): so little that
    // with two microbatches in flight full recomputation keeps less, and fits where this does not.
    op.selective_freed_bytes = 0.2 * op.saved_bytes;
    op.selective_work_bytes = 0.2 * op.saved_bytes;
  }
  PlanOptions o = two_ranks_of_four_microbatches();
  o.recompute = Recomputation::kNone;
  auto roomy = make_plan(g, Cluster::uniform(1, 2, 1e12, 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(roomy.is_ok()) << roomy.status().to_string();
  o.recompute = Recomputation::kSelective;
  auto selective = make_plan(g, Cluster::uniform(1, 2, 1e12, 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(selective.is_ok()) << selective.status().to_string();
  double need = 0, selective_need = 0;
  for (const auto& s : roomy->stages) need = std::max(need, s.memory_bytes);
  for (std::size_t k = 0; k < selective->stages.size(); ++k) {
    const StagePlan& s = selective->stages[k];
    EXPECT_EQ(s.recompute, Recomputation::kSelective);
    selective_need = std::max(selective_need, s.memory_bytes);
    // The forward's cheap quarter again before the backward (B = 2F).
    EXPECT_NEAR(s.backward_s, 0.25 * s.forward_s + 2 * s.forward_s, 1e-12);
  }
  ASSERT_LT(selective_need, need);
  o.recompute = std::nullopt;
  // Room for selective but not for keeping everything: selective, where it must.
  auto plan = make_plan(g, Cluster::uniform(1, 2, 0.5 * (need + selective_need), 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  int selective_stages = 0;
  for (const auto& s : plan->stages) {
    EXPECT_NE(s.recompute, Recomputation::kFull);
    selective_stages += s.recompute == Recomputation::kSelective;
  }
  EXPECT_GE(selective_stages, 1);
  EXPECT_NE(plan->table().find("selective"), std::string::npos) << plan->table();
  auto back = Plan::from_json(plan->to_json());
  ASSERT_TRUE(back.is_ok());
  for (std::size_t s = 0; s < plan->stages.size(); ++s) EXPECT_EQ(back->stages[s].recompute, plan->stages[s].recompute);
  // Less memory, until no plan fits with selective recomputation alone: full where it must.
  double capacity = selective_need;
  PlanOptions only_selective = o;
  only_selective.recompute = Recomputation::kSelective;
  while (make_plan(g, Cluster::uniform(1, 2, capacity, 1.0, fast_link(), fast_link()), only_selective).is_ok()) {
    capacity *= 0.97;
  }
  auto tight = make_plan(g, Cluster::uniform(1, 2, capacity, 1.0, fast_link(), fast_link()), o);
  ASSERT_TRUE(tight.is_ok()) << tight.status().to_string();
  int full = 0;
  for (const auto& s : tight->stages) {
    full += s.recompute == Recomputation::kFull;
    EXPECT_LE(s.memory_bytes, capacity);
  }
  EXPECT_GE(full, 1);
}

// A run of cheap operators is recomputed when the backward reaches it, after the operators
// after it have freed what they kept: its transient counts beside what the microbatch keeps
// up to it, not all it keeps. And what a run keeps beyond what its operators saved (its
// inputs, where nothing else saves them) is kept by every microbatch in flight.
TEST(Plans, ASelectiveRunsTransientCountsBesideWhatTheMicrobatchStillKeepsThere) {
  const double saved = 1e8, transient = 2e9;
  auto need = [&](int heavy, double heavy_transient, double kept_beyond) {
    CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e6, saved);
    for (CostOp& op : g.ops) op.selective_freed_bytes = 0.5 * op.saved_bytes;
    g.ops[heavy].selective_work_bytes = heavy_transient;
    g.ops[3].selective_kept_bytes = kept_beyond;
    PlanOptions o = two_ranks_of_four_microbatches();
    o.ranks = 1;
    o.recompute = Recomputation::kSelective;
    auto plan = make_plan(g, Cluster::uniform(1, 1, 1e12, 1.0, fast_link(), fast_link()), o);
    EXPECT_TRUE(plan.is_ok()) << plan.status().to_string();
    return plan.is_ok() ? plan->stages.at(0).memory_bytes : 0.0;
  };
  const double last = need(7, transient, 0);
  const double per_byte = (need(7, 2 * transient, 0) - last) / transient;  // the plan's bytes per profiled byte
  ASSERT_GT(per_byte, 0);
  // Placed first, the seven operators after it have freed their half of what they saved.
  EXPECT_NEAR(last - need(0, transient, 0), 7 * 0.5 * saved * per_byte, 1e-6 * last);
  // Kept beyond the saved bytes: as much more for each microbatch in flight (at least one).
  EXPECT_GE(need(7, transient, 3e8) - last, 3e8 * per_byte * (1 - 1e-9));
}

TEST(Planner, PlanDocumentRoundTripsAndSimulatesToItsPrediction) {
  CostGraph g = random_dag(30, 5);
  Cluster cluster = Cluster::uniform(2, 2, 1e9, 1.0, {50e6, 1e-5}, {5e6, 1e-4});
  PlanOptions o;
  o.batch = 32;
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  auto back = Plan::from_json(plan->to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->to_json(), plan->to_json());
  auto sim = back->simulate();
  ASSERT_TRUE(sim.is_ok());
  EXPECT_NEAR(sim->step_time_s, plan->predicted_step_s, 1e-12);
  EXPECT_NE(plan->table().find("predicted step"), std::string::npos);
}

TEST(Planner, PlanDocumentErrorsNameThePath) {
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e3, 1e3);
  Cluster cluster = Cluster::uniform(1, 2, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 4;
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok());
  std::string doc = plan->to_json();
  auto bad = Plan::from_json(doc.substr(0, doc.size() / 2));
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("not valid JSON"), std::string::npos);
  std::string wrong = doc;
  wrong.replace(wrong.find("\"replicas\": "), 13, "\"replicas\": 9");
  auto bad2 = Plan::from_json(wrong);
  ASSERT_FALSE(bad2.is_ok());
  EXPECT_NE(bad2.status().message().find("/stages/"), std::string::npos) << bad2.status().message();
  // A link of no bandwidth priced every transfer as free; a count past the schedule limit
  // allocated until bad_alloc.
  o.ranks = 2;  // two stages: a link between them
  auto piped = make_plan(g, cluster, o);
  ASSERT_TRUE(piped.is_ok()) << piped.status().to_string();
  const auto doc_json = nlohmann::json::parse(piped->to_json());
  ASSERT_FALSE(doc_json["links"].empty());
  auto zero = doc_json;
  zero["links"][0]["bandwidth_bytes_per_s"] = 0;
  auto bad3 = Plan::from_json(zero.dump());
  ASSERT_FALSE(bad3.is_ok());
  EXPECT_NE(bad3.status().message().find("expected a bandwidth > 0"), std::string::npos) << bad3.status().message();
  auto huge = doc_json;
  huge["batch"] = 2147483647;
  huge["microbatches"] = 2147483647;
  auto loaded = Plan::from_json(huge.dump());
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().to_string();
  auto sim = loaded->simulate();
  ASSERT_FALSE(sim.is_ok());
  EXPECT_NE(sim.status().message().find("65536 microbatches"), std::string::npos) << sim.status().message();
}

TEST(Planner, RejectsBadOptions) {
  CostGraph g = uniform_chain(4, 1e-3, 2e-3, 1e3, 1e3);
  Cluster cluster = Cluster::uniform(1, 2, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  EXPECT_EQ(make_plan(g, cluster, o).status().code(), ErrorCode::kInvalidArgument);  // no batch
  o.batch = 4;
  o.microbatches = 8;
  auto r = make_plan(g, cluster, o);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("smaller than the microbatch count"), std::string::npos);
  g.ops[2].group = 1;  // a group that is not convex: 0 and 2 without 1
  g.ops[0].group = 1;
  o.microbatches = 0;
  auto nc = make_plan(g, cluster, o);
  ASSERT_FALSE(nc.is_ok());
  EXPECT_NE(nc.status().message().find("not convex"), std::string::npos) << nc.status().message();
}

// 16 layers of 1 GB (4 GB with gradients and Adam) on 8 devices of 20 GB: no replica holds
// the model, so a plan has several device groups to fold it over under `kind`.
struct FoldedModel {
  CostGraph g = uniform_chain(16, 1e-3, 2e-3, 1e9, 1e5);
  Cluster cluster = Cluster::uniform(1, 8, 20e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  explicit FoldedModel(ScheduleKind kind) {
    o.batch = 32;
    o.microbatches = 16;
    o.schedules = {kind};
  }
};

// A chunked plan simulates to its prediction and keeps its chunks through a JSON round trip.
void expect_consistent(const Plan& plan) {
  auto sim = plan.simulate();
  ASSERT_TRUE(sim.is_ok()) << sim.status().to_string();
  EXPECT_NEAR(sim->step_time_s, plan.predicted_step_s, 1e-12);
  auto back = Plan::from_json(plan.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->schedule, plan.schedule);
  EXPECT_EQ(back->chunks, plan.chunks);
}

TEST(Planner, InterleavedPlansRegroupStagesOntoDeviceGroups) {
  FoldedModel f(ScheduleKind::kInterleaved);
  auto plan = make_plan(f.g, f.cluster, f.o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->schedule, ScheduleKind::kInterleaved);
  ASSERT_GT(plan->chunks, 1);
  const int groups = plan->ranks();
  for (std::size_t k = 0; k < plan->stages.size(); ++k) {
    EXPECT_EQ(plan->stages[k].first_device, plan->stages[k % groups].first_device);
    EXPECT_LE(plan->stages[k].memory_bytes, 20e9);
  }
  expect_consistent(*plan);
  // A plan that cannot be interleaved says so rather than blaming memory.
  Cluster roomy = Cluster::uniform(1, 1, 1e12, 1.0, fast_link(), fast_link());  // one device: one group
  auto none = make_plan(f.g, roomy, f.o);
  ASSERT_FALSE(none.is_ok());
  EXPECT_EQ(none.status().code(), ErrorCode::kUnsupported) << none.status().to_string();
}

// A plan of `kind` for f's model holds two pieces per device group in a V: the model down
// the groups and back up, within the devices' memory.
Result<Plan> v_shaped_plan(const FoldedModel& f, ScheduleKind kind) {
  auto plan = make_plan(f.g, f.cluster, f.o);
  if (!plan.is_ok()) return plan;
  EXPECT_EQ(plan->schedule, kind);
  EXPECT_EQ(plan->chunks, 2);
  const int groups = plan->ranks();
  EXPECT_GE(groups, 2) << plan->table();
  for (int k = 0; k < groups && plan->chunks == 2; ++k) {
    const auto& down = plan->stages[k];
    const auto& up = plan->stages[2 * groups - 1 - k];
    EXPECT_EQ(down.first_device, up.first_device) << plan->table();
    EXPECT_EQ(down.replicas, up.replicas);
    EXPECT_LE(down.memory_bytes, 20e9);
  }
  expect_consistent(*plan);
  return plan;
}

TEST(Planner, ZeroBubbleVPlansHoldTwoPiecesPerGroupInAV) {
  FoldedModel f(ScheduleKind::kZeroBubbleV);
  auto plan = v_shaped_plan(f, ScheduleKind::kZeroBubbleV);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  std::string three = plan->to_json();
  const std::string two = "\"chunks\": 2";
  ASSERT_NE(three.find(two), std::string::npos) << three;
  three.replace(three.find(two), two.size(), "\"chunks\": 4");
  auto bad = Plan::from_json(three);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("ZB-V"), std::string::npos) << bad.status().message();
  // Among every schedule the simulated step decides: never slower than ZB-V alone.
  f.o.schedules.clear();
  auto any = make_plan(f.g, f.cluster, f.o);
  ASSERT_TRUE(any.is_ok()) << any.status().to_string();
  EXPECT_LE(any->predicted_step_s, plan->predicted_step_s + 1e-12);
}

TEST(Planner, DualPipeVPlansAreVsWithTwoMicrobatchesPerStage) {
  FoldedModel f(ScheduleKind::kDualPipeV);
  auto plan = v_shaped_plan(f, ScheduleKind::kDualPipeV);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_GE(plan->microbatches, 2 * plan->ranks());
  EXPECT_NE(plan->table().find("dualpipev"), std::string::npos) << plan->table();
  // Fewer microbatches than stages: no DualPipeV plan, and the error says what it needs.
  f.o.microbatches = 2;
  auto few = make_plan(f.g, f.cluster, f.o);
  ASSERT_FALSE(few.is_ok());
  EXPECT_NE(few.status().message().find("DualPipeV needs"), std::string::npos) << few.status().message();
}

TEST(Planner, ATiedParameterIsHeldOnceByTheRankWhoseStagesShareIt) {
  // The last layer reads the first layer's weight too (GPT-2's tied embedding and head). In
  // a V the first rank holds both stages and the weight once; in a plain pipeline the first
  // and the last rank each hold it.
  auto held = [](const CostGraph& g, const Plan& plan, int rank) {
    std::set<int> params;
    double static_bytes = 0;
    for (int s : plan.schedule_spec().stages_of_rank(rank)) {
      static_bytes += plan.stages[s].static_bytes;
      for (int op : plan.stages[s].ops) params.insert(g.ops[op].params.begin(), g.ops[op].params.end());
    }
    double bytes = 0;
    for (int q : params) bytes += g.params[q].bytes;
    return std::pair{static_bytes, bytes * (2 + 2)};  // weights, gradients, Adam's two states
  };
  FoldedModel f(ScheduleKind::kZeroBubbleV);
  f.g.ops.back().params.push_back(0);
  auto v = make_plan(f.g, f.cluster, f.o);
  ASSERT_TRUE(v.is_ok()) << v.status().to_string();
  ASSERT_EQ(v->chunks, 2);
  for (int r = 0; r < v->ranks(); ++r) {
    const auto [planned, once] = held(f.g, *v, r);
    EXPECT_DOUBLE_EQ(planned, once) << "rank " << r << "\n" << v->table();
  }
  // Each rank makes each of its parameters' gradients once, the tied one with its last stage
  // (whose backward runs first in the step).
  const auto spec = v->schedule_spec();
  for (int r = 0; r < v->ranks(); ++r) {
    double grads = 0;
    for (int s : spec.stages_of_rank(r)) grads += v->stages[s].weight_grad_bytes;
    EXPECT_DOUBLE_EQ(grads, held(f.g, *v, r).second / 4) << "rank " << r;
  }
  const int last_stage = static_cast<int>(v->stages.size()) - 1;
  ASSERT_EQ(spec.rank_of_stage(last_stage), 0);
  double last_reads = 0;
  for (int op : v->stages[last_stage].ops) {
    for (int q : f.g.ops[op].params) last_reads += f.g.params[q].bytes;
  }
  EXPECT_DOUBLE_EQ(v->stages[last_stage].weight_grad_bytes, last_reads);
  const auto [first_rank, _] = held(f.g, *v, 0);
  f.o.schedules = {ScheduleKind::kOneFOneB};
  auto plain = make_plan(f.g, f.cluster, f.o);
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  const int last = plain->ranks() - 1;
  ASSERT_GE(last, 1);
  EXPECT_DOUBLE_EQ(held(f.g, *plain, 0).first, held(f.g, *plain, 0).second);
  EXPECT_DOUBLE_EQ(held(f.g, *plain, last).first, held(f.g, *plain, last).second);
  EXPECT_GT(first_rank, 0);
}

// 1F1B on 4 ranks of one replica, 8 microbatches of `batch` samples in all.
PlanOptions four_ranks_of_1f1b(int batch) {
  PlanOptions o;
  o.batch = batch;
  o.microbatches = 8;
  o.ranks = 4;
  o.replicas = {1};
  o.schedules = {ScheduleKind::kOneFOneB};
  return o;
}

TEST(Planner, AStageHoldsAValueItSendsOnAndSavesOnce) {
  // Each layer saves its own output (a ReLU's backward reads it): a stage keeps its last
  // layer's output once for its backward and for the next stage, not as saved and as sent.
  // Without knowing who saves a value, the plan counts it twice.
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  Cluster roomy = Cluster::uniform(1, 4, 1e12, 1.0, fast_link(), fast_link());
  const PlanOptions o = four_ranks_of_1f1b(8);
  auto unknown = make_plan(g, roomy, o);
  for (std::size_t v = 0; v < g.values.size(); ++v) g.values[v].saved_by = g.values[v].producer;
  auto known = make_plan(g, roomy, o);
  ASSERT_TRUE(unknown.is_ok() && known.is_ok()) << unknown.status().to_string() << known.status().to_string();
  for (std::size_t s = 0; s < known->stages.size(); ++s) {
    ASSERT_EQ(known->stages[s].ops, unknown->stages[s].ops);
    const double layers = static_cast<double>(known->stages[s].ops.size());
    const bool sends = s + 1 < known->stages.size();
    EXPECT_DOUBLE_EQ(unknown->stages[s].saved_bytes, (layers + (sends ? 1 : 0)) * 1e6) << "stage " << s;
    EXPECT_DOUBLE_EQ(known->stages[s].saved_bytes, layers * 1e6) << "stage " << s;
  }
  EXPECT_LT(known->stages[0].memory_bytes, unknown->stages[0].memory_bytes);
}

TEST(Planner, ASplitBackwardsMemoryIsWhatItsScheduleKeeps) {
  // ZB-H1 keeps a microbatch's activations until its W, later than 1F1B's B: on the same
  // stages its first rank holds more at once, and the plan says so (the simulated peak).
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e6, 1e6);
  for (auto& op : g.ops) op.backward_weight_s = 1e-3;
  Cluster roomy = Cluster::uniform(1, 4, 1e12, 1.0, fast_link(), fast_link());
  PlanOptions o = four_ranks_of_1f1b(16);
  auto ofob = make_plan(g, roomy, o);
  o.schedules = {ScheduleKind::kZeroBubbleH1};
  auto zb = make_plan(g, roomy, o);
  ASSERT_TRUE(ofob.is_ok() && zb.is_ok()) << ofob.status().to_string() << zb.status().to_string();
  auto sim = zb->simulate();
  ASSERT_TRUE(sim.is_ok());
  EXPECT_GT(zb->stages[0].memory_bytes, ofob->stages[0].memory_bytes);
  EXPECT_GE(zb->stages[0].memory_bytes, sim->peak_bytes[0]);
  // Memory between the two: ZB-H1 does not fit where 1F1B does, and the error says why.
  const double between = (zb->stages[0].memory_bytes + ofob->stages[0].memory_bytes) / 2;
  Cluster tight = Cluster::uniform(1, 4, between, 1.0, fast_link(), fast_link());
  o.recompute = Recomputation::kNone;
  auto refused = make_plan(g, tight, o);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kDoesNotFit);
  EXPECT_NE(refused.status().message().find("weight-gradient pass"), std::string::npos) << refused.status().message();
  o.schedules = {ScheduleKind::kOneFOneB, ScheduleKind::kZeroBubbleH1};
  auto either = make_plan(g, tight, o);
  ASSERT_TRUE(either.is_ok()) << either.status().to_string();
  EXPECT_EQ(either->schedule, ScheduleKind::kOneFOneB);
}

TEST(Planner, PrefersPipelinesWhenReplicasCannotHoldTheModel) {
  // 8 layers of 1 GB weights on 4 devices of 10 GB: a replica holds at most 2 layers.
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e9, 1e5);
  Cluster cluster = Cluster::uniform(1, 4, 10e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 16;
  auto plan = make_plan(g, cluster, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().to_string();
  EXPECT_EQ(plan->ranks(), 4) << plan->table();  // four device groups (ZB-V folds 8 stages over them)
  for (const auto& s : plan->stages) EXPECT_LE(s.memory_bytes, 10e9);
}

TEST(Planner, OperatorsFixedCostPlansFewerLargerMicrobatches) {
  // Four stages' bubble shrinks with more microbatches; priced in proportion to the samples,
  // that is free, and the plan splits the batch into as many as it may. With most of each
  // operator's time fixed (a CPU's weights read whatever the samples), the plan keeps them
  // large, and each microbatch's time is the fixed part and its share of the rest.
  CostGraph g = uniform_chain(16, 1e-3, 2e-3, 1e3, 1e3);
  g.microbatch = 16;
  const Cluster cluster = Cluster::uniform(1, 4, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 256;
  o.max_replicas = 1;
  auto in_proportion = make_plan(g, cluster, o);
  ASSERT_TRUE(in_proportion.is_ok()) << in_proportion.status().to_string();
  EXPECT_GE(in_proportion->microbatches, 32) << in_proportion->table();
  g.fixed_fraction = 0.6;
  auto with_fixed = make_plan(g, cluster, o);
  ASSERT_TRUE(with_fixed.is_ok()) << with_fixed.status().to_string();
  EXPECT_LE(with_fixed->microbatches, 16) << with_fixed->table();
  EXPECT_LT(with_fixed->microbatches, in_proportion->microbatches);
  const double k = static_cast<double>(o.batch) / with_fixed->microbatches / g.microbatch;
  double forward = 0;
  for (const auto& s : with_fixed->stages) forward += s.forward_s;
  EXPECT_NEAR(forward, 16 * 1e-3 * (0.6 + 0.4 * k), 1e-9) << with_fixed->table();
  auto back = CostGraph::from_json(g.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_DOUBLE_EQ(back->fixed_fraction, 0.6);
  g.fixed_fraction = 1.5;
  EXPECT_FALSE(g.validate().is_ok());
}

TEST(Planner, EveryReplicaKeepsTheSamplesTheModelRunsAtOnce) {
  // Light layers on fast links: without a bound the plan replicates down to a sample or two.
  CostGraph g = uniform_chain(8, 1e-3, 2e-3, 1e3, 1e3);
  Cluster cluster = Cluster::uniform(1, 4, 1e9, 1.0, fast_link(), fast_link());
  PlanOptions o;
  o.batch = 8;
  auto smallest_share = [&](const Plan& p) {
    int least = o.batch;
    for (const auto& s : p.stages) least = std::min(least, o.batch / p.microbatches / s.replicas);
    return least;
  };
  auto free = make_plan(g, cluster, o);
  ASSERT_TRUE(free.is_ok()) << free.status().to_string();
  ASSERT_LT(smallest_share(*free), 4) << free->table();  // the bound below changes the plan
  g.min_share = 4;
  auto bound = make_plan(g, cluster, o);
  ASSERT_TRUE(bound.is_ok()) << bound.status().to_string();
  EXPECT_GE(smallest_share(*bound), 4) << bound->table();
  auto back = CostGraph::from_json(g.to_json());
  ASSERT_TRUE(back.is_ok()) << back.status().to_string();
  EXPECT_EQ(back->min_share, 4);
  // Asked microbatches that split below the bound, or a batch below it: errors naming both.
  o.microbatches = 4;
  auto split = make_plan(g, cluster, o);
  ASSERT_FALSE(split.is_ok());
  EXPECT_NE(split.status().message().find("use at most 2 microbatches"), std::string::npos) << split.status().message();
  o.microbatches = 0;
  o.batch = 2;
  auto tiny = make_plan(g, cluster, o);
  ASSERT_FALSE(tiny.is_ok());
  EXPECT_NE(tiny.status().message().find("batch of at least 4"), std::string::npos) << tiny.status().message();
}

}  // namespace
}  // namespace conveyor::partitioner
