"""Where a model reads a row's place in the call, which splitting changes: a share numbers
its rows from 0 and holds only its own, so whatever depends on where a row sits among the
others differs from the whole batch's, silently. Found:

    positions read as data: arange over the batch compared with a capacity (tokens dropped
        by their place), looked up in a table (an embedding of the row's index), or used in
        arithmetic; a permutation of the rows drawn with randperm (mixup) used at all;
    rows taken by their place: a slice, narrow, select, split or chunk along the batch that
        is not all of it (each row minus the one before, the first half against the second);
    rows paired with rows: a result holding the batch along two dimensions (z @ z.T, a
        similarity of every sample with every other).

Positions that stay positions are fine: arange(batch) as the index of the dimension it
counts (x[arange(B), y] picks each row's own target) refers each row to itself in any
share, and the inverse of a sort's order (inverse[order] = arange(n)) is row_order.py's to
prove. Anything else done with positions is reported, the sound side of a heuristic: such a
call runs whole rather than split wrong.
"""
from __future__ import annotations

import re

from .document import node_value_inputs, operator_at

__all__ = ["position_problems"]

# Ops through which positions stay the same numbers in the same places.
_SAME = {"aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::alias", "aten::detach",
         "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::flatten", "aten::squeeze", "aten::unsqueeze",
         "aten::expand", "aten::expand_as", "aten::lift_fresh_copy"}
# Ops that read a tensor for its shape, dtype or device alone.
_SHAPE_ONLY = {"aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::new_zeros",
               "aten::new_ones", "aten::new_empty", "aten::new_full", "aten::new_empty_strided", "aten::sym_size",
               "aten::sym_numel", "aten::sym_stride", "aten::_assert_tensor_metadata"}
# Ops indexing `self` (argument 0) along the dim in argument 1 by the index in argument 2.
_INDEX_ALONG = {"aten::index_select", "aten::gather", "aten::index_add", "aten::index_add_", "aten::index_copy",
                "aten::index_copy_", "aten::index_fill", "aten::index_fill_", "aten::scatter", "aten::scatter_",
                "aten::scatter_add", "aten::scatter_add_", "aten::scatter_reduce", "aten::scatter_reduce_"}
# Ops indexing `self` by a list of indices, the k-th along dim k.
_INDEX_LIST = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_unsafe_index"}
# Ops taking part of a dimension: (the dim's argument, or None for dim 0 unless named otherwise).
_TAKES_PART = {"aten::narrow": 1, "aten::select": 1, "aten::split": 2, "aten::chunk": 2, "aten::unbind": 1,
               "aten::tensor_split": 2, "aten::unsafe_split": 2, "aten::unsafe_chunk": 2}
_INT_MAX = 2 ** 62


def position_problems(document: dict, batch_symbols: set[str], inversions: set[int]) -> dict[int, str]:
    """Per node id of a graph document, how the node reads a row's place in the call
    ("aten::lt (model.py:12) reads the rows' positions that aten::arange (model.py:12)
    numbers as data: ..."). `batch_symbols`: the symbolic sizes that are the batch's;
    `inversions`: index_put nodes that row_order.py proved put sorted rows back."""
    values = document["values"]

    def shape(v) -> list:
        return values[v].get("shape", []) if v is not None and values[v].get("kind") == "tensor" else []

    def holds_batch(size) -> bool:
        return isinstance(size, str) and bool(batch_symbols & set(re.findall(r"[A-Za-z_]\w*", size)))

    def batch_dims(v) -> list[int]:
        return [d for d, size in enumerate(shape(v)) if holds_batch(size)]

    problems: dict[int, str] = {}
    positions: dict[int, tuple[dict, bool]] = {}  # value -> (the node numbering it, counts 0, 1, 2, ... in place)
    for node in document["nodes"]:
        op, args, nid = node["op"], node["args"], node["id"]
        outs = [r["value"] for r in node["returns"] if "value" in r and values[r["value"]].get("kind") == "tensor"]
        first = args[0].get("value") if args else None
        if op in ("aten::arange", "aten::randperm") and any(batch_dims(o) for o in outs):
            identity = op == "aten::arange" and _counts_from_zero(node)
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
        if not read or op in _SHAPE_ONLY:
            continue
        numbered_by, identity = positions[read[0]]
        if op in _SAME or (op == "aten::slice" and _whole(node, shape)):
            if first in positions:
                # A reshape that regroups the counted dimension numbers rows no longer.
                kept = _sizes(shape(first)) == _sizes(shape(outs[0])) if outs else False
                positions.update((o, (numbered_by, identity and kept)) for o in outs)
                continue
        elif identity and all(_indexes_its_own_dim(node, v, shape) for v in read):
            continue
        elif nid in inversions and read == [args[2].get("value")]:
            continue
        how = ("draws a permutation of the rows, and a share permutes only its own" if not identity
               else "numbers the rows of the call, and a share numbers its own from 0")
        problems[nid] = (f"{operator_at(node)} reads as data the rows' positions that {operator_at(numbered_by)} "
                         f"{how}")
    return problems


def _counts_from_zero(node: dict) -> bool:
    """Whether an arange node is arange(n), or arange(0, n) with a step of 1: 0, 1, 2, ..."""
    if node.get("overload", "") == "":
        return True
    args = node["args"]
    step = args[2].get("int") if node["overload"] == "start_step" and len(args) > 2 else 1
    return args[0].get("int") == 0 and step == 1


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


def _indexes_its_own_dim(node: dict, v: int, shape) -> bool:
    """Whether positions `v` serve only as the index of the dimension they count: each row
    refers to itself (x[arange(B), y], index_select(x, 0, arange(B)))."""
    op, args = node["op"], node["args"]
    base = shape(args[0].get("value")) if args else []
    counted = {size for size in shape(v) if isinstance(size, str)}
    if op in _INDEX_LIST and len(args) > 1:
        along = [k for k, a in enumerate(args[1].get("list", [])) if a.get("value") == v]
        others = [a for i, a in enumerate(args) if i != 1 and a.get("value") == v]
        return bool(along) and not others and all(k < len(base) and counted == {base[k]} for k in along)
    if op in _INDEX_ALONG and len(args) > 2 and args[2].get("value") == v:
        dim = args[1].get("int", 0)
        dim = dim + len(base) if dim < 0 else dim
        others = [a for i, a in enumerate(args) if i != 2 and a.get("value") == v]
        return not others and 0 <= dim < len(base) and counted == {base[dim]}
    return False
