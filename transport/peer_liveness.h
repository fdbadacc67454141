// Same-host peers for shared memory, and noticing when one's process ends. UCX's
// shared-memory transports have no peer-failure handler (UCX 1.13 and 1.22 alike), so an
// endpoint to a peer on this host runs without UCX's error handling and the peer is
// watched here instead: a pidfd (readable once the process has exited) in the UCX progress
// thread's poll set. A peer stopped but alive is what the liveness pings find
// (UcxEndpoint::silent_peers).
#pragma once

#include <poll.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace conveyor::transport {

/// Who this process is, as a peer needs to know to share memory with it.
struct ProcessIdentity {
  int pid = 0;
  /// Equal for processes that see the same /dev/shm and each other's pids: the boot id and
  /// the pid, ipc and mount namespaces.
  std::string host;
};

/// This process's identity.
const ProcessIdentity& this_process();

/// `identity` prefixed to a UCX worker address, and split off again (an address without it,
/// from an older peer, gives an empty identity and the address unchanged).
std::vector<std::uint8_t> with_identity(const ProcessIdentity& identity, const std::vector<std::uint8_t>& address);
ProcessIdentity split_identity(std::vector<std::uint8_t>& address);

/// A descriptor that becomes readable when process `pid` exits; -1 where the kernel cannot
/// give one (the peer is then reached as a remote one).
int watch_process(int pid);

/// The watched same-host peers of one UCX member (its progress thread's): their pidfds,
/// polled with the member's own descriptors, and the peers whose processes ended.
class WatchedPeers {
 public:
  WatchedPeers() = default;
  WatchedPeers(const WatchedPeers&) = delete;
  WatchedPeers& operator=(const WatchedPeers&) = delete;
  ~WatchedPeers();
  /// Watches `peer` through `pidfd` (watch_process), which this now owns.
  void add(int peer, int pidfd);
  /// Polls the caller's `fds` (their revents set on return) with the watched pidfds, for at
  /// most `timeout_ms` (20 while a peer that ended waits out its grace); returns the peers
  /// whose processes ended, no longer watched.
  std::vector<int> poll(std::vector<pollfd>& fds, int timeout_ms);
  /// The peers whose processes ended `grace` ago or longer, each returned once.
  std::vector<int> ended_before(std::chrono::steady_clock::duration grace);

 private:
  std::vector<std::pair<int, int>> watched_;  // (peer, pidfd)
  std::vector<std::pair<int, std::chrono::steady_clock::time_point>> ended_;  // (peer, when noticed)
};

}  // namespace conveyor::transport
