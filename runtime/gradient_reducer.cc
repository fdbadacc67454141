#include "runtime/gradient_reducer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <future>

#include "runtime/comm_thread.h"
#include "transport/inproc.h"

namespace conveyor::runtime {

using scheduler::Action;
using scheduler::ActionKind;
using scheduler::Span;

struct GradientReducer::Bucket {
  std::vector<std::string> names;
  int fired = 0;      // (parameter, replica) accumulations in the final pass
  int state = 0;      // 0 waiting, 1 posted, 2 reduced (in this process)
  at::Tensor across;  // spanning processes: this process's sum, flat, then everyone's (+ a had-gradients count)
  bool early = false;
  std::chrono::steady_clock::time_point start, end;     // of an early reduction, for the trace
  std::vector<c10::Event*> accumulated;                 // streams: after each accumulation in the final pass
  c10::Event *gpu_start = nullptr, *gpu_end = nullptr;  // streams: the early reduction's
};

// The hooks reach the reducer through a target that outlives it: a hook that cannot be
// unlinked (another hook was chained in front of it) finds it gone and only passes on.
struct GradientReducer::HookTarget {
  std::mutex mu;
  GradientReducer* reducer = nullptr;
};

struct GradientReducer::Accumulated final : torch::autograd::PostAccumulateGradHook {
  Accumulated(std::shared_ptr<HookTarget> target, int s, int b, int r,
              std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous)
      : target(std::move(target)), s(s), b(b), r(r), previous(std::move(previous)) {}
  void operator()(const torch::autograd::Variable& t) override {
    if (previous) (*previous)(t);
    std::lock_guard<std::mutex> lock(target->mu);
    if (target->reducer) target->reducer->accumulated(s, b, r);
  }
  std::shared_ptr<HookTarget> target;
  int s, b, r;
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> previous;
};

struct GradientReducer::Across {
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  Status error = Status::ok();
  struct Timed {
    int stage, bucket;
    std::chrono::steady_clock::time_point start, end;
    double waited_s;  // of it, waiting for the stage's last process to contribute (-1: not told)
  };
  std::vector<Timed> times;  // this step's sums, as they completed (for the trace and the live profile)
};

GradientReducer::GradientReducer(const PipelineLayout& layout, const Placement& placement)
    : layout_(layout), placement_(placement), hook_target_(std::make_shared<HookTarget>()),
      across_(std::make_shared<Across>()) {}

Result<std::unique_ptr<GradientReducer>> GradientReducer::create(const PipelineLayout& layout,
                                                                 const Placement& placement, TensorLookup tensors,
                                                                 PipelineStreams* streams, std::int64_t bucket_bytes,
                                                                 Groups groups, SizesLookup released,
                                                                 SizesLookup declared) {
  std::unique_ptr<GradientReducer> r(new GradientReducer(layout, placement));
  r->tensors_ = std::move(tensors);
  r->streams_ = streams;
  r->bucket_bytes_ = std::max<std::int64_t>(bucket_bytes, 1);
  r->groups_ = std::move(groups);
  r->groups_.across.resize(static_cast<std::size_t>(layout.num_stages()));
  r->released_ = std::move(released);
  r->declared_ = std::move(declared);
  const int num_stages = layout.num_stages(), most = layout.most_replicas;
  for (int s = 0; s < num_stages; ++s) {
    r->local_groups_.push_back(transport::make_inproc_group(std::max<int>(1, placement.local_replicas[s].size())));
  }
  r->tied_group_ = transport::make_inproc_group(most);
  r->final_pass_.reset(new std::atomic<bool>[static_cast<std::size_t>(num_stages * most)]);
  for (int k = 0; k < num_stages * most; ++k) r->final_pass_[k] = false;
  r->buckets_.resize(static_cast<std::size_t>(num_stages));
  r->allreduce_events_.assign(static_cast<std::size_t>(num_stages), {nullptr, nullptr});
  r->next_across_.assign(static_cast<std::size_t>(num_stages), 0);
  r->hook_target_->reducer = r.get();
  for (int s = 0; s < num_stages; ++s) {
    if (layout.stage_replicas[s] < 2 || placement.local_replicas[s].empty()) continue;
    std::vector<std::string> last_first(layout.stage_parameters[s].rbegin(), layout.stage_parameters[s].rend());
    for (auto& names : r->make_buckets(last_first)) r->buckets_[s].push_back({std::move(names)});
    for (int b = 0; b < static_cast<int>(r->buckets_[s].size()); ++b) {
      for (const auto& name : r->buckets_[s][b].names) {
        for (int i : placement.local_replicas[s]) {
          const at::Tensor& t = *r->tensors_(i, name);
          // Chained in front of any hook already there (the user's, another pipeline's).
          auto& slot = torch::autograd::impl::post_acc_grad_hooks(t);
          auto hook = std::make_unique<Accumulated>(r->hook_target_, s, b, i, std::move(slot));
          r->installed_.emplace_back(t, hook.get());
          slot = std::move(hook);
        }
      }
    }
  }
  return r;
}

GradientReducer::~GradientReducer() {
  {
    std::lock_guard<std::mutex> lock(hook_target_->mu);
    hook_target_->reducer = nullptr;
  }
  for (auto it = installed_.rbegin(); it != installed_.rend(); ++it) {
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(it->first);
    if (slot.get() == it->second) {
      auto previous = std::move(it->second->previous);
      slot = std::move(previous);
    }
  }
}

std::vector<std::vector<std::string>> GradientReducer::make_buckets(const std::vector<std::string>& names) const {
  std::vector<std::vector<std::string>> out;  // consecutive parameters of one dtype, at most bucket_bytes each
  std::int64_t bytes = 0;
  at::ScalarType dtype = at::ScalarType::Undefined;
  for (const auto& name : names) {
    const at::Tensor* t = tensors_(0, name);
    if (out.empty() || t->scalar_type() != dtype || bytes >= bucket_bytes_) {
      out.emplace_back();
      bytes = 0;
      dtype = t->scalar_type();
    }
    out.back().push_back(name);
    bytes += numel_of(name) * static_cast<std::int64_t>(t->element_size());
  }
  return out;
}

// Elements of `name` by its declared shape, whether held here or not (a tensor released
// under the plan this pipeline replaced is still empty until it is handed over). Every
// process counts the same, so every process cuts the same buckets and their sums across
// processes agree.
std::int64_t GradientReducer::numel_of(const std::string& name) const {
  if (const auto* sizes = declared_ ? declared_(name) : nullptr) {
    std::int64_t n = 1;
    for (std::int64_t d : *sizes) n *= d;
    return n;
  }
  return tensors_(0, name)->numel();
}

void GradientReducer::begin_step() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& stage : buckets_) {
    for (auto& b : stage) b = Bucket{std::move(b.names)};
  }
  error_ = Status::ok();
  std::fill(next_across_.begin(), next_across_.end(), 0);
  std::fill(allreduce_events_.begin(), allreduce_events_.end(), std::pair<c10::Event*, c10::Event*>{nullptr, nullptr});
  std::lock_guard<std::mutex> across_lock(across_->mu);
  across_->error = Status::ok();
  across_->times.clear();
}

void GradientReducer::final_pass(int stage, int replica, bool on) {
  final_pass_[static_cast<std::size_t>(stage) * layout_.most_replicas + replica] = on;
}

// A replica's parameter accumulated its gradient (the autograd engine, on the replica's thread).
void GradientReducer::accumulated(int stage, int bucket, int replica) {
  if (!final_pass_[static_cast<std::size_t>(stage) * layout_.most_replicas + replica]) return;  // an earlier microbatch
  std::lock_guard<std::mutex> lock(mu_);
  Bucket& b = buckets_[stage][bucket];
  // With streams, the accumulation was queued on the stream current here (the engine's
  // for this gradient): the reduction waits for it there.
  if (streams_ != nullptr) b.accumulated.push_back(streams_->collective_events(stage).record(current_stream(streams_->device())));
  if (++b.fired < static_cast<int>(b.names.size() * placement_.local_replicas[stage].size()) || b.state != 0) return;
  b.state = 1;
  CommThread::process()->post([this, stage, bucket] { reduce_early(stage, bucket); });
}

void GradientReducer::reduce_early(int stage, int bucket) {
  std::optional<c10::StreamGuard> on_collective;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Bucket& b = buckets_[stage][bucket];
    if (b.state != 1) return;  // the stage's allreduce took it first
    b.state = 2;
    b.early = true;
    if (streams_ != nullptr) {
      wait_all(b.accumulated, streams_->collective(stage));
      on_collective.emplace(streams_->collective(stage));
      b.gpu_start = streams_->collective_events(stage).record(streams_->collective(stage));
    }
  }
  const auto start = std::chrono::steady_clock::now();
  Status s = reduce_bucket(stage, bucket);
  std::lock_guard<std::mutex> lock(mu_);
  Bucket& b = buckets_[stage][bucket];
  b.start = start;
  b.end = std::chrono::steady_clock::now();
  if (streams_ != nullptr) b.gpu_end = streams_->collective_events(stage).record(streams_->collective(stage));
  if (!s.is_ok() && error_.is_ok()) error_ = s;
}

Status GradientReducer::finish_stage(int stage, const std::vector<c10::Event*>& final_done) {
  if (buckets_[stage].empty()) return Status::ok();
  std::optional<c10::StreamGuard> on_collective;
  if (streams_ != nullptr) {
    wait_all(final_done, streams_->collective(stage));
    on_collective.emplace(streams_->collective(stage));
    std::lock_guard<std::mutex> lock(mu_);
    allreduce_events_[stage].first = streams_->collective_events(stage).record(streams_->collective(stage));
  }
  Status result = Status::ok();
  for (int k = 0; k < static_cast<int>(buckets_[stage].size()); ++k) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (buckets_[stage][k].state == 2) continue;
      buckets_[stage][k].state = 2;  // a posted reduction not run yet finds it done
    }
    result = reduce_bucket(stage, k);
    if (!result.is_ok()) break;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (streams_ != nullptr) {
    allreduce_events_[stage].second = streams_->collective_events(stage).record(streams_->collective(stage));
  }
  return result.is_ok() ? error_ : result;
}

// Bucket `b` of `stage`, on the communication thread (the collective stream current, with
// streams): summed over this process's replicas and, where the stage spans processes,
// queued to be summed across them.
Status GradientReducer::reduce_bucket(int stage, int b) {
  Bucket& bucket = buckets_[stage][b];
  const bool across = groups_.across[stage] != nullptr;
  // Summed across processes, the last element counts the replicas with gradients (so that
  // a bucket no process has gradients for stays without).
  CONVEYOR_ASSIGN_OR_RETURN(at::Tensor sum, sum_replicas(bucket.names, placement_.local_replicas[stage],
                                                         local_groups_[stage], /*with_count=*/across));
  if (!across) {
    if (sum.defined()) write_back(bucket.names, sum);
    return Status::ok();
  }
  if (!sum.defined()) {
    std::int64_t numel = 0;
    for (const auto& name : bucket.names) numel += numel_of(name);
    bucket.across = at::zeros({numel + 1}, tensors_(0, bucket.names[0])->options());
  } else {
    bucket.across = std::move(sum);
  }
  issue_across(stage);
  return Status::ok();
}

// On the communication thread: the stage's buckets summed here go to be summed across its
// processes, in bucket order (the same on every process, whatever order backward finished
// them in). Never waits: the sum is stream-ordered after the bucket (the group's stream
// waits for the current one, the collective stream), and completes through its callback.
void GradientReducer::issue_across(int stage) {
  auto& buckets = buckets_[stage];
  while (next_across_[stage] < static_cast<int>(buckets.size()) && buckets[next_across_[stage]].across.defined()) {
    const int index = next_across_[stage]++;
    {
      std::lock_guard<std::mutex> lock(across_->mu);
      ++across_->pending;
    }
    groups_.across[stage]->allreduce_timed(buckets[index].across, [state = across_, stage, index,
                                                                   start = std::chrono::steady_clock::now()](
                                                                      Status s, double waited_s) {
      std::lock_guard<std::mutex> lock(state->mu);
      state->times.push_back({stage, index, start, std::chrono::steady_clock::now(), waited_s});
      if (!s.is_ok() && state->error.is_ok()) state->error = std::move(s);
      --state->pending;
      state->cv.notify_all();
    });
  }
}

bool GradientReducer::across_pending() const {
  std::lock_guard<std::mutex> lock(across_->mu);
  return across_->pending > 0;
}

Status GradientReducer::wait_across() {
  std::unique_lock<std::mutex> lock(across_->mu);
  if (!across_->cv.wait_for(lock, groups_.timeout, [&] { return across_->pending == 0; })) {
    return Status(ErrorCode::kExecution, "process " + std::to_string(placement_.process) +
                                             ": summing the gradients of replicas in other processes did not "
                                             "complete within " + std::to_string(groups_.timeout.count()) +
                                             " ms (a process that hangs, or one out of step)");
  }
  return across_->error.with_context("summing the gradients of replicas in other processes");
}

Status GradientReducer::write_across() {
  std::vector<Bucket*> summed;
  std::vector<at::Tensor> counts;  // read in one copy: the device is done with them
  for (int st = 0; st < layout_.num_stages(); ++st) {
    if (!groups_.across[st]) continue;
    for (Bucket& b : buckets_[st]) {
      if (!b.across.defined()) {
        return Status(ErrorCode::kInternal, "a gradient bucket of stage " + std::to_string(st) + " was never reduced");
      }
      summed.push_back(&b);
      counts.push_back(b.across.narrow(0, b.across.numel() - 1, 1));
    }
  }
  if (summed.empty()) return Status::ok();
  const at::Tensor had = at::cat(counts).to(at::kCPU, at::kDouble);
  for (std::size_t k = 0; k < summed.size(); ++k) {
    Bucket& b = *summed[k];
    if (had[static_cast<std::int64_t>(k)].item<double>() > 0) {
      write_back(b.names, b.across.narrow(0, 0, b.across.numel() - 1), /*as_views=*/true);
    }
    b.across = at::Tensor();
  }
  return Status::ok();
}

// The gradients of `names` summed over `members` as one flat tensor (zeros for a member
// without one), through `group` (member order: the same sums wherever they run); every
// member's gradients but replica 0's are released. Undefined when no member has any. With
// `with_count` each member's flat ends in 1 where it has gradients, else 0.
Result<at::Tensor> GradientReducer::sum_replicas(const std::vector<std::string>& names, const std::vector<int>& members,
                                                 const std::vector<std::shared_ptr<transport::Collective>>& group,
                                                 bool with_count) {
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> flat_per_member;
  bool any = false;
  for (int r : members) {
    std::vector<at::Tensor> flat;
    bool has = false;
    for (const auto& name : names) {
      at::Tensor p = *tensors_(r, name);
      at::Tensor g = p.grad();
      has = has || g.defined();
      flat.push_back(g.defined() ? g.reshape(-1) : at::zeros({p.numel()}, p.options()));
      if (r > 0 && g.defined()) {
        if (streams_ != nullptr) used_on(g, current_stream(streams_->device()));  // the collective stream
        p.mutable_grad().reset();
      }
    }
    any = any || has;
    // One cat with the count, not a second copy of the sum to append it.
    if (with_count) flat.push_back(at::full({1}, has ? 1 : 0, tensors_(r, names[0])->options()));
    flat_per_member.push_back(at::cat(flat));
  }
  if (!any) return at::Tensor();
  if (members.size() < 2) return flat_per_member[0];
  // Every member's part of the reduction (inproc completes it inline on the last call).
  struct Pending {
    std::mutex mu;
    int left = 0;
    Status first = Status::ok();
    std::promise<void> all;
  };
  auto pending = std::make_shared<Pending>();
  pending->left = static_cast<int>(members.size());
  for (std::size_t k = 0; k < members.size(); ++k) {
    group[k]->reduce(flat_per_member[k], /*root=*/0, [pending](Status s) {
      std::lock_guard<std::mutex> lock(pending->mu);
      if (!s.is_ok() && pending->first.is_ok()) pending->first = std::move(s);
      if (--pending->left == 0) pending->all.set_value();
    });
  }
  pending->all.get_future().wait();
  CONVEYOR_RETURN_IF_ERROR(pending->first);
  return flat_per_member[0];
}

// A flat sum of `names`' gradients becomes replica 0's (the user's) `.grad` (not for
// tensors released here): copied into it, or, `as_views`, each `.grad` a view of `flat`
// (a buffer of this step's alone, as DDP's gradient_as_bucket_view: a step-sized copy less).
void GradientReducer::write_back(const std::vector<std::string>& names, const at::Tensor& flat, bool as_views) {
  c10::NoGradGuard no_grad;
  std::int64_t offset = 0;
  for (const auto& name : names) {
    at::Tensor p = *tensors_(0, name);
    at::Tensor part = flat.narrow(0, offset, p.numel()).view(p.sizes());
    offset += p.numel();
    if (released_ && released_(name) != nullptr) continue;
    if (as_views && part.scalar_type() == p.scalar_type() && part.device() == p.device()) {
      p.mutable_grad() = part;
    } else if (p.grad().defined()) {
      p.mutable_grad().copy_(part);
    } else {
      p.mutable_grad() = part.clone();
    }
  }
}

Status GradientReducer::reduce_tied() {
  if (layout_.most_replicas > 1) {
    std::vector<int> every(static_cast<std::size_t>(layout_.most_replicas));
    for (int r = 0; r < layout_.most_replicas; ++r) every[r] = r;  // those not run here have no gradients
    for (const auto& bucket : make_buckets(layout_.shared_parameters)) {
      CONVEYOR_ASSIGN_OR_RETURN(at::Tensor sum, sum_replicas(bucket, every, tied_group_));
      if (sum.defined()) write_back(bucket, sum);
    }
  }
  if (groups_.processes == nullptr) return Status::ok();
  // Read by stages in several processes: summed across them (one that does not read a
  // parameter adds zeros), kept where read.
  c10::NoGradGuard no_grad;
  for (const auto& [name, read_here] : placement_.cross_shared) {
    at::Tensor p = *tensors_(0, name);
    const auto* sizes = released_ ? released_(name) : nullptr;  // not read here: its shape, for zeros
    at::Tensor g = sizes ? at::zeros(*sizes, p.options()) : p.grad().defined() ? p.grad().clone() : at::zeros_like(p);
    CONVEYOR_RETURN_IF_ERROR(groups_.processes->wait([&](transport::Done d) { groups_.processes->all().allreduce(g, d); },
                                                     "summing the gradient of '" + name + "' across processes"));
    if (read_here) p.mutable_grad() = g;
  }
  return Status::ok();
}

void GradientReducer::add_spans(std::vector<Span>& spans, std::chrono::steady_clock::time_point start,
                                const std::function<double(const c10::Event*)>& device_time) const {
  auto host = [&](std::chrono::steady_clock::time_point t) { return std::chrono::duration<double>(t - start).count(); };
  std::lock_guard<std::mutex> lock(mu_);
  for (int s = 0; s < static_cast<int>(buckets_.size()); ++s) {
    for (const auto& b : buckets_[s]) {
      if (!b.early) continue;
      const double from = streams_ != nullptr ? device_time(b.gpu_start) : host(b.start);
      const double to = streams_ != nullptr ? device_time(b.gpu_end) : host(b.end);
      for (int r : placement_.local_replicas[s]) {
        spans.push_back({layout_.rank_of(s), Span::Stream::kCollective, Action{ActionKind::kAllReduce, -1, -1, s}, from, to, r});
      }
    }
  }
  // The sums across processes, on the track of this process's first replica of the stage:
  // the wait for the last process to contribute first, where the group tells it apart.
  std::lock_guard<std::mutex> across_lock(across_->mu);
  for (const auto& t : across_->times) {
    const Action sum{ActionKind::kAllReduce, -1, -1, t.stage};
    const int rank = layout_.rank_of(t.stage), replica = placement_.local_replicas[t.stage].front();
    const double from = host(t.start), to = host(t.end);
    const double moving_from = std::min(to, from + std::max(0.0, t.waited_s));
    if (moving_from > from) spans.push_back({rank, Span::Stream::kWaitingForProcesses, sum, from, moving_from, replica});
    spans.push_back({rank, Span::Stream::kAcrossProcesses, sum, moving_from, to, replica});
  }
}

std::pair<c10::Event*, c10::Event*> GradientReducer::allreduce_events(int stage) const {
  std::lock_guard<std::mutex> lock(mu_);
  return allreduce_events_[stage];
}

std::pair<int, int> GradientReducer::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::pair<int, int> out{0, 0};
  for (const auto& stage : buckets_) {
    for (const auto& b : stage) {
      ++out.first;
      if (b.early) ++out.second;
    }
  }
  return out;
}

}  // namespace conveyor::runtime
