// The `conveyor` command-line tool. Subcommands grow with the project: today it inspects,
// validates and cuts graph files; planning, simulation, tracing and launch join later.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>

#include "common/status.h"
#include "conveyor_config.h"
#include "graph/format.h"
#include "graph/partition.h"

namespace {

using namespace conveyor;
using namespace conveyor::graph;

int fail(const Status& st) {
  std::fprintf(stderr, "conveyor: %s\n", st.to_string().c_str());
  return 1;
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", b, units[u]);
  return buf;
}

int inspect(const std::string& path, int top) {
  auto file = load_graph_file(path);
  if (!file) return fail(file.status());
  const Graph& g = file->graph;
  std::map<std::string, int> ops;
  for (const auto& n : g.nodes) ops[n.qualified_name()]++;
  std::size_t params = 0, buffers = 0, constants = 0;
  for (const auto& b : g.bindings) {
    (b.kind == Binding::Kind::kParameter ? params : b.kind == Binding::Kind::kBuffer ? buffers : constants)++;
  }
  double weight_bytes = 0;
  for (const auto& t : file->tensors) weight_bytes += static_cast<double>(t.bytes.size());
  std::printf("graph file   %s\n", path.c_str());
  std::printf("format       version %d", g.version);
  for (const auto& [k, v] : g.producer) std::printf(", %s %s", k.c_str(), v.c_str());
  std::printf("\nnodes        %zu (%zu distinct operators)\n", g.nodes.size(), ops.size());
  std::printf("values       %zu\n", g.values.size());
  std::printf("inputs       %zu:", g.inputs.size());
  for (const auto& in : g.inputs) {
    const Value& v = g.values[in.value];
    std::printf(" %s[", in.name.c_str());
    for (std::size_t d = 0; d < v.shape.size(); ++d) {
      std::printf("%s%s", d ? "," : "", v.shape[d].is_symbolic() ? v.shape[d].symbol.c_str()
                                                                   : std::to_string(v.shape[d].size).c_str());
    }
    std::printf("]");
  }
  std::printf("\noutputs      %zu\n", g.outputs.size());
  std::printf("bound        %zu parameters, %zu buffers, %zu constants; weights stored: %s\n", params,
              buffers, constants, file->tensors.empty() ? "no" : human_bytes(weight_bytes).c_str());
  for (const auto& [sym, role] : g.symbols) std::printf("symbol       %s = %s\n", sym.c_str(), role.c_str());
  auto groups = atomic_groups(g);
  std::size_t grouped = 0;
  for (const auto& gr : groups) grouped += gr.size();
  std::printf("atomic       %zu groups covering %zu nodes (in-place writes through views)\n", groups.size(),
              grouped);
  std::vector<std::pair<int, std::string>> sorted;
  for (const auto& [k, v] : ops) sorted.emplace_back(v, k);
  std::sort(sorted.rbegin(), sorted.rend());
  std::printf("operators    (most used first)\n");
  for (int i = 0; i < top && i < static_cast<int>(sorted.size()); ++i) {
    std::printf("  %6d  %s\n", sorted[i].first, sorted[i].second.c_str());
  }
  return 0;
}

int partition(const std::string& path, int stages, std::uint64_t seed, bool keep_order) {
  auto file = load_graph_file(path);
  if (!file) return fail(file.status());
  const Graph& g = file->graph;
  auto parts = random_partition(g, stages, seed, keep_order);
  if (!parts) return fail(parts.status());
  Status st = check_partition(g, *parts);
  if (!st) return fail(st);
  std::printf("%-6s %-7s %-10s %-10s %s\n", "stage", "nodes", "inputs", "outputs", "first .. last operator");
  for (std::size_t s = 0; s < parts->size(); ++s) {
    const auto& p = (*parts)[s];
    auto b = stage_boundary(g, p);
    std::printf("%-6zu %-7zu %-10zu %-10zu %s .. %s\n", s, p.size(), b.inputs.size(), b.outputs.size(),
                g.nodes[p.front()].qualified_name().c_str(), g.nodes[p.back()].qualified_name().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"conveyor: automatic pipeline + data parallel training for PyTorch models"};
  app.set_version_flag("--version", std::string("conveyor ") + CONVEYOR_VERSION);
  app.require_subcommand(1);

  std::string path;
  int top = 15;
  auto* inspect_cmd = app.add_subcommand("inspect", "summarize a graph file (validates it first)");
  inspect_cmd->add_option("graph", path, "graph file written by Graph.save")->required();
  inspect_cmd->add_option("--top", top, "how many operators to list");

  auto* validate_cmd = app.add_subcommand("validate", "check a graph file; exit status 0 when valid");
  validate_cmd->add_option("graph", path, "graph file")->required();

  int stages = 2;
  std::uint64_t seed = 0;
  bool keep_order = false;
  auto* partition_cmd = app.add_subcommand("partition", "cut a graph file into random valid stages");
  partition_cmd->add_option("graph", path, "graph file")->required();
  partition_cmd->add_option("--stages", stages, "number of stages")->check(CLI::PositiveNumber);
  partition_cmd->add_option("--seed", seed, "random seed");
  partition_cmd->add_flag("--keep-node-order", keep_order, "stages are contiguous in capture order");

  CLI11_PARSE(app, argc, argv);
  if (*inspect_cmd) return inspect(path, top);
  if (*validate_cmd) {
    auto file = load_graph_file(path);
    if (!file) return fail(file.status());
    std::printf("%s: valid conveyor graph (%zu nodes)\n", path.c_str(), file->graph.nodes.size());
    return 0;
  }
  if (*partition_cmd) return partition(path, stages, seed, keep_order);
  return 0;
}
