#include "runtime/remote_exchange.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>

namespace conveyor::runtime {

using graph::ValueId;
using scheduler::Action;
using scheduler::ActionKind;

namespace {
enum WireKind : std::int64_t { kNone, kTensor, kUndefined, kInt, kDouble, kBool };
}  // namespace

Result<std::vector<at::Tensor>> to_wire(const std::vector<c10::IValue>& values, const std::vector<ValueId>& ids) {
  std::vector<std::int64_t> header;
  std::vector<at::Tensor> out{at::Tensor()};
  for (std::size_t k = 0; k < values.size(); ++k) {
    const c10::IValue& v = values[k];
    if (v.isTensor() && v.toTensor().defined()) {
      header.insert(header.end(), {kTensor, v.toTensor().requires_grad() ? 1 : 0});
      out.push_back(v.toTensor().detach());
    } else if (v.isTensor() || v.isNone()) {
      header.insert(header.end(), {v.isNone() ? kNone : kUndefined, 0});
      out.emplace_back();
    } else if (v.isInt()) {
      header.insert(header.end(), {kInt, 0});
      out.push_back(at::scalar_tensor(v.toInt(), at::kLong));
    } else if (v.isDouble()) {
      header.insert(header.end(), {kDouble, 0});
      out.push_back(at::scalar_tensor(v.toDouble(), at::kDouble));
    } else if (v.isBool()) {
      header.insert(header.end(), {kBool, 0});
      out.push_back(at::scalar_tensor(v.toBool(), at::kBool));
    } else {
      return Status(ErrorCode::kUnsupported, "value " + std::to_string(ids[k]) + " (a " + v.tagKind() +
                                                 ") crosses between processes, which carries tensors and scalars only; "
                                                 "cut the model where it passes tensors");
    }
  }
  out[0] = at::tensor(header, at::kLong);
  return out;
}

Result<std::vector<c10::IValue>> from_wire(const std::vector<at::Tensor>& message, std::size_t expected,
                                           const std::optional<c10::Device>& device) {
  if (message.empty() || !message[0].defined() || message[0].numel() != static_cast<std::int64_t>(2 * expected) ||
      message.size() != expected + 1) {
    return Status(ErrorCode::kCorrupt, "a pipeline message between processes carries " +
                                           std::to_string(message.empty() ? 0 : message.size() - 1) + " values, not " +
                                           std::to_string(expected) + " (do the processes run the same plan?)");
  }
  const std::int64_t* h = message[0].data_ptr<std::int64_t>();
  std::vector<c10::IValue> out;
  for (std::size_t k = 0; k < expected; ++k) {
    at::Tensor t = message[k + 1];
    if (device && h[2 * k] == kTensor) t = t.to(*device);
    switch (h[2 * k]) {
      case kTensor: out.emplace_back(h[2 * k + 1] ? t.requires_grad_(true) : t); break;
      case kUndefined: out.emplace_back(at::Tensor()); break;
      case kInt: out.emplace_back(t.item<std::int64_t>()); break;
      case kDouble: out.emplace_back(t.item<double>()); break;
      case kBool: out.emplace_back(t.item<bool>()); break;
      default: out.emplace_back(); break;
    }
  }
  return out;
}

transport::Tag message_tag(int kind, int mb, int stage, int replica) {
  return (transport::Tag(kind) << 44) | (transport::Tag(mb) << 24) | (transport::Tag(stage) << 12) |
         transport::Tag(replica);
}

RemoteExchange::RemoteExchange(const PipelineLayout& layout, const Placement& placement, ValueStore& store,
                               PipelineStreams* streams, std::shared_ptr<transport::Endpoint> endpoint)
    : layout_(layout), placement_(placement), store_(store), streams_(streams), endpoint_(std::move(endpoint)),
      alive_(std::make_shared<Alive>()) {
  alive_->self = this;
}

RemoteExchange::~RemoteExchange() {
  std::lock_guard<std::mutex> lock(alive_->mu);
  alive_->self = nullptr;
}

void RemoteExchange::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  arrivals_.clear();
  handed_back_.clear();
  send_error_ = Status::ok();
}

Status RemoteExchange::send_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return send_error_;
}

void RemoteExchange::hand_back(int stage, int mb, int i, ValueId v, const at::Tensor& g) {
  std::lock_guard<std::mutex> lock(mu_);
  handed_back_[{stage, mb, i}][v] = g;
}

Status RemoteExchange::send(int i, const Action& a) {
  const bool grad = a.kind == ActionKind::kSendGradient;
  const std::vector<Placement::Remote>& destinations = (grad ? placement_.gradients_out : placement_.activations_out)[a.stage][i];
  if (streams_ != nullptr && !destinations.empty()) {
    // A GPU pipeline's messages leave after the compute that made them: the endpoint's host
    // copy (UCX) or NCCL's stream waits for this thread's current stream, which waits for it.
    c10::Event computed(streams_->device().type());
    computed.record(streams_->of_rank(layout_.rank_of(a.stage), i).compute);
    computed.block(current_stream(streams_->device()));
  }
  std::map<ValueId, at::Tensor> gradients;  // what this replica handed back for other processes
  if (grad) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = handed_back_.find({a.stage, a.microbatch, i});
    if (it != handed_back_.end()) {
      gradients = std::move(it->second);
      handed_back_.erase(it);
    }
  }
  for (const Placement::Remote& to : destinations) {
    std::vector<c10::IValue> payload;
    for (ValueId v : to.values) {
      if (grad) {
        auto it = gradients.find(v);
        payload.emplace_back(it != gradients.end() ? it->second : at::Tensor());
      } else {
        payload.push_back(store_.produced(v, a.microbatch, i));
      }
    }
    CONVEYOR_ASSIGN_OR_RETURN(auto message, to_wire(payload, to.values));
    endpoint_->send(to.process, message_tag(grad ? 2 : 1, a.microbatch, a.stage, i), std::move(message),
                    [alive = alive_](Status s) {
                      if (s.is_ok()) return;
                      std::lock_guard<std::mutex> guard(alive->mu);
                      if (alive->self == nullptr) return;
                      std::lock_guard<std::mutex> lock(alive->self->mu_);
                      if (alive->self->send_error_.is_ok()) alive->self->send_error_ = s;
                    });
  }
  return Status::ok();
}

void RemoteExchange::receive(int i, const Action& a, std::function<void(Status)> arrived) {
  struct Need {
    int process;
    bool grad;
    int stage, replica;  // the sender's
  };
  std::vector<Need> needs;
  const bool grad = a.kind == ActionKind::kRecvGradient;
  for (int other : grad ? layout_.read_by[a.stage] : layout_.reads_from[a.stage]) {
    for (int j : layout_.partners(a.stage, i, other)) {
      if (!placement_.here(other, j)) needs.push_back({placement_.replica_process[other][j], grad, other, j});
    }
  }
  if (needs.empty()) return arrived(Status::ok());
  struct Countdown {
    std::mutex mu;
    std::size_t left;
    bool reported = false;
    std::function<void(Status)> arrived;
    void one(const Status& s) {
      std::unique_lock<std::mutex> lock(mu);
      if (reported || (s.is_ok() && --left > 0)) return;
      reported = true;
      lock.unlock();
      arrived(s);
    }
  };
  auto count = std::make_shared<Countdown>();
  count->left = needs.size();
  count->arrived = std::move(arrived);
  const int mb = a.microbatch;
  for (const Need& n : needs) {
    const std::pair<int, transport::Tag> key{n.process, message_tag(n.grad ? 2 : 1, mb, n.stage, n.replica)};
    std::unique_lock<std::mutex> lock(mu_);
    Arrival& arrival = arrivals_[key];
    if (arrival.done) {
      Status e = arrival.error;
      lock.unlock();
      count->one(e);
      continue;
    }
    arrival.waiters.push_back([count](Status s) { count->one(s); });
    if (arrival.posted) continue;
    arrival.posted = true;
    lock.unlock();
    endpoint_->recv(key.first, key.second, [alive = alive_, n, mb, key](Result<std::vector<at::Tensor>> got) {
      std::lock_guard<std::mutex> guard(alive->mu);
      RemoteExchange* self = alive->self;
      if (self == nullptr) return;  // the pipeline is gone
      Status s = got.is_ok() ? self->apply(n.grad, n.stage, n.replica, mb, *got) : got.status();
      std::vector<std::function<void(Status)>> waiters;
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        Arrival& arrival = self->arrivals_[key];
        arrival.done = true;
        arrival.error = s;
        waiters.swap(arrival.waiters);
      }
      for (auto& w : waiters) w(s);
    });
  }
}

// Stores a message from another process: values (activations) of replica `replica` of
// `stage`, or the gradients replica `replica` of reading stage `stage` computed.
Status RemoteExchange::apply(bool grad, int stage, int replica, int mb, const std::vector<at::Tensor>& message) {
  const std::vector<ValueId>* ids =
      Placement::values_for((grad ? placement_.gradients_out : placement_.activations_out)[stage][replica], placement_.process);
  if (ids == nullptr) return Status(ErrorCode::kInternal, "a message from a stage that sends this process nothing");
  // With streams, a message lands on the compute stream of the replica that sent it (one of
  // another process: here its streams carry nothing but its arrivals), so the events
  // recorded there tell readers when it is on the device.
  ReplicaStreams* rs = streams_ == nullptr ? nullptr : &streams_->of_rank(layout_.rank_of(stage), replica);
  std::optional<c10::StreamGuard> on_arrival;
  if (rs != nullptr) on_arrival.emplace(rs->compute);
  std::optional<c10::Device> device;
  if (streams_ != nullptr) device = streams_->device();
  CONVEYOR_ASSIGN_OR_RETURN(auto got, from_wire(message, ids->size(), device));
  if (grad) {
    for (std::size_t k = 0; k < ids->size(); ++k) {
      if (got[k].isTensor() && got[k].toTensor().defined()) store_.add_gradient((*ids)[k], mb, stage, replica, got[k].toTensor());
    }
    return Status::ok();
  }
  store_.put_arrived(*ids, std::move(got), mb, stage, replica);
  return Status::ok();
}

}  // namespace conveyor::runtime
