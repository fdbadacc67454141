// The `conveyor` command-line tool: inspect, validate and cut graph files; plan a graph on a
// cluster; simulate a plan; check traces; launch the processes of a job.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "common/status.h"
#include "conveyor_config.h"
#include "graph/format.h"
#include "graph/partition.h"
#include "common/env.h"
#include "common/file.h"
#include "common/printable.h"
#include "partitioner/planner.h"
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

struct PlanArgs {
  std::string graph, cluster, profile, out, trace, schedule;
  int batch = 0, microbatches = 0;
  double optimizer_state = 2;
  double time_budget_s = partitioner::PlanOptions{}.time_budget_s;
};

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

  PlanArgs plan_args;
  auto* plan_cmd = app.add_subcommand("plan", "plan a graph on a cluster: stages, replicas, schedule, microbatches");
  plan_cmd->add_option("--graph", plan_args.graph, "op-graph JSON, or a graph file (with its profile)")->required();
  plan_cmd->add_option("--cluster", plan_args.cluster, "cluster TOML (docs/formats.md)")->required();
  plan_cmd->add_option("--batch", plan_args.batch, "samples per training step")->required()->check(CLI::PositiveNumber);
  plan_cmd->add_option("--profile", plan_args.profile, "profile JSON of a graph file (default: the profile cache)");
  plan_cmd->add_option("--microbatches", plan_args.microbatches, "fix the microbatch count (default: choose)")
      ->check(CLI::Range(0, scheduler::kMostMicrobatches));
  plan_cmd->add_option("--schedule", plan_args.schedule, "auto, " + scheduler::schedule_names_text());
  // CLI::Range lets NaN through (no comparison with it is true).
  const auto finite_range = [](double lo, double hi, const std::string& what) {
    return CLI::Validator(
        [lo, hi, what](std::string& text) -> std::string {
          char* end = nullptr;
          const double v = std::strtod(text.c_str(), &end);
          if (end == text.c_str() || *end != '\0' || !std::isfinite(v) || v < lo || v > hi) {
            char range[64];
            std::snprintf(range, sizeof range, "from %g to %g", lo, hi);
            return "expected " + what + " " + range + ", not '" + printable(text, 40) + "'";
          }
          return "";
        },
        "NUMBER");
  };
  plan_cmd->add_option("--optimizer-state", plan_args.optimizer_state,
                       "optimizer state bytes per parameter byte (Adam 2, SGD+momentum 1)")
      ->check(finite_range(0, 64, "bytes of optimizer state per parameter byte"));
  plan_cmd->add_option("--time-budget", plan_args.time_budget_s,
                       "seconds the simulated search may take (default 30; 0: no limit): past it, the best plan found "
                       "so far, and the plan says so")
      ->check(finite_range(0, 86400, "seconds"));
  plan_cmd->add_option("--out", plan_args.out, "write the plan JSON here");
  plan_cmd->add_option("--trace", plan_args.trace, "write the simulated step as a Perfetto trace");

  std::string plan_path, trace_path;
  auto* simulate_cmd = app.add_subcommand("simulate", "simulate a plan's step event by event");
  simulate_cmd->add_option("--plan", plan_path, "plan JSON written by conveyor plan")->required();
  simulate_cmd->add_option("--trace", trace_path, "write a Perfetto trace of the simulated step");

  auto* trace_cmd = app.add_subcommand("trace", "work with Perfetto traces");
  trace_cmd->require_subcommand(1);
  auto* trace_check_cmd = trace_cmd->add_subcommand("check", "decode a trace and check its structure");
  trace_check_cmd->add_option("file", trace_path, "a .pftrace file")->required();

  // The environment's CONVEYOR_TIMEOUT and the like are the defaults; a config, then flags, override them.
  const Result<tools::JobConfig> environment_defaults = tools::job_defaults_from_environment();
  tools::JobConfig job = environment_defaults ? *environment_defaults : tools::JobConfig{};
  std::string job_file, hosts;
  std::vector<std::string> command;
  auto* launch_cmd = app.add_subcommand(
      "launch", "start a job's processes here (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for each); "
                "one that fails stops the others");
  launch_cmd->add_option("--config", job_file, "job config TOML (docs/formats.md); flags given here override it");
  auto* n_opt = launch_cmd->add_option("-n,--processes", job.processes, "processes on this machine")
                    ->check(CLI::Range(1, 4096));
  auto* hosts_opt = launch_cmd->add_option("--hosts", hosts, "comma-separated machines of the job (the launcher runs on each)");
  auto* node_opt = launch_cmd->add_option("--node-rank", job.node_rank, "which of --hosts this machine is")
                       ->check(CLI::NonNegativeNumber);
  auto* addr_opt = launch_cmd->add_option("--master-addr", job.master_addr, "where process 0 listens (default: the first host)");
  auto* port_opt = launch_cmd->add_option("--master-port", job.master_port, "its port (default: a free one, one machine only)")
                       ->check(CLI::Range(0, 65535));
  // CLI::Range lets NaN through (no comparison with it is true): the one check of seconds instead.
  const CLI::Validator seconds_check(
      [](std::string& text) -> std::string {
        char* end = nullptr;
        const double s = std::strtod(text.c_str(), &end);
        if (end == text.c_str() || *end != '\0' || !valid_seconds(s)) {
          char range[64];
          std::snprintf(range, sizeof range, "from %g to %g", kLeastSeconds, kMostSeconds);
          return "expected a number of seconds " + std::string(range) + ", not '" + printable(text, 40) + "'";
        }
        return "";
      },
      "SECONDS");
  auto* timeout_opt = launch_cmd->add_option("--timeout", job.timeout_s, "seconds any wait between processes may take")
                          ->check(seconds_check);
  auto* grace_opt = launch_cmd->add_option("--grace", job.grace_s, "seconds from SIGTERM to SIGKILL when stopping")
                        ->check(seconds_check);
  auto* transport_opt = launch_cmd->add_option("--transport", job.transport,
                                                "ucx or nccl: how GPU tensors cross between processes (pipelines, "
                                                "conveyor.distributed)")
                            ->check(CLI::IsMember({"ucx", "nccl"}));
  auto* trace_opt = launch_cmd->add_option("--trace", job.trace,
                                            "trace the job: each process's conveyor.Module writes its step to "
                                            "FILE.rank<R>, conveyor.distributed's process 0 every process's "
                                            "communication to FILE (Perfetto; Chrome JSON for .json)");
  launch_cmd->add_option("command", command, "the command every process runs (after --)")->expected(-1);

  CLI11_PARSE(app, argc, argv);
  if (*launch_cmd) {
    if (!environment_defaults) return fail(environment_defaults.status());
    tools::JobConfig from_cli = job;
    if (!job_file.empty()) {
      auto text = read_file(job_file, "job config");
      if (!text) return fail(text.status());
      auto parsed = tools::parse_job_config(*text, job_file, *environment_defaults);
      if (!parsed) return fail(parsed.status());
      job = *parsed;
      if (*n_opt) job.processes = from_cli.processes;
      if (*node_opt) job.node_rank = from_cli.node_rank;
      if (*addr_opt) job.master_addr = from_cli.master_addr;
      if (*port_opt) job.master_port = from_cli.master_port;
      if (*timeout_opt) job.timeout_s = from_cli.timeout_s;
      if (*grace_opt) job.grace_s = from_cli.grace_s;
      if (*transport_opt) job.transport = from_cli.transport;
      if (*trace_opt) job.trace = from_cli.trace;
    }
    if (*trace_opt && !tools::missing_folder(job.trace).empty()) {
      return fail(Status(ErrorCode::kInvalidArgument, "--trace " + job.trace + ": its folder does not exist (make it first)"));
    }
    if (*hosts_opt) {
      job.hosts.clear();
      std::size_t at = 0;
      while (at <= hosts.size()) {
        const std::size_t comma = std::min(hosts.find(',', at), hosts.size());
        if (comma > at) job.hosts.push_back(hosts.substr(at, comma - at));
        at = comma + 1;
      }
      if (job.hosts.empty()) return fail(Status(ErrorCode::kInvalidArgument, "--hosts names no machine"));
    }
    if (job.node_rank >= static_cast<int>(job.hosts.size())) {
      return fail(Status(ErrorCode::kInvalidArgument, "--node-rank " + std::to_string(job.node_rank) + " but " +
                                                          std::to_string(job.hosts.size()) + " hosts"));
    }
    return tools::launch(job, command);
  }
  if (*plan_cmd) return plan_command(plan_args);
  if (*simulate_cmd) return simulate_command(plan_path, trace_path);
  if (*trace_check_cmd) return trace_check_command(trace_path);
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
