// Reading JSON documents with errors that name the JSON path ("/ops/3/inputs/1") and what
// was expected there. Shared by every document conveyor reads (graphs, op graphs, profiles,
// plans).
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "common/printable.h"
#include "common/status.h"

namespace conveyor::json_reader {

using nlohmann::json;

/// Thrown while walking a document; turned into a kFormat Status at the document's edge.
class JsonError {
 public:
  JsonError(std::string path, std::string what) : path_(std::move(path)), what_(std::move(what)) {}
  /// "<document> at /ops/3: expected ..."
  Status status(const std::string& document) const {
    return Status(ErrorCode::kFormat, document + " at " + (path_.empty() ? "/" : path_) + ": " + what_);
  }

 private:
  std::string path_, what_;
};

inline const json& field(const json& obj, const std::string& path, const char* key) {
  if (!obj.is_object()) throw JsonError(path, "expected an object");
  auto it = obj.find(key);
  if (it == obj.end()) throw JsonError(path, std::string("missing field '") + key + "'");
  return *it;
}

/// At most this many nested arrays and objects; deeper documents are refused before anything
/// walks them (conveyor's own documents nest fewer than 20 deep).
inline constexpr int kMaxDepth = 128;

using conveyor::printable;

/// A short description of a value for error messages: never the whole value (a bad field may
/// be megabytes, or nested too deep to print).
inline std::string excerpt(const json& j) {
  if (j.is_object()) return "an object of " + std::to_string(j.size()) + " fields";
  if (j.is_array()) return "an array of " + std::to_string(j.size()) + " items";
  if (j.is_string()) return "\"" + printable(j.get_ref<const std::string&>(), 40) + "\"";
  return printable(j.dump(), 40);
}

inline std::int64_t as_int(const json& j, const std::string& path) {
  if (!j.is_number_integer()) throw JsonError(path, "expected an integer, got " + excerpt(j));
  if (j.is_number_unsigned() && j.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    throw JsonError(path, "integer " + excerpt(j) + " is out of range");
  }
  return j.get<std::int64_t>();
}

/// An integer in [lo, hi], checked at its full width before it is narrowed to int.
inline int as_int_in(const json& j, const std::string& path, std::int64_t lo, std::int64_t hi = INT32_MAX) {
  const std::int64_t v = as_int(j, path);
  if (v < lo || v > hi) {
    throw JsonError(path, "expected an integer from " + std::to_string(lo) + " to " + std::to_string(hi) + ", got " +
                              std::to_string(v));
  }
  return static_cast<int>(v);
}

/// An id: an integer from 0 to 2^31-1 (ids are 32-bit; 2^32+6 is not 6).
inline int as_id(const json& j, const std::string& path) { return as_int_in(j, path, 0, INT32_MAX); }

inline std::string as_string(const json& j, const std::string& path) {
  if (!j.is_string()) throw JsonError(path, "expected a string, got " + excerpt(j));
  return j.get<std::string>();
}

inline const json& as_array(const json& j, const std::string& path) {
  if (!j.is_array()) throw JsonError(path, "expected an array, got " + excerpt(j));
  return j;
}

/// A finite number.
inline double as_number(const json& j, const std::string& path) {
  if (!j.is_number()) throw JsonError(path, "expected a number, got " + excerpt(j));
  double v = j.get<double>();
  if (!std::isfinite(v)) throw JsonError(path, "expected a finite number, got " + excerpt(j));
  return v;
}

/// A finite number >= 0 (times, byte counts).
inline double as_amount(const json& j, const std::string& path) {
  if (!j.is_number()) throw JsonError(path, "expected a number, got " + excerpt(j));
  double v = j.get<double>();
  if (!std::isfinite(v) || v < 0) throw JsonError(path, "expected a finite number >= 0, got " + excerpt(j));
  return v;
}

/// `obj[key]` as a non-negative amount, `fallback` when absent.
inline double amount_or(const json& obj, const std::string& path, const char* key, double fallback) {
  auto it = obj.find(key);
  return it == obj.end() ? fallback : as_amount(*it, path + "/" + key);
}

/// `obj[key]` as a list of integers from 0 to 2^31-1 (ids, indices), empty when absent.
inline std::vector<int> int_list(const json& obj, const std::string& path, const char* key) {
  std::vector<int> out;
  auto it = obj.find(key);
  if (it == obj.end()) return out;
  const auto& arr = as_array(*it, path + "/" + key);
  for (std::size_t i = 0; i < arr.size(); ++i) {
    out.push_back(as_id(arr[i], path + "/" + key + "/" + std::to_string(i)));
  }
  return out;
}

/// Checks "format" and "version" of a document; `newest` is the newest version understood.
inline void check_header(const json& doc, const char* format, int newest) {
  if (!doc.is_object()) throw JsonError("", "expected a JSON object");
  std::string f = as_string(field(doc, "", "format"), "/format");
  if (f != format) throw JsonError("/format", "expected \"" + std::string(format) + "\", got " + excerpt(json(f)));
  auto v = as_int(field(doc, "", "version"), "/version");
  if (v < 1 || v > newest) {
    throw JsonError("/version", "version " + std::to_string(v) + " is not supported (this conveyor reads 1.." +
                                    std::to_string(newest) + "); upgrade conveyor or re-create the file");
  }
}

/// How deep a document's arrays and objects nest, read without building it (nlohmann's SAX
/// interface); stops at kMaxDepth. The DOM parser's own depth callback made reading an array
/// of n objects O(n^2) (its end_object walks the parent for discarded values).
class DepthCheck : public nlohmann::json_sax<json> {
 public:
  bool too_deep = false;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return enter(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return leave(); }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override { return leave(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }

 private:
  int depth_ = 0;
  bool enter() {
    too_deep = ++depth_ > kMaxDepth;
    return !too_deep;
  }
  bool leave() {
    --depth_;
    return true;
  }
};

/// Parses `text` as one JSON document of at most kMaxDepth levels; invalid JSON, a number out
/// of double's range and a document nested too deep become kFormat errors naming `document`.
/// Linear in the text: the depth is checked by a first pass that builds nothing.
inline Result<json> parse_json(std::string_view text, const std::string& document) {
  DepthCheck depth;
  json::sax_parse(text.begin(), text.end(), &depth, nlohmann::detail::input_format_t::json, /*strict=*/true);
  if (depth.too_deep) {
    return Status(ErrorCode::kFormat, document + " nests arrays and objects more than " + std::to_string(kMaxDepth) +
                                          " deep; conveyor's documents never do, so it is not one");
  }
  try {
    return json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    std::string what = e.what();  // may quote the offending bytes: keep it short and printable
    return Status(ErrorCode::kFormat, document + " is not valid JSON: " + printable(what, 300));
  }
}

/// Parses `text` and runs `body(doc)` (which returns Result<T>), turning invalid JSON, a
/// JsonError and any other nlohmann error into kFormat errors that name `document`.
template <typename Body>
auto parse_document(std::string_view text, const std::string& document, Body&& body) -> decltype(body(json{})) {
  auto doc = parse_json(text, document);
  if (!doc) return doc.status();
  try {
    return body(*doc);
  } catch (const JsonError& e) {
    return e.status(document);
  } catch (const json::exception& e) {
    return Status(ErrorCode::kFormat, document + ": " + e.what());
  }
}

}  // namespace conveyor::json_reader
