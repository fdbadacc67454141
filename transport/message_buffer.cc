#include "transport/message_buffer.h"

#include <ATen/ATen.h>
#include <sys/mman.h>

#include <bit>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "common/env.h"
#include "transport/cuda_memory.h"

namespace conveyor::transport {

namespace {

constexpr std::size_t kAlign = 64;
constexpr std::size_t kPooledFrom = 64 << 10;
// Buffers from this size on ask for transparent huge pages (the kernel here grants them on
// request, madvise mode). A same-host peer reads a message from the sender's pages (CMA),
// and huge pages there made 256 MB 20% faster (THP_MEM_ALLOC_ENABLE, tools/launch.cc); a
// received buffer is read that way when its tensor is sent on. As a destination alone it
// measured no change.
constexpr std::size_t kHugePage = 2 << 20;
// Idle buffers kept at most (beyond, a returned buffer is freed), and per size class.
constexpr std::size_t kMostIdleBytes = std::size_t{1} << 30;
constexpr std::size_t kMostIdlePerClass = 64;

std::size_t aligned(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Sizes rounded up to a quarter of their power of two, so that messages of nearly one size
// (the same tensors, another header) share buffers, wasting at most a fifth.
std::size_t size_class(std::size_t n) {
  const std::size_t quarter = std::bit_floor(n) / 4;
  return (n + quarter - 1) / quarter * quarter;
}

struct Pool {
  std::mutex mu;
  std::unordered_map<std::size_t, std::vector<void*>> idle;  // size class -> buffers
  std::size_t idle_bytes = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: tensors over its buffers may die at exit
  return *p;
}

void give_back(void* ptr, std::size_t cls) {
  Pool& p = pool();
  {
    std::lock_guard<std::mutex> lock(p.mu);
    auto& bucket = p.idle[cls];
    if (p.idle_bytes + cls <= kMostIdleBytes && bucket.size() < kMostIdlePerClass) {
      bucket.push_back(ptr);
      p.idle_bytes += cls;
      return;
    }
  }
  std::free(ptr);
}

}  // namespace

at::Tensor message_bytes(std::size_t n) {
  const auto bytes = at::TensorOptions().dtype(at::kByte);
  static const bool pooled = env::message_pool_enabled();
  if (n < kPooledFrom || !pooled) return at::empty({static_cast<std::int64_t>(n)}, bytes);
  const std::size_t cls = size_class(n);
  void* ptr = nullptr;
  {
    Pool& p = pool();
    std::lock_guard<std::mutex> lock(p.mu);
    auto it = p.idle.find(cls);
    if (it != p.idle.end() && !it->second.empty()) {
      ptr = it->second.back();
      it->second.pop_back();
      p.idle_bytes -= cls;
    }
  }
  if (ptr == nullptr) {
    const bool huge = cls >= kHugePage;
    if (posix_memalign(&ptr, huge ? kHugePage : kAlign, cls) != 0) throw std::bad_alloc();
    if (huge) madvise(ptr, cls, MADV_HUGEPAGE);  // a hint: refused, the pages stay small
  }
  return at::from_blob(ptr, {static_cast<std::int64_t>(n)}, [cls](void* q) { give_back(q, cls); }, bytes);
}

namespace {

// A tensor whose bytes travel in device memory has this bit set in its header's dtype word.
constexpr std::int64_t kOnDevice = std::int64_t{1} << 16;

// The header of `host` (count, then per tensor dtype, rank, sizes, bytes), its count negated
// when the bytes follow in parts.
std::vector<std::int64_t> header_of(const std::vector<at::Tensor>& host, bool in_parts) {
  const auto count = static_cast<std::int64_t>(host.size());
  std::vector<std::int64_t> header{in_parts ? -count : count};
  for (const auto& c : host) {
    header.push_back(c.defined() ? static_cast<std::int64_t>(c.scalar_type()) | (c.is_cuda() ? kOnDevice : 0) : -1);
    header.push_back(c.defined() ? c.dim() : 0);
    if (c.defined()) {
      for (std::int64_t d = 0; d < c.dim(); ++d) header.push_back(c.size(d));
    }
    header.push_back(c.defined() ? static_cast<std::int64_t>(c.nbytes()) : 0);
  }
  return header;
}

// `tensors` as they go: contiguous, on the host, or CUDA ones kept on their device with
// `device_memory` (once the work that made them is done; `copied`: clones, made on their
// streams before that wait).
std::vector<at::Tensor> as_sent(const std::vector<at::Tensor>& tensors, bool device_memory, bool copied) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) {
    if (!t.defined()) {
      out.emplace_back();
    } else if (device_memory && t.is_cuda()) {
      out.push_back(copied ? t.detach().clone(at::MemoryFormat::Contiguous) : t.detach().contiguous());
    } else {
      out.push_back(t.detach().to(at::kCPU).contiguous());
    }
  }
  if (device_memory) wait_for_current_streams(out);
  return out;
}

enum class Layout { kPacked, kGathered, kInParts };

// The bytes a header takes, its word count first, padded to kAlign.
std::size_t header_bytes(const std::vector<std::int64_t>& header) { return aligned(sizeof(std::int64_t) * (1 + header.size())); }

// Writes `header` (its word count first) at `bytes`, and returns where the data starts.
std::size_t write_header(const std::vector<std::int64_t>& header, std::uint8_t* bytes) {
  const std::int64_t n = static_cast<std::int64_t>(header.size());
  std::memcpy(bytes, &n, sizeof n);
  std::memcpy(bytes + sizeof n, header.data(), sizeof(std::int64_t) * header.size());
  return header_bytes(header);
}

// The packed layout's size for `tensors` under `header` (header_of), when every defined
// tensor is on the host.
std::optional<std::size_t> packed_size(const std::vector<std::int64_t>& header, const std::vector<at::Tensor>& tensors) {
  std::size_t total = header_bytes(header);
  for (const auto& c : tensors) {
    if (c.defined() && !c.device().is_cpu()) return std::nullopt;
    if (c.defined()) total += aligned(c.nbytes());
  }
  return total;
}

// Writes `tensors` packed under `header` into `out`.
void pack_into(const std::vector<std::int64_t>& header, const std::vector<at::Tensor>& tensors, std::uint8_t* out) {
  std::size_t at = write_header(header, out);
  for (const auto& c : tensors) {
    if (!c.defined()) continue;
    if (c.is_contiguous()) {
      if (c.nbytes() > 0) std::memcpy(out + at, c.data_ptr(), c.nbytes());
    } else {  // one strided copy, straight into place
      at::from_blob(out + at, c.sizes(), at::TensorOptions().dtype(c.scalar_type())).copy_(c.detach());
    }
    at += aligned(c.nbytes());
  }
}

// One buffer: the header, then each tensor's bytes when packed (a gathered message's bytes
// follow from the caller's memory; in parts, as messages of their own).
at::Tensor pack(const std::vector<at::Tensor>& host, Layout layout) {
  const std::vector<std::int64_t> header = header_of(host, layout == Layout::kInParts);
  if (layout == Layout::kPacked) {
    at::Tensor out = message_bytes(*packed_size(header, host));
    pack_into(header, host, static_cast<std::uint8_t*>(out.data_ptr()));
    return out;
  }
  at::Tensor out = message_bytes(header_bytes(header));
  write_header(header, static_cast<std::uint8_t*>(out.data_ptr()));
  return out;
}

}  // namespace

std::optional<std::size_t> packed_size(const std::vector<at::Tensor>& tensors) {
  return packed_size(header_of(tensors, /*in_parts=*/false), tensors);
}

void pack_into(const std::vector<at::Tensor>& tensors, std::uint8_t* out) {
  pack_into(header_of(tensors, /*in_parts=*/false), tensors, out);
}

OutgoingMessage frame_message(const std::vector<at::Tensor>& tensors, bool device_memory, bool copied) {
  std::vector<at::Tensor> sent = as_sent(tensors, device_memory, copied);
  std::size_t data = 0;
  bool on_device = false;  // then every tensor's bytes go as a part: one message holds one memory type
  for (const auto& c : sent) {
    data += c.defined() ? c.nbytes() : 0;
    on_device |= c.defined() && c.is_cuda();
  }
  if ((data < kPartsFrom || copied) && !on_device) return {pack(sent, Layout::kPacked), {}};
  const bool gathered = data < kGatheredBelow && !on_device;
  OutgoingMessage out{pack(sent, gathered ? Layout::kGathered : Layout::kInParts), {}, gathered};
  for (auto& c : sent) {
    if (c.defined() && c.nbytes() > 0) out.parts.push_back(std::move(c));
  }
  return out;
}

std::vector<std::pair<const void*, std::size_t>> gathered_segments(const OutgoingMessage& message) {
  static const std::uint8_t zeros[kAlign] = {};
  std::vector<std::pair<const void*, std::size_t>> out{{message.header.data_ptr(), message.header.nbytes()}};
  for (const auto& part : message.parts) {
    out.emplace_back(part.data_ptr(), part.nbytes());
    if (const std::size_t pad = aligned(part.nbytes()) - part.nbytes(); pad > 0) out.emplace_back(zeros, pad);
  }
  return out;
}

Result<IncomingMessage> read_message(const at::Tensor& buffer, const std::optional<c10::Device>& device) {
  auto corrupt = [] { return Status(ErrorCode::kCorrupt, "a UCX message with a malformed header (a peer of another version?)"); };
  const auto* b = static_cast<const std::uint8_t*>(buffer.data_ptr());
  const std::size_t size = static_cast<std::size_t>(buffer.numel());
  std::int64_t n = 0;
  if (size < sizeof n) return corrupt();
  std::memcpy(&n, b, sizeof n);
  if (n < 1 || static_cast<std::size_t>(n) > (size - sizeof n) / sizeof(std::int64_t)) return corrupt();
  std::vector<std::int64_t> h(static_cast<std::size_t>(n));
  std::memcpy(h.data(), b + sizeof n, sizeof(std::int64_t) * h.size());
  std::size_t at = aligned(sizeof(std::int64_t) * (1 + h.size())), k = 1;
  const bool in_parts = h[0] < 0;
  const std::int64_t count = in_parts ? -h[0] : h[0];
  IncomingMessage out;
  for (std::int64_t i = 0; i < count; ++i) {
    if (k + 2 > h.size()) return corrupt();
    const bool sent_from_device = h[k] >= 0 && (h[k] & kOnDevice) != 0;
    const std::int64_t dtype = sent_from_device ? h[k] & ~kOnDevice : h[k];
    ++k;
    const std::int64_t ndim = h[k++];
    if (ndim < 0 || k + static_cast<std::size_t>(ndim) + 1 > h.size()) return corrupt();
    std::vector<std::int64_t> sizes(h.begin() + static_cast<std::ptrdiff_t>(k), h.begin() + static_cast<std::ptrdiff_t>(k + ndim));
    k += static_cast<std::size_t>(ndim);
    const std::int64_t bytes = h[k++];
    if (dtype < 0) {
      out.tensors.emplace_back();
      continue;
    }
    if (dtype >= static_cast<std::int64_t>(at::ScalarType::NumOptions) || bytes < 0 || (sent_from_device && !in_parts) ||
        (!in_parts && (at > size || static_cast<std::size_t>(bytes) > size - at))) {
      return corrupt();
    }
    std::int64_t elements = 1;
    for (std::int64_t d : sizes) {
      if (d < 0 || (d > 0 && elements > std::numeric_limits<std::int64_t>::max() / d)) return corrupt();
      elements *= d;
    }
    const auto type = static_cast<at::ScalarType>(dtype);
    const auto options = at::TensorOptions().dtype(type);
    const std::int64_t item = static_cast<std::int64_t>(c10::elementSize(type));
    if (elements > std::numeric_limits<std::int64_t>::max() / item || elements * item != bytes) return corrupt();
    if (bytes == 0) {
      out.tensors.push_back(at::empty(sizes, options));
      continue;
    }
    if (in_parts && sent_from_device && device) {  // received later, into `device` memory
      // The tensor owns its memory and the part is a byte view of it, not the other way
      // round: a received tensor that is itself a view cannot be changed in place once
      // autograd returns it from a custom Function (conveyor.distributed's receives).
      at::Tensor tensor = at::empty(sizes, options.device(*device));
      out.parts.push_back(tensor.view(-1).view(at::kByte));
      out.tensors.push_back(tensor);
      continue;
    }
    if (in_parts) {  // received later, into a pooled buffer that the tensor keeps
      at::Tensor part = message_bytes(static_cast<std::size_t>(bytes));
      out.parts.push_back(part);
      out.tensors.push_back(at::from_blob(part.data_ptr(), sizes, [part](void*) mutable { part.reset(); }, options));
      continue;
    }
    // A tensor over the received bytes; its deleter keeps the buffer alive.
    at::Tensor keep = buffer;
    out.tensors.push_back(at::from_blob(const_cast<std::uint8_t*>(b + at), sizes,
                                        [keep](void*) mutable { keep.reset(); }, options));
    at += aligned(static_cast<std::size_t>(bytes));
  }
  return out;
}

}  // namespace conveyor::transport
