#include "partitioner/recalibrate.h"

#include <cmath>
#include <string>

namespace conveyor::partitioner {

namespace {

// measured / predicted, or 1 where either says nothing.
double ratio(double measured, double predicted) { return measured > 0 && predicted > 0 ? measured / predicted : 1.0; }

}  // namespace

Result<CostGraph> recalibrate(const CostGraph& costs, const Plan& plan, const std::vector<StageMeasurement>& measured) {
  if (measured.size() != plan.stages.size()) {
    return Status(ErrorCode::kInvalidArgument, "measurements of " + std::to_string(measured.size()) +
                                                   " stages for a plan of " + std::to_string(plan.stages.size()));
  }
  CostGraph out = costs;
  for (std::size_t s = 0; s < plan.stages.size(); ++s) {
    const StagePlan& predicted = plan.stages[s];
    const StageMeasurement& m = measured[s];
    for (double x : {m.forward_s, m.backward_s, m.backward_weight_s}) {
      if (!std::isfinite(x) || x < 0) {
        return Status(ErrorCode::kInvalidArgument, "stage " + std::to_string(s) + " measured a time of " +
                                                       std::to_string(x) + " s (times are finite and not negative)");
      }
    }
    const double forward = ratio(m.forward_s, predicted.forward_s);
    const bool split = m.backward_weight_s > 0;
    // Split: backward_s measured the input half, which the plan predicts as the whole
    // backward less its weight half; whole: both halves move together.
    const double input = split ? ratio(m.backward_s, predicted.backward_s - predicted.backward_weight_s)
                               : ratio(m.backward_s, predicted.backward_s);
    const double weight = split ? ratio(m.backward_weight_s, predicted.backward_weight_s) : input;
    for (int id : predicted.ops) {
      if (id < 0 || id >= static_cast<int>(out.ops.size())) {
        return Status(ErrorCode::kInvalidArgument, "stage " + std::to_string(s) + " of the plan has operator " +
                                                       std::to_string(id) + ", outside the cost graph's " +
                                                       std::to_string(out.ops.size()));
      }
      CostOp& op = out.ops[id];
      const double weight_s = op.backward_weight_s * weight;
      op.forward_s *= forward;
      op.backward_s = (op.backward_s - op.backward_weight_s) * input + weight_s;
      op.backward_weight_s = weight_s;
    }
  }
  return out;
}

}  // namespace conveyor::partitioner
