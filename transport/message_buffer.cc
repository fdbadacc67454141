#include "transport/message_buffer.h"

#include <ATen/ATen.h>

#include <cstring>
#include <limits>

namespace conveyor::transport {

namespace {

constexpr std::size_t kAlign = 64;

std::size_t aligned(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

}  // namespace

at::Tensor pack_message(const std::vector<at::Tensor>& tensors) {
  std::vector<std::int64_t> header{static_cast<std::int64_t>(tensors.size())};
  std::vector<at::Tensor> host;
  for (const auto& t : tensors) {
    at::Tensor c = t.defined() ? t.detach().to(at::kCPU).contiguous() : at::Tensor();
    header.push_back(c.defined() ? static_cast<std::int64_t>(c.scalar_type()) : -1);
    header.push_back(c.defined() ? c.dim() : 0);
    if (c.defined()) {
      for (std::int64_t d = 0; d < c.dim(); ++d) header.push_back(c.size(d));
    }
    header.push_back(c.defined() ? static_cast<std::int64_t>(c.nbytes()) : 0);
    host.push_back(std::move(c));
  }
  std::size_t total = aligned(sizeof(std::int64_t) * (1 + header.size()));
  for (const auto& c : host) {
    if (c.defined()) total += aligned(c.nbytes());
  }
  at::Tensor out = at::empty({static_cast<std::int64_t>(total)}, at::TensorOptions().dtype(at::kByte));
  auto* bytes = static_cast<std::uint8_t*>(out.data_ptr());
  const std::int64_t n = static_cast<std::int64_t>(header.size());
  std::memcpy(bytes, &n, sizeof n);
  std::memcpy(bytes + sizeof n, header.data(), sizeof(std::int64_t) * header.size());
  std::size_t at = aligned(sizeof(std::int64_t) * (1 + header.size()));
  for (const auto& c : host) {
    if (!c.defined()) continue;
    if (c.nbytes() > 0) std::memcpy(bytes + at, c.data_ptr(), c.nbytes());
    at += aligned(c.nbytes());
  }
  return out;
}

Result<std::vector<at::Tensor>> unpack_message(const at::Tensor& buffer) {
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
  std::vector<at::Tensor> out;
  for (std::int64_t i = 0; i < h[0]; ++i) {
    if (k + 2 > h.size()) return corrupt();
    const std::int64_t dtype = h[k++], ndim = h[k++];
    if (ndim < 0 || k + static_cast<std::size_t>(ndim) + 1 > h.size()) return corrupt();
    std::vector<std::int64_t> sizes(h.begin() + static_cast<std::ptrdiff_t>(k), h.begin() + static_cast<std::ptrdiff_t>(k + ndim));
    k += static_cast<std::size_t>(ndim);
    const std::int64_t bytes = h[k++];
    if (dtype < 0) {
      out.emplace_back();
      continue;
    }
    if (dtype >= static_cast<std::int64_t>(at::ScalarType::NumOptions) || bytes < 0 || at > size ||
        static_cast<std::size_t>(bytes) > size - at) {
      return corrupt();
    }
    std::int64_t elements = 1;
    for (std::int64_t d : sizes) {
      if (d < 0 || (d > 0 && elements > std::numeric_limits<std::int64_t>::max() / d)) return corrupt();
      elements *= d;
    }
    const auto options = at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype));
    const std::int64_t item = static_cast<std::int64_t>(c10::elementSize(static_cast<at::ScalarType>(dtype)));
    if (elements > std::numeric_limits<std::int64_t>::max() / item || elements * item != bytes) return corrupt();
    if (bytes == 0) {
      out.push_back(at::empty(sizes, options));
      continue;
    }
    // A tensor over the received bytes; its deleter keeps the buffer alive.
    at::Tensor keep = buffer;
    out.push_back(at::from_blob(const_cast<std::uint8_t*>(b + at), sizes, [keep](void*) mutable { keep.reset(); },
                                options));
    at += aligned(static_cast<std::size_t>(bytes));
  }
  return out;
}

}  // namespace conveyor::transport
