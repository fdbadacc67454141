// `conveyor launch`: starts the processes of a job on this machine with the environment
// torchrun-style scripts expect (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) plus conveyor's own (CONVEYOR_TIMEOUT, CONVEYOR_JOB_SECRET, CONVEYOR_PLAN,
// CONVEYOR_SCHEDULE, CONVEYOR_TRACE), watches them, and stops the job as soon as one of
// them fails: the others get SIGTERM, then SIGKILL after a grace period, and the launcher
// exits non-zero naming the process that failed. Ctrl-C (SIGINT), which a terminal sends the
// processes too, gives them a second to stop by themselves (each with KeyboardInterrupt and
// its traceback, giving the job up) before that SIGTERM. On several machines the launcher runs on
// each (--node-rank), as torchrun does. A job config file (TOML, docs/formats.md) can hold
// all of it; every field is checked, and an error names the line and what is expected.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "common/timeouts.h"

namespace conveyor::tools {

struct JobConfig {
  int processes = 1;                       ///< per machine
  std::vector<std::string> hosts{"127.0.0.1"};
  int node_rank = 0;                       ///< which of `hosts` this launcher runs on
  std::string master_addr;                 ///< empty: hosts[0]
  int master_port = 0;                     ///< 0: a free port (one machine only)
  double timeout_s = 300;                  ///< every wait between processes
  double grace_s = 5;                      ///< SIGTERM to SIGKILL when stopping the job
  std::string transport = "ucx";
  std::string plan = "auto";               ///< "auto" or a plan JSON file
  std::string schedule = "auto";
  std::string trace;                       ///< each process writes <stem>.rank<R><ext>
  std::string replan = "auto";             ///< "auto": re-plan from live profiles while training; "off"
  int replan_horizon = 100;                ///< steps a switch of plan must pay for itself within
  std::string secret;                      ///< the job's secret (empty: CONVEYOR_JOB_SECRET, or made per job)
};

/// The launcher's defaults: JobConfig's, with CONVEYOR_TIMEOUT, CONVEYOR_TRANSPORT,
/// CONVEYOR_SCHEDULE and CONVEYOR_REPLAN from the environment where set (as the processes
/// read them without a launcher); a value that is not one of the setting's is an error
/// naming the variable.
Result<JobConfig> job_defaults_from_environment();

/// The folder a file at `path` would go in, where that folder does not exist (a trace's,
/// checked before any process starts); empty where it does.
std::string missing_folder(const std::string& path);

/// Reads a job config file (TOML) over `defaults` (what it does not set stays theirs);
/// `source` names it in errors ("job.toml:7: ..."). Checks hosts and master_addr are host
/// names or addresses, the plan a readable file and the trace's folder present.
Result<JobConfig> parse_job_config(const std::string& text, const std::string& source, const JobConfig& defaults = {});

/// Runs `command` as the job's local processes; returns the launcher's exit status.
int launch(const JobConfig& config, const std::vector<std::string>& command);

/// The most processes a job has (hosts x processes per host): ranks stay far inside an int.
inline constexpr long long kMostProcesses = 1 << 20;

/// Whatever way a JobConfig was made (flags, a config file, both): its hosts and master
/// address are host names or addresses, and its world size is at most kMostProcesses. The
/// error names the value, excerpted and printable.
Status check_job(const JobConfig& config);

}  // namespace conveyor::tools
