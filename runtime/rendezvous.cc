#include "runtime/rendezvous.h"

#include <caf/io/all.hpp>
#include <algorithm>
#include <deque>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/blocking_call.h"
#include "common/secret.h"

#include "runtime/actor_messages.h"

namespace conveyor::runtime {

namespace {

using join_atom = caf::atom_constant<caf::atom("join")>;        // rendezvous: (request JSON, its MAC)
using challenge_atom = caf::atom_constant<caf::atom("challenge")>;  // rendezvous: a nonce to sign a join with
using missing_atom = caf::atom_constant<caf::atom("missing")>;  // rendezvous: who has not joined?

// Outstanding nonces process 0 keeps: enough for every process of a large job asking at
// once; an impostor asking for more only pushes out its own oldest.
constexpr std::size_t kMostNonces = 65536;
// A join request is a few hundred bytes; anything far larger is not one.
constexpr std::size_t kLargestRequest = 1 << 20;

// What process 0 answers a join with: the body and its MAC over the joining process's nonce,
// so the joining process knows the answer comes from a holder of the secret.
std::string signed_reply(const std::string& secret, const std::string& client_nonce, const nlohmann::json& body) {
  const std::string text = body.dump();
  return nlohmann::json{{"body", text}, {"mac", secret::hmac_hex(secret, "reply\n" + client_nonce + "\n" + text)}}
      .dump();
}

// A string field of a join request, or `fallback` when absent or not a string (value() would throw).
std::string text_field(const nlohmann::json& j, const char* key, const std::string& fallback = "") {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : fallback;
}

struct Waiting {
  caf::response_promise promise;
  std::string client_nonce;
};

struct RendezvousState {
  int world = 1;
  std::string version, job, secret;
  std::vector<std::string> addresses;  // hex, per rank ("" until it joins)
  std::vector<Waiting> waiting;
  std::deque<std::string> nonces;  // handed out, not yet used (each signs one join)
  bool complete = false;
  std::string error;  // the first disagreement among the job's processes: every one gets it
};

// Process 0's rendezvous actor. A join counts only when signed with the job's secret over a
// nonce this actor handed out (once): anything else is refused to its sender alone and
// changes nothing, so an impostor can neither join nor abort the forming job. Processes that
// hold the secret and disagree (version, world size, rank, model) fail every process with the
// first disagreement; once complete, a further join is turned away and the job goes on.
caf::behavior rendezvous_actor(caf::stateful_actor<RendezvousState>* self, int world, std::string version,
                               std::string job, std::string secret) {
  self->state.world = world;
  self->state.version = std::move(version);
  self->state.job = std::move(job);
  self->state.secret = std::move(secret);
  self->state.addresses.assign(static_cast<std::size_t>(world), "");
  return {
      [self](challenge_atom) {
        auto& st = self->state;
        if (st.nonces.size() >= kMostNonces) st.nonces.pop_front();
        st.nonces.push_back(secret::random_hex(16));
        return st.nonces.back();
      },
      [self](join_atom, const std::string& text, const std::string& mac) -> caf::result<std::string> {
        auto& st = self->state;
        const std::string refused = nlohmann::json{{"refused", true}}.dump();
        if (text.size() > kLargestRequest) return refused;
        nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
        if (!j.is_object() || !j.contains("nonce") || !j["nonce"].is_string()) return refused;
        auto nonce = std::find(st.nonces.begin(), st.nonces.end(), j["nonce"].get<std::string>());
        if (nonce == st.nonces.end()) return refused;
        st.nonces.erase(nonce);  // used once, whether the MAC holds or not
        if (!secret::same(mac, secret::hmac_hex(st.secret, "join\n" + text))) return refused;
        const std::string client_nonce = text_field(j, "client_nonce");
        auto answer = [&](const nlohmann::json& body) { return signed_reply(st.secret, client_nonce, body); };
        if (st.complete) {
          return answer({{"error", "the job already has all its " + std::to_string(st.world) +
                                       " processes; this one is not part of it (check RANK and WORLD_SIZE)"}});
        }
        auto promise = self->make_response_promise<std::string>();
        auto fail_all = [&](const std::string& why) {
          if (st.error.empty()) st.error = why;
          promise.deliver(answer({{"error", st.error}}));
          for (auto& w : st.waiting) w.promise.deliver(signed_reply(st.secret, w.client_nonce, {{"error", st.error}}));
          st.waiting.clear();
          return promise;
        };
        if (!st.error.empty()) return fail_all(st.error);
        if (!j.contains("rank") || !j["rank"].is_number_integer() || !j.contains("world") ||
            !j["world"].is_number_integer()) {
          return fail_all("a process sent a malformed join request (another conveyor version?)");
        }
        const std::int64_t rank = j["rank"].get<std::int64_t>();
        const std::string who = "process " + std::to_string(rank);
        const std::string their_version = text_field(j, "version", "?");
        if (their_version != st.version) {
          return fail_all(who + " runs conveyor " + their_version.substr(0, 40) + " but process 0 runs conveyor " +
                          st.version + "; install the same conveyor on every machine");
        }
        if (j["world"].get<std::int64_t>() != st.world) {
          return fail_all(who + " expects a world of " + std::to_string(j["world"].get<std::int64_t>()) +
                          " processes but process 0 expects " + std::to_string(st.world) +
                          "; set the same WORLD_SIZE everywhere");
        }
        if (rank < 0 || rank >= st.world) {
          return fail_all(who + " is outside the world of " + std::to_string(st.world) + " (RANK 0 to " +
                          std::to_string(st.world - 1) + ")");
        }
        if (!st.addresses[rank].empty()) return fail_all("two processes joined as rank " + std::to_string(rank) + "; give each a RANK of its own");
        const std::string their_job = text_field(j, "job");
        if (their_job != st.job) {
          return fail_all(who + " runs a different model or plan than process 0 (job " + their_job.substr(0, 40) +
                          " against " + st.job + "); every process must run the same script with the same model, plan and schedule");
        }
        st.addresses[rank] = text_field(j, "address");
        if (st.addresses[rank].empty()) return fail_all(who + " sent no data-plane address");
        st.waiting.push_back({promise, client_nonce});
        for (const auto& a : st.addresses) {
          if (a.empty()) return promise;
        }
        st.complete = true;
        for (auto& w : st.waiting) w.promise.deliver(signed_reply(st.secret, w.client_nonce, {{"addresses", st.addresses}}));
        st.waiting.clear();
        return promise;
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

// Asks for a nonce, sends the join request signed over it, and waits for the answer within
// `timeout`: the answer's body once its MAC over `client_nonce` holds.
Result<std::string> ask(const caf::actor& rendezvous, nlohmann::json request, const std::string& secret,
                        std::chrono::milliseconds timeout, const std::string& where) {
  caf::scoped_actor self{actor_system()};
  Result<std::string> out = Status(ErrorCode::kInternal, "the rendezvous did not answer");
  auto failed = [&](caf::error& e) {
    out = Status(ErrorCode::kExecution,
                 e == caf::sec::request_timeout ? "timeout" : "the rendezvous failed: " + actor_system().render(e));
  };
  std::string nonce;
  self->request(rendezvous, caf::duration{timeout}, challenge_atom::value)
      .receive([&](std::string& n) { nonce = std::move(n); }, failed);
  if (nonce.empty()) return out;
  const std::string client_nonce = secret::random_hex(16);
  request["nonce"] = nonce;
  request["client_nonce"] = client_nonce;
  const std::string text = request.dump();
  self->request(rendezvous, caf::duration{timeout}, join_atom::value, text, secret::hmac_hex(secret, "join\n" + text))
      .receive([&](std::string& reply) { out = std::move(reply); }, failed);
  if (!out) return out;
  nlohmann::json j = nlohmann::json::parse(*out, nullptr, false);
  if (j.is_object() && j.contains("refused")) {
    return Status(ErrorCode::kInvalidArgument,
                  "the process listening at " + where + " refused this process: its job secret differs. Start every "
                  "process with `conveyor launch`, or give each the same CONVEYOR_JOB_SECRET (by default the processes "
                  "of one user share the secret file in the cache folder)");
  }
  if (!j.is_object() || !j.contains("body") || !j["body"].is_string() || !j.contains("mac") || !j["mac"].is_string() ||
      !secret::same(j["mac"].get<std::string>(),
                    secret::hmac_hex(secret, "reply\n" + client_nonce + "\n" + j["body"].get<std::string>()))) {
    return Status(ErrorCode::kInvalidArgument, "the process listening at " + where +
                                                   " is not this job's process 0 (its answer is not signed with the "
                                                   "job's secret); check MASTER_ADDR and MASTER_PORT");
  }
  return j["body"].get<std::string>();
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
  if (req.secret.empty()) return Status(ErrorCode::kInvalidArgument, "the rendezvous needs the job's secret");
  if (req.port < 1 || req.port > 65535) {
    return Status(ErrorCode::kInvalidArgument, "MASTER_PORT " + std::to_string(req.port) + " (1 to 65535)");
  }
  auto& system = actor_system();
  auto impl = std::make_unique<Rendezvous::Impl>();
  caf::actor target;
  if (req.rank == 0) {
    impl->published = system.spawn(rendezvous_actor, req.world, req.version, req.job, req.secret);
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
      if (req.interrupted && req.interrupted()) {
        return Status(ErrorCode::kInterrupted, "process " + std::to_string(req.rank) +
                                                   " was interrupted while looking for process 0 at " + where);
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
  const nlohmann::json request = {
      {"rank", req.rank}, {"world", req.world}, {"version", req.version}, {"job", req.job}, {"address", secret::to_hex(req.address)}};
  const auto left = std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                             std::chrono::milliseconds(1));
  // The answer comes once every process joined: asked on a thread of its own, so that an
  // interruption need not wait for it (the thread ends at the request's timeout, or at once
  // when process 0's actor goes).
  auto asked = wait_for_blocking_call<Result<std::string>>(
      [target, request, secret = req.secret, left, where] { return ask(target, request, secret, left, where); }, {},
      left + std::chrono::seconds(5), req.interrupted, kStopAskedEvery);
  if (asked.end == BlockingCallEnd::kAbandoned) {
    return Status(ErrorCode::kInterrupted, "process " + std::to_string(req.rank) +
                                               " was interrupted while waiting for the others to join at " + where);
  }
  Result<std::string> reply = asked.value ? std::move(*asked.value) : Result<std::string>(Status(ErrorCode::kExecution, "timeout"));
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
                      "), or give them longer (timeout=, or CONVEYOR_TIMEOUT)");
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
  for (const auto& a : j["addresses"]) addresses.push_back(secret::from_hex(a.get<std::string>()));
  return std::make_unique<Rendezvous>(std::move(impl), std::move(addresses));
}

}  // namespace conveyor::runtime
