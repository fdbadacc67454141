// Reading TOML files with errors that name the line (cluster files, job configs): include
// after <toml++/toml.hpp>; the including target compiles toml++ header-only (toml_dep).
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "common/status.h"

namespace conveyor::toml_fields {

/// Thrown while reading a file; status() turns it into "file:line: what".
class TomlError {
 public:
  TomlError(const toml::source_region& where, std::string what) : line_(where.begin.line), what_(std::move(what)) {}
  TomlError(std::uint32_t line, std::string what) : line_(line), what_(std::move(what)) {}
  Status status(const std::string& source) const {
    return Status(ErrorCode::kFormat, source + ":" + std::to_string(line_) + ": " + what_);
  }

 private:
  std::uint32_t line_;
  std::string what_;
};

/// Parses `text` (named `source`); a syntax error becomes a TomlError at its line.
inline toml::table parse(std::string_view text, const std::string& source) {
  try {
    return toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw TomlError(e.source(), std::string("not valid TOML: ") + std::string(e.description()));
  }
}

/// Refuses a key of `t` not in `allowed`, naming its line and the keys expected.
inline void check_keys(const toml::table& t, std::initializer_list<std::string_view> allowed, const char* where) {
  for (const auto& [key, node] : t) {
    bool ok = false;
    for (auto a : allowed) ok |= key.str() == a;
    if (!ok) {
      std::string list;
      for (auto a : allowed) {
        if (!list.empty()) list += ", ";
        list += a;
      }
      throw TomlError(node.source(), "unknown key '" + std::string(key.str()) + "' in " + where + " (expected " + list + ")");
    }
  }
}

}  // namespace conveyor::toml_fields
