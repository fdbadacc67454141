// Plan documents (docs/formats.md) and the table `conveyor plan` prints.
#include <algorithm>
#include <cstdio>
#include <optional>
#include <set>
#include <string>

#include "common/file.h"
#include "common/json_reader.h"
#include "common/shares.h"
#include "partitioner/planner.h"

namespace conveyor::partitioner {
namespace {

using json_reader::JsonError;
using nlohmann::json;
using namespace json_reader;

constexpr int kPlanVersion = 1;

json link_json(const Link& l) { return {{"bandwidth_bytes_per_s", l.bandwidth_bytes_per_s}, {"latency_s", l.latency_s}}; }

Link parse_link(const json& j, const std::string& path) {
  const double bandwidth = as_amount(field(j, path, "bandwidth_bytes_per_s"), path + "/bandwidth_bytes_per_s");
  // A link of no bandwidth is no link: it priced every transfer as free.
  if (bandwidth <= 0) throw JsonError(path + "/bandwidth_bytes_per_s", "expected a bandwidth > 0");
  return {bandwidth, as_amount(field(j, path, "latency_s"), path + "/latency_s")};
}

}  // namespace

std::string Plan::to_json() const {
  json doc;
  doc["format"] = "conveyor.plan";
  doc["version"] = kPlanVersion;
  doc["graph"] = graph_name;
  doc["cluster"] = cluster_name;
  doc["batch"] = batch;
  doc["microbatches"] = microbatches;
  doc["schedule"] = std::string(scheduler::schedule_kind_name(schedule));
  doc["chunks"] = chunks;
  doc["objective_s"] = objective_s;
  doc["predicted_step_s"] = predicted_step_s;
  doc["bubble_fraction"] = bubble_fraction;
  doc["search"] = search;
  doc["search_seconds"] = search_seconds;
  json devs = json::array();
  for (const auto& d : devices) {
    devs.push_back({{"node", d.node}, {"local", d.local}, {"memory_bytes", d.memory_bytes}, {"speed", d.speed}});
  }
  doc["devices"] = std::move(devs);
  json st = json::array();
  for (const auto& s : stages) {
    st.push_back({{"ops", s.ops},
                  {"first_device", s.first_device},
                  {"replicas", s.replicas},
                  {"shares", s.shares},
                  {"forward_s", s.forward_s},
                  {"backward_s", s.backward_s},
                  {"backward_weight_s", s.backward_weight_s},
                  {"send_bytes", s.send_bytes},
                  {"recv_bytes", s.recv_bytes},
                  {"allreduce_s", s.allreduce_s},
                  {"optimizer_s", s.optimizer_s},
                  {"param_bytes", s.param_bytes},
                  {"static_bytes", s.static_bytes},
                  {"weight_grad_bytes", s.weight_grad_bytes},
                  {"saved_bytes", s.saved_bytes},
                  {"input_freed_bytes", s.input_freed_bytes},
                  {"captured_bytes", s.captured_bytes},
                  {"backward_extra_bytes", s.backward_extra_bytes},
                  {"split_backward_extra_bytes", s.split_backward_extra_bytes},
                  {"memory_bytes", s.memory_bytes},
                  {"in_flight", s.in_flight},
                  {"recompute", std::string(recomputation_name(s.recompute))}});
  }
  doc["stages"] = std::move(st);
  json ls = json::array();
  for (const auto& l : links) ls.push_back(link_json(l));
  doc["links"] = std::move(ls);
  return doc.dump(1);
}

Result<Plan> Plan::from_json(std::string_view text) {
  return parse_document(text, "plan document", [&](const json& doc) -> Result<Plan> {
    check_header(doc, "conveyor.plan", kPlanVersion);
    Plan p;
    p.graph_name = as_string(field(doc, "", "graph"), "/graph");
    p.cluster_name = as_string(field(doc, "", "cluster"), "/cluster");
    p.batch = as_int_in(field(doc, "", "batch"), "/batch", 1);
    p.microbatches = as_int_in(field(doc, "", "microbatches"), "/microbatches", 1);
    if (p.batch < 1 || p.microbatches < 1 || p.microbatches > p.batch) {
      throw JsonError("/microbatches", "expected 1 <= microbatches <= batch");
    }
    auto kind = scheduler::schedule_kind_from_name(as_string(field(doc, "", "schedule"), "/schedule"));
    if (!kind) throw JsonError("/schedule", kind.status().message());
    p.schedule = *kind;
    p.chunks = as_int_in(field(doc, "", "chunks"), "/chunks", 1, 1024);
    p.objective_s = amount_or(doc, "", "objective_s", 0);
    p.predicted_step_s = amount_or(doc, "", "predicted_step_s", 0);
    p.bubble_fraction = amount_or(doc, "", "bubble_fraction", 0);
    if (doc.contains("search")) p.search = as_string(doc["search"], "/search");
    p.search_seconds = amount_or(doc, "", "search_seconds", 0);
    const auto& devs = as_array(field(doc, "", "devices"), "/devices");
    if (devs.size() > kMostDevices) throw JsonError("/devices", "more than 2^20 devices");
    for (std::size_t i = 0; i < devs.size(); ++i) {
      const std::string path = "/devices/" + std::to_string(i);
      Device d;
      d.node = as_id(field(devs[i], path, "node"), path + "/node");
      d.local = as_id(field(devs[i], path, "local"), path + "/local");
      d.memory_bytes = as_amount(field(devs[i], path, "memory_bytes"), path + "/memory_bytes");
      d.speed = as_amount(field(devs[i], path, "speed"), path + "/speed");
      if (d.speed <= 0) throw JsonError(path + "/speed", "expected a speed > 0");
      p.devices.push_back(d);
    }
    const auto& st = as_array(field(doc, "", "stages"), "/stages");
    if (st.empty()) throw JsonError("/stages", "a plan needs at least one stage");
    std::set<int> ops_seen;
    for (std::size_t i = 0; i < st.size(); ++i) {
      const std::string path = "/stages/" + std::to_string(i);
      const json& j = st[i];
      StagePlan s;
      s.ops = int_list(j, path, "ops");
      if (s.ops.empty()) throw JsonError(path + "/ops", "a stage needs at least one operator");
      for (std::size_t k = 0; k < s.ops.size(); ++k) {
        if (!ops_seen.insert(s.ops[k]).second) {
          throw JsonError(path + "/ops/" + std::to_string(k), "operator " + std::to_string(s.ops[k]) + " is in two stages");
        }
      }
      s.first_device = as_id(field(j, path, "first_device"), path + "/first_device");
      s.replicas = as_int_in(field(j, path, "replicas"), path + "/replicas", 1);
      if (static_cast<std::int64_t>(s.first_device) + s.replicas > static_cast<std::int64_t>(p.devices.size())) {
        throw JsonError(path, "devices " + std::to_string(s.first_device) + ".." +
                                  std::to_string(s.first_device + s.replicas - 1) + " are not in the plan's " +
                                  std::to_string(p.devices.size()) + " devices");
      }
      for (const char* key : {"forward_s", "backward_s", "backward_weight_s", "send_bytes", "recv_bytes", "allreduce_s",
                              "param_bytes", "static_bytes", "saved_bytes", "memory_bytes"}) {
        as_amount(field(j, path, key), path + "/" + key);
      }
      s.forward_s = j["forward_s"].get<double>();
      s.backward_s = j["backward_s"].get<double>();
      s.backward_weight_s = j["backward_weight_s"].get<double>();
      if (s.backward_weight_s > s.backward_s) throw JsonError(path + "/backward_weight_s", "exceeds backward_s");
      s.send_bytes = j["send_bytes"].get<double>();
      s.recv_bytes = j["recv_bytes"].get<double>();
      s.allreduce_s = j["allreduce_s"].get<double>();
      s.param_bytes = j["param_bytes"].get<double>();
      s.static_bytes = j["static_bytes"].get<double>();
      s.saved_bytes = j["saved_bytes"].get<double>();
      if (j.contains("input_freed_bytes")) {  // may be negative: a stage recomputing fully
        s.input_freed_bytes = as_number(j["input_freed_bytes"], path + "/input_freed_bytes");
      }
      if (j.contains("weight_grad_bytes")) {
        s.weight_grad_bytes = as_amount(j["weight_grad_bytes"], path + "/weight_grad_bytes");
      }
      if (j.contains("optimizer_s")) s.optimizer_s = as_amount(j["optimizer_s"], path + "/optimizer_s");
      if (j.contains("captured_bytes")) s.captured_bytes = as_amount(j["captured_bytes"], path + "/captured_bytes");
      if (j.contains("backward_extra_bytes")) {
        s.backward_extra_bytes = as_amount(j["backward_extra_bytes"], path + "/backward_extra_bytes");
      }
      if (j.contains("split_backward_extra_bytes")) {
        s.split_backward_extra_bytes =
            as_amount(j["split_backward_extra_bytes"], path + "/split_backward_extra_bytes");
      }
      s.memory_bytes = j["memory_bytes"].get<double>();
      if (j.contains("in_flight")) s.in_flight = as_int_in(j["in_flight"], path + "/in_flight", 0);
      if (j.contains("recompute")) {
        // true and false: plans written before selective recomputation (full, none).
        const auto& r = j["recompute"];
        std::optional<Recomputation> mode;
        if (r.is_boolean()) mode = r.get<bool>() ? Recomputation::kFull : Recomputation::kNone;
        if (r.is_string()) mode = recomputation_from_name(r.get<std::string>());
        if (!mode) throw JsonError(path + "/recompute", "expected \"none\", \"selective\" or \"full\"");
        s.recompute = *mode;
      }
      if (j.contains("shares")) {
        const auto& sh = as_array(j["shares"], path + "/shares");
        if (!sh.empty() && sh.size() != static_cast<std::size_t>(s.replicas)) {
          throw JsonError(path + "/shares", "expected one share per replica (" + std::to_string(s.replicas) + "), got " +
                                                std::to_string(sh.size()));
        }
        double total = 0;
        for (std::size_t k = 0; k < sh.size(); ++k) {
          s.shares.push_back(as_amount(sh[k], path + "/shares/" + std::to_string(k)));
          total += s.shares.back();
        }
        if (!sh.empty() && !(total > 0)) throw JsonError(path + "/shares", "the shares add up to 0");
      }
      p.stages.push_back(std::move(s));
    }
    if (p.chunks < 1 || p.stages.size() % static_cast<std::size_t>(p.chunks) != 0) {
      throw JsonError("/chunks", "expected a divisor of the stage count " + std::to_string(p.stages.size()));
    }
    if (scheduler::is_v_shape(p.schedule) && p.chunks != 2) {
      throw JsonError("/chunks", "expected 2 (ZB-V and DualPipeV hold two stages per device group)");
    }
    const auto& ls = as_array(field(doc, "", "links"), "/links");
    if (ls.size() + 1 != p.stages.size()) {
      throw JsonError("/links", "expected " + std::to_string(p.stages.size() - 1) + " links (one per stage boundary)");
    }
    for (std::size_t i = 0; i < ls.size(); ++i) p.links.push_back(parse_link(ls[i], "/links/" + std::to_string(i)));
    return p;
  });
}

Result<Plan> load_plan(const std::string& path) {
  CONVEYOR_ASSIGN_OR_RETURN(std::string text, read_file(path, "plan file"));
  auto p = Plan::from_json(text);
  if (!p) return p.status().with_context(path);
  return p;
}

std::string Plan::table() const {
  std::string out;
  char line[512];
  auto device_range = [&](const StagePlan& s) {
    const Device& a = devices[s.first_device];
    const Device& b = devices[s.first_device + s.replicas - 1];
    char buf[64];
    if (s.replicas == 1) std::snprintf(buf, sizeof buf, "n%d:d%d", a.node, a.local);
    else if (a.node == b.node) std::snprintf(buf, sizeof buf, "n%d:d%d-%d", a.node, a.local, b.local);
    else std::snprintf(buf, sizeof buf, "n%d:d%d-n%d:d%d", a.node, a.local, b.node, b.local);
    return std::string(buf);
  };
  std::snprintf(line, sizeof line, "%-5s %6s  %-18s %8s %11s %11s %11s %11s %11s %9s\n", "stage", "ops", "devices",
                "replicas", "fwd/mb", "bwd/mb", "memory/dev", "send/mb", "allreduce", "recompute");
  out += line;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const StagePlan& st = stages[s];
    std::snprintf(line, sizeof line, "%-5zu %6zu  %-18s %8d %11s %11s %11s %11s %11s %9s\n", s, st.ops.size(),
                  device_range(st).c_str(), st.replicas, human_seconds(st.forward_s).c_str(),
                  human_seconds(st.backward_s).c_str(), human_bytes(st.memory_bytes).c_str(),
                  human_bytes(st.send_bytes).c_str(), st.replicas > 1 ? human_seconds(st.allreduce_s).c_str() : "-",
                  st.recompute == Recomputation::kNone ? "-" : std::string(recomputation_name(st.recompute)).c_str());
    out += line;
  }
  // Replicas that share a microbatch unevenly (by their devices' speeds): how many samples each.
  const std::int64_t samples = std::max(1, batch / std::max(microbatches, 1));
  for (std::size_t s = 0; s < stages.size(); ++s) {
    const StagePlan& st = stages[s];
    if (st.replicas < 2 || static_cast<int>(st.shares.size()) != st.replicas) continue;
    const std::vector<std::int64_t> n = share_lengths(samples, st.shares, st.replicas);
    if (std::all_of(n.begin(), n.end(), [&](std::int64_t x) { return x == n[0]; })) continue;
    std::string split;
    for (std::int64_t x : n) split += (split.empty() ? "" : "/") + std::to_string(x);
    out += "stage " + std::to_string(s) + "'s replicas share each microbatch " + split + " samples\n";
  }
  int used = 0;
  for (const auto& st : stages) used += st.replicas;
  if (chunks > 1) used /= chunks;
  std::snprintf(line, sizeof line,
                "schedule %s%s, %d microbatches of %.4g samples (batch %d), %d of %zu devices\n"
                "predicted step %s (%.1f samples/s), bubble %.1f%%, the search's analytic estimate %s\n"
                "search: %s, %.3f s\n",
                std::string(scheduler::schedule_kind_name(schedule)).c_str(),
                chunks > 1 ? (" x" + std::to_string(chunks) + " chunks").c_str() : "", microbatches,
                static_cast<double>(batch) / microbatches, batch, used, devices.size(),
                human_seconds(predicted_step_s).c_str(), predicted_step_s > 0 ? batch / predicted_step_s : 0.0,
                100 * bubble_fraction, human_seconds(objective_s).c_str(), search.c_str(), search_seconds);
  out += line;
  return out;
}

}  // namespace conveyor::partitioner
