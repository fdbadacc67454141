// The cost model of one stage (docs/planner.md): its compute, transfer, allreduce and memory
// on a range of devices, and a searched solution's score.
// Internal to the planner (partitioner/planner.cc and its searches): namespace detail.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/shares.h"
#include "partitioner/search_space.h"

namespace conveyor::partitioner::detail {

/// The cost model of one stage (docs/planner.md).

/// A stage's summed costs at profile size.
struct StageSums {
  double fwd = 0, bwd = 0, bwd_w = 0, saved = 0, params = 0, work = 0;
  double in_bytes = 0, out_bytes = 0;  // cut bytes before and after the stage, at profile size
  double sel_fwd = 0, sel_freed = 0;   // selective recomputation: forward again, bytes freed (net: Unit)
  // Selective recomputation's largest transient (a unit's, or its run's: Unit::sel_work)
  // less what the microbatch in its backward has freed by then (the saved bytes of the units
  // after it).
  double sel_live_work = 0;
  double saved_w = 0;                  // what a split backward keeps from Bi to W (Unit::saved_w)
  double grads_w = 0;                  // of that, the gradients Bi captures (Unit::grads_w)

  /// The forward time `r` pays again before the backward.
  double forward_again(Recomputation r) const {
    return r == Recomputation::kFull ? fwd : r == Recomputation::kSelective ? sel_fwd : 0;
  }
  /// What each microbatch in flight keeps from its forward to its backward under `r`.
  double kept(Recomputation r) const {
    return r == Recomputation::kFull ? in_bytes : r == Recomputation::kSelective ? saved - sel_freed : saved;
  }
};

/// The work of a stage's split backward done at W, of its operators' backward `bwd` and their
/// weight-gradient part `bwd_w`: a stage that reads nothing from another (the first) has no
/// input gradient to compute, so all of it (measured on GPT-2: 0.1 ms for the input half, the
/// whole 21 ms at W), in time as in memory (plan_rows.cc's stage_plan).
inline double weight_half(double bwd, double bwd_w, bool reads_another) { return reads_another ? bwd_w : bwd; }

/// A stage on a range of devices: its times and its memory.
struct StageEval {
  double compute = 0;    // (F + B) per microbatch
  double comm = 0;       // activation and gradient across the cut after the stage
  double allreduce = 0;
  double optimizer = 0;  // the optimizer's update of its parameters, on its slowest replica
  double need = 0;       // bytes per device: static + activations in flight + transient
  double static_bytes = 0;     // per device: weights, gradients, optimizer state
  // per device, while its backward runs: working memory and what a recomputing stage holds again
  double backward_extra_bytes = 0;
  double capacity = 0;   // the smallest memory among the stage's devices
  double speed = 0;          // of the shares: one over the slowest share's time (Model::speed)
  double time_per_work = 0;  // Model::time_per_work
  double max_share = 1;
  int in_flight = 0;
  Recomputation recompute = Recomputation::kNone;  // compute includes what it runs again
  bool fits() const { return need <= capacity; }
  /// What the stage adds after its last backward: its gradient sum, then the optimizer's step.
  double tail() const { return allreduce + optimizer; }
};

/// The cost model for one microbatch count and schedule (docs/planner.md).
class Model {
 public:
  /// `costs` gives the profile's microbatch, the least share and the fixed fraction.
  Model(const Cluster& cluster, const PlanOptions& options, int microbatches, ScheduleKind kind, const CostGraph& costs,
        double memory_override = 0)
      : cluster_(cluster), options_(options), m_(microbatches), kind_(kind), memory_override_(memory_override) {
    n_ = static_cast<int>(cluster.devices.size());
    // Replicas split a microbatch evenly: each must keep at least `min_share` samples.
    max_replicas_ = std::max(1, (options.batch / microbatches) / std::max(1, costs.min_share));
    if (options.max_replicas > 0) max_replicas_ = std::min(max_replicas_, options.max_replicas);
    scale_ = (static_cast<double>(options.batch) / microbatches) / costs.microbatch;
    fixed_ = costs.fixed_fraction;  // within [0, 1] (CostGraph::validate)
    speed_prefix_.assign(static_cast<std::size_t>(n_) + 1, 0);
    std::vector<double> mem(n_), speed(n_);
    for (int d = 0; d < n_; ++d) {
      speed_prefix_[d + 1] = speed_prefix_[d] + cluster.devices[d].speed;
      mem[d] = cluster.devices[d].memory_bytes;
      speed[d] = cluster.devices[d].speed;
    }
    min_memory_.build(mem, true);
    max_speed_.build(speed, false);
    min_speed_.build(speed, true);
  }

  int devices() const { return n_; }
  const PlanOptions& options() const { return options_; }
  int max_replicas() const { return max_replicas_; }
  int microbatches() const { return m_; }
  ScheduleKind kind() const { return kind_; }
  /// A microbatch's samples over the profile's: what its bytes are scaled by.
  double scale() const { return scale_; }
  /// Of the time measured for the profile's microbatch, the least a microbatch's computing
  /// takes summed over replicas (each pays the fixed part at least once): the work that
  /// bounds a search from below.
  double work_scale() const { return fixed_ + (1 - fixed_) * scale_; }
  /// A stage's time per microbatch on devices [first, first + r), per second of its work
  /// measured at the profile's microbatch: its slowest replica's, each replica paying the
  /// fixed part whole and its share of the rest, at its device's speed.
  double time_per_work(int first, int r) const {
    if (options_.even_shares || alike(first, r)) return (fixed_ + (1 - fixed_) * scale_ / r) / min_speed_.query(first, r);
    return weighted(first, r).time_per_work;
  }
  /// The speed of a stage on devices [first, first + r): with even shares r times the
  /// slowest's (every replica waits for it); else, shares weighted by speed in whole samples
  /// (common/shares.h, as the runtime splits), one over the slowest share's time.
  double speed(int first, int r) const {
    if (options_.even_shares || alike(first, r)) return r * min_speed_.query(first, r);
    return weighted(first, r).speed;
  }
  /// The devices' speeds summed: no stage on some of them runs faster.
  double total_speed(int first, int r) const { return speed_prefix_[first + r] - speed_prefix_[first]; }
  /// The largest share of a microbatch one of those devices takes.
  double max_share(int first, int r) const {
    if (options_.even_shares || alike(first, r)) return 1.0 / r;
    return weighted(first, r).max_share;
  }
  /// Each device's share of a microbatch (fractions summing to 1), as the runtime splits it.
  std::vector<double> shares(int first, int r) const {
    if (options_.even_shares || alike(first, r)) return std::vector<double>(static_cast<std::size_t>(r), 1.0 / r);
    return weighted(first, r).shares;
  }

  /// Whether stages on devices [first_a, first_a + r_a) and [first_b, first_b + r_b) split
  /// a microbatch alike (as many replicas, the same shares), so that a value with no plain
  /// batch dimension may pass between them (runtime/batch_layout.h).
  bool splits_alike(int first_a, int r_a, int first_b, int r_b) const {
    return r_a == r_b && (r_a == 1 || shares(first_a, r_a) == shares(first_b, r_b));
  }

  /// How many stage counts the searches tell apart: exactly 0..ranks when the ranks are
  /// fixed (a plan must end at `ranks`), else up to what changes the activations in flight.
  int stage_states() const {
    if (options_.ranks > 0) return options_.ranks + 1;
    return kind_ == ScheduleKind::kGPipe ? 1 : std::max(1, std::min(m_, n_));
  }
  /// Whether a search that has placed `j` stages (from the last) may place another.
  bool may_add_stage(int j) const { return options_.ranks <= 0 || j < options_.ranks; }
  /// The replica counts [lo, hi] the stage placed after `j` others (from the last) may take on
  /// at most `devices_left` devices; lo > hi when none.
  std::pair<int, int> replica_range(int j, int devices_left) const {
    const int hi = std::min(devices_left, max_replicas_);
    const auto& fixed = options_.replicas;
    if (fixed.empty()) return {1, hi};
    const int r = fixed.size() == 1 ? fixed[0] : fixed[static_cast<std::size_t>(options_.ranks - 1 - j)];
    return r <= hi ? std::pair{r, r} : std::pair{1, 0};
  }

  int in_flight(int stages_after) const {
    return kind_ == ScheduleKind::kGPipe ? m_ : std::min(m_, stages_after + 1);
  }

  double comm_time(double out_bytes, int last_device, int r) const {
    if (last_device + 1 >= n_ || out_bytes <= 0) return 0;
    const Link& l = cluster_.link(last_device, last_device + 1);
    double t = l.latency_s + (l.bandwidth_bytes_per_s > 0 ? out_bytes * scale_ / (l.bandwidth_bytes_per_s * r) : 0);
    return 2 * t;  // the activation forward, its gradient back
  }

  /// A ring allreduce of `param_bytes` over devices [first, first + r) (0 for one replica).
  double allreduce_time(double param_bytes, int first, int r) const {
    if (r <= 1) return 0;
    const Link& l = cluster_.same_node(first, first + r - 1) ? cluster_.intra_node : cluster_.inter_node;
    const double ring = 2.0 * (r - 1) / r;
    return ring * (l.bandwidth_bytes_per_s > 0 ? param_bytes / l.bandwidth_bytes_per_s : 0) + 2.0 * (r - 1) * l.latency_s;
  }

  /// The optimizer's step over `param_bytes` on each of devices [first, first + r): each
  /// updates them whole, so the slowest device's time.
  double optimizer_time(double param_bytes, int first, int r) const {
    return options_.optimizer_s_per_param_byte * param_bytes / min_speed_.query(first, r);
  }

  /// The stage as it runs: as the options fix its recomputation for every stage, or, where
  /// they leave it to the planner, keeping its activations, else recomputing them the
  /// cheapest way first (selective, then full) where it would not fit otherwise (every search
  /// prices it so).
  StageEval eval(const StageSums& s, int first, int r, int stages_after, bool has_next) const {
    using M = Recomputation;
    if (options_.recompute) return eval_as(s, first, r, stages_after, has_next, *options_.recompute);
    StageEval e = eval_as(s, first, r, stages_after, has_next, M::kNone);
    if (e.fits()) return e;
    if (s.sel_freed > 0) {
      StageEval selective = eval_as(s, first, r, stages_after, has_next, M::kSelective);
      if (selective.fits()) return selective;
    }
    StageEval again = eval_as(s, first, r, stages_after, has_next, M::kFull);
    return again.fits() ? again : e;
  }

  /// One way of running the stage. Recomputing, each microbatch in flight keeps less (full:
  /// the stage's inputs only; selective: all but what the cheap operators saved), and the
  /// one in its backward what was dropped again; that forward is paid twice.
  StageEval eval_as(const StageSums& s, int first, int r, int stages_after, bool has_next,
                    Recomputation recompute) const {
    StageEval e;
    e.recompute = recompute;
    e.speed = speed(first, r);
    e.time_per_work = time_per_work(first, r);
    e.max_share = max_share(first, r);
    e.compute = (s.fwd + s.forward_again(recompute) + s.bwd) * e.time_per_work + 2 * options_.action_overhead_s;
    e.comm = has_next ? comm_time(s.out_bytes, first + r - 1, r) : 0;
    e.allreduce = allreduce_time(s.params, first, r);
    e.optimizer = optimizer_time(s.params, first, r);
    e.in_flight = in_flight(stages_after);
    e.static_bytes = s.params * (2 + options_.optimizer_bytes_per_param_byte);
    // Kept per microbatch in flight: its activations (recomputing: its inputs) and its
    // outputs, which stay until its backward; working memory: the largest unit's backward.
    // Values between stages are the same tensors on both sides in a process, and a
    // message's buffer becomes the received value, so no transfer buffer is added.
    // Recomputing selectively, a run's backward holds every value it makes again with their
    // gradients, less what the microbatch has freed by then (StageSums::sel_live_work).
    const double transient = (recompute == Recomputation::kSelective ? s.sel_live_work : s.work) * scale_ * e.max_share;
    const double each = s.kept(recompute) + s.out_bytes;
    // The microbatch in its backward holds again what its forward dropped: all of it when
    // the whole forward runs again; recomputing selectively, one run's at a time, which the
    // run's transient (sel_live_work) holds.
    const double again = recompute == Recomputation::kFull ? s.saved : 0;
    const double kept = e.in_flight * each + again;
    e.need = e.static_bytes + kept * scale_ * e.max_share + transient;
    e.backward_extra_bytes = again * scale_ * e.max_share + transient;
    e.capacity = memory_override_ > 0 ? memory_override_ : min_memory_.query(first, r);
    return e;
  }

  /// `max_tail`: the largest of the stages' tails (StageEval::tail).
  double objective(double sum, double max_stage, double max_tail) const {
    return sum + (m_ - 1) * max_stage + max_tail;
  }

 private:
  bool alike(int first, int r) const { return min_speed_.query(first, r) == max_speed_.query(first, r); }
  struct Weighted {
    double speed = 0, max_share = 0, time_per_work = 0;
    std::vector<double> shares;
  };
  // Devices of different speeds sharing a microbatch of the plan's size in whole samples.
  const Weighted& weighted(int first, int r) const {
    auto [it, fresh] = weighted_.try_emplace(static_cast<long long>(first) * (n_ + 1) + r);
    if (!fresh) return it->second;
    const std::int64_t samples = std::max<std::int64_t>(1, options_.batch / m_);
    std::vector<double> speeds(static_cast<std::size_t>(r));
    for (int i = 0; i < r; ++i) speeds[i] = cluster_.devices[first + i].speed;
    const std::vector<std::int64_t> lengths = share_lengths(samples, speeds, r);
    double slowest = 0;  // the longest share's time per microbatch, in microbatch-work at speed 1
    for (int i = 0; i < r; ++i) {
      const double share = static_cast<double>(lengths[i]) / static_cast<double>(samples);
      it->second.shares.push_back(share);
      it->second.max_share = std::max(it->second.max_share, share);
      slowest = std::max(slowest, share / speeds[i]);
      it->second.time_per_work = std::max(it->second.time_per_work, (fixed_ + (1 - fixed_) * scale_ * share) / speeds[i]);
    }
    it->second.speed = 1.0 / slowest;
    return it->second;
  }

  const Cluster& cluster_;
  const PlanOptions& options_;
  int m_;
  ScheduleKind kind_;
  double memory_override_;
  int max_replicas_ = 1;
  int n_ = 0;
  double scale_ = 1;
  double fixed_ = 0;  // CostGraph::fixed_fraction
  std::vector<double> speed_prefix_;
  RangeTable min_memory_, max_speed_, min_speed_;
  mutable std::unordered_map<long long, Weighted> weighted_;  // by (first, r)
};

StageSums stage_sums(const Units& u, const CutStates& cs, int outer, int inner);

/// A searched pipeline: stages as (outer, inner) cut states, pipeline order, and replicas.
struct Solution {
  std::vector<std::pair<int, int>> cuts;  // (inner, outer): the stage is outer \ inner
  std::vector<int> replicas;
  double objective = kInf;
};

/// Scores a solution exactly as the searches do (used to report and to cross-check).
Result<double> score(const Units& u, const CutStates& cs, const Model& model, const Solution& sol,
                     std::vector<StageEval>* evals = nullptr);

}  // namespace conveyor::partitioner::detail
