// Large host messages between the processes of one host in one copy: a UCX member writes
// such a message (its packed layout, message_buffer.h) into a region of shared memory of its
// own, which its same-host peers map, and sends the peer a small notice (where, how long)
// as an ordinary UCX message under the message's tag; the receiver makes the message's
// tensors over the region and releases the space when the last of them dies. UCX's own
// shared-memory paths copy twice (into its FIFO and out) or read through the kernel (CMA),
// each measured at half a memcpy or less here.
//
// The region is a memfd (pages are allocated as first written; none are reserved), which a
// peer opens through /proc/<pid>/fd, as the same user. A sender never waits for space: a
// message that does not fit, or would take a peer's share of the region past
// kWindowBytes (or two messages of its size), goes the ordinary way. So a receiver that
// keeps what it received (a pipeline stage's stashed activations) slows nobody down, and
// the space a stream runs through stays small enough to stay in the caches.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

/// What a peer needs to map a member's region: the process's descriptor number and the size.
struct RegionName {
  int fd = -1;
  std::uint64_t capacity = 0;
};

/// `name` prefixed to a member's address, and split off again (an address without it gives
/// nothing and the address unchanged).
std::vector<std::uint8_t> with_region(const std::optional<RegionName>& name, const std::vector<std::uint8_t>& address);
std::optional<RegionName> split_region(std::vector<std::uint8_t>& address);

/// The region's size in bytes (CONVEYOR_UCX_REGION_MB, default 1024; 0: no region, every
/// message goes through UCX).
std::size_t region_capacity();

/// Space a sender holds in its region for one message.
struct RegionSlot {
  std::uint64_t offset = 0;  ///< of the message's first byte in the region
  std::uint8_t* data = nullptr;
};

/// A member's own region, written by its senders. Thread-safe.
class OutboundRegion {
 public:
  /// A region of `capacity` bytes. Errors when the kernel gives no memfd or mapping.
  static Result<std::unique_ptr<OutboundRegion>> create(std::size_t capacity);
  OutboundRegion(const OutboundRegion&) = delete;
  OutboundRegion& operator=(const OutboundRegion&) = delete;
  ~OutboundRegion();

  RegionName name() const { return {fd_, capacity_}; }
  /// Space for a message of `bytes` to `peer`, or nothing: no room, or `peer`'s share (what
  /// it has not released) would pass max(kWindowBytes, 2 x bytes). Space released since the
  /// last call is reclaimed first. The lowest free offset wins: what was just released is
  /// written again while still in the caches.
  std::optional<RegionSlot> allocate(int peer, std::size_t bytes);

  static constexpr std::size_t kWindowBytes = std::size_t{64} << 20;

 private:
  OutboundRegion(int fd, std::size_t capacity, std::uint8_t* base) : fd_(fd), capacity_(capacity), base_(base) {}
  void reclaim();  // under mu_

  struct Held {
    std::size_t size;  // of the slot, its control line included
    int peer;
    std::uint64_t serial;
  };
  const int fd_;
  const std::size_t capacity_;
  std::uint8_t* const base_;
  std::mutex mu_;
  std::map<std::size_t, Held> held_;        // slot offset -> what holds it
  std::map<int, std::size_t> peer_bytes_;   // per peer, bytes held
  std::uint64_t next_serial_ = 1;
};

/// A peer's region as this process maps it, for reading the messages it wrote. Tensors over
/// it keep the mapping alive after the member that opened it is gone.
class InboundRegion {
 public:
  /// Maps the region `name` of process `pid` (this process's own too). Errors name the reason.
  static Result<std::shared_ptr<InboundRegion>> open(int pid, const RegionName& name);
  InboundRegion(const InboundRegion&) = delete;
  InboundRegion& operator=(const InboundRegion&) = delete;
  ~InboundRegion();

  /// The `length` bytes at `offset` as a byte tensor; when the last tensor over them dies,
  /// their space goes back to the sender. Errors (kCorrupt) when they are not inside the region.
  Result<at::Tensor> message(std::uint64_t offset, std::uint64_t length, const std::shared_ptr<InboundRegion>& self);

 private:
  InboundRegion(std::uint8_t* base, std::size_t capacity) : base_(base), capacity_(capacity) {}
  std::uint8_t* const base_;
  const std::size_t capacity_;
};

/// The notice a sender sends for a message it wrote into its region: a small packed buffer,
/// which read_message refuses (its first word is negative), and back.
at::Tensor region_notice(std::uint64_t offset, std::uint64_t length);
/// A notice read back: where the message starts in the sender's region, and its length.
struct RegionNotice {
  std::uint64_t offset, length;
};
std::optional<RegionNotice> read_region_notice(const at::Tensor& buffer);

}  // namespace conveyor::transport
