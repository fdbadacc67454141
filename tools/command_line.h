// The `conveyor` command's arguments: what each subcommand takes, checked, into one
// Invocation that tools/conveyor_main.cc runs. Kept apart from running so that the fuzz target
// `command_line` (fuzz/readers.cc) can hand it any arguments: a parse never starts a process,
// writes a file or plans; `launch` reads its job config and checks the whole job here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "partitioner/planner.h"
#include "tools/launch.h"

namespace conveyor::tools {

struct PlanArgs {
  std::string graph, cluster, profile, out, trace, schedule;
  int batch = 0, microbatches = 0;
  double optimizer_state = 2;
  double time_budget_s = partitioner::PlanOptions{}.time_budget_s;
};

struct Invocation {
  enum class Command { kNone, kInspect, kValidate, kPartition, kPlan, kSimulate, kTraceCheck, kLaunch };
  Command command = Command::kNone;
  /// Set when there is nothing to run: help, the version, or an error, printed as `text`
  /// (to standard error when `exit_code` is not 0).
  bool done = false;
  int exit_code = 0;
  std::string text;

  std::string path;  ///< inspect, validate, partition: the graph file
  int top = 15;
  int stages = 2;
  std::uint64_t seed = 0;
  bool keep_order = false;
  PlanArgs plan;
  std::string plan_path, trace_path;  ///< simulate, trace check
  JobConfig job;                      ///< launch: flags over the config over the environment
  std::vector<std::string> launch_command;
};

/// `args` as the command line (args[0] the program's name).
Invocation parse_command_line(const std::vector<std::string>& args);

}  // namespace conveyor::tools
