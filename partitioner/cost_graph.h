// The cost graph the planner works on: operators with measured costs, the tensors between
// them and the parameters they read. Built from a captured graph plus its profile, or read
// from a plain op-graph JSON document (docs/formats.md). Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "graph/ir.h"

namespace conveyor::partitioner {

/// One operator. Times are for `CostGraph::microbatch` samples on a device of speed 1 (the
/// device the profile was measured on); byte counts are for the same microbatch.
struct CostOp {
  std::string name;
  double forward_s = 0;
  double backward_s = 0;         ///< whole backward
  double backward_weight_s = 0;  ///< its weight-gradient part (split-backward schedules)
  double saved_bytes = 0;        ///< activations kept from forward to backward
  double work_bytes = 0;         ///< transient memory while the operator runs
  /// Selective recomputation (common/recomputation.h): the forward time it pays again, the
  /// part of saved_bytes it does not keep, and the transient memory while the operator's run
  /// is recomputed for its backward (every value the run makes again and their gradients)
  /// (all 0: it changes nothing for this operator); and what it
  /// keeps beyond saved_bytes (a run's inputs that nothing saved, where they outweigh what
  /// the run frees: a loss kept as its logits rather than its log-probabilities).
  double selective_forward_s = 0, selective_freed_bytes = 0, selective_work_bytes = 0, selective_kept_bytes = 0;
  std::vector<int> inputs;       ///< values read (CostGraph::values)
  std::vector<int> params;       ///< parameters read (CostGraph::params)
  int group = -1;                ///< operators sharing a group >= 0 are never put in different stages
};

/// A tensor flowing between operators. Graph inputs (producer -1) are free: the data loader
/// places each input where it is read.
struct CostValue {
  int producer = -1;
  double bytes = 0;  ///< per microbatch
  /// The operator whose saved_bytes hold this value (it saves it for its backward), -1: none
  /// or unknown. A stage that sends the value on holds it once, not as saved and as sent.
  int saved_by = -1;
  /// Whether the value can pass between stages whose replicas split a microbatch
  /// differently (graph/batch_values.h): false for a value with no plain batch dimension,
  /// which the planner then never cuts through where the two sides may split so.
  bool redistributable = true;
};

/// A parameter (or tied set) that operators read: its bytes, for memory and allreduce.
struct CostParam {
  std::string name;
  double bytes = 0;
};

/// What the planner plans: operators with measured costs, and the bytes between them.
struct CostGraph {
  std::string name;
  std::string device;   ///< where the costs were measured
  int microbatch = 1;   ///< samples per microbatch the costs were measured at
  /// Samples a replica must run at once: the least size of the captured graph's batch range
  /// (a kernel chosen by size, a branch on the batch). The planner keeps every share at least
  /// this large.
  int min_share = 1;
  /// The part of the operators' time that does not shrink with the samples they compute on
  /// (0..1): a replica computing a share s of `microbatch` samples takes the measured time
  /// x (fixed_fraction + (1 - fixed_fraction) s) (docs/planner.md). 0: in proportion.
  double fixed_fraction = 0;
  std::vector<CostOp> ops;  ///< in a topological order: an op reads only values of earlier ops
  std::vector<CostValue> values;
  std::vector<CostParam> params;

  /// Indices in range, producers before readers, no negative or non-finite costs.
  Status validate() const;
  /// For each value, the ops reading it (ascending, unique).
  std::vector<std::vector<int>> readers() const;

  /// Parses an op-graph document ("format": "conveyor-op-graph"); errors name the JSON path.
  static Result<CostGraph> from_json(std::string_view text);
  std::string to_json() const;
};

/// Reads an op-graph JSON file.
Result<CostGraph> load_cost_graph(const std::string& path);

/// A profile: measured costs of every node of one captured graph at one microbatch size.
struct NodeProfile {
  double forward_s = 0, backward_s = 0, backward_weight_s = 0;
  double saved_bytes = 0, work_bytes = 0;
  double selective_forward_s = 0, selective_freed_bytes = 0, selective_work_bytes = 0,  ///< as CostOp's
         selective_kept_bytes = 0;
};
/// Measured costs of a captured graph's nodes at one microbatch size.
struct Profile {
  std::string graph_hash;  ///< graph_hash() of the graph it was measured on
  std::string device;
  int microbatch = 1;
  double fixed_fraction = 0;                    ///< as CostGraph's
  std::vector<NodeProfile> nodes;               ///< indexed by node id
  std::vector<double> value_bytes;              ///< indexed by value id; 0 for non-tensors
  std::vector<int> value_saved_by;              ///< indexed by value id: the node whose saved_bytes hold it, -1 none (empty: unknown)
  std::string torch_version;

  static Result<Profile> from_json(std::string_view text);
  std::string to_json() const;
};

/// A stable hash of a graph's structure (its JSON document): profiles are keyed by it.
std::string graph_hash(const graph::Graph& graph);

/// Joins a captured graph and its profile. Atomic groups (in-place writes through views)
/// become cost groups; parameters and buffers become params with the profiled sizes.
Result<CostGraph> cost_graph_from_profile(const graph::Graph& graph, const Profile& profile);

}  // namespace conveyor::partitioner
