// How the processes of one job find each other (conveyor's own frames over TCP,
// runtime/rendezvous_protocol.h): process 0 listens at MASTER_ADDR:MASTER_PORT; every
// process, process 0 included, connects to it (retrying until the deadline, so start order
// does not matter) and sends what it is: its rank, the world size it expects, its conveyor
// version, its job fingerprint (the model and plan it will run) and its data-plane address
// (a UCX worker address), signed with the job's secret over a nonce process 0 handed its
// connection (common/secret.h). Process 0 refuses an unsigned join to its sender alone and
// keeps nothing of an unproven peer beyond one bounded frame, so a process without the
// secret can neither join nor disturb the job; it signs its answer, so a process cannot be
// fooled by an impostor process 0. Once every rank has joined, each gets every rank's
// address, in rank order. Any disagreement among the job's processes fails every process
// with an error naming the processes that disagree and what each said. Torch-free.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace conveyor::runtime {

/// What a process tells the rendezvous when it joins.
struct JoinRequest {
  int rank = 0, world = 1;
  std::string host = "127.0.0.1";  ///< where process 0 publishes (MASTER_ADDR)
  int port = 29500;                ///< MASTER_PORT
  std::string version;             ///< conveyor's version: every process must run the same
  std::string job;                 ///< fingerprint of the model and plan: must be equal too
  std::string address;             ///< this process's data-plane address (bytes)
  std::string secret;              ///< the job's secret (never sent; it signs the request)
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
  /// Asked about every 100 ms while this waits for process 0 or for the others to join: true
  /// gives up (kInterrupted). The bindings run Python's signal handlers there (Ctrl-C).
  std::function<bool()> interrupted;
};

/// Held by process 0 while the job runs (its rendezvous server and port); nothing for the others.
class Rendezvous {
 public:
  ~Rendezvous();
  /// Every rank's address, in rank order.
  const std::vector<std::string>& addresses() const { return addresses_; }

  struct Impl;
  Rendezvous(std::unique_ptr<Impl> impl, std::vector<std::string> addresses);

 private:
  std::unique_ptr<Impl> impl_;
  std::vector<std::string> addresses_;
};

/// Joins the job's world; returns once every rank has joined, or an error: a rank that did not
/// join in time (named), a version or job that differs from process 0's, a repeated rank, a
/// world size that differs, a port process 0 cannot bind.
Result<std::unique_ptr<Rendezvous>> rendezvous(const JoinRequest& request);

}  // namespace conveyor::runtime
