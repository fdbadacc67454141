#include "graph/batch_values.h"

#include <algorithm>
#include <cctype>

namespace conveyor::graph {

namespace {

// The k of a dimension "k*s" (s a batch symbol, k a product of numbers and other symbols):
// k when it is a number, 0 when it holds other symbols (known per call), -1 when the
// dimension is not such a product.
std::int64_t flattened_scale(const std::string& d0, const std::set<std::string>& batch_symbols) {
  int batch_factors = 0;
  std::int64_t k = 1;
  bool symbolic = false;
  std::size_t start = 0;
  while (start <= d0.size()) {
    std::size_t end = d0.find('*', start);
    if (end == std::string::npos) end = d0.size();
    const std::string f = d0.substr(start, end - start);
    if (f.empty()) return -1;
    if (batch_symbols.count(f)) {
      ++batch_factors;
    } else if (f.find_first_not_of("0123456789") == std::string::npos) {
      k *= std::stoll(f);
    } else if (std::all_of(f.begin(), f.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; })) {
      symbolic = true;  // another symbolic size (a sequence length)
    } else {
      return -1;  // a sum, a division: not a run of samples
    }
    start = end + 1;
  }
  if (batch_factors != 1 || d0.find('*') == std::string::npos) return -1;
  return symbolic ? 0 : k;
}

// A dimension "k*s" at the front, made by flattening a batch-first tensor (view, reshape,
// flatten) or repeating its rows (repeat_interleave), possibly followed by ops whose result keeps that front dimension (elementwise
// ops, a per-row loss with reduction="none", a reduction over the other dims): samples stay
// contiguous runs of k elements, so a share is a run of k * its samples. Other products are
// not split. (Ops that mix the rows along that dimension are refused before this runs:
// call_splitting.py.)
void find_flattened_batches(const Graph& g, const std::set<std::string>& batch_symbols, BatchValues& out) {
  const std::vector<NodeId> defined_by = g.producers();
  auto same_front = [&](ValueId a, const std::vector<Dim>& front) {
    const auto& shape = g.values[a].shape;
    return !shape.empty() && shape[0].symbol == front[0].symbol && shape[0].size == front[0].size;
  };
  for (const auto& v : g.values) {
    if (out.batch_dim[v.id] >= 0 || v.shape.empty()) continue;
    const std::int64_t k = flattened_scale(v.shape[0].symbol, batch_symbols);
    if (k < 0) continue;
    // Back through the values whose front dimension is this one, at most 64 of them, to a
    // flattening of a batch-first tensor. A per-row loss takes its front from its target,
    // whose symbol export may name apart from the logits' (a sequence length each).
    std::vector<ValueId> pending{v.id};
    std::set<ValueId> seen{v.id};
    while (!pending.empty() && seen.size() <= 64 && out.batch_dim[v.id] < 0) {
      const ValueId at = pending.back();
      pending.pop_back();
      if (at < 0 || defined_by[at] < 0) continue;
      const Node& n = g.nodes[defined_by[at]];
      const auto ins = Graph::node_inputs(n);
      if (ins.empty()) continue;
      // Each row repeated k times in place (repeat_interleave along dim 0, or of a 1-d tensor):
      // runs of k per sample, as a flattening makes.
      const bool repeats_rows =
          n.op == "aten::repeat_interleave" && n.args.size() > 2 &&
          ((n.args[2].kind == Argument::Kind::kInt && n.args[2].int_value == 0) ||
           (n.args[2].kind == Argument::Kind::kNone && g.values[ins[0]].shape.size() == 1));
      if (n.op == "aten::view" || n.op == "aten::reshape" || n.op == "aten::_unsafe_view" || n.op == "aten::flatten" ||
          repeats_rows) {
        if (out.batch_dim[ins[0]] == 0) {
          out.batch_dim[v.id] = 0;
          out.batch_scale[v.id] = k;
        }
        continue;
      }
      for (ValueId in : ins) {
        if (same_front(in, g.values[at].shape) && seen.insert(in).second) pending.push_back(in);
      }
    }
  }
}

// Whether a symbolic size ("s0", "2*s0", "s0*s1") mentions a batch symbol: sizes made of
// other symbols only (a sequence length, an image's height) do not change between shares.
bool mentions_batch(const std::string& expr, const std::set<std::string>& batch_symbols) {
  std::size_t i = 0;
  while (i < expr.size()) {
    if (std::isalpha(static_cast<unsigned char>(expr[i])) || expr[i] == '_') {
      std::size_t j = i;
      while (j < expr.size() && (std::isalnum(static_cast<unsigned char>(expr[j])) || expr[j] == '_')) ++j;
      if (batch_symbols.count(expr.substr(i, j - i))) return true;
      i = j;
    } else {
      ++i;
    }
  }
  return false;
}

// x[positions, ...] (aten::index) of a batch-first x, with positions within the share (made
// from arange(batch)) along the batch and no others: each sample's row of its own x, which
// is content per sample, not positions. (A causal mask built so, as transformers' vmapped
// masks are, indexes position ids by the batch's arange.)
bool picks_own_rows(const Graph& g, const Node& node, const BatchValues& out) {
  if (node.op != "aten::index" || node.args.size() != 2 || node.args[0].kind != Argument::Kind::kValue ||
      node.args[1].kind != Argument::Kind::kList || node.args[1].items.empty()) {
    return false;
  }
  const ValueId x = node.args[0].value;
  const Argument& rows = node.args[1].items[0];
  if (out.batch_dim[x] != 0 || out.share_positions[x] || rows.kind != Argument::Kind::kValue ||
      !out.share_positions[rows.value] || g.values[rows.value].shape.empty() ||
      !out.batch_symbols.count(g.values[rows.value].shape[0].symbol)) {
    return false;
  }
  for (std::size_t k = 1; k < node.args[1].items.size(); ++k) {
    const Argument& a = node.args[1].items[k];
    if (a.kind == Argument::Kind::kValue && out.share_positions[a.value]) return false;
  }
  return true;
}

}  // namespace

BatchValues BatchValues::of(const Graph& g) {
  BatchValues out;
  for (const auto& [symbol, role] : g.symbols) {
    if (role != "batch") continue;
    out.batch_symbols.insert(symbol);
    if (auto r = g.ranges.find(symbol); r != g.ranges.end()) {
      out.range.min = std::max(out.range.min, r->second.min);
      out.range.max = std::min(out.range.max, r->second.max);
    }
  }
  out.on_batch.assign(g.values.size(), false);
  // Depends on a batched input's data.
  std::vector<bool> on_batch_data(g.values.size(), false);
  out.share_positions.assign(g.values.size(), false);
  for (std::size_t i = 0; i < g.inputs.size(); ++i) {
    const Value& v = g.values[g.inputs[i].value];
    out.input_index[g.inputs[i].value] = static_cast<int>(i);
    const bool batched = v.kind == ValueKind::kTensor && !v.shape.empty() && out.batch_symbols.count(v.shape[0].symbol) > 0;
    out.batched_input.push_back(batched);
    out.on_batch[g.inputs[i].value] = batched;
    on_batch_data[g.inputs[i].value] = batched;
  }
  out.batch_dim.assign(g.values.size(), -1);
  for (const auto& v : g.values) {
    for (std::size_t d = 0; d < v.shape.size(); ++d) {
      if (out.batch_symbols.count(v.shape[d].symbol)) {
        out.batch_dim[v.id] = static_cast<int>(d);
        break;
      }
    }
  }
  out.batch_scale.assign(g.values.size(), 1);
  find_flattened_batches(g, out.batch_symbols, out);
  out.is_batch_size.assign(g.values.size(), false);
  out.times_batch_size.assign(g.values.size(), false);
  for (const auto& node : g.nodes) {
    const auto ins = Graph::node_inputs(node);
    const auto outs = Graph::node_outputs(node);
    if (node.op == "aten::sym_size" && ins.size() == 1 && outs.size() == 1 && node.args.size() == 2 &&
        node.args[1].kind == Argument::Kind::kInt) {
      // The size of one dimension: the batch size (a share's own on each replica) or a
      // size that no replica changes.
      const auto& shape = g.values[ins[0]].shape;
      std::int64_t d = node.args[1].int_value;
      if (d < 0) d += static_cast<std::int64_t>(shape.size());
      out.is_batch_size[outs[0]] = d >= 0 && d == out.batch_dim[ins[0]];
      out.on_batch[outs[0]] = out.is_batch_size[outs[0]];
      continue;
    }
    if (node.op == kSymOpName && node.overload == "mul" && outs.size() == 1) {
      // The batch size times sizes no share changes: each share's is its own size times them.
      int batch_factors = 0, other = 0;
      for (ValueId in : ins) {
        if (out.is_batch_size[in] || out.times_batch_size[in]) ++batch_factors;
        else if (out.on_batch[in]) ++other;
      }
      out.times_batch_size[outs[0]] = batch_factors == 1 && other == 0;
    }
    bool depends = false, on_data = false, positions = false;
    for (ValueId in : ins) {
      depends = depends || out.on_batch[in];
      on_data = on_data || on_batch_data[in];
      positions = positions || out.share_positions[in] || (node.op == "aten::arange" && out.is_batch_size[in]);
    }
    if (positions && picks_own_rows(g, node, out)) positions = false;
    for (ValueId o : outs) {
      out.on_batch[o] = depends;
      on_batch_data[o] = on_data;
      out.share_positions[o] = positions && !on_data;
    }
  }
  return out;
}

bool BatchValues::redistributable(const Graph& g, ValueId v) const {
  if (!on_batch[v] || is_batch_size[v] || times_batch_size[v]) return true;
  const Value& val = g.values[v];
  int batch_dims = 0;
  for (std::size_t d = 0; d < val.shape.size(); ++d) {
    if (batch_symbols.count(val.shape[d].symbol) || (d == 0 && batch_dim[v] == 0 && batch_scale[v] != 1)) {
      ++batch_dims;
    } else if (mentions_batch(val.shape[d].symbol, batch_symbols)) {
      return false;  // the batch within a product (a flattened batch): not one share per sample
    }
  }
  return val.kind == ValueKind::kTensor && batch_dims == 1 && !share_positions[v];
}

}  // namespace conveyor::graph
