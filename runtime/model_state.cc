#include "runtime/model_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <set>

namespace conveyor::runtime {

Result<std::unique_ptr<ModelState>> ModelState::create(const PipelineLayout& layout, const Placement& placement,
                                                       std::vector<std::shared_ptr<const graph::GraphExecutor>> executors,
                                                       std::shared_ptr<ProcessGroup> processes) {
  std::unique_ptr<ModelState> m(new ModelState(layout, placement));
  m->executors_ = std::move(executors);
  m->processes_ = std::move(processes);
  for (const auto& name : placement.not_here) {
    m->not_here_.push_back({name, m->executors_[0]->tensor(name)->sizes().vec()});
  }
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
  return m;
}

void ModelState::begin_step() {
  release();  // after gather(), this process again holds only its stages' share
  c10::NoGradGuard no_grad;
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
  if (!released_) return;
  c10::NoGradGuard no_grad;
  for (const auto& t : not_here_) {
    const at::Tensor* mine = executors_[0]->tensor(t.name);
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

const std::vector<std::int64_t>* ModelState::released_sizes(const std::string& name) const {
  if (!released_) return nullptr;
  for (const auto& t : not_here_) {
    if (t.name == name) return &t.sizes;
  }
  return nullptr;
}

}  // namespace conveyor::runtime
