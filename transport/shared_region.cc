#include "transport/shared_region.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common/env.h"

namespace conveyor::transport {

namespace {

constexpr char kMagic[8] = {'c', 'v', 'y', 'r', 'e', 'g', '0', '1'};
// A notice's first word: negative, so read_message refuses one, and unlike any header.
constexpr std::int64_t kNoticeWord = -0x7265676E6F7469LL;
// Each slot starts at a page, with a control line before the message: the serial the sender
// gave it (word 0), and the serial the receiver writes back when done with it (word 1).
constexpr std::size_t kControl = 64, kPage = 4096;

std::size_t slot_size(std::size_t bytes) { return (kControl + bytes + kPage - 1) / kPage * kPage; }
std::atomic_ref<std::uint64_t> control_word(std::uint8_t* slot, int k) {
  return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(slot + 8 * k));
}

template <class T>
void append(std::vector<std::uint8_t>& out, T value) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof value);
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::vector<std::uint8_t> with_region(const std::optional<RegionName>& name, const std::vector<std::uint8_t>& address) {
  if (!name) return address;
  std::vector<std::uint8_t> out(kMagic, kMagic + sizeof kMagic);
  append(out, static_cast<std::int32_t>(name->fd));
  append(out, name->capacity);
  out.insert(out.end(), address.begin(), address.end());
  return out;
}

std::optional<RegionName> split_region(std::vector<std::uint8_t>& address) {
  constexpr std::size_t fixed = sizeof kMagic + 4 + 8;
  if (address.size() < fixed || std::memcmp(address.data(), kMagic, sizeof kMagic) != 0) return std::nullopt;
  std::int32_t fd = 0;
  RegionName name;
  std::memcpy(&fd, address.data() + sizeof kMagic, 4);
  std::memcpy(&name.capacity, address.data() + sizeof kMagic + 4, 8);
  name.fd = fd;
  address.erase(address.begin(), address.begin() + static_cast<std::ptrdiff_t>(fixed));
  return name;
}

std::size_t region_capacity() { return env::ucx_region_bytes(); }

Result<std::unique_ptr<OutboundRegion>> OutboundRegion::create(std::size_t capacity) {
  const int fd = memfd_create("conveyor-ucx-messages", MFD_CLOEXEC);
  if (fd < 0) return Status(ErrorCode::kExecution, "memfd_create for the UCX message region: " + errno_text());
  if (ftruncate(fd, static_cast<off_t>(capacity)) != 0) {
    Status s(ErrorCode::kExecution, "sizing the UCX message region: " + errno_text());
    close(fd);
    return s;
  }
  void* base = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    Status s(ErrorCode::kExecution, "mapping the UCX message region: " + errno_text());
    close(fd);
    return s;
  }
  return std::unique_ptr<OutboundRegion>(new OutboundRegion(fd, capacity, static_cast<std::uint8_t*>(base)));
}

OutboundRegion::~OutboundRegion() {
  munmap(base_, capacity_);  // peers' mappings keep the pages their tensors use
  close(fd_);
}

void OutboundRegion::reclaim() {
  for (auto it = held_.begin(); it != held_.end();) {
    if (control_word(base_ + it->first, 1).load(std::memory_order_acquire) != it->second.serial) {
      ++it;
      continue;
    }
    peer_bytes_[it->second.peer] -= it->second.size;
    it = held_.erase(it);
  }
}

std::optional<RegionSlot> OutboundRegion::allocate(int peer, std::size_t bytes) {
  const std::size_t size = slot_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  reclaim();
  if (peer_bytes_[peer] + size > std::max(kWindowBytes, 2 * size)) return std::nullopt;
  std::size_t at = 0;  // first fit, from the lowest offset
  for (const auto& [offset, held] : held_) {
    if (offset - at >= size) break;
    at = offset + held.size;
  }
  if (at + size > capacity_) return std::nullopt;
  const std::uint64_t serial = next_serial_++;
  held_.emplace(at, Held{size, peer, serial});
  peer_bytes_[peer] += size;
  control_word(base_ + at, 0).store(serial, std::memory_order_relaxed);  // the notice's send orders it
  return RegionSlot{at + kControl, base_ + at + kControl};
}

Result<std::shared_ptr<InboundRegion>> InboundRegion::open(int pid, const RegionName& name) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(name.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return Status(ErrorCode::kExecution, "opening the peer's message region " + path + ": " + errno_text());
  void* base = mmap(nullptr, name.capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const std::string failed = base == MAP_FAILED ? errno_text() : "";
  close(fd);  // the mapping keeps the memory
  if (base == MAP_FAILED) return Status(ErrorCode::kExecution, "mapping the peer's message region " + path + ": " + failed);
  return std::shared_ptr<InboundRegion>(new InboundRegion(static_cast<std::uint8_t*>(base), name.capacity));
}

InboundRegion::~InboundRegion() { munmap(base_, capacity_); }

Result<at::Tensor> InboundRegion::message(std::uint64_t offset, std::uint64_t length,
                                          const std::shared_ptr<InboundRegion>& self) {
  if (offset < kControl || offset % kPage != kControl || offset > capacity_ || length > capacity_ - offset) {
    return Status(ErrorCode::kCorrupt, "a notice of a message outside the sender's region (offset " +
                                           std::to_string(offset) + ", " + std::to_string(length) + " bytes)");
  }
  std::uint8_t* slot = base_ + offset - kControl;
  const std::uint64_t serial = control_word(slot, 0).load(std::memory_order_acquire);
  return at::from_blob(base_ + offset, {static_cast<std::int64_t>(length)},
                       [self, slot, serial](void*) { control_word(slot, 1).store(serial, std::memory_order_release); },
                       at::TensorOptions().dtype(at::kByte));
}

at::Tensor region_notice(std::uint64_t offset, std::uint64_t length) {
  at::Tensor out = at::empty({3 * 8}, at::TensorOptions().dtype(at::kByte));
  const std::int64_t words[3] = {kNoticeWord, static_cast<std::int64_t>(offset), static_cast<std::int64_t>(length)};
  std::memcpy(out.data_ptr(), words, sizeof words);
  return out;
}

std::optional<RegionNotice> read_region_notice(const at::Tensor& buffer) {
  std::int64_t words[3];
  if (buffer.nbytes() != sizeof words) return std::nullopt;
  std::memcpy(words, buffer.data_ptr(), sizeof words);
  if (words[0] != kNoticeWord) return std::nullopt;
  return RegionNotice{static_cast<std::uint64_t>(words[1]), static_cast<std::uint64_t>(words[2])};
}

}  // namespace conveyor::transport
