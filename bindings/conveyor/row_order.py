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

from .document import node_value_inputs

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
# Ops whose last result holds indices along a dim: (where the dim argument is, how many results).
_PICKS = {"aten::topk": (2, 2), "aten::max": (1, 2), "aten::min": (1, 2), "aten::argmax": (1, 1),
          "aten::argmin": (1, 1)}


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
    walk = _KeyOrder(document, batch_dims)
    for node in document["nodes"]:
        walk.visit(node)
    walk.check_outputs()
    return walk.problems, set(walk.counted_by)


class _KeyOrder:
    """One walk over a graph document in node order: what each value is to a sort."""

    def __init__(self, document: dict, batch_dims):
        self.values = document["values"]
        self.document = document
        self.batch_dims = batch_dims
        self.producer = {r["value"]: node for node in document["nodes"] for r in node["returns"] if "value" in r}
        self.nodes = {node["id"]: node for node in document["nodes"]}
        self.order: dict[int, int] = {}        # value -> the sort node whose key order its rows follow
        self.moves: dict[int, int] = {}        # index values that put rows in a sort's order: order, order // k
        self.divisor: dict[int, int] = {}      # order // k -> k
        self.pairs: dict[int, tuple] = {}      # a sort -> (rows, k) where it sorts a [rows, k] tensor's flattening
        self.permutation: dict[int, int] = {}  # a sort's order itself
        self.restores: dict[int, int] = {}     # the inverse of a sort's order
        self.keys: dict[int, int] = {}         # a sort's sorted keys
        self.key_range: dict[int, tuple] = {}  # integer values known to lie within [low, high]
        self.counts: dict[int, int] = {}       # per group counts of a sort's keys, or their running sum
        self.offsets: dict[int, int] = {}      # the running sum: where each group ends
        self.counted_by: dict[int, dict] = {}  # counts -> the node that counted them
        self.problems: dict[int, str] = {}

    # -- helpers ------------------------------------------------------------------------------
    def tensor(self, v: int) -> bool:
        return self.values[v].get("kind") == "tensor"

    def shape(self, v: int) -> list:
        return self.values[v].get("shape", []) if self.tensor(v) else []

    def outputs(self, node: dict) -> list[int]:
        out = []
        for r in node["returns"]:
            out += [r["value"]] if "value" in r else list(r.get("list", []))
        return [v for v in out if self.tensor(v)]

    @staticmethod
    def at(node: dict) -> str:
        return f"{node['op']}" + (f" ({node['source']})" if node.get("source") else "")

    def sort_at(self, sort: int) -> str:
        return self.at(self.nodes[sort])

    def gathered_rows(self, by: int) -> list | None:
        """How many rows a gather by `by` reads from, for row i of its result to be pair i's:
        the pairs themselves (as many as the sort's), or with order // k the [rows, k] tensor
        the sort's keys were flattened from."""
        if by not in self.divisor:
            return self.shape(by)[:1]
        rows, k = self.pairs.get(self.moves[by], (None, None))
        return [rows] if k == self.divisor[by] else None

    # -- the walk -----------------------------------------------------------------------------
    def visit(self, node: dict) -> None:
        if node["op"] in _SHAPE_ONLY:
            return
        handlers = (self.cast, self.top_k, self.sort, self.divide, self.gather, self.invert, self.count,
                    self.running_sum, self.grouped)
        if not any(handle(node) for handle in handlers):
            self.any_other(node)

    def cast(self, node: dict) -> bool:
        """A reshape keeps the values (a key's range); a cast keeps each in place (every tag)."""
        first, outs = _first(node), self.outputs(node)
        if node["op"] not in _SAME_VALUES or first is None or len(outs) != 1:
            return False
        if first in self.key_range:
            self.key_range[outs[0]] = self.key_range[first]
        tagged = [tags for tags in (self.moves, self.divisor, self.permutation, self.restores, self.keys, self.counts,
                                    self.offsets, self.counted_by, self.order) if first in tags]
        if node["op"] not in _SAME_PLACES or not any(t is not self.order for t in tagged):
            return False
        for tags in tagged:
            tags[outs[0]] = tags[first]
        return True

    def top_k(self, node: dict) -> bool:
        """The indices topk, max, min, argmax and argmin give along a dim of static size n lie
        within [0, n - 1]; a concatenation of such indices within the widest of their ranges."""
        first, outs, args = _first(node), self.outputs(node), node["args"]
        picks = _PICKS.get(node["op"])
        if picks is not None and first is not None and len(outs) == picks[1] and len(args) > picks[0]:
            dim = args[picks[0]].get("int")
            dims = self.shape(first)
            if dims and dim is not None and isinstance(dims[dim], int) and dim % len(dims) not in self.batch_dims(first):
                self.key_range[outs[-1]] = (0, dims[dim] - 1)
        if node["op"] in ("aten::cat", "aten::concat") and len(outs) == 1 and args and "list" in args[0]:
            ranges = [self.key_range.get(a.get("value")) for a in args[0]["list"]]
            if ranges and None not in ranges:
                self.key_range[outs[0]] = (min(r[0] for r in ranges), max(r[1] for r in ranges))
        return False  # otherwise an operator like any other

    def sort(self, node: dict) -> bool:
        """A sort along the batch puts rows in its order; an ascending sort of a 1-D tensor gives
        the keys and the permutation; sorting that permutation gives its inverse."""
        if node["op"] not in _SORTS:
            return False
        first, outs, args, nid = _first(node), self.outputs(node), node["args"], node["id"]
        dim_at = 2 if node.get("overload") == "stable" else 1
        dim = args[dim_at].get("int", -1) if len(args) > dim_at else -1
        ascending = len(args) > dim_at + 1 and args[dim_at + 1].get("bool") is False
        if first in self.permutation and ascending:
            self.restores[outs[-1]] = self.permutation[first]
            return True
        rank = len(self.shape(first)) if first is not None else 0
        if self.order.get(first) or first in self.permutation or not rank or dim % rank not in self.batch_dims(first):
            return False
        for v in outs:
            self.order[v] = nid
        if rank == 1 and ascending:  # the order histc's bins run in
            self.permutation[outs[-1]] = self.moves[outs[-1]] = nid
            flattened = _flattened_from(self.producer, first, self.shape)
            if flattened is not None:
                self.pairs[nid] = flattened
            if node["op"] == "aten::sort":
                self.keys[outs[0]] = nid
                if first in self.key_range:
                    self.key_range[outs[0]] = self.key_range[first]
        return True

    def divide(self, node: dict) -> bool:
        """order // k: for each pair in key order, the row it came from."""
        first, args = _first(node), node["args"]
        if node["op"] != "aten::floor_divide" or first not in self.permutation or len(args) < 2 or "int" not in args[1]:
            return False
        out = self.outputs(node)[0]
        self.moves[out], self.divisor[out] = self.moves[first], args[1]["int"]
        return True

    def gather(self, node: dict) -> bool:
        """rows[order] (or rows[order // k]) puts rows in key order; rows[inverse] puts them back."""
        first, args = _first(node), node["args"]
        if node["op"] != "aten::index" or first is None or len(args) < 2:
            return False
        index = [a.get("value") for a in args[1].get("list", [])]
        if not index or index[0] is None or any(i is not None for i in index[1:]):
            return False
        by = index[0]
        if (by in self.moves and not self.order.get(first) and 0 in self.batch_dims(first)
                and self.shape(first)[:1] == self.gathered_rows(by)):
            for v in self.outputs(node):
                self.order[v] = self.moves[by]
            return True
        return by in self.restores and self.order.get(first) == self.restores[by]  # back in the batch's order

    def invert(self, node: dict) -> bool:
        """inverse[order] = arange(n): the inverse permutation."""
        first, args = _first(node), node["args"]
        if node["op"] not in ("aten::index_put_", "aten::index_put") or len(args) < 3:
            return False
        index = [a.get("value") for a in args[1].get("list", [])]
        filled_with = args[2].get("value")
        accumulate = len(args) > 3 and args[3].get("bool", False)
        if (len(index) != 1 or index[0] not in self.permutation or accumulate
                or not _counts_from_zero(self.producer.get(filled_with))
                or self.shape(filled_with) != self.shape(index[0])):
            return False
        for v in self.outputs(node) + [first]:
            self.restores[v] = self.permutation[index[0]]
        return True

    def count(self, node: dict) -> bool:
        """histc of sorted keys all within its range: per group counts."""
        first, args, nid = _first(node), node["args"], node["id"]
        if node["op"] != "aten::histc" or first not in self.keys:
            return False
        low, high = _number(args[2]), _number(args[3])
        known = self.key_range.get(first)
        if known is not None and low is not None and high is not None and low <= known[0] and known[1] <= high:
            out = self.outputs(node)[0]
            self.counts[out], self.counted_by[out] = self.keys[first], node
        else:
            self.problems[nid] = (f"{self.at(node)} counts keys sorted by {self.sort_at(self.keys[first])} that may "
                                  f"fall outside its range [{low}, {high}]: an uncounted key would move every later "
                                  "row to another group")
        return True

    def running_sum(self, node: dict) -> bool:
        """cumsum of the counts: where each group ends."""
        first = _first(node)
        if (node["op"] != "aten::cumsum" or first not in self.counts or first in self.offsets
                or node["args"][1].get("int") not in (0, -1)):
            return False
        out = self.outputs(node)[0]
        self.counts[out] = self.offsets[out] = self.counts[first]
        self.counted_by[out] = self.counted_by[first]
        return True

    def grouped(self, node: dict) -> bool:
        """A grouped product over rows in a sort's key order, its offsets where that sort's
        groups end: row i by the weights of its own key's group."""
        if node["op"] not in _GROUPED:
            return False
        rows_at, offsets_at = _GROUPED[node["op"]]
        args, nid, at = node["args"], node["id"], self.at(node)
        rows = args[rows_at].get("value")
        ends = args[offsets_at].get("value") if len(args) > offsets_at else None
        if rows is None or not self.batch_dims(rows) or ends is None:
            return False
        if ends in self.offsets and self.order.get(rows) == self.offsets[ends]:
            for v in self.outputs(node):
                self.order[v] = self.offsets[ends]
        elif ends in self.offsets:
            self.problems[nid] = (f"{at} groups rows that are not sorted by the keys its offsets count "
                                  f"({self.at(self.counted_by[ends])}): a row's group would depend on the other rows")
        elif ends in self.counts:
            self.problems[nid] = (f"{at} takes the counts of {self.at(self.counted_by[ends])} for the offsets where "
                                  "groups end, not their running sum: a row's group would depend on the other rows")
        else:
            self.problems[nid] = (f"{at} groups rows by offsets that do not count their sorted keys: a row's group "
                                  "would depend on its place in the call")
        return True

    def any_other(self, node: dict) -> None:
        """Counts and a sort's positions are not read as data, and rows in one order do not
        meet rows in another; results follow their inputs' order."""
        nid, at = node["id"], self.at(node)
        ins = [v for v in node_value_inputs(node) if self.tensor(v)]
        for v in ins:
            if v in self.counts:
                self.problems.setdefault(nid, (
                    f"{at} uses the counts of {self.at(self.counted_by[v])} otherwise than as the offsets of a "
                    "grouped product over the rows they count, so a row depends on the other rows of its call (as "
                    "capacity-limited routing drops a token by its place among the others)"))
            elif v in self.moves or v in self.restores:
                sort = self.moves.get(v, self.restores.get(v))
                self.problems.setdefault(nid, (f"{at} reads the places {self.sort_at(sort)} gives the rows as data, "
                                               "so a row depends on the other rows of its call"))
        orders = {self.order.get(v) for v in ins if self.batch_dims(v) or v in self.order}
        if len(orders) > 1:
            sort = next(o for o in orders if o is not None)
            self.problems.setdefault(nid, f"{at} combines rows in the order {self.sort_at(sort)} gave them with rows "
                                          "in another order")
        elif orders and None not in orders:
            for v in self.outputs(node):
                if self.batch_dims(v):
                    self.order[v] = next(iter(orders))

    def check_outputs(self) -> None:
        """Rows the graph returns are in the batch's order."""
        for v in self.document.get("outputs", []):
            made = self.producer.get(v)
            if self.order.get(v) and self.batch_dims(v) and made is not None:
                self.problems.setdefault(made["id"], (f"{self.at(made)} returns rows in the order "
                                                      f"{self.sort_at(self.order[v])} gave them, not the call's"))


def _first(node: dict) -> int | None:
    args = node["args"]
    return args[0].get("value") if args else None
