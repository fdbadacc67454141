// What a UCX member (transport/ucx_member.h) knows of its peers being there: the words they
// said (a goodbye, with why it gave the job up; that it leaves), whose process ended (same-host
// peers, watched by pidfd: transport/peer_liveness.h), and this member's own words. From it
// come the errors that name a peer ("process 2 was lost", "process 2 gave up the job: ...")
// and the receives that fail because nothing more comes.
#pragma once

#include <poll.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "transport/peer_liveness.h"

namespace conveyor::transport {

/// The liveness of one UCX member's peers: its own lock, and the watched processes of its
/// progress thread.
class UcxPeerLiveness {
 public:
  /// What a peer said.
  enum class Word { kGoodbye, kLeaving };
  /// What a peer that closed or left sent just before has this long to be received.
  static constexpr auto kGrace = std::chrono::milliseconds(500);

  /// The peers of a member of `world`, called `noun` and their rank in errors.
  UcxPeerLiveness(int world, std::string noun);

  /// Any thread: "process 2".
  std::string name(int peer) const { return noun_ + " " + std::to_string(peer); }
  /// Any thread: "process 2 was lost" and `how` ("(its process exited)"); or, when the peer
  /// said in its goodbye why it gave the job up, "process 2 gave up the job: " and why.
  std::string lost(int peer, const std::string& how = "") const;
  /// Any thread: why a receive from `from` that is still pending will never be met (its
  /// sender closed, or left and the receive is not for the job's `last_exchange`), once the
  /// grace after the sender's word has passed; or "". Cheap while no peer said anything.
  std::string why_nothing_comes(int from, bool last_exchange) const;
  /// Any thread (the progress thread, receiving it): `peer` said `word` now; a goodbye may
  /// say `why` it gave the job up.
  void heard(int peer, Word word, std::string why = "");

  /// The progress thread: watches `peer`'s process through `pidfd` (watch_process).
  void watch(int peer, int pidfd);
  /// The progress thread, not holding the worker: polls `fds` with the watched pidfds for at
  /// most `timeout_ms`; a peer whose process ended counts as closed from now.
  void wait(std::vector<pollfd>& fds, int timeout_ms);
  /// The progress thread: the peers whose processes ended kGrace ago or longer, each once.
  std::vector<int> ended_past_grace();

  /// Any thread holding the worker: whether to probe for pings, goodbyes and leavings now.
  /// Small worlds probe every round; worlds of more than kPeersProbedEveryRound every
  /// kPingProbeInterval, and again `before_sleep` (a ping that came since their last probe
  /// raised no event).
  bool probe_now(bool before_sleep);

  /// Any thread: true the first time, when this member leaves (UcxEndpoint::leave).
  bool leaving() { return !left_.exchange(true); }
  /// The progress thread: true the first time, when this member says goodbye.
  bool saying_goodbye() { return !said_goodbye_.exchange(true); }

 private:
  using When = std::optional<std::chrono::steady_clock::time_point>;
  static constexpr int kPeersProbedEveryRound = 16;
  static constexpr std::int64_t kPingProbeIntervalNs = 100'000;

  const int world_;
  const std::string noun_;
  mutable std::mutex mu_;
  std::vector<When> closed_at_;                // under mu_: when each peer said goodbye, or its process ended
  std::vector<When> leaving_at_;               // under mu_: when each peer said it leaves
  std::vector<std::string> gave_up_because_;   // under mu_: why each peer gave the job up, when its goodbye said
  std::atomic<bool> heard_any_{false};         // any of the above was set: why_nothing_comes looks
  std::int64_t pings_probed_at_ = 0;           // under mu_ (now_ns)
  WatchedPeers watched_;                       // progress thread only (its poll blocks: not under mu_)
  std::atomic<bool> left_{false}, said_goodbye_{false};
};

}  // namespace conveyor::transport
