#include "partitioner/stage_model.h"

#include <algorithm>
#include <numeric>

namespace conveyor::partitioner::detail {

StageSums stage_sums(const Units& u, const CutStates& cs, int outer, int inner) {
  StageSums s;
  s.fwd = cs.fwd[outer] - cs.fwd[inner];
  s.bwd = cs.bwd[outer] - cs.bwd[inner];
  s.bwd_w = cs.bwd_w[outer] - cs.bwd_w[inner];
  s.saved = cs.saved[outer] - cs.saved[inner];
  s.params = cs.params[outer] - cs.params[inner];
  s.sel_fwd = cs.sel_fwd[outer] - cs.sel_fwd[inner];
  s.sel_freed = cs.sel_freed[outer] - cs.sel_freed[inner];
  s.saved_w = cs.saved_w[outer] - cs.saved_w[inner];
  s.grads_w = cs.grads_w[outer] - cs.grads_w[inner];
  s.in_bytes = cs.out_bytes[inner];
  s.out_bytes = cs.out_bytes[outer];
  if (cs.linear && !cs.blocks.empty()) {
    s.work = cs.block_work.query(inner, outer - inner);
    s.sel_live_work = std::max(0.0, cs.block_sel_live.query(inner, outer - inner) -
                                        (cs.saved[outer] - cs.sel_freed[outer]));
  } else {
    const Bits& a = cs.sets[outer];
    const Bits& b = cs.sets[inner];
    double kept = 0, live = 0;  // selective: as CutStates::block_sel_live, over this stage alone
    for (std::size_t w = 0; w < a.size(); ++w) {
      std::uint64_t diff = a[w] & ~b[w];
      while (diff) {
        int bit = __builtin_ctzll(diff);
        diff &= diff - 1;
        const Unit& unit = u.units[static_cast<int>(w) * 64 + bit];
        s.work = std::max(s.work, unit.work);
        kept += unit.saved - unit.sel_freed;  // units in a topological order: the forward's
        live = std::max(live, std::max(unit.work, unit.sel_work) + kept);
      }
    }
    s.sel_live_work = std::max(0.0, live - kept);
  }
  return s;
}

Result<double> score(const Units& u, const CutStates& cs, const Model& model, const Solution& sol,
                     std::vector<StageEval>* evals) {
  const int stages = static_cast<int>(sol.cuts.size());
  int used = std::accumulate(sol.replicas.begin(), sol.replicas.end(), 0);
  if (used > model.devices()) return Status(ErrorCode::kInvalidArgument, "the plan uses more devices than the cluster has");
  int first = model.devices() - used;
  double sum = 0, max_stage = 0, max_ar = 0;
  for (int s = 0; s < stages; ++s) {
    StageSums ss = stage_sums(u, cs, sol.cuts[s].second, sol.cuts[s].first);
    StageEval e = model.eval(ss, first, sol.replicas[s], stages - 1 - s, s + 1 < stages);
    if (!e.fits()) {
      return Status(ErrorCode::kDoesNotFit, "stage " + std::to_string(s) + " needs " + human_bytes(e.need) +
                                                " per device, its devices have " + human_bytes(e.capacity));
    }
    sum += e.compute + e.comm;
    max_stage = std::max({max_stage, e.compute, e.comm});
    max_ar = std::max(max_ar, e.tail());
    if (evals) evals->push_back(e);
    first += sol.replicas[s];
  }
  return model.objective(sum, max_stage, max_ar);
}

}  // namespace conveyor::partitioner::detail
