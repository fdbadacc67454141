#include "transport/inproc.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

namespace conveyor::transport {

namespace {

// ---- point to point --------------------------------------------------------------------

// The oldest entry queued under `key`, removed (the key goes when its queue empties).
template <typename Map>
std::optional<typename Map::mapped_type::value_type> pop_oldest(Map& queues, const typename Map::key_type& key) {
  auto it = queues.find(key);
  if (it == queues.end() || it->second.empty()) return std::nullopt;
  auto front = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) queues.erase(it);
  return front;
}

struct World {
  std::mutex mu;
  std::vector<c10::Device> devices;
  using Key = std::tuple<int, int, Tag>;  // from, to, tag
  std::map<Key, std::deque<std::vector<at::Tensor>>> messages;  // sent, not yet received
  std::map<Key, std::deque<Received>> receivers;                // receiving, nothing sent yet
  Status error = Status::ok();

  // The receiver's view of a message: the same tensors on its device, copies elsewhere.
  std::vector<at::Tensor> deliver(std::vector<at::Tensor> tensors, int to) const {
    const c10::Device device = devices[to];
    for (auto& t : tensors) {
      if (t.defined() && t.device() != device) t = t.to(device);
    }
    return tensors;
  }
};

class InprocEndpoint final : public Endpoint {
 public:
  InprocEndpoint(std::shared_ptr<World> world, int rank) : world_(std::move(world)), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(world_->devices.size()); }

  void send(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) override {
    if (Status s = check_peer(peer); !s) return done(s);
    std::unique_lock<std::mutex> lock(world_->mu);
    if (Status e = world_->error; !e) {
      lock.unlock();
      return done(e);
    }
    const World::Key key{rank_, peer, tag};
    if (auto receiver = pop_oldest(world_->receivers, key)) {
      lock.unlock();
      (*receiver)(world_->deliver(std::move(tensors), peer));
    } else {
      world_->messages[key].push_back(std::move(tensors));
      lock.unlock();
    }
    done(Status::ok());
  }

  void recv(int peer, Tag tag, Received done) override {
    if (Status s = check_peer(peer); !s) return done(s);
    std::unique_lock<std::mutex> lock(world_->mu);
    if (Status e = world_->error; !e) {
      lock.unlock();
      return done(e);
    }
    const World::Key key{peer, rank_, tag};
    if (auto tensors = pop_oldest(world_->messages, key)) {
      lock.unlock();
      return done(world_->deliver(std::move(*tensors), rank_));
    }
    world_->receivers[key].push_back(std::move(done));
  }

  World& world() const { return *world_; }

 private:
  Status check_peer(int peer) const { return transport::check_peer(rank_, world_size(), peer); }
  std::shared_ptr<World> world_;
  int rank_;
};

// ---- collectives -----------------------------------------------------------------------

struct Call : CollectiveCall {
  Call() = default;
  Call(CollectiveKind kind, int root, at::Tensor in, at::Tensor out, Done done)
      : CollectiveCall{kind, root, without_python(in), without_python(out)}, done(std::move(done)) {}
  Done done;
  bool arrived = false;
};

struct Group {
  std::mutex mu;
  int size = 1;
  std::vector<std::uint64_t> issued;                  // per member: calls made so far
  std::map<std::uint64_t, std::vector<Call>> pending;  // call number -> per member
  Status error = Status::ok();
};

// Checks that the members' k-th calls agree, then runs the operation in member order.
Status run(std::vector<Call>& calls, std::uint64_t number) {
  const int n = static_cast<int>(calls.size());
  const Call& first = calls[0];
  for (int i = 0; i < n; ++i) CONVEYOR_RETURN_IF_ERROR(check_collective_call(first, 0, calls[i], i, n, number));
  c10::NoGradGuard no_grad;
  auto sum = [&](bool reuse_first) {
    at::Tensor acc = reuse_first ? calls[0].in : calls[0].in.clone();
    for (int i = 1; i < n; ++i) acc.add_(calls[i].in.to(acc.device()));
    return acc;
  };
  switch (first.kind) {
    case CollectiveKind::kAllReduce: {
      at::Tensor total = sum(/*reuse_first=*/false);
      for (auto& c : calls) c.in.copy_(total);
      break;
    }
    case CollectiveKind::kReduce:
      if (first.root == 0) {
        sum(/*reuse_first=*/true);
      } else {
        calls[first.root].in.copy_(sum(false));
      }
      break;
    case CollectiveKind::kBroadcast:
      for (int i = 0; i < n; ++i) {
        if (i != first.root) calls[i].in.copy_(calls[first.root].in);
      }
      break;
    case CollectiveKind::kAllGather: {
      const std::int64_t k = first.in.size(0);
      for (auto& c : calls) {
        for (int j = 0; j < n; ++j) c.out.narrow(0, j * k, k).copy_(calls[j].in);
      }
      break;
    }
    case CollectiveKind::kReduceScatter: {
      at::Tensor total = sum(false);
      const std::int64_t k = first.out.size(0);
      for (int i = 0; i < n; ++i) calls[i].out.copy_(total.narrow(0, i * k, k));
      break;
    }
  }
  return Status::ok();
}

class InprocMember final : public Collective {
 public:
  InprocMember(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size; }
  void allreduce(at::Tensor t, Done done) override { call({CollectiveKind::kAllReduce, 0, std::move(t), {}, std::move(done)}); }
  void reduce(at::Tensor t, int root, Done done) override {
    call({CollectiveKind::kReduce, root, std::move(t), {}, std::move(done)});
  }
  void broadcast(at::Tensor t, int root, Done done) override {
    call({CollectiveKind::kBroadcast, root, std::move(t), {}, std::move(done)});
  }
  void allgather(at::Tensor in, at::Tensor out, Done done) override {
    call({CollectiveKind::kAllGather, 0, std::move(in), std::move(out), std::move(done)});
  }
  void reduce_scatter(at::Tensor in, at::Tensor out, Done done) override {
    call({CollectiveKind::kReduceScatter, 0, std::move(in), std::move(out), std::move(done)});
  }
  Group& group() const { return *group_; }

 private:
  // The member whose call completes the set runs the operation and completes every call.
  void call(Call c) {
    std::unique_lock<std::mutex> lock(group_->mu);
    if (Status e = group_->error; !e) {
      lock.unlock();
      return c.done(e);
    }
    const std::uint64_t number = group_->issued[rank_]++;
    auto& calls = group_->pending[number];
    if (calls.empty()) calls.resize(static_cast<std::size_t>(group_->size));
    c.arrived = true;
    calls[rank_] = std::move(c);
    for (const auto& other : calls) {
      if (!other.arrived) return;
    }
    std::vector<Call> ready = std::move(calls);
    group_->pending.erase(number);
    lock.unlock();
    Status result = run(ready, number);
    for (auto& r : ready) r.done(result);
  }
  std::shared_ptr<Group> group_;
  int rank_;
};

}  // namespace

std::vector<std::shared_ptr<Endpoint>> make_inproc_endpoints(const std::vector<c10::Device>& devices) {
  auto world = std::make_shared<World>();
  world->devices = devices;
  std::vector<std::shared_ptr<Endpoint>> out;
  for (int r = 0; r < static_cast<int>(devices.size()); ++r) out.push_back(std::make_shared<InprocEndpoint>(world, r));
  return out;
}

std::vector<std::shared_ptr<Collective>> make_inproc_group(int size) {
  auto group = std::make_shared<Group>();
  group->size = std::max(size, 1);
  group->issued.assign(static_cast<std::size_t>(group->size), 0);
  std::vector<std::shared_ptr<Collective>> out;
  for (int r = 0; r < group->size; ++r) out.push_back(std::make_shared<InprocMember>(group, r));
  return out;
}

void abort_inproc(const Endpoint& endpoint, Status error) {
  World& world = dynamic_cast<const InprocEndpoint&>(endpoint).world();
  std::vector<Received> waiting;
  {
    std::lock_guard<std::mutex> lock(world.mu);
    if (world.error.is_ok()) world.error = error;
    for (auto& [key, q] : world.receivers) {
      for (auto& r : q) waiting.push_back(std::move(r));
    }
    world.receivers.clear();
    world.messages.clear();
  }
  for (auto& r : waiting) r(error);
}

void abort_inproc(const Collective& member, Status error) {
  Group& group = dynamic_cast<const InprocMember&>(member).group();
  std::vector<Done> waiting;
  {
    std::lock_guard<std::mutex> lock(group.mu);
    if (group.error.is_ok()) group.error = error;
    for (auto& [number, calls] : group.pending) {
      for (auto& c : calls) {
        if (c.arrived) waiting.push_back(std::move(c.done));
      }
    }
    group.pending.clear();
  }
  for (auto& d : waiting) d(error);
}

}  // namespace conveyor::transport
