#include "partitioner/recalibrate.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "partitioner/stage_model.h"

namespace conveyor::partitioner {

namespace {

// The median of the ratios measured / predicted over the stages where both are known; 1 if none.
double common_ratio(const std::vector<double>& measured, const std::vector<double>& predicted) {
  std::vector<double> r;
  for (std::size_t s = 0; s < measured.size(); ++s) {
    if (measured[s] > 0 && predicted[s] > 0) r.push_back(measured[s] / predicted[s]);
  }
  if (r.empty()) return 1.0;
  std::sort(r.begin(), r.end());
  const std::size_t n = r.size();
  return n % 2 ? r[n / 2] : (r[n / 2 - 1] + r[n / 2]) / 2;
}

Status check_time(double x, std::size_t stage) {
  if (std::isfinite(x) && x >= 0) return Status::ok();
  return Status(ErrorCode::kInvalidArgument, "stage " + std::to_string(stage) + " measured a time of " +
                                                 std::to_string(x) + " s (times are finite and not negative)");
}

Status check_devices(const StagePlan& p, std::size_t stage, int devices) {
  if (p.first_device >= 0 && p.replicas >= 1 && p.first_device + p.replicas <= devices) return Status::ok();
  return Status(ErrorCode::kInvalidArgument, "stage " + std::to_string(stage) + " of the plan runs on devices " +
                                                 std::to_string(p.first_device) + ".." +
                                                 std::to_string(p.first_device + p.replicas - 1) +
                                                 ", outside the cluster's " + std::to_string(devices));
}

// Per replica of `p` on `devices`, its share's time at its device's speed, per second of
// the stage's work measured at the profile's microbatch (SharePricing); empty when the plan
// gives no shares for it.
std::vector<double> share_times(const StagePlan& p, const std::vector<Device>& devices, const SharePricing& pricing) {
  std::vector<double> out;
  if (static_cast<int>(p.shares.size()) != p.replicas || p.first_device + p.replicas > static_cast<int>(devices.size())) {
    return out;
  }
  const double fixed = pricing.fixed_fraction;
  for (int i = 0; i < p.replicas; ++i) {
    out.push_back((fixed + (1 - fixed) * pricing.scale * p.shares[i]) / std::max(devices[p.first_device + i].speed, 1e-12));
  }
  return out;
}

// Per replica: its share's time over the slowest replica's (which the stage's time is).
std::vector<double> replica_fractions(const StagePlan& p, const std::vector<Device>& devices,
                                      const SharePricing& pricing) {
  std::vector<double> out = share_times(p, devices, pricing);
  const double slowest = out.empty() ? 0 : *std::max_element(out.begin(), out.end());
  if (slowest <= 0) return std::vector<double>(static_cast<std::size_t>(p.replicas), 1.0);
  for (double& x : out) x /= slowest;
  return out;
}

// A stage's time per second of its work at the profile's microbatch, on `devices` with the
// shares it runs (the plan's): its slowest replica's; 0 when the plan gives no shares.
double running_time_per_work(const StagePlan& p, const std::vector<Device>& devices, const SharePricing& pricing) {
  const std::vector<double> times = share_times(p, devices, pricing);
  return times.empty() ? 0 : *std::max_element(times.begin(), times.end());
}

// What a stage's measured times are scaled by before they count towards the common factor:
// its least slowed replica's compute over its predicted share (`fraction` of the stage's
// time), against the stage's measured compute `whole`, which is its slowest replica's.
// 1 when no two replicas were measured; never above 1. `replica`: the one it is (-1: none).
struct Reference {
  double scale = 1;
  int replica = -1;
};
Reference fastest_replica(const std::vector<double>& replica_compute_s, const std::vector<double>& fraction,
                          double whole) {
  double least = 0;
  int measured = 0, fastest = -1;
  for (std::size_t i = 0; i < replica_compute_s.size() && i < fraction.size(); ++i) {
    if (replica_compute_s[i] <= 0 || fraction[i] <= 0) continue;
    const double per_stage = replica_compute_s[i] / fraction[i];
    if (!measured++ || per_stage < least) least = per_stage, fastest = static_cast<int>(i);
  }
  if (measured < 2 || whole <= 0) return {};
  return {std::min(1.0, least / whole), fastest};
}

// The speed of the device whose replica a stage's reference time is (`reference`), by the
// probes: that replica's device, or without one the stage's slowest (its time is the slowest
// replica's).
double reference_speed(const StagePlan& p, const Reference& reference, const std::vector<double>& speed) {
  if (reference.replica >= 0) return speed[p.first_device + reference.replica];
  double slowest = speed[p.first_device];
  for (int d = p.first_device; d < p.first_device + p.replicas; ++d) slowest = std::min(slowest, speed[d]);
  return slowest;
}

}  // namespace

std::vector<double> weight_input_shares(const CostGraph& costs, const Plan& plan) {
  std::vector<double> out;
  for (const StagePlan& p : plan.stages) {
    double whole = 0, weight = 0;
    for (int id : p.ops) {
      if (id < 0 || id >= static_cast<int>(costs.ops.size())) continue;
      whole += costs.ops[id].backward_s;
      weight += costs.ops[id].backward_weight_s;
    }
    // As reprice prices it (detail::weight_half): a stage that reads another's output leaves
    // the input halves to its backward action.
    out.push_back(p.recv_bytes > 0 || whole <= 0 ? 0.0 : std::max(0.0, whole - weight) / whole);
  }
  return out;
}

SharePricing share_pricing(const CostGraph& costs, const Plan& plan) {
  const double samples = plan.microbatches > 0 ? static_cast<double>(plan.batch) / plan.microbatches : 0;
  return {costs.fixed_fraction, samples > 0 ? samples / costs.microbatch : 1.0};
}

std::vector<double> probed_speeds(const Plan& plan, const std::vector<double>& probed, int devices) {
  if (static_cast<int>(probed.size()) < devices) return {};
  double fastest = 0;
  for (const StagePlan& p : plan.stages) {
    for (int d = p.first_device; d < p.first_device + p.replicas && d < devices; ++d) {
      if (!(probed[d] > 0) || !std::isfinite(probed[d])) return {};
      fastest = std::max(fastest, probed[d]);
    }
  }
  if (fastest <= 0) return {};
  std::vector<double> out(probed.begin(), probed.begin() + devices);
  for (double& x : out) x /= fastest;
  return out;
}

Result<Factors> measure_factors(const Plan& plan, const std::vector<StageMeasurement>& measured, int devices,
                                double action_overhead_s, const SharePricing& pricing,
                                const std::vector<double>& probed, double probe_noise,
                                const std::vector<double>& weight_input_share) {
  const std::size_t stages = plan.stages.size();
  if (measured.size() != stages) {
    return Status(ErrorCode::kInvalidArgument, "measurements of " + std::to_string(measured.size()) +
                                                   " stages for a plan of " + std::to_string(stages));
  }
  // Split: backward_s measured the input half, which the plan predicts as the whole backward
  // less its weight half; whole: both halves move together.
  const bool split = std::any_of(measured.begin(), measured.end(), [](const auto& m) { return m.backward_weight_s > 0; });
  for (std::size_t s = 0; s < stages; ++s) CONVEYOR_RETURN_IF_ERROR(check_devices(plan.stages[s], s, devices));
  const std::vector<double> speed_probed = probed_speeds(plan, probed, devices);
  std::vector<double> mf, mb, mw, pf, pb, pw, pwb;  // pwb: input halves run in the weight-gradient action
  std::vector<bool> nominal;  // the stage's reference device as fast as the fastest, or not probed
  for (std::size_t s = 0; s < stages; ++s) {
    const StageMeasurement& m = measured[s];
    for (double x : {m.forward_s, m.backward_s, m.backward_weight_s}) CONVEYOR_RETURN_IF_ERROR(check_time(x, s));
    for (double x : m.replica_compute_s) CONVEYOR_RETURN_IF_ERROR(check_time(x, s));
    const StagePlan& p = plan.stages[s];
    // The common factor is the profile's error, which every device shows alike: read from the
    // stage's fastest replica, so that a straggler among its replicas (whose time the stage's
    // is) shows as that device's speed, not as every device's.
    const Reference ref = fastest_replica(m.replica_compute_s, replica_fractions(p, plan.devices, pricing),
                                          m.compute_s());
    // Where probes say that replica's device is slower than the fastest beyond their noise,
    // the stage's times hold the device's slowness, and the kinds are read without it. How
    // much slower is not the probe's to say: beside a busy process a probe ran at 0.25 of a
    // core where the pipeline's stage, sleeping between its actions and woken ahead of the
    // hog, got 0.55; the stage's times say it.
    nominal.push_back(speed_probed.empty() || reference_speed(p, ref, speed_probed) >= 1 - probe_noise);
    mf.push_back(m.forward_s * ref.scale);
    mb.push_back(m.backward_s * ref.scale);
    mw.push_back(m.backward_weight_s * ref.scale);
    pf.push_back(std::max(0.0, p.forward_s - action_overhead_s));
    // A first stage's split backward is all W: its input half is the action's overhead alone,
    // less which only rounding is left (a ratio over that would be astronomical).
    const double input_half = (split ? p.backward_s - p.backward_weight_s : p.backward_s) - action_overhead_s;
    pb.push_back(input_half > 1e-9 ? input_half : 0.0);
    // A stage that reads no other's output computes its operators' input halves in its
    // weight-gradient action: that part is the backward kind's work.
    const double in_weight = split && s < weight_input_share.size() ? std::clamp(weight_input_share[s], 0.0, 1.0) : 0.0;
    pw.push_back(split ? p.backward_weight_s * (1 - in_weight) : 0);
    pwb.push_back(split ? p.backward_weight_s * in_weight : 0);
  }
  auto on_nominal = [&nominal](std::vector<double> x) {
    for (std::size_t s = 0; s < x.size(); ++s) x[s] = nominal[s] ? x[s] : 0.0;  // common_ratio skips 0
    return x;
  };
  // Per kind, its median ratio over the nominal stages, each stage's times over its
  // operators' own error.
  Factors f;
  std::vector<double> own(stages, 1.0);
  auto read_kinds = [&] {
    auto mine = [&](const std::vector<double>& m) {
      std::vector<double> x = on_nominal(m);
      for (std::size_t s = 0; s < stages; ++s) x[s] /= own[s];
      return x;
    };
    f.forward = common_ratio(mine(mf), pf);
    const std::vector<double> b = mine(mb);
    const bool backward_read = std::any_of(pb.begin(), pb.end(), [](double x) { return x > 0; }) &&
                               std::any_of(b.begin(), b.end(), [](double x) { return x > 0; });
    f.backward = common_ratio(b, pb);
    if (!split) {
      f.weight = f.backward;
      return;
    }
    // The weight gradients' part of each weight-gradient action: the input halves it ran
    // priced at the backward kind (unread, the whole action is read as weight gradients).
    std::vector<double> w = mine(mw), pw_read = pw;
    for (std::size_t s = 0; s < stages; ++s) {
      if (!backward_read) pw_read[s] += pwb[s];
      else if (w[s] > 0) w[s] = std::max(0.0, w[s] - pwb[s] * f.backward);
    }
    f.weight = common_ratio(w, pw_read);
    if (!backward_read) f.backward = f.weight;
  };
  // A stage's compute as the kinds price it.
  auto priced = [&](std::size_t s) { return pf[s] * f.forward + (pb[s] + pwb[s]) * f.backward + pw[s] * f.weight; };
  read_kinds();
  // A stage far smaller than the plan's average, as predicted and as measured, measures the
  // runtime's cost per action and the schedule's bookkeeping more than its operators or its
  // device (GPT-NeoX under zb-v: a stage of one operator of 19 us read at 4.66x, one whose
  // weight gradient ran with another at 0.01x, and the plan that believed them left device
  // 0 idle; an MLP's stage of one operator read its device as slow again and again): it
  // tells nothing of either.
  constexpr double kSmallStage = 0.25;
  double mean_predicted = 0, mean_measured = 0;
  for (std::size_t s = 0; s < stages; ++s) {
    mean_predicted += (pf[s] + pb[s] + pw[s]) / stages;
    mean_measured += measured[s].compute_s() / stages;
  }
  std::vector<bool> small(stages);
  for (std::size_t s = 0; s < stages; ++s) {
    small[s] = pf[s] + pb[s] + pw[s] < kSmallStage * mean_predicted && measured[s].compute_s() < kSmallStage * mean_measured;
  }
  // With the devices probed, what a stage on a device as fast as the fastest measured beyond
  // the kinds is its operators' own error: each of them carries it (the caller bounds what it
  // prices: Replanner::kMostOwnError). The kinds and these errors are read together until
  // they agree: the kinds from the stages' times without their errors, each error against
  // those kinds, their median 1 (what is common is the kinds'). Read once, the errors are
  // told against kinds other than those the windows after the census read (from the times
  // without the errors) wherever stages mix the kinds differently, and the difference is
  // read as the devices' speeds (modelled on random stages, up to 8% off).
  std::vector<std::size_t> told;
  for (std::size_t s = 0; s < stages && !speed_probed.empty(); ++s) {
    if (nominal[s] && !small[s] && mf[s] + mb[s] + mw[s] > 0) told.push_back(s);
  }
  for (int round = 0; round < 100 && !told.empty(); ++round) {
    std::vector<double> next = own, errors;
    for (std::size_t s : told) {
      const double predicted = priced(s);
      if (predicted > 0) next[s] = (mf[s] + mb[s] + mw[s]) / predicted;
      errors.push_back(next[s]);
    }
    std::sort(errors.begin(), errors.end());
    const std::size_t n = errors.size();
    const double median = n % 2 ? errors[n / 2] : (errors[n / 2 - 1] + errors[n / 2]) / 2;
    double moved = 0;
    for (std::size_t s : told) {
      next[s] /= median;
      moved = std::max(moved, std::abs(next[s] / own[s] - 1));
    }
    own = next;
    read_kinds();
    if (moved < 1e-9) break;
  }
  for (std::size_t s : told) {
    for (int id : plan.stages[s].ops) {
      if (id < 0) continue;
      if (id >= static_cast<int>(f.op.size())) f.op.resize(id + 1, 1.0);
      f.op[id] = own[s];
    }
  }
  // Per device: what its replicas measured over what the common-corrected model predicts
  // for its own share (the stage's time is its slowest replica's).
  std::vector<double> device_measured(devices, 0), device_predicted(devices, 0);
  for (std::size_t s = 0; s < stages; ++s) {
    if (small[s]) continue;  // a device with no other stage keeps its speed (factor 1)
    const StagePlan& p = plan.stages[s];
    const StageMeasurement& m = measured[s];
    const double predicted = priced(s) * own[s];
    const double whole = m.compute_s();
    const std::vector<double> fraction = replica_fractions(p, plan.devices, pricing);
    for (int i = 0; i < p.replicas; ++i) {
      const double mine = i < static_cast<int>(m.replica_compute_s.size()) ? m.replica_compute_s[i] : whole;
      if (mine <= 0 || predicted <= 0) continue;  // not measured here
      device_measured[p.first_device + i] += mine;
      device_predicted[p.first_device + i] += predicted * fraction[i];
    }
  }
  f.speed.assign(devices, 1.0);
  for (int d = 0; d < devices; ++d) {
    if (device_predicted[d] > 0 && device_measured[d] > 0) f.speed[d] = device_predicted[d] / device_measured[d];
  }
  // A transfer after stage s, as the simulator prices it (Plan::stage_costs): the link's
  // latency and the largest share's bytes over its bandwidth.
  std::vector<double> ms, ps;
  for (std::size_t s = 0; s + 1 < stages && s < plan.links.size(); ++s) {
    const StagePlan& p = plan.stages[s];
    const Link& l = plan.links[s];
    const double bytes = p.send_bytes / std::min(p.replicas, plan.stages[s + 1].replicas);
    ms.push_back(measured[s].send_s);
    ps.push_back(l.latency_s + (l.bandwidth_bytes_per_s > 0 ? bytes / l.bandwidth_bytes_per_s : 0));
  }
  // A replicated stage's gradient sum crosses the same links (a ring over its devices).
  for (std::size_t s = 0; s < stages; ++s) {
    ms.push_back(measured[s].allreduce_s);
    ps.push_back(plan.stages[s].allreduce_s);
  }
  f.link = common_ratio(ms, ps);
  return f;
}

Factors settle(const Factors& factors, double tolerance) {
  Factors out = factors;
  auto within = [](double x, double t) { return std::abs(x - 1) <= t; };
  for (double* k : {&out.forward, &out.backward, &out.weight, &out.link}) {
    if (within(*k, tolerance / 2)) *k = 1;
  }
  for (double& x : out.speed) {
    if (within(x, tolerance)) x = 1;
  }
  // An operator's own error rests on one census's probes, whose noise is the devices' (a
  // probe of this machine's shared cores spreads 15-20%), and it stands for the whole plan.
  for (double& x : out.op) {
    if (within(x, 2 * tolerance)) x = 1;
  }
  return out;
}

void apply_factors(const Factors& factors, CostGraph& costs, Cluster& cluster) {
  for (std::size_t i = 0; i < costs.ops.size(); ++i) {
    CostOp& op = costs.ops[i];
    const double own = factors.op_factor(static_cast<int>(i));
    const double weight_s = op.backward_weight_s * factors.weight * own;
    op.forward_s *= factors.forward * own;
    op.backward_s = (op.backward_s - op.backward_weight_s) * factors.backward * own + weight_s;
    op.backward_weight_s = weight_s;
  }
  for (std::size_t d = 0; d < cluster.devices.size() && d < factors.speed.size(); ++d) {
    cluster.devices[d].speed *= factors.speed[d];
  }
  scale_links(cluster, factors.link);
}

void scale_links(Cluster& cluster, double factor) {
  for (Link* l : {&cluster.intra_node, &cluster.inter_node}) {
    l->latency_s *= factor;
    l->bandwidth_bytes_per_s /= factor;
  }
}

Result<Plan> reprice(const CostGraph& costs, const Cluster& cluster, const PlanOptions& options, const Plan& plan) {
  CONVEYOR_RETURN_IF_ERROR(costs.validate());
  Plan out = plan;
  out.devices = cluster.devices;
  for (std::size_t s = 0; s < out.links.size() && s + 1 < out.stages.size(); ++s) {
    const StagePlan& a = out.stages[s];
    const StagePlan& b = out.stages[s + 1];
    const int last = a.first_device + a.replicas - 1;
    if (last >= 0 && last < static_cast<int>(cluster.devices.size()) && b.first_device >= 0 &&
        b.first_device < static_cast<int>(cluster.devices.size())) {
      out.links[s] = cluster.link(last, b.first_device);
    }
  }
  PlanOptions o = options;
  o.batch = plan.batch > 0 ? plan.batch : options.batch;
  const detail::Model model(cluster, o, std::max(plan.microbatches, 1), plan.schedule, costs);
  const SharePricing pricing{costs.fixed_fraction, model.scale()};
  for (std::size_t s = 0; s < out.stages.size(); ++s) {
    StagePlan& p = out.stages[s];
    CONVEYOR_RETURN_IF_ERROR(check_devices(p, s, static_cast<int>(cluster.devices.size())));
    double fwd = 0, bwd = 0, bwd_w = 0;
    for (int id : p.ops) {
      if (id < 0 || id >= static_cast<int>(costs.ops.size())) {
        return Status(ErrorCode::kInvalidArgument, "stage " + std::to_string(s) + " of the plan has operator " +
                                                       std::to_string(id) + ", outside the cost graph's " +
                                                       std::to_string(costs.ops.size()));
      }
      fwd += costs.ops[id].forward_s;
      bwd += costs.ops[id].backward_s;
      bwd_w += costs.ops[id].backward_weight_s;
    }
    // The shares it runs, on the devices as now; without shares, as the planner prices them.
    double per_work = running_time_per_work(p, cluster.devices, pricing);
    if (per_work <= 0) per_work = model.time_per_work(p.first_device, p.replicas);
    p.forward_s = fwd * per_work + o.action_overhead_s;
    p.backward_s = bwd * per_work + o.action_overhead_s;
    p.allreduce_s = model.allreduce_time(p.param_bytes, p.first_device, p.replicas);
    p.optimizer_s = model.optimizer_time(p.param_bytes, p.first_device, p.replicas);
    p.backward_weight_s = detail::weight_half(bwd, bwd_w, p.recv_bytes > 0) * per_work;
  }
  CONVEYOR_ASSIGN_OR_RETURN(auto sim, out.simulate());
  out.predicted_step_s = sim.step_time_s;
  out.bubble_fraction = sim.bubble_fraction;
  return out;
}

Result<double> optimizer_cost(const CostGraph& costs, const Cluster& cluster, const Plan& plan,
                              const std::vector<double>& optimizer_s) {
  const std::size_t devices = cluster.devices.size();
  if (optimizer_s.size() > devices) {
    return Status(ErrorCode::kInvalidArgument, "optimizer steps measured on " + std::to_string(optimizer_s.size()) +
                                                   " devices, more than the cluster's " + std::to_string(devices));
  }
  std::vector<std::vector<char>> reads(optimizer_s.size(), std::vector<char>(costs.params.size(), 0));
  for (std::size_t s = 0; s < plan.stages.size(); ++s) {
    const StagePlan& p = plan.stages[s];
    CONVEYOR_RETURN_IF_ERROR(check_devices(p, s, static_cast<int>(devices)));
    for (int d = p.first_device; d < p.first_device + p.replicas && d < static_cast<int>(reads.size()); ++d) {
      for (int op : p.ops) {
        if (op < 0 || op >= static_cast<int>(costs.ops.size())) continue;
        for (int param : costs.ops[op].params) {
          if (param >= 0 && param < static_cast<int>(costs.params.size())) reads[d][param] = 1;
        }
      }
    }
  }
  std::vector<double> per_byte;
  for (std::size_t d = 0; d < optimizer_s.size(); ++d) {
    const double t = optimizer_s[d];
    if (!std::isfinite(t) || t < 0) {
      return Status(ErrorCode::kInvalidArgument, "device " + std::to_string(d) + "'s optimizer step measured " +
                                                     std::to_string(t) + " s (times are finite and not negative)");
    }
    double bytes = 0;
    for (std::size_t param = 0; param < costs.params.size(); ++param) bytes += reads[d][param] * costs.params[param].bytes;
    if (t > 0 && bytes > 0) per_byte.push_back(t * cluster.devices[d].speed / bytes);
  }
  if (per_byte.empty()) return 0.0;
  std::sort(per_byte.begin(), per_byte.end());
  const std::size_t n = per_byte.size();
  return n % 2 ? per_byte[n / 2] : (per_byte[n / 2 - 1] + per_byte[n / 2]) / 2;
}

Result<Calibration> recalibrate(const CostGraph& costs, const Cluster& cluster, const PlanOptions& options,
                                const Plan& plan, const std::vector<StageMeasurement>& measured, double tolerance) {
  CONVEYOR_ASSIGN_OR_RETURN(Factors raw, measure_factors(plan, measured, static_cast<int>(cluster.devices.size()),
                                                         options.action_overhead_s, share_pricing(costs, plan), {}, 0,
                                                         weight_input_shares(costs, plan)));
  Calibration out{costs, cluster, plan, settle(raw, tolerance)};
  apply_factors(out.factors, out.costs, out.cluster);
  CONVEYOR_ASSIGN_OR_RETURN(out.running, reprice(out.costs, out.cluster, options, plan));
  return out;
}

}  // namespace conveyor::partitioner
