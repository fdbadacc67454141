// What the devices' probes tell the Replanner (docs/planner.md, "Telling a device from its
// operators", "A device left idle"): the speeds of devices the running plan leaves idle, the
// ceilings on slow devices' speeds and when a census is owed, and at a census, which devices
// run alike, and what the operators' own errors it measured their prices leave out. Torch-free.
#include <algorithm>
#include <cmath>
#include <string>

#include "partitioner/replan.h"

namespace conveyor::partitioner {

void Replanner::note_idle_devices() {
  const std::size_t devices = base_cluster_.devices.size();
  idle_from_.resize(devices, 0.0);
  idle_rate_.resize(devices, 0.0);
  for (std::size_t d = 0; d < devices; ++d) {
    if (!idle(running_, static_cast<int>(d))) {
      idle_from_[d] = idle_rate_[d] = 0;
    } else if (idle_from_[d] == 0) {  // went idle now: its speed as last estimated (1: never corrected)
      idle_from_[d] = d < smoothed_.speed.size() ? smoothed_.speed[d] : 1.0;
    }
  }
}

// A device no stage runs on. At a census: the speed its probe shows against the device that
// runs with the fastest probe (its speed as this window measured it, per unit of its probe:
// a slower device's probe need not scale as its stages do). Later: its speed
// at its reference probe times what its probe says since, but running no faster than the
// fastest device that runs a stage, unless it already did: a probe's reference, timed beside a
// straggler's neighbours, is noisy (nine hogs: a recovery of 10x read 6.7-11.7x), and a device
// taken back is measured by its stages from the next window on. (The factors scale the
// cluster's speeds: `rated` compares devices.)
Status Replanner::idle_speeds(Factors& seen, const std::vector<double>& probe_rate,
                              const std::vector<double>& per_rated) {
  const bool census = !per_rated.empty();
  auto rated = [&](std::size_t d, double factor) { return base_cluster_.devices[d].speed * factor; };
  double fastest_running = 0, per_probe = 0, fastest_probe = 0;  // per_probe: a speed factor per unit of rate
  for (std::size_t d = 0; d < seen.speed.size(); ++d) {
    if (idle(running_, static_cast<int>(d))) continue;
    fastest_running = std::max(fastest_running, rated(d, seen.speed[d]));
    if (census && per_rated[d] > fastest_probe) fastest_probe = per_rated[d], per_probe = seen.speed[d] / per_rated[d];
  }
  for (std::size_t d = 0; d < probe_rate.size() && d < idle_from_.size(); ++d) {
    if (!std::isfinite(probe_rate[d]) || probe_rate[d] < 0) {
      return Status(ErrorCode::kInvalidArgument, "device " + std::to_string(d) + "'s probe ran at " +
                                                     std::to_string(probe_rate[d]) +
                                                     " products per second (a positive, finite rate, or 0: not probed)");
    }
    if (idle_from_[d] <= 0 || probe_rate[d] <= 0) continue;
    if (census && per_probe > 0) {
      idle_from_[d] = per_probe * per_rated[d];
      idle_rate_[d] = probe_rate[d];
    } else if (idle_rate_[d] <= 0) {  // its first probe: the reference, at its speed when it went idle
      idle_rate_[d] = probe_rate[d];
    }
    const double bound = std::max(fastest_running, rated(d, idle_from_[d])) / rated(d, 1.0);
    seen.speed[d] = std::min(idle_from_[d] * probe_rate[d] / idle_rate_[d], bound);
  }
  return Status::ok();
}

bool Replanner::update_ceilings(const std::vector<double>& probe_rate, const std::vector<double>& per_rated) {
  const std::size_t devices = base_cluster_.devices.size();
  ceiling_.resize(devices, 0.0);
  ceiling_rate_.resize(devices, 0.0);
  const double noise = 2 * policy_.tolerance;  // a probe's, as measure_factors takes it
  if (!per_rated.empty()) {  // a census: every ceiling set anew, measured from its window on
    uncapped_.clear();
    double fastest = 0;
    for (std::size_t d = 0; d < devices; ++d) {
      if (!idle(running_, static_cast<int>(d))) fastest = std::max(fastest, per_rated[d]);
    }
    for (std::size_t d = 0; d < devices; ++d) {
      const double ratio = fastest > 0 ? per_rated[d] / fastest : 1.0;
      const bool slow = !idle(running_, static_cast<int>(d)) && ratio < 1 - noise;
      ceiling_[d] = slow ? ratio : 0.0;
      ceiling_rate_[d] = slow ? probe_rate[d] : 0.0;
    }
    return false;
  }
  bool lifted = false;
  for (std::size_t d = 0; d < devices && d < probe_rate.size(); ++d) {
    if (ceiling_[d] <= 0 || probe_rate[d] <= 0 || ceiling_rate_[d] <= 0) continue;
    ceiling_[d] *= probe_rate[d] / ceiling_rate_[d];
    ceiling_rate_[d] = probe_rate[d];
    if (ceiling_[d] < 1 - noise) continue;
    ceiling_[d] = ceiling_rate_[d] = 0;  // its straggler went
    lifted = true;
  }
  return lifted;
}

// A device's lead over its busy neighbour, on a core they share, does not move under one
// plan; a straggler's going does: a capped device measured much faster than in its first
// window under its ceiling is owed a census at once, not at its next probe (every fifth
// window: a ResNet-18's straggler gone at step 70 was still capped at x0.52 at step 80, and a
// switch decided on it). Against the window before instead, a straggler gone mid-window rose
// by less than the threshold in each of two (a BERT's 0.34/0.66 shares, 20-28% slower than an
// even split, stood for 22 steps after its straggler went).
bool Replanner::cap_at_ceilings(Factors& seen) {
  const std::size_t devices = std::min(ceiling_.size(), seen.speed.size());
  double unbounded = 0;
  for (std::size_t d = 0; d < devices; ++d) {
    if (ceiling_[d] <= 0) unbounded = std::max(unbounded, seen.speed[d]);
  }
  uncapped_.resize(devices, 0.0);
  disputed_.assign(devices, false);
  bool jumped = false;
  for (std::size_t d = 0; d < devices; ++d) {
    if (ceiling_[d] <= 0 || unbounded <= 0) {
      uncapped_[d] = 0;
      continue;
    }
    const double relative = seen.speed[d] / unbounded;
    disputed_[d] = relative > ceiling_[d] * (1 + 2 * policy_.tolerance);  // beyond a probe's noise
    if (uncapped_[d] <= 0) uncapped_[d] = relative;  // its first window under the ceiling
    jumped = jumped || relative > uncapped_[d] * (1 + 3 * policy_.tolerance);
    seen.speed[d] = std::min(seen.speed[d], ceiling_[d] * unbounded);
  }
  return jumped;
}

int Replanner::unprobed_dispute(const std::vector<double>& probe_rate) const {
  for (std::size_t d = 0; d < disputed_.size(); ++d) {
    if (disputed_[d] && !idle(running_, static_cast<int>(d)) && (d >= probe_rate.size() || probe_rate[d] <= 0)) {
      return static_cast<int>(d);
    }
  }
  return -1;
}

// A census tells a device that probes as fast as the fastest from its operators: it runs as
// fast as that device, and what its stages measure beyond that is theirs. Measured against a
// speed estimated before instead, the difference would be taken for their operators' error
// and the old speed kept (a ResNet-18's two processes, the straggler on device 1 gone, read
// device 0, never slowed, at x0.61 against device 1 at the next plan's census).
Status Replanner::price_probed_alike(const std::vector<double>& per_rated) {
  const int devices = static_cast<int>(base_cluster_.devices.size());
  const std::vector<double> by_probe = probed_speeds(running_, per_rated, devices);
  if (by_probe.empty() || static_cast<int>(applied_.speed.size()) != devices) return Status::ok();
  const double noise = 2 * policy_.tolerance;  // a probe's, as measure_factors takes it
  auto alike = [&](int d) { return !idle(running_, d) && by_probe[d] >= 1 - noise; };
  double fastest = 0;
  for (int d = 0; d < devices; ++d) {
    if (alike(d)) fastest = std::max(fastest, applied_.speed[d]);
  }
  bool moved = false;
  for (int d = 0; d < devices; ++d) {
    if (!alike(d) || applied_.speed[d] == fastest) continue;
    applied_.speed[d] = fastest;
    moved = true;
  }
  return moved ? price_with(applied_) : Status::ok();
}

void Replanner::note_unpriced(const std::vector<double>& measured) {
  unpriced_.clear();
  const auto priced = [this](int id) { return applied_.op_factor(id); };
  const auto ran = [&measured](int id) { return id < static_cast<int>(measured.size()) ? measured[id] : 1.0; };
  for (const StagePlan& stage : running_.stages) {
    const double p = weighted_time(stage, priced), r = weighted_time(stage, ran);
    unpriced_.push_back(p > 0 && r > 0 ? r / p : 1.0);
  }
}

std::vector<StageMeasurement> Replanner::as_priced(std::vector<StageMeasurement> measured) const {
  if (unpriced_.size() != measured.size()) return measured;  // measure_factors names the mismatch
  for (std::size_t s = 0; s < measured.size(); ++s) {
    const double k = unpriced_[s];
    if (!(k > 0) || !std::isfinite(k) || k == 1) continue;
    StageMeasurement& m = measured[s];
    for (double* t : {&m.forward_s, &m.backward_s, &m.backward_weight_s}) *t /= k;
    for (double& t : m.replica_compute_s) t /= k;
  }
  return measured;
}

}  // namespace conveyor::partitioner
