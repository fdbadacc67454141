#include "runtime/loss_reduction.h"

#include <map>

namespace conveyor::runtime {

using graph::Argument;
using graph::ValueId;

namespace {

// What a value is to the samples.
enum class Of {
  kConstant,     // depends on no sample (parameters, constants, sizes other than the batch's)
  kSamples,      // has a batch dimension
  kBatchSize,    // the batch size itself (or converted: float(B))
  kOfSize,       // a number made from the batch size otherwise (B ** 2, B / 8): a share's differs
  kMean,         // a mean over the samples, or what follows from one linearly
  kSum,          // a sum over the samples, likewise
  kNeither,      // depends on the samples otherwise
};

// Loss functions by schema name, and where their `reduction` argument is (0 none, 1 mean, 2 sum).
const std::map<std::string, std::size_t>& loss_functions() {
  static const std::map<std::string, std::size_t> m{
      {"aten::mse_loss", 2},          {"aten::l1_loss", 2},           {"aten::smooth_l1_loss", 2},
      {"aten::huber_loss", 2},        {"aten::soft_margin_loss", 2},  {"aten::kl_div", 2},
      {"aten::multilabel_margin_loss", 2}, {"aten::binary_cross_entropy", 3}, {"aten::nll_loss", 3},
      {"aten::nll_loss_nd", 3},       {"aten::nll_loss2d", 3},        {"aten::cross_entropy_loss", 3},
      {"aten::hinge_embedding_loss", 3}, {"aten::binary_cross_entropy_with_logits", 4},
      {"aten::margin_ranking_loss", 4}, {"aten::cosine_embedding_loss", 4}, {"aten::multi_margin_loss", 5},
      {"aten::poisson_nll_loss", 5},  {"aten::ctc_loss", 5},          {"aten::triplet_margin_loss", 7},
  };
  return m;
}

// Ops that pass one value on unchanged but for its layout, dtype or sign.
bool passes_on(const std::string& op) {
  static const char* const ops[] = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::flatten",
                                    "aten::squeeze", "aten::unsqueeze", "aten::clone", "aten::alias",
                                    "aten::contiguous", "aten::to", "aten::_to_copy", "aten::neg",
                                    "aten::expand", "aten::expand_as"};
  for (const char* o : ops) {
    if (op == o) return true;
  }
  return false;
}

bool aggregate(Of k) { return k == Of::kMean || k == Of::kSum; }

// A loss whose mean divides by the targets it counts (those other than ignore_index, each
// its class's weight): a share counts its own, so its mean weighs neither its samples nor 1.
// Capture rewrites such a loss as a sum over a count of the whole call's targets where it can
// (bindings/conveyor/counted_targets.py); one left as it was is read here.
bool averages_counted_targets(const graph::Graph& g, const graph::Node& node) {
  static const char* const ops[] = {"aten::nll_loss", "aten::nll_loss_nd", "aten::nll_loss2d",
                                    "aten::cross_entropy_loss"};
  bool counting = false;
  for (const char* o : ops) counting = counting || node.op == o;
  if (!counting || node.args.size() < 4 || node.args[1].kind != Argument::Kind::kValue) return false;
  if (node.args[3].kind != Argument::Kind::kInt || node.args[3].int_value != 1) return false;
  const std::string& dtype = g.values[node.args[1].value].dtype;
  return dtype.rfind("int", 0) == 0 || dtype == "uint8";  // class indices, not probabilities
}

}  // namespace

const char* loss_reduction_name(LossReduction reduction) {
  switch (reduction) {
    case LossReduction::kMean: return "mean";
    case LossReduction::kSum: return "sum";
    case LossReduction::kOther: return "other";
  }
  return "other";
}

LossReductionFound find_loss_reduction(const graph::Graph& g, const std::vector<int>& batch_dim,
                                       const std::vector<bool>& is_batch_size) {
  std::vector<Of> of(g.values.size(), Of::kConstant);
  std::vector<std::string> why(g.values.size());
  for (std::size_t v = 0; v < g.values.size(); ++v) {
    if (batch_dim[v] >= 0) of[v] = Of::kSamples;
    if (is_batch_size[v]) of[v] = Of::kBatchSize;
  }
  auto kind_of = [&](const Argument& a) { return a.kind == Argument::Kind::kValue ? of[a.value] : Of::kConstant; };
  for (const auto& node : g.nodes) {
    const auto ins = graph::Graph::node_inputs(node);
    const std::string where = node.op + (node.source.empty() ? "" : " (" + node.source + ")");
    Of result = Of::kConstant;
    std::string reason;
    bool samples = false, neither = false, size = false, of_size = false;
    Of first_aggregate = Of::kConstant;
    for (ValueId in : ins) {
      samples = samples || of[in] == Of::kSamples;
      size = size || of[in] == Of::kBatchSize;
      of_size = of_size || of[in] == Of::kOfSize;
      if (of[in] == Of::kNeither && !neither) {
        neither = true;
        reason = why[in];
      }
      if (aggregate(of[in]) && first_aggregate == Of::kConstant) first_aggregate = of[in];
    }
    const auto loss = loss_functions().find(node.op);
    if (neither) {
      result = Of::kNeither;
    } else if (samples) {
      // A result with no batch dimension made from the samples (one with one is kSamples below).
      if (averages_counted_targets(g, node)) {
        result = Of::kNeither;
        reason = where + " averages over the targets it counts (ignore_index, class weights), which each share "
                 "counts alone; conveyor makes it a sum over the call's count only where its targets and weights "
                 "come from the inputs, buffers and constants alone, and the whole loss is then a sum";
      } else if (node.op == "aten::sum") {
        result = Of::kSum;
      } else if (node.op == "aten::mean") {
        result = Of::kMean;
      } else if (loss != loss_functions().end() && loss->second < node.args.size() &&
                 node.args[loss->second].kind == Argument::Kind::kInt &&
                 (node.args[loss->second].int_value == 1 || node.args[loss->second].int_value == 2)) {
        result = node.args[loss->second].int_value == 1 ? Of::kMean : Of::kSum;
      } else {
        result = Of::kNeither;
        reason = where + " combines the samples otherwise than by a sum or a mean";
      }
    } else if (aggregate(first_aggregate)) {
      const Of a = first_aggregate;
      // In place, the same arithmetic (an MoE's `loss += coef * aux_loss`).
      std::string op = node.op;
      if (op == "aten::add_" || op == "aten::sub_" || op == "aten::mul_" || op == "aten::div_") op.pop_back();
      const bool binary = node.args.size() >= 2;
      const Of other = binary ? kind_of(node.args[1]) : Of::kConstant;
      const bool first_is_it = !node.args.empty() && kind_of(node.args[0]) == a;
      if (passes_on(node.op) || op == "aten::sum" || op == "aten::mean") {
        result = a;  // a mean over the features of a sum over the samples is still one
      } else if (op == "aten::mul" && first_is_it && other == Of::kConstant) {
        result = a;
      } else if (op == "aten::mul" && other == Of::kBatchSize && a == Of::kMean) {
        result = Of::kSum;
      } else if (op == "aten::div" && first_is_it && other == Of::kConstant) {
        result = a;
      } else if (op == "aten::div" && first_is_it && other == Of::kBatchSize && a == Of::kSum) {
        result = Of::kMean;  // a sum over the batch divided by its size
      } else if ((op == "aten::mul" || op == "aten::div") && other == Of::kOfSize) {
        result = Of::kNeither;
        reason = where + " scales the " + (a == Of::kSum ? "sum" : "mean") +
                 " over the samples by a number made from the batch size, which differs between a share and the call";
      } else if ((op == "aten::add" || op == "aten::sub") && binary) {
        const Of x = kind_of(node.args[0]), y = kind_of(node.args[1]);
        if (x == y || (a == Of::kMean && (x == Of::kConstant || y == Of::kConstant))) {
          result = a;  // losses of one kind added, or a constant added to a mean
        } else {
          result = Of::kNeither;
          reason = where + (a == Of::kSum && (x == Of::kConstant || y == Of::kConstant)
                                ? " adds a term that does not grow with the batch to a sum over it"
                                : " adds a sum over the samples to a mean over them");
        }
      } else {
        result = Of::kNeither;
        reason = where + " is not linear in the " + (a == Of::kSum ? "sum" : "mean") + " over the samples";
      }
    } else if (size || of_size) {
      // Size arithmetic: the size itself through a conversion, any other number made from it
      // differs between a share and the call without being the share's size.
      const bool converts = node.op == graph::kSymOpName && (node.overload == "float" || node.overload == "int");
      result = size && converts ? Of::kBatchSize : Of::kOfSize;
    }
    for (ValueId o : graph::Graph::node_outputs(node)) {
      if (of[o] == Of::kSamples || of[o] == Of::kBatchSize) continue;
      of[o] = result;
      why[o] = reason;
    }
  }
  LossReductionFound found;
  if (g.outputs.size() != 1) return found;
  const ValueId out = g.outputs[0];
  if (of[out] == Of::kSum) {
    found.reduction = LossReduction::kSum;
  } else if (of[out] == Of::kNeither) {
    found.reduction = LossReduction::kOther;
    found.why = why[out];
  }
  return found;
}

}  // namespace conveyor::runtime
