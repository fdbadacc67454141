"""Rows put in key order, worked on per group and put back: how a mixture of experts keeps
each token to itself although counts cross the tokens.

transformers' experts (integrations/moe.py, its default "grouped_mm" implementation) route
every (token, expert) pair so:

    keys, order = sort(expert_ids)                     # the pairs in expert order
    rows = hidden[order // top_k]                      # each pair's token row, in that order
    counts = histc(keys, bins=experts, min=0, max=experts - 1)
    out = grouped_mm(rows, weights, offs=cumsum(counts))  # group e's rows times weights[e]
    inverse[order] = arange(pairs); out = out[inverse]    # back in the pairs' order

The counts reduce over every row of the call, yet each row's result depends on that row
alone: sorted by key, with every key counted, row i falls in the group of its own key
whatever the other rows are. `key_order_problems` follows the order rows are in through a
graph and proves that, or names the first operator where it does not hold: counts used
otherwise than as the offsets of such a product (capacity-limited routing drops a row by
its place among the others), offsets that do not count the rows' keys, a key not provably
within the counted range, the place a sort gives a row read as data, rows in key order
combined with rows in another order, or rows returned still in key order.
"""
from __future__ import annotations

from .graph import node_value_inputs

__all__ = ["key_order_problems"]

# Ops that keep every element's value: a key's range and a tag survive them.
_SAME_VALUES = {"aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::alias", "aten::detach",
                "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::flatten", "aten::squeeze",
                "aten::unsqueeze"}
# Ops that keep each element in place (a cast): a permutation, a count survives them.
_SAME_PLACES = {"aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::alias", "aten::detach"}
# Ops that read a tensor for its shape, dtype or device alone.
_SHAPE_ONLY = {"aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::new_zeros",
               "aten::new_ones", "aten::new_empty", "aten::new_full", "aten::new_empty_strided", "aten::sym_size",
               "aten::sym_numel", "aten::sym_stride", "aten::_assert_tensor_metadata"}
# Grouped matrix products (rows argument, offsets argument): row i of the rows is multiplied
# by the weights of the group whose offsets range holds i.
_GROUPED = {"aten::_grouped_mm": (0, 2), "transformers::grouped_mm_fallback": (0, 2)}
_SORTS = {"aten::sort", "aten::argsort"}


def _number(arg: dict) -> float | None:
    for kind in ("int", "float"):
        if kind in arg:
            return arg[kind]
    return None


def _counts_from_zero(node: dict | None) -> bool:
    """Whether `node` is arange(n), or arange(0, n) with a step of 1: 0, 1, 2, ..."""
    if node is None or node["op"] != "aten::arange":
        return False
    if node.get("overload", "") == "":
        return True
    args = node["args"]
    step = args[2].get("int") if node["overload"] == "start_step" and len(args) > 2 else 1
    return args[0].get("int") == 0 and step == 1


def _flattened_from(producer: dict, v: int, shape) -> tuple | None:
    """(rows, k) where value `v` is a [rows, k] tensor flattened (through casts), else None."""
    node = producer.get(v)
    while node is not None and node["op"] in _SAME_PLACES:
        node = producer.get(node["args"][0].get("value"))
    if node is None or node["op"] not in ("aten::view", "aten::reshape", "aten::flatten", "aten::_unsafe_view"):
        return None
    source = shape(node["args"][0].get("value")) if "value" in node["args"][0] else []
    return (source[0], source[1]) if len(source) == 2 and isinstance(source[1], int) else None


def key_order_problems(document: dict, batch_dims) -> tuple[dict[int, str], set[int]]:
    """Per node id, why the node lets rows of one call depend on each other through a sort
    ("aten::sub (model.py:40) uses the counts of aten::histc (model.py:31) ..."); and the
    values that count sorted keys and serve only as the offsets of grouped products over
    the rows in that order (reductions over the batch that keep rows apart). `batch_dims(v)`
    gives the dimensions of value v that hold the batch."""
    values = document["values"]
    nodes = document["nodes"]
    producer = {r["value"]: node for node in nodes for r in node["returns"] if "value" in r}

    def tensor(v: int) -> bool:
        return values[v].get("kind") == "tensor"

    def shape(v: int) -> list:
        return values[v].get("shape", []) if tensor(v) else []

    def at(node: dict) -> str:
        return f"{node['op']}" + (f" ({node['source']})" if node.get("source") else "")

    def outputs(node: dict) -> list[int]:
        out = []
        for r in node["returns"]:
            out += [r["value"]] if "value" in r else list(r.get("list", []))
        return [v for v in out if tensor(v)]

    order: dict[int, int] = {}        # value -> the sort node whose key order its rows follow
    moves: dict[int, int] = {}        # index values that put rows in a sort's order: order, order // k
    divisor: dict[int, int] = {}      # order // k -> k
    pairs: dict[int, tuple] = {}      # a sort -> (rows, k) where it sorts a [rows, k] tensor's flattening
    permutation: dict[int, int] = {}  # a sort's order itself
    restores: dict[int, int] = {}     # the inverse of a sort's order
    keys: dict[int, int] = {}         # a sort's sorted keys
    key_range: dict[int, tuple] = {}  # integer values known to lie within [low, high]
    counts: dict[int, int] = {}       # per group counts of a sort's keys, or their running sum
    offsets: dict[int, int] = {}      # the running sum: where each group ends
    counted_by: dict[int, dict] = {}  # counts -> the node that counted them
    problems: dict[int, str] = {}

    def sort_at(s: int) -> str:
        return at(next(n for n in nodes if n["id"] == s))

    def gathered_rows(by: int) -> list | None:
        """How many rows a gather by `by` reads from, for row i of its result to be pair i's:
        the pairs themselves (as many as the sort's), or with order // k the [rows, k] tensor
        the sort's keys were flattened from."""
        if by not in divisor:
            return shape(by)[:1]
        rows, k = pairs.get(moves[by], (None, None))
        return [rows] if k == divisor[by] else None

    for node in nodes:
        op, args, nid = node["op"], node["args"], node["id"]
        ins = [v for v in node_value_inputs(node) if tensor(v)]
        outs = outputs(node)
        first = args[0].get("value") if args else None

        if op in _SHAPE_ONLY:
            continue
        if op in _SAME_VALUES and first is not None and len(outs) == 1:
            out = outs[0]
            if first in key_range:
                key_range[out] = key_range[first]
            tagged = [tags for tags in (moves, divisor, permutation, restores, keys, counts, offsets) if first in tags]
            if op in _SAME_PLACES and tagged:
                for tags in tagged:
                    tags[out] = tags[first]
                if first in counts:
                    counted_by[out] = counted_by[first]
                if first in order:
                    order[out] = order[first]
                continue
        if op == "aten::topk" and first is not None and len(outs) == 2:
            dim = args[2].get("int", -1) if len(args) > 2 else -1
            dims = shape(first)
            if dims and isinstance(dims[dim], int) and dim % len(dims) not in batch_dims(first):
                key_range[outs[1]] = (0, dims[dim] - 1)
        if op in _SORTS:
            dim_at = 2 if node.get("overload") == "stable" else 1
            dim = args[dim_at].get("int", -1) if len(args) > dim_at else -1
            ascending = len(args) > dim_at + 1 and args[dim_at + 1].get("bool") is False
        if op in _SORTS and first in permutation and ascending:
            restores[outs[-1]] = permutation[first]  # sorting a permutation inverts it
            continue
        if op in _SORTS and first is not None and not order.get(first) and first not in permutation:
            rank = len(shape(first))
            if rank and dim % rank in batch_dims(first):
                sorted_keys = outs[0] if op == "aten::sort" else None
                positions = outs[-1]
                for v in outs:
                    order[v] = nid
                if rank == 1 and ascending:  # the order histc's bins run in
                    permutation[positions] = moves[positions] = nid
                    flattened = _flattened_from(producer, first, shape)
                    if flattened is not None:
                        pairs[nid] = flattened
                    if sorted_keys is not None:
                        keys[sorted_keys] = nid
                        if first in key_range:
                            key_range[sorted_keys] = key_range[first]
                continue
        if op == "aten::floor_divide" and first in permutation and len(args) > 1 and "int" in args[1]:
            moves[outs[0]] = moves[first]
            divisor[outs[0]] = args[1]["int"]
            continue
        if op == "aten::index" and first is not None and len(args) > 1:
            index = [a.get("value") for a in args[1].get("list", [])]
            if index and index[0] is not None and all(i is None for i in index[1:]):
                by = index[0]
                if by in moves and not order.get(first) and 0 in batch_dims(first) and \
                        shape(first)[:1] == gathered_rows(by):
                    for v in outs:
                        order[v] = moves[by]
                    continue
                if by in restores and order.get(first) == restores[by]:
                    continue  # back in the batch's order
        if op in ("aten::index_put_", "aten::index_put") and len(args) > 2:
            index = [a.get("value") for a in args[1].get("list", [])]
            filled_with = args[2].get("value")
            accumulate = len(args) > 3 and args[3].get("bool", False)
            if (len(index) == 1 and index[0] in permutation and _counts_from_zero(producer.get(filled_with))
                    and shape(filled_with) == shape(index[0]) and not accumulate):
                for v in outs + [first]:
                    restores[v] = permutation[index[0]]
                continue
        if op == "aten::histc" and first in keys:
            low, high = _number(args[2]), _number(args[3])
            known = key_range.get(first)
            if known is not None and low is not None and high is not None and low <= known[0] and known[1] <= high:
                counts[outs[0]] = keys[first]
                counted_by[outs[0]] = node
                continue
            problems[nid] = (f"{at(node)} counts keys sorted by {sort_at(keys[first])} that may fall outside its "
                             f"range [{low}, {high}]: an uncounted key would move every later row to another group")
            continue
        if op == "aten::cumsum" and first in counts and first not in offsets and args[1].get("int") in (0, -1):
            counts[outs[0]] = offsets[outs[0]] = counts[first]
            counted_by[outs[0]] = counted_by[first]
            continue
        if op in _GROUPED:
            rows_at, offsets_at = _GROUPED[op]
            rows = args[rows_at].get("value")
            ends = args[offsets_at].get("value") if len(args) > offsets_at else None
            if rows is not None and batch_dims(rows) and ends is not None:
                if ends in offsets and order.get(rows) == offsets[ends]:
                    for v in outs:
                        order[v] = offsets[ends]
                    continue
                if ends in offsets:
                    problems[nid] = (f"{at(node)} groups rows that are not sorted by the keys its offsets count "
                                     f"({at(counted_by[ends])}): a row's group would depend on the other rows")
                elif ends in counts:
                    problems[nid] = (f"{at(node)} takes the counts of {at(counted_by[ends])} for the offsets where "
                                     "groups end, not their running sum: a row's group would depend on the other rows")
                else:
                    problems[nid] = (f"{at(node)} groups rows by offsets that do not count their sorted keys: a "
                                     "row's group would depend on its place in the call")
                continue

        # Any other operator: counts and a sort's positions may not be read as data, and rows
        # in one order are not combined with rows in another.
        for v in ins:
            if v in counts:
                problems.setdefault(nid, (
                    f"{at(node)} uses the counts of {at(counted_by[v])} otherwise than as the offsets of a grouped "
                    "product over the rows they count, so a row depends on the other rows of its call (as "
                    "capacity-limited routing drops a token by its place among the others)"))
            elif v in moves or v in restores:
                tag = moves.get(v, restores.get(v))
                problems.setdefault(nid, (
                    f"{at(node)} reads the places {sort_at(tag)} gives the rows as data, so a row depends on the "
                    "other rows of its call"))
        orders = {order.get(v) for v in ins if batch_dims(v) or v in order}
        if len(orders) > 1:
            sort = next(o for o in orders if o is not None)
            problems.setdefault(nid, f"{at(node)} combines rows in the order {sort_at(sort)} gave them with rows "
                                     "in another order")
        elif orders and None not in orders:
            for v in outs:
                if batch_dims(v):
                    order[v] = next(iter(orders))

    for v in document.get("outputs", []):
        if order.get(v) and batch_dims(v) and v in producer:
            problems.setdefault(producer[v]["id"], (
                f"{at(producer[v])} returns rows in the order {sort_at(order[v])} gave them, not the call's"))
    return problems, set(counted_by)
