#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "graph/compiled_node.h"

namespace conveyor::graph {

namespace {


// The device a random node draws on: its first tensor argument's, else its `device`
// argument's, else the CPU.
c10::Device drawing_device(const torch::jit::Stack& stack) {
  for (const auto& v : stack) {
    if (v.isTensor() && v.toTensor().defined()) return v.toTensor().device();
  }
  for (const auto& v : stack) {
    if (v.isDevice()) return v.toDevice();
  }
  return c10::Device(c10::kCPU);
}

// scaled_dot_product_attention(q, k, v, mask, p, causal, *, scale, gqa) with dropout
// drawing from `gen`: its math form given the dropout mask (a Bernoulli(1 - p) draw per
// attention weight), which drops and rescales the weights as the fused kernels do.
// Drops ATen's note that a given dropout mask is meant for tests (here it is the point).
class GivenMaskNoteFilter : public c10::WarningHandler {
 public:
  explicit GivenMaskNoteFilter(c10::WarningHandler* next) : next_(next) {}
  void process(const c10::Warning& warning) override {
    if (warning.msg().find("Dropout mask should only be used for testing") != std::string::npos) return;
    next_->process(warning);
  }

 private:
  c10::WarningHandler* next_;
};

void seeded_attention(const c10::OperatorHandle& math, torch::jit::Stack& stack, at::Generator& gen) {
  const double p = stack[4].toDouble();
  if (p == 0) {
    // A probability computed at run time that came out 0: the plain operator draws nothing.
    static const auto plain = c10::Dispatcher::singleton().findSchemaOrThrow("aten::scaled_dot_product_attention", "");
    plain.callBoxed(stack);
    return;
  }
  const at::Tensor& q = stack[0].toTensor();
  const at::Tensor& k = stack[1].toTensor();
  std::vector<std::int64_t> shape(q.sizes().begin(), q.sizes().end());
  shape.back() = k.size(-2);  // (..., L, S): a draw per query and key position
  at::Tensor keep = at::empty(shape, q.options().dtype(at::kBool)).bernoulli_(1 - p, gen);
  torch::jit::Stack args{stack[0], stack[1], stack[2], stack[3], stack[4], stack[5], c10::IValue(keep), stack[6],
                         stack[7]};
  {
    GivenMaskNoteFilter filter(c10::WarningUtils::get_warning_handler());
    c10::WarningUtils::WarningHandlerGuard guard(&filter);
    math.callBoxed(args);
  }
  stack.clear();
  stack.push_back(std::move(args[0]));  // the output; the attention weights are dropped
}

// The dropouts drawing from `gen`, computed as ATen's composite `_dropout_impl` computes
// them (native_dropout: a boolean mask returned beside); autograd differentiates the result.
void seeded_dropout(Draws kind, torch::jit::Stack& stack, at::Generator& gen) {
  at::Tensor input = stack[0].toTensor();
  const double p = stack[1].toDouble();
  const bool train = stack[2].isNone() || stack[2].toBool();
  at::Tensor out, mask;
  if (kind == Draws::kNativeDropout) {
    if (!train || p == 0 || input.numel() == 0) {
      out = input.clone();
      mask = at::ones_like(input, input.options().dtype(at::kBool));
    } else {
      mask = at::empty_like(input, input.options().dtype(at::kBool)).bernoulli_(1 - p, gen);
      out = p == 1 ? input.mul(0) : input.mul(mask).mul(1 / (1 - p));
    }
  } else if (!train || p == 0 || input.numel() == 0) {
    out = input;
  } else if (p == 1) {
    out = input.mul(at::zeros({}, input.options()));
  } else {
    const bool feature = kind == Draws::kFeatureDropout || kind == Draws::kFeatureAlphaDropout;
    const bool alpha = kind == Draws::kAlphaDropout || kind == Draws::kFeatureAlphaDropout;
    at::Tensor noise;
    if (feature) {  // one draw per (sample, channel), broadcast over the rest
      std::vector<std::int64_t> sizes(static_cast<std::size_t>(input.dim()), 1);
      sizes[0] = input.size(0);
      if (input.dim() > 1) sizes[1] = input.size(1);
      noise = at::empty(sizes, input.options());
    } else {
      noise = at::empty_like(input);
    }
    noise.bernoulli_(1 - p, gen);
    if (alpha) {
      constexpr double kAlpha = 1.7580993408473766;
      const double a = 1. / std::sqrt((kAlpha * kAlpha * p + 1) * (1 - p));
      at::Tensor b = noise.add(-1).mul_(kAlpha * a).add_(kAlpha * a * p);
      noise.mul_(a);
      out = input.mul(noise).add_(b);
    } else {
      noise.div_(1 - p);
      out = input.mul(noise);
    }
  }
  stack.clear();
  stack.emplace_back(std::move(out));
  if (kind == Draws::kNativeDropout) stack.emplace_back(std::move(mask));
}


}  // namespace

at::Generator& SeededGenerators::on(c10::Device device) {
  auto it = made_.find(device.str());
  if (it != made_.end()) return it->second;
  at::Generator g = device.is_cpu() ? at::detail::createCPUGenerator(seed_)
                                    : at::detail::getCUDAHooks().getNewGenerator(device.index());
  if (!device.is_cpu()) g.set_current_seed(seed_);
  return made_.emplace(device.str(), std::move(g)).first->second;
}

SeededGenerators SeededGenerators::copy() const {
  SeededGenerators out(seed_);
  for (const auto& [device, g] : made_) out.made_.emplace(device, g.clone());
  return out;
}

void call_seeded(const GraphExecutor::CompiledNode& cn, torch::jit::Stack& stack, SeededGenerators& generators) {
  at::Generator& gen = generators.on(drawing_device(stack));
  switch (cn.draws) {
    case Draws::kGeneratorArgument:
      if (stack[cn.generator_argument].isNone()) stack[cn.generator_argument] = c10::IValue(gen);
      cn.op->callBoxed(stack);
      return;
    case Draws::kAttentionDropout: return seeded_attention(*cn.with_generator, stack, gen);
    case Draws::kGeneratorOverload:
      stack.insert(stack.begin() + cn.generator_argument, c10::IValue(gen));
      cn.with_generator->callBoxed(stack);
      return;
    default: return seeded_dropout(cn.draws, stack, gen);
  }
}

}  // namespace conveyor::graph
