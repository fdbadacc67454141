#include "common/status.h"

#include <cstdio>
#include <cstdlib>

namespace conveyor {

std::string_view error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk: return "ok";
    case ErrorCode::kInvalidArgument: return "invalid_argument";
    case ErrorCode::kFormat: return "format";
    case ErrorCode::kVersion: return "version";
    case ErrorCode::kCorrupt: return "corrupt";
    case ErrorCode::kUnknownOp: return "unknown_op";
    case ErrorCode::kInvalidGraph: return "invalid_graph";
    case ErrorCode::kInvalidStage: return "invalid_stage";
    case ErrorCode::kExecution: return "execution";
    case ErrorCode::kIo: return "io";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kDoesNotFit: return "does_not_fit";
    case ErrorCode::kInterrupted: return "interrupted";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

std::string Status::capped(std::string message) {
  constexpr std::size_t kLimit = 4096, kHead = 2048, kTail = 1024;
  if (message.size() <= kLimit) return message;
  return message.substr(0, kHead) + " [... " + std::to_string(message.size() - kHead - kTail) + " bytes left out ...] " +
         message.substr(message.size() - kTail);
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  return Status(code_, std::string(context) + ": " + message_);
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(error_code_name(code_)) + ": " + message_;
}

namespace detail {
void check_failed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "conveyor: internal invariant broken at %s:%d: %s %s\n", file, line, expr,
               msg.c_str());
  std::abort();
}
}  // namespace detail

}  // namespace conveyor
