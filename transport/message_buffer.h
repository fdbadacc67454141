// Tensors as UCX messages: a header (count, then per tensor dtype, rank, sizes and bytes)
// and each tensor's bytes at a 64-byte boundary. Below kPartsFrom bytes of data, packing
// copies once into one buffer and the tensors received are made over it, which they keep
// alive; up to kGatheredBelow the same layout is gathered from the caller's memory as one
// message. From there, and whenever a tensor travels in device memory, the header goes alone
// (its count negated) and each tensor's bytes follow as a message of its own under the same
// tag, sent from the caller's memory and received into the tensor it becomes: over shared
// memory the one copy is the receiver's read from the sender (transport.h: a sender does not
// modify what it sent until done; one that may, as a script's send, frames with `copied`:
// host data packed whatever its size, device tensors cloned). Between the processes of one
// host such messages go in the packed layout through the sender's shared region instead,
// where it has room (transport/shared_region.h).
// Buffers of 64 KiB and more come from a pool and go back to it when their last tensor
// dies: a fresh large allocation is fresh pages from the kernel, each faulted in and zeroed
// on first touch, which cost more than the copy itself from a few MB up
// (CONVEYOR_MESSAGE_POOL=0 turns the pool off, to measure it).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

/// `n` uninitialized bytes for a message (a CPU byte tensor), pooled from 64 KiB up: its
/// memory returns to the pool when the last tensor over it dies. Thread-safe.
at::Tensor message_bytes(std::size_t n);

/// A message as it goes out: one buffer (`header` holds everything, `parts` is empty), or
/// from kPartsFrom bytes of tensor data a header followed by `parts`, the bytes of each
/// defined non-empty tensor as the caller gave it (host, contiguous; nothing copied).
struct OutgoingMessage {
  at::Tensor header;
  std::vector<at::Tensor> parts;
  /// The header and the parts go as one message, each padded to 64 bytes (gathered_segments),
  /// and arrive as a packed one.
  bool gathered = false;
};

/// Messages with this many bytes of tensor data or more are not packed.
inline constexpr std::size_t kPartsFrom = std::size_t{64} << 10;
/// Below this many bytes of tensor data, such a message is gathered; from it, its parts
/// travel as messages of their own.
inline constexpr std::size_t kGatheredBelow = std::size_t{32} << 20;

/// `tensors` (undefined ones allowed) framed for sending, on the caller's thread. CUDA
/// tensors are copied to the host, unless `device_memory` (the transport moves device
/// memory): then they stay on their device, the message goes in parts, and this waits for
/// the work queued on their devices' current streams (what made them). `copied`: nothing
/// is read later from the caller's memory (host data packed whatever its size, device
/// tensors cloned), so the caller may write the tensors once this returns.
OutgoingMessage frame_message(const std::vector<at::Tensor>& tensors, bool device_memory = false, bool copied = false);

/// The size of `tensors` in the packed layout (read_message's), when every defined one is on
/// the host; nothing otherwise.
std::optional<std::size_t> packed_size(const std::vector<at::Tensor>& tensors);
/// Writes host `tensors` in the packed layout into `out` (packed_size bytes): one copy, from
/// any strides.
void pack_into(const std::vector<at::Tensor>& tensors, std::uint8_t* out);

/// The memory a gathered message is sent from, in order: the header, then each part and the
/// zeros that pad it to 64 bytes.
std::vector<std::pair<const void*, std::size_t>> gathered_segments(const OutgoingMessage& message);

/// A received first buffer, read: the message's `tensors`, complete when `parts` is empty;
/// otherwise the buffers each following part is to be received into, in order (the bytes
/// of tensors, pooled like message_bytes).
struct IncomingMessage {
  std::vector<at::Tensor> tensors;
  std::vector<at::Tensor> parts;
};

/// Reads a message's first `buffer` (a CPU byte tensor, contiguous, as received); the
/// tensors of a message in one buffer share its memory. Parts sent from device memory are to
/// be received into `device` (this process's CUDA device), or the host without one. Errors: a
/// malformed header or sizes that do not add up (kCorrupt).
Result<IncomingMessage> read_message(const at::Tensor& buffer, const std::optional<c10::Device>& device = std::nullopt);

}  // namespace conveyor::transport
