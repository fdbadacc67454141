#include "fuzz/readers.h"

#include "graph/format.h"
#include "partitioner/cluster.h"
#include "partitioner/cost_graph.h"
#include "partitioner/planner.h"
#include "runtime/rendezvous_protocol.h"
#include "runtime/rendezvous_wire.h"
#include "tools/command_line.h"
#include "tools/launch.h"

#include <sys/socket.h>
#include <unistd.h>
#include "trace/perfetto.h"

namespace conveyor::fuzz {

const std::vector<std::string>& reader_names() {
  static const std::vector<std::string> names{"graph_file", "graph_document", "op_graph",     "profile",        "cluster",
                                              "job_config", "plan",           "trace",        "command_line",   "rendezvous_join"};
  return names;
}

namespace {

// The `conveyor` command's arguments, NUL-separated: parsed and checked as the tool does, never run.
Status read_command_line(std::string_view bytes) {
  std::vector<std::string> args{"conveyor"};
  std::size_t at = 0;
  while (at < bytes.size()) {
    const std::size_t end = std::min(bytes.find('\0', at), bytes.size());
    args.emplace_back(bytes.substr(at, end - at));
    at = end + 1;
  }
  const tools::Invocation run = tools::parse_command_line(args);
  if (run.done && run.exit_code != 0) return Status(ErrorCode::kInvalidArgument, run.text);
  return Status::ok();
}

// What process 0's rendezvous reads from unproven peers: the bytes as they would arrive on the
// port, frame after frame, one connection each, read by the same FrameReader; a payload whose
// first byte is odd is signed by the fuzzer first (a peer that holds the secret and lies),
// so the JoinBook's reading past the MAC is reached too. Every answer is read back as a
// joining process would. Ok when every frame was whole and every join was taken.
Status read_rendezvous_joins(std::string_view bytes) {
  namespace protocol = runtime::rendezvous_protocol;
  const std::string secret = "fuzzing-secret-0123456789abcdef";
  int sockets[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sockets) != 0) return Status(ErrorCode::kIo, "socketpair");
  runtime::wire::Socket reading(sockets[0]), writing(sockets[1]);
  const std::size_t sent = std::min(bytes.size(), std::size_t{1} << 16);  // within the socket's buffer
  if (::write(writing.fd(), bytes.data(), sent) != static_cast<ssize_t>(sent)) return Status(ErrorCode::kIo, "write");
  ::shutdown(writing.fd(), SHUT_WR);
  protocol::JoinBook book(3, "fuzz", "job", secret);
  Status out = Status::ok();
  for (int connection = 0;; ++connection) {
    runtime::wire::FrameReader reader(protocol::kLargestJoin);
    const auto progress = reader.read_from(reading.fd());
    if (progress == runtime::wire::FrameReader::Progress::kTooLarge) return Status(ErrorCode::kFormat, "a frame over the limit");
    if (progress != runtime::wire::FrameReader::Progress::kDone) break;
    const std::string nonce = "nonce" + std::to_string(connection);
    std::string payload = reader.payload();
    if (!payload.empty() && (payload[0] & 1)) payload = protocol::join_payload(secret, nonce, payload);
    const auto outcome = book.join(connection, nonce, payload);
    if (!outcome.held) out = Status(ErrorCode::kInvalidArgument, "a join was not taken");
    for (const auto& send : outcome.sends) {
      auto body = protocol::read_answer(secret, "", send.payload, "fuzz");
      if (!body && outcome.held) out = body.status();
    }
  }
  (void)book.missing();
  return out;
}

}  // namespace

Status read_as(std::string_view reader, std::string_view bytes) {
  const std::string text(bytes);
  if (reader == "graph_file") {
    // Whoever crafts a file recomputes its checksums: so does the fuzzer, to get past them.
    std::string fixed(bytes);
    graph::fix_checksums(fixed);
    auto file = graph::read_graph_file(fixed, "graph file");
    if (!file) return file.status();
    return graph::Graph::from_json(file->graph.to_json()).status();
  }
  if (reader == "graph_document") {
    auto g = graph::Graph::from_json(text);
    if (!g) return g.status();
    return graph::Graph::from_json(g->to_json()).status();
  }
  if (reader == "op_graph") {
    auto g = partitioner::CostGraph::from_json(text);
    if (!g) return g.status();
    return partitioner::CostGraph::from_json(g->to_json()).status();
  }
  if (reader == "profile") {
    auto p = partitioner::Profile::from_json(text);
    if (!p) return p.status();
    return partitioner::Profile::from_json(p->to_json()).status();
  }
  if (reader == "cluster") {
    auto c = partitioner::Cluster::from_toml(text, "cluster");
    if (!c) return c.status();
    (void)c->summary();
    return Status::ok();
  }
  if (reader == "job_config") return tools::parse_job_config(text, "job.toml").status();
  if (reader == "plan") {
    auto p = partitioner::Plan::from_json(text);
    if (!p) return p.status();
    (void)p->table();
    return partitioner::Plan::from_json(p->to_json()).status();
  }
  if (reader == "trace") return trace::check_trace(bytes).status();
  if (reader == "command_line") return read_command_line(bytes);
  if (reader == "rendezvous_join") return read_rendezvous_joins(bytes);
  return Status(ErrorCode::kInvalidArgument, "no reader named '" + std::string(reader) + "'");
}

}  // namespace conveyor::fuzz
