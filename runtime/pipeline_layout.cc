#include "runtime/pipeline_layout.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "graph/partition.h"

namespace conveyor::runtime {

using graph::NodeId;
using graph::ValueId;

namespace {

// Per rank, its replicas' weights summing to 1, or empty for an even split (none given, or
// all equal). Errors: a count other than the rank's replicas, a weight that is not positive.
Result<std::vector<std::vector<double>>> normalized_weights(std::vector<std::vector<double>> weights,
                                                            const std::vector<int>& replicas) {
  if (weights.empty()) weights.resize(replicas.size());
  if (weights.size() != replicas.size()) {
    return Status(ErrorCode::kInvalidArgument, "replica weights for " + std::to_string(weights.size()) +
                                                   " ranks, but the pipeline has " + std::to_string(replicas.size()));
  }
  for (std::size_t r = 0; r < weights.size(); ++r) {
    auto& w = weights[r];
    if (w.empty()) continue;
    if (static_cast<int>(w.size()) != replicas[r]) {
      return Status(ErrorCode::kInvalidArgument, "rank " + std::to_string(r) + " has " + std::to_string(replicas[r]) +
                                                     " replicas but " + std::to_string(w.size()) + " weights");
    }
    double sum = 0;
    for (double x : w) {
      if (!std::isfinite(x) || x <= 0) {
        return Status(ErrorCode::kInvalidArgument, "rank " + std::to_string(r) + " has a replica weight of " +
                                                       std::to_string(x) + " (weights are positive)");
      }
      sum += x;
    }
    if (std::all_of(w.begin(), w.end(), [&](double x) { return x == w[0]; })) {
      w.clear();
      continue;
    }
    for (double& x : w) x /= sum;
  }
  return weights;
}

}  // namespace

Result<PipelineLayout> PipelineLayout::create(const graph::Graph& g, std::vector<std::vector<NodeId>> stages,
                                              const scheduler::ScheduleSpec& spec, std::vector<int> rank_replicas,
                                              std::set<std::string> held, std::set<std::string> trainable,
                                              std::vector<std::vector<double>> rank_weights) {
  CONVEYOR_RETURN_IF_ERROR(graph::check_partition(g, stages));
  const int num_stages = static_cast<int>(stages.size());
  if (spec.stages() != num_stages) {
    return Status(ErrorCode::kInvalidArgument, "the schedule has " + std::to_string(spec.stages()) +
                                                   " stages but the partition " + std::to_string(num_stages));
  }
  PipelineLayout out;
  out.rank_replicas = rank_replicas.empty() ? std::vector<int>(static_cast<std::size_t>(spec.ranks), 1)
                                            : std::move(rank_replicas);
  if (static_cast<int>(out.rank_replicas.size()) != spec.ranks) {
    return Status(ErrorCode::kInvalidArgument, "replica counts for " + std::to_string(out.rank_replicas.size()) +
                                                   " ranks, but the schedule has " + std::to_string(spec.ranks));
  }
  for (int r : out.rank_replicas) {
    if (r < 1) return Status(ErrorCode::kInvalidArgument, "every stage needs at least one replica");
    out.most_replicas = std::max(out.most_replicas, r);
  }
  for (int s = 0; s < num_stages; ++s) out.stage_replicas.push_back(out.rank_replicas[spec.rank_of_stage(s)]);
  CONVEYOR_ASSIGN_OR_RETURN(out.rank_weights, normalized_weights(std::move(rank_weights), out.rank_replicas));
  for (int r = 0; r < spec.ranks; ++r) {
    int first = r;
    for (int q = 0; q < r && first == r; ++q) {
      if (out.rank_replicas[q] == out.rank_replicas[r] && out.rank_weights[q] == out.rank_weights[r]) first = q;
    }
    out.rank_split.push_back(first);
  }
  std::vector<int> stage_split;
  for (int s = 0; s < num_stages; ++s) stage_split.push_back(out.rank_split[spec.rank_of_stage(s)]);
  CONVEYOR_ASSIGN_OR_RETURN(out.batch, BatchLayout::analyze(g, stages, out.stage_replicas, stage_split));
  CONVEYOR_ASSIGN_OR_RETURN(out.schedule, scheduler::make_schedule(spec));

  out.reads_from.assign(static_cast<std::size_t>(num_stages), {});
  out.read_by.assign(static_cast<std::size_t>(num_stages), {});
  for (int t = 0; t < num_stages; ++t) {
    for (ValueId v : graph::stage_boundary(g, stages[t]).inputs) {
      const int s = out.batch.producer[v];
      if (s < 0) continue;
      if (std::find(out.reads_from[t].begin(), out.reads_from[t].end(), s) == out.reads_from[t].end()) {
        out.reads_from[t].push_back(s);
      }
      if (std::find(out.read_by[s].begin(), out.read_by[s].end(), t) == out.read_by[s].end()) out.read_by[s].push_back(t);
    }
  }
  // Parameters by the stages that read them: reduced by their stage, or after the step
  // when several stages read them.
  std::map<ValueId, std::set<int>> readers;
  for (int s = 0; s < num_stages; ++s) {
    for (NodeId n : stages[s]) {
      for (ValueId in : graph::Graph::node_inputs(g.nodes[n])) readers[in].insert(s);
    }
  }
  out.stage_parameters.resize(static_cast<std::size_t>(num_stages));
  out.stage_shared.resize(static_cast<std::size_t>(num_stages));
  for (const auto& b : g.bindings) {
    if (b.kind == graph::Binding::Kind::kBuffer) out.buffers.push_back(b.name);
    if (b.kind != graph::Binding::Kind::kParameter) continue;
    if (!held.count(b.name) || !trainable.count(b.name) || !readers.count(b.value)) continue;
    const auto& who = readers[b.value];
    if (who.size() == 1) {
      out.stage_parameters[*who.begin()].push_back(b.name);
    } else {
      out.shared_parameters.push_back(b.name);
      for (int s : who) out.stage_shared[s].push_back(b.name);
    }
  }
  out.stages = std::move(stages);
  out.held = std::move(held);
  out.trainable = std::move(trainable);
  return out;
}

std::vector<int> PipelineLayout::partners(int stage, int i, int other) const {
  return scheduler::partner_replicas({stage_replicas[stage], stage_replicas[other]}, 0, i, 1,
                                     {rank_split[rank_of(stage)], rank_split[rank_of(other)]});
}

Share PipelineLayout::share(std::int64_t length, int stage, int i) const {
  return share_of(length, rank_weights[rank_of(stage)], stage_replicas[stage], i);
}

std::vector<std::vector<double>> PipelineLayout::stage_weights() const {
  std::vector<std::vector<double>> out;
  for (int s = 0; s < num_stages(); ++s) out.push_back(rank_weights[rank_of(s)]);
  return out;
}

}  // namespace conveyor::runtime
