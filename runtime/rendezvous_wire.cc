#include "runtime/rendezvous_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <utility>

#include "common/blocking_call.h"

namespace conveyor::runtime::wire {

namespace {

struct AddressList {
  addrinfo* first = nullptr;
  AddressList() = default;
  AddressList(AddressList&& other) noexcept : first(std::exchange(other.first, nullptr)) {}
  AddressList(const AddressList&) = delete;
  AddressList& operator=(const AddressList&) = delete;
  AddressList& operator=(AddressList&&) = delete;
  ~AddressList() {
    if (first) freeaddrinfo(first);
  }
};

Result<AddressList> resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  AddressList out;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &out.first);
  if (rc != 0 || out.first == nullptr) {
    return Status(ErrorCode::kExecution, "cannot resolve " + host + " (" + gai_strerror(rc) + ")");
  }
  return out;
}

// A non-blocking socket for address `a`; empty, with `why` set, when the system refuses one.
Socket socket_for(const addrinfo& a, std::string& why) {
  Socket s(::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol));
  if (!s) why = std::strerror(errno);
  return s;
}

int milliseconds_until(Clock::time_point deadline, std::chrono::milliseconds at_most) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp(left, std::chrono::milliseconds(0), at_most).count());
}

}  // namespace

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Result<Socket> listen_at(const std::string& host, int port) {
  CONVEYOR_ASSIGN_OR_RETURN(auto addresses, resolve(host, port, /*passive=*/true));
  std::string why = "no address";
  for (addrinfo* a = addresses.first; a != nullptr; a = a->ai_next) {
    Socket s = socket_for(*a, why);
    if (!s) continue;
    const int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd(), 128) != 0) {
      why = std::strerror(errno);
      continue;
    }
    return s;
  }
  return Status(ErrorCode::kExecution, why);
}

Result<Socket> connect_to(const std::string& host, int port, std::chrono::milliseconds within) {
  CONVEYOR_ASSIGN_OR_RETURN(auto addresses, resolve(host, port, /*passive=*/false));
  const auto deadline = Clock::now() + within;
  std::string why = "no address";
  for (addrinfo* a = addresses.first; a != nullptr; a = a->ai_next) {
    Socket s = socket_for(*a, why);
    if (!s) continue;
    if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        why = std::strerror(errno);
        continue;
      }
      pollfd p{s.fd(), POLLOUT, 0};
      if (::poll(&p, 1, milliseconds_until(deadline, within)) != 1) {
        why = "no answer";
        continue;
      }
      int error = 0;
      socklen_t size = sizeof error;
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &error, &size);
      if (error != 0) {
        why = std::strerror(error);
        continue;
      }
    }
    const int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return s;
  }
  return Status(ErrorCode::kExecution, why);
}

std::string peer_of(int fd) {
  sockaddr_storage address{};
  socklen_t size = sizeof address;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &size) != 0) return "?";
  char text[INET6_ADDRSTRLEN] = {};
  const void* raw = address.ss_family == AF_INET6 ? static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(&address)->sin6_addr)
                                                  : static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(&address)->sin_addr);
  return ::inet_ntop(address.ss_family, raw, text, sizeof text) ? text : "?";
}

std::string frame(std::string_view payload) {
  const auto n = static_cast<std::uint32_t>(payload.size());
  std::string out = {static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8), static_cast<char>(n)};
  out.append(payload);
  return out;
}

FrameReader::Progress FrameReader::read_from(int fd) {
  while (true) {
    const bool in_header = header_read_ < sizeof header_;
    if (!in_header && payload_.size() == length_) return Progress::kDone;
    // Never past this frame: what follows it is not this reader's.
    char chunk[16384];
    const std::size_t want = in_header ? sizeof header_ - header_read_ : std::min(sizeof chunk, length_ - payload_.size());
    const ssize_t got = ::recv(fd, in_header ? reinterpret_cast<char*>(header_) + header_read_ : chunk, want, 0);
    if (got == 0) return Progress::kClosed;
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno == EAGAIN || errno == EWOULDBLOCK ? Progress::kMore : Progress::kClosed;
    }
    if (!in_header) {
      payload_.append(chunk, static_cast<std::size_t>(got));
      continue;
    }
    header_read_ += static_cast<std::size_t>(got);
    if (header_read_ < sizeof header_) continue;
    length_ = (std::uint32_t{header_[0]} << 24) | (std::uint32_t{header_[1]} << 16) | (std::uint32_t{header_[2]} << 8) |
              std::uint32_t{header_[3]};
    if (length_ > limit_) return Progress::kTooLarge;
  }
}

Status write_all(int fd, std::string_view bytes, Clock::time_point deadline) {
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      if (Clock::now() >= deadline) return Status(ErrorCode::kExecution, "the peer takes nothing in");
      ::poll(&p, 1, milliseconds_until(deadline, kStopAskedEvery));
      continue;
    }
    return Status(ErrorCode::kExecution, std::string("the peer closed the connection (") + std::strerror(errno) + ")");
  }
  return Status::ok();
}

Result<std::string> read_frame(int fd, std::size_t limit, Clock::time_point deadline,
                               const std::function<bool()>& interrupted) {
  FrameReader reader(limit);
  while (true) {
    switch (reader.read_from(fd)) {
      case FrameReader::Progress::kDone:
        return std::move(reader.payload());
      case FrameReader::Progress::kTooLarge:
        return Status(ErrorCode::kFormat, "a frame larger than " + std::to_string(limit) + " bytes");
      case FrameReader::Progress::kClosed:
        return Status(ErrorCode::kExecution, "the peer closed the connection");
      case FrameReader::Progress::kMore:
        break;
    }
    if (interrupted && interrupted()) return Status(ErrorCode::kInterrupted, "interrupted");
    if (Clock::now() >= deadline) return Status(ErrorCode::kExecution, "timeout");
    pollfd p{fd, POLLIN, 0};
    ::poll(&p, 1, milliseconds_until(deadline, kStopAskedEvery));
  }
}

}  // namespace conveyor::runtime::wire
