#include "partitioner/cost_graph.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "common/file.h"
#include "common/json_reader.h"
#include "graph/batch_values.h"
#include "graph/partition.h"

namespace conveyor::partitioner {
namespace {

using json_reader::JsonError;
using nlohmann::json;
using namespace json_reader;

constexpr int kOpGraphVersion = 1;
constexpr int kProfileVersion = 1;

std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool finite_nonneg(double v) { return std::isfinite(v) && v >= 0; }

// A document's optional top-level `key`, a fraction from 0 to 1 (0 when absent).
double fraction_or(const json& doc, const std::string& key) {
  if (!doc.contains(key)) return 0;
  const double f = as_amount(doc[key], "/" + key);
  if (f > 1) throw JsonError("/" + key, "expected a fraction from 0 to 1");
  return f;
}

}  // namespace

Status CostGraph::validate() const {
  auto bad = [&](const std::string& msg) { return Status(ErrorCode::kInvalidGraph, "cost graph '" + name + "': " + msg); };
  if (microbatch < 1) return bad("microbatch must be at least 1");
  if (min_share < 1) return bad("min_share must be at least 1");
  if (!(fixed_fraction >= 0 && fixed_fraction <= 1)) return bad("fixed_fraction must be between 0 and 1");
  if (ops.empty()) return bad("it has no operators");
  for (std::size_t v = 0; v < values.size(); ++v) {
    const auto& val = values[v];
    if (val.producer < -1 || val.producer >= static_cast<int>(ops.size())) {
      return bad("value " + std::to_string(v) + " names producer " + std::to_string(val.producer) +
                 ", which is not an operator");
    }
    if (!finite_nonneg(val.bytes)) return bad("value " + std::to_string(v) + " has a negative or non-finite size");
    if (val.saved_by < -1 || val.saved_by >= static_cast<int>(ops.size())) {
      return bad("value " + std::to_string(v) + " names saved_by " + std::to_string(val.saved_by) +
                 ", which is not an operator");
    }
  }
  for (std::size_t p = 0; p < params.size(); ++p) {
    if (!finite_nonneg(params[p].bytes)) return bad("parameter '" + params[p].name + "' has a negative or non-finite size");
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& op = ops[i];
    const std::string who = "operator " + std::to_string(i) + (op.name.empty() ? "" : " ('" + op.name + "')");
    for (double c : {op.forward_s, op.backward_s, op.backward_weight_s, op.saved_bytes, op.work_bytes,
                     op.selective_forward_s, op.selective_freed_bytes, op.selective_work_bytes,
                     op.selective_kept_bytes}) {
      if (!finite_nonneg(c)) return bad(who + " has a negative or non-finite cost");
    }
    if (op.backward_weight_s > op.backward_s) {
      return bad(who + " has a weight-gradient time larger than its whole backward time");
    }
    for (int v : op.inputs) {
      if (v < 0 || v >= static_cast<int>(values.size())) return bad(who + " reads missing value " + std::to_string(v));
      if (values[v].producer >= static_cast<int>(i)) {
        return bad(who + " reads value " + std::to_string(v) + " of operator " + std::to_string(values[v].producer) +
                   ", which does not come before it (operators must be in a topological order)");
      }
    }
    for (int p : op.params) {
      if (p < 0 || p >= static_cast<int>(params.size())) return bad(who + " reads missing parameter " + std::to_string(p));
    }
  }
  return Status::ok();
}

std::vector<std::vector<int>> CostGraph::readers() const {
  std::vector<std::vector<int>> out(values.size());
  for (std::size_t i = 0; i < ops.size(); ++i) {
    for (int v : ops[i].inputs) {
      if (out[v].empty() || out[v].back() != static_cast<int>(i)) out[v].push_back(static_cast<int>(i));
    }
  }
  return out;
}

// The op-graph document: each op produces the values listed in "output_bytes" (a number:
// one value); an input is an op index (its first output) or [op, output].
Result<CostGraph> CostGraph::from_json(std::string_view text) {
  return parse_document(text, "op-graph document", [&](const json& doc) -> Result<CostGraph> {
    check_header(doc, "conveyor.op-graph", kOpGraphVersion);
    CostGraph g;
    if (doc.contains("name")) g.name = as_string(doc["name"], "/name");
    if (doc.contains("device")) g.device = as_string(doc["device"], "/device");
    if (doc.contains("microbatch")) {
      g.microbatch = as_int_in(doc["microbatch"], "/microbatch", 1);
      if (g.microbatch < 1) throw JsonError("/microbatch", "expected at least 1");
    }
    if (doc.contains("min_share")) {
      g.min_share = as_int_in(doc["min_share"], "/min_share", 1);
      if (g.min_share < 1) throw JsonError("/min_share", "expected at least 1");
    }
    g.fixed_fraction = fraction_or(doc, "fixed_fraction");
    if (doc.contains("params")) {
      const auto& ps = as_array(doc["params"], "/params");
      for (std::size_t i = 0; i < ps.size(); ++i) {
        const std::string path = "/params/" + std::to_string(i);
        CostParam p;
        if (ps[i].contains("name")) p.name = as_string(ps[i]["name"], path + "/name");
        p.bytes = as_amount(field(ps[i], path, "bytes"), path + "/bytes");
        g.params.push_back(std::move(p));
      }
    }
    const auto& ops = as_array(field(doc, "", "ops"), "/ops");
    std::vector<std::vector<int>> outputs_of;  // op -> its value ids
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const std::string path = "/ops/" + std::to_string(i);
      const json& o = ops[i];
      if (!o.is_object()) throw JsonError(path, "expected an operator object");
      CostOp op;
      if (o.contains("name")) op.name = as_string(o["name"], path + "/name");
      op.forward_s = as_amount(field(o, path, "forward_s"), path + "/forward_s");
      op.backward_s = as_amount(field(o, path, "backward_s"), path + "/backward_s");
      op.backward_weight_s = amount_or(o, path, "backward_weight_s", 0);
      if (op.backward_weight_s > op.backward_s) {
        throw JsonError(path + "/backward_weight_s", "the weight-gradient part cannot exceed backward_s");
      }
      op.saved_bytes = amount_or(o, path, "saved_bytes", 0);
      op.work_bytes = amount_or(o, path, "work_bytes", 0);
      op.selective_forward_s = amount_or(o, path, "selective_forward_s", 0);
      op.selective_freed_bytes = amount_or(o, path, "selective_freed_bytes", 0);
      op.selective_work_bytes = amount_or(o, path, "selective_work_bytes", 0);
      op.selective_kept_bytes = amount_or(o, path, "selective_kept_bytes", 0);
      if (op.selective_freed_bytes > op.saved_bytes) {
        throw JsonError(path + "/selective_freed_bytes", "selective recomputation cannot free more than saved_bytes");
      }
      if (o.contains("group")) op.group = as_int_in(o["group"], path + "/group", -1);
      op.params = int_list(o, path, "params");
      for (std::size_t k = 0; k < op.params.size(); ++k) {
        if (op.params[k] < 0 || op.params[k] >= static_cast<int>(g.params.size())) {
          throw JsonError(path + "/params/" + std::to_string(k), "no parameter " + std::to_string(op.params[k]) +
                                                                      " (the document lists " +
                                                                      std::to_string(g.params.size()) + ")");
        }
      }
      if (o.contains("inputs")) {
        const auto& ins = as_array(o["inputs"], path + "/inputs");
        for (std::size_t k = 0; k < ins.size(); ++k) {
          const std::string ipath = path + "/inputs/" + std::to_string(k);
          int from = 0, out = 0;
          if (ins[k].is_array()) {
            if (ins[k].size() != 2) throw JsonError(ipath, "expected an op index or [op, output]");
            from = as_id(ins[k][0], ipath + "/0");
            out = as_id(ins[k][1], ipath + "/1");
          } else {
            from = as_id(ins[k], ipath);
          }
          if (from < 0 || from >= static_cast<int>(i)) {
            throw JsonError(ipath, "operator " + std::to_string(from) +
                                       " is not an earlier operator (list operators in a topological order)");
          }
          if (out < 0 || out >= static_cast<int>(outputs_of[from].size())) {
            throw JsonError(ipath, "operator " + std::to_string(from) + " has no output " + std::to_string(out));
          }
          op.inputs.push_back(outputs_of[from][out]);
        }
      }
      std::vector<double> out_bytes;
      if (o.contains("output_bytes")) {
        const json& ob = o["output_bytes"];
        if (ob.is_array()) {
          for (std::size_t k = 0; k < ob.size(); ++k) out_bytes.push_back(as_amount(ob[k], path + "/output_bytes/" + std::to_string(k)));
        } else {
          out_bytes.push_back(as_amount(ob, path + "/output_bytes"));
        }
      } else {
        out_bytes.push_back(0);
      }
      outputs_of.emplace_back();
      for (double b : out_bytes) {
        outputs_of.back().push_back(static_cast<int>(g.values.size()));
        g.values.push_back({static_cast<int>(i), b});
      }
      if (o.contains("not_redistributable")) {
        const auto& fixed = as_array(o["not_redistributable"], path + "/not_redistributable");
        for (std::size_t k = 0; k < fixed.size(); ++k) {
          const std::string fpath = path + "/not_redistributable/" + std::to_string(k);
          const int out = as_id(fixed[k], fpath);
          if (out < 0 || out >= static_cast<int>(outputs_of.back().size())) {
            throw JsonError(fpath, "operator " + std::to_string(i) + " has no output " + std::to_string(out));
          }
          g.values[outputs_of.back()[out]].redistributable = false;
        }
      }
      g.ops.push_back(std::move(op));
    }
    CONVEYOR_RETURN_IF_ERROR(g.validate());
    return g;
  });
}

std::string CostGraph::to_json() const {
  // Values are listed per producer in order; graph inputs (producer -1) are free and omitted.
  std::vector<std::vector<int>> outputs_of(ops.size());
  for (std::size_t v = 0; v < values.size(); ++v) {
    if (values[v].producer >= 0) outputs_of[values[v].producer].push_back(static_cast<int>(v));
  }
  json doc;
  doc["format"] = "conveyor.op-graph";
  doc["version"] = kOpGraphVersion;
  doc["name"] = name;
  if (!device.empty()) doc["device"] = device;
  doc["microbatch"] = microbatch;
  if (min_share > 1) doc["min_share"] = min_share;
  if (fixed_fraction > 0) doc["fixed_fraction"] = fixed_fraction;
  json ps = json::array();
  for (const auto& p : params) ps.push_back({{"name", p.name}, {"bytes", p.bytes}});
  doc["params"] = std::move(ps);
  json os = json::array();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const CostOp& op = ops[i];
    json o = {{"name", op.name}, {"forward_s", op.forward_s}, {"backward_s", op.backward_s}};
    if (op.backward_weight_s > 0) o["backward_weight_s"] = op.backward_weight_s;
    if (op.saved_bytes > 0) o["saved_bytes"] = op.saved_bytes;
    if (op.work_bytes > 0) o["work_bytes"] = op.work_bytes;
    if (op.selective_forward_s > 0) o["selective_forward_s"] = op.selective_forward_s;
    if (op.selective_freed_bytes > 0) o["selective_freed_bytes"] = op.selective_freed_bytes;
    if (op.selective_work_bytes > 0) o["selective_work_bytes"] = op.selective_work_bytes;
    if (op.selective_kept_bytes > 0) o["selective_kept_bytes"] = op.selective_kept_bytes;
    if (op.group >= 0) o["group"] = op.group;
    if (!op.params.empty()) o["params"] = op.params;
    json ins = json::array();
    for (int v : op.inputs) {
      int from = values[v].producer;
      if (from < 0) continue;
      const auto& outs = outputs_of[from];
      int k = static_cast<int>(std::find(outs.begin(), outs.end(), v) - outs.begin());
      if (k == 0) ins.push_back(from); else ins.push_back(json::array({from, k}));
    }
    if (!ins.empty()) o["inputs"] = std::move(ins);
    if (outputs_of[i].size() == 1) {
      o["output_bytes"] = values[outputs_of[i][0]].bytes;
    } else {
      json ob = json::array();
      for (int v : outputs_of[i]) ob.push_back(values[v].bytes);
      o["output_bytes"] = std::move(ob);
    }
    json fixed = json::array();
    for (std::size_t k = 0; k < outputs_of[i].size(); ++k) {
      if (!values[outputs_of[i][k]].redistributable) fixed.push_back(k);
    }
    if (!fixed.empty()) o["not_redistributable"] = std::move(fixed);
    os.push_back(std::move(o));
  }
  doc["ops"] = std::move(os);
  return doc.dump();
}

Result<CostGraph> load_cost_graph(const std::string& path) {
  CONVEYOR_ASSIGN_OR_RETURN(std::string text, read_file(path, "op-graph file"));
  auto g = CostGraph::from_json(text);
  if (!g) return g.status().with_context(path);
  return g;
}

Result<Profile> Profile::from_json(std::string_view text) {
  return parse_document(text, "profile document", [&](const json& doc) -> Result<Profile> {
    check_header(doc, "conveyor.profile", kProfileVersion);
    Profile p;
    p.graph_hash = as_string(field(doc, "", "graph_hash"), "/graph_hash");
    p.device = as_string(field(doc, "", "device"), "/device");
    p.microbatch = as_int_in(field(doc, "", "microbatch"), "/microbatch", 1);
    if (p.microbatch < 1) throw JsonError("/microbatch", "expected at least 1");
    if (doc.contains("torch")) p.torch_version = as_string(doc["torch"], "/torch");
    p.fixed_fraction = fraction_or(doc, "fixed_fraction");
    const auto& nodes = as_array(field(doc, "", "nodes"), "/nodes");
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      const std::string path = "/nodes/" + std::to_string(i);
      NodeProfile n;
      n.forward_s = as_amount(field(nodes[i], path, "forward_s"), path + "/forward_s");
      n.backward_s = as_amount(field(nodes[i], path, "backward_s"), path + "/backward_s");
      n.backward_weight_s = amount_or(nodes[i], path, "backward_weight_s", 0);
      n.saved_bytes = amount_or(nodes[i], path, "saved_bytes", 0);
      n.work_bytes = amount_or(nodes[i], path, "work_bytes", 0);
      n.selective_forward_s = amount_or(nodes[i], path, "selective_forward_s", 0);
      n.selective_freed_bytes = amount_or(nodes[i], path, "selective_freed_bytes", 0);
      n.selective_work_bytes = amount_or(nodes[i], path, "selective_work_bytes", 0);
      n.selective_kept_bytes = amount_or(nodes[i], path, "selective_kept_bytes", 0);
      if (n.backward_weight_s > n.backward_s) {
        throw JsonError(path + "/backward_weight_s", "the weight-gradient part cannot exceed backward_s");
      }
      p.nodes.push_back(n);
    }
    const auto& vb = as_array(field(doc, "", "value_bytes"), "/value_bytes");
    for (std::size_t i = 0; i < vb.size(); ++i) p.value_bytes.push_back(as_amount(vb[i], "/value_bytes/" + std::to_string(i)));
    if (doc.contains("value_saved_by")) {
      const auto& sb = as_array(doc["value_saved_by"], "/value_saved_by");
      if (sb.size() != vb.size()) throw JsonError("/value_saved_by", "expected one entry per value (as value_bytes)");
      for (std::size_t i = 0; i < sb.size(); ++i) {
        const std::string path = "/value_saved_by/" + std::to_string(i);
        if (!sb[i].is_number_integer() || sb[i].get<long long>() < -1 ||
            sb[i].get<long long>() >= static_cast<long long>(nodes.size())) {
          throw JsonError(path, "expected a node id or -1");
        }
        p.value_saved_by.push_back(sb[i].get<int>());
      }
    }
    return p;
  });
}

std::string Profile::to_json() const {
  json doc;
  doc["format"] = "conveyor.profile";
  doc["version"] = kProfileVersion;
  doc["graph_hash"] = graph_hash;
  doc["device"] = device;
  doc["microbatch"] = microbatch;
  if (fixed_fraction > 0) doc["fixed_fraction"] = fixed_fraction;
  if (!torch_version.empty()) doc["torch"] = torch_version;
  json nodes_j = json::array();
  for (const auto& n : nodes) {
    nodes_j.push_back({{"forward_s", n.forward_s},
                       {"backward_s", n.backward_s},
                       {"backward_weight_s", n.backward_weight_s},
                       {"saved_bytes", n.saved_bytes},
                       {"work_bytes", n.work_bytes},
                       {"selective_forward_s", n.selective_forward_s},
                       {"selective_freed_bytes", n.selective_freed_bytes},
                       {"selective_work_bytes", n.selective_work_bytes},
                       {"selective_kept_bytes", n.selective_kept_bytes}});
  }
  doc["nodes"] = std::move(nodes_j);
  doc["value_bytes"] = value_bytes;
  if (!value_saved_by.empty()) doc["value_saved_by"] = value_saved_by;
  return doc.dump();
}

std::string graph_hash(const graph::Graph& graph) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(fnv1a(graph.to_json())));
  return buf;
}

Result<CostGraph> cost_graph_from_profile(const graph::Graph& g, const Profile& profile) {
  const std::string hash = graph_hash(g);
  if (profile.graph_hash != hash) {
    return Status(ErrorCode::kInvalidArgument,
                  "the profile was measured on another graph (profile graph hash " + profile.graph_hash +
                      ", this graph " + hash + "); profile this graph again");
  }
  if (profile.nodes.size() != g.nodes.size() || profile.value_bytes.size() != g.values.size()) {
    return Status(ErrorCode::kInvalidArgument, "the profile lists " + std::to_string(profile.nodes.size()) +
                                                   " nodes and " + std::to_string(profile.value_bytes.size()) +
                                                   " values; the graph has " + std::to_string(g.nodes.size()) +
                                                   " and " + std::to_string(g.values.size()));
  }
  CostGraph c;
  c.device = profile.device;
  c.microbatch = profile.microbatch;
  c.fixed_fraction = profile.fixed_fraction;
  for (const auto& [symbol, role] : g.symbols) {
    if (role != "batch") continue;
    if (auto r = g.ranges.find(symbol); r != g.ranges.end()) {
      c.min_share = static_cast<int>(std::max<std::int64_t>(c.min_share, r->second.min));
    }
  }
  c.name = g.producer.count("model") ? g.producer.at("model") : "graph";
  // Parameters and buffers: one entry per binding (tied names share it).
  std::vector<int> param_of_value(g.values.size(), -1);
  for (const auto& b : g.bindings) {
    if (b.kind == graph::Binding::Kind::kConstant) continue;
    param_of_value[b.value] = static_cast<int>(c.params.size());
    c.params.push_back({b.name, profile.value_bytes[b.value]});
  }
  // Values: every tensor a node produces; graph inputs are free.
  std::vector<int> cost_value(g.values.size(), -1);
  const auto producers = g.producers();
  const graph::BatchValues batch = graph::BatchValues::of(g);
  for (std::size_t v = 0; v < g.values.size(); ++v) {
    if (producers[v] < 0) continue;
    cost_value[v] = static_cast<int>(c.values.size());
    const int saved_by = profile.value_saved_by.empty() ? -1 : profile.value_saved_by[v];
    c.values.push_back({producers[v], profile.value_bytes[v], saved_by,
                        batch.redistributable(g, static_cast<graph::ValueId>(v))});
  }
  const auto groups = graph::atomic_groups(g);
  const auto group_of = graph::group_of_nodes(g, groups);
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    const auto& node = g.nodes[i];
    const NodeProfile& np = profile.nodes[i];
    CostOp op;
    op.name = node.qualified_name();
    op.forward_s = np.forward_s;
    op.backward_s = np.backward_s;
    op.backward_weight_s = np.backward_weight_s;
    op.saved_bytes = np.saved_bytes;
    op.work_bytes = np.work_bytes;
    op.selective_forward_s = np.selective_forward_s;
    op.selective_freed_bytes = std::min(np.selective_freed_bytes, np.saved_bytes);
    op.selective_work_bytes = np.selective_work_bytes;
    op.selective_kept_bytes = np.selective_kept_bytes;
    op.group = group_of[i];
    std::set<int> ins, ps;
    for (graph::ValueId v : graph::Graph::node_inputs(node)) {
      if (cost_value[v] >= 0) ins.insert(cost_value[v]);
      if (param_of_value[v] >= 0) ps.insert(param_of_value[v]);
    }
    op.inputs.assign(ins.begin(), ins.end());
    op.params.assign(ps.begin(), ps.end());
    c.ops.push_back(std::move(op));
  }
  CONVEYOR_RETURN_IF_ERROR(c.validate());
  return c;
}

}  // namespace conveyor::partitioner
