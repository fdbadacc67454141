// Where a job's processes listen: the one network interface that reaches the job's master
// address (transport/ucx.h, interface_towards).
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "transport/ucx.h"

namespace conveyor::transport {

std::string interface_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) return "";
  // Connecting a UDP socket sends nothing; it only asks the kernel which local address routes there.
  sockaddr_storage local{};
  socklen_t length = sizeof local;
  const int fd = socket(found->ai_family, SOCK_DGRAM, 0);
  const bool routed = fd >= 0 && connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
                      getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0;
  if (fd >= 0) close(fd);
  freeaddrinfo(found);
  if (!routed) return "";
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return "";
  std::string name;
  for (ifaddrs* i = interfaces; i != nullptr && name.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != local.ss_family) continue;
    if (local.ss_family == AF_INET) {
      const auto* a = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
      if (a->sin_addr.s_addr == reinterpret_cast<const sockaddr_in*>(&local)->sin_addr.s_addr) name = i->ifa_name;
    } else if (local.ss_family == AF_INET6) {
      const auto* a = reinterpret_cast<const sockaddr_in6*>(i->ifa_addr);
      if (std::memcmp(&a->sin6_addr, &reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr, 16) == 0) {
        name = i->ifa_name;
      }
    }
  }
  freeifaddrs(interfaces);
  return name;
}

}  // namespace conveyor::transport
