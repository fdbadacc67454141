#include "runtime/rendezvous.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "common/blocking_call.h"
#include "common/secret.h"
#include "runtime/rendezvous_protocol.h"
#include "runtime/rendezvous_wire.h"

namespace conveyor::runtime {

namespace protocol = rendezvous_protocol;
using wire::Clock;

namespace {

// What process 0 lets unproven peers (connected, no signed join yet) hold, so that nothing
// grows before authentication: each keeps at most one join frame (protocol::kLargestJoin), so
// all of them together at most 16 MiB; a peer address holds at most a quarter of the places,
// and a connection that has not sent its signed join within kProofWithin is closed. A process
// turned away for want of a place connects again (every joining process retries until its
// deadline), so a burst of honest processes only waits.
constexpr std::size_t kMostUnproven = 256;
constexpr std::size_t kMostUnprovenPerPeer = 64;
constexpr auto kProofWithin = std::chrono::seconds(10);

// Process 0's side: a thread that listens at MASTER_ADDR:MASTER_PORT, hands every connection
// a nonce, reads its one join frame and answers as the JoinBook decides, for as long as the
// job runs (a late process is told the job is complete).
class Server {
 public:
  Server(wire::Socket listener, protocol::JoinBook book)
      : listener_(std::move(listener)), book_(std::move(book)), thread_([this] { run(); }) {}
  ~Server() {
    stop_ = true;
    thread_.join();
  }
  std::string missing() {
    std::lock_guard<std::mutex> lock(mutex_);
    return book_.missing();
  }

 private:
  struct Connection {
    wire::Socket socket;
    std::string peer, nonce;
    wire::FrameReader reader{protocol::kLargestJoin};
    Clock::time_point opened = Clock::now();
    bool proven = false;         // its join was signed: it waits for its answer, beyond the limits
    bool close_after_sent = false;
    std::string outgoing;        // framed bytes not yet sent
    std::size_t sent = 0;
  };

  void run() {
    while (!stop_) {
      std::vector<pollfd> fds{{listener_.fd(), POLLIN, 0}};
      std::vector<int> ids;
      for (auto& [id, c] : connections_) {
        short events = c.sent < c.outgoing.size() ? POLLOUT : 0;
        if (!c.proven && !c.close_after_sent) events |= POLLIN;
        fds.push_back({c.socket.fd(), events, 0});
        ids.push_back(id);
      }
      ::poll(fds.data(), fds.size(), static_cast<int>(kStopAskedEvery.count()));
      if (fds[0].revents & POLLIN) accept_all();
      for (std::size_t i = 1; i < fds.size(); ++i) {
        if (fds[i].revents != 0) serve(ids[i - 1], fds[i].revents);
      }
      close_idle();
    }
  }

  std::size_t unproven(const std::string& peer) const {
    return static_cast<std::size_t>(std::count_if(connections_.begin(), connections_.end(), [&](const auto& entry) {
      return !entry.second.proven && (peer.empty() || entry.second.peer == peer);
    }));
  }

  void accept_all() {
    while (true) {
      wire::Socket s(::accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
      if (!s) return;
      std::string peer = wire::peer_of(s.fd());
      if (unproven("") >= kMostUnproven || unproven(peer) >= kMostUnprovenPerPeer) continue;  // closed: it may retry
      Connection c;
      c.socket = std::move(s);
      c.peer = std::move(peer);
      c.nonce = protocol::challenge();
      c.outgoing = wire::frame(c.nonce);
      connections_.emplace(next_id_++, std::move(c));
    }
  }

  void serve(int id, short revents) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    Connection& c = it->second;
    if ((revents & POLLOUT) && !flush(c)) return drop(id);
    if (c.close_after_sent && c.sent == c.outgoing.size()) return drop(id);
    if (revents & (POLLERR | POLLHUP | POLLNVAL)) return drop(id);
    if (!(revents & POLLIN) || c.proven) return;
    switch (c.reader.read_from(c.socket.fd())) {
      case wire::FrameReader::Progress::kMore:
        return;
      case wire::FrameReader::Progress::kTooLarge:
      case wire::FrameReader::Progress::kClosed:
        return drop(id);
      case wire::FrameReader::Progress::kDone:
        break;
    }
    protocol::JoinBook::Outcome outcome;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      outcome = book_.join(id, c.nonce, c.reader.payload());
    }
    c.reader = wire::FrameReader(0);  // the join is read; nothing more is
    c.proven = outcome.held;
    if (!outcome.held) c.close_after_sent = true;
    for (auto& send : outcome.sends) {
      auto to = connections_.find(send.connection);
      if (to == connections_.end()) continue;
      to->second.outgoing += wire::frame(send.payload);
      to->second.close_after_sent = to->second.close_after_sent || send.close_after;
      if (!flush(to->second)) drop(send.connection);
    }
  }

  // Sends what the socket takes now; false when the peer has gone.
  static bool flush(Connection& c) {
    while (c.sent < c.outgoing.size()) {
      const ssize_t n = ::send(c.socket.fd(), c.outgoing.data() + c.sent, c.outgoing.size() - c.sent, MSG_NOSIGNAL);
      if (n > 0) {
        c.sent += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
    }
    return true;
  }

  void drop(int id) {
    auto it = connections_.find(id);
    if (it == connections_.end()) return;
    if (it->second.proven) {
      std::lock_guard<std::mutex> lock(mutex_);
      book_.forget(id);
    }
    connections_.erase(it);
  }

  void close_idle() {
    const auto now = Clock::now();
    for (auto it = connections_.begin(); it != connections_.end();) {
      const Connection& c = it->second;
      const bool done = c.close_after_sent && c.sent == c.outgoing.size();
      if (done || (!c.proven && now - c.opened > kProofWithin)) {
        it = connections_.erase(it);
      } else {
        ++it;
      }
    }
  }

  wire::Socket listener_;
  protocol::JoinBook book_;  // guarded by mutex_ (missing() reads it from another thread)
  std::mutex mutex_;
  std::map<int, Connection> connections_;
  int next_id_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: it starts once everything it reads is made
};

// Connects to process 0 until the deadline, sends the signed join, and waits for the answer:
// its body once the answer's MAC over this process's own nonce holds. A connection process 0
// turned away before handing out a nonce (its limits) is tried again.
Result<std::string> ask(const JoinRequest& req, const nlohmann::json& request, Clock::time_point deadline,
                        const std::string& where) {
  const std::string who = "process " + std::to_string(req.rank);
  std::string last_refusal = "no attempt";
  while (true) {
    if (req.interrupted && req.interrupted()) {
      return Status(ErrorCode::kInterrupted, who + " was interrupted while looking for process 0 at " + where);
    }
    if (Clock::now() >= deadline) {
      return Status(ErrorCode::kExecution, who + " found no process 0 at " + where + " within " +
                                               std::to_string(req.timeout.count()) + " ms (" + last_refusal +
                                               "); start process 0, or check MASTER_ADDR and MASTER_PORT");
    }
    auto socket = wire::connect_to(req.host, req.port, std::chrono::seconds(1));
    if (!socket) {
      last_refusal = socket.status().message();
      std::this_thread::sleep_for(kStopAskedEvery);
      continue;
    }
    auto nonce = wire::read_frame(socket->fd(), protocol::kLargestChallenge,
                                  std::min(deadline, Clock::now() + kProofWithin), req.interrupted);
    if (!nonce && nonce.status().code() == ErrorCode::kInterrupted) {
      return Status(ErrorCode::kInterrupted, who + " was interrupted while looking for process 0 at " + where);
    }
    if (!nonce && nonce.status().code() == ErrorCode::kFormat) {
      return Status(ErrorCode::kInvalidArgument, "the process listening at " + where +
                                                     " does not speak conveyor's rendezvous; check MASTER_ADDR and MASTER_PORT");
    }
    if (!nonce) {
      last_refusal = nonce.status().message() == "timeout"
                         ? "connected, but no word from it"
                         : "it turned the connection away: its places for unproven connections were all taken "
                           "(is something flooding the port?)";
      std::this_thread::sleep_for(kStopAskedEvery);
      continue;
    }
    nlohmann::json signed_request = request;
    const std::string client_nonce = secret::random_hex(16);
    signed_request["client_nonce"] = client_nonce;
    const std::string payload = protocol::join_payload(req.secret, *nonce, signed_request.dump());
    CONVEYOR_RETURN_IF_ERROR(wire::write_all(socket->fd(), wire::frame(payload), deadline));
    auto answer = wire::read_frame(socket->fd(), protocol::largest_answer(req.world), deadline, req.interrupted);
    if (!answer) {
      switch (answer.status().code()) {
        case ErrorCode::kInterrupted:
          return Status(ErrorCode::kInterrupted, who + " was interrupted while waiting for the others to join at " + where);
        case ErrorCode::kFormat:
          return Status(ErrorCode::kInvalidArgument, "the process listening at " + where +
                                                         " is not this job's process 0 (its answer is too large)");
        default:
          if (answer.status().message() == "timeout") return answer.status();
          return Status(ErrorCode::kExecution, "process 0 at " + where + " closed the connection before every process "
                                                   "joined (did it stop? its own output says why)");
      }
    }
    return protocol::read_answer(req.secret, client_nonce, *answer, where);
  }
}

}  // namespace

struct Rendezvous::Impl {
  std::unique_ptr<Server> server;  // process 0's, while the job runs
};

Rendezvous::Rendezvous(std::unique_ptr<Impl> impl, std::vector<std::string> addresses)
    : impl_(std::move(impl)), addresses_(std::move(addresses)) {}
Rendezvous::~Rendezvous() = default;

Result<std::unique_ptr<Rendezvous>> rendezvous(const JoinRequest& req) {
  const auto deadline = Clock::now() + req.timeout;
  const std::string where = req.host + ":" + std::to_string(req.port);
  if (req.world < 1 || req.rank < 0 || req.rank >= req.world) {
    return Status(ErrorCode::kInvalidArgument, "RANK " + std::to_string(req.rank) + " with WORLD_SIZE " +
                                                   std::to_string(req.world) + " (RANK must be 0 to WORLD_SIZE - 1)");
  }
  if (req.secret.empty()) return Status(ErrorCode::kInvalidArgument, "the rendezvous needs the job's secret");
  if (req.port < 1 || req.port > 65535) {
    return Status(ErrorCode::kInvalidArgument, "MASTER_PORT " + std::to_string(req.port) + " (1 to 65535)");
  }
  if (req.address.size() * 2 > protocol::kLargestAddress) {
    return Status(ErrorCode::kInternal, "this process's data-plane address is " + std::to_string(req.address.size()) +
                                            " bytes, more than the rendezvous carries");
  }
  auto impl = std::make_unique<Rendezvous::Impl>();
  if (req.rank == 0) {
    auto listener = wire::listen_at(req.host, req.port);
    if (!listener) {
      return Status(ErrorCode::kExecution, "process 0 cannot listen for the other processes at " + where + ": " +
                                               listener.status().message() +
                                               " (is the port in use? set MASTER_PORT, or `conveyor launch "
                                               "--master-port`, to a free one)");
    }
    impl->server = std::make_unique<Server>(std::move(*listener),
                                            protocol::JoinBook(req.world, req.version, req.job, req.secret));
  }
  const nlohmann::json request = {{"rank", req.rank},
                                  {"world", req.world},
                                  {"version", req.version},
                                  {"job", req.job},
                                  {"address", secret::to_hex(req.address)}};
  Result<std::string> reply = ask(req, request, deadline, where);
  if (!reply) {
    if (reply.status().message() != "timeout") return reply.status();
    const std::string missing = impl->server ? impl->server->missing() : "";
    return Status(ErrorCode::kExecution,
                  "the rendezvous at " + where + " did not complete within " + std::to_string(req.timeout.count()) +
                      " ms" + (req.rank == 0 ? ": processes " + missing + " did not join" : "") +
                      "; start every process (WORLD_SIZE " + std::to_string(req.world) +
                      "), or give them longer (timeout=, or CONVEYOR_TIMEOUT)");
  }
  nlohmann::json j = nlohmann::json::parse(*reply, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].is_string()) {
    return Status(ErrorCode::kInvalidArgument, "rendezvous at " + where + ": " + j["error"].get<std::string>());
  }
  if (!j.is_object() || !j.contains("addresses") || !j["addresses"].is_array() ||
      static_cast<int>(j["addresses"].size()) != req.world ||
      !std::all_of(j["addresses"].begin(), j["addresses"].end(), [](const auto& a) { return a.is_string(); })) {
    return Status(ErrorCode::kCorrupt, "a malformed rendezvous answer from process 0 (another conveyor version?)");
  }
  std::vector<std::string> addresses;
  for (const auto& a : j["addresses"]) addresses.push_back(secret::from_hex(a.get<std::string>()));
  return std::make_unique<Rendezvous>(std::move(impl), std::move(addresses));
}

}  // namespace conveyor::runtime
