// Deciding whether a running plan should give way to another (docs/planner.md,
// "Re-planning"): the measured stage times correct the planning inputs (recalibrate.h), the
// planner plans again on them, and the new plan is taken only when what it saves over the
// horizon pays for moving to it by a margin, and keeps doing so over consecutive
// measurements (hysteresis: noise never makes plans flip back and forth). Torch-free.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "partitioner/recalibrate.h"

namespace conveyor::partitioner {

/// When a new plan is worth switching to.
struct ReplanPolicy {
  int horizon_steps = 100;      ///< the steps over which a switch must pay for itself
  double min_gain = 0.1;        ///< the least predicted saving, relative to the measured step
  double margin = 0.5;          ///< the horizon's saving must exceed the moving cost times (1 + margin)
  int confirmations = 2;        ///< consecutive evaluations that must find a move that pays
  double tolerance = 0.1;       ///< deviations from the prediction below this are noise (settle)
  /// Each window's factors move the running estimate this far (an exponential average):
  /// one noisy window cannot swing it, and estimates never ratchet away from the profile.
  double smoothing = 0.5;
  /// Whether parameters and optimizer state cross links when stages move (several
  /// processes); in one process they stay in place and only the pipeline is rebuilt.
  bool moves_bytes = true;
  /// Whether the caller can probe a device again on its own (a process per device); in one
  /// process its devices are one device shared, read alike at each census and never apart,
  /// so a ceiling its stages dispute owes no second reading (ReplanDecision::reprobe_owed).
  bool probes_each_device = true;
  double rebuild_s = 0;         ///< what building a pipeline took (measured)
  double bytes_per_s = 0;       ///< measured moving speed; 0: the cluster's link bandwidth
};

/// What moving from one plan to another costs.
struct MoveCost {
  double bytes = 0;        ///< parameters and optimizer state that change device
  double transfer_s = 0;   ///< those bytes over the links (0 when nothing crosses a link)
  double rebuild_s = 0;
  double seconds() const { return transfer_s + rebuild_s; }
};

/// `bytes` of parameters and optimizer state (optimizer_bytes_per_param_byte of `options`)
/// that a device of `to` reads and no device of `from` held there, over the link from one of
/// their old holders.
MoveCost move_cost(const CostGraph& costs, const Cluster& cluster, const Plan& from, const Plan& to,
                   const PlanOptions& options, const ReplanPolicy& policy);

/// What a window's step spent beyond what its live profile measured of the pipeline.
struct BeyondPipeline {
  /// Per device, its process's optimizer step per training step (0, or none: not measured).
  /// The plans price it per stage, after its gradient sum (optimizer_cost, PlanOptions::
  /// optimizer_s_per_param_byte), and the measured step evaluate is given includes it.
  std::vector<double> optimizer_s;
  /// Per step, what no plan changes: the caller's loop, its data, its logging (and, in one
  /// process, the optimizer's step, which updates the whole model under any plan). Added
  /// to the measured and the predicted step alike: a switch is asked its gain of the step as
  /// the caller sees it.
  double host_s = 0;
  /// The mean step as the caller measured it over the window (0: not measured; then the
  /// measured step with host_s). A switch is judged on it, against the same figure of the
  /// last window before it (switched_to): the one comparison the switch's log also prints.
  double caller_step_s = 0;
};

/// One evaluation: the corrected model's view and what it decided.
struct ReplanDecision {
  bool switch_plan = false;
  bool undo = false;               ///< back to the plan before the last switch, which measured slower
  Calibration calibration;         ///< the corrected inputs; its `running` is the new reference
  double action_overhead_s = 0;    ///< the runtime's measured cost per action, planned with
  Plan candidate;                  ///< the best plan on the corrected inputs
  /// The running plan's mean step over the window, as the caller sees it (host_s included).
  double measured_step_s = 0;
  double predicted_step_s = 0;     ///< the candidate's, in the same terms
  double optimizer_s_per_param_byte = 0;  ///< the optimizer's step, as measured (PlanOptions')
  double host_s = 0;               ///< of measured_step_s, what no plan changes (BeyondPipeline)
  double gain_s = 0;               ///< per step: measured less predicted
  MoveCost move;
  int confirmations = 0;           ///< consecutive evaluations that picked this candidate
  /// The least saving asked of the candidate, relative to the measured step: the policy's
  /// min_gain, doubled by each undone switch (up to 8x) and again to return to a shape left
  /// under the devices' present speeds; halved for a plan of the running shape while the
  /// running shares no longer match the devices' speeds (shares_outlived: a straggler went).
  double gain_asked = 0;
  /// Whether the planner searched: false when the corrected inputs moved less than half the
  /// tolerance since its last search under the same running plan, or the caller asked for no
  /// search and none was owed (evaluate's `may_search`); that search's best plan is then
  /// priced again instead (a search is the costly part).
  bool searched = true;
  bool search_deferred = false;    ///< not searched though the inputs moved: the caller asked for none
  /// The search kept the running plan's shape (shape_key) and searched its cuts and shares
  /// alone: a device's speed moved, and a plan of that shape paid (the whole search follows
  /// once it runs, or at the next window if it is not confirmed).
  bool shape_only = false;
  /// Per device, the most its speed is taken to be (as a factor, the fastest device's 1), as
  /// its probes set it (Replanner::ceiling_; 0: none): its process probes it again now and
  /// then, so that the ceiling lifts when its straggler goes.
  std::vector<double> speed_ceiling;
  /// A ceiling lifted at this window (its device's straggler went), or a device under one
  /// measured much faster than when it was set (it may have): that device's stages
  /// measured its slowness and their operators' pricing error as one, so the next window's
  /// probes of every device are owed as a census, which tells them apart (and sets the
  /// ceilings anew).
  /// A running device's speed moved beyond three times the noise in a window with no census
  /// (read from its stages' times alone) owes one too, as does one owed and not evaluated
  /// three windows later. census_why: which, when owed.
  bool census_owed = false;
  std::string census_why;
  /// A switch found on a device's speed ceiling that its stages measure well above (one
  /// reading of its probe, slower than its work ran: other work passed through its core while
  /// it probed, or a straggler that its light stage outruns) is confirmed only by a window in
  /// which that device was probed again: the processes of such devices probe at the end of
  /// the next window. A census that read a device at x0.59 with no straggler was confirmed
  /// by its ceiling alone, and the switch, measured slower, undone.
  bool reprobe_owed = false;
  std::string reason;              ///< why it switches or not
  /// The decision's arithmetic on one line: gain, horizon, moving cost in bytes and seconds.
  std::string arithmetic(const ReplanPolicy& policy) const;
};

/// Keeps the planning inputs of a running plan and decides, window after window, whether to
/// move to another. The profile's inputs stay as they were; every window's factors (against
/// the corrected prediction, so they compose) update a smoothed estimate, and what of it is
/// beyond the noise corrects those inputs. A switch it decided that then measures slower than
/// the step before it by more than half the tolerance is undone at the next window.
class Replanner {
 public:
  Replanner(CostGraph costs, Cluster cluster, Plan running, PlanOptions options, ReplanPolicy policy);

  /// One window of the running plan: per stage what it measured, and its mean step time
  /// (the pipeline's, with `beyond`'s optimizer step: what the plans price; an undo and the
  /// gain asked are judged on it with `beyond`'s host time).
  /// `may_search` false (the caller spaces searches out, their CPU time being the costly
  /// part): the last search's best plan is priced again instead of searching, unless a
  /// search is owed: none yet under the running plan, or a device whose speed moved beyond
  /// the tolerance since the last one (a straggler came or went). A switch awaiting its
  /// confirmation is confirmed by the last search's plan still paying.
  /// `probe_rate`, per device: how fast a probe of it ran at the window's end (matrix
  /// products per second; 0: not probed). Where every device was probed (a census: the first
  /// window of each running plan), the probes tell each device's speed apart from its
  /// operators' pricing (measure_factors), and a device the plan leaves idle gets the speed
  /// its probe shows against the running devices'. Later windows probe only idle devices: such
  /// a device's speed is then the one it had at the census times its probe's change since,
  /// so a straggler the plan left out is seen to go away.
  Result<ReplanDecision> evaluate(const std::vector<StageMeasurement>& measured, double measured_step_s,
                                  bool may_search = true, const std::vector<double>& probe_rate = {},
                                  const BeyondPipeline& beyond = {});
  /// `plan` runs from now on (the decision's candidate, or one the user forced), priced on
  /// the corrected inputs. `step_before_s`: the mean step of the last window the plan before
  /// it ran, as the caller measured it (BeyondPipeline::caller_step_s), which the next
  /// window judges a switch this decided against (0: the step of the window that decided
  /// it; confirmed over later windows, that one can be many steps older). Errors: a plan
  /// that does not fit the cost graph or the cluster; a step_before_s negative or not finite.
  Status switched_to(const Plan& plan, double step_before_s = 0);
  /// Whether no stage of `plan` runs on `device`.
  static bool idle(const Plan& plan, int device);

  /// Per stage of `plan`, its operators' own pricing error as corrected (Factors::op): their
  /// profiled time with it over without (1: none known).
  std::vector<double> stage_pricing(const Plan& plan) const;
  /// Per stage of the running plan, what its last census measured of its operators' own error
  /// beyond what they are priced at (empty: none measured).
  const std::vector<double>& unpriced() const { return unpriced_; }

  const Plan& running() const { return running_; }
  const ReplanPolicy& policy() const { return policy_; }
  ReplanPolicy& policy() { return policy_; }

  /// What identifies a layout: stages with their operators, devices and replicas' shares (in
  /// whole samples), microbatches, schedule and chunks (predictions aside).
  static std::string layout_key(const Plan& plan);
  /// A layout's shape: its stages' devices and replicas, microbatches, schedule and chunks,
  /// whatever the cuts and shares. A shape left before (a switch undone, or moved away
  /// from) asks twice the gain to return to, whichever cut the search finds this time, while
  /// every device's speed is still within the tolerance of what it was when it was left:
  /// returning then would be the model changing its mind on the same devices. A straggler
  /// that came or went since changed what the shape was left for, and the usual gain is asked.
  static std::string shape_key(const Plan& plan);

 private:
  /// costs_ and cluster_ as profiled, corrected by `factors`, and the running plan priced on them.
  Status price_with(const Factors& factors);
  /// Where the running plan is priced above its measured step and communicates, the links
  /// priced down until it is not (replan.cc says why); applied_ keeps the link factor used.
  Status fit_links(double measured_step_s);
  CostGraph base_costs_, costs_;  // as profiled; corrected by applied_
  Cluster base_cluster_, cluster_;
  Factors smoothed_, applied_;
  double measured_link_ = 1;  // the links' factor as their sends measured it, before fit_links
  /// The profiled cluster with its links as their sends measured them (not as fitted): what
  /// a move is priced on.
  Cluster links_as_measured() const;
  bool measured_once_ = false;
  Plan running_;                   // priced on the corrected inputs
  PlanOptions options_;
  ReplanPolicy policy_;
  int confirmations_ = 0;
  // Switches undone so far that were decided on the devices' speeds as they are at the undo:
  // each doubles the gain asked (up to 8x).
  int undone_ = 0;
  // Shapes switched away from, with the devices' speeds (as estimated) when they were: a
  // return under speeds within the tolerance of those needs twice the gain.
  std::map<std::string, std::vector<double>> left_;
  // Per device the running plan leaves idle, its speed (as estimated) at its reference probe
  // (the census, or the first probe after it went idle) and that probe's rate: what its later
  // probes are relative to. 0 for a device a stage runs on (and a rate not yet probed).
  std::vector<double> idle_from_, idle_rate_;
  void note_idle_devices();
  /// Per device, the most its speed (as a factor, the fastest device's 1) is taken to be: on
  /// a core it shares, a process woken from waiting runs ahead of its neighbour, so a light
  /// stage there measures full speed and a heavier one gets only the core's share (a BERT's
  /// hogged process 0, given a quarter of the model, read 1.8x device 1's speed; given more,
  /// it ran 10 ms a step slower, and the plan flip-flopped). A census that probes a running
  /// device slower than the fastest beyond the noise sets its ceiling at the probe's ratio
  /// (its share of the device under a full load); a later probe of it scales that, and lifts
  /// it once it runs as fast as the fastest. 0: none.
  std::vector<double> ceiling_, ceiling_rate_;
  /// Whether a later probe lifted a ceiling (a census sets them anew, and lifts none).
  bool update_ceilings(const std::vector<double>& probe_rate, const std::vector<double>& per_rated);
  /// `seen`'s speeds held to their ceilings, against the fastest device without one; whether
  /// a capped device's stages measured it faster than in its first window under its ceiling
  /// by more than three times the tolerance (its straggler may have gone: a census is owed).
  bool cap_at_ceilings(Factors& seen);
  /// Per device, whether this window's stages measured it faster than its ceiling beyond a
  /// probe's noise (cap_at_ceilings).
  std::vector<bool> disputed_;
  /// The first device with a ceiling its stages dispute and no probe in this window
  /// (`probe_rate`), which a switch waits for (ReplanDecision::reprobe_owed); -1: none.
  int unprobed_dispute(const std::vector<double>& probe_rate) const;
  // Per device with a ceiling, its speed as its stages measured it in its first window under
  // the ceiling and the running plan, over the fastest device without one (0: none).
  std::vector<double> uncapped_;
  bool census_asked_ = false;  // a decision owed a census that has not been evaluated yet
  bool probed_ = false;        // the caller probes its devices (a census was evaluated)
  /// Windows evaluated since a running device's speed moved sharply with no probe to say so
  /// (0: none awaited): no switch until the census it owes is evaluated (evaluate).
  int windows_awaiting_census_ = 0;
  /// At a census: every running device its probe shows as fast as the fastest is priced at the
  /// fastest such device's speed before its stages are measured (`per_rated`: every device's
  /// rate per unit of its rated speed). A speed estimated before (under a straggler since gone,
  /// whose stages' times held their operators' error too) would else stand, and what the
  /// stages measure against it be taken for their operators' error.
  Status price_probed_alike(const std::vector<double>& per_rated);
  /// The most an operator's own error is priced at, either way (its stage's measure at a
  /// census: a stage of one 19 us operator read 4.66x, one whose weight gradient ran with
  /// another 0.01x, and the plan that believed them left a device idle).
  static constexpr double kMostOwnError = 4;
  /// Per stage of the running plan, its operators' own error as its census measured it over
  /// what they are priced at (beyond kMostOwnError, or within the noise that settle leaves
  /// unpriced; empty: all 1). The windows until the next census take it out of the stage's
  /// times, which would else read it as its devices' speed (GPT-NeoX's stage of its 50k-word
  /// head, 8x its profile, read its device, never slowed, at x0.3-0.5, and a plan left it
  /// idle; a ResNet-18's stage 15% over its price read its device at x0.85).
  std::vector<double> unpriced_;
  /// unpriced_ from the census's own errors (`measured`, per operator) against applied_'s.
  void note_unpriced(const std::vector<double>& measured);
  /// `stage`'s operators' profiled time (forward and backward), each weighted by `weight(id)`.
  double weighted_time(const StagePlan& stage, const std::function<double(int)>& weight) const;
  /// `measured` with unpriced_ taken out of each stage's compute.
  std::vector<StageMeasurement> as_priced(std::vector<StageMeasurement> measured) const;
  /// `seen`'s speeds of the devices the running plan leaves idle, from their probes
  /// (`per_rated`: at a census, every device's rate per unit of its rated speed; else empty).
  Status idle_speeds(Factors& seen, const std::vector<double>& probe_rate, const std::vector<double>& per_rated);
  // The switch last decided (its layout, the step measured before it, the devices' speeds it
  // was decided on), and once taken, the plan it left with those: the next window undoes it
  // if it measures slower.
  struct Decided {
    std::string key;
    double step_s = 0;
    std::vector<double> speeds;
  };
  std::optional<Decided> decided_;
  struct Undo {
    Plan previous;
    Decided decided;
    double step_before_s = 0;  ///< what the next window is judged against
  };
  std::optional<Undo> undo_;
  // The last search: under which running layout, on which corrections (as applied, and the
  // smoothed estimate before settling), and its best plan.
  struct Search {
    std::string running_key;
    Factors factors;
    Factors smoothed;
    Plan best;
    bool shape_only = false;  ///< the running shape alone searched (a device's speed moved)
  };
  std::optional<Search> last_search_;
  bool kept_shape_ = false;  // the running plan kept the shape of the one before, and is not searched yet
};

}  // namespace conveyor::partitioner
