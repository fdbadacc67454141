// Runtime failures as values: Status and Result<T>. Broken invariants are
// CONVEYOR_CHECKs instead (a bug in conveyor, not in the user's input).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace conveyor {

/// What kind of failure a Status carries; bindings/ maps each to a Python exception type.
enum class ErrorCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,  ///< the caller passed something malformed
  kFormat,           ///< a file or document is malformed
  kVersion,          ///< a file comes from a newer/unknown format version
  kCorrupt,          ///< a file is truncated or its checksum does not match
  kUnknownOp,        ///< an operator is unknown to this torch build
  kInvalidGraph,     ///< the graph breaks a structural rule
  kInvalidStage,     ///< a stage cut is not convex or splits an atomic group
  kExecution,        ///< an operator failed while running
  kIo,               ///< the file system said no
  kUnsupported,      ///< valid input that conveyor does not handle yet
  kDoesNotFit,       ///< no plan fits the cluster's memory
  kInterrupted,      ///< a wait was ended by its caller (Python's Ctrl-C), and the job with it
  kInternal,
};

/// Stable lower-case name of an error code ("format", "unknown_op", ...).
std::string_view error_code_name(ErrorCode code);

/// The outcome of an operation: ok, or an error code and a message a user can act on.
class [[nodiscard]] Status {
 public:
  Status() = default;
  /// A message over 4 KiB keeps its start and end: no error quotes a whole bad input.
  Status(ErrorCode code, std::string message) : code_(code), message_(capped(std::move(message))) {}

  static Status ok() { return {}; }
  bool is_ok() const { return code_ == ErrorCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }

  /// Returns a copy whose message is prefixed with `context: `.
  Status with_context(std::string_view context) const;
  /// "format: <message>" style text for logs and exceptions.
  std::string to_string() const;

 private:
  ErrorCode code_ = ErrorCode::kOk;
  static std::string capped(std::string message);
  std::string message_;
};

/// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : state_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (std::get<Status>(state_).is_ok()) {
      state_ = Status(ErrorCode::kInternal, "Result constructed from an ok Status");
    }
  }

  bool is_ok() const { return std::holds_alternative<T>(state_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOk;
    return is_ok() ? kOk : std::get<Status>(state_);
  }
  T& value() & { return std::get<T>(state_); }
  const T& value() const& { return std::get<T>(state_); }
  T&& value() && { return std::get<T>(std::move(state_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, Status> state_;
};

namespace detail {
[[noreturn]] void check_failed(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace conveyor

/// Aborts with a message when an internal invariant is broken (never for user input).
#define CONVEYOR_CHECK(cond, ...)                                                      \
  do {                                                                                 \
    if (!(cond)) ::conveyor::detail::check_failed(#cond, __FILE__, __LINE__, std::string{__VA_ARGS__}); \
  } while (0)

#define CONVEYOR_CONCAT_INNER(a, b) a##b
#define CONVEYOR_CONCAT(a, b) CONVEYOR_CONCAT_INNER(a, b)

/// Returns the Status from the enclosing function when `expr` is not ok.
#define CONVEYOR_RETURN_IF_ERROR(expr)        \
  do {                                        \
    ::conveyor::Status _st = (expr);          \
    if (!_st.is_ok()) return _st;             \
  } while (0)

/// `CONVEYOR_ASSIGN_OR_RETURN(auto x, make_x());`
#define CONVEYOR_ASSIGN_OR_RETURN(lhs, expr) \
  CONVEYOR_ASSIGN_OR_RETURN_IMPL(CONVEYOR_CONCAT(_result_, __LINE__), lhs, expr)
#define CONVEYOR_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.is_ok()) return tmp.status();               \
  lhs = std::move(tmp).value()
