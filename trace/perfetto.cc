#include "trace/perfetto.h"

#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

#include "common/file.h"

namespace conveyor::trace {
namespace {

// ---- protobuf encoding ------------------------------------------------------------------

void varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire) { varint(out, (static_cast<std::uint64_t>(field) << 3) | wire); }
void put_varint(std::string& out, int field, std::uint64_t v) {
  key(out, field, 0);
  varint(out, v);
}
void put_bytes(std::string& out, int field, std::string_view b) {
  key(out, field, 2);
  varint(out, b.size());
  out.append(b);
}
void put_fixed64(std::string& out, int field, std::uint64_t v) {
  key(out, field, 1);
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

constexpr std::uint32_t kSequenceId = 1;

// ---- protobuf decoding ------------------------------------------------------------------

struct Field {
  int number = 0;
  int wire = 0;
  std::uint64_t value = 0;  // varint / fixed64
  std::string_view bytes;   // length-delimited
};

class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  bool done() const { return pos_ >= data_.size(); }
  // False on malformed input.
  bool next(Field& f) {
    std::uint64_t k = 0;
    if (!read_varint(k)) return false;
    f.number = static_cast<int>(k >> 3);
    f.wire = static_cast<int>(k & 7);
    if (f.number == 0) return false;
    switch (f.wire) {
      case 0: return read_varint(f.value);
      case 1:
        if (data_.size() - pos_ < 8) return false;
        f.value = 0;
        for (int i = 0; i < 8; ++i) f.value |= static_cast<std::uint64_t>(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
        pos_ += 8;
        return true;
      case 2: {
        std::uint64_t len = 0;
        if (!read_varint(len) || len > data_.size() - pos_) return false;
        f.bytes = data_.substr(pos_, len);
        pos_ += len;
        return true;
      }
      case 5:
        if (data_.size() - pos_ < 4) return false;
        pos_ += 4;
        return true;
      default: return false;
    }
  }

 private:
  bool read_varint(std::uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) return false;
      auto b = static_cast<unsigned char>(data_[pos_++]);
      v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }
  std::string_view data_;
  std::size_t pos_ = 0;
};

std::string name_family(const std::string& name) {
  std::size_t i = 0;
  while (i < name.size() && std::isalpha(static_cast<unsigned char>(name[i]))) ++i;
  return name.substr(0, i);
}

}  // namespace

std::uint64_t PerfettoTrace::add_track(const std::string& name, std::uint64_t parent) {
  const std::uint64_t uuid = next_uuid_++;
  tracks_.push_back({uuid, parent, name});
  return uuid;
}

void PerfettoTrace::slice(std::uint64_t track, std::uint64_t start_ns, std::uint64_t end_ns, const std::string& name,
                          const std::vector<std::uint64_t>& flows) {
  events_.push_back({start_ns, 1, 1, track, name, flows, events_.size()});
  events_.push_back({std::max(start_ns, end_ns), 2, end_ns > start_ns ? 0 : 2, track, "", {}, events_.size()});
}

void PerfettoTrace::instant(std::uint64_t track, std::uint64_t t_ns, const std::string& name) {
  events_.push_back({t_ns, 3, 1, track, name, {}, events_.size()});
}

std::vector<const PerfettoTrace::Event*> PerfettoTrace::in_time_order() const {
  std::vector<const Event*> order;
  for (const auto& e : events_) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const Event* a, const Event* b) {
    if (a->t != b->t) return a->t < b->t;
    if (a->priority != b->priority) return a->priority < b->priority;
    return a->order < b->order;
  });
  return order;
}

std::string PerfettoTrace::serialize() const {
  std::string out;
  auto packet = [&](const std::string& body) { put_bytes(out, 1, body); };
  for (const auto& t : tracks_) {
    std::string desc;
    put_varint(desc, 1, t.uuid);
    put_bytes(desc, 2, t.name);
    if (t.parent) put_varint(desc, 5, t.parent);
    std::string p;
    put_varint(p, 10, kSequenceId);
    put_bytes(p, 60, desc);
    packet(p);
  }
  for (const Event* e : in_time_order()) {
    std::string ev;
    put_varint(ev, 9, static_cast<std::uint64_t>(e->type));
    put_varint(ev, 11, e->track);
    if (!e->name.empty()) put_bytes(ev, 23, e->name);
    for (auto f : e->flows) put_fixed64(ev, 47, f);
    std::string p;
    put_varint(p, 8, e->t);
    put_varint(p, 10, kSequenceId);
    put_bytes(p, 11, ev);
    packet(p);
  }
  return out;
}

std::string PerfettoTrace::chrome_json() const {
  std::map<std::uint64_t, std::uint64_t> parent;
  for (const auto& t : tracks_) parent[t.uuid] = t.parent;
  auto process_of = [&](std::uint64_t uuid) {
    while (parent.count(uuid) != 0 && parent[uuid] != 0) uuid = parent[uuid];
    return uuid;
  };
  auto events = nlohmann::json::array();
  for (const auto& t : tracks_) {
    if (t.parent == 0) {
      events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", t.uuid}, {"args", {{"name", t.name}}}});
    }
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", process_of(t.uuid)}, {"tid", t.uuid},
                      {"args", {{"name", t.name}}}});
  }
  const std::vector<const Event*> order = in_time_order();
  const std::uint64_t first = order.empty() ? 0 : order.front()->t;
  std::set<std::uint64_t> started;  // flows whose "s" is written
  for (const Event* e : order) {
    const double ts = static_cast<double>(e->t - first) / 1e3;
    nlohmann::json ev = {{"pid", process_of(e->track)}, {"tid", e->track}, {"ts", ts}};
    if (e->type == 1) {
      ev["ph"] = "B";
      ev["name"] = e->name;
    } else if (e->type == 2) {
      ev["ph"] = "E";
    } else {
      ev["ph"] = "i";
      ev["s"] = "t";
      ev["name"] = e->name;
    }
    events.push_back(ev);
    for (std::uint64_t f : e->flows) {
      nlohmann::json flow = {{"name", "flow"}, {"cat", "flow"}, {"id", f}, {"pid", process_of(e->track)},
                             {"tid", e->track}, {"ts", ts}};
      if (started.insert(f).second) {
        flow["ph"] = "s";
      } else {
        flow["ph"] = "f";
        flow["bp"] = "e";
      }
      events.push_back(flow);
    }
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump();
}

Status PerfettoTrace::write(const std::string& path) const {
  const bool json = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
  return write_file(path, json ? chrome_json() : serialize(), "trace");
}

Result<TraceSummary> check_trace(std::string_view bytes) {
  auto bad = [](std::size_t packet, const std::string& what) {
    return Status(ErrorCode::kFormat, "trace packet " + std::to_string(packet) + ": " + what);
  };
  TraceSummary s;
  std::map<std::uint64_t, std::string> tracks;
  std::map<std::uint64_t, std::vector<std::pair<std::uint64_t, std::string>>> open;  // track -> (begin time, name)
  std::map<std::uint64_t, std::uint64_t> last_time;
  std::map<std::uint64_t, std::size_t> flow_uses;
  Reader trace(bytes);
  std::size_t index = 0;
  if (bytes.empty()) return Status(ErrorCode::kFormat, "the trace is empty");
  while (!trace.done()) {
    Field f;
    if (!trace.next(f)) return bad(index, "malformed protobuf (truncated or not a trace)");
    if (f.number != 1 || f.wire != 2) return bad(index, "expected a TracePacket (field 1)");
    Reader packet(f.bytes);
    std::uint64_t timestamp = 0;
    bool has_time = false;
    std::string_view event, descriptor;
    while (!packet.done()) {
      Field pf;
      if (!packet.next(pf)) return bad(index, "malformed TracePacket");
      if (pf.number == 8 && pf.wire == 0) {
        timestamp = pf.value;
        has_time = true;
      }
      if (pf.number == 11 && pf.wire == 2) event = pf.bytes;
      if (pf.number == 60 && pf.wire == 2) descriptor = pf.bytes;
    }
    if (!descriptor.empty()) {
      Reader d(descriptor);
      std::uint64_t uuid = 0, parent = 0;
      std::string name;
      while (!d.done()) {
        Field df;
        if (!d.next(df)) return bad(index, "malformed TrackDescriptor");
        if (df.number == 1 && df.wire == 0) uuid = df.value;
        if (df.number == 2 && df.wire == 2) name = std::string(df.bytes);
        if (df.number == 5 && df.wire == 0) parent = df.value;
      }
      if (uuid == 0) return bad(index, "a track without a uuid");
      if (parent && !tracks.count(parent)) return bad(index, "track '" + name + "' names an undeclared parent");
      if (!tracks.emplace(uuid, name).second) return bad(index, "track uuid " + std::to_string(uuid) + " declared twice");
      ++s.tracks;
    }
    if (!event.empty()) {
      if (!has_time) return bad(index, "a track event without a timestamp");
      Reader e(event);
      std::uint64_t type = 0, track = 0;
      std::string name;
      std::vector<std::uint64_t> flows;
      while (!e.done()) {
        Field ef;
        if (!e.next(ef)) return bad(index, "malformed TrackEvent");
        if (ef.number == 9 && ef.wire == 0) type = ef.value;
        if (ef.number == 11 && ef.wire == 0) track = ef.value;
        if (ef.number == 23 && ef.wire == 2) name = std::string(ef.bytes);
        if (ef.number == 47 && ef.wire == 1) flows.push_back(ef.value);
      }
      auto t = tracks.find(track);
      if (t == tracks.end()) return bad(index, "an event on undeclared track " + std::to_string(track));
      auto& lt = last_time[track];
      if (timestamp < lt) return bad(index, "time goes backwards on track '" + t->second + "'");
      lt = timestamp;
      if (type == 1) {
        open[track].emplace_back(timestamp, name);
        for (auto fl : flows) ++flow_uses[fl];
      } else if (type == 2) {
        auto& stack = open[track];
        if (stack.empty()) return bad(index, "a slice ends on track '" + t->second + "' without a begin");
        ++s.slices;
        ++s.slices_by_track[t->second];
        ++s.slices_by_name[name_family(stack.back().second)];
        stack.pop_back();
      } else if (type == 3) {
        ++s.instants;
        for (auto fl : flows) ++flow_uses[fl];
      } else {
        return bad(index, "unknown event type " + std::to_string(type));
      }
    }
    ++index;
  }
  for (const auto& [track, stack] : open) {
    if (!stack.empty()) {
      return Status(ErrorCode::kFormat, "slice '" + stack.back().second + "' on track '" + tracks[track] + "' never ends");
    }
  }
  for (const auto& [id, uses] : flow_uses) {
    if (uses < 2) return Status(ErrorCode::kFormat, "flow " + std::to_string(id) + " starts but never arrives");
  }
  s.flows = flow_uses.size();
  return s;
}

Result<TraceSummary> check_trace_file(const std::string& path) {
  CONVEYOR_ASSIGN_OR_RETURN(std::string bytes, read_file(path, "trace", kLargeFileLimit));
  auto r = check_trace(bytes);
  if (!r) return r.status().with_context(path);
  return r;
}

}  // namespace conveyor::trace
