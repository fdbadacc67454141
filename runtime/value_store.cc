#include "runtime/value_store.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>

#include <optional>

namespace conveyor::runtime {

using graph::ValueId;

void add_into(at::Tensor& acc, const at::Tensor& g) {
  if (!g.defined()) return;
  acc = acc.defined() ? acc + g : g;
}

ReplicaStreams* ValueStore::streams_of(int stage, int i) const {
  return streams_ == nullptr ? nullptr : &streams_->of_rank(layout_.rank_of(stage), i);
}

Status ValueStore::begin_step(const std::vector<c10::IValue>& inputs, std::int64_t batch) {
  const int m = layout_.microbatches();
  std::lock_guard<std::mutex> lock(mu_);
  batch_ = batch;
  micro_inputs_.assign(static_cast<std::size_t>(m), {});
  // Where no input is batched (a capture that fixed the batch size), the call is one
  // microbatch of `batch` samples (samples_of: 1); batched inputs set each microbatch's length.
  micro_length_.assign(static_cast<std::size_t>(m), m == 1 ? batch : 0);
  inputs_wanting_grad_.assign(inputs.size(), c10::IValue());
  input_grads_.clear();
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].isTensor() && inputs[i].toTensor().requires_grad()) inputs_wanting_grad_[i] = inputs[i];
    std::vector<at::Tensor> parts;
    if (layout_.batch.batched_input[i] && inputs[i].isTensor()) {
      const at::Tensor& t = inputs[i].toTensor();
      if (t.size(0) != batch) {
        return Status(ErrorCode::kInvalidArgument, "input " + std::to_string(i) + " has " + std::to_string(t.size(0)) +
                                                       " samples, input 0 has " + std::to_string(batch));
      }
      parts = t.tensor_split(m, 0);
    }
    for (int mb = 0; mb < m; ++mb) {
      micro_inputs_[mb].push_back(parts.empty() ? inputs[i] : c10::IValue(parts[mb]));
      if (!parts.empty()) micro_length_[mb] = parts[mb].size(0);
    }
  }
  losses_.clear();
  return Status::ok();
}

Status ValueStore::begin_packed_step(const std::vector<std::vector<c10::IValue>>& microbatches,
                                     const std::vector<std::int64_t>& rows) {
  if (static_cast<int>(microbatches.size()) != layout_.microbatches() || rows.size() != microbatches.size()) {
    return Status(ErrorCode::kInternal, "a packed step needs one list of inputs per microbatch");
  }
  std::lock_guard<std::mutex> lock(mu_);
  micro_inputs_ = microbatches;
  micro_length_ = rows;
  inputs_wanting_grad_.clear();  // the caller's microbatches: their gradients are not gathered
  input_grads_.clear();
  batch_ = 0;
  for (std::int64_t r : rows) batch_ += r;
  losses_.clear();
  return Status::ok();
}

void ValueStore::end_step() {
  std::lock_guard<std::mutex> lock(mu_);
  values_.clear();
  value_ready_.clear();
  joined_.clear();
  joined_ready_.clear();
  grads_.clear();
  grad_ready_.clear();
  joined_grads_.clear();
  joined_grad_ready_.clear();
  micro_inputs_.clear();
  inputs_wanting_grad_.clear();
  input_grads_.clear();
}

Result<std::vector<c10::IValue>> ValueStore::read(const std::vector<ValueId>& ids, int mb, int stage, int i) {
  ReplicaStreams* rs = streams_of(stage, i);
  auto ready_on_compute = [&](c10::IValue x, c10::Event* ready) {
    if (rs != nullptr) {
      if (ready != nullptr) ready->block(rs->compute);
      if (x.isTensor()) used_on(x.toTensor(), rs->compute);
    }
    return x;
  };
  const BatchLayout& bl = layout_.batch;
  std::vector<c10::IValue> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (ValueId v : ids) {
    auto produced = [&](int r) -> c10::Event* {
      auto rt = value_ready_.find({v, mb});
      return rt == value_ready_.end() || r >= static_cast<int>(rt->second.size()) ? nullptr : rt->second[r];
    };
    if (auto gi = bl.input_index.find(v); gi != bl.input_index.end()) {
      const c10::IValue& whole = micro_inputs_[mb][gi->second];
      if (!bl.batched_input[gi->second] || !whole.isTensor()) {
        out.push_back(whole);
        continue;
      }
      const Share s = layout_.share(micro_length_[mb], stage, i);
      out.emplace_back(whole.toTensor().narrow(0, s.offset, s.length));
      continue;
    }
    auto it = values_.find({v, mb});
    if (it == values_.end()) {
      return Status(ErrorCode::kInternal, "value " + std::to_string(v) + " of microbatch " + std::to_string(mb) +
                                              " was not produced yet");
    }
    const auto& shares = it->second;
    const int rp = layout_.stage_replicas[bl.producer[v]];
    if (layout_.same_split(bl.producer[v], stage)) {
      out.push_back(ready_on_compute(shares[i], produced(i)));
      continue;
    }
    if (bl.is_batch_size[v]) {
      out.emplace_back(layout_.share(micro_length_[mb], stage, i).length);
      continue;
    }
    if (bl.times_batch_size[v]) {  // the producer's share times the factor, as this share's
      const std::int64_t from = layout_.share(micro_length_[mb], bl.producer[v], 0).length;
      const std::int64_t factor = from > 0 ? shares[0].toInt() / from : 0;
      out.emplace_back(factor * layout_.share(micro_length_[mb], stage, i).length);
      continue;
    }
    if (bl.batch_dim[v] < 0) {  // the same on every replica (checked when the layout was made)
      out.push_back(ready_on_compute(shares[0], produced(0)));
      continue;
    }
    auto [jt, fresh] = joined_.emplace(Key{v, mb}, c10::IValue());
    if (fresh) {  // joined on the recv stream of the first replica to read it
      std::optional<c10::StreamGuard> on_recv;
      if (rs != nullptr) {
        for (int r = 0; r < rp; ++r) {
          if (c10::Event* e = produced(r)) e->block(rs->recv);
        }
        on_recv.emplace(rs->recv);
      }
      std::vector<at::Tensor> parts;
      bool needs_grad = false;
      for (const auto& s : shares) {
        parts.push_back(s.toTensor().detach());
        needs_grad = needs_grad || s.toTensor().requires_grad();
        if (rs != nullptr) used_on(parts.back(), rs->recv);
      }
      at::Tensor whole = at::cat(parts, bl.batch_dim[v]);
      if (needs_grad) whole.requires_grad_(true);  // so consumers' inputs ask for gradients
      jt->second = whole;
      if (rs != nullptr) joined_ready_[{v, mb}] = rs->events.record(rs->recv);
    }
    const Share s = layout_.share(micro_length_[mb], stage, i);
    const std::int64_t k = per_sample(v, jt->second.toTensor(), micro_length_[mb]);
    auto jr = joined_ready_.find({v, mb});
    out.push_back(ready_on_compute(c10::IValue(jt->second.toTensor().narrow(bl.batch_dim[v], k * s.offset, k * s.length)),
                                   jr == joined_ready_.end() ? nullptr : jr->second));
  }
  return out;
}

void ValueStore::put(const std::vector<ValueId>& ids, std::vector<c10::IValue> values, int mb, int stage, int i,
                     c10::Event* ready) {
  std::lock_guard<std::mutex> lock(mu_);
  put_locked(ids, values, mb, stage, i, ready);
}

void ValueStore::put_arrived(const std::vector<ValueId>& ids, std::vector<c10::IValue> values, int mb, int stage, int i) {
  ReplicaStreams* rs = streams_of(stage, i);
  std::lock_guard<std::mutex> lock(mu_);  // also the sender's event pool: arrivals may come on several threads
  put_locked(ids, values, mb, stage, i, rs != nullptr ? rs->events.record(rs->compute) : nullptr);
}

void ValueStore::put_locked(const std::vector<ValueId>& ids, std::vector<c10::IValue>& values, int mb, int stage, int i,
                            c10::Event* ready) {
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const ValueId v = ids[k];
    if (v == layout_.batch.loss) losses_[{mb, i}] = values[k].toTensor().detach();
    auto& shares = values_[{v, mb}];
    shares.resize(static_cast<std::size_t>(layout_.stage_replicas[stage]));
    shares[i] = std::move(values[k]);
    if (ready != nullptr) {
      auto& r = value_ready_[{v, mb}];
      r.resize(shares.size(), nullptr);
      r[i] = ready;
    }
  }
}

c10::IValue ValueStore::produced(ValueId v, int mb, int i) {
  std::lock_guard<std::mutex> lock(mu_);
  return values_.at({v, mb})[i];
}

void ValueStore::add_gradient(ValueId v, int mb, int stage, int i, const at::Tensor& g) {
  const BatchLayout& bl = layout_.batch;
  const int rp = layout_.stage_replicas[bl.producer[v]];
  const bool alike = layout_.same_split(bl.producer[v], stage);
  ReplicaStreams* rs = streams_of(stage, i);
  std::lock_guard<std::mutex> lock(mu_);
  auto& slots = grads_[{v, mb}];
  slots.resize(static_cast<std::size_t>(rp));
  if (alike || bl.batch_dim[v] < 0) {
    const int slot = alike ? i : 0;
    if (rs == nullptr) return add_into(slots[slot], g);
    auto& ready = grad_ready_[{v, mb}];
    ready.resize(static_cast<std::size_t>(rp), nullptr);
    if (slots[slot].defined() && ready[slot] != nullptr) {  // another stage's gradient of it
      ready[slot]->block(rs->compute);
      used_on(slots[slot], rs->compute);
    }
    add_into(slots[slot], g);
    ready[slot] = rs->events.record(rs->compute);
    return;
  }
  std::optional<c10::StreamGuard> on_send;
  if (rs != nullptr) {
    rs->events.record(rs->compute)->block(rs->send);
    auto jr = joined_grad_ready_.find({v, mb});
    if (jr != joined_grad_ready_.end()) jr->second->block(rs->send);
    on_send.emplace(rs->send);
    used_on(g, rs->send);
  }
  at::Tensor& whole = joined_grads_[{v, mb}];
  if (!whole.defined()) whole = zeros_like_joined(v, mb);
  if (!whole.defined()) return;  // no share of the value is here: no replica here reads this gradient
  const Share s = layout_.share(micro_length_[mb], stage, i);
  const std::int64_t k = per_sample(v, whole, micro_length_[mb]);
  whole.narrow(bl.batch_dim[v], k * s.offset, k * s.length).add_(g);
  if (rs != nullptr) {
    used_on(whole, rs->send);
    joined_grad_ready_[{v, mb}] = rs->events.record(rs->send);
  }
}

// Zeros shaped like value `v` of microbatch `mb` with its producers' shares joined (the join
// itself is in the reading process, which may be another one, and this process may hold
// some of the shares only): a share's shape, the whole microbatch along the batch dimension.
at::Tensor ValueStore::zeros_like_joined(ValueId v, int mb) const {
  auto jt = joined_.find({v, mb});
  if (jt != joined_.end()) return at::zeros_like(jt->second.toTensor());
  const auto& shares = values_.at({v, mb});
  for (std::size_t r = 0; r < shares.size(); ++r) {
    if (!shares[r].isTensor()) continue;
    const at::Tensor& share = shares[r].toTensor();
    const int producer = layout_.batch.producer[v];
    const std::int64_t k = per_sample(v, share, layout_.share(micro_length_[mb], producer, static_cast<int>(r)).length);
    std::vector<std::int64_t> sizes = share.sizes().vec();
    sizes[layout_.batch.batch_dim[v]] = k * micro_length_[mb];
    return at::zeros(sizes, share.options());
  }
  return at::Tensor();
}

at::Tensor ValueStore::take_gradient(ValueId v, int mb, int i) {
  const BatchLayout& bl = layout_.batch;
  ReplicaStreams* rs = streams_of(bl.producer[v], i);
  std::lock_guard<std::mutex> lock(mu_);
  at::Tensor g;
  auto it = grads_.find({v, mb});
  if (it != grads_.end() && i < static_cast<int>(it->second.size())) g = std::move(it->second[i]);
  if (rs != nullptr) {
    auto rt = grad_ready_.find({v, mb});
    if (rt != grad_ready_.end() && i < static_cast<int>(rt->second.size()) && rt->second[i] != nullptr) {
      rt->second[i]->block(rs->compute);
    }
    auto jr = joined_grad_ready_.find({v, mb});
    if (jr != joined_grad_ready_.end()) jr->second->block(rs->compute);
    used_on(g, rs->compute);
  }
  auto jt = joined_grads_.find({v, mb});
  if (jt != joined_grads_.end()) {
    const Share s = layout_.share(micro_length_[mb], bl.producer[v], i);
    const std::int64_t k = per_sample(v, jt->second, micro_length_[mb]);
    add_into(g, jt->second.narrow(bl.batch_dim[v], k * s.offset, k * s.length));
  }
  release_read_locked(v, mb, i);
  return g;
}

void ValueStore::release_read_locked(ValueId v, int mb, int i) {
  auto it = values_.find({v, mb});
  if (it == values_.end()) return;
  if (i < static_cast<int>(it->second.size())) it->second[i] = c10::IValue();
  for (const auto& share : it->second) {
    if (!share.isNone()) return;
  }
  values_.erase(it);
  value_ready_.erase({v, mb});
  joined_.erase({v, mb});
  joined_ready_.erase({v, mb});
}

std::int64_t ValueStore::per_sample(ValueId v, const at::Tensor& t, std::int64_t samples) const {
  const BatchLayout& bl = layout_.batch;
  if (bl.batch_scale[v] > 0 || samples <= 0) return bl.batch_scale[v];
  return t.size(bl.batch_dim[v]) / samples;
}

void ValueStore::add_input_gradient(int input, int mb, int stage, int i, const at::Tensor& g) {
  std::lock_guard<std::mutex> lock(mu_);
  if (input < 0 || input >= static_cast<int>(inputs_wanting_grad_.size()) || inputs_wanting_grad_[input].isNone()) {
    return;
  }
  add_into(input_grads_[{input, mb, stage, i}], g);
}

std::vector<at::Tensor> ValueStore::take_input_gradients() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<at::Tensor> out(inputs_wanting_grad_.size());
  for (std::size_t k = 0; k < out.size(); ++k) {
    if (inputs_wanting_grad_[k].isTensor()) out[k] = at::zeros_like(inputs_wanting_grad_[k].toTensor().detach());
  }
  std::vector<std::int64_t> mb_offset(micro_length_.size(), 0);
  for (std::size_t mb = 1; mb < micro_length_.size(); ++mb) mb_offset[mb] = mb_offset[mb - 1] + micro_length_[mb - 1];
  for (const auto& [key, g] : input_grads_) {
    const auto [input, mb, stage, i] = key;
    at::Tensor into = out[input];
    if (layout_.batch.batched_input[input]) {
      const Share share = layout_.share(micro_length_[mb], stage, i);
      into = into.narrow(0, mb_offset[mb] + share.offset, share.length);
    }
    into.add_(g.to(into.device()));
  }
  input_grads_.clear();
  return out;
}

double ValueStore::weight(int mb, int stage, int i) const {
  if (layout_.batch.loss_reduction.reduction == LossReduction::kSum) return 1.0;  // a sum over the samples
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<double>(layout_.share(micro_length_[mb], stage, i).length) / static_cast<double>(batch_);
}

std::map<std::pair<int, int>, at::Tensor> ValueStore::losses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return losses_;
}

}  // namespace conveyor::runtime
