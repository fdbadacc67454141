// A running plan's planning inputs corrected by what its stages measured (the live profile):
// the first step of re-planning (docs/planner.md, "Re-planning"). The planner then plans
// again on the corrected costs and devices. Torch-free.
#pragma once

#include <vector>

#include "common/status.h"
#include "partitioner/cluster.h"
#include "partitioner/cost_graph.h"
#include "partitioner/planner.h"

namespace conveyor::partitioner {

/// What one stage of a running plan measured, per microbatch (its slowest replica's time,
/// as the live profile reports it): forward, backward (the input half under split-backward
/// schedules) and the weight gradient (0 unless the backward is split); and per replica its
/// own compute (F + B + W) per microbatch, when known (empty: every replica as the stage).
struct StageMeasurement {
  double forward_s = 0, backward_s = 0, backward_weight_s = 0;
  std::vector<double> replica_compute_s;
  /// The mean time of one of its transfers to a neighbouring stage (activation or gradient;
  /// 0: none measured here).
  double send_s = 0;
  /// Its replicas' gradient sum per step (0: one replica, or not measured here).
  double allreduce_s = 0;
  /// Its compute per microbatch: forward, backward and weight gradient.
  double compute_s() const { return forward_s + backward_s + backward_weight_s; }
};

/// How far the planning inputs are from what ran: measured over predicted per kind of work,
/// common to the stages (the profile's error: another microbatch size, thread count or
/// machine), and per device its speed's multiplier (a straggler: below 1).
struct Factors {
  double forward = 1, backward = 1, weight = 1;
  std::vector<double> speed;  ///< per device; empty: all 1
  /// Measured over predicted time of a transfer between stages (latency and bytes over
  /// bandwidth): the links' multiplier (their latency times it, their bandwidth over it).
  double link = 1;
  /// Per operator (by id), its own pricing error beyond the kind's: known only where probes
  /// told its device's speed apart from it (measure_factors' `probed`: its stage's whole
  /// error, unbounded); empty or short: 1.
  std::vector<double> op;
  double op_factor(int id) const { return id >= 0 && id < static_cast<int>(op.size()) ? op[id] : 1.0; }
};

/// How a replica's time grows with its share of a microbatch: the measured time of the
/// profile's microbatch x (fixed_fraction + (1 - fixed_fraction) x scale x share), where
/// scale is the plan's microbatch over the profile's (CostGraph::fixed_fraction).
struct SharePricing {
  double fixed_fraction = 0;
  double scale = 1;
};
/// `costs`' pricing of `plan`'s microbatches.
SharePricing share_pricing(const CostGraph& costs, const Plan& plan);

/// Per device, its probe's rate (`probed`) over the fastest of those of the devices that run
/// a stage of `plan`, where every such device was probed; empty otherwise (no device is told
/// apart then).
std::vector<double> probed_speeds(const Plan& plan, const std::vector<double>& probed, int devices);

/// The factors `measured` shows against `plan`'s predictions: each kind's median ratio over
/// the stages; for each device, what its replicas measured beyond that (over the corrected
/// prediction), as a speed multiplier; the links' median ratio over the stages' transfers and
/// gradient sums. `devices`: the cluster's device count. Errors: a
/// measurement count other than the plan's stages, a stage on devices outside the cluster,
/// a negative or non-finite measurement.
/// `action_overhead_s`: what the plan's stage times include per action beyond the operators
/// (PlanOptions::action_overhead_s), which the measured compute does not. `pricing`: how
/// each replica's share of the stage's time was priced.
///
/// A stage's times alone cannot tell its operators' pricing error from its devices' speed:
/// every device of a pipeline runs its own operators, so a stage the profile priced low reads
/// as a slow device. `probed`, per device, how fast a probe of it ran at the window's end
/// (docs/planner.md, "Telling a device from its operators"; 0: not probed), over its rated
/// speed. Where every device that runs a stage was probed: the kinds are read from the stages
/// whose reference replica's device probed as fast as the fastest (within `probe_noise`),
/// and what such a stage measured beyond them is its operators' own error (`op`), not its
/// devices' (devices that probe alike run alike: a stage's error within the noise, read as
/// its device's speed, put one of a ResNet-18's two devices at x0.74-0.83); a stage on a
/// device that probed slower holds that device's slowness, which its times measure (a probe
/// is not the model's work: how much slower is the stage's to say).
///
/// `weight_input_share`, per stage: the part of its predicted weight-gradient time that is
/// its operators' input halves (weight_input_shares; empty: none), which the backward kind
/// prices: read as weight gradients, a ResNet-18's first stage was priced lower window after
/// window, and its device, never slowed, read x0.71.
Result<Factors> measure_factors(const Plan& plan, const std::vector<StageMeasurement>& measured, int devices,
                                double action_overhead_s = 0, const SharePricing& pricing = {},
                                const std::vector<double>& probed = {}, double probe_noise = 0,
                                const std::vector<double>& weight_input_share = {});

/// Per stage of `plan` (its operators priced on `costs`), the part of its weight-gradient
/// action's time that is its operators' input halves: under a split backward, a stage that
/// reads no other stage's output runs its whole backward there.
std::vector<double> weight_input_shares(const CostGraph& costs, const Plan& plan);

/// `factors` with what is within the tolerance taken as noise (set to 1): a kind's factor
/// and the links' within half of it, a device's speed within it, an operator's own within
/// twice it (it rests on the probes' noise, and stands until the next plan).
Factors settle(const Factors& factors, double tolerance);

/// `costs` with every operator scaled per kind and by its own factor, and `cluster` with
/// every device's speed and both links scaled.
void apply_factors(const Factors& factors, CostGraph& costs, Cluster& cluster);
/// The cluster's links `factor` times slower: their latency times it, their bandwidth over it.
void scale_links(Cluster& cluster, double factor);

/// `plan`'s layout (stages, devices, microbatches, schedule) priced on `costs` and `cluster`
/// as the planner prices it: its stage times, its devices and its simulated step. Errors: an
/// operator outside the cost graph, a device outside the cluster.
Result<Plan> reprice(const CostGraph& costs, const Cluster& cluster, const PlanOptions& options, const Plan& plan);

/// The optimizer's step, in seconds per parameter byte at speed 1 (PlanOptions::
/// optimizer_s_per_param_byte), as `optimizer_s` measured it under `plan`: per device, its
/// process's optimizer step per training step (0: not measured), over the bytes of the
/// parameters its stages read (each once), times the device's speed in `cluster`; the median
/// over the devices measured, 0 if none. Errors: a time that is negative or not finite, more
/// devices than the cluster's.
Result<double> optimizer_cost(const CostGraph& costs, const Cluster& cluster, const Plan& plan,
                              const std::vector<double>& optimizer_s);

/// The corrected inputs, and the factors that made them.
struct Calibration {
  CostGraph costs;   ///< every operator scaled per kind by the common factor
  Cluster cluster;   ///< devices that ran off the common factor: their speed corrected
  Plan running;      ///< the running plan, priced on the corrected inputs
  Factors factors;   ///< what was applied (settled: noise left out)
};

/// One measurement's correction of `costs` and `cluster`, from which `plan` was made:
/// measure_factors, settle, apply_factors, reprice.
Result<Calibration> recalibrate(const CostGraph& costs, const Cluster& cluster, const PlanOptions& options,
                                const Plan& plan, const std::vector<StageMeasurement>& measured,
                                double tolerance = 0.1);

}  // namespace conveyor::partitioner
