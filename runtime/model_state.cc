#include "runtime/model_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <map>
#include <set>

namespace conveyor::runtime {

Result<std::unique_ptr<ModelState>> ModelState::create(const PipelineLayout& layout, const Placement& placement,
                                                       std::vector<std::shared_ptr<const graph::GraphExecutor>> executors,
                                                       std::shared_ptr<ProcessGroup> processes) {
  std::unique_ptr<ModelState> m(new ModelState(layout, placement));
  m->executors_ = std::move(executors);
  m->processes_ = std::move(processes);
  // Sizes from the graph: the tensor may be released already (a pipeline made after a re-plan).
  std::map<std::string, std::vector<std::int64_t>> sizes;
  const graph::Graph& g = m->executors_[0]->graph();
  for (const auto& b : g.bindings) {
    std::vector<std::int64_t> dims;
    for (const graph::Dim& d : g.values[b.value].shape) dims.push_back(d.size);
    sizes[b.name] = std::move(dims);
  }
  for (const auto& name : placement.not_here) {
    auto it = sizes.find(name);
    m->not_here_.push_back({name, it != sizes.end() ? it->second : m->executors_[0]->tensor(name)->sizes().vec()});
  }
  m->declared_ = std::move(sizes);
  // One group per set of readers, made in the placement's order on every process.
  std::map<std::vector<int>, std::shared_ptr<transport::EndpointGroup>> groups;
  for (const auto& sync : placement.buffer_syncs) {
    auto it = groups.find(sync.readers);
    if (it == groups.end()) {
      CONVEYOR_ASSIGN_OR_RETURN(auto made, m->processes_->subgroup(sync.readers));
      it = groups.emplace(sync.readers, std::move(made)).first;
    }
    m->buffer_groups_.push_back({sync.name, it->second, sync.root});
  }
  // Tied parameters: the first local rank that reads one reads the replica's tensor, each
  // later one a leaf of its own.
  const LocalReplicas local = placement.local_workers(layout);
  const auto& spec = layout.schedule.spec;
  for (int i = 0; i < static_cast<int>(m->executors_.size()); ++i) {
    std::set<std::string> read_earlier;  // by a lower rank of replica i here
    for (int rank = 0; rank < spec.ranks; ++rank) {
      if (i >= static_cast<int>(local[rank].size()) || !local[rank][i]) continue;
      std::set<std::string> reads;
      for (int s : spec.stages_of_rank(rank)) reads.insert(layout.stage_shared[s].begin(), layout.stage_shared[s].end());
      std::vector<std::string> own;
      for (const auto& name : reads) {
        if (!read_earlier.insert(name).second) own.push_back(name);
      }
      if (own.empty()) continue;
      CONVEYOR_ASSIGN_OR_RETURN(auto executor, m->executors_[i]->with_own_leaves(own));
      for (const auto& name : own) m->own_leaves_.push_back({i, name, *executor->tensor(name)});
      m->rank_executors_[{i, rank}] = std::move(executor);
    }
  }
  return m;
}

std::shared_ptr<const graph::GraphExecutor> ModelState::executor_for(int replica, int rank) const {
  auto it = rank_executors_.find({replica, rank});
  return it != rank_executors_.end() ? it->second : executors_[static_cast<std::size_t>(replica)];
}

void ModelState::begin_step() {
  release();  // after gather(), this process again holds only its stages' share
  c10::NoGradGuard no_grad;
  for (auto& own : own_leaves_) {
    // The replica's tensor may have new data since (released, handed over, assigned by the user).
    own.leaf.set_data(*executors_[static_cast<std::size_t>(own.replica)]->tensor(own.name));
    own.leaf.mutable_grad().reset();
  }
  for (std::size_t r = 1; r < executors_.size(); ++r) {
    for (const auto& name : layout_.buffers) {
      if (placement_.across_processes() && !placement_.buffers_here.count(name)) continue;  // released here
      at::Tensor mine = *executors_[r]->tensor(name);
      mine.copy_(*executors_[0]->tensor(name));
    }
    for (const auto& stage : layout_.stage_parameters) {
      for (const auto& name : stage) executors_[r]->tensor(name)->mutable_grad().reset();
    }
    for (const auto& name : layout_.shared_parameters) executors_[r]->tensor(name)->mutable_grad().reset();
  }
}

void ModelState::fold_tied_gradients() {
  c10::NoGradGuard no_grad;
  for (auto& own : own_leaves_) {
    at::Tensor g = own.leaf.grad();
    if (!g.defined()) continue;
    const at::Tensor& p = *executors_[static_cast<std::size_t>(own.replica)]->tensor(own.name);
    if (!p.grad().defined()) {
      p.mutable_grad() = g;
    } else if (p.grad().layout() == at::kStrided && g.layout() == at::kStrided) {
      p.mutable_grad().add_(g);
    } else {  // a sparse gradient on either side
      p.mutable_grad() = p.grad() + g;
    }
    own.leaf.mutable_grad().reset();
  }
}

void ModelState::release() {
  if (released_ || not_here_.empty()) return;
  c10::NoGradGuard no_grad;
  for (const auto& t : not_here_) {
    for (const auto& ex : executors_) {
      if (const at::Tensor* x = ex->tensor(t.name)) x->set_data(at::empty({0}, x->options()));
    }
  }
  released_ = true;
}

void ModelState::materialize() {
  c10::NoGradGuard no_grad;
  for (const auto& t : not_here_) {
    const at::Tensor* mine = executors_[0]->tensor(t.name);
    // Before this pipeline's first release a tensor may still be empty from the pipeline it
    // replaced (a re-plan, another capture's): that one gets its shape back too.
    if (!released_ && mine->sizes().vec() == t.sizes) continue;
    mine->set_data(at::empty(t.sizes, mine->options()));
    for (std::size_t r = 1; r < executors_.size(); ++r) {
      if (const at::Tensor* x = executors_[r]->tensor(t.name)) x->set_data(*mine);
    }
  }
  released_ = false;
}

Status ModelState::gather() {
  if (!processes_) return Status::ok();
  materialize();
  c10::NoGradGuard no_grad;
  for (const auto& [name, owner] : placement_.owners) {
    CONVEYOR_RETURN_IF_ERROR(processes_->broadcast(*executors_[0]->tensor(name), owner));
  }
  return Status::ok();
}

namespace {

// Tags of the hand-over's messages (entry k of the placement's owners): bits 44-46 set, which
// no pipeline message (kinds 1 and 2 at bit 44), conveyor.distributed message (bits 44-45) or
// lane control message (bit 46 with a channel) has.
constexpr transport::Tag kHandOverTag = transport::Tag{7} << 44;

// The sends of a hand-over: the first error, and the waiter once every send is done.
struct Sends {
  std::mutex mu;
  int pending = 0;
  Status error = Status::ok();
  transport::Done all_done;
  void finished(Status s) {
    transport::Done run;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!s && error) error = std::move(s);
      if (--pending == 0 && all_done) run = std::move(all_done);
    }
    if (run) run(error);
  }
  void when_done(transport::Done d) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (pending > 0) {
        all_done = std::move(d);
        return;
      }
    }
    d(error);
  }
};

}  // namespace

void ModelState::take(const std::string& name, const at::Tensor& whole) {
  c10::NoGradGuard no_grad;
  const at::Tensor* mine = executors_[0]->tensor(name);
  mine->set_data(at::empty(whole.sizes(), mine->options()));
  mine->copy_(whole);
  const bool buffer = std::find(layout_.buffers.begin(), layout_.buffers.end(), name) != layout_.buffers.end();
  for (std::size_t r = 1; r < executors_.size(); ++r) {
    if (const at::Tensor* x = executors_[r]->tensor(name)) x->set_data(buffer ? mine->clone() : *mine);
  }
}

Result<std::int64_t> ModelState::hand_over(const std::map<std::string, std::vector<int>>& holders) {
  if (!processes_) return std::int64_t{0};
  const int me = processes_->rank();
  auto sends = std::make_shared<Sends>();
  struct Arrival {
    std::string name;
    int from = 0;
    transport::Tag tag = 0;
  };
  std::vector<Arrival> arrivals;
  // Every process walks the same entries in the same order: the sends are posted first (none
  // waits for its receiver), then the receives.
  for (std::size_t k = 0; k < placement_.owners.size(); ++k) {
    const std::string& name = placement_.owners[k].first;
    auto it = holders.find(name);
    if (it == holders.end() || it->second.empty()) {
      return Status(ErrorCode::kInternal, "no process holds '" + name + "' to hand over to the new plan's readers");
    }
    const std::vector<int>& held = it->second;
    const int from = *std::min_element(held.begin(), held.end());
    const transport::Tag tag = kHandOverTag | static_cast<transport::Tag>(k);
    for (int p : placement_.readers[k]) {
      if (std::find(held.begin(), held.end(), p) != held.end()) continue;
      if (from == me) {
        {
          std::lock_guard<std::mutex> lock(sends->mu);
          ++sends->pending;
        }
        processes_->endpoint()->send(p, tag, {executors_[0]->tensor(name)->detach()},
                                     [sends](Status s) { sends->finished(std::move(s)); });
      } else if (p == me) {
        arrivals.push_back({name, from, tag});
      }
    }
  }
  std::int64_t received = 0;
  for (const Arrival& a : arrivals) {
    CONVEYOR_ASSIGN_OR_RETURN(auto got, processes_->receive(a.from, a.tag,
                                                            "receiving '" + a.name + "' from process " +
                                                                std::to_string(a.from) + " for the new plan"));
    if (got.size() != 1) {
      return Status(ErrorCode::kInternal, "'" + a.name + "' arrived as " + std::to_string(got.size()) + " tensors");
    }
    take(a.name, got[0]);
    received += static_cast<std::int64_t>(got[0].nbytes());
  }
  CONVEYOR_RETURN_IF_ERROR(processes_->wait([&](transport::Done d) { sends->when_done(std::move(d)); },
                                            "handing this process's parameters and buffers to the new plan's readers"));
  return received;
}

Status ModelState::sync_buffers() {
  c10::NoGradGuard no_grad;
  for (const BufferGroup& b : buffer_groups_) {
    if (!b.group) continue;
    at::Tensor t = *executors_[0]->tensor(b.name);
    CONVEYOR_RETURN_IF_ERROR(processes_->wait([&](transport::Done d) { b.group->broadcast(t, b.root, d); },
                                              "handing buffer '" + b.name + "' to the processes that read it"));
  }
  return Status::ok();
}

void ModelState::set_gradients_aside() {
  aside_.clear();
  for (const auto& name : layout_.trainable) {
    const at::Tensor* p = executors_[0]->tensor(name);
    if (p == nullptr) continue;
    aside_.emplace_back(*p, p->grad());
    p->mutable_grad().reset();
  }
}

std::shared_ptr<HeldGradients> ModelState::hold_step_gradients() {
  auto held = std::make_shared<HeldGradients>();
  for (auto& [p, before] : aside_) {
    if (p.grad().defined()) held->grads_.emplace_back(p, p.grad());
    p.mutable_grad() = std::move(before);
  }
  aside_.clear();
  return held;
}

void HeldGradients::apply(const at::Tensor& scale) {
  c10::NoGradGuard no_grad;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [p, g] : grads_) {
    at::Tensor scaled = g * scale.to(g.device(), g.scalar_type());
    if (p.grad().defined()) {
      p.mutable_grad() = p.grad() + scaled;
    } else {
      p.mutable_grad() = std::move(scaled);
    }
  }
  grads_.clear();
}

const std::vector<std::int64_t>* ModelState::declared_sizes(const std::string& name) const {
  auto it = declared_.find(name);
  return it != declared_.end() ? &it->second : nullptr;
}

const std::vector<std::int64_t>* ModelState::released_sizes(const std::string& name) const {
  if (!released_) return nullptr;
  for (const auto& t : not_here_) {
    if (t.name == name) return &t.sizes;
  }
  return nullptr;
}

}  // namespace conveyor::runtime
