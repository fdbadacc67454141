"""Where a model reads a row's place in the call, or the call's size, which splitting
changes: a share numbers its rows from 0, holds only its own and is smaller than the call,
so whatever depends on where a row sits among the others, on which other rows there are or
on how many differs from the whole batch's, silently. Found:

    positions read as data: arange over the batch compared with a capacity (tokens dropped
        by their place), looked up in a table (an embedding of the row's index), or used in
        arithmetic; a permutation of the rows drawn with randperm (mixup) used at all;
    rows taken by their place: a slice, narrow, select, split or chunk along the batch that
        is not all of it (each row minus the one before, the first half against the second);
    rows taken by indices: a gather, index_select, index or index_add along the batch by
        indices other than the rows' own (a label used as a row index, a bootstrap draw);
    rows paired with rows: a result holding the batch along two dimensions (z @ z.T, a
        similarity of every sample with every other);
    the call's size read as data: the batch size (a sym_size of a dimension holding it) in
        arithmetic on rows (h * B / 8), but as the divisor of a sum on its way to the loss
        (a mean) or as a size. A statistic or the loss scaled by it (a loss over B ** 2) is
        the loss analysis's (runtime/loss_reduction.cc), which warns of what is no mean.

Positions that stay positions are fine: arange(batch) as the index of the dimension it
counts (x[arange(B), y] picks each row's own target) refers each row to itself in any
share, and rows moved in a sort's order and back are row_order.py's to prove. Anything else
is reported, the sound side of a heuristic: such a call runs whole rather than split wrong.
"""
from __future__ import annotations

import re
from typing import Callable

from .document import node_value_inputs, operator_at
from .row_order import SHAPE_ONLY, counts_from_zero

__all__ = ["position_problems"]

# Ops through which positions stay the same numbers in the same places.
_SAME = {"aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::alias", "aten::detach",
         "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::flatten", "aten::squeeze", "aten::unsqueeze",
         "aten::expand", "aten::expand_as", "aten::lift_fresh_copy"}
# Ops indexing `self` (argument 0) along the dim in argument 1 by the index in argument 2.
_INDEX_ALONG = {"aten::index_select", "aten::gather", "aten::index_add", "aten::index_add_", "aten::index_copy",
                "aten::index_copy_", "aten::index_fill", "aten::index_fill_", "aten::scatter", "aten::scatter_",
                "aten::scatter_add", "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_"}
# Ops indexing `self` by a list of indices, the k-th along dim k.
_INDEX_LIST = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_unsafe_index"}
# Ops indexing `self` (argument 0) along a dim by an index elsewhere: (the dim's argument, or
# a dim itself as -1 - dim, the index's argument).
_INDEX_BY = {"aten::take_along_dim": (2, 1), "aten::embedding": (-1, 1)}
# Ops that read a number as a size, an index or a check, never as data.
_READS_SIZES = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::expand", "aten::new_zeros",
                "aten::new_ones", "aten::new_empty", "aten::new_full", "aten::new_empty_strided", "aten::zeros",
                "aten::ones", "aten::empty", "aten::full", "aten::rand", "aten::randn", "aten::randint",
                "aten::empty_strided", "aten::arange", "aten::randperm", "aten::slice", "aten::narrow",
                "aten::split", "aten::split_with_sizes", "aten::repeat", "aten::unflatten", "aten::select",
                "aten::sym_size", "aten::sym_numel", "aten::sym_stride", "aten::_assert_tensor_metadata",
                "aten::sym_constrain_range_for_size", "aten::_assert_scalar", "aten::sym_constrain_range",
                "aten::linspace", "aten::eye", "aten::tensor_split", "aten::chunk", "conveyor::guard"}
# Ops taking part of a dimension: (the dim's argument, or None for dim 0 unless named otherwise).
_TAKES_PART = {"aten::narrow": 1, "aten::select": 1, "aten::split": 2, "aten::chunk": 2, "aten::unbind": 1,
               "aten::tensor_split": 2, "aten::unsafe_split": 2, "aten::unsafe_chunk": 2}
_INT_MAX = 2 ** 62


def position_problems(document: dict, batch_symbols: set[str], proven: set[int],
                      linear_to_loss: Callable[[int], bool]) -> dict[int, str]:
    """Per node id of a graph document, how the node reads a row's place in the call, other
    rows or the call's size ("aten::lt (model.py:12) reads as data the rows' positions that
    aten::arange (model.py:12) numbers ..."). `batch_symbols`: the symbolic sizes that are the
    batch's; `proven`: indexing nodes row_order.py proved keep rows apart (rows in a sort's
    order and back); `linear_to_loss(v)`: whether value v reaches the loss through sums,
    means and scaling alone."""
    values = document["values"]
    made_by = {r["value"]: node for node in document["nodes"] for r in node["returns"] if "value" in r}

    def shape(v) -> list:
        return values[v].get("shape", []) if v is not None and values[v].get("kind") == "tensor" else []

    def holds_batch(size) -> bool:
        return isinstance(size, str) and bool(batch_symbols & set(re.findall(r"[A-Za-z_]\w*", size)))

    def batch_dims(v) -> list[int]:
        return [d for d, size in enumerate(shape(v)) if holds_batch(size)]

    def own_rows(v: int, size) -> bool:
        """Whether index v counts 0, 1, 2, ... along a dimension of `size`: each row itself."""
        numbered = positions.get(v)
        return numbered is not None and numbered[1] and {d for d in shape(v) if isinstance(d, str)} == {size}

    def made_at(v: int) -> str:
        return operator_at(made_by[v]) if v in made_by else "an input of the graph"

    problems: dict[int, str] = {}
    positions: dict[int, tuple[dict, bool]] = {}  # value -> (the node numbering it, counts 0, 1, 2, ... in place)
    sizes: dict[int, bool] = {}  # numbers made from the batch size -> whether the size itself
    for node in document["nodes"]:
        op, args, nid = node["op"], node["args"], node["id"]
        outs = [r["value"] for r in node["returns"] if "value" in r and values[r["value"]].get("kind") == "tensor"]
        first = args[0].get("value") if args else None
        numbers = [v for v in node_value_inputs(node) if v in sizes]
        if op == "aten::sym_size" and len(args) > 1 and "int" in args[1]:
            dim = args[1]["int"] + len(shape(first)) if args[1]["int"] < 0 else args[1]["int"]
            if dim in batch_dims(first):
                sizes.update((r["value"], True) for r in node["returns"] if "value" in r)
            continue
        if numbers and op == "conveyor::sym":
            sizes.update((r["value"], False) for r in node["returns"] if "value" in r)
            continue
        # Rows scaled by the size (a statistic or the loss so scaled is the loss analysis's:
        # runtime/loss_reduction.cc tells a mean from a loss over B ** 2, and warns of it).
        if numbers and op not in _READS_SIZES and any(batch_dims(v) for v in node_value_inputs(node)):
            divisor = args[1].get("value") if op == "aten::div" and len(args) > 1 else None
            mean = numbers == [divisor] and sizes[divisor] and all(linear_to_loss(o) for o in outs)
            if not mean:
                problems[nid] = (f"{operator_at(node)} reads as data how many samples the call holds, and a share "
                                 "holds fewer")
                continue
        uses = _index_uses(node, len(shape(first)))
        taken = [(d, v) for d, v in uses
                 if d in batch_dims(first) and not own_rows(v, shape(first)[d])
                 and values[v].get("dtype") not in ("bool", "uint8")]
        if taken and nid not in proven:
            d, v = taken[0]
            problems[nid] = (f"{operator_at(node)} takes rows of the call along dim {d} by indices from {made_at(v)}, "
                             "and a share holds only its own rows")
            continue
        if op in ("aten::arange", "aten::randperm") and any(batch_dims(o) for o in outs):
            identity = op == "aten::arange" and counts_from_zero(node)
            positions.update((o, (node, identity)) for o in outs)
            continue
        paired = next((o for o in outs if len(batch_dims(o)) > 1), None)
        if paired is not None:
            dims = batch_dims(paired)
            problems[nid] = (f"{operator_at(node)} pairs the rows with one another: its result of shape "
                             f"{shape(paired)} holds the batch along dims {dims[0]} and {dims[1]}")
            continue
        part = _part_taken(node, batch_dims(first), shape)
        if part is not None:
            problems[nid] = (f"{operator_at(node)} takes rows by their place in the call ({part}), and a share "
                             "holds other rows in other places")
            continue
        read = [v for v in node_value_inputs(node) if v in positions]
        if not read or op in SHAPE_ONLY:
            continue
        numbered_by, identity = positions[read[0]]
        if op in _SAME or (op == "aten::slice" and _whole(node, shape)):
            if first in positions:
                # A reshape that regroups the counted dimension numbers rows no longer.
                kept = _sizes(shape(first)) == _sizes(shape(outs[0])) if outs else False
                positions.update((o, (numbered_by, identity and kept)) for o in outs)
                continue
        elif identity and all(d < len(shape(first)) and own_rows(v, shape(first)[d])
                              for d, v in uses if v in read) and all(
                node_value_inputs(node).count(v) == sum(u == v for _, u in uses) for v in read):
            continue  # only as the index of the dimension they count: each row itself
        elif nid in proven:
            continue
        how = ("draws a permutation of the rows, and a share permutes only its own" if not identity
               else "numbers the rows of the call, and a share numbers its own from 0")
        problems[nid] = (f"{operator_at(node)} reads as data the rows' positions that {operator_at(numbered_by)} "
                         f"{how}")
    return problems


def _index_uses(node: dict, rank: int) -> list[tuple[int, int]]:
    """(the dim of `self` it indexes, the index value) for each index an indexing node reads."""
    op, args = node["op"], node["args"]
    if op in _INDEX_LIST and len(args) > 1:
        return [(k, a["value"]) for k, a in enumerate(args[1].get("list", [])) if "value" in a]
    where = (1, 2) if op in _INDEX_ALONG else _INDEX_BY.get(op)
    if where is None or len(args) <= where[1] or "value" not in args[where[1]]:
        return []
    dim = -1 - where[0] if where[0] < 0 else (args[where[0]].get("int", 0) if len(args) > where[0] else 0)
    dim = dim + rank if dim < 0 else dim
    return [(dim, args[where[1]]["value"])]


def _sizes(dims: list) -> list:
    """A shape's sizes without its 1s: what a view keeps when it only adds or drops those."""
    return [size for size in dims if size != 1]


def _whole(node: dict, shape) -> bool:
    """Whether an aten::slice takes all of its dimension, in order."""
    args = node["args"]
    dim = args[1].get("int", 0) if len(args) > 1 else 0
    start = args[2].get("int", 0) if len(args) > 2 and "none" not in args[2] else 0
    end = args[3] if len(args) > 3 else {"none": None}
    step = args[4].get("int", 1) if len(args) > 4 else 1
    if start != 0 or step != 1:
        return False
    if "none" in end or end.get("int", 0) >= _INT_MAX:
        return True
    before, after = shape(args[0].get("value")), shape(node["returns"][0].get("value"))
    dim = dim + len(before) if dim < 0 else dim
    return 0 <= dim < len(before) and len(after) == len(before) and after[dim] == before[dim]


def _part_taken(node: dict, dims: list[int], shape) -> str | None:
    """What part of a dimension holding the batch the node takes (a slice that is not all of
    it, a narrow, a select, a split), or None."""
    op, args = node["op"], node["args"]
    if not dims:
        return None
    rank = len(shape(args[0].get("value")))
    if op == "aten::slice":
        dim = args[1].get("int", 0) if len(args) > 1 else 0
        dim = dim + rank if dim < 0 else dim
        return f"a slice along dim {dim}" if dim in dims and not _whole(node, shape) else None
    where = _TAKES_PART.get(op)
    if where is None:
        return None
    dim = args[where].get("int", 0) if len(args) > where else 0
    dim = dim + rank if dim < 0 else dim
    return f"{op.split('::')[1]} along dim {dim}" if dim in dims else None
