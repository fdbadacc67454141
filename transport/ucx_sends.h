// The sends a UCX member (transport/ucx_member.h) posted and UCX has not completed: their
// peer, and what finishes them. A peer's loss finishes its sends here: UCX completes none to
// a dead shared-memory peer (its shared-memory transports have no error handling, and a
// forced close of the endpoint leaves such a send in flight too).
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/transport.h"

namespace conveyor::transport {

/// Where one send stands. A send UCX completed leaves the table (its `done` ran).
enum class SendState {
  kPosted,  // handed to UCX; its completion finishes it
  kFailed,  // finished with an error before UCX completed it (its peer was lost, or the member
            // closed); UCX's completion, if it ever comes, finds it failed and finishes nothing
};

/// The sends in flight of one UCX member, under a lock of their own: any thread may call.
/// Callers run what a call returns to finish (Finish::done) after it returns, as the
/// member's completions run (UcxProgress::complete), never under this lock.
class UcxSendsInFlight {
 public:
  /// What finishes a send: `done`, run as `owner`'s completion.
  struct Finish {
    std::thread::id owner;  // the thread that issued the send (UcxProgress::complete)
    Done done;
  };

  /// A send to `peer` about to be posted to UCX, kPosted; its number, for completed().
  std::uint64_t posted(int peer, std::thread::id owner, Done done);
  /// UCX completed send `number`: it leaves the table, and what finishes it comes back,
  /// unless it was kFailed already.
  std::optional<Finish> completed(std::uint64_t number);
  /// The kPosted sends to `peer` (every peer: -1) now kFailed, and what finishes each.
  std::vector<Finish> fail(int peer);
  /// How many sends are kPosted.
  int count_posted() const;

 private:
  struct Send {
    int peer;
    SendState state;
    Finish finish;
  };
  mutable std::mutex mu_;
  std::unordered_map<std::uint64_t, Send> sends_;  // under mu_, by number
  std::uint64_t issued_ = 0;                       // under mu_
  int posted_ = 0;                                 // under mu_: sends in kPosted
};

}  // namespace conveyor::transport
