// The UCX endpoint's member (transport/ucx.h), shared by the two files that implement it:
// ucx.cc (starting, connecting, sending, the progress thread's rounds and closing) and
// ucx_receive.cc (matching receives to the messages that arrived, pings and goodbyes).
//
// Threads. Calls into the worker are serialized by worker_mu_. The progress thread holds it
// for each of its rounds. A caller's thread takes it only when it is free (try_lock) and
// briefly: to send a small message itself (sent_by_caller), to ask for a receive itself
// (recv), and while it waits, to run rounds itself (progress_here). While a caller's thread holds
// it, completions go through complete(): those of operations that thread issued run on it
// once it lets go of the worker; the others are queued for the progress thread. So no
// callback runs under worker_mu_ on a caller's thread, and no callback runs on a caller's
// thread that did not issue its operation.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "transport/message_buffer.h"
#include "transport/peer_liveness.h"
#include "transport/shared_region.h"
#include "transport/ucx.h"

namespace conveyor::transport {

inline constexpr int kRankBits = 16;
inline constexpr Tag kMaxTag = (Tag{1} << (64 - kRankBits)) - 1;
// The two highest tags carry liveness pings and their answers (silent_peers); callers' tags stay below.
inline constexpr Tag kPingTag = kMaxTag - 1, kPongTag = kMaxTag;
// A member that closes says so to every peer under this tag (below the pings): over shared
// memory nothing else tells them, and they fail what waits on it at once instead of at the timeout.
inline constexpr Tag kByeTag = kMaxTag - 2;
// A member that leaves (UcxEndpoint::leave) says so under this tag: it sends nothing more but
// collectives. Callers' tags stay below it.
inline constexpr Tag kLeavingTag = kMaxTag - 3;

inline ucp_tag_t ucx_tag(Tag tag, int from) { return (tag << kRankBits) | static_cast<ucp_tag_t>(from); }
inline std::int64_t now_ns() {  // steady clock
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline int sender_of(ucp_tag_t tag) { return static_cast<int>(tag & ((ucp_tag_t{1} << kRankBits) - 1)); }

/// One member of a UCX world: its context, worker, progress thread and peers.
class UcxMember final : public UcxEndpoint {
 public:
  UcxMember(int rank, int world, std::string noun)
      : rank_(rank), world_(world), noun_(std::move(noun)), eps_(static_cast<std::size_t>(world), nullptr) {}
  ~UcxMember() override;
  /// Creates the context and worker (transports as ucx.h says) and starts the progress thread.
  Status start(const std::string& net_device);

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::vector<std::uint8_t> address() const override {
    return with_identity(this_process(), with_region(region_ ? std::optional(region_->name()) : std::nullopt, address_));
  }
  bool on_progress_thread() const { return std::this_thread::get_id() == progress_.get_id(); }
  Status connect(int peer, const std::vector<std::uint8_t>& given) override;
  void send(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) override;
  void send_copied(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done) override;
  void recv(int peer, Tag tag, Received done) override;
  bool progress_here() override;
  std::vector<int> silent_peers(std::chrono::milliseconds within) override;
  void close_gracefully() override { graceful_ = true; }
  void leave() override;
  void abort(Status error) override;

 private:
  struct PendingReceive {
    ucp_tag_t tag;
    std::optional<c10::Device> device;  // where parts sent from device memory land
    std::thread::id owner;              // the thread that asked (complete)
    Received done;
  };
  /// Completions met by a caller's thread while it held the worker (complete).
  struct HeldCompletions {
    std::vector<std::function<void()>> mine, others;
  };

  Status check_peer(int peer) const { return transport::check_peer(rank_, world_, peer); }
  // "process 2 was lost" and `how` ("(its process exited)"); or, when the peer said in its
  // goodbye why it gave the job up, "process 2 gave up the job: " and why.
  std::string lost(int peer, const std::string& how = "") const;
  Status current_error();

  // Runs `completion`, of an operation thread `owner` issued: at once, unless this is a
  // caller's thread holding the worker; then once it lets go, on it if it is `owner`, else
  // on the progress thread.
  static void complete(std::thread::id owner, std::function<void()> completion);
  // Runs `body` on the calling thread holding the worker, if the worker is free and this
  // thread holds no worker already; then the completions met, as complete() says. False when
  // it did not run, or `body` said false. `then_wake`, read once `body` ran (it may set it):
  // the progress thread is woken if it sleeps (what `body` issued needs it). Nothing may
  // touch the member after this returns: the last completion may have dropped it. A
  // template: it runs on every small send and receive.
  template <class Body>
  bool with_worker_on_caller(Body&& body, const bool& then_wake) {
    if (held_ != nullptr || on_progress_thread()) return false;
    std::unique_lock<std::mutex> worker(worker_mu_, std::try_to_lock);
    if (!worker.owns_lock()) return false;
    HeldCompletions held;
    held_ = &held;
    const bool did = body();
    held_ = nullptr;
    worker.unlock();
    let_go_on_caller(held, did && then_wake);
    return did;
  }
  // After a caller's thread let go of the worker: wakes the progress thread if asked and it
  // sleeps, hands it the others' completions and runs this thread's.
  void let_go_on_caller(HeldCompletions& held, bool wake_a_sleeper);
  bool nothing_queued();  // no work queued for the worker (what a caller's own call would overtake)

  // ucx.cc: sending, and the progress thread.
  // A user's send (send, send_copied): its peer and tag checked, then send_tagged.
  void send_checked(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done, bool copied);
  // `copied`: the caller may write the tensors once this returns (frame_message's `copied`).
  void send_tagged(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done, bool copied = false);
  void issue_send(int peer, Tag tag, const std::shared_ptr<OutgoingMessage>& message, std::thread::id owner, Done done);
  bool sent_by_caller(int peer, Tag tag, const std::shared_ptr<OutgoingMessage>& message, Done& done, bool reply_likely);
  // `tensors` written into this member's region for `peer` (shared_region.h), as the notice
  // to send in their place; nothing when they go through UCX.
  std::optional<at::Tensor> written_to_region(int peer, const std::vector<at::Tensor>& tensors);
  void post(std::function<void()> work);
  void wake();
  bool round();
  void loop();
  void close_on_progress_thread();
  void fail_now(Status error);
  void fail_exited();
  void wait_for_events(int timeout_ms);

  // ucx_receive.cc: receiving (holding the worker).
  void ask_receive(ucp_tag_t tag, const std::optional<c10::Device>& into, std::thread::id owner, Received done);
  bool match_receives();
  // Why a pending receive of `tag` will never be met (its sender closed, or left and the
  // tag is not a collective's), once the grace after the sender's word has passed; or "".
  std::string why_nothing_comes(ucp_tag_t tag) const;
  bool answer_pings(bool before_sleep = false);
  // `why`: this member gives the job up (abort), and its peers' errors say why.
  void say_goodbye(const std::string& why = "");
  void receive_probed(ucp_tag_message_h msg, std::size_t length, int from, ucp_tag_t tag, std::thread::id owner,
                      Received done, const std::optional<c10::Device>& device = std::nullopt);
  // A received first buffer from `from`, read: a message, or the one a region notice names.
  Result<IncomingMessage> read_received(const at::Tensor& first, int from, const std::optional<c10::Device>& device);
  void receive_parts(IncomingMessage message, int from, ucp_tag_t tag, std::thread::id owner, Received done);
  // A send UCX has not completed: its peer, and what finishes it.
  struct SendInFlight {
    int peer;
    std::thread::id owner;  // the thread that issued it (complete())
    Done done;
  };
  // Finishes with `error` the sends in flight to `peer` (every peer: -1), which UCX will not
  // complete, or whose completion then finds nothing to finish.
  void finish_sends(int peer, const Status& error);
  // Finishes the send at `it` (none at end()) with `s`, as complete() says.
  void finish_send(std::unordered_map<std::uint64_t, SendInFlight>::iterator it, Status s);
  // `done` with `result`, as complete() says.
  static void deliver(std::thread::id owner, Received done, Result<std::vector<at::Tensor>> result);

  const int rank_, world_;
  const std::string noun_;  // what a peer is called in errors ("member", "process")
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1, wake_ = -1;
  std::vector<std::uint8_t> address_;
  std::vector<ucp_ep_h> eps_;  // under worker_mu_
  std::vector<std::unique_ptr<std::pair<UcxMember*, int>>> handler_args_;
  std::deque<PendingReceive> receives_;     // under worker_mu_
  int in_flight_ = 0;                       // UCX requests not completed (under worker_mu_)
  // Sends UCX has not completed, by number: their peer, and what finishes them. A peer's loss
  // finishes its sends here (fail_exited): UCX completes none to a dead shared-memory peer.
  std::unordered_map<std::uint64_t, SendInFlight> sends_in_flight_;  // under worker_mu_
  std::uint64_t sends_issued_ = 0;                                    // under worker_mu_
  std::unordered_set<void*> posted_parts_;  // receives of message parts in flight (under worker_mu_)
  std::unordered_set<ucp_tag_t> reading_;   // tags with a message being received (under worker_mu_)
  std::thread progress_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};  // the progress thread is (about to be) in poll: post wakes it
  bool shared_memory_ = false;         // peers on this host over shared memory (start)
  bool device_memory_ = false;         // CUDA tensors travel from and into device memory (start)
  // When each peer said goodbye (written by the progress thread; read holding the worker).
  std::vector<std::optional<std::chrono::steady_clock::time_point>> closed_at_ =
      std::vector<std::optional<std::chrono::steady_clock::time_point>>(static_cast<std::size_t>(world_));
  // Why each peer gave the job up, when its goodbye said (as closed_at_).
  std::vector<std::string> gave_up_because_ = std::vector<std::string>(static_cast<std::size_t>(world_));
  bool said_goodbye_ = false;  // progress thread only
  // When each peer said it leaves (kLeavingTag; as closed_at_).
  std::vector<std::optional<std::chrono::steady_clock::time_point>> leaving_at_ =
      std::vector<std::optional<std::chrono::steady_clock::time_point>>(static_cast<std::size_t>(world_));
  std::atomic<bool> left_{false};  // leave() was called
  WatchedPeers watched_;  // same-host peers' processes (progress thread only)
  // Large host messages to same-host peers (shared_region.h): this member's region (start),
  // whether each peer is sent to through it (connect), and each peer's region as mapped here
  // (progress thread only).
  std::unique_ptr<OutboundRegion> region_;
  std::unique_ptr<std::atomic<bool>[]> region_to_ = std::make_unique<std::atomic<bool>[]>(static_cast<std::size_t>(world_));
  std::vector<std::shared_ptr<InboundRegion>> inbound_ = std::vector<std::shared_ptr<InboundRegion>>(static_cast<std::size_t>(world_));
  std::vector<int> ended_;  // peers whose process ended, for closed_at_ (progress thread only)
  static constexpr auto kSpin = std::chrono::microseconds(50);
  // What a peer that closed or exited sent just before has this long to be received.
  static constexpr auto kGrace = std::chrono::milliseconds(500);
  std::chrono::steady_clock::time_point last_busy_{};  // progress thread only
  // answer_pings: how often it probes in larger worlds; when it last did (under worker_mu_).
  static constexpr int kPeersProbedEveryRound = 16;
  static constexpr std::int64_t kPingProbeIntervalNs = 100'000;
  std::int64_t pings_probed_at_ = 0;
  std::atomic<bool> graceful_{false};  // flush the endpoints when closing
  std::mutex mu_;
  std::deque<std::function<void()>> commands_;     // for whoever holds the worker next
  std::deque<std::function<void()>> completions_;  // met by a waiter, for the progress thread
  Status error_ = Status::ok();
  // Held while calling into the worker (the threads above). Taken before mu_.
  std::mutex worker_mu_;
  std::atomic<bool> poked_{false};  // a caller sent: the progress thread polls a while
  // When a waiting caller last ran a round itself (steady clock, ns): the progress thread
  // leaves the worker to it meanwhile.
  std::atomic<std::int64_t> helped_at_{0};
  static thread_local HeldCompletions* held_;  // set while a caller's thread holds a worker
};

}  // namespace conveyor::transport
