// The planner: from a cost graph and a cluster to a pipeline plan (stages, replicas per
// stage, placement, microbatches, schedule) that fits memory and minimizes the step time.
// Torch-free. The search and the cost model are described in docs/planner.md.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/recomputation.h"
#include "common/status.h"
#include "partitioner/cluster.h"
#include "partitioner/cost_graph.h"
#include "scheduler/schedule.h"
#include "scheduler/simulator.h"

namespace conveyor::partitioner {

/// Which search the planner runs.
enum class SearchMode : std::uint8_t {
  kAuto,        ///< exact when its work fits `exact_budget`, else bottleneck
  kExact,       ///< Pareto DP over all convex stages (downsets, or block prefixes when too many)
  kBottleneck,  ///< bisection on the slowest stage over block prefixes (large problems)
};

/// What the planner may choose and within which limits.
struct PlanOptions {
  int batch = 0;           ///< samples per training step (required)
  int microbatches = 0;    ///< 0: the planner chooses
  int max_microbatches = 64;
  int max_replicas = 0;    ///< replicas per stage at most (0: no limit)
  /// Fixed parts of the plan; the planner chooses the rest (docs/planner.md, "Fixed parts").
  /// Pipeline ranks (device groups) the plan has exactly; 0: the planner chooses.
  int ranks = 0;
  /// Replicas of every stage (one count) or of each rank in order (one per rank); empty:
  /// the planner chooses each stage's.
  std::vector<int> replicas;
  /// Interleaved: stages per device group; 0: the planner tries 2, 3 and 4.
  int chunks = 0;
  /// Schedules to consider; empty: gpipe, 1f1b, interleaved and zb-h1.
  std::vector<scheduler::ScheduleKind> schedules;
  /// Optimizer state per parameter byte (Adam keeps two moments: 2; SGD with momentum: 1).
  double optimizer_bytes_per_param_byte = 2;
  /// Replicas split each microbatch evenly (as conveyor's runtime does): a stage runs at
  /// its replica count times its slowest device's speed. Off: shares proportional to the
  /// devices' speeds (the plan's `shares`), a stage at the sum of their speeds.
  bool even_shares = false;
  /// What the runtime spends per action beyond the operators' time (dispatch, messages, the
  /// host), added to each stage's forward and backward per microbatch: with it the planner
  /// weighs more microbatches (a smaller bubble) against more actions. Re-planning measures it.
  double action_overhead_s = 0;
  /// The optimizer's step, in seconds per byte of the parameters it updates on a device of
  /// speed 1: every replica of a stage updates the stage's parameters whole after the step's
  /// gradient sum, so a stage's tail is its sum and then this over its slowest replica
  /// (its shares do not shrink it). Re-planning measures it (0: not priced).
  double optimizer_s_per_param_byte = 0;
  /// Activation recomputation (common/recomputation.h): selective (the cheap operators'
  /// forward again; their activations are not kept) or full (a stage keeps only its inputs
  /// and runs its whole forward again: a forward more of time, one microbatch's activations
  /// of memory). Set: every stage recomputes so (kNone: no stage recomputes). Unset, the
  /// planner chooses per stage: it keeps everything where that fits, else recomputes
  /// selectively where that fits, else fully.
  std::optional<Recomputation> recompute;
  SearchMode search = SearchMode::kAuto;
  /// After an exact search: enumerate, by branch and bound, every plan of the same space whose
  /// simulated step could beat the analytic optimum's, and return the simulator's best
  /// (docs/planner.md). Off: the analytic optimum as found.
  bool simulated_search = true;
  long long simulated_budget = 3000000;  ///< stages the branch and bound may try
  /// Seconds the simulated searches may take together, over every microbatch count and
  /// memory model (0: no limit). Each gets an equal share of what is left when it starts;
  /// one that reaches its share returns the best plan it found so far, and the plan's
  /// `search` says so. The analytic searches before them are bounded by `exact_budget`.
  double time_budget_s = 30;
  /// Called after each microbatch count and memory model is searched: how many of how many,
  /// and the best analytic step time found so far (infinity: none fits yet).
  std::function<void(int done, int total, double best_objective_s)> progress;
  int max_downsets = 1500;   ///< more convex cut states than this: stages cut a linear order of blocks
  int max_blocks = 192;      ///< blocks of that linear order
  double exact_budget = 3e7; ///< transitions the exact search may take before bottleneck search is used
};

/// One stage of a plan: its operators and the consecutive devices its replicas run on.
struct StagePlan {
  std::vector<int> ops;            ///< cost-graph operator ids (captured graphs: node ids)
  int first_device = 0;
  int replicas = 1;
  std::vector<double> shares;      ///< share of each microbatch per replica (proportional to speed)
  // Per microbatch, replicas working in parallel on their shares:
  double forward_s = 0, backward_s = 0, backward_weight_s = 0;
  double send_bytes = 0;           ///< activations to the next stage (whole microbatch)
  double recv_bytes = 0;           ///< activations from the previous stage (whole microbatch)
  double allreduce_s = 0;          ///< per step, gradient reduction across replicas
  double optimizer_s = 0;          ///< per step, the optimizer's update on its slowest replica
  double param_bytes = 0;
  double static_bytes = 0;         ///< per device: parameters, gradients, optimizer state
  /// Of its rank's static_bytes, the parameters' gradients this stage makes first (the rank's
  /// last stage that reads the parameter): held from its first backward on (StageCost).
  double weight_grad_bytes = 0;
  double saved_bytes = 0;          ///< per device and microbatch in flight
  /// Of saved_bytes, what a split backward's Bi frees: all but the weight gradients' factors
  /// (what the operators that read parameters saved, and the gradients of their outputs),
  /// which stay until its W.
  double input_freed_bytes = 0;
  /// The gradients a split backward's Bi captures for its W (at the outputs of the operators
  /// that read parameters); Bi makes them before it frees anything, so it peaks this much
  /// above what was held when it began. 0 for a first stage (its Bi computes nothing).
  double captured_bytes = 0;
  /// What its whole backward (B) holds while it runs beyond what is kept (working memory,
  /// and a recomputing stage's forward run again): the simulator adds it at each B. The
  /// units run last to first, each freeing what it saved, so a unit's working memory comes
  /// on top of what the units before it keep.
  double backward_extra_bytes = 0;
  /// The same for a split backward's Bi and W, which keep everything until W: the largest
  /// unit's working memory on all of it.
  double split_backward_extra_bytes = 0;
  double memory_bytes = 0;         ///< predicted peak per device
  int in_flight = 0;               ///< microbatches whose activations are alive at once
  /// What it recomputes before the backward; backward_s includes that forward again.
  Recomputation recompute = Recomputation::kNone;
};

/// A plan: stages, replicas and devices, schedule and microbatches, with its predictions.
struct Plan {
  std::string graph_name, cluster_name;
  int batch = 0, microbatches = 1;
  scheduler::ScheduleKind schedule = scheduler::ScheduleKind::kOneFOneB;
  int chunks = 1;                  ///< interleaved: stages per device group
  std::vector<Device> devices;     ///< the cluster's devices, so a plan file stands alone
  std::vector<StagePlan> stages;
  std::vector<Link> links;         ///< between stage k and k + 1
  double objective_s = 0;          ///< the analytic step time the search minimized
  double predicted_step_s = 0;     ///< the simulated step time of the schedule
  double bubble_fraction = 0;
  std::string search;              ///< how the plan was found
  double search_seconds = 0;

  /// Device groups (pipeline ranks): stages, or stages / chunks when interleaved.
  int ranks() const { return static_cast<int>(stages.size()) / chunks; }
  scheduler::ScheduleSpec schedule_spec() const;
  std::vector<scheduler::StageCost> stage_costs() const;
  std::vector<scheduler::LinkCost> link_costs() const;
  Result<scheduler::SimulationResult> simulate() const;
  /// The same, for a pipeline built from this plan: an error naming both when `built`
  /// (schedule, ranks, chunks, microbatches) is not the plan's.
  Result<scheduler::SimulationResult> simulate_as_built(const scheduler::ScheduleSpec& built) const;
  /// The readable table `conveyor plan` prints.
  std::string table() const;
  std::string to_json() const;
  static Result<Plan> from_json(std::string_view text);
};

Result<Plan> load_plan(const std::string& path);

/// Plans `graph` on `cluster`. Errors: kInvalidArgument for bad options, kDoesNotFit when no
/// plan fits memory (the message gives the smallest memory per device that would work).
Result<Plan> make_plan(const CostGraph& graph, const Cluster& cluster, const PlanOptions& options);

/// A plan to score with the analytic model: ordered stages of operator ids on consecutive
/// devices ending at the cluster's last device, `replicas[s]` devices for stage s.
struct Candidate {
  std::vector<std::vector<int>> stages;
  std::vector<int> replicas;
  int microbatches = 1;
  scheduler::ScheduleKind schedule = scheduler::ScheduleKind::kOneFOneB;
};

/// The analytic step time the search minimizes (docs/planner.md). Errors when the candidate
/// is not a valid partition or does not fit memory. Used by tests against the search.
Result<double> candidate_objective(const CostGraph& graph, const Cluster& cluster, const PlanOptions& options,
                                   const Candidate& candidate);

/// The plan of a given candidate (not interleaved), with its objective and simulated step:
/// how the planner prices a split made elsewhere (by hand, by brute force).
Result<Plan> plan_candidate(const CostGraph& graph, const Cluster& cluster, const PlanOptions& options,
                            const Candidate& candidate);

}  // namespace conveyor::partitioner
