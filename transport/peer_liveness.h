// Same-host peers for shared memory, and noticing when one's process ends. UCX's
// shared-memory transports have no peer-failure handler (UCX 1.13 and 1.22 alike), so an
// endpoint to a peer on this host runs without UCX's error handling and the peer is
// watched here instead: a pidfd (readable once the process has exited) in the UCX progress
// thread's poll set. A peer stopped but alive is what the liveness pings find
// (UcxEndpoint::silent_peers).
#pragma once

#include <cstdint>
#include <string>
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

}  // namespace conveyor::transport
