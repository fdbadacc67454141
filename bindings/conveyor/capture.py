"""Capture: torch.export (training IR, dynamic batch) -> conveyor's graph IR.

Each ATen call becomes a node with its schema name and overload, its arguments
normalized against the schema (defaults filled in), which arguments it writes in place
and which it returns a view of. Parameters and buffers are referenced by their
fully-qualified names and bound to the model's own tensors, so the user's optimizer
keeps updating the very tensors the graph runs with.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import math
import operator
import re
import sys
import warnings
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export import Dim, ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .capture_failure import FRAME, capture_failure, helpers_in_stack_traces, is_user_path
from .counted_targets import with_counted_means_summed
from .errors import CaptureError
from .graph import Graph
from . import guards
from .guards import export_attempt_begins, export_under_guards
from .moe_experts import eager_experts_grouped

# Python-level size arithmetic that export leaves in the graph, by conveyor::sym overload.
_SYM_OPS = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.floordiv: "floordiv",
    operator.truediv: "truediv", operator.mod: "mod", operator.neg: "neg", operator.pow: "pow",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge", operator.and_: "and", operator.or_: "or", operator.not_: "not",
    torch.sym_max: "max", torch.sym_min: "min", torch.sym_float: "float", torch.sym_int: "int",
    torch.sym_not: "not", math.ceil: "ceil", math.floor: "floor", math.sqrt: "sqrt",
}
if hasattr(torch, "sym_sqrt"):
    _SYM_OPS[torch.sym_sqrt] = "sqrt"


# Ops that update running statistics in training mode although their schema does not say so
# (no `(a!)`): (running_mean, running_var, the training flag) argument positions. The graph
# marks them written, so what reads the statistics knows they change.
_RUNNING_STATISTICS = {"aten::batch_norm": (3, 4, 5), "aten::instance_norm": (3, 4, 5)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dim(size) -> int | str:
    """A shape entry: an int, or the symbolic expression as text ("s0", "2*s0")."""
    if isinstance(size, int):
        return size
    concrete = size.node.maybe_as_int() if hasattr(size.node, "maybe_as_int") else None
    return int(concrete) if concrete is not None else str(size)


def _is_list_type(t) -> bool:
    return isinstance(t, torch._C.ListType)


def _source_of(node: torch.fx.Node) -> str:
    frames = [(p, l) for p, l in FRAME.findall(node.meta.get("stack_trace") or "") if is_user_path(p)]
    if not frames:
        return ""
    path, line = frames[-1]
    return f"{path}:{line}"


def _dynamic_shapes(model, args, kwargs, batch: int, bounds: dict[str, int] | None = None, other_sizes: bool = True):
    """dynamic_shapes marking dim 0 of every tensor whose dim 0 equals the batch size, as one
    Dim("batch") within `bounds` (min, max) where given; with `other_sizes`, every other
    dimension of every input as Dim.AUTO: symbolic where the model allows it (a sequence
    length, an image's height and width), fixed where the model specializes it."""
    dim = Dim("batch", **(bounds or {}))

    def spec(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return None
        out = {d: Dim.AUTO for d in range(x.dim())} if other_sizes else {}
        if x.shape[0] == batch:
            out[0] = dim
        return out or None

    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    out = {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(pytree.tree_map(spec, v) for v in value)
        elif kind == inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: pytree.tree_map(spec, v) for k, v in value.items()}
        else:
            out[name] = pytree.tree_map(spec, value)
    return out


_SUGGESTED_BATCH = re.compile(r"batch = Dim\('batch'((?:, (?:min|max)=\d+)*)\)")


def _suggested_batch_bounds(text: str) -> dict[str, int] | None:
    """The range torch.export suggests for the batch when the model's guards bound it (a
    kernel chosen by size, as cuDNN's BatchNorm is up to 880801 samples, or a Python branch
    on the batch size): {"min": .., "max": ..}; None when it suggests a fixed size instead."""
    found = _SUGGESTED_BATCH.search(text)
    if not found:
        return None
    return {k: int(v) for k, v in re.findall(r"(min|max)=(\d+)", found.group(1))}


_RELATION = re.compile(r"L\['(\w+)'\](?:\[(?:'(\w+)'|(\d+))\])*\.size\(\)\[(\d+)\] = ([^=]+)$")


def _batch_relation(text: str) -> str | None:
    """What torch.export says ties an input's size to the batch, as "target dim 0 must be
    8*batch" (a target flattened to batch x length rows), or None."""
    for line in text.splitlines():
        found = _RELATION.match(line.strip())
        if found and "batch" in found.group(5):
            name = found.group(2) or found.group(1)
            return f"{name} dim {found.group(4)} must be {found.group(5).strip()}"
    return None


_GUARD = re.compile(r"satisfy the generated guard (.+?)\.(?:\s|$|Specializations)")
_SIZE_OF_AN_INPUT = re.compile(r"L\['\w+'\](?:\[(?:'\w+'|\d+)\])*\.size\(\)\[0\]")


def _batch_guard(text: str) -> str | None:
    """The first check on the batch size torch.export names, with the batch called "batch":
    "((1 + batch) // 2) != 1" (a chunk into halves), or None."""
    found = _GUARD.search(text)
    if found is None:
        return None
    guard = _SIZE_OF_AN_INPUT.sub("batch", found.group(1)).strip()
    return guard if len(guard) <= 120 else guard[:117] + "..."


def _export(model, args, kwargs, dynamic_batch: bool) -> tuple[ExportedProgram, bool]:
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if not leaves:
        raise CaptureError(f"cannot capture {type(model).__name__}: it takes no tensor inputs")
    batch = leaves[0].shape[0] if leaves[0].dim() > 0 else None
    if dynamic_batch and batch is not None and batch < 2:
        raise CaptureError(
            f"cannot capture {type(model).__name__} with a batch of {batch}: capture with an "
            "example batch of at least 2 so the batch dimension can stay symbolic")
    if dynamic_batch and batch is not None:
        bounds: dict[str, int] = {}
        other_sizes = True
        for _ in range(6):  # each retry narrows the range to what the model's guards allow
            try:
                shapes = _dynamic_shapes(model, args, kwargs, batch, bounds, other_sizes)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    return _export_quietly(model, args, kwargs, dynamic_shapes=shapes), True
            except Exception as exc:  # noqa: BLE001 - retried below, then reported
                text = str(exc)
                specialization = "batch" in text and ("specializ" in text or "constraint" in text.lower()
                                                      or "Constraints violated" in text)
                if not specialization:
                    if other_sizes:  # sizes other than the batch fixed, as captured
                        other_sizes = False
                        continue
                    raise capture_failure(model, exc) from exc
                narrower = _suggested_batch_bounds(text)
                if narrower is None or narrower == bounds:
                    break
                bounds = narrower
        why = _batch_relation(text)
        if why is None and _batch_guard(text):
            why = f"it checks {_batch_guard(text)}, as halving or counting the batch does"
        warnings.warn(f"conveyor: {type(model).__name__} specializes its batch size"
                      + (f" ({why})" if why else "") + f"; captured for a fixed batch of {batch}: a pipeline "
                      "runs each call whole (one microbatch, one replica per stage)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _export_quietly(model, args, kwargs), False
    except Exception as exc:  # noqa: BLE001
        raise capture_failure(model, exc) from exc


def _export_quietly(model, args, kwargs, **options):
    """torch.export.export (non-strict), without the partial graph torch prints to stderr
    when an attempt fails (conveyor tries several, and says what failed in its own words);
    anything else written to stderr meanwhile, such as the model's own prints, is kept."""
    caught = io.StringIO()
    failed = None
    export_attempt_begins()
    try:
        with contextlib.redirect_stderr(caught), helpers_in_stack_traces():
            return torch.export.export(model, args, kwargs, strict=False, **options)
    except Exception as exc:
        failed = exc
        raise
    finally:
        text = caught.getvalue()
        partial = getattr(failed, "partial_fx_graph", None)
        if partial is not None:
            text = text.replace(f"{partial}\n", "")
        if text:
            sys.stderr.write(text)


@contextlib.contextmanager
def _torch_logs_quiet():
    """torch's own loggers below ERROR while conveyor exports: each attempt of a capture
    (a symbolic batch, then fixed sizes, then guards) made torch log its warnings with the
    whole graph ("Unable to find user code corresponding to {u0}" and the graph's code). What
    conveyor concludes from them is its own error or one warning."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    levels = [(lg, lg.level) for lg in loggers]
    for lg, _ in levels:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in levels:
            lg.setLevel(level)


def _finite_int(bound) -> int | None:
    """A range bound as an int; None for an infinite one."""
    try:
        return int(bound) if bound.is_finite else None
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


class _Builder:
    """Walks an exported FX graph and emits conveyor's IR document."""

    def __init__(self, ep: ExportedProgram, model: torch.nn.Module):
        self.ep = ep
        self.model = model
        self.values: list[dict] = []
        self.nodes: list[dict] = []
        self.inputs: list[dict] = []
        self.bindings: list[dict] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.symbols: dict[str, str] = {}
        self.ranges: dict[str, dict[str, int]] = {}  # symbol -> the sizes the graph holds for
        self.env: dict[torch.fx.Node, Any] = {}  # fx node -> value id, or list of them

    # -- values ---------------------------------------------------------------------------
    def new_value(self, val, name: str) -> int:
        vid = len(self.values)
        entry: dict[str, Any] = {"id": vid, "name": name}
        if isinstance(val, torch.Tensor):
            entry["kind"] = "tensor"
            entry["dtype"] = _dtype_name(val.dtype)
            entry["shape"] = [_dim(d) for d in val.shape]
            if val.requires_grad:
                entry["requires_grad"] = True
        elif isinstance(val, (torch.SymBool, bool)):
            entry["kind"] = "bool"
        elif isinstance(val, (torch.SymFloat, float)):
            entry["kind"] = "float"
        elif isinstance(val, (torch.SymInt, int)):
            entry["kind"] = "int"
        else:
            raise CaptureError(f"value '{name}' has an unsupported type {type(val).__name__}")
        self.values.append(entry)
        return vid

    def where(self, node: torch.fx.Node) -> str:
        src = _source_of(node)
        return f" at {src}" if src else ""

    # -- arguments ------------------------------------------------------------------------
    def encode(self, x, node: torch.fx.Node) -> dict:
        if isinstance(x, torch.fx.Node):
            rep = self.env.get(x)
            if rep is None:
                raise CaptureError(f"node {node.name} reads {x.name}, which conveyor could not "
                                   f"translate{self.where(node)}")
            if isinstance(rep, list):
                return {"list": [{"value": v} if v is not None else {"none": None} for v in rep]}
            return {"value": rep}
        if isinstance(x, (list, tuple)):
            return {"list": [self.encode(e, node) for e in x]}
        if isinstance(x, bool):
            return {"bool": x}
        if isinstance(x, int):
            return {"int": x}
        if isinstance(x, float):
            if math.isnan(x):
                return {"float": "nan"}
            if math.isinf(x):
                return {"float": "inf" if x > 0 else "-inf"}
            return {"float": x}
        if isinstance(x, str):
            return {"str": x}
        if x is None:
            return {"none": None}
        if isinstance(x, torch.dtype):
            return {"dtype": _dtype_name(x)}
        if isinstance(x, torch.device):
            return {"device": str(x)}
        if isinstance(x, torch.layout):
            return {"layout": str(x).removeprefix("torch.")}
        if isinstance(x, torch.memory_format):
            return {"memory_format": str(x).removeprefix("torch.")}
        raise CaptureError(f"node {node.name} ({node.target}) has an argument of unsupported type "
                           f"{type(x).__name__}: {x!r}{self.where(node)}")

    # -- nodes ----------------------------------------------------------------------------
    def add_op(self, node: torch.fx.Node, grad_enabled):
        op = node.target
        schema = op._schema
        args = []
        for i, a in enumerate(schema.arguments):
            if not a.kwarg_only and i < len(node.args):
                v = node.args[i]
            elif a.name in node.kwargs:
                v = node.kwargs[a.name]
            elif a.has_default_value():
                v = a.default_value
            else:
                raise CaptureError(f"node {node.name} ({op}) is missing argument '{a.name}'"
                                   f"{self.where(node)}")
            args.append(self.encode(v, node))
        mutates = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        stats = _RUNNING_STATISTICS.get(schema.name)
        if stats is not None and args[stats[2]].get("bool") is True:
            mutates += [i for i in stats[:2] if "value" in args[i]]
        aliases = []
        if schema.returns and schema.returns[0].alias_info is not None:
            ret_sets = set(schema.returns[0].alias_info.before_set)
            aliases = [i for i, a in enumerate(schema.arguments)
                       if a.alias_info is not None and set(a.alias_info.before_set) & ret_sets]
        val = node.meta.get("val")
        returns = []
        if len(schema.returns) == 1:
            if _is_list_type(schema.returns[0].type):
                ids = [self.new_value(v, f"{node.name}_{j}") for j, v in enumerate(val)]
                returns.append({"list": ids})
                self.env[node] = ids
            elif val is None:
                returns.append({"unused": None})
                self.env[node] = None
            else:
                vid = self.new_value(val, node.name)
                returns.append({"value": vid})
                self.env[node] = vid
        elif len(schema.returns) > 1:
            ids = []
            for j, r in enumerate(schema.returns):
                v = val[j] if val is not None and j < len(val) else None
                if v is None or _is_list_type(r.type):
                    returns.append({"unused": None})
                    ids.append(None)
                else:
                    vid = self.new_value(v, f"{node.name}_{j}")
                    returns.append({"value": vid})
                    ids.append(vid)
            self.env[node] = ids
        entry = {"id": len(self.nodes), "op": schema.name, "overload": schema.overload_name,
                 "args": args, "returns": returns}
        if mutates:
            entry["mutates"] = mutates
        if aliases:
            entry["aliases"] = aliases
        src = _source_of(node)
        if src:
            entry["source"] = src
        if grad_enabled is not None:
            entry["grad_enabled"] = grad_enabled
        if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            entry["random"] = True
        self.nodes.append(entry)

    def add_sym(self, node: torch.fx.Node, name: str):
        args = [self.encode(a, node) for a in node.args]
        vid = self.new_value(node.meta.get("val", 0), node.name)
        self.env[node] = vid
        entry = {"id": len(self.nodes), "op": "conveyor::sym", "overload": name, "args": args,
                 "returns": [{"value": vid}]}
        src = _source_of(node)
        if src:
            entry["source"] = src
        self.nodes.append(entry)

    def walk(self, gm: torch.fx.GraphModule, grad_enabled=None):
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op != "call_function":
                raise CaptureError(f"unsupported FX node kind {node.op} ({node.target}){self.where(node)}")
            target = node.target
            if target is operator.getitem:
                base = self.env.get(node.args[0])
                if not isinstance(base, list):
                    raise CaptureError(f"unsupported indexing of {node.args[0].name}{self.where(node)}")
                self.env[node] = base[node.args[1]]
            elif isinstance(target, torch._ops.OpOverload):
                self.add_op(node, grad_enabled)
            elif target in _SYM_OPS:
                self.add_sym(node, _SYM_OPS[target])
            elif isinstance(target, torch._ops.HigherOrderOperator) and \
                    target.__name__ == "wrap_with_set_grad_enabled":
                enabled, sub, *operands = node.args
                self.inline(gm.get_submodule(sub.target), operands, node, bool(enabled))
            else:
                name = getattr(target, "__name__", str(target))
                hint = ""
                if isinstance(target, torch._ops.HigherOrderOperator):
                    hint = ("\n  hint: conveyor runs plain ATen operators; higher-order operators such as "
                            "torch.cond, torch.map or while_loop are not supported: compute both branches "
                            "and select with torch.where")
                raise CaptureError(f"cannot capture {type(self.model).__name__}: unsupported operation "
                                   f"'{name}' (node {node.name}){self.where(node)}{hint}")

    def inline(self, sub: torch.fx.GraphModule, operands, node, grad_enabled):
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for p, operand in zip(placeholders, operands):
            self.env[p] = self.env[operand]
        self.walk(sub, grad_enabled)
        out = next(n for n in sub.graph.nodes if n.op == "output")
        self.env[node] = [self.env[o] for o in out.args[0]]

    def batch_bounds(self, symbol: str) -> dict[str, int]:
        """The batch sizes the graph was captured for, where the model's guards bound them:
        {"max": n} and {"min": n} above 2 (export's own floor for a dynamic size, which
        conveyor's executor does not need: it runs shares of one sample)."""
        for sym, vr in self.ep.range_constraints.items():
            if str(sym) != symbol:
                continue
            out = {}
            lower, upper = _finite_int(vr.lower), _finite_int(vr.upper)
            if lower is not None and lower > 2:
                out["min"] = lower
            if upper is not None:
                out["max"] = upper
            return out
        return {}

    def size_bounds(self, symbol: str) -> dict[str, int]:
        """The sizes a symbolic dimension other than the batch holds for: from 2 (export
        assumes a dynamic size is not 0 or 1, where broadcasting would differ) to the model's
        bound where its guards set one."""
        out = {"min": 2}
        for sym, vr in self.ep.range_constraints.items():
            if str(sym) == symbol:
                lower, upper = _finite_int(vr.lower), _finite_int(vr.upper)
                out["min"] = max(2, lower or 2)
                if upper is not None:
                    out["max"] = upper
        return out

    # -- whole program --------------------------------------------------------------------
    def build(self, dynamic: bool) -> tuple[dict, dict[str, torch.Tensor]]:
        ep = self.ep
        sig = ep.graph_signature
        specs = {s.arg.name: s for s in sig.input_specs}
        state = dict(self.model.named_parameters(remove_duplicate=False))
        state.update(dict(self.model.named_buffers(remove_duplicate=False)))
        tied: dict[int, dict] = {}
        for node in ep.graph.nodes:
            if node.op != "placeholder":
                continue
            spec = specs[node.name]
            val = node.meta.get("val")
            if spec.kind == InputKind.USER_INPUT:
                if not isinstance(val, torch.Tensor):
                    self.env[node] = None
                    continue
                vid = self.new_value(val, node.name)
                self.env[node] = vid
                self.inputs.append({"value": vid, "name": node.name})
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                name = spec.target
                live = state.get(name)
                if live is None:
                    raise CaptureError(f"the exported graph refers to '{name}' which the model does not have")
                if id(live) in tied:  # one tensor under several names: bind it once
                    binding = tied[id(live)]
                    binding.setdefault("tied", []).append(name)
                    self.env[node] = binding["value"]
                    continue
                vid = self.new_value(live, name)
                self.env[node] = vid
                kind = "parameter" if spec.kind == InputKind.PARAMETER else "buffer"
                self.bindings.append({"value": vid, "name": name, "kind": kind})
                tied[id(live)] = self.bindings[-1]
                self.tensors[name] = live
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                name = "constant." + spec.target
                const = ep.constants[spec.target]
                vid = self.new_value(const, name)
                self.env[node] = vid
                self.bindings.append({"value": vid, "name": name, "kind": "constant"})
                self.tensors[name] = const
            else:
                raise CaptureError(f"unsupported graph input {node.name} of kind {spec.kind.name}")
        self.walk(ep.graph_module)
        out_node = next(n for n in ep.graph.nodes if n.op == "output")
        outputs = []
        for spec, o in zip(sig.output_specs, out_node.args[0]):
            if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT):
                raise CaptureError(f"unsupported graph output of kind {spec.kind.name} ({spec.target}); "
                                   "conveyor expects in-place buffer updates in the training IR")
            if not isinstance(o, torch.fx.Node) or not isinstance(self.env.get(o), int):
                raise CaptureError(f"output {o!r} of {type(self.model).__name__} is not a tensor "
                                   "computed by the model; return tensors only")
            outputs.append(self.env[o])
        # The batch symbol: dim 0 of the first user input, when dynamic. Every other plain
        # symbol of an input's shape is named by where it first appears ("input_ids dim 1").
        if dynamic and self.inputs:
            shape0 = self.values[self.inputs[0]["value"]].get("shape") or []
            if shape0 and isinstance(shape0[0], str):
                self.symbols[shape0[0]] = "batch"
                bounds = self.batch_bounds(shape0[0])
                if bounds:
                    self.ranges[shape0[0]] = bounds
            for entry in self.inputs:
                for d, size in enumerate(self.values[entry["value"]].get("shape") or []):
                    if isinstance(size, str) and size.isidentifier() and size not in self.symbols:
                        self.symbols[size] = f"{entry['name']} dim {d}"
                        self.ranges[size] = self.size_bounds(size)
        doc = {
            "format": "conveyor.graph",
            "version": 1,
            "producer": {"conveyor": "0.1.0", "torch": torch.__version__},
            "symbols": self.symbols,
            **({"ranges": self.ranges} if self.ranges else {}),
            "values": self.values,
            "inputs": self.inputs,
            "bindings": self.bindings,
            "nodes": self.nodes,
            "outputs": outputs,
        }
        return doc, self.tensors


def capture(model: torch.nn.Module, args=(), kwargs=None, *, dynamic_batch: bool = True,
            meta_runs_on: torch.device | None = None, guards: bool = True) -> Graph:
    """Captures `model` called as `model(*args, **kwargs)` into a conveyor Graph.

    The batch dimension (dim 0 of the inputs) stays symbolic unless `dynamic_batch=False`
    or the model fixes it. Parameters and buffers are bound to the model's live tensors.
    `meta_runs_on`: a model and inputs on the meta device, traced there, whose graph runs on
    that device (the operators' device arguments say it instead of meta).
    `guards`: a check of a tensor's values (`if not torch.isfinite(h).all()`, `torch._assert`)
    is captured as the example takes it, under a guard that stops a step whose batch would take
    the other way (guards.py); False: refused, as any branch on a value is.
    Raises CaptureError naming the construct and source line when the model cannot be captured.
    """
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"capture expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, tuple):
        args = tuple(args) if isinstance(args, list) else (args,)
    kwargs = dict(kwargs or {})
    with _torch_logs_quiet(), eager_experts_grouped(model):
        ep, dynamic = (export_under_guards(_export, model, args, kwargs, dynamic_batch) if guards
                       else _export(model, args, kwargs, dynamic_batch))
    builder = _Builder(ep, model)
    doc, tensors = builder.build(dynamic)
    if meta_runs_on is not None:
        for node in doc["nodes"]:
            for arg in node["args"]:
                if arg.get("device") == "meta":
                    arg["device"] = str(meta_runs_on)
    doc, counted = with_counted_means_summed(doc)
    user_positions = _user_leaf_positions(args, kwargs)
    call = ep.module_call_graph[0].signature
    graph = Graph.from_document(doc, tensors, in_spec=call.in_spec if call else None,
                                out_spec=call.out_spec if call else None,
                                input_positions=user_positions, dynamic_batch=dynamic, counted_targets=counted)
    graph.call_constants = {i: x for i, x in enumerate(pytree.tree_leaves((args, kwargs)))
                            if not isinstance(x, torch.Tensor)}
    return graph


def modes_of(model: torch.nn.Module) -> tuple[bool, ...]:
    """Every module's train/eval flag, the model's first: what the captured operators depend
    on (BatchNorm's statistics, dropout, the model's own branches on self.training)."""
    return tuple(m.training for m in model.modules())


def _user_leaf_positions(args, kwargs) -> list[int]:
    """Which leaves of the flattened (args, kwargs) feed the graph's tensor inputs."""
    leaves = pytree.tree_leaves((args, kwargs))
    return [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
