#include "runtime/rendezvous.h"

#include <caf/io/all.hpp>
#include <nlohmann/json.hpp>
#include <thread>

#include "runtime/actor_messages.h"

namespace conveyor::runtime {

namespace {

using join_atom = caf::atom_constant<caf::atom("join")>;        // rendezvous: (request as JSON)
using missing_atom = caf::atom_constant<caf::atom("missing")>;  // rendezvous: who has not joined?

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string unhex(const std::string& text) {
  std::string out;
  for (std::size_t i = 0; i + 1 < text.size(); i += 2) out += static_cast<char>(std::stoi(text.substr(i, 2), nullptr, 16));
  return out;
}

struct RendezvousState {
  int world = 1;
  std::string version, job;
  std::vector<std::string> addresses;  // hex, per rank ("" until it joins)
  std::vector<caf::response_promise> promises;
  std::string error;  // the first disagreement: every process gets it
};

// Process 0's rendezvous actor: answers every join once all ranks have joined, or everyone
// with the first disagreement.
caf::behavior rendezvous_actor(caf::stateful_actor<RendezvousState>* self, int world, std::string version,
                               std::string job) {
  self->state.world = world;
  self->state.version = std::move(version);
  self->state.job = std::move(job);
  self->state.addresses.assign(static_cast<std::size_t>(world), "");
  return {
      [self](join_atom, const std::string& text) {
        auto& st = self->state;
        auto promise = self->make_response_promise();
        auto fail_all = [&](const std::string& why) {
          if (st.error.empty()) st.error = why;
          const std::string reply = nlohmann::json{{"error", st.error}}.dump();
          promise.deliver(reply);
          for (auto& p : st.promises) p.deliver(reply);
          st.promises.clear();
        };
        if (!st.error.empty()) return fail_all(st.error);
        nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (!j.is_object() || !j.contains("rank") || !j["rank"].is_number_integer()) {
          return fail_all("a process sent a malformed join request (another conveyor version?)");
        }
        const int rank = j["rank"].get<int>();
        const std::string who = "process " + std::to_string(rank);
        const std::string their_version = j.value("version", std::string("?"));
        if (their_version != st.version) {
          return fail_all(who + " runs conveyor " + their_version + " but process 0 runs conveyor " + st.version +
                          "; install the same conveyor on every machine");
        }
        if (j.value("world", -1) != st.world) {
          return fail_all(who + " expects a world of " + std::to_string(j.value("world", -1)) +
                          " processes but process 0 expects " + std::to_string(st.world) +
                          "; set the same WORLD_SIZE everywhere");
        }
        if (rank < 0 || rank >= st.world) {
          return fail_all(who + " is outside the world of " + std::to_string(st.world) + " (RANK 0 to " +
                          std::to_string(st.world - 1) + ")");
        }
        if (!st.addresses[rank].empty()) return fail_all("two processes joined as rank " + std::to_string(rank) + "; give each a RANK of its own");
        const std::string their_job = j.value("job", std::string());
        if (their_job != st.job) {
          return fail_all(who + " runs a different model or plan than process 0 (job " + their_job + " against " +
                          st.job + "); every process must run the same script with the same model, plan and schedule");
        }
        st.addresses[rank] = j.value("address", std::string());
        if (st.addresses[rank].empty()) return fail_all(who + " sent no data-plane address");
        st.promises.push_back(promise);
        for (const auto& a : st.addresses) {
          if (a.empty()) return;
        }
        const std::string reply = nlohmann::json{{"addresses", st.addresses}}.dump();
        for (auto& p : st.promises) p.deliver(reply);
        st.promises.clear();
      },
      [self](missing_atom) {
        std::string out;
        for (int r = 0; r < self->state.world; ++r) {
          if (self->state.addresses[r].empty()) out += (out.empty() ? "" : ", ") + std::to_string(r);
        }
        return out;
      },
  };
}

// Sends the join request and waits for the answer within `timeout`.
Result<std::string> ask(const caf::actor& rendezvous, const std::string& request, std::chrono::milliseconds timeout) {
  caf::scoped_actor self{actor_system()};
  Result<std::string> out = Status(ErrorCode::kInternal, "the rendezvous did not answer");
  self->request(rendezvous, caf::duration{timeout}, join_atom::value, request)
      .receive([&](std::string& reply) { out = std::move(reply); },
               [&](caf::error& e) {
                 out = Status(ErrorCode::kExecution, e == caf::sec::request_timeout
                                                         ? "timeout"
                                                         : "the rendezvous failed: " + actor_system().render(e));
               });
  return out;
}

}  // namespace

struct Rendezvous::Impl {
  caf::actor published;
  ~Impl() {
    if (!published) return;
    (void)actor_system().middleman().unpublish(published);
    caf::anon_send_exit(published, caf::exit_reason::user_shutdown);
  }
};

Rendezvous::Rendezvous(std::unique_ptr<Impl> impl, std::vector<std::string> addresses)
    : impl_(std::move(impl)), addresses_(std::move(addresses)) {}
Rendezvous::~Rendezvous() = default;

Result<std::unique_ptr<Rendezvous>> rendezvous(const JoinRequest& req) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + req.timeout;
  const std::string where = req.host + ":" + std::to_string(req.port);
  if (req.world < 1 || req.rank < 0 || req.rank >= req.world) {
    return Status(ErrorCode::kInvalidArgument, "RANK " + std::to_string(req.rank) + " with WORLD_SIZE " +
                                                   std::to_string(req.world) + " (RANK must be 0 to WORLD_SIZE - 1)");
  }
  if (req.port < 1 || req.port > 65535) {
    return Status(ErrorCode::kInvalidArgument, "MASTER_PORT " + std::to_string(req.port) + " (1 to 65535)");
  }
  auto& system = actor_system();
  auto impl = std::make_unique<Rendezvous::Impl>();
  caf::actor target;
  if (req.rank == 0) {
    impl->published = system.spawn(rendezvous_actor, req.world, req.version, req.job);
    auto port = system.middleman().publish(impl->published, static_cast<std::uint16_t>(req.port), req.host.c_str(),
                                           /*reuse=*/true);
    if (!port) {
      return Status(ErrorCode::kExecution, "process 0 cannot listen for the other processes at " + where + ": " +
                                               system.render(port.error()) +
                                               " (is the port in use? set MASTER_PORT to a free one)");
    }
    target = impl->published;
  } else {
    while (true) {
      auto remote = system.middleman().remote_actor(req.host, static_cast<std::uint16_t>(req.port));
      if (remote) {
        target = *remote;
        break;
      }
      if (Clock::now() >= deadline) {
        return Status(ErrorCode::kExecution, "process " + std::to_string(req.rank) + " found no process 0 at " + where +
                                                 " within " + std::to_string(req.timeout.count()) +
                                                 " ms (" + system.render(remote.error()) +
                                                 "); start process 0, or check MASTER_ADDR and MASTER_PORT");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  const std::string request = nlohmann::json{{"rank", req.rank},
                                             {"world", req.world},
                                             {"version", req.version},
                                             {"job", req.job},
                                             {"address", hex(req.address)}}
                                  .dump();
  const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                             std::chrono::milliseconds(1));
  auto reply = ask(target, request, left);
  if (!reply) {
    if (reply.status().message() != "timeout") return reply.status();
    std::string missing = "?";
    if (req.rank == 0) {
      caf::scoped_actor self{system};
      self->request(target, std::chrono::seconds(5), missing_atom::value)
          .receive([&](std::string& m) { missing = std::move(m); }, [](caf::error&) {});
    }
    return Status(ErrorCode::kExecution,
                  "the rendezvous at " + where + " did not complete within " + std::to_string(req.timeout.count()) +
                      " ms" + (req.rank == 0 ? ": processes " + missing + " did not join" : "") +
                      "; start every process (WORLD_SIZE " + std::to_string(req.world) +
                      "), or raise CONVEYOR_RENDEZVOUS_TIMEOUT");
  }
  nlohmann::json j = nlohmann::json::parse(*reply, nullptr, false);
  if (j.is_object() && j.contains("error")) {
    return Status(ErrorCode::kInvalidArgument, "rendezvous at " + where + ": " + j["error"].get<std::string>());
  }
  if (!j.is_object() || !j.contains("addresses") || !j["addresses"].is_array() ||
      static_cast<int>(j["addresses"].size()) != req.world) {
    return Status(ErrorCode::kCorrupt, "a malformed rendezvous answer from process 0 (another conveyor version?)");
  }
  std::vector<std::string> addresses;
  for (const auto& a : j["addresses"]) addresses.push_back(unhex(a.get<std::string>()));
  return std::make_unique<Rendezvous>(std::move(impl), std::move(addresses));
}

}  // namespace conveyor::runtime
