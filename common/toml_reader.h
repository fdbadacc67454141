// Reading TOML (cluster files, job configs) with errors that name the line: conveyor's own
// parser of TOML 1.0 without dates and times, written to be safe on any bytes (fuzzed by
// fuzz/: no recursion deeper than kMaxDepth, every number range-checked, no assertion a
// malformed file can reach). Debian's toml++ 3.3 aborts or runs into undefined behaviour on
// inputs as small as "[\n".
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace conveyor::toml {

/// Thrown while reading a file; status() turns it into "file:line: what".
class TomlError {
 public:
  TomlError(int line, std::string what) : line_(line), what_(std::move(what)) {}
  Status status(const std::string& source) const {
    return Status(ErrorCode::kFormat, source + ":" + std::to_string(line_) + ": " + what_);
  }

 private:
  int line_;
  std::string what_;
};

/// Values nest at most this deep, however they nest: table headers' and dotted keys' parts,
/// arrays and inline tables (so no walk or destructor of a Node recurses deeper).
inline constexpr int kMaxDepth = 64;

/// One TOML value: a string, integer, float, boolean, array or table, with the line it
/// starts on.
class Node {
 public:
  enum class Kind { kString, kInteger, kFloat, kBool, kArray, kTable };

  Kind kind() const { return kind_; }
  int line() const { return line_; }
  bool is_table() const { return kind_ == Kind::kTable; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_integer() const { return kind_ == Kind::kInteger; }
  const Node* as_table() const { return is_table() ? this : nullptr; }
  const Node* as_array() const { return is_array() ? this : nullptr; }

  /// A table's value under `key`, or null (also when this is not a table).
  const Node* get(std::string_view key) const;
  /// A table's keys and values in file order, or an array's items (keys empty).
  const std::vector<std::string>& keys() const { return keys_; }
  const std::vector<Node>& items() const { return items_; }

  std::optional<std::string> string() const;
  std::optional<std::int64_t> integer() const;
  /// A float, or an integer as a double.
  std::optional<double> number() const;
  std::optional<bool> boolean() const;

 private:
  friend class Parser;
  Kind kind_ = Kind::kTable;
  int line_ = 1;
  std::string text_;
  std::int64_t integer_ = 0;
  double number_ = 0;
  bool boolean_ = false;
  std::vector<std::string> keys_;
  std::vector<Node> items_;
  std::unordered_map<std::string, std::size_t> index_;  ///< a table's key -> its place in keys_ (lookups in O(1))
  // How a table or array came to be, for TOML's rules on defining things twice.
  bool header_defined_ = false;  ///< named by a [header] (may not be named again)
  bool by_dotted_key_ = false;   ///< made by a dotted key (a [header] may not name it)
  bool frozen_ = false;          ///< an inline table or a static array: complete as written
  bool table_array_ = false;     ///< an array made by [[header]]
};

/// Parses `text` into its root table; throws TomlError at the first thing wrong.
Node parse(std::string_view text);

/// Refuses a key of table `t` not in `allowed`, naming its line and the keys expected.
void check_keys(const Node& t, std::initializer_list<std::string_view> allowed, const char* where);

}  // namespace conveyor::toml
