// Planner scale: plans transformer op graphs on large clusters and prints the search time and
// memory against the targets (a 1,000-layer GPT of over 10,000 operators on 1,024 devices in
// 10 s and 4 GB; BERT-large on 64 devices in 2 s), and the plan's throughput against the
// fluid bound (all work spread perfectly over every device, no bubble, no communication).
//
//   ./run bench planner_scale
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>

#include "partitioner/planner.h"

using namespace conveyor;
using namespace conveyor::partitioner;

namespace {

// Operators of a pre-LN transformer layer (11 per layer) at one sample of `seq` tokens, width `h`, bf16,
// costed at `flops` per second (a speed-1 device). Each op's output feeds the next; the
// residual adds also read the layer input (skip connections), attention splits into q, k, v.
struct Builder {
  CostGraph g;
  double h, seq, flops;
  int last = -1;  // value id of the running hidden state

  int op(const std::string& name, double f, std::vector<int> inputs, double out_bytes, double param_bytes = 0,
         int outputs = 1) {
    CostOp o;
    o.name = name;
    o.forward_s = f / flops + 5e-6;  // launch overhead
    o.backward_s = 2 * f / flops + 1e-5;
    o.backward_weight_s = param_bytes > 0 ? f / flops : 0;
    o.saved_bytes = out_bytes;
    o.work_bytes = out_bytes;
    o.inputs = std::move(inputs);
    if (param_bytes > 0) {
      o.params.push_back(static_cast<int>(g.params.size()));
      g.params.push_back({name + ".weight", param_bytes});
    }
    const int id = static_cast<int>(g.ops.size());
    g.ops.push_back(o);
    const int first = static_cast<int>(g.values.size());
    for (int k = 0; k < outputs; ++k) g.values.push_back({id, out_bytes});
    return first;
  }

  void layer(int i) {
    const double act = seq * h * 2;
    const std::string p = "layer" + std::to_string(i) + ".";
    const int x = last;
    int a = op(p + "ln1", 5 * seq * h, {x}, act, 2 * h * 2);
    int qkv = op(p + "qkv", 2 * seq * h * 3 * h, {a}, 3 * act, 3 * h * h * 2);
    int split = op(p + "split", 0, {qkv}, act, 0, 3);  // q, k, v
    // Fused (flash) attention: keeps q, k, v and the output, not the score matrix.
    int ctx = op(p + "attention", 4 * seq * seq * h, {split, split + 1, split + 2}, act);
    int proj = op(p + "proj", 2 * seq * h * h, {ctx}, act, h * h * 2);
    int res1 = op(p + "residual1", seq * h, {proj, x}, act);
    int b = op(p + "ln2", 5 * seq * h, {res1}, act, 2 * h * 2);
    int fc1 = op(p + "fc1", 2 * seq * h * 4 * h, {b}, 4 * act, 4 * h * h * 2);
    int gelu = op(p + "gelu", 8 * seq * 4 * h, {fc1}, 4 * act);
    int fc2 = op(p + "fc2", 2 * seq * 4 * h * h, {gelu}, act, 4 * h * h * 2);
    last = op(p + "residual2", seq * h, {fc2, res1}, act);
  }
};

CostGraph transformer(const std::string& name, int layers, double h, double seq, double vocab, double flops) {
  Builder b{{}, h, seq, flops};
  b.g.name = name;
  b.last = b.op("embed", seq * h, {}, seq * h * 2, vocab * h * 2);
  for (int i = 0; i < layers; ++i) b.layer(i);
  int ln = b.op("ln_f", 5 * seq * h, {b.last}, seq * h * 2, 2 * h * 2);
  b.op("lm_head+loss", 2 * seq * h * vocab, {ln}, 4, vocab * h * 2);
  return b.g;
}

long peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

void run(const char* title, const CostGraph& g, const Cluster& cluster, int batch, double budget_s) {
  PlanOptions o;
  o.batch = batch;
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = make_plan(g, cluster, o);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!plan) {
    std::printf("%s: %s\n", title, plan.status().to_string().c_str());
    return;
  }
  double work = 0, speeds = 0;
  for (const auto& op : g.ops) work += op.forward_s + op.backward_s;
  for (const auto& d : cluster.devices) speeds += d.speed;
  const double fluid = work * batch / g.microbatch / speeds;
  std::printf("\n== %s: %zu operators on %zu devices (%d nodes), batch %d\n", title, g.ops.size(),
              cluster.devices.size(), cluster.nodes, batch);
  std::string table = plan->table();
  if (plan->stages.size() > 12) {  // first and last rows only
    std::size_t cut = 0;
    for (int line = 0; line < 7; ++line) cut = table.find('\n', cut) + 1;
    std::size_t tail = table.size();
    for (int line = 0; line < 9; ++line) tail = table.rfind('\n', tail - 1);
    table = table.substr(0, cut) + "  ...\n" + table.substr(tail + 1);
  }
  std::printf("%s", table.c_str());
  std::printf("planning time   %.2f s (target %.0f s): %.2fx of the budget used\n", seconds, budget_s,
              seconds / budget_s);
  std::printf("peak memory     %ld MiB (target 4096 MiB)\n", peak_rss_mb());
  std::printf("throughput      %.3f of the fluid bound (%.3f s per step vs %.3f s)\n", fluid / plan->predicted_step_s,
              plan->predicted_step_s, fluid);
}

}  // namespace

int main() {
  const Link nvlink{300e9, 5e-6}, ib{25e9, 2e-5};
  // BERT-large: 24 layers, width 1024, 512 tokens, 30k vocabulary; 8 nodes x 8 devices.
  CostGraph bert = transformer("bert-large", 24, 1024, 512, 30522, 200e12);
  run("BERT-large", bert, Cluster::uniform(8, 8, 80.0 * (1u << 30), 1.0, nvlink, ib), 512, 2);
  // A 1,000-layer GPT: width 2048, 2048 tokens, 50k vocabulary; 128 nodes x 8 devices.
  CostGraph gpt = transformer("gpt-1000-layers", 1000, 2048, 2048, 50257, 200e12);
  run("GPT, 1,000 layers", gpt, Cluster::uniform(128, 8, 80.0 * (1u << 30), 1.0, nvlink, ib), 2048, 10);
  return 0;
}
