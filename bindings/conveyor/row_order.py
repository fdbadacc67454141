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

JetMoE counts otherwise: a one-hot of each token's topk experts summed over the tokens, read
as numbers that split the rows in key order into one group per expert (split_with_sizes),
each multiplied by its expert, joined in key order (cat) and added back to their tokens
(index_add by order // k). Each group's rows are rows of the batch too (its size symbol is
returned with the problems), so what would mix them is found as it is for the batch's.
"""
from __future__ import annotations

import re

from .document import node_value_inputs, operator_at

__all__ = ["key_order_problems", "counts_from_zero", "SHAPE_ONLY"]

# Ops that keep every element's value: a key's range and a tag survive them.
_SAME_VALUES = {"aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::alias", "aten::detach",
                "aten::view", "aten::reshape", "aten::_unsafe_view", "aten::flatten", "aten::squeeze",
                "aten::unsqueeze"}
# Ops that keep each element in place (a cast): a permutation, a count survives them.
_SAME_PLACES = {"aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::alias", "aten::detach"}
# Ops that read a tensor for its shape, dtype or device alone.
SHAPE_ONLY = {"aten::empty_like", "aten::zeros_like", "aten::ones_like", "aten::full_like", "aten::new_zeros",
               "aten::new_ones", "aten::new_empty", "aten::new_full", "aten::new_empty_strided", "aten::sym_size",
               "aten::sym_numel", "aten::sym_stride", "aten::_assert_tensor_metadata"}
# Grouped matrix products (rows argument, offsets argument): row i of the rows is multiplied
# by the weights of the group whose offsets range holds i.
_GROUPED = {"aten::_grouped_mm": (0, 2), "transformers::grouped_mm_fallback": (0, 2)}
_SORTS = {"aten::sort", "aten::argsort"}
_ZEROS = {"aten::zeros", "aten::zeros_like", "aten::new_zeros"}
# Ops whose last result holds indices along a dim: (where the dim argument is, how many results).
_PICKS = {"aten::topk": (2, 2), "aten::max": (1, 2), "aten::min": (1, 2), "aten::argmax": (1, 1),
          "aten::argmin": (1, 1)}


def _number(arg: dict) -> float | None:
    for kind in ("int", "float"):
        if kind in arg:
            return arg[kind]
    return None


def counts_from_zero(node: dict | None) -> bool:
    """Whether `node` is arange(n), or arange(0, n) with a step of 1: 0, 1, 2, ..."""
    if node is None or node["op"] != "aten::arange":
        return False
    if node.get("overload", "") == "":
        return True
    args = node["args"]
    step = args[2].get("int") if node["overload"] == "start_step" and len(args) > 2 else 1
    return args[0].get("int") == 0 and step == 1


def _flattened_from(producer: dict, v: int, shape) -> tuple | None:
    """(rows, k, the tensor) where value `v` is a [rows, k] tensor flattened (through casts),
    else None."""
    node = producer.get(v)
    while node is not None and node["op"] in _SAME_PLACES:
        node = producer.get(node["args"][0].get("value"))
    if node is None or node["op"] not in ("aten::view", "aten::reshape", "aten::flatten", "aten::_unsafe_view"):
        return None
    source = shape(node["args"][0].get("value")) if "value" in node["args"][0] else []
    if len(source) == 2 and isinstance(source[1], int):
        return source[0], source[1], node["args"][0]["value"]
    return None


def key_order_problems(document: dict, batch_dims) -> tuple[dict[int, str], set[int], set[str], set[int]]:
    """Per node id, why the node lets rows of one call depend on each other through a sort
    ("aten::sub (model.py:40) uses the counts of aten::histc (model.py:31) ..."); the values
    that count sorted keys and serve only as the offsets of grouped products over the rows
    in that order, or as the sizes the rows are split by (reductions over the batch that keep
    rows apart); the symbolic sizes of those split groups (their rows are the batch's rows
    too); and the indexing nodes that move rows as the proof allows (rows put in a sort's
    order, its inverse order written, rows added back to their tokens).
    `batch_dims(v)` gives the dimensions of value v that hold the batch."""
    walk = _KeyOrder(document, batch_dims)
    for node in document["nodes"]:
        walk.visit(node)
    walk.check_outputs()
    return walk.problems, set(walk.counted_by) | set(walk.tallies), walk.group_symbols, walk.proven


class _KeyOrder:
    """One walk over a graph document in node order: what each value is to a sort."""

    def __init__(self, document: dict, batch_dims):
        self.values = document["values"]
        self.document = document
        self.rows_of_the_batch = batch_dims
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
        # Rows split into groups by the counts of their keys (JetMoE's experts): a one-hot of
        # each row's keys, its sum over the rows, each count as a number, each group's rows.
        self.distinct: dict[int, bool] = {}    # indices distinct within each row (topk's)
        self.one_hot: dict[int, int] = {}      # zeros[rows, n].scatter(1, indices, 1) -> the indices
        self.tallies: dict[int, tuple] = {}    # its sum over the rows -> (the indices, the node)
        self.tally_items: dict[int, tuple] = {}  # a count of it, a tensor or a number -> (the tally, key)
        self.tally_numbers: set[int] = set()   # arithmetic on those numbers (checks of the sizes)
        self.pieces: dict[int, tuple] = {}     # a group's rows -> (the split node, its key)
        self.split_into: dict[int, int] = {}   # a split node -> how many groups
        self.group_symbols: set[str] = set()   # the groups' sizes ("u0")
        self.views: set[int] = set()           # views of any of those (a write through them is one into them)
        self.problems: dict[int, str] = {}
        self.proven: set[int] = set()          # indexing nodes that move rows as the proof allows

    # -- helpers ------------------------------------------------------------------------------
    def batch_dims(self, v: int) -> list[int]:
        """The dims of v that hold the batch's rows: the batch's own, or a group's of them."""
        groups = [d for d, size in enumerate(self.shape(v)) if isinstance(size, str)
                  and self.group_symbols & set(re.findall(r"[A-Za-z_]\w*", size))]
        return sorted(set(self.rows_of_the_batch(v)) | set(groups))

    def tensor(self, v: int) -> bool:
        return self.values[v].get("kind") == "tensor"

    def shape(self, v: int) -> list:
        return self.values[v].get("shape", []) if self.tensor(v) else []

    def outputs(self, node: dict) -> list[int]:
        out = []
        for r in node["returns"]:
            out += [r["value"]] if "value" in r else list(r.get("list", []))
        return [v for v in out if self.tensor(v)]

    at = staticmethod(operator_at)

    def sort_at(self, sort: int) -> str:
        return self.at(self.nodes[sort])

    def gathered_rows(self, by: int) -> list | None:
        """How many rows a gather by `by` reads from, for row i of its result to be pair i's:
        the pairs themselves (as many as the sort's), or with order // k the [rows, k] tensor
        the sort's keys were flattened from."""
        if by not in self.divisor:
            return self.shape(by)[:1]
        rows, k, _ = self.pairs.get(self.moves[by], (None, None, None))
        return [rows] if k == self.divisor[by] else None

    # -- the walk -----------------------------------------------------------------------------
    def visit(self, node: dict) -> None:
        self.writes(node)
        if node["op"] in SHAPE_ONLY:
            return
        handlers = (self.cast, self.top_k, self.sort, self.divide, self.gather, self.invert, self.count,
                    self.running_sum, self.grouped, self.one_hot_rows, self.tally, self.tally_each, self.split,
                    self.join, self.add_back)
        taken = next((handle for handle in handlers if handle(node)), None)
        if taken is None:
            self.any_other(node)
        elif taken in (self.gather, self.invert, self.add_back):
            self.proven.add(node["id"])

    def relied_on(self, v: int) -> bool:
        return any(v in tags for tags in (self.moves, self.permutation, self.restores, self.keys, self.counts,
                                          self.one_hot, self.tallies, self.tally_items, self.views))

    def writes(self, node: dict) -> None:
        """What the proof relies on (a sort's keys and places, counts, a one-hot of keys) is
        not written in place, directly or through a view of it."""
        args = node["args"]
        read = [args[i].get("value") for i in node.get("aliases", []) if i < len(args)]
        if any(v is not None and self.relied_on(v) for v in read):
            self.views.update(r["value"] for r in node["returns"] if "value" in r)
        written = [args[i].get("value") for i in node.get("mutates", []) if i < len(args)]
        if any(v is not None and self.relied_on(v) for v in written):
            self.problems.setdefault(node["id"], f"{self.at(node)} writes in place into the keys, places or counts "
                                                 "of a sort, so a row's group may depend on the other rows")

    def cast(self, node: dict) -> bool:
        """A reshape keeps the values (a key's range); a cast keeps each in place (every tag)."""
        first, outs = _first(node), self.outputs(node)
        if node["op"] not in _SAME_VALUES or first is None or len(outs) != 1:
            return False
        if first in self.key_range:
            self.key_range[outs[0]] = self.key_range[first]
        tagged = [tags for tags in (self.moves, self.divisor, self.permutation, self.restores, self.keys, self.counts,
                                    self.offsets, self.counted_by, self.distinct, self.one_hot, self.tallies,
                                    self.tally_items, self.order) if first in tags]
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
                if node["op"] == "aten::topk":
                    self.distinct[outs[-1]] = True
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
        if self.order.get(first) and rank and dim % rank in self.batch_dims(first):
            self.problems[nid] = (f"{self.at(node)} sorts rows already in the order {self.sort_at(self.order[first])} "
                                  "gave them along that order, so a row depends on the other rows of its call")
            return True
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
        """order // k: for each pair in key order, the row it came from (a division rounding
        toward zero is the same: places are not negative)."""
        first, args = _first(node), node["args"]
        rounded = node["op"] == "aten::floor_divide" or (
            node["op"] == "aten::div" and len(args) > 2 and args[2].get("str") in ("trunc", "floor"))
        if not rounded or first not in self.permutation or len(args) < 2 or args[1].get("int", 0) < 1:
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
                or not counts_from_zero(self.producer.get(filled_with))
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

    def one_hot_rows(self, node: dict) -> bool:
        """zeros[rows, n].scatter(1, indices, 1), each row's indices distinct (topk's) and within
        [0, n - 1]: each row's keys marked once."""
        args, outs = node["args"], self.outputs(node)
        if node["op"] != "aten::scatter" or node.get("overload") != "value" or len(args) < 4 or len(outs) != 1:
            return False
        base, index = args[0].get("value"), args[2].get("value")
        made, dims = self.producer.get(base), self.shape(base) if base is not None else []
        known = self.key_range.get(index)
        if (made is None or made["op"] not in _ZEROS or index not in self.distinct or len(dims) != 2
                or not isinstance(dims[1], int) or known is None or known[0] < 0 or known[1] > dims[1] - 1
                or args[1].get("int") not in (1, -1) or _number(args[3]) != 1):
            return False
        self.one_hot[outs[0]] = index
        return True

    def tally(self, node: dict) -> bool:
        """A one-hot of the rows' keys summed over the rows: how many pairs hold each key."""
        first, args, outs = _first(node), node["args"], self.outputs(node)
        if node["op"] != "aten::sum" or first not in self.one_hot or len(outs) != 1 or len(args) < 2:
            return False
        dims = [a.get("int") for a in args[1].get("list", [])]
        if dims not in ([0], [-2]) or (len(args) > 2 and args[2].get("bool")):
            return False
        self.tallies[outs[0]] = (self.one_hot[first], node)
        return True

    def tally_each(self, node: dict) -> bool:
        """The counts taken one by one (unbind), each read as a number (item)."""
        first, args = _first(node), node["args"]
        if node["op"] == "aten::unbind" and first in self.tallies and len(args) > 1 and args[1].get("int") in (0, -1):
            for key, v in enumerate(self.outputs(node)):
                self.tally_items[v] = (first, key)
            return True
        if node["op"] in ("aten::item", "aten::_local_scalar_dense") and first in self.tally_items:
            for r in node["returns"]:
                if "value" in r:
                    self.tally_items[r["value"]] = self.tally_items[first]
            return True
        return False

    def split(self, node: dict) -> bool:
        """Rows in a sort's key order split, dim 0, by the counts of every key of that sort, in
        key order: group j holds exactly the rows whose key is j, whatever the other rows."""
        args, nid = node["args"], node["id"]
        if node["op"] not in ("aten::split_with_sizes", "aten::split") or len(args) < 2 or "list" not in args[1]:
            return False
        sizes = [a.get("value") for a in args[1]["list"]]
        if not any(v in self.tally_items for v in sizes):
            return False
        rows, dim = args[0].get("value"), args[2].get("int", 0) if len(args) > 2 else 0
        sort = self.order.get(rows)
        tallied = [self.tally_items.get(v) for v in sizes]
        tallies = {t[0] for t in tallied if t is not None}
        tally = next(iter(tallies)) if len(tallies) == 1 else None
        flattened = self.pairs.get(sort) if sort is not None else None
        outs = self.outputs(node)
        symbols = [self.shape(v)[0] if self.shape(v) else None for v in outs]
        if (sort is None or rows in self.pieces or dim != 0 or None in tallied or tally is None or flattened is None
                or flattened[2] != self.tallies[tally][0] or self.shape(tally) != [len(sizes)]
                or [t[1] for t in tallied] != list(range(len(sizes))) or len(outs) != len(sizes)
                or not all(isinstance(x, str) and x.isidentifier() for x in symbols)):
            counted = self.at(self.tallies[tally][1]) if tally is not None else "a count"
            self.problems[nid] = (f"{self.at(node)} splits rows by the counts of {counted} otherwise than rows sorted "
                                  "by those keys, by every key's count in key order: a row's group would depend on "
                                  "the other rows")
            return True
        self.group_symbols.update(symbols)
        self.split_into[nid] = len(outs)
        for key, v in enumerate(outs):
            self.order[v], self.pieces[v] = sort, (nid, key)
        return True

    def join(self, node: dict) -> bool:
        """Every group of one split, in key order, concatenated along dim 0: the rows in the
        sort's key order again."""
        args, outs = node["args"], self.outputs(node)
        if node["op"] not in ("aten::cat", "aten::concat") or not args or "list" not in args[0]:
            return False
        parts = [a.get("value") for a in args[0]["list"]]
        if not any(v in self.pieces for v in parts):
            return False
        splits = {self.pieces[v][0] if v in self.pieces else None for v in parts}
        split = next(iter(splits))
        dim = args[1].get("int", 0) if len(args) > 1 else 0
        if (len(splits) != 1 or split is None or dim != 0 or len(outs) != 1
                or [self.pieces[v][1] for v in parts] != list(range(self.split_into[split]))):
            self.problems[node["id"]] = (f"{self.at(node)} joins groups of the rows of {self.at(self.nodes[split])} "
                                         "otherwise than all of them in key order along dim 0")
            return True
        self.order[outs[0]] = self.order[parts[0]]
        return True

    def add_back(self, node: dict) -> bool:
        """base.index_add(0, order // k, rows in that order) (or by the order itself): each row
        of the base, in the batch's order, gets its own pairs added."""
        args = node["args"]
        if node["op"] not in ("aten::index_add", "aten::index_add_") or len(args) < 4:
            return False
        base, by, source = args[0].get("value"), args[2].get("value"), args[3].get("value")
        return (by in self.moves and args[1].get("int") == 0 and self.order.get(source) == self.moves[by]
                and source not in self.pieces and not self.order.get(base) and base not in self.pieces
                and self.shape(base)[:1] == self.gathered_rows(by))

    def any_other(self, node: dict) -> None:
        """Counts and a sort's positions are not read as data, and rows in one order do not
        meet rows in another; results follow their inputs' order."""
        nid, at = node["id"], self.at(node)
        for v in node_value_inputs(node):
            if v in self.tally_items or v in self.tally_numbers:
                if node["op"] == "conveyor::sym" and not any(self.tensor(o) for o in self.outputs(node)):
                    self.tally_numbers.update(r["value"] for r in node["returns"] if "value" in r)
                elif node["op"] != "aten::_assert_scalar":  # checks of the sizes alone
                    self.problems.setdefault(nid, f"{at} uses the counts of keys as data, so a row depends on the "
                                                  "other rows of its call")
        ins = [v for v in node_value_inputs(node) if self.tensor(v)]
        for v in ins:
            if v in self.tallies:
                self.problems.setdefault(nid, (
                    f"{at} uses the counts of {self.at(self.tallies[v][1])} otherwise than as the sizes the rows they "
                    "count are split by, so a row depends on the other rows of its call"))
            elif v in self.counts:
                self.problems.setdefault(nid, (
                    f"{at} uses the counts of {self.at(self.counted_by[v])} otherwise than as the offsets of a "
                    "grouped product over the rows they count, so a row depends on the other rows of its call (as "
                    "capacity-limited routing drops a token by its place among the others)"))
            elif v in self.moves or v in self.restores:
                sort = self.moves.get(v, self.restores.get(v))
                self.problems.setdefault(nid, (f"{at} reads the places {self.sort_at(sort)} gives the rows as data, "
                                               "so a row depends on the other rows of its call"))
        orders = {self.order.get(v) for v in ins if self.batch_dims(v) or v in self.order}
        pieces = {self.pieces.get(v) for v in ins if self.batch_dims(v) or v in self.order}
        if len(pieces) > 1 and any(pieces):
            self.problems.setdefault(nid, f"{at} combines the rows of one group of a split by counts with other rows")
        elif any(pieces):
            for v in self.outputs(node):
                if self.batch_dims(v):
                    self.pieces[v] = next(iter(pieces))
        def group_rows(v: int) -> bool:
            return bool(set(self.batch_dims(v)) - set(self.rows_of_the_batch(v)))

        if any(group_rows(v) for v in self.outputs(node)) and not any(group_rows(v) for v in ins):
            self.problems.setdefault(nid, f"{at} makes rows as many as a group's from no rows of it (positions "
                                          "within the group), so a row depends on the other rows of its call")
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
