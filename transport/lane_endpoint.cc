#include "transport/lane_endpoint.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <deque>
#include <mutex>
#include <utility>

namespace conveyor::transport {
namespace {

// A header: [kHeaderMagic, tag, count, then per tensor: where it goes (Where), and for one
// on the lane its dtype, dimensions and sizes].
constexpr std::int64_t kHeaderMagic = 0x6c616e65;  // "lane"
enum Where : std::int64_t { kUndefined = 0, kInline = 1, kOnLane = 2 };

class EndpointLane final : public Lane {
 public:
  EndpointLane(std::shared_ptr<Endpoint> endpoint, int peer, Tag tag)
      : endpoint_(std::move(endpoint)), peer_(peer), tag_(tag) {}

  void send(std::vector<at::Tensor> tensors, Done done) override {
    if (Status e = error(); !e.is_ok()) return done(e);
    endpoint_->send(peer_, tag_, std::move(tensors), std::move(done));
  }

  void recv(std::vector<at::Tensor> into, Done done) override {
    if (Status e = error(); !e.is_ok()) return done(e);
    endpoint_->recv(peer_, tag_, [into = std::move(into), done = std::move(done)](Result<std::vector<at::Tensor>> got) {
      if (!got.is_ok()) return done(got.status());
      if (got->size() != into.size()) {
        return done(Status(ErrorCode::kCorrupt, "a lane message of " + std::to_string(got->size()) +
                                                    " tensors where its header announced " + std::to_string(into.size())));
      }
      for (std::size_t k = 0; k < into.size(); ++k) {
        const at::Tensor& t = (*got)[k];
        if (!t.defined() || t.scalar_type() != into[k].scalar_type() || !t.sizes().equals(into[k].sizes())) {
          return done(Status(ErrorCode::kCorrupt, "a lane message's tensor " + std::to_string(k) + " is " +
                                                      describe_tensor(t) + " where its header announced " +
                                                      describe_tensor(into[k])));
        }
        try {
          into[k].copy_(t);
        } catch (const std::exception& e) {
          return done(Status(ErrorCode::kExecution, std::string("copying a lane message: ") + e.what()));
        }
      }
      done(Status::ok());
    });
  }

  void abort(Status error) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_.is_ok()) error_ = std::move(error);
  }

 private:
  Status error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  std::shared_ptr<Endpoint> endpoint_;
  int peer_;
  Tag tag_;
  std::mutex mu_;
  Status error_ = Status::ok();
};

class LaneEndpointImpl final : public LaneEndpoint, public std::enable_shared_from_this<LaneEndpointImpl> {
 public:
  LaneEndpointImpl(std::shared_ptr<Endpoint> control, c10::Device device, std::map<int, std::shared_ptr<Lane>> sends,
                   std::map<int, std::shared_ptr<Lane>> receives, Tag control_tag)
      : control_(std::move(control)), device_(device), sends_(std::move(sends)), receives_(std::move(receives)),
        control_tag_(control_tag) {
    for (const auto& [peer, lane] : sends_) send_order_[peer] = std::make_unique<std::mutex>();
  }

  void start() {
    for (const auto& [peer, lane] : receives_) listen(peer);
  }

  int rank() const override { return control_->rank(); }
  int world_size() const override { return control_->world_size(); }

  void send(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) override {
    if (Status s = check_peer(rank(), world_size(), peer); !s.is_ok()) return done(s);
    auto lane = sends_.find(peer);
    if (lane == sends_.end()) return done(no_lane("to", peer));
    if (Status e = current_error(); !e.is_ok()) return done(e);
    std::vector<std::int64_t> header{kHeaderMagic, static_cast<std::int64_t>(tag),
                                     static_cast<std::int64_t>(tensors.size())};
    std::vector<at::Tensor> message{at::Tensor()}, on_lane;
    try {
      for (const at::Tensor& t : tensors) {
        if (!t.defined()) {
          header.push_back(kUndefined);
        } else if (t.device() == device_) {
          header.insert(header.end(), {kOnLane, static_cast<std::int64_t>(t.scalar_type()), t.dim()});
          header.insert(header.end(), t.sizes().begin(), t.sizes().end());
          on_lane.push_back(t.detach().contiguous());
        } else {
          header.push_back(kInline);
          message.push_back(t);
        }
      }
      message[0] = at::tensor(header, at::kLong);
    } catch (const std::exception& e) {  // making a tensor contiguous (out of device memory, say)
      return done(Status(ErrorCode::kExecution, std::string("sending to member ") + std::to_string(peer) + ": " + e.what()));
    }
    // Done once both parts are: the header (with the inline tensors) and the lane's transfer.
    struct Both {
      std::mutex mu;
      int left;
      Status first = Status::ok();
      Done done;
    };
    auto both = std::make_shared<Both>();
    // One more than the parts: the caller's own, given back once the order lock is released,
    // so `done` never runs under it (a part may fail at once, inside the send call).
    both->left = (on_lane.empty() ? 1 : 2) + 1;
    both->done = std::move(done);
    auto part = [both](Status s) {
      std::unique_lock<std::mutex> lock(both->mu);
      if (both->first.is_ok() && !s.is_ok()) both->first = s;
      if (--both->left > 0) return;
      Status result = both->first;
      lock.unlock();
      both->done(result);
    };
    {
      // Headers and lane transfers to one peer in one order.
      std::lock_guard<std::mutex> order(*send_order_.at(peer));
      control_->send(peer, control_tag_, std::move(message), part);
      if (!on_lane.empty()) lane->second->send(std::move(on_lane), part);
    }
    part(Status::ok());
  }

  void recv(int peer, Tag tag, Received done) override {
    if (Status s = check_peer(rank(), world_size(), peer); !s.is_ok()) return done(s);
    if (!receives_.count(peer)) return done(no_lane("from", peer));
    std::unique_lock<std::mutex> lock(mu_);
    auto& ready = arrived_[{peer, tag}];
    if (!ready.empty()) {
      Result<std::vector<at::Tensor>> message = std::move(ready.front());
      ready.pop_front();
      lock.unlock();
      return done(std::move(message));
    }
    Status failed = !error_.is_ok() ? error_ : lost_.count(peer) ? lost_.at(peer) : Status::ok();
    if (!failed.is_ok()) {
      lock.unlock();
      return done(failed);
    }
    waiting_[{peer, tag}].push_back(std::move(done));
  }

  void abort(Status error) override {
    std::vector<Received> woken;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_.is_ok()) return;
      error_ = error;
      for (auto& [key, waiters] : waiting_) {
        for (auto& w : waiters) woken.push_back(std::move(w));
      }
      waiting_.clear();
    }
    for (auto& [peer, lane] : sends_) lane->abort(error);
    for (auto& [peer, lane] : receives_) lane->abort(error);
    for (auto& w : woken) w(error);
  }

 private:
  Status no_lane(const char* direction, int peer) const {
    return Status(ErrorCode::kInvalidArgument, "member " + std::to_string(rank()) + " has no lane " + direction +
                                                   " member " + std::to_string(peer) +
                                                   " (the lanes are made for the links the plan uses; is it the same "
                                                   "plan on every process?)");
  }

  Status current_error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

  void listen(int peer) {
    std::weak_ptr<LaneEndpointImpl> weak = weak_from_this();
    control_->recv(peer, control_tag_, [weak, peer](Result<std::vector<at::Tensor>> got) {
      if (auto self = weak.lock()) self->on_header(peer, std::move(got));
    });
  }

  // The next header from `peer`: its lane transfer is posted now (headers come in the order
  // the transfers were sent), and the next header is listened for only after that.
  void on_header(int peer, Result<std::vector<at::Tensor>> got) {
    if (!got.is_ok()) return lose(peer, got.status());
    Result<Parsed> parsed = Status::ok();
    try {
      parsed = parse(peer, *got);
    } catch (const std::exception& e) {  // allocating the tensors (out of device memory, say)
      parsed = Status(ErrorCode::kExecution, std::string("receiving a message from member ") + std::to_string(peer) +
                                                 ": " + e.what());
    }
    if (!parsed.is_ok()) return lose(peer, parsed.status());
    auto [tag, message, into] = std::move(parsed).value();
    // Delivered in header order, whichever lane transfer completes first (a small message's
    // can overtake a large one's on a lane over UCX).
    auto arriving = std::make_shared<Arriving>(Arriving{tag, std::move(message), into.empty()});
    {
      std::lock_guard<std::mutex> lock(order_mu_);
      in_order_[peer].push_back(arriving);
    }
    if (into.empty()) {
      deliver_in_order(peer);
    } else {
      std::weak_ptr<LaneEndpointImpl> weak = weak_from_this();
      receives_.at(peer)->recv(into, [weak, peer, arriving](Status s) {
        auto self = weak.lock();
        if (!self) return;
        if (!s.is_ok()) return self->lose(peer, s);
        {
          std::lock_guard<std::mutex> lock(self->order_mu_);
          arriving->complete = true;
        }
        self->deliver_in_order(peer);
      });
    }
    listen(peer);
  }

  // A message whose header came from a peer, until it is delivered.
  struct Arriving {
    Tag tag;
    std::vector<at::Tensor> message;
    bool complete;  // its lane transfer (if any) has finished
  };

  // Delivers `peer`'s complete messages from the front of its header order. One thread at a
  // time delivers a peer's messages; another that completes one meanwhile leaves it to it.
  void deliver_in_order(int peer) {
    std::unique_lock<std::mutex> lock(order_mu_);
    if (delivering_[peer]) return;
    delivering_[peer] = true;
    auto& queue = in_order_[peer];
    while (!queue.empty() && queue.front()->complete) {
      std::shared_ptr<Arriving> next = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      deliver(peer, next->tag, std::move(next->message));
      lock.lock();
    }
    delivering_[peer] = false;
  }

  struct Parsed {
    Tag tag;
    std::vector<at::Tensor> message, into;  // `into`: the lane's tensors, also in `message`
  };
  Result<Parsed> parse(int peer, const std::vector<at::Tensor>& got) const {
    auto corrupt = [&](const std::string& why) {
      return Status(ErrorCode::kCorrupt, "a message header from member " + std::to_string(peer) + " " + why +
                                             " (do both members run the same conveyor?)");
    };
    if (got.empty() || !got[0].defined() || got[0].scalar_type() != at::kLong || got[0].dim() != 1) {
      return corrupt("is not a header");
    }
    const at::Tensor header = got[0].contiguous();
    const std::int64_t* h = header.data_ptr<std::int64_t>();
    const std::int64_t n = header.numel();
    std::int64_t at_word = 3;
    auto next = [&]() -> std::optional<std::int64_t> {
      if (at_word >= n) return std::nullopt;
      return h[at_word++];
    };
    if (n < 3 || h[0] != kHeaderMagic || h[2] < 0) return corrupt("is not a header");
    Parsed p{static_cast<Tag>(h[1]), {}, {}};
    std::size_t inline_next = 1;
    c10::DeviceGuard on_device(device_);
    for (std::int64_t k = 0; k < h[2]; ++k) {
      auto where = next();
      if (!where) return corrupt("is cut short");
      if (*where == kUndefined) {
        p.message.emplace_back();
      } else if (*where == kInline) {
        if (inline_next >= got.size()) return corrupt("announces more tensors than it carries");
        p.message.push_back(got[inline_next++]);
      } else if (*where == kOnLane) {
        auto dtype = next(), dims = next();
        if (!dtype || !dims || *dtype < 0 || *dtype >= static_cast<std::int64_t>(at::ScalarType::NumOptions) ||
            *dims < 0 || *dims > 64) {
          return corrupt("has a tensor of unknown dtype or rank");
        }
        std::vector<std::int64_t> sizes;
        for (std::int64_t d = 0; d < *dims; ++d) {
          auto size = next();
          if (!size || *size < 0) return corrupt("has a tensor of bad sizes");
          sizes.push_back(*size);
        }
        at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(static_cast<at::ScalarType>(*dtype)).device(device_));
        p.message.push_back(t);
        p.into.push_back(t);
      } else {
        return corrupt("has a tensor of unknown placement " + std::to_string(*where));
      }
    }
    if (at_word != n || inline_next != got.size()) return corrupt("carries more than it announces");
    return p;
  }

  void deliver(int peer, Tag tag, std::vector<at::Tensor> message) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = waiting_.find({peer, tag});
    if (it == waiting_.end() || it->second.empty()) {
      arrived_[{peer, tag}].push_back(std::move(message));
      return;
    }
    Received waiter = std::move(it->second.front());
    it->second.pop_front();
    lock.unlock();
    waiter(std::move(message));
  }

  // `peer`'s headers or lane failed: every receive from it fails, now and later.
  void lose(int peer, const Status& error) {
    std::vector<Received> woken;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!lost_.count(peer)) lost_.emplace(peer, error);
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (it->first.first != peer) {
          ++it;
          continue;
        }
        for (auto& w : it->second) woken.push_back(std::move(w));
        it = waiting_.erase(it);
      }
    }
    for (auto& w : woken) w(error);
  }

  std::shared_ptr<Endpoint> control_;
  c10::Device device_;
  std::map<int, std::shared_ptr<Lane>> sends_, receives_;
  Tag control_tag_;
  std::map<int, std::unique_ptr<std::mutex>> send_order_;  // by peer: headers and lane in one order
  std::mutex order_mu_;  // guards in_order_, delivering_ and each Arriving's `complete`
  std::map<int, std::deque<std::shared_ptr<Arriving>>> in_order_;  // by peer: in header order
  std::map<int, bool> delivering_;                                 // by peer: a thread delivers
  std::mutex mu_;
  std::map<std::pair<int, Tag>, std::deque<Result<std::vector<at::Tensor>>>> arrived_;
  std::map<std::pair<int, Tag>, std::deque<Received>> waiting_;
  std::map<int, Status> lost_;
  Status error_ = Status::ok();
};

}  // namespace

std::shared_ptr<Lane> make_endpoint_lane(std::shared_ptr<Endpoint> endpoint, int peer, Tag tag) {
  return std::make_shared<EndpointLane>(std::move(endpoint), peer, tag);
}

Result<std::shared_ptr<LaneEndpoint>> make_lane_endpoint(std::shared_ptr<Endpoint> control, c10::Device device,
                                                         std::map<int, std::shared_ptr<Lane>> sends,
                                                         std::map<int, std::shared_ptr<Lane>> receives, int channel) {
  if (!control) return Status(ErrorCode::kInvalidArgument, "a lane endpoint needs a control endpoint");
  if (channel < 0 || channel >= (1 << 16)) {
    return Status(ErrorCode::kInvalidArgument, "a lane endpoint's channel must be 0 to 65535, not " +
                                                   std::to_string(channel));
  }
  for (const auto* lanes : {&sends, &receives}) {
    for (const auto& [peer, lane] : *lanes) {
      if (Status s = check_peer(control->rank(), control->world_size(), peer); !s.is_ok()) return s;
      if (!lane) return Status(ErrorCode::kInvalidArgument, "a null lane for member " + std::to_string(peer));
    }
  }
  auto endpoint = std::make_shared<LaneEndpointImpl>(std::move(control), device, std::move(sends), std::move(receives),
                                                     kLaneControlTagBit | static_cast<Tag>(channel));
  endpoint->start();
  return std::shared_ptr<LaneEndpoint>(std::move(endpoint));
}

}  // namespace conveyor::transport
