#include "transport/peer_liveness.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <fstream>

namespace conveyor::transport {

namespace {

constexpr char kMagic[8] = {'c', 'v', 'y', 'p', 'i', 'd', '0', '1'};

std::string first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string link_of(const char* path) {
  char buf[256];
  const ssize_t n = readlink(path, buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

}  // namespace

const ProcessIdentity& this_process() {
  static const ProcessIdentity me = [] {
    ProcessIdentity p;
    p.pid = static_cast<int>(getpid());
    const std::string boot = first_line("/proc/sys/kernel/random/boot_id");
    if (!boot.empty()) {
      p.host = boot + "|" + link_of("/proc/self/ns/pid") + "|" + link_of("/proc/self/ns/ipc") + "|" +
               link_of("/proc/self/ns/mnt");
    }
    return p;
  }();
  return me;
}

std::vector<std::uint8_t> with_identity(const ProcessIdentity& identity, const std::vector<std::uint8_t>& address) {
  std::vector<std::uint8_t> out(kMagic, kMagic + sizeof kMagic);
  const std::int32_t pid = identity.pid;
  const std::uint32_t length = static_cast<std::uint32_t>(identity.host.size());
  out.insert(out.end(), reinterpret_cast<const std::uint8_t*>(&pid), reinterpret_cast<const std::uint8_t*>(&pid) + 4);
  out.insert(out.end(), reinterpret_cast<const std::uint8_t*>(&length),
             reinterpret_cast<const std::uint8_t*>(&length) + 4);
  out.insert(out.end(), identity.host.begin(), identity.host.end());
  out.insert(out.end(), address.begin(), address.end());
  return out;
}

ProcessIdentity split_identity(std::vector<std::uint8_t>& address) {
  ProcessIdentity p;
  const std::size_t fixed = sizeof kMagic + 8;
  if (address.size() < fixed || std::memcmp(address.data(), kMagic, sizeof kMagic) != 0) return p;
  std::int32_t pid = 0;
  std::uint32_t length = 0;
  std::memcpy(&pid, address.data() + sizeof kMagic, 4);
  std::memcpy(&length, address.data() + sizeof kMagic + 4, 4);
  if (length > address.size() - fixed) return p;
  p.pid = pid;
  p.host.assign(reinterpret_cast<const char*>(address.data() + fixed), length);
  address.erase(address.begin(), address.begin() + static_cast<std::ptrdiff_t>(fixed + length));
  return p;
}

int watch_process(int pid) {
#ifdef SYS_pidfd_open
  if (pid <= 0) return -1;
  const long fd = syscall(SYS_pidfd_open, pid, 0);
  return fd >= 0 ? static_cast<int>(fd) : -1;
#else
  (void)pid;
  return -1;
#endif
}

WatchedPeers::~WatchedPeers() {
  for (const auto& [peer, fd] : watched_) close(fd);
}

void WatchedPeers::add(int peer, int pidfd) { watched_.emplace_back(peer, pidfd); }

std::vector<int> WatchedPeers::poll(std::vector<pollfd>& fds, int timeout_ms) {
  if (!ended_.empty()) timeout_ms = std::min(timeout_ms, 20);
  const std::size_t own = fds.size();
  for (const auto& [peer, fd] : watched_) fds.push_back({fd, POLLIN, 0});
  ::poll(fds.data(), fds.size(), timeout_ms);
  std::vector<int> ended;
  std::vector<std::pair<int, int>> alive;
  for (std::size_t k = 0; k < watched_.size(); ++k) {
    if (fds[own + k].revents == 0) {
      alive.push_back(watched_[k]);
      continue;
    }
    close(watched_[k].second);
    ended_.emplace_back(watched_[k].first, std::chrono::steady_clock::now());
    ended.push_back(watched_[k].first);
  }
  watched_.swap(alive);
  fds.resize(own);
  return ended;
}

std::vector<int> WatchedPeers::ended_before(std::chrono::steady_clock::duration grace) {
  std::vector<int> peers;
  for (auto it = ended_.begin(); it != ended_.end();) {
    if (std::chrono::steady_clock::now() - it->second < grace) {
      ++it;
      continue;
    }
    peers.push_back(it->first);
    it = ended_.erase(it);
  }
  return peers;
}

}  // namespace conveyor::transport
