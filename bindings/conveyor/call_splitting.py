"""Whether conveyor.Module may split a model's calls along dim 0 of their inputs (into
microbatches and replicas). Not where the capture fixed the batch size, nor where dim 0 is
not the batch: a model whose dim 0 is something else, nn.Transformer's default [sequence,
batch, features] layout, would train on cut sequences without a word of warning. So before
splitting, the graph is read for operators that combine values across that dimension:

    attention whose keys run along it (scaled_dot_product_attention, a softmax over it),
    a convolution, pooling or cumulative sum along it,
    and any operator after which it is gone from a result that is not yet the loss
    (a mean over the sequence, a product summing over it), unless only sums, means and
    scaling by constants follow on the way to the loss (a loss that averages over the
    batch first), or the result is a statistic of the batch that reaches the loss combined
    only with other such statistics and constants (a mixture of experts' load-balancing
    loss: no weight of the model, no row and no other input meets it after the batch is
    gone, so each share computes it as gradient accumulation would).

A mixture of experts counts its rows per expert, a reduction over the batch, yet keeps each
row to itself: row_order.py proves that, or names what breaks it. A row's place in the call
read as data (arange over the batch, a slice of it, rows paired with rows) is
batch_positions.py's to find.

BatchNorm combines samples too, by design, and keeps its per-share statistics, of which a
split step warns (warn_of_statistics_per_share; docs/design.md, "Execution"). A recurrence
needs no rule: torch.export fixes the length an RNN runs along, so a time-major RNN's
capture fixes "the batch" (conveyor.Module runs its calls whole for that reason). What is found is a reason to run each call whole.
"""
from __future__ import annotations

import re
import warnings

import torch

from .errors import ConveyorValueError
from .document import node_value_inputs, operator_at
from .counted_targets import why_left_as_a_mean
from .batch_positions import position_problems
from .row_order import key_order_problems

__all__ = ["why_calls_stay_whole", "refuse_to_split", "warn_of_a_loss_split_changes", "warn_of_statistics_per_share",
           "where_samples_mix"]

_SOFTMAX = {"aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax"}
_CONVOLUTION = ("aten::convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::conv_transpose1d",
                "aten::conv_transpose2d", "aten::conv_transpose3d", "aten::_convolution")
_POOLING = re.compile(r"aten::(max_pool|avg_pool|adaptive_avg_pool|adaptive_max_pool|lp_pool)[123]d")
# Ops that read their tensor input for its dtype and device only.
_NEW = {"aten::new_zeros", "aten::new_ones", "aten::new_empty", "aten::new_full", "aten::new_empty_strided"}
# Ops through which a batch-free result may still reach the loss linearly.
_LINEAR = {"aten::sum", "aten::mean", "aten::neg", "aten::view", "aten::reshape", "aten::_unsafe_view",
           "aten::flatten", "aten::squeeze", "aten::unsqueeze", "aten::clone", "aten::alias", "aten::mul",
           "aten::div", "aten::add", "aten::sub", "aten::add_", "aten::sub_", "aten::mul_", "aten::div_",
           "aten::to", "aten::_to_copy"}


def where_samples_mix(document: dict) -> str | None:
    """The first operator of a graph document that combines values across the batch
    dimension, "aten::scaled_dot_product_attention (model.py:12) attends along dim 2 of
    its keys, which holds the batch", or None where every operator keeps samples apart."""
    batch = {s for s, role in document.get("symbols", {}).items() if role == "batch"}
    if not batch:
        return None
    values = document["values"]
    consumers: dict[int, list[dict]] = {}
    for node in document["nodes"]:
        for v in node_value_inputs(node):
            consumers.setdefault(v, []).append(node)
    loss = set(document.get("outputs", []))

    def shape(v: int) -> list:
        return values[v].get("shape", []) if values[v].get("kind") == "tensor" else []

    def holds_batch(size) -> bool:
        return isinstance(size, str) and bool(batch & set(re.findall(r"[A-Za-z_]\w*", size)))

    def batch_dims(v: int) -> list[int]:
        return [d for d, size in enumerate(shape(v)) if holds_batch(size)]

    def int_arg(node: dict, i: int, default: int | None = None) -> int | None:
        args = node["args"]
        return args[i]["int"] if i < len(args) and "int" in args[i] else default

    def reaches_loss_linearly(v: int, seen: set) -> bool:
        if v in loss or v in seen:
            return True
        seen.add(v)
        users = consumers.get(v, [])
        if not users:
            return False
        for node in users:
            if node["op"] not in _LINEAR:
                return False
            if node["op"].rstrip("_") in ("aten::mul", "aten::div", "aten::add", "aten::sub") and any(
                    u != v and values[u].get("kind") == "tensor" and shape(u) for u in node_value_inputs(node)):
                return False  # combined with another tensor: no longer a plain sum of samples
            outs = [r["value"] for r in node["returns"] if "value" in r]
            if not all(reaches_loss_linearly(o, seen) for o in outs):
                return False
        return True

    problems, counted, groups, proven = key_order_problems(document, batch_dims)
    batch |= groups  # a group's rows, split from the batch's by counts, are rows of the batch
    found = position_problems(document, batch, proven, lambda v: reaches_loss_linearly(v, set()))
    for nid, why in found.items():
        problems.setdefault(nid, why)
    statistics, constants = _statistics_and_constants(document, batch_dims)

    def a_loss_of_statistics(v: int, seen: set) -> bool:
        if v in loss or v in seen:
            return True
        seen.add(v)
        for node in consumers.get(v, []):
            outs = [r["value"] for r in node["returns"] if "value" in r and values[r["value"]].get("kind") == "tensor"]
            if any(batch_dims(o) for o in outs):
                return False  # back into rows: the rows would depend on each other
            if any(u not in statistics and u not in constants
                   for u in node_value_inputs(node) if values[u].get("kind") == "tensor"):
                return False  # meets a weight of the model or another input: a layer after a pooling
            if not all(a_loss_of_statistics(o, seen) for o in outs):
                return False
        return True

    for node in document["nodes"]:
        op = node["op"]
        if node["id"] in problems:
            return problems[node["id"]]
        if "batch_norm" in op or op in _NEW:
            continue
        ins = [v for v in node_value_inputs(node) if values[v].get("kind") == "tensor"]
        if not ins:
            continue
        first = ins[0]
        dims = batch_dims(first)
        if op == "aten::scaled_dot_product_attention" or op.startswith("aten::_scaled_dot_product"):
            key = ins[1] if len(ins) > 1 else first
            if len(shape(key)) >= 2 and len(shape(key)) - 2 in batch_dims(key):
                return f"{operator_at(node)} attends along dim {len(shape(key)) - 2} of its keys, which holds the batch"
            continue
        if op in _SOFTMAX:
            d = int_arg(node, 1, -1)
            d = d + len(shape(first)) if d is not None and d < 0 else d
            if d in dims:
                return f"{operator_at(node)} normalizes along dim {d}, which holds the batch"
            continue
        if op.startswith(_CONVOLUTION) or _POOLING.match(op):
            spatial = [d for d in dims if d >= 2]
            if spatial:
                return f"{operator_at(node)} slides along dim {spatial[0]} of its input, which holds the batch"
            continue
        if op == "aten::cumsum" or op == "aten::cumprod":
            d = int_arg(node, 1, 0)
            d = d + len(shape(first)) if d < 0 else d
            if d in dims:
                return f"{operator_at(node)} accumulates along dim {d}, which holds the batch"
            continue
        if op in ("aten::roll", "aten::flip"):
            along = node["args"][2 if op == "aten::roll" else 1].get("list", [])
            moved = [a["int"] + len(shape(first)) if a["int"] < 0 else a["int"] for a in along if "int" in a]
            if dims and (not moved or set(moved) & set(dims)):
                return f"{operator_at(node)} moves values along dim {dims[0]}, which holds the batch"
            continue
        if not any(batch_dims(v) for v in ins):
            continue
        outs = [r["value"] for r in node["returns"] if "value" in r and values[r["value"]].get("kind") == "tensor"]
        lost = [o for o in outs if not batch_dims(o)]  # a statistic of the batch (a scalar too)
        if lost and outs and not any(batch_dims(o) for o in outs):
            if all(o in counted for o in lost):
                continue  # rows per group, as offsets of a product over the rows in that order
            if all(reaches_loss_linearly(o, set()) for o in lost):
                continue  # a loss that sums or averages over the batch first
            if all(a_loss_of_statistics(o, set()) for o in lost):
                continue  # a loss term of batch statistics, per share as gradient accumulation has it
            return (f"{operator_at(node)} leaves no batch dimension in its result of shape {shape(lost[0])}, which the "
                    "rows then use")
    return None


def _statistics_and_constants(document: dict, batch_dims) -> tuple[set[int], set[int]]:
    """The batch-free tensors of a graph document computed from the batch through reductions
    over it and from constants alone (statistics of the batch), and those computed from
    constants alone (zeros, a constant arange). A parameter, a buffer or an input is neither."""
    values = document["values"]
    statistics: set[int] = set()
    constants: set[int] = set()
    for node in document["nodes"]:
        ins = [v for v in node_value_inputs(node) if values[v].get("kind") == "tensor"]
        outs = [r["value"] for r in node["returns"] if "value" in r and values[r["value"]].get("kind") == "tensor"]
        free = [o for o in outs if not batch_dims(o)]
        if any(batch_dims(v) for v in ins):
            statistics.update(free)
        elif all(v in constants for v in ins):
            constants.update(free)
        elif all(v in constants or v in statistics for v in ins):
            statistics.update(free)
    return statistics, constants


def why_calls_stay_whole(model: torch.nn.Module, graph, batch: int) -> str | None:
    """Why a call of `graph` cannot be split along dim 0 of its inputs (into microbatches or
    replicas), or None: the capture fixed the batch size, or the model combines values
    across that dimension, so it is not the batch (a time-major model). Such a call runs
    whole, in one microbatch on one replica per stage."""
    name = type(model).__name__
    if not graph.dynamic_batch:
        return (f"{name} fixes its batch size (captured for {batch} samples; capture's warning says which size "
                "ties it): to split calls, let dim 0 of every input be the batch (batch_first=True for nn.LSTM, "
                "nn.GRU and nn.RNN; a target not flattened) and nothing check its size (chunk(2), topk of half "
                "the batch)")
    mixing = where_samples_mix(graph.document)
    if mixing is None:
        return None
    why = (f"{name} combines values across dim 0 of its inputs, which splitting would cut: {mixing}. To split "
           "calls, put the batch first in every input (batch_first=True for nn.Transformer layers and "
           "nn.MultiheadAttention) and let each sample's result depend on that sample alone (what a row needs of "
           "its place or of the batch, pass as an input); where the samples are meant to meet (in-batch "
           "negatives), the call runs whole")
    warnings.warn(f"conveyor: {why}; until then each call runs whole (one microbatch, one replica per stage)",
                  stacklevel=5)
    return why


def refuse_to_split(why: str, microbatches: int | None, replicas, fixed_by: str = "") -> None:
    """A call that cannot be split (`why`) takes one microbatch and one replica per stage;
    `microbatches` and `replicas` (an int, or a list per rank) asked for more are refused."""
    most = max(replicas) if isinstance(replicas, list) else replicas or 1
    asked = [f"microbatches={microbatches}"] if (microbatches or 1) > 1 else []
    asked += [f"replicas={replicas}"] if most > 1 else []
    if asked:
        raise ConveyorValueError(f"{fixed_by or ' and '.join(asked)} would split each call along dim 0 of its "
                                 f"inputs, but {why}. It runs whole with microbatches=1 and one replica per stage")


# Batch normalizations by their `training` argument: in training mode each normalizes by the
# statistics of its input over every dim but the channels (dim 1).
_BATCH_STATISTICS = {"aten::batch_norm": 5, "aten::native_batch_norm": 5, "aten::_native_batch_norm_legit": 5,
                     "aten::cudnn_batch_norm": 5}


def warn_of_statistics_per_share(document: dict, microbatches: int, replicas: list) -> None:
    """Warns where a split step runs a batch norm in training mode whose statistics cover a
    dimension holding the batch (a CNN's BatchNorm2d, a BatchNorm1d over the tokens of an
    expert block): each share normalizes by its own samples' mean and variance, as gradient
    accumulation over the same shares would, not by the whole batch's."""
    if not (microbatches > 1 or max(replicas) > 1):
        return
    batch = {s for s, role in document.get("symbols", {}).items() if role == "batch"}
    values = document["values"]
    found = []
    for node in document["nodes"]:
        training = _BATCH_STATISTICS.get(node["op"])
        args = node["args"]
        if training is None or len(args) <= training or args[training].get("bool") is not True:
            continue
        shape = values[args[0]["value"]].get("shape", []) if "value" in args[0] else []
        held = [d for d, size in enumerate(shape) if d != 1 and isinstance(size, str)
                and batch & set(re.findall(r"[A-Za-z_]\w*", size))]
        if held:
            found.append((node, held[0]))
    if found:
        node, dim = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        split = ([f"{microbatches} microbatches"] if microbatches > 1 else []) + \
                ([f"{max(replicas)} replicas of a stage"] if max(replicas) > 1 else [])
        warnings.warn(f"conveyor: {operator_at(node)}{more}" +
                      f" normalizes in training mode by statistics over dim {dim} of its input, which holds the "
                      f"batch: each share the step splits it into ({' and '.join(split)}) normalizes by its own "
                      "samples' mean and variance, as gradient accumulation over the same shares would, not by the "
                      "whole batch's. For the whole batch's statistics run each call whole (microbatches=1, "
                      "replicas=1), or normalize per sample (LayerNorm, GroupNorm)", stacklevel=5)


def warn_of_a_loss_split_changes(step, microbatches: int, replicas: list, document: dict) -> None:
    """Warns where `step` splits calls and its loss is neither a mean nor a sum over the
    samples (runtime/loss_reduction.h): the shares' losses are then weighed as a mean's, as
    gradient accumulation weighs microbatches, which is not the whole batch's loss. Where a
    mean over counted targets was left as it was because the loss would still be no sum
    (`document`'s, counted_targets.why_left_as_a_mean), the warning names what stops it."""
    how, why = step.loss_reduction
    if how == "other" and (microbatches > 1 or max(replicas) > 1):
        stopped = why_left_as_a_mean(document) if "averages over the targets it counts" in why else None
        if stopped:
            why = (f"{stopped}; so {why.split(' averages over the targets it counts')[0]}, which averages over "
                   "the targets it counts, is left a mean of each share's own count: made one over the call's "
                   "count, the loss would still be no sum over the samples")
        warnings.warn(f"conveyor: the loss is neither a mean nor a sum over the samples ({why}): each of the "
                      f"{microbatches} microbatches' shares weighs its part of the batch, as gradient accumulation "
                      "would, which differs from the loss of the whole batch at once; compute the loss as a mean "
                      "or a sum over the samples to train exactly as on one device", stacklevel=5)
