#include "graph/ir.h"

#include "common/json_reader.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

namespace conveyor::graph {
namespace {

using nlohmann::json;

// Parsing errors name the JSON path ("/nodes/3/args/1") and what was expected there.
using ParseError = json_reader::JsonError;
using json_reader::as_array;
using json_reader::as_id;
using json_reader::as_int;
using json_reader::as_string;
using json_reader::field;

ValueKind parse_value_kind(const std::string& s, const std::string& path) {
  if (s == "tensor") return ValueKind::kTensor;
  if (s == "int") return ValueKind::kInt;
  if (s == "float") return ValueKind::kFloat;
  if (s == "bool") return ValueKind::kBool;
  throw ParseError(path, "unknown value kind '" + s + "' (expected tensor, int, float or bool)");
}

double parse_float(const json& j, const std::string& path) {
  if (j.is_number()) return j.get<double>();
  if (j.is_string()) {
    auto s = j.get<std::string>();
    if (s == "inf") return std::numeric_limits<double>::infinity();
    if (s == "-inf") return -std::numeric_limits<double>::infinity();
    if (s == "nan") return std::numeric_limits<double>::quiet_NaN();
  }
  throw ParseError(path, "expected a number or \"inf\", \"-inf\", \"nan\", got " + json_reader::excerpt(j));
}

json float_to_json(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

Argument parse_argument(const json& j, const std::string& path) {
  if (!j.is_object() || j.size() != 1) {
    throw ParseError(path, "expected an argument object with exactly one key, got " + json_reader::excerpt(j));
  }
  // (not `*j.items().begin()`: that binds to an iteration proxy that dies at the semicolon)
  const std::string key = j.begin().key();
  const json& v = j.begin().value();
  using K = Argument::Kind;
  if (key == "value") return Argument::of_value(as_id(v, path + "/value"));
  if (key == "int") return Argument::of_int(as_int(v, path + "/int"));
  if (key == "float") return Argument::of_float(parse_float(v, path + "/float"));
  if (key == "bool") {
    if (!v.is_boolean()) throw ParseError(path + "/bool", "expected true or false");
    return Argument::of_bool(v.get<bool>());
  }
  if (key == "none") return Argument::none();
  if (key == "str") return Argument::of_text(K::kString, as_string(v, path + "/str"));
  if (key == "dtype") return Argument::of_text(K::kDtype, as_string(v, path + "/dtype"));
  if (key == "device") return Argument::of_text(K::kDevice, as_string(v, path + "/device"));
  if (key == "layout") return Argument::of_text(K::kLayout, as_string(v, path + "/layout"));
  if (key == "memory_format") {
    return Argument::of_text(K::kMemoryFormat, as_string(v, path + "/memory_format"));
  }
  if (key == "list") {
    std::vector<Argument> items;
    const auto& arr = as_array(v, path + "/list");
    for (std::size_t i = 0; i < arr.size(); ++i) {
      items.push_back(parse_argument(arr[i], path + "/list/" + std::to_string(i)));
    }
    return Argument::of_list(std::move(items));
  }
  throw ParseError(path, "unknown argument kind '" + key +
                             "' (expected value, int, float, bool, none, str, dtype, device, "
                             "layout, memory_format or list)");
}

json argument_to_json(const Argument& a) {
  using K = Argument::Kind;
  switch (a.kind) {
    case K::kValue: return {{"value", a.value}};
    case K::kInt: return {{"int", a.int_value}};
    case K::kFloat: return {{"float", float_to_json(a.float_value)}};
    case K::kBool: return {{"bool", a.bool_value}};
    case K::kNone: return {{"none", nullptr}};
    case K::kString: return {{"str", a.text}};
    case K::kDtype: return {{"dtype", a.text}};
    case K::kDevice: return {{"device", a.text}};
    case K::kLayout: return {{"layout", a.text}};
    case K::kMemoryFormat: return {{"memory_format", a.text}};
    case K::kList: {
      json items = json::array();
      for (const auto& item : a.items) items.push_back(argument_to_json(item));
      return {{"list", items}};
    }
  }
  return {{"none", nullptr}};
}

Return parse_return(const json& j, const std::string& path) {
  if (!j.is_object() || j.size() != 1) throw ParseError(path, "expected a return object with one key");
  // (not `*j.items().begin()`: that binds to an iteration proxy that dies at the semicolon)
  const std::string key = j.begin().key();
  const json& v = j.begin().value();
  Return r;
  if (key == "value") {
    r.kind = Return::Kind::kValue;
    r.value = as_id(v, path + "/value");
  } else if (key == "list") {
    r.kind = Return::Kind::kList;
    const auto& arr = as_array(v, path + "/list");
    for (std::size_t i = 0; i < arr.size(); ++i) {
      r.items.push_back(json_reader::as_int_in(arr[i], path + "/list/" + std::to_string(i), -1));  // -1: unused
    }
  } else if (key == "unused") {
    r.kind = Return::Kind::kUnused;
  } else {
    throw ParseError(path, "unknown return kind '" + key + "' (expected value, list or unused)");
  }
  return r;
}

json return_to_json(const Return& r) {
  switch (r.kind) {
    case Return::Kind::kValue: return {{"value", r.value}};
    case Return::Kind::kList: return {{"list", r.items}};
    case Return::Kind::kUnused: return {{"unused", nullptr}};
  }
  return {{"unused", nullptr}};
}

std::vector<int> parse_int_list(const json& obj, const std::string& path, const char* key) {
  return json_reader::int_list(obj, path, key);
}

Binding::Kind parse_binding_kind(const std::string& s, const std::string& path) {
  if (s == "parameter") return Binding::Kind::kParameter;
  if (s == "buffer") return Binding::Kind::kBuffer;
  if (s == "constant") return Binding::Kind::kConstant;
  throw ParseError(path, "unknown binding kind '" + s + "' (expected parameter, buffer or constant)");
}

const char* binding_kind_name(Binding::Kind k) {
  switch (k) {
    case Binding::Kind::kParameter: return "parameter";
    case Binding::Kind::kBuffer: return "buffer";
    case Binding::Kind::kConstant: return "constant";
  }
  return "parameter";
}

Graph parse_graph(const json& doc) {
  Graph g;
  if (!doc.is_object()) throw ParseError("/", "expected a JSON object");
  auto fmt = as_string(field(doc, "", "format"), "/format");
  if (fmt != "conveyor.graph") {
    throw ParseError("/format", "expected \"conveyor.graph\", got " + json_reader::excerpt(json(fmt)));
  }
  g.version = json_reader::as_int_in(field(doc, "", "version"), "/version", 0);
  if (g.version > kGraphFormatVersion || g.version < 1) {
    // Reported by from_json with ErrorCode::kVersion.
    return g;
  }
  if (auto it = doc.find("producer"); it != doc.end() && it->is_object()) {
    for (const auto& [k, v] : it->items()) {
      if (v.is_string()) g.producer[k] = v.get<std::string>();
    }
  }
  if (auto it = doc.find("symbols"); it != doc.end()) {
    if (!it->is_object()) throw ParseError("/symbols", "expected an object");
    for (const auto& [k, v] : it->items()) g.symbols[k] = as_string(v, "/symbols/" + k);
  }
  if (auto it = doc.find("ranges"); it != doc.end()) {
    if (!it->is_object()) throw ParseError("/ranges", "expected an object");
    for (const auto& [k, v] : it->items()) {
      const std::string p = "/ranges/" + k;
      if (!v.is_object()) throw ParseError(p, "expected an object {\"min\": n, \"max\": n}");
      Graph::Range r;
      if (auto lo = v.find("min"); lo != v.end()) r.min = as_int(*lo, p + "/min");
      if (auto hi = v.find("max"); hi != v.end()) r.max = as_int(*hi, p + "/max");
      if (r.min < 0 || r.max < r.min) throw ParseError(p, "expected 0 <= min <= max");
      g.ranges[k] = r;
    }
  }
  const auto& values = as_array(field(doc, "", "values"), "/values");
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::string p = "/values/" + std::to_string(i);
    const auto& jv = values[i];
    Value v;
    v.id = as_id(field(jv, p, "id"), p + "/id");
    v.kind = parse_value_kind(as_string(field(jv, p, "kind"), p + "/kind"), p + "/kind");
    if (auto it = jv.find("name"); it != jv.end()) v.name = as_string(*it, p + "/name");
    if (auto it = jv.find("requires_grad"); it != jv.end() && it->is_boolean()) {
      v.requires_grad = it->get<bool>();
    }
    if (v.kind == ValueKind::kTensor) {
      v.dtype = as_string(field(jv, p, "dtype"), p + "/dtype");
      const auto& shape = as_array(field(jv, p, "shape"), p + "/shape");
      for (std::size_t d = 0; d < shape.size(); ++d) {
        Dim dim;
        if (shape[d].is_string()) {
          dim.symbol = shape[d].get<std::string>();
        } else {
          dim.size = as_int(shape[d], p + "/shape/" + std::to_string(d));
        }
        v.shape.push_back(std::move(dim));
      }
    }
    g.values.push_back(std::move(v));
  }
  const auto& inputs = as_array(field(doc, "", "inputs"), "/inputs");
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    std::string p = "/inputs/" + std::to_string(i);
    Input in;
    in.value = as_id(field(inputs[i], p, "value"), p + "/value");
    if (auto it = inputs[i].find("name"); it != inputs[i].end()) in.name = as_string(*it, p + "/name");
    g.inputs.push_back(std::move(in));
  }
  const auto& bindings = as_array(field(doc, "", "bindings"), "/bindings");
  for (std::size_t i = 0; i < bindings.size(); ++i) {
    std::string p = "/bindings/" + std::to_string(i);
    Binding b;
    b.value = as_id(field(bindings[i], p, "value"), p + "/value");
    b.name = as_string(field(bindings[i], p, "name"), p + "/name");
    b.kind = parse_binding_kind(as_string(field(bindings[i], p, "kind"), p + "/kind"), p + "/kind");
    if (auto it = bindings[i].find("tied"); it != bindings[i].end()) {
      const auto& arr = as_array(*it, p + "/tied");
      for (std::size_t t = 0; t < arr.size(); ++t) {
        b.tied_names.push_back(as_string(arr[t], p + "/tied/" + std::to_string(t)));
      }
    }
    g.bindings.push_back(std::move(b));
  }
  const auto& nodes = as_array(field(doc, "", "nodes"), "/nodes");
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    std::string p = "/nodes/" + std::to_string(i);
    const auto& jn = nodes[i];
    Node n;
    n.id = as_id(field(jn, p, "id"), p + "/id");
    n.op = as_string(field(jn, p, "op"), p + "/op");
    if (auto it = jn.find("overload"); it != jn.end()) n.overload = as_string(*it, p + "/overload");
    const auto& args = as_array(field(jn, p, "args"), p + "/args");
    for (std::size_t a = 0; a < args.size(); ++a) {
      n.args.push_back(parse_argument(args[a], p + "/args/" + std::to_string(a)));
    }
    const auto& rets = as_array(field(jn, p, "returns"), p + "/returns");
    for (std::size_t r = 0; r < rets.size(); ++r) {
      n.returns.push_back(parse_return(rets[r], p + "/returns/" + std::to_string(r)));
    }
    n.mutated_args = parse_int_list(jn, p, "mutates");
    n.aliased_args = parse_int_list(jn, p, "aliases");
    if (auto it = jn.find("source"); it != jn.end()) n.source = as_string(*it, p + "/source");
    if (auto it = jn.find("grad_enabled"); it != jn.end() && !it->is_null()) {
      if (!it->is_boolean()) throw ParseError(p + "/grad_enabled", "expected true, false or null");
      n.grad_enabled = it->get<bool>();
    }
    if (auto it = jn.find("random"); it != jn.end() && it->is_boolean()) {
      n.nondeterministic_seeded = it->get<bool>();
    }
    g.nodes.push_back(std::move(n));
  }
  const auto& outputs = as_array(field(doc, "", "outputs"), "/outputs");
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    g.outputs.push_back(as_id(outputs[i], "/outputs/" + std::to_string(i)));
  }
  if (auto it = doc.find("extra"); it != doc.end()) g.extra_json = it->dump();
  return g;
}

void collect_values(const Argument& a, std::vector<ValueId>& out) {
  if (a.kind == Argument::Kind::kValue) out.push_back(a.value);
  for (const auto& item : a.items) collect_values(item, out);
}

}  // namespace

std::string_view value_kind_name(ValueKind kind) {
  switch (kind) {
    case ValueKind::kTensor: return "tensor";
    case ValueKind::kInt: return "int";
    case ValueKind::kFloat: return "float";
    case ValueKind::kBool: return "bool";
  }
  return "tensor";
}

Result<Graph> Graph::from_json(std::string_view text) {
  auto parsed = json_reader::parse_document(text, "graph document",
                                            [](const json& doc) -> Result<Graph> { return parse_graph(doc); });
  if (!parsed) return parsed.status();
  Graph g = std::move(parsed).value();
  if (g.version > kGraphFormatVersion || g.version < 1) {
    return Status(ErrorCode::kVersion,
                  "graph document has format version " + std::to_string(g.version) +
                      " but this conveyor reads versions 1 to " +
                      std::to_string(kGraphFormatVersion) +
                      "; upgrade conveyor or capture the model again");
  }
  CONVEYOR_RETURN_IF_ERROR(g.validate());
  return g;
}

std::string Graph::to_json() const {
  json doc;
  doc["format"] = "conveyor.graph";
  doc["version"] = version;
  doc["producer"] = producer;
  doc["symbols"] = symbols;
  if (!ranges.empty()) {
    json r = json::object();
    for (const auto& [k, range] : ranges) {
      json jr = json::object();
      if (range.min > 0) jr["min"] = range.min;
      if (range.max != std::numeric_limits<std::int64_t>::max()) jr["max"] = range.max;
      r[k] = jr;
    }
    doc["ranges"] = r;
  }
  json values_j = json::array();
  for (const auto& v : values) {
    json jv = {{"id", v.id}, {"kind", value_kind_name(v.kind)}};
    if (!v.name.empty()) jv["name"] = v.name;
    if (v.requires_grad) jv["requires_grad"] = true;
    if (v.kind == ValueKind::kTensor) {
      jv["dtype"] = v.dtype;
      json shape = json::array();
      for (const auto& d : v.shape) {
        if (d.is_symbolic()) shape.push_back(d.symbol); else shape.push_back(d.size);
      }
      jv["shape"] = shape;
    }
    values_j.push_back(std::move(jv));
  }
  doc["values"] = std::move(values_j);
  json inputs_j = json::array();
  for (const auto& in : inputs) inputs_j.push_back({{"value", in.value}, {"name", in.name}});
  doc["inputs"] = std::move(inputs_j);
  json bindings_j = json::array();
  for (const auto& b : bindings) {
    json jb = {{"value", b.value}, {"name", b.name}, {"kind", binding_kind_name(b.kind)}};
    if (!b.tied_names.empty()) jb["tied"] = b.tied_names;
    bindings_j.push_back(std::move(jb));
  }
  doc["bindings"] = std::move(bindings_j);
  json nodes_j = json::array();
  for (const auto& n : nodes) {
    json jn = {{"id", n.id}, {"op", n.op}, {"overload", n.overload}};
    json args = json::array();
    for (const auto& a : n.args) args.push_back(argument_to_json(a));
    jn["args"] = std::move(args);
    json rets = json::array();
    for (const auto& r : n.returns) rets.push_back(return_to_json(r));
    jn["returns"] = std::move(rets);
    if (!n.mutated_args.empty()) jn["mutates"] = n.mutated_args;
    if (!n.aliased_args.empty()) jn["aliases"] = n.aliased_args;
    if (!n.source.empty()) jn["source"] = n.source;
    if (n.grad_enabled) jn["grad_enabled"] = *n.grad_enabled;
    if (n.nondeterministic_seeded) jn["random"] = true;
    nodes_j.push_back(std::move(jn));
  }
  doc["nodes"] = std::move(nodes_j);
  doc["outputs"] = outputs;
  doc["extra"] = json::parse(extra_json.empty() ? "{}" : extra_json);
  return doc.dump();
}

std::vector<ValueId> Graph::node_inputs(const Node& node) {
  std::vector<ValueId> out;
  for (const auto& a : node.args) collect_values(a, out);
  return out;
}

std::vector<ValueId> Graph::node_outputs(const Node& node) {
  std::vector<ValueId> out;
  for (const auto& r : node.returns) {
    if (r.kind == Return::Kind::kValue) out.push_back(r.value);
    for (ValueId v : r.items) {
      if (v >= 0) out.push_back(v);
    }
  }
  return out;
}

std::vector<NodeId> Graph::producers() const {
  std::vector<NodeId> prod(values.size(), -1);
  for (const auto& n : nodes) {
    for (ValueId v : node_outputs(n)) {
      if (v >= 0 && static_cast<std::size_t>(v) < prod.size()) prod[v] = n.id;
    }
  }
  return prod;
}

std::vector<std::vector<NodeId>> Graph::consumers() const {
  auto prod = producers();
  std::vector<std::vector<NodeId>> cons(nodes.size());
  for (const auto& n : nodes) {
    for (ValueId v : node_inputs(n)) {
      NodeId p = prod[v];
      if (p >= 0 && (cons[p].empty() || cons[p].back() != n.id)) cons[p].push_back(n.id);
    }
  }
  for (auto& c : cons) {
    std::sort(c.begin(), c.end());
    c.erase(std::unique(c.begin(), c.end()), c.end());
  }
  return cons;
}

Status Graph::validate() const {
  auto bad = [](const std::string& msg) { return Status(ErrorCode::kInvalidGraph, msg); };
  auto quoted = [](const std::string& name) { return "'" + json_reader::printable(name, 80) + "'"; };
  const auto num_values = static_cast<ValueId>(values.size());
  for (ValueId i = 0; i < num_values; ++i) {
    if (values[i].id != i) {
      return bad("value at position " + std::to_string(i) + " has id " +
                 std::to_string(values[i].id) + "; value ids must equal their position");
    }
  }
  std::vector<char> defined(values.size(), 0);
  auto define = [&](ValueId v, const std::string& where) -> Status {
    if (v < 0 || v >= num_values) {
      return bad(where + " defines value " + std::to_string(v) + " which does not exist");
    }
    if (defined[v]) return bad(where + " defines value " + std::to_string(v) + " a second time");
    defined[v] = 1;
    return Status::ok();
  };
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    CONVEYOR_RETURN_IF_ERROR(define(inputs[i].value, "input " + std::to_string(i)));
  }
  std::set<std::string> binding_names;
  for (const auto& b : bindings) {
    CONVEYOR_RETURN_IF_ERROR(define(b.value, "binding " + quoted(b.name)));
    if (!binding_names.insert(b.name).second) return bad("binding " + quoted(b.name) + " appears twice");
    for (const auto& tied : b.tied_names) {
      if (!binding_names.insert(tied).second) return bad("binding " + quoted(tied) + " appears twice");
    }
    if (values[b.value].kind != ValueKind::kTensor) {
      return bad("binding " + quoted(b.name) + " must be a tensor value");
    }
  }
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = nodes[i];
    std::string where = "node " + std::to_string(i) + " (" + json_reader::printable(n.qualified_name(), 80) +
                        (n.source.empty() ? "" : ", from " + json_reader::printable(n.source, 120)) + ")";
    if (n.id != static_cast<NodeId>(i)) {
      return bad("node at position " + std::to_string(i) + " has id " + std::to_string(n.id) +
                 "; node ids must equal their position");
    }
    if (n.op.empty()) return bad(where + " has no operator name");
    for (ValueId v : node_inputs(n)) {
      if (v < 0 || v >= num_values) {
        return bad(where + " reads value " + std::to_string(v) + " which does not exist");
      }
      if (!defined[v]) {
        return bad(where + " reads value " + std::to_string(v) + " (" + quoted(values[v].name) +
                   ") before it is defined; nodes must be in topological order");
      }
    }
    for (int a : n.mutated_args) {
      if (a < 0 || static_cast<std::size_t>(a) >= n.args.size()) {
        return bad(where + " marks argument " + std::to_string(a) + " as mutated but has only " +
                   std::to_string(n.args.size()) + " arguments");
      }
    }
    for (int a : n.aliased_args) {
      if (a < 0 || static_cast<std::size_t>(a) >= n.args.size()) {
        return bad(where + " marks argument " + std::to_string(a) + " as aliased but has only " +
                   std::to_string(n.args.size()) + " arguments");
      }
    }
    for (ValueId v : node_outputs(n)) CONVEYOR_RETURN_IF_ERROR(define(v, where));
  }
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    ValueId v = outputs[i];
    if (v < 0 || v >= num_values || !defined[v]) {
      return bad("graph output " + std::to_string(i) + " refers to value " + std::to_string(v) +
                 " which is never defined");
    }
  }
  return Status::ok();
}

}  // namespace conveyor::graph
