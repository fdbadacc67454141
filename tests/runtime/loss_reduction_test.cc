// How a graph's loss combines its samples (runtime/loss_reduction.h), which decides each
// share's weight in a split step: a mean's shares weigh their samples over the batch's, a
// sum's weigh 1. Hand-built graphs; no torch.
#include <gtest/gtest.h>

#include <functional>
#include <tuple>

#include "../graph/test_graphs.h"
#include "runtime/batch_layout.h"

namespace conveyor::runtime {
namespace {

using graph::Argument;
using graph::Graph;
using graph::ValueId;
using graph::testing::fixed;
using graph::testing::GraphBuilder;
using graph::testing::sym;
using graph::testing::v;

// x[b, 4] -> linear -> y[b, 3], then `loss` makes the scalar loss from y (with x, a weight).
Graph with_loss(const std::function<ValueId(GraphBuilder&, ValueId y, ValueId x, ValueId w)>& loss) {
  GraphBuilder b;
  ValueId x = b.input("x", {sym("s0"), fixed(4)});
  ValueId w = b.parameter("w", {fixed(3), fixed(4)});
  ValueId y = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(3)});
  b.output(loss(b, y, x, w));
  Graph g = b.build();
  g.symbols["s0"] = "batch";
  return g;
}

LossReductionFound found(const Graph& g) {
  std::vector<graph::NodeId> all;
  for (const auto& n : g.nodes) all.push_back(n.id);
  auto layout = BatchLayout::analyze(g, {all}, {1});
  EXPECT_TRUE(layout.is_ok()) << layout.status().to_string();
  return layout->loss_reduction;
}

ValueId total(GraphBuilder& b, const std::string& op, ValueId t) {
  return b.op(op, "", {v(t), Argument::none()}, {});
}

TEST(LossReduction, SumsAndMeansOverTheBatch) {
  EXPECT_EQ(found(graph::testing::mlp_graph()).reduction, LossReduction::kSum);
  EXPECT_EQ(found(with_loss([](GraphBuilder& b, ValueId y, ValueId, ValueId) { return total(b, "aten::mean", y); }))
                .reduction,
            LossReduction::kMean);
  // A mean over the batch, then a sum over the features: still a mean over the samples.
  EXPECT_EQ(found(with_loss([](GraphBuilder& b, ValueId y, ValueId, ValueId) {
              ValueId per_feature = b.op("aten::mean", "dim", {v(y), Argument::of_list({Argument::of_int(0)})},
                                         {fixed(3)});
              return total(b, "aten::sum", per_feature);
            })).reduction,
            LossReduction::kMean);
}

TEST(LossReduction, ALossFunctionsReductionArgumentDecides) {
  for (const auto& [reduction, want] : {std::pair{1, LossReduction::kMean}, std::pair{2, LossReduction::kSum}}) {
    const Graph g = with_loss([reduction = reduction](GraphBuilder& b, ValueId y, ValueId x, ValueId) {
      return b.op("aten::mse_loss", "", {v(y), v(y), Argument::of_int(reduction)}, {});
    });
    EXPECT_EQ(found(g).reduction, want) << reduction;
  }
}

TEST(LossReduction, AMeanOverCountedTargetsIsNeitherASumOverThemIs) {
  // cross_entropy's mean divides by the targets other than ignore_index: a share's count is
  // its own. Class probabilities (a float target) average over the samples.
  for (const auto& [dtype, reduction, want] :
       {std::tuple{"int64", 1, LossReduction::kOther}, std::tuple{"int64", 2, LossReduction::kSum},
        std::tuple{"float64", 1, LossReduction::kMean}}) {
    GraphBuilder b;
    ValueId x = b.input("x", {sym("s0"), fixed(4)});
    ValueId t = b.input("t", {sym("s0")}, dtype);
    ValueId w = b.parameter("w", {fixed(3), fixed(4)});
    ValueId y = b.op("aten::linear", "", {v(x), v(w), Argument::none()}, {sym("s0"), fixed(3)});
    ValueId target = std::string(dtype) == "int64" ? t : b.op("aten::softmax", "int", {v(y), Argument::of_int(-1),
                                                                                        Argument::none()},
                                                               {sym("s0"), fixed(3)});
    b.output(b.op("aten::cross_entropy_loss", "", {v(y), v(target), Argument::none(), Argument::of_int(reduction),
                                                   Argument::of_int(-100), Argument::of_float(0.0)}, {}));
    Graph g = b.build();
    g.symbols["s0"] = "batch";
    const LossReductionFound f = found(g);
    EXPECT_EQ(f.reduction, want) << dtype << " " << reduction;
    if (want == LossReduction::kOther) EXPECT_NE(f.why.find("targets it counts"), std::string::npos) << f.why;
  }
}

TEST(LossReduction, ASumDividedByTheBatchSizeIsAMean) {
  const Graph g = with_loss([](GraphBuilder& b, ValueId y, ValueId x, ValueId) {
    ValueId size = b.op("aten::sym_size", "int", {v(x), Argument::of_int(0)}, {});
    return b.op("aten::div", "Tensor", {v(total(b, "aten::sum", y)), v(size)}, {});
  });
  EXPECT_EQ(found(g).reduction, LossReduction::kMean);
}

TEST(LossReduction, ASumOverANumberMadeFromTheBatchSizeIsNoMean) {
  // sum / float(B) is a mean; sum / B ** 2 is not (a share's B ** 2 is no share of the call's):
  // it read as a constant, and a split step returned 4x the loss, silently (a user trial).
  auto over = [](const std::string& arithmetic) {
    return with_loss([arithmetic](GraphBuilder& b, ValueId y, ValueId x, ValueId) {
      ValueId size = b.op("aten::sym_size", "int", {v(x), Argument::of_int(0)}, {});
      ValueId made = arithmetic == "float" ? b.op("conveyor::sym", "float", {v(size)}, {})
                                           : b.op("conveyor::sym", "pow", {v(size), Argument::of_int(2)}, {});
      return b.op("aten::div", "Tensor", {v(total(b, "aten::sum", y)), v(made)}, {});
    });
  };
  EXPECT_EQ(found(over("float")).reduction, LossReduction::kMean);
  const LossReductionFound squared = found(over("pow"));
  EXPECT_EQ(squared.reduction, LossReduction::kOther);
  EXPECT_NE(squared.why.find("by a number made from the batch size"), std::string::npos) << squared.why;
}

TEST(LossReduction, ConstantsMayScaleEitherAndBeAddedToAMeanOnly) {
  auto plus_weight_norm = [](const std::string& over_batch) {
    return with_loss([over_batch](GraphBuilder& b, ValueId y, ValueId, ValueId w) {
      ValueId scaled = b.op("aten::mul", "Scalar", {v(total(b, over_batch, y)), Argument::of_float(2.0)}, {});
      return b.op("aten::add", "Tensor", {v(scaled), v(total(b, "aten::sum", w)), Argument::of_int(1)}, {});
    });
  };
  EXPECT_EQ(found(plus_weight_norm("aten::mean")).reduction, LossReduction::kMean);
  const LossReductionFound sum = found(plus_weight_norm("aten::sum"));
  EXPECT_EQ(sum.reduction, LossReduction::kOther);
  EXPECT_EQ(sum.why.rfind("aten::add (", 0), 0u) << sum.why;  // named, with its source line
  EXPECT_NE(sum.why.find("adds a term that does not grow with the batch to a sum over it"), std::string::npos) << sum.why;
}

TEST(LossReduction, InPlaceArithmeticReadsAsItsOwnOp) {
  // An MoE's `loss += coef * aux_loss`: aten::add_ of two means is a mean, as aten::add.
  const Graph g = with_loss([](GraphBuilder& b, ValueId y, ValueId, ValueId) {
    ValueId loss = total(b, "aten::mean", y);
    ValueId aux = b.op("aten::mul_", "Scalar", {v(total(b, "aten::mean", y)), Argument::of_float(0.01)}, {});
    return b.op("aten::add_", "Tensor", {v(loss), v(aux), Argument::of_int(1)}, {});
  });
  EXPECT_EQ(found(g).reduction, LossReduction::kMean) << found(g).why;
}

TEST(LossReduction, ANonlinearFunctionOfTheLossIsNeitherAndNamed) {
  const LossReductionFound rms = found(with_loss([](GraphBuilder& b, ValueId y, ValueId, ValueId) {
    return b.op("aten::sqrt", "", {v(total(b, "aten::mean", y))}, {});
  }));
  EXPECT_EQ(rms.reduction, LossReduction::kOther);
  EXPECT_EQ(rms.why.rfind("aten::sqrt (", 0), 0u) << rms.why;
  EXPECT_NE(rms.why.find("is not linear in the mean over the samples"), std::string::npos) << rms.why;
  // The largest sample's loss: the batch combined by neither a sum nor a mean.
  const LossReductionFound most = found(with_loss([](GraphBuilder& b, ValueId y, ValueId, ValueId) {
    return b.op("aten::amax", "", {v(y), Argument::of_list({}), Argument::of_bool(false)}, {});
  }));
  EXPECT_EQ(most.reduction, LossReduction::kOther);
  EXPECT_EQ(most.why.rfind("aten::amax (", 0), 0u) << most.why;
  EXPECT_NE(most.why.find("combines the samples otherwise than by a sum or a mean"), std::string::npos) << most.why;
}

}  // namespace
}  // namespace conveyor::runtime
