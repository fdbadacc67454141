#include "partitioner/cluster.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "common/file.h"
#include "common/toml_reader.h"

namespace conveyor::partitioner {
namespace {

using toml::check_keys;
using toml::TomlError;

// Splits "80 GiB" into 80 and "GiB".
bool split_number(std::string_view text, double& number, std::string& unit) {
  std::string s(text);
  std::size_t pos = 0;
  try {
    number = std::stod(s, &pos);
  } catch (...) {
    return false;
  }
  while (pos < s.size() && std::isspace(static_cast<unsigned char>(s[pos]))) ++pos;
  unit = s.substr(pos);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  return std::isfinite(number) && number >= 0;
}

Result<double> scaled(std::string_view text, const std::vector<std::pair<std::string, double>>& units,
                      const char* expected) {
  double n = 0;
  std::string unit;
  if (split_number(text, n, unit)) {
    for (const auto& [name, factor] : units) {
      if (unit == name) return n * factor;
    }
  }
  std::string msg = "'";
  msg.append(text).append("' is not ").append(expected);
  return Status(ErrorCode::kInvalidArgument, std::move(msg));
}

// A quantity given as a number (base unit) or a string with a unit.
double quantity(const toml::Node& t, std::string_view key, const char* where,
                Result<double> (*parse)(std::string_view), double fallback, bool required) {
  const toml::Node* n = t.get(key);
  if (!n) {
    if (required) throw TomlError(t.line(), "missing key '" + std::string(key) + "' in " + where);
    return fallback;
  }
  if (auto v = n->number()) {
    if (!std::isfinite(*v) || *v < 0) throw TomlError(n->line(), std::string(key) + " must be a number >= 0");
    return *v;
  }
  if (auto s = n->string()) {
    auto r = parse(*s);
    if (!r) throw TomlError(n->line(), std::string(key) + ": " + r.status().message());
    return *r;
  }
  throw TomlError(n->line(), std::string(key) + " must be a number or a string with a unit");
}

int positive_int(const toml::Node& t, std::string_view key, const char* where, int fallback) {
  const toml::Node* n = t.get(key);
  if (!n) return fallback;
  auto v = n->integer();
  if (!v || !n->is_integer() || *v < 1 || *v > (1 << 20)) {
    throw TomlError(n->line(), std::string(key) + " in " + where + " must be a positive integer");
  }
  return static_cast<int>(*v);
}

Link parse_link(const toml::Node& root, std::string_view key) {
  Link l;
  const toml::Node* n = root.get(key);
  if (!n) throw TomlError(root.line(), "missing table [link." + std::string(key) + "] (bandwidth, latency)");
  const toml::Node* t = n->as_table();
  if (!t) throw TomlError(n->line(), "link." + std::string(key) + " must be a table with bandwidth and latency");
  const std::string where = "[link." + std::string(key) + "]";
  check_keys(*t, {"bandwidth", "latency"}, where.c_str());
  l.bandwidth_bytes_per_s = quantity(*t, "bandwidth", where.c_str(), parse_bandwidth, 0, true);
  l.latency_s = quantity(*t, "latency", where.c_str(), parse_duration, 0, false);
  if (l.bandwidth_bytes_per_s <= 0) throw TomlError(t->line(), where + " bandwidth must be positive");
  return l;
}

}  // namespace

Result<double> parse_bytes(std::string_view text) {
  return scaled(text,
                {{"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"KiB", 1024.0},
                 {"MiB", 1024.0 * 1024}, {"GiB", 1024.0 * 1024 * 1024}, {"TiB", 1024.0 * 1024 * 1024 * 1024}},
                "a size (a number of bytes, or with B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)");
}

Result<double> parse_bandwidth(std::string_view text) {
  return scaled(text,
                {{"", 1}, {"B/s", 1}, {"KB/s", 1e3}, {"MB/s", 1e6}, {"GB/s", 1e9}, {"TB/s", 1e12},
                 {"GiB/s", 1024.0 * 1024 * 1024}, {"Mbit/s", 1e6 / 8}, {"Gbit/s", 1e9 / 8}, {"Tbit/s", 1e12 / 8}},
                "a bandwidth (bytes per second, or with B/s, MB/s, GB/s, GiB/s, TB/s, Mbit/s, Gbit/s, Tbit/s)");
}

Result<double> parse_duration(std::string_view text) {
  return scaled(text, {{"", 1}, {"s", 1}, {"ms", 1e-3}, {"us", 1e-6}, {"ns", 1e-9}},
                "a duration (seconds, or with s, ms, us, ns)");
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (std::fabs(b) >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.1f %s" : "%.0f %s", b, units[u]);
  return buf;
}

std::string human_seconds(double s) {
  if (s < 0) return "-" + human_seconds(-s);
  char buf[32];
  if (s >= 1) std::snprintf(buf, sizeof buf, "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof buf, "%.3f ms", s * 1e3);
  else std::snprintf(buf, sizeof buf, "%.1f us", s * 1e6);
  return buf;
}

Cluster Cluster::uniform(int nodes, int per_node, double memory_bytes, double speed, Link intra, Link inter) {
  Cluster c;
  c.name = std::to_string(nodes) + "x" + std::to_string(per_node);
  c.nodes = nodes;
  c.intra_node = intra;
  c.inter_node = inter;
  for (int n = 0; n < nodes; ++n) {
    for (int d = 0; d < per_node; ++d) c.devices.push_back({n, d, memory_bytes, speed});
  }
  return c;
}

Result<Cluster> Cluster::from_toml(std::string_view text, const std::string& source) {
  try {
    const toml::Node root = toml::parse(text);
    check_keys(root, {"name", "node", "link"}, "the cluster file");
    Cluster c;
    if (const toml::Node* n = root.get("name")) {
      auto s = n->string();
      if (!s) throw TomlError(n->line(), "name must be a string");
      c.name = *s;
    }
    const toml::Node* nodes = root.get("node");
    if (!nodes) throw TomlError(1, "missing [[node]] entries (count, devices, memory, speed)");
    const toml::Node* arr = nodes->as_array();
    if (!arr || arr->items().empty()) throw TomlError(nodes->line(), "node must be an array of tables: write [[node]]");
    for (const toml::Node& entry : arr->items()) {
      const toml::Node* t = entry.as_table();
      if (!t) throw TomlError(entry.line(), "each node entry must be a table: write [[node]]");
      check_keys(*t, {"count", "devices", "memory", "speed"}, "[[node]]");
      const int count = positive_int(*t, "count", "[[node]]", 1);
      const int devices = positive_int(*t, "devices", "[[node]]", 1);
      const double memory = quantity(*t, "memory", "[[node]]", parse_bytes, 0, true);
      if (memory <= 0) throw TomlError(t->line(), "memory in [[node]] must be positive");
      double speed = 1;
      if (const toml::Node* s = t->get("speed")) {
        auto v = s->number();
        if (!v || !std::isfinite(*v) || *v <= 0) throw TomlError(s->line(), "speed must be a number > 0 (1 = the profiled device)");
        speed = *v;
      }
      if (c.devices.size() + static_cast<std::size_t>(count) * static_cast<std::size_t>(devices) > kMostDevices) {
        throw TomlError(t->line(), "more than 2^20 devices");
      }
      for (int n = 0; n < count; ++n, ++c.nodes) {
        for (int d = 0; d < devices; ++d) c.devices.push_back({c.nodes, d, memory, speed});
      }
    }
    if (c.devices.size() > kMostDevices) throw TomlError(1, "more than 2^20 devices");
    const toml::Node* link = root.get("link");
    if (!link || !link->as_table()) {
      throw TomlError(link ? link->line() : 1,
                      "missing tables [link.intra_node] and [link.inter_node] (bandwidth, latency)");
    }
    const toml::Node& links = *link->as_table();
    check_keys(links, {"intra_node", "inter_node"}, "[link]");
    c.intra_node = parse_link(links, "intra_node");
    if (c.nodes > 1 || links.get("inter_node")) c.inter_node = parse_link(links, "inter_node");
    if (c.name.empty()) c.name = source;
    return c;
  } catch (const TomlError& e) {
    return e.status(source);
  }
}

Result<Cluster> load_cluster(const std::string& path) {
  CONVEYOR_ASSIGN_OR_RETURN(std::string text, read_file(path, "cluster file", kConfigFileLimit));
  return Cluster::from_toml(text, path);
}

std::string Cluster::summary() const {
  std::string out = name + ": " + std::to_string(devices.size()) + " devices on " + std::to_string(nodes) + " node" +
                    (nodes == 1 ? "" : "s");
  return out;
}

}  // namespace conveyor::partitioner
