// The `conveyor` command-line tool: inspect, validate and cut graph files; plan a graph on a
// cluster; simulate a plan; check traces; launch the processes of a job. Its arguments are
// read by tools/command_line.h.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <string>

#include "common/status.h"
#include "conveyor_config.h"
#include "graph/format.h"
#include "graph/partition.h"
#include "common/env.h"
#include "common/file.h"
#include "common/printable.h"
#include "partitioner/planner.h"
#include "tools/command_line.h"
#include "tools/launch.h"
#include "trace/simulation_trace.h"

namespace {

using namespace conveyor;
using namespace conveyor::graph;

int fail(const Status& st) {
  std::fprintf(stderr, "conveyor: %s\n", st.to_string().c_str());
  return 1;
}

using partitioner::human_bytes;
using partitioner::human_seconds;

// A name read from a file (an operator, an input, a track), as printed: printable and excerpted.
std::string shown(const std::string& name) { return printable(name, 80); }

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
  for (const auto& [k, v] : g.producer) std::printf(", %s %s", shown(k).c_str(), shown(v).c_str());
  std::printf("\nnodes        %zu (%zu distinct operators)\n", g.nodes.size(), ops.size());
  std::printf("values       %zu\n", g.values.size());
  std::printf("inputs       %zu:", g.inputs.size());
  for (const auto& in : g.inputs) {
    const Value& v = g.values[in.value];
    std::printf(" %s[", shown(in.name).c_str());
    for (std::size_t d = 0; d < v.shape.size(); ++d) {
      std::printf("%s%s", d ? "," : "", v.shape[d].is_symbolic() ? shown(v.shape[d].symbol).c_str()
                                                                   : std::to_string(v.shape[d].size).c_str());
    }
    std::printf("]");
  }
  std::printf("\noutputs      %zu\n", g.outputs.size());
  std::printf("bound        %zu parameters, %zu buffers, %zu constants; weights stored: %s\n", params,
              buffers, constants, file->tensors.empty() ? "no" : human_bytes(weight_bytes).c_str());
  for (const auto& [sym, role] : g.symbols) std::printf("symbol       %s = %s\n", shown(sym).c_str(), shown(role).c_str());
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
    std::printf("  %6d  %s\n", sorted[i].first, shown(sorted[i].second).c_str());
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
                shown(g.nodes[p.front()].qualified_name()).c_str(), shown(g.nodes[p.back()].qualified_name()).c_str());
  }
  return 0;
}

// A graph to plan: an op-graph JSON document, or a captured graph file with its profile
// (given, or found in the profile cache under the graph's hash).
Result<partitioner::CostGraph> load_planning_graph(const std::string& path, const std::string& profile_path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(ErrorCode::kIo, "cannot open graph '" + path + "'");
  char head[8] = {};
  in.read(head, sizeof head);
  if (std::string_view(head, static_cast<std::size_t>(in.gcount())) != kContainerMagic) {
    return partitioner::load_cost_graph(path);
  }
  CONVEYOR_ASSIGN_OR_RETURN(GraphFile file, load_graph_file(path));
  std::string chosen = profile_path;
  const std::string hash = partitioner::graph_hash(file.graph);
  if (chosen.empty()) {
    namespace fs = std::filesystem;
    const fs::path dir = fs::path(env::cache_dir()) / "profiles";
    std::error_code ec;
    auto newest = fs::file_time_type::min();
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(hash + "-", 0) == 0 && entry.last_write_time(ec) >= newest) {
        newest = entry.last_write_time(ec);
        chosen = entry.path().string();
      }
    }
    if (chosen.empty()) {
      return Status(ErrorCode::kInvalidArgument,
                    "no profile for graph " + hash + " in " + dir.string() +
                        "; profile it first (conveyor.profile(model, example) in Python) or pass --profile FILE");
    }
  }
  CONVEYOR_ASSIGN_OR_RETURN(std::string profile_text, read_file(chosen, "profile"));
  auto profile = partitioner::Profile::from_json(profile_text);
  if (!profile) return profile.status().with_context(chosen);
  auto g = partitioner::cost_graph_from_profile(file.graph, *profile);
  if (g) g->name = std::filesystem::path(path).stem().string();
  return g;
}

Status write_simulation_trace(const partitioner::Plan& plan, const std::string& path) {
  CONVEYOR_ASSIGN_OR_RETURN(auto schedule, scheduler::make_schedule(plan.schedule_spec()));
  CONVEYOR_ASSIGN_OR_RETURN(auto sim, plan.simulate());
  return trace::write_step_trace(path, schedule, sim);
}

using tools::PlanArgs;

int plan_command(const PlanArgs& a) {
  auto g = load_planning_graph(a.graph, a.profile);
  if (!g) return fail(g.status());
  auto cluster = partitioner::load_cluster(a.cluster);
  if (!cluster) return fail(cluster.status());
  partitioner::PlanOptions o;
  o.batch = a.batch;
  o.microbatches = a.microbatches;
  o.optimizer_bytes_per_param_byte = a.optimizer_state;
  o.time_budget_s = a.time_budget_s;
  // Progress on stderr, so a long search is never silent and the plan on stdout stays clean.
  const auto started = std::chrono::steady_clock::now();
  o.progress = [&started](int done, int total, double best_s) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (std::isfinite(best_s)) {
      std::fprintf(stderr, "planning: %d of %d searches done in %.1f s; best so far %.3f ms a step (analytic)\n", done,
                   total, elapsed, best_s * 1e3);
    } else {
      std::fprintf(stderr, "planning: %d of %d searches done in %.1f s; no plan fits yet\n", done, total, elapsed);
    }
  };
  if (!a.schedule.empty() && a.schedule != "auto") {
    auto k = scheduler::schedule_kind_from_name(a.schedule);
    if (!k) return fail(k.status());
    o.schedules = {*k};
  }
  auto plan = partitioner::make_plan(*g, *cluster, o);
  if (!plan) return fail(plan.status());
  std::printf("graph %s: %zu operators (profiled at microbatch %d%s%s)\ncluster %s\n\n", g->name.c_str(),
              g->ops.size(), g->microbatch, g->device.empty() ? "" : " on ", g->device.c_str(),
              cluster->summary().c_str());
  std::printf("%s", plan->table().c_str());
  if (!a.out.empty()) {
    Status st = write_file(a.out, plan->to_json(), "plan file");
    if (!st) return fail(st);
    std::printf("plan written to %s\n", a.out.c_str());
  }
  if (!a.trace.empty()) {
    Status st = write_simulation_trace(*plan, a.trace);
    if (!st) return fail(st);
    std::printf("simulated trace written to %s\n", a.trace.c_str());
  }
  return 0;
}

int simulate_command(const std::string& path, const std::string& trace_path) {
  auto plan = partitioner::load_plan(path);
  if (!plan) return fail(plan.status());
  auto sim = plan->simulate();
  if (!sim) return fail(sim.status());
  std::printf("plan %s: %zu stages, schedule %s, %d microbatches\n", path.c_str(), plan->stages.size(),
              std::string(scheduler::schedule_kind_name(plan->schedule)).c_str(), plan->microbatches);
  std::printf("step time     %s (%.1f samples/s)\n", human_seconds(sim->step_time_s).c_str(),
              plan->batch / sim->step_time_s);
  std::printf("bubble        %.2f%%\n", 100 * sim->bubble_fraction);
  for (std::size_t r = 0; r < sim->busy_s.size(); ++r) {
    std::printf("rank %-3zu      busy %s, peak memory %s (%.0f bytes: weights, gradients, optimizer state and "
                "activations alive at once)\n",
                r, human_seconds(sim->busy_s[r]).c_str(), human_bytes(sim->peak_bytes[r]).c_str(), sim->peak_bytes[r]);
  }
  if (!trace_path.empty()) {
    Status st = write_simulation_trace(*plan, trace_path);
    if (!st) return fail(st);
    std::printf("trace written to %s\n", trace_path.c_str());
  }
  return 0;
}

int trace_check_command(const std::string& path) {
  auto s = trace::check_trace_file(path);
  if (!s) return fail(s.status());
  std::printf("%s: valid Perfetto trace: %zu tracks, %zu slices, %zu instants, %zu flows\n", path.c_str(), s->tracks,
              s->slices, s->instants, s->flows);
  for (const auto& [name, count] : s->slices_by_name) {
    std::printf("  %-12s %zu slices\n", name.empty() ? "(other)" : shown(name).c_str(), count);
  }
  for (const auto& [track, count] : s->slices_by_track) {
    std::printf("  on %-24s %zu slices\n", ("'" + shown(track) + "'").c_str(), count);
  }
  return 0;
}

}  // namespace

static int run_command(int argc, char** argv) {
  const tools::Invocation run = tools::parse_command_line(std::vector<std::string>(argv, argv + argc));
  if (run.done) {
    std::fputs(run.text.c_str(), run.exit_code == 0 ? stdout : stderr);
    return run.exit_code;
  }
  using Command = tools::Invocation::Command;
  switch (run.command) {
    case Command::kLaunch:
      return tools::launch(run.job, run.launch_command);
    case Command::kPlan:
      return plan_command(run.plan);
    case Command::kSimulate:
      return simulate_command(run.plan_path, run.trace_path);
    case Command::kTraceCheck:
      return trace_check_command(run.trace_path);
    case Command::kInspect:
      return inspect(run.path, run.top);
    case Command::kValidate: {
      auto file = load_graph_file(run.path);
      if (!file) return fail(file.status());
      std::printf("%s: valid conveyor graph (%zu nodes)\n", run.path.c_str(), file->graph.nodes.size());
      return 0;
    }
    case Command::kPartition:
      return partition(run.path, run.stages, run.seed, run.keep_order);
    case Command::kNone:
      break;
  }
  return 0;
}

// Every reader bounds its input, so memory runs out only past those bounds (a machine with
// little of it): said in one line, not as an abort.
int main(int argc, char** argv) {
  try {
    return run_command(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fputs("conveyor: out of memory: the input is within conveyor's limits (docs/formats.md) but this machine, "
               "or the process's memory limit (ulimit -v), has too little for it\n", stderr);
    return 1;
  }
}
