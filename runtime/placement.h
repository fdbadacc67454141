// Which process runs each stage replica, and everything that follows from it (torch-free):
// which values and gradients cross between processes and to whom, which stages sum their
// gradients across processes, which process owns each parameter and buffer, what this
// process may release, which written buffers go from their owner to the other readers
// after a step. This is what a re-plan changes when it moves replicas between processes;
// in one process every replica is here and nothing crosses.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "graph/ir.h"
#include "runtime/pipeline_layout.h"
#include "runtime/step_run.h"

namespace conveyor::runtime {

/// The processes of a pipeline's replicas and what crosses between them.
struct Placement {
  /// Values one replica sends to another process (activations), or gradients it hands back.
  struct Remote {
    int process = 0;
    std::vector<graph::ValueId> values;
  };
  using RemoteLists = std::vector<std::vector<std::vector<Remote>>>;  ///< [stage][replica]: per other process

  /// A buffer the model writes, read by stages whose replicas span processes: after every
  /// step its owner's value goes to every process in `readers` (ascending; `root` is the
  /// owner's place among them).
  struct BufferSync {
    std::string name;
    std::vector<int> readers;
    int root = 0;
  };

  int process = 0, world = 1;
  std::vector<std::vector<int>> replica_process;  ///< [stage][replica]: the process that runs it
  std::vector<std::vector<int>> local_replicas;   ///< [stage]: the replicas this process runs
  std::vector<std::vector<int>> stage_processes;  ///< [stage]: the processes running its replicas, ascending
  RemoteLists activations_out;  ///< [s][i]: the outputs of s that another process reads from replica i
  RemoteLists gradients_out;    ///< [t][j]: the gradients of t's inputs that replica j hands another process
  std::vector<std::pair<std::string, int>> owners;  ///< parameters and buffers: the process of their first reader's replica 0
  std::vector<std::vector<int>> readers;            ///< per entry of owners: the processes whose stages read it, ascending
  std::vector<std::string> not_here;                ///< parameters and buffers no stage of this process reads
  std::set<std::string> buffers_here;               ///< buffers some stage of this process reads
  /// Parameters that several stages in several processes read (tied weights), and whether
  /// this process reads it: their gradients are summed across processes after each step.
  std::vector<std::pair<std::string, bool>> cross_shared;
  std::vector<BufferSync> buffer_syncs;
  std::uint64_t fingerprint = 0;  ///< of the pipeline and its placement: every process must agree

  /// Every replica in this process.
  static Placement one_process(const PipelineLayout& layout);
  /// Replica i of pipeline rank r on process `per_rank[r][i]`, seen from `process` of `world`.
  static Result<Placement> across(const graph::Graph& g, const PipelineLayout& layout, int process, int world,
                                  const std::vector<std::vector<int>>& per_rank);

  bool across_processes() const { return !replica_process.empty(); }
  /// Whether replica `replica` of `stage` runs in this process.
  bool here(int stage, int replica) const {
    return replica_process.empty() || replica_process[stage][replica] == process;
  }
  /// Whether `stage`'s replicas run in more than one process.
  bool spans_processes(int stage) const { return stage_processes[stage].size() > 1; }
  /// The values `list` sends to `process` (null: none).
  static const std::vector<graph::ValueId>* values_for(const std::vector<Remote>& list, int process);
  /// Every (sender, receiver) pair of processes a message goes between.
  std::vector<std::pair<int, int>> links() const;
  /// Per rank and replica, whether this process runs it (what the runner walks).
  LocalReplicas local_workers(const PipelineLayout& layout) const;
};

}  // namespace conveyor::runtime
