#include "fuzz/readers.h"

#include "graph/format.h"
#include "partitioner/cluster.h"
#include "partitioner/cost_graph.h"
#include "partitioner/planner.h"
#include "tools/launch.h"
#include "trace/perfetto.h"

namespace conveyor::fuzz {

const std::vector<std::string>& reader_names() {
  static const std::vector<std::string> names{"graph_file", "graph_document", "op_graph", "profile",
                                              "cluster",    "job_config",     "plan",     "trace"};
  return names;
}

Status read_as(std::string_view reader, std::string_view bytes) {
  const std::string text(bytes);
  if (reader == "graph_file") {
    // Whoever crafts a file recomputes its checksums: so does the fuzzer, to get past them.
    std::string fixed(bytes);
    graph::fix_checksums(fixed);
    auto file = graph::read_graph_file(fixed, "graph file");
    if (!file) return file.status();
    return graph::Graph::from_json(file->graph.to_json()).status();
  }
  if (reader == "graph_document") {
    auto g = graph::Graph::from_json(text);
    if (!g) return g.status();
    return graph::Graph::from_json(g->to_json()).status();
  }
  if (reader == "op_graph") {
    auto g = partitioner::CostGraph::from_json(text);
    if (!g) return g.status();
    return partitioner::CostGraph::from_json(g->to_json()).status();
  }
  if (reader == "profile") {
    auto p = partitioner::Profile::from_json(text);
    if (!p) return p.status();
    return partitioner::Profile::from_json(p->to_json()).status();
  }
  if (reader == "cluster") {
    auto c = partitioner::Cluster::from_toml(text, "cluster");
    if (!c) return c.status();
    (void)c->summary();
    return Status::ok();
  }
  if (reader == "job_config") return tools::parse_job_config(text, "job.toml").status();
  if (reader == "plan") {
    auto p = partitioner::Plan::from_json(text);
    if (!p) return p.status();
    (void)p->table();
    return partitioner::Plan::from_json(p->to_json()).status();
  }
  if (reader == "trace") return trace::check_trace(bytes).status();
  return Status(ErrorCode::kInvalidArgument, "no reader named '" + std::string(reader) + "'");
}

}  // namespace conveyor::fuzz
