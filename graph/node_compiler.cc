#include "graph/compiled_node.h"

#include <ATen/ScalarOps.h>

#include <algorithm>
#include <cmath>

#include "conveyor_config.h"

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

std::string where(const Node& n) {
  return "node " + std::to_string(n.id) + " (" + n.qualified_name() +
         (n.source.empty() ? "" : ", from " + n.source) + ")";
}

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


Result<c10::IValue> evaluate_sym(SymOp op, const std::vector<c10::IValue>& operands) { return eval_sym(op, operands); }

Result<std::unique_ptr<GraphExecutor::CompiledNode>> compile_node(const Graph& g, const Node& n,
                                                                  const std::vector<c10::IValue>& bound) {
  NodeCompiler compiler(g, bound);
  auto& dispatcher = c10::Dispatcher::singleton();
  auto cn = std::make_unique<GraphExecutor::CompiledNode>();
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
    return cn;
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
  return cn;
}

}  // namespace conveyor::graph
