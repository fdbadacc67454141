"""conveyor.Graph: a captured model that runs through conveyor's C++ executor, whole or
cut into stages."""
from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

import torch
import torch.utils._pytree as pytree

from . import _C
from .counted_targets import count_targets, counted_losses, counting_document
from .errors import ConveyorValueError, GraphFormatError


def _spec_dumps(spec) -> str | None:
    if spec is None:
        return None
    try:
        return pytree.treespec_dumps(spec)
    except Exception:  # noqa: BLE001 - some output types cannot be serialized; fall back to flat
        return None


def _spec_loads(text: str | None):
    if not text:
        return None
    try:
        return pytree.treespec_loads(text)
    except Exception:  # noqa: BLE001 - torch raises several kinds on a malformed spec
        return None


def _checked_extra(doc: dict, path) -> dict:
    """A loaded graph document's "extra" (how a call's arguments and results map to the
    graph's inputs and outputs), checked against the graph: anything else is a
    GraphFormatError naming the file, never a TypeError at the first call."""
    def bad(what: str):
        return GraphFormatError(f"the graph in '{path}' is not one conveyor wrote: its extra {what}; capture and save "
                                "the model again")
    extra = doc.get("extra") or {}
    if not isinstance(extra, dict):
        raise bad(f"is {type(extra).__name__}, not a table")
    inputs, outputs = len(doc.get("inputs") or []), len(doc.get("outputs") or [])
    positions = extra.get("input_positions")
    if positions is not None and (not isinstance(positions, list) or
                                  not all(type(k) is int and k >= 0 for k in positions)):
        raise bad(f"input_positions is {_C.printable(repr(positions))}, not a list of argument positions")
    if positions is not None and not extra.get("counted_targets") and len(positions) != inputs:
        raise bad(f"input_positions names {len(positions)} arguments for {inputs} graph inputs")
    for key, count in (("in_spec", None), ("out_spec", outputs)):
        text = extra.get(key)
        if text is None:
            continue
        spec = _spec_loads(text) if isinstance(text, str) else None
        if spec is None:
            raise bad(f"{key} does not read as a tree of arguments")
        if count is not None and spec.num_leaves != count:
            raise bad(f"{key} has {spec.num_leaves} leaves for {count} graph outputs")
    if not isinstance(extra.get("dynamic_batch", True), bool):
        raise bad("dynamic_batch is not true or false")
    counted = extra.get("counted_targets") or []
    try:
        counted_losses(doc, counted)
    except ValueError as e:
        raise bad(f"counted_targets {_C.printable(str(e), 200)}") from None
    if positions is not None and counted and len(positions) + len(counted) != inputs:
        raise bad(f"input_positions names {len(positions)} arguments for {inputs - len(counted)} graph inputs")
    return extra


class Graph:
    """A model captured into conveyor's IR and bound to tensors.

    Calling it runs the whole graph in C++ through the ATen dispatcher with autograd:
    `loss = g(*args, **kwargs); loss.backward()` fills the bound parameters' `.grad`
    exactly as the eager model would.
    """

    def __init__(self, ir: "_C.GraphIR", tensors: dict[str, torch.Tensor], *, in_spec=None,
                 out_spec=None, input_positions: Sequence[int] | None = None,
                 dynamic_batch: bool = True, counted_targets: list[int] | None = None):
        self._ir = ir
        self._tensors = dict(tensors)
        self._in_spec = in_spec
        self._out_spec = out_spec
        self._input_positions = list(input_positions) if input_positions is not None else None
        self.dynamic_batch = dynamic_batch
        # Losses averaged over counted targets, each divided by the call's count, the last
        # inputs (counted_targets.py): those inputs, what each counts (read from the graph on
        # first use), and the graph making the targets and weights.
        self._count_inputs = list(counted_targets or [])
        self._counted: list[dict] | None = None
        self._counting_graph: Graph | None = None
        self._counting_bound: list[str | None] = []
        # The capture's call's non-tensor arguments (a flag, a temperature) by leaf position:
        # the graph holds them as constants. Set by capture; unknown for a loaded graph.
        self.call_constants: dict[int, Any] = {}
        # Every module's train/eval flag at capture, the model's first (capture.modes_of): the
        # graph holds the operators they chose (a BatchNorm's batch or running statistics,
        # dropout, the model's own branches on them). Unknown (empty) for a loaded graph.
        self.modes: tuple[bool, ...] = ()
        # The type the model's forward returned at capture (a ModelOutput, a dict, a tensor):
        # conveyor.Module(returns="model") returns the loss in it. None for a loaded graph.
        self.output_type: type | None = None
        self._executor = None
        self._doc = None

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_document(cls, doc: dict, tensors: dict[str, torch.Tensor], *, in_spec=None,
                      out_spec=None, input_positions=None, dynamic_batch=True,
                      counted_targets: list[int] | None = None) -> "Graph":
        doc = dict(doc)
        doc["extra"] = {
            "in_spec": _spec_dumps(in_spec),
            "out_spec": _spec_dumps(out_spec),
            "input_positions": list(input_positions) if input_positions is not None else None,
            "dynamic_batch": dynamic_batch,
            **({"counted_targets": counted_targets} if counted_targets else {}),
        }
        ir = _C.GraphIR(json.dumps(doc))
        return cls(ir, tensors, in_spec=in_spec, out_spec=out_spec,
                   input_positions=input_positions, dynamic_batch=dynamic_batch, counted_targets=counted_targets)

    @classmethod
    def load(cls, path: str, model: torch.nn.Module | None = None) -> "Graph":
        """Loads a graph file. With `model`, parameters and buffers bind to the model's live
        tensors (checked against the graph); without, they come from the file's weights."""
        ir, stored = _C.load_graph_file(str(path))
        doc = json.loads(ir.to_json())
        extra = _checked_extra(doc, path)
        stored = dict(stored)
        tensors: dict[str, torch.Tensor] = {}
        live = {}
        if model is not None:
            live = dict(model.named_parameters(remove_duplicate=False))
            live.update(dict(model.named_buffers(remove_duplicate=False)))
        for b in doc["bindings"]:
            name = b["name"]
            if b["kind"] != "constant" and model is not None:
                if name not in live:
                    raise ConveyorValueError(
                        f"the graph in '{path}' needs '{name}' but the model has no such parameter "
                        "or buffer; pass the model the graph was captured from")
                tensors[name] = live[name]
            elif name in stored:
                t = stored[name]
                if b["kind"] == "parameter":
                    if not (t.is_floating_point() or t.is_complex()):
                        raise GraphFormatError(f"the graph in '{path}' stores parameter '{_C.printable(name)}' as {t.dtype}: a "
                                               "parameter is floating point (the file is damaged or was not written "
                                               "by conveyor)")
                    t = torch.nn.Parameter(t)
                tensors[name] = t
            else:
                raise GraphFormatError(
                    f"the graph in '{path}' was saved without weights and needs '{name}'; "
                    "pass model= to bind it to a model's tensors")
        return cls(ir, tensors, in_spec=_spec_loads(extra.get("in_spec")),
                   out_spec=_spec_loads(extra.get("out_spec")),
                   input_positions=extra.get("input_positions"),
                   dynamic_batch=bool(extra.get("dynamic_batch", True)),
                   counted_targets=extra.get("counted_targets"))

    def save(self, path: str, *, weights: bool = True) -> None:
        """Writes the graph (and, by default, its parameters, buffers and constants)."""
        tensors = [(n, t) for n, t in self._tensors.items()] if weights else []
        _C.save_graph_file(str(path), self._ir, tensors)

    # -- inspection -----------------------------------------------------------------------
    @property
    def document(self) -> dict:
        """The graph's JSON document (docs/formats.md), parsed."""
        if self._doc is None:
            self._doc = json.loads(self._ir.to_json())
        return self._doc

    @property
    def nodes(self) -> list[dict]:
        return self.document["nodes"]

    @property
    def num_nodes(self) -> int:
        return self._ir.num_nodes

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Bound tensors by name (the model's own parameters and buffers, and constants)."""
        return dict(self._tensors)

    @property
    def ir(self) -> "_C.GraphIR":
        return self._ir

    def __repr__(self) -> str:
        doc = self.document
        ops: dict[str, int] = {}
        for n in doc["nodes"]:
            ops[n["op"]] = ops.get(n["op"], 0) + 1
        top = ", ".join(f"{k.removeprefix('aten::')}x{v}" for k, v in
                        sorted(ops.items(), key=lambda kv: -kv[1])[:6])
        return (f"conveyor.Graph({len(doc['nodes'])} nodes, {len(doc['inputs'])} inputs, "
                f"{len(doc['bindings'])} bound tensors, {len(doc['outputs'])} outputs; {top})")

    # -- execution ------------------------------------------------------------------------
    def rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Binds the graph to `tensors` by name instead (its executor made again on next use)."""
        self._tensors = dict(tensors)
        self._executor = None
        self._counting_graph = None

    @property
    def executor(self) -> "_C.GraphExecutor":
        if self._executor is None:
            self._executor = _C.GraphExecutor(self._ir, self._tensors)
        return self._executor

    def flatten_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The graph's inputs, in order, from a call's positional and keyword arguments: the
        call's tensors, then the counts of targets its losses average over (counted_targets.py),
        which runs the nodes making the targets."""
        inputs = self.user_inputs(args, kwargs)
        return inputs + self.count_targets(inputs)

    def user_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The graph's inputs that come from a call's arguments (all but the counts), in order."""
        leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
        if self._in_spec is not None and spec != self._in_spec:
            raise ConveyorValueError(
                f"the model was captured with {_call_shape(self._in_spec)}; this call passes {_call_shape(spec)} "
                "(pass the same arguments, in the same structure)")
        changed = self.constant_mismatch(args, kwargs)
        if changed is not None:
            raise ConveyorValueError(f"{changed}: the graph holds the model's non-tensor arguments as constants; "
                                     "capture the model again for this value, or pass it as a tensor")
        positions = self._input_positions
        if positions is None:
            positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        n = len(self.document["inputs"]) - len(self._count_inputs)
        if len(positions) != n:
            raise ConveyorValueError(f"the graph takes {n} tensor inputs but the call provides "
                                     f"{len(positions)}")
        out = []
        for k, p in enumerate(positions):
            if p >= len(leaves) or not isinstance(leaves[p], torch.Tensor):
                got = type(leaves[p]).__name__ if p < len(leaves) else "nothing"
                raise ConveyorValueError(f"input {k} ('{self.document['inputs'][k]['name']}') is a {got}, but the model "
                                         "was captured with a tensor there; pass a tensor")
            out.append(leaves[p])
        return out

    @property
    def counted_targets(self) -> list[dict]:
        """Per loss capture made a sum over a count of its targets (counted_targets.py): its
        count input, targets and weights (value ids), ignore_index and dtype."""
        if self._counted is None:
            self._counted = counted_losses(self.document, self._count_inputs) if self._count_inputs else []
        return self._counted

    def count_targets(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The counts of targets the graph's losses average over (counted_targets.py), for a
        call with the user's `inputs`: the graph's last inputs."""
        if not self._count_inputs:
            return []
        if self._counting_graph is None:
            doc = counting_document(self.document, self.counted_targets)
            read = {b["name"] for b in doc["bindings"]}
            self._counting_graph = Graph(_C.GraphIR(json.dumps(doc)),
                                         {k: t for k, t in self._tensors.items() if k in read})
            # The executor returns what its nodes made; a bound tensor itself is taken here.
            names = {b["value"]: b["name"] for b in doc["bindings"]}
            self._counting_bound = [names.get(v) for v in doc["outputs"]]
        with torch.no_grad():
            made = self._counting_graph.executor.run(inputs)
        made = [self._tensors[name] if name is not None else t for t, name in zip(made, self._counting_bound)]
        return count_targets(made, self.counted_targets)

    def counted_over(self, calls: list[list]) -> list[list]:
        """Flattened inputs of calls making one step (packed microbatches), each call's counts
        made the step's: the losses average over the targets of all the calls."""
        k = len(self._count_inputs)
        if not k or len(calls) < 2:
            return calls
        totals = [sum(call[len(call) - k + j] for call in calls) for j in range(k)]
        return [call[:len(call) - k] + totals for call in calls]

    def constant_mismatch(self, args: tuple, kwargs: dict) -> str | None:
        """Where a call's non-tensor arguments differ from the capture's, which the graph holds
        as constants: "temperature is 2.0 (captured with 0.5)"; None where they agree (or the
        call's structure differs, which flatten_inputs names)."""
        if not self.call_constants:
            return None
        leaves, spec = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))
        if self._in_spec is not None and spec != self._in_spec:
            return None
        for position, want in self.call_constants.items():
            if position >= len(leaves):
                return None
            path, got = leaves[position]
            if not _same_constant(got, want):
                return f"{_argument_name(path)} is {got!r} (captured with {want!r})"
        return None

    def unflatten_outputs(self, outputs: list) -> Any:
        if self._out_spec is not None:
            return pytree.tree_unflatten(outputs, self._out_spec)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def __call__(self, *args, **kwargs):
        return self.unflatten_outputs(self.executor.run(self.flatten_inputs(args, kwargs)))

    # -- stages ---------------------------------------------------------------------------
    def atomic_groups(self) -> list[list[int]]:
        """Groups of node ids that must share a stage (in-place writes through views)."""
        return self._ir.atomic_groups()

    def random_partition(self, num_stages: int, seed: int = 0, *,
                         keep_node_order: bool = False) -> list[list[int]]:
        """A random valid cut into `num_stages` stages (node ids per stage, in run order)."""
        return self._ir.random_partition(num_stages, seed, keep_node_order)

    def split(self, stages: int | Iterable[Iterable[int]], *, random_cut: bool = False, seed: int = 0,
              keep_node_order: bool = False) -> "StagedGraph":
        """Cuts the graph into `stages`: node-id lists, one per stage (a plan's stage_nodes);
        or, to test a cut, a count with `random_cut=True`: a random valid cut drawn from `seed`."""
        if isinstance(stages, int):
            if not random_cut:
                raise ConveyorValueError(
                    f"split({stages}): a count of stages is a random cut, for testing; pass "
                    f"split({stages}, random_cut=True, seed=0) for one, or the stages' node ids "
                    "(conveyor.plan(...).stage_nodes) for a planned cut (conveyor.Module plans and cuts by itself)")
            partition = self.random_partition(stages, seed, keep_node_order=keep_node_order)
        elif random_cut:
            raise ConveyorValueError("split(random_cut=True) draws a cut into a count of stages: pass the count, as "
                                     "split(3, random_cut=True, seed=0), not node-id lists")
        else:
            partition = [sorted(int(n) for n in s) for s in stages]
        self._ir.check_partition(partition)
        return StagedGraph(self, partition)


def _same_constant(a, b) -> bool:
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are taken as different
        return a is b


def _argument_name(path) -> str:
    """A leaf of (args, kwargs) by name: "temperature", "positional argument 2", "options['k']"."""
    keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]  # (0: args or 1: kwargs, name, ...)
    if len(keys) < 2:
        return "an argument"
    head = f"positional argument {keys[1]}" if keys[0] == 0 else str(keys[1])
    return head + "".join(f"[{k!r}]" for k in keys[2:])


def _call_shape(spec) -> str:
    """A call's structure in words: '2 positional arguments and keywords labels, mask'."""
    try:
        args, kwargs = spec.children()
        words = f"{args.num_children} positional argument{'s' if args.num_children != 1 else ''}"
        keys = list(kwargs.context or [])
        return words + (f" and keyword{'s' if len(keys) != 1 else ''} {', '.join(keys)}" if keys else "")
    except (AttributeError, ValueError, TypeError):
        return str(spec)


class _StagedRun(torch.autograd.Function):
    """Runs every stage forward; on backward, every stage backward in reverse order."""

    @staticmethod
    def forward(ctx, staged: "StagedGraph", num_inputs: int, *tensors):
        inputs = list(tensors[:num_inputs])
        with torch.enable_grad():
            outputs, activations = staged.forward_stages(inputs)
        ctx.staged = staged
        ctx.activations = activations
        ctx.num_inputs = num_inputs
        ctx.num_rest = len(tensors) - num_inputs
        results = []
        for o in outputs:
            if isinstance(o, torch.Tensor):
                d = o.detach()
                if not (d.is_floating_point() or d.is_complex()):
                    ctx.mark_non_differentiable(d)
                results.append(d)
            else:
                results.append(o)
        return tuple(results)

    @staticmethod
    def backward(ctx, *grad_outputs):
        input_grads = ctx.staged.backward_stages(ctx.activations, list(grad_outputs))
        ctx.activations = None
        return (None, None, *input_grads, *([None] * ctx.num_rest))


class StagedGraph:
    """A graph cut into stages that run one after another, passing values between them
    exactly as pipeline stages do (each stage sees detached inputs and returns input grads)."""

    def __init__(self, graph: Graph, partition: list[list[int]]):
        self.graph = graph
        self.partition = partition
        self.stages = [graph.executor.stage(p) for p in partition]
        doc = graph.document
        self._input_ids = [i["value"] for i in doc["inputs"]]
        self._output_ids = list(doc["outputs"])
        self._params = [t for t in graph.tensors.values() if t.requires_grad]

    def __len__(self) -> int:
        return len(self.stages)

    def forward_stages(self, inputs: list):
        values = dict(zip(self._input_ids, inputs))
        activations = []
        for stage in self.stages:
            act = stage.forward([values[v] for v in stage.inputs])
            for v, out in zip(stage.outputs, act.outputs):
                values[v] = out
            activations.append(act)
        return [values[v] for v in self._output_ids], activations

    def backward_stages(self, activations, grad_outputs: list) -> list:
        grads: dict[int, torch.Tensor] = {}

        def add(v, g):
            if g is None:
                return
            grads[v] = g if v not in grads else grads[v] + g

        for v, g in zip(self._output_ids, grad_outputs):
            add(v, g)
        for stage, act in zip(reversed(self.stages), reversed(activations)):
            out_grads = [grads.pop(v, None) for v in stage.outputs]
            for v, g in zip(stage.inputs, stage.backward(act, out_grads)):
                add(v, g)
        return [grads.get(v) for v in self._input_ids]

    def __call__(self, *args, **kwargs):
        inputs = self.graph.flatten_inputs(args, kwargs)
        if not torch.is_grad_enabled():
            outputs, _ = self.forward_stages(inputs)
            return self.graph.unflatten_outputs(outputs)
        outputs = _StagedRun.apply(self, len(inputs), *inputs, *self._params)
        return self.graph.unflatten_outputs(list(outputs))
