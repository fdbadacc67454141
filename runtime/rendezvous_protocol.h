// What the rendezvous's messages say, and what process 0 decides on each join, apart from the
// sockets that carry them (runtime/rendezvous_wire.h) so that a test or a fuzzer can drive it.
//
// A connection to process 0 gets a nonce of its own, at once. The joining process answers
// with one frame: 64 hex digits of HMAC-SHA256(secret, "join\n" + nonce + "\n" + request),
// then the request (JSON: rank, world, version, job, data-plane address, its own nonce).
// Nothing of a join is parsed before its MAC holds: a join not signed with the job's secret
// over that connection's nonce is refused to its sender alone (a bare {"refused":true}) and
// changes nothing, so an impostor can neither join nor abort the forming job. Process 0
// answers the joined processes once every rank has joined, signed over each one's nonce.
// Torch-free, CAF-free.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::runtime::rendezvous_protocol {

/// The largest frames each side reads; anything larger is not one of these messages.
inline constexpr std::size_t kLargestChallenge = 64;      // a nonce: 32 hex digits
inline constexpr std::size_t kLargestJoin = 64 * 1024;    // a request is a few hundred bytes
inline constexpr std::size_t kLargestAddress = 16 * 1024; // a data-plane address, in hex
/// Process 0's answer: every rank's address, and a little more.
inline std::size_t largest_answer(int world) {
  return 4096 + static_cast<std::size_t>(world) * (kLargestAddress + 8);
}

/// A connection's first frame: a fresh nonce for its join.
std::string challenge();

/// The join frame's payload for `request` (JSON text) on a connection that was handed `nonce`.
std::string join_payload(std::string_view secret, std::string_view nonce, std::string_view request);

/// What a joining process makes of process 0's answer: the body, once it is signed over its
/// own nonce; a refusal, or an answer not signed with the job's secret, as an error naming `where`.
Result<std::string> read_answer(std::string_view secret, std::string_view client_nonce, std::string_view answer,
                                const std::string& where);

/// Process 0's book of the job forming: who joined, and what each connection is sent.
class JoinBook {
 public:
  JoinBook(int world, std::string version, std::string job, std::string secret);

  /// A payload to send on a connection, and whether to close it once sent.
  struct Send {
    int connection;
    std::string payload;
    bool close_after = true;
  };
  struct Outcome {
    std::vector<Send> sends;
    bool held = false;  ///< the sender joined: keep its connection for the answer
  };
  /// The join `payload` that `connection`, handed `nonce`, sent.
  Outcome join(int connection, std::string_view nonce, std::string_view payload);
  /// A held connection that closed before its answer (its process went).
  void forget(int connection);

  /// The ranks that have not joined, as "1, 3".
  std::string missing() const;

 private:
  struct Held {
    int connection;
    std::string client_nonce;
  };
  std::string signed_reply(const std::string& client_nonce, const std::string& body) const;
  Outcome fail_all(const std::string& why, int connection, const std::string& client_nonce);

  int world_;
  std::string version_, job_, secret_;
  std::vector<std::string> addresses_;  // hex, per rank ("" until it joins)
  std::vector<Held> held_;
  bool complete_ = false;
  std::string error_;  // the first disagreement among the job's processes: every one gets it
};

}  // namespace conveyor::runtime::rendezvous_protocol
