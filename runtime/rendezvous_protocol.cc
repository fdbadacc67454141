#include "runtime/rendezvous_protocol.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/printable.h"
#include "common/secret.h"

namespace conveyor::runtime::rendezvous_protocol {

namespace {

constexpr std::size_t kMacDigits = 64;

std::string join_mac(std::string_view secret, std::string_view nonce, std::string_view request) {
  std::string message = "join\n";
  message.append(nonce).append("\n").append(request);
  return secret::hmac_hex(secret, message);
}

std::string reply_mac(std::string_view secret, std::string_view client_nonce, std::string_view body) {
  std::string message = "reply\n";
  message.append(client_nonce).append("\n").append(body);
  return secret::hmac_hex(secret, message);
}

// A string field of a join request, or `fallback` when absent or not a string (value() would throw).
std::string text_field(const nlohmann::json& j, const char* key, const std::string& fallback = "") {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : fallback;
}

}  // namespace

std::string challenge() { return secret::random_hex(16); }

std::string join_payload(std::string_view secret, std::string_view nonce, std::string_view request) {
  return join_mac(secret, nonce, request) + std::string(request);
}

Result<std::string> read_answer(std::string_view secret, std::string_view client_nonce, std::string_view answer,
                                const std::string& where) {
  nlohmann::json j = nlohmann::json::parse(answer, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("refused")) {
    return Status(ErrorCode::kInvalidArgument,
                  "the process listening at " + where + " refused this process: its job secret differs. Start every "
                  "process with `conveyor launch`, or give each the same CONVEYOR_JOB_SECRET (by default the processes "
                  "of one user share the secret file in the cache folder)");
  }
  if (!j.is_object() || !j.contains("body") || !j["body"].is_string() || !j.contains("mac") || !j["mac"].is_string() ||
      !secret::same(j["mac"].get<std::string>(), reply_mac(secret, client_nonce, j["body"].get<std::string>()))) {
    return Status(ErrorCode::kInvalidArgument, "the process listening at " + where +
                                                   " is not this job's process 0 (its answer is not signed with the "
                                                   "job's secret); check MASTER_ADDR and MASTER_PORT");
  }
  return j["body"].get<std::string>();
}

JoinBook::JoinBook(int world, std::string version, std::string job, std::string secret)
    : world_(world), version_(std::move(version)), job_(std::move(job)), secret_(std::move(secret)),
      addresses_(static_cast<std::size_t>(world)) {}

std::string JoinBook::signed_reply(const std::string& client_nonce, const std::string& body) const {
  return nlohmann::json{{"body", body}, {"mac", reply_mac(secret_, client_nonce, body)}}.dump();
}

JoinBook::Outcome JoinBook::fail_all(const std::string& why, int connection, const std::string& client_nonce) {
  if (error_.empty()) error_ = why;
  const std::string body = nlohmann::json{{"error", error_}}.dump();
  Outcome out;
  out.sends.push_back({connection, signed_reply(client_nonce, body)});
  for (const auto& h : held_) out.sends.push_back({h.connection, signed_reply(h.client_nonce, body)});
  held_.clear();
  return out;
}

JoinBook::Outcome JoinBook::join(int connection, std::string_view nonce, std::string_view payload) {
  Outcome refused;
  refused.sends.push_back({connection, nlohmann::json{{"refused", true}}.dump()});
  // The MAC first: nothing of an unsigned request is read.
  if (payload.size() < kMacDigits || payload.size() > kLargestJoin) return refused;
  const std::string_view request = payload.substr(kMacDigits);
  if (!secret::same(payload.substr(0, kMacDigits), join_mac(secret_, nonce, request))) return refused;

  nlohmann::json j = nlohmann::json::parse(request, nullptr, /*allow_exceptions=*/false);
  const std::string client_nonce = j.is_object() ? text_field(j, "client_nonce") : "";
  if (complete_) {
    Outcome out;
    out.sends.push_back({connection, signed_reply(client_nonce, nlohmann::json{{"error", "the job already has all its " + std::to_string(world_) + " processes; this one is not part of it (check RANK and WORLD_SIZE)"}}.dump())});
    return out;
  }
  if (!error_.empty()) return fail_all(error_, connection, client_nonce);
  if (!j.is_object() || !j.contains("rank") || !j["rank"].is_number_integer() || !j.contains("world") ||
      !j["world"].is_number_integer()) {
    return fail_all("a process sent a malformed join request (another conveyor version?)", connection, client_nonce);
  }
  const std::int64_t rank = j["rank"].get<std::int64_t>();
  const std::string who = "process " + std::to_string(rank);
  const std::string their_version = text_field(j, "version", "?");
  if (their_version != version_) {
    return fail_all(who + " runs conveyor " + printable(their_version, 40) + " but process 0 runs conveyor " + version_ +
                        "; install the same conveyor on every machine",
                    connection, client_nonce);
  }
  if (j["world"].get<std::int64_t>() != world_) {
    return fail_all(who + " expects a world of " + std::to_string(j["world"].get<std::int64_t>()) +
                        " processes but process 0 expects " + std::to_string(world_) +
                        "; set the same WORLD_SIZE everywhere",
                    connection, client_nonce);
  }
  if (rank < 0 || rank >= world_) {
    return fail_all(who + " is outside the world of " + std::to_string(world_) + " (RANK 0 to " +
                        std::to_string(world_ - 1) + ")",
                    connection, client_nonce);
  }
  if (!addresses_[rank].empty()) {
    return fail_all("two processes joined as rank " + std::to_string(rank) + "; give each a RANK of its own", connection,
                    client_nonce);
  }
  const std::string their_job = text_field(j, "job");
  if (their_job != job_) {
    return fail_all(who + " runs a different model or plan than process 0 (job " + printable(their_job, 40) +
                        " against " + job_ +
                        "); every process must run the same script with the same model, plan and schedule",
                    connection, client_nonce);
  }
  const std::string address = text_field(j, "address");
  if (address.empty() || address.size() > kLargestAddress) {
    return fail_all(who + " sent no data-plane address, or one over " + std::to_string(kLargestAddress) + " hex digits",
                    connection, client_nonce);
  }
  addresses_[rank] = address;
  held_.push_back({connection, client_nonce});
  Outcome out;
  out.held = true;
  if (std::any_of(addresses_.begin(), addresses_.end(), [](const std::string& a) { return a.empty(); })) return out;
  complete_ = true;
  const std::string body = nlohmann::json{{"addresses", addresses_}}.dump();
  for (const auto& h : held_) out.sends.push_back({h.connection, signed_reply(h.client_nonce, body)});
  held_.clear();
  return out;
}

void JoinBook::forget(int connection) {
  held_.erase(std::remove_if(held_.begin(), held_.end(), [&](const Held& h) { return h.connection == connection; }),
              held_.end());
}

std::string JoinBook::missing() const {
  std::string out;
  for (int r = 0; r < world_; ++r) {
    if (addresses_[r].empty()) out += (out.empty() ? "" : ", ") + std::to_string(r);
  }
  return out;
}

}  // namespace conveyor::runtime::rendezvous_protocol
