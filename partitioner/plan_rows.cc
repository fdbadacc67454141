#include "partitioner/plan_rows.h"

#include <algorithm>

namespace conveyor::partitioner::detail {

// Parameters, their gradients and optimizer state per device, each parameter once: the
// searches count a parameter once per unit that reads it (conservative), but a stage holds
// it once, and so does a rank for all its stages (GPT-2's tied embedding in the first and
// the last stage of a V): it is counted with the rank's first stage that reads it. Its
// gradient comes with the rank's last stage that reads it, whose backward runs first.
void count_parameters_once(const CostGraph& g, const scheduler::ScheduleSpec& spec, double state_per_byte,
                           Plan& p) {
  const auto ranks = static_cast<std::size_t>(spec.ranks);
  std::vector<std::vector<bool>> held(ranks, std::vector<bool>(g.params.size(), false));
  std::vector<std::vector<bool>> graded(ranks, std::vector<bool>(g.params.size(), false));
  auto bytes_of_new = [&](const StagePlan& stage, std::vector<bool>& seen) {
    double bytes = 0;
    for (int op : stage.ops) {
      for (int q : g.ops[op].params) {
        if (!seen[q]) bytes += g.params[q].bytes;
        seen[q] = true;
      }
    }
    return bytes;
  };
  for (std::size_t s = 0; s < p.stages.size(); ++s) {
    const auto r = static_cast<std::size_t>(spec.rank_of_stage(static_cast<int>(s)));
    p.stages[s].static_bytes = bytes_of_new(p.stages[s], held[r]) * (2 + state_per_byte);
  }
  for (std::size_t s = p.stages.size(); s-- > 0;) {
    const auto r = static_cast<std::size_t>(spec.rank_of_stage(static_cast<int>(s)));
    p.stages[s].weight_grad_bytes = bytes_of_new(p.stages[s], graded[r]);
  }
}

// Bytes the stage outer \ inner both sends on and saves for its own backward: a stage holds
// such a value once, where the searches (StageModel) count it as kept and as sent.
static double sent_and_saved(const Units& u, const CutStates& cs, int outer, int inner) {
  double bytes = 0;
  for (const Edge& e : u.edges) {
    if (e.saved_by < 0 || !test(cs.sets[outer], e.from) || !test(cs.sets[outer], e.saved_by) ||
        test(cs.sets[inner], e.saved_by)) {
      continue;
    }
    for (int t : e.to) {
      if (!test(cs.sets[outer], t)) {
        bytes += e.bytes;
        break;
      }
    }
  }
  return bytes;
}

// The plan row of the stage outer \ inner on devices [first, first + replicas).
StagePlan stage_plan(const Units& u, const CutStates& cs, int inner, int outer, const Model& model,
                     const Cluster& cluster, int first, int replicas, const StageEval& e, bool has_prev,
                     bool has_next) {
  StagePlan sp;
  for (std::size_t x = 0; x < u.units.size(); ++x) {
    if (test(cs.sets[outer], static_cast<int>(x)) && !test(cs.sets[inner], static_cast<int>(x))) {
      sp.ops.insert(sp.ops.end(), u.units[x].ops.begin(), u.units[x].ops.end());
    }
  }
  std::sort(sp.ops.begin(), sp.ops.end());
  const StageSums ss = stage_sums(u, cs, outer, inner);
  sp.first_device = first;
  sp.replicas = replicas;
  sp.shares = model.shares(first, replicas);
  sp.forward_s = ss.fwd * e.time_per_work + model.options().action_overhead_s;
  sp.backward_s = (ss.forward_again(e.recompute) + ss.bwd) * e.time_per_work + model.options().action_overhead_s;
  sp.backward_weight_s = weight_half(ss.bwd, ss.bwd_w, ss.in_bytes > 0) * e.time_per_work;
  sp.send_bytes = has_next ? ss.out_bytes * model.scale() : 0;
  sp.recv_bytes = has_prev ? ss.in_bytes * model.scale() : 0;
  sp.allreduce_s = e.allreduce;
  sp.optimizer_s = e.optimizer;
  sp.param_bytes = ss.params;
  // static_bytes: count_parameters_once, over every stage of the plan.
  const double held_once = e.recompute == Recomputation::kNone ? sent_and_saved(u, cs, outer, inner) : 0;
  sp.saved_bytes = (ss.kept(e.recompute) + ss.out_bytes - held_once) * model.scale() * e.max_share;
  // A stage that reads nothing from another (the first) has no input gradient to compute: its
  // split backward does everything at W.
  sp.input_freed_bytes = ss.in_bytes > 0 ? sp.saved_bytes - ss.saved_w * model.scale() * e.max_share : 0;
  sp.captured_bytes = ss.in_bytes > 0 ? ss.grads_w * model.scale() * e.max_share : 0;
  sp.recompute = e.recompute;
  sp.split_backward_extra_bytes = e.backward_extra_bytes;
  sp.backward_extra_bytes = e.backward_extra_bytes;
  if (e.recompute == Recomputation::kNone) {
    double after = 0, extra = 0;  // the units of the stage, last to first
    for (std::size_t x = u.units.size(); x-- > 0;) {
      if (test(cs.sets[outer], static_cast<int>(x)) && !test(cs.sets[inner], static_cast<int>(x))) {
        extra = std::max(extra, u.units[x].work - after);
        after += u.units[x].saved;
      }
    }
    sp.backward_extra_bytes = extra * model.scale() * e.max_share;
    // A first stage's Bi computes nothing: its W is a whole backward, freeing as it goes.
    if (!has_prev) sp.split_backward_extra_bytes = sp.backward_extra_bytes;
  }
  sp.memory_bytes = e.need;
  sp.in_flight = e.in_flight;
  return sp;
}

}  // namespace conveyor::partitioner::detail
