// The rendezvous's wire: plain TCP, each message one frame of a 4-byte big-endian length and
// that many bytes. A reader names the largest frame it accepts and refuses a larger one from
// its header alone, before reading or keeping any of it; a frame is kept only as its bytes
// arrive. So a peer announcing 4 GiB costs nothing, and nothing reads beyond the one frame it
// waits for (docs/formats.md, "Rendezvous frames"). Torch-free, CAF-free.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace conveyor::runtime::wire {

using Clock = std::chrono::steady_clock;

/// An open socket, closed when this goes.
class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket();
  int fd() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

/// A non-blocking socket listening at host:port (the first address host resolves to that can
/// be bound), or why not.
Result<Socket> listen_at(const std::string& host, int port);

/// A connection to host:port made within `within`, or why not (kExecution, naming the reason).
Result<Socket> connect_to(const std::string& host, int port, std::chrono::milliseconds within);

/// The numeric address of the peer of `fd` ("10.0.0.2"), for limits per peer.
std::string peer_of(int fd);

/// `payload` as one frame.
std::string frame(std::string_view payload);

/// Reads one frame from a non-blocking socket as its bytes arrive, keeping at most `limit`.
class FrameReader {
 public:
  explicit FrameReader(std::size_t limit) : limit_(limit) {}
  enum class Progress { kMore, kDone, kTooLarge, kClosed };
  /// Reads what `fd` has now, never past this frame's end.
  Progress read_from(int fd);
  std::string& payload() { return payload_; }

 private:
  std::size_t limit_;
  unsigned char header_[4] = {};
  std::size_t header_read_ = 0;
  std::uint32_t length_ = 0;
  std::string payload_;
};

/// Writes all of `bytes` to `fd` (blocking or not) by `deadline`, or why not.
Status write_all(int fd, std::string_view bytes, Clock::time_point deadline);

/// Waits for one whole frame of at most `limit` bytes from `fd` until `deadline`, asking
/// `interrupted` (when given) about every 100 ms whether to give up. The error's code says
/// which end: kExecution (the deadline, or the peer closed: the message says which), kFormat
/// (a frame over `limit`), kInterrupted.
Result<std::string> read_frame(int fd, std::size_t limit, Clock::time_point deadline,
                               const std::function<bool()>& interrupted);

}  // namespace conveyor::runtime::wire
