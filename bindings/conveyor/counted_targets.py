"""A loss averaged over the targets it counts, made a sum over the batch's samples.

torch's cross_entropy and nll_loss with reduction="mean" divide by the targets they count:
those other than `ignore_index` (-100 by default: the padding of a causal LM's labels, the
unmasked tokens of masked language modelling), each counting its class's weight where
`weight=` is given. A share of the batch (a microbatch, a replica's part) counts its own, so
weighing the shares' means by their samples, as a mean over the samples is weighed, is not
the batch's loss wherever shares count different numbers of targets.

So capture rewrites such a loss as its sum over the targets divided by a new input of the
graph, the whole call's count (`counted_targets_<k>`). The targets are computed from the
inputs, buffers and constants alone (labels padded, shifted, flattened, mapped through a
table), and the class weights from the model's tensors alone, so every call counts before the
step (Graph.flatten_inputs appends the counts, running the nodes that make the targets and
weights on the whole call); each share then adds its part sum/count, and the shares add up
to the batch's loss exactly, as transformers' Trainer does with `num_items_in_batch`.

Where that cannot be (a target made from the model's activations, a random draw, or a loss
that would then add a sum to a mean, such as a mixture of experts' load balancing), the loss
is left as it was, and the batch analysis reads it as neither a mean nor a sum
(runtime/loss_reduction.cc): shares weigh their samples, and a split step warns so, naming
the operator that kept it a mean (why_left_as_a_mean: the add that joins the other term).

A graph document names only the count inputs (extra "counted_targets"); which loss each
divides, its targets, ignore_index and weights are read from the graph (`counted_losses`).
"""
from __future__ import annotations

import copy
import json

import torch

from . import _C
from .document import node_value_inputs, operator_at

# Loss operators whose mean divides by the targets counted: argument positions of the
# target, the class weights, the reduction (1 mean, 2 sum) and ignore_index.
_COUNTING_LOSSES = {
    "aten::nll_loss": (1, 2, 3, 4), "aten::nll_loss_nd": (1, 2, 3, 4), "aten::nll_loss2d": (1, 2, 3, 4),
    "aten::cross_entropy_loss": (1, 2, 3, 4),
}
_MEAN, _SUM = 1, 2
_INTEGER_DTYPES = {"int64", "int32", "int16", "int8", "uint8"}


def with_counted_means_summed(doc: dict) -> tuple[dict, list[int]]:
    """`doc` (a graph document, docs/formats.md) with each counting loss taken as a mean
    rewritten as a sum divided by a new input, the call's count of its targets, where the
    targets and weights can be counted before the step and that makes the graph's loss a sum
    over the samples (or the graph returns more than a scalar loss, and runs whole); else
    `doc` itself. Also the new inputs' value ids (the document's extra
    "counted_targets")."""
    rewritten, inputs, found = _rewritten(doc)
    if not inputs or (found is not None and found[0] != "sum"):
        return doc, []
    return rewritten, inputs  # (a graph returning more than a loss runs whole: the call's count is exact)


def why_left_as_a_mean(doc: dict) -> str | None:
    """Where `doc` holds a counting loss taken as a mean whose targets and weights could be
    counted, but the rewrite was not made because the loss would still be no sum over the
    samples (a mixture of experts' router loss, a mean, added to it): the operator that
    stops it, as the batch analysis names it ("aten::add (modeling.py:12) adds a sum over the
    samples to a mean over them"); else None."""
    rewritten, inputs, found = _rewritten(doc)
    if not inputs or found is None or found[0] != "other" or not found[1]:
        return None
    joined = _where_a_term_joins(rewritten)
    if joined is None or found[1].startswith(joined):
        return found[1]
    return f"{joined} adds to it a term that is no sum over the samples ({found[1]})"


_ADDS = {"aten::add", "aten::add_", "aten::sub", "aten::sub_"}


def _where_a_term_joins(doc: dict) -> str | None:
    """The add or subtract on the way from the graph's loss back to its counting losses where
    a term made without them joins (a mixture of experts' `loss += coef * aux_loss`), named as
    the batch analysis names operators; None where there is none."""
    made_by = _made_by(doc)
    from_loss: set[int] = set()
    for node in doc["nodes"]:
        if node["op"] in _COUNTING_LOSSES or any(v in from_loss for v in node_value_inputs(node)):
            from_loss.update(r["value"] for r in node["returns"] if "value" in r)
    value = doc["outputs"][0] if len(doc.get("outputs", [])) == 1 else None
    while value is not None and value in from_loss:
        node = made_by[value]
        if node["op"] in _COUNTING_LOSSES:
            return None
        ins = [v for v in node_value_inputs(node) if v in from_loss]
        if node["op"] in _ADDS and len(ins) == 1 and len(node_value_inputs(node)) == 2:
            return operator_at(node)
        value = ins[0] if len(ins) == 1 else None
    return None


def _rewritten(doc: dict) -> tuple[dict, list[int], tuple | None]:
    """`doc` rewritten (a copy), its count inputs (none: nothing to count, and `doc` itself),
    and how its loss then combines the samples (GraphIR.loss_reduction)."""
    if not any(node["op"] in _COUNTING_LOSSES for node in doc["nodes"]):
        return doc, [], None
    rewritten = copy.deepcopy(doc)
    inputs = _make_counted_means_sums(rewritten)
    if not inputs:
        return doc, [], None
    return rewritten, inputs, _C.GraphIR(json.dumps(rewritten)).loss_reduction()


def _make_counted_means_sums(doc: dict) -> list[int]:
    """The rewrite with_counted_means_summed describes, in place, whatever it makes of the loss."""
    values, nodes = doc["values"], doc["nodes"]
    bound = {b["value"]: b for b in doc["bindings"]}
    made_by = _made_by(doc)
    inputs = {i["value"] for i in doc["inputs"]}
    chosen: list[dict] = []
    for node in nodes:
        positions = _COUNTING_LOSSES.get(node["op"])
        if positions is None:
            continue
        target, _, reduction, ignore = (node["args"][k] for k in positions)
        if (reduction.get("int") != _MEAN or "value" not in target or "int" not in ignore
                or len(node["returns"]) != 1 or "value" not in node["returns"][0]
                or values[target["value"]].get("dtype") not in _INTEGER_DTYPES):
            continue  # class probabilities: a mean over the samples
        if _countable(node, made_by, bound, inputs):
            chosen.append(node)
    counts = []
    for k, node in enumerate(chosen):
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
        counts.append(count)
    for i, node in enumerate(nodes):
        node["id"] = i
    return counts


def counted_losses(doc: dict, counts: list) -> list[dict]:
    """What each count input of `doc` counts, read from the graph: {"input", "target",
    "ignore_index", "weight" (a value id or None), "dtype"}. Raises ValueError naming what
    does not hold: an input that is not among the graph's last, or not the divisor of a
    counting loss's sum whose targets and weights can be counted before the step."""
    if not isinstance(counts, list) or not all(type(c) is int for c in counts):
        raise ValueError(f"is {counts!r:.80}, not a list of value ids")
    last = [i["value"] for i in doc["inputs"]][len(doc["inputs"]) - len(counts):]
    if counts != last or len(set(counts)) != len(counts):
        raise ValueError(f"names {counts!r:.40}, not the graph's last {len(counts)} inputs")
    values = doc["values"]
    bound = {b["value"]: b for b in doc["bindings"]}
    made_by = _made_by(doc)
    inputs = {i["value"] for i in doc["inputs"]} - set(counts)
    divisions = {node["args"][1]["value"]: node for node in doc["nodes"] if node["op"] == "aten::div"
                 and len(node["args"]) == 2 and all("value" in a for a in node["args"])}
    out = []
    for count in counts:
        divide = divisions.get(count)
        loss = made_by.get(divide["args"][0]["value"]) if divide is not None else None
        positions = _COUNTING_LOSSES.get(loss["op"]) if loss is not None else None
        if positions is None:
            raise ValueError(f"input {count} divides no counting loss's sum")
        target, weight, reduction, ignore = (loss["args"][k] for k in positions)
        if (reduction.get("int") != _SUM or "value" not in target or type(ignore.get("int")) is not int
                or not _countable(loss, made_by, bound, inputs)):
            raise ValueError(f"input {count} divides {loss['op']}, whose targets conveyor cannot count before the "
                             "step")
        out.append({"input": count, "target": target["value"], "ignore_index": ignore["int"],
                    "weight": weight.get("value"), "dtype": values[count].get("dtype")})
    return out


def _countable(loss: dict, made_by: dict[int, dict], bound: dict[int, dict], inputs: set[int]) -> bool:
    """Whether a counting loss's targets and class weights can be counted before the step:
    the targets from the inputs, buffers and constants, the weights from the model's tensors."""
    target, weight = (loss["args"][k] for k in _COUNTING_LOSSES[loss["op"]][:2])
    if _ancestors(target["value"], made_by, bound, inputs, parameters=False) is None:
        return False
    return "value" not in weight or _ancestors(weight["value"], made_by, bound, inputs, parameters=True,
                                               batch=False) is not None


def _made_by(doc: dict) -> dict[int, dict]:
    return {r["value"]: node for node in doc["nodes"] for r in node["returns"] if "value" in r}


def _ancestors(value: int, made_by: dict[int, dict], bound: dict[int, dict], inputs: set[int], *,
               parameters: bool, batch: bool = True) -> list[dict] | None:
    """The nodes `value` is computed by, in no order, or None where it cannot be computed
    apart from the step: one of them draws random numbers (the step would draw others), or
    reads a parameter (unless `parameters`: a target of the model's own making) or a graph
    input (unless `batch`: class weights made from the batch differ from share to share)."""
    seen: set[int] = set()
    out: dict[int, dict] = {}
    todo = [value]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in bound:
            if bound[v]["kind"] == "parameter" and not parameters:
                return None
            continue
        if v in inputs:
            if not batch:
                return None
            continue
        node = made_by.get(v)
        if node is None or node.get("random"):
            return None
        out[id(node)] = node
        todo.extend(node_value_inputs(node))
    return list(out.values())


def counting_document(doc: dict, entries: list[dict]) -> dict:
    """A graph document computing, from the user's inputs and the model's tensors, what
    `entries` count: per entry its targets, then its weights where it has them (its outputs, in
    that order), by the nodes the graph makes them with, in the graph's order."""
    made_by = _made_by(doc)
    outputs = [v for e in entries for v in ([e["target"]] + ([e["weight"]] if e["weight"] is not None else []))]
    wanted: dict[int, dict] = {}
    todo = list(outputs)
    while todo:
        node = made_by.get(todo.pop())
        if node is not None and id(node) not in wanted:
            wanted[id(node)] = node
            todo.extend(node_value_inputs(node))
    counts = {e["input"] for e in entries}
    nodes = [dict(n) for n in doc["nodes"] if id(n) in wanted]
    for i, node in enumerate(nodes):
        node["id"] = i
    read = {v for n in nodes for v in node_value_inputs(n)} | set(outputs)
    return {**{k: v for k, v in doc.items() if k != "extra"},
            "inputs": [i for i in doc["inputs"] if i["value"] not in counts],
            "bindings": [b for b in doc["bindings"] if b["value"] in read],
            "nodes": nodes, "outputs": outputs}


def count_targets(made: list[torch.Tensor], entries: list[dict]) -> list[torch.Tensor]:
    """Each entry's count (a 0-dim tensor of its loss's dtype) from what counting_document's
    graph made: the targets other than ignore_index, each its class's weight where the loss
    has weights."""
    out = []
    made = list(made)
    for entry in entries:
        t = made.pop(0)
        kept = t != entry["ignore_index"]
        if entry["weight"] is None:
            n = kept.sum()
        else:
            w = made.pop(0).detach()
            n = (w.to(t.device)[t.masked_fill(~kept, 0)] * kept).sum()
        out.append(n.to(getattr(torch, entry["dtype"])))
    return out
