#include "transport/ucx.h"

#include <ATen/ATen.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

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
#include <unordered_set>

#include "transport/cuda_memory.h"
#include "transport/message_buffer.h"
#include "transport/peer_liveness.h"
#include "transport/ucx_message.h"
#include "transport/ucx_request.h"

namespace conveyor::transport {

namespace {

constexpr int kRankBits = 16;
constexpr Tag kMaxTag = (Tag{1} << (64 - kRankBits)) - 1;
// The two highest tags carry liveness pings and their answers (silent_peers); callers' tags stay below.
constexpr Tag kPingTag = kMaxTag - 1, kPongTag = kMaxTag;
// A member that closes says so to every peer under this tag (below the pings): over shared
// memory nothing else tells them, and they fail what waits on it at once instead of at the timeout.
constexpr Tag kByeTag = kMaxTag - 2;

ucp_tag_t ucx_tag(Tag tag, int from) { return (tag << kRankBits) | static_cast<ucp_tag_t>(from); }

int sender_of(ucp_tag_t tag) { return static_cast<int>(tag & ((ucp_tag_t{1} << kRankBits) - 1)); }

class UcxMember final : public UcxEndpoint {
 public:
  UcxMember(int rank, int world, std::string noun)
      : rank_(rank), world_(world), noun_(std::move(noun)), eps_(static_cast<std::size_t>(world), nullptr) {}

  Status start(const std::string& net_device) {
    ucp_config_t* config = nullptr;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
    if (s != UCS_OK) return ucx_error("reading the UCX configuration", s);
    // Peers on this host talk through shared memory (sm), watched by pidfd since UCX's
    // shared-memory transports detect no peer failure; others over tcp, whose failure UCX
    // detects. The user's UCX_TLS wins (then every endpoint asks UCX for failure detection);
    // CONVEYOR_UCX_SHM=0 keeps every peer on tcp.
    const char* shm = std::getenv("CONVEYOR_UCX_SHM");
    shared_memory_ = std::getenv("UCX_TLS") == nullptr && !(shm != nullptr && std::string(shm) == "0");
    // With a GPU, UCX's CUDA transports move CUDA tensors from and into device memory
    // (CONVEYOR_UCX_CUDA=0: through the host, as without them).
    const char* cuda = std::getenv("CONVEYOR_UCX_CUDA");
    const bool with_cuda = process_sees_a_gpu() && !(cuda != nullptr && std::string(cuda) == "0");
    const std::string tls = std::string(shared_memory_ ? "sm," : "") + (with_cuda ? "cuda," : "") + "tcp,self";
    if (std::getenv("UCX_TLS") == nullptr) ucp_config_modify(config, "TLS", tls.c_str());
    // A peer that dies is noticed within about a second, even with nothing in flight to it.
    if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) ucp_config_modify(config, "KEEPALIVE_INTERVAL", "1s");
    // Listen only where the job's processes meet; the user's UCX_NET_DEVICES wins.
    if (!net_device.empty() && std::getenv("UCX_NET_DEVICES") == nullptr) {
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
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the progress thread calls UCX after this
    s = ucp_worker_create(context_, &wp, &worker_);
    if (s != UCS_OK) return ucx_error("creating the UCX worker", s);
    s = ucp_worker_get_efd(worker_, &efd_);
    if (s != UCS_OK) return ucx_error("the UCX worker's event descriptor", s);
    ucp_address_t* address = nullptr;
    std::size_t length = 0;
    s = ucp_worker_get_address(worker_, &address, &length);
    if (s != UCS_OK) return ucx_error("the UCX worker's address", s);
    address_.assign(reinterpret_cast<std::uint8_t*>(address), reinterpret_cast<std::uint8_t*>(address) + length);
    ucp_worker_release_address(worker_, address);
    wake_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_ < 0) return Status(ErrorCode::kExecution, "eventfd failed for the UCX progress thread");
    progress_ = std::thread([this] { loop(); });
    return Status::ok();
  }

  ~UcxMember() override {
    if (progress_.joinable()) {
      stop_ = true;
      wake();
      progress_.join();
    }
    if (wake_ >= 0) close(wake_);
    for (const auto& [peer, fd] : watched_) close(fd);
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::vector<std::uint8_t> address() const override { return with_identity(this_process(), address_); }
  bool on_progress_thread() const { return std::this_thread::get_id() == progress_.get_id(); }

  Status connect(int peer, const std::vector<std::uint8_t>& given) override {
    if (Status s = check_peer(peer); !s) return s;
    std::vector<std::uint8_t> address = given;
    const ProcessIdentity who = split_identity(address);
    // A peer on this host: shared memory, and its process watched here (itself when it is
    // this process: members of one process). Else, or with no pidfd: UCX detects failures.
    int watch = -1;
    bool local = shared_memory_ && !who.host.empty() && who.host == this_process().host;
    if (local && who.pid != this_process().pid) {
      watch = watch_process(who.pid);
      local = watch >= 0;
    }
    auto result = std::make_shared<std::promise<Status>>();
    auto future = result->get_future();
    post([this, peer, address, result, local, watch] {
      if (watch >= 0) watched_.emplace_back(peer, watch);
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
      ep.err_mode = local ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t status) {
        auto* self = static_cast<std::pair<UcxMember*, int>*>(arg);
        self->first->fail_now(ucx_error(self->first->lost(self->second), status));
      };
      handler_args_.push_back(std::make_unique<std::pair<UcxMember*, int>>(this, peer));
      ep.err_handler.arg = handler_args_.back().get();
      ucs_status_t s = ucp_ep_create(worker_, &ep, &eps_[peer]);
      result->set_value(s == UCS_OK ? Status::ok() : ucx_error("connecting to member " + std::to_string(peer), s));
    });
    return future.get();
  }

  void send(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) override {
    if (Status s = check_peer(peer); !s) return done(s);
    if (tag >= kByeTag) return done(Status(ErrorCode::kInvalidArgument, "a UCX message tag at or above 2^48 - 3"));
    send_tagged(peer, tag, std::move(tensors), std::move(done));
  }

  std::vector<int> silent_peers(std::chrono::milliseconds within) override {
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
      post([this, peer, answers] {
        receives_.push_back({ucx_tag(kPongTag, peer), std::nullopt, [answers, peer](Result<std::vector<at::Tensor>> r) {
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

  void send_tagged(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) {
    if (Status e = current_error(); !e) return done(e);
    auto message = std::make_shared<OutgoingMessage>(frame_message(tensors, device_memory_));
    post([this, peer, tag, message, done = std::move(done)]() mutable {
      if (Status e = current_error(); !e) return done(e);
      if (!eps_[peer]) return done(Status(ErrorCode::kInvalidArgument, "member " + std::to_string(rank_) +
                                                                          " is not connected to member " + std::to_string(peer)));
      ++in_flight_;
      send_message(eps_[peer], ucx_tag(tag, rank_), message, lost(peer), [this, done = std::move(done)](Status s) {
        --in_flight_;
        done(std::move(s));
      });
    });
  }

  void recv(int peer, Tag tag, Received done) override {
    if (Status s = check_peer(peer); !s) return done(s);
    if (tag >= kByeTag) return done(Status(ErrorCode::kInvalidArgument, "a UCX message tag at or above 2^48 - 3"));
    if (Status e = current_error(); !e) return done(e);
    // CUDA tensors sent from device memory arrive on the caller's current device.
    std::optional<c10::Device> into = device_memory_ ? current_cuda_device() : std::nullopt;
    post([this, peer, tag, into, done = std::move(done)]() mutable {
      if (Status e = current_error(); !e) return done(e);
      receives_.push_back({ucx_tag(tag, peer), into, std::move(done)});
    });
  }

  void close_gracefully() override { graceful_ = true; }

  void abort(Status error) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.is_ok()) error_ = error;
    }
    post([this, error] { fail_now(error); });
  }

 private:
  struct PendingReceive {
    ucp_tag_t tag;
    std::optional<c10::Device> device;  // where parts sent from device memory land
    Received done;
  };

  Status check_peer(int peer) const { return transport::check_peer(rank_, world_, peer); }

  // On the progress thread: answers every ping that arrived (so a process whose main thread is
  // busy still counts as alive; a stopped or hung process answers nothing). True if any came.
  bool answer_pings() {
    bool any = false;
    while (true) {
      ucp_tag_recv_info_t info{};
      const ucp_tag_t mask = ~((ucp_tag_t{1} << kRankBits) - 1);
      ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, ucx_tag(kPingTag, 0), mask, 1, &info);
      if (msg == nullptr) break;
      any = true;
      const int from = sender_of(info.sender_tag);
      receive_probed(msg, info.length, from, info.sender_tag,
                     [this, from](Result<std::vector<at::Tensor>>) { send_tagged(from, kPongTag, {}, [](Status) {}); });
    }
    while (true) {  // a peer that closed: what it sent before stays receivable
      ucp_tag_recv_info_t info{};
      const ucp_tag_t mask = ~((ucp_tag_t{1} << kRankBits) - 1);
      ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, ucx_tag(kByeTag, 0), mask, 1, &info);
      if (msg == nullptr) return any;
      any = true;
      const int from = sender_of(info.sender_tag);
      receive_probed(msg, info.length, from, info.sender_tag, [this, from](Result<std::vector<at::Tensor>>) {
        if (from >= 0 && from < world_) closed_at_[static_cast<std::size_t>(from)] = std::chrono::steady_clock::now();
      });
    }
  }

  // On the progress thread, closing: tells every connected peer (what waits on this member
  // there fails at once), progressing the messages for at most 200 ms.
  void say_goodbye() {
    at::Tensor bye = frame_message({}).header;
    std::vector<ucs_status_ptr_t> sent;
    for (int peer = 0; peer < world_; ++peer) {
      if (peer == rank_ || !eps_[peer]) continue;
      ucp_request_param_t p{};
      ucs_status_ptr_t r = ucp_tag_send_nbx(eps_[peer], bye.data_ptr(), static_cast<std::size_t>(bye.numel()),
                                            ucx_tag(kByeTag, rank_), &p);
      if (UCS_PTR_IS_PTR(r)) sent.push_back(r);
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    for (ucs_status_ptr_t r : sent) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
        ucp_worker_progress(worker_);
      }
      if (ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);
    }
  }

  // On the progress thread: receives the probed message `msg` of `length` bytes from member
  // `from` under `tag`, then the parts its header announces, and hands its tensors, or the
  // error, to `done`.
  void receive_probed(ucp_tag_message_h msg, std::size_t length, int from, ucp_tag_t tag, Received done,
                      const std::optional<c10::Device>& device = std::nullopt) {
    at::Tensor first = message_bytes(length);
    ++in_flight_;
    reading_.insert(tag);  // until the whole message is in, no other receive takes the tag's next one
    post_request(
        [this, first, from, tag, device, done = std::move(done)](ucs_status_t s) mutable {
          --in_flight_;
          auto message = s == UCS_OK ? read_message(first, device) : transfer_error("a UCX receive", lost(from), s);
          if (message.is_ok() && !message->parts.empty()) return receive_parts(std::move(*message), from, tag, std::move(done));
          reading_.erase(tag);
          if (!message.is_ok()) return done(message.status());
          done(std::move(message->tensors));
        },
        [&](const ucp_request_param_t& p) { return ucp_tag_msg_recv_nbx(worker_, first.data_ptr(), length, msg, &p); },
        /*receive=*/true);
  }

  // On the progress thread, as the header is received: receives each part the header
  // announced into its tensor. Until all are in, no other receive matches the tag, so the
  // receives of one (peer, tag) complete in order. Parts still posted when the member fails
  // are cancelled (fail_now) and fail with its error.
  void receive_parts(IncomingMessage message, int from, ucp_tag_t tag, Received done) {
    auto received = std::make_shared<Countdown>(
        message.parts.size(), [this, tag, tensors = std::move(message.tensors), done = std::move(done)](Status s) mutable {
          reading_.erase(tag);
          if (!s.is_ok()) return done(s);
          done(std::move(tensors));
        });
    for (at::Tensor& part : message.parts) {
      ++in_flight_;
      auto posted = std::make_shared<void*>(nullptr);
      *posted = post_request(
          [this, received, part, from, posted](ucs_status_t s) {
            --in_flight_;
            posted_parts_.erase(*posted);
            if (s == UCS_OK) return received->completed(Status::ok());
            Status failed = current_error();  // a cancelled part fails with the member's error
            received->completed(s == UCS_ERR_CANCELED && !failed.is_ok() ? failed
                                                                        : transfer_error("a UCX receive", lost(from), s));
          },
          [&](const ucp_request_param_t& given) {
            ucp_request_param_t p = with_memory_type(given, part);
            return ucp_tag_recv_nbx(worker_, part.data_ptr(), part.nbytes(), tag, ~ucp_tag_t{0}, &p);
          },
          /*receive=*/true);
      if (*posted != nullptr) posted_parts_.insert(*posted);
    }
  }

  Status current_error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  // Queues `work` for the progress thread, waking it only when it sleeps (a write to the
  // eventfd is a system call; the spinning thread takes the work on its next round).
  void post(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      commands_.push_back(std::move(work));
    }
    if (sleeping_.load()) wake();
  }
  void wake() {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = write(wake_, &one, sizeof one);
  }
  // On the progress thread: every pending receive fails with `error`, and later ones too.
  void fail_now(Status error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.is_ok()) error_ = error;
    }
    std::deque<PendingReceive> pending;
    pending.swap(receives_);
    for (auto& r : pending) r.done(error);
    const std::unordered_set<void*> parts = posted_parts_;  // each cancelled completes (and erases itself)
    for (void* r : parts) ucp_request_cancel(worker_, r);
  }

  void loop() {
    while (true) {
      std::deque<std::function<void()>> work;
      {
        std::lock_guard<std::mutex> lock(mu_);
        work.swap(commands_);
      }
      for (auto& w : work) w();
      bool busy = !work.empty();
      while (ucp_worker_progress(worker_) != 0) busy = true;
      busy |= answer_pings();
      // Match pending receives in order: per (peer, tag) messages complete in arrival order.
      for (auto it = receives_.begin(); it != receives_.end();) {
        if (reading_.contains(it->tag)) {
          ++it;
          continue;
        }
        ucp_tag_recv_info_t info{};
        ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, it->tag, ~ucp_tag_t{0}, 1, &info);
        if (msg == nullptr) {
          // Nothing more comes from a peer that closed (after a grace for what it sent just
          // before, which may arrive around its goodbye).
          const int from = sender_of(it->tag);
          const auto closed = closed_at_[static_cast<std::size_t>(from)];
          if (!closed || std::chrono::steady_clock::now() - *closed < kGrace) {
            ++it;
            continue;
          }
          Received done = std::move(it->done);
          it = receives_.erase(it);
          done(Status(ErrorCode::kExecution, lost(from) + " (it closed its endpoint)"));
          busy = true;
          continue;
        }
        busy = true;
        Received done = std::move(it->done);
        const int from = sender_of(it->tag);
        const std::optional<c10::Device> device = it->device;
        it = receives_.erase(it);
        receive_probed(msg, info.length, from, info.sender_tag, std::move(done), device);
      }
      fail_exited();
      if (stop_) break;
      const auto now = std::chrono::steady_clock::now();
      if (busy) {
        last_busy_ = now;
        continue;
      }
      // Just after traffic a reply often follows within microseconds (shared memory raises
      // its wakeup late): keep polling a short while before sleeping.
      if (now - last_busy_ < kSpin) {
        std::this_thread::yield();  // to a thread woken on this core (a waiter polls too: transport.cc)
        continue;
      }
      // A transfer in flight may need progress that raises no event (a send waiting for
      // socket or FIFO space): keep progressing, yielding the core between rounds, and
      // looking at the watched peers every millisecond (one that died holds it forever).
      if (in_flight_ > 0) {
        if (now - last_watch_ > std::chrono::milliseconds(1)) {
          last_watch_ = now;
          wait_for_events(0);
        }
        std::this_thread::yield();
        continue;
      }
      // Idle: sleep until the worker has events, someone queues work or a watched peer ends.
      if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) continue;
      sleeping_ = true;  // before looking at the queue: work posted after this wakes the thread
      bool queued = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        queued = !commands_.empty();
      }
      if (!queued) wait_for_events(receives_.empty() ? 1000 : 10);
      sleeping_ = false;
    }
    // Closing: pending receives failed; endpoints flushed first (what was sent reaches the
    // peers, within 5 s) unless the member failed or was told to go at once.
    const bool flush = graceful_ && current_error().is_ok();
    if (flush) {  // what was queued after the last round (a send just before closing) goes out too
      std::deque<std::function<void()>> work;
      {
        std::lock_guard<std::mutex> lock(mu_);
        work.swap(commands_);
      }
      for (auto& w : work) w();
    }
    if (current_error().is_ok()) say_goodbye();
    fail_now(Status(ErrorCode::kExecution, "the UCX endpoint was closed"));
    std::vector<ucs_status_ptr_t> closing;
    for (ucp_ep_h& ep : eps_) {
      if (!ep) continue;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = flush ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
      if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
      ep = nullptr;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(flush ? 5 : 1);
    for (ucs_status_ptr_t r : closing) {
      while (ucp_request_check_status(r) == UCS_INPROGRESS && std::chrono::steady_clock::now() < deadline) {
        ucp_worker_progress(worker_);
      }
      if (ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);
    }
    drop_unreceived(worker_);
  }

  const int rank_, world_;
  const std::string noun_;  // what a peer is called in errors ("member", "process")
  std::string lost(int peer) const { return noun_ + " " + std::to_string(peer) + " was lost"; }

  // On the progress thread: a peer whose process ended fails everything, once what it sent
  // before it ended has had a grace to be received.
  void fail_exited() {
    for (auto it = exited_.begin(); it != exited_.end();) {
      if (std::chrono::steady_clock::now() - it->second < kGrace) {
        ++it;
        continue;
      }
      fail_now(Status(ErrorCode::kExecution, lost(it->first) + " (its process exited)"));
      it = exited_.erase(it);
    }
  }

  // On the progress thread: polls the worker's events, the wakeup and the watched peers'
  // pidfds for at most `timeout_ms`; a peer whose process ended is noted (fail_exited).
  void wait_for_events(int timeout_ms) {
    if (!exited_.empty()) timeout_ms = std::min(timeout_ms, 20);
    std::vector<pollfd> fds{{efd_, POLLIN, 0}, {wake_, POLLIN, 0}};
    for (const auto& [peer, fd] : watched_) fds.push_back({fd, POLLIN, 0});
    poll(fds.data(), fds.size(), timeout_ms);
    if (fds[1].revents & POLLIN) {
      std::uint64_t drained;
      [[maybe_unused]] auto n = read(wake_, &drained, sizeof drained);
    }
    std::vector<std::pair<int, int>> alive;
    for (std::size_t k = 0; k < watched_.size(); ++k) {
      if (fds[2 + k].revents == 0) {
        alive.push_back(watched_[k]);
        continue;
      }
      close(watched_[k].second);
      exited_.emplace_back(watched_[k].first, std::chrono::steady_clock::now());
      closed_at_[static_cast<std::size_t>(watched_[k].first)] = exited_.back().second;
    }
    watched_.swap(alive);
  }
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1, wake_ = -1;
  std::vector<std::uint8_t> address_;
  std::vector<ucp_ep_h> eps_;  // progress thread only
  std::vector<std::unique_ptr<std::pair<UcxMember*, int>>> handler_args_;
  std::deque<PendingReceive> receives_;  // progress thread only
  int in_flight_ = 0;                    // UCX requests not completed (progress thread only)
  std::unordered_set<void*> posted_parts_;  // receives of message parts in flight (progress thread only)
  std::unordered_set<ucp_tag_t> reading_;  // tags with a message being received (progress thread only)
  std::thread progress_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};  // the progress thread is (about to be) in poll: post wakes it
  bool shared_memory_ = false;  // peers on this host over shared memory (start)
  bool device_memory_ = false;  // CUDA tensors travel from and into device memory (start)
  // When each peer said goodbye (progress thread only).
  std::vector<std::optional<std::chrono::steady_clock::time_point>> closed_at_ =
      std::vector<std::optional<std::chrono::steady_clock::time_point>>(static_cast<std::size_t>(world_));
  std::vector<std::pair<int, int>> watched_;  // (peer, pidfd) of same-host peers (progress thread only)
  static constexpr auto kSpin = std::chrono::microseconds(50);
  // What a peer that closed or exited sent just before has this long to be received.
  static constexpr auto kGrace = std::chrono::milliseconds(500);
  std::vector<std::pair<int, std::chrono::steady_clock::time_point>> exited_;  // (peer, when), progress thread
  std::chrono::steady_clock::time_point last_busy_{}, last_watch_{};  // progress thread only
  std::atomic<bool> graceful_{false};  // flush the endpoints when closing
  std::mutex mu_;
  std::deque<std::function<void()>> commands_;
  Status error_ = Status::ok();
};

}  // namespace

Result<std::shared_ptr<UcxEndpoint>> make_ucx_endpoint(int rank, int world_size, std::string noun,
                                                       std::string net_device) {
  if (world_size < 1 || world_size > (1 << kRankBits) || rank < 0 || rank >= world_size) {
    return Status(ErrorCode::kInvalidArgument, "member " + std::to_string(rank) + " of a world of " +
                                                   std::to_string(world_size) + " (at most 65536 members)");
  }
  // A completion callback may drop the last reference on the progress thread, which cannot
  // join itself: the member is then destroyed by a thread of its own once the callback returns.
  std::shared_ptr<UcxMember> member(new UcxMember(rank, world_size, std::move(noun)), [](UcxMember* m) {
    if (m->on_progress_thread()) {
      std::thread([m] { delete m; }).detach();
    } else {
      delete m;
    }
  });
  CONVEYOR_RETURN_IF_ERROR(member->start(net_device));
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
