#include "transport/transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <future>
#include <thread>

#include "common/blocking_call.h"

namespace conveyor::transport {

std::string collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce: return "allreduce";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllGather: return "allgather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
  }
  return "collective";
}

void Endpoint::send_copied(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) {
  for (auto& t : tensors) {
    if (t.defined()) t = t.detach().clone(at::MemoryFormat::Contiguous);
  }
  send(peer, tag, std::move(tensors), std::move(done));
}

void Collective::allreduce_timed(at::Tensor tensor, TimedDone done) {
  allreduce(std::move(tensor), [done = std::move(done)](Status s) { done(std::move(s), -1.0); });
}

Status check_peer(int rank, int world, int peer) {
  if (peer >= 0 && peer < world && peer != rank) return Status::ok();
  return Status(ErrorCode::kInvalidArgument, "member " + std::to_string(rank) + " addressed member " +
                                                 std::to_string(peer) + " of a world of " + std::to_string(world) +
                                                 " (itself or out of range)");
}

at::Tensor text_tensor(const std::string& s) {
  at::Tensor t = at::empty({static_cast<std::int64_t>(s.size())}, at::kByte);
  std::copy(s.begin(), s.end(), t.data_ptr<std::uint8_t>());
  return t;
}

std::string text_of(const at::Tensor& t) {
  const auto* text = t.data_ptr<std::uint8_t>();
  return std::string(text, text + t.numel());
}

std::string describe_tensor(const at::Tensor& t) {
  if (!t.defined()) return "an undefined tensor";
  std::string s = std::string(c10::toString(t.scalar_type())) + "[";
  for (std::int64_t d = 0; d < t.dim(); ++d) s += (d ? "," : "") + std::to_string(t.size(d));
  s += "]";
  return t.device().is_meta() ? s : s + " on " + t.device().str();  // meta: a remote member's call
}

std::string CollectiveCall::text(int member) const {
  std::string s = "member " + std::to_string(member) + " called " + collective_kind_name(kind) + " of " + describe_tensor(in);
  if (kind == CollectiveKind::kReduce || kind == CollectiveKind::kBroadcast) s += " with root " + std::to_string(root);
  if (out.defined()) s += " into " + describe_tensor(out);
  return s;
}

std::vector<std::int64_t> CollectiveCall::encode() const {
  std::vector<std::int64_t> code{static_cast<std::int64_t>(kind), root};
  for (const at::Tensor* t : {&in, &out}) {
    code.push_back(t->defined() ? static_cast<std::int64_t>(t->scalar_type()) : -1);
    code.push_back(t->defined() ? t->dim() : 0);
    if (t->defined()) code.insert(code.end(), t->sizes().begin(), t->sizes().end());
  }
  return code;
}

Result<CollectiveCall> CollectiveCall::decode(const std::vector<std::int64_t>& code) {
  auto corrupt = [] { return Status(ErrorCode::kCorrupt, "a malformed collective call from a peer (another conveyor version?)"); };
  if (code.size() < 2 || code[0] < 0 || code[0] > static_cast<std::int64_t>(CollectiveKind::kReduceScatter)) return corrupt();
  CollectiveCall c;
  c.kind = static_cast<CollectiveKind>(code[0]);
  c.root = static_cast<int>(code[1]);
  std::size_t k = 2;
  for (at::Tensor* t : {&c.in, &c.out}) {
    if (k + 2 > code.size()) return corrupt();
    const std::int64_t dtype = code[k++], ndim = code[k++];
    if (dtype < 0) continue;
    if (dtype >= static_cast<std::int64_t>(at::ScalarType::NumOptions) || ndim < 0 ||
        k + static_cast<std::size_t>(ndim) > code.size()) {
      return corrupt();
    }
    std::vector<std::int64_t> sizes(code.begin() + static_cast<std::ptrdiff_t>(k),
                                    code.begin() + static_cast<std::ptrdiff_t>(k + ndim));
    for (std::int64_t d : sizes) {
      if (d < 0) return corrupt();
    }
    k += static_cast<std::size_t>(ndim);
    *t = at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)).device(at::kMeta));
  }
  return c;
}

Status check_collective_call(const CollectiveCall& first, int first_member, const CollectiveCall& c, int i, int n,
                             std::uint64_t number) {
  auto mismatch = [&](const std::string& why) {
    return Status(ErrorCode::kInvalidArgument, "collective call " + std::to_string(number) + ": " + first.text(first_member) +
                                                   " but " + c.text(i) + " (" + why +
                                                   "); every member must make the same calls in the same order");
  };
  if (c.kind != first.kind) return mismatch("a different operation");
  if (c.root != first.root) return mismatch("a different root");
  if (!c.in.defined()) return mismatch("an undefined tensor");
  if (c.in.sizes() != first.in.sizes() || c.in.scalar_type() != first.in.scalar_type()) {
    return mismatch("a different shape or dtype");
  }
  if (c.kind == CollectiveKind::kAllGather || c.kind == CollectiveKind::kReduceScatter) {
    const at::Tensor& big = c.kind == CollectiveKind::kAllGather ? c.out : c.in;
    const at::Tensor& part = c.kind == CollectiveKind::kAllGather ? c.in : c.out;
    bool ok = c.out.defined() && big.dim() >= 1 && big.dim() == part.dim() && big.size(0) == n * part.size(0) &&
              c.out.scalar_type() == c.in.scalar_type();
    for (std::int64_t d = 1; ok && d < big.dim(); ++d) ok = big.size(d) == part.size(d);
    if (!ok) {
      return mismatch("the larger tensor must be " + std::to_string(n) +
                      " times the other along dim 0, same dtype, other dims equal");
    }
  }
  if (first.root < 0 || first.root >= n) {
    return Status(ErrorCode::kInvalidArgument, "collective call " + std::to_string(number) + ": root " +
                                                   std::to_string(first.root) + " is not a member of a group of " +
                                                   std::to_string(n));
  }
  return Status::ok();
}

namespace {

// Whether `future` is ready within `timeout`. It first polls for a few microseconds, yielding
// the core, and advancing `helping` (the endpoint it waits on) itself meanwhile: the reply to
// a small message often comes that soon, and a thread that slept waits for the kernel to
// wake it (tens of microseconds on a virtual machine's cores). Then it sleeps, asking
// `stop` (when given) every kStopAskedEvery whether to give up.
template <class T>
bool ready_within(std::future<T>& future, std::chrono::milliseconds timeout, Endpoint* helping = nullptr,
                  const std::function<bool()>& stop = {}) {
  constexpr auto kPoll = std::chrono::microseconds(50);
  const auto start = std::chrono::steady_clock::now();
  const auto until = start + kPoll;
  while (std::chrono::steady_clock::now() < until) {
    if (future.wait_for(std::chrono::seconds(0)) == std::future_status::ready) return true;
    if (helping != nullptr) helping->progress_here();
    std::this_thread::yield();
  }
  const bool forever = timeout == std::chrono::milliseconds::max();
  if (!stop) {
    if (!forever) return future.wait_for(timeout) == std::future_status::ready;
    future.wait();
    return true;
  }
  const auto deadline = forever ? std::chrono::steady_clock::time_point::max() : start + timeout;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    const auto slice = deadline - now < kStopAskedEvery ? deadline - now : std::chrono::steady_clock::duration(kStopAskedEvery);
    if (future.wait_for(slice) == std::future_status::ready) return true;
    if (stop()) return false;
  }
}

}  // namespace

Status wait_for(const std::function<void(Done)>& issue) { return *wait_within(issue, std::chrono::milliseconds::max()); }

std::optional<Status> wait_within(const std::function<void(Done)>& issue, std::chrono::milliseconds timeout,
                                  Endpoint* helping, const std::function<bool()>& stop) {
  auto promise = std::make_shared<std::promise<Status>>();
  auto future = promise->get_future();
  issue([promise](Status s) { promise->set_value(std::move(s)); });
  if (!ready_within(future, timeout, helping, stop)) return std::nullopt;
  return future.get();
}

Result<std::vector<at::Tensor>> receive_within(Endpoint& endpoint, int peer, Tag tag,
                                               std::chrono::milliseconds timeout) {
  auto promise = std::make_shared<std::promise<Result<std::vector<at::Tensor>>>>();
  auto future = promise->get_future();
  endpoint.recv(peer, tag, [promise](Result<std::vector<at::Tensor>> r) { promise->set_value(std::move(r)); });
  if (!ready_within(future, timeout, &endpoint)) {
    return Status(ErrorCode::kExecution, "no message from member " + std::to_string(peer) + " under tag " +
                                             std::to_string(tag) + " within " + std::to_string(timeout.count()) + " ms");
  }
  return future.get();
}

}  // namespace conveyor::transport
