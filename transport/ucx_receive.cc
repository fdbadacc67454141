// The UCX member's receiving side (transport/ucx_member.h): matching pending receives to the
// messages that arrived, in order per (peer, tag); a message's header and then its parts;
// pings, goodbyes and leavings. Everything here runs holding the worker.
#include <ATen/ATen.h>

#include "transport/endpoint_group.h"
#include "transport/ucx_member.h"
#include "transport/ucx_message.h"
#include "transport/ucx_request.h"

namespace conveyor::transport {

void UcxMember::deliver(std::thread::id owner, Received done, Result<std::vector<at::Tensor>> result) {
  complete(owner, [done = std::move(done), result = std::move(result)]() mutable { done(std::move(result)); });
}

void UcxMember::ask_receive(ucp_tag_t tag, const std::optional<c10::Device>& into, std::thread::id owner,
                            Received done) {
  // The member may have failed since recv() looked: fail_now may have run already, and would
  // not see this receive.
  if (Status e = current_error(); !e) return deliver(owner, std::move(done), e);
  receives_.push_back({tag, into, owner, std::move(done)});
}

bool UcxMember::match_receives() {
  bool busy = false;
  // In the order they were asked for: per (peer, tag) messages complete in arrival order.
  for (auto it = receives_.begin(); it != receives_.end();) {
    if (it->state != ReceiveState::kAsked || reading_.contains(it->tag)) {
      ++it;
      continue;
    }
    const auto receive = it++;  // its completion may finish it (erase) before receive_probed returns
    ucp_tag_recv_info_t info{};
    ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, receive->tag, ~ucp_tag_t{0}, 1, &info);
    if (msg == nullptr) {
      // Nothing more comes from a peer that closed, nor anything but collectives from one
      // that leaves (after a grace for what it sent just before, which may arrive around
      // its word).
      const std::string gone = why_nothing_comes(receive->tag);
      if (gone.empty()) continue;
      finish_receive(receive, Status(ErrorCode::kExecution, gone));
      busy = true;
      continue;
    }
    busy = true;
    receive_probed(receive, msg, info.length);
  }
  return busy;
}

void UcxMember::fail_receives(const Status& error) {
  Receives asked;  // taken out first: a done may run at once
  std::vector<void*> parts;
  for (auto it = receives_.begin(); it != receives_.end();) {
    const auto receive = it++;
    if (receive->state == ReceiveState::kAsked) asked.splice(asked.end(), receives_, receive);
    if (receive->state == ReceiveState::kReadingParts) parts.insert(parts.end(), receive->parts.begin(), receive->parts.end());
  }
  for (auto& r : asked) deliver(r.owner, std::move(r.done), error);
  for (void* r : parts) ucp_request_cancel(worker_, r);  // each cancelled completes (and leaves its receive)
}

void UcxMember::finish_receive(Receives::iterator receive, Result<std::vector<at::Tensor>> result) {
  if (receive->state != ReceiveState::kAsked) reading_.erase(receive->tag);
  const std::thread::id owner = receive->owner;
  Received done = std::move(receive->done);
  receives_.erase(receive);
  deliver(owner, std::move(done), std::move(result));
}

std::string UcxMember::why_nothing_comes(ucp_tag_t tag) const {
  // The job group's collectives (its last exchange) and the member's own words still come
  // from a peer that left; a subgroup's (a stage's gradient sum) do not: a process whose
  // training ended early is named at once by one still summing with it.
  const Tag caller_tag = tag >> kRankBits;
  const bool last_exchange = (caller_tag & kCollectiveTagBit) != 0 && collective_group_of(caller_tag) == 0;
  return peers_.why_nothing_comes(sender_of(tag), caller_tag >= kLeavingTag || last_exchange);
}

bool UcxMember::answer_pings(bool before_sleep) {
  // Answers every ping that arrived (so a process whose main thread is busy still counts as
  // alive; a stopped or hung process answers nothing) and notes every goodbye and leaving. True if any
  // came. Each peer's tags are probed exactly, a lookup in UCX's hash of unexpected messages:
  // a probe under a mask walks all of them, thousands while a stream of large sends waits to
  // be received, and made each round cost more than a 1 MB transfer's share. How often:
  // UcxPeerLiveness::probe_now.
  if (!peers_.probe_now(before_sleep)) return false;
  bool any = false;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    for (const Tag tag : {kPingTag, kByeTag, kLeavingTag}) {
      while (true) {
        ucp_tag_recv_info_t info{};
        ucp_tag_message_h msg = ucp_tag_probe_nb(worker_, ucx_tag(tag, peer), ~ucp_tag_t{0}, 1, &info);
        if (msg == nullptr) break;
        any = true;
        Received done;
        if (tag == kPingTag) {
          done = [this, peer](Result<std::vector<at::Tensor>>) { send_tagged(peer, kPongTag, {}, [](Status) {}); };
        } else {  // a peer that closed or leaves: what it sent before stays receivable
          const auto word = tag == kByeTag ? UcxPeerLiveness::Word::kGoodbye : UcxPeerLiveness::Word::kLeaving;
          done = [this, peer, word](Result<std::vector<at::Tensor>> got) {
            std::string why;
            if (got.is_ok() && got->size() == 1 && (*got)[0].scalar_type() == at::kByte) {
              why = text_of((*got)[0]);  // a goodbye that says why
            }
            peers_.heard(peer, word, std::move(why));
          };
        }
        receives_.push_back({info.sender_tag, std::nullopt, std::thread::id{}, std::move(done)});
        receive_probed(std::prev(receives_.end()), msg, info.length);
      }
    }
  }
  return any;
}

void UcxMember::say_goodbye(const std::string& why) {
  // Closing, or giving the job up: tells every connected peer (what waits on this member
  // there fails at once, saying `why` if given), progressing the messages for at most 200 ms.
  if (!peers_.saying_goodbye()) return;
  constexpr std::size_t kMostSaid = 2000;  // bytes of `why` said
  std::vector<at::Tensor> said;
  if (!why.empty()) said.push_back(text_tensor(why.substr(0, kMostSaid)));
  at::Tensor bye = frame_message(said, /*device_memory=*/false, /*copied=*/true).header;
  std::vector<ucs_status_ptr_t> sent;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_ || !eps_[peer]) continue;
    ucp_request_param_t p{};
    ucs_status_ptr_t r = ucp_tag_send_nbx(eps_[peer], bye.data_ptr(), static_cast<std::size_t>(bye.numel()),
                                          ucx_tag(kByeTag, rank_), &p);
    if (UCS_PTR_IS_PTR(r)) sent.push_back(r);
  }
  wait_for_requests(worker_, sent, std::chrono::steady_clock::now() + std::chrono::milliseconds(200));
}

void UcxMember::receive_probed(Receives::iterator receive, ucp_tag_message_h msg, std::size_t length) {
  // Receives the probed message `msg` of `length` bytes, then the parts its header
  // announces, and hands its tensors, or the error, to the receive's done.
  at::Tensor first = message_bytes(length);
  receive->state = ReceiveState::kReadingHeader;
  ++receiving_;
  reading_.insert(receive->tag);  // until the whole message is in, no other receive takes the tag's next one
  post_request(
      [this, first, receive](ucs_status_t s) mutable {
        --receiving_;
        const int from = sender_of(receive->tag);
        auto message = s == UCS_OK ? read_received(first, from, receive->device)
                                   : transfer_error("a UCX receive", peers_.lost(from), s);
        if (message.is_ok() && !message->parts.empty()) return receive_parts(receive, std::move(*message));
        if (!message.is_ok()) return finish_receive(receive, message.status());
        finish_receive(receive, std::move(message->tensors));
      },
      [&](const ucp_request_param_t& p) { return ucp_tag_msg_recv_nbx(worker_, first.data_ptr(), length, msg, &p); },
      /*receive=*/true);
}

Result<IncomingMessage> UcxMember::read_received(const at::Tensor& first, int from,
                                                 const std::optional<c10::Device>& device) {
  const std::optional<RegionNotice> notice = read_region_notice(first);
  if (!notice) return read_message(first, device);
  const std::shared_ptr<InboundRegion>& region = inbound_[static_cast<std::size_t>(from)];
  if (!region) {
    return Status(ErrorCode::kExecution, peers_.name(from) +
                                             " sent a message through its shared-memory region, which this process "
                                             "could not map; set CONVEYOR_UCX_REGION_MB=0 for every process of the job");
  }
  CONVEYOR_ASSIGN_OR_RETURN(at::Tensor buffer, region->message(notice->offset, notice->length, region));
  return read_message(buffer, device);
}

void UcxMember::receive_parts(Receives::iterator receive, IncomingMessage message) {
  // As the header is received: receives each part the header announced into its tensor.
  // Until all are in, no other receive matches the tag, so the receives of one (peer, tag)
  // complete in order. Parts still posted when the member fails are cancelled
  // (fail_receives) and fail with its error.
  receive->state = ReceiveState::kReadingParts;
  const int from = sender_of(receive->tag);
  auto received = std::make_shared<Countdown>(
      message.parts.size(), [this, receive, tensors = std::move(message.tensors)](Status s) mutable {
        if (!s.is_ok()) return finish_receive(receive, s);
        finish_receive(receive, std::move(tensors));
      });
  for (at::Tensor& part : message.parts) {
    ++receiving_;
    auto posted = std::make_shared<void*>(nullptr);
    *posted = post_request(
        [this, received, receive, part, from, posted](ucs_status_t s) {
          --receiving_;
          receive->parts.erase(*posted);  // before the last part's completion finishes the receive
          if (s == UCS_OK) return received->completed(Status::ok());
          Status failed = current_error();  // a cancelled part fails with the member's error
          received->completed(s == UCS_ERR_CANCELED && !failed.is_ok() ? failed
                                                                      : transfer_error("a UCX receive", peers_.lost(from), s));
        },
        [&](const ucp_request_param_t& given) {
          ucp_request_param_t p = with_memory_type(given, part);
          return ucp_tag_recv_nbx(worker_, part.data_ptr(), part.nbytes(), receive->tag, ~ucp_tag_t{0}, &p);
        },
        /*receive=*/true);
    // Still in flight (not completed as it was posted): the receive is not finished, since
    // its last part's completion finishes it.
    if (*posted != nullptr) receive->parts.insert(*posted);
  }
}

}  // namespace conveyor::transport
