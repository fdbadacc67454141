#include "runtime/batch_layout.h"

#include <algorithm>
#include <string>

#include "graph/partition.h"

namespace conveyor::runtime {

using graph::NodeId;
using graph::ValueId;

Result<BatchLayout> BatchLayout::analyze(const graph::Graph& g, const std::vector<std::vector<NodeId>>& stages,
                                         const std::vector<int>& stage_replicas,
                                         const std::vector<int>& stage_split) {
  auto alike = [&](int a, int b) {
    return stage_split.empty() ? stage_replicas[a] == stage_replicas[b] : stage_split[a] == stage_split[b];
  };
  if (g.outputs.size() != 1 || g.values[g.outputs[0]].kind != graph::ValueKind::kTensor ||
      !g.values[g.outputs[0]].shape.empty()) {
    return Status(ErrorCode::kInvalidArgument,
                  "the model's forward must return one scalar loss to be trained pipelined (it returns " +
                      std::to_string(g.outputs.size()) +
                      " values); compute the loss inside forward, or wrap the model so that it does");
  }
  const int num_stages = static_cast<int>(stages.size());
  BatchLayout out;
  out.loss = g.outputs[0];
  out.producer.assign(g.values.size(), -1);
  for (int s = 0; s < num_stages; ++s) {
    for (NodeId n : stages[s]) {
      for (ValueId v : graph::Graph::node_outputs(g.nodes[n])) out.producer[v] = s;
    }
  }
  static_cast<graph::BatchValues&>(out) = graph::BatchValues::of(g);
  out.loss_reduction = find_loss_reduction(g, out.batch_dim, out.is_batch_size);
  // Between stages that split a microbatch differently (replica counts or weights) a value
  // is redistributed along its batch dimension, or, when it does not depend on the batch,
  // taken from any replica.
  for (int s = 0; s < num_stages; ++s) {
    for (ValueId v : graph::stage_boundary(g, stages[s]).inputs) {
      const int p = out.producer[v];
      if (p < 0 || alike(p, s)) continue;
      const graph::Value& val = g.values[v];
      if (!out.redistributable(g, v)) {
        return Status(ErrorCode::kUnsupported,
                      "value " + std::to_string(v) + " ('" + val.name + "') passes from stage " + std::to_string(p) +
                          " (" + std::to_string(stage_replicas[p]) + " replicas) to stage " + std::to_string(s) + " (" +
                          std::to_string(stage_replicas[s]) +
                          " replicas, split " + (stage_replicas[p] == stage_replicas[s] ? "by other weights" : "otherwise") +
                          ") but has no plain batch dimension to redistribute along (or holds "
                          "positions within a share, like arange(batch)); give both "
                          "stages the same number of replicas and the same shares, or cut the model elsewhere");
      }
    }
  }
  return out;
}

Status BatchLayout::check_step(std::int64_t batch, int m, const std::vector<int>& stage_replicas,
                               const std::vector<std::vector<double>>& stage_weights) const {
  if (batch < m) {
    return Status(ErrorCode::kInvalidArgument, "the batch has " + std::to_string(batch) + " samples, fewer than the " +
                                                   std::to_string(m) +
                                                   " microbatches the plan runs; use a larger batch, or fix fewer microbatches (microbatches= of "
                                                   "conveyor.Module); a data loader's smaller last batch can be dropped: "
                                                   "drop_last=True");
  }
  const int most = *std::max_element(stage_replicas.begin(), stage_replicas.end());
  if (batch / m < most) {
    return Status(ErrorCode::kInvalidArgument,
                  "the batch has " + std::to_string(batch) + " samples: " + std::to_string(m) + " microbatches leave " +
                      std::to_string(batch / m) + " per microbatch, fewer than the " + std::to_string(most) +
                      " replicas of a stage; use a larger batch, fewer microbatches or fewer replicas (a data "
                      "loader's smaller last batch can be dropped: drop_last=True)");
  }
  // Each replica runs a share of a microbatch; the graph holds only for the sizes its
  // capture allowed (a kernel chosen by size, a branch on the batch size).
  std::int64_t largest = 0, smallest = batch;
  for (std::int64_t micro : {batch / m, (batch + m - 1) / m}) {  // tensor_split's two microbatch lengths
    for (std::size_t s = 0; s < stage_replicas.size(); ++s) {
      const std::vector<double> none;
      for (std::int64_t n : share_lengths(micro, s < stage_weights.size() ? stage_weights[s] : none, stage_replicas[s])) {
        largest = std::max(largest, n);
        smallest = std::min(smallest, n);
      }
    }
  }
  auto outside = [&](const char* bound, std::int64_t limit, std::int64_t share, const char* change) {
    return Status(ErrorCode::kInvalidArgument,
                  std::string("the model's graph holds for ") + bound + " " + std::to_string(limit) +
                      " samples at once (capture found a guard on the batch size: a kernel chosen by size or a "
                      "branch on it), but a replica would run " + std::to_string(share) + " (a batch of " +
                      std::to_string(batch) + " in " + std::to_string(m) + " microbatches, shared by up to " +
                      std::to_string(most) + " replicas); use " + change);
  };
  if (largest > range.max) return outside("at most", range.max, largest, "more microbatches or replicas, or a smaller batch");
  if (smallest < range.min) return outside("at least", range.min, smallest, "fewer microbatches or replicas, or a larger batch");
  return Status::ok();
}

}  // namespace conveyor::runtime
