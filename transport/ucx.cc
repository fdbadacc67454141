#include "transport/ucx.h"

#include <ATen/ATen.h>
#include <poll.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "common/env.h"
#include "transport/cuda_memory.h"
#include "transport/message_buffer.h"
#include "transport/peer_liveness.h"
#include "transport/ucx_member.h"
#include "transport/ucx_message.h"
#include "transport/ucx_request.h"

namespace conveyor::transport {

namespace {

// Small messages a caller's thread sends itself, when the worker is free: a hop to the
// progress thread and back is most of a small message's latency.
constexpr std::size_t kSentByCallerUpTo = std::size_t{16} << 10;

// Every member of this process, for its exit. A member whose last reference goes on its own
// progress thread (a completion callback held it), which cannot join itself, is destroyed on a
// thread of its own. At exit every member still alive is closed (its progress thread stopped:
// its last act closes it) and every such thread joined, before torch's operators are torn
// down: this is made at the first member, after torch's own statics, so it is destroyed before
// them. Members kept alive (a pending receive's callback holding its group) ran on through
// exit, and a close or a goodbye that reached torch's torn-down operators (a goodbye allocates
// a tensor) aborted the conformance test after every test had passed (2 runs in 12 under load).
class LiveMembers {
 public:
  static LiveMembers& instance() {
    static LiveMembers members;
    return members;
  }

  void add(const std::shared_ptr<UcxMember>& member) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(members_, [](const std::weak_ptr<UcxMember>& m) { return m.expired(); });
    members_.push_back(member);
  }

  void destroy_off_its_thread(UcxMember* member) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::erase_if(closing_, [](Closing& c) {
      if (!c.finished->load()) return false;
      c.thread.join();
      return true;
    });
    auto finished = std::make_shared<std::atomic<bool>>(false);
    closing_.push_back({std::thread([member, finished] {
                          delete member;
                          finished->store(true);
                        }),
                        finished});
  }

  ~LiveMembers() {
    std::vector<std::weak_ptr<UcxMember>> members;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      members.swap(members_);
    }
    for (auto& weak : members) {
      if (std::shared_ptr<UcxMember> member = weak.lock()) member->stop_progress();  // each within its flush's 5 s
    }
    while (true) {  // closing may drop further members off their threads
      std::vector<Closing> closing;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        closing.swap(closing_);
      }
      if (closing.empty()) break;
      for (Closing& c : closing) c.thread.join();
    }
  }

 private:
  struct Closing {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> finished;
  };

  std::mutex mutex_;
  std::vector<std::weak_ptr<UcxMember>> members_;
  std::vector<Closing> closing_;
};

}  // namespace

Status UcxMember::start(const std::string& net_device) {
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return ucx_error("reading the UCX configuration", s);
  // Peers on this host talk through shared memory (sm), watched by pidfd since UCX's
  // shared-memory transports detect no peer failure; others over tcp, whose failure UCX
  // detects. The user's UCX_TLS wins (then every endpoint asks UCX for failure detection);
  // CONVEYOR_UCX_SHM=0 keeps every peer on tcp.
  const bool user_transports = env::ucx_setting_given("TLS");
  shared_memory_ = !user_transports && env::ucx_shared_memory_allowed();
  // With a GPU, UCX's CUDA transports move CUDA tensors from and into device memory
  // (CONVEYOR_UCX_CUDA=0: through the host, as without them).
  const bool with_cuda = process_sees_a_gpu() && env::ucx_cuda_allowed();
  const std::string tls = std::string(shared_memory_ ? "sm," : "") + (with_cuda ? "cuda," : "") + "tcp,self";
  if (!user_transports) ucp_config_modify(config, "TLS", tls.c_str());
  // A peer that dies is noticed within about a second, even with nothing in flight to it.
  if (!env::ucx_setting_given("KEEPALIVE_INTERVAL")) ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
  // Listen only where the job's processes meet; the user's UCX_NET_DEVICES wins.
  if (!net_device.empty() && !env::ucx_setting_given("NET_DEVICES")) {
    ucp_config_modify(config, "NET_DEVICES", net_device.c_str());
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  s = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (s != UCS_OK) return ucx_error("starting UCX", s);
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  device_memory_ = with_cuda && ucp_context_query(context_, &attr) == UCS_OK &&
                   (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Calls into the worker are serialized by the progress thread's worker lock (UcxProgress):
  // the progress thread's, and a caller's sending a small message itself.
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  s = ucp_worker_create(context_, &wp, &worker_);
  if (s != UCS_OK) return ucx_error("creating the UCX worker", s);
  int efd = -1;
  s = ucp_worker_get_efd(worker_, &efd);
  if (s != UCS_OK) return ucx_error("the UCX worker's event descriptor", s);
  ucp_address_t* address = nullptr;
  std::size_t length = 0;
  s = ucp_worker_get_address(worker_, &address, &length);
  if (s != UCS_OK) return ucx_error("the UCX worker's address", s);
  address_.assign(reinterpret_cast<std::uint8_t*>(address), reinterpret_cast<std::uint8_t*>(address) + length);
  ucp_worker_release_address(worker_, address);
  if (shared_memory_ && region_capacity() > 0) {  // without one (no memfd), everything goes through UCX
    if (auto made = OutboundRegion::create(region_capacity()); made.is_ok()) region_ = std::move(*made);
  }
  return progress_.start(efd);
}

UcxMember::~UcxMember() {
  progress_.stop();  // the progress thread's last act closes the member (close)
  if (worker_) ucp_worker_destroy(worker_);
  if (context_) ucp_cleanup(context_);
}

Status UcxMember::connect(int peer, const std::vector<std::uint8_t>& given) {
  if (Status s = check_peer(peer); !s) return s;
  std::vector<std::uint8_t> address = given;
  const ProcessIdentity who = split_identity(address);
  const std::optional<RegionName> their_region = split_region(address);
  // A peer on this host: shared memory, and its process watched here (itself when it is
  // this process: members of one process). Else, or with no pidfd: UCX detects failures.
  int watch = -1;
  bool local = shared_memory_ && !who.host.empty() && who.host == this_process().host;
  if (local && who.pid != this_process().pid) {
    watch = watch_process(who.pid);
    local = watch >= 0;
  }
  // Its region mapped here: what it writes there is read here, and (the same permissions
  // both ways) what this member writes in its own is read there.
  std::shared_ptr<InboundRegion> inbound;
  if (local && their_region) {
    if (auto opened = InboundRegion::open(who.pid, *their_region); opened.is_ok()) inbound = *opened;
  }
  region_to_[static_cast<std::size_t>(peer)] = inbound != nullptr && region_ != nullptr;
  auto result = std::make_shared<std::promise<Status>>();
  auto future = result->get_future();
  progress_.post([this, peer, address, result, local, watch, inbound] {
    if (watch >= 0) peers_.watch(peer, watch);
    inbound_[static_cast<std::size_t>(peer)] = inbound;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ep.err_mode = local ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
      auto* self = static_cast<std::pair<UcxMember*, int>*>(arg);
      self->first->fail_now(ucx_error(self->first->peers_.lost(self->second), status));
    };
    handler_args_.push_back(std::make_unique<std::pair<UcxMember*, int>>(this, peer));
    ep.err_handler.arg = handler_args_.back().get();
    ucs_status_t s = ucp_ep_create(worker_, &ep, &eps_[peer]);
    result->set_value(s == UCS_OK ? Status::ok() : ucx_error("connecting to member " + std::to_string(peer), s));
  });
  return future.get();
}

void UcxMember::send(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) {
  send_checked(peer, tag, std::move(tensors), std::move(done), /*copied=*/false);
}

void UcxMember::send_copied(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) {
  send_checked(peer, tag, std::move(tensors), std::move(done), /*copied=*/true);
}

void UcxMember::send_checked(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done, bool copied) {
  if (Status s = check_peer(peer); !s) return done(s);
  if (tag >= kLeavingTag) return done(Status(ErrorCode::kInvalidArgument, "a UCX message tag at or above 2^48 - 4"));
  send_tagged(peer, tag, std::move(tensors), std::move(done), copied);
}

void UcxMember::recv(int peer, Tag tag, Received done) {
  if (Status s = check_peer(peer); !s) return done(s);
  if (tag >= kLeavingTag) return done(Status(ErrorCode::kInvalidArgument, "a UCX message tag at or above 2^48 - 4"));
  if (Status e = current_error(); !e) return done(e);
  // CUDA tensors sent from device memory arrive on the caller's current device.
  std::optional<c10::Device> into = device_memory_ ? current_cuda_device() : std::nullopt;
  // Asked for directly when the worker is free and nothing is queued before it (receives
  // under a tag are matched in the order asked), and matched at once: a message already in
  // completes here, on the caller, with no thread woken. A sleeping progress thread is woken
  // while anything stays pending: the message may have come in during this round, whose
  // arrival then raises no event.
  const std::thread::id owner = std::this_thread::get_id();
  bool pending = true;  // read by with_worker_on_caller once the body ran
  const bool asked = progress_.with_worker_on_caller([&] {
    if (!progress_.nothing_queued()) return false;
    ask_receive(ucx_tag(tag, peer), into, owner, std::move(done));
    progress_.round();
    pending = !receives_.empty() || in_flight() > 0;
    return true;
  }, /*then_wake=*/pending);
  if (asked) return;
  progress_.post([this, peer, tag, into, owner, done = std::move(done)]() mutable {
    ask_receive(ucx_tag(tag, peer), into, owner, std::move(done));
  });
}

void UcxMember::leave() {
  if (!peers_.leaving()) return;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_) send_tagged(peer, kLeavingTag, {}, [](Status) {});
  }
}

bool UcxMember::progress_here() {
  // A progress thread asleep since before is woken (once: then it yields to this waiter):
  // this thread's calls may leave the worker disarmed, and what it starts may need progress
  // once it stops waiting.
  return progress_.with_worker_on_caller([this] {
    progress_.round();
    progress_.helped();  // here: a completion this thread runs after may drop the member
    return true;
  }, /*then_wake=*/true);
}

void UcxMember::abort(Status error) {
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.is_ok()) error_ = error;
  }
  progress_.post([this, error] {
    say_goodbye(error.message());  // the peers learn at once, and why, rather than when this process goes
    fail_now(error);
  });
}

std::vector<int> UcxMember::silent_peers(std::chrono::milliseconds within) {
  struct Answers {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<bool> answered;
    int count = 0;
  };
  auto answers = std::make_shared<Answers>();
  answers->answered.assign(static_cast<std::size_t>(world_), false);
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    progress_.post([this, peer, answers] {
      receives_.push_back({ucx_tag(kPongTag, peer), std::nullopt, std::thread::id{}, [answers, peer](Result<std::vector<at::Tensor>> r) {
                             std::lock_guard<std::mutex> lock(answers->mu);
                             if (!r.is_ok() || answers->answered[peer]) return;
                             answers->answered[peer] = true;
                             ++answers->count;
                             answers->cv.notify_all();
                           }});
    });
    send_tagged(peer, kPingTag, {}, [](Status) {});
  }
  std::unique_lock<std::mutex> lock(answers->mu);
  answers->cv.wait_for(lock, within, [&] { return answers->count == world_ - 1; });
  std::vector<int> silent;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_ && !answers->answered[peer]) silent.push_back(peer);
  }
  return silent;
}

void UcxMember::send_tagged(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done, bool copied) {
  if (Status e = current_error(); !e) return done(e);
  std::shared_ptr<OutgoingMessage> message;
  std::optional<at::Tensor> notice = written_to_region(peer, tensors);  // a copy
  if (notice) {
    message = std::make_shared<OutgoingMessage>(OutgoingMessage{std::move(*notice), {}});
  } else {
    message = std::make_shared<OutgoingMessage>(frame_message(tensors, device_memory_, copied));
  }
  if (sent_by_caller(peer, tag, message, done, /*reply_likely=*/!notice)) return;
  progress_.post([this, peer, tag, message, owner = std::this_thread::get_id(), done = std::move(done)]() mutable {
    issue_send(peer, tag, message, owner, std::move(done));
  });
}

std::optional<at::Tensor> UcxMember::written_to_region(int peer, const std::vector<at::Tensor>& tensors) {
  // The copy runs on the caller's thread, where the tensors were just made (in its caches),
  // while the progress thread moves other messages.
  if (!region_to_[static_cast<std::size_t>(peer)]) return std::nullopt;
  std::size_t data = 0;  // a small message (most) leaves here before its header is built
  for (const auto& t : tensors) data += t.defined() ? t.nbytes() : 0;
  if (data < kPartsFrom) return std::nullopt;
  const std::optional<std::size_t> bytes = packed_size(tensors);
  if (!bytes) return std::nullopt;
  const std::optional<RegionSlot> slot = region_->allocate(peer, *bytes);
  if (!slot) return std::nullopt;
  pack_into(tensors, slot->data);
  return region_notice(slot->offset, *bytes);
}

void UcxMember::issue_send(int peer, Tag tag, const std::shared_ptr<OutgoingMessage>& message, std::thread::id owner,
                           Done done) {
  auto finish = [owner](Done done, Status s) { complete(owner, [done = std::move(done), s] { done(s); }); };
  if (Status e = current_error(); !e) return finish(std::move(done), e);
  if (!eps_[peer]) {
    return finish(std::move(done), Status(ErrorCode::kInvalidArgument, "member " + std::to_string(rank_) +
                                                                         " is not connected to member " +
                                                                         std::to_string(peer)));
  }
  const std::uint64_t number = sends_.posted(peer, owner, std::move(done));
  send_message(eps_[peer], ucx_tag(tag, rank_), message, peers_.lost(peer), [this, number](Status s) {
    std::optional<UcxSendsInFlight::Finish> send = sends_.completed(number);
    if (!send) return;  // failed already (fail_sends): its peer was lost
    if (!s) {  // failed by the member's failure (its peer lost): that says why
      if (Status e = current_error(); !e) s = e;
    }
    complete(send->owner, [done = std::move(send->done), s = std::move(s)] { done(s); });
  });
}

bool UcxMember::sent_by_caller(int peer, Tag tag, const std::shared_ptr<OutgoingMessage>& message, Done& done,
                               bool reply_likely) {
  if (message->gathered || !message->parts.empty() ||
      static_cast<std::size_t>(message->header.nbytes()) > kSentByCallerUpTo) {
    return false;
  }
  return progress_.with_worker_on_caller([&] {
    if (!progress_.nothing_queued()) return false;  // queued earlier, it goes first
    issue_send(peer, tag, message, std::this_thread::get_id(), std::move(done));
    // A small message's reply often follows: the progress thread is woken to poll for it
    // instead of sleeping. Not for a large message's notice, unless UCX left its send in
    // flight: in a stream of them, a thread woken for each took the core its sender copies
    // the next one on.
    if (reply_likely) {
      progress_.poke();
    } else if (in_flight() > 0) {
      progress_.wake_if_sleeping();
    }
    return true;
  }, /*then_wake=*/reply_likely);
}

Status UcxMember::current_error() {
  std::lock_guard<std::mutex> lock(error_mu_);
  return error_;
}

void UcxMember::fail_now(Status error) {
  // Every pending receive fails with `error`, and later ones too.
  {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (error_.is_ok()) error_ = error;
  }
  fail_receives(error);
}

bool UcxMember::work() {
  bool busy = false;
  while (ucp_worker_progress(worker_) != 0) busy = true;
  busy |= answer_pings();
  busy |= match_receives();
  return busy;
}

void UcxMember::after_round() {
  // A peer whose process ended fails everything, once what it sent before it ended has had
  // a grace to be received. A send still in flight to it (a rendezvous waiting for the dead
  // process to read it) is finished here with the error, since UCX never completes it (its
  // shared-memory transports have no error handling, and a forced close of the endpoint
  // leaves it in flight too; over tcp UCX fails such sends itself), so whoever waits for it
  // (a step, SendsInFlight::wait) learns of the loss instead of waiting out its timeout.
  for (int peer : peers_.ended_past_grace()) {
    const Status error(ErrorCode::kExecution, peers_.lost(peer, "(its process exited)"));
    fail_now(error);
    fail_sends(peer, error);
  }
}

std::optional<int> UcxMember::may_sleep() {
  // At most a millisecond while a transfer is in flight, since one waiting for FIFO or
  // socket space raises no event; 10 ms while a receive waits for its message (a receive
  // being read has a request in flight).
  if (answer_pings(/*before_sleep=*/true) || ucp_worker_arm(worker_) == UCS_ERR_BUSY) return std::nullopt;
  return in_flight() > 0 ? 1 : receives_.empty() ? 1000 : 10;
}

void UcxMember::wait(std::vector<pollfd>& fds, int timeout_ms) {
  peers_.wait(fds, timeout_ms);  // a peer whose process ended counts as closed (then after_round)
}

void UcxMember::close() {
  // Pending receives fail; endpoints are flushed first (what was sent reaches the peers,
  // within 5 s) unless the member failed or was told to go at once.
  const bool flush = graceful_ && current_error().is_ok();
  if (flush) progress_.run_queued();  // what was queued after the last round (a send just before closing) goes out too
  if (current_error().is_ok()) say_goodbye();
  const Status closed(ErrorCode::kExecution, "the UCX endpoint was closed");
  fail_now(closed);
  close_endpoints(worker_, eps_, flush);
  fail_sends(-1, closed);  // what the flush did not see through (a peer that never read it)
  drop_unreceived(worker_);
}

void UcxMember::fail_sends(int peer, const Status& error) {
  for (UcxSendsInFlight::Finish& send : sends_.fail(peer)) {
    complete(send.owner, [done = std::move(send.done), error] { done(error); });
  }
}

Result<std::shared_ptr<UcxEndpoint>> make_ucx_endpoint(int rank, int world_size, std::string noun,
                                                       std::string net_device) {
  if (world_size < 1 || world_size > (1 << kRankBits) || rank < 0 || rank >= world_size) {
    return Status(ErrorCode::kInvalidArgument, "member " + std::to_string(rank) + " of a world of " +
                                                   std::to_string(world_size) + " (at most 65536 members)");
  }
  LiveMembers& live = LiveMembers::instance();
  std::shared_ptr<UcxMember> member(new UcxMember(rank, world_size, std::move(noun)), [&live](UcxMember* m) {
    if (m->on_progress_thread()) {
      live.destroy_off_its_thread(m);
    } else {
      delete m;
    }
  });
  CONVEYOR_RETURN_IF_ERROR(member->start(net_device));
  live.add(member);
  return std::shared_ptr<UcxEndpoint>(member);
}

Result<std::vector<std::shared_ptr<Endpoint>>> make_ucx_world_in_process(int n) {
  std::vector<std::shared_ptr<UcxEndpoint>> members;
  for (int r = 0; r < n; ++r) {
    CONVEYOR_ASSIGN_OR_RETURN(auto m, make_ucx_endpoint(r, n));
    members.push_back(std::move(m));
  }
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      if (a != b) CONVEYOR_RETURN_IF_ERROR(members[a]->connect(b, members[b]->address()));
    }
  }
  return std::vector<std::shared_ptr<Endpoint>>(members.begin(), members.end());
}

}  // namespace conveyor::transport
