// The UCX endpoint's member (transport/ucx.h), shared by the two files that implement it:
// ucx.cc (starting, connecting, sending and closing) and ucx_receive.cc (matching receives
// to the messages that arrived, pings and goodbyes). Its jobs' state belongs to three owners,
// each with its own lock or thread:
// - UcxProgress (ucx_progress.h): the progress thread, its queue of work and the lock on
//   the worker, which callers' threads take for a moment themselves;
// - UcxSendsInFlight (ucx_sends.h): the sends UCX has not completed, each kPosted or kFailed;
// - UcxPeerLiveness (ucx_liveness.h): what the peers said, whose process ended, and the
//   errors that name them.
// What stays here is the worker's: its endpoints and receives (each with its ReceiveState),
// touched only holding the worker (the progress thread, or a caller's thread in
// with_worker_on_caller).
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
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
#include "transport/ucx_liveness.h"
#include "transport/ucx_progress.h"
#include "transport/ucx_sends.h"

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
inline int sender_of(ucp_tag_t tag) { return static_cast<int>(tag & ((ucp_tag_t{1} << kRankBits) - 1)); }

/// One member of a UCX world: its context, worker, endpoints and receives, and the owners of
/// its progress thread, its sends in flight and its peers' liveness.
class UcxMember final : public UcxEndpoint, private WorkerRounds {
 public:
  UcxMember(int rank, int world, std::string noun)
      : rank_(rank), world_(world), eps_(static_cast<std::size_t>(world), nullptr), peers_(world, std::move(noun)) {}
  ~UcxMember() override;
  /// Creates the context and worker (transports as ucx.h says) and starts the progress thread.
  Status start(const std::string& net_device);

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::vector<std::uint8_t> address() const override {
    return with_identity(this_process(), with_region(region_ ? std::optional(region_->name()) : std::nullopt, address_));
  }
  bool on_progress_thread() const { return progress_.on_progress_thread(); }
  /// Stops the progress thread, whose last act closes the member (at process exit: ucx.cc).
  void stop_progress() { progress_.stop(); }
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
  /// Where one receive stands.
  enum class ReceiveState {
    kAsked,          // waiting for its message; receives of one (peer, tag) take theirs in the order asked
    kReadingHeader,  // its message found: its first buffer (the header, or all of it) being received
    kReadingParts,   // its header read: the parts it announced being received (cancelled if the member fails)
  };
  struct Receive {
    ucp_tag_t tag;
    std::optional<c10::Device> device;  // where parts sent from device memory land
    std::thread::id owner;              // the thread that asked (UcxProgress::complete)
    Received done;
    ReceiveState state = ReceiveState::kAsked;
    std::unordered_set<void*> parts = {};  // kReadingParts: the parts' requests still in flight
  };
  using Receives = std::list<Receive>;  // stable: a request's completion holds its receive

  Status check_peer(int peer) const { return transport::check_peer(rank_, world_, peer); }
  Status current_error();
  static void complete(std::thread::id owner, std::function<void()> completion) {
    UcxProgress::complete(owner, std::move(completion));
  }

  // WorkerRounds, for the progress thread (ucx.cc).
  bool work() override;
  void after_round() override;
  std::optional<int> may_sleep() override;
  void wait(std::vector<pollfd>& fds, int timeout_ms) override;
  void close() override;

  // ucx.cc: sending.
  // A user's send (send, send_copied): its peer and tag checked, then send_tagged.
  void send_checked(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done, bool copied);
  // `copied`: the caller may write the tensors once this returns (frame_message's `copied`).
  void send_tagged(int peer, Tag tag, std::vector<at::Tensor> tensors, Done done, bool copied = false);
  void issue_send(int peer, Tag tag, const std::shared_ptr<OutgoingMessage>& message, std::thread::id owner, Done done);
  bool sent_by_caller(int peer, Tag tag, const std::shared_ptr<OutgoingMessage>& message, Done& done, bool reply_likely);
  // `tensors` written into this member's region for `peer` (shared_region.h), as the notice
  // to send in their place; nothing when they go through UCX.
  std::optional<at::Tensor> written_to_region(int peer, const std::vector<at::Tensor>& tensors);
  void fail_now(Status error);
  // Finishes with `error` the sends in flight to `peer` (every peer: -1), which UCX will not
  // complete.
  void fail_sends(int peer, const Status& error);
  // UCX requests not completed: sends and receives.
  int in_flight() const { return sends_.count_posted() + receiving_; }

  // ucx_receive.cc: receiving (holding the worker).
  void ask_receive(ucp_tag_t tag, const std::optional<c10::Device>& into, std::thread::id owner, Received done);
  bool match_receives();
  // Why a pending receive of `tag` will never be met (UcxPeerLiveness::why_nothing_comes), or "".
  std::string why_nothing_comes(ucp_tag_t tag) const;
  bool answer_pings(bool before_sleep = false);
  // `why`: this member gives the job up (abort), and its peers' errors say why.
  void say_goodbye(const std::string& why = "");
  // Fails every receive kAsked with `error`, and cancels the parts of those kReadingParts.
  void fail_receives(const Status& error);
  // `receive`'s message `msg` of `length` bytes, found (kAsked -> kReadingHeader): received,
  // then the parts its header announces (kReadingParts), then handed to its done.
  void receive_probed(Receives::iterator receive, ucp_tag_message_h msg, std::size_t length);
  // A received first buffer from `from`, read: a message, or the one a region notice names.
  Result<IncomingMessage> read_received(const at::Tensor& first, int from, const std::optional<c10::Device>& device);
  void receive_parts(Receives::iterator receive, IncomingMessage message);
  // `receive` leaves the table, and its done gets `result`.
  void finish_receive(Receives::iterator receive, Result<std::vector<at::Tensor>> result);
  // `done` with `result`, as UcxProgress::complete says.
  static void deliver(std::thread::id owner, Received done, Result<std::vector<at::Tensor>> result);

  const int rank_, world_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<std::uint8_t> address_;
  bool shared_memory_ = false;  // peers on this host over shared memory (start)
  bool device_memory_ = false;  // CUDA tensors travel from and into device memory (start)
  std::atomic<bool> graceful_{false};  // flush the endpoints when closing
  // The member's first failure: every pending and later operation fails with it.
  std::mutex error_mu_;
  Status error_ = Status::ok();  // under error_mu_
  // The worker's: touched only holding it.
  std::vector<ucp_ep_h> eps_;
  std::vector<std::unique_ptr<std::pair<UcxMember*, int>>> handler_args_;
  Receives receives_;                      // in the order asked, until each is finished
  int receiving_ = 0;                      // UCX receive requests not completed
  std::unordered_set<ucp_tag_t> reading_;  // tags of the receives kReadingHeader or kReadingParts
  // Large host messages to same-host peers (shared_region.h): this member's region (start),
  // whether each peer is sent to through it (connect; callers' threads), and each peer's
  // region as mapped here (the worker's).
  std::unique_ptr<OutboundRegion> region_;
  std::unique_ptr<std::atomic<bool>[]> region_to_ = std::make_unique<std::atomic<bool>[]>(static_cast<std::size_t>(world_));
  std::vector<std::shared_ptr<InboundRegion>> inbound_ = std::vector<std::shared_ptr<InboundRegion>>(static_cast<std::size_t>(world_));
  // The owners. peers_ and sends_ come before progress_, whose thread uses them until it stops.
  UcxPeerLiveness peers_;
  UcxSendsInFlight sends_;
  UcxProgress progress_{*this};
};

}  // namespace conveyor::transport
