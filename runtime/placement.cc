#include "runtime/placement.h"

#include <algorithm>
#include <map>

#include "graph/partition.h"

namespace conveyor::runtime {

using graph::NodeId;
using graph::ValueId;

namespace {

void add_remote(std::vector<Placement::Remote>& list, int to, ValueId v) {
  for (Placement::Remote& r : list) {
    if (r.process != to) continue;
    if (std::find(r.values.begin(), r.values.end(), v) == r.values.end()) r.values.push_back(v);
    return;
  }
  list.push_back({to, {v}});
}

std::uint64_t fingerprint_of(const graph::Graph& g, const PipelineLayout& layout,
                             const std::vector<std::vector<int>>& per_rank) {
  std::uint64_t h = 1469598103934665603ULL;  // FNV-1a over every number that shapes the pipeline
  auto mix = [&h](std::int64_t x) {
    for (int k = 0; k < 8; ++k) h = (h ^ static_cast<std::uint64_t>((x >> (8 * k)) & 0xff)) * 1099511628211ULL;
  };
  const auto& spec = layout.schedule.spec;
  mix(static_cast<std::int64_t>(spec.kind));
  mix(spec.chunks);
  mix(spec.microbatches);
  for (int r : layout.rank_replicas) mix(r);
  for (const auto& rank : per_rank) {
    mix(-2);
    for (int p : rank) mix(p);
  }
  for (const auto& stage : layout.stages) {
    mix(-1);
    for (NodeId n : stage) mix(n);
  }
  mix(static_cast<std::int64_t>(g.nodes.size()));
  return h;
}

}  // namespace

Placement Placement::one_process(const PipelineLayout& layout) {
  Placement p;
  for (int s = 0; s < layout.num_stages(); ++s) {
    p.local_replicas.emplace_back();
    for (int r = 0; r < layout.stage_replicas[s]; ++r) p.local_replicas.back().push_back(r);
    p.stage_processes.push_back({0});
  }
  return p;
}

Result<Placement> Placement::across(const graph::Graph& g, const PipelineLayout& layout, int process, int world,
                                    const std::vector<std::vector<int>>& per_rank) {
  const int ranks = layout.schedule.spec.ranks, num_stages = layout.num_stages();
  if (static_cast<int>(per_rank.size()) != ranks) {
    return Status(ErrorCode::kInvalidArgument, "processes given for " + std::to_string(per_rank.size()) +
                                                   " pipeline ranks, but the pipeline has " + std::to_string(ranks));
  }
  for (int rank = 0; rank < ranks; ++rank) {
    if (static_cast<int>(per_rank[rank].size()) != layout.rank_replicas[rank]) {
      return Status(ErrorCode::kInvalidArgument, "pipeline rank " + std::to_string(rank) + " has " +
                                                     std::to_string(layout.rank_replicas[rank]) + " replicas but " +
                                                     std::to_string(per_rank[rank].size()) + " are placed on processes");
    }
    for (int p : per_rank[rank]) {
      if (p < 0 || p >= world) {
        return Status(ErrorCode::kInvalidArgument, "pipeline rank " + std::to_string(rank) + " placed on process " +
                                                       std::to_string(p) + " of a world of " + std::to_string(world));
      }
    }
  }
  Placement out;
  out.process = process;
  out.world = world;
  out.activations_out.assign(static_cast<std::size_t>(num_stages), {});
  out.gradients_out.assign(static_cast<std::size_t>(num_stages), {});
  for (int st = 0; st < num_stages; ++st) {
    out.replica_process.push_back(per_rank[layout.rank_of(st)]);
    std::set<int> spanned(out.replica_process[st].begin(), out.replica_process[st].end());
    out.stage_processes.emplace_back(spanned.begin(), spanned.end());
    out.local_replicas.emplace_back();
    for (int r = 0; r < layout.stage_replicas[st]; ++r) {
      if (out.replica_process[st][r] == process) out.local_replicas.back().push_back(r);
    }
    out.activations_out[st].resize(static_cast<std::size_t>(layout.stage_replicas[st]));
    out.gradients_out[st].resize(static_cast<std::size_t>(layout.stage_replicas[st]));
  }
  // Values go from their producer's process straight to every process that reads them,
  // gradients straight back.
  for (int t = 0; t < num_stages; ++t) {
    for (ValueId v : graph::stage_boundary(g, layout.stages[t]).inputs) {
      const int s = layout.batch.producer[v];
      if (s < 0) continue;
      for (int j = 0; j < layout.stage_replicas[t]; ++j) {
        for (int i : layout.partners(t, j, s)) {
          if (out.replica_process[t][j] == out.replica_process[s][i]) continue;
          add_remote(out.activations_out[s][i], out.replica_process[t][j], v);
          add_remote(out.gradients_out[t][j], out.replica_process[s][i], v);
        }
      }
    }
  }
  // Parameters and buffers: owned by the process of their first reader's replica 0;
  // parameters several stages read in several processes (tied weights) get their gradients
  // summed across the processes after each step (a stage's own parameters, by its
  // processes' subgroup during the step).
  std::map<ValueId, std::set<int>> reading, stages_reading;  // value -> processes, stages
  std::map<ValueId, int> first;                              // value -> first reading stage
  for (int st = 0; st < num_stages; ++st) {
    for (NodeId n : layout.stages[st]) {
      for (ValueId in : graph::Graph::node_inputs(g.nodes[n])) {
        for (int p : out.replica_process[st]) reading[in].insert(p);
        stages_reading[in].insert(st);
        first.emplace(in, st);
      }
    }
  }
  // Buffers the model writes (running statistics; through views too): the others never change.
  std::vector<bool> written(g.values.size(), false);
  const std::vector<ValueId> root = graph::storage_roots(g);
  for (const auto& n : g.nodes) {
    for (int a : n.mutated_args) {
      if (n.args[a].kind == graph::Argument::Kind::kValue) written[root[n.args[a].value]] = true;
    }
  }
  for (const auto& b : g.bindings) {
    if (!first.count(b.value) || !layout.held.count(b.name)) continue;
    if (b.kind != graph::Binding::Kind::kParameter && b.kind != graph::Binding::Kind::kBuffer) continue;
    const int owner = out.replica_process[first[b.value]][0];
    out.owners.emplace_back(b.name, owner);
    const std::set<int>& readers = reading[b.value];
    out.readers.emplace_back(readers.begin(), readers.end());
    if (!readers.count(process)) {
      out.not_here.push_back(b.name);
    } else if (b.kind == graph::Binding::Kind::kBuffer) {
      out.buffers_here.insert(b.name);
    }
    if (b.kind == graph::Binding::Kind::kParameter && stages_reading[b.value].size() > 1 && readers.size() > 1 &&
        layout.trainable.count(b.name)) {
      out.cross_shared.emplace_back(b.name, readers.count(process) > 0);
    }
    bool replicated_across = false;  // read by a stage whose replicas span processes
    for (int st : stages_reading[b.value]) replicated_across = replicated_across || out.spans_processes(st);
    if (b.kind == graph::Binding::Kind::kBuffer && written[b.value] && replicated_across && readers.size() > 1) {
      out.buffer_syncs.push_back({b.name, std::vector<int>(readers.begin(), readers.end()),
                                  static_cast<int>(std::distance(readers.begin(), readers.find(owner)))});
    }
  }
  out.fingerprint = fingerprint_of(g, layout, per_rank);
  return out;
}

const std::vector<ValueId>* Placement::values_for(const std::vector<Remote>& list, int process) {
  for (const Remote& r : list) {
    if (r.process == process) return &r.values;
  }
  return nullptr;
}

std::vector<std::pair<int, int>> Placement::links() const {
  std::vector<std::pair<int, int>> out;
  for (const RemoteLists* lists : {&activations_out, &gradients_out}) {
    for (std::size_t st = 0; st < lists->size(); ++st) {
      for (std::size_t i = 0; i < (*lists)[st].size(); ++i) {
        for (const Remote& to : (*lists)[st][i]) out.emplace_back(replica_process[st][i], to.process);
      }
    }
  }
  return out;
}

LocalReplicas Placement::local_workers(const PipelineLayout& layout) const {
  LocalReplicas local(static_cast<std::size_t>(layout.schedule.spec.ranks));
  for (int s = 0; s < layout.num_stages(); ++s) {
    auto& rank = local[layout.rank_of(s)];
    rank.assign(static_cast<std::size_t>(layout.stage_replicas[s]), false);
    for (int r : local_replicas[s]) rank[r] = true;
  }
  return local;
}

}  // namespace conveyor::runtime
