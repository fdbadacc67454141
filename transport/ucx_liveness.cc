#include "transport/ucx_liveness.h"

#include <utility>

#include "transport/ucx_progress.h"

namespace conveyor::transport {

UcxPeerLiveness::UcxPeerLiveness(int world, std::string noun)
    : world_(world),
      noun_(std::move(noun)),
      closed_at_(static_cast<std::size_t>(world)),
      leaving_at_(static_cast<std::size_t>(world)),
      gave_up_because_(static_cast<std::size_t>(world)) {}

std::string UcxPeerLiveness::lost(int peer, const std::string& how) const {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = gave_up_because_[static_cast<std::size_t>(peer)];
  }
  if (!why.empty()) return name(peer) + " gave up the job: " + why;
  return name(peer) + " was lost" + (how.empty() ? "" : " " + how);
}

std::string UcxPeerLiveness::why_nothing_comes(int from, bool last_exchange) const {
  // Every round asks this of every receive still waiting: no lock taken nor clock read
  // unless a peer said something.
  if (!heard_any_.load(std::memory_order_acquire)) return {};
  When closed, leaving;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed = closed_at_[static_cast<std::size_t>(from)];
    leaving = leaving_at_[static_cast<std::size_t>(from)];
  }
  if (!closed && !leaving) return {};
  const auto now = std::chrono::steady_clock::now();
  if (closed && now - *closed >= kGrace) return lost(from, "(it closed its endpoint)");
  if (leaving && now - *leaving >= kGrace && !last_exchange) {
    return name(from) + " sent nothing for this before it left the job (its work ended, " +
           "by returning or exiting): every " + noun_ + " must make the same calls in the same order";
  }
  return {};
}

void UcxPeerLiveness::heard(int peer, Word word, std::string why) {
  std::lock_guard<std::mutex> lock(mu_);
  (word == Word::kGoodbye ? closed_at_ : leaving_at_)[static_cast<std::size_t>(peer)] = std::chrono::steady_clock::now();
  if (!why.empty()) gave_up_because_[static_cast<std::size_t>(peer)] = std::move(why);
  heard_any_.store(true, std::memory_order_release);
}

void UcxPeerLiveness::watch(int peer, int pidfd) { watched_.add(peer, pidfd); }

void UcxPeerLiveness::wait(std::vector<pollfd>& fds, int timeout_ms) {
  const std::vector<int> ended = watched_.poll(fds, timeout_ms);
  if (ended.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  for (int peer : ended) closed_at_[static_cast<std::size_t>(peer)] = now;
  heard_any_.store(true, std::memory_order_release);
}

std::vector<int> UcxPeerLiveness::ended_past_grace() { return watched_.ended_before(kGrace); }

bool UcxPeerLiveness::probe_now(bool before_sleep) {
  const std::int64_t now = now_ns();
  if (world_ <= kPeersProbedEveryRound) return !before_sleep;
  std::lock_guard<std::mutex> lock(mu_);
  if (!before_sleep && now - pings_probed_at_ < kPingProbeIntervalNs) return false;
  pings_probed_at_ = now;
  return true;
}

}  // namespace conveyor::transport
