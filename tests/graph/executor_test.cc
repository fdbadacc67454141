#include "common/recomputation.h"
#include "graph/executor.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "test_graphs.h"

namespace conveyor::graph {
namespace {

TensorMap mlp_tensors() {
  torch::manual_seed(0);
  auto opts = torch::TensorOptions().dtype(torch::kDouble).requires_grad(true);
  return {{"fc1.weight", torch::randn({8, 4}, opts)}, {"fc1.bias", torch::randn({8}, opts)},
          {"fc2.weight", torch::randn({3, 8}, opts)}, {"fc2.bias", torch::randn({3}, opts)}};
}

void zero_grads(TensorMap& t) {
  for (auto& [name, tensor] : t) {
    if (tensor.grad().defined()) tensor.mutable_grad().zero_();
  }
}

TEST(GraphExecutor, WholeGraphMatchesEagerForwardAndBackward) {
  TensorMap t = mlp_tensors();
  auto ex = GraphExecutor::create(testing::mlp_graph(), t);
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  auto x = torch::randn({5, 4}, torch::kDouble);
  auto out = (*ex)->run({x});
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  auto loss = out->at(0).toTensor();
  loss.backward();
  std::map<std::string, at::Tensor> graph_grads;
  for (auto& [n, p] : t) graph_grads[n] = p.grad().clone();
  zero_grads(t);

  auto eager = torch::linear(torch::relu(torch::linear(x, t["fc1.weight"], t["fc1.bias"])), t["fc2.weight"],
                             t["fc2.bias"]).sum();
  eager.backward();
  EXPECT_TRUE(torch::equal(loss, eager));
  for (auto& [n, p] : t) EXPECT_TRUE(torch::equal(graph_grads[n], p.grad())) << n;
}

TEST(GraphExecutor, BatchSizeIsFreeAtRunTime) {
  auto ex = GraphExecutor::create(testing::mlp_graph(), mlp_tensors());
  ASSERT_TRUE(ex.is_ok());
  for (int batch : {1, 3, 17}) {
    auto out = (*ex)->run({torch::randn({batch, 4}, torch::kDouble)});
    ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  }
}

// Runs `stages` in order like a pipeline and returns the loss; backward leaves grads in `t`.
// Runs `parts` as a pipeline of one microbatch; recomputing fully, every stage keeps only its
// inputs (forward_for_recompute) and runs its forward again before its backward; selectively,
// its cheap operators run again inside the backward (forward_selective).
double run_staged(const std::shared_ptr<GraphExecutor>& ex, const std::vector<std::vector<NodeId>>& parts,
                  const at::Tensor& x, Recomputation mode = Recomputation::kNone) {
  const bool recompute = mode == Recomputation::kFull;
  const Graph& g = ex->graph();
  std::map<ValueId, c10::IValue> values = {{g.inputs[0].value, x}};
  std::vector<std::shared_ptr<const StageProgram>> stages;
  std::vector<StageActivation> acts;
  for (const auto& p : parts) {
    auto s = ex->stage(p);
    EXPECT_TRUE(s.is_ok()) << s.status().to_string();
    std::vector<c10::IValue> in;
    for (ValueId v : (*s)->inputs()) in.push_back(values.at(v));
    auto act = recompute                               ? (*s)->forward_for_recompute(in)
               : mode == Recomputation::kSelective ? (*s)->forward_selective(in)
                                                   : (*s)->forward(in);
    EXPECT_TRUE(act.is_ok()) << act.status().to_string();
    if (recompute) {  // no autograd graph is kept: the outputs are leaves that still ask for gradients
      for (const auto& out : act->outputs) {
        if (out.isTensor() && out.toTensor().is_floating_point()) {
          EXPECT_EQ(out.toTensor().grad_fn(), nullptr);
          EXPECT_TRUE(out.toTensor().requires_grad());
        }
      }
    }
    for (std::size_t i = 0; i < (*s)->outputs().size(); ++i) values[(*s)->outputs()[i]] = act->outputs[i];
    stages.push_back(*s);
    acts.push_back(std::move(act).value());
  }
  at::Tensor loss = values.at(g.outputs[0]).toTensor();
  double result = loss.item<double>();
  std::map<ValueId, at::Tensor> grads = {{g.outputs[0], torch::ones_like(loss)}};
  for (std::size_t i = stages.size(); i-- > 0;) {
    std::vector<c10::IValue> out_grads;
    for (ValueId v : stages[i]->outputs()) {
      auto it = grads.find(v);
      out_grads.push_back(it == grads.end() ? c10::IValue() : c10::IValue(it->second));
    }
    if (recompute) {
      EXPECT_TRUE(acts[i].needs_recompute);
      Status again = stages[i]->recompute(acts[i]);
      EXPECT_TRUE(again.is_ok()) << again.to_string();
      EXPECT_FALSE(acts[i].needs_recompute);
    }
    auto in_grads = stages[i]->backward(acts[i], out_grads);
    EXPECT_TRUE(in_grads.is_ok()) << in_grads.status().to_string();
    for (std::size_t j = 0; j < stages[i]->inputs().size(); ++j) {
      if (!in_grads->at(j).isTensor()) continue;
      ValueId v = stages[i]->inputs()[j];
      auto grad = in_grads->at(j).toTensor();
      grads[v] = grads.count(v) ? grads[v] + grad : grad;
    }
  }
  return result;
}

TEST(StageProgram, RandomCutsGiveTheSameLossAndGradientsWithAndWithoutRecomputation) {
  for (const Graph& g : {testing::mlp_graph(), testing::diamond_graph(), testing::inplace_view_graph()}) {
    TensorMap t;
    torch::manual_seed(1);
    for (const auto& b : g.bindings) {
      std::vector<int64_t> shape;
      for (const auto& d : g.values[b.value].shape) shape.push_back(d.size);
      t[b.name] = torch::randn(shape, torch::dtype(torch::kDouble).requires_grad(true));
    }
    auto ex = GraphExecutor::create(g, t);
    ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
    auto x = torch::randn({6, 4}, torch::kDouble);
    auto whole = (*ex)->run({x});
    ASSERT_TRUE(whole.is_ok()) << whole.status().to_string();
    whole->at(0).toTensor().backward();
    std::map<std::string, at::Tensor> expected;
    for (auto& [n, p] : t) expected[n] = p.grad().clone();
    for (int k = 2; k <= 3; ++k) {
      for (std::uint64_t seed = 0; seed < 5; ++seed) {
        zero_grads(t);
        auto parts = random_partition(g, k, seed, false);
        ASSERT_TRUE(parts.is_ok());
        for (Recomputation mode : {Recomputation::kNone, Recomputation::kSelective, Recomputation::kFull}) {
          zero_grads(t);
          double loss = run_staged(*ex, *parts, x, mode);
          EXPECT_DOUBLE_EQ(loss, whole->at(0).toTensor().item<double>());
          for (auto& [n, p] : t) {
            EXPECT_TRUE(torch::allclose(expected[n], p.grad(), 1e-12, 1e-12))
                << n << " k=" << k << " seed=" << seed << " recomputing " << recomputation_name(mode);
          }
        }
      }
    }
  }
}

// Selective recomputation wraps only runs that free something: the diamond's relu, sigmoid,
// sum and product (the sigmoid's output and the sum are saved inside the run), not the mlp's
// lone relu between two linear layers (it would keep what the relu keeps), and nothing that
// reads or writes a storage written in place. A split backward over a selective stage equals the whole one.
TEST(StageProgram, SelectiveRecomputationRunsOnlyCheapOperatorsThatFreeSomething) {
  auto bind = [](const Graph& g) {
    TensorMap t;
    torch::manual_seed(3);
    for (const auto& b : g.bindings) {
      std::vector<int64_t> shape;
      for (const auto& d : g.values[b.value].shape) shape.push_back(d.size);
      t[b.name] = torch::randn(shape, torch::dtype(torch::kDouble).requires_grad(true));
    }
    return t;
  };
  auto runs_of = [&](const Graph& g) {
    auto ex = GraphExecutor::create(g, bind(g));
    EXPECT_TRUE(ex.is_ok());
    std::vector<NodeId> all(g.nodes.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<NodeId>(i);
    return (*(*ex)->stage(all))->selective_runs();
  };
  const std::vector<RecomputedRun> diamond = runs_of(testing::diamond_graph());
  ASSERT_EQ(diamond.size(), 1u);
  EXPECT_EQ(diamond[0].nodes, (std::vector<NodeId>{1, 2, 3, 4, 5}));
  EXPECT_EQ(diamond[0].inputs, (std::vector<ValueId>{0, 2}));  // x and the linear's output: kept in their stead
  EXPECT_TRUE(runs_of(testing::mlp_graph()).empty());
  for (const RecomputedRun& run : runs_of(testing::inplace_view_graph())) {
    for (NodeId n : run.nodes) EXPECT_GE(n, 6) << "node " << n << " reads or writes y, which node 4 writes in place";
  }

  const Graph g = testing::diamond_graph();
  TensorMap t = bind(g);
  auto ex = GraphExecutor::create(g, t);
  ASSERT_TRUE(ex.is_ok());
  auto stage = (*ex)->stage({0, 1, 2, 3, 4, 5});
  ASSERT_TRUE(stage.is_ok());
  const at::Tensor x = torch::randn({5, 4}, torch::kDouble);
  std::map<std::string, at::Tensor> whole;
  for (bool selective : {false, true}) {
    for (bool split : {false, true}) {
      zero_grads(t);
      auto act = selective ? (*stage)->forward_selective({x}) : (*stage)->forward({x});
      ASSERT_TRUE(act.is_ok()) << act.status().to_string();
      const at::Tensor loss = act->outputs[0].toTensor();
      EXPECT_NE(loss.grad_fn(), nullptr);
      std::vector<c10::IValue> grads{torch::ones_like(loss)};
      if (split) {
        ASSERT_TRUE((*stage)->backward_input(*act, grads).is_ok());
        ASSERT_TRUE((*stage)->backward_weight(*act).is_ok());
      } else {
        ASSERT_TRUE((*stage)->backward(*act, grads).is_ok());
      }
      for (auto& [n, p] : t) {
        if (!selective && !split) {
          whole[n] = p.grad().clone();
        } else {
          EXPECT_TRUE(torch::equal(whole[n], p.grad())) << n << (selective ? " selective" : "") << (split ? " split" : "");
        }
      }
    }
  }
}

TEST(StageProgram, ARecomputedStageSeesItsInputsAsTheyWereBeforeItWroteThem) {
  // x -> add_(x, 1) in place -> linear -> sum: the first forward writes into the input; the
  // recomputed forward must start from the input as the first one did.
  testing::GraphBuilder b;
  ValueId x = b.input("x", {testing::sym("s0"), testing::fixed(4)});
  ValueId w = b.parameter("w", {testing::fixed(3), testing::fixed(4)});
  ValueId bumped = b.op("aten::add_", "Tensor", {testing::v(x), Argument::of_int(1), Argument::of_int(1)},
                        {testing::sym("s0"), testing::fixed(4)}, {0}, {0});
  ValueId h = b.op("aten::linear", "", {testing::v(bumped), testing::v(w), Argument::none()},
                   {testing::sym("s0"), testing::fixed(3)});
  b.output(b.op("aten::sum", "", {testing::v(h), Argument::none()}, {}));
  TensorMap t{{"w", torch::randn({3, 4}, torch::dtype(torch::kDouble).requires_grad(true))}};
  auto ex = GraphExecutor::create(b.build(), t);
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  auto stage = (*ex)->stage({0, 1, 2});
  ASSERT_TRUE(stage.is_ok()) << stage.status().to_string();
  const at::Tensor x0 = torch::randn({5, 4}, torch::kDouble);
  at::Tensor plain_x = x0.clone(), recomputed_x = x0.clone();
  auto plain = (*stage)->forward({plain_x});
  ASSERT_TRUE(plain.is_ok()) << plain.status().to_string();
  ASSERT_EQ(plain->outputs.size(), 1u);
  const double plain_loss = plain->outputs[0].toTensor().item<double>();
  auto plain_grads = (*stage)->backward(*plain, {c10::IValue(torch::ones({}, torch::kDouble))});
  ASSERT_TRUE(plain_grads.is_ok());
  const at::Tensor expected = t["w"].grad().clone();
  t["w"].mutable_grad().zero_();
  auto act = (*stage)->forward_for_recompute({recomputed_x});
  ASSERT_TRUE(act.is_ok()) << act.status().to_string();
  Status again = (*stage)->recompute(*act);
  ASSERT_TRUE(again.is_ok()) << again.to_string();
  ASSERT_EQ(act->outputs.size(), 1u);
  EXPECT_DOUBLE_EQ(act->outputs[0].toTensor().item<double>(), plain_loss);
  ASSERT_TRUE((*stage)->backward(*act, {c10::IValue(torch::ones({}, torch::kDouble))}).is_ok());
  EXPECT_TRUE(torch::equal(t["w"].grad(), expected));
  EXPECT_TRUE(torch::equal(recomputed_x, x0 + 1));  // written once, as eager writes it
}

TEST(GraphExecutor, AViewThatMeetsOtherStridesThanTracedRunsAsReshapeUnlessWrittenThrough) {
  // x[s0, 3, 4] -> permute(1, 0, 2) -> view [3 * s0, 4] -> sum: the permuted tensor is not
  // viewable so (torch.export can leave such a view where a kernel returned another layout
  // when it traced). Nothing writes through it: it runs as reshape, with the same values.
  auto build = [](bool write_through) {
    testing::GraphBuilder b;
    ValueId x = b.input("x", {testing::sym("s0"), testing::fixed(3), testing::fixed(4)});
    ValueId w = b.parameter("w", {testing::fixed(4), testing::fixed(4)});
    ValueId h = b.op("aten::linear", "", {testing::v(x), testing::v(w), Argument::none()},
                     {testing::sym("s0"), testing::fixed(3), testing::fixed(4)});
    ValueId p = b.op("aten::permute", "", {testing::v(h), Argument::of_list({Argument::of_int(1), Argument::of_int(0),
                                                                            Argument::of_int(2)})},
                     {testing::fixed(3), testing::sym("s0"), testing::fixed(4)}, {}, {0});
    ValueId flat = b.op("aten::view", "", {testing::v(p), Argument::of_list({Argument::of_int(-1), Argument::of_int(4)})},
                        {testing::sym("3*s0"), testing::fixed(4)}, {}, {0});
    if (write_through) flat = b.op("aten::mul_", "Tensor", {testing::v(flat), Argument::of_int(2)},
                                   {testing::sym("3*s0"), testing::fixed(4)}, {0}, {0});
    b.output(b.op("aten::sum", "", {testing::v(flat), Argument::none()}, {}));
    return b.build();
  };
  const at::Tensor w = torch::randn({4, 4}, torch::kDouble);
  const at::Tensor x = torch::randn({2, 3, 4}, torch::kDouble);
  auto ex = GraphExecutor::create(build(false), {{"w", w}});
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  auto out = (*ex)->run({x});
  ASSERT_TRUE(out.is_ok()) << out.status().to_string();
  EXPECT_DOUBLE_EQ(out->at(0).toTensor().item<double>(), at::linear(x, w).sum().item<double>());
  // Written through, a copy would lose the write: it stays a view, and fails as eager's would.
  auto written = GraphExecutor::create(build(true), {{"w", w}});
  ASSERT_TRUE(written.is_ok()) << written.status().to_string();
  auto refused = (*written)->run({x});
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("aten::view"), std::string::npos) << refused.status().message();
}

TEST(StageProgram, InvalidCutsAreRefused) {
  auto ex = GraphExecutor::create(testing::diamond_graph(),
                                  {{"w", torch::randn({4, 4}, torch::kDouble)}});
  ASSERT_TRUE(ex.is_ok());
  auto s = (*ex)->stage({0, 3});
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.status().code(), ErrorCode::kInvalidStage);
}

TEST(GraphExecutor, UnknownOperatorIsNamed) {
  Graph g = testing::mlp_graph();
  g.nodes[1].op = "aten::relu_but_fancier";
  g.producer["torch"] = "9.9.0";
  auto ex = GraphExecutor::create(g, mlp_tensors());
  ASSERT_FALSE(ex.is_ok());
  EXPECT_EQ(ex.status().code(), ErrorCode::kUnknownOp);
  EXPECT_NE(ex.status().message().find("aten::relu_but_fancier"), std::string::npos);
  EXPECT_NE(ex.status().message().find("captured with torch 9.9.0"), std::string::npos);
}

TEST(GraphExecutor, WrongArgumentCountIsReported) {
  Graph g = testing::mlp_graph();
  g.nodes[1].args.push_back(Argument::of_int(3));
  auto ex = GraphExecutor::create(g, mlp_tensors());
  ASSERT_FALSE(ex.is_ok());
  EXPECT_EQ(ex.status().code(), ErrorCode::kInvalidGraph);
  EXPECT_NE(ex.status().message().find("has 2 arguments but the schema"), std::string::npos) << ex.status().message();
}

TEST(GraphExecutor, MissingOrMismatchedTensorsAreReported) {
  TensorMap t = mlp_tensors();
  t.erase("fc2.bias");
  auto missing = GraphExecutor::create(testing::mlp_graph(), t);
  EXPECT_NE(missing.status().message().find("'fc2.bias'"), std::string::npos);

  TensorMap u = mlp_tensors();
  u["fc1.weight"] = torch::randn({8, 5}, torch::kDouble);
  auto wrong = GraphExecutor::create(testing::mlp_graph(), u);
  EXPECT_NE(wrong.status().message().find("has shape [8, 5] but the graph expects [8, 4]"), std::string::npos)
      << wrong.status().message();

  TensorMap w = mlp_tensors();
  w["fc1.bias"] = torch::randn({8}, torch::kFloat);
  auto dtype = GraphExecutor::create(testing::mlp_graph(), w);
  EXPECT_NE(dtype.status().message().find("dtype float32 but the graph expects float64"), std::string::npos);
}

TEST(GraphExecutor, InputsAreCheckedAgainstTheCapturedShapesDtypesAndRanges) {
  Graph g = testing::mlp_graph();
  g.ranges["s0"] = {2, 16};
  auto ex = GraphExecutor::create(g, mlp_tensors());
  ASSERT_TRUE(ex.is_ok());
  auto expect_refused = [&](const at::Tensor& x, const std::string& says) {
    auto out = (*ex)->run({x});
    ASSERT_FALSE(out.is_ok());
    EXPECT_EQ(out.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find(says), std::string::npos) << out.status().message();
  };
  expect_refused(torch::randn({2, 7}, torch::kDouble), "input 0 ('x') has shape [2, 7] but the graph was captured for [s0, 4]");
  expect_refused(torch::randn({2, 4, 1}, torch::kDouble), "has shape [2, 4, 1]");
  expect_refused(torch::randn({2, 4}, torch::kFloat), "has dtype float32 but the graph was captured with float64");
  expect_refused(torch::randn({1, 4}, torch::kDouble), "has batch (s0) = 1 but the graph holds for 2 to 16 only");
  expect_refused(torch::randn({17, 4}, torch::kDouble), "has batch (s0) = 17");
  for (std::int64_t batch : {2, 16}) EXPECT_TRUE((*ex)->run({torch::randn({batch, 4}, torch::kDouble)}).is_ok());
}

TEST(GraphExecutor, InputsThatDisagreeOnTheBatchAreRefused) {
  testing::GraphBuilder b;
  ValueId x = b.input("x", {testing::sym("s0"), testing::fixed(4)});
  ValueId y = b.input("y", {testing::sym("s0"), testing::fixed(4)});
  b.output(b.op("aten::mul", "Tensor", {testing::v(x), testing::v(y)}, {testing::sym("s0"), testing::fixed(4)}));
  auto ex = GraphExecutor::create(b.build(), {});
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  auto out = (*ex)->run({torch::randn({3, 4}, torch::kDouble), torch::randn({2, 4}, torch::kDouble)});
  ASSERT_FALSE(out.is_ok());
  EXPECT_NE(out.status().message().find("inputs 0 and 1 disagree on s0: 3 and 2"), std::string::npos)
      << out.status().message();
}

TEST(GraphExecutor, OperatorFailuresNameTheNodeAndSource) {
  // Shapes as the graph declares them, but fc1's weight does not fit the input: linear fails.
  testing::GraphBuilder b;
  ValueId x = b.input("x", {testing::sym("s0"), testing::fixed(4)});
  ValueId w = b.parameter("w", {testing::fixed(8), testing::fixed(5)});
  ValueId h = b.op("aten::linear", "", {testing::v(x), testing::v(w), Argument::none()},
                   {testing::sym("s0"), testing::fixed(8)});
  b.output(b.op("aten::sum", "", {testing::v(h), Argument::none()}, {}));
  auto ex = GraphExecutor::create(b.build(), {{"w", torch::randn({8, 5}, torch::kDouble)}});
  ASSERT_TRUE(ex.is_ok()) << ex.status().to_string();
  auto out = (*ex)->run({torch::randn({2, 4}, torch::kDouble)});
  ASSERT_FALSE(out.is_ok());
  EXPECT_EQ(out.status().code(), ErrorCode::kExecution);
  EXPECT_NE(out.status().message().find("node 0 (aten::linear, from test_graphs.cc:0) failed"), std::string::npos)
      << out.status().message();
}

}  // namespace
}  // namespace conveyor::graph
