#include "runtime/batch_layout.h"

#include <algorithm>
#include <cctype>
#include <set>
#include <string>

#include "graph/partition.h"

namespace conveyor::runtime {

using graph::NodeId;
using graph::ValueId;

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
void find_flattened_batches(const graph::Graph& g, const std::set<std::string>& batch_symbols, BatchLayout& out) {
  const std::vector<NodeId> defined_by = g.producers();
  auto same_front = [&](ValueId a, const std::vector<graph::Dim>& front) {
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
      const graph::Node& n = g.nodes[defined_by[at]];
      const auto ins = graph::Graph::node_inputs(n);
      if (ins.empty()) continue;
      // Each row repeated k times in place (repeat_interleave along dim 0, or of a 1-d tensor):
      // runs of k per sample, as a flattening makes.
      const bool repeats_rows =
          n.op == "aten::repeat_interleave" && n.args.size() > 2 &&
          ((n.args[2].kind == graph::Argument::Kind::kInt && n.args[2].int_value == 0) ||
           (n.args[2].kind == graph::Argument::Kind::kNone && g.values[ins[0]].shape.size() == 1));
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

}  // namespace

Result<BatchLayout> BatchLayout::analyze(const graph::Graph& g, const std::vector<std::vector<NodeId>>& stages,
                                         const std::vector<int>& stage_replicas,
                                         const std::vector<int>& stage_split) {
  auto alike = [&](int a, int b) {
    return stage_split.empty() ? stage_replicas[a] == stage_replicas[b] : stage_split[a] == stage_split[b];
  };
  if (g.outputs.size() != 1 || g.values[g.outputs[0]].kind != graph::ValueKind::kTensor ||
      !g.values[g.outputs[0]].shape.empty()) {
    return Status(ErrorCode::kInvalidArgument,
                  "the model's forward must return one scalar loss to be trained pipelined (it returns " +
                      std::to_string(g.outputs.size()) +
                      " values); compute the loss inside forward, or wrap the model so that it does");
  }
  const int num_stages = static_cast<int>(stages.size());
  BatchLayout out;
  out.loss = g.outputs[0];
  out.producer.assign(g.values.size(), -1);
  for (int s = 0; s < num_stages; ++s) {
    for (NodeId n : stages[s]) {
      for (ValueId v : graph::Graph::node_outputs(g.nodes[n])) out.producer[v] = s;
    }
  }
  std::set<std::string> batch_symbols;
  for (const auto& [symbol, role] : g.symbols) {
    if (role != "batch") continue;
    batch_symbols.insert(symbol);
    if (auto r = g.ranges.find(symbol); r != g.ranges.end()) {
      out.range.min = std::max(out.range.min, r->second.min);
      out.range.max = std::min(out.range.max, r->second.max);
    }
  }
  std::vector<bool> on_batch(g.values.size(), false);  // depends on a batched input
  // Depends on a batched input's data, and holds positions within a share (made from
  // arange(batch) and no data): such positions mean nothing once shares are joined and split.
  std::vector<bool> on_batch_data(g.values.size(), false), share_positions(g.values.size(), false);
  for (std::size_t i = 0; i < g.inputs.size(); ++i) {
    const graph::Value& v = g.values[g.inputs[i].value];
    out.input_index[g.inputs[i].value] = static_cast<int>(i);
    const bool batched = v.kind == graph::ValueKind::kTensor && !v.shape.empty() && batch_symbols.count(v.shape[0].symbol) > 0;
    out.batched_input.push_back(batched);
    on_batch[g.inputs[i].value] = batched;
    on_batch_data[g.inputs[i].value] = batched;
  }
  out.batch_dim.assign(g.values.size(), -1);
  for (const auto& v : g.values) {
    for (std::size_t d = 0; d < v.shape.size(); ++d) {
      if (batch_symbols.count(v.shape[d].symbol)) {
        out.batch_dim[v.id] = static_cast<int>(d);
        break;
      }
    }
  }
  out.batch_scale.assign(g.values.size(), 1);
  find_flattened_batches(g, batch_symbols, out);
  out.is_batch_size.assign(g.values.size(), false);
  for (const auto& node : g.nodes) {
    const auto ins = graph::Graph::node_inputs(node);
    const auto outs = graph::Graph::node_outputs(node);
    if (node.op == "aten::sym_size" && ins.size() == 1 && outs.size() == 1 && node.args.size() == 2 &&
        node.args[1].kind == graph::Argument::Kind::kInt) {
      // The size of one dimension: the batch size (a share's own on each replica) or a
      // size that no replica changes.
      const auto& shape = g.values[ins[0]].shape;
      std::int64_t d = node.args[1].int_value;
      if (d < 0) d += static_cast<std::int64_t>(shape.size());
      out.is_batch_size[outs[0]] = d >= 0 && d == out.batch_dim[ins[0]];
      on_batch[outs[0]] = out.is_batch_size[outs[0]];
      continue;
    }
    bool depends = false, on_data = false, positions = false;
    for (ValueId in : ins) {
      depends = depends || on_batch[in];
      on_data = on_data || on_batch_data[in];
      positions = positions || share_positions[in] || (node.op == "aten::arange" && out.is_batch_size[in]);
    }
    for (ValueId o : outs) {
      on_batch[o] = depends;
      on_batch_data[o] = on_data;
      share_positions[o] = positions && !on_data;
    }
  }
  out.loss_reduction = find_loss_reduction(g, out.batch_dim, out.is_batch_size);
  // Between stages that split a microbatch differently (replica counts or weights) a value
  // is redistributed along its batch dimension, or, when it does not depend on the batch,
  // taken from any replica.
  for (int s = 0; s < num_stages; ++s) {
    for (ValueId v : graph::stage_boundary(g, stages[s]).inputs) {
      const int p = out.producer[v];
      if (p < 0 || alike(p, s) || !on_batch[v] || out.is_batch_size[v]) continue;
      const graph::Value& val = g.values[v];
      int batch_dims = 0;
      bool other_symbolic = false;
      for (std::size_t d = 0; d < val.shape.size(); ++d) {
        if (batch_symbols.count(val.shape[d].symbol) || (d == 0 && out.batch_dim[v] == 0 && out.batch_scale[v] != 1)) {
          ++batch_dims;
        } else if (mentions_batch(val.shape[d].symbol, batch_symbols)) {
          other_symbolic = true;  // the batch within a product (a flattened batch): not one share per sample
        }
      }
      if (val.kind != graph::ValueKind::kTensor || batch_dims != 1 || other_symbolic || share_positions[v]) {
        return Status(ErrorCode::kUnsupported,
                      "value " + std::to_string(v) + " ('" + val.name + "') passes from stage " + std::to_string(p) +
                          " (" + std::to_string(stage_replicas[p]) + " replicas) to stage " + std::to_string(s) + " (" +
                          std::to_string(stage_replicas[s]) +
                          " replicas, split " + (stage_replicas[p] == stage_replicas[s] ? "by other weights" : "otherwise") +
                          ") but has no plain batch dimension to redistribute along (or holds "
                          "positions within a share, like arange(batch)); give both "
                          "stages the same number of replicas and the same shares, or cut the model elsewhere");
      }
    }
  }
  return out;
}

Status BatchLayout::check_step(std::int64_t batch, int m, const std::vector<int>& stage_replicas,
                               const std::vector<std::vector<double>>& stage_weights) const {
  if (batch < m) {
    return Status(ErrorCode::kInvalidArgument, "the batch has " + std::to_string(batch) + " samples, fewer than the " +
                                                   std::to_string(m) +
                                                   " microbatches the plan runs; use a larger batch, or fix fewer microbatches (microbatches= of "
                                                   "conveyor.Module); a data loader's smaller last batch can be dropped: "
                                                   "drop_last=True");
  }
  const int most = *std::max_element(stage_replicas.begin(), stage_replicas.end());
  if (batch / m < most) {
    return Status(ErrorCode::kInvalidArgument,
                  "the batch has " + std::to_string(batch) + " samples: " + std::to_string(m) + " microbatches leave " +
                      std::to_string(batch / m) + " per microbatch, fewer than the " + std::to_string(most) +
                      " replicas of a stage; use a larger batch, fewer microbatches or fewer replicas (a data "
                      "loader's smaller last batch can be dropped: drop_last=True)");
  }
  // Each replica runs a share of a microbatch; the graph holds only for the sizes its
  // capture allowed (a kernel chosen by size, a branch on the batch size).
  std::int64_t largest = 0, smallest = batch;
  for (std::int64_t micro : {batch / m, (batch + m - 1) / m}) {  // tensor_split's two microbatch lengths
    for (std::size_t s = 0; s < stage_replicas.size(); ++s) {
      const std::vector<double> none;
      for (std::int64_t n : share_lengths(micro, s < stage_weights.size() ? stage_weights[s] : none, stage_replicas[s])) {
        largest = std::max(largest, n);
        smallest = std::min(smallest, n);
      }
    }
  }
  auto outside = [&](const char* bound, std::int64_t limit, std::int64_t share, const char* change) {
    return Status(ErrorCode::kInvalidArgument,
                  std::string("the model's graph holds for ") + bound + " " + std::to_string(limit) +
                      " samples at once (capture found a guard on the batch size: a kernel chosen by size or a "
                      "branch on it), but a replica would run " + std::to_string(share) + " (a batch of " +
                      std::to_string(batch) + " in " + std::to_string(m) + " microbatches, shared by up to " +
                      std::to_string(most) + " replicas); use " + change);
  };
  if (largest > range.max) return outside("at most", range.max, largest, "more microbatches or replicas, or a smaller batch");
  if (smallest < range.min) return outside("at least", range.min, smallest, "fewer microbatches or replicas, or a larger batch");
  return Status::ok();
}

}  // namespace conveyor::runtime
