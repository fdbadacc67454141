"""Profiling a captured graph: what the planner is given.

    g = conveyor.capture(model, (x,))
    prof = conveyor.profile(g, (x,))               # measured once, cached by graph hash

The profile measures every node (an atomic group as one unit) on the device its tensors
live on: forward and backward time at the example's batch size, the bytes of every value,
the activations autograd saves for backward, and the working memory. See docs/formats.md.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .. import _C, environment
from ..errors import ConveyorValueError
from ..document import node_value_inputs
from ..graph import Graph
from ..materialize import is_placeholder, units_made
from ..selective import SelectiveAccounting

__all__ = ["profile", "profile_cache_dir"]


def profile_cache_dir() -> Path:
    """Where profiles are cached: $CONVEYOR_CACHE_DIR/profiles (default ~/.cache/conveyor)."""
    base = environment.variable("CONVEYOR_CACHE_DIR") or os.path.join(
        environment.variable("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "conveyor")
    return Path(base) / "profiles"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.machine()} x{torch.get_num_threads()} threads"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clock(device: torch.device):
    """What a unit's time is read on. On a CPU profiled with one intra-op thread: the thread's
    own CPU time, which a busy neighbour on its core does not stretch (on wall time, beside one
    hog, GPT-2's units under 2 ms read their full speed, woken ahead of it, and those over 2 ms
    1.8-1.95x: a skew no common correction undoes, and the two plans re-planning mispredicted
    by 27-60% were priced on a profile of process 0 beside its hog; the device's share is
    measured live, as its speed). Else wall time: a GPU's, synchronized, or several threads
    working at once."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _units(graph: Graph) -> list[list[int]]:
    """Nodes in execution order, an atomic group as one unit (it is never split)."""
    groups = graph.atomic_groups()
    group_of = {n: i for i, grp in enumerate(groups) for n in grp}
    units, seen = [], set()
    for n in range(graph.num_nodes):
        if n in group_of:
            g = group_of[n]
            if g not in seen:
                seen.add(g)
                units.append(sorted(groups[g]))
        else:
            units.append([n])
    return units


def _peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (Linux's VmHWM), or None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


def _stand_ins_for_views(outputs: list, made: list) -> list:
    """`outputs`, those that view a tensor in `made` replaced by a placeholder of their shape."""
    storages = {t.untyped_storage().data_ptr() for t in made}
    if not storages:
        return list(outputs)
    return [torch.empty(1, dtype=o.dtype, device=o.device).expand(o.shape)
            if isinstance(o, torch.Tensor) and o.numel() > 1 and o.untyped_storage().data_ptr() in storages else o
            for o in outputs]


def _made_if_stand_in(t):
    """A unit's input: a placeholder made to its shape and dtype (values that serve timing)."""
    if not isinstance(t, torch.Tensor) or not is_placeholder(t):
        return t
    if t.is_floating_point():
        return torch.empty(t.shape, dtype=t.dtype, device=t.device).normal_(0, 0.02)
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device)


def _selective_run_work(graph: Graph, runs, values: dict, device: torch.device) -> dict[int, float]:
    """Per run of cheap operators (by its first node): what its backward holds at once beyond
    what its forward left, measured by running it as selective recomputation does (kept
    inputs; in the backward, the run again with every value it makes and their gradients),
    once per kind of run (each transformer block's attention alike). Runs whose inputs the
    profile has no value for, or on a CPU whose meter is off, are left to
    SelectiveAccounting's estimate."""
    work: dict[int, float] = {}
    if device.type != "cuda" and not _C.HostMemoryMeter.active():
        return work
    alike: dict[str, float] = {}
    executor = graph.executor
    for run_nodes, _ in runs:
        signature = _unit_signature(graph, list(run_nodes), values)
        if signature in alike:
            work[run_nodes[0]] = alike[signature]
            continue
        stage = executor.stage(list(run_nodes))
        if not all(v in values for v in stage.inputs):
            continue
        meter = _C.HostMemoryMeter() if device.type != "cuda" else None
        with meter if meter is not None else contextlib.nullcontext():
            act = stage.forward_selective([_made_if_stand_in(values[v]) for v in stage.inputs], None)
            grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                     for o in act.outputs]
            if all(g is None for g in grads):
                continue
            if meter is not None:
                held = meter.live
                meter.reset_peak()
            else:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                held = torch.cuda.memory_allocated(device)
            stage.backward(act, grads)
            peak = meter.peak if meter is not None else torch.cuda.max_memory_allocated(device)
        work[run_nodes[0]] = alike[signature] = float(max(peak - held, 0))
    return work


def _unit_signature(graph: Graph, unit: list[int], values: dict) -> str:
    """What a unit computes on: its operators, their constants, and the shape, dtype and
    gradient need of every value they read (a parameter counts as any value). Units alike
    (the same layer of each transformer block) take the same time and memory."""
    doc = graph.document
    parts = []
    for n in unit:
        node = doc["nodes"][n]
        args = []
        for a in node["args"]:
            v = a.get("value")
            if v is None:
                args.append(a)
                continue
            t = values.get(v)
            if isinstance(t, torch.Tensor):
                args.append(("t", tuple(t.shape), str(t.dtype), t.requires_grad))
            else:
                meta = doc["values"][v]
                args.append(("v", meta.get("shape"), meta.get("dtype"), meta.get("requires_grad")))
        parts.append((node["op"], node.get("overload", ""), args))
    return repr(parts)


def profile(graph: Graph, args: tuple, kwargs: dict | None = None, *, repeats: int = 3, warmup: int = 1,
            cache: bool = True, flat_inputs: list | None = None) -> dict:
    """Measures `graph` on `args` (one microbatch: its batch size is the profile's) and returns
    the profile document. With `cache`, a profile of the same graph, device and input sizes is
    read from and written to profile_cache_dir(). Parameter gradients and buffers (BatchNorm
    statistics) are left as they were. `flat_inputs`: the inputs already flattened
    (Graph.flatten_inputs), instead of `args` and `kwargs`."""
    if not isinstance(graph, Graph):
        raise ConveyorValueError("conveyor.profile expects a captured conveyor.Graph; capture the model first "
                                 "with conveyor.capture(model, args)")
    if repeats < 1:
        raise ConveyorValueError("repeats must be at least 1")
    kwargs = kwargs or {}
    inputs = list(flat_inputs) if flat_inputs is not None else graph.flatten_inputs(args, kwargs)
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    microbatch = tensors[0].shape[0] if tensors and tensors[0].dim() > 0 else 1
    ghash = _C.graph_hash(graph.ir)
    name = _device_name(device)
    key = "".join(c if c.isalnum() else "_" for c in name)
    # Keyed by every input's sizes (a sequence length changes the profile as a batch does);
    # "m9": how memory and time are measured (working memory, metered on the CPU; a value two units save counted
    # once, and which unit it counts for; what selective recomputation frees; a first pass over the units
    # unmeasured; m10: units alike measured once; m11: the fixed fraction; m12: a one-thread CPU's
    # units on the thread's CPU time; m14: a selective run's working memory measured, on each of its nodes), so
    # that older entries are measured again.
    sizes = hashlib.sha256(repr([tuple(t.shape) for t in tensors]).encode()).hexdigest()[:12]
    path = profile_cache_dir() / f"{ghash}-{key}-mb{microbatch}-{sizes}-m14.json"
    if cache and path.exists():
        try:
            doc = json.loads(path.read_text())
            if doc.get("graph_hash") == ghash and len(doc.get("nodes", [])) == graph.num_nodes:
                return doc
        except (OSError, ValueError):
            pass  # unreadable cache entry: measure again

    bound = graph.tensors
    # Tensors this process does not hold (a meta-built model's, or released here by a
    # pipeline) are placeholders: each unit's are made only while it is measured.
    released = []  # released here by a pipeline: 0 elements again after (the runtime's sign)
    for b in graph.document["bindings"]:
        t = bound[b["name"]]
        shape = graph.document["values"][b["value"]].get("shape", [])
        if b["kind"] != "constant" and t.numel() == 0 and math.prod(shape) > 0:
            released.append(t)
            with torch.no_grad():
                t.data = torch.empty(1, dtype=t.dtype).expand(shape)
    held = {n: t for n, t in bound.items() if not is_placeholder(t)}
    saved_grads = {n: (t.grad.clone() if t.grad is not None else None) for n, t in held.items() if t.requires_grad}
    # Running the nodes updates buffers in place (BatchNorm statistics): put them back after.
    saved_buffers = {n: t.detach().clone() for n, t in held.items() if not t.requires_grad}
    param_storages = {t.untyped_storage().data_ptr() for t in held.values()}
    executor = graph.executor
    doc_in = graph.document
    values: dict[int, Any] = dict(zip([i["value"] for i in doc_in["inputs"]], inputs))
    value_bytes = [0] * graph.ir.num_values
    saved_by = [-1] * graph.ir.num_values
    for b in doc_in["bindings"]:
        value_bytes[b["value"]] = _nbytes(bound[b["name"]])
    for v, t in values.items():
        value_bytes[v] = _nbytes(t)
    nodes = [dict(forward_s=0.0, backward_s=0.0, backward_weight_s=0.0, saved_bytes=0.0, work_bytes=0.0,
                  selective_forward_s=0.0, selective_freed_bytes=0.0, selective_work_bytes=0.0,
                  selective_kept_bytes=0.0)
             for _ in range(graph.num_nodes)]
    selective = SelectiveAccounting(graph, doc_in)
    measured: list = []  # per unit: (nodes, bytes saved on storages made inside it, {value storage: bytes}, every storage saved)
    selective.note_values(values, list(values))
    reads_param = set()
    bound_ids = {b["value"] for b in doc_in["bindings"] if b["kind"] != "constant"}
    trained = {b["value"] for b in doc_in["bindings"] if b["kind"] == "parameter" and bound[b["name"]].requires_grad}
    grad_bytes = [0] * graph.num_nodes  # the gradients of the parameters a node reads: its backward makes them
    for i, node in enumerate(graph.nodes):
        if any(v in bound_ids for v in node_value_inputs(node)):
            reads_param.add(i)
            grad_bytes[i] = sum(value_bytes[v] for v in set(node_value_inputs(node)) if v in trained)
    try:
        # Units in a topological order: the first (by node id) whose inputs all exist.
        pending = [(unit, executor.stage(unit)) for unit in _units(graph)]
        available = set(values)
        order = []
        while pending:
            for k, (unit, stage) in enumerate(pending):
                if available.issuperset(stage.inputs):
                    break
            else:
                raise ConveyorValueError("profile: the graph's units have no topological order (a bug)")
            unit, stage = pending.pop(k)
            available.update(stage.outputs)
            order.append((unit, stage))
        # A pass over every unit first, unmeasured: the first pass in a process measured the
        # backwards up to twice as slow as a whole step runs them (the allocator's and the
        # kernels' first uses), and unevenly, which skewed the cuts.
        value_names = {b["value"]: b["name"] for b in doc_in["bindings"] if b["kind"] != "constant"}
        reads = {tuple(unit): [bound[value_names[v]] for n in unit for v in node_value_inputs(graph.nodes[n])
                               if v in value_names] for unit in _units(graph)}
        warm = dict(values)
        for unit, stage in order:
            with units_made(reads[tuple(unit)], device) as made:
                act = stage.forward([_made_if_stand_in(warm[v]) for v in stage.inputs])
                warm.update(zip(stage.outputs, [o.detach().requires_grad_(o.requires_grad) if isinstance(o, torch.Tensor)
                                                else o for o in _stand_ins_for_views(act.outputs, made)]))
                grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                         for o in act.outputs]
                if any(g is not None for g in grads):
                    stage.backward(act, grads)
        del warm, act, grads
        timed: dict[str, dict] = {}  # a unit's measured figures by what it computes on (_unit_signature)
        device_peak = 0  # on a GPU: the most this process held there at once (each unit resets torch's peak)
        repeated = 0
        fixed = _FixedPart(microbatch)
        for unit, stage in order:
            with units_made(reads[tuple(unit)], device) as made:
                param_storages.update(t.untyped_storage().data_ptr() for t in made)
                stage_inputs = [_made_if_stand_in(values[v]) for v in stage.inputs]
                # Forward: the saved activations are counted once, then the time is measured.
                saved: dict[int, int] = {}
                saved_here: set[int] = set()

                def pack(t):
                    try:
                        ptr = t.untyped_storage().data_ptr()
                        if ptr not in param_storages:
                            saved[ptr] = max(saved.get(ptr, 0), t.untyped_storage().nbytes())
                            saved_here.add(ptr)
                    except (RuntimeError, NotImplementedError):
                        pass
                    return t

                if device.type == "cuda":
                    device_peak = max(device_peak, torch.cuda.max_memory_allocated(device))
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                # On the CPU the meter charges what the unit allocates from here on, and credits
                # what of it is freed: the backward's working memory is its peak over what the
                # forward left (the incoming gradients, every gradient it holds at once, less the
                # saved activations it has freed by then).
                meter = _C.HostMemoryMeter() if device.type != "cuda" else None
                with meter if meter is not None else contextlib.nullcontext(), \
                        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    act = stage.forward(stage_inputs)
                outputs = act.outputs
                for v, out in zip(stage.outputs, outputs):
                    values[v] = out
                    value_bytes[v] = _nbytes(out)
                selective.note_values(values, stage.outputs)
                # An output over a tensor made for this unit alone (a weight's transpose) is not
                # kept: the unit that reads it gets one made to its shape and dtype.
                values.update(zip(stage.outputs, _stand_ins_for_views([values[v] for v in stage.outputs], made)))
                # Kept as leaves: a kept output's graph would keep what the unit saved for its
                # backward (its weights) past the unit, and a unit measured once runs no backward.
                for v in stage.outputs:
                    if isinstance(values[v], torch.Tensor):
                        values[v] = values[v].detach().requires_grad_(values[v].requires_grad)
                # Storages made inside the unit (alive now, so no value's) are its own; a graph
                # value's storage is counted for one unit only (below).
                measured.append((unit, sum(b for ptr, b in saved.items() if ptr not in selective.value_storages),
                                 {ptr: b for ptr, b in saved.items() if ptr in selective.value_storages}, saved_here))
                first = unit[0]
                signature = _unit_signature(graph, unit, values)
                if signature in timed:  # a unit like one measured already (the next transformer layer's)
                    nodes[first].update(timed[signature])
                    fixed.add_again(signature)
                    repeated += 1
                    continue
                if meter is not None:
                    meter.reset_peak()
                    held = meter.live
                with meter if meter is not None else contextlib.nullcontext():
                    grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                             for o in outputs]
                    differentiable = any(g is not None for g in grads)
                    if differentiable:
                        stage.backward(act, grads)
                if device.type == "cuda":
                    work = torch.cuda.max_memory_allocated(device) - base
                elif _C.HostMemoryMeter.active():  # beyond its kept activations, what its backward holds at once
                    work = meter.peak - held
                else:  # the meter is off: the incoming gradients and the parameters' gradients
                    work = sum(_nbytes(o) for o in outputs) + sum(grad_bytes[n] for n in unit)
                fwd, bwd = [], []
                clock = _clock(device)
                for rep in range(warmup + repeats):
                    _sync(device)
                    t0 = clock()
                    a = stage.forward(stage_inputs)
                    _sync(device)
                    t1 = clock()
                    if differentiable:
                        stage.backward(a, [None if g is None else g for g in grads])
                        _sync(device)
                    t2 = clock()
                    if rep >= warmup:
                        fwd.append(t1 - t0)
                        bwd.append(t2 - t1)
                nodes[first]["forward_s"] = statistics.median(fwd)
                nodes[first]["backward_s"] = statistics.median(bwd) if differentiable else 0.0
                # The weight-gradient part of a split backward: about half for nodes that read
                # parameters (dW costs what dX costs for matmuls and convolutions), else none.
                if any(n in reads_param for n in unit):
                    nodes[first]["backward_weight_s"] = nodes[first]["backward_s"] / 2
                nodes[first]["work_bytes"] = float(max(work, 0))
                timed[signature] = {k: nodes[first][k] for k in ("forward_s", "backward_s", "backward_weight_s",
                                                                  "work_bytes")}
                fixed.measure(signature, stage, stage_inputs, differentiable, device, warmup, repeats,
                              nodes[first]["forward_s"] + nodes[first]["backward_s"])
        _count_saved_once(measured, reads_param, nodes, selective, saved_by)
        if device.type == "cuda":
            device_peak = max(device_peak, torch.cuda.max_memory_allocated(device))
        selective.finish(nodes, values, _selective_run_work(graph, selective.runs, values, device))
    finally:
        for n, t in bound.items():
            if n in saved_grads:
                t.grad = saved_grads[n]
        with torch.no_grad():
            for n, v in saved_buffers.items():
                bound[n].copy_(v)
            for t in released:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    doc = {
        "format": "conveyor.profile", "version": 1, "graph_hash": ghash, "device": name,
        "microbatch": int(microbatch), "torch": torch.__version__, "nodes": nodes,
        "value_bytes": [float(b) for b in value_bytes], "value_saved_by": saved_by,
        "units": len(order), "units_measured": len(order) - repeated, "peak_rss_bytes": _peak_rss_bytes(),
        "peak_device_bytes": device_peak if device.type == "cuda" else None,
        "fixed_fraction": fixed.fraction(),
    }
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)  # atomic: a concurrent reader never sees half a profile
    return doc


class _FixedPart:
    """The part of the operators' time that does not shrink with the samples they compute on
    (launching a kernel, reading a weight): each unit is timed again on a quarter of the
    microbatch, and the line through both times meets zero samples at its fixed part. Summed
    over the units, as a fraction of their time (the profile's "fixed_fraction"): the planner
    prices a replica's share s of a microbatch at time x (fixed + (1 - fixed) s) (on this
    machine's CPU an MLP's 2 samples ran at 68% of 16's time, which a price in proportion to
    the samples put at 1/8, and so planned 128 microbatches of 2 that ran 20 times slower)."""

    def __init__(self, microbatch: int):
        self.microbatch = int(microbatch)
        self.small = max(1, self.microbatch // 4)
        self.by_signature: dict[str, tuple[float, float]] = {}  # (fixed, whole) of units timed at both sizes
        self.fixed_s = self.whole_s = 0.0

    def measure(self, signature: str, stage, inputs: list, differentiable: bool, device, warmup: int,
                repeats: int, whole_s: float) -> None:
        """Times `stage` again on the first `small` samples of `inputs`; a unit that reads no
        batch-sized tensor, or that cannot run on fewer samples (a size fixed in the graph),
        is left out of the fraction."""
        if self.small >= self.microbatch:
            return
        sliced, cut = [], False
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == self.microbatch:
                t = t[:self.small].detach().requires_grad_(t.requires_grad)
                cut = True
            sliced.append(t)
        if not cut:
            return
        times = []
        clock = _clock(device)
        try:
            for rep in range(warmup + repeats):
                _sync(device)
                t0 = clock()
                a = stage.forward(sliced)
                if differentiable:
                    grads = [torch.ones_like(o) if isinstance(o, torch.Tensor) and o.requires_grad else None
                             for o in a.outputs]
                    if any(g is not None for g in grads):
                        stage.backward(a, grads)
                _sync(device)
                if rep >= warmup:
                    times.append(clock() - t0)
        except (RuntimeError, ValueError, IndexError):
            return  # a size fixed in the graph: this unit tells nothing of the fixed part
        small_s = statistics.median(times)
        b, s = self.microbatch, self.small
        intercept = (small_s * b - whole_s * s) / (b - s)
        self.by_signature[signature] = (min(max(intercept, 0.0), whole_s), whole_s)
        self.add_again(signature)

    def add_again(self, signature: str) -> None:
        if signature in self.by_signature:
            f, w = self.by_signature[signature]
            self.fixed_s += f
            self.whole_s += w

    def fraction(self) -> float:
        return round(self.fixed_s / self.whole_s, 4) if self.whole_s > 0 else 0.0


def _count_saved_once(measured: list, reads_param: set, nodes: list[dict], selective: SelectiveAccounting,
                      saved_by: list[int]) -> None:
    """Each unit's saved bytes: the storages made inside it, and the graph values it saves
    that count for it. A process holds a value two units save (a residual stream a norm and
    a sum both read) once: it counts for the first unit that reads parameters and saves it
    (a split backward keeps that unit's saved tensors until its W), else for the first.
    `saved_by[value]` becomes the first node of the unit it counts for (the value of lowest
    id where several share a storage), so that a stage sending it on holds it once."""
    owner: dict[int, int] = {}
    param = [any(n in reads_param for n in unit) for unit, _, _, _ in measured]
    for i, (_, _, on_values, _) in enumerate(measured):
        for ptr in on_values:
            j = owner.get(ptr)
            if j is None or (param[i] and not param[j]):
                owner[ptr] = i
    for i, (unit, inside, on_values, every) in enumerate(measured):
        own = {ptr: b for ptr, b in on_values.items() if owner[ptr] == i}
        for ptr in own:
            on_storage = selective.value_storages.get(ptr)
            if on_storage:
                saved_by[min(on_storage)] = unit[0]
        nodes[unit[0]]["saved_bytes"] = float(inside + sum(own.values()))
        selective.note_unit(unit, inside, own, kept_too=every)
