// Reading JSON documents with errors that name the JSON path ("/ops/3/inputs/1") and what
// was expected there. Shared by every document conveyor reads (graphs, op graphs, profiles,
// plans).
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

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

inline std::int64_t as_int(const json& j, const std::string& path) {
  if (!j.is_number_integer()) throw JsonError(path, "expected an integer, got " + j.dump());
  return j.get<std::int64_t>();
}

inline std::string as_string(const json& j, const std::string& path) {
  if (!j.is_string()) throw JsonError(path, "expected a string, got " + j.dump());
  return j.get<std::string>();
}

inline const json& as_array(const json& j, const std::string& path) {
  if (!j.is_array()) throw JsonError(path, "expected an array");
  return j;
}

/// A finite number >= 0 (times, byte counts).
inline double as_amount(const json& j, const std::string& path) {
  if (!j.is_number()) throw JsonError(path, "expected a number, got " + j.dump());
  double v = j.get<double>();
  if (!std::isfinite(v) || v < 0) throw JsonError(path, "expected a finite number >= 0, got " + j.dump());
  return v;
}

/// `obj[key]` as a non-negative amount, `fallback` when absent.
inline double amount_or(const json& obj, const std::string& path, const char* key, double fallback) {
  auto it = obj.find(key);
  return it == obj.end() ? fallback : as_amount(*it, path + "/" + key);
}

/// `obj[key]` as a list of integers, empty when absent.
inline std::vector<int> int_list(const json& obj, const std::string& path, const char* key) {
  std::vector<int> out;
  auto it = obj.find(key);
  if (it == obj.end()) return out;
  const auto& arr = as_array(*it, path + "/" + key);
  for (std::size_t i = 0; i < arr.size(); ++i) {
    out.push_back(static_cast<int>(as_int(arr[i], path + "/" + key + "/" + std::to_string(i))));
  }
  return out;
}

/// Checks "format" and "version" of a document; `newest` is the newest version understood.
inline void check_header(const json& doc, const char* format, int newest) {
  if (!doc.is_object()) throw JsonError("", "expected a JSON object");
  std::string f = as_string(field(doc, "", "format"), "/format");
  if (f != format) throw JsonError("/format", "expected \"" + std::string(format) + "\", got \"" + f + "\"");
  auto v = as_int(field(doc, "", "version"), "/version");
  if (v < 1 || v > newest) {
    throw JsonError("/version", "version " + std::to_string(v) + " is not supported (this conveyor reads 1.." +
                                    std::to_string(newest) + "); upgrade conveyor or re-create the file");
  }
}

/// Parses `text` and runs `body(doc)` (which returns Result<T>), turning invalid JSON, a
/// JsonError and any other nlohmann error into kFormat errors that name `document`.
template <typename Body>
auto parse_document(std::string_view text, const std::string& document, Body&& body) -> decltype(body(json{})) {
  json doc;
  try {
    doc = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    return Status(ErrorCode::kFormat, document + " is not valid JSON: " + e.what());
  }
  try {
    return body(doc);
  } catch (const JsonError& e) {
    return e.status(document);
  } catch (const json::exception& e) {
    return Status(ErrorCode::kFormat, document + ": " + e.what());
  }
}

}  // namespace conveyor::json_reader
