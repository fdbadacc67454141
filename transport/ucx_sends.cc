#include "transport/ucx_sends.h"

#include <utility>

namespace conveyor::transport {

std::uint64_t UcxSendsInFlight::posted(int peer, std::thread::id owner, Done done) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t number = issued_++;
  sends_.emplace(number, Send{peer, SendState::kPosted, Finish{owner, std::move(done)}});
  ++posted_;
  return number;
}

std::optional<UcxSendsInFlight::Finish> UcxSendsInFlight::completed(std::uint64_t number) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sends_.find(number);
  if (it == sends_.end()) return std::nullopt;
  Send send = std::move(it->second);
  sends_.erase(it);
  if (send.state == SendState::kFailed) return std::nullopt;  // finished already: its peer was lost
  --posted_;
  return std::move(send.finish);
}

std::vector<UcxSendsInFlight::Finish> UcxSendsInFlight::fail(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Finish> failed;
  for (auto& [number, send] : sends_) {
    if (send.state != SendState::kPosted || (peer >= 0 && send.peer != peer)) continue;
    send.state = SendState::kFailed;
    --posted_;
    failed.push_back(std::move(send.finish));
  }
  return failed;
}

int UcxSendsInFlight::count_posted() const {
  std::lock_guard<std::mutex> lock(mu_);
  return posted_;
}

}  // namespace conveyor::transport
