#include "trace/span_record.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

namespace conveyor::trace {

using scheduler::ActionKind;
using scheduler::Span;

std::string span_record(const std::vector<Span>& spans, std::int64_t wall_start_ns) {
  auto rows = nlohmann::json::array();
  for (const Span& s : spans) {
    rows.push_back({s.rank, s.replica, static_cast<int>(s.stream), static_cast<int>(s.action.kind),
                    s.action.microbatch, s.action.stage, s.action.peer, s.start_s, s.end_s});
  }
  return nlohmann::json{{"wall_start_ns", wall_start_ns}, {"spans", std::move(rows)}}.dump();
}

namespace {

constexpr int kStreams = static_cast<int>(Span::Stream::kWaitingForProcesses) + 1;
constexpr int kKinds = static_cast<int>(ActionKind::kOptimizerStep) + 1;

// One row of a record: [rank, replica, stream, kind, microbatch, stage, peer, start, end].
Result<Span> span_of(const nlohmann::json& row, int ranks) {
  if (!row.is_array() || row.size() != 9) return Status(ErrorCode::kFormat, "a span is not a row of 9 values");
  for (std::size_t k = 0; k < 7; ++k) {
    if (!row[k].is_number_integer()) return Status(ErrorCode::kFormat, "a span's field " + std::to_string(k) + " is not an integer");
  }
  if (!row[7].is_number() || !row[8].is_number()) return Status(ErrorCode::kFormat, "a span's times are not numbers");
  Span s;
  s.rank = row[0].get<int>();
  s.replica = row[1].get<int>();
  const int stream = row[2].get<int>(), kind = row[3].get<int>();
  s.action.microbatch = row[4].get<int>();
  s.action.stage = row[5].get<int>();
  s.action.peer = row[6].get<int>();
  s.start_s = row[7].get<double>();
  s.end_s = row[8].get<double>();
  if (s.rank < 0 || s.rank >= ranks || s.replica < 0 || stream < 0 || stream >= kStreams || kind < 0 || kind >= kKinds ||
      s.action.peer < -1 || s.action.peer >= ranks || !std::isfinite(s.start_s) || !std::isfinite(s.end_s) ||
      s.end_s < s.start_s) {
    return Status(ErrorCode::kFormat, "a span names a rank, stream, action or time this pipeline of " +
                                          std::to_string(ranks) + " ranks cannot have");
  }
  s.stream = static_cast<Span::Stream>(stream);
  s.action.kind = static_cast<ActionKind>(kind);
  return s;
}

}  // namespace

Result<std::vector<Span>> merge_span_records(const std::vector<std::string>& records, int ranks) {
  std::vector<std::int64_t> starts;
  std::vector<std::vector<Span>> parts;
  for (std::size_t p = 0; p < records.size(); ++p) {
    auto fail = [p](const std::string& why) {
      return Status(ErrorCode::kFormat, "the spans of process " + std::to_string(p) + " do not read: " + why);
    };
    const auto doc = nlohmann::json::parse(records[p], nullptr, /*allow_exceptions=*/false);
    if (!doc.is_object() || !doc.contains("wall_start_ns") || !doc["wall_start_ns"].is_number_integer() ||
        !doc.contains("spans") || !doc["spans"].is_array()) {
      return fail("expected {\"wall_start_ns\": integer, \"spans\": [...]}");
    }
    starts.push_back(doc["wall_start_ns"].get<std::int64_t>());
    auto& spans = parts.emplace_back();
    for (const auto& row : doc["spans"]) {
      auto span = span_of(row, ranks);
      if (!span.is_ok()) return fail(span.status().message());
      spans.push_back(*span);
    }
  }
  std::vector<Span> out;
  if (starts.empty()) return out;
  const std::int64_t first = *std::min_element(starts.begin(), starts.end());
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const double shift = static_cast<double>(starts[p] - first) * 1e-9;
    for (Span s : parts[p]) {
      s.start_s += shift;
      s.end_s += shift;
      out.push_back(s);
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const Span& a, const Span& b) {
    return a.rank != b.rank ? a.rank < b.rank : a.start_s < b.start_s;
  });
  return out;
}

}  // namespace conveyor::trace
