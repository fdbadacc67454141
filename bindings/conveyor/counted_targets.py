"""A loss averaged over the targets it counts, made a sum over the batch's samples.

torch's cross_entropy and nll_loss with reduction="mean" divide by the targets they count:
those other than `ignore_index` (-100 by default: the padding of a causal LM's labels, the
unmasked tokens of masked language modelling), each counting its class's weight where
`weight=` is given. A share of the batch (a microbatch, a replica's part) counts its own, so
weighing the shares' means by their samples, as a mean over the samples is weighed, is not
the batch's loss wherever shares count different numbers of targets.

So capture rewrites such a loss as its sum over the targets divided by a new input of the
graph, the whole call's count (`counted_targets_<k>`). The target is computed from the
inputs alone (labels padded, shifted and flattened), so every call counts it before the step
from its inputs (Graph.flatten_inputs appends the counts); each share then adds its part
sum/count, and the shares add up to the batch's loss exactly, as transformers' Trainer
does with `num_items_in_batch`. A loss whose target depends on the model's parameters or
activations is left a mean, weighed as before.
"""
from __future__ import annotations

import copy
import json

import torch

from . import _C
from .document import node_value_inputs

# Loss operators whose mean divides by the targets counted: argument positions of the
# target, the class weights, the reduction (1 mean, 2 sum) and ignore_index.
_COUNTING_LOSSES = {
    "aten::nll_loss": (1, 2, 3, 4), "aten::nll_loss_nd": (1, 2, 3, 4), "aten::nll_loss2d": (1, 2, 3, 4),
    "aten::cross_entropy_loss": (1, 2, 3, 4),
}
_MEAN, _SUM = 1, 2
_INTEGER_DTYPES = {"int64", "int32", "int16", "int8", "uint8"}


def with_counted_means_summed(doc: dict) -> tuple[dict, list[dict]]:
    """`doc` (a graph document, docs/formats.md) with each counting loss taken as a mean whose
    target comes from the inputs alone rewritten as a sum divided by a new input, the call's
    count of that target, where that makes the graph's loss a sum over the samples; else
    `doc` itself (a loss that also adds a term of its own kind, such as a mixture of experts'
    load balancing, stays weighed as a mean, with the warning call_splitting gives). Also one
    entry per new input, for the document's extra "counted_targets": {"input", "target",
    "ignore_index", "weight"} (a binding's name or None)."""
    if not any(node["op"] in _COUNTING_LOSSES for node in doc["nodes"]):
        return doc, []
    rewritten = copy.deepcopy(doc)
    entries = _make_counted_means_sums(rewritten)
    if not entries:
        return doc, []
    found = _C.GraphIR(json.dumps(rewritten)).loss_reduction()
    if found is None or found[0] != "sum":
        return doc, []
    return rewritten, entries


def _make_counted_means_sums(doc: dict) -> list[dict]:
    """The rewrite with_counted_means_summed describes, in place, whatever it makes of the loss."""
    values, nodes = doc["values"], doc["nodes"]
    bound = {b["value"]: b for b in doc["bindings"]}
    made_by: dict[int, dict] = {}
    for node in nodes:
        for r in node["returns"]:
            if "value" in r:
                made_by[r["value"]] = node
    entries: list[dict] = []
    rewritten: list[dict] = []
    for node in nodes:
        positions = _COUNTING_LOSSES.get(node["op"])
        if positions is None:
            continue
        target, weight, reduction, ignore = positions
        args = node["args"]
        if (args[reduction].get("int") != _MEAN or "value" not in args[target] or "int" not in args[ignore]
                or len(node["returns"]) != 1 or "value" not in node["returns"][0]):
            continue
        target_id = args[target]["value"]
        if values[target_id].get("dtype") not in _INTEGER_DTYPES:
            continue  # class probabilities: a mean over the samples
        weight_name = None
        if "value" in args[weight]:
            binding = bound.get(args[weight]["value"])
            if binding is None:
                continue  # weights computed by the model: counted only where they are
            weight_name = binding["name"]
        if _ancestors(target_id, made_by, bound) is None:
            continue
        rewritten.append(node)
        entries.append({"target": target_id, "ignore_index": args[ignore]["int"], "weight": weight_name})
    for k, (node, entry) in enumerate(zip(rewritten, entries)):
        loss = node["returns"][0]["value"]
        total = len(values)
        values.append({**values[loss], "id": total, "name": f"{values[loss].get('name', 'loss')}_sum"})
        count = len(values)
        values.append({"id": count, "kind": "tensor", "dtype": values[loss]["dtype"], "shape": [],
                       "name": f"counted_targets_{k}"})
        doc["inputs"].append({"value": count, "name": f"counted_targets_{k}"})
        node["args"][_COUNTING_LOSSES[node["op"]][2]] = {"int": _SUM}
        node["returns"][0] = {"value": total}
        divide = {"op": "aten::div", "overload": "Tensor", "args": [{"value": total}, {"value": count}],
                  "returns": [{"value": loss}]}
        for key in ("source", "grad_enabled"):
            if key in node:
                divide[key] = node[key]
        nodes.insert(next(i for i, n in enumerate(nodes) if n is node) + 1, divide)
        entry["input"] = count
    for i, node in enumerate(nodes):
        node["id"] = i
    return entries


def _ancestors(value: int, made_by: dict[int, dict], bound: dict[int, dict]) -> list[dict] | None:
    """The nodes `value` is computed by, in no order, or None where one of them reads a
    parameter or buffer (a target of the model's own making) or draws random numbers (a
    masking the model draws: counted apart from the step, it would draw other numbers)."""
    seen: set[int] = set()
    out: dict[int, dict] = {}
    todo = [value]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in bound:
            if bound[v]["kind"] != "constant":
                return None
            continue
        node = made_by.get(v)
        if node is None:
            continue  # an input
        if node.get("random"):
            return None
        out[id(node)] = node
        todo.extend(node_value_inputs(node))
    return list(out.values())


def targets_document(doc: dict, entries: list[dict]) -> dict:
    """A graph document computing, from the user's inputs alone, the targets `entries` count
    (its outputs, in order): the nodes they are computed by, in the graph's order."""
    bound = {b["value"]: b for b in doc["bindings"]}
    made_by = {r["value"]: node for node in doc["nodes"] for r in node["returns"] if "value" in r}
    wanted: set[int] = set()
    for entry in entries:
        wanted.update(id(n) for n in _ancestors(entry["target"], made_by, bound) or [])
    counted = {entry["input"] for entry in entries}
    nodes = [dict(n) for n in doc["nodes"] if id(n) in wanted]
    for i, node in enumerate(nodes):
        node["id"] = i
    read = {v for n in nodes for v in node_value_inputs(n)}
    return {**{k: v for k, v in doc.items() if k != "extra"},
            "inputs": [i for i in doc["inputs"] if i["value"] not in counted],
            "bindings": [b for b in doc["bindings"] if b["value"] in read],
            "nodes": nodes, "outputs": [entry["target"] for entry in entries]}


def count_targets(targets: list[torch.Tensor], entries: list[dict], tensors: dict[str, torch.Tensor],
                  dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Each entry's count of its target (a 0-dim tensor of the loss's dtype): the targets
    other than ignore_index, each weighing its class's weight where the loss has weights."""
    out = []
    for t, entry, dtype in zip(targets, entries, dtypes):
        kept = t != entry["ignore_index"]
        if entry["weight"] is None:
            n = kept.sum()
        else:
            w = tensors[entry["weight"]].detach()
            n = (w.to(t.device)[t.masked_fill(~kept, 0)] * kept).sum()
        out.append(n.to(dtype))
    return out
