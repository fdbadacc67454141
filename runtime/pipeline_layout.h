// The immutable shape of one pipeline (torch-free): its stages and schedule, the replica
// count of every stage, where the batch is in every value (BatchLayout), which stages read
// which, and which parameters each stage's replicas reduce. Made once when a pipeline is
// built; every owner of a step's state reads it and none changes it. A re-plan makes a new
// one.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "common/status.h"
#include "graph/ir.h"
#include "runtime/batch_layout.h"
#include "scheduler/schedule.h"

namespace conveyor::runtime {

/// What a pipeline is made of, and the relations every other owner needs.
struct PipelineLayout {
  scheduler::Schedule schedule;
  std::vector<std::vector<graph::NodeId>> stages;  ///< node lists, in pipeline order
  std::vector<int> rank_replicas;                  ///< per rank
  std::vector<int> stage_replicas;                 ///< per stage (its rank's count)
  /// Per rank: each replica's weight in splitting a microbatch (share_lengths, summing to
  /// 1); empty: even (also when every weight given was equal).
  std::vector<std::vector<double>> rank_weights;
  /// Per rank: the first rank that splits a microbatch the same way (as many replicas, the
  /// same weights). Replica i of one talks to replica i of the other only; other pairs join
  /// and split again.
  std::vector<int> rank_split;
  int most_replicas = 1;                           ///< the largest count: replica executors made
  BatchLayout batch;
  std::vector<std::vector<int>> reads_from;  ///< [stage]: the stages whose outputs it reads
  std::vector<std::vector<int>> read_by;     ///< [stage]: the stages that read its outputs
  /// Trainable parameters read by one stage alone (its replicas sum their gradients), per stage.
  std::vector<std::vector<std::string>> stage_parameters;
  std::vector<std::string> shared_parameters;  ///< trainable, read by several stages (tied)
  std::vector<std::vector<std::string>> stage_shared;  ///< [stage]: the shared parameters it reads
  std::vector<std::string> buffers;            ///< every buffer binding
  std::set<std::string> held;                  ///< parameters and buffers the executor holds a tensor for
  std::set<std::string> trainable;             ///< parameters that require gradients

  /// Checks `stages` against `g` and `spec`, and analyses the batch. `held` and `trainable`
  /// name the bindings the executor holds and those that require gradients; `rank_weights`
  /// (empty: even shares) one positive weight per replica of each rank.
  static Result<PipelineLayout> create(const graph::Graph& g, std::vector<std::vector<graph::NodeId>> stages,
                                       const scheduler::ScheduleSpec& spec, std::vector<int> rank_replicas,
                                       std::set<std::string> held, std::set<std::string> trainable,
                                       std::vector<std::vector<double>> rank_weights = {});

  int num_stages() const { return static_cast<int>(stages.size()); }
  int rank_of(int stage) const { return schedule.spec.rank_of_stage(stage); }
  int microbatches() const { return schedule.spec.microbatches; }
  /// Replica `i` of `stage`'s share of a microbatch of `length` samples (its rank's weights).
  Share share(std::int64_t length, int stage, int i) const;
  /// Per stage, its rank's weights (for BatchLayout::check_step).
  std::vector<std::vector<double>> stage_weights() const;
  /// Whether stages `a` and `b` split a microbatch alike (rank_split).
  bool same_split(int a, int b) const { return rank_split[rank_of(a)] == rank_split[rank_of(b)]; }
  /// The replicas of `other` (a stage) that replica `i` of `stage` exchanges values with:
  /// the one of the same index when both have as many replicas, every one otherwise.
  std::vector<int> partners(int stage, int i, int other) const;
};

}  // namespace conveyor::runtime
