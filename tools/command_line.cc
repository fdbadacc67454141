#include "tools/command_line.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>
#include <sstream>

#include "common/file.h"
#include "common/printable.h"
#include "conveyor_config.h"
#include "scheduler/schedule.h"

namespace conveyor::tools {

namespace {

Invocation failed(const Status& st) {
  Invocation out;
  out.done = true;
  out.exit_code = 1;
  out.text = "conveyor: " + st.to_string() + "\n";
  return out;
}

// CLI::Range lets NaN through (no comparison with it is true): numbers are checked here instead.
CLI::Validator finite_range(double lo, double hi, const std::string& what) {
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
}

// What the launch subcommand's flags, its config and the environment make together, checked.
Status finish_launch(Invocation& out, const Result<JobConfig>& environment_defaults, const std::string& job_file,
                     const std::string& hosts, const CLI::App& launch_cmd) {
  if (!environment_defaults) return environment_defaults.status();
  const JobConfig from_cli = out.job;
  if (!job_file.empty()) {
    CONVEYOR_ASSIGN_OR_RETURN(std::string text, read_file(job_file, "job config", kConfigFileLimit));
    CONVEYOR_ASSIGN_OR_RETURN(out.job, parse_job_config(text, job_file, *environment_defaults));
    auto given = [&](const char* flag) { return launch_cmd.get_option(flag)->count() > 0; };
    if (given("--processes")) out.job.processes = from_cli.processes;
    if (given("--node-rank")) out.job.node_rank = from_cli.node_rank;
    if (given("--master-addr")) out.job.master_addr = from_cli.master_addr;
    if (given("--master-port")) out.job.master_port = from_cli.master_port;
    if (given("--timeout")) out.job.timeout_s = from_cli.timeout_s;
    if (given("--grace")) out.job.grace_s = from_cli.grace_s;
    if (given("--transport")) out.job.transport = from_cli.transport;
    if (given("--trace")) out.job.trace = from_cli.trace;
  }
  if (launch_cmd.get_option("--trace")->count() > 0 && !missing_folder(out.job.trace).empty()) {
    return Status(ErrorCode::kInvalidArgument,
                  "--trace " + printable(out.job.trace, 80) + ": its folder does not exist (make it first)");
  }
  if (launch_cmd.get_option("--hosts")->count() > 0) {
    out.job.hosts.clear();
    std::size_t at = 0;
    while (at <= hosts.size()) {
      const std::size_t comma = std::min(hosts.find(',', at), hosts.size());
      if (comma > at) out.job.hosts.push_back(hosts.substr(at, comma - at));
      at = comma + 1;
    }
    if (out.job.hosts.empty()) return Status(ErrorCode::kInvalidArgument, "--hosts names no machine");
  }
  if (out.job.node_rank >= static_cast<int>(out.job.hosts.size())) {
    return Status(ErrorCode::kInvalidArgument, "--node-rank " + std::to_string(out.job.node_rank) + " but " +
                                                   std::to_string(out.job.hosts.size()) + " hosts");
  }
  return Status::ok();
}

}  // namespace

Invocation parse_command_line(const std::vector<std::string>& args) {
  Invocation out;
  CLI::App app{"conveyor: automatic pipeline + data parallel training for PyTorch models"};
  app.set_version_flag("--version", std::string("conveyor ") + CONVEYOR_VERSION);
  app.require_subcommand(1);

  auto* inspect_cmd = app.add_subcommand("inspect", "summarize a graph file (validates it first)");
  inspect_cmd->add_option("graph", out.path, "graph file written by Graph.save")->required();
  inspect_cmd->add_option("--top", out.top, "how many operators to list")->check(CLI::Range(0, 1 << 20));

  auto* validate_cmd = app.add_subcommand("validate", "check a graph file; exit status 0 when valid");
  validate_cmd->add_option("graph", out.path, "graph file")->required();

  auto* partition_cmd = app.add_subcommand("partition", "cut a graph file into random valid stages");
  partition_cmd->add_option("graph", out.path, "graph file")->required();
  partition_cmd->add_option("--stages", out.stages, "number of stages")->check(CLI::Range(1, 1 << 20));
  partition_cmd->add_option("--seed", out.seed, "random seed");
  partition_cmd->add_flag("--keep-node-order", out.keep_order, "stages are contiguous in capture order");

  PlanArgs& plan = out.plan;
  auto* plan_cmd = app.add_subcommand("plan", "plan a graph on a cluster: stages, replicas, schedule, microbatches");
  plan_cmd->add_option("--graph", plan.graph, "op-graph JSON, or a graph file (with its profile)")->required();
  plan_cmd->add_option("--cluster", plan.cluster, "cluster TOML (docs/formats.md)")->required();
  plan_cmd->add_option("--batch", plan.batch, "samples per training step")
      ->required()
      ->check(CLI::Range(1, std::numeric_limits<int>::max()));
  plan_cmd->add_option("--profile", plan.profile, "profile JSON of a graph file (default: the profile cache)");
  plan_cmd->add_option("--microbatches", plan.microbatches, "fix the microbatch count (default: choose)")
      ->check(CLI::Range(0, scheduler::kMostMicrobatches));
  plan_cmd->add_option("--schedule", plan.schedule, "auto, " + scheduler::schedule_names_text());
  plan_cmd->add_option("--optimizer-state", plan.optimizer_state,
                       "optimizer state bytes per parameter byte (Adam 2, SGD+momentum 1)")
      ->check(finite_range(0, 64, "bytes of optimizer state per parameter byte"));
  plan_cmd->add_option("--time-budget", plan.time_budget_s,
                       "seconds the simulated search may take (default 30; 0: no limit): past it, the best plan found "
                       "so far, and the plan says so")
      ->check(finite_range(0, 86400, "seconds"));
  plan_cmd->add_option("--out", plan.out, "write the plan JSON here");
  plan_cmd->add_option("--trace", plan.trace, "write the simulated step as a Perfetto trace");

  auto* simulate_cmd = app.add_subcommand("simulate", "simulate a plan's step event by event");
  simulate_cmd->add_option("--plan", out.plan_path, "plan JSON written by conveyor plan")->required();
  simulate_cmd->add_option("--trace", out.trace_path, "write a Perfetto trace of the simulated step");

  auto* trace_cmd = app.add_subcommand("trace", "work with Perfetto traces");
  trace_cmd->require_subcommand(1);
  auto* trace_check_cmd = trace_cmd->add_subcommand("check", "decode a trace and check its structure");
  trace_check_cmd->add_option("file", out.trace_path, "a .pftrace file")->required();

  // The environment's CONVEYOR_TIMEOUT and the like are the defaults; a config, then flags, override them.
  const Result<JobConfig> environment_defaults = job_defaults_from_environment();
  if (environment_defaults) out.job = *environment_defaults;
  std::string job_file, hosts;
  auto* launch_cmd = app.add_subcommand(
      "launch", "start a job's processes here (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for each); "
                "one that fails stops the others");
  launch_cmd->add_option("--config", job_file, "job config TOML (docs/formats.md); flags given here override it");
  launch_cmd->add_option("-n,--processes", out.job.processes, "processes on this machine")->check(CLI::Range(1, 4096));
  launch_cmd->add_option("--hosts", hosts, "comma-separated machines of the job (the launcher runs on each)");
  launch_cmd->add_option("--node-rank", out.job.node_rank, "which of --hosts this machine is")
      ->check(CLI::NonNegativeNumber);
  launch_cmd->add_option("--master-addr", out.job.master_addr, "where process 0 listens (default: the first host)");
  launch_cmd->add_option("--master-port", out.job.master_port, "its port (default: a free one, one machine only)")
      ->check(CLI::Range(0, 65535));
  launch_cmd->add_option("--timeout", out.job.timeout_s, "seconds any wait between processes may take")
      ->check(finite_range(kLeastSeconds, kMostSeconds, "a number of seconds"));
  launch_cmd->add_option("--grace", out.job.grace_s, "seconds from SIGTERM to SIGKILL when stopping")
      ->check(finite_range(kLeastSeconds, kMostSeconds, "a number of seconds"));
  launch_cmd->add_option("--transport", out.job.transport,
                         "ucx or nccl: how GPU tensors cross between processes (pipelines, conveyor.distributed)")
      ->check(CLI::IsMember({"ucx", "nccl"}));
  launch_cmd->add_option("--trace", out.job.trace,
                         "trace the job: each process's conveyor.Module writes its step to FILE.rank<R>, "
                         "conveyor.distributed's process 0 every process's communication to FILE (Perfetto; Chrome "
                         "JSON for .json)");
  launch_cmd->add_option("command", out.launch_command, "the command every process runs (after --)")->expected(-1);

  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    std::ostringstream shown_out, shown_err;
    out.done = true;
    out.exit_code = app.exit(e, shown_out, shown_err);
    out.text = shown_out.str() + shown_err.str();
    if (out.exit_code != 0) {  // CLI11 quotes the arguments as given: terminal escapes and all
      std::string text;
      for (std::size_t at = 0; at < out.text.size();) {
        const std::size_t end = std::min(out.text.find('\n', at), out.text.size());
        text += printable(std::string_view(out.text).substr(at, end - at), 300) + "\n";
        at = end + 1;
      }
      out.text = text;
    }
    return out;
  }
  using Command = Invocation::Command;
  if (*launch_cmd) {
    out.command = Command::kLaunch;
    if (Status st = finish_launch(out, environment_defaults, job_file, hosts, *launch_cmd); !st) return failed(st);
    if (Status st = check_job(out.job); !st) {  // as tools::launch says it, and exits
      Invocation refused;
      refused.done = true;
      refused.exit_code = 2;
      refused.text = "conveyor launch: " + st.message() + "\n";
      return refused;
    }
  } else if (*plan_cmd) {
    out.command = Command::kPlan;
  } else if (*simulate_cmd) {
    out.command = Command::kSimulate;
  } else if (*trace_check_cmd) {
    out.command = Command::kTraceCheck;
  } else if (*inspect_cmd) {
    out.command = Command::kInspect;
  } else if (*validate_cmd) {
    out.command = Command::kValidate;
  } else if (*partition_cmd) {
    out.command = Command::kPartition;
  }
  return out;
}

}  // namespace conveyor::tools
