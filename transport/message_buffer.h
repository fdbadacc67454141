// Tensors as one UCX message: a header (count, then per tensor dtype, rank, sizes and bytes)
// and each tensor's bytes at a 64-byte boundary. Packing copies once into an uninitialized
// buffer (the caller may change its tensors as soon as send() returns); unpacking copies
// nothing: the tensors received are made over the received buffer, which they keep alive.
// Buffers of 64 KiB and more come from a pool and go back to it when their last tensor
// dies: a fresh large allocation is fresh pages from the kernel, each faulted in and zeroed
// on first touch, which cost more than the copy itself from a few MB up
// (CONVEYOR_MESSAGE_POOL=0 turns the pool off, to measure it).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace conveyor::transport {

/// `n` uninitialized bytes for a message (a CPU byte tensor), pooled from 64 KiB up: its
/// memory returns to the pool when the last tensor over it dies. Thread-safe.
at::Tensor message_bytes(std::size_t n);

/// `tensors` (undefined ones allowed; device tensors copied to the host) as one message:
/// a CPU byte tensor, contiguous.
at::Tensor pack_message(const std::vector<at::Tensor>& tensors);

/// The tensors of a message `buffer` (a CPU byte tensor, contiguous, as received), sharing
/// its memory. Errors: a malformed header or sizes that do not add up (kCorrupt).
Result<std::vector<at::Tensor>> unpack_message(const at::Tensor& buffer);

}  // namespace conveyor::transport
