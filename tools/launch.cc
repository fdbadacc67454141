#include "tools/launch.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "common/printable.h"

#include "common/env.h"
#include "common/secret.h"
#include "common/toml_reader.h"
#include "scheduler/schedule.h"

namespace conveyor::tools {

using toml::check_keys;
using toml::TomlError;

namespace {

int whole_number(const toml::Node& t, std::string_view key, int lo, int hi, int fallback) {
  const toml::Node* n = t.get(key);
  if (!n) return fallback;
  auto v = n->integer();
  if (!v || *v < lo || *v > hi) {
    throw TomlError(n->line(), std::string(key) + " must be a whole number from " + std::to_string(lo) + " to " +
                                     std::to_string(hi));
  }
  return static_cast<int>(*v);
}

double seconds(const toml::Node& t, std::string_view key, double fallback) {
  const toml::Node* n = t.get(key);
  if (!n) return fallback;
  auto v = n->number();
  if (!v || !valid_seconds(*v)) {
    throw TomlError(n->line(), std::string(key) + " must be a number of seconds from 0.001 to 604800 (a week)");
  }
  return *v;
}

// A host name or an IPv4/IPv6 address: what a socket can be pointed at, nothing else.
bool host_name(const std::string& h) {
  if (h.empty() || h.size() > 253) return false;
  for (char c : h) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != ':' && c != '_') return false;
  }
  return true;
}

using Choices = std::vector<std::string_view>;
const Choices kTransports{"ucx", "nccl"};
// "auto" (the planner chooses), then every schedule by scheduler/schedule.h's name for it.
const Choices kSchedules = [] {
  Choices names{"auto"};
  for (auto kind : scheduler::kScheduleKinds) names.push_back(scheduler::schedule_kind_name(kind));
  return names;
}();
const Choices kReplans{"auto", "off"};

// Empty where `v` is one of `choices` (or there are none); else what they are, for an error.
std::string not_one_of(const std::string& v, const Choices& choices) {
  std::string list;
  for (auto c : choices) {
    if (v == c) return "";
    list += (list.empty() ? "" : ", ") + std::string(c);
  }
  return list;
}

std::string text(const toml::Node& t, std::string_view key, const std::string& fallback, const Choices& choices = {}) {
  const toml::Node* n = t.get(key);
  if (!n) return fallback;
  auto v = n->string();
  if (!v) throw TomlError(n->line(), std::string(key) + " must be a string");
  if (std::string list = not_one_of(*v, choices); !list.empty()) {
    throw TomlError(n->line(), std::string(key) + " = \"" + printable(*v, 40) + "\" (expected one of " + list + ")");
  }
  return *v;
}

// Whether nothing holds TCP port `port` on the loopback interface now (a port in TIME_WAIT
// counts as held).
bool port_free(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  close(fd);
  return free;
}

// A port free on the loopback interface for process 0 to listen on, taken below the kernel's
// ephemeral range (/proc/sys/net/ipv4/ip_local_port_range). Process 0 listens seconds after
// this pick, after its imports and capture; a port from that range (the kernel's pick for a
// bind to port 0) could meanwhile be handed to any outgoing connection, and 1 launch in 12 of
// two ResNet processes failed so ("Address already in use"). A port below it goes only to
// whoever binds it by number.
int free_port() {
  int ephemeral_from = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); !(range >> ephemeral_from)) ephemeral_from = 32768;
  const int low = ephemeral_from > 12000 ? 10000 : 1024;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(low, std::max(low, ephemeral_from - 1));
  for (int attempt = 0; attempt < 200; ++attempt) {
    if (const int port = pick(rng); port_free(port)) return port;
  }
  return 29500;
}

bool loopback(const std::string& host) { return host == "127.0.0.1" || host == "localhost" || host == "::1"; }

volatile sig_atomic_t stop_signal = 0;

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + strsignal(WTERMSIG(status));
  return "stopped";
}

}  // namespace

Result<JobConfig> job_defaults_from_environment() {
  JobConfig c;
  const auto invalid = [](const char* name, const std::string& v, const std::string& expected) {
    return Status(ErrorCode::kInvalidArgument, std::string(name) + "=\"" + printable(v, 40) + "\" in the environment: " +
                                                   expected + " (set it so, or unset it)");
  };
  if (std::string v = env::job_setting("CONVEYOR_TIMEOUT"); !v.empty()) {
    char* end = nullptr;
    const double s = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || !valid_seconds(s)) {
      return invalid("CONVEYOR_TIMEOUT", v, "expected a number of seconds from 0.001 to 604800 (a week)");
    }
    c.timeout_s = s;
  }
  struct Choice {
    const char* variable;
    std::string* field;
    const Choices* choices;
  };
  for (const Choice& x : {Choice{"CONVEYOR_TRANSPORT", &c.transport, &kTransports},
                          Choice{"CONVEYOR_SCHEDULE", &c.schedule, &kSchedules},
                          Choice{"CONVEYOR_REPLAN", &c.replan, &kReplans}}) {
    std::string v = env::job_setting(x.variable);
    if (v.empty()) continue;
    if (std::string list = not_one_of(v, *x.choices); !list.empty()) return invalid(x.variable, v, "expected one of " + list);
    *x.field = v;
  }
  return c;
}

std::string missing_folder(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path dir = std::filesystem::absolute(path, ec).parent_path();
  return std::filesystem::is_directory(dir, ec) ? "" : dir.string();
}

Result<JobConfig> parse_job_config(const std::string& content, const std::string& source, const JobConfig& defaults) {
  try {
    const toml::Node root = toml::parse(content);
    check_keys(root, {"job"}, "the job config");
    const toml::Node* job = root.get("job");
    if (!job || !job->as_table()) throw TomlError(job ? job->line() : 1, "missing the [job] table");
    const toml::Node& t = *job->as_table();
    check_keys(t, {"processes", "hosts", "node_rank", "master_addr", "master_port", "timeout", "grace", "transport",
                   "plan", "schedule", "trace", "replan", "replan_horizon", "secret"},
               "[job]");
    JobConfig c = defaults;
    c.processes = whole_number(t, "processes", 1, 4096, c.processes);
    if (const toml::Node* h = t.get("hosts")) {
      const toml::Node* arr = h->as_array();
      if (!arr || arr->items().empty()) throw TomlError(h->line(), "hosts must be a non-empty list of host names");
      c.hosts.clear();
      for (const toml::Node& e : arr->items()) {
        auto name = e.string();
        if (!name || !host_name(*name)) throw TomlError(e.line(), "hosts must be a list of host names or addresses (strings)");
        c.hosts.push_back(*name);
      }
    }
    c.node_rank = whole_number(t, "node_rank", 0, static_cast<int>(c.hosts.size()) - 1, 0);
    c.master_addr = text(t, "master_addr", c.master_addr);
    if (t.get("master_addr") && !host_name(c.master_addr)) {
      throw TomlError(t.get("master_addr")->line(), "master_addr = \"" + printable(c.master_addr, 40) +
                                                        "\" is not a host name or address");
    }
    c.master_port = whole_number(t, "master_port", 0, 65535, c.master_port);
    c.timeout_s = seconds(t, "timeout", c.timeout_s);
    c.grace_s = seconds(t, "grace", c.grace_s);
    c.transport = text(t, "transport", c.transport, kTransports);
    c.plan = text(t, "plan", c.plan);
    std::error_code ec;
    if (c.plan != "auto" && (access(c.plan.c_str(), R_OK) != 0 || std::filesystem::is_directory(c.plan, ec))) {
      throw TomlError(t.get("plan")->line(), "plan = \"" + printable(c.plan, 40) + "\": no such readable file (or \"auto\")");
    }
    c.schedule = text(t, "schedule", c.schedule, kSchedules);
    c.trace = text(t, "trace", c.trace);
    if (const std::string dir = c.trace.empty() ? "" : missing_folder(c.trace); !dir.empty()) {
      throw TomlError(t.get("trace")->line(), "trace = \"" + printable(c.trace, 40) + "\": the folder " + printable(dir, 40) +
                                                  " does not exist (make it first)");
    }
    c.replan = text(t, "replan", c.replan, kReplans);
    c.replan_horizon = whole_number(t, "replan_horizon", 1, 1000000000, c.replan_horizon);
    c.secret = text(t, "secret", c.secret);
    if (t.get("secret") && c.secret.find('\0') != std::string::npos) {
      // The environment a secret travels in ends a string at NUL: it would be cut, not kept.
      throw TomlError(t.get("secret")->line(), "secret must not hold a NUL character (\\u0000)");
    }
    if (t.get("secret") && c.secret.size() < 16) {
      throw TomlError(t.get("secret")->line(), "secret must be at least 16 characters (a random string)");
    }
    return c;
  } catch (const TomlError& e) {
    return e.status(source);
  }
}

Status check_job(const JobConfig& c) {
  for (const std::string& h : c.hosts) {
    if (!host_name(h)) {
      return Status(ErrorCode::kInvalidArgument, "host '" + printable(h, 40) +
                                                     "' is not a host name or address (letters, digits, '.', '-', "
                                                     "':', '_'; at most 253)");
    }
  }
  if (!c.master_addr.empty() && !host_name(c.master_addr)) {
    return Status(ErrorCode::kInvalidArgument, "master address '" + printable(c.master_addr, 40) +
                                                   "' is not a host name or address");
  }
  const long long world = static_cast<long long>(c.processes) * static_cast<long long>(c.hosts.size());
  if (c.processes < 1 || world > kMostProcesses) {
    return Status(ErrorCode::kInvalidArgument, std::to_string(c.processes) + " processes on each of " +
                                                   std::to_string(c.hosts.size()) + " hosts make " +
                                                   std::to_string(world) + " processes; a job has 1 to " +
                                                   std::to_string(kMostProcesses));
  }
  return Status::ok();
}

int launch(const JobConfig& c, const std::vector<std::string>& command) {
  if (Status st = check_job(c); !st) {
    std::fprintf(stderr, "conveyor launch: %s\n", st.message().c_str());
    return 2;
  }
  if (command.empty()) {
    std::fprintf(stderr, "conveyor launch: nothing to run; write the command after --, e.g. "
                         "conveyor launch -n 2 -- python train.py\n");
    return 2;
  }
  const bool one_machine = c.hosts.size() == 1;
  const std::string master = c.master_addr.empty() ? c.hosts[0] : c.master_addr;
  if (c.master_port == 0 && !one_machine) {
    std::fprintf(stderr, "conveyor launch: several hosts need a fixed master port (--master-port, or master_port in "
                         "the config) that every machine's launcher is given\n");
    return 2;
  }
  const int port = c.master_port != 0 ? c.master_port : free_port();
  const int world = c.processes * static_cast<int>(c.hosts.size());
  const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  const int threads = static_cast<int>(std::max(1L, cores / c.processes));
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", c.timeout_s);
  const std::string timeout = buf;
  // The job's secret: the config's, or CONVEYOR_JOB_SECRET, or on one machine a fresh one;
  // several machines' launchers must agree on one (then this user's secret file, shared home).
  std::string secret = c.secret.empty() ? env::job_secret() : c.secret;
  if (secret.empty() && one_machine) secret = secret::random_hex(32);
  if (secret.empty()) {
    auto shared = secret::job_secret();
    if (!shared) {
      std::fprintf(stderr, "conveyor launch: %s\n", shared.status().message().c_str());
      return 2;
    }
    secret = *shared;
  }

  struct sigaction sa{};
  sa.sa_handler = [](int s) { stop_signal = s; };
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  std::vector<pid_t> pids;
  for (int local = 0; local < c.processes; ++local) {
    const int rank = c.node_rank * c.processes + local;
    const pid_t pid = fork();
    if (pid < 0) {
      std::perror("conveyor launch: fork");
      for (pid_t p : pids) kill(p, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(c.processes).c_str(), 1);
      setenv("MASTER_ADDR", master.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("CONVEYOR_TIMEOUT", timeout.c_str(), 1);
      setenv("CONVEYOR_JOB_SECRET", secret.c_str(), 1);
      setenv("CONVEYOR_PLAN", c.plan.c_str(), 1);
      setenv("CONVEYOR_SCHEDULE", c.schedule.c_str(), 1);
      setenv("CONVEYOR_TRANSPORT", c.transport.c_str(), 1);
      setenv("CONVEYOR_REPLAN", c.replan.c_str(), 1);
      setenv("CONVEYOR_REPLAN_HORIZON", std::to_string(c.replan_horizon).c_str(), 1);
      if (!c.trace.empty()) setenv("CONVEYOR_TRACE", c.trace.c_str(), 1);
      // The cores shared out between the processes (fewer if the caller asked for fewer).
      const int asked = env::openmp_threads();
      setenv("OMP_NUM_THREADS", std::to_string(asked > 0 ? std::min(asked, threads) : threads).c_str(), 1);
      if (one_machine && loopback(master)) setenv("UCX_NET_DEVICES", "lo", 0);
      // torch's CPU allocations of 2 MB and more on transparent huge pages (unless the caller
      // says otherwise): a peer process of this host reads a message from the sender's
      // memory (CMA), pinning its pages, and 256 MB then moved at 6.4 GB/s instead of 5.2.
      setenv("THP_MEM_ALLOC_ENABLE", "1", 0);
      std::vector<char*> argv;
      for (const auto& a : command) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execvp(argv[0], argv.data());
      std::fprintf(stderr, "conveyor launch: cannot run %s: %s\n", argv[0], std::strerror(errno));
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::fprintf(stderr, "conveyor launch: %d processes (ranks %d-%d of %d), rendezvous at %s:%d\n", c.processes,
               c.node_rank * c.processes, c.node_rank * c.processes + c.processes - 1, world, master.c_str(), port);

  // Wait for all; the first failure (or a signal to the launcher) stops the others.
  int exit_code = 0, running = static_cast<int>(pids.size());
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();  // then SIGKILL
  auto stop_others = [&](const std::string& why) {
    if (stopping) return;
    stopping = true;
    std::fprintf(stderr, "conveyor launch: %s; stopping the other processes\n", why.c_str());
    for (pid_t p : pids) {
      if (p > 0) kill(p, SIGTERM);
    }
    stop_deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<long>(c.grace_s * 1000));
  };
  constexpr auto kInterruptedStop = std::chrono::seconds(1);
  // After SIGINT to the launcher: when the processes that did not stop by themselves get SIGTERM.
  auto interrupted_deadline = std::chrono::steady_clock::time_point::max();
  while (running > 0) {
    int status = 0;
    const pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      for (std::size_t local = 0; local < pids.size(); ++local) {
        if (pids[local] != done) continue;
        pids[local] = -1;
        --running;
        const int rank = c.node_rank * c.processes + static_cast<int>(local);
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && !stopping && stop_signal != SIGINT) {  // an interrupted process: the Ctrl-C below
          exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
          stop_others("process " + std::to_string(rank) + " " + describe_exit(status));
        }
      }
      continue;
    }
    const bool interrupted = interrupted_deadline != std::chrono::steady_clock::time_point::max();
    if (stop_signal == SIGINT && !stopping && !interrupted) {
      // Ctrl-C at a terminal reaches the processes too (one process group): each stops with
      // KeyboardInterrupt, its traceback saying where it was, and gives the job up. They get
      // kInterruptedStop for it before SIGTERM (a process that did not get the signal).
      exit_code = 128 + SIGINT;
      std::fprintf(stderr, "conveyor launch: the launcher got Interrupt; the processes stop (SIGTERM in %.0f s)\n",
                   std::chrono::duration<double>(kInterruptedStop).count());
      interrupted_deadline = std::chrono::steady_clock::now() + kInterruptedStop;
    }
    if (interrupted && !stopping && std::chrono::steady_clock::now() > interrupted_deadline) {
      stop_others("the processes did not stop within a second of the interrupt");
    }
    if (stop_signal != 0 && stop_signal != SIGINT && !stopping) {
      exit_code = 128 + stop_signal;
      stop_others(std::string("the launcher got ") + strsignal(stop_signal));
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
      for (pid_t p : pids) {
        if (p > 0) kill(p, SIGKILL);
      }
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return exit_code;
}

}  // namespace conveyor::tools
