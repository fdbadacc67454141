#include "graph/executor.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ScalarOps.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "conveyor_config.h"
#include <optional>

namespace conveyor::graph {

namespace {

struct DtypeName {
  std::string_view name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"float32", at::kFloat},     {"float64", at::kDouble},         {"float16", at::kHalf},
    {"bfloat16", at::kBFloat16}, {"int64", at::kLong},             {"int32", at::kInt},
    {"int16", at::kShort},       {"int8", at::kChar},              {"uint8", at::kByte},
    {"bool", at::kBool},         {"complex64", at::kComplexFloat}, {"complex128", at::kComplexDouble},
    {"uint16", at::kUInt16},     {"uint32", at::kUInt32},          {"uint64", at::kUInt64},
    {"float8_e4m3fn", at::kFloat8_e4m3fn}, {"float8_e5m2", at::kFloat8_e5m2},
};

std::string where(const Node& n) {
  return "node " + std::to_string(n.id) + " (" + n.qualified_name() +
         (n.source.empty() ? "" : ", from " + n.source) + ")";
}

Result<c10::Layout> layout_from_name(const std::string& s) {
  if (s == "strided") return c10::kStrided;
  if (s == "sparse_coo") return c10::kSparse;
  if (s == "sparse_csr") return c10::kSparseCsr;
  if (s == "mkldnn") return c10::kMkldnn;
  return Status(ErrorCode::kUnsupported, "unknown layout '" + s + "'");
}

Result<c10::MemoryFormat> memory_format_from_name(const std::string& s) {
  if (s == "contiguous_format") return c10::MemoryFormat::Contiguous;
  if (s == "preserve_format") return c10::MemoryFormat::Preserve;
  if (s == "channels_last") return c10::MemoryFormat::ChannelsLast;
  if (s == "channels_last_3d") return c10::MemoryFormat::ChannelsLast3d;
  return Status(ErrorCode::kUnsupported, "unknown memory format '" + s + "'");
}

at::Tensor wrapped_number(const c10::IValue& v) {
  at::Tensor t;
  if (v.isInt()) t = at::scalar_to_tensor(at::Scalar(v.toInt()));
  else if (v.isDouble()) t = at::scalar_to_tensor(at::Scalar(v.toDouble()));
  else t = at::scalar_to_tensor(at::Scalar(v.toBool()));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

enum class SymOp : std::uint8_t {
  kNone, kAdd, kSub, kMul, kFloorDiv, kTrueDiv, kMod, kNeg, kPow, kEq, kNe, kLt, kLe, kGt, kGe,
  kAnd, kOr, kNot, kMax, kMin, kToFloat, kToInt, kCeil, kFloor, kSqrt,
};

Result<SymOp> sym_op_from_name(const std::string& s) {
  static const std::pair<std::string_view, SymOp> table[] = {
      {"add", SymOp::kAdd}, {"sub", SymOp::kSub}, {"mul", SymOp::kMul},
      {"floordiv", SymOp::kFloorDiv}, {"truediv", SymOp::kTrueDiv}, {"mod", SymOp::kMod},
      {"neg", SymOp::kNeg}, {"pow", SymOp::kPow}, {"eq", SymOp::kEq}, {"ne", SymOp::kNe},
      {"lt", SymOp::kLt}, {"le", SymOp::kLe}, {"gt", SymOp::kGt}, {"ge", SymOp::kGe},
      {"and", SymOp::kAnd}, {"or", SymOp::kOr}, {"not", SymOp::kNot}, {"max", SymOp::kMax},
      {"min", SymOp::kMin}, {"float", SymOp::kToFloat}, {"int", SymOp::kToInt},
      {"ceil", SymOp::kCeil}, {"floor", SymOp::kFloor}, {"sqrt", SymOp::kSqrt},
  };
  for (const auto& [name, op] : table) {
    if (name == s) return op;
  }
  return Status(ErrorCode::kUnknownOp, "unknown symbolic operation '" + s + "'");
}

bool is_number(const c10::IValue& v) { return v.isInt() || v.isDouble() || v.isBool(); }
double as_double(const c10::IValue& v) {
  return v.isDouble() ? v.toDouble() : v.isInt() ? static_cast<double>(v.toInt()) : v.toBool();
}
std::int64_t as_int(const c10::IValue& v) { return v.isInt() ? v.toInt() : static_cast<std::int64_t>(v.toBool()); }

Result<c10::IValue> eval_sym(SymOp op, const std::vector<c10::IValue>& a) {
  auto need = [&](std::size_t n) { return a.size() == n && std::all_of(a.begin(), a.end(), is_number); };
  bool all_int = std::all_of(a.begin(), a.end(), [](const c10::IValue& v) { return v.isInt() || v.isBool(); });
  switch (op) {
    case SymOp::kNeg: case SymOp::kNot: case SymOp::kToFloat: case SymOp::kToInt:
    case SymOp::kCeil: case SymOp::kFloor: case SymOp::kSqrt:
      if (!need(1)) break;
      switch (op) {
        case SymOp::kNeg: return all_int ? c10::IValue(-as_int(a[0])) : c10::IValue(-as_double(a[0]));
        case SymOp::kNot: return c10::IValue(!static_cast<bool>(as_double(a[0])));
        case SymOp::kToFloat: return c10::IValue(as_double(a[0]));
        case SymOp::kToInt: return c10::IValue(static_cast<std::int64_t>(as_double(a[0])));
        case SymOp::kCeil: return c10::IValue(static_cast<std::int64_t>(std::ceil(as_double(a[0]))));
        case SymOp::kFloor: return c10::IValue(static_cast<std::int64_t>(std::floor(as_double(a[0]))));
        default: return c10::IValue(std::sqrt(as_double(a[0])));
      }
    default:
      if (!need(2)) break;
      {
        double x = as_double(a[0]), y = as_double(a[1]);
        std::int64_t i = all_int ? as_int(a[0]) : 0, j = all_int ? as_int(a[1]) : 0;
        switch (op) {
          case SymOp::kAdd: return all_int ? c10::IValue(i + j) : c10::IValue(x + y);
          case SymOp::kSub: return all_int ? c10::IValue(i - j) : c10::IValue(x - y);
          case SymOp::kMul: return all_int ? c10::IValue(i * j) : c10::IValue(x * y);
          case SymOp::kFloorDiv:
            if (all_int) {
              if (j == 0) return Status(ErrorCode::kExecution, "integer division by zero");
              std::int64_t q = i / j;
              if ((i % j != 0) && ((i < 0) != (j < 0))) --q;  // Python floors toward -inf
              return c10::IValue(q);
            }
            return c10::IValue(std::floor(x / y));
          case SymOp::kTrueDiv: return c10::IValue(x / y);
          case SymOp::kMod:
            if (all_int) {
              if (j == 0) return Status(ErrorCode::kExecution, "integer modulo by zero");
              std::int64_t m = i % j;
              if (m != 0 && ((m < 0) != (j < 0))) m += j;
              return c10::IValue(m);
            }
            return c10::IValue(x - std::floor(x / y) * y);
          case SymOp::kPow:
            if (all_int && j >= 0) {
              std::int64_t r = 1;
              for (std::int64_t k = 0; k < j; ++k) r *= i;
              return c10::IValue(r);
            }
            return c10::IValue(std::pow(x, y));
          case SymOp::kEq: return c10::IValue(x == y);
          case SymOp::kNe: return c10::IValue(x != y);
          case SymOp::kLt: return c10::IValue(x < y);
          case SymOp::kLe: return c10::IValue(x <= y);
          case SymOp::kGt: return c10::IValue(x > y);
          case SymOp::kGe: return c10::IValue(x >= y);
          case SymOp::kAnd: return c10::IValue(static_cast<bool>(x) && static_cast<bool>(y));
          case SymOp::kOr: return c10::IValue(static_cast<bool>(x) || static_cast<bool>(y));
          case SymOp::kMax: return all_int ? c10::IValue(std::max(i, j)) : c10::IValue(std::max(x, y));
          case SymOp::kMin: return all_int ? c10::IValue(std::min(i, j)) : c10::IValue(std::min(x, y));
          default: break;
        }
      }
  }
  return Status(ErrorCode::kExecution, "symbolic operation got unexpected operands");
}

}  // namespace

// How one stack slot of an operator call is filled.
struct ArgPlan {
  enum class Kind : std::uint8_t { kConstant, kValue, kList };
  enum class Convert : std::uint8_t { kNone, kWrapNumber, kToDouble };
  Kind kind = Kind::kConstant;
  Convert convert = Convert::kNone;
  c10::IValue constant;
  ValueId value = -1;
  std::vector<ArgPlan> items;
  c10::TypePtr element_type;
};

// How a node that draws random numbers is given a seeded generator (StageProgram::forward
// with a seed): through its own `generator` argument, or by conveyor computing it.
enum class Draws : std::uint8_t {
  kNone,               // draws nothing
  kGeneratorArgument,  // rand, randn, bernoulli, normal, randint, randperm, multinomial, ...
  kGeneratorOverload,  // rand_like, randn_like: their `.generator` overload, generator inserted
  kDropout,            // aten::dropout(input, p, train): input * bernoulli(1 - p) / (1 - p)
  kFeatureDropout,     // aten::feature_dropout: one draw per (sample, channel)
  kAlphaDropout,       // aten::alpha_dropout, feature_alpha_dropout: SELU-preserving
  kFeatureAlphaDropout,
  kNativeDropout,      // aten::native_dropout(input, p, train?): (the output, the mask)
  kAttentionDropout,   // aten::scaled_dot_product_attention with dropout: its math form, mask given
  kGlobalOnly,         // takes no generator and none of the above: torch's global one
};

struct GraphExecutor::CompiledNode {
  const Node* node = nullptr;
  std::optional<c10::OperatorHandle> op;
  SymOp sym = SymOp::kNone;
  std::vector<ArgPlan> args;
  Draws draws = Draws::kNone;
  int generator_argument = -1;  // kGeneratorArgument, kGeneratorOverload: its stack slot
  std::optional<c10::OperatorHandle> with_generator;  // kGeneratorOverload; kAttentionDropout: the math form
  // A `*_like` factory (zeros_like, randint_like, ...): run without autograd, as eager's
  // torch.* factories are, so its output never requires grad (randint_like's autograd kernel
  // would otherwise attach a backward that fails).
  bool factory = false;
};

// A stage forward's seeded generators: one per device it draws on, each made on first use
// from the same seed, so its draws depend on the seed and the stage's node order only.
class SeededGenerators {
 public:
  explicit SeededGenerators(std::uint64_t seed) : seed_(seed) {}
  at::Generator& on(c10::Device device) {
    auto it = made_.find(device.str());
    if (it != made_.end()) return it->second;
    at::Generator g = device.is_cpu() ? at::detail::createCPUGenerator(seed_)
                                      : at::detail::getCUDAHooks().getNewGenerator(device.index());
    if (!device.is_cpu()) g.set_current_seed(seed_);
    return made_.emplace(device.str(), std::move(g)).first->second;
  }

 private:
  std::uint64_t seed_;
  std::map<std::string, at::Generator> made_;
};

Result<at::ScalarType> scalar_type_from_name(std::string_view name) {
  for (const auto& d : kDtypes) {
    if (d.name == name) return d.type;
  }
  return Status(ErrorCode::kUnsupported, "unknown dtype '" + std::string(name) + "'");
}

std::string scalar_type_name(at::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return std::string(d.name);
  }
  return c10::toString(type);
}

namespace {

// Strips Optional[...] from a schema type.
c10::TypePtr unwrap_optional(const c10::TypePtr& t) {
  if (auto opt = t->cast<c10::OptionalType>()) return opt->getElementType();
  return t;
}

class NodeCompiler {
 public:
  NodeCompiler(const Graph& g, const std::vector<c10::IValue>& bound) : g_(g), bound_(bound) {}

  // Plans the argument `a` for a schema slot of type `type` (fixed list size `n` when > 0).
  Result<ArgPlan> plan(const Argument& a, const c10::TypePtr& type, std::optional<int32_t> n) {
    using K = Argument::Kind;
    ArgPlan p;
    c10::TypePtr base = unwrap_optional(type);
    if (a.kind == K::kNone) {
      p.constant = c10::IValue();
      return p;
    }
    if (a.kind == K::kValue) {
      if (!bound_[a.value].isNone()) {  // a parameter, buffer or constant: bind once
        p.constant = bound_[a.value];
        return p;
      }
      p.kind = ArgPlan::Kind::kValue;
      p.value = a.value;
      ValueKind vk = g_.values[a.value].kind;
      if (base->kind() == c10::TypeKind::TensorType && vk != ValueKind::kTensor) {
        p.convert = ArgPlan::Convert::kWrapNumber;
      } else if (base->kind() == c10::TypeKind::FloatType && vk == ValueKind::kInt) {
        p.convert = ArgPlan::Convert::kToDouble;
      } else if (base->kind() == c10::TypeKind::ListType && n && *n > 0 && vk == ValueKind::kInt) {
        // A symbolic int where the schema wants int[N]: repeat it N times.
        auto list = base->expect<c10::ListType>();
        p.kind = ArgPlan::Kind::kList;
        p.element_type = list->getElementType();
        ArgPlan item;
        item.kind = ArgPlan::Kind::kValue;
        item.value = a.value;
        p.items.assign(static_cast<std::size_t>(*n), item);
      }
      return p;
    }
    if (a.kind == K::kList) {
      auto list = base->cast<c10::ListType>();
      if (!list) return Status(ErrorCode::kInvalidGraph, "a list was given where the schema expects " + type->str());
      c10::TypePtr elem = list->getElementType();
      std::vector<ArgPlan> items;
      bool all_constant = true;
      for (const auto& item : a.items) {
        CONVEYOR_ASSIGN_OR_RETURN(ArgPlan ip, plan(item, elem, std::nullopt));
        all_constant = all_constant && ip.kind == ArgPlan::Kind::kConstant;
        items.push_back(std::move(ip));
      }
      if (all_constant) {
        c10::impl::GenericList l(list_element_type(elem));
        for (auto& ip : items) l.push_back(std::move(ip.constant));
        p.constant = c10::IValue(std::move(l));
        return p;
      }
      p.kind = ArgPlan::Kind::kList;
      p.element_type = elem;
      p.items = std::move(items);
      return p;
    }
    // Literal scalars, converted to what the schema slot holds.
    switch (a.kind) {
      case K::kInt:
        if (base->kind() == c10::TypeKind::TensorType) {
          p.constant = wrapped_number(c10::IValue(a.int_value));
        } else if (base->kind() == c10::TypeKind::FloatType) {
          p.constant = c10::IValue(static_cast<double>(a.int_value));
        } else if (base->kind() == c10::TypeKind::ListType) {
          auto elem = base->expect<c10::ListType>()->getElementType();
          c10::impl::GenericList l(list_element_type(elem));
          for (int32_t i = 0; i < (n && *n > 0 ? *n : 1); ++i) l.push_back(c10::IValue(a.int_value));
          p.constant = c10::IValue(std::move(l));
        } else if (base->kind() == c10::TypeKind::BoolType) {
          p.constant = c10::IValue(a.int_value != 0);
        } else {
          p.constant = c10::IValue(a.int_value);
        }
        return p;
      case K::kFloat:
        if (base->kind() == c10::TypeKind::TensorType) p.constant = wrapped_number(c10::IValue(a.float_value));
        else p.constant = c10::IValue(a.float_value);
        return p;
      case K::kBool:
        if (base->kind() == c10::TypeKind::TensorType) p.constant = wrapped_number(c10::IValue(a.bool_value));
        else if (base->kind() == c10::TypeKind::IntType) p.constant = c10::IValue(static_cast<std::int64_t>(a.bool_value));
        else p.constant = c10::IValue(a.bool_value);
        return p;
      case K::kString:
        p.constant = c10::IValue(a.text);
        return p;
      case K::kDtype: {
        CONVEYOR_ASSIGN_OR_RETURN(auto st, scalar_type_from_name(a.text));
        p.constant = c10::IValue(st);
        return p;
      }
      case K::kDevice:
        try {
          p.constant = c10::IValue(c10::Device(a.text));
        } catch (const std::exception&) {
          return Status(ErrorCode::kInvalidGraph, "unknown device '" + a.text + "'");
        }
        return p;
      case K::kLayout: {
        CONVEYOR_ASSIGN_OR_RETURN(auto l, layout_from_name(a.text));
        p.constant = c10::IValue(l);
        return p;
      }
      case K::kMemoryFormat: {
        CONVEYOR_ASSIGN_OR_RETURN(auto m, memory_format_from_name(a.text));
        p.constant = c10::IValue(m);
        return p;
      }
      default:
        break;
    }
    return Status(ErrorCode::kInternal, "unhandled argument kind");
  }

  // Lists of symbolic ints are plain int lists at run time.
  static c10::TypePtr list_element_type(const c10::TypePtr& elem) {
    if (elem->kind() == c10::TypeKind::SymIntType) return c10::IntType::get();
    if (elem->kind() == c10::TypeKind::SymFloatType) return c10::FloatType::get();
    if (elem->kind() == c10::TypeKind::SymBoolType) return c10::BoolType::get();
    return elem;
  }

 private:
  const Graph& g_;
  const std::vector<c10::IValue>& bound_;
};

c10::IValue materialize(const ArgPlan& p, const std::vector<c10::IValue>& values) {
  switch (p.kind) {
    case ArgPlan::Kind::kConstant:
      return p.constant;
    case ArgPlan::Kind::kValue: {
      const c10::IValue& v = values[p.value];
      switch (p.convert) {
        case ArgPlan::Convert::kWrapNumber: return is_number(v) ? c10::IValue(wrapped_number(v)) : v;
        case ArgPlan::Convert::kToDouble: return v.isInt() ? c10::IValue(static_cast<double>(v.toInt())) : v;
        case ArgPlan::Convert::kNone: return v;
      }
      return v;
    }
    case ArgPlan::Kind::kList: {
      c10::impl::GenericList l(NodeCompiler::list_element_type(p.element_type));
      l.reserve(p.items.size());
      for (const auto& item : p.items) l.push_back(materialize(item, values));
      return c10::IValue(std::move(l));
    }
  }
  return {};
}

std::string shape_string(const at::Tensor& t) {
  std::string s = "[";
  for (std::int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// The tensor has the shape's rank and every fixed size of it (symbolic sizes: any).
bool fits_shape(const at::Tensor& t, const std::vector<Dim>& shape) {
  if (t.dim() != static_cast<std::int64_t>(shape.size())) return false;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (!shape[d].is_symbolic() && shape[d].size != t.size(static_cast<std::int64_t>(d))) return false;
  }
  return true;
}

std::string shape_string(const std::vector<Dim>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    s += (i ? ", " : "") + (shape[i].is_symbolic() ? shape[i].symbol : std::to_string(shape[i].size));
  }
  return s + "]";
}

}  // namespace

GraphExecutor::~GraphExecutor() = default;

namespace {

bool is_generator(const c10::Argument& a) {
  return unwrap_optional(a.type())->kind() == c10::TypeKind::GeneratorType;
}

// Where `with` (an overload's arguments) is `args` with one generator argument added: that
// argument's position, or -1 when it is not.
int generator_slot(const std::vector<c10::Argument>& args, const std::vector<c10::Argument>& with) {
  if (with.size() != args.size() + 1) return -1;
  int slot = -1;
  for (std::size_t i = 0, j = 0; i < with.size(); ++i) {
    if (slot < 0 && is_generator(with[i])) {
      slot = static_cast<int>(i);
      continue;
    }
    if (j >= args.size() || with[i].name() != args[j].name() || *with[i].type() != *args[j].type()) return -1;
    ++j;
  }
  return slot;
}

// How a node that draws random numbers can draw from a seeded generator (Draws).
void classify_draws(GraphExecutor::CompiledNode& cn, c10::Dispatcher& dispatcher) {
  const Node& n = *cn.node;
  const auto& sargs = cn.op->schema().arguments();
  static const std::map<std::string, Draws> kDropouts = {
      {"aten::dropout", Draws::kDropout}, {"aten::feature_dropout", Draws::kFeatureDropout},
      {"aten::alpha_dropout", Draws::kAlphaDropout}, {"aten::feature_alpha_dropout", Draws::kFeatureAlphaDropout},
      {"aten::native_dropout", Draws::kNativeDropout}};
  // Drawing nothing: a dropout probability of constant 0, or constant train=False.
  for (std::size_t i = 0; i < sargs.size() && i < n.args.size(); ++i) {
    const Argument& a = n.args[i];
    const bool zero_p = (sargs[i].name() == "p" || sargs[i].name() == "dropout_p" || sargs[i].name() == "dropout") &&
                        ((a.kind == Argument::Kind::kFloat && a.float_value == 0) ||
                         (a.kind == Argument::Kind::kInt && a.int_value == 0));
    const bool no_train = sargs[i].name() == "train" && a.kind == Argument::Kind::kBool && !a.bool_value;
    if (zero_p || no_train) {
      cn.draws = Draws::kNone;
      return;
    }
  }
  if (auto it = kDropouts.find(n.op); it != kDropouts.end() && sargs.size() == 3) {
    cn.draws = it->second;
    return;
  }
  if (n.op == "aten::scaled_dot_product_attention" && n.overload.empty() && sargs.size() == 8) {
    if (auto math = dispatcher.findSchema({"aten::_scaled_dot_product_attention_math", ""});
        math && math->schema().arguments().size() == 9) {
      cn.draws = Draws::kAttentionDropout;
      cn.with_generator = *math;
      return;
    }
  }
  for (std::size_t i = 0; i < sargs.size(); ++i) {
    if (is_generator(sargs[i])) {
      cn.draws = Draws::kGeneratorArgument;
      cn.generator_argument = static_cast<int>(i);
      return;
    }
  }
  // An overload that is this one plus a generator argument: its name has "generator" put
  // in among the parts of this one's (rand_like -> rand_like.generator, randint_like.low_dtype
  // -> randint_like.low_generator_dtype).
  cn.draws = Draws::kGlobalOnly;
  std::vector<std::string> parts;
  for (std::size_t start = 0; !n.overload.empty() && start <= n.overload.size();) {
    const std::size_t end = std::min(n.overload.find('_', start), n.overload.size());
    parts.push_back(n.overload.substr(start, end - start));
    start = end + 1;
  }
  for (std::size_t at = 0; at <= parts.size(); ++at) {
    std::string name;
    for (std::size_t k = 0; k <= parts.size(); ++k) {
      if (k == at) name += (name.empty() ? "" : "_") + std::string("generator");
      if (k < parts.size()) name += (name.empty() ? "" : "_") + parts[k];
    }
    auto other = dispatcher.findSchema({n.op, name});
    if (!other) continue;
    const int slot = generator_slot(sargs, other->schema().arguments());
    if (slot < 0) continue;
    cn.draws = Draws::kGeneratorOverload;
    cn.generator_argument = slot;
    cn.with_generator = *other;
    return;
  }
}

}  // namespace

Result<std::shared_ptr<GraphExecutor>> GraphExecutor::create(Graph graph, TensorMap tensors) {
  CONVEYOR_RETURN_IF_ERROR(graph.validate());
  std::shared_ptr<GraphExecutor> ex(new GraphExecutor());
  ex->graph_ = std::move(graph);
  ex->tensors_ = std::move(tensors);
  const Graph& g = ex->graph_;

  std::vector<c10::IValue> bound(g.values.size());
  for (const auto& b : g.bindings) {
    auto it = ex->tensors_.find(b.name);
    if (it == ex->tensors_.end()) {
      return Status(ErrorCode::kInvalidArgument,
                    "the graph needs a tensor named '" + b.name +
                        "' but none was given; pass the model the graph was captured from");
    }
    const at::Tensor& t = it->second;
    const Value& v = g.values[b.value];
    if (!fits_shape(t, v.shape)) {
      return Status(ErrorCode::kInvalidArgument, "tensor '" + b.name + "' has shape " + shape_string(t) +
                                                     " but the graph expects " + shape_string(v.shape));
    }
    if (scalar_type_name(t.scalar_type()) != v.dtype) {
      return Status(ErrorCode::kInvalidArgument, "tensor '" + b.name + "' has dtype " +
                                                     scalar_type_name(t.scalar_type()) +
                                                     " but the graph expects " + v.dtype);
    }
    bound[b.value] = t;
  }

  NodeCompiler compiler(g, bound);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const Node& n : g.nodes) {
    auto cn = std::make_unique<CompiledNode>();
    cn->node = &n;
    if (n.op == kSymOpName) {
      auto sym = sym_op_from_name(n.overload);
      if (!sym) return sym.status().with_context(where(n));
      cn->sym = sym.value();
      for (const auto& a : n.args) {
        CONVEYOR_ASSIGN_OR_RETURN(ArgPlan p, compiler.plan(a, c10::NumberType::get(), std::nullopt));
        cn->args.push_back(std::move(p));
      }
      if (n.returns.size() != 1 || n.returns[0].kind != Return::Kind::kValue) {
        return Status(ErrorCode::kInvalidGraph, where(n) + " must return exactly one value");
      }
      ex->compiled_.push_back(std::move(cn));
      continue;
    }
    auto handle = dispatcher.findSchema({n.op, n.overload});
    if (!handle) {
      return Status(ErrorCode::kUnknownOp,
                    "operator " + n.qualified_name() + " (" + where(n) + ") is unknown to this torch " +
                        CONVEYOR_TORCH_VERSION_STRING +
                        (g.producer.count("torch") ? "; the graph was captured with torch " + g.producer.at("torch") : "") +
                        ". Load it with the torch it was captured with, import the library that "
                        "defines the operator, or capture the model again");
    }
    cn->op = *handle;
    const auto& schema = handle->schema();
    const auto& sargs = schema.arguments();
    if (n.args.size() != sargs.size()) {
      return Status(ErrorCode::kInvalidGraph, where(n) + " has " + std::to_string(n.args.size()) +
                                                  " arguments but the schema " + toString(schema) +
                                                  " takes " + std::to_string(sargs.size()));
    }
    for (std::size_t i = 0; i < sargs.size(); ++i) {
      auto p = compiler.plan(n.args[i], sargs[i].type(), sargs[i].N());
      if (!p) return p.status().with_context(where(n) + " argument '" + sargs[i].name() + "'");
      cn->args.push_back(std::move(p).value());
    }
    if (n.returns.size() != schema.returns().size()) {
      return Status(ErrorCode::kInvalidGraph, where(n) + " lists " + std::to_string(n.returns.size()) +
                                                  " returns but the schema has " +
                                                  std::to_string(schema.returns().size()));
    }
    if (n.nondeterministic_seeded) classify_draws(*cn, dispatcher);
    cn->factory = n.op.size() > 5 && n.op.compare(n.op.size() - 5, 5, "_like") == 0;
    ex->compiled_.push_back(std::move(cn));
  }
  std::vector<NodeId> all(g.nodes.size());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = static_cast<NodeId>(i);
  ex->whole_graph_steps_ = ex->plan_steps(all, g.outputs);
  return ex;
}

std::vector<StageProgram::Step> GraphExecutor::plan_steps(const std::vector<NodeId>& nodes,
                                                          const std::vector<ValueId>& keep) const {
  std::vector<StageProgram::Step> steps;
  std::vector<int> last_use(graph_.values.size(), -1);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = graph_.nodes[nodes[i]];
    for (ValueId v : Graph::node_inputs(n)) last_use[v] = static_cast<int>(i);
    for (ValueId v : Graph::node_outputs(n)) {
      if (last_use[v] < static_cast<int>(i)) last_use[v] = static_cast<int>(i);
    }
  }
  for (ValueId v : keep) last_use[v] = -2;  // never released
  for (const auto& b : graph_.bindings) last_use[b.value] = -2;
  std::vector<std::vector<ValueId>> release(nodes.size());
  for (std::size_t v = 0; v < last_use.size(); ++v) {
    if (last_use[v] >= 0) release[last_use[v]].push_back(static_cast<ValueId>(v));
  }
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    steps.push_back({static_cast<std::size_t>(nodes[i]), std::move(release[i])});
  }
  return steps;
}

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

Status GraphExecutor::execute(const std::vector<StageProgram::Step>& steps, std::vector<c10::IValue>& values,
                              std::optional<std::uint64_t> random_seed) const {
  torch::jit::Stack stack;
  std::optional<SeededGenerators> generators;
  if (random_seed) generators.emplace(*random_seed);
  for (const auto& step : steps) {
    const CompiledNode& cn = *compiled_[step.compiled];
    const Node& n = *cn.node;
    stack.clear();
    stack.reserve(cn.args.size());
    for (const auto& a : cn.args) stack.push_back(materialize(a, values));
    const bool seeded = generators && cn.draws != Draws::kNone && cn.draws != Draws::kGlobalOnly;
    if (cn.sym != SymOp::kNone) {
      auto r = eval_sym(cn.sym, stack);
      if (!r) return r.status().with_context(where(n));
      values[n.returns[0].value] = std::move(r).value();
    } else {
      try {
        std::optional<c10::AutoGradMode> grad_mode;
        if (cn.factory) {
          grad_mode.emplace(false);
        } else if (n.grad_enabled) {
          grad_mode.emplace(*n.grad_enabled);
        }
        if (!seeded) {
          cn.op->callBoxed(stack);
        } else if (cn.draws == Draws::kGeneratorArgument) {
          if (stack[cn.generator_argument].isNone()) {
            stack[cn.generator_argument] = c10::IValue(generators->on(drawing_device(stack)));
          }
          cn.op->callBoxed(stack);
        } else if (cn.draws == Draws::kAttentionDropout) {
          seeded_attention(*cn.with_generator, stack, generators->on(drawing_device(stack)));
        } else if (cn.draws == Draws::kGeneratorOverload) {
          at::Generator& gen = generators->on(drawing_device(stack));
          stack.insert(stack.begin() + cn.generator_argument, c10::IValue(gen));
          cn.with_generator->callBoxed(stack);
        } else {
          seeded_dropout(cn.draws, stack, generators->on(drawing_device(stack)));
        }
      } catch (const c10::Error& e) {
        return Status(ErrorCode::kExecution, where(n) + " failed: " + e.what_without_backtrace());
      } catch (const std::exception& e) {
        return Status(ErrorCode::kExecution, where(n) + " failed: " + e.what());
      }
      if (stack.size() != n.returns.size()) {
        return Status(ErrorCode::kExecution, where(n) + " returned " + std::to_string(stack.size()) +
                                                 " values, expected " + std::to_string(n.returns.size()));
      }
      for (std::size_t r = 0; r < n.returns.size(); ++r) {
        const Return& ret = n.returns[r];
        if (ret.kind == Return::Kind::kValue) {
          values[ret.value] = std::move(stack[r]);
        } else if (ret.kind == Return::Kind::kList) {
          auto list = stack[r].toList();
          if (list.size() != ret.items.size()) {
            return Status(ErrorCode::kExecution,
                          where(n) + " returned a list of " + std::to_string(list.size()) +
                              " tensors but the graph was captured with " +
                              std::to_string(ret.items.size()) +
                              "; its length depends on an input size that changed since capture");
          }
          for (std::size_t j = 0; j < ret.items.size(); ++j) {
            if (ret.items[j] >= 0) values[ret.items[j]] = list.get(j);
          }
        }
      }
    }
    for (ValueId v : step.release) values[v] = c10::IValue();
  }
  return Status::ok();
}

namespace {

bool is_plain_symbol(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; });
}

// The user's tensors against what the graph was captured for: every fixed size and dtype,
// one size per symbol across inputs, and the sizes the symbol's range allows. (Only the
// batch stays symbolic in capture; any other size is part of the graph.)
Status check_graph_inputs(const Graph& g, const std::vector<c10::IValue>& inputs) {
  std::map<std::string, std::pair<std::int64_t, std::size_t>> seen;  // symbol -> (size, input)
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Value& v = g.values[g.inputs[i].value];
    if (v.kind != ValueKind::kTensor || !inputs[i].isTensor()) continue;
    const at::Tensor& t = inputs[i].toTensor();
    const std::string which = "input " + std::to_string(i) + " ('" + g.inputs[i].name + "')";
    if (!fits_shape(t, v.shape)) {
      return Status(ErrorCode::kInvalidArgument,
                    which + " has shape " + shape_string(t) + " but the graph was captured for " +
                        shape_string(v.shape) +
                        " (only the batch, the symbolic size, may change); pass that shape or capture the model "
                        "again with this one");
    }
    if (scalar_type_name(t.scalar_type()) != v.dtype) {
      return Status(ErrorCode::kInvalidArgument, which + " has dtype " + scalar_type_name(t.scalar_type()) +
                                                     " but the graph was captured with " + v.dtype +
                                                     "; convert it, or capture the model again with this dtype");
    }
    for (std::size_t d = 0; d < v.shape.size(); ++d) {
      const std::string& sym = v.shape[d].symbol;
      if (!is_plain_symbol(sym)) continue;
      const std::int64_t size = t.size(static_cast<std::int64_t>(d));
      auto [it, fresh] = seen.try_emplace(sym, size, i);
      if (!fresh && it->second.first != size) {
        return Status(ErrorCode::kInvalidArgument,
                      "inputs " + std::to_string(it->second.second) + " and " + std::to_string(i) +
                          " disagree on size " + sym + ": " + std::to_string(it->second.first) + " and " +
                          std::to_string(size) + "; every batched input must hold the same batch");
      }
      if (!fresh) continue;
      if (auto r = g.ranges.find(sym); r != g.ranges.end() && (size < r->second.min || size > r->second.max)) {
        return Status(ErrorCode::kInvalidArgument,
                      which + " has " + sym + " = " + std::to_string(size) + " but the graph holds for " +
                          std::to_string(r->second.min) + " <= " + sym + " <= " + std::to_string(r->second.max) +
                          " only (the model's guards bound it at capture); pass a size within that range");
      }
    }
  }
  return Status::ok();
}

}  // namespace

Result<std::vector<c10::IValue>> GraphExecutor::run(std::vector<c10::IValue> inputs) const {
  if (inputs.size() != graph_.inputs.size()) {
    return Status(ErrorCode::kInvalidArgument, "the graph takes " + std::to_string(graph_.inputs.size()) +
                                                   " inputs but got " + std::to_string(inputs.size()));
  }
  CONVEYOR_RETURN_IF_ERROR(check_graph_inputs(graph_, inputs));
  std::vector<c10::IValue> values(graph_.values.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) values[graph_.inputs[i].value] = std::move(inputs[i]);
  CONVEYOR_RETURN_IF_ERROR(execute(whole_graph_steps_, values));
  std::vector<c10::IValue> out;
  out.reserve(graph_.outputs.size());
  for (ValueId v : graph_.outputs) out.push_back(values[v]);
  return out;
}

Result<std::shared_ptr<GraphExecutor>> GraphExecutor::replica() const {
  TensorMap copies = tensors_;
  for (const Binding& b : graph_.bindings) {
    auto it = copies.find(b.name);
    if (it == copies.end()) continue;
    at::Tensor& t = it->second;
    if (b.kind == Binding::Kind::kParameter) {
      const bool grad = t.requires_grad();
      t = t.detach();
      if (grad) t.requires_grad_(true);
    } else if (b.kind == Binding::Kind::kBuffer) {
      t = t.detach().clone();
    }
  }
  return create(graph_, std::move(copies));
}

Result<std::shared_ptr<const StageProgram>> GraphExecutor::stage(std::vector<NodeId> nodes) const {
  CONVEYOR_RETURN_IF_ERROR(check_stage(graph_, nodes));
  std::sort(nodes.begin(), nodes.end());
  auto program = std::shared_ptr<StageProgram>(new StageProgram());
  program->executor_ = shared_from_this();
  program->boundary_ = stage_boundary(graph_, nodes);
  program->steps_ = plan_steps(nodes, program->boundary_.outputs);
  program->draws_random_ = std::any_of(nodes.begin(), nodes.end(),
                                       [&](NodeId n) { return graph_.nodes[n].nondeterministic_seeded; });
  program->nodes_ = std::move(nodes);
  return std::shared_ptr<const StageProgram>(std::move(program));
}

std::vector<NodeId> GraphExecutor::unseeded_random_nodes() const {
  std::vector<NodeId> out;
  for (const auto& cn : compiled_) {
    if (cn->draws == Draws::kGlobalOnly) out.push_back(cn->node->id);
  }
  return out;
}

Result<StageActivation> StageProgram::forward(std::vector<c10::IValue> inputs,
                                              std::optional<std::uint64_t> random_seed) const {
  const Graph& g = executor_->graph();
  if (inputs.size() != boundary_.inputs.size()) {
    return Status(ErrorCode::kInvalidArgument, "the stage takes " + std::to_string(boundary_.inputs.size()) +
                                                   " inputs but got " + std::to_string(inputs.size()));
  }
  StageActivation act;
  std::vector<c10::IValue> values(g.values.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    c10::IValue& in = inputs[i];
    if (in.isTensor()) {
      const at::Tensor& t = in.toTensor();
      at::Tensor leaf = t.detach();
      if (t.requires_grad()) leaf.requires_grad_(true);
      in = leaf;
    }
    values[boundary_.inputs[i]] = in;
  }
  act.inputs = std::move(inputs);
  CONVEYOR_RETURN_IF_ERROR(executor_->execute(steps_, values, random_seed));
  act.outputs.reserve(boundary_.outputs.size());
  for (ValueId v : boundary_.outputs) act.outputs.push_back(std::move(values[v]));
  return act;
}

namespace {

using torch::autograd::Edge;
using AutogradNode = torch::autograd::Node;

/// The stage outputs that get a gradient, with their gradients (shapes checked).
Status backward_roots(const StageActivation& act, const std::vector<c10::IValue>& output_grads,
                      const StageBoundary& boundary, std::vector<at::Tensor>& roots, std::vector<at::Tensor>& grads) {
  if (output_grads.size() != act.outputs.size()) {
    return Status(ErrorCode::kInvalidArgument, "the stage has " + std::to_string(act.outputs.size()) +
                                                   " outputs but got " + std::to_string(output_grads.size()) +
                                                   " gradients");
  }
  for (std::size_t i = 0; i < act.outputs.size(); ++i) {
    if (!act.outputs[i].isTensor() || !output_grads[i].isTensor()) continue;
    const at::Tensor& out = act.outputs[i].toTensor();
    const at::Tensor& grad = output_grads[i].toTensor();
    if (!grad.defined() || !out.requires_grad()) continue;
    if (!grad.sizes().equals(out.sizes())) {
      return Status(ErrorCode::kInvalidArgument,
                    "gradient for stage output " + std::to_string(boundary.outputs[i]) + " has shape " +
                        shape_string(grad) + " but the output has shape " + shape_string(out));
    }
    roots.push_back(out);
    grads.push_back(grad);
  }
  return Status::ok();
}

}  // namespace

struct DeferredWeightGradient {
  torch::autograd::edge_list roots;
  torch::autograd::variable_list grads;
  std::vector<std::shared_ptr<AutogradNode>> keep_alive;  // the graph between the two halves
};

Result<std::vector<c10::IValue>> StageProgram::backward(StageActivation& act,
                                                        std::vector<c10::IValue> output_grads) const {
  std::vector<at::Tensor> roots, grads;
  CONVEYOR_RETURN_IF_ERROR(backward_roots(act, output_grads, boundary_, roots, grads));
  if (!roots.empty()) {
    try {
      torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false);
    } catch (const c10::Error& e) {
      return Status(ErrorCode::kExecution, std::string("stage backward failed: ") + e.what_without_backtrace());
    }
  }
  std::vector<c10::IValue> input_grads;
  input_grads.reserve(act.inputs.size());
  for (const auto& in : act.inputs) {
    if (in.isTensor() && in.toTensor().requires_grad() && in.toTensor().grad().defined()) {
      input_grads.emplace_back(in.toTensor().grad());
    } else {
      input_grads.emplace_back();
    }
  }
  act.inputs.clear();
  act.outputs.clear();
  return input_grads;
}

// The split follows the autograd graph. "Input side" nodes are those from which a stage
// input's gradient accumulator can be reached; everything else reachable from the outputs
// leads only to parameters. The input half runs the engine from the outputs to the input
// accumulators (the engine then skips every output a node does not need, e.g. the weight
// product of a matmul) and captures the gradient arriving at each input-side node that also
// has an edge into the parameter side (a "branch" node). Those edges into the input side are
// then cut, so the weight half, run from the branch nodes with the captured gradients (and
// from outputs that never reach an input), re-executes each branch node for its parameter
// outputs only and never walks the input side again: every parameter gets each path's
// contribution exactly once, shared and tied parameters included.
Result<std::vector<c10::IValue>> StageProgram::backward_input(StageActivation& act,
                                                              std::vector<c10::IValue> output_grads) const {
  namespace ag = torch::autograd;
  std::vector<at::Tensor> roots, grads;
  CONVEYOR_RETURN_IF_ERROR(backward_roots(act, output_grads, boundary_, roots, grads));
  auto deferred = std::make_shared<DeferredWeightGradient>();
  std::vector<c10::IValue> input_grads(act.inputs.size());
  try {
    ag::edge_list input_edges;
    std::vector<std::size_t> input_slot;
    std::unordered_map<const AutogradNode*, bool> input_side;  // node -> reaches a stage input
    for (std::size_t i = 0; i < act.inputs.size(); ++i) {
      if (!act.inputs[i].isTensor() || !act.inputs[i].toTensor().requires_grad()) continue;
      Edge e = ag::impl::gradient_edge(act.inputs[i].toTensor());
      input_side[e.function.get()] = true;
      input_edges.push_back(std::move(e));
      input_slot.push_back(i);
    }
    // The edges hold the nodes (a leaf's accumulator is otherwise only weakly referenced).
    ag::edge_list root_edges;
    for (const at::Tensor& r : roots) root_edges.push_back(ag::impl::gradient_edge(r));
    // Post-order walk from the roots: a node is input-side when one of its children is.
    std::vector<AutogradNode*> order;  // post-order: children before parents
    {
      std::vector<std::pair<AutogradNode*, std::size_t>> stack;
      std::unordered_map<const AutogradNode*, bool> seen;
      for (const Edge& root : root_edges) {
        AutogradNode* fn = root.function.get();
        if (fn == nullptr || seen[fn]) continue;
        seen[fn] = true;
        stack.emplace_back(fn, 0);
        while (!stack.empty()) {
          auto& [node, next] = stack.back();
          if (next < node->num_outputs()) {
            const Edge& e = node->next_edge(next++);
            if (e.is_valid() && !seen[e.function.get()]) {
              seen[e.function.get()] = true;
              stack.emplace_back(e.function.get(), 0);
            }
            continue;
          }
          order.push_back(node);
          stack.pop_back();
        }
      }
    }
    for (AutogradNode* n : order) {
      bool& reaches = input_side[n];
      for (const Edge& e : n->next_edges()) {
        if (e.is_valid() && input_side[e.function.get()]) reaches = true;
      }
    }
    // Branch nodes: input-side with an edge into the parameter side.
    std::vector<AutogradNode*> branches;
    for (AutogradNode* n : order) {
      if (!input_side[n]) continue;
      for (const Edge& e : n->next_edges()) {
        if (e.is_valid() && !input_side[e.function.get()]) {
          branches.push_back(n);
          break;
        }
      }
    }
    ag::edge_list capture = input_edges;
    for (AutogradNode* n : branches) {
      for (std::uint32_t k = 0; k < n->num_inputs(); ++k) capture.emplace_back(n->getptr(), k);
    }
    // Roots on the input side start the input half; the others wait for the weight half.
    ag::edge_list input_roots;
    ag::variable_list input_root_grads;
    for (std::size_t i = 0; i < root_edges.size(); ++i) {
      if (input_side[root_edges[i].function.get()]) {
        input_roots.push_back(root_edges[i]);
        input_root_grads.push_back(grads[i]);
      } else {
        deferred->roots.push_back(root_edges[i]);
        deferred->grads.push_back(grads[i]);
      }
    }
    if (!input_roots.empty()) {
      ag::variable_list captured = ag::Engine::get_default_engine().execute(
          input_roots, input_root_grads, /*keep_graph=*/true, /*create_graph=*/false,
          /*accumulate_grad=*/false, capture);
      for (std::size_t j = 0; j < input_edges.size(); ++j) {
        if (captured[j].defined()) input_grads[input_slot[j]] = captured[j];
      }
      std::size_t c = input_edges.size();
      for (AutogradNode* n : branches) {
        for (std::uint32_t k = 0; k < n->num_inputs(); ++k, ++c) {
          if (!captured[c].defined()) continue;
          deferred->roots.emplace_back(n->getptr(), k);
          deferred->grads.push_back(captured[c]);
        }
      }
    }
    // Free what the weight half will not need, before the cut below drops the references
    // that keep these nodes alive.
    const std::unordered_set<const AutogradNode*> branch_set(branches.begin(), branches.end());
    for (AutogradNode* n : order) {
      if (input_side[n] && !branch_set.count(n)) {
        n->release_variables();
      }
    }
    for (AutogradNode* n : branches) {
      // In place (set_next_edge refuses nodes that have parents; cutting an edge only
      // lowers reachability, so the topological numbers stay valid).
      for (Edge& e : n->next_edges()) {
        if (e.is_valid() && input_side[e.function.get()]) e = Edge();
      }
      deferred->keep_alive.push_back(n->getptr());
    }
    for (const Edge& e : deferred->roots) deferred->keep_alive.push_back(e.function);
  } catch (const c10::Error& e) {
    return Status(ErrorCode::kExecution, std::string("stage backward (input half) failed: ") +
                                             e.what_without_backtrace());
  }
  act.inputs.clear();
  act.outputs.clear();
  act.deferred = std::move(deferred);
  return input_grads;
}

Status StageProgram::backward_weight(StageActivation& act) const {
  if (!act.deferred) {
    return Status(ErrorCode::kInternal, "backward_weight needs the activation backward_input returned");
  }
  std::shared_ptr<DeferredWeightGradient> deferred = std::move(act.deferred);
  if (deferred->roots.empty()) return Status::ok();
  try {
    torch::autograd::Engine::get_default_engine().execute(deferred->roots, deferred->grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false, /*accumulate_grad=*/true);
  } catch (const c10::Error& e) {
    return Status(ErrorCode::kExecution, std::string("stage backward (weight half) failed: ") +
                                             e.what_without_backtrace());
  }
  return Status::ok();
}

}  // namespace conveyor::graph
