#include "partitioner/replan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <utility>

#include "common/shares.h"
#include "partitioner/speed_groups.h"

namespace conveyor::partitioner {

namespace {

// The actions one rank walks per step: its stages' forward and backward (and weight-gradient
// under a split backward) of every microbatch.
double actions_per_rank(const Plan& plan) {
  const bool split = scheduler::splits_backward(plan.schedule);
  const int per_microbatch = split ? 3 : 2;
  return std::max(1.0, static_cast<double>(plan.stages.size()) / std::max(plan.ranks(), 1) * plan.microbatches *
                           per_microbatch);
}

// `op` over every field of two sets of factors (their speeds device by device).
template <class Op>
Factors zip(const Factors& x, const Factors& y, Op op) {
  Factors out = x;
  out.forward = op(x.forward, y.forward);
  out.backward = op(x.backward, y.backward);
  out.weight = op(x.weight, y.weight);
  out.link = op(x.link, y.link);
  for (std::size_t d = 0; d < out.speed.size() && d < y.speed.size(); ++d) out.speed[d] = op(x.speed[d], y.speed[d]);
  out.op.resize(std::max(x.op.size(), y.op.size()), 1.0);
  for (std::size_t i = 0; i < out.op.size(); ++i) {
    out.op[i] = op(x.op_factor(static_cast<int>(i)), y.op_factor(static_cast<int>(i)));
  }
  return out;
}

// Every correction of `a` within `tolerance` (relative) of `b`'s.
bool close(double x, double y, double tolerance) { return std::abs(x - y) <= tolerance * std::max(std::abs(y), 1e-12); }

// Whether every device's speed of `a` is within `tolerance` of `b`'s (relative).
bool within_speeds(const std::vector<double>& a, const std::vector<double>& b, double tolerance) {
  if (a.size() != b.size()) return false;
  for (std::size_t d = 0; d < a.size(); ++d) {
    if (!close(a[d], b[d], tolerance)) return false;
  }
  return true;
}
bool within_speeds(const Factors& a, const Factors& b, double tolerance) {
  return within_speeds(a.speed, b.speed, tolerance);
}

// Whether every factor of `a` is within `tolerance` of `b`'s (relative).
bool within(const Factors& a, const Factors& b, double tolerance) {
  return within_speeds(a, b, tolerance) && close(a.forward, b.forward, tolerance) &&
         close(a.backward, b.backward, tolerance) && close(a.weight, b.weight, tolerance) &&
         close(a.link, b.link, tolerance);
}

// The fewest samples one replica of `plan` computes per microbatch.
int smallest_share(const Plan& plan) {
  const int samples = std::max(1, plan.batch / std::max(plan.microbatches, 1));
  std::int64_t least = samples;
  for (const StagePlan& s : plan.stages) {
    if (s.replicas < 2) continue;
    for (std::int64_t n : share_lengths(samples, s.shares, s.replicas)) least = std::min(least, n);
  }
  return static_cast<int>(std::max<std::int64_t>(1, least));
}

// `options` with the running plan's shape fixed (Replanner::shape_key: its ranks and their
// replicas, microbatches, schedule and chunks), its cuts and shares left to the search.
PlanOptions same_shape(PlanOptions options, const Plan& running) {
  options.ranks = running.ranks();
  options.replicas.clear();
  for (int r = 0; r < running.ranks(); ++r) options.replicas.push_back(running.stages[r].replicas);
  options.microbatches = running.microbatches;
  options.schedules = {running.schedule};
  options.chunks = running.chunks > 1 ? running.chunks : 0;
  return options;
}

std::string percent(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f%%", x * 100);
  return b;
}

}  // namespace

std::string ReplanDecision::arithmetic(const ReplanPolicy& policy) const {
  const std::string host = host_s > 0 ? " (" + human_seconds(host_s) + " of it outside the plan's pipeline and optimizer step)" : "";
  if (!undo && Replanner::layout_key(candidate) == Replanner::layout_key(calibration.running)) {
    return "measured step " + human_seconds(measured_step_s) + host + ", predicted " +
           human_seconds(calibration.running.predicted_step_s + host_s) +
           " on the corrected inputs: the running plan stays (no other plan found faster)";
  }
  if (!undo && gain_s <= 0) {  // a slower plan is no saving: it said "-59 ms saved per step"
    return "measured step " + human_seconds(measured_step_s) + host + ", predicted " +
           human_seconds(predicted_step_s) + " with the best other plan found: " + human_seconds(-gain_s) +
           " (" + percent(measured_step_s > 0 ? -gain_s / measured_step_s : 0) +
           ") more per step, so the running plan stays";
  }
  char b[640];
  std::snprintf(b, sizeof b,
                "measured step %s%s, predicted %s with the new plan: %s saved per step (%s; %s), %s over the "
                "next %d steps; moving priced at %s (%.0f bytes of parameters and optimizer state: %s, rebuilding: "
                "%s); %d of %d confirmations",
                human_seconds(measured_step_s).c_str(), host.c_str(), human_seconds(predicted_step_s).c_str(),
                human_seconds(gain_s).c_str(), percent(measured_step_s > 0 ? gain_s / measured_step_s : 0).c_str(),
                undo ? "no gain asked of an undo" : (percent(gain_asked) + " asked").c_str(),
                human_seconds(gain_s * policy.horizon_steps).c_str(), policy.horizon_steps,
                human_seconds(move.seconds()).c_str(), move.bytes, human_seconds(move.transfer_s).c_str(),
                human_seconds(move.rebuild_s).c_str(), confirmations, policy.confirmations);
  return b;
}

Replanner::Replanner(CostGraph costs, Cluster cluster, Plan running, PlanOptions options, ReplanPolicy policy)
    : base_costs_(costs),
      costs_(std::move(costs)),
      base_cluster_(cluster),
      cluster_(std::move(cluster)),
      running_(std::move(running)),
      options_(std::move(options)),
      policy_(policy) {
  note_idle_devices();
}

bool Replanner::idle(const Plan& plan, int device) {
  return std::none_of(plan.stages.begin(), plan.stages.end(), [device](const StagePlan& s) {
    return s.first_device <= device && device < s.first_device + s.replicas;
  });
}

double Replanner::weighted_time(const StagePlan& stage, const std::function<double(int)>& weight) const {
  double sum = 0;
  for (int id : stage.ops) {
    if (id < 0 || id >= static_cast<int>(base_costs_.ops.size())) continue;
    sum += (base_costs_.ops[id].forward_s + base_costs_.ops[id].backward_s) * weight(id);
  }
  return sum;
}

std::vector<double> Replanner::stage_pricing(const Plan& plan) const {
  std::vector<double> out;
  for (const StagePlan& stage : plan.stages) {
    const double profiled = weighted_time(stage, [](int) { return 1.0; });
    out.push_back(profiled > 0 ? weighted_time(stage, [this](int id) { return applied_.op_factor(id); }) / profiled
                               : 1.0);
  }
  return out;
}

std::string Replanner::layout_key(const Plan& plan) {
  std::string key = std::to_string(plan.microbatches) + "/" + std::to_string(static_cast<int>(plan.schedule)) + "/" +
                    std::to_string(plan.chunks);
  for (const StagePlan& s : plan.stages) {
    key += "|" + std::to_string(s.first_device) + "x" + std::to_string(s.replicas) + ":";
    for (int op : s.ops) key += std::to_string(op) + ",";
    if (s.replicas > 1) {  // shares in whole samples of the plan's microbatch: another split is another layout
      const std::int64_t samples = std::max(1, plan.batch / std::max(plan.microbatches, 1));
      key += "/";
      for (std::int64_t n : share_lengths(samples, s.shares, s.replicas)) key += std::to_string(n) + ",";
    }
  }
  return key;
}

std::string Replanner::shape_key(const Plan& plan) {
  std::string key = std::to_string(plan.microbatches) + "/" + std::to_string(static_cast<int>(plan.schedule)) + "/" +
                    std::to_string(plan.chunks);
  for (const StagePlan& s : plan.stages) key += "|" + std::to_string(s.first_device) + "x" + std::to_string(s.replicas);
  return key;
}

Cluster Replanner::links_as_measured() const {
  Cluster out = base_cluster_;
  scale_links(out, measured_link_);
  return out;
}

Status Replanner::price_with(const Factors& factors) {
  costs_ = base_costs_;
  cluster_ = base_cluster_;
  apply_factors(factors, costs_, cluster_);
  CONVEYOR_ASSIGN_OR_RETURN(running_, reprice(costs_, cluster_, options_, running_));
  return Status::ok();
}

// A gradient sum's span runs from its bucket's being ready to its completion, mostly beside
// the backward that fills later buckets, and the simulator places the whole sum after the
// backward: so a plan with sums is priced above its measured step by what the backward hid
// (two processes of this machine: a data-parallel step priced 48% above its measure, and a
// pipeline without those sums credited with that time as a gain it never measured). Where
// the running plan is priced above its step, the links are priced down, never below a
// thousandth, until its price meets the measured step.
Status Replanner::fit_links(double measured_step_s) {
  if (running_.predicted_step_s <= measured_step_s) return Status::ok();
  const bool communicates = std::any_of(running_.stages.begin(), running_.stages.end(), [](const StagePlan& p) {
    return p.allreduce_s > 0 || p.send_bytes > 0;
  });
  if (!communicates) return Status::ok();
  Factors fitted = applied_;
  double low = 1e-3, high = 1.0;  // of the link factor: too low a price at `low`, too high at `high`
  fitted.link = applied_.link * low;
  CONVEYOR_RETURN_IF_ERROR(price_with(fitted));
  // Links all but free still price the step above its measure: the compute's price is what
  // is off, not the links'. They stay as measured (priced at a thousandth, every pipeline's
  // sends would look free).
  if (running_.predicted_step_s >= measured_step_s) return price_with(applied_);
  for (int i = 0; i < 20 && high / low > 1.01; ++i) {
    const double mid = std::sqrt(low * high);
    fitted.link = applied_.link * mid;
    CONVEYOR_RETURN_IF_ERROR(price_with(fitted));
    (running_.predicted_step_s > measured_step_s ? high : low) = mid;
  }
  fitted.link = applied_.link * high;
  CONVEYOR_RETURN_IF_ERROR(price_with(fitted));
  applied_ = fitted;
  return Status::ok();
}

Result<ReplanDecision> Replanner::evaluate(const std::vector<StageMeasurement>& measured, double measured_step_s,
                                          bool may_search, const std::vector<double>& probe_rate,
                                          const BeyondPipeline& beyond) {
  if (!std::isfinite(measured_step_s) || measured_step_s <= 0) {
    return Status(ErrorCode::kInvalidArgument,
                  "a measured step of " + std::to_string(measured_step_s) + " s (steps take a positive, finite time)");
  }
  for (const auto& [what, s] : {std::pair{"a step's host time", beyond.host_s}, {"a caller's step", beyond.caller_step_s}}) {
    if (!std::isfinite(s) || s < 0) {
      return Status(ErrorCode::kInvalidArgument, what + (" of " + std::to_string(s) + " s (a finite time, not negative)"));
    }
  }
  const double host_s = beyond.host_s;
  ReplanDecision d;
  const int devices = static_cast<int>(base_cluster_.devices.size());
  // A census: every device probed. Its rates, per unit of each device's rated speed, tell the
  // devices' speeds apart from their operators' pricing (recalibrate.h).
  const bool census = static_cast<int>(probe_rate.size()) == devices &&
                      std::all_of(probe_rate.begin(), probe_rate.end(), [](double r) { return r > 0 && std::isfinite(r); });
  std::vector<double> per_rated;
  for (int d = 0; census && d < devices; ++d) per_rated.push_back(probe_rate[d] / base_cluster_.devices[d].speed);
  if (applied_.speed.empty()) applied_.speed.assign(devices, 1.0);
  if (census) CONVEYOR_RETURN_IF_ERROR(price_probed_alike(per_rated));
  CONVEYOR_ASSIGN_OR_RETURN(Factors raw, measure_factors(running_, census ? measured : as_priced(measured), devices,
                                                         options_.action_overhead_s,
                                                         share_pricing(costs_, running_), per_rated,
                                                         2 * policy_.tolerance, weight_input_shares(costs_, running_)));
  // Against the profile: this window's factors on top of those its prediction already had.
  Factors seen = zip(raw, applied_, [](double r, double a) { return r * a; });
  const std::vector<double> own_measured = seen.op;
  // No operator priced beyond kMostOwnError either way, over every census together.
  for (double& x : seen.op) x = std::clamp(x, 1 / kMostOwnError, kMostOwnError);
  CONVEYOR_RETURN_IF_ERROR(idle_speeds(seen, probe_rate, per_rated));
  // No device runs faster than its ceiling lets it, against the fastest device without one.
  const bool lifted = update_ceilings(probe_rate, per_rated);
  // Owed once: a census is heard a window after the decision that owes it, and the window
  // between would owe another (a BERT's took two censuses in a row).
  const bool jumped = cap_at_ceilings(seen);
  d.census_owed = (jumped || lifted) && !census_asked_;
  if (d.census_owed) {
    d.census_why = lifted
                       ? "a device's probe lifted its speed ceiling (its straggler went, or the reading that set it misread)"
                       : "a device held to a speed ceiling measured much faster than under it";
  }
  census_asked_ = (census_asked_ && !census) || d.census_owed;
  d.speed_ceiling = ceiling_;
  // Kinds and speeds are known up to a common scale (a stage's time is cost x kind / speed):
  // the fastest device keeps its speed, the scale goes to the kinds, so that estimates made
  // under different plans agree.
  // An idle device's speed at its reference probe (idle_speeds) takes the same scale: kept in
  // an earlier one, it set each window's scale anew, and the running devices read slower
  // each window than the last (x0.10 read as x0.02 by the end of a test_straggler run).
  const double fastest = *std::max_element(seen.speed.begin(), seen.speed.end());
  if (fastest > 0) {
    for (double& x : seen.speed) x /= fastest;
    for (double& x : idle_from_) x /= fastest;
    seen.forward /= fastest;
    seen.backward /= fastest;
    seen.weight /= fastest;
  }
  const double a = policy_.smoothing;
  // A device's speed that moved beyond three times the tolerance in one window changed (a
  // process started beside it, or ended), which noise within the tolerance does not do: the
  // estimate takes the window's figure at once instead of averaging it in over windows (a
  // straggler appearing was switched from a window later). The confirmation still guards.
  const Factors before = smoothed_;
  smoothed_ = measured_once_ ? zip(smoothed_, seen, [a](double old, double now) { return old + a * (now - old); })
                             : seen;
  for (std::size_t dev = 0; measured_once_ && dev < smoothed_.speed.size() && dev < before.speed.size(); ++dev) {
    const double old = before.speed[dev];
    if (old > 0 && std::abs(seen.speed[dev] / old - 1) > 3 * policy_.tolerance) smoothed_.speed[dev] = seen.speed[dev];
  }
  // The same for the devices that run a stage, against the others that do, with no probe of
  // them, where no stage joins them: such a move is read from the stages' times alone, where
  // a stage's own pricing error can move too (GPT-NeoX under zb-v, never slowed: device 0
  // read x1.00 at the census, then x0.61 and x0.39, and about one run in three switched to a
  // plan that left it idle). So a caller that probes owes a census, which tells a device's
  // speed from its operators', and no switch is made before it is evaluated (a straggler that
  // came is switched from a short window later: the census confirms it). The replicas of one
  // stage run the same operators, and their times tell their devices apart whatever the
  // operators' pricing: a move among them owes nothing (under GPT-2's data-parallel plan, a
  // hog from step 20 owed a census, and the switch came after the bench's 40 steps).
  const bool moved_unprobed = measured_once_ && !census && before.speed.size() == seen.speed.size() &&
                              !within_speeds(group_speeds(running_, before.speed),
                                             group_speeds(running_, seen.speed), 3 * policy_.tolerance);
  probed_ = probed_ || census;
  if (moved_unprobed && probed_) {
    if (!census_asked_) {
      d.census_owed = true;
      d.census_why = "a running device's speed moved beyond three times the noise, read from its stages' times alone";
    }
    census_asked_ = true;
  }
  if (census) {
    windows_awaiting_census_ = 0;
  } else if (windows_awaiting_census_ > 0 || (moved_unprobed && probed_)) {
    ++windows_awaiting_census_;
  }
  // A census owed and not evaluated three windows later (its figures lost) is owed again.
  if (windows_awaiting_census_ > 0 && windows_awaiting_census_ % 4 == 0) {
    d.census_owed = true;
    d.census_why = "the census owed three windows ago was not evaluated";
  }
  const bool awaiting_census = windows_awaiting_census_ > 0;
  // The operators' own errors do not change while training: a census's figure is taken at
  // once, and kept until the next census (the first window of the next plan) refines it;
  // the devices' speeds it told them from are taken with it (averaged with speeds read
  // under the last plan's pricing, a stage would be priced off by their difference).
  smoothed_.op = census ? seen.op : before.op;
  if (census) smoothed_.speed = seen.speed;
  measured_once_ = true;
  applied_ = settle(smoothed_, policy_.tolerance);
  if (census) note_unpriced(own_measured);
  CONVEYOR_RETURN_IF_ERROR(price_with(applied_));
  // The optimizer's step per parameter byte, on the devices' corrected speeds (smoothed like
  // the factors): priced per stage from here on, so that a plan that leaves a slow device
  // updating the whole model is not taken for one that shares its work (a user's BERT under
  // uneven shares: the slowed process still ran AdamW over every parameter).
  CONVEYOR_ASSIGN_OR_RETURN(const double per_byte, optimizer_cost(costs_, cluster_, running_, beyond.optimizer_s));
  if (per_byte > 0) {
    double& k = options_.optimizer_s_per_param_byte;
    k = k > 0 ? k + policy_.smoothing * (per_byte - k) : per_byte;
    CONVEYOR_RETURN_IF_ERROR(price_with(applied_));
  }
  // The links as their sends measured them, for pricing a move (fit_links may price them down
  // to a thousandth to account for a sum the backward hid; a move's bytes are not hidden:
  // priced on fitted links, 348 MB of a GPT-NeoX were to move in 24 ms, and took 1.64 s).
  measured_link_ = applied_.link;
  CONVEYOR_RETURN_IF_ERROR(fit_links(measured_step_s));
  // What the step spends beyond the corrected simulation, per action a rank walks: the
  // runtime's own cost per action (smoothed like the factors, never below 0).
  const double extra = (measured_step_s - running_.predicted_step_s) / actions_per_rank(running_);
  const double overhead = std::max(0.0, options_.action_overhead_s + extra);
  options_.action_overhead_s += policy_.smoothing * (overhead - options_.action_overhead_s);
  CONVEYOR_ASSIGN_OR_RETURN(running_, reprice(costs_, cluster_, options_, running_));
  d.calibration = Calibration{costs_, cluster_, running_, applied_};
  d.action_overhead_s = options_.action_overhead_s;
  d.optimizer_s_per_param_byte = options_.optimizer_s_per_param_byte;
  d.measured_step_s = measured_step_s + host_s;
  d.host_s = host_s;
  // The first window after a switch this decided: slower than the step before it by more
  // than half the tolerance, and the switch is undone (returning to it needs twice the gain).
  // It was taken for a saving of at least the gain asked, so it then missed its prediction by
  // more than the tolerance. Allowing the whole tolerance kept a switch 9.75% slower for good
  // (GPT-NeoX under zb-v); allowing none undid a GPT-2 switch that one window read 2.3%
  // slower and the next would have read faster, and the undo cost 43 ms a step.
  const bool judging = undo_.has_value();
  if (judging) {
    Plan previous = std::move(undo_->previous);
    const double before = undo_->step_before_s;
    const double after = beyond.caller_step_s > 0 ? beyond.caller_step_s : d.measured_step_s;
    // Decided on speeds that have since moved (a straggler went while the switch was being
    // confirmed), it measured what the devices do now, not how the model prices operators:
    // it asks no more of later switches. Counted, a ResNet-18's switch decided as its
    // straggler left was undone, and the even shares it then needed (16.9% faster) fell
    // short of the 20% asked: 1.2x the step for the rest of the run.
    const bool same_devices = within_speeds(smoothed_.speed, undo_->decided.speeds, policy_.tolerance);
    undo_.reset();
    if (after > before * (1 + policy_.tolerance / 2)) {
      undone_ += same_devices ? 1 : 0;
      CONVEYOR_ASSIGN_OR_RETURN(d.candidate, reprice(costs_, cluster_, options_, previous));
      d.predicted_step_s = before;
      d.gain_s = after - before;
      d.move = move_cost(costs_, links_as_measured(), running_, d.candidate, options_, policy_);
      d.switch_plan = d.undo = true;
      d.searched = false;
      d.reason = "the last switch measured slower than the plan before it (" + human_seconds(after) +
                 " against " + human_seconds(before) + "): back to that plan" +
                 (same_devices ? "" : " (the devices' speeds moved since it was decided: no more gain asked of later switches)");
      return d;
    }
    // Kept. The caller waits for this judgement (process 0's training stops for it), so the
    // new plan's first search waits for the next window, which nobody waits for: searching
    // here, on a slow process 0 whose planner thread got a tenth of the core, stopped GPT-2's
    // training for 4.9 s.
    d.candidate = running_;
    d.predicted_step_s = d.measured_step_s;
    d.searched = false;
    d.reason = "the last switch measured " + human_seconds(after) + " against " + human_seconds(before) +
               " before it: kept (the new plan is searched from the next window)";
    return d;
  }
  // The search again only when the inputs moved since the last one: with nothing new to
  // learn, its best plan is priced on the inputs now. Where the caller spaces searches out,
  // only a search owed runs: a device's speed that moved beyond the tolerance is what a
  // straggler coming or going does, while the other factors move with the noise (the links'
  // fitted to each window's step). The speeds are compared as estimated, before settling: a
  // speed near the tolerance's edge, settled to 1 in one window and not in the next, moved
  // little (GPT-2 in two processes: 1.00 and 0.89 in turn, a search owed every other
  // window). A confirmation needs none, whatever moved: the plan found still paying on this
  // window's inputs confirms it; confirmed, the new plan's own search follows, and not, this
  // window's inputs are searched at the next (searching again, on a slow process 0 whose
  // planner got a tenth of the core, took 3 s and a window, and the switch came at step 27
  // rather than 17; a straggler's speed that moved 12% between the two windows made it search,
  // and the confirmation was heard two windows later). A search of the running shape alone
  // (below) is followed by the whole one.
  const std::string running_key = layout_key(running_);
  const bool speeds_moved = last_search_ && last_search_->running_key == running_key &&
                            !within_speeds(last_search_->smoothed, smoothed_, policy_.tolerance);
  // Of those, a device that runs a stage, against the others that do: the running shape can
  // use no other device, so a speed moved on a device it leaves idle alone (its straggler
  // went) owes the whole search.
  const bool running_speeds_moved =
      speeds_moved && !within_speeds(running_speeds(running_, last_search_->smoothed.speed),
                                     running_speeds(running_, smoothed_.speed), policy_.tolerance);
  const bool confirming = confirmations_ > 0 && last_search_ && last_search_->running_key == running_key;
  const bool owed = !last_search_ || last_search_->running_key != running_key || speeds_moved ||
                    last_search_->shape_only;
  // The runtime's cost beyond the simulated step (dispatching actions, messages, the host)
  // grows with the actions each rank walks: per action, measured on the running plan.
  const double per_action =
      std::max(0.0, measured_step_s - running_.predicted_step_s) / actions_per_rank(running_);
  // Both plans priced by the same model, the measured step scaled by their ratio: a model
  // that prices the running plan above what it measures (a link correction learnt under a
  // straggler's stretched transfers) prices the other plans as high, so comparing its
  // figure for another plan with the running plan's measured step would see every other
  // plan as slower (a straggler's uneven shares priced 27% slower, measured 19% faster).
  // The host's time per step is the same under either plan: the gain is asked of the whole step.
  const double modelled_running = running_.predicted_step_s + per_action * actions_per_rank(running_);
  auto predicted = [&](const Plan& plan) {
    const double modelled = plan.predicted_step_s + per_action * actions_per_rank(plan);
    return host_s + (modelled_running > 0 ? measured_step_s * modelled / modelled_running : modelled);
  };
  // Each undone switch doubles the gain asked (the model was wrong once; it must be surer),
  // and a return to a shape left on devices as fast doubles it again.
  const double asked = policy_.min_gain * (1 << std::min(undone_, 3));
  auto left_before = [&](const Plan& plan) {
    const auto left = left_.find(shape_key(plan));
    return left != left_.end() && within_speeds(smoothed_.speed, left->second, policy_.tolerance);
  };
  // Shares that no longer match their devices' speeds were made for speeds that moved since (a
  // straggler that went): a plan of the same shape, which moves shares and cuts alone, asks half
  // the gain (a Qwen2's 0.62/0.38 stood 50 steps after its hog stopped, its devices read x1.00
  // and x0.90, the even split priced 8.2% faster, measured 13% faster).
  const bool outlived = shares_outlived(running_, cluster_, policy_.tolerance);
  auto refit = [&](const Plan& plan) { return outlived && shape_key(plan) == shape_key(running_); };
  auto needed = [&](const Plan& plan) { return (left_before(plan) ? 2 * asked : asked) * (refit(plan) ? 0.5 : 1); };

  // A plan of the running shape, searched alone, is confirmed by the whole search where every
  // running device now runs as fast as the fastest (a straggler went): the shape cut around
  // it is what the whole space may change, and that search is quick on every process (a
  // ResNet-18's pipeline was re-cut 29 steps after its hog stopped, and data parallelism, the
  // whole search's, came 29 steps later still).
  const std::vector<double> running_now = running_speeds(running_, smoothed_.speed);
  const bool confirm_whole = confirming && may_search && last_search_->shape_only && !running_now.empty() &&
                             *std::min_element(running_now.begin(), running_now.end()) >= 1 - policy_.tolerance;
  if ((confirming && !confirm_whole) ||
      (!owed && (!may_search || within(last_search_->factors, applied_, policy_.tolerance / 2)))) {
    CONVEYOR_ASSIGN_OR_RETURN(d.candidate, reprice(costs_, cluster_, options_, last_search_->best));
    d.searched = false;
    d.search_deferred = !within(last_search_->factors, applied_, policy_.tolerance / 2);
  } else {
    // Operators were measured at one microbatch size and are priced in proportion to the
    // samples, which small microbatches are not (each operator's fixed cost: a CPU MLP's
    // 2 samples ran at 68% of 16's time, priced at 1/8). So a search may at most halve the
    // samples a replica computes per microbatch from what the running plan measured: a
    // prediction never rests far from a measurement, and the next window may go on.
    const int floor = std::max(1, smallest_share(running_) / 2);
    CostGraph bounded = costs_;
    bounded.min_share = std::max(bounded.min_share, floor);
    PlanOptions near = options_;
    if (near.microbatches == 0) near.max_microbatches = std::max(1, std::min(near.max_microbatches, near.batch / floor));
    // A device's speed that moved under the running plan (a straggler came or went) asks
    // what the running shape does with its cuts and shares free: a search a fraction of the
    // whole one's, which follows at the next window, or once a plan of this one's runs.
    // Searched whole at once on a straggler's process 0, whose planner gets a tenth of its
    // core, the window that saw the straggler was heard two windows later (4.9 s), and the
    // windows it overlapped went unevaluated. So does the first search of a new plan that
    // kept the shape of the one before (its cuts or shares moved: a straggler's speed read
    // under one split of its time-shared core was faster than the next split ran, and the
    // better split, searched whole, came 20 steps after the switch); after a new shape, the
    // whole space is searched first, for a shape that fits the devices better still. A search
    // of the running shape is followed by the whole one whatever moved since: an idle device
    // probed each window read a new speed each time, and every search was of the running
    // shape, which could not take the device back; and a speed moved on an idle device alone
    // is searched whole at once (the running shape searched alone, it came back a 2 s window
    // later: 122 steps after its nine hogs stopped, in bench/replan).
    d.shape_only = (running_speeds_moved && !last_search_->shape_only) || kept_shape_;
    kept_shape_ = false;
    CONVEYOR_ASSIGN_OR_RETURN(d.candidate, make_plan(bounded, cluster_, d.shape_only ? same_shape(near, running_) : near));
    last_search_ = Search{running_key, applied_, smoothed_, d.candidate, d.shape_only};
  }
  d.predicted_step_s = predicted(d.candidate);
  d.gain_s = d.measured_step_s - d.predicted_step_s;
  d.move = move_cost(costs_, links_as_measured(), running_, d.candidate, options_, policy_);
  const std::string shape_search = std::string(speeds_moved ? "a device's speed moved" : "a new plan's first search") +
                                   ": the running shape searched alone";
  const std::string key = layout_key(d.candidate);
  const double relative = d.gain_s / d.measured_step_s;
  d.gain_asked = needed(d.candidate);
  if (key == layout_key(running_)) {
    d.reason = "the running plan is still the best on the corrected costs";
  } else if (relative <= 0) {
    d.reason = "no other plan is faster on the corrected costs: the best other one would take " +
               percent(-relative) + " more of a step";
  } else if (relative < d.gain_asked) {
    d.reason = "the best other plan saves " + percent(relative) + " of a step, less than the " +
               percent(d.gain_asked) + " asked" + (left_before(d.candidate) ? " to return to a plan of a shape left before on devices as fast" : "") +
               (refit(d.candidate) ? " (half the gain: the running shares no longer match the devices' speeds)" : "");
  } else if (d.gain_s * policy_.horizon_steps < (1 + policy_.margin) * d.move.seconds()) {
    d.reason = "what it saves over " + std::to_string(policy_.horizon_steps) + " steps does not pay for moving";
  } else {
    // Consecutive windows that each find a move that pays (the best plan may differ between
    // them by a cut that hardly matters): the last one's plan is taken.
    d.confirmations = ++confirmations_;
    const int disputed = confirmations_ >= policy_.confirmations && policy_.probes_each_device
                             ? unprobed_dispute(probe_rate) : -1;
    d.reprobe_owed = disputed >= 0 && !awaiting_census;
    d.switch_plan = confirmations_ >= policy_.confirmations && !awaiting_census && !d.reprobe_owed;
    if (awaiting_census || d.reprobe_owed) {
      confirmations_ = d.confirmations = std::min(confirmations_, policy_.confirmations - 1);
    }
    d.reason = d.switch_plan     ? "switching: the saving over the horizon pays for moving"
               : awaiting_census ? "a better plan, waiting for the census a device's speed moved owes to confirm it"
               : d.reprobe_owed  ? "a better plan, waiting for a probe of device " + std::to_string(disputed) +
                                      " to confirm it (its stages measure it faster than its speed ceiling)"
                                 : "a better plan, waiting for it to be confirmed";
    if (d.shape_only) d.reason += " (" + shape_search + ")";
    if (d.switch_plan) decided_ = Decided{key, d.measured_step_s, smoothed_.speed};
    return d;
  }
  confirmations_ = 0;
  if (d.shape_only) {
    d.reason += " (" + shape_search + ", the whole space at the next window)";
  } else if (d.search_deferred) {
    d.reason += " (not searched again: the corrections moved, but searches are spaced out and no device's speed "
                "moved beyond the noise)";
  } else if (!d.searched) {
    d.reason += " (not searched again: the corrections moved less than the noise since the last search)";
  }
  return d;
}

Status Replanner::switched_to(const Plan& plan, double step_before_s) {
  if (!std::isfinite(step_before_s) || step_before_s < 0) {
    return Status(ErrorCode::kInvalidArgument, "a step before the switch of " + std::to_string(step_before_s) +
                                                   " s (a finite time, not negative; 0: the deciding window's)");
  }
  const std::string key = layout_key(plan);
  // A switch this decided is judged by the next window; an undo or a forced switch is not.
  if (decided_ && decided_->key == key) {
    undo_ = Undo{running_, *decided_, step_before_s > 0 ? step_before_s : decided_->step_s};
  }
  decided_.reset();
  kept_shape_ = shape_key(plan) == shape_key(running_);
  left_[shape_key(running_)] = smoothed_.speed;
  left_.erase(shape_key(plan));
  CONVEYOR_ASSIGN_OR_RETURN(running_, reprice(costs_, cluster_, options_, plan));
  note_idle_devices();
  uncapped_.clear();
  unpriced_.clear();
  census_asked_ = false;  // its first window is a census
  windows_awaiting_census_ = 0;
  confirmations_ = 0;
  last_search_.reset();
  return Status::ok();
}

}  // namespace conveyor::partitioner
